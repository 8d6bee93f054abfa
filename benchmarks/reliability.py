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
once hashed (the disk holds one at a time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from markdown_blocks import add_markdown_option, publish
from scale import PAIR_SHAPES, build_streamed, gib, sampled_run

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
    """Each input's self-check as ``error / tolerance``."""
    return "; ".join(f"{c['error']:.1e} / {c['tolerance']:.1e}" for c in report["self_check"])


def repeat(args) -> None:
    """``--runs`` runs of the scramble merge (see the module docstring); the table."""
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
    shape = PAIR_SHAPES[args.shape]
    lines = [
        f"Random bf16 Llama of the {args.shape} shape (d={shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} KV heads, MLP {shape['intermediate_size']}, vocabulary "
        "32,000) and its `lmc-mergekit scramble` copy, `lmc_dm` (weights, `steps: 0`, "
        "`evaluate: false`), each run a fresh process with a fresh `--lmc-cache`. Self-check: "
        "each prepared input's float64 logits error / the tolerance (16 × its float32 noise).",
        "",
        "| run | result | seconds | peak anonymous | output sha256 | self-check (original; "
        "scrambled) | weight matching stopped |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    hashes, merged = [], 0
    for run in range(1, args.runs + 1):
        folder = Path(tempfile.mkdtemp(prefix="reliability-", dir=args.work))
        command = [str(BIN / "lmc-mergekit-yaml"), str(recipe_file), str(folder / "out")]
        command += ["--lazy-unpickle", "--lmc-cache", str(folder / "cache")]
        try:
            result = sampled_run(command, None)
            out = folder / "out"
            if result["code"] == 0:
                merged += 1
                hashes.append(output_hash(out))
                report = json.loads((out / "lmc_report.json").read_text())
                row = (
                    f"merged | {result['seconds']:.0f} | {gib(result['anon'])} | "
                    f"`{hashes[-1][:16]}` | {checks(report)} | "
                    f"{report['matching'][0]['stopped']} |"
                )
            else:
                row = f"failed: {result['tail'][0][:160]} | {result['seconds']:.0f} | | | | |"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        lines.append(f"| {run} | {row}")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"**{merged} of {args.runs} runs merged; {len(set(hashes))} distinct output "
        f"hash{'es' if len(set(hashes)) != 1 else ''}.**",
    ]
    publish(args, f"repeat-{args.shape}", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runs = sub.add_parser("repeat")
    runs.add_argument("--shape", default="1b", choices=list(PAIR_SHAPES))
    runs.add_argument("--runs", type=int, default=10)
    runs.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lmc-scale")
    add_markdown_option(runs)
    args = parser.parse_args()
    if args.command == "repeat":
        repeat(args)


if __name__ == "__main__":
    main()
