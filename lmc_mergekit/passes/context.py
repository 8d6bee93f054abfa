"""What every pre-merge pass receives."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mergekit.options import MergeOptions

from lmc_mergekit.distributed import Processes
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import CheckpointView, open_model
from lmc_mergekit.plugin.recipe import Recipe, Section


def pass_device(options: MergeOptions):
    """Where passes compute: mergekit's ``--device``, else the GPU with ``--cuda`` or when there
    is one."""
    from lmc_mergekit.evaluation.loss import resolve_device

    device = resolve_device(options.device or ("cuda" if options.cuda else "auto"))
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # one GPU per process
    return device


@dataclass(frozen=True)
class PassContext:
    """What a pass gets: inputs (recipe order), where to write each, settings, mergekit options,
    a folder for its report (copied next to the merged model), a folder for resumable state
    that survives an interrupted run (removed once the pass succeeds), the method's cache
    folder (for artefacts that recipes over the same models share), the recipe's base model,
    and the processes of a distributed run (only the main one writes outputs)."""

    method: str
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]
    settings: Section
    options: MergeOptions
    report_dir: Path
    state_dir: Path
    cache_dir: Path
    base_model: Path | None = None
    processes: Processes = field(default_factory=Processes)

    def open_inputs(self) -> list[CheckpointView]:
        """Views of every input, refused unless they share one architecture and shape."""
        views = [open_model(path, self.options.trust_remote_code) for path in self.inputs]
        first = views[0]
        for view in views[1:]:
            if view.spec.architecture != first.spec.architecture:
                raise LmcError(
                    f"{self.method} needs models of one architecture: {first.folder.name} is "
                    f"{first.spec.architecture}, {view.folder.name} is {view.spec.architecture}"
                )
            mismatch = first.spec.shape_mismatch(view.spec)
            if mismatch is not None:
                key, a, b = mismatch
                raise LmcError(
                    f"{self.method} needs models of one shape: {key} is {a} in "
                    f"{first.folder.name} but {b} in {view.folder.name}"
                )
        return views


@dataclass(frozen=True)
class FinishContext:
    """What a pass's finishing step gets once mergekit has written the merged model: its
    folder, the recipe, the original inputs, mergekit's options and the prepared checkpoint
    of every input (keyed by the input's path)."""

    folder: Path
    recipe: Recipe
    inputs: tuple[Path, ...]
    options: MergeOptions
    prepared: dict[str, Path] = field(default_factory=dict)


@dataclass(frozen=True)
class PreMergePass:
    """A method's pre-merge pass, an optional step after the merge that completes its report
    in the output folder and returns a Markdown section for the model card, and the card's
    sentence on how each prepared checkpoint was checked."""

    run: Callable[[PassContext], None]
    finish: Callable[[FinishContext], str] | None = None
    checked: str = "Every prepared checkpoint was checked to reproduce its source's logits."
