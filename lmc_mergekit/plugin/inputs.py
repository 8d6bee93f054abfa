"""The models a recipe names, wherever it names them, and their checks before any work.

A mergekit recipe names models under ``models:``, ``base_model:``, slices and ``modules:``, and
in its tokenizer settings (``tokenizer: source:``, ``tokens: …: source:``, plain or as
``kind: model_token``). Every one of them is a mergekit ``ModelReference``; walking the parsed
configuration by type finds them all, so a plugin recipe's inputs are swapped for their
prepared checkpoints everywhere at once, and every local model is checked before mergekit or a
pre-merge pass reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from pydantic import BaseModel

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import check_checkpoint, model_dir


def map_references(node, change: Callable[[ModelReference], ModelReference]):
    """``node`` (a mergekit configuration or any part of it) with every model reference ``r``
    replaced by ``change(r)``; parts without references are returned as they are."""
    if isinstance(node, ModelReference):
        return change(node)
    if isinstance(node, BaseModel):
        updates = {}
        for name in type(node).model_fields:
            value = getattr(node, name)
            changed = map_references(value, change)
            if changed is not value:
                updates[name] = changed
        return node.model_copy(update=updates) if updates else node
    if isinstance(node, list | tuple):
        items = [map_references(item, change) for item in node]
        same = all(a is b for a, b in zip(items, node, strict=True))
        return node if same else type(node)(items)
    if isinstance(node, dict):
        items = {key: map_references(value, change) for key, value in node.items()}
        return node if all(items[k] is node[k] for k in node) else items
    return node


def references(config: MergeConfiguration) -> list[ModelReference]:
    """Every model reference in ``config``, in order of first appearance."""
    found: list[ModelReference] = []

    def note(ref: ModelReference) -> ModelReference:
        if ref not in found:
            found.append(ref)
        return ref

    map_references(config, note)
    return found


def is_hub_id(path: str) -> bool:
    """Whether ``path`` names a Hub repository rather than a local folder: no such local path
    exists and it has the form of a repository id (asked without any network)."""
    if Path(path).expanduser().exists():
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def check_models(config: MergeConfiguration) -> None:
    """A one-line error for a model that is neither a readable local checkpoint nor a Hub id
    mergekit can fetch (what a built-in method's recipe names; LoRA adapters are left to
    mergekit)."""
    for ref in references(config):
        path = ref.model.path
        if Path(path).expanduser().exists():
            check_checkpoint(model_dir(path))
        elif not is_hub_id(path):
            model_dir(path)  # the one-line error for a path that does not exist


def expand_home(config: MergeConfiguration) -> MergeConfiguration:
    """``config`` with ``~`` expanded in model paths (mergekit would take them for Hub ids)."""

    def expand(ref: ModelReference) -> ModelReference:
        if not ref.model.path.startswith("~"):
            return ref
        path = ref.model.model_copy(update={"path": str(Path(ref.model.path).expanduser())})
        return ref.model_copy(update={"model": path})

    return map_references(config, expand)


def plugin_inputs(config: MergeConfiguration, method: str) -> list[Path]:
    """The distinct checkpoint folders a plugin recipe merges, in recipe order (the base model
    first); ``config``'s models are local folders (see :mod:`lmc_mergekit.plugin.resolve`)."""
    if config.slices or config.modules or not config.models:
        raise LmcError(
            f"{method} recipes list whole models under 'models:'; slices are not supported"
        )
    refs = [entry.model for entry in config.models]
    if config.base_model is not None:
        refs.insert(0, config.base_model)
    paths: list[Path] = []
    for ref in refs:
        path = model_dir(ref.model.path)
        if path not in paths:
            paths.append(path)
    return paths


def with_prepared(config: MergeConfiguration, prepared: dict[Path, Path]) -> MergeConfiguration:
    """``config`` with every reference to an input (``prepared``'s keys, resolved folders)
    replaced by its prepared checkpoint."""

    def swap(ref: ModelReference) -> ModelReference:
        if ref.lora is None and Path(ref.model.path).expanduser().exists():
            target = prepared.get(model_dir(ref.model.path))
            if target is not None:
                return ModelReference.model_validate(str(target))
        return ref

    return map_references(config, swap)
