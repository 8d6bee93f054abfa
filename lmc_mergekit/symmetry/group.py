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
  its elementwise gain blocks the rotations;
- OV maps, always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.view import ModelSpec

Residual = Literal["orthogonal", "ones_fixing", "signed_permutation", "permutation"]
#: The families of learned matching (continuous symmetries).
FAMILIES: tuple[str, ...] = ("residual", "scale", "qk", "ov")


@dataclass(frozen=True)
class SymmetryGroup:
    """The symmetries a model admits; ``why`` says, per symmetry kind that is restricted or
    absent, which feature of the model restricts it."""

    residual: Residual
    qk_maps: bool
    why: dict[str, str]
    architecture: str = ""

    def refuse(self, kind: str, detail: str = "") -> LmcError:
        """The one-line error for a transform with ``kind`` (``residual``, ``qk``) that this
        model does not admit."""
        reason = self.why.get(kind, "")
        return LmcError(
            f"the {self.architecture} model does not admit {detail or kind}: {reason}".rstrip(": ")
        )

    @property
    def learnable(self) -> tuple[str, ...]:
        """The learned-matching families that are continuous symmetries of this model."""
        discrete = {"residual"} if self.residual in ("signed_permutation", "permutation") else set()
        absent = set() if self.qk_maps else {"qk"}
        return tuple(f for f in FAMILIES if f not in discrete | absent)


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
    qk_maps = spec.qk_norm == "none"
    if not qk_maps:
        where = "per head" if spec.qk_norm == "head" else "over the whole projection"
        why["qk"] = f"its queries and keys are normalised {where} (QK-norm)"
    return SymmetryGroup(residual, qk_maps, why, spec.architecture)
