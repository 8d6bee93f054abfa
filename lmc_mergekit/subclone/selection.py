"""Structured selection: the channels, heads, head dims, MLP units and layers a smaller model
keeps from a larger one, and the smaller block they make.

Selection only drops coordinates (and reorders them within what the architecture allows), so
every kept head, rotary pair, MLP unit and norm channel computes what it computed in the donor;
a dense projection would mix them and break rotary pairs, heads, the activation and the norms.
Heads and MLP units are ranked by the norms of the weights that read and write them (with the
norm gain in front folded in), or at random for the ablation; residual channels are ranked by
the caller (by activation variance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.view import Attention, Block, ModelSpec, Norm
from lmc_mergekit.subclone.target import RotaryPlan


class Ranker:
    """Picks the ``k`` best-scoring indices (kept in donor order), or ``k`` random ones."""

    def __init__(self, method: str, seed: int = 0):
        self.random = method == "random"
        self.generator = torch.Generator().manual_seed(seed)

    def top(self, scores: torch.Tensor, k: int) -> list[int]:
        if self.random:
            scores = torch.rand(len(scores), generator=self.generator)
        return sorted(torch.topk(scores.double(), k).indices.tolist())


@dataclass(frozen=True)
class BlockSelection:
    """What one block keeps: donor key/value heads; donor query heads, grouped by kept
    key/value head; per kept key/value head the donor head dims of q and k (in target order:
    the kept rotary pairs' first halves, their second halves, then non-rotary dims) and of v
    and o; and the donor MLP units."""

    kv_heads: tuple[int, ...]
    heads: tuple[int, ...]
    qk_dims: tuple[tuple[int, ...], ...]
    vo_dims: tuple[tuple[int, ...], ...]
    units: tuple[int, ...]

    def to_dict(self) -> dict:
        return {
            "kv_heads": list(self.kv_heads),
            "heads": list(self.heads),
            "qk_dims": [list(dims) for dims in self.qk_dims],
            "vo_dims": [list(dims) for dims in self.vo_dims],
            "units": list(self.units),
        }


def select_block(
    block: Block,
    donor: ModelSpec,
    target: ModelSpec,
    channels: torch.Tensor,
    plan: RotaryPlan,
    ranker: Ranker,
) -> BlockSelection:
    """Rank the heads, head dims and MLP units of a donor block (its residual channels already
    reduced to ``channels``) and keep as many as ``target`` has."""
    attn, mlp = block.attn, block.mlp
    heads, kv, dh = donor.num_heads, donor.num_kv_heads, donor.head_dim
    group = donor.group_size
    gain = _gain(block.attn_norm, channels)
    q = (attn.q[:, channels].double() * gain).reshape(heads, dh, -1)
    k = (attn.k[:, channels].double() * gain).reshape(kv, dh, -1)
    v = (attn.v[:, channels].double() * gain).reshape(kv, dh, -1)
    o = attn.o[channels].double().reshape(-1, heads, dh)
    owner = torch.arange(heads) // group
    v_norm, k_norm = v.norm(dim=(1, 2)), k.norm(dim=(1, 2))
    head_score = q.norm(dim=(1, 2)) * k_norm[owner] + v_norm[owner] * o.norm(dim=(0, 2))
    kv_kept = ranker.top(head_score.reshape(kv, group).sum(1), target.num_kv_heads)

    half, target_free = donor.rotary_dims // 2, target.head_dim - target.rotary_dims
    rotary = [*plan.pairs, *(j + half for j in plan.pairs)]
    kept_heads, qk_dims, vo_dims = [], [], []
    for g in kv_kept:
        members = list(range(g * group, (g + 1) * group))
        chosen = [members[i] for i in ranker.top(head_score[members], target.group_size)]
        kept_heads.extend(chosen)
        free = list(range(donor.rotary_dims, dh))
        free_score = (q[chosen][:, free].norm(dim=2).sum(0)) * k[g, free].norm(dim=1)
        qk_dims.append(tuple(rotary + [free[i] for i in ranker.top(free_score, target_free)]))
        vo_score = v[g].norm(dim=1) * o[:, chosen].norm(dim=(0, 1))
        vo_dims.append(tuple(ranker.top(vo_score, target.head_dim)))

    mlp_gain = _gain(block.mlp_norm, channels)
    unit_score = (mlp.up[:, channels].double() * mlp_gain).norm(dim=1)
    unit_score = unit_score * mlp.down[channels].double().norm(dim=0)
    if mlp.gate is not None:
        unit_score = unit_score * (mlp.gate[:, channels].double() * mlp_gain).norm(dim=1)
    units = ranker.top(unit_score, target.intermediate_size)
    return BlockSelection(
        tuple(kv_kept), tuple(kept_heads), tuple(qk_dims), tuple(vo_dims), tuple(units)
    )


def _gain(norm: Norm | None, channels: torch.Tensor) -> torch.Tensor | float:
    """The gain a reader of the stream sees on ``channels`` (1 without a norm)."""
    return 1.0 if norm is None else norm.gain[channels].double()


def subclone_block(
    block: Block,
    donor: ModelSpec,
    target: ModelSpec,
    channels: torch.Tensor,
    selection: BlockSelection,
) -> Block:
    """The smaller block made of what ``selection`` and ``channels`` keep.

    Queries are scaled so that every kept dim's share of the attention logits is what it was
    in the donor: by ``sqrt(dh'/dh)`` where the attention divides by ``sqrt(head size)`` (not at
    all where it divides by a fixed ``query_pre_attn_scalar``), and under a QK-norm, which
    normalises over fewer dims, by that over the norms' gain in the kept dims (the factor goes
    into the query norm's gain, which would undo it on the projection).
    """
    dh, per_group = donor.head_dim, target.group_size
    q_rows, k_rows, v_rows, o_cols = [], [], [], []
    for index, g in enumerate(selection.kv_heads):
        qk, vo = selection.qk_dims[index], selection.vo_dims[index]
        members = selection.heads[index * per_group : (index + 1) * per_group]
        k_rows += [g * dh + t for t in qk]
        v_rows += [g * dh + t for t in vo]
        for h in members:
            q_rows += [h * dh + t for t in qk]
            o_cols += [h * dh + t for t in vo]
    q_scale = _query_scale(donor, target)
    units, attn, mlp = list(selection.units), block.attn, block.mlp
    q_norm, k_norm = _qk_norms(attn, donor, selection, q_rows, k_rows)
    if q_norm is not None:  # the norm would undo a scaled projection: scale its gain
        q_norm, q_scale = q_norm.with_gain(q_norm.gain * q_scale), 1.0

    def pick(tensor: torch.Tensor | None, rows=None, cols=None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if rows is not None:
            tensor = tensor[rows]
        return tensor if cols is None else tensor[:, cols]

    return replace(
        block,
        attn_norm=select_norm(block.attn_norm, channels),
        attn=replace(
            attn,
            q=pick(attn.q, q_rows, channels) * q_scale,
            k=pick(attn.k, k_rows, channels),
            v=pick(attn.v, v_rows, channels),
            o=pick(attn.o, channels, o_cols),
            q_bias=None if attn.q_bias is None else attn.q_bias[q_rows] * q_scale,
            k_bias=pick(attn.k_bias, k_rows),
            v_bias=pick(attn.v_bias, v_rows),
            o_bias=pick(attn.o_bias, channels),
            q_norm=q_norm,
            k_norm=k_norm,
        ),
        mlp_norm=select_norm(block.mlp_norm, channels),
        mlp=replace(
            mlp,
            up=pick(mlp.up, units, channels),
            down=pick(mlp.down, channels, units),
            gate=pick(mlp.gate, units, channels),
            up_bias=pick(mlp.up_bias, units),
            gate_bias=pick(mlp.gate_bias, units),
            down_bias=pick(mlp.down_bias, channels),
        ),
        attn_post_norm=select_norm(block.attn_post_norm, channels),
        mlp_post_norm=select_norm(block.mlp_post_norm, channels),
    )


def _query_scale(donor: ModelSpec, target: ModelSpec) -> float:
    """The factor on the queries that keeps each kept dim's share of the attention logits."""
    scale = 1.0 if target.query_pre_attn_scalar else math.sqrt(target.head_dim / donor.head_dim)
    if donor.qk_norm == "head":  # q and k each normalised over dh' dims instead of dh
        scale /= target.head_dim / donor.head_dim
    elif donor.qk_norm == "projection":  # over the kept part of each projection
        q_kept = target.num_heads * target.head_dim / (donor.num_heads * donor.head_dim)
        k_kept = target.num_kv_heads * target.head_dim / (donor.num_kv_heads * donor.head_dim)
        scale /= math.sqrt(q_kept * k_kept)
    return scale


def _qk_norms(attn: Attention, donor: ModelSpec, selection: BlockSelection, q_rows, k_rows):
    """The query and key norms over what ``selection`` keeps: the kept dims of the one shared
    gain (per-head QK-norm, where every kept group keeps the same dims), or the kept rows of the
    projection's gains."""
    if donor.qk_norm == "none":
        return None, None
    if donor.qk_norm == "projection":
        return (
            replace(n, weight=n.weight[rows])
            for n, rows in ((attn.q_norm, q_rows), (attn.k_norm, k_rows))
        )
    dims = set(selection.qk_dims)
    if len(dims) > 1:
        raise LmcError(
            "the query/key norm is shared by every head, but the kept groups keep different "
            "non-rotary dims; keep every non-rotary dim (head_dim) or all rotary dims"
        )
    kept = list(next(iter(dims)))
    return (replace(n, weight=n.weight[kept]) for n in (attn.q_norm, attn.k_norm))


def select_norm(norm: Norm | None, channels: torch.Tensor) -> Norm | None:
    """The norm over ``channels`` only: its gains and biases selected with them."""
    if norm is None:
        return None
    return replace(
        norm, weight=norm.weight[channels], bias=None if norm.bias is None else norm.bias[channels]
    )
