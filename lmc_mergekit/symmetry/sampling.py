"""Random group elements: used by ``scramble`` and by the tests."""

from __future__ import annotations

import math

import torch
from scipy.linalg import null_space

from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.symmetry.rope import rope_map_from_pairs
from lmc_mergekit.symmetry.transform import LayerTransform, Transform


def ones_complement_basis(d: int) -> torch.Tensor:
    """``U`` (d×(d-1)): an orthonormal basis of the vectors orthogonal to all-ones."""
    return torch.from_numpy(null_space(torch.ones(1, d, dtype=torch.float64).numpy()))


def ones_fixing_rotation(inner: torch.Tensor) -> torch.Tensor:
    """``Q = 11ᵀ/d + U·Q'·Uᵀ`` for an orthogonal ``Q'`` of size d-1: an orthogonal map of R^d
    that fixes the all-ones vector, so it commutes with LayerNorm."""
    d = inner.shape[0] + 1
    basis = ones_complement_basis(d)
    return torch.full((d, d), 1.0 / d, dtype=torch.float64) + basis @ inner.double() @ basis.T


def random_orthogonal(d: int, generator: torch.Generator, fix_ones: bool = False) -> torch.Tensor:
    """A Haar-random orthogonal d×d matrix (restricted to fix the all-ones vector if asked)."""
    size = d - 1 if fix_ones else d
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    # Imported here: scipy.stats takes longer to import than the rest of the plugin together,
    # and every process that loads the plugin (each mergekit-yaml) would pay for it.
    from scipy.stats import ortho_group

    q = torch.from_numpy(ortho_group.rvs(size, random_state=seed)) if size > 1 else torch.eye(size)
    return ones_fixing_rotation(q) if fix_ones else q.double()


def random_well_conditioned(
    shape: tuple[int, ...], n: int, generator: torch.Generator, condition: float = 4.0
) -> torch.Tensor:
    """Random invertible n×n maps ``U·diag(s)·Vᵀ`` with singular values in [1/√c, √c]."""
    count = math.prod(shape)
    us = [random_orthogonal(n, generator) for _ in range(2 * count)]
    log_s = (torch.rand(count, n, generator=generator, dtype=torch.float64) - 0.5) * math.log(
        condition
    )
    maps = torch.stack(
        [us[2 * i] @ torch.diag(log_s[i].exp()) @ us[2 * i + 1] for i in range(count)]
    )
    return maps.reshape(*shape, n, n)


def random_rope_maps(
    count: int, head_dim: int, rotary_dims: int, generator: torch.Generator, condition: float = 4.0
) -> torch.Tensor:
    """Random invertible maps that commute with RoPE (scaled rotations on the rotary pairs)."""
    half = rotary_dims // 2
    log_range = math.log(condition)
    scales = (
        (torch.rand(count, half, generator=generator, dtype=torch.float64) - 0.5) * log_range
    ).exp()
    angles = torch.rand(count, half, generator=generator, dtype=torch.float64) * 2 * math.pi
    rest = head_dim - rotary_dims
    free = random_well_conditioned((count,), rest, generator, condition) if rest else None
    return rope_map_from_pairs(scales, angles, free)


def random_diagonal_qk_maps(
    spec: ModelSpec, generator: torch.Generator, condition: float = 4.0
) -> torch.Tensor:
    """Random QK maps of a QK-norm model (:mod:`.group`): a sign per key/value head and dim
    (equal on a rotary pair's two dims) times a scale per dim (equal on a pair; one for every
    head under a per-head norm)."""
    hkv, dh, half = spec.num_kv_heads, spec.head_dim, spec.rotary_dims // 2
    heads = 1 if symmetry_group(spec).qk == "shared_gains" else hkv
    draw = dh - half  # one value per pair, one per non-rotary dim
    scales = (
        (
            (torch.rand(heads, draw, generator=generator, dtype=torch.float64) - 0.5)
            * math.log(condition)
        )
        .exp()
        .expand(hkv, draw)
    )
    signs = torch.randint(0, 2, (hkv, draw), generator=generator).double() * 2 - 1
    values = scales * signs
    per_dim = torch.cat([values[:, :half], values[:, :half], values[:, half:]], dim=1)
    return torch.diag_embed(per_dim)


def random_head_perm(spec: ModelSpec, generator: torch.Generator) -> torch.Tensor:
    """A random query-head permutation that keeps key/value groups whole."""
    g = spec.group_size
    groups = torch.randperm(spec.num_kv_heads, generator=generator)
    within = torch.stack([torch.randperm(g, generator=generator) for _ in range(spec.num_kv_heads)])
    return (groups[:, None] * g + within).reshape(-1)


def random_signed_permutation(d: int, generator: torch.Generator) -> torch.Tensor:
    """A random d×d signed permutation matrix."""
    signs = torch.randint(0, 2, (d,), generator=generator).double() * 2 - 1
    return torch.eye(d, dtype=torch.float64)[torch.randperm(d, generator=generator)] * signs


def random_residual_map(
    spec: ModelSpec, generator: torch.Generator, keep_tie: bool = False
) -> torch.Tensor:
    """A random element of the residual group ``spec`` admits (see :mod:`.group`)."""
    residual = symmetry_group(spec, keep_tie).residual
    if residual == "signed_permutation":
        return random_signed_permutation(spec.hidden_size, generator)
    if residual == "permutation":
        return random_signed_permutation(spec.hidden_size, generator).abs()
    return random_orthogonal(spec.hidden_size, generator, fix_ones=residual == "ones_fixing")


def random_transform(
    spec: ModelSpec,
    seed: int = 0,
    scale_range: tuple[float, float] = (0.5, 2.0),
    keep_tie: bool = False,
) -> Transform:
    """A random element of exactly the group ``spec`` admits (:func:`.group.symmetry_group`;
    with ``keep_tie``, the one keeping tied embeddings tied): residual map, scale,
    permutations and maps."""
    group = symmetry_group(spec)
    gen = torch.Generator().manual_seed(seed)
    low, high = (math.log(x) for x in scale_range)
    scale = math.exp(low + (high - low) * float(torch.rand(1, generator=gen)))
    layers = []
    for _ in range(spec.num_layers):
        if group.qk_maps:
            qk = random_rope_maps(spec.num_kv_heads, spec.head_dim, spec.rotary_dims, gen)
        else:
            qk = random_diagonal_qk_maps(spec, gen)
        layers.append(
            LayerTransform(
                head_perm=random_head_perm(spec, gen),
                ffn_perm=torch.randperm(spec.intermediate_size, generator=gen),
                qk=qk,
                ov=random_well_conditioned((spec.num_kv_heads,), spec.head_dim, gen),
            )
        )
    return Transform(
        num_layers=spec.num_layers,
        absorb_norms=True,
        rotation=random_residual_map(spec, gen, keep_tie),
        scale=scale,
        layers=tuple(layers),
        keep_tie=keep_tie,
    )
