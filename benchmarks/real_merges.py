"""Does statistics repair help the merges users already make? A real pretrained model
(SmolLM2-135M-Instruct, bf16, tied) and its fine-tunes, merged by mergekit's ``linear`` and
``ties`` and by ``lmc_dm`` without and with ``repair: true``.

    python benchmarks/real_merges.py [--eval-sequences 32] [--finetune-steps 60]
        [--repair-sequences 64] [--markdown docs/results.md README.md]

Two pairs: the base with its fine-tune on the King James Bible (the pair of
``benchmarks/real_pretrained.py``), and two fine-tunes of the base, one on the KJV and one on
Austen (each ``--finetune-steps`` steps from the base, batch 8, lr 1e-4, cached next to the
model). Each merge is one ``lmc-mergekit-yaml`` command with a fresh cache, weights ½ and ½,
written in bf16:

- ``linear``: mergekit's weighted average;
- ``ties``: mergekit's TIES with the base as ``base_model``, density 0.5;
- ``lmc_dm``: the default recipe (no evaluation of its paths);
- ``lmc_dm + repair``: the same with ``repair: true`` (``--repair-sequences`` calibration
  sequences); the spread of its scales comes from its report.

Each model's loss is measured on both texts' test splits (``--eval-sequences`` sequences of 128
tokens, mean next-token nats); a cell reads ``Austen / KJV (mean)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from markdown_blocks import add_markdown_option, publish
from real_pretrained import (
    MODEL_DIR,
    TEXTS,
    cache_root,
    corpus_file,
    finetuned,
    run_recipe,
    smollm2_folder,
    test_loss,
)

MERGES = ("linear", "ties", "lmc_dm", "lmc_dm + repair")


def recipe(merge: str, base: Path, pair: tuple[Path, Path], args) -> dict:
    """The one-command recipe of ``merge`` for ``pair`` (fine-tunes of ``base``)."""
    models = [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair]
    if merge == "ties":
        for model in models:
            model["parameters"]["density"] = 0.5
        return {
            "merge_method": "ties",
            "base_model": str(base),
            "models": models,
            "dtype": "bfloat16",
        }
    if merge == "linear":
        return {"merge_method": "linear", "models": models, "dtype": "bfloat16"}
    alignment = {"evaluate": False}
    if merge == "lmc_dm + repair":
        alignment.update(repair=True, repair_sequences=args.repair_sequences)
    return {"merge_method": "lmc_dm", "models": models, "dtype": "bfloat16", "alignment": alignment}


def losses(model: Path, args) -> dict[str, float]:
    """``model``'s test loss on each text."""
    return {name: test_loss(model, args, corpus_file(stem)) for name, stem in TEXTS.items()}


def cell(loss: dict[str, float]) -> str:
    mean = sum(loss.values()) / len(loss)
    return f"{loss['Austen']:.3f} / {loss['KJV']:.3f} ({mean:.3f})"


def spread(report: dict) -> str:
    """The repair's scales, per kind, as ``kind min–max``."""
    scales = report.get("repair", {}).get("scales", {})
    return ", ".join(f"{k} {v['min']:.3f}–{v['max']:.3f}" for k, v in scales.items()) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--repair-sequences", type=int, default=64)
    add_markdown_option(parser)
    args = parser.parse_args()
    base = smollm2_folder()
    args.work = (args.work or cache_root() / "merges").absolute()
    kjv, austen = finetuned(base, args, "KJV"), finetuned(base, args, "Austen")
    pairs = {"base + KJV fine-tune": (base, kjv), "KJV + Austen fine-tunes": (kjv, austen)}
    measured = {model: losses(model, args) for model in (base, kjv, austen)}
    names = {base: "base", kjv: "KJV ft", austen: "Austen ft"}
    lines = [
        f"{MODEL_DIR} and fine-tunes of {args.finetune_steps} steps; test loss Austen / KJV "
        f"(mean), {args.eval_sequences} sequences each.",
        "",
        "| pair | inputs | " + " | ".join(MERGES) + " | repair's scales | seconds |",
        "|---|---|" + "---|" * len(MERGES) + "---|---|",
    ]
    for label, pair in pairs.items():
        inputs = "; ".join(f"{names[m]} {cell(measured[m])}" for m in pair)
        cells, seconds, repaired = [], [], {}
        for merge in MERGES:
            slug = f"{label.split()[0].lower()}-{merge.replace(' + ', '-')}"
            result, out = run_recipe(slug, recipe(merge, base, pair, args), args)
            cells.append(cell(losses(out, args)))
            seconds.append(f"{result['seconds']:.0f}")
            if merge == "lmc_dm + repair":
                repaired = result["report"]
            print(f"  {label}, {merge}: {cells[-1]} in {seconds[-1]} s", flush=True)
        lines.append(
            f"| {label} | {inputs} | "
            + " | ".join(cells)
            + f" | {spread(repaired)} | {' / '.join(seconds)} |"
        )
        print(lines[-1], flush=True)
    publish(args, "merges", "\n".join(lines))


if __name__ == "__main__":
    main()
