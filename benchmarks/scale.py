"""Time and peak memory of every pass at the shapes users merge, as ratios to one model.

    python benchmarks/scale.py table [--shapes d256 160m 410m 1b llama-gqa]
        [--passes lmc_dm activations subclone ls_merge learn] [--work DIR] [--rounds N]
        [--cuda] [--markdown docs/results.md]

Builds (once, under ``--work``) a pair of random-initialised checkpoints per shape: GPT-NeoX of
Pythia shapes (d=256 ×4 layers, 160M, 410M, 1B; vocabulary 4096, the zoo's tokenizer) and one
Llama shape with GQA. Each pass then runs as a recipe through the whole tool
(``lmc-mergekit-yaml``'s pipeline, ``evaluate: false``, a fresh cache), alone in a fresh
process: its peak RSS when the pre-merge pass ends, and the process's peak over the whole
recipe read from ``wait4`` (what ``/usr/bin/time -v`` reports), which includes mergekit's own
merge of the prepared inputs (mergekit holds one output shard, ``--out-shard-size``, and its
serialised copy):

- ``lmc_dm``: ``steps: 0`` (weight matching, writing both inputs, the self-check, the merge);
  also the seconds per weight-matching round and of writing + self-check;
- ``activations``: the same with ``matching: activations`` (64 calibration sequences of 128
  tokens read by both models, block by block); also the seconds of activation matching;
- ``subclone``: ``subclone_compensate`` to half the width and MLP (compensation on);
- ``ls_merge``: encoding both inputs with an autoencoder given to the recipe (trained
  beforehand on the pair for ``--ae-steps`` steps, in its own process: the measured pass is the
  encoding, which is what scales with the model);
- ``learn``: one learned-matching step (dual, every family) next to one plain training step
  (forward, backward, AdamW) of one model at the same batch, in one process each.

Memory is given as a multiple of one model's fp32 size; the learned step as a multiple of the
plain step measured in the same run (the machine is noisy, ratios less so).

    python benchmarks/scale.py pair [--shape 7b] [--memory-limit GIB] [--rounds N] [--work DIR]
        [--markdown docs/results.md]

A pair that need not fit in memory: two random bf16 checkpoints of a Llama shape (``7b``:
Llama-2-7B's configuration, 13.5 GB each; ``1b``: 1.1B, 2.2 GB each; ``250m``), written a
tensor at a time (never a whole model in memory), merged by mergekit's own ``linear`` and by
``lmc_dm`` (``matching: weights``, ``steps: 0``, ``evaluate: false``) side by side, each a
whole command in a fresh process: its seconds, whether it succeeded, and its peak memory read
apart into anonymous memory and mapped file pages (page cache, which the kernel can drop:
mmapped reads count in RSS), sampled every 0.2 s over the process tree, with ``wait4``'s peak
RSS. With ``--memory-limit`` both run inside a memory cgroup of that size (cgroup v1 or v2,
where this process may make one), so that the pair is larger than the memory the merge may
use.

    python benchmarks/scale.py heal [--shape 1b] [--hidden 1536 --heads 24 --mlp 4224]
        [--steps 10] [--work DIR] [--markdown docs/results.md]

Healing at the sizes people shrink: the first model of ``pair``'s ``--shape`` (random bf16)
converted by ``subclone_compensate`` (selection alone on 16 calibration sequences) to
``--hidden`` (``--heads`` query heads, the group size kept, MLP ``--mlp``), then ``lmc-mergekit
heal`` for ``--steps`` steps (batch 8 × 128 tokens of the bundled corpus), by distillation from
its donor (the default), the same with ``--gradient-checkpointing``, and on the text alone, each
a whole command in a fresh process: seconds a step, the teacher's share, and peak anonymous
memory against the bound of four times the student in float32 (weights, gradients, AdamW's two
moments) plus the teacher as stored.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from markdown_blocks import add_markdown_option, publish

SHAPES: dict[str, tuple[str, dict]] = {
    "d256": ("gpt_neox", {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8}),
    "160m": ("gpt_neox", {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12}),
    "410m": (
        "gpt_neox",
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16},
    ),
    "1b": ("gpt_neox", {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 8}),
    "llama-gqa": (
        "llama",
        {
            "hidden_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "intermediate_size": 2816,
        },
    ),
}
PASSES = ("lmc_dm", "activations", "subclone", "ls_merge", "learn")
#: Llama shapes of ``pair`` (bf16, vocabulary 32,000, untied): Llama-2-7B's, TinyLlama's, and
#: a 250M one that runs in minutes on two cores.
PAIR_SHAPES = {
    "7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
    },
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 5632,
    },
    "250m": {
        "hidden_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
    },
    # gpu_check.py's dry run: every stage of the large rows, at a toy size.
    "toy": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 172,
    },
}
VOCAB = 4096
SEQ_LEN = 128


def build_pair(shape: str, work: Path) -> tuple[Path, Path, int]:
    """Two random-initialised checkpoints of ``shape`` (seeds 0 and 1) and their parameter
    count; built once, in a child process: a process's peak RSS is inherited by the processes
    it starts, so the measuring process must never hold a model."""
    folders = [work / f"{shape}-seed{seed}" for seed in (0, 1)]
    if not all((folder / "config.json").is_file() for folder in folders):
        subprocess.run([sys.executable, __file__, "build-worker", shape, str(work)], check=True)
    return folders[0], folders[1], parameter_count(folders[0])


def parameter_count(folder: Path) -> int:
    """The parameters of the checkpoint in ``folder`` (from its config, nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def build_worker(shape: str, work: Path) -> None:
    """Build the pair of ``shape`` under ``work``."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

    from lmc_mergekit.runtime.publish import staged_folder
    from lmc_mergekit.zoo.tokenizer import cached_tokenizer

    arch, sizes = SHAPES[shape]
    tokenizer = cached_tokenizer(work)
    for seed in (0, 1):
        folder = work / f"{shape}-seed{seed}"
        if (folder / "config.json").is_file():
            continue
        common = dict(vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=False)
        if arch == "gpt_neox":
            config = GPTNeoXConfig(
                **common, **sizes, intermediate_size=4 * sizes["hidden_size"], rotary_pct=0.25
            )
        else:
            config = LlamaConfig(**common, **sizes)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with staged_folder(folder, "replace") as staging:
            model.save_pretrained(staging, max_shard_size="2GB")
            for name in os.listdir(tokenizer):
                (staging / name).write_bytes((tokenizer / name).read_bytes())
        del model


def recipe(kind: str, a: Path, b: Path, args) -> dict:
    """The recipe the pass ``kind`` runs."""
    both = [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)]
    if kind in ("lmc_dm", "activations"):
        matching = "weights" if kind == "lmc_dm" else "activations"
        return {
            "merge_method": "lmc_dm",
            "models": both,
            "dtype": "float32",
            # Random models look like one basin: the check would keep them as they are.
            "alignment": {"matching": matching, "steps": 0, "evaluate": False}
            | {"one_basin_check": False}
            | ({"max_iterations": args.rounds} if args.rounds else {}),
        }
    if kind == "subclone":
        config = json.loads((a / "config.json").read_text())
        half = config["hidden_size"] // 2
        return {
            "merge_method": "subclone_compensate",
            "models": [{"model": str(a)}],
            "dtype": "float32",
            "subclone": {
                "hidden_size": half,
                "intermediate_size": config["intermediate_size"] // 2,
                "evaluate": False,
                "calibration_sequences": 64,
            },
        }
    return {
        "merge_method": "ls_merge",
        "models": both,
        "dtype": "float32",
        "latent": {
            "autoencoder": str(autoencoder_for(a, b, args)),
            "evaluate": False,
            "noise_floor": False,
        },
    }


def autoencoder_for(a: Path, b: Path, args) -> Path:
    """An autoencoder trained on the pair for ``--ae-steps`` steps (once, in a child)."""
    path = a.parent / f"{a.name}-autoencoder-{args.ae_steps}.safetensors"
    if not path.is_file():
        command = [sys.executable, __file__, "ae-worker", str(a), str(b), str(path)]
        subprocess.run([*command, "--ae-steps", str(args.ae_steps)], check=True)
    return path


def ae_worker(args) -> None:
    """Train the autoencoder ``autoencoder_for`` names."""
    from lmc_mergekit.latent.autoencoder import save_autoencoder
    from lmc_mergekit.latent.chunks import model_tensors
    from lmc_mergekit.latent.training import (
        TrainingConfig,
        autoencoder_config_for,
        train_autoencoder,
    )
    from lmc_mergekit.models.adapters import open_model

    tensors = [t for folder in (args.a, args.b) for t in model_tensors(open_model(folder))]
    config = autoencoder_config_for(tensors)
    model, _ = train_autoencoder(tensors, config, TrainingConfig(steps=args.ae_steps))
    save_autoencoder(model, args.path)


def run_measured(command: list[str]) -> tuple[float, float, str]:
    """Seconds, peak RSS (bytes) and output of ``command`` run alone in a fresh process."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return seconds, usage.ru_maxrss * 1024, output


def measure_pass(kind: str, a: Path, b: Path, fp32: int, work: Path, args) -> dict:
    """One pass through the pipeline of ``lmc-mergekit-yaml`` in a fresh process with a fresh
    cache: the pre-merge pass first (its peak is read when it ends), then the whole recipe
    (mergekit's merge of the prepared inputs; the pass is reused from the cache)."""
    row = measure_recipe(recipe(kind, a, b, args), kind, work, args.cuda)
    row.update(ratio=row["rss"] / fp32, pass_ratio=row["pass_rss"] / fp32)
    row["work_ratio"] = (row["pass_rss"] - row.get("base_rss", 0)) / fp32
    if kind == "lmc_dm":
        match = row["report"]["matching"][0]
        row["rounds"] = match["iterations"]
        row["per_round"] = match["seconds"] / match["iterations"]
        row["write_check"] = row["report"]["seconds"].get("writing_and_self_check")
    if kind == "activations":
        row["matching_seconds"] = row["report"]["matching"][0]["seconds"]
    return row


def measure_recipe(recipe: dict, name: str, work: Path, cuda: bool = False) -> dict:
    """``recipe`` run through ``lmc-mergekit-yaml``'s pipeline in a fresh process with a fresh
    cache under ``work`` (see :func:`pass_worker`): the pass's seconds and peak RSS, the whole
    command's, the GPU's peak (``cuda``) and the plugin's report (None for another method)."""
    run = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    path = run / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    command = [sys.executable, __file__, "pass-worker", str(path), str(run)]
    seconds, rss, output = run_measured(command + (["--cuda"] if cuda else []))
    row = json.loads(output.strip().splitlines()[-1])
    reports = list((run / "out").glob("*_report.json"))
    row.update(seconds=seconds, rss=rss)
    row["report"] = json.loads(reports[0].read_text()) if reports else None
    shutil.rmtree(run, ignore_errors=True)  # the outputs: the disk holds one at a time
    return row


def pass_worker(args) -> None:
    """Prepare, note the peak, then run the whole recipe (printed as JSON, last)."""
    from mergekit.options import MergeOptions

    from lmc_mergekit.plugin.pipeline import prepare, run_recipe
    from lmc_mergekit.plugin.plan import plan_recipe
    from lmc_mergekit.plugin.recipe import read_recipe
    from lmc_mergekit.runtime.distributed import Processes

    options, cache = MergeOptions(quiet=True, cuda=args.cuda), args.run / "cache"
    recipe = read_recipe(args.recipe)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the libraries
    started = time.perf_counter()
    prepare(plan_recipe(recipe, options, cache), Processes())
    prepared = time.perf_counter() - started
    pass_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run_recipe(args.recipe, args.run / "out", options, cache)
    row = {"pass_seconds": prepared, "pass_rss": pass_rss, "base_rss": base_rss}
    if args.cuda:
        row["gpu_peak"] = torch.cuda.max_memory_allocated()
    print(json.dumps(row))


def measure_learn(a: Path, b: Path, args) -> dict:
    """One learned-matching step and one plain training step, each in its own process."""
    device = "cuda" if args.cuda else "cpu"
    return {what: timed_step(what, a, b, args.batch, device) for what in ("train", "align")}


def timed_step(
    what: str, a: Path, b: Path, batch: int, device: str = "cpu", optimizer: str = "adamw"
) -> tuple[float, float]:
    """Median seconds and peak RSS (bytes) of one step of ``what`` (``train``: of ``a`` with
    ``optimizer``; ``align``: of the pair's symmetries) on ``batch`` sequences, in a fresh
    process."""
    command = [sys.executable, __file__, "step-worker", what, str(a), str(b)]
    command += ["--batch", str(batch), "--device", device, "--optimizer", optimizer]
    _, rss, output = run_measured(command)
    return json.loads(output.strip().splitlines()[-1])["seconds"], rss


def step_worker(args) -> None:
    """Median seconds of one step of one kind (printed as JSON, last)."""
    from step_timing import time_step

    batch = torch.randint(
        0, VOCAB, (args.batch, SEQ_LEN), generator=torch.Generator().manual_seed(0)
    )
    folders = [Path(args.a), Path(args.b)]
    print(json.dumps(time_step(args.what, folders, batch, 3, 1, args.device, args.optimizer)))


def build_streamed(shape: str, work: Path) -> tuple[Path, Path]:
    """The bf16 pair of :data:`PAIR_SHAPES` ``shape`` (seeds 0 and 1), built once, in a child
    process, a tensor at a time."""
    folders = [work / f"pair-{shape}-seed{seed}" for seed in (0, 1)]
    if not all((folder / "config.json").is_file() for folder in folders):
        command = [sys.executable, __file__, "stream-build-worker", shape, str(work)]
        subprocess.run(command, check=True)
    return folders[0], folders[1]


def stream_build_worker(shape: str, work: Path) -> None:
    """Write each checkpoint of the pair tensor by tensor: the names and shapes from a model
    on the meta device, each tensor drawn as ``transformers`` initialises it (normal with the
    config's ``initializer_range``, norms one) in bf16, through mergekit's shard writer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lmc_mergekit.models.checkpoint import ShardWriter
    from lmc_mergekit.runtime.publish import staged_folder
    from lmc_mergekit.zoo.tokenizer import cached_tokenizer

    tokenizer = cached_tokenizer(work)
    config = LlamaConfig(
        vocab_size=32000,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],  # what mergekit reads the family from
        **PAIR_SHAPES[shape],
    )
    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()
        }
    for seed in (0, 1):
        folder = work / f"pair-{shape}-seed{seed}"
        if (folder / "config.json").is_file():
            continue
        generator = torch.Generator().manual_seed(seed)
        with staged_folder(folder, "replace") as staging:
            writer = ShardWriter(staging, 2 * 10**9)
            for name, size in shapes.items():
                if name.endswith("norm.weight"):
                    tensor = torch.ones(size, dtype=torch.bfloat16)
                else:
                    values = torch.empty(size).normal_(
                        0, config.initializer_range, generator=generator
                    )
                    tensor = values.to(torch.bfloat16)
                writer.write({name: tensor})
                del tensor
            writer.close()
            config.save_pretrained(staging)
            for name in os.listdir(tokenizer):
                (staging / name).write_bytes((tokenizer / name).read_bytes())


def matching_estimate(model: Path) -> int:
    """Weight matching's estimated peak for a pair of ``model``'s shape (bf16, the default
    128-token probe), beyond the process's start: the figure the pass checks before it starts."""
    from lmc_mergekit.matching.align import AlignConfig
    from lmc_mergekit.models.adapters import open_model

    return AlignConfig().matching_memory(open_model(model).spec, 2, 128)


def pair_recipe(kind: str, a: Path, b: Path, args) -> dict:
    """mergekit's ``linear`` or ``lmc_dm`` (weights, no learning, no evaluation) of the pair."""
    both = [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)]
    if kind == "linear":
        return {"merge_method": "linear", "models": both, "dtype": "bfloat16"}
    alignment = {"matching": "weights", "steps": 0, "evaluate": False, "one_basin_check": False}
    if args.rounds:
        alignment["max_iterations"] = args.rounds
    return {"merge_method": "lmc_dm", "models": both, "dtype": "bfloat16", "alignment": alignment}


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes the measured command runs in (v2, else v1), or a
    one-line reason it cannot be made here."""

    def __init__(self, limit: int):
        name = f"lmc-scale-{os.getpid()}"
        v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
        if (v2 / "cgroup.controllers").is_file():
            self.path, files = v2 / name, ("memory.max", "memory.swap.max")
        else:
            self.path, files = v1 / name, ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        try:
            self.path.mkdir()
            (self.path / files[0]).write_text(str(limit))
        except OSError as error:
            raise SystemExit(
                f"cannot make a memory cgroup at {self.path} ({error}); run as root or "
                "without --memory-limit"
            ) from None
        try:  # no swap either, where the kernel counts it
            (self.path / files[1]).write_text(str(limit))
        except OSError:
            pass

    def enter(self) -> None:
        """Move the calling process (a child, before it runs the command) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            if (self.path / name).is_file():
                return int((self.path / name).read_text())
        return None

    def remove(self) -> None:
        self.path.rmdir()


def sampled_run(command: list[str], cgroup: MemoryCgroup | None, gpu: bool = False) -> dict:
    """Run ``command``; its seconds, exit code, ``wait4`` peak RSS and, sampled every 0.2 s
    over its process tree, the peaks of anonymous memory and of mapped file pages (and with
    ``gpu``, of the GPU memory in use, read from ``nvidia-smi`` about once a second)."""
    import threading

    started = time.perf_counter()
    preexec = cgroup.enter if cgroup is not None else None
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec
    )
    peaks = {"anon": 0, "file": 0, "gpu": 0}

    def sample() -> None:
        ticks = 0
        while process.poll() is None:
            ticks += 1
            if gpu and ticks % 5 == 1:
                peaks["gpu"] = max(peaks["gpu"], _gpu_memory_used())
            anon = file = 0
            for pid in [process.pid, *_descendants(process.pid)]:
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        key, _, value = line.partition(":")
                        if key == "RssAnon":
                            anon += int(value.split()[0]) * 1024
                        elif key in ("RssFile", "RssShmem"):
                            file += int(value.split()[0]) * 1024
                except OSError:
                    continue
            peaks["anon"], peaks["file"] = max(peaks["anon"], anon), max(peaks["file"], file)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    errors = process.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    sampler.join()
    return {
        "seconds": time.perf_counter() - started,
        "code": os.waitstatus_to_exitcode(status),
        "rss": usage.ru_maxrss * 1024,
        "tail": errors.strip().splitlines()[-1:] or [""],
        **peaks,
    }


def _gpu_memory_used() -> int:
    """Bytes of GPU memory in use on the first GPU (``nvidia-smi``; 0 where it cannot tell)."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        return int(text.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def _descendants(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [d for c in map(int, children) for d in (c, *_descendants(c))]


def measure_pair(args) -> list[str]:
    """``linear`` and ``lmc_dm`` of the pair of ``--shape``, side by side (see the doc); the
    table's lines (printed as they come, and published with ``--markdown``)."""
    args.work.mkdir(parents=True, exist_ok=True)
    a, b = build_streamed(args.shape, args.work)
    size = sum(f.stat().st_size for f in a.glob("*.safetensors"))
    limit = None if args.memory_limit is None else int(args.memory_limit * 2**30)
    where = "no memory limit" if limit is None else f"a memory cgroup of {gib(limit)}"
    lines = [
        f"Pair of random bf16 checkpoints in the {args.shape} Llama shape ({gib(size)} each on "
        f"disk, the pair {gib(2 * size)}), {where}; machine memory "
        f"{gib(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))}"
        + ("; both on the GPU (`--cuda`)." if args.cuda else ".")
        + f" `lmc_dm`'s matching estimated its peak at {gib(matching_estimate(a))} beyond the "
        "process's start (about 0.75 GiB) before it started.",
        "",
        "| method | result | seconds | peak anonymous | peak mapped file pages | peak RSS "
        "(wait4) | cgroup peak | " + ("GPU peak (nvidia-smi) | " if args.cuda else "") + "stages |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if args.cuda else ""),
    ]
    print("\n".join(lines), flush=True)
    for kind in ("linear", "lmc_dm"):
        run = Path(tempfile.mkdtemp(prefix=f"pair-{kind}-", dir=args.work))
        (run / "recipe.yml").write_text(yaml.safe_dump(pair_recipe(kind, a, b, args)))
        tool = "mergekit-yaml" if kind == "linear" else "lmc-mergekit-yaml"
        command = [
            str(Path(sys.executable).parent / tool),
            str(run / "recipe.yml"),
            str(run / "out"),
        ]
        command += ["--lazy-unpickle"] + (
            ["--lmc-cache", str(run / "cache")] if kind != "linear" else []
        )
        command += ["--cuda"] if args.cuda else []
        cgroup = None if limit is None else MemoryCgroup(limit)
        try:
            row = sampled_run(command, cgroup, args.cuda)
            peak = None if cgroup is None else cgroup.peak()
            stages = pair_stages(run / "out", row["seconds"]) if kind == "lmc_dm" else ""
        finally:
            shutil.rmtree(run, ignore_errors=True)  # the outputs: the disk holds one at a time
            if cgroup is not None:
                cgroup.remove()
        result = "merged" if row["code"] == 0 else f"failed ({row['code']}: {row['tail'][0][:80]})"
        lines.append(
            f"| {kind} | {result} | {row['seconds']:.0f} | {gib(row['anon'])} | "
            f"{gib(row['file'])} | {gib(row['rss'])} | {'' if peak is None else gib(peak)} | "
            + (f"{gib(row['gpu'])} | " if args.cuda else "")
            + f"{stages} |"
        )
        print(lines[-1], flush=True)
    publish(args, "pair", "\n".join(lines))
    return lines


def pair_stages(out: Path, whole: float) -> str:
    """The stage split of an ``lmc_dm`` run from its report: weight matching (its rounds and
    why they stopped), writing and self-checking the inputs it had not written on the way,
    and the rest (start-up, mergekit's merge of the moved pair)."""
    path = out / "lmc_report.json"
    if not path.is_file():
        return ""
    report = json.loads(path.read_text())
    seconds, match = report["seconds"], report["matching"][0]
    matching, writing = seconds.get("matching", 0.0), seconds.get("writing_and_self_check", 0.0)
    written = " (the moved input written and checked in its last round)" * bool(
        match.get("written_by_last_round")
    )
    return (
        f"matching {matching:.0f} s: {match['iterations']} round(s), stopped: "
        f"{match.get('stopped', '?')}{written}; writing and self-check {writing:.0f} s; "
        f"start-up and mergekit's merge {whole - matching - writing:.0f} s"
    )


def measure_heal(args) -> None:
    """A converted model of ``--shape`` healed with and without its donor (see the doc)."""
    args.work.mkdir(parents=True, exist_ok=True)
    donor, _ = build_streamed(args.shape, args.work)
    student = args.work / f"heal-{args.shape}-d{args.hidden}"
    if not (student / "config.json").is_file():
        section = {
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "intermediate_size": args.mlp,
            # Selection alone on 16 calibration sequences: the heal's memory is what is
            # measured, and the student's shape is the same; the default conversion (256
            # sequences through the 1.1B donor, the held-out fits) takes over 20 minutes here.
            "compensate": False,
            "calibration_sequences": 16,
            "evaluate": False,
        }
        merge = {"merge_method": "subclone_compensate", "models": [{"model": str(donor)}]}
        recipe_file = args.work / f"heal-{args.shape}.yml"
        recipe_file.write_text(yaml.safe_dump({**merge, "dtype": "bfloat16", "subclone": section}))
        tool = str(Path(sys.executable).parent / "lmc-mergekit-yaml")
        cache = args.work / "heal-cache"
        converted = sampled_run(
            [tool, str(recipe_file), str(student), "--lmc-cache", str(cache)], None
        )
        if converted["code"] != 0:
            raise SystemExit(f"conversion failed: {converted['tail'][0]}")
    params = parameter_count(student)
    teacher = sum(f.stat().st_size for f in donor.glob("*.safetensors"))
    bound = 4 * 4 * params + teacher
    lines = [
        f"{args.shape} donor (random bf16, {gib(teacher)}) converted to d={args.hidden} "
        f"({params / 1e6:.0f}M parameters, {gib(4 * params)} in float32); {args.steps} steps of "
        f"`lmc-mergekit heal` (8 × 128 tokens). Bound: 4 × the student in float32 + the teacher "
        f"as stored = {gib(bound)}.",
        "",
        "| heal | seconds a step | teacher's forward, share | peak anonymous | peak RSS (wait4) "
        "| within the bound |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    hows = {
        "distilled from the donor": [],
        "distilled, --gradient-checkpointing": ["--gradient-checkpointing"],
        "text alone (--no-teacher)": ["--no-teacher"],
    }
    for how, options in hows.items():
        out = Path(tempfile.mkdtemp(prefix="healed-", dir=args.work)) / "out"
        command = [
            str(Path(sys.executable).parent / "lmc-mergekit"), "heal", str(student), str(out),
            "--steps", str(args.steps), "--eval-sequences", "8", "--eval-every", str(args.steps),
            "--lmc-cache", str(args.work / "heal-cache"), "--device", "cpu", *options,
        ]  # fmt: skip
        row = sampled_run(command, None)
        if row["code"] != 0:
            raise SystemExit(f"heal failed: {row['tail'][0]}")
        record = json.loads((out / "heal.json").read_text())
        shutil.rmtree(out.parent, ignore_errors=True)
        share = record["teacher"]["share_of_time"] if record["teacher"] else 0.0
        lines.append(
            f"| {how} | {record['wall_time_s'] / args.steps:.1f} | {share:.0%} | "
            f"{gib(row['anon'])} | {gib(row['rss'])} | {'yes' if row['anon'] <= bound else 'no'} |"
        )
        print(lines[-1], flush=True)
    publish(args, f"heal-{args.shape}", "\n".join(lines))


def gib(n: float) -> str:
    return f"{n / 1024**3:.2f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    table = sub.add_parser("table")
    table.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    table.add_argument("--passes", nargs="+", default=list(PASSES), choices=list(PASSES))
    table.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    table.add_argument("--ae-steps", type=int, default=50, help="autoencoder training steps")
    table.add_argument("--batch", type=int, default=4, help="sequences per step (learn)")
    table.add_argument("--cuda", action="store_true", help="run every pass on the GPU")
    table.add_argument(
        "--rounds", type=int, help="most weight-matching rounds (lmc_dm; default: the tool's)"
    )
    add_markdown_option(table)
    pair = sub.add_parser("pair")
    pair.add_argument("--shape", default="7b", choices=list(PAIR_SHAPES))
    pair.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    pair.add_argument("--memory-limit", type=float, metavar="GIB", help="run in a cgroup")
    pair.add_argument("--rounds", type=int, help="most weight-matching rounds of lmc_dm")
    pair.add_argument("--cuda", action="store_true", help="both merges on the GPU")
    add_markdown_option(pair)
    healing = sub.add_parser("heal")
    healing.add_argument("--shape", default="1b", choices=list(PAIR_SHAPES))
    healing.add_argument("--hidden", type=int, default=1536)
    healing.add_argument("--heads", type=int, default=24)
    healing.add_argument("--mlp", type=int, default=4224)
    healing.add_argument("--steps", type=int, default=10)
    healing.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    add_markdown_option(healing)
    streamer = sub.add_parser("stream-build-worker")
    streamer.add_argument("shape", choices=list(PAIR_SHAPES))
    streamer.add_argument("work", type=Path)
    builder = sub.add_parser("build-worker")
    builder.add_argument("shape", choices=list(SHAPES))
    builder.add_argument("work", type=Path)
    passes = sub.add_parser("pass-worker")
    passes.add_argument("recipe", type=Path)
    passes.add_argument("run", type=Path)
    passes.add_argument("--cuda", action="store_true")
    trainer = sub.add_parser("ae-worker")
    trainer.add_argument("a", type=Path)
    trainer.add_argument("b", type=Path)
    trainer.add_argument("path", type=Path)
    trainer.add_argument("--ae-steps", type=int, default=50)
    worker = sub.add_parser("step-worker")
    worker.add_argument("what", choices=["train", "align"])
    worker.add_argument("a")
    worker.add_argument("b")
    worker.add_argument("--batch", type=int, default=4)
    worker.add_argument("--device", default="cpu")
    worker.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    args = parser.parse_args(sys.argv[1:] if len(sys.argv) > 1 else ["table"])
    if args.command == "step-worker":
        step_worker(args)
        return
    if args.command == "pass-worker":
        pass_worker(args)
        return
    if args.command == "ae-worker":
        ae_worker(args)
        return
    if args.command == "build-worker":
        build_worker(args.shape, args.work)
        return
    if args.command == "stream-build-worker":
        stream_build_worker(args.shape, args.work)
        return
    if args.command == "pair":
        measure_pair(args)
        return
    if args.command == "heal":
        measure_heal(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    lines = [
        "| shape | parameters | one model fp32 | pass | seconds: whole (pass) | peak RSS of "
        "the pass | ratio | above the libraries' own | whole command (with mergekit's merge) "
        "| detail |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for shape in args.shapes:
        a, b, params = build_pair(shape, args.work)
        fp32 = params * 4
        head = f"| {shape} | {params / 1e6:.0f} M | {gib(fp32)} "
        for kind in args.passes:
            if kind == "learn":
                steps = measure_learn(a, b, args)
                (train, train_rss), (align, align_rss) = steps["train"], steps["align"]
                lines.append(
                    f"{head}| learned step (batch {args.batch}×{SEQ_LEN}) | {align:.2f} s "
                    f"({align / train:.1f}× a plain step: {train:.2f} s) | {gib(align_rss)} | "
                    f"**{align_rss / fp32:.2f}×** | | plain step: {gib(train_rss)} "
                    f"({train_rss / fp32:.2f}×) | |"
                )
                print(lines[-1], flush=True)
                continue
            row = measure_pass(kind, a, b, fp32, args.work, args)
            detail = ""
            if kind == "activations":
                detail = f"activation matching {row['matching_seconds']:.1f} s"
            if kind == "lmc_dm":
                detail = (
                    f"{row['rounds']} rounds, {row['per_round']:.1f} s each; write + "
                    f"self-check {row['write_check']:.1f} s"
                )
            lines.append(
                f"{head}| {kind} | {row['seconds']:.0f} s ({row['pass_seconds']:.0f} s) | "
                f"{gib(row['pass_rss'])} | **{row['pass_ratio']:.2f}×** | "
                f"{row['work_ratio']:.2f}× ({gib(row['base_rss'])} before any work) | "
                f"{gib(row['rss'])} ({row['ratio']:.2f}×) | {detail} |"
            )
            print(lines[-1], flush=True)
    publish(args, "table", "\n".join(lines))


if __name__ == "__main__":
    main()
