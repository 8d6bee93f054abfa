"""Repairing a merged model's statistics: the REPAIR idea, by rescaling units with parameters
the architecture already has.

Two aligned units of correlation ρ average to a unit with (1+ρ)/2 of their variance, so an
interpolated network's activations shrink layer after layer ("variance collapse": Jordan et
al., *REPAIR: REnormalizing Permuted Activations for Interpolation Repair*, ICLR 2023). REPAIR
rescales each unit of the merged network so that its statistics are the interpolation of the
endpoints'. Here, on calibration text, block by block (one block of each model in memory, and
the residual streams of the calibration tokens):

- each attention value dimension (a row of ``v``, shared by the query heads of its key/value
  group under GQA) is scaled so that the root mean square of what it carries into the output
  projection (over tokens and the group's query heads) is the weighted mean of the endpoints';
- each MLP unit likewise: its ``up`` row where the MLP is gated (``act(gate·x) · up·x`` is
  linear in it), its ``down`` column otherwise (the activation cannot be scaled from its input);
- where a family writes through post-norms (Gemma 2, Gemma 3, OLMo 2), each post-norm's gain
  channel is scaled so that what it writes into the residual stream has the endpoints'
  interpolated root mean square per channel (a post-norm would undo a scale applied before it).

Scales only, no new bias: the output keeps its input's architecture and config. Root mean
squares (not standard deviations) because a scale without a shift can match the second moment
exactly. A scale is not a symmetry: it changes the merged model, never the endpoints. Merging
a model with itself needs no repair, and the scales come out exactly 1.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import BlockActivations, BlockRunner, embed, final_norm
from lmc_mergekit.models.view import Block, ModelSpec, ModelView, Norm

#: Calibration sequences a block runs on at a time.
BATCH = 8
#: Scales are kept within [1/LIMIT, LIMIT]: a unit the merge nearly silenced is not blown up.
LIMIT = 16.0


@dataclass
class BlockScales:
    """One block's scales: value dimensions (``kv_heads·head_dim``), MLP units, and the
    post-norms' channels (None where the family has no post-norm)."""

    values: torch.Tensor
    units: torch.Tensor
    attn_post: torch.Tensor | None = None
    mlp_post: torch.Tensor | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in ("values", "units", "attn_post", "mlp_post"):
            value = getattr(self, name)
            if value is not None:
                yield name, value


@dataclass(frozen=True)
class Repair:
    """The scales of every block of one merged model."""

    blocks: tuple[BlockScales, ...]

    def summary(self) -> dict:
        """JSON-ready: per kind of unit, how many were scaled and the spread of the scales."""
        kinds: dict[str, list[torch.Tensor]] = {}
        for block in self.blocks:
            for name, scales in block.tensors():
                kinds.setdefault(name, []).append(scales)
        summary = {}
        for name, parts in kinds.items():
            scales = torch.cat(parts)
            summary[name] = {
                "units": scales.numel(),
                "mean": round(float(scales.mean()), 6),
                "min": round(float(scales.min()), 6),
                "max": round(float(scales.max()), 6),
                "at_limit": int(((scales >= LIMIT) | (scales <= 1 / LIMIT)).sum()),
            }
        return summary


class RepairedView:
    """A model view with a :class:`Repair`'s scales applied to each block as it is read."""

    def __init__(self, view: ModelView, repair: Repair):
        self.view, self.repair, self.spec = view, repair, view.spec

    def embeddings(self):
        return self.view.embeddings()

    def block(self, index: int) -> Block:
        return scaled_block(self.view.block(index), self.repair.blocks[index], self.spec)

    def head(self):
        return self.view.head()


def scaled_block(block: Block, scales: BlockScales, spec: ModelSpec) -> Block:
    """``block`` with its value dimensions, MLP units and post-norm channels scaled."""

    def rows(weight: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor | None:
        if weight is None:
            return None
        shape = (-1,) + (1,) * (weight.dim() - 1)
        return (weight.float() * scale.reshape(shape)).to(weight.dtype)

    attn = replace(
        block.attn,
        v=rows(block.attn.v, scales.values),
        v_bias=rows(block.attn.v_bias, scales.values),
    )
    mlp = block.mlp
    if spec.gated_mlp:
        mlp = replace(mlp, up=rows(mlp.up, scales.units), up_bias=rows(mlp.up_bias, scales.units))
    else:  # the down projection's columns: its input is the unit's activation
        mlp = replace(mlp, down=(mlp.down.float() * scales.units).to(mlp.down.dtype))
    changes = {"attn": attn, "mlp": mlp}
    for name, scale in (("attn_post_norm", scales.attn_post), ("mlp_post_norm", scales.mlp_post)):
        norm: Norm | None = getattr(block, name)
        if scale is not None and norm is not None:
            gain = norm.gain.float() * scale
            changes[name] = norm.with_gain(gain.to(norm.weight.dtype), norm.bias)
    return replace(block, **changes)


class _Moments:
    """Per-unit sums of squares over tokens, accumulated in float64."""

    def __init__(self):
        self.squares: torch.Tensor | None = None
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        flat = values.reshape(-1, values.shape[-1]).double()
        squares = (flat * flat).sum(0).cpu()
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += flat.shape[0]

    def rms(self) -> torch.Tensor:
        return (self.squares / self.count).sqrt()


def _value_units(acts: BlockActivations, spec: ModelSpec) -> torch.Tensor:
    """What each value dimension carries into the output projection, as ``(..., kv·dh)``
    tokens × (query heads of the group) rows: the group's query heads are samples of it."""
    z = acts.attn_out_input
    group = spec.num_heads // spec.num_kv_heads
    z = z.reshape(*z.shape[:-1], spec.num_kv_heads, group, spec.head_dim)
    return z.transpose(-3, -2).reshape(-1, spec.num_kv_heads * spec.head_dim)


def _post_norm_writes(
    block: Block, acts: BlockActivations, spec: ModelSpec
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the attention and the MLP write into the stream through their post-norms."""

    def written(norm: Norm | None, inputs: torch.Tensor, weight, bias) -> torch.Tensor | None:
        if norm is None:
            return None
        bias = None if bias is None else bias.to(inputs)
        return final_norm(norm, F.linear(inputs, weight.to(inputs), bias), spec)

    attn, mlp = block.attn, block.mlp
    return (
        written(block.attn_post_norm, acts.attn_out_input, attn.o, attn.o_bias),
        written(block.mlp_post_norm, acts.mlp_out_input, mlp.down, mlp.down_bias),
    )


def _statistics(
    runner: BlockRunner, block: Block, residuals: Sequence[torch.Tensor], layer: int
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Per-unit root mean squares of ``block`` run on ``residuals``, and its outputs."""
    spec = runner.spec
    moments = {name: _Moments() for name in ("values", "units", "attn_post", "mlp_post")}
    outputs = []
    for acts in runner.each(block, residuals, layer):
        moments["values"].add(_value_units(acts, spec))
        moments["units"].add(acts.mlp_out_input)
        attn_post, mlp_post = _post_norm_writes(block, acts, spec)
        for name, values in (("attn_post", attn_post), ("mlp_post", mlp_post)):
            if values is not None:
                moments[name].add(values)
        outputs.append(acts.output)
    return {k: m.rms() for k, m in moments.items() if m.squares is not None}, outputs


def _ratio(target: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``target / current``, 1 where the unit is silent in both, within the limits."""
    ratio = torch.where(current > 0, target / current.clamp_min(1e-30), torch.ones_like(target))
    return ratio.clamp(1 / LIMIT, LIMIT).float()


@torch.no_grad()
def repair_statistics(
    endpoints: Sequence[ModelView],
    weights: Sequence[float],
    merged: ModelView,
    runner: BlockRunner,
    sequences: torch.Tensor,
) -> Repair:
    """The scales that give ``merged`` (a merge of ``endpoints`` with ``weights``, summing to
    1) the endpoints' interpolated unit statistics on ``sequences`` ``(n, L)``, found block by
    block on the repaired model's own residual stream. ``runner`` runs blocks of their shape."""
    spec, device = merged.spec, runner.device
    ids = sequences.to(device=device, dtype=torch.long).split(BATCH)

    def stream(view: ModelView) -> list[torch.Tensor]:
        return [embed(view.embeddings(), batch, spec).to(device, torch.float32) for batch in ids]

    ends = [stream(view) for view in endpoints]
    mixed = stream(merged)
    blocks = []
    for layer in range(spec.num_layers):
        target: dict[str, torch.Tensor] = {}
        for index, (view, weight) in enumerate(zip(endpoints, weights, strict=True)):
            stats, ends[index] = _statistics(runner, view.block(layer), ends[index], layer)
            for name, rms in stats.items():
                target[name] = target.get(name, 0) + weight * rms
        block = merged.block(layer)
        scales = BlockScales(
            values=torch.ones(spec.num_kv_heads * spec.head_dim),
            units=torch.ones(spec.intermediate_size),
            attn_post=None if block.attn_post_norm is None else torch.ones(spec.hidden_size),
            mlp_post=None if block.mlp_post_norm is None else torch.ones(spec.hidden_size),
        )
        # In the order the block computes them: in a sequential block what the MLP reads
        # depends on the attention, and each post-norm on what it normalises.
        for name in ("values", "attn_post", "units", "mlp_post"):
            if getattr(scales, name) is not None:
                stats, _ = _statistics(runner, scaled_block(block, scales, spec), mixed, layer)
                setattr(scales, name, _ratio(target[name], stats[name]))
        _, mixed = _statistics(runner, scaled_block(block, scales, spec), mixed, layer)
        blocks.append(scales)
    return Repair(tuple(blocks))


def repair_checkpoint(
    folder: Path,
    endpoints: Sequence[Path],
    weights: Sequence[float],
    sequences: torch.Tensor,
    device: torch.device,
    max_shard_size: int,
    trust_remote_code: bool = False,
    progress: bool = False,
) -> Repair:
    """Repair the merged checkpoint in ``folder`` (a merge of ``endpoints`` with ``weights``)
    in place: the repaired weights are written beside it, read back (every tensor finite), and
    only then put in place of the merged ones; its config.json and other files stay as they
    are. Returns the scales."""
    views = [open_model(path, trust_remote_code) for path in endpoints]
    merged = open_model(folder, trust_remote_code)
    runner = BlockRunner(merged.folder, merged.adapter, merged.spec, device, trust_remote_code)
    repair = repair_statistics(views, weights, merged, runner, sequences)
    staging = folder / ".repaired"
    shutil.rmtree(staging, ignore_errors=True)
    merged.adapter.save(RepairedView(merged, repair), staging, folder, max_shard_size, progress)
    written = open_model(staging, trust_remote_code)
    for index in range(written.spec.num_layers):  # the reader refuses a non-finite tensor
        written.block(index)
    weight_files = ("*.safetensors", "*.safetensors.index.json")
    for pattern in weight_files:
        for old in folder.glob(pattern):
            old.unlink()
    for pattern in weight_files:
        for new in staging.glob(pattern):
            new.rename(folder / new.name)
    shutil.rmtree(staging)
    return repair
