"""``subclone_compensate`` on a real pretrained model: does the smaller model generalize?

    python benchmarks/subclone_real.py generalize [--targets d384 d192] [--arms ...]
        [--work DIR] [--eval-sequences 32] [--heal-steps 30] [--markdown docs/results.md]
        [--block generalize]
    python benchmarks/subclone_real.py race [--targets d384 d192] [--budgets 0 30 100 300]
        [--starts ...] [--work DIR] [--eval-sequences 32] [--markdown docs/results.md]
        [--plot DIR]
    python benchmarks/subclone_real.py distill [--targets d384] [--steps 30]
        [--settings 1,1 2,1 1,0.5] [--lr 3e-4] [--work DIR] [--markdown docs/results.md]

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
- ``plain``: selection alone (``compensate: false, rescale: none``) on the Austen file;
- ``auto, no rescale``: today's defaults calibrated on the Austen file alone, and ``ridge R,
  no rescale`` the same at a fixed ridge ``R``: how much of its gain a calibration on one text
  carries to another, and what the ridge's strength does to that.

Losses (mean next-token nats) on the test split of Pride and Prejudice (the calibration text
of the first arms) and of the KJV file (text no Austen-calibrated arm saw), ``--eval-sequences``
sequences of 128 tokens each, zero-shot and after ``--heal-steps`` steps of continued training
(batch 8, lr 3e-4) on train sequences of both texts in equal shares (``--heal-steps 0``:
zero-shot only). The out-of-text share is the KJV gain over plain selection divided by the
Austen gain, zero-shot (``plain`` must be among the arms).

``race`` is the size conversion paper's continued-training race: each start healed
(``lmc_mergekit.subclone.heal``, the tool's one training loop) for the largest budget, its
losses on both texts measured at every budget (equal tokens: batch 8 × 128 tokens a step).
The starts: ``compensated`` (the default recipe), ``compensated + rescale`` (``o_down``),
``plain selection``, ``torch-pruning (Taylor)`` (a peer tool, where it is installed: see
``peers.py``), ``from scratch`` (the same shape, transformers' initialisation, lr 1e-3: a
from-scratch run at a fine-tuning rate would be a straw man), and ``compensated + distilled``
(the compensated start healed by distillation from SmolLM2, its donor, at the default
temperature and weight: ``heal``'s default after a conversion). Every other start is healed on
the text alone. One run per start, its cosine schedule over the largest budget, so a smaller
budget is a point of that run; the runs keep resumable checkpoints in ``--work``, so an
interrupted race goes on where it stopped, and a start already healed there for these budgets
is read back, not run again. The plot has loss against tokens and against training seconds.

``distill`` heals the compensated start for ``--steps`` steps by distillation at each
``temperature,weight`` of ``--settings`` (and on the text alone, for reference), every run at
the peak rate ``--lr``: how the defaults were chosen. A run already finished in ``--work`` is
read back.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from pathlib import Path

import peers
import torch
from markdown_blocks import add_markdown_option, publish
from real_pretrained import REAL_MODELS, cache_root, corpus_file, run_recipe, smollm2_folder

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.loss import load_causal_lm, mean_token_loss
from lmc_mergekit.subclone.heal import HEAL_INFO, heal

#: Target shapes of SmolLM2's conversions.
SMALLER = REAL_MODELS["smollm2-135m"].smaller

#: Each arm's ``subclone:`` settings; ``data`` is a corpus file's stem or None (the bundled
#: corpus). Rescaling is named in each arm, so that an arm means what it did when its table
#: was written whatever the defaults (``o_down`` was the default then).
ARMS = {
    "fixed": {"ridge": 0.01, "rescale": "o_down", "data": "prideprejudice"},
    "auto": {"rescale": "o_down", "data": "prideprejudice"},
    "auto+mixed": {"rescale": "o_down"},
    "auto+mixed, no rescale": {"rescale": "none"},
    "plain": {"compensate": False, "rescale": "none", "data": "prideprejudice"},
    # Calibrated on one novel with today's defaults, and at fixed ridges around the held-out
    # choice: how much of the gain one text's calibration can carry to another.
    "auto, no rescale": {"rescale": "none", "data": "prideprejudice"},
    "ridge 0.3, no rescale": {"ridge": 0.3, "rescale": "none", "data": "prideprejudice"},
    "ridge 3, no rescale": {"ridge": 3.0, "rescale": "none", "data": "prideprejudice"},
    "ridge 30, no rescale": {"ridge": 30.0, "rescale": "none", "data": "prideprejudice"},
}
TEXTS = {"Austen (P&P)": "prideprejudice", "KJV": "kjv"}
#: The race's starts: ``subclone:`` settings of a conversion, or how else the start is made.
RACE = {
    "compensated": {},
    "compensated + rescale": {"rescale": "o_down"},
    "plain selection": {"compensate": False, "rescale": "none"},
    "torch-pruning (Taylor)": "peer",
    "from scratch": "scratch",
    "compensated + distilled": "distilled",
}
HEAL_LR, SCRATCH_LR = 3e-4, 1e-3
TOKENS_PER_STEP = 8 * 128


def losses(folder: Path, args) -> dict[str, float]:
    """``folder``'s loss on each text's test split."""
    model = load_causal_lm(folder)
    return {name: mean_token_loss(model, seqs).loss for name, seqs in args.tests.items()}


def healed(
    folder: Path, out: Path, args, budgets: list[int], lr: float = HEAL_LR, **distillation
) -> dict[int, dict]:
    """``folder`` healed into ``out`` for the largest of ``budgets`` steps on both texts'
    train splits in equal shares (:func:`lmc_mergekit.subclone.heal.heal`, batch 8; with
    ``distillation``, its ``teacher``, ``temperature`` and ``distill_weight``): its losses on
    each text's test split and its training seconds at each budget, keyed by step."""
    record = heal(
        folder,
        out,
        steps=max(budgets),
        data=DataConfig(source=list(args.files.values())),
        lr=lr,
        evaluate_at=budgets,
        test=args.tests,
        cache_dir=args.work / "heal-cache",
        overwrite=True,
        progress=False,
        **distillation,
    )
    return {e["step"]: e for e in record["evaluations"]}


def convert(source: Path, target: str, name: str, settings: dict, args) -> tuple[dict, Path]:
    """A conversion of ``source`` to ``target`` with the ``subclone:`` ``settings``, run as a
    recipe in ``args.work/<target>-<name>``: its result (seconds, peak, report) and output
    folder."""
    section = {**SMALLER[target], **settings, "evaluate": False}
    if section.get("data"):
        section["data"] = str(corpus_file(section["data"]))
    recipe = {
        "merge_method": "subclone_compensate",
        "models": [{"model": str(source)}],
        "dtype": "bfloat16",
        "subclone": section,
    }
    return run_recipe(f"{target}-{slug_of(name)}", recipe, args)


def slug_of(name: str) -> str:
    """``name`` as a folder name: ``compensated + rescale`` → ``compensated-rescale``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def ridges(report: dict) -> str:
    """How often each ridge was chosen over the conversion's fits."""
    counts: dict[str, int] = {}
    for layer in report["donors"][0]["conversion"]["layers"]:
        for fit in layer["fits"].values():
            key = str(fit.get("ridge"))
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ×{n}" for k, n in sorted(counts.items())) or "–"


def generalize(args) -> None:
    source = texts(args)
    donor = losses(source, args)
    names = list(TEXTS)
    head = " / ".join(names)
    lines = [
        f"Donor: {' / '.join(f'{donor[n]:.3f}' for n in names)} ({head}).",
        "",
        f"| target | arm | zero-shot {head} | after {args.heal_steps or 'no'} steps {head} "
        "| out-of-text share of the gain | ridges chosen | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in args.targets:
        plain = None
        rows = []
        for arm in args.arms:
            result, out = convert(source, target, arm, ARMS[arm], args)
            if args.heal_steps:
                curve = healed(out, out.parent / "healed", args, [0, args.heal_steps])
                zero, after = curve[0], curve[args.heal_steps]
            else:  # zero-shot only
                zero, after = losses(out, args), None
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
                " / ".join(f"{after[n]:.3f}" for n in names) if after else "–",
                share,
                ridges(result["report"]) if arm != "plain" else "–",
                f"{result['seconds']:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    publish(args, "generalize", "\n".join(lines))


def texts(args) -> Path:
    """SmolLM2's folder; ``args.files`` set to the two texts' files, ``args.tests`` to their
    test splits."""
    source = smollm2_folder()
    tokenizer = load_tokenizer([source])
    args.files = {name: str(corpus_file(stem)) for name, stem in TEXTS.items()}
    args.tests = {
        name: load_split(DataConfig(source=path), tokenizer, "test", args.eval_sequences)
        for name, path in args.files.items()
    }
    return source


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
    source = texts(args)
    names = list(TEXTS)
    starts = [s for s in args.starts if RACE[s] != "peer" or peers.version()]
    for target in args.targets:
        results = {}
        for start in starts:
            slug = slug_of(start)
            out = args.work / f"{target}-{slug}-healed"
            results[start] = finished(out, args.budgets)
            if results[start] is None:
                folder = race_start(source, target, start, slug, args)
                lr = SCRATCH_LR if RACE[start] == "scratch" else HEAL_LR
                teacher = {"teacher": source} if RACE[start] == "distilled" else {}
                results[start] = healed(folder, out, args, args.budgets, lr, **teacher)
            print(f"{target} {start}: {results[start]}", flush=True)
        text = race_table(results, args.budgets, names, target)
        text += f"\n\nThe donor, SmolLM2-135M-Instruct: {donor_line(source, args)}."
        if "torch-pruning (Taylor)" in starts:
            text += f"\n\ntorch-pruning {peers.version()}: {peer_shape(args.work, target)}."
        publish(args, f"race-{target}", text)
        if args.plot:
            plot_race(args.plot / f"race-{target}.png", results, names, target)


def finished(out: Path, budgets: list[int]) -> dict[int, dict] | None:
    """The losses of a healing run already written to ``out`` for these budgets, if any: an
    interrupted benchmark resumes with the starts it has not healed yet."""
    info = out / HEAL_INFO
    if not info.is_file():
        return None
    record = json.loads(info.read_text())
    evaluations = {e["step"]: e for e in record["evaluations"]}
    if record["steps"] != max(budgets) or not set(budgets) <= set(evaluations):
        return None
    return evaluations


def race_start(source: Path, target: str, start: str, slug: str, args) -> Path:
    """The folder of ``start``'s model at ``target``: a conversion, a peer's pruning, or the
    shape from scratch (that of the compensated conversion)."""
    how = RACE[start]
    if how in ("scratch", "distilled"):
        like = compensated(source, target, args)
        if how == "distilled":
            return like
        return from_scratch(like, args.work / f"{target}-scratch")
    if how == "peer":
        folder = args.work / f"{target}-{slug}"
        if (folder / "peer.json").is_file():
            return folder
        record = peers.torch_pruning(
            source, folder, SMALLER[target]["hidden_size"], SMALLER[target]["num_attention_heads"]
        )
        (folder / "peer.json").write_text(json.dumps(record, indent=2))
        return folder
    return convert(source, target, start, how, args)[1]


def compensated(source: Path, target: str, args) -> Path:
    """The compensated start at ``target`` (converted once, reused)."""
    folder = args.work / f"{target}-compensated" / "out"
    if not folder.is_dir():
        _, folder = convert(source, target, "compensated", RACE["compensated"], args)
    return folder


def donor_line(source: Path, args) -> str:
    """The donor's losses on both texts."""
    donor = losses(source, args)
    return " / ".join(f"{donor[n]:.3f}" for n in TEXTS) + f" ({' / '.join(TEXTS)})"


def distill(args) -> None:
    """The compensated start healed ``--steps`` steps by distillation at each setting, and on
    the text alone: the losses on both texts and the teacher's share of the time."""
    source = texts(args)
    names = list(TEXTS)
    rows = []
    for target in args.targets:
        start = compensated(source, target, args)
        settings = [None, *[tuple(float(v) for v in s.split(",")) for s in args.settings]]
        for setting in settings:
            name = "text alone" if setting is None else f"T={setting[0]:g}, weight={setting[1]:g}"
            teacher = {}
            if setting is not None:
                teacher = {
                    "teacher": source,
                    "temperature": setting[0],
                    "distill_weight": setting[1],
                }
            out = args.work / f"{target}-distill-{slug_of(name)}-{args.steps}-lr{args.lr:g}"
            curve = finished(out, [0, args.steps])
            if curve is None:
                curve = healed(start, out, args, [0, args.steps], args.lr, **teacher)
            record = json.loads((out / HEAL_INFO).read_text())
            trained = curve[args.steps]["seconds"]  # the steps' own, not evaluating or saving
            share = record["teacher"]["forward_seconds"] / trained if record["teacher"] else 0.0
            after = " / ".join(f"{curve[args.steps][n]:.3f}" for n in names)
            seconds = trained / args.steps
            rows.append(f"| {target} | {name} | {after} | {seconds:.2f} | {share:.0%} |")
            print(rows[-1], flush=True)
    zero = " / ".join(f"{curve[0][n]:.3f}" for n in names)
    text = "\n".join(
        [
            f"The compensated start ({zero} zero-shot at {args.targets[-1]}) after {args.steps} "
            f"steps of healing (8 × 128 tokens, lr {args.lr:g}, cosine over the {args.steps}); "
            f"the donor: {donor_line(source, args)}.",
            "",
            f"| target | loss | after {args.steps} steps {' / '.join(names)} | seconds a step "
            "| teacher's forward, share of a step |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    publish(args, "distill", text)


def peer_shape(work: Path, target: str) -> str:
    """What the peer's pruning reached at ``target``."""
    record = json.loads((work / f"{target}-torch-pruning-taylor" / "peer.json").read_text())
    return (
        f"{record['shape']}, {record['parameters'] / 1e6:.1f}M parameters, "
        f"pruned in {record['seconds']:.0f} s"
    )


def race_table(results: dict, budgets: list[int], names: list[str], target: str) -> str:
    """Losses per start (rows) and budget (columns), both texts in each cell; the best start
    at each budget in bold."""
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

    fig, axes = plt.subplots(2, len(names), figsize=(10, 8), dpi=120, sharey=True)
    for column, name in enumerate(names):
        for start, losses in results.items():
            steps = sorted(losses)
            tokens = [s * TOKENS_PER_STEP for s in steps]
            seconds = [losses[s].get("seconds", math.nan) for s in steps]
            for ax, x in zip(axes[:, column], (tokens, seconds), strict=True):
                ax.plot(x, [losses[s][name] for s in steps], marker="o", label=start)
        axes[0, column].set_title(f"{name} test split")
        axes[0, column].set_xlabel("tokens of healing (8 × 128 a step)")
        axes[1, column].set_xlabel("seconds of healing (2 CPU cores; teacher's forwards included)")
        for ax, linthresh in zip(axes[:, column], (30 * TOKENS_PER_STEP, 60), strict=True):
            ax.set_xscale("symlog", linthresh=linthresh)
            ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("loss (nats per token)")
    axes[0, 0].legend()
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
    p.add_argument("--heal-steps", type=int, default=30, help="0: zero-shot losses only")
    add_markdown_option(p)
    p = sub.add_parser("race")
    p.add_argument("--targets", nargs="+", choices=list(SMALLER), default=list(SMALLER))
    p.add_argument("--budgets", nargs="+", type=int, default=[0, 30, 100, 300])
    p.add_argument("--starts", nargs="+", choices=list(RACE), default=list(RACE))
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--plot", type=Path, default=None, help="folder for race-<target>.png")
    add_markdown_option(p)
    p = sub.add_parser("distill")
    p.add_argument("--targets", nargs="+", choices=list(SMALLER), default=["d384"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", nargs="+", default=["1,1", "2,1", "1,0.5"])
    p.add_argument("--lr", type=float, default=HEAL_LR, help="peak rate of every run")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--eval-sequences", type=int, default=32)
    add_markdown_option(p)
    args = parser.parse_args()
    args.work = (args.work or Path(tempfile.mkdtemp(dir=cache_root()))).absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    {"generalize": generalize, "race": race, "distill": distill}[args.command](args)
    print(json.dumps({"work": str(args.work)}))


if __name__ == "__main__":
    main()
