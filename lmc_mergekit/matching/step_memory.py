"""The memory plan of a learned-matching step: the bytes a step holds in a process, estimated
from the model's shape (:func:`step_memory`), how many blocks keep their work for the backward
within them (:class:`StepMemory`), and why a step cannot run on a GPU, with the fix
(:func:`device_shortfall`)."""

from __future__ import annotations

from dataclasses import dataclass

from lmc_mergekit.models.block_runner import loss_tokens
from lmc_mergekit.models.view import ModelSpec


@dataclass(frozen=True)
class StepMemory:
    """What one step of learned matching holds in a process, in bytes (estimates: see
    :func:`step_memory`)."""

    #: Every endpoint as held, whole, and the largest of their parts (a block or the
    #: embeddings of every endpoint), which a process gathers whole while it runs under FSDP.
    endpoints: int
    part: int
    processes: int
    #: The residual stream kept at every block's input; the learned symmetries with their
    #: gradients, AdamW's moments and the maps a step makes of them.
    stream: int
    symmetries: int
    #: One block's work: what its mix keeps for the backward.
    block: int
    #: The loss's logits pieces (one at a time, with their copies and gradient).
    logits: int
    layers: int

    def held(self, processes: int | None = None) -> int:
        """The endpoints one of ``processes`` (this step's by default) holds: all of them,
        or under several its share and a part gathered whole."""
        count = processes or self.processes
        return self.endpoints if count == 1 else self.endpoints // count + self.part

    def need(self, kept: int, processes: int | None = None) -> int:
        """The step's bytes in one of ``processes`` when ``kept`` blocks keep their work for
        the backward (the others recompute it there, one at a time)."""
        working = self.stream + self.symmetries + self.logits + max(kept, 1) * self.block
        return self.held(processes) + working

    def kept_blocks(self, free: int | None = None) -> int:
        """How many blocks keep their work rather than recompute it: as many as fit in the
        endpoints' own bytes (a plain training step holds four copies of its model besides
        its activations: a step of two endpoints stays below that), and in ``free`` bytes."""
        kept = min(self.layers, self.endpoints // self.processes // max(self.block, 1))
        while free is not None and kept and self.need(kept) > free:
            kept -= 1
        return kept


def step_memory(
    spec: ModelSpec,
    endpoints: int,
    itemsize: int,
    tokens: int,
    seq_len: int,
    *,
    processes: int = 1,
    scores: bool = False,
    reads_tokens: bool = False,
    casts: bool = False,
) -> StepMemory:
    """The bytes of one learned-matching step on ``endpoints`` models of ``spec`` held in
    ``itemsize``-byte floats, on ``tokens`` tokens in sequences of ``seq_len`` per process,
    the endpoints sharded over ``processes``. ``scores``: the attention keeps its
    probabilities (eager); ``reads_tokens``: tied heads read through their tokens; ``casts``:
    16-bit endpoints run in float32, so that a block keeping its work keeps their float32
    copies too.

    One block's work is bounded per token by float32 vectors: 12 of the stream's width, 1 of
    the queries', keys' and values' together and 2 of the MLP's for the mixed block, 8, 1
    and 1 more for each moved endpoint (its projections' moved inputs and outputs; the first
    endpoint's run as held), and 2 per head and key where the attention keeps its
    probabilities. The tests measure what every family keeps below it."""
    d, layers = spec.hidden_size, spec.num_layers
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    mlp = spec.intermediate_size * (2 if spec.gated_mlp else 1)
    moved = endpoints - 1
    floats = (12 + 8 * moved) * d + (1 + moved) * qkv + (2 + moved) * mlp
    if scores:
        floats += 2 * spec.num_heads * seq_len
    block = spec.num_heads * spec.head_dim * d * 2 + 2 * spec.num_kv_heads * spec.head_dim * d
    block += (3 if spec.gated_mlp else 2) * d * spec.intermediate_size + qkv + 6 * d
    outside = (spec.vocab_size + spec.learned_positions) * d
    outside += d * d if reads_tokens else spec.vocab_size * d
    return StepMemory(
        endpoints=endpoints * (layers * block + outside) * itemsize,
        part=endpoints * max(block, outside) * itemsize,
        processes=processes,
        stream=2 * 4 * (layers + 1) * tokens * d,
        # Per endpoint: the residual rotation and its parameters, gradients and moments, and
        # the maps the step makes of them (a few of each).
        symmetries=endpoints * 8 * 4 * d * d,
        block=4 * tokens * floats + (endpoints * block * 4 if casts else 0),
        logits=3 * 4 * min(tokens, loss_tokens(spec.vocab_size)) * spec.vocab_size,
        layers=layers,
    )


def device_shortfall(memory: StepMemory, free: int) -> str | None:
    """Why a step of ``memory`` cannot run in ``free`` bytes of its GPU, with the fix (one
    line), or None where it can (every block recomputing its work)."""
    need = memory.need(0)
    if need <= free:
        return None
    # Sharded over more processes, each holds less of the endpoints (and gathers one part).
    count = next((n for n in range(memory.processes + 1, 1025) if memory.need(0, n) <= free), None)
    fix = "lower alignment batch_size: the step's working set alone does not fit"
    if count is not None:
        fix = (
            f"shard the endpoints over {count} GPUs (FSDP, one process each): torchrun "
            f"--nproc_per_node {count} lmc-mergekit-yaml ..."
        )
    return (
        f"learned matching needs about {_gib(need)} of GPU memory (the endpoints "
        f"{_gib(memory.held())}, the step's working set {_gib(need - memory.held())}) but "
        f"{_gib(free)} is free; {fix}"
    )


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"
