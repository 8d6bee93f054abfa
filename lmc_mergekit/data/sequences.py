"""Text turned into fixed-length token sequences, and their split into train/validation/test.

Documents are tokenized without special tokens, joined into one token stream with the
tokenizer's EOS id between them, and cut into consecutive sequences of ``seq_len`` tokens, each
starting as the tokenizer starts a text (its BOS where it adds one, then the next
``seq_len - 1`` tokens of the stream). Each sequence belongs to one split by its position in the
stream (:func:`split_of`), so every split is fixed by the data and ``seq_len`` alone, with no
random state to carry around.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmc_mergekit.data.sources import Source, iter_texts, source_parts
from lmc_mergekit.data.tokenizer import text_affixes
from lmc_mergekit.errors import LmcError

SPLITS = ("train", "validation", "test")
BLOCK = 8
# Of every 10 blocks: block 0 is test, block 1 validation, the other 8 train.
SPLIT_OF_BLOCK = ("test", "validation", *("train",) * 8)
TOKENIZE_PIECE_CHARS = 100_000
#: A spread sample reads at most this many times the sequences it keeps from each text.
SPREAD_READ = 16


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
    """Sequences of ``seq_len`` tokens: the ids the tokenizer starts a text with (its BOS,
    where it adds one; see :func:`text_affixes`), then the next consecutive chunk of the token
    stream of ``texts``.

    Each text is tokenized without special tokens (long texts in pieces of about
    :data:`TOKENIZE_PIECE_CHARS` characters cut at line ends, so memory stays bounded), the
    tokenizer's EOS id goes between texts when it has one, and the final partial chunk is
    dropped. Ids a tokenizer appends to a text (an EOS after it) are not put into sequences.
    With a tokenizer that adds nothing the sequences are plain chunks of the stream.
    """
    prefix = text_affixes(tokenizer)[0]
    body = _body_len(seq_len, prefix)
    buffer: list[int] = []
    for ids in _iter_token_pieces(texts, tokenizer):
        buffer.extend(ids)
        start = 0
        while len(buffer) - start >= body:
            yield prefix + buffer[start : start + body]
            start += body
        del buffer[:start]


def _body_len(seq_len: int, prefix: list[int]) -> int:
    """The stream tokens in a sequence of ``seq_len`` after the tokenizer's ``prefix``."""
    if seq_len - len(prefix) < 1:
        after = f" after the {len(prefix)} tokens the tokenizer starts a text with"
        after = after if prefix else ""
        raise LmcError(
            f"sequence length {seq_len} leaves no room for text{after}; "
            f"use --seq-len {len(prefix) + 1} or more"
        )
    return seq_len - len(prefix)


@dataclass(frozen=True)
class DataConfig:
    """Which text to use and how to cut it: ``source`` as for :func:`iter_texts`."""

    source: Source = None
    field: str = "text"
    seq_len: int = 128

    def __post_init__(self) -> None:
        _check_seq_len(self.seq_len)
        if isinstance(self.source, list):
            object.__setattr__(self, "source", tuple(self.source))

    def describe(self) -> str:
        """A short human description of the data, e.g. ``bundled corpus``."""
        if self.source is None:
            name = "bundled corpus"
        elif isinstance(self.source, tuple):
            name = ", ".join(map(str, self.source))
        else:
            name = str(self.source)
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
        body = _body_len(config.seq_len, text_affixes(tokenizer)[0])
        raise LmcError(
            f"{config.describe()} gives {total} sequences of {config.seq_len} tokens, none in the "
            f"{split!r} split (it gets sequences {first}-{first + BLOCK - 1} of every "
            f"{BLOCK * len(SPLIT_OF_BLOCK)}); give at least {(first + 1 - total) * body} more "
            "tokens of text or a smaller --seq-len"
        )
    return torch.tensor(chosen, dtype=torch.long)


def sample_split(
    config: DataConfig, tokenizer: Any, split: str, most: int
) -> tuple[torch.Tensor, list[tuple[str, int]]]:
    """Up to ``most`` sequences of ``split`` drawn from every text of ``config.source`` (each
    source of a list, each file of the bundled corpus) in equal shares, each share evenly spaced
    over the first :data:`SPREAD_READ` times as many sequences of that text's split, and
    interleaved so that every batch mixes the texts; with each text's name and count. A
    calibration read this way represents all it is given, not the first pages of its first
    book."""
    parts = source_parts(config.source)
    shares = [most // len(parts) + (i < most % len(parts)) for i in range(len(parts))]
    chosen: list[torch.Tensor] = []
    read: list[tuple[str, int]] = []
    for part, share in zip(parts, shares, strict=True):
        if share == 0:
            continue
        sequences = load_split(replace(config, source=part), tokenizer, split, share * SPREAD_READ)
        index = torch.linspace(0, len(sequences) - 1, min(share, len(sequences))).round().long()
        chosen.append(sequences[index])
        read.append((part.name if isinstance(part, Path) else str(part), len(index)))
    order = sorted((j / len(c), t, j) for t, c in enumerate(chosen) for j in range(len(c)))
    return torch.stack([chosen[t][j] for _, t, j in order]), read
