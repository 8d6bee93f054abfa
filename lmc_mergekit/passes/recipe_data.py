"""The text a pass calibrates and evaluates on, as its recipe section names it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmc_mergekit.errors import LmcError


def load_recipe_split(
    inputs: tuple[Path, ...], settings, split: str, most: int, fix: str | None = None
) -> tuple[torch.Tensor, dict]:
    """Up to ``most`` sequences of ``split`` of the section's ``data`` (``field``, ``seq_len``)
    through the inputs' shared tokenizer, and a JSON-ready description; ``fix`` is appended to
    a missing-tokenizer error (how to do without this data, where one can)."""
    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer

    try:
        tokenizer = load_tokenizer(inputs)
    except LmcError as error:
        if fix is None:
            raise
        raise LmcError(f"{error} (or {fix})") from None
    config = DataConfig(source=settings.data, field=settings.field, seq_len=settings.seq_len)
    sequences = load_split(config, tokenizer, split, most)
    data = {
        "description": config.describe(),
        "split": split,
        "sequences": int(sequences.shape[0]),
        "seq_len": settings.seq_len,
        "tokens": int(sequences.shape[0] * (settings.seq_len - 1)),
    }
    return sequences, data


def load_test_split(inputs: tuple[Path, ...], settings, fix: str) -> tuple | None:
    """The section's test sequences and their description when it asks for evaluation
    (``settings.evaluate``), else None."""
    if not settings.evaluate:
        return None
    return load_recipe_split(inputs, settings, "test", settings.eval_sequences, fix)


def model_test_loss(folder: Path, sequences: torch.Tensor, options) -> float:
    """The mean test loss of the checkpoint ``folder`` on the pass's device (mergekit
    ``options``)."""
    from lmc_mergekit.evaluation.loss import mean_token_loss
    from lmc_mergekit.evaluation.selfcheck import load_fp32
    from lmc_mergekit.passes.context import pass_device

    model = load_fp32(folder, options.trust_remote_code).to(pass_device(options))
    return mean_token_loss(model, sequences, progress=not options.quiet).loss


def add_merged_loss(ctx, report_file: str, settings_type, fix: str) -> dict | None:
    """Read the pass's report in the merged model's folder (``ctx``: the pass's
    ``FinishContext``); when its settings ask for evaluation, add the merged model's test loss
    to it (``merged``) and save it. None when there is no report."""
    path = ctx.folder / report_file
    if not path.is_file():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    settings = settings_type.model_validate(report["settings"])
    test = load_test_split(ctx.inputs, settings, fix)
    if test is not None:
        sequences, data = test
        loss = model_test_loss(ctx.folder, sequences, ctx.options)
        report["merged"] = {"test_loss": loss, "tokens": data["tokens"]}
        path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
