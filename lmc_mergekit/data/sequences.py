"""Text turned into fixed-length token sequences, and their split into train/validation/test.

Documents are tokenized without special tokens, joined into one token stream with the
tokenizer's EOS id between them, and cut into consecutive sequences of ``seq_len`` tokens. Each
sequence belongs to one split by its position in the stream (:func:`split_of`), so every split
is fixed by the data and ``seq_len`` alone, with no random state to carry around.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmc_mergekit.data.sources import iter_texts
from lmc_mergekit.errors import LmcError

SPLITS = ("train", "validation", "test")
BLOCK = 8
# Of every 10 blocks: block 0 is test, block 1 validation, the other 8 train.
SPLIT_OF_BLOCK = ("test", "validation", *("train",) * 8)
TOKENIZE_PIECE_CHARS = 100_000
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def split_of(index: int) -> str:
    """The split of packed sequence number ``index``: by block of :data:`BLOCK` sequences.

    Block ``index // BLOCK`` goes to "test" when its number is 0 modulo 10, to "validation" when
    it is 1, and to "train" otherwise (80/10/10). Interleaving blocks rather than cutting the
    stream into three parts makes every split sample the whole corpus evenly (not, say, only its
    last book); blocks rather than single sequences keep neighbouring text, which shares
    vocabulary and topic, within one split. Test comes first so that even a short text gives a
    test split.
    """
    if index < 0:
        raise ValueError(f"sequence index must be >= 0, got {index}")
    return SPLIT_OF_BLOCK[(index // BLOCK) % len(SPLIT_OF_BLOCK)]


def _first_index(split: str) -> int:
    """The number of the first sequence that belongs to ``split``."""
    return SPLIT_OF_BLOCK.index(split) * BLOCK


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 2:
        raise LmcError(f"sequence length {seq_len} is too short; use --seq-len 2 or more")


def _iter_token_pieces(texts: Iterable[str], tokenizer: Any) -> Iterator[list[int]]:
    """The token stream of ``texts`` in pieces, EOS (where the tokenizer has one) between texts."""
    eos = tokenizer.eos_token_id
    first = True
    for text in texts:
        if not text:
            continue
        if not first and eos is not None:
            yield [eos]
        first = False
        for piece in _line_pieces(text, TOKENIZE_PIECE_CHARS):
            # verbose=False: pieces exceed model_max_length on purpose; nothing is truncated.
            yield tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"]


def _line_pieces(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, cut after a newline where there is one."""
    start = 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        end = cut + 1 if cut >= start else start + size
        yield text[start:end]
        start = end
    yield text[start:]


def iter_sequences(texts: Iterable[str], tokenizer: Any, seq_len: int) -> Iterator[list[int]]:
    """Consecutive ``seq_len``-token chunks of the token stream of ``texts``.

    Each text is tokenized without special tokens (long texts in pieces of about
    :data:`TOKENIZE_PIECE_CHARS` characters cut at line ends, so memory stays bounded), the
    tokenizer's EOS id goes between texts when it has one, and the final partial chunk is
    dropped.
    """
    if seq_len < 1:
        raise LmcError(f"sequence length {seq_len} must be positive")
    buffer: list[int] = []
    for ids in _iter_token_pieces(texts, tokenizer):
        buffer.extend(ids)
        start = 0
        while len(buffer) - start >= seq_len:
            yield buffer[start : start + seq_len]
            start += seq_len
        del buffer[:start]


@dataclass(frozen=True)
class DataConfig:
    """Which text to use and how to cut it: ``source`` as for :func:`iter_texts`."""

    source: str | None = None
    field: str = "text"
    seq_len: int = 128

    def __post_init__(self) -> None:
        _check_seq_len(self.seq_len)

    def describe(self) -> str:
        """A short human description of the data, e.g. ``bundled corpus``."""
        name = "bundled corpus" if self.source is None else str(self.source)
        return name if self.field == "text" else f"{name} (field {self.field!r})"


def load_split(
    config: DataConfig, tokenizer: Any, split: str, max_sequences: int | None = None
) -> torch.Tensor:
    """The sequences of ``split`` as a ``torch.long`` tensor ``(n, seq_len)``, in corpus order.

    Reading stops as soon as ``max_sequences`` sequences of the split were collected.
    """
    if split not in SPLITS:
        raise LmcError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if max_sequences is not None and max_sequences < 1:
        raise LmcError(f"max_sequences must be at least 1, got {max_sequences}")
    _check_seq_len(config.seq_len)
    texts = iter_texts(config.source, config.field)
    chosen: list[list[int]] = []
    total = 0
    for index, sequence in enumerate(iter_sequences(texts, tokenizer, config.seq_len)):
        total = index + 1
        if split_of(index) == split:
            chosen.append(sequence)
            if len(chosen) == max_sequences:
                break
    if total == 0:
        # Fewer tokens than one sequence, so counting them again is cheap.
        texts = iter_texts(config.source, config.field)
        count = sum(len(ids) for ids in _iter_token_pieces(texts, tokenizer))
        raise LmcError(
            f"{config.describe()} yields {count} tokens, fewer than one sequence of "
            f"{config.seq_len}; give more text or a smaller --seq-len"
        )
    if not chosen:
        first = _first_index(split)
        raise LmcError(
            f"{config.describe()} gives {total} sequences of {config.seq_len} tokens, none in the "
            f"{split!r} split (it gets sequences {first}-{first + BLOCK - 1} of every "
            f"{BLOCK * len(SPLIT_OF_BLOCK)}); give at least {(first + 1 - total) * config.seq_len} "
            "more tokens of text or a smaller --seq-len"
        )
    return torch.tensor(chosen, dtype=torch.long)


def load_tokenizer(model_dirs: Sequence[str | Path]) -> Any:
    """The Hugging Face tokenizer that all of ``model_dirs`` share (loaded from the first)."""
    from lmc_mergekit.models.checkpoint import model_dir, read_config

    if not model_dirs:
        raise LmcError("no model given; evaluation needs at least one model folder")
    tokenizer = None
    first: Path | None = None
    for path in model_dirs:
        folder = model_dir(path)
        candidate = _tokenizer_of(folder)
        vocab_size = read_config(folder).get("vocab_size")
        if isinstance(vocab_size, int) and len(candidate) > vocab_size:
            raise LmcError(
                f"the tokenizer in {folder} has {len(candidate)} tokens but the model's "
                f"vocab_size is {vocab_size}; put the model's own tokenizer files there"
            )
        if tokenizer is None:
            tokenizer, first = candidate, folder
        elif _signature(candidate) != _signature(tokenizer):
            raise LmcError(
                f"the tokenizers of {first} and {folder} differ; models evaluated together "
                "must share one tokenizer"
            )
    return tokenizer


def shares_tokenizer(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders tokenise alike: the same tokenizer where both have one,
    else (nothing to compare) the same vocabulary size."""
    from lmc_mergekit.models.checkpoint import read_config

    has = [any((f / name).is_file() for name in TOKENIZER_FILES) for f in (a, b)]
    if all(has):
        return _signature(_tokenizer_of(a)) == _signature(_tokenizer_of(b))
    return read_config(a).get("vocab_size") == read_config(b).get("vocab_size")


def _tokenizer_of(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise LmcError(
            f"evaluation needs the model's tokenizer, but {folder} has no tokenizer files; "
            "copy them from the model it was trained or merged from"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LmcError(f"could not load the tokenizer in {folder}: {first_line}") from None


def _signature(tokenizer: Any) -> tuple:
    """What two tokenizers must agree on to produce the same ids: vocabulary and special ids."""
    special = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")
    }
    return tokenizer.get_vocab(), special, sorted(tokenizer.all_special_ids)
