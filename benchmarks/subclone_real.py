"""``subclone_compensate`` on a real pretrained model: does the smaller model generalize?

    python benchmarks/subclone_real.py generalize [--targets d384 d192] [--arms ...]
        [--work DIR] [--eval-sequences 32] [--heal-steps 30] [--markdown docs/results.md]
    python benchmarks/subclone_real.py race [--targets d384 d192] [--budgets 0 30 100 300]
        [--work DIR] [--eval-sequences 32] [--markdown docs/results.md] [--plot DIR]

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

``race`` is the size conversion paper's continued-training race: each start healed
(``lmc_mergekit.subclone.heal``, the tool's one training loop) for the largest budget, its
losses on both texts measured at every budget (equal tokens: batch 8 × 128 tokens a step).
The starts: ``compensated`` (the default recipe), ``compensated + rescale`` (``o_down``),
``plain selection`` and ``from scratch`` (the same shape, transformers' initialisation, lr
1e-3: a from-scratch run at a fine-tuning rate would be a straw man). One run per start, its
cosine schedule over the largest budget, so a smaller budget is a point of that run.
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
from lmc_mergekit.subclone.heal import heal
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
#: The race's starts: ``subclone:`` settings of the conversion (None: from scratch).
RACE = {
    "compensated": {},
    "compensated + rescale": {"rescale": "o_down"},
    "plain selection": {"compensate": False, "rescale": "none"},
    "from scratch": None,
}
HEAL_LR, SCRATCH_LR = 3e-4, 1e-3


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
    source, files = texts(args)
    tokenizer = load_tokenizer([source])
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


def texts(args) -> tuple[Path, dict[str, str]]:
    """SmolLM2's folder and the two texts' files; ``args.tests`` set to their test splits."""
    source = smollm2_folder()
    tokenizer = load_tokenizer([source])
    files = {name: str(corpus_file(stem)) for name, stem in TEXTS.items()}
    args.tests = {
        name: load_split(DataConfig(source=path), tokenizer, "test", args.eval_sequences)
        for name, path in files.items()
    }
    return source, files


def from_scratch(like: Path, out: Path) -> Path:
    """A checkpoint of ``like``'s configuration, randomly initialised (seed 0), with its
    tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmc_mergekit.models.checkpoint import copy_tagalong_files

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like))
    model.to(torch.bfloat16).save_pretrained(out)
    copy_tagalong_files(like, out)
    return out


def race(args) -> None:
    source, files = texts(args)
    names = list(TEXTS)
    steps = max(args.budgets)
    for target in args.targets:
        results = {}
        for start, settings in RACE.items():
            slug = start.replace(" + ", "-").replace(" ", "-")
            if settings is None:
                folder = from_scratch(
                    args.work / f"{target}-compensated" / "out", args.work / f"{target}-scratch"
                )
            else:
                section = {**SMALLER[target], **settings, "evaluate": False}
                recipe = {
                    "merge_method": "subclone_compensate",
                    "models": [{"model": str(source)}],
                    "dtype": "bfloat16",
                    "subclone": section,
                }
                _, folder = run_recipe(f"{target}-{slug}", recipe, args)
            record = heal(
                folder,
                args.work / f"{target}-{slug}-healed",
                steps=steps,
                data=DataConfig(source=list(files.values())),
                lr=SCRATCH_LR if settings is None else HEAL_LR,
                evaluate_at=args.budgets,
                test=args.tests,
                cache_dir=args.work / "heal-cache",
                overwrite=True,
                progress=False,
            )
            results[start] = {e["step"]: e for e in record["evaluations"]}
            print(f"{target} {start}: {results[start]} ({record['wall_time_s']:.0f} s)", flush=True)
        publish(args, f"race-{target}", race_table(results, args.budgets, names, target))
        if args.plot:
            plot_race(args.plot / f"race-{target}.png", results, names, target)


def race_table(results: dict, budgets: list[int], names: list[str], target: str) -> str:
    """Losses per start (rows) and budget (columns), both texts in each cell; the best start
    at each budget in bold; from scratch's tokens to reach compensation's zero-shot loss."""
    head = " / ".join(names)
    lines = [
        f"SmolLM2-135M-Instruct → {target}: loss {head} after each budget of healing "
        "(steps of 8 × 128 tokens).",
        "",
        "| start | " + " | ".join(f"{b} steps" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]
    best = {b: min(results, key=lambda s: sum(results[s][b][n] for n in names)) for b in budgets}
    for start, losses in results.items():
        cells = []
        for b in budgets:
            cell = " / ".join(f"{losses[b][n]:.3f}" for n in names)
            cells.append(f"**{cell}**" if best[b] == start else cell)
        lines.append(f"| {start} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_race(path: Path, results: dict, names: list[str], target: str) -> None:
    """Loss against steps of healing, one panel per text, one line per start."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(10, 4), dpi=120, sharey=True)
    for ax, name in zip(axes, names, strict=True):
        for start, losses in results.items():
            steps = sorted(losses)
            ax.plot(steps, [losses[s][name] for s in steps], marker="o", label=start)
        ax.set_title(f"{name} test split")
        ax.set_xlabel("healing steps (8 × 128 tokens each)")
        ax.set_xscale("symlog", linthresh=30)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats per token)")
    axes[0].legend()
    fig.suptitle(f"SmolLM2-135M-Instruct → {target}: which start heals best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


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
    p = sub.add_parser("race")
    p.add_argument("--targets", nargs="+", choices=list(SMALLER), default=list(SMALLER))
    p.add_argument("--budgets", nargs="+", type=int, default=[0, 30, 100, 300])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--plot", type=Path, default=None, help="folder for race-<target>.png")
    add_markdown_option(p)
    args = parser.parse_args()
    args.work = (args.work or Path(tempfile.mkdtemp(dir=cache_root()))).absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    {"generalize": generalize, "race": race}[args.command](args)
    print(json.dumps({"work": str(args.work)}))


if __name__ == "__main__":
    main()
