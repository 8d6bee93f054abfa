"""Where the plugin's passes compute."""

from __future__ import annotations

import torch
from mergekit.options import MergeOptions

from lmc_mergekit.evaluation.loss import resolve_device
from lmc_mergekit.runtime.distributed import process_device


def pass_device(options: MergeOptions) -> torch.device:
    """mergekit's ``--device``, else the GPU with ``--cuda`` or when there is one (under a
    launcher with one GPU per process, this process's)."""
    return process_device(resolve_device(options.device or ("cuda" if options.cuda else "auto")))


def with_default_device(
    options: MergeOptions, device_given: bool, gpu_available: bool | None = None
) -> MergeOptions:
    """``options`` for a plugin recipe: the device the user chose, else the GPU when there is
    one (``gpu_available``, asked of torch when None). mergekit's option validator turns an
    absent ``--device`` into ``cpu``, so only the caller can tell "not given" from "cpu"."""
    if device_given:
        return options
    if gpu_available is None:
        gpu_available = torch.cuda.is_available()
    return options.model_copy(update={"device": "cuda" if gpu_available else "cpu"})
