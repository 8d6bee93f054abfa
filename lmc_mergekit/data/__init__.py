"""Calibration and evaluation data: the bundled corpus (see corpus/PROVENANCE.md), other sources,
and their packing into token sequences."""

from importlib.resources import files
from pathlib import Path

from lmc_mergekit.data.sequences import (
    BLOCK,
    SPLITS,
    DataConfig,
    iter_sequences,
    load_split,
    load_tokenizer,
    split_of,
)
from lmc_mergekit.data.sources import iter_texts

__all__ = [
    "BLOCK",
    "SPLITS",
    "DataConfig",
    "bundled_corpus_dir",
    "bundled_text_files",
    "iter_sequences",
    "iter_texts",
    "load_split",
    "load_tokenizer",
    "split_of",
]


def bundled_corpus_dir() -> Path:
    """Folder of the bundled public-domain text files (the default calibration data)."""
    return Path(str(files(__name__).joinpath("corpus")))


def bundled_text_files() -> list[Path]:
    """The bundled text files, in a fixed order."""
    return sorted(bundled_corpus_dir().glob("*.txt"))
