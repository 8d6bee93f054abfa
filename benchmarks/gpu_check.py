"""Every GPU path of the project in one run on one GPU (an H200: about 6 minutes).

    python benchmarks/gpu_check.py [--work DIR] [--shape 160m] [--zoo-steps 1500] [--dry-run]
        [--markdown docs/results.md]

1. the environment (torch, the device, its memory);
2. a zoo pair (GPT-NeoX, d=128, 4 layers, seeds 0 and 1) trained on the GPU;
3. the default device: a plugin recipe run as a plain command line runs it (no ``--device``)
   lands on the GPU (``lmc_dm`` with ``steps: 0`` on the pair; the GPU memory it held);
4. ``lmc_dm`` on that pair with 600 learned-matching steps on the GPU (bf16 autocast), weight
   matching's products and the barrier evaluation there too: the barrier table row;
5. the same recipe (100 steps) under ``torchrun`` with one process per GPU (two at most),
   through NCCL, each process on the GPU of its ``LOCAL_RANK``;
6. ``ls_merge`` on the pair (autoencoder trained and the inputs encoded on the GPU);
7. the scale rows (``benchmarks/scale.py --cuda``) at ``--shape``: ``lmc_dm`` with ``steps: 0``,
   ``subclone_compensate`` to half width, ``ls_merge`` encoding, one learned step against one
   plain training step;
8. a 1B-shape pair (TinyLlama's shape, random bf16, built here a tensor at a time): ``lmc_dm``
   with one weight-matching round and ``--learn-steps`` (50) learned steps on the GPU, in a
   fresh process: seconds, a learned step's seconds, the GPU's and the host's peaks;
9. the 7B-shape pair (Llama-2-7B's shape, random bf16, built here; in ``/dev/shm`` where it
   has room): ``benchmarks/scale.py pair --shape 7b --rounds 1 --cuda``, mergekit's
   ``linear`` and ``lmc_dm`` (weights, ``steps: 0``) side by side on the GPU, each a whole
   command: seconds, host memory apart into anonymous and mapped, the GPU's peak, the stage
   split.

``--dry-run`` runs the same stages on the CPU at toy sizes (a d=32 pair, a few steps; two gloo
processes under ``torchrun``; no scale rows; the large rows on a toy Llama pair) in a few
minutes: it checks the script, not the
GPU, so that the day a GPU is lent is not spent on a typo. Each stage prints its row as it
finishes; a stage that fails prints its error and the run goes on (the exit status counts the
failed stages). Everything printed is also written to ``$OUT/gpu_check.md`` when ``OUT`` is set.
With ``--markdown``, the tables of the stages that succeeded are written, once every stage has
run, as the blocks ``table-lmc_dm`` (stage 4), ``table-scale`` (stage 7) and ``table-large``
(stages 8 and 9); ``--block`` replaces ``table``. ``--stages`` runs some of them (by number).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from lmc_dm_recipe import HEADER, pair_row
from markdown_blocks import add_markdown_option, publish
from mergekit.options import MergeOptions
from scale import (
    build_pair,
    build_streamed,
    gib,
    measure_learn,
    measure_pair,
    measure_pass,
    measure_recipe,
)

from lmc_mergekit.passes.device import pass_device, with_default_device
from lmc_mergekit.passes.ls_merge import LatentReport
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.zoo import build_zoo

LINES: list[str] = []
FAILED: list[str] = []
#: The tables of the stages that succeeded, by block suffix: written at the end of the run.
TABLES: dict[str, str] = {}


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.md").write_text("\n".join(LINES) + "\n")


def stage(name: str, fn) -> None:
    """Run one stage; a failure is printed and the run goes on."""
    started = time.perf_counter()
    try:
        fn()
    except Exception as error:  # a GPU path that fails is a finding, not the end of the run
        say(f"\n**{name} failed** after {time.perf_counter() - started:.0f} s: {error!r}")
        traceback.print_exc()
        FAILED.append(name)
        return
    say(f"\n({name}: {time.perf_counter() - started:.0f} s)")


def environment(dry_run: bool) -> None:
    if dry_run:
        say(f"dry run on the CPU: torch {torch.__version__}, {os.cpu_count()} CPU cores")
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script checks the GPU paths (--dry-run: the CPU)")
    props = torch.cuda.get_device_properties(0)
    say(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name} "
        f"(×{torch.cuda.device_count()}), {props.total_memory / 1024**3:.0f} GiB, "
        f"{os.cpu_count()} CPU cores"
    )


def lmc_dm_recipe(pair: list[Path], path: Path, **alignment) -> Path:
    """An ``lmc_dm`` recipe on ``pair`` written to ``path``."""
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
        "dtype": "float32",
        "alignment": alignment,
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gpu-check")
    parser.add_argument("--shape", default="160m")
    parser.add_argument("--zoo-steps", type=int, default=None, help="default 1500 (dry: 30)")
    parser.add_argument(
        "--dry-run", action="store_true", help="the same stages on the CPU at toy sizes"
    )
    parser.add_argument("--learn-steps", type=int, default=50, help="stage 8's learned steps")
    parser.add_argument(
        "--stages", nargs="+", type=int, default=list(range(2, 10)), help="which (2–9) to run"
    )
    add_markdown_option(parser)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    environment(args.dry_run)
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    # Toy sizes for a dry run: every stage runs, in minutes, on two CPU cores.
    hidden, layers = (32, 2) if dry else (128, 4)
    zoo_steps = args.zoo_steps or (30 if dry else 1500)
    learn_steps, launcher_steps, latent_steps = (20, 4, 20) if dry else (600, 100, 1500)
    options = MergeOptions(quiet=True, device=device)
    pair: list[Path] = []

    def zoo() -> None:
        root = args.work / "zoo"
        pair[:] = build_zoo(root, "gpt_neox", hidden, layers, (0, 1), zoo_steps, device=device)
        say(f"zoo pair: {', '.join(p.name for p in pair)}")

    def default_device() -> None:
        # What a command line without --device gets, then the recipe run that way.
        chosen = pass_device(with_default_device(MergeOptions(), device_given=False))
        if chosen.type != device:
            raise RuntimeError(f"a recipe without --device would run on {chosen}, not {device}")
        path = lmc_dm_recipe(pair, args.work / "default.yml", steps=0, evaluate=False)
        if not dry:
            torch.cuda.reset_peak_memory_stats()
        out = run_recipe(
            path,
            args.work / "default-out",
            MergeOptions(quiet=True),
            args.work / "default-cache",
            overwrite=True,
            device_given=False,
        )
        held = 0 if dry else torch.cuda.max_memory_allocated()
        if not dry and held == 0:
            raise RuntimeError("a recipe without --device ran, but nothing was held on the GPU")
        say(f"default device {chosen}: {out.name} written, {held / 2**20:.0f} MiB held on it")

    def learned() -> None:
        (args.work / "lmc").mkdir(exist_ok=True)
        say("\n" + HEADER)
        label = f"gpt_neox d={hidden} ({'CPU, dry run' if dry else 'GPU'})"
        evaluation = {"points": 3, "eval_sequences": 16} if dry else {}
        row = pair_row(label, *pair, learn_steps, args.work / "lmc", options, **evaluation)
        say(row)
        TABLES["lmc_dm"] = f"{HEADER}\n{row}"

    def launcher() -> None:
        # One process per GPU (two at most: LOCAL_RANK picks each one's); two on the CPU.
        count = 2 if dry else max(1, min(2, torch.cuda.device_count()))
        path = lmc_dm_recipe(pair, args.work / "launcher.yml", steps=launcher_steps, evaluate=False)
        command = ["torchrun", "--standalone", "--nproc_per_node", str(count), "--no-python"]
        command += ["lmc-mergekit-yaml"]
        command += [str(path), str(args.work / "launcher-out"), "--device", device]
        command += ["--overwrite"]
        env = dict(os.environ, LMC_MERGEKIT_CACHE=str(args.work / "launcher-cache"))
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError((done.stderr or done.stdout)[-600:])
        backend = "gloo" if dry else "NCCL"
        say(
            f"torchrun, {count} process(es), {backend}: {launcher_steps} learned-matching steps, "
            "merged and written"
        )

    def latent() -> None:
        recipe = {
            "merge_method": "ls_merge",
            "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
            "dtype": "float32",
            "latent": {"steps": latent_steps},
        }
        path = args.work / "ls.yml"
        path.write_text(yaml.safe_dump(recipe))
        out = run_recipe(path, args.work / "ls-out", options, args.work / "cache", overwrite=True)
        report = LatentReport.read(out / LatentReport.file_name)
        say(f"ls_merge on {device}: {report.model_dump_json(include={'merged', 'noise_floor'})}")

    def scale_rows() -> None:
        a, b, params = build_pair(args.shape, args.work)
        fp32 = params * 4
        scale_args = argparse.Namespace(ae_steps=50, batch=4, cuda=True, rounds=None)
        lines = [
            f"{args.shape}: {params / 1e6:.0f} M parameters, {fp32 / 1024**3:.2f} GB fp32",
            "",
            "| pass | seconds: pass (whole command) | peak RSS of the pass (× one model fp32) "
            "| GPU peak | detail |",
            "|---|---|---|---|---|",
        ]
        say("\n" + "\n".join(lines))
        for kind in ("lmc_dm", "subclone", "ls_merge"):
            row = measure_pass(kind, a, b, fp32, args.work, scale_args)
            detail = ""
            if kind == "lmc_dm":
                detail = f"{row['rounds']} rounds of {row['per_round']:.1f} s"
            lines.append(
                f"| {kind} | {row['pass_seconds']:.0f} s (whole {row['seconds']:.0f} s) | "
                f"{row['pass_ratio']:.2f}× | {row.get('gpu_peak', 0) / 1024**3:.2f} GB | "
                f"{detail} |"
            )
            say(lines[-1])
        steps = measure_learn(a, b, scale_args)
        (train, _), (align, _) = steps["train"], steps["align"]
        lines.append(
            f"| learned step | {align:.3f} s = {align / train:.1f}× a plain step ({train:.3f} s) "
            "| | | |"
        )
        say(lines[-1])
        TABLES["scale"] = "\n".join(lines)

    large: list[str] = []

    def large_learned() -> None:
        shape = "toy" if dry else "1b"
        a, b = build_streamed(shape, args.work)
        steps = 4 if dry else args.learn_steps
        alignment = {"matching": "weights", "max_iterations": 1, "steps": steps}
        alignment |= {"evaluate": False, "one_basin_check": False}
        recipe = {
            "merge_method": "lmc_dm",
            "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)],
            "dtype": "bfloat16",
            "alignment": alignment,
        }
        row = measure_recipe(recipe, f"large-{shape}", args.work, cuda=not dry)
        learning = row["report"]["learning"]
        step = learning["seconds"] / max(1, learning["steps"])
        large.extend(
            [
                f"{shape}-shape pair (random bf16): `lmc_dm`, 1 weight-matching round, "
                f"{steps} learned steps, on {device}",
                "",
                "| pass | whole command | learning | a learned step | GPU peak | host peak |",
                "|---|---|---|---|---|---|",
                f"| lmc_dm + {steps} learned steps | {row['seconds']:.0f} s | "
                f"{learning['seconds']:.0f} s | {step:.2f} s | "
                f"{gib(row.get('gpu_peak', 0))} | {gib(row['rss'])} |",
                "",
            ]
        )
        say("\n" + "\n".join(large[-6:]))

    def large_pair() -> None:
        shm = Path("/dev/shm")
        room = shm.is_dir() and shutil.disk_usage(shm).free > 80 * 2**30
        work = shm / "gpu-check" if room and not dry else args.work
        shape = "toy" if dry else "7b"
        namespace = argparse.Namespace(
            shape=shape, work=work, memory_limit=None, rounds=1, cuda=not dry, markdown=None
        )
        lines = measure_pair(namespace)
        large.extend(lines)
        TABLES["large"] = "\n".join(large)
        if work != args.work:
            shutil.rmtree(work, ignore_errors=True)

    stages = set(args.stages)
    if stages & {3, 4, 5, 6}:
        stage("zoo pair", zoo)
    if pair:
        for number, name, fn in (
            (3, "default device", default_device),
            (4, "lmc_dm learned", learned),
            (5, "torchrun", launcher),
            (6, "ls_merge", latent),
        ):
            if number in stages:
                stage(name, fn)
    if 7 in stages:
        if dry:
            say("\n(scale rows: not in a dry run)")
        else:
            stage("scale rows", scale_rows)
    if 8 in stages:
        stage("1B-shape pair, learned", large_learned)
        TABLES["large"] = "\n".join(large)
    if 9 in stages:
        stage("7B-shape pair beside linear", large_pair)
    if FAILED:
        say(f"\nfailed: {', '.join(FAILED)}")
    for suffix, body in TABLES.items():
        block = f"{args.block or 'table'}-{suffix}"
        publish(argparse.Namespace(markdown=args.markdown), block, body)
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
