"""The self-check: a transformed checkpoint must be its source moved by a symmetry, exactly.

Two checks, both before anything is kept:

- **function**: the exact transform of the source (computed in float32, float64 for parts
  stored in float32; see :func:`~lmc_mergekit.symmetry.weight_actions.compute_dtype`) must
  compute the source's logits on a probe batch (bundled text through the model's own
  tokenizer, or fixed random ids without one), whatever the checkpoint's dtype. Both models
  run in float64, so that the float32 noise of a deep or wide model does not count as a
  difference; the moved model also runs in float32, and its own float32 noise on the probe sets
  the tolerance:
  ``max|Δlogits| / max(1, max|logits|)`` of the two float64 runs must stay within
  :data:`NOISE_MARGIN` times the moved model's float32-against-float64 difference (at least
  :data:`FUNCTION_FLOOR`). A wrong transform moves the logits by orders of magnitude more; a
  model whose float32 noise is so large that the tolerance would pass :data:`FUNCTION_CEILING`
  (per-head maps too ill-conditioned to check) is refused. The measured error, noise and
  tolerance are returned (:class:`FunctionCheck`) and recorded in the reports.
- **storage**: every written tensor must be that exact transform rounded once to the written
  tensor's dtype, within a few units in the last place, and keep its source tensor's dtype; and
  ``transformers`` must load the written folder without a missing, unexpected or mis-shaped
  tensor (checked on the meta device). This catches any writing or layout mistake, in bf16 as
  in float32: rounding to the storage dtype is the only difference allowed, and it is measured
  in that dtype's own units, not as a fraction of the logits (a bf16 rounding moves a real
  model's logits by about one, which hides real bugs).

Models run block by block where the family allows it (:class:`LogitsCheck`: each block through
a one-layer stock ``transformers`` module), so that one block is in memory at a time; the others
(GPT-2 scaling attention by layer index) are loaded whole. :func:`check_transformed` checks a
folder written before; a checkpoint being written is checked as it is written, each exact part
computed once (:class:`~lmc_mergekit.transform_checkpoint.CheckedWriter`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from lmc_mergekit.data import bundled_text_files, folder_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import CheckpointView, open_model
from lmc_mergekit.models.block_runner import BlockRunner, embed, embedded, final_logits
from lmc_mergekit.models.checkpoint import read_config, row_slices
from lmc_mergekit.models.view import (
    VOCAB_ROWS,
    Block,
    Embeddings,
    Head,
    ModelSpec,
    iter_tensors,
    map_tensors,
    row_chunks,
)
from lmc_mergekit.symmetry import Transform, apply_transform

#: The function check allows this many times the moved model's own float32 noise on the probe
#: (two float32 computations of one function differ by about one to three times it).
NOISE_MARGIN = 16.0
#: The least tolerance of the function check (a model whose float32 run is nearly exact).
FUNCTION_FLOOR = 1e-6
#: The largest tolerance the check may grant: beyond it, noise could hide a wrong transform.
FUNCTION_CEILING = 1e-2
#: Units in the last place of its dtype a written tensor may differ from the exact transform.
STORAGE_ULPS = 2
PROBE_SHAPE = (2, 48)
#: Vocabulary rows compared and run through the head at a time.
CHECK_ROWS = VOCAB_ROWS


def probe_batch(
    folder: Path, vocab_size: int, shape: tuple[int, int] = PROBE_SHAPE
) -> torch.Tensor:
    """Token ids ``(batch, length)``: real text where the checkpoint has a tokenizer."""
    batch, length = shape
    try:
        tokenizer = folder_tokenizer(folder)
    except LmcError:
        tokenizer = None
    if tokenizer is not None:
        text = bundled_text_files()[0].read_text(encoding="utf-8")[:20000]
        ids = torch.tensor(tokenizer(text)["input_ids"][: batch * length])
        if ids.numel() == batch * length and int(ids.max()) < vocab_size:
            return ids.reshape(batch, length)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, shape, generator=generator)


def load_fp32(
    folder: Path, trust_remote_code: bool = False, untie: bool = False
) -> torch.nn.Module:
    """A checkpoint as a float32 ``transformers`` model in eval mode; with ``untie``, one
    whose LM head is a parameter of its own (a tied checkpoint's is left uninitialised)."""
    return load_model(folder, trust_remote_code, untie, torch.float32)


def load_model(
    folder: Path, trust_remote_code: bool, untie: bool, dtype: torch.dtype
) -> torch.nn.Module:
    """:func:`load_fp32` in ``dtype``."""
    overrides = {"tie_word_embeddings": False} if untie else {}
    with _quiet_loading():  # an untied load of a tied checkpoint reports its head missing
        model = AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            use_kernels=False,  # the stock modules: hub kernels change the numbers checked
            **overrides,
        )
    return model.eval()


@contextmanager
def _quiet_loading():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@torch.no_grad()
def checkpoint_logits(
    folder: Path, input_ids: torch.Tensor, trust_remote_code: bool = False
) -> torch.Tensor:
    """The float32 logits of the checkpoint in ``folder`` on ``input_ids``: block by block
    where the family allows it (after checking the stored layout), else through the whole
    ``transformers`` model."""
    view = open_model(folder, trust_remote_code)
    if not runs_blockwise(view):
        return load_fp32(view.folder, trust_remote_code)(input_ids).logits
    check_layout(folder, trust_remote_code)
    return _runner(view.folder, view).logits(view, input_ids)


@torch.no_grad()
def check_transformed(
    source: CheckpointView, transform: Transform, candidate: Path, trust_remote_code: bool = False
) -> FunctionCheck:
    """Raise unless ``candidate`` is ``source`` moved by ``transform`` (see the module
    docstring); return what the function check measured."""
    written = open_model(candidate, trust_remote_code)
    check_layout(candidate, trust_remote_code)
    exact = apply_transform(source, transform, torch.float32)
    name = written.folder.name
    if not runs_blockwise(written):
        ids = probe_batch(source.folder, source.spec.vocab_size)
        expected = load_model(source.folder, trust_remote_code, False, torch.float64)(ids).logits
        stored = _StoredAsExact(exact, written)
        moved = _whole_model(candidate, written, stored, trust_remote_code)
        single = moved(ids).logits
        return judge_function(moved.double()(ids).logits, single, expected, source.folder.name)
    check = LogitsCheck(source, written.spec, candidate, trust_remote_code)

    def compared(read: str):
        exact_rows = row_chunks(exact, read, CHECK_ROWS)
        for want, got in zip(exact_rows, row_chunks(written, read, CHECK_ROWS), strict=True):
            check_stored(read, want, got, name)
            yield want

    for chunk in compared("embeddings"):
        check.embeddings(chunk)
    for index in range(source.spec.num_layers):
        want = exact.block(index)
        check_stored(f"block {index}", want, written.block(index), name)
        check.block(index, want, source.block(index))
    for chunk in compared("head"):
        check.head(chunk)
    return check.result()


@dataclass(frozen=True)
class FunctionCheck:
    """What the function check measured on its probe, each ``max|Δlogits| / max(1,
    max|logits|)`` (:func:`relative_logits_error`): the checked model's logits against the
    reference's (``error``), the checked model's own float32 noise there (``noise``), and the
    tolerance it was held to (``tolerance``, from the noise)."""

    error: float
    noise: float
    tolerance: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def summary(self) -> str:
        """One line for a command's output."""
        return (
            f"logits match the source to {self.error:.1e} (relative; tolerance "
            f"{self.tolerance:.1e}, from the float32 noise {self.noise:.1e})"
        )


def function_tolerance(noise: float) -> float:
    """The tolerance of the function check for a model whose float32 noise is ``noise``."""
    return max(FUNCTION_FLOOR, NOISE_MARGIN * noise)


def judge_function(
    moved: torch.Tensor, moved_fp32: torch.Tensor, expected: torch.Tensor, name: str
) -> FunctionCheck:
    """The function check of a moved model: its float64 logits ``moved`` against the source's
    float64 logits ``expected``, within :func:`function_tolerance` of its own float32 noise
    (``moved_fp32`` against ``moved``); a one-line error otherwise (not a symmetry, or too
    noisy to tell)."""
    noise = relative_logits_error(moved_fp32, moved)
    return judged(
        relative_logits_error(moved, expected),
        noise,
        f"the transform of {name}",
        "the source's",
        "it is not a symmetry of this model",
    )


def judged(error: float, noise: float, what: str, reference: str, meaning: str) -> FunctionCheck:
    """:class:`FunctionCheck` of ``what`` (its ``error`` against ``reference`` and its float32
    ``noise``), or the one-line error where the tolerance is above the ceiling or the error
    above the tolerance (which ``meaning`` explains)."""
    tolerance = function_tolerance(noise)
    if not tolerance <= FUNCTION_CEILING:
        raise LmcError(
            f"self-check cannot tell: {what} computes in float32 with a noise of {noise:.1e} "
            f"(relative) on the probe, too large to tell a symmetry from a mistake (above "
            f"{FUNCTION_CEILING / NOISE_MARGIN:.0e}; ill-conditioned per-head maps?); nothing "
            "was written"
        )
    if not error <= tolerance:
        raise LmcError(
            f"self-check failed: {what} computes logits {error:.3e} (relative) away from "
            f"{reference}, above {tolerance:.1e} ({NOISE_MARGIN:g} × its float32 noise "
            f"{noise:.1e}): {meaning}; nothing was written"
        )
    return FunctionCheck(error, noise, tolerance)


class LogitsCheck:
    """The function check, fed a part at a time: the logits of the source (in float64) and of
    the exact moved model (in float64 and in float32) on the probe batch, each residual stream
    carried through its blocks by one-layer stock modules (the moved one of ``moved_folder``'s
    config, or the source's rewritten for ``moved_spec``: what the written config.json says).

    Hand in the moved embeddings' vocabulary slices in order, then the blocks in order (each
    with the source's block), then the head's slices in order; :meth:`result` raises unless
    the two agree within the moved model's float32 noise and returns what it measured."""

    def __init__(
        self,
        source: CheckpointView,
        moved_spec: ModelSpec,
        moved_folder: Path | None = None,
        trust_remote_code: bool = False,
    ):
        self.source, self.moved_spec = source, moved_spec
        self.ids = probe_batch(source.folder, source.spec.vocab_size)
        self._tokens, self._positions = torch.unique(self.ids, return_inverse=True)
        cpu, wide = torch.device("cpu"), torch.float64
        self._source_runner = BlockRunner(
            source.folder, source.adapter, source.spec, cpu, trust_remote_code, wide
        )
        # One set of float64 modules where the two configs agree.
        other = moved_folder is not None or moved_spec != source.spec
        folder = moved_folder or source.folder
        self._moved_runners = {
            dtype: BlockRunner(folder, source.adapter, moved_spec, cpu, trust_remote_code, dtype)
            for dtype in ((torch.float32, wide) if other else (torch.float32,))
        }
        self._moved_runners.setdefault(wide, self._source_runner)
        self._source = embedded(source, self.ids).to(wide)
        self._moved: dict[torch.dtype, torch.Tensor] = {}
        self._rows: list[torch.Tensor] = []  # the probe's token rows of each embeddings slice
        self._first: Embeddings | None = None
        self._seen = self._blocks = self._head_rows = 0
        self._logits: dict[torch.dtype, list[torch.Tensor]] = {d: [] for d in self._moved_runners}

    def embeddings(self, chunk: Embeddings) -> None:
        """The next slice of the moved embeddings' vocabulary rows."""
        start, stop = self._seen, self._seen + len(chunk.tokens)
        inside = self._tokens[(self._tokens >= start) & (self._tokens < stop)]
        self._rows.append(chunk.tokens[inside - start])
        self._first, self._seen = self._first or chunk, stop

    def block(self, index: int, moved: Block, source: Block) -> None:
        """Block ``index`` of the moved model and of the source, run on their streams."""
        if index != self._blocks or self._seen != self.source.spec.vocab_size:
            raise LmcError(f"self-check: block {index} came out of order")
        if not self._moved:
            table = replace(self._first, tokens=torch.cat(self._rows))
            for dtype in self._moved_runners:
                exact = map_tensors(table, lambda t, dtype=dtype: t.to(dtype))
                self._moved[dtype] = embed(exact, self._positions, self.moved_spec)
            self._rows = []
        self._source = self._source_runner.run(source, self._source, index).output
        for dtype, runner in self._moved_runners.items():
            self._moved[dtype] = runner.run(moved, self._moved[dtype], index).output
        self._blocks += 1

    def head(self, chunk: Head) -> None:
        """The next slice of the moved head's vocabulary rows."""
        for dtype, logits in self._logits.items():
            logits.append(final_logits(chunk, self._moved[dtype], self.moved_spec))
        self._head_rows += len(chunk.weight)

    def result(self) -> FunctionCheck:
        """Raise unless the moved model computed the source's logits (see the module
        docstring); what the check measured."""
        spec = self.source.spec
        if self._blocks != spec.num_layers or self._head_rows != spec.vocab_size:
            raise LmcError("self-check: the moved model was not handed in whole")
        expected = torch.cat(
            [
                final_logits(head, self._source, spec)
                for head in row_chunks(self.source, "head", CHECK_ROWS)
            ],
            dim=-1,
        )
        single, wide = (torch.cat(self._logits[d], dim=-1) for d in (torch.float32, torch.float64))
        return judge_function(wide, single, expected, self.source.folder.name)


class _StoredAsExact:
    """The exact view, part by part, each part checked against the written one first (the
    whole-model check of families that cannot run block by block)."""

    def __init__(self, exact, written):
        self.exact, self.written = exact, written
        self.spec = exact.spec

    def embeddings(self):
        return self._checked("embeddings", self.exact.embeddings(), self.written.embeddings())

    def block(self, index: int):
        return self._checked(f"block {index}", self.exact.block(index), self.written.block(index))

    def head(self):
        return self._checked("head", self.exact.head(), self.written.head())

    def _checked(self, where: str, exact, written):
        check_stored(where, exact, written, self.written.folder.name)
        return exact


def check_stored(where: str, exact, written, name: str) -> None:
    """Raise unless every tensor of the ``written`` part is the float32 ``exact`` one rounded
    to the written tensor's dtype, within :data:`STORAGE_ULPS` units in its last place."""
    pairs = zip(iter_tensors(exact), iter_tensors(written), strict=True)
    for (field, want), (_, got) in pairs:
        if want.shape != got.shape:
            raise LmcError(
                f"self-check failed: {name} stores {where} {field} as {tuple(got.shape)}, the "
                f"transform gives {tuple(want.shape)}; nothing was written"
            )
        if not got.is_floating_point():
            continue
        ulps = units_in_last_place(got, want)
        if ulps > STORAGE_ULPS:
            raise LmcError(
                f"self-check failed: {name} stores {where} {field} {ulps:.0f} units in the last "
                f"place ({got.dtype}) away from the exact transform, more than rounding "
                f"({STORAGE_ULPS}); nothing was written"
            )


#: Elements compared at a time (a vocabulary's rows would otherwise make several float32
#: temporaries of the whole embedding).
COMPARE_ELEMENTS = 1 << 22


def units_in_last_place(stored: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest ``|stored - exact|`` in units of ``stored``'s dtype at ``exact``'s value
    (a slice of rows at a time)."""
    if stored.dim() == 0 or stored.numel() == 0:
        return _ulps(stored.reshape(-1), exact.reshape(-1))
    return max(_ulps(stored[rows], exact[rows]) for rows in row_slices(stored, COMPARE_ELEMENTS))


def _ulps(stored: torch.Tensor, exact: torch.Tensor) -> float:
    rounded = exact.to(stored.dtype)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    unit = (up.float() - rounded.float()).abs()
    # Rounding to the nearest value is half a unit; a unit is measured where it is largest.
    return float(((stored.float() - exact.float()).abs() / unit).max()) if unit.numel() else 0.0


def runs_blockwise(view) -> bool:
    """Whether ``view``'s model can run block by block (GPT-2 scaling attention by the layer's
    index cannot: its one-layer module would compute another function)."""
    problem = view.adapter.blockwise_problem(read_config(view.folder))
    return bool(view.adapter.block_modules) and problem is None


def _runner(folder: Path, view) -> BlockRunner:
    return BlockRunner(folder, view.adapter, view.spec, torch.device("cpu"))


def check_layout(folder: Path, trust_remote_code: bool) -> None:
    problem = layout_problem(folder, trust_remote_code)
    if problem is not None:
        raise LmcError(f"self-check failed: {problem}; nothing was written")


def _whole_model(folder: Path, written, view, trust_remote_code: bool) -> torch.nn.Module:
    """``folder``'s float32 ``transformers`` model with the weights of ``view`` (in the
    written folder's layout)."""
    model = load_fp32(folder, trust_remote_code)
    adapter, spec = written.adapter, written.spec
    state = dict(adapter.embeddings_tensors(view.embeddings(), spec))
    for index in range(spec.num_layers):
        state.update(adapter.block_tensors(view.block(index), spec, index))
    state.update(adapter.head_tensors(view.head(), spec))
    model.load_state_dict({adapter.module_key(k): v for k, v in state.items()}, strict=False)
    return model


def layout_problem(folder: Path, trust_remote_code: bool = False) -> str | None:
    """What ``transformers`` would refuse or leave unloaded in the checkpoint ``folder`` (a
    tensor its model does not have, has in another shape, or needs and does not find), found by
    loading it onto the meta device (no weights are read). None when it loads cleanly."""
    try:
        _, info = AutoModelForCausalLM.from_pretrained(
            str(folder),
            device_map="meta",
            output_loading_info=True,
            use_kernels=False,  # transformers >= 5.2x kernelizes by default, not on meta
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, RuntimeError) as error:
        return f"transformers cannot load {folder.name} ({str(error).splitlines()[0]})"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            names = sorted(str(name) for name in info[kind])
            return f"transformers finds {kind.replace('_', ' ')} in {folder.name}: {names[:3]}"
    return None


def relative_logits_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|Δlogits| / max(1, max|logits|)``, the self-check's measure."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0))
