"""Converting a donor into a smaller model of its family, layer by layer.

1. Residual channels: ranked by the variance of the donor's residual stream over calibration
   text (each layer boundary normalised to the same total, so every depth counts), one
   selection for the whole stream.
2. Layers: the donor's layers kept at an even stride; a kept layer also stands in for the
   removed ones after it.
3. Each kept layer's heads, head dims and MLP units by weight norm (:mod:`.selection`).
4. Compensation: the projections that write to the residual stream (attention output, MLP
   down) are refitted by ridge least squares so that the smaller model's residual stream
   follows the donor's kept channels: features are what the smaller model's projections read
   on its own (already converted) residual stream; targets are what the donor added between
   this point and the next kept layer. Parallel-residual blocks fit both projections jointly;
   sequential ones the attention output first, then the MLP down. Where a projection writes
   through a post-norm (Gemma 2 and 3, OLMo 2), the target is what it must write before that
   norm: the update divided by the norm's gain, a direction only (the norm, now over the kept
   channels, sets the size as the pre-norms do), taken at the size of what the selected
   projection writes so that the ridge's pull towards it is a pull of like to like.
5. Rescaling ``sqrt(n/n')`` by the shrink of each projection's input, on the attention output
   and MLP down (``o_down``) or on every matrix (``all``), after compensation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import CheckpointView
from lmc_mergekit.models.block_runner import BlockRunner, embed
from lmc_mergekit.models.view import Block, Head, InMemoryView, ModelSpec, Norm
from lmc_mergekit.runtime.memory import trim_heap
from lmc_mergekit.subclone.compensation import (
    SELECTION,
    RidgeFit,
    RidgeSolution,
    held_out_ridge,
)
from lmc_mergekit.subclone.selection import (
    Ranker,
    select_block,
    select_norm,
    subclone_block,
)
from lmc_mergekit.subclone.target import RotaryPlan, kept_layers

# Residual-channel variance is estimated on at most this many calibration sequences.
VARIANCE_SEQUENCES = 64
#: With ``ridge: auto``, every this-many-th calibration batch is held out to choose the ridge.
HOLD_OUT_EVERY = 4
#: The strength used where too little calibration is left to hold any out.
DEFAULT_RIDGE = 0.01


@dataclass(frozen=True)
class ConversionConfig:
    """How to convert: ``rescale`` is ``none``, ``o_down`` or ``all``; ``selection`` is
    ``weight_norm`` or ``random``; ``ridge`` is λ relative to the mean feature energy, or
    ``auto``: chosen per fit on held-out calibration batches (:func:`.held_out_ridge`)."""

    compensate: bool = True
    rescale: str = "none"
    selection: str = "weight_norm"
    seed: int = 0
    ridge: float | str = "auto"
    batch_size: int = 16


@dataclass(frozen=True)
class Conversion:
    """The converted model and a JSON-ready record of what was kept and fitted."""

    view: InMemoryView
    record: dict


def check_convertible(donor: ModelSpec, config: ConversionConfig) -> None:
    """A one-line error for a conversion that ``donor``'s family cannot take."""
    if config.compensate and donor.post_norms and donor.parallel_residual:
        raise LmcError(
            f"compensation fits {donor.architecture}'s two projections jointly (parallel "
            "residual), but each writes through a post-norm of its own; set compensate: false"
        )


def compensation_features(target: ModelSpec) -> int:
    """The most features one compensation fit solves for (bias column included)."""
    attention = target.num_heads * target.head_dim
    if target.parallel_residual:
        return attention + target.intermediate_size + 1
    return max(attention, target.intermediate_size) + 1


def convert_model(
    donor_view: CheckpointView,
    target: ModelSpec,
    plan: RotaryPlan,
    sequences: torch.Tensor,
    config: ConversionConfig,
    device: torch.device,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> Conversion:
    """Convert ``donor_view`` to the shape ``target`` on calibration ``sequences``."""
    started = time.perf_counter()
    donor, adapter = donor_view.spec, donor_view.adapter
    check_convertible(donor, config)
    folder: Path = donor_view.folder
    donor_runner = BlockRunner(folder, adapter, donor, device, trust_remote_code)
    student_runner = BlockRunner(folder, adapter, target, device, trust_remote_code)
    ranker = Ranker(config.selection, config.seed)
    batches = sequences.split(config.batch_size)
    emb = donor_view.embeddings()

    channels = torch.arange(donor.hidden_size)
    if target.hidden_size < donor.hidden_size:
        scores = torch.zeros(donor.hidden_size)
        if not ranker.random:
            scores = _residual_variance(donor_view, donor_runner, emb, batches, progress)
        channels = torch.tensor(ranker.top(scores, target.hidden_size))

    layers = kept_layers(donor.num_layers, target.num_layers)
    donor_states = [embed(emb, ids, donor) for ids in batches]
    del emb  # read again at the end: not held through the layers
    student_states = [state[..., channels] for state in donor_states]
    blocks, records = [], []
    bar = tqdm(
        total=donor.num_layers, desc=f"converting {folder.name}", unit="layer", disable=not progress
    )
    for position, first in enumerate(layers):
        end = layers[position + 1] if position + 1 < len(layers) else donor.num_layers
        block = donor_view.block(first)
        after_attention = _run_donor(
            donor_view, donor_runner, block, range(first, end), donor_states, channels, bar
        )
        targets = _Kept(donor_states, channels)
        selection = select_block(block, donor, target, channels, plan, ranker)
        small = subclone_block(block, donor, target, channels, selection)
        fits = {}
        if config.compensate:
            small, fits = _compensate(
                small,
                student_runner,
                position,
                student_states,
                after_attention,
                targets,
                config,
                device,
            )
        _run_in_place(student_runner, small, student_states, position)
        blocks.append(small)
        # A layer's batches free and allocate the same sizes again: without this the heap keeps
        # each layer's freed pages and the conversion grows layer by layer.
        trim_heap()
        records.append(
            {
                "donor_layer": first,
                "stands_in_for": list(range(first + 1, end)),
                **selection.to_dict(),
                "fits": fits,
            }
        )
    bar.close()
    # ``targets`` now holds the kept channels of the donor's final residual stream.
    final_error = _relative_error(student_states, targets)

    emb, head = donor_view.embeddings(), donor_view.head()
    tokens, small_head = _embeddings_and_head(emb, head, channels, donor, target)
    blocks, small_head = _rescale(blocks, small_head, donor, target, config.rescale)
    positions = None
    if emb.positions is not None:
        positions = emb.positions[: target.learned_positions][:, channels]
    # A multimodal projector writes the stream as it is (no embedding multiplier): its kept
    # channels are the stream's.
    projector = None if emb.projector is None else emb.projector[:, channels]
    view = InMemoryView(
        spec=target,
        embeddings_=replace(emb, tokens=tokens, positions=positions, projector=projector),
        blocks=blocks,
        head_=small_head,
    )
    record = {
        "residual_channels": channels.tolist(),
        "channels_ranked_by": "random" if ranker.random else "activation variance",
        "kept_layers": layers,
        "rotary": plan.to_dict(),
        "layers": records,
        "residual_error_before_rescale": final_error,
        "rescale": config.rescale,
        "seconds": round(time.perf_counter() - started, 3),
    }
    return Conversion(view=view, record=record)


def _embeddings_and_head(emb, head, channels, donor: ModelSpec, target: ModelSpec):
    """The kept channels of the token embeddings and the head. Where the family multiplies its
    embeddings by a constant of the width (Gemma: sqrt(d)), the stored ones are rescaled so that
    the stream is what it was: ``E·m/m'``; a tied head then reads through a final norm whose
    gain is divided by the same factor, so the logits stay what they were too."""
    ratio = donor.embedding_multiplier / target.embedding_multiplier
    tokens = emb.tokens[:, channels]
    norm = select_norm(head.norm, channels)
    if ratio != 1.0:
        tokens.mul_(ratio)  # a copy already (indexed), scaled where it lies
        if donor.tied_embeddings:
            norm = norm.with_gain(norm.gain / ratio, norm.bias)
    # A tied head is the embeddings: the same tensor, not a second vocabulary-sized copy.
    weight = tokens if donor.tied_embeddings else head.weight[:, channels]
    return tokens, replace(head, norm=norm, weight=weight)


@torch.no_grad()
def _residual_variance(view, runner, emb, batches, progress) -> torch.Tensor:
    """Per-channel variance of the residual stream at every layer boundary, each boundary
    normalised to mean 1, summed."""
    states, total = [], 0
    for ids in batches:
        if total >= VARIANCE_SEQUENCES:
            break
        states.append(embed(emb, ids[: VARIANCE_SEQUENCES - total], view.spec))
        total += len(states[-1])
    score = _variance(states)
    layers = range(view.spec.num_layers)
    for index in tqdm(layers, desc="ranking residual channels", disable=not progress):
        block = view.block(index)
        states = [seen.output.cpu() for seen in runner.each(block, states, index)]
        score += _variance(states)
    return score


def _variance(states: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([s.reshape(-1, s.shape[-1]) for s in states]).double()
    variance = flat.var(dim=0)
    return variance / variance.mean().clamp_min(1e-30)


class _Kept(Sequence):
    """The kept ``channels`` of each of ``states``, sliced when read (not a second copy of the
    calibration stream)."""

    def __init__(self, states: list[torch.Tensor], channels: torch.Tensor):
        self.states, self.channels = states, channels

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, index):
        return self.states[index][..., self.channels]


@torch.no_grad()
def _run_in_place(runner, block, states: list[torch.Tensor], layer: int, kept=None, after=None):
    """Replace each of ``states`` by ``block``'s output on it, one batch at a time (the stream
    is held once, not twice); where ``after`` is a list, also append the ``kept`` channels of
    the stream after the block's attention."""
    for index, seen in enumerate(runner.each(block, states, layer)):
        states[index] = seen.output.cpu()
        if after is not None:
            after.append(seen.mlp_reads[..., kept.to(seen.mlp_reads.device)].cpu())


def _run_donor(view, runner, first_block, layers, states, channels, bar):
    """Run donor ``layers`` on ``states`` in place; return the kept channels of the stream
    after the first layer's attention (the target for a sequential block's attention output)."""
    after_attention = []
    for index in layers:
        block = first_block if index == layers[0] else view.block(index)
        first = index == layers[0] and not view.spec.parallel_residual
        _run_in_place(runner, block, states, index, channels, after_attention if first else None)
        bar.update(1)
    return after_attention


@torch.no_grad()
def _compensate(
    block: Block,
    runner: BlockRunner,
    layer: int,
    states: list[torch.Tensor],
    after_attention: list[torch.Tensor],
    targets: Sequence[torch.Tensor],
    config: ConversionConfig,
    device: torch.device,
) -> tuple[Block, dict]:
    """Refit the attention output and MLP down projections of ``block`` (see module doc)."""
    attn, mlp = block.attn, block.mlp
    dtype = attn.o.dtype
    if runner.spec.parallel_residual:
        # Both projections read the same stream: one joint fit; the attention bias stays.
        attn_bias = 0 if attn.o_bias is None else attn.o_bias.to(device, torch.float32)
        solution, record = _refit(
            runner,
            block,
            layer,
            states,
            targets,
            lambda seen, x: torch.cat([seen.attn_out_input, seen.mlp_out_input], -1),
            lambda seen, x: x + attn_bias,
            torch.cat([attn.o, mlp.down], 1),
            mlp.down_bias,
            config,
            device,
        )
        o, down = solution.weight.to(dtype).cpu().split([attn.o.shape[1], mlp.down.shape[1]], 1)
        block = replace(
            block,
            attn=replace(attn, o=o),
            mlp=replace(mlp, down=down, down_bias=_bias(solution.bias, dtype)),
        )
        return block, {"joint": record}
    solution, attn_record = _refit(
        runner,
        block,
        layer,
        states,
        after_attention,
        lambda seen, x: seen.attn_out_input,
        lambda seen, x: x,
        attn.o,
        attn.o_bias,
        config,
        device,
        block.attn_post_norm,
    )
    o, o_bias = solution.weight.to(dtype).cpu(), _bias(solution.bias, dtype)
    block = replace(block, attn=replace(attn, o=o, o_bias=o_bias))
    solution, down_record = _refit(
        runner,
        block,
        layer,
        states,
        targets,
        lambda seen, x: seen.mlp_out_input,
        lambda seen, x: seen.mlp_reads,
        mlp.down,
        mlp.down_bias,
        config,
        device,
        block.mlp_post_norm,
    )
    down, down_bias = solution.weight.to(dtype).cpu(), _bias(solution.bias, dtype)
    block = replace(block, mlp=replace(mlp, down=down, down_bias=down_bias))
    return block, {"attn_out": attn_record, "mlp_down": down_record}


def _refit(
    runner: BlockRunner,
    block: Block,
    layer: int,
    states: list[torch.Tensor],
    targets: Sequence[torch.Tensor],
    features: Callable,
    baseline: Callable,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: ConversionConfig,
    device: torch.device,
    post_norm: Norm | None = None,
) -> tuple[RidgeSolution, dict]:
    """Run ``block`` on every batch and refit ``weight`` (and ``bias``) so that
    ``features(seen, x)`` maps to ``target − baseline(seen, x)``, or where the projection
    writes through ``post_norm``, to what makes that norm add it (see the module doc)."""
    # float64 Gram matrices: on a CUDA device, else on the CPU (MPS has no float64).
    gram_device = device if device.type == "cuda" else torch.device("cpu")
    fit = RidgeFit(weight.shape[1], weight.shape[0], bias is not None, gram_device)
    held = RidgeFit(weight.shape[1], weight.shape[0], bias is not None, gram_device)
    choose = config.ridge == "auto" and len(states) >= 2
    seen_all = runner.each(block, states, layer)
    for index, (state, target, seen) in enumerate(zip(states, targets, seen_all, strict=True)):
        x = state.to(device, torch.float32)
        inputs, update = features(seen, x), target.to(device, torch.float32) - baseline(seen, x)
        if post_norm is not None:
            update = _before_norm(update, inputs, weight, bias, post_norm)
        (held if choose and _held_out(index, len(states)) else fit).add(inputs, update)
    start, start_bias = weight.double(), None if bias is None else bias.double()
    record: dict = {}
    strength: float | str = DEFAULT_RIDGE if config.ridge == "auto" else config.ridge
    if held.rows and fit.rows >= fit.gram.shape[0]:
        strength, record["held_out_error"] = held_out_ridge(fit, held, start, start_bias)
    fit.absorb(held)
    if strength == SELECTION:  # no refit did better on text it was not fitted to
        error = fit.relative_error(fit.stacked(start, start_bias))
        solution = RidgeSolution(start, start_bias, error, error)
    else:
        solution = fit.solve(strength, start, start_bias)
    return solution, {"ridge": strength, **_fit_record(solution, fit), **record}


def _held_out(index: int, batches: int) -> bool:
    """Whether calibration batch ``index`` of ``batches`` is held out to choose the ridge: every
    :data:`HOLD_OUT_EVERY`-th, or the last where there are fewer."""
    if batches < HOLD_OUT_EVERY:
        return index == batches - 1
    return index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1


def _before_norm(
    update: torch.Tensor,
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: Norm,
) -> torch.Tensor:
    """What a projection (``weight``, ``bias`` on ``inputs``) writing through ``norm`` should
    write for the norm to add ``update``: ``(update − β)/γ``, a direction per token, at the
    size of what the selected projection writes, the two sizes compared after the gain (where
    the norm's output is: a channel of small gain weighs little). A channel of no gain takes
    the selected projection's output: nothing it writes is seen."""
    gain = norm.gain.to(update)
    live = gain.abs() > 1e-3 * gain.abs().mean().clamp_min(1e-30)
    wanted = update if norm.bias is None else update - norm.bias.to(update)
    selected = inputs @ weight.to(inputs).T
    if bias is not None:
        selected = selected + bias.to(inputs)
    size = _rms((gain * selected)[..., live]) / _rms(wanted[..., live]).clamp_min(1e-30)
    return torch.where(live, wanted / torch.where(live, gain, 1.0) * size, selected)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True).sqrt()


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.to(dtype).cpu()


def _fit_record(solution: RidgeSolution, fit: RidgeFit) -> dict:
    return {
        "tokens": fit.rows,
        "features": fit.gram.shape[0],
        "relative_error_selected": round(solution.error_before, 6),
        "relative_error_refit": round(solution.error_after, 6),
    }


def _relative_error(student: list[torch.Tensor], donor: list[torch.Tensor]) -> float:
    """``‖student − donor‖² / ‖donor‖²`` over all calibration tokens."""
    num = sum(float(((s - d).double() ** 2).sum()) for s, d in zip(student, donor, strict=True))
    den = sum(float((d.double() ** 2).sum()) for d in donor)
    return round(num / max(den, 1e-30), 6)


def _rescale(blocks: list[Block], head: Head, donor: ModelSpec, target: ModelSpec, mode: str):
    """Multiply projections by ``sqrt(n/n')`` for the shrink ``n → n'`` of their input."""
    if mode == "none":
        return blocks, head
    attention = math.sqrt(donor.num_heads * donor.head_dim / (target.num_heads * target.head_dim))
    units = math.sqrt(donor.intermediate_size / target.intermediate_size)
    width = math.sqrt(donor.hidden_size / target.hidden_size) if mode == "all" else 1.0

    def scaled(t, factor):
        return None if t is None else t * factor

    out = []
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        out.append(
            replace(
                block,
                attn=replace(
                    attn,
                    q=attn.q * width,
                    k=attn.k * width,
                    v=attn.v * width,
                    o=attn.o * attention,
                ),
                mlp=replace(
                    mlp, up=mlp.up * width, gate=scaled(mlp.gate, width), down=mlp.down * units
                ),
            )
        )
    if donor.tied_embeddings:
        # Scaling the final norm instead of the head gives the same logits and keeps the tie.
        norm = head.norm.with_gain(head.norm.gain * width, scaled(head.norm.bias, width))
        return out, replace(head, norm=norm)
    return out, replace(head, weight=head.weight * width)
