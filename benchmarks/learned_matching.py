"""Learned matching (``lmc_dm`` with ``steps > 0``) on zoo pairs: four measurements.

    python benchmarks/learned_matching.py time     [--zoo DIR] [--arch gpt_neox llama] [--steps N]
    python benchmarks/learned_matching.py ablation [--zoo DIR] [--arch gpt_neox] [--steps 200]
    python benchmarks/learned_matching.py step     [--zoo DIR] [--arch gpt_neox llama]
    python benchmarks/learned_matching.py three    [--zoo DIR] [--hidden 64] [--steps 300]
    python benchmarks/learned_matching.py matching [--zoo DIR] [--arch gemma2] [--steps 200]
        (each also [--markdown docs/results.md] [--block NAME])

``time``: the barrier on the test split against wall-clock learning time (evaluation excluded),
starting from weight matching. ``ablation``: the final barrier of the paper's variants with one
step budget. ``step``: one alignment step against one plain training step (forward, backward,
AdamW) of one endpoint on the same batch, and the peak memory of each (separate processes).
``three``: three seeds aligned at once against pairwise alignment. ``matching``: weight against
activation matching, each alone and followed by learned matching with and without the learned
residual permutation (families with a discrete residual group), each also with every mix of its
path statistics-repaired (``repair: true``, 64 calibration sequences). Barriers use the recipe
defaults (11 λ points) on ``--eval`` test sequences. Zoo models are built when missing (a d=128
model takes about 5 minutes on two CPU cores).

With ``--markdown`` each table is written as the block named after the command; ``ablation``
writes one block per architecture, ``ablation-<arch>``, and ``matching`` its whole table and a
row per pair for the better start, ``matching-summary``, each into the files that hold its
markers (``--block`` replaces the command's name, the suffix still appended).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from markdown_blocks import add_markdown_option, publish
from step_timing import time_step

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.barrier import path_mix
from lmc_mergekit.evaluation.blockwise import blockwise_loss
from lmc_mergekit.matching.align import AlignConfig, block_runner, match_all, moved
from lmc_mergekit.matching.interpolation import InterpolationObjective
from lmc_mergekit.matching.learned_matching import LearningConfig, learn_symmetries
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.group import DEFAULT_FAMILIES, symmetry_group
from lmc_mergekit.zoo import build_zoo

GRID = tuple(i / 10 for i in range(11))
#: Calibration sequences of a repaired mix (the recipe's ``repair_sequences`` default).
REPAIR_SEQUENCES = 64


class Setup:
    """Zoo models of one architecture, moved by weight matching onto the first, with data."""

    def __init__(self, args, arch: str, seeds: tuple[int, ...], matching: str = "weights"):
        self.folders = build_zoo(args.zoo, arch, args.hidden, args.layers, seeds, args.zoo_steps)
        views = [open_model(folder) for folder in self.folders]
        self.group = symmetry_group(views[0].spec)
        tokenizer = load_tokenizer(self.folders)
        config = DataConfig(seq_len=128)
        self.train = load_split(config, tokenizer, "train", 4096)
        self.test = load_split(config, tokenizer, "test", args.eval)
        absorbed = apply_transform(views[0], Transform(views[0].spec.num_layers, True))
        self.model = block_runner(views[0], absorbed.spec, torch.device("cpu"))
        start = time.perf_counter()
        # What the lmc_dm pass runs.
        matched, _ = match_all(
            views, AlignConfig(matching), runners=(self.model, None), calibration=self.train
        )
        self.matching_seconds = time.perf_counter() - start
        self.raw = moved(views, [matched[0]] * len(views))  # norms absorbed, nothing else
        self.endpoints = moved(views, matched)

    @torch.no_grad()
    def loss(self, endpoints, weights: torch.Tensor) -> float:
        """Test loss of the mix of ``endpoints`` with ``weights``."""
        objective = InterpolationObjective(endpoints, [None] * len(endpoints), self.model)
        total = sum(objective(weights, x) * len(x) for x in self.test.split(32))
        return float(total / len(self.test))

    def barrier(self, endpoints, pair=(0, 1)) -> float:
        """Barrier on the straight path between two of the endpoints."""
        losses = []
        for lam in GRID:
            weights = torch.zeros(len(endpoints))
            weights[pair[0]], weights[pair[1]] = 1 - lam, lam
            losses.append(self.loss(endpoints, weights))
        return max(losses) - (losses[0] + losses[-1]) / 2

    @torch.no_grad()
    def repaired_barrier(self, endpoints, pair=(0, 1)) -> float:
        """Barrier on the straight path between two of the endpoints with each inner mix's
        statistics repaired first, on the recipe's default 64 calibration sequences (what
        ``repair: true`` measures)."""
        a, b = (endpoints[i] for i in pair)
        calibration = self.train[:REPAIR_SEQUENCES]
        losses = [
            blockwise_loss(path_mix(a, b, lam, self.model, calibration), self.model, self.test).loss
            for lam in GRID
        ]
        return max(losses) - (losses[0] + losses[-1]) / 2

    def centre_loss(self, endpoints) -> float:
        return self.loss(endpoints, torch.full((len(endpoints),), 1 / len(endpoints)))

    def learn(self, config: LearningConfig, endpoints=None, on_checkpoint=None):
        endpoints = endpoints or self.endpoints
        result = learn_symmetries(
            endpoints,
            self.model,
            self.train,
            config,
            progress=True,
            on_checkpoint=on_checkpoint,
        )
        return moved(endpoints, result.transforms), result


def cmd_time(args) -> None:
    lines = [
        "| pair | raw barrier | weight matching | learned: barrier (removed) after seconds |",
        "|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for arch in args.arch:
        setup = Setup(args, arch, (0, 1))
        raw, matched = setup.barrier(setup.raw), setup.barrier(setup.endpoints)
        marks, clock = [], {"eval": 0.0, "start": time.perf_counter()}
        every = max(1, args.steps // 20)
        checkpoints = {every * k for k in (1, 2, 4, 7, 10, 15)} | {args.steps}

        def follow(
            step,
            transforms,
            setup=setup,
            marks=marks,
            clock=clock,
            raw=raw,
            arch=arch,
            checkpoints=checkpoints,
        ):
            if step not in checkpoints:
                return
            tick = time.perf_counter()
            ends = moved(setup.endpoints, transforms)
            barrier = setup.barrier(ends)
            seconds = tick - clock["start"] - clock["eval"] + setup.matching_seconds
            clock["eval"] += time.perf_counter() - tick
            marks.append(f"{barrier:.3f} ({1 - barrier / raw:.0%}) @ {seconds:.0f} s")
            print(f"  {arch} step {step}: barrier {barrier:.3f} after {seconds:.0f} s", flush=True)

        config = LearningConfig(steps=args.steps, lr=args.lr, checkpoint_every=every)
        setup.learn(config, on_checkpoint=follow)
        lines.append(
            f"| {arch} d={args.hidden} | {raw:.3f} | {matched:.3f} "
            f"({1 - matched / raw:.0%}) @ {setup.matching_seconds:.0f} s | "
            + "; ".join(marks)
            + " |"
        )
        print(lines[-1], flush=True)
    publish(args, "time", "\n".join(lines))


ABLATION = {
    "dual (polar, all families)": {},
    "one-sided": {"dual": False},
    "without QK": {"families": tuple(f for f in DEFAULT_FAMILIES if f != "qk")},
    "without OV": {"families": tuple(f for f in DEFAULT_FAMILIES if f != "ov")},
    "without scale": {"families": tuple(f for f in DEFAULT_FAMILIES if f != "scale")},
    "without residual": {"families": tuple(f for f in DEFAULT_FAMILIES if f != "residual")},
    "unconstrained": {"parametrization": "unconstrained"},
    "matrix exponential": {"parametrization": "matrix_exp"},
    "Cayley only": {"parametrization": "cayley"},
    "λ band U(0.4, 0.6)": {"sampler": "band"},
    "λ fixed 0.5": {"sampler": "half"},
}


def cmd_ablation(args) -> None:
    for arch in args.arch:
        setup = Setup(args, arch, (0, 1))
        raw, matched = setup.barrier(setup.raw), setup.barrier(setup.endpoints)
        lines = [
            f"{arch} d={args.hidden}, {args.steps} steps each",
            "",
            "| variant | barrier | removed | seconds |",
            "|---|---|---|---|",
            f"| raw | {raw:.3f} | 0% | |",
            f"| weight matching | {matched:.3f} | {1 - matched / raw:.0%} | "
            f"{setup.matching_seconds:.1f} |",
        ]
        print("\n" + "\n".join(lines), flush=True)
        base = LearningConfig(steps=args.steps, lr=args.lr, checkpoint_every=args.steps)
        for name, change in ABLATION.items():
            ends, result = setup.learn(replace(base, **change))
            barrier = setup.barrier(ends)
            lines.append(
                f"| {name} | {barrier:.3f} | {1 - barrier / raw:.0%} | {result.seconds:.0f} |"
            )
            print(lines[-1], flush=True)
        # One block per architecture: --block names the blocks' prefix.
        block = f"{args.block or 'ablation'}-{arch}"
        publish(argparse.Namespace(markdown=args.markdown), block, "\n".join(lines))


#: The ``matching`` ablation's states, in its columns' order: (label, learned families).
STATES = (
    ("matching", None),
    ("learned", DEFAULT_FAMILIES),
    ("learned with the permutation", (*DEFAULT_FAMILIES, "permutation")),
)


def cmd_matching(args) -> None:
    """Each start, each state, each with and without repair: the table ``matching`` (where
    its markers are) and a row per pair for the better start, ``matching-summary``."""
    lines = [
        "| pair | start | " + " | ".join(f"{label} | + repair" for label, _ in STATES) + " |",
        "|---|---|" + "---|---|" * len(STATES),
    ]
    summary = [
        "| pair | raw barrier | better start | after matching | learned | learned, repaired | "
        "learned with the permutation |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for arch in args.arch:
        starts, raw = {}, None
        for matching in ("weights", "activations"):
            setup = Setup(args, arch, (0, 1), matching)
            raw = setup.barrier(setup.raw) if raw is None else raw  # one per pair
            got = {}  # state → (barrier, repaired barrier, seconds), None where not learnable
            for label, families in STATES:
                if families is None:
                    ends, seconds = setup.endpoints, setup.matching_seconds
                elif "permutation" in families and "permutation" not in setup.group.learnable:
                    got[label] = None
                    continue
                else:
                    config = LearningConfig(steps=args.steps, lr=args.lr, families=families)
                    ends, result = setup.learn(replace(config, checkpoint_every=args.steps))
                    seconds = result.seconds
                got[label] = (setup.barrier(ends), setup.repaired_barrier(ends), seconds)
            starts[matching] = got
            cells = []
            for label, _ in STATES:
                if got[label] is None:
                    cells += ["–", "–"]
                    continue
                plain, repaired, seconds = got[label]
                cells += [f"{removed(plain, raw)}, {seconds:.0f} s", removed(repaired, raw)]
            lines.append(
                f"| {arch} d={args.hidden} (raw {raw:.3f}) | {matching} | "
                + " | ".join(cells)
                + " |"
            )
            print(lines[-1], flush=True)
        best = min(starts, key=lambda start: starts[start]["learned"][0])
        got = starts[best]
        permuted = got["learned with the permutation"]
        summary.append(
            f"| {arch} d={args.hidden} | {raw:.3f} | {best} | {removed(got['matching'][0], raw)} | "
            f"**{removed(got['learned'][0], raw)}** | {removed(got['learned'][1], raw)} | "
            + ("–" if permuted is None else removed(permuted[0], raw))
            + " |"
        )
        # Written after each pair: a long run stopped early still leaves what it measured.
        done = args.arch[: args.arch.index(arch) + 1]
        caption = "" if done == args.arch else f"Pairs measured so far: {', '.join(done)}.\n\n"
        name = args.block or "matching"
        blocks = argparse.Namespace(markdown=args.markdown)
        publish(blocks, name, caption + "\n".join(lines), where_marked=True)
        publish(blocks, f"{name}-summary", caption + "\n".join(summary), where_marked=True)


def removed(barrier: float, raw: float) -> str:
    """``barrier (share of raw removed)``."""
    return f"{barrier:.3f} ({1 - barrier / raw:.1%})"


def cmd_step(args) -> None:
    lines = [
        "| pair | training step | alignment step | ratio | training peak RSS | "
        "alignment peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for arch in args.arch:
        times = {}
        for mode in ("train", "align"):
            out = (
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "step-worker",
                        "--mode",
                        mode,
                        "--arch",
                        arch,
                        "--zoo",
                        str(args.zoo),
                        "--hidden",
                        str(args.hidden),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            times[mode] = json.loads(out)
        t, a = times["train"], times["align"]
        lines.append(
            f"| {arch} d={args.hidden} | {t['seconds'] * 1e3:.0f} ms | "
            f"{a['seconds'] * 1e3:.0f} ms | {a['seconds'] / t['seconds']:.2f} | "
            f"{t['peak_mib']:.0f} MiB | {a['peak_mib']:.0f} MiB |"
        )
        print(lines[-1], flush=True)
    publish(args, "step", "\n".join(lines))


def cmd_step_worker(args) -> None:
    """One process, one kind of step: median seconds and the process's peak RSS."""
    folders = build_zoo(args.zoo, args.arch[0], args.hidden, args.layers, (0, 1), args.zoo_steps)
    batch = torch.randint(0, 4096, (16, 128), generator=torch.Generator().manual_seed(0))
    print(json.dumps(time_step(args.mode, folders, batch, args.repeats)))


def cmd_three(args) -> None:
    setup = Setup(args, args.arch[0], (0, 1, 2))
    config = LearningConfig(steps=args.steps, lr=args.lr, checkpoint_every=args.steps)
    pairs = list(itertools.combinations(range(3), 2))
    rows = {"raw": setup.raw, "weight matching": setup.endpoints}
    rows["three at once"], _ = setup.learn(config)
    # Pairwise: each other model learned against the first, which stays fixed (one-sided), so
    # that all of them end up in the first model's frame.
    pairwise = [setup.endpoints[0], None, None]
    for other in (1, 2):
        ends, _ = setup.learn(replace(config, dual=False), [pairwise[0], setup.endpoints[other]])
        pairwise[other] = ends[1]
    rows["pairwise (each with the fixed first)"] = pairwise
    header = " | ".join(f"barrier {a + 1}–{b + 1}" for a, b in pairs)
    lines = [
        f"{args.arch[0]} d={args.hidden}, seeds 0, 1, 2, {args.steps} steps",
        "",
        f"| alignment | {header} | three-way average loss |",
        "|---|---|---|---|---|",
    ]
    print("\n" + "\n".join(lines), flush=True)
    for name, ends in rows.items():
        cells = " | ".join(f"{setup.barrier(ends, pair):.3f}" for pair in pairs)
        lines.append(f"| {name} | {cells} | {setup.centre_loss(ends):.3f} |")
        print(lines[-1], flush=True)
    publish(args, "three", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command", choices=["time", "ablation", "step", "three", "matching", "step-worker"]
    )
    parser.add_argument("--zoo", type=Path, default=default_cache_dir() / "zoo")
    parser.add_argument("--arch", nargs="+", default=["gpt_neox", "llama"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--zoo-steps", type=int, default=None, help="zoo training steps")
    parser.add_argument("--steps", type=int, default=None, help="learned-matching steps")
    parser.add_argument("--lr", type=float, default=LearningConfig(steps=1).lr)
    parser.add_argument("--eval", type=int, default=256, help="test sequences per barrier")
    parser.add_argument("--mode", choices=["train", "align"], default="align")
    parser.add_argument("--repeats", type=int, default=10)
    add_markdown_option(parser)
    args = parser.parse_args()
    args.zoo_steps = args.zoo_steps or (1500 if args.hidden >= 128 else 600)
    defaults = {"time": 1400, "ablation": 200, "three": 300, "matching": 200}
    args.steps = args.steps or defaults.get(args.command, 0)
    {
        "time": cmd_time,
        "ablation": cmd_ablation,
        "step": cmd_step,
        "three": cmd_three,
        "matching": cmd_matching,
        "step-worker": cmd_step_worker,
    }[args.command](args)


if __name__ == "__main__":
    main()
