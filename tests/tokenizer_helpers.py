"""Small real tokenizers, and tiny models that go with them, built in code for the tests."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tiny_models import build_model
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from lmc_mergekit.data import DataConfig, bundled_text_files
from lmc_mergekit.zoo.tokenizer import SPECIAL_TOKEN, train_tokenizer


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


def tokenizer_variant(
    added: tuple[str, ...] = (),
    eos: str = SPECIAL_TOKEN,
    bos: str | None = None,
    suffix: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """:func:`make_tokenizer`'s tokenizer with the special tokens ``added`` after its
    vocabulary (ids 300, 301, ...), ``eos`` as its EOS and a ``chat_template``. With ``bos`` (a
    token of ``added``) its post-processor puts that token before every text, as Gemma's and
    Llama 3's do; with ``suffix`` it puts that one after every text."""
    backend = Tokenizer.from_str(make_tokenizer().backend_tokenizer.to_str())
    backend.add_special_tokens(list(added))
    if bos is not None or suffix is not None:
        before, after = (f"{bos} " if bos else ""), (f" {suffix}" if suffix else "")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{before}$A{after}",
            pair=f"{before}$A{after} {before}$B{after}",
            special_tokens=[(t, backend.token_to_id(t)) for t in (bos, suffix) if t is not None],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos or SPECIAL_TOKEN,
        eos_token=eos,
        unk_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        chat_template=chat_template,
    )


def model_with(folder: Path, tokenizer: PreTrainedTokenizerFast, rows: int, seed: int = 0) -> Path:
    """A tiny random llama checkpoint of ``rows`` embedding rows (at least the tokenizer's
    tokens; more is padding, as Qwen's) with ``tokenizer`` saved next to it."""
    build_model("llama", folder, seed, vocab_size=rows)
    tokenizer.save_pretrained(folder)
    return folder
