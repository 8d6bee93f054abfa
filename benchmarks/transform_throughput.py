"""Throughput and peak memory of moving a checkpoint by a random symmetry (``scramble``).

    python benchmarks/transform_throughput.py [--hidden 512] [--layers 8]
        [--markdown docs/results.md]

Builds a Llama-shaped checkpoint in a temporary folder, then times the three stages of
``transform_checkpoint``: reading + transforming + writing shard by shard, and the self-check.
Peak memory is the process's high-water mark, printed next to the checkpoint's size: writing is
part by part, so the transform itself needs about one block beyond what is loaded; the
self-check runs the source and the exact transform block by block and compares each written
part with it.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from markdown_blocks import add_markdown_option, publish
from transformers import LlamaConfig, LlamaForCausalLM

from lmc_mergekit.evaluation.selfcheck import check_transformed
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.symmetry import apply_transform, random_transform


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    add_markdown_option(parser)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
    )
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(root / "src")
    del model
    base = peak_mib()

    view = open_model(root / "src")
    transform = random_transform(view.spec, seed=0)
    start = time.perf_counter()
    view.adapter.save(
        apply_transform(view, transform),
        root / "out",
        view.folder,
        max_shard_size=64 * 1024**2,
        progress=False,
    )
    write_s = time.perf_counter() - start
    write_peak = peak_mib()
    start = time.perf_counter()
    error = check_transformed(view, transform, root / "out").error
    check_s = time.perf_counter() - start

    size_mib = params * 4 / 1024**2
    table = (
        "| params | fp32 size | transform+write | self-check | logits error "
        "| peak RSS before | after write | after check |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {params / 1e6:.1f}M | {size_mib:.0f} MiB | {write_s:.1f} s | {check_s:.1f} s | "
        f"{error:.1e} | {base:.0f} MiB | {write_peak:.0f} MiB | {peak_mib():.0f} MiB |"
    )
    publish(args, "table", table)


if __name__ == "__main__":
    main()
