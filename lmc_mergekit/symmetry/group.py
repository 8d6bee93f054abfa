"""Which function-preserving symmetries a model admits, derived from its structure alone.

This is the one place that knows it; validation of transforms, ``scramble``, weight matching,
the learned parametrisations and size conversion all ask it (reference notes §2 and §8):

- residual maps: any orthogonal map when every norm reading the stream is an RMSNorm; only those
  fixing the all-ones vector when they are LayerNorms (which subtract the mean); only **signed
  permutations** when a gain sits after a normalisation on the write path (post-norms and
  sandwich norms), since an elementwise gain commutes with no other orthogonal map;
- where tied embeddings must stay tied (``tied_embeddings: keep``), residual maps reduce to
  signed permutations (permutations under LayerNorm): the head reads the embedding through the
  final norm's gain, ``E·diag(γ)·norm(x)``, and ``Qᵀ·diag(γ')·Q`` is diagonal only for those;
- a global scale of the stream, always (norms normalise it away once their eps scales by g²);
- head and FFN neuron permutations, always (GQA-aware: whole key/value groups);
- QK maps (RoPE-commuting on rotary pairs, free on the other dims) unless queries and keys are
  normalised after their projection: a norm is not equivariant under a non-orthogonal map, and
  its elementwise gain blocks the rotations. What a QK-norm leaves are **diagonal** QK maps:
  per key/value head a sign on each rotary pair (and each other dim), applied to the rows of
  ``W_q`` and ``W_k`` (a norm commutes with sign flips, RoPE with a pair turned by π), times a
  positive scale traded between the ``q_norm`` and ``k_norm`` gains, equal on both dims of a
  pair; a per-head norm's gain is shared by all heads, so its scales are too (``qk:
  shared_gains``), a norm over the whole projection has a gain per head (``head_gains``);
- OV maps, always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.view import ModelSpec

Residual = Literal["orthogonal", "ones_fixing", "signed_permutation", "permutation"]
#: The QK maps admitted: RoPE-commuting maps, or diagonal ones under a QK-norm (see above).
QK = Literal["maps", "shared_gains", "head_gains"]
#: The families of learned matching: continuous symmetries, and ``permutation``, the residual
#: map of a model whose residual group is discrete (learned through a straight-through
#: estimator, :mod:`lmc_mergekit.symmetry.parametrize`).
FAMILIES: tuple[str, ...] = ("residual", "permutation", "scale", "qk", "ov")
#: What learned matching learns unless told: the learned permutation is opt-in (on the zoo's
#: Gemma 2 pair it removes no more than the fixed one from activation matching).
DEFAULT_FAMILIES: tuple[str, ...] = ("residual", "scale", "qk", "ov")


@dataclass(frozen=True)
class SymmetryGroup:
    """The symmetries a model admits; ``why`` says, per symmetry kind that is restricted or
    absent, which feature of the model restricts it."""

    residual: Residual
    qk: QK
    why: dict[str, str]
    architecture: str = ""

    @property
    def qk_maps(self) -> bool:
        """Whether any RoPE-commuting QK map is a symmetry (no QK-norm)."""
        return self.qk == "maps"

    def refuse(self, kind: str, detail: str = "") -> LmcError:
        """The one-line error for a transform with ``kind`` (``residual``, ``qk``) that this
        model does not admit."""
        reason = self.why.get(kind, "")
        return LmcError(
            f"the {self.architecture} model does not admit {detail or kind}: {reason}".rstrip(": ")
        )

    @property
    def learnable(self) -> tuple[str, ...]:
        """The learned-matching families this model admits: a residual rotation where its
        residual group is continuous, a residual (signed) permutation where it is discrete."""
        discrete = self.residual in ("signed_permutation", "permutation")
        absent = {"residual"} if discrete else {"permutation"}
        return tuple(f for f in FAMILIES if f not in absent)


def symmetry_group(spec: ModelSpec, keep_tie: bool = False) -> SymmetryGroup:
    """The symmetry group of models of ``spec``; with ``keep_tie``, of those whose tied
    embeddings must stay tied."""
    why = {}
    if spec.post_norms:
        residual: Residual = "signed_permutation"
        why["residual"] = (
            "its block outputs pass through a norm with a gain before they are added to the "
            "residual stream (post-norms), which commutes with signed permutations only"
        )
    elif spec.norm == "layernorm":
        residual = "ones_fixing"
        why["residual"] = (
            "its LayerNorms subtract the mean, so residual maps must fix the all-ones vector"
        )
    else:
        residual = "orthogonal"
    if keep_tie and spec.tied_embeddings:
        # A sign flip moves the mean a LayerNorm subtracts: permutations only there.
        residual = "permutation" if residual == "ones_fixing" else "signed_permutation"
        why["residual"] = (
            "its head is tied to its embeddings and reads them through the final norm's gain "
            "(tied_embeddings: keep), which commutes with "
            + ("permutations" if residual == "permutation" else "signed permutations")
            + " only"
        )
    qk: QK = "maps"
    if spec.qk_norm != "none":
        qk = "shared_gains" if spec.qk_norm == "head" else "head_gains"
        where = "per head" if spec.qk_norm == "head" else "over the whole projection"
        why["qk"] = (
            f"its queries and keys are normalised {where} (QK-norm), which leaves diagonal QK "
            "maps only: a sign per key/value head and rotary pair times a scale traded between "
            "the q_norm and k_norm gains"
            + (", shared by all heads" if qk == "shared_gains" else "")
        )
    return SymmetryGroup(residual, qk, why, spec.architecture)


def untying_gains(spec: ModelSpec) -> bool:
    """Whether untying a tied head widens the residual group of models of ``spec``: it does
    where their stream admits more than signed permutations (RMSNorm or LayerNorm pre-norm
    families); it does not where post-norms already confine it to them."""
    return symmetry_group(spec).residual != symmetry_group(spec, keep_tie=True).residual
