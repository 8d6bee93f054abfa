"""ls_merge through the tool (``lmc-mergekit-yaml`` recipes) against mergekit's own merges.

    python benchmarks/ls_merge.py experts       [--base DIR] [--austen F] [--kjv F] [--steps N]
    python benchmarks/ls_merge.py heterogeneous [--source DIR] [--target DIR] [--lambdas ...]
                                                [--random-source]
    python benchmarks/ls_merge.py self-merge    [--base DIR] [--samples 1 4 16]
        (each also [--markdown docs/results.md] [--block NAME])

``experts``: two experts fine-tuned from one zoo model on different text (``--austen`` and
``--kjv``; default: the bundled corpus's ``austen_prideprejudice.txt``, Austen's *Pride and
Prejudice*, and ``kjv_genesis_to_numbers.txt``, the King James Bible from Genesis to Numbers),
merged half and half by ``ls_merge`` (autoencoder seeds 0 and 1: the noise floor), by mergekit
``linear`` and by mergekit ``ties`` (task vectors against the base, density 0.5), each scored
on both texts' test splits. Latent merges are shown as the paper decodes them
(``keep_residuals: false``) and with the inputs' reconstruction residuals kept (the default).
``heterogeneous``: a d=64 source merged into a d=128 target of the same family,
``(1-λ)·target + λ·transported source`` in latent space, test loss against λ for autoencoder
seeds 0 and 1, plain decode and residuals kept; λ = 0 is the target's own encode–decode (plain)
or the target itself (residuals kept), λ = 1 the transported source alone (optimal transport,
no interpolation). ``--random-source`` runs the same sweep with an untrained model of the
source's shape: the control that tells knowledge carried over from the source apart from a
mere perturbation of the target. ``self-merge``: one model, the average of K posterior samples
per tensor decoded (plain, and with the model's residuals kept). Every row is a recipe run end
to end; the autoencoder's training time and throughput come from the runs' reports.

With ``--markdown`` each table, with the autoencoders' training lines below it, is written as
the block named after the command (``heterogeneous-random`` with ``--random-source``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import yaml
from markdown_blocks import add_markdown_option, publish
from mergekit.options import MergeOptions
from transformers import AutoConfig, AutoModelForCausalLM

from lmc_mergekit.data import DataConfig, bundled_text_files, load_split, load_tokenizer
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32
from lmc_mergekit.passes.ls_merge import LatentReport
from lmc_mergekit.plugin.pipeline import run_recipe
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.zoo.train import continue_training


def run(recipe: dict, out: Path, cache: Path) -> Path:
    """Run ``recipe`` through the tool into ``out`` (replacing it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".yml")
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return run_recipe(path, out, MergeOptions(quiet=True), cache, overwrite=True)


def latent_recipe(models: list[Path], weights: list[float], args, seed: int, **extra) -> dict:
    return {
        "merge_method": "ls_merge",
        "models": [
            {"model": str(m), "parameters": {"weight": w}}
            for m, w in zip(models, weights, strict=True)
        ],
        "dtype": "float32",
        "latent": {"steps": args.steps, "seed": seed, "noise_floor": False, **extra},
    }


def table_and_notes(lines: list[str], notes: list[str]) -> str:
    """The table (caption first) and, below it, each autoencoder's training line once."""
    return "\n".join([lines[0], "", *lines[1:]]) + "".join(
        f"\n\n{line}" for line in dict.fromkeys(notes) if line
    )


def training_line(out: Path) -> str:
    record = LatentReport.read(out / LatentReport.file_name).autoencoders[0].record
    if record["source"] == "cache":
        return ""
    return (
        f"autoencoder seed {record['seed']}: {record['steps']} steps on {record['chunks']} "
        f"chunks in {record['seconds']:.0f} s ({record['chunks_per_second']:.0f} chunks/s, "
        f"{record['device']})"
    )


def experts(args) -> None:
    tokenizer = load_tokenizer([args.base])
    texts = {"Austen": args.austen, "KJV": args.kjv}
    tests = [
        load_split(DataConfig(source=str(path)), tokenizer, "test", args.eval)
        for path in texts.values()
    ]
    work = args.work / "experts"
    folders = []
    for name, path in texts.items():
        folder = work / f"{args.base.name}-{name.lower()}-{path.stem}-{args.expert_steps}"
        if not (folder / "config.json").is_file():
            model = load_fp32(args.base)
            train = load_split(DataConfig(source=str(path)), tokenizer, "train", 2000)
            continue_training(
                model, train, seed=0, steps=args.expert_steps, lr=1e-3, warmup=20, progress=False
            )
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        folders.append(folder)
    lines = [
        f"experts: {args.expert_steps} steps of lr 1e-3 from {args.base.name}",
        "| model | Austen test | KJV test | mean |",
        "|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)

    def row(label: str, folder: Path) -> None:
        model = load_fp32(folder)
        losses = [mean_token_loss(model, test).loss for test in tests]
        lines.append(f"| {label} | {losses[0]:.3f} | {losses[1]:.3f} | {sum(losses) / 2:.3f} |")
        print(lines[-1], flush=True)

    row("base", args.base)
    for name, folder in zip(texts, folders, strict=True):
        row(f"{name} expert", folder)
    plain = {"models": [{"model": str(f), "parameters": {"weight": 0.5}} for f in folders]}
    row(
        "mergekit linear",
        run({**plain, "merge_method": "linear", "dtype": "float32"}, work / "linear", args.cache),
    )
    ties = {
        "merge_method": "ties",
        "base_model": str(args.base),
        "models": [
            {"model": str(f), "parameters": {"weight": 0.5, "density": 0.5}} for f in folders
        ],
        "dtype": "float32",
    }
    row("mergekit ties (density 0.5)", run(ties, work / "ties", args.cache))
    notes = []
    for seed in (0, 1):
        for keep in (False, True):
            recipe = latent_recipe(
                folders, [0.5, 0.5], args, seed, evaluate=False, keep_residuals=keep
            )
            out = run(recipe, work / f"latent-{seed}-{keep}", args.cache)
            notes.append(training_line(out))
            if not keep:
                report = LatentReport.read(out / LatentReport.file_name)
                for name, entry in zip(texts, report.inputs, strict=True):
                    row(f"{name} expert encoded–decoded (seed {seed})", Path(entry.prepared))
            label = "residuals kept" if keep else "plain decode"
            row(f"ls_merge, {label} (autoencoder seed {seed})", out)
            shutil.rmtree(out)
    publish(args, "experts", table_and_notes(lines, notes))


def self_merge(args) -> None:
    tokenizer = load_tokenizer([args.base])
    test = load_split(DataConfig(), tokenizer, "test", args.eval)
    original = mean_token_loss(load_fp32(args.base), test).loss
    lines = [
        f"self-merge of {args.base.name} (test {original:.3f})",
        "| posterior samples K | plain decode, seed 0 / 1 | residuals kept, seed 0 / 1 |",
        "|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    notes = []
    for samples in args.samples:
        cells = []
        for keep in (False, True):
            losses = []
            for seed in (0, 1):
                recipe = latent_recipe(
                    [args.base],
                    [1.0],
                    args,
                    seed,
                    evaluate=False,
                    keep_residuals=keep,
                    samples=samples,
                )
                out = run(recipe, args.work / "self-merge" / f"k{samples}-{seed}", args.cache)
                notes.append(training_line(out))
                losses.append(mean_token_loss(load_fp32(out), test).loss)
                shutil.rmtree(out)
            cells.append(f"{losses[0]:.3f} / {losses[1]:.3f}")
        lines.append(f"| {samples} | {cells[0]} | {cells[1]} |")
        print(lines[-1], flush=True)
    publish(args, "self-merge", table_and_notes(lines, notes))


def random_twin(folder: Path, out: Path) -> Path:
    """An untrained model of ``folder``'s config and tokenizer (the control source)."""
    if not (out / "config.json").is_file():
        config = AutoConfig.from_pretrained(folder)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        load_tokenizer([folder]).save_pretrained(out)
    return out


def heterogeneous(args) -> None:
    tokenizer = load_tokenizer([args.target])
    test = load_split(DataConfig(), tokenizer, "test", args.eval)
    work = args.work / "heterogeneous"
    if args.random_source:
        args.source = random_twin(args.source, work / f"untrained-{args.source.name}")
    losses = {
        name: mean_token_loss(load_fp32(f), test).loss
        for name, f in (("source", args.source), ("target", args.target))
    }
    lines = [
        f"source {args.source.name} (test {losses['source']:.3f}) into target "
        f"{args.target.name} (test {losses['target']:.3f})",
        "| λ | plain decode, seed 0 / 1 | spread | residuals kept, seed 0 / 1 | spread |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    notes = []
    for lam in args.lambdas:
        row = []
        for keep in (False, True):
            for seed in (0, 1):
                recipe = latent_recipe(
                    [args.target, args.source],
                    [1 - lam, lam],
                    args,
                    seed,
                    evaluate=False,
                    keep_residuals=keep,
                )
                recipe["base_model"] = str(args.target)
                out = run(recipe, work / f"lambda-{lam:g}-seed-{seed}", args.cache)
                notes.append(training_line(out))
                row.append(mean_token_loss(load_fp32(out), test).loss)
                shutil.rmtree(out)
        cells = [
            f"{row[i]:.3f} / {row[i + 1]:.3f} | {abs(row[i] - row[i + 1]):.3f}" for i in (0, 2)
        ]
        lines.append(f"| {lam:g} | {cells[0]} | {cells[1]} |")
        print(lines[-1], flush=True)
    name = "heterogeneous-random" if args.random_source else "heterogeneous"
    publish(args, name, table_and_notes(lines, notes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["experts", "heterogeneous", "self-merge"])
    zoo = default_cache_dir() / "zoo"
    parser.add_argument("--base", type=Path, default=zoo / "gpt_neox-d64-l4-s600-seed0")
    parser.add_argument("--source", type=Path, default=zoo / "gpt_neox-d64-l4-s600-seed0")
    parser.add_argument("--target", type=Path, default=zoo / "gpt_neox-d128-l4-s1500-seed0")
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0, 0.05, 0.1, 0.2, 0.5, 1])
    parser.add_argument(
        "--random-source",
        action="store_true",
        help="control: an untrained model of the source's config as the source",
    )
    parser.add_argument("--steps", type=int, default=1500, help="autoencoder training steps")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--eval", type=int, default=128, help="test sequences")
    bundled = {path.name: path for path in bundled_text_files()}
    parser.add_argument(
        "--austen",
        type=Path,
        default=bundled["austen_prideprejudice.txt"],
        help="the Austen expert's text (default: the bundled Pride and Prejudice)",
    )
    parser.add_argument(
        "--kjv",
        type=Path,
        default=bundled["kjv_genesis_to_numbers.txt"],
        help="the KJV expert's text (default: the bundled KJV, Genesis to Numbers)",
    )
    parser.add_argument("--expert-steps", type=int, default=300)
    parser.add_argument("--work", type=Path, default=default_cache_dir() / "bench-ls-merge")
    parser.add_argument("--cache", type=Path, default=default_cache_dir())
    add_markdown_option(parser)
    args = parser.parse_args()
    commands = {"experts": experts, "heterogeneous": heterogeneous, "self-merge": self_merge}
    commands[args.command](args)


if __name__ == "__main__":
    main()
