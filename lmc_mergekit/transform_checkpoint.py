"""Moving a checkpoint folder by a symmetry, checked before anything is kept."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.selfcheck import (
    CHECK_ROWS,
    FunctionCheck,
    LogitsCheck,
    check_layout,
    check_transformed,
    runs_blockwise,
)
from lmc_mergekit.models.adapters import CheckpointView, open_model
from lmc_mergekit.models.adapters.base import DEFAULT_SHARD_SIZE, CheckpointSaver
from lmc_mergekit.models.view import Block, Embeddings, Head, ModelSpec, row_chunks
from lmc_mergekit.runtime.memory import release_freed_memory
from lmc_mergekit.runtime.publish import staged_folder
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.weight_actions import rounded, stored_dtypes


def transform_checkpoint(
    source: str | Path,
    out: str | Path,
    transform: Transform,
    *,
    max_shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> tuple[ModelSpec, FunctionCheck]:
    """Write ``source`` moved by ``transform`` to ``out`` as a stock checkpoint.

    Each part is moved once (in float32, float64 for parts stored in float32), written
    rounded to its source tensor's dtype and self-checked on the way (:class:`CheckedWriter`);
    only then is the folder renamed to ``out``. A family whose blocks cannot run one at a time
    is written first and checked whole (:func:`check_transformed`). Returns the written spec
    and what the function check measured.
    """
    view = open_model(source, trust_remote_code)
    if not runs_blockwise(view):
        with staged_folder(out, "replace" if overwrite else "refuse") as staging:
            moved = apply_transform(view, transform)
            spec = view.adapter.save(moved, staging, view.folder, max_shard_size, progress)
            check = check_transformed(view, transform, staging, trust_remote_code)
        release_freed_memory()
        return spec, check
    remembered = _LastBlock(view)
    exact = apply_transform(remembered, transform, torch.float32)
    with CheckedWriter(
        view,
        exact.spec,
        Path(out),
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        progress=progress,
        trust_remote_code=trust_remote_code,
    ) as writer:
        for chunk in row_chunks(exact, "embeddings", CHECK_ROWS):
            writer.embeddings(chunk)
        for index in range(view.spec.num_layers):
            writer.block(index, exact.block(index), remembered.block(index))
        for chunk in row_chunks(exact, "head", CHECK_ROWS):
            writer.head(chunk)
        result = writer.publish()
    release_freed_memory()  # the check's float32 parts: not kept while the next input is written
    return result


class CheckedWriter:
    """A moved checkpoint written a part at a time as its exact parts come (the source's parts
    moved by a symmetry, before any rounding: float32, or float64 where the source stores
    float32), and self-checked on the way (:mod:`lmc_mergekit.evaluation.selfcheck`): each part
    is rounded once to its source tensor's dtype and written, every byte read back at the end;
    the exact parts run block by block beside the source's on a probe batch; the written
    config must describe the moved model and ``transformers`` must load the folder. It appears
    at ``out`` only when :meth:`publish` has passed every check; leaving the ``with`` block
    otherwise removes it.

    Hand in the embeddings' vocabulary slices in order, the blocks in order (each with the
    source's block, read anew where not given), the head's slices in order, then publish. The
    parts may be computed by anyone: :func:`transform_checkpoint` moves them itself, weight
    matching hands in those it computed for its last round (no block moved twice).
    """

    def __init__(
        self,
        source: CheckpointView,
        moved_spec: ModelSpec,
        out: Path,
        *,
        max_shard_size: int = DEFAULT_SHARD_SIZE,
        overwrite: bool = False,
        progress: bool = True,
        trust_remote_code: bool = False,
    ):
        self.source, self.moved_spec = source, moved_spec
        self._trust_remote_code = trust_remote_code
        self._stage = ExitStack()
        self.staging = self._stage.enter_context(
            staged_folder(out, "replace" if overwrite else "refuse")
        )
        self._saver = CheckpointSaver(
            source.adapter, self.staging, source.folder, moved_spec, max_shard_size, verify=True
        )
        self._check = LogitsCheck(source, moved_spec, trust_remote_code=trust_remote_code)
        # The dtype each written tensor keeps: its source tensor's.
        self._dtypes = {
            read: stored_dtypes(next(row_chunks(source, read, 1)))
            for read in ("embeddings", "head")
        }
        self._bar = tqdm(
            total=source.spec.num_layers, desc=f"writing {out.name}", disable=not progress
        )

    def __enter__(self) -> CheckedWriter:
        return self

    def __exit__(self, error_type, error, trace) -> None:
        """Remove the staged folder unless :meth:`publish` renamed it into place."""
        self._bar.close()
        self._stage.__exit__(error_type or LmcError, error or LmcError("not published"), trace)

    def discard(self) -> None:
        """Remove the staged folder (nothing is published)."""
        self.__exit__(None, None, None)

    def embeddings(self, exact: Embeddings) -> None:
        """The next slice of the moved embeddings' vocabulary rows."""
        self._check.embeddings(exact)
        self._saver.embeddings(rounded(exact, self._dtypes["embeddings"]))

    def block(self, index: int, exact: Block, source: Block | None = None) -> None:
        """Moved block ``index`` (``source``: the source's block ``index``, if at hand)."""
        source = self.source.block(index) if source is None else source
        self._check.block(index, exact, source)
        self._saver.block(index, rounded(exact, stored_dtypes(source)))
        self._bar.update()

    def head(self, exact: Head) -> None:
        """The next slice of the moved head's vocabulary rows."""
        self._check.head(exact)
        self._saver.head(rounded(exact, self._dtypes["head"]))

    def publish(self) -> tuple[ModelSpec, FunctionCheck]:
        """Finish the folder (every byte read back), run the remaining checks and rename it
        into place; the written spec and what the function check measured."""
        spec = self._saver.close()
        check = self._check.result()
        check_layout(self.staging, self._trust_remote_code)
        written = open_model(self.staging, self._trust_remote_code).spec
        if written.norm_eps != self.moved_spec.norm_eps or written.shape_mismatch(spec):
            raise LmcError(
                f"self-check failed: the config.json written for {self.source.folder.name} "
                "does not describe the moved model; nothing was written"
            )
        self._stage.close()  # published
        return spec, check


class _LastBlock:
    """``view``, with the last block read kept: the source block a part is moved from is read
    once for the move and the check."""

    def __init__(self, view: CheckpointView):
        self._view, self.spec = view, view.spec
        self._last: tuple[int, Block] | None = None

    def __getattr__(self, name: str):
        return getattr(self._view, name)

    def block(self, index: int) -> Block:
        if self._last is None or self._last[0] != index:
            self._last = (index, self._view.block(index))
        return self._last[1]
