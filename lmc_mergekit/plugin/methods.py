"""The plugin's merge methods, registered into mergekit's method registry.

Each method combines inputs that its own pre-merge pass wrote (they carry a provenance file,
:data:`PROVENANCE_FILE`) and refuses anything else: run through plain ``mergekit-yaml`` on raw
checkpoints, they would silently compute a meaningless average.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch
from mergekit import merge_methods
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

PROVENANCE_FILE = "lmc_prepared.json"

METHODS = {
    "lmc_dm": ("LMC-DM (dual learned matching)", "https://arxiv.org/abs/2606.23607"),
    "subclone_compensate": (
        "Subclone + least-squares compensation",
        "https://arxiv.org/abs/2608.02829",
    ),
    "ls_merge": ("LS-Merge (latent-space merging)", "https://openreview.net/forum?id=VSDV0SWwOC"),
}


@cache
def prepared_by(path: str) -> str | None:
    """The method whose pre-merge pass wrote the model folder ``path``, if any."""
    marker = Path(path) / PROVENANCE_FILE
    if not marker.is_file():
        return None
    with open(marker, encoding="utf-8") as fp:
        return json.load(fp).get("method")


def write_provenance(folder: Path, method: str, details: dict[str, Any]) -> None:
    """Mark ``folder`` as prepared by ``method``'s pre-merge pass."""
    with open(folder / PROVENANCE_FILE, "w", encoding="utf-8") as fp:
        json.dump({"method": method, **details}, fp, indent=2, sort_keys=True)


def _spec(name: str, *extra: ParameterSpec) -> MergeMethodSpec:
    pretty, url = METHODS[name]
    return MergeMethodSpec(
        name=name,
        parameters=(
            ParameterSpec("weight", float, ParameterScope.INPUT, default=1.0),
            ParameterSpec("normalize", bool, ParameterScope.SHARED, default=True),
            *extra,
        ),
        contract=InputContract(min_inputs=1),
        pretty_name=pretty,
        reference_url=url,
    )


class PreparedInputMerge(GroupMergeMethod):
    """Weighted average of prepared inputs, per tensor, with mergekit's own ``linear`` kernel."""

    def __init__(self, name: str):
        self.spec = _spec(name)

    def check_prepared(self, group: TensorGroup) -> list[str]:
        """The input folders, refused unless this method's pre-merge pass wrote them."""
        paths = [entry.id.model.path for entry in group.entries]
        for path in paths:
            if prepared_by(path) != self.spec.name:
                raise ValueError(
                    f"{self.spec.name}: input {path} did not come out of {self.spec.name}'s "
                    "pre-merge pass; run the recipe with lmc-mergekit-yaml, not mergekit-yaml"
                )
        return paths

    def merge_group(
        self, group: TensorGroup, /, weight: PerInputValues, normalize: bool
    ) -> torch.Tensor:
        self.check_prepared(group)
        return merge_tensors(
            group.tensors,
            "linear",
            parameters={"weight": weight.values_for(group.entries), "normalize": normalize},
        )


class LatentMerge(PreparedInputMerge):
    """``ls_merge``: each input's latents of the tensor (its posterior mean, or the mean of
    ``samples`` posterior draws), averaged with the inputs' weights, decoded by the
    autoencoder that encoded them (plus the inputs' averaged reconstruction residuals unless
    ``residuals`` is false). The tensors mergekit loads (each input's own encode–decode)
    only fix the output's shape and dtype."""

    def __init__(self):
        self.spec = _spec(
            "ls_merge",
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
        from lmc_mergekit.latent.tensor_merge import merge_key

        paths = self.check_prepared(group)
        like = group.entries[0].tensor
        merged = merge_key(
            group.metadata.name,
            paths,
            list(weight.values_for(group.entries)),
            normalize,
            samples,
            seed,
            residuals,
            like.device,
        )
        return merged.to(device=like.device, dtype=like.dtype)


def register_methods() -> None:
    """Register the plugin's methods with mergekit (importing twice is harmless)."""
    known = {method.spec.name for method in merge_methods.registered_methods()}
    for name in METHODS:
        if name not in known:
            merge_methods.register(
                LatentMerge() if name == "ls_merge" else PreparedInputMerge(name)
            )
