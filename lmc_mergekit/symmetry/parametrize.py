"""Symmetries as trainable parameters (reference notes §2, "Parametrisations").

:class:`LearnedSymmetry` holds the parameters of one endpoint's symmetries and builds the
:class:`Transform` they stand for, differentiably: a residual rotation ``Cayley(S)`` (in the
group fixing the all-ones vector for LayerNorm models), a global residual scale ``exp(s)``, and per
key/value head QK and OV maps. QK maps commute with RoPE: on each rotary pair a scaled rotation
``exp(σ)·R(φ)``, a full map on the non-rotary dims; under a QK-norm a positive scale per pair
traded between the norms' gains. Where the residual group is discrete (post-norms, sandwich
norms, kept ties) the residual map is a (signed) permutation learned through a straight-through
estimator: the forward uses the exact permutation that best fits a score matrix, the backward
treats it as the scores themselves (Ainsworth et al., Git Re-Basin), so what is learned and
written is always an exact group element. Every parameter starts at zero, which is the
identity, so learning starts exactly at the matching result it refines.

How the maps are parametrised is a setting (the paper's ablation):

========================  ==========================  ======================================
``parametrization``        residual rotation           QK / OV maps (non-rotary blocks)
========================  ==========================  ======================================
``polar`` (default)        ``Cayley(S)``               ``Cayley(S)·L·Lᵀ``, L lower triangular
                                                       with a positive diagonal
``cayley``                 ``Cayley(S)``               ``Cayley(S)`` (orthogonal maps; rotary
                                                       pairs turn without scaling)
``matrix_exp``             ``exp(S)``                  ``exp(A)``, A any matrix
``unconstrained``          ``Cayley(S)``               ``I + A``, A any matrix
========================  ==========================  ======================================

The residual map stays orthogonal in every variant: a non-orthogonal map of the residual stream
does not commute with the norms, so it would not be a symmetry.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Literal

import torch
from torch import nn

from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.symmetry.group import FAMILIES, symmetry_group
from lmc_mergekit.symmetry.projection import nearest_permutation
from lmc_mergekit.symmetry.rope import rope_map_from_pairs
from lmc_mergekit.symmetry.transform import LayerTransform, Transform

Parametrization = Literal["polar", "cayley", "matrix_exp", "unconstrained"]
Family = Literal["residual", "scale", "qk", "ov"]
PARAMETRIZATIONS: tuple[str, ...] = ("polar", "cayley", "matrix_exp", "unconstrained")


def skew(a: torch.Tensor) -> torch.Tensor:
    """The skew-symmetric matrix whose strict upper triangle is that of ``a``."""
    upper = a.triu(1)
    return upper - upper.mT


def cayley(a: torch.Tensor) -> torch.Tensor:
    """``(I - S)⁻¹(I + S)`` for ``S = skew(a)``: orthogonal, and the identity at ``a = 0``."""
    return _Cayley.apply(skew(a))


class _Cayley(torch.autograd.Function):
    """``C = (I - S)⁻¹(I + S)`` with a backward that solves nothing: ``C + I = 2(I - S)⁻¹``,
    so ``dC = ½(I + C)·dS·(I + C)`` and the gradient is ``½(I + C)ᵀ·G·(I + C)ᵀ``: two
    products where autograd's would solve again (an LU solve per matrix, which stalls for
    seconds on a CPU shared with other work)."""

    @staticmethod
    def forward(ctx, s: torch.Tensor) -> torch.Tensor:
        eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device).expand_as(s)
        c = torch.linalg.solve(eye - s, eye + s)
        ctx.save_for_backward(c)
        return c

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (c,) = ctx.saved_tensors
        plus = (c + torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)).mT
        return 0.5 * plus @ grad @ plus


def orthogonal(a: torch.Tensor, kind: Parametrization) -> torch.Tensor:
    """An orthogonal matrix from free parameters: matrix exponential or Cayley map of skew(a)."""
    return torch.linalg.matrix_exp(skew(a)) if kind == "matrix_exp" else cayley(a)


def positive_definite(a: torch.Tensor) -> torch.Tensor:
    """``L·Lᵀ``: ``L`` is the lower triangle of ``a``, its diagonal exponentiated."""
    lower = a.tril(-1) + torch.diag_embed(a.diagonal(dim1=-2, dim2=-1).exp())
    return lower @ lower.mT


def invertible(rot: torch.Tensor, tri: torch.Tensor, kind: Parametrization) -> torch.Tensor:
    """A square map (batched) from two parameter blocks, as the table in the module docstring."""
    if kind == "polar":
        return cayley(rot) @ positive_definite(tri)
    if kind == "cayley":
        return cayley(rot)
    if kind == "matrix_exp":
        return torch.linalg.matrix_exp(rot)
    return torch.eye(rot.shape[-1], dtype=rot.dtype, device=rot.device) + rot


def ones_reflection(d: int) -> torch.Tensor:
    """``v`` (float64) of the Householder reflection ``H = I - 2vvᵀ`` that takes ``e_0`` to
    ``-1/√d`` (all-ones, normalised): ``H``'s other columns are an orthonormal basis ``U`` of
    the vectors orthogonal to all-ones, the coordinates of the rotations that fix it."""
    v = torch.full((d,), d**-0.5, dtype=torch.float64)
    v[0] += 1.0
    return v / v.norm()


def reflected(inner: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``11ᵀ/d + U·inner·Uᵀ = H·diag(1, inner)·H`` for ``H = I - 2vvᵀ`` (:func:`ones_reflection`):
    the rotation fixing all-ones whose action on its complement is ``inner``, made by
    rank-one updates (``d²``) where products with ``U`` would cost ``d³`` each."""
    b = torch.block_diag(inner.new_ones(1, 1), inner)
    bv, vb = b @ v, v @ b
    return b - 2 * torch.outer(v, vb) - 2 * torch.outer(bv, v) + 4 * (v @ bv) * torch.outer(v, v)


class Diverged(ArithmeticError):
    """The parameters no longer stand for a group element (a scale that under- or overflowed)."""


class LearnedSymmetry(nn.Module):
    """The continuous symmetries of one endpoint, as trainable parameters (zero = identity)."""

    def __init__(
        self,
        spec: ModelSpec,
        families: tuple[str, ...] = FAMILIES,
        parametrization: Parametrization = "polar",
        keep_tie: bool = False,
    ):
        super().__init__()
        self.spec = spec
        self.kind = parametrization
        self.keep_tie = keep_tie
        # Only what the model admits: a residual rotation, or for post-norm models and kept
        # ties a residual (signed) permutation; diagonal QK maps under a QK-norm.
        group = symmetry_group(spec, keep_tie)
        admitted = group.learnable
        self.families = tuple(f for f in admitted if f in families)
        d, layers, kv, dh = spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim
        half, free = spec.rotary_dims // 2, spec.head_dim - spec.rotary_dims
        fix_ones = spec.norm == "layernorm"
        if "residual" in self.families:
            size = d - 1 if fix_ones else d
            self.residual = nn.Parameter(torch.zeros(size, size))
            if fix_ones:
                # Kept in float64 (module casts leave it alone): written transforms need it exact.
                self.register_buffer("ones_reflection", ones_reflection(d), persistent=False)
        if "permutation" in self.families:
            # Scores whose best assignment is the permutation; zero = the identity.
            self.residual_scores = nn.Parameter(torch.zeros(d, d))
            self.residual_group = group.residual
        if "scale" in self.families:
            self.log_scale = nn.Parameter(torch.zeros(()))
        if "qk" in self.families and not group.qk_maps:
            # Under a QK-norm: one log scale per pair and per non-rotary dim (per head only
            # when each head has its own gains); the signs are discrete (matching sets them).
            heads = 1 if group.qk == "shared_gains" else kv
            self.qk_gain_log_scale = nn.Parameter(torch.zeros(layers, heads, dh - half))
        elif "qk" in self.families and half:
            self.qk_pair_log_scale = nn.Parameter(torch.zeros(layers, kv, half))
            self.qk_pair_angle = nn.Parameter(torch.zeros(layers, kv, half))
        if "qk" in self.families and free and group.qk_maps:
            self.qk_rot = nn.Parameter(torch.zeros(layers, kv, free, free))
            self.qk_tri = nn.Parameter(torch.zeros(layers, kv, free, free))
        if "ov" in self.families:
            self.ov_rot = nn.Parameter(torch.zeros(layers, kv, dh, dh))
            self.ov_tri = nn.Parameter(torch.zeros(layers, kv, dh, dh))

    def rotation(self) -> torch.Tensor | None:
        """The residual rotation (None when that family is not learned)."""
        if "permutation" in self.families:
            return self.permutation()
        if "residual" not in self.families:
            return None
        inner = orthogonal(self.residual, self.kind)
        if not hasattr(self, "ones_reflection"):
            return inner
        return reflected(inner, self.ones_reflection.to(inner.dtype))

    def permutation(self) -> torch.Tensor:
        """The residual (signed) permutation: the best assignment of ``I + scores``, whose
        value it has, with the gradient of ``scores`` (a straight-through estimator: the loss
        is always that of an exact symmetry, the scores move towards better assignments)."""
        scores = self.residual_scores + torch.eye(len(self.residual_scores)).to(
            self.residual_scores
        )
        signed = self.residual_group == "signed_permutation"
        hard = nearest_permutation(scores.detach().cpu(), signed)
        return hard.to(scores) + (scores - scores.detach())  # exactly `hard` in value

    def qk_maps(self) -> torch.Tensor | None:
        """QK maps ``(layers, kv heads, dh, dh)`` commuting with RoPE (diagonal, positive,
        under a QK-norm)."""
        if "qk" not in self.families:
            return None
        if hasattr(self, "qk_gain_log_scale"):
            scales = self._scales(self.qk_gain_log_scale).expand(-1, self.spec.num_kv_heads, -1)
            half = self.spec.rotary_dims // 2
            return torch.diag_embed(torch.cat([scales[..., :half], scales], dim=-1))
        free = None
        if self.spec.head_dim > self.spec.rotary_dims:
            free = invertible(self.qk_rot, self.qk_tri, self.kind)
        if not self.spec.rotary_dims:
            return free
        return rope_map_from_pairs(self._scales(self.qk_pair_log_scale), self.qk_pair_angle, free)

    def _scales(self, log_scale: torch.Tensor) -> torch.Tensor:
        """Per-pair scales as the parametrisation makes them: none under ``cayley`` (rotations
        only), ``1 + x`` under ``unconstrained``, ``exp(x)`` otherwise."""
        if self.kind == "cayley":
            return torch.ones_like(log_scale)
        if self.kind == "unconstrained":
            return 1 + log_scale
        return log_scale.exp()

    def ov_maps(self) -> torch.Tensor | None:
        """OV maps ``(layers, kv heads, dh, dh)``."""
        if "ov" not in self.families:
            return None
        return invertible(self.ov_rot, self.ov_tri, self.kind)

    def transform(self) -> Transform:
        """The symmetry these parameters stand for (differentiable in them)."""
        qk, ov = self.qk_maps(), self.ov_maps()
        scale = self.log_scale.exp() if "scale" in self.families else 1.0
        if "scale" in self.families and not 0 < float(scale.detach()) < float("inf"):
            raise Diverged(f"the learned scale is {float(scale.detach())}")
        layers = tuple(
            LayerTransform(qk=None if qk is None else qk[i], ov=None if ov is None else ov[i])
            for i in range(self.spec.num_layers)
        )
        return Transform(
            num_layers=self.spec.num_layers,
            absorb_norms=True,
            rotation=self.rotation(),
            scale=scale,
            layers=layers,
            keep_tie=self.keep_tie,
        )

    def frozen_transform(self) -> Transform:
        """The current symmetry computed in float64 on the CPU, detached: what gets written."""
        twin = copy.deepcopy(self).double().cpu()
        with torch.no_grad():
            learned = twin.transform()
        return replace(learned, scale=float(learned.scale))
