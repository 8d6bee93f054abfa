"""The mean next-token loss of a causal language model on packed token sequences."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lmc_mergekit.errors import LmcError

# Test-split sequences evaluated by default (65k tokens of 128): enough for a stable mean loss
# on small models, and the same everywhere (eval, barrier, lmc_dm reports, zoo records).
DEFAULT_EVAL_SEQUENCES = 512
#: Most bytes of float32 logits one forward produces. At today's vocabularies (128k–256k) a
#: batch of 16×128 tokens has 1–2 GB of logits, and the cross-entropy copies them twice: such
#: a batch runs a few whole sequences at a time. Smaller vocabularies keep the whole batch.
LOGITS_BYTES = 128 * 2**20


@dataclass(frozen=True)
class LossResult:
    """Mean next-token cross-entropy (nats) over ``tokens`` predicted tokens."""

    loss: float
    tokens: int

    @property
    def perplexity(self) -> float:
        """``exp(loss)``."""
        return math.exp(self.loss)

    def to_dict(self) -> dict:
        """The result as plain JSON-ready values."""
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens}


def resolve_device(name: str) -> torch.device:
    """The torch device ``name``; ``auto`` is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LmcError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LmcError(f"device {name!r} asked for, but CUDA is not available; use --device cpu")
    return device


def load_causal_lm(path: str | Path, device: str = "cpu", trust_remote_code: bool = False):
    """A checkpoint folder as a float32 ``transformers`` causal LM in eval mode on ``device``."""
    from lmc_mergekit.evaluation.selfcheck import load_fp32
    from lmc_mergekit.models.checkpoint import model_dir

    return load_fp32(model_dir(path), trust_remote_code).to(resolve_device(device))


@torch.no_grad()
def mean_token_loss(
    model, sequences: torch.Tensor, batch_size: int = 16, progress: bool = False
) -> LossResult:
    """The token-weighted mean next-token cross-entropy of ``model`` on ``sequences``.

    ``sequences`` is ``(n, L)`` token ids; each sequence predicts its last ``L - 1`` tokens. The
    loss is computed here from float32 logits (summed, then divided once by the token count), so
    it does not depend on ``batch_size`` (beyond float32 rounding of each batch's sum) or on how
    a model averages its own ``labels`` loss. A batch runs whole only while its logits fit in
    :data:`LOGITS_BYTES`, else in pieces of as many whole sequences as fit. The model is put in
    eval mode and run on its own device.
    """
    if sequences.ndim != 2 or sequences.shape[0] == 0 or sequences.shape[1] < 2:
        raise LmcError(
            f"need token sequences of shape (n >= 1, length >= 2), got {tuple(sequences.shape)}"
        )
    if batch_size < 1:
        raise LmcError(f"batch size must be at least 1, got {batch_size}")
    vocab_size = getattr(model.config, "vocab_size", None)
    if vocab_size is not None and int(sequences.max()) >= vocab_size:
        raise LmcError(
            f"token id {int(sequences.max())} is outside the model's vocabulary of {vocab_size}; "
            "was the data tokenized with another model's tokenizer?"
        )
    model.eval()
    device = next(model.parameters()).device
    rows = _rows_per_forward(model, batch_size, sequences.shape[1])
    total = 0.0
    with tqdm(total=len(sequences), unit="seq", desc="loss", disable=not progress) as bar:
        for batch in sequences.split(rows):
            batch = batch.to(device=device, dtype=torch.long)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            total += float(
                F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    batch[:, 1:].reshape(-1),
                    reduction="sum",
                )
            )
            bar.update(len(batch))
    tokens = sequences.shape[0] * (sequences.shape[1] - 1)
    return LossResult(loss=total / tokens, tokens=tokens)


def _rows_per_forward(model, batch_size: int, length: int) -> int:
    """``batch_size``, or fewer sequences where their float32 logits would pass
    :data:`LOGITS_BYTES` (at least one)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return batch_size
    logits = length * head.weight.shape[0] * 4
    return max(1, min(batch_size, LOGITS_BYTES // logits))
