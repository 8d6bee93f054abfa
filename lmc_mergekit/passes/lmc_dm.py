"""The ``lmc_dm`` pre-merge pass: move every input into one basin by symmetries."""

from __future__ import annotations

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.passes.context import PassContext
from lmc_mergekit.symmetry import Transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint


def run(ctx: PassContext) -> None:
    """Write one aligned checkpoint per input (``matching: none`` writes them unmoved)."""
    views = ctx.open_inputs()
    if len(views) < 2:
        raise LmcError("lmc_dm merges two or more models; the recipe lists one")
    if ctx.settings.matching != "none":
        raise LmcError(
            f"lmc_dm: alignment matching {ctx.settings.matching!r} is not implemented yet in "
            "this version; use 'matching: none' for the unaligned baseline"
        )
    for view, out in zip(views, ctx.outputs, strict=True):
        transform_checkpoint(
            view.folder,
            out,
            Transform.identity(view.spec.num_layers),
            max_shard_size=min(ctx.options.out_shard_size, DEFAULT_SHARD_SIZE),
            progress=not ctx.options.quiet,
            trust_remote_code=ctx.options.trust_remote_code,
        )
