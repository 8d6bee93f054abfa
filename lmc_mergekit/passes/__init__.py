"""Pre-merge passes: each plugin method's whole-model work before mergekit combines tensors.

A pass takes the recipe's input checkpoints and writes one prepared checkpoint per input into
the folders it is given; :mod:`lmc_mergekit.plugin.pipeline` caches and feeds them to mergekit.
"""

from __future__ import annotations

from lmc_mergekit.passes import lmc_dm, ls_merge, subclone
from lmc_mergekit.passes.context import FinishContext, PassContext, PreMergePass

PASSES: dict[str, PreMergePass] = {
    "lmc_dm": PreMergePass(run=lmc_dm.run, finish=lmc_dm.finish),
    "subclone_compensate": PreMergePass(
        run=subclone.run,
        finish=subclone.finish,
        checked="Each converted checkpoint is a smaller model, not a copy of its donor's "
        "function; it was reloaded through transformers and checked to compute the logits "
        "the conversion computed.",
    ),
    "ls_merge": PreMergePass(
        run=ls_merge.run,
        finish=ls_merge.finish,
        checked="Each prepared checkpoint is its input encoded and decoded by the weight "
        "autoencoder, a lossy step (its test loss is in the report); every checkpoint tensor "
        "was checked to be rebuilt exactly from the canonical pieces the latents encode.",
    ),
}

__all__ = ["PASSES", "FinishContext", "PassContext", "PreMergePass"]
