"""The self-check: a transformed checkpoint must compute the same logits as its source.

Both folders run in float32 on one probe batch (bundled text through the model's own
tokenizer, or fixed random token ids when there is no tokenizer). Where the family can be run
block by block (:class:`~lmc_mergekit.models.block_runner.BlockRunner`: each block through a
one-layer stock ``transformers`` module built from the folder's own config.json), it is, so
that only one block of one model is in memory at a time; the written tensors' names and shapes
are then checked against the ``transformers`` model of that config (built on the meta device),
which is what loading it would check. Otherwise both models are loaded whole through
``transformers``. The measured error is ``max|Δlogits| / max(1, max|logits|)``; it must not
exceed the tolerance for the checkpoint's storage dtype (:data:`TOLERANCES`), since rounding the
transformed weights back to that dtype is the only expected source of error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmc_mergekit.data import bundled_text_files
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.checkpoint import read_config

TOLERANCES = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 1e-2, torch.bfloat16: 5e-2}
PROBE_SHAPE = (2, 48)
SAFETENSORS_FLOAT_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def probe_batch(
    folder: Path, vocab_size: int, shape: tuple[int, int] = PROBE_SHAPE
) -> torch.Tensor:
    """Token ids ``(batch, length)``: real text where the checkpoint has a tokenizer."""
    batch, length = shape
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        text = bundled_text_files()[0].read_text(encoding="utf-8")[:20000]
        ids = torch.tensor(tokenizer(text)["input_ids"][: batch * length])
        if ids.numel() == batch * length and int(ids.max()) < vocab_size:
            return ids.reshape(batch, length)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, shape, generator=generator)


def load_fp32(folder: Path, trust_remote_code: bool = False) -> torch.nn.Module:
    """A checkpoint as a float32 ``transformers`` model in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    return model.eval()


@torch.no_grad()
def checkpoint_logits(
    folder: Path, input_ids: torch.Tensor, trust_remote_code: bool = False
) -> torch.Tensor:
    """The float32 logits of the checkpoint in ``folder`` on ``input_ids``: block by block
    where the family allows it (after checking the stored layout), else through the whole
    ``transformers`` model."""
    return _view_logits(open_model(folder, trust_remote_code), input_ids, trust_remote_code)


def _view_logits(view, input_ids: torch.Tensor, trust_remote_code: bool) -> torch.Tensor:
    adapter = view.adapter
    if not adapter.block_modules or adapter.blockwise_problem(read_config(view.folder)):
        return load_fp32(view.folder, trust_remote_code)(input_ids).logits
    problem = layout_problem(view.folder, trust_remote_code)
    if problem is not None:
        raise LmcError(f"self-check failed: {problem}; nothing was written")
    runner = BlockRunner(view.folder, adapter, view.spec, torch.device("cpu"), trust_remote_code)
    return runner.logits(view, input_ids)


def layout_problem(folder: Path, trust_remote_code: bool = False) -> str | None:
    """What ``transformers`` would refuse or leave unloaded in the checkpoint ``folder`` (a
    tensor its model does not have, has in another shape, or needs and does not find), found by
    loading it onto the meta device (no weights are read). None when it loads cleanly."""
    try:
        _, info = AutoModelForCausalLM.from_pretrained(
            str(folder),
            device_map="meta",
            output_loading_info=True,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError, RuntimeError) as error:
        return f"transformers cannot load {folder.name} ({str(error).splitlines()[0]})"
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            names = sorted(str(name) for name in info[kind])
            return f"transformers finds {kind.replace('_', ' ')} in {folder.name}: {names[:3]}"
    return None


@torch.no_grad()
def logits_error(source: Path, candidate: Path, trust_remote_code: bool = False) -> float:
    """The relative logits error of ``candidate`` against ``source`` on the probe batch."""
    view = open_model(source, trust_remote_code)
    ids = probe_batch(source, view.spec.vocab_size)
    expected = _view_logits(view, ids, trust_remote_code)
    return relative_logits_error(checkpoint_logits(candidate, ids, trust_remote_code), expected)


def relative_logits_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|Δlogits| / max(1, max|logits|)``, the self-check's measure."""
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1.0))


def tolerance_for(folder: Path) -> float:
    """The self-check tolerance for the storage dtype of the checkpoint in ``folder``."""
    return TOLERANCES.get(storage_dtype(folder), 1e-4)


def storage_dtype(folder: Path) -> torch.dtype:
    """The floating dtype the checkpoint's weights are stored in (read from the file header)."""
    shard = sorted(folder.glob("*.safetensors"))[0]
    with safe_open(str(shard), "pt") as fp:
        for key in fp.keys():
            name = fp.get_slice(key).get_dtype()
            if name in SAFETENSORS_FLOAT_DTYPES:
                return SAFETENSORS_FLOAT_DTYPES[name]
    return torch.float32


def check_same_function(
    source: Path, candidate: Path, tolerance: float | None = None, trust_remote_code: bool = False
) -> float:
    """Raise unless ``candidate`` reproduces ``source``'s logits; return the measured error."""
    if tolerance is None:
        tolerance = tolerance_for(candidate)
    error = logits_error(source, candidate, trust_remote_code)
    if not error <= tolerance:
        raise LmcError(
            f"self-check failed: the transformed model's logits differ from {source.name}'s by "
            f"{error:.3e} (relative), above the tolerance {tolerance:.1e}; nothing was written"
        )
    return error
