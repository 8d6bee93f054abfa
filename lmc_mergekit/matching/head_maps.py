"""Fitting one model's per-head maps to another's.

A head map ``A`` (k×k, invertible) acts on a pair of row blocks as ``X ← A·X``, ``Y ← A⁻ᵀ·Y``,
which keeps the circuit ``Xᵀ·Y`` (QK: ``X`` = query rows, ``Y`` = key rows; OV: ``X`` = value
rows, ``Y`` = the head's output columns, transposed). We look for ``A`` with ``A·X_B ≈ X_A`` and
``A⁻ᵀ·Y_B ≈ Y_A``.

Both heads are first brought to a canonical *balanced* form in which ``X·Xᵀ = Y·Yᵀ`` is
diagonal (the basis in which the circuit's singular directions are the coordinates, unique up to
signs); an orthogonal Procrustes step then matches the balanced forms, so
``A = C_A⁻¹·R·C_B``. For a copy of a head moved by any map this recovers the map exactly; for
independently trained heads it is a well-conditioned best fit. Rotary pairs only admit scaled
2×2 rotations (they must commute with RoPE): there the balancing is a scalar and ``R`` a planar
rotation.

All functions take batches: ``X`` is ``(..., k, n)`` and ``Y`` is ``(..., k, m)``.
"""

from __future__ import annotations

import torch

from lmc_mergekit.symmetry.rope import rotary_pairs

# Relative ridge on the Gram matrices, so that a dead head (all-zero rows) stays invertible.
RIDGE = 1e-12
# QK-norm gains below this share of the largest are too small to balance (scale 1 there).
GAIN_FLOOR = 1e-6


def balancing_map(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``C`` with ``C·X·Xᵀ·Cᵀ = C⁻ᵀ·Y·Yᵀ·C⁻¹ = S`` diagonal (the circuit's singular values)."""
    lx, ly = _cholesky(x @ x.mT), _cholesky(y @ y.mT)
    _, s, vh = torch.linalg.svd(ly.mT @ lx)
    return s.clamp_min(torch.finfo(s.dtype).tiny).sqrt()[..., :, None] * (vh @ torch.linalg.inv(lx))


def fit_free_maps(
    xa: torch.Tensor, ya: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor
) -> torch.Tensor:
    """Maps ``A`` (any invertible) taking the heads ``(X_B, Y_B)`` onto ``(X_A, Y_A)``."""
    ca, cb = balancing_map(xa, ya), balancing_map(xb, yb)
    xa_c, xb_c = ca @ xa, cb @ xb
    ya_c = torch.linalg.solve(ca.mT, ya)
    yb_c = torch.linalg.solve(cb.mT, yb)
    k = xa_c @ xb_c.mT + ya_c @ yb_c.mT
    u, _, vh = torch.linalg.svd(k)
    return torch.linalg.solve(ca, u @ vh @ cb)


def fit_conformal_maps(
    xa: torch.Tensor, ya: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor
) -> torch.Tensor:
    """Maps ``A = s·R(φ)`` (2×2 scaled rotations) taking ``(X_B, Y_B)`` onto ``(X_A, Y_A)``."""
    ca, cb = _balancing_scale(xa, ya), _balancing_scale(xb, yb)
    k = (ca * xa) @ (cb * xb).mT + (ya / ca) @ (yb / cb).mT
    angle = torch.atan2(k[..., 1, 0] - k[..., 0, 1], k[..., 0, 0] + k[..., 1, 1])
    c, s = torch.cos(angle), torch.sin(angle)
    rotation = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    return rotation * (cb / ca)


def fit_rope_maps(
    xa: torch.Tensor, ya: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, rotary_dims: int
) -> torch.Tensor:
    """Maps ``(..., dh, dh)`` that commute with RoPE: conformal on each rotary pair, free on the
    non-rotary dims. The rows of ``X`` and ``Y`` are head dims in transformers' layout."""
    dh = xa.shape[-2]
    out = xa.new_zeros((*xa.shape[:-2], dh, dh))
    if rotary_dims:
        first, second = rotary_pairs(rotary_dims)
        pair = torch.stack([first, second], -1)  # (r/2, 2)

        def pairs(t: torch.Tensor) -> torch.Tensor:
            return t[..., pair, :]  # (..., r/2, 2, n)

        blocks = fit_conformal_maps(pairs(xa), pairs(ya), pairs(xb), pairs(yb))
        out[..., pair[:, :, None], pair[:, None, :]] = blocks
    if rotary_dims < dh:
        free = slice(rotary_dims, dh)
        out[..., free, free] = fit_free_maps(
            xa[..., free, :], ya[..., free, :], xb[..., free, :], yb[..., free, :]
        )
    return out


def _cholesky(gram: torch.Tensor) -> torch.Tensor:
    k = gram.shape[-1]
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    ridge = (RIDGE * trace / k).clamp_min(torch.finfo(gram.dtype).tiny)
    eye = torch.eye(k, dtype=gram.dtype)
    return torch.linalg.cholesky(gram + ridge[..., None, None] * eye)


def _balancing_scale(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The scalar ``c`` with ``||c·X|| = ||Y/c||`` (1 for an all-zero block)."""
    nx, ny = x.norm(dim=(-2, -1)), y.norm(dim=(-2, -1))
    ok = (nx > 0) & (ny > 0)
    c = torch.where(ok, (ny / nx.where(ok, torch.ones_like(nx))).sqrt(), torch.ones_like(nx))
    return c[..., None, None]


def fit_normed_qk_maps(
    xa: torch.Tensor,
    ya: torch.Tensor,
    xb: torch.Tensor,
    yb: torch.Tensor,
    gains_a: tuple[torch.Tensor, torch.Tensor],
    gains_b: tuple[torch.Tensor, torch.Tensor],
    rotary_dims: int,
) -> torch.Tensor:
    """Diagonal QK maps of a QK-norm model (:mod:`lmc_mergekit.symmetry.group`) taking B's
    heads onto A's: per key/value head and dim (pairs together) the sign under which B's query
    and key rows ``(X, Y)`` correlate with A's, times the scale ``c`` that best balances the
    gains (``γ_q·c ≈ γ_q,A``, ``γ_k/c ≈ γ_k,A`` in logs; 1 where a gain vanishes). The rows
    come multiplied by their norm's gain (what the head computes: a gain's sign is no
    symmetry); ``gains_*`` are the gains' magnitudes ``(|γ_q|, |γ_k|)`` as ``(heads, dh)``, one
    row when every head shares them, query gains per key/value group. Shapes as
    :func:`fit_free_maps`; the maps come back as ``(Hkv, dh, dh)``."""
    hkv, dh = xa.shape[0], xa.shape[1]
    half = rotary_dims // 2
    first, second = rotary_pairs(rotary_dims)

    def paired(values: torch.Tensor) -> torch.Tensor:
        """Per dim, the sum over its pair (pairs share one value)."""
        out = values.clone()
        out[..., first] = out[..., second] = values[..., first] + values[..., second]
        return out

    score = paired((xa * xb).sum(-1) + (ya * yb).sum(-1))
    sign = torch.where(score < 0, -1.0, 1.0).to(xa.dtype)
    gains = [g.abs().expand(hkv, dh) for g in (*gains_a, *gains_b)]
    alive = torch.stack(gains).amin(0) > GAIN_FLOOR * max(float(g.max()) for g in gains)
    logs = [g.clamp_min(torch.finfo(g.dtype).tiny).log() for g in gains]
    balance = torch.where(alive, ((logs[0] - logs[2]) - (logs[1] - logs[3])) / 2, 0.0)
    counts = torch.ones(dh, dtype=xa.dtype)
    counts[:half] = counts[half : 2 * half] = 2
    return torch.diag_embed(sign * (paired(balance) / counts).exp())
