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

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmc_mergekit.evaluation.loss import LossResult, mean_token_loss, resolve_device
from lmc_mergekit.evaluation.selfcheck import load_fp32, runs_blockwise
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import (
    BlockRunner,
    embed,
    final_norm,
    head_logits,
    soft_capped,
)
from lmc_mergekit.models.view import Head, ModelSpec, ModelView, iter_tensors, map_named_tensors

#: Bytes of float32 residual stream held at once (sequences beyond it run in another group,
#: whose blocks are read again).
GROUP_BYTES = 256 * 2**20
#: Sequences a block runs on at a time.
BATCH = 16
#: Tokens whose logits are made at a time (at a 256k vocabulary, 256 MiB of float32).
LOSS_TOKENS = 256


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
        return map_named_tensors(
            part_a, lambda name, t: torch.lerp(t.float(), others[name].float(), self.lam)
        )

    def embeddings(self):
        return self._mix(self.a.embeddings(), self.b.embeddings())

    def block(self, index: int):
        return self._mix(self.a.block(index), self.b.block(index))

    def head(self):
        return self._mix(self.a.head(), self.b.head())


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
    sums, head = [], None
    for ids, residual in final_streams(view, runner, sequences, batch_size, progress):
        head = view.head() if head is None else head  # read (or mixed) once
        rows = [slice(r, r + 1) for r in range(len(ids))] if per_sequence else [slice(None)]
        sums += [summed_loss(head, view.spec, residual[r], ids[r]) for r in rows]
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
        residual = embed(view.embeddings(), ids, spec).to(device, torch.float32)
        for index in range(spec.num_layers):
            pieces = runner.each(view.block(index), residual.split(batch_size), index)
            residual = torch.cat([piece.output for piece in pieces])
        yield ids, residual
        bar.update(len(ids))
    bar.close()


def summed_loss(head: Head, spec: ModelSpec, residual: torch.Tensor, ids: torch.Tensor) -> float:
    """The summed next-token cross-entropy of the last residual stream ``residual`` through
    the final norm and ``head`` of a model of ``spec``, :data:`LOSS_TOKENS` tokens at a time."""
    states = residual[:, :-1].reshape(-1, residual.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    total = 0.0
    for start in range(0, len(targets), LOSS_TOKENS):
        stop = start + LOSS_TOKENS
        normed = final_norm(head.norm, states[start:stop], spec)
        logits = soft_capped(head_logits(normed, head.weight, head.bias), spec)
        total += float(F.cross_entropy(logits.float(), targets[start:stop], reduction="sum"))
    return total
