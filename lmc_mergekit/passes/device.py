"""Where the plugin's passes compute."""

from __future__ import annotations

import os

import torch
from mergekit.options import MergeOptions

from lmc_mergekit.evaluation.loss import resolve_device


def pass_device(options: MergeOptions) -> torch.device:
    """mergekit's ``--device``, else the GPU with ``--cuda`` or when there is one (under a
    launcher with one GPU per process, this process's)."""
    device = resolve_device(options.device or ("cuda" if options.cuda else "auto"))
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device
