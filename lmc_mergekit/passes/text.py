"""The text a method calibrates and evaluates on, as its recipe section names it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.records import Record


class SplitRecord(Record):
    """Which text a split of sequences came from, and how much of it."""

    description: str
    split: str
    sequences: int
    seq_len: int
    tokens: int


@dataclass(frozen=True)
class Split:
    """Token sequences ``(n, seq_len)`` of one split and their description."""

    sequences: torch.Tensor
    record: SplitRecord


def load_recipe_split(
    inputs: tuple[Path, ...], settings, split: str, most: int, fix: str | None = None
) -> Split:
    """Up to ``most`` sequences of ``split`` of the section's ``data`` (``field``, ``seq_len``)
    through the inputs' shared tokenizer; ``fix`` is appended to a missing-tokenizer error
    (how to do without this data, where one can)."""
    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer

    try:
        tokenizer = load_tokenizer(inputs)
    except LmcError as error:
        if fix is None:
            raise
        raise LmcError(f"{error} (or {fix})") from None
    config = DataConfig(source=settings.data, field=settings.field, seq_len=settings.seq_len)
    sequences = load_split(config, tokenizer, split, most)
    record = SplitRecord(
        description=config.describe(),
        split=split,
        sequences=int(sequences.shape[0]),
        seq_len=settings.seq_len,
        tokens=int(sequences.shape[0] * (settings.seq_len - 1)),
    )
    return Split(sequences, record)


def load_test_split(inputs: tuple[Path, ...], settings, section: str) -> Split | None:
    """The test sequences of the recipe section ``section`` when it asks for evaluation
    (``settings.evaluate``), else None."""
    if not settings.evaluate:
        return None
    fix = f"set 'evaluate: false' under {section}:"
    return load_recipe_split(inputs, settings, "test", settings.eval_sequences, fix)


def model_test_loss(folder: Path, test: Split, options) -> float:
    """The mean test loss of the checkpoint ``folder`` on the pass's device (mergekit
    ``options``)."""
    from lmc_mergekit.evaluation.loss import mean_token_loss
    from lmc_mergekit.evaluation.selfcheck import load_fp32
    from lmc_mergekit.passes.device import pass_device

    model = load_fp32(folder, options.trust_remote_code).to(pass_device(options))
    return mean_token_loss(model, test.sequences, progress=not options.quiet).loss


class MergedLoss(Record):
    """The merged model's own test loss."""

    test_loss: float
    tokens: int
