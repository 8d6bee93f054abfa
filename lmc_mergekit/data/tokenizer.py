"""The models' tokenizers: which one tokenises the text, whether the others agree with it, how
they differ, and what it puts around a text.

Models are evaluated (and merged) together when their vocabularies agree: every token both
tokenizers have has one id in both. Special tokens, added tokens and chat templates may differ,
as between a base model and its instruct variant (Llama 3's eos is ``<|end_of_text|>`` in one,
``<|eot_id|>`` in the other); the differences are recorded. The first model's tokenizer
tokenises the text. A model may have more embedding rows than its tokenizer has tokens (Qwen
pads to 151,936), never fewer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.records import Record

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
# Plain words that every tokenizer encodes without special tokens of its own.
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."


class Token(Record):
    """A token and its id."""

    token: str
    id: int

    def __str__(self) -> str:
        return f"{self.token} ({self.id})"


class SpecialTokenDifference(Record):
    """A named special token (bos, eos, ...) that two tokenizers set differently (None: unset)."""

    name: str
    first: Token | None
    other: Token | None


class TokenizerDifference(Record):
    """How another model's tokenizer differs from the one that tokenised the text: its size,
    the tokens only one of them has, its named special tokens and its chat template."""

    model: str
    tokens: int
    only_first: int
    only_other: int
    special_tokens: list[SpecialTokenDifference]
    chat_template_differs: bool

    def summary(self) -> str:
        """What differs, in a few words ("" for nothing)."""
        parts = [
            f"{d.name} {d.first or 'none'} vs {d.other or 'none'}" for d in self.special_tokens
        ]
        if self.chat_template_differs:
            parts.append("the chat template")
        if self.only_first or self.only_other:
            parts.append(f"tokens only in one: {self.only_first} vs {self.only_other}")
        return "; ".join(parts)


class TokenizerRecord(Record):
    """Which tokenizer tokenised the text (the first model's), the tokens it starts every
    sequence with (``prefix``: its BOS, where it adds one), what it appends to a text
    (``suffix``: recorded, never put inside packed sequences) and how each other model's
    tokenizer differs."""

    model: str
    tokens: int
    prefix: list[Token]
    suffix: list[Token]
    differences: list[TokenizerDifference]

    def note(self) -> str:
        """A sentence for a model card on the start tokens and the differences ("" for none)."""
        parts = []
        if self.prefix:
            parts.append(
                "Every sequence starts with "
                + " ".join(f"`{t}`" for t in self.prefix)
                + ", as the tokenizer starts a text."
            )
        for difference in self.differences:
            summary = difference.summary()
            if summary:
                parts.append(
                    f"The tokenizer of `{Path(difference.model).name}` differs from that of "
                    f"`{Path(self.model).name}` (which tokenised the text): {summary}."
                )
        return " ".join(parts)


@dataclass(frozen=True)
class SharedTokenizer:
    """The tokenizer that tokenises the text for models evaluated together, its record, and
    each model's embedding rows (``vocab_size``, where its config gives one)."""

    tokenizer: Any
    record: TokenizerRecord
    rows: tuple[tuple[Path, int | None], ...]

    def check_ids(self, sequences: torch.Tensor) -> None:
        """A one-line error when a token id of ``sequences`` has no embedding row in one of
        the models (its tokenizer has fewer tokens than the first's)."""
        if sequences.numel() == 0:
            return
        highest = int(sequences.max())
        for folder, rows in self.rows:
            if rows is not None and highest >= rows:
                token = self.tokenizer.convert_ids_to_tokens(highest)
                raise LmcError(
                    f"the text tokenised by the tokenizer of {self.record.model} has token "
                    f"{token!r} (id {highest}), past the {rows} embedding rows of {folder}; list "
                    f"{folder} first, so that its tokenizer tokenises the text"
                )


def shared_tokenizer(model_dirs: Sequence[str | Path]) -> SharedTokenizer:
    """The first model's tokenizer, refused unless every other model's vocabulary agrees with
    it (one id per token both have), with a record of how the others differ."""
    from lmc_mergekit.models.checkpoint import model_dir, read_config

    if not model_dirs:
        raise LmcError("no model given; evaluation needs at least one model folder")
    loaded = []
    for path in model_dirs:
        folder = model_dir(path)
        tokenizer = folder_tokenizer(folder)
        rows = read_config(folder).get("vocab_size")
        rows = rows if isinstance(rows, int) else None
        if rows is not None and len(tokenizer) > rows:
            raise LmcError(
                f"the tokenizer in {folder} has {len(tokenizer)} tokens but the model's "
                f"vocab_size is {rows}; put the model's own tokenizer files there"
            )
        loaded.append((folder, tokenizer, rows))
    first_folder, first, _ = loaded[0]
    vocabulary = first.get_vocab()
    differences = []
    for folder, tokenizer, _ in loaded[1:]:
        other = tokenizer.get_vocab()
        _refuse_conflict(first_folder, vocabulary, folder, other)
        differences.append(_difference(folder, first, vocabulary, tokenizer, other))
    prefix, suffix = text_affixes(first)
    record = TokenizerRecord(
        model=str(first_folder),
        tokens=len(first),
        prefix=[_token(first, i) for i in prefix],
        suffix=[_token(first, i) for i in suffix],
        differences=differences,
    )
    return SharedTokenizer(first, record, tuple((folder, rows) for folder, _, rows in loaded))


def load_tokenizer(model_dirs: Sequence[str | Path]) -> Any:
    """The Hugging Face tokenizer that tokenises the text for all of ``model_dirs`` (the
    first's; see :func:`shared_tokenizer`)."""
    return shared_tokenizer(model_dirs).tokenizer


def shares_tokenizer(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders' embedding rows stand for the same tokens: vocabularies
    that agree and one number of rows where both have a tokenizer, else (nothing to compare)
    one number of rows."""
    from lmc_mergekit.models.checkpoint import read_config

    same_rows = read_config(a).get("vocab_size") == read_config(b).get("vocab_size")
    if not all(has_tokenizer(folder) for folder in (a, b)):
        return same_rows
    first, other = folder_tokenizer(a).get_vocab(), folder_tokenizer(b).get_vocab()
    return same_rows and _conflict(first, other) is None


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds tokenizer files."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def text_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` puts before and after a text (``add_special_tokens=True``): BOS
    for Gemma's and Llama's, nothing for Qwen's or GPT-2's, EOS after for some."""
    plain = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    full = tokenizer(PROBE_TEXT)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    raise LmcError(
        f"the tokenizer {type(tokenizer).__name__} encodes a text differently with its special "
        "tokens than without; give the model a tokenizer that only adds tokens around a text"
    )


def folder_tokenizer(folder: Path) -> Any:
    """The tokenizer in the checkpoint folder ``folder`` (loaded once a process while its files
    are unchanged; callers only read it), or a one-line error where it has none or it cannot
    be loaded."""
    if not has_tokenizer(folder):
        raise LmcError(
            f"evaluation needs the model's tokenizer, but {folder} has no tokenizer files; "
            "copy them from the model it was trained or merged from"
        )
    stamp = tuple(
        (path.name, stat.st_mtime_ns, stat.st_size)
        for path in sorted(folder.iterdir())
        if path.is_file() and (stat := path.stat())
    )
    try:
        return _loaded_tokenizer(str(folder), stamp)
    except (OSError, ValueError, TypeError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise LmcError(f"could not load the tokenizer in {folder}: {first_line}") from None


@functools.lru_cache(maxsize=4)
def _loaded_tokenizer(folder: str, stamp: tuple) -> Any:
    """The tokenizer in ``folder``, loaded once a process while its files (``stamp``: every
    file's name, time and size) are unchanged: a recipe's stages ask for it several times,
    and a 150k-token tokenizer takes a second or more to load. Callers only read it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _conflict(first: dict[str, int], other: dict[str, int]) -> tuple[str, int, int] | None:
    """A token both vocabularies have under different ids (the one with the lowest id in
    ``first``), or None when they agree."""
    clashes = [(i, token) for token, i in first.items() if other.get(token, i) != i]
    if not clashes:
        return None
    i, token = min(clashes)
    return token, i, other[token]


def _refuse_conflict(
    first_folder: Path, first: dict[str, int], folder: Path, other: dict[str, int]
) -> None:
    conflict = _conflict(first, other)
    if conflict is not None:
        token, a, b = conflict
        raise LmcError(
            f"the tokenizers of {first_folder} and {folder} differ: token {token!r} is id {a} "
            f"in the first and {b} in the second; models merged or evaluated together need one "
            "vocabulary (use models of one tokenizer family, each with its own tokenizer files)"
        )


def _difference(
    folder: Path, first: Any, vocabulary: dict[str, int], tokenizer: Any, other: dict[str, int]
) -> TokenizerDifference:
    special = []
    for attribute in first.SPECIAL_TOKENS_ATTRIBUTES:
        name = attribute.removesuffix("_token")
        a, b = _named_token(first, attribute), _named_token(tokenizer, attribute)
        if a != b:
            special.append(SpecialTokenDifference(name=name, first=a, other=b))
    return TokenizerDifference(
        model=str(folder),
        tokens=len(tokenizer),
        only_first=len(vocabulary.keys() - other.keys()),
        only_other=len(other.keys() - vocabulary.keys()),
        special_tokens=special,
        chat_template_differs=_chat_template(first) != _chat_template(tokenizer),
    )


def _named_token(tokenizer: Any, attribute: str) -> Token | None:
    token = getattr(tokenizer, attribute, None)
    token_id = getattr(tokenizer, f"{attribute}_id", None)
    return None if token is None or token_id is None else Token(token=str(token), id=token_id)


def _chat_template(tokenizer: Any) -> Any:
    return getattr(tokenizer, "chat_template", None)


def _token(tokenizer: Any, token_id: int) -> Token:
    return Token(token=tokenizer.convert_ids_to_tokens(token_id), id=token_id)
