"""The mergekit merge methods that combine what the plugin's pre-merge passes prepared.

Each refuses inputs its own pass did not prepare (they carry a provenance mark, see
:mod:`lmc_mergekit.runtime.provenance`): given raw checkpoints by anything that bypasses the
pass (mergekit's planner called directly, its unrouted ``run_merge``) it would silently compute
a meaningless merge. The refusal comes while mergekit plans the merge, before it writes
anything, as a one-line click error.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

import click
import torch
from mergekit.common import ModelReference
from mergekit.merge_methods.api import merge_tensors
from mergekit.merge_methods.base import (
    GroupMergeMethod,
    InputContract,
    MergeMethodSpec,
    ParameterScope,
    ParameterSpec,
    PerInputValues,
    TensorGroup,
)

from lmc_mergekit.latent.store import open_store
from lmc_mergekit.latent.tensor_merge import merge_key
from lmc_mergekit.models.checkpoint import row_slices
from lmc_mergekit.runtime.provenance import prepared_by

#: Elements of each input merged at a time by the prepared-input methods.
MERGE_ELEMENTS = 1 << 24


class PluginOnly(click.ClickException):
    """A plugin method called on inputs its pre-merge pass did not prepare (plain mergekit)."""


class PreparedInputMerge(GroupMergeMethod):
    """Weighted average of prepared inputs, per tensor, with mergekit's own ``linear`` kernel."""

    #: Parameters besides ``weight`` and ``normalize``.
    extra_parameters: ClassVar[tuple[ParameterSpec, ...]] = ()

    def __init__(self, name: str, pretty_name: str, reference_url: str):
        self.spec = MergeMethodSpec(
            name=name,
            parameters=(
                ParameterSpec("weight", float, ParameterScope.INPUT, default=1.0),
                ParameterSpec("normalize", bool, ParameterScope.SHARED, default=True),
                *self.extra_parameters,
            ),
            contract=InputContract(min_inputs=1),
            pretty_name=pretty_name,
            reference_url=reference_url,
        )

    def validate_inputs(
        self,
        input_ids: Sequence[Hashable],
        base_id: Hashable | None = None,
        *,
        group_name: str | None = None,
    ) -> None:
        super().validate_inputs(input_ids, base_id, group_name=group_name)
        name = self.spec.name
        for ref in [*input_ids, base_id]:
            if isinstance(ref, ModelReference) and prepared_by(ref.model.path) != name:
                raise PluginOnly(
                    f"{name}: input {ref.model.path} did not come out of {name}'s pre-merge "
                    f"pass; {name} is an lmc-mergekit method: run the recipe with mergekit-yaml, "
                    "run_merge or lmc-mergekit-yaml, which run the pass first"
                )

    def merge_group(
        self, group: TensorGroup, /, weight: PerInputValues, normalize: bool
    ) -> torch.Tensor:
        parameters = {"weight": weight.values_for(group.entries), "normalize": normalize}
        tensors = list(group.tensors)
        slices = row_slices(tensors[0], MERGE_ELEMENTS)
        if len(slices) == 1:
            return merge_tensors(tensors, "linear", parameters=parameters)
        # The kernel sums in float32: elementwise, so a slice of rows at a time gives the same
        # tensor without a float32 sum (and addends) of a whole vocabulary at once.
        merged = None
        for rows in slices:
            piece = merge_tensors([t[rows] for t in tensors], "linear", parameters=parameters)
            if merged is None:
                merged = piece.new_empty(tensors[0].shape)
            merged[rows] = piece
        return merged


class LatentMerge(PreparedInputMerge):
    """``ls_merge``: each input's latents of the tensor (its posterior mean, or the mean of
    ``samples`` posterior draws), averaged with the inputs' weights, decoded by the
    autoencoder that encoded them (plus the inputs' averaged reconstruction residuals unless
    ``residuals`` is false). The tensors mergekit loads (each input's own encode–decode)
    only fix the output's shape and dtype; those with no latents (outside the canonical
    view: a vision tower) are the inputs' weighted average."""

    extra_parameters: ClassVar[tuple[ParameterSpec, ...]] = (
        ParameterSpec("samples", int, ParameterScope.SHARED, default=0),
        ParameterSpec("seed", int, ParameterScope.SHARED, default=0),
        ParameterSpec("residuals", bool, ParameterScope.SHARED, default=True),
    )

    def merge_group(
        self,
        group: TensorGroup,
        /,
        weight: PerInputValues,
        normalize: bool,
        samples: int,
        seed: int,
        residuals: bool,
    ) -> torch.Tensor:
        like = group.entries[0].tensor
        folders = [entry.id.model.path for entry in group.entries]
        if not any(open_store(folder).has(group.metadata.name) for folder in folders):
            return super().merge_group(group, weight=weight, normalize=normalize)
        merged = merge_key(
            group.metadata.name,
            folders,
            list(weight.values_for(group.entries)),
            normalize,
            samples,
            seed,
            residuals,
            like.device,
            like.dtype,
        )
        return merged.to(device=like.device, dtype=like.dtype)
