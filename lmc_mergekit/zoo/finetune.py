"""Fine-tuning a checkpoint on other text: the base + fine-tune pairs mergekit users bring most,
made here from any model (a zoo model in the tests, a real pretrained one in the benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lmc_mergekit.data.sequences import DataConfig, load_split
from lmc_mergekit.models.checkpoint import stored_dtype
from lmc_mergekit.runtime.publish import staged_folder
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
) -> Path:
    """``out``: ``base`` trained on for ``steps`` AdamW steps (float32, warm-up over a tenth,
    cosine decay) on the train split of ``data`` read by ``base``'s tokenizer, stored in
    ``base``'s dtype with its tokenizer and tie; ``finetune.json`` holds the run's record.
    Reused when ``out`` already holds a finished one."""
    base, out = Path(base), Path(out)
    if (out / FINETUNE_INFO).is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    train = load_split(data, tokenizer, "train", max_sequences=steps * batch_size)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, use_kernels=False)
    record = continue_training(
        model,
        train,
        seed=seed,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup=steps // 10,
        progress=progress,
        desc=f"fine-tuning {base.name}",
    )
    with staged_folder(out, "replace") as staging:
        model.to(stored_dtype(base)).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info = {"base": str(base), "data": data.source, **record}
        (staging / FINETUNE_INFO).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return out
