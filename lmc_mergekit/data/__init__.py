"""Calibration and evaluation data: the bundled corpus (see corpus/PROVENANCE.md), other sources,
and their packing into token sequences."""

from lmc_mergekit.data.corpus import bundled_corpus_dir, bundled_text_files
from lmc_mergekit.data.sequences import (
    BLOCK,
    SPLITS,
    DataConfig,
    iter_sequences,
    load_split,
    sample_split,
    split_of,
)
from lmc_mergekit.data.sources import iter_texts
from lmc_mergekit.data.tokenizer import (
    SharedTokenizer,
    TokenizerRecord,
    folder_tokenizer,
    load_tokenizer,
    shared_tokenizer,
    shares_tokenizer,
    text_affixes,
)

__all__ = [
    "BLOCK",
    "SPLITS",
    "DataConfig",
    "SharedTokenizer",
    "TokenizerRecord",
    "bundled_corpus_dir",
    "bundled_text_files",
    "folder_tokenizer",
    "iter_sequences",
    "iter_texts",
    "load_split",
    "load_tokenizer",
    "sample_split",
    "shared_tokenizer",
    "shares_tokenizer",
    "split_of",
    "text_affixes",
]
