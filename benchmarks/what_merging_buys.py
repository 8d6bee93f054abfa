"""What merging buys a user: two models trained on different text, and what each merge keeps.

    python benchmarks/what_merging_buys.py --kjv FILE... --austen FILE... [--zoo DIR]
        [--arch gpt_neox llama qwen3 gemma2] [--steps 200] [--eval 256]
        [--hidden 128] [--zoo-steps 1500] [--markdown docs/results.md]

Per architecture, two zoo models (d=128, 4 layers, 1500 steps, one tokenizer trained on both
texts) from different seeds on different text: seed 0 on the ``--kjv`` files, seed 1 on the
``--austen`` files (copied, with their dates, to ``<zoo>/texts/``; default: the bundled corpus's
KJV and Austen books). Each arm runs as an ``lmc_dm`` recipe through ``lmc-mergekit-yaml``'s
pipeline (calibration on both texts' train splits, taking turns) and is scored on each text's
test split (``--eval`` sequences each) and on both (the mean of the two):

- each endpoint; the plain average (``matching: none``, no learning); weight matching and
  activation matching (no learning); learned matching (the default recipe: ``matching: auto``
  and ``--steps`` steps);
- the output ensemble: the two models' next-token probabilities averaged (twice the cost of
  one model at inference: the ceiling a merge would reach if it lost nothing).

A merge *buys* something where it beats both endpoints on both texts together.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from markdown_blocks import add_markdown_option, publish
from mergekit.options import MergeOptions

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.data.corpus import bundled_text_files
from lmc_mergekit.evaluation.loss import load_causal_lm, mean_token_loss
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.zoo import build_zoo_model

TEXTS = ("kjv", "austen")
# Arm: the recipe's alignment settings (None: an endpoint or the ensemble, no recipe).
MERGES = {
    "plain average": {"matching": "none", "steps": 0},
    "weight matching": {"matching": "weights", "steps": 0},
    "activation matching": {"matching": "activations", "steps": 0},
    "learned matching (default recipe)": {},
}


def gather_texts(root: Path, files: dict[str, list[Path]]) -> Path:
    """``root/texts/<name>/`` holding each text's files and nothing else (copied with their
    dates, so that the zoo's fingerprints of them, and so its models, are reused by later
    runs)."""
    texts = root / "texts"
    for name, paths in files.items():
        folder = texts / name
        folder.mkdir(parents=True, exist_ok=True)
        for stale in set(folder.iterdir()) - {folder / p.name for p in paths}:
            stale.unlink()
        for path in paths:
            copy = folder / path.name
            if not copy.is_file() or _size_and_date(copy) != _size_and_date(path):
                shutil.copy2(path, copy)
    return texts


def _size_and_date(path: Path) -> tuple[int, int]:
    return path.stat().st_size, path.stat().st_mtime_ns


def calibration_text(texts: Path, tokenizer, out: Path) -> Path:
    """A JSON Lines file of the train splits of every text, one sequence a line, the texts
    taking turns: calibration that reads both texts from the first sequence on and never a
    test sequence of either (the test splits are each text's own)."""
    splits = [
        load_split(DataConfig(source=str(texts / name)), tokenizer, "train") for name in TEXTS
    ]
    with out.open("w", encoding="utf-8") as file:
        for row in range(max(len(split) for split in splits)):
            for split in splits:
                if row < len(split):
                    text = tokenizer.decode(split[row], skip_special_tokens=True)
                    file.write(json.dumps({"text": text}) + "\n")
    return out


@torch.no_grad()
def ensemble_loss(models: list, sequences: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token loss of the models' averaged probabilities on ``sequences``."""
    total = 0.0
    for batch in sequences.split(batch_size):
        logs = [F.log_softmax(m(input_ids=batch).logits[:, :-1].float(), -1) for m in models]
        mixed = torch.logsumexp(torch.stack(logs), 0) - torch.log(torch.tensor(len(models)))
        total += float(F.nll_loss(mixed.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
    return total / (sequences.shape[0] * (sequences.shape[1] - 1))


def scores(loss_of: Callable, tests: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """The losses on the KJV's and Austen's test sequences and their mean, ``loss_of`` scoring
    one text's sequences."""
    kjv, austen = (loss_of(tests[name]) for name in TEXTS)
    return kjv, austen, (kjv + austen) / 2


def _loss_of(model) -> Callable:
    return lambda sequences: mean_token_loss(model, sequences).loss


def merged(label: str, a: Path, b: Path, data: Path, work: Path, settings: dict, steps: int):
    """The folder of the ``lmc_dm`` merge of ``a`` and ``b`` with alignment ``settings``, and
    the seconds the whole command took."""
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)],
        "dtype": "float32",
        "alignment": {"data": str(data), "evaluate": False, "steps": steps, **settings},
    }
    name = label.split(" (")[0].replace(" ", "-")
    path = work / f"{a.name}-{name}.yml"
    path.write_text(yaml.safe_dump(recipe))
    started = time.perf_counter()
    out = run_recipe(path, work / path.stem, MergeOptions(quiet=True), work / "cache")
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bundled = bundled_text_files()
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument(
        "--kjv", type=Path, nargs="+", default=[p for p in bundled if "kjv" in p.name]
    )
    parser.add_argument(
        "--austen", type=Path, nargs="+", default=[p for p in bundled if "austen" in p.name]
    )
    parser.add_argument("--arch", nargs="+", default=["gpt_neox", "llama", "qwen3", "gemma2"])
    parser.add_argument("--steps", type=int, default=200, help="learned-matching steps")
    parser.add_argument("--eval", type=int, default=256, help="test sequences per text")
    parser.add_argument("--hidden", type=int, default=128, help="zoo models' width")
    parser.add_argument("--zoo-steps", type=int, default=1500, help="zoo models' training steps")
    add_markdown_option(parser)
    args = parser.parse_args()
    texts = gather_texts(args.zoo, {"kjv": args.kjv, "austen": args.austen})
    work = Path(tempfile.mkdtemp(prefix="merging-buys-"))
    rows: dict[str, dict[str, str]] = {}
    for arch in args.arch:
        a, b = (
            build_zoo_model(
                args.zoo,
                arch,
                args.hidden,
                4,
                seed=seed,
                steps=args.zoo_steps,
                data_source=texts / name,
                tokenizer_data=texts,
            )
            for seed, name in enumerate(TEXTS)
        )
        tokenizer = load_tokenizer([a, b])
        tests = {
            name: load_split(DataConfig(source=str(texts / name)), tokenizer, "test", args.eval)
            for name in TEXTS
        }

        calibration = calibration_text(texts, tokenizer, work / f"{arch}-calibration.jsonl")
        endpoints = [load_causal_lm(m) for m in (a, b)]
        results = {
            f"{name} model (seed {i})": scores(_loss_of(model), tests)
            for i, (name, model) in enumerate(zip(("KJV", "Austen"), endpoints, strict=True))
        }
        seconds = {}
        for label, settings in MERGES.items():
            out, seconds[label] = merged(label, a, b, calibration, work, settings, args.steps)
            results[label] = scores(_loss_of(load_causal_lm(out)), tests)
        results["output ensemble (2× cost)"] = scores(partial(ensemble_loss, endpoints), tests)
        best_both = min(results[k][2] for k in results if " model (seed" in k)
        for label, (kjv, austen, both) in results.items():
            mark = "**" if both < best_both and " model (seed" not in label else ""
            rows.setdefault(label, {})[arch] = f"{kjv:.3f} / {austen:.3f} / {mark}{both:.3f}{mark}"
        took = ", ".join(f"{label}: {t:.0f} s" for label, t in seconds.items())
        print(f"{arch}: done ({took})", flush=True)
    lines = [
        "| test loss: KJV / Austen / both | " + " | ".join(args.arch) + " |",
        "|---|" + "---|" * len(args.arch),
    ]
    for label, cells in rows.items():
        lines.append(
            f"| {label} | " + " | ".join(cells.get(arch, "–") for arch in args.arch) + " |"
        )
    lines += ["", "(bold: better on both texts together than either endpoint)"]
    publish(args, "table", "\n".join(lines))


if __name__ == "__main__":
    main()
