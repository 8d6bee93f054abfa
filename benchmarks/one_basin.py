"""When is a pair one basin? The evidence for the margin by which ``lmc_dm`` keeps a matching.

    python benchmarks/one_basin.py [--arch gpt_neox llama qwen3 gemma2 gemma3 phi3 olmo2]
        [--hidden 64] [--zoo-steps 600] [--finetune-steps 30 100 300] [--finetune-lr 1e-3]
        [--zoo DIR] [--markdown docs/how-it-works.md]

Per family, two zoo models (4 layers, one tokenizer trained on the bundled corpus) trained from
seeds 0 and 1 on the bundled Austen novels (tied where the family's small models are: Llama,
Qwen3, Gemma 2, Gemma 3), and fine-tunes of the first on the King James Bible (another text:
``--finetune-steps`` steps each, batch 8, ``--finetune-lr``). Each pair is scored as
``lmc_dm`` scores it (:mod:`lmc_mergekit.matching.starts`, ties kept): the loss of the mix at
½ on the 16 calibration sequences after the 64 activation matching reads (a recipe's default
calibration text, the bundled corpus's train split), for the models as they are and after
each matching, both run here whatever the decision. A cell gives how much lower a matching's
mix is than the models' as they are (± the standard error of the per-sequence differences)
and how many units it moved; the last column is the start ``lmc_dm`` keeps.

A margin separates the two kinds of pair where every fine-tune's gain lies below it and every
seed pair's above it (and likewise the barrier of the models as they are).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from markdown_blocks import add_markdown_option, publish
from what_merging_buys import gather_texts

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.data.corpus import bundled_text_files
from lmc_mergekit.matching.align import (
    AlignConfig,
    block_runner,
    choose_start,
    match_pair,
    score_sequences,
)
from lmc_mergekit.matching.starts import CLEAR_MARGIN, SCORE_SEQUENCES, StartScorer
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.zoo import BUNDLED, build_zoo_model
from lmc_mergekit.zoo.finetune import finetune

TIED = ("llama", "qwen3", "gemma2", "gemma3")
ACTIVATION_SEQUENCES = 64
KINDS = ("weights", "activations")


def measure(a: Path, b: Path, keep_tie: bool) -> dict:
    """Both matchings of ``b`` onto ``a``, scored as ``lmc_dm`` scores them, and the start it
    keeps."""
    views = [open_model(a), open_model(b)]
    spec = views[0].spec
    tokenizer = load_tokenizer([a, b])
    needed = ACTIVATION_SEQUENCES + SCORE_SEQUENCES
    calibration = load_split(DataConfig(), tokenizer, "train", max_sequences=needed)
    config = AlignConfig("both", keep_tie=keep_tie, activation_sequences=ACTIVATION_SEQUENCES)
    reference = Transform(spec.num_layers, absorb_norms=True, keep_tie=keep_tie)
    absorbed = apply_transform(views[0], reference).spec
    cpu = torch.device("cpu")
    runner, raw_runner = block_runner(views[0], absorbed, cpu), block_runner(views[0], spec, cpu)
    scores = score_sequences(calibration, ACTIVATION_SEQUENCES)
    scorer = StartScorer(views[0], views[1], reference, raw_runner, runner, scores)
    found = {
        kind: match_pair(
            kind, views[0], views[1], config, keep_tie, False, "cpu", runner, calibration
        )[:2]
        for kind in KINDS
    }
    scorer.score("kept", None)
    row = {"kept_barrier": scorer.barrier("kept")}
    for kind, (transform, _) in found.items():
        scorer.score(kind, transform)
        _, figures = scorer.compare("kept", kind)
        row[kind] = {**figures, "units": transform.units_moved()}
    _, record = choose_start(KINDS, lambda kind: found[kind], scorer, reference)
    row["decision"] = record["matching"]
    return row


def cell(figures: dict) -> str:
    return (
        f"{figures['lower_by']:+.4f} ± {figures['standard_error']:.4f} ({figures['units']} units)"
    )


def zoo_texts(zoo: Path) -> Path:
    """``zoo/texts/{austen,kjv}``: the bundled corpus's two texts, apart."""
    bundled = bundled_text_files()
    return gather_texts(
        zoo,
        {
            "kjv": [p for p in bundled if "kjv" in p.name],
            "austen": [p for p in bundled if "austen" in p.name],
        },
    )


def austen_model(zoo: Path, arch: str, hidden: int, steps: int, tied: bool, seed: int) -> Path:
    """A zoo model (4 layers) trained on Austen, its tokenizer on the whole bundled corpus."""
    return build_zoo_model(
        zoo,
        arch,
        hidden,
        4,
        seed=seed,
        steps=steps,
        data_source=zoo_texts(zoo) / "austen",
        tokenizer_data=BUNDLED,
        tied=tied,
        progress=False,
    )


def kjv_finetune(zoo: Path, base: Path, steps: int, lr: float) -> Path:
    """``base`` fine-tuned on the KJV (``steps`` steps of batch 8 at ``lr``), cached."""
    out = zoo / "finetunes" / f"{base.name}-kjv-s{steps}-lr{lr:g}"
    data = DataConfig(source=str(zoo_texts(zoo) / "kjv"))
    return finetune(base, out, data, steps=steps, lr=lr, batch_size=8, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        nargs="+",
        default=["gpt_neox", "llama", "qwen3", "gemma2", "gemma3", "phi3", "olmo2"],
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--zoo-steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, nargs="+", default=[30, 100, 300])
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    add_markdown_option(parser)
    args = parser.parse_args()
    lines = [
        f"Zoo models d={args.hidden}, 4 layers, {args.zoo_steps} steps on Austen; fine-tunes of "
        f"seed 0 on the KJV at lr {args.finetune_lr:g}. Mix loss at ½ on {SCORE_SEQUENCES} "
        "calibration sequences; a matching's cell: how much lower its mix is than the models' "
        "as they are (nats ± standard error; units it moved).",
        "",
        "| family | pair | barrier at ½ as they are | weight matching | activation matching "
        "| kept start |",
        "|---|---|---|---|---|---|",
    ]
    finetunes, seeds = [], []
    barriers = {"ft": [], "seeds": []}
    for arch in args.arch:
        tied = arch in TIED
        base, other = (
            austen_model(args.zoo, arch, args.hidden, args.zoo_steps, tied, seed) for seed in (0, 1)
        )
        pairs = {}
        for steps in args.finetune_steps:
            tuned = kjv_finetune(args.zoo, base, steps, args.finetune_lr)
            pairs[f"base + {steps}-step KJV fine-tune"] = (tuned, finetunes)
        pairs["seeds 0 and 1"] = (other, seeds)
        for label, (b, bucket) in pairs.items():
            row = measure(base, b, keep_tie=tied)
            barriers["ft" if bucket is finetunes else "seeds"].append(row["kept_barrier"])
            gains = [row[kind]["lower_by"] for kind in KINDS]
            bucket.append(max(gains) if bucket is finetunes else min(gains))
            family = f"{arch}{', tied' if tied else ''}"
            lines.append(
                f"| {family} | {label} | {row['kept_barrier']:+.4f} | {cell(row['weights'])} | "
                f"{cell(row['activations'])} | {row['decision']} |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        f"Largest gain of a matching over the models as they are, fine-tunes: "
        f"{max(finetunes):+.4f} nats (barrier as they are: {max(barriers['ft']):+.4f} or "
        f"lower); smallest gain of either matching, pairs from different seeds: "
        f"{min(seeds):+.4f} nats (barrier: {min(barriers['seeds']):+.4f} or higher); the "
        f"margin `lmc_dm` requires: {CLEAR_MARGIN} nats.",
    ]
    print(lines[-1])
    publish(args, "evidence", "\n".join(lines))


if __name__ == "__main__":
    main()
