"""Every GPU path of the project in one run on one GPU (an H200: about 6 minutes).

    python benchmarks/gpu_check.py [--work DIR] [--shape 160m] [--zoo-steps 1500]

1. the environment (torch, the device, its memory);
2. a zoo pair (GPT-NeoX, d=128, 4 layers, seeds 0 and 1) trained on the GPU;
3. ``lmc_dm`` on that pair with 600 learned-matching steps on the GPU (bf16 autocast), weight
   matching's products and the barrier evaluation there too: the barrier table row;
4. the same recipe (100 steps) under ``torchrun`` with one process, through NCCL;
5. ``ls_merge`` on the pair (autoencoder trained and the inputs encoded on the GPU);
6. the scale rows (``benchmarks/scale.py --cuda``) at ``--shape``: ``lmc_dm`` with ``steps: 0``,
   ``subclone_compensate`` to half width, ``ls_merge`` encoding, one learned step against one
   plain training step.

Each stage prints its row as it finishes; a stage that fails prints its error and the run goes
on. Everything printed is also written to ``$OUT/gpu_check.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml
from lmc_dm_recipe import HEADER, pair_row
from mergekit.options import MergeOptions
from scale import build_pair, measure_learn, measure_pass

from lmc_mergekit.passes.ls_merge import LatentReport
from lmc_mergekit.plugin.pipeline import run_recipe_file
from lmc_mergekit.zoo import build_zoo

LINES: list[str] = []


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
        return
    say(f"\n({name}: {time.perf_counter() - started:.0f} s)")


def environment() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script checks the GPU paths")
    props = torch.cuda.get_device_properties(0)
    say(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, "
        f"{props.total_memory / 1024**3:.0f} GiB, {os.cpu_count()} CPU cores"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gpu-check")
    parser.add_argument("--shape", default="160m")
    parser.add_argument("--zoo-steps", type=int, default=1500)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    environment()
    options = MergeOptions(quiet=True, cuda=True)
    pair: list[Path] = []

    def zoo() -> None:
        pair[:] = build_zoo(
            args.work / "zoo", "gpt_neox", 128, 4, (0, 1), args.zoo_steps, device="cuda"
        )
        say(f"zoo pair: {', '.join(p.name for p in pair)}")

    def learned() -> None:
        say("\n" + HEADER)
        say(pair_row("gpt_neox d=128 (GPU)", *pair, 600, args.work / "lmc", options))

    def nccl() -> None:
        recipe = {
            "merge_method": "lmc_dm",
            "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
            "dtype": "float32",
            "alignment": {"steps": 100, "evaluate": False},
        }
        path = args.work / "nccl.yml"
        path.write_text(yaml.safe_dump(recipe))
        command = ["torchrun", "--standalone", "--nproc_per_node", "1", "--no-python"]
        command += ["lmc-mergekit-yaml"]
        command += [str(path), str(args.work / "nccl-out"), "--cuda"]
        env = dict(os.environ, LMC_MERGEKIT_CACHE=str(args.work / "nccl-cache"))
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError((done.stderr or done.stdout)[-600:])
        say("torchrun, one process, NCCL: 100 learned-matching steps, merged and written")

    def latent() -> None:
        recipe = {
            "merge_method": "ls_merge",
            "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
            "dtype": "float32",
            "latent": {"steps": 1500},
        }
        path = args.work / "ls.yml"
        path.write_text(yaml.safe_dump(recipe))
        out = run_recipe_file(path, args.work / "ls-out", options, args.work / "cache")
        report = LatentReport.read(out / LatentReport.file_name)
        say(f"ls_merge on the GPU: {report.model_dump_json(include={'merged', 'noise_floor'})}")

    def scale_rows() -> None:
        a, b, params = build_pair(args.shape, args.work)
        fp32 = params * 4
        scale_args = argparse.Namespace(ae_steps=50, batch=4, cuda=True, rounds=None)
        say(f"\n{args.shape}: {params / 1e6:.0f} M parameters, {fp32 / 1024**3:.2f} GB fp32")
        for kind in ("lmc_dm", "subclone", "ls_merge"):
            row = measure_pass(kind, a, b, fp32, args.work, scale_args)
            extra = ""
            if kind == "lmc_dm":
                extra = f", {row['rounds']} rounds of {row['per_round']:.1f} s"
            say(
                f"| {kind} | {row['pass_seconds']:.0f} s (whole {row['seconds']:.0f} s) | "
                f"RSS {row['pass_ratio']:.2f}× | GPU peak {row.get('gpu_peak', 0) / 1024**3:.2f}"
                f" GB{extra} |"
            )
        steps = measure_learn(a, b, scale_args)
        (train, _), (align, _) = steps["train"], steps["align"]
        say(f"| learned step | {align:.3f} s = {align / train:.1f}× a plain step ({train:.3f} s) |")

    stage("zoo pair", zoo)
    if pair:
        stage("lmc_dm learned", learned)
        stage("torchrun NCCL", nccl)
        stage("ls_merge", latent)
    stage("scale rows", scale_rows)


if __name__ == "__main__":
    sys.exit(main())
