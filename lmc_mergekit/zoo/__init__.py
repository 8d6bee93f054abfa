"""A zoo of small language models trained here from scratch, one per seed.

No model hub is reachable from where the project is developed and tested, so it trains its own
models on the bundled public-domain corpus (or on given text): independently trained pairs to
measure loss barriers between and to merge. Each model is a stock Hugging Face checkpoint
(safetensors, with its tokenizer) in a folder named by its settings under the zoo's root; a
``zoo_model.json`` in it marks it finished and holds the config summary and the training record,
and a later build with the same settings reuses it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from lmc_mergekit.data.sequences import DataConfig
from lmc_mergekit.data.sources import data_fingerprint
from lmc_mergekit.errors import LmcError
from lmc_mergekit.runtime.publish import staged_folder
from lmc_mergekit.zoo.architectures import ZOO_ARCHITECTURES, check_architecture, zoo_config
from lmc_mergekit.zoo.tokenizer import cached_tokenizer
from lmc_mergekit.zoo.train import DEFAULT_LR, DEFAULT_WARMUP, train_model

__all__ = [
    "BUNDLED",
    "ZOO_ARCHITECTURES",
    "ZOO_INFO",
    "build_zoo",
    "build_zoo_model",
    "parse_seeds",
    "read_zoo_info",
    "zoo_model_name",
]

ZOO_INFO = "zoo_model.json"
#: ``tokenizer_data`` naming the bundled corpus (``None`` names the training text itself).
BUNDLED = "bundled"
DEFAULT_VOCAB = 4096
DEFAULT_SEQ_LEN = 128
DEFAULT_BATCH = 16


def zoo_model_name(
    arch: str,
    hidden: int,
    layers: int,
    seed: int,
    steps: int,
    *,
    data_tag: str | None = None,
    vocab_size: int = DEFAULT_VOCAB,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    tied: bool = False,
    tokenizer_tag: str | None = None,
) -> str:
    """The folder name of a zoo model, e.g. ``gpt_neox-d128-l4-s1500-seed0``; settings that
    differ from the defaults, the fingerprint of non-bundled text and that of a tokenizer's
    text other than the training text are added before the seed
    (``gpt_neox-d32-l2-s30-v512-ctx32-tied-data1a2b3c4d-tok5e6f7a8b-seed0``)."""
    parts = [arch, f"d{hidden}", f"l{layers}", f"s{steps}"]
    for tag, value, default in (
        ("v", vocab_size, DEFAULT_VOCAB),
        ("ctx", seq_len, DEFAULT_SEQ_LEN),
        ("b", batch_size, DEFAULT_BATCH),
        ("lr", lr, DEFAULT_LR),
        ("w", warmup, DEFAULT_WARMUP),
    ):
        if value != default:
            parts.append(f"{tag}{value:g}" if isinstance(value, float) else f"{tag}{value}")
    if tied:
        parts.append("tied")
    if data_tag:
        parts.append(f"data{data_tag}")
    if tokenizer_tag:
        parts.append(f"tok{tokenizer_tag}")
    return "-".join([*parts, f"seed{seed}"])


def build_zoo_model(
    root: Path,
    arch: str,
    hidden: int,
    layers: int = 4,
    seed: int = 0,
    steps: int = 1500,
    data_source: str | Path | None = None,
    field: str = "text",
    seq_len: int = DEFAULT_SEQ_LEN,
    progress: bool = True,
    *,
    vocab_size: int = DEFAULT_VOCAB,
    batch_size: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    device: str | torch.device = "cpu",
    tied: bool = False,
    tokenizer_data: str | Path | None = None,
) -> Path:
    """The folder ``root/<name>`` of a zoo model trained from scratch with these settings on
    ``data_source`` (``None``: the bundled corpus); trained and saved only if no finished one
    is there. The tokenizer is trained once per text and vocabulary size and cached under
    ``root/.tokenizers``. Training is bitwise reproducible on one device (the CPU by default:
    a model trained on a GPU is a different model under the same name). ``tied`` ties the LM
    head to the token embeddings, as small Llama 3.2, Qwen3 and every Gemma do.
    ``tokenizer_data`` trains the tokenizer on other text (:data:`BUNDLED`: the bundled corpus)
    than the model, so that models trained on different texts share one vocabulary and can be
    merged."""
    check_architecture(arch, hidden, layers)
    root = Path(root).expanduser().absolute()
    source = None if data_source is None else str(data_source)
    fingerprint = data_fingerprint(source, field)
    words = source if tokenizer_data is None else _tokenizer_text(tokenizer_data)
    words_fingerprint = data_fingerprint(words, field)
    name = zoo_model_name(
        arch,
        hidden,
        layers,
        seed,
        steps,
        data_tag=None if source is None else fingerprint[:8],
        vocab_size=vocab_size,
        seq_len=seq_len,
        batch_size=batch_size,
        lr=lr,
        warmup=warmup,
        tied=tied,
        tokenizer_tag=None if words_fingerprint == fingerprint else words_fingerprint[:8],
    )
    out = root / name
    if (out / ZOO_INFO).is_file():
        _check_same_data(out, fingerprint)
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LmcError(
            f"{out} exists but holds no {ZOO_INFO}, so it is no finished zoo model; remove it"
        )

    data = DataConfig(source=source, field=field, seq_len=seq_len)
    tokenizer_dir = cached_tokenizer(root, words, field, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = zoo_config(
        arch, hidden, layers, len(tokenizer), seq_len, tokenizer.eos_token_id, tied=tied
    )
    # Training runs inside the staged folder: an interrupted build leaves only a hidden
    # ".<name>.partial-*" folder (removed on any Python-level error), never a finished-looking one.
    with staged_folder(out, "replace") as tmp:
        model, record = train_model(
            config,
            tokenizer,
            data,
            seed=seed,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            warmup=warmup,
            progress=progress,
            device=device,
        )
        model.to("cpu").save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        tokenizer_text = {"source": words, "fingerprint": words_fingerprint}
        info = _zoo_info(name, arch, config, data, fingerprint, tokenizer_text, record)
        (tmp / ZOO_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out


def build_zoo(
    root: Path,
    arch: str,
    hidden: int,
    layers: int = 4,
    seeds: list[int] | tuple[int, ...] = (0, 1),
    steps: int = 1500,
    **kwargs,
) -> list[Path]:
    """One zoo model per seed (see :func:`build_zoo_model`, which takes the other arguments)."""
    return [
        build_zoo_model(root, arch, hidden, layers, seed=seed, steps=steps, **kwargs)
        for seed in seeds
    ]


def read_zoo_info(folder: Path) -> dict:
    """The ``zoo_model.json`` of a finished zoo model: config summary and training record."""
    path = Path(folder) / ZOO_INFO
    if not path.is_file():
        raise LmcError(f"{folder} is no finished zoo model (no {ZOO_INFO}); build it again")
    return json.loads(path.read_text())


def parse_seeds(text: str) -> list[int]:
    """Seeds from ``"0,1,2"``, ranges ``"0-3"`` or both (``"0,4-6"``), in order, once each."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            span = range(int(low), int(high) + 1) if dash else [int(part)]
        except ValueError:
            span = []
        if not span:
            raise LmcError(
                f"bad seed {part!r} in {text!r}; give non-negative integers and ranges, "
                "e.g. '0,1' or '0-3'"
            )
        seeds.extend(seed for seed in span if seed not in seeds)
    return seeds


def _tokenizer_text(tokenizer_data: str | Path) -> str | None:
    return None if str(tokenizer_data) == BUNDLED else str(tokenizer_data)


def _check_same_data(folder: Path, fingerprint: str) -> None:
    recorded = read_zoo_info(folder)["data"]["fingerprint"]
    if recorded != fingerprint:
        raise LmcError(
            f"{folder} was trained on other text than is there now (the bundled corpus "
            "changed?); remove it to train it again"
        )


def _zoo_info(name, arch, config, data, fingerprint, tokenizer_text, record) -> dict:
    import torch
    import transformers

    from lmc_mergekit import __version__

    return {
        "name": name,
        "architecture": arch,
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "data": {
            "source": data.source,
            "field": data.field,
            "seq_len": data.seq_len,
            "fingerprint": fingerprint,
        },
        "tokenizer": tokenizer_text,
        "training": record,
        "created_unix": time.time(),
        "versions": {
            "lmc_mergekit": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
