"""The ``ls_merge`` pre-merge pass: encode weights into an autoencoder's latent space."""

from __future__ import annotations

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.passes.context import PassContext


def run(ctx: PassContext) -> None:
    """Validate the inputs; the latent encoding is not implemented yet."""
    for path in ctx.inputs:
        open_model(path, ctx.options.trust_remote_code)
    raise LmcError("ls_merge: latent-space merging is not implemented yet in this version")
