"""``subclone_compensate`` on zoo donors: the ablation table and the cost of a conversion.

    python benchmarks/subclone.py table [--zoo DIR] [--arch gpt_neox llama] [--axes ...]
                                        [--steps 150] [--lr 2e-3] [--markdown docs/results.md]
    python benchmarks/subclone.py cost  [--zoo DIR] [--arch gpt_neox llama]
                                        [--markdown docs/results.md]

The donors are zoo models of d=256 (``--donor-hidden``), 4 layers, heads of 32 dims, trained
1000 steps (``--donor-steps``; built when missing: about 10 minutes each on two CPU cores).
Axes halve sizes of the donor: ``width`` (d 256→128 with 8 heads of 16 dims, MLP halved),
``heads`` (d 256→128 with 4 heads of 32 dims, MLP halved), ``depth`` (4→2 layers) and ``all``
(d 128, 2 layers, 4 heads, MLP halved). ``table``: the test loss of each arm zero-shot
and after ``--early`` and ``--steps`` steps of the same continued training (same data order,
AdamW, learning rate and schedule), next to a randomly initialised model of the target shape
trained alike (from scratch); the compensated arm of the first axis is trained a second time
with another data order, for the run-to-run noise. ``cost``: the
time and peak memory of one compensated conversion against one forward pass of the donor over
the calibration set, each in its own process.

With ``--markdown``, ``table`` writes one block per architecture, ``table-<arch>`` (``--block``
replaces ``table``, the architecture still appended), and ``cost`` the block ``cost``.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from markdown_blocks import add_markdown_option, publish
from transformers import AutoModelForCausalLM

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.functional import module_config
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.subclone.convert import ConversionConfig, convert_model
from lmc_mergekit.subclone.target import resolve_target
from lmc_mergekit.zoo import build_zoo_model
from lmc_mergekit.zoo.train import continue_training

# Each axis halves these sizes of the donor (recipe key: the donor spec's field).
HALVED = {
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_heads",
    "num_hidden_layers": "num_layers",
    "intermediate_size": "intermediate_size",
}
AXES = {
    "width": ("hidden_size", "intermediate_size"),
    "heads": ("hidden_size", "num_attention_heads", "intermediate_size"),
    "depth": ("num_hidden_layers",),
    "all": tuple(HALVED),
}
ARMS = {
    "plain subclone": ConversionConfig(compensate=False, rescale="none"),
    "subclone + rescale all": ConversionConfig(compensate=False, rescale="all"),
    "subclone + rescale o/down": ConversionConfig(compensate=False, rescale="o_down"),
    "compensated": ConversionConfig(compensate=True, rescale="none"),
    "compensated + rescale o/down": ConversionConfig(compensate=True, rescale="o_down"),
}
SCRATCH = "random init (from scratch)"
# Trained a second time with another data order on the first axis: the run-to-run noise.
NOISE_ARM = "compensated"
CALIBRATION = 256


def sizes_for(axis: str, donor) -> dict:
    """The recipe's size keys of an axis: half the donor's."""
    return {key: getattr(donor, HALVED[key]) // 2 for key in AXES[axis]}


def donor_settings(args) -> dict:
    return {"hidden": args.donor_hidden, "layers": 4, "steps": args.donor_steps, "seed": 0}


def table(args) -> None:
    results = {}
    for arch in args.arch:
        donor_dir = build_zoo_model(args.zoo, arch, **donor_settings(args))
        view = open_model(donor_dir)
        tokenizer = load_tokenizer([donor_dir])
        data = DataConfig()
        calibration = load_split(data, tokenizer, "train", CALIBRATION)
        train = load_split(data, tokenizer, "train")
        test = load_split(data, tokenizer, "test", args.eval)
        donor_loss = mean_token_loss(load_fp32(donor_dir), test).loss
        print(f"\n{arch} donor {donor_dir.name}: test loss {donor_loss:.3f}", flush=True)
        for axis in args.axes:
            target, plan = resolve_target(
                view.spec, view.adapter, sizes_for(axis, view.spec), folder=donor_dir
            )
            rows = {}
            for arm, config in [(SCRATCH, None), *ARMS.items()]:
                started = time.perf_counter()
                if config is None:
                    torch.manual_seed(0)
                    model = AutoModelForCausalLM.from_config(
                        module_config(donor_dir, view.adapter, target), dtype=torch.float32
                    )
                else:
                    conversion = convert_model(
                        view, target, plan, calibration, config, torch.device("cpu"), False
                    )
                    with tempfile.TemporaryDirectory() as tmp:
                        view.adapter.save(conversion.view, Path(tmp), donor_dir, progress=False)
                        model = load_fp32(Path(tmp))
                seconds = time.perf_counter() - started
                row = {"seconds": seconds, 0: mean_token_loss(model, test).loss}
                seeds = (0, 1) if arm == NOISE_ARM and axis == args.axes[0] else (0,)
                for seed in seeds:
                    trained = model if seed == seeds[-1] else copy.deepcopy(model)
                    loss = train_and_measure(trained, train, test, args, seed)
                    if seed == 0:
                        row.update(loss)
                    else:
                        row["noise"] = loss[args.steps]
                rows[arm] = row
                print(
                    f"  {axis:6s} {arm:30s} zero-shot {row[0]:7.3f}  after "
                    f"{args.early} steps {row[args.early]:6.3f}  after {args.steps} steps "
                    f"{row[args.steps]:6.3f}  ({seconds:.1f} s)"
                    + (f"  data seed 1: {row['noise']:.3f}" if "noise" in row else ""),
                    flush=True,
                )
            results.setdefault(arch, {"donor": donor_loss})[axis] = {
                "target": target.shape_summary(),
                "rotary": plan.to_dict(),
                "arms": rows,
            }
    publish_tables(results, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def train_and_measure(model, train, test, args, seed: int) -> dict[int, float]:
    """Continue training ``model`` (data order ``seed``); its test loss after ``args.early``
    and ``args.steps`` steps."""
    losses = {}

    def measure(step: int) -> None:
        if step in (args.early, args.steps):
            losses[step] = mean_token_loss(model, test).loss

    continue_training(
        model,
        train,
        seed=seed,
        steps=args.steps,
        lr=args.lr,
        warmup=args.steps // 10,
        progress=False,
        after_step=measure,
    )
    return losses


def publish_tables(results: dict, args) -> None:
    """One table per architecture, each its own block ``table-<arch>``."""
    for arch, per_axis in results.items():
        axes = [axis for axis in per_axis if axis != "donor"]
        lines = [
            f"{arch} (donor test loss {per_axis['donor']:.3f}): zero-shot / after "
            f"{args.early} / after {args.steps} steps",
            "",
            "| arm | " + " | ".join(axes) + " |",
            "|---|" + "---|" * len(axes),
        ]
        for arm in [SCRATCH, *ARMS]:
            cells = []
            for a in axes:
                row = per_axis[a]["arms"][arm]
                cells.append(f"{row[0]:.2f} / {row[args.early]:.3f} / {row[args.steps]:.3f}")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        block = f"{args.block or 'table'}-{arch}"
        publish(argparse.Namespace(markdown=args.markdown), block, "\n".join(lines))


def cost(args) -> None:
    lines = [
        "| donor | calibration | forward: s / peak MiB | conversion: s / peak MiB | ratio |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for arch in args.arch:
        donor_dir = build_zoo_model(args.zoo, arch, **donor_settings(args))
        measured = {}
        for what in ("forward", "convert"):
            out = subprocess.run(
                [sys.executable, __file__, "cost-worker", str(donor_dir), what],
                check=True,
                capture_output=True,
                text=True,
            )
            measured[what] = json.loads(out.stdout.strip().splitlines()[-1])
        f, c = measured["forward"], measured["convert"]
        lines.append(
            f"| {arch} | {CALIBRATION} × 128 | {f['seconds']:.2f} / {f['peak_mib']:.0f} | "
            f"{c['seconds']:.2f} / {c['peak_mib']:.0f} | {c['seconds'] / f['seconds']:.2f}× time, "
            f"{c['peak_mib'] / f['peak_mib']:.2f}× memory |"
        )
        print(lines[-1], flush=True)
    publish(args, "cost", "\n".join(lines))


def cost_worker(donor_dir: str, what: str) -> None:
    """One measurement in a fresh process: the time of the work (model loading excluded) and
    the process's peak resident memory."""
    donor_dir = Path(donor_dir)
    view = open_model(donor_dir)
    tokenizer = load_tokenizer([donor_dir])
    calibration = load_split(DataConfig(), tokenizer, "train", CALIBRATION)
    if what == "forward":
        model = load_fp32(donor_dir)
        started = time.perf_counter()
        with torch.no_grad():
            for batch in calibration.split(16):
                model(input_ids=batch, use_cache=False)
    else:
        target, plan = resolve_target(
            view.spec, view.adapter, sizes_for("all", view.spec), folder=donor_dir
        )
        started = time.perf_counter()
        convert_model(
            view, target, plan, calibration, ConversionConfig(), torch.device("cpu"), False
        )
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mib": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("table", "cost"):
        p = sub.add_parser(name)
        p.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
        p.add_argument("--arch", nargs="+", default=["gpt_neox", "llama"])
        p.add_argument("--donor-hidden", type=int, default=256, help="donor width (zoo)")
        p.add_argument("--donor-steps", type=int, default=1000, help="donor training steps")
        add_markdown_option(p)
        if name == "table":
            p.add_argument("--axes", nargs="+", default=list(AXES), choices=list(AXES))
            p.add_argument("--steps", type=int, default=150, help="continued-training steps")
            p.add_argument("--early", type=int, default=30, help="also measured after this step")
            p.add_argument("--lr", type=float, default=2e-3, help="continued-training peak lr")
            p.add_argument("--eval", type=int, default=256, help="test sequences")
            p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    worker = sub.add_parser("cost-worker")
    worker.add_argument("donor")
    worker.add_argument("what", choices=["forward", "convert"])
    args = parser.parse_args()
    if args.command == "cost-worker":
        cost_worker(args.donor, args.what)
    else:
        {"table": table, "cost": cost}[args.command](args)


if __name__ == "__main__":
    main()
