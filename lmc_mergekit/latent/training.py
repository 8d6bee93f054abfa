"""Training the weight autoencoder on the weights of some models.

The paper's two-stage curriculum: first a plain (deterministic) autoencoder, the KL term off,
so that the latents learn to carry the weights; then the variational objective with a small KL
weight, so that the latent space becomes smooth enough to interpolate and sample in. The
reconstruction loss is a Huber loss on normalised weights: quadratic near zero, linear for the
rare large weights, which an over-regularised Gaussian fit would flatten.

A non-finite loss rolls the training back to its last snapshot with half the learning rate,
as every training loop of the tool does (:mod:`lmc_mergekit.runtime.rollback`); only
non-finite losses count, since the loss jumps by design when the KL term switches on.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import AutoencoderConfig, WeightAutoencoder, Windows
from lmc_mergekit.latent.chunks import NamedTensor, moments
from lmc_mergekit.runtime.rollback import TrainingState, rollbacks_for_json
from lmc_mergekit.runtime.schedule import warmup_cosine

#: Rollbacks after a non-finite loss before the training stops with an error.
MAX_ROLLBACKS = 3
#: Bumped when the checkpoint's contents change: an older checkpoint is not resumed.
STATE_FORMAT = 2


@dataclass(frozen=True)
class TrainingConfig:
    """``autoencoder_fraction`` of the steps run with the KL term off, the rest with weight
    ``beta``; AdamW with linear warm-up (5 %) and cosine decay."""

    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    autoencoder_fraction: float = 0.5
    beta: float = 1e-3
    huber_delta: float = 1.0
    seed: int = 0


def autoencoder_config_for(tensors: list[NamedTensor], **sizes) -> AutoencoderConfig:
    """An autoencoder config that covers the kinds and layers of ``tensors``."""
    kinds = tuple(sorted({t.kind for t in tensors}))
    layers = max([t.layer for t in tensors] + [0]) + 1
    return AutoencoderConfig(kinds=kinds, layers=layers, **sizes)


def train_autoencoder(
    tensors: list[NamedTensor],
    config: AutoencoderConfig,
    training: TrainingConfig,
    device: torch.device | str = "cpu",
    progress: bool = True,
    checkpoint: Path | None = None,
    checkpoint_every: int = 200,
    on_checkpoint: Callable[[int], None] | None = None,
) -> tuple[WeightAutoencoder, dict]:
    """Train an autoencoder of ``config`` on every window of every tensor in ``tensors``;
    return it (in eval mode) and a record of the run (losses per stage, wall time,
    throughput, rollbacks). Every ``checkpoint_every`` steps the state is kept as a rollback
    target and, with ``checkpoint``, saved there, then ``on_checkpoint(step)`` is called; an
    interrupted run resumes from the file (which is removed at the end)."""
    if not tensors:
        raise LmcError("no tensors to train the weight autoencoder on")
    torch.manual_seed(training.seed)
    model = WeightAutoencoder(config).to(device).train()
    stream = WindowStream(model, tensors, device)
    generator = torch.Generator().manual_seed(training.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    warmup = max(1, training.steps // 20)
    first_stage = round(training.autoencoder_fraction * training.steps)
    started = time.perf_counter()
    identity = {"config": config.to_json(), "training": asdict(training), "state": STATE_FORMAT}
    state = _AutoencoderState(model, optimizer, generator, training.lr)
    start = state.load(checkpoint, identity) or 0  # None also for a checkpoint of another run
    state.keep()
    bar = tqdm(
        total=training.steps,
        initial=start,
        desc="training the weight autoencoder",
        disable=not progress,
    )
    while state.step < training.steps:
        step = state.step
        variational = step >= first_stage
        for group in optimizer.param_groups:
            group["lr"] = training.lr * warmup_cosine(step, training.steps, warmup) * state.lr_scale
        picks = torch.randint(len(stream), (training.batch_size,), generator=generator)
        reconstruction, kl = _batch_loss(model, *stream.draw(picks), variational, training)
        loss = reconstruction + (training.beta * kl if variational else 0.0)
        value = loss.item()
        if state.diverged(value):
            state.roll_back(step, value)
            bar.n = state.step
            bar.refresh()
            continue
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        state.history.append((reconstruction.item(), kl.item()))
        state.accept(value)
        bar.update()
        if step % 10 == 0 or state.step == training.steps:
            bar.set_postfix(huber=f"{state.history[-1][0]:.4f}", kl=f"{state.history[-1][1]:.2f}")
        if state.step % checkpoint_every == 0:
            snapshot = state.keep()
            if checkpoint is not None:
                state.save(checkpoint, identity, snapshot)
            if on_checkpoint is not None:
                on_checkpoint(state.step)
    bar.close()
    seconds = time.perf_counter() - started
    history = state.history
    chunks_per_window = stream.chunks / len(stream)
    model.eval()
    record = {
        "steps": training.steps,
        "autoencoder_steps": first_stage,
        "windows": len(stream),
        "chunks": stream.chunks,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_huber": _mean_tail([h for h, _ in history]),
        "final_kl": _mean_tail([k for _, k in history]),
        "huber_at_stage_change": _mean_tail([h for h, _ in history[:first_stage]]),
        "seconds": round(seconds, 3),
        "chunks_per_second": round(
            (training.steps - start) * training.batch_size * chunks_per_window / seconds, 1
        ),
        "resumed_at": start,
        "rollbacks": rollbacks_for_json(state.rollbacks),
    }
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return model, record


class _AutoencoderState(TrainingState):
    """The autoencoder training's state: the model, the optimiser, both random generators (the
    batches' and the variational noise's) and the per-step (Huber, KL) history."""

    def __init__(self, model, optimizer, generator: torch.Generator, lr: float):
        super().__init__(
            "autoencoder training",
            lr,
            MAX_ROLLBACKS,
            "set a smaller latent lr",
            explode_factor=None,
        )
        self.model, self.optimizer, self.generator = model, optimizer, generator
        self.history: list[tuple[float, float]] = []

    def capture(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "rng": torch.get_rng_state(),
            "history": list(self.history),
        }

    def apply(self, parts: dict) -> None:
        self.model.load_state_dict(parts["model"])
        self.optimizer.load_state_dict(copy.deepcopy(parts["optimizer"]))
        self.generator.set_state(parts["generator"])
        torch.set_rng_state(parts["rng"])
        self.history = list(parts["history"])


class WindowStream:
    """Every window of every tensor of ``tensors``, drawn by index without being stacked:
    a batch's windows are cut, normalised and padded from their tensors when drawn, exactly
    as :func:`~lmc_mergekit.latent.chunks.to_chunks` and :meth:`Windows.of` would (so the
    training is the same as from a bank of every window), but the only copy of the weights
    held is the models' own."""

    def __init__(self, model: WeightAutoencoder, tensors: list[NamedTensor], device):
        self.size, self.window = model.config.chunk_size, model.config.window
        self.device = device
        self.flat, self.norms, counts, kinds, layers = [], [], [], [], []
        for named in tensors:
            flat = named.tensor.detach().reshape(-1)
            self.flat.append(flat)
            self.norms.append(moments(flat))
            counts.append(max(1, math.ceil(flat.numel() / self.size)))
            # Indices, not tensors, until the end: small tensors made between the statistics'
            # large transient ones fragment the heap (a model's worth of it kept resident).
            kinds.append(model.kind_index(named.kind))
            layers.append(named.layer)
        self.counts = torch.tensor(counts)
        windows = (self.counts + self.window - 1) // self.window
        #: The first window of each tensor in the global numbering, and the total.
        self.starts = torch.cumsum(windows, 0) - windows
        self.total = int(windows.sum())
        self.chunks = int(self.counts.sum())
        self.kinds, self.layers = model.tags_of(kinds, layers)

    def __len__(self) -> int:
        return self.total

    def draw(self, picks: torch.Tensor) -> tuple[Windows, torch.Tensor, torch.Tensor]:
        """The windows numbered ``picks``, with the kind and layer index of each."""
        owners = torch.searchsorted(self.starts, picks, right=True) - 1
        span = self.window * self.size
        chunks = torch.zeros(len(picks), span)
        positions = torch.empty(len(picks), self.window, dtype=torch.long)
        for row, (pick, owner) in enumerate(zip(picks.tolist(), owners.tolist(), strict=True)):
            first = (pick - int(self.starts[owner])) * self.window
            piece = self.flat[owner][first * self.size : first * self.size + span]
            mean, std = self.norms[owner]
            chunks[row, : len(piece)] = ((piece.double() - mean) / std).float()
            positions[row] = torch.arange(first, first + self.window)
        valid = positions < self.counts[owners][:, None]
        windows = Windows(chunks.reshape(len(picks), self.window, self.size), positions, valid)
        index = owners.to(self.kinds.device)
        return windows.to(self.device), self.kinds[index], self.layers[index]


def _batch_loss(model, windows: Windows, kinds, layers, variational: bool, training):
    """Huber reconstruction per real chunk and the mean KL per latent number."""
    mean, log_var = model.encode(kinds, layers, windows)
    latents = mean
    if variational:
        latents = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
    decoded = model.decode(kinds, layers, latents, windows)
    valid = windows.valid
    reconstruction = F.huber_loss(decoded[valid], windows.chunks[valid], delta=training.huber_delta)
    mean, log_var = mean[valid], log_var[valid]
    kl = 0.5 * (mean**2 + log_var.exp() - 1 - log_var).mean()
    return reconstruction, kl


def _mean_tail(values: list[float], count: int = 20) -> float | None:
    tail = values[-count:]
    return sum(tail) / len(tail) if tail else None
