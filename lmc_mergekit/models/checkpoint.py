"""Reading and writing checkpoint folders (safetensors, single file or sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from mergekit.io import TensorWriter
from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex
from safetensors import SafetensorError, safe_open

from lmc_mergekit.errors import LmcError

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
    """The raw config.json of a checkpoint folder, or a one-line error if it is not JSON."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LmcError(
            f"{path} is not valid JSON ({error}); repair it or save the checkpoint again"
        ) from None
    if not isinstance(config, dict):
        raise LmcError(f"{path} is not a JSON object; repair it or save the checkpoint again")
    return config


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
    for name, tensor in _stored_tensors(folder):
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return name, bad
    return None


def _stored_tensors(folder: Path):
    """Every stored tensor, one safetensors tensor (or one pickled shard) at a time."""
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fp:
            for name in fp.keys():
                yield name, fp.get_tensor(name)
    for shard in sorted(folder.glob("*.bin")):
        yield from torch.load(shard, map_location="cpu", weights_only=True).items()


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint folder, checked for NaN and Inf on read."""

    def __init__(self, folder: Path):
        self.folder = folder
        if not any(folder.glob("*.safetensors")):
            raise LmcError(
                f"{folder} holds no .safetensors weights; convert it with "
                "transformers' save_pretrained(..., safe_serialization=True)"
            )
        index = ShardedTensorIndex.from_disk(str(folder))
        self._loader = LazyTensorLoader(index, lazy_unpickle=False)
        self._names = set(index.tensor_paths)
        self._checked: set[str] = set()  # passes read some tensors every round: check once

    def has(self, name: str) -> bool:
        """Whether the checkpoint stores a tensor under ``name``."""
        return name in self._names

    def get(self, name: str, optional: bool = False) -> torch.Tensor | None:
        """The tensor ``name``; None for a missing optional one."""
        if name not in self._names:
            if optional:
                return None
            raise LmcError(f"{self.folder} lacks tensor {name!r}; is the checkpoint complete?")
        tensor = self._loader.get_tensor(name)
        # Closing the shard unmaps it: pages of a kept mapping count as this process's memory,
        # and would add up to the whole checkpoint over a pass.
        self._loader.flush()
        if name not in self._checked and tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                bad = int((~torch.isfinite(tensor)).sum())
                raise LmcError(
                    f"{self.folder}: tensor {name!r} holds {bad} NaN/Inf values; "
                    "the checkpoint is corrupt or diverged, repair or replace it"
                )
            self._checked.add(name)
        return tensor


class ShardWriter:
    """Writes tensors into size-limited safetensors shards (mergekit's own writer)."""

    def __init__(self, folder: Path, max_shard_size: int):
        self._writer = TensorWriter(str(folder), max_shard_size=max_shard_size)

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue tensors; full shards are flushed to disk as they fill."""
        for name, tensor in tensors.items():
            self._writer.save_tensor(name, tensor.contiguous())

    def close(self) -> None:
        """Flush the last shard and write the index."""
        self._writer.finalize()


def copy_tagalong_files(source: Path, target: Path) -> None:
    """Copy tokenizer and generation-config files from ``source`` to ``target``."""
    for name in TAGALONG_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
