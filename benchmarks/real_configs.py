"""Time and whole-command memory of every pass on checkpoints in real models' configurations.

    python benchmarks/real_configs.py table [--configs llama-3.2-1b qwen3-0.6b gemma-2-2b
        olmo-2-1b gemma-3-270m gemma-3-4b] [--passes lmc_dm learn subclone ls_merge] [--layers N]
        [--work DIR] [--rounds N] [--eval-sequences N] [--points N] [--markdown docs/results.md]

Builds (once, under ``--work``, in a child process) two random-initialised bf16 checkpoints per
configuration, in the exact configuration of the published model (transformers' config
classes; vocabulary, heads, rotary scaling, soft-caps, tying), cut to ``--layers`` blocks (or
the configuration's default depth, printed with the table) where the full depth would not fit
this machine's time or memory, each with a tokenizer that adds a BOS token where the family's
does: the zoo's byte-level BPE with the family's special tokens and a ``bos $A`` post-processor
(Llama 3, Gemma, OLMo 2), none for Qwen. The embedding keeps the real vocabulary: the rows past
the tokenizer's are padding, as in Qwen3's own checkpoints.

Each pass then runs as a recipe through ``lmc-mergekit-yaml``'s pipeline in a fresh process
with a fresh cache (``scale.py``'s ``pass-worker``), and its whole-command peak RSS is read
from ``wait4`` (what ``/usr/bin/time -v`` reports), mergekit's merge and any evaluation
included:

- ``lmc_dm``: ``steps: 0`` (``matching: weights``, capped at ``--rounds``, both inputs written and
  self-checked, mergekit's merge) with evaluation (the loss along the raw and the matched path
  on ``--points`` λ values and the merged model's loss, ``--eval-sequences`` test sequences);
- ``self-merge``: ``lmc_dm`` of the first checkpoint and its scramble (``lmc-mergekit
  scramble``: a random symmetry, as a held-out model's check scrambles it), the recipe's
  defaults but ``steps: 0`` (``matching: auto``, its rounds to convergence) and
  ``one_basin_check: false`` (random weights and their scramble both score a uniform guess,
  so the check would keep them as they are, where a trained model's scramble is matched),
  with the same evaluation;
- ``learn``: the same as ``lmc_dm`` with one learned-matching step (the recipe's default
  batch), no evaluation;
- ``subclone``: ``subclone_compensate`` of the first checkpoint to the next size down of the
  family through ``target_config`` (compensated; post-norm families through their
  post-norms), no evaluation;
- ``ls_merge``: a self-merge (``samples: 1``) of the first checkpoint, encoded with an
  autoencoder of the default size given to the recipe (trained beforehand in its own process
  for ``--ae-steps`` steps on the blocks and slices of the embeddings: the measured pass is the
  encoding, which is what scales with the model), no evaluation.

Printed per configuration and pass: seconds, whole-command peak RSS and its ratio to one model
in float32, the output's dtype and whether its embeddings are tied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from scale import gib, run_measured

HERE = Path(__file__).resolve().parent
PASSES = ("lmc_dm", "self-merge", "learn", "subclone", "ls_merge")
#: Tokens of the benchmark's tokenizer (the embedding keeps the real vocabulary).
TOKENIZER_VOCAB = 4096
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


@dataclass(frozen=True)
class RealConfig:
    """A published model's configuration, how deep the benchmark builds it, its tokenizer's
    special tokens, and the next size down that size conversion converts it to."""

    model_type: str
    config: dict
    #: Depth built unless ``--layers`` says otherwise (the full depth where it fits here).
    layers: int
    bos: str | None
    eos: str
    #: Sizes of the next size down (the rest of the configuration kept).
    smaller: dict
    note: str = ""
    vision: dict = field(default_factory=dict)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
GEMMA3_4B_ROPE = {
    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
CONFIGS: dict[str, RealConfig] = {
    "llama-3.2-1b": RealConfig(
        "llama",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "rope_parameters": LLAMA3_ROPE,
            "tie_word_embeddings": True,
        },
        layers=2,
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        smaller={
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "intermediate_size": 4096,
        },
        note="no smaller Llama 3.2 exists: half width, head size 64 kept",
    ),
    "qwen3-0.6b": RealConfig(
        "qwen3",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 3072,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
        },
        layers=2,
        bos=None,
        eos="<|endoftext|>",
        smaller={
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "intermediate_size": 1536,
        },
        note="the smallest Qwen3: half width, head size 128 kept",
    ),
    "gemma-2-2b": RealConfig(
        "gemma2",
        {
            "hidden_size": 2304,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "intermediate_size": 9216,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": True,
        },
        layers=2,
        bos="<bos>",
        eos="<eos>",
        smaller={
            "hidden_size": 1152,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 4608,
        },
        note="the smallest Gemma 2: half width, head size 256 kept",
    ),
    "olmo-2-1b": RealConfig(
        "olmo2",
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "intermediate_size": 8192,
            "vocab_size": 100352,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": False,
        },
        layers=2,
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        smaller={
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "intermediate_size": 4096,
        },
        note="OLMo-2-0425-1B is the smallest OLMo 2: half width, head size 128 kept",
    ),
    "gemma-3-270m": RealConfig(
        "gemma3_text",
        {
            "hidden_size": 640,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "intermediate_size": 2048,
            "vocab_size": 262144,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 512,
            "rope_parameters": GEMMA3_ROPE,
            "tie_word_embeddings": True,
        },
        layers=18,
        bos="<bos>",
        eos="<eos>",
        smaller={"hidden_size": 320, "intermediate_size": 1024},
        note="no smaller Gemma 3 exists: half width and MLP, heads and head size kept",
    ),
    "gemma-3-4b": RealConfig(
        "gemma3",
        {
            "hidden_size": 2560,
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "intermediate_size": 10240,
            "vocab_size": 262208,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 256,
            "sliding_window": 1024,
            "rope_parameters": GEMMA3_4B_ROPE,
            "tie_word_embeddings": True,
        },
        layers=2,
        bos="<bos>",
        eos="<eos>",
        smaller={
            "hidden_size": 1152,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 6912,
        },
        note="Gemma 3 1B's width and MLP (its vocabulary differs: the 4B's kept), head size 256",
        vision={
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 896,
            "patch_size": 14,
            "vision_use_head": False,
        },
    ),
}


def model_type_for(name: str) -> str:
    """The ``model_type`` built for ``name``: multimodal Gemma 3 where the tool supports it,
    else its text model (``gemma3_text``)."""
    from lmc_mergekit.models.adapters import SUPPORTED_MODEL_TYPES

    wanted = CONFIGS[name].model_type
    if wanted == "gemma3" and wanted not in SUPPORTED_MODEL_TYPES:
        return "gemma3_text"
    return wanted


def depth(name: str, args) -> int:
    return args.layers or CONFIGS[name].layers


def pair_folders(name: str, args) -> list[Path]:
    return [args.work / f"{name}-{depth(name, args)}L-seed{seed}" for seed in (0, 1)]


def build_pair(name: str, args) -> list[Path]:
    """The two checkpoints of ``name`` (built once, in a child process: a process's peak RSS
    is inherited by the processes it starts, so the measuring process never holds a model)."""
    folders = pair_folders(name, args)
    if not all((folder / "config.json").is_file() for folder in folders):
        command = [sys.executable, __file__, "build-worker", name, str(args.work)]
        subprocess.run([*command, "--layers", str(depth(name, args))], check=True)
    return folders


def transformers_config(name: str, layers: int, tokenizer, sizes: dict | None = None):
    """The transformers config of ``name`` cut to ``layers`` blocks (layer types: the first
    ``layers`` of the published pattern), with ``sizes`` changed and the tokenizer's ids."""
    from transformers import AutoConfig

    real = CONFIGS[name]
    text = {**real.config, **(sizes or {}), "num_hidden_layers": layers}
    ids = {
        "bos_token_id": tokenizer.bos_token_id if real.bos else None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    full = AutoConfig.for_model(_text_type(real.model_type), **real.config)
    if getattr(full, "layer_types", None):
        text["layer_types"] = list(full.layer_types[:layers])
    model_type = model_type_for(name)
    if model_type == "gemma3":
        return AutoConfig.for_model(
            "gemma3",
            text_config={**text, **ids},
            vision_config=real.vision,
            tie_word_embeddings=True,
            **ids,
        )
    return AutoConfig.for_model(model_type, **text, **ids)


def _text_type(model_type: str) -> str:
    return "gemma3_text" if model_type == "gemma3" else model_type


def family_tokenizer(name: str, work: Path):
    """The zoo's byte-level BPE with the family's special tokens, prepending BOS where the
    family's tokenizer does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from lmc_mergekit.zoo.tokenizer import SPECIAL_TOKEN, cached_tokenizer

    real = CONFIGS[name]
    tokenizer = AutoTokenizer.from_pretrained(cached_tokenizer(work, vocab_size=TOKENIZER_VOCAB))
    special = {"eos_token": real.eos, "pad_token": real.eos, "unk_token": SPECIAL_TOKEN}
    tokenizer.add_special_tokens(special | ({"bos_token": real.bos} if real.bos else {}))
    if real.bos:
        bos = (real.bos, tokenizer.convert_tokens_to_ids(real.bos))
        tokenizer.backend_tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{real.bos} $A",
                    pair=f"{real.bos} $A {real.bos} $B",
                    special_tokens=[bos],
                ),
            ]
        )
    else:
        tokenizer.bos_token = None
    return tokenizer


def build_worker(name: str, work: Path, layers: int) -> None:
    """Build the pair of ``name`` under ``work`` (and the smaller target's config.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from lmc_mergekit.runtime.publish import staged_folder

    tokenizer = family_tokenizer(name, work)
    config = transformers_config(name, layers, tokenizer)
    auto = AutoModelForImageTextToText if config.model_type == "gemma3" else AutoModelForCausalLM
    for seed, folder in enumerate(pair_folders(name, argparse.Namespace(layers=layers, work=work))):
        if (folder / "config.json").is_file():
            continue
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.bfloat16)
        with staged_folder(folder, "replace") as staging:
            model.save_pretrained(staging, max_shard_size="2GB")
            tokenizer.save_pretrained(staging)
            ids = tokenizer("Language modeling is")["input_ids"]
            if (ids[0] == tokenizer.bos_token_id) != bool(CONFIGS[name].bos):
                raise SystemExit(f"{name}: the tokenizer's BOS handling is wrong ({ids})")
        del model


def target_config(name: str, folder: Path, args) -> Path:
    """A config.json of the next size down of ``name``'s family, at the built depth."""
    target = args.work / f"{name}-{depth(name, args)}L-smaller"
    if not (target / "config.json").is_file():
        target.mkdir(parents=True, exist_ok=True)
        config = json.loads((folder / "config.json").read_text())
        smaller = CONFIGS[name].smaller
        if "text_config" in config:
            config["text_config"].update(smaller)
        else:
            config.update(smaller)
        (target / "config.json").write_text(json.dumps(config, indent=2))
    return target / "config.json"


def recipe(kind: str, folders: list[Path], name: str, args) -> dict:
    """The recipe the pass ``kind`` runs on the pair ``folders`` of ``name``."""
    both = [{"model": str(m), "parameters": {"weight": 0.5}} for m in folders]
    # Weight matching always kept: random models from different seeds lie in one basin to the
    # one-basin check, which would run no matching, and the pass would not be measured.
    matching = {"matching": "weights", "one_basin_check": False}
    if args.rounds:
        matching["max_iterations"] = args.rounds
    evaluation = {"eval_sequences": args.eval_sequences, "points": args.points}
    if kind == "lmc_dm":
        alignment = {"steps": 0, **evaluation, **matching}
        return {"merge_method": "lmc_dm", "models": both, "alignment": alignment}
    if kind == "self-merge":
        pair = [{"model": str(m), "parameters": {"weight": 0.5}} for m in scrambled(folders[0])]
        # A random model and its scramble lie in one basin to the one-basin check (both score
        # a uniform guess): a trained model and its scramble do not, so matching is kept.
        alignment = {"steps": 0, "one_basin_check": False, **evaluation}
        return {"merge_method": "lmc_dm", "models": pair, "alignment": alignment}
    if kind == "learn":
        alignment = {"steps": 1, "evaluate": False, **matching}
        return {"merge_method": "lmc_dm", "models": both, "alignment": alignment}
    if kind == "subclone":
        return {
            "merge_method": "subclone_compensate",
            "models": [{"model": str(folders[0])}],
            "subclone": {
                "target_config": str(target_config(name, folders[0], args)),
                "calibration_sequences": args.calibration_sequences,
                "evaluate": False,
            },
        }
    return {
        "merge_method": "ls_merge",
        "models": [{"model": str(folders[0])}],
        "latent": {
            "autoencoder": str(autoencoder_for(folders[0], args)),
            "samples": 1,
            "evaluate": False,
            "noise_floor": False,
        },
    }


def scrambled(folder: Path) -> tuple[Path, Path]:
    """``folder`` and its scramble beside it (made once by ``lmc-mergekit scramble``)."""
    copy = folder.parent / f"{folder.name}-scrambled"
    if not (copy / "config.json").is_file():
        tool = Path(sys.executable).parent / "lmc-mergekit"
        command = [str(tool), "scramble", str(folder), str(copy), "--overwrite"]
        subprocess.run(command, check=True, capture_output=True)
    return folder, copy


def autoencoder_for(folder: Path, args) -> Path:
    """An autoencoder of the default size that knows every kind and layer of ``folder`` (once,
    in a child process)."""
    path = folder.parent / f"{folder.name}-autoencoder-{args.ae_steps}.safetensors"
    if not path.is_file():
        command = [sys.executable, __file__, "ae-worker", str(folder), str(path)]
        subprocess.run([*command, "--ae-steps", str(args.ae_steps)], check=True)
    return path


def ae_worker(args) -> None:
    """Train :func:`autoencoder_for`'s autoencoder on the blocks of ``args.folder`` and the
    first rows of its embeddings and head (the kinds are what matters: the pass encodes)."""
    from lmc_mergekit.latent.autoencoder import save_autoencoder
    from lmc_mergekit.latent.chunks import NamedTensor, model_tensors
    from lmc_mergekit.latent.training import (
        TrainingConfig,
        autoencoder_config_for,
        train_autoencoder,
    )
    from lmc_mergekit.models.adapters import open_model

    tensors = [
        NamedTensor(t.kind, t.layer, t.tensor[:4096] if t.layer < 0 else t.tensor)
        for t in model_tensors(open_model(args.folder))
    ]
    config = autoencoder_config_for(tensors)
    model, _ = train_autoencoder(tensors, config, TrainingConfig(steps=args.ae_steps))
    save_autoencoder(model, args.path)


def safetensors_facts(folder: Path) -> tuple[set[str], set[str]]:
    """The dtypes and tensor names stored in ``folder`` (read from the file headers)."""
    dtypes, names = set(), set()
    for shard in folder.glob("*.safetensors"):
        with open(shard, "rb") as fp:
            header = json.loads(fp.read(struct.unpack("<Q", fp.read(8))[0]))
        for key, entry in header.items():
            if key != "__metadata__":
                dtypes.add(SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]))
                names.add(key)
    return dtypes, names


def parameter_count(folder: Path) -> int:
    """Parameters stored in the checkpoint ``folder`` (a tied head counted once)."""
    total = 0
    for shard in folder.glob("*.safetensors"):
        with open(shard, "rb") as fp:
            header = json.loads(fp.read(struct.unpack("<Q", fp.read(8))[0]))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


def tied(folder: Path) -> str:
    """Whether the checkpoint in ``folder`` ties its head to its embeddings."""
    config = json.loads((folder / "config.json").read_text())
    _, names = safetensors_facts(folder)
    text = config.get("text_config", config)
    flag = text.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return "tied" if flag and not any(n.endswith("lm_head.weight") for n in names) else "untied"


def measure(kind: str, folders: list[Path], name: str, args) -> dict:
    """One pass in a fresh process with a fresh cache: seconds, whole-command peak RSS, and
    the output's dtype and tying."""
    run = Path(tempfile.mkdtemp(prefix=f"{name}-{kind}-", dir=args.work))
    path = run / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe(kind, folders, name, args)))
    command = [sys.executable, str(HERE / "scale.py"), "pass-worker", str(path), str(run)]
    seconds, rss, output = run_measured(command)
    row = json.loads(output.strip().splitlines()[-1])
    out = run / "out"
    dtypes, _ = safetensors_facts(out)
    row.update(seconds=seconds, rss=rss, dtype="/".join(sorted(dtypes)), tied=tied(out))
    if kind in ("lmc_dm", "self-merge", "learn"):
        report = json.loads((out / "lmc_report.json").read_text())
        match = report["matching"][0]
        rounds = match.get("iterations")
        row["detail"] = (
            f"{rounds} rounds of {match['seconds'] / rounds:.0f} s" if rounds else match["matching"]
        )
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items())
        row["detail"] += f"; {stages}"
        if "stopped" in match:
            row["detail"] += f"; stopped: {match['stopped']}"
    if not args.keep:
        shutil.rmtree(run, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    table = sub.add_parser("table")
    table.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    table.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    table.add_argument("--layers", type=int, help="blocks built (default: per configuration)")
    table.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-real")
    table.add_argument("--rounds", type=int, default=2, help="most weight-matching rounds")
    table.add_argument("--eval-sequences", type=int, default=16, help="test sequences (lmc_dm)")
    table.add_argument("--points", type=int, default=5, help="λ values on each path (lmc_dm)")
    table.add_argument(
        "--calibration-sequences",
        type=int,
        default=64,
        help="(subclone; compensation needs more tokens than features)",
    )
    table.add_argument("--ae-steps", type=int, default=20, help="autoencoder training steps")
    table.add_argument("--keep", action="store_true", help="keep each run's folder")
    add_markdown_option(table)
    builder = sub.add_parser("build-worker")
    builder.add_argument("name", choices=list(CONFIGS))
    builder.add_argument("work", type=Path)
    builder.add_argument("--layers", type=int, required=True)
    trainer = sub.add_parser("ae-worker")
    trainer.add_argument("folder", type=Path)
    trainer.add_argument("path", type=Path)
    trainer.add_argument("--ae-steps", type=int, default=20)
    args = parser.parse_args(sys.argv[1:] if len(sys.argv) > 1 else ["table"])
    if args.command == "build-worker":
        build_worker(args.name, args.work, args.layers)
        return
    if args.command == "ae-worker":
        ae_worker(args)
        return
    args.work = args.work.absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    lines = [
        "| configuration | layers built | parameters | one model fp32 | pass | seconds | "
        "whole command peak RSS | ratio | output dtype | output embeddings | detail |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name in args.configs:
        folders = build_pair(name, args)
        params = parameter_count(folders[0])
        fp32 = params * 4
        full = CONFIGS[name].config["num_hidden_layers"]
        model_type = json.loads((folders[0] / "config.json").read_text())["model_type"]
        head = (
            f"| {name} (`{model_type}`) | {depth(name, args)} of {full} | "
            f"{params / 1e6:.0f} M | {gib(fp32)} "
        )
        for kind in args.passes:
            try:
                row = measure(kind, folders, name, args)
            except SystemExit as failure:  # one failed pass leaves the rest of the table
                lines.append(f"{head}| {kind} | failed: {str(failure).strip().splitlines()[-1]} |")
                print(lines[-1], flush=True)
                continue
            lines.append(
                f"{head}| {kind} | {row['seconds']:.0f} s | {gib(row['rss'])} | "
                f"**{row['rss'] / fp32:.2f}×** | {row['dtype']} | {row['tied']} | "
                f"{row.get('detail', '')} |"
            )
            print(lines[-1], flush=True)
    publish(args, "table", "\n".join(lines))


if __name__ == "__main__":
    main()
