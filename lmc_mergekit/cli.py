"""``lmc-mergekit``: the plugin's own tools (scramble, transform, demo, zoo, heal, eval, barrier).

It imports no part of mergekit (whose import alone takes seconds), so that the tools start
quickly; ``lmc-mergekit-yaml`` (:mod:`lmc_mergekit.plugin.cli`) runs recipes.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES
from lmc_mergekit.runtime.locations import default_cache_dir
from lmc_mergekit.subclone.distill import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT
from lmc_mergekit.zoo.architectures import ZOO_ARCHITECTURES

# Training steps per zoo model and learned-matching steps of the demo: with its evaluation they
# keep the whole demo, zoo training included, under 5 minutes on 2 CPU cores.
DEMO_TRAIN_STEPS = 500
DEMO_ALIGN_STEPS = 120


def one_line_errors(fn):
    """Turn the tool's own errors into click's one-line ``Error: ...`` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LmcError as error:
            raise click.ClickException(str(error)) from None

    return wrapper


def lmc_cache_option(fn):
    """``--lmc-cache``: where prepared inputs (and the demo's zoo) are kept."""
    return click.option(
        "--lmc-cache",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Cache folder [default: $LMC_MERGEKIT_CACHE or ~/.cache/lmc-mergekit]",
    )(fn)


def evaluation_options(fn):
    """The data and device options shared by ``eval`` and ``barrier``."""
    options = [
        click.option(
            "--data",
            metavar="PATH",
            default=None,
            help="Text file, .jsonl, folder, saved dataset or hf:NAME[:SPLIT] "
            "[default: bundled corpus]",
        ),
        click.option("--field", default="text", show_default=True, help="Text field of records"),
        click.option(
            "--seq-len",
            type=click.IntRange(min=2),
            default=128,
            show_default=True,
            help="Tokens per sequence",
        ),
        click.option(
            "--max-sequences",
            type=click.IntRange(min=1),
            default=DEFAULT_EVAL_SEQUENCES,
            show_default=True,
            help="Most sequences of the split evaluated",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=16,
            show_default=True,
            help="Sequences per forward pass",
        ),
        click.option(
            "--split",
            type=click.Choice(["train", "validation", "test"]),
            default="test",
            show_default=True,
            help="Which split of the data to evaluate on",
        ),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda[:N]"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.group("lmc-mergekit")
def main() -> None:
    """lmc-mergekit tools."""


@main.command("scramble")
@click.argument("model")
@click.argument("out")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed")
@click.option(
    "--save-transform",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the applied transform to this file",
)
@click.option(
    "--untie",
    is_flag=True,
    help="For a model whose LM head is tied to its embeddings: write a separate head, so that "
    "the residual map can be any rotation the model admits [default: keep the tie]",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists")
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def scramble_command(
    model: str,
    out: str,
    seed: int,
    save_transform: Path | None,
    untie: bool,
    overwrite: bool,
    trust_remote_code: bool,
) -> None:
    """Write MODEL moved by a random element of every symmetry it admits to OUT.

    The copy computes the same function (checked before it is kept) but its weights are
    permuted, rotated, rescaled and re-mixed per head: a hard test case for any merge method.
    A tied model stays tied (its residual map is then a signed permutation) unless --untie.
    """
    from lmc_mergekit.models.adapters import open_model
    from lmc_mergekit.symmetry import random_transform
    from lmc_mergekit.symmetry.transform import save_transform as write_transform

    spec = open_model(model, trust_remote_code).spec
    keep_tie = spec.tied_embeddings and not untie
    transform = random_transform(spec, seed, keep_tie=keep_tie)
    _transform_and_report(model, out, transform, overwrite, trust_remote_code)
    if spec.tied_embeddings:
        click.echo(
            "tied embeddings kept: the residual map is a signed permutation (--untie for any "
            "rotation)"
            if keep_tie
            else "tied embeddings untied (--untie): the copy stores a separate LM head"
        )
    if save_transform is not None:
        write_transform(transform, save_transform)


@main.command("transform")
@click.argument("model")
@click.argument("transform_file", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out")
@click.option("--inverse", is_flag=True, help="Apply the inverse of the transform")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists")
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def transform_command(
    model: str,
    transform_file: Path,
    out: str,
    inverse: bool,
    overwrite: bool,
    trust_remote_code: bool,
) -> None:
    """Write MODEL moved by the symmetry saved in TRANSFORM_FILE to OUT."""
    from lmc_mergekit.symmetry.transform import load_transform

    transform = load_transform(transform_file)
    _transform_and_report(
        model, out, transform.inverse() if inverse else transform, overwrite, trust_remote_code
    )


def _transform_and_report(model, out, transform, overwrite, trust_remote_code) -> None:
    from lmc_mergekit.transform_checkpoint import transform_checkpoint

    spec, check = transform_checkpoint(
        model, out, transform, overwrite=overwrite, trust_remote_code=trust_remote_code
    )
    click.echo(
        f"wrote {out} ({spec.architecture}, {spec.num_layers} layers); self-check: "
        + check.summary()
    )


@main.command("zoo")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--arch",
    type=click.Choice(ZOO_ARCHITECTURES),
    default="gpt_neox",
    show_default=True,
    help="Pythia-like GPT-NeoX, Llama with GQA, or a modern family built like it",
)
@click.option("--hidden", type=int, default=128, show_default=True, help="Width, a multiple of 32")
@click.option("--layers", type=int, default=4, show_default=True, help="Number of layers")
@click.option("--seeds", default="0,1", show_default=True, help="Seeds: a list and/or ranges (0-3)")
@click.option("--steps", type=int, default=1500, show_default=True, help="Training steps")
@click.option(
    "--data",
    default=None,
    help="Training text: a file, folder, JSONL or dataset on disk [default: the bundled corpus]",
)
@click.option(
    "--tokenizer-data",
    default=None,
    help="Text the tokenizer is trained on, or 'bundled' for the bundled corpus, so that "
    "models trained on different texts share one vocabulary [default: the training text]",
)
@click.option("--field", default="text", show_default=True, help="Text field of records")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Tokens per sequence")
@click.option("--vocab-size", type=int, default=4096, show_default=True, help="BPE vocabulary")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Sequences per step")
@click.option("--lr", type=float, default=None, help="Peak learning rate [default: 6e-3]")
@click.option("--warmup", type=int, default=None, help="Warm-up steps [default: 100]")
@click.option("--tied", is_flag=True, help="Tie the LM head to the token embeddings")
@one_line_errors
def zoo_command(
    out: Path,
    arch: str,
    hidden: int,
    layers: int,
    seeds: str,
    steps: int,
    data: str | None,
    tokenizer_data: str | None,
    field: str,
    seq_len: int,
    vocab_size: int,
    batch_size: int,
    lr: float | None,
    warmup: int | None,
    tied: bool,
) -> None:
    """Train small language models from scratch into OUT, one per seed (reused if there).

    Each is a stock Hugging Face checkpoint with its tokenizer, in a folder named by its
    settings; zoo_model.json in it holds the training record.
    """
    import time

    from lmc_mergekit.zoo import build_zoo_model, parse_seeds, read_zoo_info
    from lmc_mergekit.zoo.train import DEFAULT_LR, DEFAULT_WARMUP

    started = time.time()
    for seed in parse_seeds(seeds):
        path = build_zoo_model(
            out,
            arch,
            hidden,
            layers,
            seed=seed,
            steps=steps,
            data_source=data,
            field=field,
            seq_len=seq_len,
            vocab_size=vocab_size,
            batch_size=batch_size,
            lr=DEFAULT_LR if lr is None else lr,
            warmup=DEFAULT_WARMUP if warmup is None else warmup,
            tied=tied,
            tokenizer_data=tokenizer_data,
        )
        info = read_zoo_info(path)
        record = info["training"]
        how = (
            "reused"
            if info["created_unix"] < started
            else f"trained in {record['wall_time_s']:.0f} s at {record['tokens_per_s']:.0f} tok/s"
        )
        click.echo(f"{path}  validation loss {record['validation_loss']:.3f} nats  ({how})")


@main.command("heal")
@click.argument("model")
@click.argument("out")
@click.option("--steps", type=click.IntRange(min=1), required=True, help="Training steps")
@click.option(
    "--data",
    metavar="PATH",
    multiple=True,
    help="Training text (repeat for several, mixed in equal shares): a file, .jsonl, folder, "
    "saved dataset or hf:NAME[:SPLIT] [default: bundled corpus]",
)
@click.option("--field", default="text", show_default=True, help="Text field of records")
@click.option("--seq-len", type=click.IntRange(min=2), default=128, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--lr", type=float, default=3e-4, show_default=True, help="Peak learning rate")
@click.option("--seed", type=int, default=0, show_default=True, help="Order of the batches")
@click.option(
    "--eval-every",
    type=click.IntRange(min=1),
    default=None,
    help="Steps between held-out losses [default: a tenth of the run]",
)
@click.option(
    "--eval-sequences",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Test-split sequences of the data the held-out loss is measured on",
)
@click.option(
    "--teacher",
    metavar="PATH",
    default=None,
    help="Distil from this model (same tokenizer) [default: the donor MODEL's "
    "subclone_report.json names, where it can be read]",
)
@click.option("--no-teacher", is_flag=True, help="Train on the text alone, without distillation")
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TEMPERATURE,
    show_default=True,
    help="Softens teacher and student distributions",
)
@click.option(
    "--distill-weight",
    type=click.FloatRange(0, 1),
    default=DEFAULT_WEIGHT,
    show_default=True,
    help="Share of the loss that is the KL to the teacher (the text's own loss has the rest)",
)
@click.option(
    "--gradient-checkpointing",
    is_flag=True,
    help="Recompute each layer's activations in the backward pass: less memory for a large "
    "model, about a third more time a step",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda[:N]")
@lmc_cache_option
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists")
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def heal_command(
    model: str,
    out: str,
    steps: int,
    data: tuple[str, ...],
    field: str,
    seq_len: int,
    batch_size: int,
    lr: float,
    seed: int,
    eval_every: int | None,
    eval_sequences: int,
    teacher: str | None,
    no_teacher: bool,
    temperature: float,
    distill_weight: float,
    gradient_checkpointing: bool,
    device: str,
    lmc_cache: Path | None,
    overwrite: bool,
    trust_remote_code: bool,
) -> None:
    """Train MODEL on for --steps steps and write it to OUT: healing after a size conversion.

    A model written by subclone_compensate learns from its donor by default (distillation:
    the KL to the donor's next-token distribution); --no-teacher trains on the text alone. The
    held-out loss is measured along the way and written with the run's record to
    OUT/heal.json. Interrupted, the same command resumes from its last checkpoint.
    """
    from lmc_mergekit.data import DataConfig
    from lmc_mergekit.subclone.heal import choose_teacher, heal, heal_steps_to_evaluate

    if teacher is not None and no_teacher:
        raise LmcError("--teacher and --no-teacher contradict each other; pass one")
    chosen = choose_teacher(model, teacher, distill=not no_teacher)
    click.echo(chosen.why, err=True)
    source = None if not data else data[0] if len(data) == 1 else list(data)
    record = heal(
        model,
        out,
        steps=steps,
        data=DataConfig(source=source, field=field, seq_len=seq_len),
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        evaluate_at=heal_steps_to_evaluate(steps, eval_every),
        eval_sequences=eval_sequences,
        device=device,
        cache_dir=lmc_cache or default_cache_dir(),
        overwrite=overwrite,
        progress=sys.stderr.isatty(),
        trust_remote_code=trust_remote_code,
        teacher=chosen.folder,
        temperature=temperature,
        distill_weight=distill_weight,
        gradient_checkpointing=gradient_checkpointing,
    )
    for evaluation in record["evaluations"]:
        click.echo(f"step {evaluation['step']:>6}: held-out loss {evaluation['test']:.4f}")
    first, last = record["evaluations"][0]["test"], record["evaluations"][-1]["test"]
    resumed = f", resumed at step {record['resumed_at']}" if record["resumed_at"] else ""
    taught = record["teacher"]
    teacher_cost = (
        f"; the teacher's forwards took {taught['share_of_time']:.0%} of the run" if taught else ""
    )
    click.echo(
        f"wrote {out}: held-out loss {first:.4f} -> {last:.4f} nats after {steps} steps "
        f"({record['tokens_seen']} tokens{resumed}{teacher_cost})"
    )


@main.command("eval")
@click.argument("model")
@evaluation_options
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result to this JSON file",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own code to run")
@one_line_errors
def eval_command(
    model: str,
    data: str | None,
    field: str,
    seq_len: int,
    split: str,
    max_sequences: int | None,
    batch_size: int,
    device: str,
    json_file: Path | None,
    trust_remote_code: bool,
) -> None:
    """Print MODEL's mean next-token loss and perplexity on a split of the data."""
    import json

    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
    from lmc_mergekit.evaluation.blockwise import checkpoint_loss
    from lmc_mergekit.models.checkpoint import model_dir

    folder = model_dir(model)
    config = DataConfig(source=data, field=field, seq_len=seq_len)
    # Data errors come before the (slower) model load.
    sequences = load_split(config, load_tokenizer([folder]), split, max_sequences)
    progress = sys.stderr.isatty()
    result = checkpoint_loss(folder, sequences, device, trust_remote_code, progress, batch_size)
    click.echo(
        f"{folder.name}: loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f} "
        f"over {result.tokens} tokens ({len(sequences)} sequences of {seq_len}, {split} split "
        f"of {config.describe()})"
    )
    if json_file is not None:
        report = {
            "model": str(folder),
            "data": config.describe(),
            "split": split,
            "seq_len": seq_len,
            "sequences": len(sequences),
            **result.to_dict(),
        }
        json_file.parent.mkdir(parents=True, exist_ok=True)
        json_file.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


@main.command("barrier")
@click.argument("model_a")
@click.argument("model_b")
@evaluation_options
@click.option("--points", type=int, default=11, show_default=True, help="λ grid points from A to B")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the curve and barrier as JSON",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw the curve into this PNG",
)
@one_line_errors
def barrier_command(
    model_a: str,
    model_b: str,
    data: str | None,
    field: str,
    seq_len: int,
    split: str,
    points: int,
    max_sequences: int,
    batch_size: int,
    device: str,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Test loss of (1-λ)·MODEL_A + λ·MODEL_B along an evenly spaced λ grid, and the barrier
    (highest loss on the path minus the mean of the two endpoint losses)."""
    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
    from lmc_mergekit.evaluation.barrier import (
        format_table,
        interpolation_losses,
        plot_paths,
        write_path_json,
    )
    from lmc_mergekit.evaluation.loss import resolve_device
    from lmc_mergekit.models.checkpoint import model_dir

    a, b = model_dir(model_a), model_dir(model_b)
    config = DataConfig(source=data, field=field, seq_len=seq_len)
    sequences = load_split(config, load_tokenizer([a, b]), split, max_sequences)
    path = interpolation_losses(
        a,
        b,
        sequences,
        points=points,
        batch_size=batch_size,
        device=resolve_device(device),
        progress=True,
    )
    curves = {f"{split} loss": path}
    click.echo(format_table(curves))
    click.echo(
        f"barrier {path.barrier:.4f} nats (endpoints {path.losses[0]:.4f} and "
        f"{path.losses[-1]:.4f}; {path.tokens} {split} tokens of {config.describe()})"
    )
    if json_path is not None:
        extra = {
            "model_a": str(a),
            "model_b": str(b),
            "data": config.describe(),
            "split": split,
            "seq_len": seq_len,
        }
        write_path_json(json_path, curves, extra)
    if plot is not None:
        plot_paths(plot, curves, f"{a.name} → {b.name}")


@main.command("demo")
@click.argument("out", default="lmc-demo", required=False)
@click.option("--arch", type=click.Choice(ZOO_ARCHITECTURES), default="gpt_neox", show_default=True)
@click.option("--hidden", type=int, default=64, show_default=True, help="Width of the zoo models")
@click.option("--layers", type=int, default=4, show_default=True, help="Depth of the zoo models")
@click.option(
    "--steps",
    type=int,
    default=DEMO_TRAIN_STEPS,
    show_default=True,
    help="Training steps per model",
)
@click.option(
    "--align-steps",
    type=click.IntRange(min=0),
    default=DEMO_ALIGN_STEPS,
    show_default=True,
    help="Learned-matching steps (0: weight matching only)",
)
@click.option(
    "--zoo",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Zoo folder [default: <cache>/zoo]",
)
@lmc_cache_option
@click.option("--overwrite", is_flag=True, help="Replace OUT/merged if it exists")
@one_line_errors
def demo_command(
    out: str,
    arch: str,
    hidden: int,
    layers: int,
    steps: int,
    align_steps: int,
    zoo: Path | None,
    lmc_cache: Path | None,
    overwrite: bool,
) -> None:
    """Train (or reuse) two small models of different seeds, merge them with lmc_dm (weight
    matching, then learned matching) into OUT/merged [default OUT: ./lmc-demo], and show the
    loss barrier before and after each alignment stage."""
    from lmc_mergekit.plugin.demo import run_demo

    cache = lmc_cache or default_cache_dir()
    result = run_demo(
        Path(out),
        zoo_root=zoo or cache / "zoo",
        cache_dir=cache,
        arch=arch,
        hidden=hidden,
        layers=layers,
        steps=steps,
        align_steps=align_steps,
        overwrite=overwrite,
    )
    click.echo("\n" + result.summary())


if __name__ == "__main__":
    sys.exit(main())
