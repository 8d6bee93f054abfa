"""The plugin's methods, one record each: the single source for registration in mergekit,
recipe validation and the pipeline. Adding a method means adding a record here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmc_mergekit.passes import ls_merge, subclone
from lmc_mergekit.passes.base import (
    Comparison,
    FinishContext,
    MeasureContext,
    PassContext,
    Report,
    Section,
    no_finish,
)
from lmc_mergekit.passes.lmc_dm import records as lmc_dm_records
from lmc_mergekit.passes.lmc_dm import settings as lmc_dm_settings
from lmc_mergekit.passes.lmc_dm import stages as lmc_dm_stages
from lmc_mergekit.plugin.merge_methods import LatentMerge, PreparedInputMerge
from lmc_mergekit.runtime.records import Record


def _no_comparisons(settings: Section, preparation: Record) -> list[Comparison]:
    return []


@dataclass(frozen=True)
class PluginMethod:
    """One plugin method: its mergekit name, card name and reference; its recipe section and
    that section's settings; the pre-merge pass (``prepare``, returning a ``preparation``
    record); the finishing step on the merged model (before it is measured); the measurement
    (returning a ``report``) and the comparison merges it needs; the mergekit method that
    combines the prepared inputs; and the card's sentence on how each prepared checkpoint was
    checked."""

    name: str
    pretty_name: str
    reference_url: str
    section: str
    settings: type[Section]
    prepare: Callable[[PassContext], Record | None]
    preparation: type[Record]
    measure: Callable[[MeasureContext], Report]
    report: type[Report]
    merge: type[PreparedInputMerge] = PreparedInputMerge
    comparisons: Callable[[Section, Record], list[Comparison]] = _no_comparisons
    finish: Callable[[FinishContext], Record | None] = no_finish
    checked: str = "Every prepared checkpoint was checked to reproduce its source's logits."

    def mergekit_method(self) -> PreparedInputMerge:
        """A fresh instance of the mergekit method, to register."""
        return self.merge(self.name, self.pretty_name, self.reference_url)


METHODS: tuple[PluginMethod, ...] = (
    PluginMethod(
        name="lmc_dm",
        pretty_name="LMC-DM (dual learned matching)",
        reference_url="https://arxiv.org/abs/2606.23607",
        section="alignment",
        settings=lmc_dm_settings.AlignmentSettings,
        prepare=lmc_dm_stages.prepare,
        preparation=lmc_dm_records.AlignmentPreparation,
        measure=lmc_dm_stages.measure,
        report=lmc_dm_records.AlignmentReport,
        finish=lmc_dm_stages.finish,
    ),
    PluginMethod(
        name="subclone_compensate",
        pretty_name="Subclone + least-squares compensation",
        reference_url="https://arxiv.org/abs/2608.02829",
        section="subclone",
        settings=subclone.SubcloneSettings,
        prepare=subclone.prepare,
        preparation=subclone.SubclonePreparation,
        measure=subclone.measure,
        report=subclone.SubcloneReport,
        checked="Each converted checkpoint is a smaller model, not a copy of its donor's "
        "function; it was reloaded through transformers and checked to compute the logits "
        "the conversion computed.",
    ),
    PluginMethod(
        name="ls_merge",
        pretty_name="LS-Merge (latent-space merging)",
        reference_url="https://openreview.net/forum?id=VSDV0SWwOC",
        section="latent",
        settings=ls_merge.LatentSettings,
        prepare=ls_merge.prepare,
        preparation=ls_merge.LatentPreparation,
        measure=ls_merge.measure,
        report=ls_merge.LatentReport,
        merge=LatentMerge,
        comparisons=ls_merge.comparisons,
        checked="Each prepared checkpoint is its input encoded and decoded by the weight "
        "autoencoder, a lossy step (its test loss is in the report); every checkpoint tensor "
        "was checked to be rebuilt exactly from the canonical pieces the latents encode.",
    ),
)
BY_NAME = {method.name: method for method in METHODS}
BY_SECTION = {method.section: method for method in METHODS}


def plugin_method(name: str | None) -> PluginMethod | None:
    """The record of the plugin method ``name``; None for anything else (built-in methods)."""
    return BY_NAME.get(name) if isinstance(name, str) else None


def register_methods() -> None:
    """Register every plugin method with mergekit (calling it again is harmless)."""
    from mergekit import merge_methods

    known = {method.spec.name for method in merge_methods.registered_methods()}
    for method in METHODS:
        if method.name not in known:
            merge_methods.register(method.mergekit_method())
