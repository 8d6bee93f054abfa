"""Fine-tuning a checkpoint on other text: the base + fine-tune pairs mergekit users bring most,
made here from any model (a zoo model in the tests, a real pretrained one in the benchmarks)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from lmc_mergekit.data.sequences import DataConfig, load_split
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.checkpoint import copy_tagalong_files, first_non_finite, stored_dtype
from lmc_mergekit.runtime.publish import Existing, staged_folder
from lmc_mergekit.zoo.train import continue_training

FINETUNE_INFO = "finetune.json"


def finetune(
    base: str | Path,
    out: str | Path,
    data: DataConfig,
    *,
    steps: int,
    batch_size: int = 8,
    lr: float = 1e-4,
    seed: int = 0,
    progress: bool = True,
    last_layers: int | None = None,
) -> Path:
    """``out``: ``base`` trained on for ``steps`` AdamW steps (float32, warm-up over a tenth,
    cosine decay) on the train split of ``data`` read by ``base``'s tokenizer, stored in
    ``base``'s dtype with its tokenizer and tie; ``finetune.json`` holds the run's record.
    Reused when ``out`` already holds a finished one. With ``last_layers`` only the last that
    many decoder layers train (the rest frozen): a fine-tune of a model whose whole float32
    training state would not fit in memory."""
    base, out = Path(base), Path(out)
    if (out / FINETUNE_INFO).is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    train = load_split(data, tokenizer, "train", max_sequences=steps * batch_size)
    train_checkpoint(
        base,
        out,
        train,
        FINETUNE_INFO,
        {"base": str(base), "data": data.source, "last_layers": last_layers},
        existing="replace",
        last_layers=last_layers,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        progress=progress,
        desc=f"fine-tuning {base.name}",
    )
    return out


def train_checkpoint(
    base: Path,
    out: Path,
    train: torch.Tensor,
    info_file: str,
    info: dict,
    *,
    existing: Existing = "refuse",
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    before_write: Callable[[dict], None] | None = None,
    gradient_checkpointing: bool = False,
    last_layers: int | None = None,
    **loop,
) -> dict:
    """Train the checkpoint ``base`` on the sequences ``train`` with the tool's one training
    loop (float32; ``loop``: :func:`continue_training`'s settings, warm-up over a tenth by
    default) and write it to ``out`` in ``base``'s dtype with its tokenizer files and the run's
    record (``info`` and the loop's, completed by ``before_write`` where given) as
    ``info_file``; staged, and refused with nothing written if a value is not finite. Returns
    the record. With ``gradient_checkpointing`` each layer's activations are recomputed in the
    backward pass (:func:`recompute_activations`); with ``last_layers`` only the last that many
    decoder layers train (:func:`train_last_layers`)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, trust_remote_code=trust_remote_code, use_kernels=False
    ).to(device)
    if last_layers is not None:
        train_last_layers(model, last_layers)
    if gradient_checkpointing:
        recompute_activations(model)
    loop.setdefault("warmup", loop["steps"] // 10)
    record = {**info, **continue_training(model, train, **loop)}
    if gradient_checkpointing:
        model.gradient_checkpointing_disable()
    if before_write is not None:
        before_write(record)
    with staged_folder(out, existing) as staging:
        model.to(stored_dtype(base)).save_pretrained(staging)
        copy_tagalong_files(base, staging)
        bad = first_non_finite(staging)
        if bad is not None:
            raise LmcError(
                f"training left a non-finite value in {bad[0]}; nothing was written; "
                "try a smaller learning rate"
            )
        (staging / info_file).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def train_last_layers(model: PreTrainedModel, count: int) -> None:
    """Freeze every parameter of ``model`` but those of its last ``count`` decoder layers: the
    optimizer then holds state for those alone, and the backward pass stops at the first of
    them."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not 1 <= count <= len(layers):
        total = "none" if layers is None else len(layers)
        raise LmcError(
            f"cannot train the last {count} decoder layers of {type(model).__name__} "
            f"({total} found); give a count from 1 to its number of layers"
        )
    model.requires_grad_(False)
    for layer in layers[len(layers) - count :]:
        layer.requires_grad_(True)


def recompute_activations(model: PreTrainedModel) -> None:
    """Train ``model`` with transformers' gradient checkpointing: a layer keeps only its input
    for the backward pass and runs again there, so a step holds one layer's activations, not
    every layer's, for about a third more compute. Non-reentrant, so that a loss computed from
    the decoder's states (distillation's) gets the same gradients."""
    if not model.supports_gradient_checkpointing:
        raise LmcError(
            f"{type(model).__name__} does not support gradient checkpointing; "
            "heal without --gradient-checkpointing"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
