"""``subclone_compensate`` on a real pretrained model: does the smaller model generalize?

    python benchmarks/subclone_real.py generalize [--targets d384 d192] [--arms ...]
        [--work DIR] [--eval-sequences 32] [--heal-steps 30] [--markdown docs/results.md]

SmolLM2-135M-Instruct (bf16, built by ``benchmarks/real_pretrained.py``) converted to the
family's smaller shapes (``d384``: 6/2 heads, MLP 1024, 66M parameters; ``d192``: 3/1 heads,
MLP 512), each arm one ``lmc-mergekit-yaml`` recipe with a fresh cache:

- ``fixed``: compensation with the former fixed ridge (``ridge: 0.01``) and rescaling
  (``o_down``), calibrated on Pride and Prejudice alone (``data:`` that file): what was
  measured from outside;
- ``auto``: the same with the ridge chosen on held-out calibration batches (the default);
- ``auto+mixed``: held-out ridge, calibration spread over every text of the bundled corpus (two
  Austen novels and Genesis–Numbers), rescaling ``o_down``;
- ``auto+mixed, no rescale``: the same without the ``sqrt(n/n')`` rescaling: the default recipe;
- ``plain``: selection alone (``compensate: false, rescale: none``) on the Austen file.

Losses (mean next-token nats) on the test split of Pride and Prejudice (the calibration text
of the first arms) and of the KJV file (text no Austen-calibrated arm saw), ``--eval-sequences``
sequences of 128 tokens each, zero-shot and after ``--heal-steps`` steps of continued training
(batch 8, lr 3e-4) on train sequences of both texts in equal shares.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from markdown_blocks import add_markdown_option, publish
from real_pretrained import SMALLER, cache_root, corpus_file, run_recipe, smollm2_folder

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer, sample_split
from lmc_mergekit.evaluation.loss import load_causal_lm, mean_token_loss
from lmc_mergekit.zoo.train import continue_training

#: Each arm's ``subclone:`` settings; ``data`` is a corpus file's stem or None (the bundled
#: corpus). Rescaling is named in each arm, so that an arm means what it did when its table
#: was written whatever the defaults (``o_down`` was the default then).
ARMS = {
    "fixed": {"ridge": 0.01, "rescale": "o_down", "data": "prideprejudice"},
    "auto": {"rescale": "o_down", "data": "prideprejudice"},
    "auto+mixed": {"rescale": "o_down"},
    "auto+mixed, no rescale": {"rescale": "none"},
    "plain": {"compensate": False, "rescale": "none", "data": "prideprejudice"},
}
TEXTS = {"Austen (P&P)": "prideprejudice", "KJV": "kjv"}


def losses(folder: Path, args) -> dict[str, float]:
    """``folder``'s loss on each text's test split."""
    model = load_causal_lm(folder)
    return {name: mean_token_loss(model, seqs).loss for name, seqs in args.tests.items()}


def healed(folder: Path, args) -> dict[str, float]:
    """``folder``'s losses after ``--heal-steps`` steps on both texts' train sequences."""
    model = load_causal_lm(folder)
    continue_training(
        model, args.train, seed=0, steps=args.heal_steps, batch_size=8, lr=3e-4, progress=False
    )
    return {name: mean_token_loss(model, seqs).loss for name, seqs in args.tests.items()}


def convert(source: Path, target: str, arm: str, args) -> tuple[dict, Path]:
    """One arm's recipe run: its result (seconds, peak, report) and output folder."""
    section = {**SMALLER[target], **ARMS[arm], "evaluate": False}
    if section.get("data"):
        section["data"] = str(corpus_file(section["data"]))
    recipe = {
        "merge_method": "subclone_compensate",
        "models": [{"model": str(source)}],
        "dtype": "bfloat16",
        "subclone": section,
    }
    name = f"{target}-{arm}".replace(" ", "").replace(",", "-").replace("+", "-")
    return run_recipe(name, recipe, args)


def ridges(report: dict) -> str:
    """How often each ridge was chosen over the conversion's fits."""
    counts: dict[str, int] = {}
    for layer in report["donors"][0]["conversion"]["layers"]:
        for fit in layer["fits"].values():
            key = str(fit.get("ridge"))
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ×{n}" for k, n in sorted(counts.items())) or "–"


def generalize(args) -> None:
    source = smollm2_folder()
    tokenizer = load_tokenizer([source])
    files = {name: str(corpus_file(stem)) for name, stem in TEXTS.items()}
    args.tests = {
        name: load_split(DataConfig(source=path), tokenizer, "test", args.eval_sequences)
        for name, path in files.items()
    }
    mixed = DataConfig(source=list(files.values()))
    args.train, _ = sample_split(mixed, tokenizer, "train", 8 * args.heal_steps)
    donor = losses(source, args)
    names = list(TEXTS)
    head = " / ".join(names)
    lines = [
        f"Donor: {' / '.join(f'{donor[n]:.3f}' for n in names)} ({head}).",
        "",
        f"| target | arm | zero-shot {head} | after {args.heal_steps} steps {head} "
        "| out-of-text share of the gain | ridges chosen | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in args.targets:
        plain = None
        rows = []
        for arm in args.arms:
            result, out = convert(source, target, arm, args)
            zero, after = losses(out, args), healed(out, args)
            if arm == "plain":
                plain = zero
            rows.append((arm, zero, after, result))
            print(f"{target} {arm}: {zero} -> {after} ({result['seconds']:.0f} s)", flush=True)
        for arm, zero, after, result in rows:
            share = "–"
            if plain is not None and arm != "plain":
                gains = [plain[n] - zero[n] for n in names]
                share = f"{gains[1] / gains[0]:.0%}" if gains[0] > 0 else "–"
            cells = [
                target,
                arm,
                " / ".join(f"{zero[n]:.3f}" for n in names),
                " / ".join(f"{after[n]:.3f}" for n in names),
                share,
                ridges(result["report"]) if arm != "plain" else "–",
                f"{result['seconds']:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    publish(args, "generalize", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generalize")
    p.add_argument("--targets", nargs="+", choices=list(SMALLER), default=list(SMALLER))
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--heal-steps", type=int, default=30)
    add_markdown_option(p)
    args = parser.parse_args()
    args.work = (args.work or Path(tempfile.mkdtemp(dir=cache_root()))).absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    generalize(args)
    print(json.dumps({"work": str(args.work)}))


if __name__ == "__main__":
    main()
