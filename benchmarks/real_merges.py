"""The merges users make most: a base and its fine-tunes, merged by mergekit's ``linear`` and
``ties`` and by ``lmc_dm`` (and ``lmc_dm`` with ``repair: true``), with what each writes.

    python benchmarks/real_merges.py [--pairs smollm2 zoo] [--eval-sequences 32]
        [--finetune-steps 60] [--repair-sequences 64] [--zoo DIR] [--zoo-arch gemma2 gemma3
        olmo2] [--zoo-hidden 64] [--zoo-steps 600] [--zoo-finetune-steps 100]
        [--markdown docs/results.md README.md]

Pairs:

- ``smollm2``: a real pretrained model (SmolLM2-135M-Instruct, bf16, tied, as shipped) with
  its fine-tune on the King James Bible, and two fine-tunes of it, one on the KJV and one on
  Austen (each ``--finetune-steps`` steps from the base, batch 8, lr 1e-4, cached next to the
  model; the pairs of ``benchmarks/real_pretrained.py``);
- ``zoo``: post-norm families, where the residual stream admits signed permutations only
  (Gemma 2, Gemma 3 and OLMo 2 zoo models: d=``--zoo-hidden``, 4 layers, ``--zoo-steps`` steps
  on Austen, tied and untied), each with its fine-tune on the KJV (``--zoo-finetune-steps``
  steps, batch 8, lr 1e-3).

Each merge is one ``lmc-mergekit-yaml`` command with a fresh cache, weights ½ and ½, written in
bf16 (the zoo's in float32): ``linear``, mergekit's weighted average; ``ties``, mergekit's
TIES with the base as ``base_model``, density 0.5; ``lmc_dm``, the default recipe (no
evaluation of its paths); ``lmc_dm + repair``, the same with ``repair: true``. Each model's
loss is measured on both texts' test splits (``--eval-sequences`` sequences of 128 tokens, mean
next-token nats); a cell reads ``Austen / KJV (mean)``. ``lmc_dm − linear`` is the larger of
the two texts' differences (the target: at most +0.002); ``parameters`` counts the inputs' and
each output's parameters (from their configs).
"""

from __future__ import annotations

import argparse
import re
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
from scale import parameter_count

MERGES = ("linear", "ties", "lmc_dm", "lmc_dm + repair")
ZOO_ARCH = ("gemma2", "gemma3", "olmo2")


def recipe(merge: str, base: Path, pair: tuple[Path, Path], args, dtype: str) -> dict:
    """The one-command recipe of ``merge`` for ``pair`` (fine-tunes of ``base``)."""
    models = [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair]
    if merge == "ties":
        for model in models:
            model["parameters"]["density"] = 0.5
        return {"merge_method": "ties", "base_model": str(base), "models": models, "dtype": dtype}
    if merge == "linear":
        return {"merge_method": "linear", "models": models, "dtype": dtype}
    alignment = {"evaluate": False}
    if merge == "lmc_dm + repair":
        alignment.update(repair=True, repair_sequences=args.repair_sequences)
    return {"merge_method": "lmc_dm", "models": models, "dtype": dtype, "alignment": alignment}


def losses(model: Path, args) -> dict[str, float]:
    """``model``'s test loss on each text."""
    return {name: test_loss(model, args, corpus_file(stem)) for name, stem in TEXTS.items()}


def cell(loss: dict[str, float]) -> str:
    mean = sum(loss.values()) / len(loss)
    return f"{loss['Austen']:.3f} / {loss['KJV']:.3f} ({mean:.3f})"


def millions(count: int) -> str:
    return f"{count / 1e6:.2f}M"


def smollm2_pairs(args) -> list[tuple[str, Path, tuple[Path, Path], dict[Path, str]]]:
    """The real model's pairs: label, base, pair, and a short name per model."""
    base = smollm2_folder()
    kjv, austen = finetuned(base, args, "KJV"), finetuned(base, args, "Austen")
    names = {base: "base", kjv: "KJV ft", austen: "Austen ft"}
    return [
        ("SmolLM2: base + KJV fine-tune", base, (base, kjv), names),
        ("SmolLM2: KJV + Austen fine-tunes", base, (kjv, austen), names),
    ]


def zoo_pairs(args) -> list[tuple[str, Path, tuple[Path, Path], dict[Path, str]]]:
    """Per post-norm family, tied and untied: a zoo model and its KJV fine-tune."""
    from one_basin import austen_model, kjv_finetune

    pairs = []
    for arch in args.zoo_arch:
        for tied in (True, False):
            base = austen_model(args.zoo, arch, args.zoo_hidden, args.zoo_steps, tied, seed=0)
            tuned = kjv_finetune(args.zoo, base, args.zoo_finetune_steps, lr=1e-3)
            label = f"{arch} d={args.zoo_hidden}{', tied' if tied else ''}: base + KJV fine-tune"
            pairs.append((label, base, (base, tuned), {base: "base", tuned: "KJV ft"}))
    return pairs


def main() -> None:
    from lmc_mergekit.runtime.locations import default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pairs", nargs="+", choices=("smollm2", "zoo"), default=["smollm2", "zoo"]
    )
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--eval-sequences", type=int, default=32)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--repair-sequences", type=int, default=64)
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument("--zoo-arch", nargs="+", default=list(ZOO_ARCH))
    parser.add_argument("--zoo-hidden", type=int, default=64)
    parser.add_argument("--zoo-steps", type=int, default=600)
    parser.add_argument("--zoo-finetune-steps", type=int, default=100)
    add_markdown_option(parser)
    args = parser.parse_args()
    args.work = (args.work or cache_root() / "merges").absolute()
    pairs = []
    if "smollm2" in args.pairs:
        pairs += smollm2_pairs(args)
    if "zoo" in args.pairs:
        pairs += zoo_pairs(args)
    lines = [
        f"{MODEL_DIR} and fine-tunes of {args.finetune_steps} steps (bf16); zoo models and "
        f"fine-tunes of {args.zoo_finetune_steps} steps (float32); test loss Austen / KJV "
        f"(mean), {args.eval_sequences} sequences each.",
        "",
        "| pair | inputs | "
        + " | ".join(MERGES)
        + " | lmc_dm − linear | parameters: inputs; "
        + " / ".join(MERGES)
        + " | seconds |",
        "|---|---|" + "---|" * len(MERGES) + "---|---|---|",
    ]
    measured: dict[Path, dict[str, float]] = {}
    for label, base, pair, names in pairs:
        for model in pair:
            if model not in measured:
                measured[model] = losses(model, args)
        inputs = "; ".join(f"{names[m]} {cell(measured[m])}" for m in pair)
        dtype = "bfloat16" if "SmolLM2" in label else "float32"
        cells, seconds, counts, merged = [], [], [], {}
        for merge in MERGES:
            slug = re.sub(r"[^a-z0-9]+", "-", f"{label} {merge}".lower()).strip("-")
            result, out = run_recipe(slug, recipe(merge, base, pair, args, dtype), args)
            merged[merge] = losses(out, args)
            cells.append(cell(merged[merge]))
            seconds.append(f"{result['seconds']:.0f}")
            counts.append(parameter_count(out))
            print(f"  {label}, {merge}: {cells[-1]}, {counts[-1]:,} parameters", flush=True)
        gap = max(merged["lmc_dm"][text] - merged["linear"][text] for text in TEXTS)
        source = parameter_count(pair[0])
        same = all(count == source for count in counts)
        params = f"{millions(source)}; " + (
            "all the same" if same else " / ".join(millions(c) for c in counts)
        )
        lines.append(
            f"| {label} | {inputs} | "
            + " | ".join(cells)
            + f" | {gap:+.4f} | {params} | {' / '.join(seconds)} |"
        )
        print(lines[-1], flush=True)
    publish(args, "merges", "\n".join(lines))


if __name__ == "__main__":
    main()
