"""Training a zoo model from scratch, reproducibly per seed.

The seed fixes both the initialisation and the order of the training batches, so two seeds give
two independently trained models (the setting of linear mode connectivity) and one seed always
gives the same weights, bit for bit, on the same machine and software.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lmc_mergekit.data.sequences import DataConfig, load_split
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES, mean_token_loss
from lmc_mergekit.runtime.schedule import warmup_cosine

# Tuned on the bundled corpus for a 4-layer d=128 GPT-NeoX, batch 16x128, 1500 steps.
DEFAULT_LR = 6e-3
DEFAULT_WARMUP = 100
WEIGHT_DECAY = 0.1
MIN_LR_FRACTION = 0.1  # the cosine decays to this fraction of the peak rate
SMOOTHING = 0.98  # of the reported training loss (an exponential moving average)


def train_model(
    config: PretrainedConfig,
    tokenizer,
    data: DataConfig,
    *,
    seed: int,
    steps: int,
    batch_size: int = 16,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, dict]:
    """Train a model of ``config`` from scratch on the train split of ``data`` for ``steps``
    AdamW steps of ``batch_size`` sequences; return it (in eval mode) and a record of the run:
    settings, smoothed final training loss, validation and test loss (on up to
    :data:`DEFAULT_EVAL_SEQUENCES` sequences each), wall time, tokens per second and parameter
    count.

    The learning rate warms up linearly over ``warmup`` steps (at most a fifth of training) and
    then decays along a cosine to a tenth of ``lr``. The model is initialised on the CPU and
    trained on ``device`` (bitwise reproducibility holds for one device and thread count).
    """
    if steps < 1 or batch_size < 1:
        raise LmcError(f"steps ({steps}) and batch size ({batch_size}) must be at least 1")
    if not lr > 0:
        raise LmcError(f"learning rate must be positive, not {lr}")
    train = load_split(data, tokenizer, "train")
    # Held-out text is loaded first: too little of it is better found before training.
    held_out = {
        split: load_split(data, tokenizer, split, max_sequences=DEFAULT_EVAL_SEQUENCES)
        for split in ("validation", "test")
    }
    torch.manual_seed(seed)  # the initialisation
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    record = continue_training(
        model,
        train,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup=warmup,
        progress=progress,
        desc=f"training seed {seed}",
    )
    validation, test = (
        mean_token_loss(model, held_out[split], batch_size=16) for split in ("validation", "test")
    )
    record.update(
        {
            "validation_loss": float(validation.loss),
            "validation_tokens": int(validation.tokens),
            "test_loss": float(test.loss),
            "test_tokens": int(test.tokens),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    )
    return model, record


def continue_training(
    model: PreTrainedModel,
    train: torch.Tensor,
    *,
    seed: int,
    steps: int,
    batch_size: int = 16,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    progress: bool = True,
    desc: str = "training",
    after_step: Callable[[int], None] | None = None,
) -> dict:
    """Train ``model`` in place for ``steps`` AdamW steps on batches of the ``(n, length)``
    sequences ``train`` and leave it in eval mode; return a record of the run.

    The batch order depends on ``seed`` alone, so models trained with one seed see the same
    data in the same order whatever their starting weights. The learning rate warms up
    linearly over ``warmup`` steps (at most a fifth of training), then decays along a cosine
    to a tenth of ``lr``. ``after_step(n)`` is called after the ``n``-th step (1-based), e.g.
    to evaluate part-way.
    """
    warmup = max(0, min(warmup, steps // 5))
    device = next(model.parameters()).device
    model.train()
    train = train.to(device)
    optimizer = _adamw(model, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, steps, warmup, MIN_LR_FRACTION)
    )
    batches = _batch_indices(len(train), batch_size, seed)
    tokens_per_step = batch_size * train.shape[1]

    smoothed, first_loss = 0.0, None
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress)
    start = time.perf_counter()
    for step in bar:
        batch = train[next(batches).to(device)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)

        value = loss.item()
        if after_step is not None:
            after_step(step + 1)
            model.train()
        first_loss = value if first_loss is None else first_loss
        smoothed = SMOOTHING * smoothed + (1 - SMOOTHING) * value
        if step % 10 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                loss=f"{smoothed / (1 - SMOOTHING ** (step + 1)):.3f}",
                tok_s=f"{tokens_per_step * (step + 1) / elapsed:.0f}",
            )
    wall = time.perf_counter() - start
    model.eval()
    return {
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": int(train.shape[1]),
        "lr": lr,
        "warmup": warmup,
        "weight_decay": WEIGHT_DECAY,
        "train_sequences": len(train),
        "tokens_seen": tokens_per_step * steps,
        "first_train_loss": first_loss,
        "train_loss": smoothed / (1 - SMOOTHING**steps),
        "wall_time_s": round(wall, 2),
        "tokens_per_s": round(tokens_per_step * steps / wall, 1),
    }


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norm gains and biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _batch_indices(count: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Row indices of the training batches: epochs of random permutations drawn from a
    generator seeded with ``seed``, so each sequence is seen once per epoch."""
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(count, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]
