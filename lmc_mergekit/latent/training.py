"""Training the weight autoencoder on the weights of some models.

The paper's two-stage curriculum: first a plain (deterministic) autoencoder, the KL term off,
so that the latents learn to carry the weights; then the variational objective with a small KL
weight, so that the latent space becomes smooth enough to interpolate and sample in. The
reconstruction loss is a Huber loss on normalised weights: quadratic near zero, linear for the
rare large weights, which an over-regularised Gaussian fit would flatten.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import AutoencoderConfig, WeightAutoencoder, Windows
from lmc_mergekit.latent.chunks import NamedTensor, to_chunks
from lmc_mergekit.runtime.resumable import load_state, save_state
from lmc_mergekit.runtime.schedule import warmup_cosine


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
) -> tuple[WeightAutoencoder, dict]:
    """Train an autoencoder of ``config`` on every window of every tensor in ``tensors``;
    return it (in eval mode) and a record of the run (losses per stage, wall time,
    throughput). With ``checkpoint``, the state is saved there every ``checkpoint_every``
    steps and an interrupted run resumes from it (the file is removed at the end)."""
    if not tensors:
        raise LmcError("no tensors to train the weight autoencoder on")
    torch.manual_seed(training.seed)
    model = WeightAutoencoder(config).to(device).train()
    bank, kinds, layers = _window_bank(model, tensors, device)
    generator = torch.Generator().manual_seed(training.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    warmup = max(1, training.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, training.steps, warmup)
    )
    first_stage = round(training.autoencoder_fraction * training.steps)
    history, started, start = [], time.perf_counter(), 0
    identity = {"config": config.to_json(), "training": asdict(training)}
    state = load_state(checkpoint, identity)  # None also for a checkpoint of another run
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["rng"])
        history, start = state["history"], state["step"]
    bar = tqdm(
        range(start, training.steps),
        desc="training the weight autoencoder",
        disable=not progress,
        initial=start,
        total=training.steps,
    )
    for step in bar:
        variational = step >= first_stage
        picks = torch.randint(len(kinds), (training.batch_size,), generator=generator)
        picks = picks.to(kinds.device)
        reconstruction, kl = _batch_loss(
            model, bank[picks], kinds[picks], layers[picks], variational, training
        )
        loss = reconstruction + (training.beta * kl if variational else 0.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        history.append((reconstruction.item(), kl.item()))
        if step % 10 == 0 or step == training.steps - 1:
            bar.set_postfix(huber=f"{history[-1][0]:.4f}", kl=f"{history[-1][1]:.2f}")
        if checkpoint is not None and (step + 1) % checkpoint_every == 0:
            snapshot = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "generator": generator.get_state(),
                "rng": torch.get_rng_state(),
                "history": history,
                "step": step + 1,
            }
            save_state(checkpoint, identity, snapshot)
    seconds = time.perf_counter() - started
    chunks_per_window = float(bank.valid.sum()) / len(kinds)
    model.eval()
    record = {
        "steps": training.steps,
        "autoencoder_steps": first_stage,
        "windows": len(kinds),
        "chunks": int(bank.valid.sum()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_huber": _mean_tail([h for h, _ in history]),
        "final_kl": _mean_tail([k for _, k in history]),
        "huber_at_stage_change": _mean_tail([h for h, _ in history[:first_stage]]),
        "seconds": round(seconds, 3),
        "chunks_per_second": round(
            (training.steps - start) * training.batch_size * chunks_per_window / seconds, 1
        ),
        "resumed_at": start,
    }
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return model, record


def _window_bank(model, tensors, device) -> tuple[Windows, torch.Tensor, torch.Tensor]:
    """Every window of every tensor, stacked, with the kind and layer of each."""
    parts, kinds, layers = [], [], []
    for named in tensors:
        chunks, _ = to_chunks(named.tensor, model.config.chunk_size)
        windows = Windows.of(chunks.to(device), model.config.window)
        kind, layer = model.tags(named.kind, named.layer, windows.chunks.shape[0])
        parts.append(windows)
        kinds.append(kind)
        layers.append(layer)
    return Windows.cat(parts), torch.cat(kinds), torch.cat(layers)


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
