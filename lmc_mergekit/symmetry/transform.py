"""A symmetry element as a value: composable, invertible, saved to and loaded from a file.

A :class:`Transform` acts on a model in a fixed normal order: (1) norm absorption, (2) residual
rotation ``x → x·Q`` and global scale ``x → g·x`` of the residual stream, (3) per layer, attention
head and FFN neuron permutations (new position ``i`` takes old position ``perm[i]``), (4) per
layer and key/value head ``j`` (new positions), the QK map ``q → q·M_j, k → k·M_j⁻ᵀ`` and the OV
map ``v → v·N_j`` (and ``W_O`` by ``N_j⁻ᵀ``). Absorption commutes with every other step, so
composition stays in this normal form.

Norm absorption is a re-parametrisation, not an invertible element: the inverse of a transform
that absorbs also absorbs (``t.then(t.inverse())`` is an absorbed copy of the model, computing
the same function).

A transform that keeps tied embeddings tied (``keep_tie``) leaves the final norm's gain in place
and moves the head as the embedding it is tied to (``W ← g·W·Q``, ``γ ← γ·|Q|/g``); its residual
map must then be a signed permutation (a permutation under LayerNorm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.symmetry.group import SymmetryGroup, symmetry_group
from lmc_mergekit.symmetry.rope import rope_commutation_error

FORMAT = "lmc-mergekit-transform-v1"
# Tolerances for accepting user-supplied group elements (relative, float64).
ORTHOGONALITY_TOL = 1e-6
ROPE_TOL = 1e-6


@dataclass(frozen=True)
class LayerTransform:
    """The per-layer part of a transform; None means identity."""

    head_perm: torch.Tensor | None = None
    ffn_perm: torch.Tensor | None = None
    qk: torch.Tensor | None = None
    ov: torch.Tensor | None = None


@dataclass(frozen=True)
class Transform:
    """A function-preserving symmetry of a model with ``num_layers`` blocks."""

    num_layers: int
    absorb_norms: bool = False
    rotation: torch.Tensor | None = None
    #: A float, or a 0-d tensor while it is being learned.
    scale: float | torch.Tensor = 1.0
    layers: tuple[LayerTransform, ...] = field(default=())
    #: Keep tied embeddings tied: the final norm keeps its gain (see the module docstring).
    keep_tie: bool = False

    def __post_init__(self):
        if not self.layers:
            object.__setattr__(self, "layers", (LayerTransform(),) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise LmcError(
                f"transform has {len(self.layers)} layer entries for {self.num_layers} layers"
            )
        if self.scale <= 0:
            raise LmcError(f"transform scale must be positive, got {self.scale}")
        # A rotation commutes with a norm only once its gain is absorbed.
        if self.rotation is not None and not self.absorb_norms:
            object.__setattr__(self, "absorb_norms", True)

    @classmethod
    def identity(cls, num_layers: int) -> Transform:
        return cls(num_layers=num_layers)

    def to(self, dtype: torch.dtype) -> Transform:
        """This transform with its rotation and maps (and a tensor scale) in ``dtype``."""

        def cast(x):
            return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

        return Transform(
            num_layers=self.num_layers,
            absorb_norms=self.absorb_norms,
            rotation=cast(self.rotation),
            scale=cast(self.scale),
            layers=tuple(
                replace(layer, qk=cast(layer.qk), ov=cast(layer.ov)) for layer in self.layers
            ),
            keep_tie=self.keep_tie,
        )

    # ---- group structure ----------------------------------------------------------------

    def then(self, other: Transform) -> Transform:
        """The transform that applies ``self`` first and ``other`` after it."""
        if other.num_layers != self.num_layers:
            raise LmcError("cannot compose transforms for different numbers of layers")
        return Transform(
            num_layers=self.num_layers,
            absorb_norms=self.absorb_norms or other.absorb_norms,
            rotation=_matmul_optional(self.rotation, other.rotation),
            scale=self.scale * other.scale,
            layers=tuple(
                _compose_layers(a, b) for a, b in zip(self.layers, other.layers, strict=True)
            ),
            keep_tie=self.keep_tie or other.keep_tie,
        )

    def inverse(self) -> Transform:
        """The transform undoing this one (up to norm absorption, see the module docstring)."""
        return Transform(
            num_layers=self.num_layers,
            absorb_norms=self.absorb_norms,
            rotation=None if self.rotation is None else self.rotation.T.clone(),
            scale=1.0 / self.scale,
            layers=tuple(_invert_layer(layer) for layer in self.layers),
            keep_tie=self.keep_tie,
        )

    def is_identity(self) -> bool:
        """Whether this transform leaves every stored tensor as it is (no absorption, no
        rotation or scale, no permutation or map): the model moved by it is the model."""
        return (
            not self.absorb_norms
            and self.rotation is None
            and float(self.scale) == 1.0
            and all(getattr(layer, f.name) is None for layer in self.layers for f in fields(layer))
        )

    def units_moved(self) -> int:
        """How many units this transform's permutations move to another place: heads,
        MLP neurons, and residual channels where the residual map is a (signed)
        permutation. 0 for a model matched to its own fine-tune; independently trained models
        move nearly every unit."""
        moved = 0
        if self.rotation is not None and is_signed_permutation(self.rotation):
            eye = torch.eye(len(self.rotation), dtype=self.rotation.dtype)
            moved += int((self.rotation.abs() != eye).any(dim=1).sum())
        for layer in self.layers:
            for perm in (layer.head_perm, layer.ffn_perm):
                if perm is not None:
                    moved += int((perm != torch.arange(len(perm), device=perm.device)).sum())
        return moved

    # ---- validation ---------------------------------------------------------------------

    def non_finite_part(self) -> str | None:
        """The first part holding NaN or Inf (``rotation``, ``scale``, ``layer 3 QK maps``),
        or None when every part is finite."""
        parts: list[tuple[str, float | torch.Tensor | None]] = [
            ("scale", self.scale),
            ("rotation", self.rotation),
        ]
        for index, layer in enumerate(self.layers):
            parts += [(f"layer {index} QK maps", layer.qk), (f"layer {index} OV maps", layer.ov)]
        for name, value in parts:
            if value is not None and not torch.isfinite(torch.as_tensor(value)).all():
                return name
        return None

    def check_fits(self, spec: ModelSpec) -> None:
        """Raise a one-line error unless this transform is a valid symmetry of ``spec``."""
        name = spec.architecture
        if self.num_layers != spec.num_layers:
            raise LmcError(
                f"transform is for {self.num_layers} layers but the {name} model has "
                f"{spec.num_layers}; use a transform made for this model"
            )
        if self.keep_tie and not spec.tied_embeddings:
            raise LmcError(
                f"transform keeps tied embeddings tied, but the {name} model's are not tied; "
                "use a transform made for this model"
            )
        bad = self.non_finite_part()
        if bad is not None:
            raise LmcError(f"NaN or Inf values in the transform's {bad}; it is no symmetry")
        group = symmetry_group(spec, self.keep_tie)
        if self.rotation is not None:
            _check_rotation(self.rotation.double(), spec, group)
        for index, layer in enumerate(self.layers):
            _check_layer(layer, spec, group, index)


def _check_rotation(q: torch.Tensor, spec: ModelSpec, group: SymmetryGroup) -> None:
    d = spec.hidden_size
    if q.shape != (d, d):
        raise LmcError(f"transform rotation is {tuple(q.shape)} but the model's hidden size is {d}")
    err = float((q.T @ q - torch.eye(d, dtype=q.dtype)).abs().max())
    if err > ORTHOGONALITY_TOL:
        raise LmcError(f"transform rotation is not orthogonal (|QᵀQ - I| = {err:.2e})")
    if group.residual == "ones_fixing":
        ones = torch.ones(d, dtype=q.dtype)
        drift = float((ones @ q - ones).abs().max())
        if drift > ORTHOGONALITY_TOL:
            raise group.refuse(
                "residual",
                f"a residual rotation that moves the all-ones vector (|1·Q - 1| = {drift:.2e}; "
                "build one with ones_fixing_rotation)",
            )
    if group.residual == "signed_permutation" and not is_signed_permutation(q):
        raise group.refuse("residual", "a residual rotation other than a signed permutation")
    if group.residual == "permutation" and not (is_signed_permutation(q) and (q > -0.5).all()):
        raise group.refuse("residual", "a residual rotation other than a permutation")


def is_signed_permutation(q: torch.Tensor) -> bool:
    """Whether ``q`` (orthogonal) has one ±1 per row and column, up to rounding."""
    magnitude = q.abs()
    return bool(((magnitude - 1).abs() < ORTHOGONALITY_TOL).sum(dim=1).eq(1).all()) and bool(
        (magnitude.sum(dim=1) - 1).abs().max() < ORTHOGONALITY_TOL * q.shape[0]
    )


def _check_layer(layer: LayerTransform, spec: ModelSpec, group: SymmetryGroup, index: int) -> None:
    where = f"transform layer {index}"
    if layer.qk is not None and not group.qk_maps:
        _check_diagonal_qk(layer.qk.double(), group, where)
    shape = (spec.num_kv_heads, spec.head_dim, spec.head_dim)
    for kind, maps in (("QK", layer.qk), ("OV", layer.ov)):
        if maps is None:
            continue
        if tuple(maps.shape) != shape:
            raise LmcError(
                f"{where} {kind} maps have shape {tuple(maps.shape)}; the model needs {shape} "
                "(one dh×dh map per key/value head)"
            )
        if torch.linalg.matrix_rank(maps.double()).min() < spec.head_dim:
            raise LmcError(f"{where} {kind} maps are not invertible")
    if layer.qk is not None and spec.rotary_dims:
        err = rope_commutation_error(layer.qk.double(), spec.rotary_dims)
        if err > ROPE_TOL:
            raise LmcError(
                f"{where} QK maps do not commute with RoPE (relative gap {err:.2e}); use "
                "scaled 2×2 rotations on rotary pairs (see symmetry.rope)"
            )
    if layer.head_perm is not None:
        _check_perm(layer.head_perm, spec.num_heads, f"{where} head permutation")
        kv_permutation(layer.head_perm, spec.num_kv_heads)  # raises if it splits a KV group
    if layer.ffn_perm is not None:
        _check_perm(layer.ffn_perm, spec.intermediate_size, f"{where} FFN permutation")


def _check_diagonal_qk(maps: torch.Tensor, group: SymmetryGroup, where: str) -> None:
    """Under a QK-norm: diagonal maps, and one scale per dim for every head under a per-head
    norm (its gain is shared)."""
    diagonal = maps.diagonal(dim1=-2, dim2=-1)
    off = float((maps - torch.diag_embed(diagonal)).abs().max())
    if off > ROPE_TOL * float(diagonal.abs().max()):
        raise group.refuse("qk", f"QK maps that are not diagonal ({where})")
    magnitude = diagonal.abs()
    spread = float((magnitude - magnitude[:1]).abs().max())
    if group.qk == "shared_gains" and spread > ROPE_TOL * float(magnitude.max()):
        raise group.refuse("qk", f"QK scales that differ between heads ({where})")


def _check_perm(perm: torch.Tensor, size: int, what: str) -> None:
    if perm.shape != (size,) or not torch.equal(torch.sort(perm).values, torch.arange(size)):
        raise LmcError(f"{what} is not a permutation of {size} entries")


def kv_permutation(head_perm: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The key/value head permutation implied by a query head permutation (GQA-aware)."""
    groups = head_perm.reshape(num_kv_heads, -1) // (head_perm.numel() // num_kv_heads)
    if not (groups == groups[:, :1]).all():
        raise LmcError(
            "head permutation moves query heads between key/value groups; permute whole "
            "groups, and heads only within a group"
        )
    return groups[:, 0].clone()


def _matmul_optional(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.double() @ b.double()


def _compose_perm(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    if first is None:
        return second
    if second is None:
        return first
    return first[second]


def _compose_maps(
    first: torch.Tensor | None, second: torch.Tensor | None, second_kv_perm: torch.Tensor | None
) -> torch.Tensor | None:
    # New KV head j came from first-stage head kv_perm[j]; its map is then extended by second's.
    if first is not None and second_kv_perm is not None:
        first = first[second_kv_perm]
    return _matmul_optional(first, second)


def _compose_layers(a: LayerTransform, b: LayerTransform) -> LayerTransform:
    kv = None
    if b.head_perm is not None and (a.qk is not None or a.ov is not None):
        kv_heads = (a.qk if a.qk is not None else a.ov).shape[0]
        kv = kv_permutation(b.head_perm, kv_heads)
    return LayerTransform(
        head_perm=_compose_perm(a.head_perm, b.head_perm),
        ffn_perm=_compose_perm(a.ffn_perm, b.ffn_perm),
        qk=_compose_maps(a.qk, b.qk, kv),
        ov=_compose_maps(a.ov, b.ov, kv),
    )


def _invert_layer(layer: LayerTransform) -> LayerTransform:
    head_inv = None if layer.head_perm is None else torch.argsort(layer.head_perm)
    kv = None
    if head_inv is not None and (layer.qk is not None or layer.ov is not None):
        kv_heads = (layer.qk if layer.qk is not None else layer.ov).shape[0]
        kv = kv_permutation(head_inv, kv_heads)

    def invert_maps(maps: torch.Tensor | None) -> torch.Tensor | None:
        if maps is None:
            return None
        inv = torch.linalg.inv(maps.double())
        return inv if kv is None else inv[kv]

    return LayerTransform(
        head_perm=head_inv,
        ffn_perm=None if layer.ffn_perm is None else torch.argsort(layer.ffn_perm),
        qk=invert_maps(layer.qk),
        ov=invert_maps(layer.ov),
    )


# ---- files ------------------------------------------------------------------------------


def save_transform(transform: Transform, path: str | Path) -> None:
    """Write a transform as one safetensors file (tensors plus JSON metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    if transform.rotation is not None:
        tensors["rotation"] = transform.rotation.double().contiguous()
    for index, layer in enumerate(transform.layers):
        for name in ("head_perm", "ffn_perm", "qk", "ov"):
            value = getattr(layer, name)
            if value is not None:
                tensors[f"layers.{index}.{name}"] = value.contiguous()
    metadata = {
        "format": FORMAT,
        "num_layers": str(transform.num_layers),
        "absorb_norms": json.dumps(transform.absorb_norms),
        "scale": repr(float(transform.scale)),
        "keep_tie": json.dumps(transform.keep_tie),
    }
    save_file(tensors, str(path), metadata=metadata)


def load_transform(path: str | Path) -> Transform:
    """Read a transform written by :func:`save_transform`; a one-line error for a file that is
    not one, or whose values are not all finite."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise LmcError(f"transform file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), "pt") as fp:
            metadata = fp.metadata() or {}
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises several types for a damaged file
        raise LmcError(f"{path} is not a readable transform file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise LmcError(f"{path} is not an lmc-mergekit transform file")
    num_layers = int(metadata["num_layers"])
    layers = []
    for index in range(num_layers):
        layers.append(
            LayerTransform(
                **{
                    name: tensors.get(f"layers.{index}.{name}")
                    for name in ("head_perm", "ffn_perm", "qk", "ov")
                }
            )
        )
    transform = Transform(
        num_layers=num_layers,
        absorb_norms=json.loads(metadata["absorb_norms"]),
        rotation=tensors.get("rotation"),
        scale=float(metadata["scale"]),
        layers=tuple(layers),
        keep_tie=json.loads(metadata.get("keep_tie", "false")),
    )
    bad = transform.non_finite_part()
    if bad is not None:
        raise LmcError(
            f"{path}: NaN or Inf values in the transform's {bad}; the file is damaged or was "
            "written by a run that diverged, make it again"
        )
    return transform
