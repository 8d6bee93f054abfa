"""Healing a converted model: continued training after ``subclone_compensate``.

A smaller model cut from a larger one starts above its donor's loss; a few hundred steps of
ordinary training on text close to the model's use recover much of the gap (the size
conversion paper's continued-training race). Healing is the tool's one training loop
(:func:`lmc_mergekit.zoo.train.continue_training`: progress, rollback on divergence, a
resumable checkpoint) run on the converted checkpoint, with the held-out loss measured along
the way; the result is written in the source's dtype beside its tokenizer, staged and renamed
into place only when complete and finite.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer, sample_split
from lmc_mergekit.data.sources import data_fingerprint
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import mean_token_loss, resolve_device
from lmc_mergekit.models.checkpoint import model_dir
from lmc_mergekit.runtime.keys import content_key, fingerprint
from lmc_mergekit.runtime.publish import check_output_free
from lmc_mergekit.zoo.finetune import train_checkpoint
from lmc_mergekit.zoo.train import CHECKPOINT_EVERY

#: The record written beside the healed weights.
HEAL_INFO = "heal.json"
#: Defaults for a converted model: a fine-tuning rate, not a from-scratch one.
DEFAULT_LR = 3e-4
DEFAULT_BATCH = 8
#: Held-out evaluations over a run (besides the start and the end).
EVALUATIONS = 10


def heal_steps_to_evaluate(steps: int, every: int | None = None) -> list[int]:
    """Steps before which the held-out loss is measured: the start, every ``every`` steps
    (about a tenth of the run by default) and the end."""
    every = every or max(1, steps // EVALUATIONS)
    return sorted({0, steps, *range(every, steps, every)})


def heal(
    source: str | Path,
    out: str | Path,
    *,
    steps: int,
    data: DataConfig | None = None,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    evaluate_at: list[int] | None = None,
    test: dict[str, torch.Tensor] | None = None,
    eval_sequences: int = 32,
    device: str = "auto",
    cache_dir: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> dict:
    """Write ``source`` trained on for ``steps`` AdamW steps (float32, warm-up over a tenth,
    cosine decay) to ``out``; return the run's record (also written to ``out/heal.json``).

    Training reads the train split of ``data`` (every text it names in equal shares, as a
    calibration does), ``steps × batch_size`` sequences at most, one epoch for the default
    sizes; the held-out losses are measured on ``test`` (named token sequences) or else the
    test split of ``data`` (``eval_sequences`` sequences), at ``evaluate_at`` (default
    :func:`heal_steps_to_evaluate`). With ``cache_dir`` the run keeps a resumable checkpoint
    there: the same command after an interruption resumes where it was.
    """
    if steps < 1 or batch_size < 1:
        raise LmcError(f"steps ({steps}) and batch size ({batch_size}) must be at least 1")
    if not lr > 0:
        raise LmcError(f"learning rate must be positive, not {lr}; try {DEFAULT_LR}")
    folder = model_dir(source)
    out = Path(out).expanduser().absolute()
    check_output_free(out, overwrite)
    data = data or DataConfig()
    tokenizer = load_tokenizer([folder])
    # Data errors come before the (slower) model load.
    train, described = sample_split(data, tokenizer, "train", steps * batch_size)
    if test is None:
        test = {"test": load_split(data, tokenizer, "test", eval_sequences)}

    def losses(model) -> dict[str, float]:
        return {name: mean_token_loss(model, seqs).loss for name, seqs in test.items()}

    identity = {
        "source": fingerprint(folder),
        "data": data_fingerprint(data.source, data.field),
        "seq_len": data.seq_len,
        "test": {name: content_key(seqs.tolist()) for name, seqs in test.items()},
    }
    checkpoint = None
    if cache_dir is not None:
        checkpoint = Path(cache_dir) / "heal" / f"{content_key(identity)}-{steps}.pt"
    return train_checkpoint(
        folder,
        out,
        train,
        HEAL_INFO,
        {"source": str(folder), "data": described},
        existing="replace" if overwrite else "refuse",
        device=resolve_device(device),
        trust_remote_code=trust_remote_code,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        progress=progress,
        desc=f"healing {folder.name}",
        evaluate=losses,
        evaluate_at=heal_steps_to_evaluate(steps) if evaluate_at is None else evaluate_at,
        checkpoint=checkpoint,
        identity=identity,
        # At least ten checkpoints a run: an interruption loses a tenth of it at most.
        checkpoint_every=max(1, min(CHECKPOINT_EVERY, steps // 10)),
    )
