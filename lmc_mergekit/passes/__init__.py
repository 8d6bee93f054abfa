"""Pre-merge passes: each plugin method's whole-model work before mergekit combines tensors.

A pass takes the recipe's input checkpoints and writes one prepared checkpoint per input into
the folders it is given; :mod:`lmc_mergekit.plugin.pipeline` caches and feeds them to mergekit.
"""

from __future__ import annotations

from collections.abc import Callable

from lmc_mergekit.passes import lmc_dm, ls_merge, subclone
from lmc_mergekit.passes.context import PassContext

PASSES: dict[str, Callable[[PassContext], None]] = {
    "lmc_dm": lmc_dm.run,
    "subclone_compensate": subclone.run,
    "ls_merge": ls_merge.run,
}

__all__ = ["PASSES", "PassContext"]
