"""The weight autoencoder on one zoo model: encode–decode fidelity against PCA.

    python benchmarks/latent_autoencoder.py fidelity [--model DIR] [--ratios 1.6 2 4]
        [--markdown docs/results.md]

``fidelity``: for each compression ratio ``r`` the autoencoder (default sizes: chunks of 64,
latents of ``64/r``) is trained on the model's own weights, every tensor is encoded and decoded
(posterior mean), and the decoded model's test loss is measured: what decoding alone costs
(the λ = 0 endpoint of every latent merge). PCA keeps ``64/r`` principal components of all
chunks of the model (one basis for the whole model, fitted on the normalised chunks), the same
number of numbers per chunk as the autoencoder's latents. Merges (self-merge, experts,
heterogeneous) run through the tool itself in ``benchmarks/ls_merge.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from markdown_blocks import add_markdown_option, publish

from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32
from lmc_mergekit.latent.chunks import NamedTensor, from_chunks, model_tensors, to_chunks
from lmc_mergekit.latent.codec import decode_tensor, encode_tensor, relative_error
from lmc_mergekit.latent.training import TrainingConfig, autoencoder_config_for, train_autoencoder
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import materialize
from lmc_mergekit.runtime.locations import default_cache_dir


def decoded_loss(folder: Path, decoded: dict[tuple[str, int], torch.Tensor], *tests) -> float:
    """The test loss (one per test set) of ``folder``'s model with every tensor replaced by
    its decoded one."""
    view = materialize(open_model(folder))
    for named in model_tensors(view):  # the view's own tensors, overwritten in place
        named.tensor.copy_(decoded[(named.kind, named.layer)].to(named.tensor.dtype))
    with tempfile.TemporaryDirectory() as tmp:
        open_model(folder).adapter.save(view, Path(tmp), folder, progress=False)
        model = load_fp32(Path(tmp))
        losses = [mean_token_loss(model, test).loss for test in tests]
    return losses[0] if len(losses) == 1 else losses


def pca_decode(tensors: list[NamedTensor], size: int, keep: int) -> dict:
    """Every tensor reconstructed from ``keep`` principal components of all chunks."""
    cut = [to_chunks(t.tensor, size) for t in tensors]
    stacked = torch.cat([chunks for chunks, _ in cut]).double()
    mean = stacked.mean(0)
    _, _, basis = torch.linalg.svd(stacked - mean, full_matrices=False)
    basis = basis[:keep]
    decoded = {}
    for named, (chunks, norm) in zip(tensors, cut, strict=True):
        codes = (chunks.double() - mean) @ basis.T
        decoded[(named.kind, named.layer)] = from_chunks(codes @ basis + mean, norm)
    return decoded


def fidelity(args, tensors, test, caption: str) -> None:
    lines = [
        "| ratio | method | mean relative error | test loss | training |",
        "|---|---|---|---|---|",
    ]
    print("\n".join([caption, *lines]), flush=True)
    for ratio in args.ratios:
        config = autoencoder_config_for(tensors, compression_ratio=ratio)
        started = time.perf_counter()
        model, _ = train_autoencoder(
            tensors, config, TrainingConfig(steps=args.steps), progress=False
        )
        seconds = time.perf_counter() - started
        vae = {(t.kind, t.layer): decode_tensor(model, encode_tensor(model, t)) for t in tensors}
        pca = pca_decode(tensors, config.chunk_size, config.latent_dim)
        for name, decoded, cost in (("VAE", vae, f"{seconds:.0f} s"), ("PCA", pca, "–")):
            error = sum(
                relative_error(t.tensor, decoded[(t.kind, t.layer)]) for t in tensors
            ) / len(tensors)
            loss = decoded_loss(args.model, decoded, test)
            lines.append(f"| {ratio:g} | {name} | {error:.3f} | {loss:.3f} | {cost} |")
            print(lines[-1], flush=True)
    publish(args, "fidelity", "\n".join([caption, "", *lines]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["fidelity"])
    parser.add_argument(
        "--model", type=Path, default=default_cache_dir() / "zoo/gpt_neox-d64-l4-s600-seed0"
    )
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.6, 2.0, 4.0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--eval", type=int, default=128, help="test sequences")
    add_markdown_option(parser)
    args = parser.parse_args()
    tokenizer = load_tokenizer([args.model])
    test = load_split(DataConfig(), tokenizer, "test", args.eval)
    tensors = model_tensors(open_model(args.model))
    original = mean_token_loss(load_fp32(args.model), test).loss
    caption = (
        f"{args.model.name}: {sum(t.tensor.numel() for t in tensors)} weights, test {original:.3f}"
    )
    {"fidelity": fidelity}[args.command](args, tensors, test, caption)


if __name__ == "__main__":
    main()
