"""Reading and writing checkpoint folders (safetensors, single file or sharded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from mergekit.io import TensorWriter
from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex

from lmc_mergekit.errors import LmcError

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
    """The raw config.json of a checkpoint folder."""
    with open(folder / "config.json", encoding="utf-8") as fp:
        return json.load(fp)


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
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise LmcError(
                f"{self.folder}: tensor {name!r} holds {bad} NaN/Inf values; "
                "the checkpoint is corrupt or diverged, repair or replace it"
            )
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
