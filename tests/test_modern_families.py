"""The modern families end to end: every method from a recipe through ``lmc-mergekit-yaml``,
outputs loaded by transformers, and what the mathematics forbids refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from tiny_models import build_model, logits, probe_ids
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.cli import main
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.passes.lmc_dm.settings import AlignmentSettings
from lmc_mergekit.plugin.cache import preparation_key
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.symmetry.group import symmetry_group

MODERN = (
    "qwen3_qk_norm_gqa",
    "gemma",
    "gemma2_softcap_windows",
    "gemma3_text",
    "phi3_partial_rotary",
    "olmo2",
)
ATOL = 5e-5


def run_yaml(recipe: dict, tmp_path, out):
    path = tmp_path / f"{out.name}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


def recipe(method: str, models, **section) -> dict:
    sections = {"lmc_dm": "alignment", "subclone_compensate": "subclone", "ls_merge": "latent"}
    body = {
        "merge_method": method,
        "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in models],
        "dtype": "float32",
    }
    if method in sections:
        body[sections[method]] = section
    return body


@pytest.fixture(scope="module")
def scrambled(tmp_path_factory):
    """Per family: a tiny model and its scrambled copy (moved by a random element of exactly
    its symmetry group)."""
    root = tmp_path_factory.mktemp("modern")
    pairs = {}
    for variant in MODERN:
        model = build_model(variant, root / variant / "model", seed=3)
        copy = root / variant / "scrambled"
        result = CliRunner().invoke(main, ["scramble", str(model), str(copy), "--seed", "5"])
        assert result.exit_code == 0, result.output
        pairs[variant] = (model, copy)
    return pairs


@pytest.mark.parametrize("variant", MODERN)
def test_scramble_then_lmc_dm_merges_a_model_with_its_copy_into_itself(
    scrambled, tmp_path, variant
):
    model, copy = scrambled[variant]
    ids = probe_ids()
    expected = logits(model, ids)
    assert (logits(copy, ids) - expected).abs().max() < ATOL  # the copy computes the same
    # mergekit's own definition of the family keeps every tensor (an untied head included).
    linear = run_yaml(recipe("linear", [copy]), tmp_path, tmp_path / "linear")
    assert linear.exit_code == 0, linear.output
    assert (logits(tmp_path / "linear", ids) - expected).abs().max() < ATOL
    # Weight matching undoes the scramble, so the average is the model itself.
    out = tmp_path / "dm"
    body = recipe("lmc_dm", [model, copy], matching="weights", steps=0, evaluate=False)
    result = run_yaml(body, tmp_path, out)
    assert result.exit_code == 0, result.output
    assert (logits(out, ids) - expected).abs().max() < 1e-4


@pytest.fixture(scope="module")
def with_text(tmp_path_factory):
    """Per family: two tiny models with a real tokenizer (for calibration)."""
    root = tmp_path_factory.mktemp("modern-text")
    return {
        v: tuple(model_with_tokenizer(root / v / n, v, seed=s) for s, n in enumerate("ab"))
        for v in MODERN
    }


# Ten steps at the midpoint: enough for the midpoint's loss to fall below weight matching's on
# every family (by 0.06 to 0.7 nats on these models), three path points to see it.
LEARNING = dict(
    steps=10, lr=0.05, sampler="half", batch_size=2, seq_len=32, points=3, eval_sequences=8
)
# Random models: the mix of two scores no worse than either (one basin, by the score), so a
# matching is kept without being scored against them.
LEARNING["one_basin_check"] = False


@pytest.mark.slow
@pytest.mark.parametrize("variant", MODERN)
def test_learned_matching_learns_what_the_family_admits(with_text, tmp_path, variant):
    """Learned matching moves each model of the family within its symmetry group (the moved
    models compute their sources' logits) and lowers the midpoint's loss below what weight
    matching alone leaves."""
    a, b = with_text[variant]
    body = recipe("lmc_dm", [a, b], **LEARNING)
    out = tmp_path / "learned"
    result = run_yaml(body, tmp_path, out)
    assert result.exit_code == 0, result.output
    report = yaml.safe_load((out / "lmc_report.json").read_text())
    assert report["learning"]["steps"] == LEARNING["steps"]
    spec = open_model(a).spec
    group = symmetry_group(spec, AlignmentSettings().keeps_tie([spec]))  # tied ones kept tied
    # Every family the model admits, but the learned permutation (opt-in: learn: permutation).
    assert report["learning"]["families"] == [f for f in group.learnable if f != "permutation"]
    ids = probe_ids()
    assert torch.isfinite(logits(out, ids)).all()
    prepared = sorted((tmp_path / "lmc-cache" / "lmc_dm").glob("*/model-*"))
    assert len(prepared) == 2
    for moved, source in zip(prepared, (a, b), strict=True):
        assert (logits(moved, ids) - logits(source, ids)).abs().max() < 1e-4, moved
    pair = report["pairs"][0]
    midpoint = {kind: pair[kind]["losses"][1] for kind in ("raw", "matched", "learned")}
    assert midpoint["learned"] < midpoint["matched"] - 0.01, midpoint
    assert pair["learned"]["endpoint_losses"] == pytest.approx(
        pair["raw"]["endpoint_losses"], abs=1e-4
    )
    if "residual" not in group.learnable:  # asking for it alone learns nothing: refused
        body["alignment"]["learn"] = ["residual"]
        refused = run_yaml(body, tmp_path, tmp_path / "refused")
        assert refused.exit_code == 1 and "admits none" in refused.output, refused.output
        assert len(refused.output.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("variant", MODERN)
def test_size_conversion_and_latent_merging(with_text, tmp_path, variant):
    a, b = with_text[variant]
    spec = open_model(a).spec
    small = dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=spec.head_dim, intermediate_size=40
    )
    conversion = recipe(
        "subclone_compensate", [a], **small, calibration_sequences=32, seq_len=32, evaluate=False
    )
    result = run_yaml(conversion, tmp_path, tmp_path / "small")
    assert result.exit_code == 0, result.output
    assert open_model(tmp_path / "small").spec.num_heads == 2
    assert torch.isfinite(logits(tmp_path / "small", probe_ids())).all()
    # Compensated, post-norm families too (fitted before the norm): no fit loses to selection.
    report = json.loads((tmp_path / "small" / "subclone_report.json").read_text())
    fits = [
        f for layer in report["donors"][0]["conversion"]["layers"] for f in layer["fits"].values()
    ]
    assert fits and all(f["relative_error_refit"] <= f["relative_error_selected"] for f in fits)
    # Latent merge, residuals kept: all weight on one model gives it back exactly.
    latent = recipe("ls_merge", [a, b], steps=5, width=16, evaluate=False)
    latent["models"][1]["parameters"]["weight"] = 0.0
    result = run_yaml(latent, tmp_path, tmp_path / "latent")
    assert result.exit_code == 0, result.output
    ids = probe_ids()
    assert (logits(tmp_path / "latent", ids) - logits(a, ids)).abs().max() < 1e-4


@pytest.mark.parametrize(("variant", "runs"), [("olmo2", "both"), ("qwen3_qk_norm_gqa", "weights")])
@pytest.mark.slow
def test_auto_matching_reads_text_where_the_residual_group_is_discrete(
    with_text, tmp_path, variant, runs
):
    """``matching: auto`` (the default) matches a post-norm family by its weights, then by its
    activations where a barrier is left, keeping activation matching only where its mix
    scores clearly lower on calibration text (the scores and the decision reported); a
    pre-norm one by its weights; the cache key holds what runs (and the text only where it is
    read); models without one tokenizer fall back to weights."""
    a, b = with_text[variant]
    evaluation = dict(steps=0, seq_len=32, points=3, eval_sequences=8, activation_sequences=8)
    evaluation["one_basin_check"] = False  # random models: their raw mix is no worse
    out = tmp_path / "auto"
    result = run_yaml(recipe("lmc_dm", [a, b], **evaluation), tmp_path, out)
    assert result.exit_code == 0, result.output
    report = yaml.safe_load((out / "lmc_report.json").read_text())
    record = report["matching"][0]
    if runs == "both":
        tried = record["tried"]
        assert "weights" in tried and record["scores"]["weights"] == tried["weights"]["mix_loss"]
        if "activations" in tried:
            against = tried["activations"]["against"]
            assert against["start"] == "weights"
            clearly = against["lower_by"] > against["threshold"]
            assert record["matching"] == ("activations" if clearly else "weights")
        else:
            assert "activation matching not run" in record["decision"]
        runs = record["matching"]
    assert record["matching"] == runs
    card = (out / "README.md").read_text()
    assert f"| {runs.removesuffix('s')} matching |" in card
    ids = probe_ids()
    prepared = sorted((tmp_path / "lmc-cache" / "lmc_dm").glob("*/model-*"))
    for moved, source in zip(prepared, (a, b), strict=True):
        assert (logits(moved, ids) - logits(source, ids)).abs().max() < 1e-4, moved

    def key(**changes) -> str:
        settings = AlignmentSettings(**{**evaluation, **changes})
        return preparation_key("lmc_dm", settings, [a, b], "cpu")

    assert (key() == key(matching="weights")) == (variant != "olmo2")
    assert key() != key(matching="none")
    assert (key() == key(seq_len=64)) == (variant != "olmo2")  # the text counts where it is read
    # The models as they are are scored against the matching on the text: it is read.
    assert key(one_basin_check=True) != key(one_basin_check=True, seq_len=64)
    assert AlignmentSettings().resolved_matching([open_model(a).spec], with_text=False) == "weights"
