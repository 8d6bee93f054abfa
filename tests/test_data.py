"""Calibration and evaluation data: sources, packing into sequences, splits, the tokenizer."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tokenizer_helpers import make_tokenizer, save_tokenizer

from lmc_mergekit.data import (
    BLOCK,
    SPLITS,
    DataConfig,
    bundled_text_files,
    iter_sequences,
    iter_texts,
    load_split,
    load_tokenizer,
    sample_split,
    split_of,
)
from lmc_mergekit.data import sequences as sequences_module
from lmc_mergekit.data import sources as sources_module
from lmc_mergekit.errors import LmcError

BOOK = bundled_text_files()[0].read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def token_stream(tokenizer, source, field: str = "text") -> list[int]:
    """Every token of ``source``: with sequences of length 1 nothing is dropped."""
    return [s[0] for s in iter_sequences(iter_texts(source, field), tokenizer, 1)]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join(json.dumps(row) + "\n" for row in rows))


# --- sources -------------------------------------------------------------------------------


def test_text_file_gives_its_token_stream_in_full_sequences(tmp_path, tokenizer):
    text = BOOK[:3000]
    path = write(tmp_path / "book.txt", text)
    assert list(iter_texts(path)) == [text]
    chunks = list(iter_sequences(iter_texts(str(path)), tokenizer, 16))
    expected = ids(tokenizer, text)
    assert len(chunks) == len(expected) // 16 and all(len(c) == 16 for c in chunks)
    assert [t for c in chunks for t in c] == expected[: 16 * len(chunks)]


def test_long_text_is_read_and_tokenized_in_pieces_at_line_ends(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(sources_module, "TEXT_PIECE_CHARS", 500)
    monkeypatch.setattr(sequences_module, "TOKENIZE_PIECE_CHARS", 200)
    text = "".join(f"line {i} of a text that goes on and on\n" for i in range(100))
    pieces = list(iter_texts(write(tmp_path / "long.md", text)))
    assert len(pieces) > 3 and "".join(pieces) == text
    assert all(p.endswith("\n") and 500 <= len(p) < 600 for p in pieces[:-1])
    # Cutting a document after a newline does not change its tokens.
    assert [s[0] for s in iter_sequences([text], tokenizer, 1)] == ids(tokenizer, text)
    # A line longer than a piece is still read in bounded pieces.
    endless = "x" * 1234
    assert [len(p) for p in iter_texts(write(tmp_path / "endless.txt", endless))] == [500] * 2 + [
        234
    ]


def test_bundled_corpus_is_the_default(tokenizer):
    texts = list(iter_texts(None))
    assert texts == [path.read_text(encoding="utf-8") for path in bundled_text_files()]


def test_folder_reads_its_text_files_in_path_order(tmp_path, tokenizer):
    write(tmp_path / "b.txt", "Second file.\n")
    write(tmp_path / "a" / "z.md", "# First file\n")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "Third."}, {"text": "Fourth."}])
    write(tmp_path / "notes.csv", "not,data\n")
    write(tmp_path / ".hidden" / "x.txt", "hidden\n")
    write(tmp_path / "empty.txt", "")
    assert list(iter_texts(tmp_path)) == ["# First file\n", "Second file.\n", "Third.", "Fourth."]
    eos = tokenizer.eos_token_id
    expected = [*ids(tokenizer, "# First file\n"), eos, *ids(tokenizer, "Second file.\n"), eos]
    expected += [*ids(tokenizer, "Third."), eos, *ids(tokenizer, "Fourth.")]
    assert token_stream(tokenizer, tmp_path) == expected


def test_jsonl_reads_the_named_field_and_skips_blank_lines(tmp_path, tokenizer):
    path = write(
        tmp_path / "rows.jsonl",
        '{"body": "Hello there.", "id": 1}\n\n{"body": "Goodbye.", "id": 2}\n',
    )
    assert list(iter_texts(path, field="body")) == ["Hello there.", "Goodbye."]
    expected = [
        *ids(tokenizer, "Hello there."),
        tokenizer.eos_token_id,
        *ids(tokenizer, "Goodbye."),
    ]
    assert token_stream(tokenizer, path, "body") == expected


def test_saved_datasets_are_read_row_by_row(tmp_path, tokenizer):
    texts = ["One row.", "Two rows.", "Three rows."]
    datasets.Dataset.from_dict({"text": texts, "n": [1, 2, 3]}).save_to_disk(tmp_path / "ds")
    assert list(iter_texts(tmp_path / "ds")) == texts
    eos = tokenizer.eos_token_id
    expected = [*ids(tokenizer, texts[0]), eos, *ids(tokenizer, texts[1]), eos]
    assert token_stream(tokenizer, tmp_path / "ds") == [*expected, *ids(tokenizer, texts[2])]

    splits = datasets.DatasetDict(
        test=datasets.Dataset.from_dict({"body": ["held out"]}),
        train=datasets.Dataset.from_dict({"body": ["train a", "train b"]}),
    )
    splits.save_to_disk(tmp_path / "dd")
    assert list(iter_texts(tmp_path / "dd", field="body")) == ["train a", "train b"]
    with pytest.raises(LmcError, match=r"no field 'text' \(fields: body\); pass --field NAME"):
        list(iter_texts(tmp_path / "dd"))


def test_hub_datasets_stream_and_fail_with_a_hint(monkeypatch):
    calls = []

    def fake_load_dataset(name, split, streaming):
        calls.append((name, split, streaming))
        return iter([{"text": "a"}, {"text": "b"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert list(iter_texts("hf:org/corpus:validation")) == ["a", "b"]
    assert list(iter_texts("hf:org/corpus")) == ["a", "b"]
    assert calls == [("org/corpus", "validation", True), ("org/corpus", "train", True)]

    def offline(name, split, streaming):
        raise ConnectionError("Couldn't reach 'org/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(LmcError, match=r"'hf:org/corpus' could not be loaded .*local file"):
        list(iter_texts("hf:org/corpus"))


# --- source errors -------------------------------------------------------------------------


def test_missing_path_fails_at_the_call(tmp_path):
    with pytest.raises(LmcError, match=r"data path .*nope\.txt' does not exist"):
        iter_texts(tmp_path / "nope.txt")


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("empty.txt", "", r"data file .*empty.txt is empty"),
        (
            "bad.jsonl",
            '{"text": "ok"}\n{"text": oops}\n',
            r"line 2 of .*bad.jsonl is not valid JSON",
        ),
        (
            "fields.jsonl",
            '{"body": "x", "id": 3}\n',
            r"line 1 of .*fields.jsonl has no field 'text' \(fields: body, id\); pass --field",
        ),
        ("number.jsonl", '{"text": 5}\n', r"field 'text' of line 1 .* is a int, not a string"),
        ("list.jsonl", '["text"]\n', r"line 1 of .*list.jsonl is not a JSON object"),
        ("data.json", '{"text": "x"}', r"cannot read .*data.json as data: write it as JSON Lines"),
    ],
)
def test_bad_files_give_one_line_errors(tmp_path, name, content, error):
    path = write(tmp_path / name, content)
    with pytest.raises(LmcError, match=error) as raised:
        list(iter_texts(path))
    assert "\n" not in str(raised.value)


def test_binary_file_is_not_text(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(LmcError, match="is not UTF-8 text"):
        list(iter_texts(path))


def test_folder_without_usable_files(tmp_path):
    write(tmp_path / "table.csv", "a,b\n")
    write(tmp_path / "empty.md", "")
    with pytest.raises(LmcError, match=r"holds no non-empty \.txt, \.md, \.jsonl files"):
        list(iter_texts(tmp_path))


def test_datasets_not_installed(tmp_path, monkeypatch):
    datasets.Dataset.from_dict({"text": ["x"]}).save_to_disk(tmp_path / "ds")
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(LmcError, match="pip install datasets"):
        list(iter_texts(tmp_path / "ds"))


# --- sequences and splits ------------------------------------------------------------------


def test_split_of_assigns_blocks_of_eight():
    assert BLOCK == 8
    assert {split_of(i) for i in range(8)} == {"test"}
    assert {split_of(i) for i in range(8, 16)} == {"validation"}
    assert {split_of(i) for i in range(16, 80)} == {"train"}
    assert (split_of(80), split_of(87), split_of(88), split_of(96)) == (
        "test",
        "test",
        "validation",
        "train",
    )
    counts = [sum(split_of(i) == s for i in range(800)) for s in SPLITS]
    assert counts == [640, 80, 80]


def test_splits_are_deterministic_disjoint_and_cover_the_stream(tmp_path, tokenizer):
    path = write(tmp_path / "book.txt", BOOK[:20000])
    config = DataConfig(source=str(path), seq_len=16)
    everything = list(iter_sequences(iter_texts(path), tokenizer, 16))
    assert len(everything) > 200
    loaded = {split: load_split(config, tokenizer, split) for split in SPLITS}
    for split, tensor in loaded.items():
        expected = [s for i, s in enumerate(everything) if split_of(i) == split]
        assert tensor.dtype == torch.long and tensor.shape == (len(expected), 16)
        assert tensor.tolist() == expected
        assert load_split(config, tokenizer, split).equal(tensor)
    assert sum(len(t) for t in loaded.values()) == len(everything)


def test_max_sequences_stops_reading_early(tmp_path, tokenizer):
    rows = [{"text": line} for line in BOOK[:4000].splitlines() if line]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with open(path, "a", encoding="utf-8") as fp:
        fp.write("this line is not JSON\n")
    config = DataConfig(source=str(path), seq_len=8)
    first = load_split(config, tokenizer, "test", max_sequences=3)
    texts = [row["text"] for row in rows]
    assert first.tolist() == list(iter_sequences(texts, tokenizer, 8))[:3]  # indices 0-2: test
    # Without the limit the whole file is read, up to its bad last line.
    with pytest.raises(LmcError, match=r"line \d+ of .*rows.jsonl is not valid JSON"):
        load_split(config, tokenizer, "test")


def test_text_shorter_than_one_sequence(tmp_path, tokenizer):
    text = "Hello there, a short text.\n"
    path = write(tmp_path / "short.txt", text)
    count = len(ids(tokenizer, text))
    with pytest.raises(
        LmcError,
        match=rf"yields {count} tokens, fewer than one sequence of 128; give more text or a "
        r"smaller --seq-len",
    ):
        load_split(DataConfig(source=str(path)), tokenizer, "test")


def test_empty_split_says_how_much_text_is_missing(tmp_path, tokenizer):
    path = write(tmp_path / "small.txt", BOOK[:250])
    total = len(list(iter_sequences(iter_texts(path), tokenizer, 32)))
    assert 1 <= total < BLOCK
    config = DataConfig(source=str(path), seq_len=32)
    assert len(load_split(config, tokenizer, "test")) == total
    with pytest.raises(LmcError, match=rf"gives {total} sequences of 32 tokens, none in the 'va"):
        load_split(config, tokenizer, "validation")
    with pytest.raises(LmcError, match=rf"at least {(2 * BLOCK + 1 - total) * 32} more tokens"):
        load_split(config, tokenizer, "train")


def test_bad_split_and_sequence_length(tokenizer):
    with pytest.raises(LmcError, match="unknown split 'dev'; use one of train, validation, test"):
        load_split(DataConfig(), tokenizer, "dev")
    with pytest.raises(LmcError, match="sequence length 1 is too short"):
        DataConfig(seq_len=1)


def test_a_spread_sample_reads_every_text_in_equal_interleaved_shares(tmp_path, tokenizer):
    books = [b.read_text(encoding="utf-8")[:20_000] for b in bundled_text_files()[:2]]
    paths = [str(write(tmp_path / f"{n}.txt", book)) for n, book in enumerate(books)]
    config = DataConfig(source=paths, seq_len=16)
    sequences, read = sample_split(config, tokenizer, "train", 10)
    assert read == [(paths[0], 5), (paths[1], 5)]
    own = [
        {
            tuple(s)
            for s in load_split(DataConfig(source=p, seq_len=16), tokenizer, "train").tolist()
        }
        for p in paths
    ]
    rows = [tuple(s) for s in sequences.tolist()]
    source = [0 if s in own[0] else 1 if s in own[1] else None for s in rows]
    assert source == [0, 1] * 5  # every batch mixes the texts
    # Each share is spread over its text, not its first sequences.
    first = load_split(DataConfig(source=paths[0], seq_len=16), tokenizer, "train", 5)
    assert not torch.equal(sequences[0::2], first)
    assert sequences[0::2].tolist()[0] == first.tolist()[0]
    # The default is the bundled corpus: each of its files gets a share.
    _, bundled = sample_split(DataConfig(seq_len=16), tokenizer, "train", 7)
    assert [name for name, _ in bundled] == [p.name for p in bundled_text_files()]
    assert sum(count for _, count in bundled) == 7


def test_a_list_of_sources_reads_one_after_another(tmp_path, tokenizer):
    a, b = write(tmp_path / "a.txt", "one two three\n"), write(tmp_path / "b.txt", "four five\n")
    assert list(iter_texts([str(a), str(b)])) == ["one two three\n", "four five\n"]
    assert DataConfig(source=[str(a), str(b)]).describe() == f"{a}, {b}"
    with pytest.raises(LmcError, match="does not exist"):
        iter_texts([str(a), str(tmp_path / "missing.txt")])


def test_describe():
    assert DataConfig().describe() == "bundled corpus"
    assert DataConfig(source="/data/a.txt").describe() == "/data/a.txt"
    assert DataConfig(source="rows.jsonl", field="body").describe() == "rows.jsonl (field 'body')"


# --- the models' tokenizer -----------------------------------------------------------------


def model_folder(folder: Path, vocab_size: int = 300, book: int = 0, tokenizer: bool = True):
    """A folder that looks like a checkpoint to load_tokenizer (config.json, tokenizer files)."""
    write(folder / "config.json", json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    if tokenizer:
        save_tokenizer(folder, book=book)
    return folder


def test_models_share_their_tokenizer(tmp_path, tokenizer):
    a, b = model_folder(tmp_path / "a"), model_folder(tmp_path / "b")
    shared = load_tokenizer([a, str(b)])
    assert shared.get_vocab() == tokenizer.get_vocab()
    assert shared.eos_token_id == tokenizer.eos_token_id
    assert shared("Sir Walter", add_special_tokens=False)["input_ids"] == ids(
        tokenizer, "Sir Walter"
    )


def test_different_tokenizers_are_refused(tmp_path):
    a, b = model_folder(tmp_path / "a"), model_folder(tmp_path / "b", book=1)
    with pytest.raises(
        LmcError, match=f"tokenizers of {re.escape(str(a))} and {re.escape(str(b))} differ"
    ):
        load_tokenizer([a, b])


def test_missing_tokenizer_is_refused(tmp_path):
    a, b = model_folder(tmp_path / "a"), model_folder(tmp_path / "b", tokenizer=False)
    with pytest.raises(
        LmcError, match=f"evaluation needs the model's tokenizer, but {re.escape(str(b))} has no"
    ):
        load_tokenizer([a, b])


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    folder = model_folder(tmp_path / "a", vocab_size=96)
    with pytest.raises(LmcError, match="has 300 tokens but the model's vocab_size is 96"):
        load_tokenizer([folder])


def test_missing_model_folder_is_refused(tmp_path):
    with pytest.raises(LmcError, match="does not exist"):
        load_tokenizer([tmp_path / "nowhere"])
