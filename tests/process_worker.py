"""One process of a multi-process test, started by the test with a launcher's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). It joins the group
through the real :func:`~lmc_mergekit.runtime.distributed.processes`, aligns the models named on
its command line with the real :func:`~lmc_mergekit.matching.align.align` and writes what it got
for the test to compare across processes.

    python process_worker.py OUT MODEL...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lmc_mergekit.matching import align as align_module
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.distributed import close_processes, process_device, processes
from lmc_mergekit.symmetry.transform import save_transform


def _not_here(*args, **kwargs):
    raise AssertionError("weight matching ran outside the main process")


def main() -> None:
    out, models = Path(sys.argv[1]), [Path(m) for m in sys.argv[2:]]
    procs = processes(torch.device("cpu"))
    try:
        if not procs.is_main:  # the main process's result must arrive instead
            align_module.match_weights = _not_here
        views = [open_model(m) for m in models]
        config = align_module.AlignConfig()
        alignment = align_module.align(views, config, processes=procs, progress=False)
        for index, transform in enumerate(alignment.matched):
            save_transform(transform, out / f"rank{procs.rank}-{index}.safetensors")
        facts = {
            "rank": procs.rank,
            "world_size": procs.world_size,
            # The accelerator this rank would take from its LOCAL_RANK.
            "cuda": str(process_device(torch.device("cuda"))),
            "matching": alignment.matching,
        }
        (out / f"rank{procs.rank}.json").write_text(json.dumps(facts))
    finally:
        close_processes()


if __name__ == "__main__":
    main()
