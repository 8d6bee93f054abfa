"""Test losses computed block by block: a checkpoint's, or that of a mix of two checkpoints.

A whole float32 model, its activations and a batch's logits at today's vocabularies take
several times one model's size. Run block by block (:class:`~lmc_mergekit.models.block_runner.
BlockRunner`: each block through a one-layer stock ``transformers`` module, the computation
``transformers`` runs, checked by the self-check's tests), a loss holds one block of each
model, the residual stream of a group of sequences, and the logits of a few hundred tokens at
a time. A mix ``(1-λ)·A + λ·B`` is made part by part as it is read (:class:`MixedView`), so
the path between two checkpoints needs no mixed model either. Where the two tie their LM head
differently, the mix reads the tied one's embedding as its head.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmc_mergekit.evaluation.loss import LossResult, mean_token_loss, resolve_device
from lmc_mergekit.evaluation.selfcheck import load_fp32, runs_blockwise
from lmc_mergekit.models import block_runner
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import (
    BlockRunner,
    embedded,
    final_norm,
    head_logits,
    soft_capped,
)
from lmc_mergekit.models.view import (
    Head,
    ModelSpec,
    ModelView,
    iter_tensors,
    map_named_tensors,
    row_chunks,
)

#: Bytes of float32 residual stream held at once (sequences beyond it run in another group,
#: whose blocks are read again).
GROUP_BYTES = 256 * 2**20
#: Sequences a block runs on at a time.
BATCH = 16
#: Tokens run through the head at a time (their float32 logits over any real vocabulary pass
#: ``LOGITS_BYTES``: the vocabulary is then read in slices, see :func:`token_losses`). Each
#: such pass reads (moves, mixes) the whole head once, so a group of sequences makes few.
HEAD_TOKENS = 16384
#: Rows of two tensors mixed at a time: the float32 copies of a vocabulary-sized matrix are
#: made a slice at a time, next to the one float32 result.
MIX_ROWS = 8192


def checkpoint_loss(
    folder: str | Path,
    sequences: torch.Tensor,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    progress: bool = False,
    batch_size: int = BATCH,
) -> LossResult:
    """The test loss of the checkpoint in ``folder``: block by block where the family allows
    it, else through the whole float32 ``transformers`` model."""
    device = resolve_device(device) if isinstance(device, str) else device
    view = open_model(folder, trust_remote_code)
    if not runs_blockwise(view):
        model = load_fp32(view.folder, trust_remote_code).to(device)
        return mean_token_loss(model, sequences, batch_size, progress=progress)
    runner = BlockRunner(view.folder, view.adapter, view.spec, device, trust_remote_code)
    return blockwise_loss(view, runner, sequences, batch_size, progress)


class MixedView:
    """``(1-λ)·a + λ·b`` part by part, in float32 (``a``'s spec; untied where the two tie
    their heads differently)."""

    def __init__(self, a: ModelView, b: ModelView, lam: float):
        self.a, self.b, self.lam = a, b, lam
        untie = a.spec.tied_embeddings != b.spec.tied_embeddings
        self.spec = replace(a.spec, tied_embeddings=False) if untie else a.spec

    def _mix(self, part_a, part_b):
        others = dict(iter_tensors(part_b))
        return map_named_tensors(part_a, lambda name, t: mixed(t, others[name], self.lam))

    def embeddings(self):
        return self._mix(self.a.embeddings(), self.b.embeddings())

    def block(self, index: int):
        return self._mix(self.a.block(index), self.b.block(index))

    def head(self):
        return self._mix(self.a.head(), self.b.head())

    def row_chunks(self, read: str, rows: int):
        """See :func:`~lmc_mergekit.models.view.row_chunks`: a slice of each, mixed."""
        pairs = zip(row_chunks(self.a, read, rows), row_chunks(self.b, read, rows), strict=True)
        for part_a, part_b in pairs:
            yield self._mix(part_a, part_b)


def mixed(a: torch.Tensor, b: torch.Tensor, lam: float) -> torch.Tensor:
    """``(1-λ)·a + λ·b`` in float32, :data:`MIX_ROWS` rows at a time (no float32 copy of a
    whole half-precision input)."""
    if a.ndim == 0 or a.shape[0] <= MIX_ROWS:
        return torch.lerp(a.float(), b.float(), lam)
    out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[0], MIX_ROWS):
        rows = slice(start, start + MIX_ROWS)
        torch.lerp(a[rows].float(), b[rows].float(), lam, out=out[rows])
    return out


@torch.no_grad()
def blockwise_loss(
    view: ModelView,
    runner: BlockRunner,
    sequences: torch.Tensor,
    batch_size: int = BATCH,
    progress: bool = False,
) -> LossResult:
    """The token-weighted mean next-token cross-entropy of ``view``'s model on ``sequences``
    ``(n, L)``, run block by block through ``runner``, ``batch_size`` sequences through a
    block at a time (float32 logits, summed, divided once by the token count: what
    :func:`~lmc_mergekit.evaluation.loss.mean_token_loss` computes)."""
    sums = _summed_losses(view, runner, sequences, batch_size, progress, per_sequence=False)
    tokens = sequences.shape[0] * (sequences.shape[1] - 1)
    return LossResult(loss=sum(sums, 0.0) / tokens, tokens=tokens)


@torch.no_grad()
def sequence_losses(
    view: ModelView, runner: BlockRunner, sequences: torch.Tensor, batch_size: int = BATCH
) -> torch.Tensor:
    """Per sequence of ``sequences`` ``(n, L)``, the mean next-token cross-entropy of
    ``view``'s model (float64 ``(n,)``): what a paired comparison of two models on the same
    text needs (the spread of their per-sequence differences)."""
    sums = _summed_losses(view, runner, sequences, batch_size, False, per_sequence=True)
    return torch.tensor(sums, dtype=torch.float64) / (sequences.shape[1] - 1)


def _summed_losses(view, runner, sequences, batch_size, progress, per_sequence) -> list[float]:
    """Summed next-token losses of ``view``'s model: one per group of sequences run at once,
    or one per sequence (``per_sequence``)."""
    sums = []
    for ids, residual in final_streams(view, runner, sequences, batch_size, progress):
        losses = token_losses(view, residual, ids)
        sums += losses.sum(dim=1).tolist() if per_sequence else [float(losses.sum())]
    return sums


def final_streams(
    view: ModelView,
    runner: BlockRunner,
    sequences: torch.Tensor,
    batch_size: int = BATCH,
    progress: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Groups of ``sequences`` (as many as :data:`GROUP_BYTES` of residual stream holds) and
    the last residual stream of each, run block by block through ``runner``."""
    spec, device = view.spec, runner.device
    per_sequence = sequences.shape[1] * spec.hidden_size * 4
    group = max(1, GROUP_BYTES // per_sequence)
    bar = tqdm(total=len(sequences), unit="seq", desc="loss", disable=not progress)
    for ids in sequences.split(group):
        ids = ids.to(device=device, dtype=torch.long)
        residual = embedded(view, ids).to(device, torch.float32)
        for index in range(spec.num_layers):
            pieces = runner.each(view.block(index), residual.split(batch_size), index)
            residual = torch.cat([piece.output for piece in pieces])
        yield ids, residual
        bar.update(len(ids))
    bar.close()


def token_losses(view: ModelView, residual: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy of every position of ``ids`` ``(n, L)`` (float32 ``(n,
    L-1)``) from the last residual stream ``residual`` through ``view``'s final norm and head:
    :data:`HEAD_TOKENS` tokens at a time, the head read whole where their float32 logits fit
    ``LOGITS_BYTES``, else a slice of vocabulary rows at a time (read, moved or mixed alone:
    :func:`~lmc_mergekit.models.view.row_chunks`) with a running log-sum-exp, a fused linear
    cross-entropy: no tokens × vocabulary tensor and no whole float32 head."""
    states = residual[:, :-1].reshape(-1, residual.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    losses = []
    for start in range(0, len(targets), HEAD_TOKENS):
        stop = start + HEAD_TOKENS
        part, wanted = states[start:stop], targets[start:stop]
        rows = max(1, block_runner.LOGITS_BYTES // (4 * len(wanted)))
        if rows >= view.spec.vocab_size:
            losses.append(_whole_cross_entropy(view, part, wanted))
        else:
            chunks = row_chunks(view, "head", rows)
            losses.append(_streamed_cross_entropy(chunks, view.spec, part, wanted))
    return torch.cat(losses).reshape(ids.shape[0], -1)


def _whole_cross_entropy(view: ModelView, states: torch.Tensor, targets: torch.Tensor):
    head, spec = view.head(), view.spec
    normed = final_norm(head.norm, states, spec)
    logits = soft_capped(head_logits(normed, head.weight, head.bias), spec)
    return F.cross_entropy(logits.float(), targets, reduction="none")


def _streamed_cross_entropy(
    chunks: Iterator[Head], spec: ModelSpec, states: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Per token, the cross-entropy of the logits of the head given as ``chunks`` of its
    vocabulary rows (soft-capped) against ``targets``, with a running log-sum-exp."""
    top = states.new_full((len(targets),), -math.inf, dtype=torch.float32)
    total, picked = torch.zeros_like(top), torch.zeros_like(top)
    normed, start = None, 0
    for head in chunks:
        if normed is None:  # every chunk carries the whole final norm
            normed = final_norm(head.norm, states, spec)
        logits = soft_capped(head_logits(normed, head.weight, head.bias), spec).float()
        stop = start + logits.shape[1]
        inside = (targets >= start) & (targets < stop)
        picked[inside] = logits[inside, targets[inside] - start]
        new_top = torch.maximum(top, logits.amax(dim=1))
        # In place: the chunk's one tokens × rows tensor is the pass's peak, not three of them.
        total = total * torch.exp(top - new_top) + logits.sub_(new_top[:, None]).exp_().sum(1)
        top = new_top
        start = stop
    return total.log() + top - picked
