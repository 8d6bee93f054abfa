"""The same recipe, run again and again on a model at the sizes people merge: every run merges,
the self-check never refuses the correct transform, and every run writes the same files.

    python benchmarks/reliability.py repeat [--shape 1b] [--runs 10] [--work DIR]
        [--markdown docs/results.md]

The first model of ``scale.py pair``'s ``--shape`` (random bf16 Llama, built once under
``--work``) and its ``lmc-mergekit scramble`` copy, merged by ``lmc_dm`` (``matching:
weights``, ``steps: 0``, ``evaluate: false``) ``--runs`` times, each a whole
``lmc-mergekit-yaml`` command in a fresh process with a fresh ``--lmc-cache``: whether it
merged, its seconds and peak memory, one sha256 over every safetensors file it wrote, how
weight matching stopped, and the self-check of each prepared input (its float64 logits error
against the tolerance its float32 noise grants, ``lmc_report.json``). The outputs are removed
once hashed (the disk holds one at a time). The caption gives matching's estimated peak
(what the pass checks against the memory available before it starts) beside the peaks
measured.

    python benchmarks/reliability.py interrupt [--shape 1b] [--work DIR] [--markdown ...]

The same merge killed (``SIGKILL``, the whole process group) while weight matching runs, while
the prepared inputs are written and while mergekit merges them, then run again with the same
command and cache: what the kill left at the output folder, whether the rerun merged, and
whether it wrote what an uninterrupted run writes (its hash). Last, the same command in a
memory cgroup of a process's start and half matching's estimate: the refusal and its
seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from scale import (
    PAIR_SHAPES,
    MemoryCgroup,
    build_streamed,
    gib,
    matching_estimate,
    sampled_run,
)

#: About what a process holds once it has imported the tool, torch and mergekit and read the
#: recipe: 0.56–0.64 GiB anonymous at the memory check, on the 1B pair and on the real 1.5B one.
START = 3 * 2**28
#: Where ``interrupt`` kills the merge: the text its progress shows once the stage has begun,
#: and the seconds after it (``--delay`` at most): weight matching's first round writes both
#: prepared inputs as it streams, and mergekit merges the 1B pair in about 14 s.
STAGES = {
    "weight matching": ("weight matching", 10.0),
    "writing the second prepared input": ("writing model-1", 10.0),
    "mergekit's merge": ("Executing graph", 3.0),
}

BIN = Path(sys.executable).parent


def scrambled(model: Path) -> Path:
    """``model``'s ``lmc-mergekit scramble`` copy (seed 0), made once beside it."""
    copy = model.with_name(model.name + "-scrambled")
    if not (copy / "config.json").is_file():
        command = [str(BIN / "lmc-mergekit"), "scramble", str(model), str(copy), "--overwrite"]
        subprocess.run(command, check=True)
    return copy


def output_hash(folder: Path) -> str:
    """One sha256 over every safetensors file of ``folder``, in name order."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode())
        with path.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def checks(report: dict) -> str:
    """Each input's self-check as ``error / tolerance`` (``linked`` for one linked as stored)."""
    return "; ".join(
        f"{c['error']:.1e} / {c['tolerance']:.1e}" if "error" in c else "linked"
        for c in report["self_check"]
    )


def prepared(args) -> tuple[Path, list[str]]:
    """The pair (built once), the recipe file and the whole command less its output folder and
    cache."""
    args.work.mkdir(parents=True, exist_ok=True)
    model, _ = build_streamed(args.shape, args.work)
    copy = scrambled(model)
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (model, copy)],
        "dtype": "bfloat16",
        "alignment": {
            "matching": "weights",
            "steps": 0,
            "evaluate": False,
            "one_basin_check": False,
        },
    }
    recipe_file = args.work / "reliability.yml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    return model, [str(BIN / "lmc-mergekit-yaml"), str(recipe_file), "--lazy-unpickle"]


def caption(args, model: Path) -> str:
    shape = PAIR_SHAPES[args.shape]
    estimate = matching_estimate(model)
    return (
        f"Random bf16 Llama of the {args.shape} shape (d={shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} KV heads, MLP {shape['intermediate_size']}, vocabulary "
        "32,000) and its `lmc-mergekit scramble` copy, `lmc_dm` (weights, `steps: 0`, "
        "`evaluate: false`), each run a fresh process with a fresh `--lmc-cache`. Matching's "
        f"estimated peak, checked before it starts: {gib(estimate)} beyond the process's start."
    )


def into(command: list[str], folder: Path) -> list[str]:
    """The whole command, its output at ``folder``/out and its cache at ``folder``/cache."""
    return [*command[:2], str(folder / "out"), *command[2:], "--lmc-cache", str(folder / "cache")]


def run_once(command: list[str], folder: Path) -> tuple[dict, str | None, dict | None]:
    """``command`` into ``folder``/out with ``folder``/cache: its measures, output hash and
    report (None where it failed)."""
    full = into(command, folder)
    result = sampled_run(full, None)
    if result["code"] != 0:
        return result, None, None
    report = json.loads((folder / "out" / "lmc_report.json").read_text())
    return result, output_hash(folder / "out"), report


def repeat(args) -> None:
    """``--runs`` runs of the scramble merge (see the module docstring); the table."""
    model, command = prepared(args)
    lines = [
        caption(args, model) + " Self-check: each prepared input's float64 logits error / the "
        "tolerance (16 × its float32 noise).",
        "",
        "| run | result | seconds | peak anonymous | output sha256 | self-check (original; "
        "scrambled) | weight matching stopped |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    hashes = []
    for run in range(1, args.runs + 1):
        folder = Path(tempfile.mkdtemp(prefix="reliability-", dir=args.work))
        try:
            result, digest, report = run_once(command, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if digest is None:
            row = f"failed: {result['tail'][0][:160]} | {result['seconds']:.0f} | | | | |"
        else:
            hashes.append(digest)
            row = (
                f"merged | {result['seconds']:.0f} | {gib(result['anon'])} | `{digest[:16]}` | "
                f"{checks(report)} | {report['matching'][0]['stopped']} |"
            )
        lines.append(f"| {run} | {row}")
        print(lines[-1], flush=True)
    distinct = len(set(hashes))
    lines += [
        "",
        f"**{len(hashes)} of {args.runs} runs merged; {distinct} distinct output "
        f"hash{'es' if distinct != 1 else ''}.**",
    ]
    publish(args, f"repeat-{args.shape}", "\n".join(lines))


def killed_at(command: list[str], folder: Path, marker: str, delay: float) -> float:
    """Run ``command`` (output and cache in ``folder``) and kill its process group ``delay``
    seconds after its progress first shows ``marker``; the seconds it ran."""
    full = into(command, folder)
    started = time.perf_counter()
    process = subprocess.Popen(
        full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    seen = b""
    while marker.encode() not in seen:
        chunk = process.stderr.read1(65536)
        if not chunk:
            raise SystemExit(f"the run ended before {marker!r} showed: {seen[-500:]!r}")
        seen = seen[-4096:] + chunk
    deadline = time.perf_counter() + delay
    while time.perf_counter() < deadline and process.poll() is None:
        process.stderr.read1(65536)
    if process.poll() is not None:  # a kill that came too late would prove nothing
        raise SystemExit(f"the run ended before it was killed, {delay} s after {marker!r}")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return time.perf_counter() - started


def left_behind(folder: Path) -> str:
    """What a killed run left where its output goes, in words."""
    out = folder / "out"
    if not out.exists():
        debris = [p.name for p in folder.iterdir() if p.name.startswith(".out")]
        return "no output folder" + (f" (staging left: {len(debris)})" if debris else "")
    names = {p.name for p in out.iterdir()}
    complete = "config.json" in names and "lmc_report.json" in names
    return f"an output folder of {len(names)} files" + (" that looks complete" if complete else "")


def interrupt(args) -> None:
    """Kill the merge in each stage, then rerun it (see the module docstring); the table."""
    model, command = prepared(args)
    lines = [
        caption(args, model),
        "",
        "| killed during | after (s) | left behind | rerun, same command | rerun's seconds | "
        "output the uninterrupted run's |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="reliability-", dir=args.work))
    try:
        _, reference, _ = run_once(command, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for stage, (marker, delay) in STAGES.items():
        folder = Path(tempfile.mkdtemp(prefix="reliability-", dir=args.work))
        try:
            ran = killed_at(command, folder, marker, min(delay, args.delay))
            left = left_behind(folder)
            result, digest, _ = run_once(command, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        merged = "merged" if digest else f"failed: {result['tail'][0][:120]}"
        same = "yes" if digest is not None and digest == reference else "**no**"
        lines.append(
            f"| {stage} | {ran:.0f} | {left} | {merged} | {result['seconds']:.0f} | {same} |"
        )
        print(lines[-1], flush=True)
    estimate = matching_estimate(model)
    limit = START + estimate // 2
    cgroup = MemoryCgroup(limit)
    folder = Path(tempfile.mkdtemp(prefix="reliability-", dir=args.work))
    try:
        refused = sampled_run(into(command, folder), cgroup)
        wrote = (folder / "out").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        cgroup.remove()
    lines += [
        "",
        f"In a memory cgroup of {gib(limit)} (a process's start and half the estimate): exit code "
        f"{refused['code']} after {refused['seconds']:.0f} s, "
        f"{'an output folder' if wrote else 'no output folder'}; it said:",
        "",
        f"    {refused['tail'][0]}",
    ]
    publish(args, f"interrupt-{args.shape}", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runs = sub.add_parser("repeat")
    runs.add_argument("--shape", default="1b", choices=list(PAIR_SHAPES))
    runs.add_argument("--runs", type=int, default=10)
    runs.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    add_markdown_option(runs)
    kills = sub.add_parser("interrupt")
    kills.add_argument("--shape", default="1b", choices=list(PAIR_SHAPES))
    kills.add_argument("--delay", type=float, default=10.0, help="seconds into the stage")
    kills.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    add_markdown_option(kills)
    args = parser.parse_args()
    {"repeat": repeat, "interrupt": interrupt}[args.command](args)


if __name__ == "__main__":
    main()
