"""The zoo's tokenizer: a byte-level BPE (as GPT-2's and Pythia's) trained on the zoo's text.

Training is deterministic, and the result is cached under the zoo's root keyed by a fingerprint
of the text (file paths, sizes and modification times, as build tools do) and the vocabulary
size, so that every model trained on the same text shares one tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmc_mergekit.data.sequences import DataConfig
from lmc_mergekit.data.sources import data_fingerprint, iter_texts
from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.keys import content_key
from lmc_mergekit.runtime.publish import staged_folder

SPECIAL_TOKEN = "<|endoftext|>"
# Bump when the training recipe changes, so that cached tokenizers are retrained.
TOKENIZER_VERSION = 1
TOKENIZER_CACHE = ".tokenizers"


def train_tokenizer(data: DataConfig, vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` first, as bos, eos, unk
    and pad) trained on the texts of ``data.source`` (field ``data.field``)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise LmcError(
            f"vocabulary size {vocab_size} is too small for a byte-level BPE; "
            f"use at least {len(alphabet) + 1}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(data.source, field=data.field), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        unk_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
    )


def cached_tokenizer(
    root: Path, source: str | Path | None = None, field: str = "text", vocab_size: int = 4096
) -> Path:
    """The folder under ``root`` holding the tokenizer trained on ``source``; trained and saved
    there on first use (``AutoTokenizer.from_pretrained`` loads it)."""
    key = {"data": data_fingerprint(source, field), "vocab": vocab_size, "v": TOKENIZER_VERSION}
    digest = content_key(key, 16)
    folder = Path(root).expanduser().absolute() / TOKENIZER_CACHE / f"bpe{vocab_size}-{digest}"
    if (folder / "tokenizer.json").is_file():
        return folder
    tokenizer = train_tokenizer(DataConfig(source=_as_str(source), field=field), vocab_size)
    # A folder without tokenizer.json can only be debris: replace it.
    with staged_folder(folder, "replace") as tmp:
        tokenizer.save_pretrained(tmp)
    return folder


def _as_str(source: str | Path | None) -> str | None:
    return None if source is None else str(source)
