"""One plain training step against one learned-matching step, timed in the calling process.

Shared by ``learned_matching.py step`` and ``scale.py``: each runs :func:`time_step` in a fresh
process per kind, so that each process's peak RSS belongs to one kind of step.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from lmc_mergekit.evaluation.selfcheck import load_fp32
from lmc_mergekit.matching.align import block_runner
from lmc_mergekit.matching.interpolation import InterpolationObjective, autocast_dtype
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.group import DEFAULT_FAMILIES
from lmc_mergekit.symmetry.parametrize import LearnedSymmetry


def time_step(
    mode: str,
    folders: list[Path],
    batch: torch.Tensor,
    repeats: int = 10,
    warmup: int = 3,
    device: str = "cpu",
    optimizer: str = "adamw",
) -> dict[str, float]:
    """Median seconds of one step and this process's peak RSS (MiB). ``train``: forward,
    backward and ``optimizer`` (``adamw``, or ``sgd`` where AdamW's float32 state does not fit)
    of the first model on ``batch``; ``align``: the same (AdamW) for the symmetries
    of both models (dual, the default families; the first's scale excepted, as learned
    matching has them) through the interpolated model at λ = 0.5. On a GPU both run under bf16
    autocast, as learned matching does there."""
    device = torch.device(device)
    batch = batch.to(device)
    dtype = autocast_dtype("auto", device)  # learned matching's default for the device
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    if mode == "train":
        model = load_fp32(folders[0]).to(device).train()
        kind = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        optimizer = kind(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            with autocast:
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
    else:
        views = [open_model(f) for f in folders]
        absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
        ends = [apply_transform(view, absorb) for view in views]
        spec = ends[0].spec
        runner = block_runner(views[0], spec, device)
        first = tuple(family for family in DEFAULT_FAMILIES if family != "scale")
        symmetries = [LearnedSymmetry(spec, first), LearnedSymmetry(spec, DEFAULT_FAMILIES)]
        objective = InterpolationObjective(ends, symmetries, runner, autocast=dtype)
        objective.symmetries.to(device)
        optimizer = torch.optim.AdamW(objective.symmetries.parameters(), lr=1e-4)
        weights = torch.tensor([0.5, 0.5], device=device)

        def step():
            optimizer.zero_grad()
            with autocast:
                loss = objective(weights, batch)
            loss.backward()
            optimizer.step()

    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": sorted(samples)[len(samples) // 2], "peak_mib": peak}
