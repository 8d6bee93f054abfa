"""Calibration and evaluation data: the bundled corpus (see corpus/PROVENANCE.md), other sources,
and their packing into token sequences."""

from lmc_mergekit.data.corpus import bundled_corpus_dir, bundled_text_files
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
