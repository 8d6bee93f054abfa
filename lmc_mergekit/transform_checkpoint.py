"""Moving a checkpoint folder by a symmetry, checked before anything is kept."""

from __future__ import annotations

from pathlib import Path

from lmc_mergekit.evaluation.selfcheck import check_transformed
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE
from lmc_mergekit.models.view import ModelSpec
from lmc_mergekit.runtime.memory import release_freed_memory
from lmc_mergekit.runtime.publish import staged_folder
from lmc_mergekit.symmetry import Transform, apply_transform


def transform_checkpoint(
    source: str | Path,
    out: str | Path,
    transform: Transform,
    *,
    max_shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> tuple[ModelSpec, float]:
    """Write ``source`` moved by ``transform`` to ``out`` as a stock checkpoint.

    The result is written shard by shard into a staging folder and self-checked (see
    :mod:`lmc_mergekit.evaluation.selfcheck`: the exact transform computes the source's logits,
    every written tensor is it rounded once, transformers loads the folder); only then is it
    renamed to ``out``. Returns the written spec and the function check's logits error.
    """
    view = open_model(source, trust_remote_code)
    moved = apply_transform(view, transform)
    with staged_folder(out, "replace" if overwrite else "refuse") as staging:
        spec = view.adapter.save(moved, staging, view.folder, max_shard_size, progress)
        error = check_transformed(view, transform, staging, trust_remote_code)
    release_freed_memory()  # the check's float32 parts: not kept while the next input is written
    return spec, error
