"""Small real tokenizers, and tiny models that go with them, built in code for the tests."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tiny_models import build_model
from transformers import PreTrainedTokenizerFast

from lmc_mergekit.data import DataConfig, bundled_text_files
from lmc_mergekit.zoo.tokenizer import train_tokenizer


@functools.cache
def make_tokenizer(vocab_size: int = 300, book: int = 0) -> PreTrainedTokenizerFast:
    """The zoo's byte-level BPE (every text encodes; ``<|endoftext|>`` is its EOS) trained on
    8 KB of bundled book number ``book``. Different ``vocab_size`` or ``book`` give different
    merges."""
    text = bundled_text_files()[book].read_text(encoding="utf-8")[:8000]
    source = Path(tempfile.mkdtemp(prefix="tokenizer-text-")) / "text.txt"
    source.write_text(text, encoding="utf-8")
    return train_tokenizer(DataConfig(source=str(source)), vocab_size)


def save_tokenizer(folder: Path, vocab_size: int = 300, book: int = 0) -> Path:
    """Write :func:`make_tokenizer`'s tokenizer files into ``folder``."""
    make_tokenizer(vocab_size, book).save_pretrained(folder)
    return folder


def model_with_tokenizer(
    folder: Path, variant: str = "llama", seed: int = 0, vocab_size: int = 300, book: int = 0
) -> Path:
    """A tiny random ``variant`` checkpoint whose vocabulary is the saved tokenizer's."""
    build_model(variant, folder, seed, vocab_size=len(make_tokenizer(vocab_size, book)))
    save_tokenizer(folder, vocab_size, book)
    return folder
