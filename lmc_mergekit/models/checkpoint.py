"""Reading and writing checkpoint folders (safetensors, single file or sharded)."""

from __future__ import annotations

import copy
import functools
import json
import math
import shutil
import zlib
from pathlib import Path

import torch
from mergekit.io import TensorWriter
from mergekit.io.lazy_tensor_loader import ShardedTensorIndex
from safetensors import SafetensorError, safe_open

from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.keys import size_and_mtime
from lmc_mergekit.runtime.provenance import PROVENANCE_FILE

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files that travel with a checkpoint and that no transform changes.
TAGALONG_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    # A multimodal model's image processor (Gemma 3).
    "preprocessor_config.json",
    "processor_config.json",
)


def model_dir(path: str | Path) -> Path:
    """The checkpoint folder ``path``, or a one-line error saying what is wrong with it."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise LmcError(f"model path {str(path)!r} does not exist; give a local checkpoint folder")
    if not folder.is_dir():
        raise LmcError(f"model path {str(path)!r} is not a folder; give a checkpoint folder")
    if not (folder / "config.json").is_file():
        raise LmcError(f"{str(path)!r} has no config.json; is it a Hugging Face checkpoint folder?")
    return folder.resolve()


def read_config(folder: Path) -> dict:
    """The raw config.json of a checkpoint folder, or a one-line error if it is not JSON. Read
    once a process while the file is unchanged (its size and time): a recipe's stages ask for
    every input's many times. Each caller gets a copy of its own to change."""
    path = folder / "config.json"
    return copy.deepcopy(_parsed_config(path, size_and_mtime(path)))


@functools.lru_cache(maxsize=64)
def _parsed_config(path: Path, stamp: tuple[int, int]) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LmcError(
            f"{path} is not valid JSON ({error}); repair it or save the checkpoint again"
        ) from None
    if not isinstance(config, dict):
        raise LmcError(f"{path} is not a JSON object; repair it or save the checkpoint again")
    return config


def stored_dtype(folder: Path) -> torch.dtype:
    """The dtype a checkpoint's config.json says its weights are stored in (float32 if none)."""
    config = read_config(folder)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def checkpoint_bytes(folder: Path) -> int:
    """The bytes of a checkpoint's weights on disk (its safetensors files)."""
    return sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))


def row_slices(tensor: torch.Tensor, elements: int) -> list[slice]:
    """Slices of ``tensor``'s rows of about ``elements`` elements each (one row at least; a
    0-d tensor is one whole slice): how large tensors are read, compared or merged a piece
    at a time."""
    if tensor.dim() == 0 or len(tensor) == 0:
        return [slice(None)]
    step = max(1, elements // max(1, tensor[0].numel()))
    return [slice(start, min(start + step, len(tensor))) for start in range(0, len(tensor), step)]


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite: its least and greatest values are (a NaN
    anywhere makes both NaN). ``aminmax`` reads the tensor once and copies nothing: 25 times
    quicker than ``isfinite(...).all()`` on a bf16 embedding, which makes a mask of its size."""
    if tensor.numel() == 0:
        return True
    least, greatest = torch.aminmax(tensor)
    return bool(torch.isfinite(least) & torch.isfinite(greatest))


def check_checkpoint(folder: Path) -> None:
    """A one-line error unless ``folder``'s config.json and every safetensors file it has (or
    its index names) can be read: caught before any work instead of half-way through it."""
    read_config(folder)
    index_path = folder / SAFETENSORS_INDEX
    shards = sorted(folder.glob("*.safetensors"))
    expected: dict[str, set[str]] = {}
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            for name, shard in weight_map.items():
                expected.setdefault(shard, set()).add(name)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise LmcError(
                f"{index_path} is not a valid safetensors index (JSON with a weight_map); "
                "repair it or save the checkpoint again"
            ) from None
        for shard in sorted(expected):
            if not (folder / shard).is_file():
                raise LmcError(
                    f"{index_path.name} in {folder} names the shard {shard!r}, which is "
                    "missing; copy the whole checkpoint again"
                )
        shards = [folder / shard for shard in sorted(expected)]
    for shard in shards:
        names = _safetensors_names(shard)
        missing = sorted(expected.get(shard.name, set()) - names)
        if missing:
            raise LmcError(
                f"{shard} lacks {missing[0]!r}, which {SAFETENSORS_INDEX} puts there; "
                "copy the whole checkpoint again"
            )


def _safetensors_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file's header, or a one-line error if it is corrupt."""
    try:
        with safe_open(str(path), "pt") as fp:
            return set(fp.keys())
    except (SafetensorError, OSError) as error:
        raise LmcError(
            f"{path} is not a readable safetensors file ({str(error).splitlines()[0]}); it is "
            "truncated or corrupt: copy or save the checkpoint again"
        ) from None


def first_non_finite(folder: Path) -> tuple[str, int] | None:
    """The first floating tensor of the checkpoint in ``folder`` (safetensors or pickled
    shards) that holds NaN or Inf values, and how many; None when every value is finite."""
    counts: dict[str, int] = {}
    for name, tensor in _stored_tensors(folder):
        counts.setdefault(name, 0)
        # Counted only where a value is not finite: the count makes a mask of the slice.
        if tensor.is_floating_point() and not all_finite(tensor):
            counts[name] += int((~torch.isfinite(tensor)).sum())
    return next(((name, count) for name, count in counts.items() if count), None)


#: Elements of a stored tensor read at a time when scanning a checkpoint.
SCAN_ELEMENTS = 2**24


def _stored_tensors(folder: Path):
    """Every stored tensor, a slice of rows of a safetensors tensor (or one pickled shard) at
    a time: scanning a merged model holds a slice, not a whole embedding."""
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fp:
            shapes = {name: fp.get_slice(name).get_shape() for name in fp.keys()}
        for name, shape in shapes.items():
            rows = shape[0] if shape else 1
            step = max(1, SCAN_ELEMENTS // max(1, math.prod(shape[1:])))
            for start in range(0, rows, step):
                with safe_open(str(shard), "pt") as fp:
                    part = fp.get_slice(name)
                    yield name, part[start : start + step] if shape else fp.get_tensor(name)
    for shard in sorted(folder.glob("*.bin")):
        yield from torch.load(shard, map_location="cpu", weights_only=True).items()


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint folder, checked for NaN and Inf on read.

    ``aliases`` (name → stored name) make stored tensors readable under a second name too: a
    tied checkpoint's embedding as the LM head an untied one stores."""

    def __init__(self, folder: Path, aliases: dict[str, str] | None = None):
        self.folder = folder
        self._aliases = dict(aliases or {})
        if not any(folder.glob("*.safetensors")):
            raise LmcError(
                f"{folder} holds no .safetensors weights; convert it with "
                "transformers' save_pretrained(..., safe_serialization=True)"
            )
        index = ShardedTensorIndex.from_disk(str(folder))
        self._paths = {
            name: Path(index.base_path) / shard for name, shard in index.tensor_paths.items()
        }
        self._names = set(index.tensor_paths) | self._aliases.keys()
        self._checked: set[str] = set()  # passes read some tensors every round: check once

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores a tensor under ``name``."""
        return name in self._names

    @property
    def names(self) -> frozenset[str]:
        """Every stored tensor name (and alias)."""
        return frozenset(self._names)

    @property
    def aliases(self) -> frozenset[str]:
        """The names that are aliases of stored tensors."""
        return frozenset(self._aliases)

    def get(self, name: str, optional: bool = False) -> torch.Tensor | None:
        """The tensor ``name``; None for a missing optional one. A large tensor is read a
        slice of :data:`SCAN_ELEMENTS` at a time, each through its own mapping of the shard,
        so that the pages mapped at once (which count as this process's memory) are a slice's,
        not a whole embedding's."""
        if name not in self._names:
            if optional:
                return None
            raise LmcError(f"{self.folder} lacks tensor {name!r}; is the checkpoint complete?")
        name = self._aliases.get(name, name)
        with safe_open(str(self._path(name)), "pt") as fp:
            shape = fp.get_slice(name).get_shape()
            whole = len(shape) < 2 or math.prod(shape) <= SCAN_ELEMENTS
            tensor = fp.get_tensor(name) if whole else None
        if tensor is None:
            step = max(1, SCAN_ELEMENTS // math.prod(shape[1:]))
            first = self._slice(name, 0, step)
            tensor = first.new_empty(shape)
            tensor[:step] = first
            for start in range(step, shape[0], step):
                tensor[start : start + step] = self._slice(name, start, start + step)
        if name not in self._checked:
            self._check_finite(name, tensor)
            self._checked.add(name)
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of the tensor ``name`` (read from its shard's header)."""
        with safe_open(str(self._path(name)), "pt") as fp:
            return tuple(fp.get_slice(self._aliases.get(name, name)).get_shape())

    def rows(
        self, name: str, start: int, stop: int, within: tuple[slice, ...] = ()
    ) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor ``name``, read alone: a slice of a whole embedding
        costs the slice, not the embedding. The rows are of the first dimension, or with
        ``within`` (slices of the leading dimensions) of the dimension after them."""
        tensor = self._slice(name, start, stop, within)
        self._check_finite(name, tensor)
        return tensor

    def flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the tensor ``name`` flattened, reading only the rows
        they lie in."""
        shape = self.shape(name)
        if not shape:
            return self.get(name).reshape(-1)[start:stop]
        width = math.prod(shape[1:])
        first = start // width
        values = self.rows(name, first, -(-stop // width)).reshape(-1)
        return values[start - first * width : stop - first * width]

    def _slice(self, name: str, start: int, stop: int, within: tuple[slice, ...] = ()):
        with safe_open(str(self._path(name)), "pt") as fp:
            return fp.get_slice(self._aliases.get(name, name))[(*within, slice(start, stop))]

    def _path(self, name: str) -> Path:
        if name not in self._names:
            raise LmcError(f"{self.folder} lacks tensor {name!r}; is the checkpoint complete?")
        return self._paths[self._aliases.get(name, name)]

    def _check_finite(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point() and not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            raise LmcError(
                f"{self.folder}: tensor {name!r} holds {bad} NaN/Inf values; "
                "the checkpoint is corrupt or diverged, repair or replace it"
            )


class MetaReader:
    """Stands in for a :class:`CheckpointReader` and reads nothing: every tensor is an empty
    meta tensor of its stored shape, remembered by name, so that which stored tensor an adapter
    puts where (as it is) can be found without reading one."""

    def __init__(self, reader: CheckpointReader):
        self._reader = reader
        self._given: dict[str, torch.Tensor] = {}

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def get(self, name: str, optional: bool = False) -> torch.Tensor | None:
        """An empty meta tensor of ``name``'s shape; None for a missing optional one."""
        if optional and not self._reader.has(name):
            return None
        self._given[name] = torch.empty(self._reader.shape(name), device="meta")
        return self._given[name]

    def name_of(self, tensor: torch.Tensor) -> str | None:
        """The stored tensor ``tensor`` is, as given out (None for anything else)."""
        return next((name for name, given in self._given.items() if given is tensor), None)


class RowsReader:
    """A :class:`CheckpointReader` that gives rows ``start:stop`` of the tensor ``name``, and
    every other tensor whole: an adapter reading a part through it builds the part with a
    slice of that matrix (a few thousand rows of an embedding, not all of them)."""

    def __init__(self, reader: CheckpointReader, name: str, start: int, stop: int):
        self._reader, self._name, self._rows = reader, name, (start, stop)

    def __getattr__(self, name: str):
        return getattr(self._reader, name)

    def get(self, name: str, optional: bool = False) -> torch.Tensor | None:
        """Rows of the sliced tensor, or any other tensor whole."""
        if name == self._name:
            return self._reader.rows(name, *self._rows)
        return self._reader.get(name, optional)


class ShardWriter:
    """Writes tensors into size-limited safetensors shards (mergekit's own writer). With
    ``verify``, the CRC-32 of every tensor's bytes is noted as it is handed in, and
    :meth:`close` reads every one back from the finished shards and compares."""

    def __init__(self, folder: Path, max_shard_size: int, verify: bool = False):
        self._folder = folder
        self._writer = TensorWriter(str(folder), max_shard_size=max_shard_size)
        self._max = max_shard_size
        self._crcs: dict[str, int] | None = {} if verify else None

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue tensors; a shard is flushed to disk as soon as it is full."""
        for name, tensor in tensors.items():
            tensor = tensor.contiguous()
            self.note(name, tensor)
            self._writer.save_tensor(name, tensor)
            # mergekit flushes a full shard only when the next tensor arrives, so a tensor
            # larger than a shard (a whole embedding) would stay in memory while the next part
            # is computed. Flushed now, the shards hold the same tensors.
            if self._writer.current_shard_size >= self._max:
                with self._writer._lock:
                    self._writer._flush_current_shard()

    def sink(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSink:
        """A sink that takes tensor ``name``'s flat values in order, a slice at a time (use it
        as a context manager). One at least a shard large goes straight into a shard of its
        own, so that it is never held whole; a smaller one is gathered and queued."""
        return TensorSink(self, name, shape, dtype)

    def _own_shard(self, name: str, nbytes: int) -> Path:
        """The file of a new shard that holds ``name`` alone (``nbytes`` of data), numbered
        and indexed as mergekit's writer numbers and indexes its own."""
        writer = self._writer
        with writer._lock:
            writer._flush_current_shard()
            prefix, extension = writer._get_name_components()
            shard = f"{prefix}-{writer.shards_written + 1}.{extension}"
            writer.shards_written += 1
            writer.weight_map[name] = shard
            writer.total_size += nbytes
        return Path(writer.out_path) / shard

    def note(self, name: str, values: torch.Tensor) -> None:
        """Fold the bytes of ``values`` (the next ones of tensor ``name``) into its CRC."""
        if self._crcs is not None:
            self._crcs[name] = zlib.crc32(_bytes(values), self._crcs.get(name, 0))

    def close(self) -> None:
        """Flush the last shard, write the index and, with ``verify``, check every tensor."""
        self._writer.finalize()
        if self._crcs is not None:
            self.verify()

    def verify(self) -> None:
        """Raise unless every tensor written reads back, byte for byte, as it was handed in
        (read a slice of rows at a time)."""
        reader = CheckpointReader(self._folder)
        for name, expected in self._crcs.items():
            crc = 0
            shape = reader.shape(name)
            if len(shape) < 2:
                crc = zlib.crc32(_bytes(reader.get(name)))
            else:
                step = max(1, SCAN_ELEMENTS // math.prod(shape[1:]))
                for start in range(0, shape[0], step):
                    crc = zlib.crc32(_bytes(reader.rows(name, start, start + step)), crc)
            if crc != expected:
                raise LmcError(
                    f"{self._folder.name}: tensor {name!r} reads back from its shard other than "
                    "it was written (a failing disk or a concurrent writer); nothing was kept"
                )


#: safetensors' names of the dtypes a sink streams.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


class TensorSink:
    """One tensor of a :class:`ShardWriter`, taken as flat values in order (see
    :meth:`ShardWriter.sink`); on leaving the ``with`` block every value must have come."""

    def __init__(self, writer: ShardWriter, name: str, shape: tuple[int, ...], dtype):
        self.name, self.shape, self.dtype = name, tuple(shape), dtype
        self.numel, self.filled = math.prod(shape), 0
        self._writer = writer
        nbytes = self.numel * dtype.itemsize
        self._buffer, self._file = None, None
        if nbytes < writer._max or dtype not in _SAFETENSORS_DTYPES:
            self._buffer = torch.empty(self.numel, dtype=dtype)
            return
        header = {
            "__metadata__": {"format": "pt"},
            name: {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(self.shape),
                "data_offsets": [0, nbytes],
            },
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        self._file = writer._own_shard(name, nbytes).open("wb")
        self._file.write(len(text).to_bytes(8, "little") + text)

    def __enter__(self) -> TensorSink:
        return self

    def write(self, values: torch.Tensor) -> None:
        """The next ``values.numel()`` values of the tensor (any shape, cast to its dtype)."""
        flat = values.detach().reshape(-1).to(self.dtype)
        if self.filled + flat.numel() > self.numel:
            raise ValueError(f"{self.name}: more values than its shape {self.shape} holds")
        if self._buffer is not None:
            self._buffer[self.filled : self.filled + flat.numel()] = flat
        else:
            self._writer.note(self.name, flat)
            self._file.write(_bytes(flat))
        self.filled += flat.numel()

    def __exit__(self, error_type, error, trace) -> None:
        if self._file is not None:
            self._file.close()
        if error_type is not None:
            return
        if self.filled != self.numel:
            raise ValueError(f"{self.name}: {self.filled} of its {self.numel} values came")
        if self._buffer is not None:
            self._writer.write({self.name: self._buffer.reshape(self.shape)})
            self._buffer = None


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor (as safetensors stores them)."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def link_checkpoint(source: Path, target: Path) -> None:
    """``target``, a new folder, holding a link to every entry of the checkpoint folder
    ``source`` but its provenance marker: the checkpoint as stored, for a reader such as
    mergekit, without a copy (a marker written into ``target`` later stays there)."""
    target.mkdir(parents=True)
    for entry in sorted(Path(source).absolute().iterdir()):
        if entry.name != PROVENANCE_FILE:
            (target / entry.name).symlink_to(entry)


def copy_tagalong_files(source: Path, target: Path) -> None:
    """Copy tokenizer and generation-config files from ``source`` to ``target``."""
    for name in TAGALONG_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
