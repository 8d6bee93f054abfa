"""The self-check: a transformed checkpoint must compute the same logits as its source.

Both folders are loaded through ``transformers`` in float32 and run on one probe batch (bundled
text through the model's own tokenizer, or fixed random token ids when there is no tokenizer).
The measured error is ``max|Δlogits| / max(1, max|logits|)``; it must not exceed the tolerance
for the checkpoint's storage dtype (:data:`TOLERANCES`), since rounding the transformed weights
back to that dtype is the only expected source of error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmc_mergekit.data import bundled_text_files
from lmc_mergekit.errors import LmcError

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
def logits_error(source: Path, candidate: Path, trust_remote_code: bool = False) -> float:
    """The relative logits error of ``candidate`` against ``source`` on the probe batch."""
    reference = load_fp32(source, trust_remote_code)
    ids = probe_batch(source, reference.config.vocab_size)
    expected = reference(ids).logits
    del reference
    actual = load_fp32(candidate, trust_remote_code)(ids).logits
    return relative_logits_error(actual, expected)


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
