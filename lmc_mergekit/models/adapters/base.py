"""The adapter interface: one checkpoint layout in, the canonical view out, and back."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import (
    CheckpointReader,
    MetaReader,
    RowsReader,
    ShardWriter,
    copy_tagalong_files,
    read_config,
)
from lmc_mergekit.models.view import (
    ROW_FIELDS,
    VOCAB_ROWS,
    Block,
    Embeddings,
    Head,
    ModelSpec,
    ModelView,
    Norm,
    row_chunks,
    sliced_rows,
)
from lmc_mergekit.runtime.keys import size_and_mtime

# Prepared checkpoints are written in shards of 256 MiB: the writer holds one shard and, while
# it writes it, a serialised copy, so this is the memory writing needs beyond one block.
DEFAULT_SHARD_SIZE = 256 * 1024**2
# Rotary settings as config.json stored them before transformers 5's ``rope_parameters``.
# (transformers 5 reads ``rope_scaling`` in preference to ``rope_parameters``, so it must go too.)
LEGACY_ROPE_KEYS = (
    "rope_theta",
    "rotary_emb_base",
    "rotary_pct",
    "partial_rotary_factor",
    "rope_scaling",
)


class Adapter(ABC):
    """Maps one family of checkpoints to and from the canonical view.

    All checkpoint key names and tensor layouts of the family live in its adapter.
    """

    #: ``model_type`` values in config.json that this adapter reads.
    model_types: tuple[str, ...] = ()
    #: config.json key holding the norm epsilon.
    eps_key: str = ""
    #: Checkpoint keys that ``transformers`` modules name differently in their state dict.
    module_names: ClassVar[dict[str, str]] = {}
    #: Paths, in the ``transformers`` module, of the parts of layer 0 whose activations size
    #: conversion observes: ``block`` (its output is the residual stream after the block),
    #: ``attn_out`` and ``mlp_out`` (the projections writing to the residual stream; their input
    #: is what they read) and ``mlp_norm`` (its input is the residual stream the MLP reads).
    block_modules: ClassVar[dict[str, str]] = {}
    #: Whether the family derives the head size from the width (``hidden_size / heads``)
    #: rather than storing it in config.json.
    head_dim_from_hidden: ClassVar[bool] = True
    #: config.json keys of the model's sizes, and the :class:`ModelSpec` field each holds.
    size_keys: ClassVar[dict[str, str]] = {}
    #: The config.json key under which a multimodal family nests its text model's config
    #: (sizes, norm epsilon, rotary settings); None where they sit at the top level.
    text_config_key: ClassVar[str | None] = None

    def text_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The config of the text model, the canonical view's (``config`` itself unless the
        family nests it)."""
        return config if self.text_config_key is None else getattr(config, self.text_config_key)

    def module_key(self, key: str) -> str:
        """The name that the stock ``transformers`` module of the text config gives checkpoint
        key ``key`` (what the block runner loads block weights under)."""
        return self.module_names.get(key, key)

    def passthrough_keys(self, stored: Iterable[str]) -> dict[str, str]:
        """The tensors outside the canonical view that every writer carries through unchanged
        (a multimodal model's vision tower), chosen from a checkpoint's ``stored`` key names:
        written name → stored name. Text-only families have none."""
        return {}

    def passthrough(self, reader: CheckpointReader) -> Iterator[tuple[str, torch.Tensor]]:
        """(written name, tensor) of every tensor :meth:`passthrough_keys` names, one at a
        time."""
        for written, stored in self.passthrough_keys(reader.names).items():
            yield written, reader.get(stored)

    @abstractmethod
    def spec_from_config(self, config: PretrainedConfig) -> ModelSpec:
        """The structural facts of a model of this family."""

    @abstractmethod
    def read_embeddings(self, reader: CheckpointReader, spec: ModelSpec) -> Embeddings: ...

    @abstractmethod
    def read_block(self, reader: CheckpointReader, spec: ModelSpec, index: int) -> Block: ...

    @abstractmethod
    def read_head(self, reader: CheckpointReader, spec: ModelSpec) -> Head: ...

    @abstractmethod
    def tie_keys(self, reader: CheckpointReader) -> tuple[str, str]:
        """The key ``reader``'s checkpoint stores its LM head under (or would, untied), and the
        key of the token embeddings that a tied head reads."""

    def head_key(self, reader: CheckpointReader, spec: ModelSpec) -> str:
        """The stored tensor the LM head of ``reader``'s checkpoint reads."""
        head, embeddings = self.tie_keys(reader)
        return embeddings if spec.tied_embeddings or not reader.has(head) else head

    @abstractmethod
    def embeddings_tensors(self, emb: Embeddings, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Checkpoint tensors for the embeddings."""

    @abstractmethod
    def block_tensors(self, block: Block, spec: ModelSpec, index: int) -> dict[str, torch.Tensor]:
        """Checkpoint tensors for block ``index``."""

    @abstractmethod
    def head_tensors(self, head: Head, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Checkpoint tensors for the final norm and, unless tied, the LM head."""

    def embedding_multiplier(self, hidden_size: int) -> float:
        """The constant a model of this family with ``hidden_size`` multiplies its token
        embeddings by (1: none)."""
        return 1.0

    def config_updates(self, spec: ModelSpec) -> dict:
        """config.json entries that follow from ``spec``, other than the rotary settings
        (transforms change the norm epsilon and the tying; size conversion the shape)."""
        sizes = {key: getattr(spec, field) for key, field in self.size_keys.items()}
        return {self.eps_key: spec.norm_eps, "tie_word_embeddings": spec.tied_embeddings, **sizes}

    def updated_config(self, raw: dict, spec: ModelSpec) -> dict:
        """The config.json ``raw`` of a model of this family rewritten to describe ``spec``
        (in the nested text config where the family has one; the tying at both levels, since
        the outer model is the one that ties).

        Rotary settings are rewritten (as transformers 5 ``rope_parameters``, the older keys
        dropped) only where ``spec`` changes the base or the rotary fraction.
        """
        if self.text_config_key is None:
            return self._updated_text_config(raw, spec)
        text = self._updated_text_config(raw[self.text_config_key], spec)
        return {**raw, self.text_config_key: text, "tie_word_embeddings": spec.tied_embeddings}

    def _updated_text_config(self, raw: dict, spec: ModelSpec) -> dict:
        config = {**raw, **self.config_updates(spec)}
        if spec.layer_types and isinstance(raw.get("layer_types"), list):
            config["layer_types"] = list(spec.layer_types)
        if not spec.rotary_dims:
            return config
        model_type = raw["model_type"]
        kwargs = {key: copy.deepcopy(value) for key, value in raw.items() if key != "model_type"}
        parsed = AutoConfig.for_model(model_type, **kwargs)
        # With parameters per attention type (Gemma 3) the spec holds the full-attention
        # layers' (size conversion keeps them all: it refuses to change their rotary pairs).
        current = rope_parameters(parsed)
        factor = rotary_factor(spec.rotary_dims, spec.head_dim)
        old_factor = current.get("partial_rotary_factor", 1.0)
        if current.get("rope_theta") == spec.rope_theta and old_factor == factor:
            return config
        params = dict(parsed.rope_parameters or {})
        for key in LEGACY_ROPE_KEYS:
            config.pop(key, None)
        params["rope_theta"] = spec.rope_theta
        if factor != 1.0 or "partial_rotary_factor" in params:
            params["partial_rotary_factor"] = factor
        config["rope_parameters"] = params
        return config

    def blockwise_problem(self, raw: dict) -> str | None:
        """Why blocks of the model with config.json ``raw`` cannot be run (or kept) one at a
        time, as size conversion does; None when they can."""
        return None

    # ---- shared machinery -------------------------------------------------------------

    def open(self, folder: Path, config: PretrainedConfig) -> CheckpointView:
        """A lazy canonical view of the checkpoint in ``folder``."""
        return CheckpointView(self, folder, self.spec_from_config(config))

    def save(
        self,
        view: ModelView,
        folder: Path,
        source: Path,
        max_shard_size: int = DEFAULT_SHARD_SIZE,
        progress: bool = True,
    ) -> ModelSpec:
        """Write ``view`` as a stock checkpoint of this family into ``folder``, part by part
        (a :class:`CheckpointSaver` fed the view's embeddings, blocks and head in turn).
        Returns the written spec."""
        saver = CheckpointSaver(self, folder, source, view.spec, max_shard_size)
        for chunk in row_chunks(view, "embeddings", VOCAB_ROWS):
            saver.embeddings(chunk)
        for index in tqdm(
            range(view.spec.num_layers), desc=f"writing {folder.name}", disable=not progress
        ):
            saver.block(index, view.block(index))
        for chunk in row_chunks(view, "head", VOCAB_ROWS):
            saver.head(chunk)
        return saver.close()


class CheckpointSaver:
    """Writes a stock checkpoint of ``adapter``'s family into ``folder`` as its parts are
    handed in: the embeddings and the head a slice of vocabulary rows at a time (each in
    order), the blocks one at a time, in any order between them.

    ``source`` supplies config.json (updated from the written spec), the tokenizer and
    generation-config files, and the tensors outside the canonical view (copied unchanged).
    Tied embeddings stay tied only where the written head equals the written embedding (each
    slice compared as it comes: no second vocabulary matrix unless they differ); otherwise the
    output is untied. With ``verify``, every written tensor is read back and compared, byte
    for byte, with what was handed in (:meth:`ShardWriter.verify`).
    """

    def __init__(
        self,
        adapter: Adapter,
        folder: Path,
        source: Path,
        spec: ModelSpec,
        max_shard_size: int = DEFAULT_SHARD_SIZE,
        verify: bool = False,
    ):
        self.adapter, self.folder, self.source, self.spec = adapter, folder, source, spec
        folder.mkdir(parents=True, exist_ok=True)
        self._writer = ShardWriter(folder, max_shard_size, verify)
        self._embeddings = _Rows(spec.vocab_size, "tokens")
        self._head = _Rows(spec.vocab_size, "weight")
        #: The written token rows while a tied head is compared with them.
        self._tokens: torch.Tensor | None = None
        self._tied = spec.tied_embeddings  # until a head slice differs from the tokens

    def embeddings(self, chunk: Embeddings) -> None:
        """The next slice of the embeddings' vocabulary rows (the other tensors whole); the
        embeddings are written with the last one."""
        whole = self._embeddings.add(chunk)
        if whole is not None:
            self._writer.write(self.adapter.embeddings_tensors(whole, self.spec))
            self._tokens = whole.tokens if self._tied else None

    def block(self, index: int, block: Block) -> None:
        """Block ``index``, written at once."""
        self._writer.write(self.adapter.block_tensors(block, self.spec, index))

    def head(self, chunk: Head) -> None:
        """The next slice of the head's vocabulary rows (the final norm whole); the head is
        written with the last one, tied where every slice equalled the tokens."""
        if self._tied:
            start, tokens = self._head.filled, self._tokens
            stop = start + len(chunk.weight)
            if (
                chunk.bias is not None
                or tokens is None
                or not torch.equal(chunk.weight, tokens[start:stop])
            ):
                # Untied from here on: the slices so far were the tokens.
                self._tied = False
                self._head.keep_from(tokens[:start] if tokens is not None else None)
        whole = self._head.add(chunk, keep=not self._tied)
        if whole is None:
            return
        if self._tied:
            whole = replace(whole, weight=self._tokens)
        else:
            self.spec = replace(self.spec, tied_embeddings=False)
        self._tokens = None
        self._writer.write(self.adapter.head_tensors(whole, self.spec))

    def close(self) -> ModelSpec:
        """Copy the tensors outside the canonical view, finish the shards (and verify them),
        write config.json and the tag-along files; the written spec."""
        if not (self._embeddings.done and self._head.done):
            raise LmcError(f"{self.folder}: the embeddings or the head were not handed in whole")
        for name, tensor in self.adapter.passthrough(CheckpointReader(self.source)):
            self._writer.write({name: tensor})
        self._writer.close()
        config = self.adapter.updated_config(read_config(self.source), self.spec)
        with open(self.folder / "config.json", "w", encoding="utf-8") as fp:
            json.dump(config, fp, indent=2, sort_keys=True)
            fp.write("\n")
        copy_tagalong_files(self.source, self.folder)
        return self.spec


class _Rows:
    """A part (embeddings or head) gathered from slices of its vocabulary rows (``field``, and
    a head's bias), filled in place; the part's other tensors come from its first slice."""

    def __init__(self, count: int, field: str):
        self.count, self.field, self.filled = count, field, 0
        self.first = None
        self.matrix: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.done = False

    def keep_from(self, rows: torch.Tensor | None) -> None:
        """Keep the slices counted so far after all: they are ``rows``."""
        if rows is not None and len(rows):
            self.matrix = rows.new_empty((self.count, *rows.shape[1:]))
            self.matrix[: len(rows)] = rows

    def add(self, chunk, keep: bool = True):
        """Take the next slice (its rows only counted unless ``keep``); the whole part once
        the last one has come (its matrix None if no slice was kept), else None."""
        piece = getattr(chunk, self.field)
        start, self.filled = self.filled, self.filled + len(piece)
        if self.filled > self.count:
            raise LmcError(f"{self.filled} vocabulary rows handed in for {self.count}")
        self.first = self.first or chunk
        if keep:
            if self.matrix is None:
                self.matrix = piece.new_empty((self.count, *piece.shape[1:]))
            self.matrix[start : self.filled] = piece
            bias = getattr(chunk, "bias", None)
            if bias is not None:
                if self.bias is None:
                    self.bias = bias.new_empty(self.count)
                self.bias[start : self.filled] = bias
        if self.filled < self.count:
            return None
        changes = {self.field: self.matrix}
        if self.bias is not None:
            changes["bias"] = self.bias
        part = replace(self.first, **changes)
        self.first, self.matrix, self.bias, self.done = None, None, None, True
        return part


def first_present(reader: CheckpointReader, names: Iterable[str]) -> str:
    """The first of ``names`` that ``reader``'s checkpoint stores (the first of all where it
    stores none, so that reading it names the expected tensor in its error)."""
    names = list(names)
    return next((name for name in names if reader.has(name)), names[0])


def read_norm(reader: CheckpointReader, name: str) -> Norm:
    """The norm stored as ``name.weight`` (and ``name.bias`` where there is one)."""
    return Norm(reader.get(name + ".weight"), reader.get(name + ".bias", optional=True))


class CheckpointView:
    """A :class:`ModelView` that reads each part from a checkpoint folder when asked."""

    def __init__(self, adapter: Adapter, folder: Path, spec: ModelSpec):
        self.adapter = adapter
        self.folder = folder
        self.spec = spec
        self._reader = CheckpointReader(folder)

    def embeddings(self) -> Embeddings:
        return self.adapter.read_embeddings(self._reader, self.spec)

    def block(self, index: int) -> Block:
        if not 0 <= index < self.spec.num_layers:
            raise IndexError(index)
        return self.adapter.read_block(self._reader, self.spec, index)

    def head(self) -> Head:
        return self.adapter.read_head(self._reader, self.spec)

    def row_chunks(self, read: str, rows: int) -> Iterator[Embeddings | Head]:
        """See :func:`~lmc_mergekit.models.view.row_chunks`: where the checkpoint stores the
        matrix as it is (and the part has no bias), each slice is read alone; otherwise the
        part is read whole once and sliced."""
        traced = MetaReader(self._reader)
        part = getattr(self.adapter, f"read_{read}")(traced, self.spec)
        name = traced.name_of(getattr(part, ROW_FIELDS[read]))
        if name is None or getattr(part, "bias", None) is not None:
            yield from sliced_rows(getattr(self, read)(), read, rows)
            return
        count = self._reader.shape(name)[0]
        for start in range(0, count, rows):
            piece = RowsReader(self._reader, name, start, min(start + rows, count))
            yield getattr(self.adapter, f"read_{read}")(piece, self.spec)

    def passthrough(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(written name, tensor) of every tensor outside the canonical view, one at a time:
        what every writer copies unchanged."""
        return self.adapter.passthrough(self._reader)


def load_config(folder: Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of ``folder``; remote code runs only if the user allowed it.
    Parsed once a process while config.json is unchanged (its size and time); each caller gets
    a copy of its own to change."""
    path = Path(folder) / "config.json"
    stamp = size_and_mtime(path) if path.is_file() else None
    return copy.deepcopy(_parsed_config(Path(folder), stamp, trust_remote_code))


@functools.lru_cache(maxsize=64)
def _parsed_config(
    folder: Path, stamp: tuple[int, int] | None, trust_remote_code: bool
) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(
            os.fspath(folder), trust_remote_code=trust_remote_code, local_files_only=True
        )
    except ValueError as error:
        raise LmcError(
            f"cannot read the config of {folder}: {str(error).splitlines()[0]}"
        ) from None


def rotary_factor(rotary_dims: int, head_dim: int) -> float:
    """The ``partial_rotary_factor`` from which transformers computes exactly ``rotary_dims``
    (``int(head_dim · factor)``; the plain ratio can round down by one)."""
    factor = rotary_dims / head_dim
    while int(head_dim * factor) < rotary_dims:
        factor = math.nextafter(factor, 2.0)
    return factor


def rope_parameters(config: PretrainedConfig) -> dict:
    """A config's rotary parameters (transformers 5 ``rope_parameters``); for families with one
    set per attention type (Gemma 3), the full-attention layers'."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        return params.get("full_attention") or next(iter(params.values()))
    return params


def rope_type(config: PretrainedConfig) -> str:
    """The rotary type (``default``, ``llama3``, ``yarn``, ...), or ``per-layer-type`` where
    the attention types have rotary parameters of their own."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        return "per-layer-type"
    return params.get("rope_type", "default")


def rope_theta(config: PretrainedConfig) -> float:
    """The rotary base of a config (transformers 5 ``rope_parameters`` or older keys)."""
    params = rope_parameters(config)
    for value in (
        params.get("rope_theta"),
        getattr(config, "rope_theta", None),
        getattr(config, "rotary_emb_base", None),
    ):
        if value is not None:
            return float(value)
    return 10000.0


def rotary_dims(config: PretrainedConfig, head_dim: int) -> int:
    """Rotary dimensions per head from a config (transformers 5 ``rope_parameters`` or older)."""
    params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    dims = int(head_dim * (1.0 if factor is None else factor))
    if dims % 2:
        raise LmcError(f"rotary dimensions per head are odd ({dims}); rotary pairs are undefined")
    return dims
