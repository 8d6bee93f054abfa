"""The ``subclone_compensate`` pre-merge pass: a large model turned into a smaller one."""

from __future__ import annotations

from lmc_mergekit.errors import LmcError
from lmc_mergekit.passes.context import PassContext


def run(ctx: PassContext) -> None:
    """Validate the donors; the conversion itself is not implemented yet."""
    ctx.open_inputs()
    raise LmcError(
        "subclone_compensate: the size conversion is not implemented yet in this version"
    )
