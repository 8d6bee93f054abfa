"""Where calibration and evaluation text comes from: files, folders, datasets, the bundled corpus.

Everything streams, so a multi-gigabyte corpus is never held in memory: plain text is read in
pieces of about :data:`TEXT_PIECE_CHARS` characters ending at line boundaries (each piece counts
as one document), JSON Lines line by line, and ``datasets`` datasets row by row.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmc_mergekit.data.corpus import bundled_text_files
from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.keys import content_key, size_and_mtime

TEXT_PIECE_CHARS = 1 << 20
FOLDER_SUFFIXES = (".txt", ".md", ".jsonl")
HUB_PREFIX = "hf:"
# Files that datasets' save_to_disk writes (a Dataset, or a DatasetDict of them).
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
# Files with these suffixes are structured data that reading as text would silently garble.
REFUSED_SUFFIXES = {
    ".json": "write it as JSON Lines (.jsonl), one object per line",
    ".parquet": "load it with datasets and save_to_disk, then pass that folder",
    ".arrow": "load it with datasets and save_to_disk, then pass that folder",
}


#: Text a method reads: one source (a path, ``hf:NAME``), several, or None (the bundled corpus).
Source = str | Path | list | tuple | None


def source_parts(source: Source) -> list[str | Path]:
    """The texts a calibration mixes: each source of a list, each file of the bundled corpus,
    or the one source."""
    if source is None:
        return list(bundled_text_files())
    return list(source) if isinstance(source, list | tuple) else [source]


def data_fingerprint(source: Source, field: str = "text") -> str:
    """A short hex key of the text ``source`` names: the bundled corpus (file names and sizes),
    a Hub dataset's name, or the path, field and every file's name, size and modification
    time (of each source, for several)."""
    if isinstance(source, list | tuple):
        return content_key({"sources": [data_fingerprint(s, field) for s in source]}, 12)
    if source is None:
        payload: dict = {"bundled": [[p.name, p.stat().st_size] for p in bundled_text_files()]}
    elif str(source).startswith(HUB_PREFIX):  # a Hub dataset: only its name is known here
        payload = {"hub": str(source), "field": field}
    else:
        path = Path(source).expanduser().absolute()
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        payload = {
            "source": str(path),
            "field": field,
            "files": [
                [p.relative_to(path).as_posix() if p != path else p.name, *size_and_mtime(p)]
                for p in files
                if p.is_file()
            ],
        }
    return content_key(payload, 12)


def iter_texts(source: Source, field: str = "text") -> Iterator[str]:
    """Yield the documents of ``source``, streaming.

    ``source`` is ``None`` (the bundled corpus), a text file, a ``.jsonl`` file (``obj[field]``
    of each line), a folder saved by ``datasets``' ``save_to_disk`` (``row[field]``), any other
    folder (its ``*.txt``, ``*.md`` and ``*.jsonl`` files, recursively, sorted by relative path),
    ``hf:NAME[:SPLIT]`` (a Hub dataset, streamed), or a list of these (one after another). Bad
    input raises a one-line :class:`LmcError`.
    """
    # Not a generator itself, so that a wrong path fails at the call rather than on first use.
    if isinstance(source, list | tuple):
        return itertools.chain.from_iterable([iter_texts(s, field) for s in source])
    if source is None:
        return _iter_bundled()
    if isinstance(source, str) and source.startswith(HUB_PREFIX):
        return _iter_hub_dataset(source, field)
    path = Path(source).expanduser()
    if not path.exists():
        raise LmcError(f"data path {str(source)!r} does not exist; give a text file or folder")
    return _iter_folder(path, field) if path.is_dir() else _iter_file(path, field)


def _iter_bundled() -> Iterator[str]:
    for path in bundled_text_files():
        yield from _iter_text_file(path)


def _iter_file(path: Path, field: str) -> Iterator[str]:
    if path.stat().st_size == 0:
        raise LmcError(f"data file {path} is empty")
    suffix = path.suffix.lower()
    if suffix in REFUSED_SUFFIXES:
        raise LmcError(f"cannot read {path} as data: {REFUSED_SUFFIXES[suffix]}")
    try:
        if suffix == ".jsonl":
            yield from _iter_jsonl(path, field)
        else:
            yield from _iter_text_file(path)
    except UnicodeDecodeError:
        raise LmcError(
            f"data file {path} is not UTF-8 text; give a text, .jsonl or datasets source"
        ) from None


def _iter_text_file(path: Path) -> Iterator[str]:
    """Pieces of about TEXT_PIECE_CHARS characters, cut after a newline where there is one."""
    with open(path, encoding="utf-8") as fp:
        piece: list[str] = []
        size = 0
        while line := fp.readline(TEXT_PIECE_CHARS):  # bounded even for one endless line
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
        if piece:
            yield "".join(piece)


def _iter_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="strict") as fp:
        for number, line in enumerate(fp, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise LmcError(
                    f"line {number} of {path} is not valid JSON ({error.msg}); "
                    "a .jsonl file holds one JSON object per line"
                ) from None
            if not isinstance(row, dict):
                raise LmcError(f"line {number} of {path} is not a JSON object")
            yield _text_field(row, field, f"line {number} of {path}")


def _iter_folder(folder: Path, field: str) -> Iterator[str]:
    if any((folder / name).is_file() for name in SAVED_DATASET_MARKERS):
        yield from _iter_saved_dataset(folder, field)
        return
    files = [
        path
        for path in sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).as_posix())
        if path.suffix.lower() in FOLDER_SUFFIXES
        and path.is_file()
        # Hidden files and folders (.git, editor backups) are not data.
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
        and path.stat().st_size > 0
    ]
    if not files:
        raise LmcError(
            f"data folder {folder} holds no non-empty {', '.join(FOLDER_SUFFIXES)} files "
            "and is not a saved datasets dataset"
        )
    for path in files:
        yield from _iter_file(path, field)


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise LmcError(
            "reading datasets needs the datasets package; pip install datasets"
        ) from None
    return datasets


def _iter_saved_dataset(folder: Path, field: str) -> Iterator[str]:
    datasets = _import_datasets()
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as error:  # datasets raises many types for a broken folder
        raise LmcError(
            f"could not load the dataset saved in {folder} ({_first_line(error)}); "
            "save it again with datasets' save_to_disk"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = list(dataset)
        if "train" in dataset:
            dataset = dataset["train"]
        elif len(splits) == 1:
            dataset = dataset[splits[0]]
        else:
            raise LmcError(
                f"the dataset in {folder} has splits {', '.join(splits)} but no 'train'; "
                "save the split you want on its own"
            )
    if field not in dataset.column_names:
        raise LmcError(
            f"the dataset in {folder} has no field {field!r} "
            f"(fields: {', '.join(dataset.column_names)}); pass --field NAME"
        )
    number = 0
    for batch in dataset.select_columns([field]).iter(batch_size=1000):
        for value in batch[field]:
            number += 1
            yield _check_text(value, field, f"row {number} of the dataset in {folder}")


def _iter_hub_dataset(source: str, field: str) -> Iterator[str]:
    name, _, split = source[len(HUB_PREFIX) :].partition(":")
    if not name:
        raise LmcError(f"{source!r} names no dataset; write hf:NAME or hf:NAME:SPLIT")
    datasets = _import_datasets()
    number = 0
    try:
        for row in datasets.load_dataset(name, split=split or "train", streaming=True):
            number += 1
            yield _text_field(row, field, f"row {number} of {source}")
    except LmcError:
        raise
    except Exception as error:  # no network, unknown name, bad split: all end the same way
        raise LmcError(
            f"dataset {source!r} could not be loaded ({_first_line(error)}); "
            "give a local file or folder instead"
        ) from None
    if number == 0:
        raise LmcError(f"dataset {source!r} has no rows")


def _text_field(row: dict, field: str, where: str) -> str:
    if field not in row:
        raise LmcError(
            f"{where} has no field {field!r} (fields: {', '.join(map(str, row))}); "
            "pass --field NAME"
        )
    return _check_text(row[field], field, where)


def _check_text(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise LmcError(
            f"field {field!r} of {where} is a {type(value).__name__}, not a string; "
            "pass --field NAME of a text field"
        )
    return value


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
