"""The text a method calibrates and evaluates on, as its recipe section names it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from lmc_mergekit.data.tokenizer import TokenizerRecord
from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.records import Record


class SplitRecord(Record):
    """Which text a split of sequences came from, how much of it, and which tokenizer
    tokenised it (how the other inputs' tokenizers differ from it)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ("tokenizer",)

    description: str
    split: str
    sequences: int
    seq_len: int
    tokens: int
    tokenizer: TokenizerRecord | None = None

    def tokenizer_note(self) -> str:
        """A sentence for a model card on the tokenizer's start tokens and how the inputs'
        tokenizers differ ("" for nothing to say)."""
        return "" if self.tokenizer is None else self.tokenizer.note()


@dataclass(frozen=True)
class Split:
    """Token sequences ``(n, seq_len)`` of one split and their description."""

    sequences: torch.Tensor
    record: SplitRecord


def load_recipe_split(
    inputs: tuple[Path, ...],
    settings,
    split: str,
    most: int,
    fix: str | None = None,
    spread: bool = False,
) -> Split:
    """Up to ``most`` sequences of ``split`` of the section's ``data`` (``field``, ``seq_len``)
    through the first input's tokenizer, which the others' must agree with; ``fix`` is appended
    to a missing-tokenizer error (how to do without this data, where one can). ``spread``: an
    equal share of every text given, spread over each (:func:`~lmc_mergekit.data.sample_split`;
    the record names each text and its count), rather than the first ``most`` in corpus order."""
    from lmc_mergekit.data import DataConfig, load_split, sample_split, shared_tokenizer

    try:
        shared = shared_tokenizer(inputs)
    except LmcError as error:
        if fix is None:
            raise
        raise LmcError(f"{error} (or {fix})") from None
    config = DataConfig(source=settings.data, field=settings.field, seq_len=settings.seq_len)
    description = config.describe()
    if spread:
        sequences, read = sample_split(config, shared.tokenizer, split, most)
        if len(read) > 1:
            description += ": " + ", ".join(f"{name} ({count})" for name, count in read)
    else:
        sequences = load_split(config, shared.tokenizer, split, most)
    shared.check_ids(sequences)
    record = SplitRecord(
        description=description,
        split=split,
        sequences=int(sequences.shape[0]),
        seq_len=settings.seq_len,
        tokens=int(sequences.shape[0] * (settings.seq_len - 1)),
        tokenizer=shared.record,
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
    from lmc_mergekit.evaluation.blockwise import checkpoint_loss
    from lmc_mergekit.passes.device import pass_device

    device, remote = pass_device(options), options.trust_remote_code
    return checkpoint_loss(folder, test.sequences, device, remote, not options.quiet).loss


class MergedLoss(Record):
    """The merged model's own test loss."""

    test_loss: float
    tokens: int
