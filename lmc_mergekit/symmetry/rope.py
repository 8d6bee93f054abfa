"""Per-head maps that commute with rotary position embeddings.

transformers rotates with ``rotate_half``: within the first ``r`` dims of a head, dim ``j`` pairs
with ``j + r/2``. As a right-multiplied matrix on row vectors, each pair turns by
``[[c, s], [-s, c]]``; a map commutes with every such turn iff on each pair it is
``[[α, β], [-β, α]]`` (a scaled rotation) and it does not mix pairs with each other or with the
non-rotary dims, which may take any invertible block.
"""

from __future__ import annotations

import torch


def rotary_pairs(rotary_dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors ``(first, second)`` of the rotary pairs of one head."""
    half = rotary_dims // 2
    first = torch.arange(half)
    return first, first + half


def project_to_rope_commutant(maps: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """The nearest (Frobenius) maps to ``maps`` (``(..., dh, dh)``) that commute with RoPE."""
    if rotary_dims == 0:
        return maps.clone()
    first, second = rotary_pairs(rotary_dims)
    out = torch.zeros_like(maps)
    alpha = (maps[..., first, first] + maps[..., second, second]) / 2
    beta = (maps[..., first, second] - maps[..., second, first]) / 2
    out[..., first, first] = alpha
    out[..., second, second] = alpha
    out[..., first, second] = beta
    out[..., second, first] = -beta
    out[..., rotary_dims:, rotary_dims:] = maps[..., rotary_dims:, rotary_dims:]
    return out


def rope_commutation_error(maps: torch.Tensor, rotary_dims: int) -> float:
    """Relative distance of ``maps`` from the maps that commute with RoPE (0 = commuting)."""
    gap = maps - project_to_rope_commutant(maps, rotary_dims)
    return float(gap.norm() / maps.norm().clamp_min(1e-30))


def rope_map_from_pairs(
    scales: torch.Tensor, angles: torch.Tensor, free_block: torch.Tensor | None
) -> torch.Tensor:
    """Build RoPE-commuting maps: scaled rotations on the pairs, ``free_block`` elsewhere.

    ``scales`` and ``angles`` are ``(..., r/2)``; ``free_block`` is ``(..., dh-r, dh-r)`` or None.
    """
    half = scales.shape[-1]
    rest = 0 if free_block is None else free_block.shape[-1]
    dh = 2 * half + rest
    out = scales.new_zeros((*scales.shape[:-1], dh, dh))
    first, second = rotary_pairs(2 * half)
    alpha, beta = scales * torch.cos(angles), scales * torch.sin(angles)
    out[..., first, first] = alpha
    out[..., second, second] = alpha
    out[..., first, second] = beta
    out[..., second, first] = -beta
    if free_block is not None:
        out[..., 2 * half :, 2 * half :] = free_block
    return out
