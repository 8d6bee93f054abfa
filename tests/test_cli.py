"""The command-line tools end to end: real files, the real mergekit executor, transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import build_model, logits, probe_ids, stored_tensors

from lmc_mergekit.cli import main
from lmc_mergekit.plugin.cli import mergekit_yaml_main

# Tiny random models have no tokenizer, so these recipes skip the barrier evaluation.
UNALIGNED = {"matching": "none", "evaluate": False}


def run_yaml(recipe: dict, tmp_path: Path, out: Path, *extra: str):
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet", *extra])


def two_models(kind: str, root: Path) -> tuple[Path, Path]:
    return build_model(kind, root / "a", seed=1), build_model(kind, root / "b", seed=2)


def linear_recipe(a: Path, b: Path, method: str = "linear", **extra) -> dict:
    return {
        "merge_method": method,
        "models": [
            {"model": str(a), "parameters": {"weight": 0.3}},
            {"model": str(b), "parameters": {"weight": 0.7}},
        ],
        "dtype": "float32",
        **extra,
    }


@pytest.mark.parametrize("kind", ["gpt_neox_partial_rotary_parallel", "llama"])
def test_builtin_linear_merge_loads(tmp_path, kind):
    a, b = two_models(kind, tmp_path)
    result = run_yaml(linear_recipe(a, b), tmp_path, tmp_path / "merged")
    assert result.exit_code == 0, result.output
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, 0.3 * wa[name] + 0.7 * wb[name])
    assert logits(tmp_path / "merged", probe_ids()).shape[-1] == 96
    assert (tmp_path / "merged" / "README.md").is_file()


def test_scramble_writes_an_equivalent_model(model_dirs, tmp_path):
    kinds = (
        "gpt_neox_partial_rotary_parallel",
        "llama",
        "mistral_gqa",
        "qwen2_gqa_bias_tied",
        "gpt2_tied",
    )
    for kind in kinds:
        out = tmp_path / kind
        result = CliRunner().invoke(
            main, ["scramble", str(model_dirs[kind]), str(out), "--seed", "7"]
        )
        assert result.exit_code == 0, result.output
        assert "self-check" in result.output
        torch.testing.assert_close(
            logits(out, probe_ids()), logits(model_dirs[kind], probe_ids()), atol=5e-5, rtol=0
        )
        tied = json.loads((model_dirs[kind] / "config.json").read_text())["tie_word_embeddings"]
        written = json.loads((out / "config.json").read_text())
        assert written["tie_word_embeddings"] is tied  # a tied model stays tied
        assert ("tied embeddings kept" in result.output) is tied


@pytest.mark.parametrize("untie", [False, True], ids=["kept", "untied"])
def test_scramble_keeps_a_tie_unless_asked_to_untie(model_dirs, tmp_path, untie):
    source = model_dirs["qwen2_gqa_bias_tied"]
    out = tmp_path / "out"
    args = ["scramble", str(source), str(out), "--seed", "3"] + (["--untie"] * untie)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert ("untied (--untie)" if untie else "tied embeddings kept") in result.output
    assert ("lm_head.weight" in stored_tensors(out)) is untie
    torch.testing.assert_close(
        logits(out, probe_ids()), logits(source, probe_ids()), atol=5e-5, rtol=0
    )
    moved, original = stored_tensors(out), stored_tensors(source)
    embedding = "model.embed_tokens.weight"
    # Kept: the embedding is a signed permutation of the scaled original's columns, so each
    # column's largest magnitude is one of the original's (times the scale).
    if not untie:
        ratio = (
            moved[embedding].abs().amax(0).sort().values
            / original[embedding].abs().amax(0).sort().values
        )
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio))


def test_lmc_dm_pipeline_with_cache_and_card(tmp_path):
    a, b = two_models("llama", tmp_path)
    cache = tmp_path / "cache"
    recipe = linear_recipe(a, b, "lmc_dm", alignment=UNALIGNED)
    result = run_yaml(recipe, tmp_path, tmp_path / "dm", "--lmc-cache", str(cache))
    assert result.exit_code == 0, result.output
    # Unaligned, lmc_dm is exactly mergekit's linear merge of the same weights.
    assert run_yaml(linear_recipe(a, b), tmp_path, tmp_path / "lin").exit_code == 0
    dm, lin = (load_file(tmp_path / n / "model.safetensors") for n in ("dm", "lin"))
    assert dm.keys() == lin.keys() and all(torch.equal(dm[k], lin[k]) for k in dm)
    card = (tmp_path / "dm" / "README.md").read_text()
    assert "Pre-merge pass (lmc-mergekit)" in card and str(a) in card and "lmc_dm" in card
    assert yaml.safe_load((tmp_path / "dm" / "mergekit_config.yml").read_text())["alignment"]
    # A rerun reuses the prepared shards instead of rewriting them.
    prepared = sorted(cache.glob("lmc_dm/*/model-0/*.safetensors"))
    assert len(prepared) == 1
    stamp = prepared[0].stat().st_mtime_ns
    again = run_yaml(recipe, tmp_path, tmp_path / "dm", "--lmc-cache", str(cache), "--overwrite")
    assert again.exit_code == 0, again.output
    assert prepared[0].stat().st_mtime_ns == stamp
    provenance = json.loads((prepared[0].parent / "lmc_prepared.json").read_text())
    assert provenance["method"] == "lmc_dm" and provenance["source"] == str(a)


def test_registration_is_idempotent():
    import importlib

    from mergekit import merge_methods

    import lmc_mergekit.plugin

    importlib.reload(lmc_mergekit.plugin)
    names = [m.spec.name for m in merge_methods.registered_methods()]
    assert all(names.count(n) == 1 for n in ("lmc_dm", "subclone_compensate", "ls_merge"))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda r: r.update(alignment={"stpes": 3}),
            "unknown key 'stpes' (allowed: matching, steps,",
        ),
        (lambda r: r.update(alignment={"matching": "magic"}), "matching: Input should be"),
        (
            lambda r: r.update(merge_method="linear", alignment={}),
            "belongs to merge_method: lmc_dm",
        ),
        (lambda r: r["models"][1].update(model="/no/such/model"), "does not exist"),
        (lambda r: r.update(alignment={"combine": "magic"}), "'magic' is not a mergekit method"),
        (lambda r: r.update(alignment={"steps": 5, "learn": []}), "learn: is empty"),
        (lambda r: r.update(alignment={"steps": 0, "evaluate": True}), "has no tokenizer"),
        (
            lambda r: r.update(alignment={"steps": 5, "evaluate": False}),
            "or use matching: weights and steps: 0",
        ),
    ],
)
def test_bad_recipes_fail_in_one_line_and_leave_nothing(tmp_path, change, needle):
    a, b = two_models("llama", tmp_path)
    recipe = linear_recipe(a, b, "lmc_dm", alignment=UNALIGNED)
    change(recipe)
    out = tmp_path / "out"
    result = run_yaml(recipe, tmp_path, out)
    assert result.exit_code == 1
    assert needle in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_models_of_different_shapes_or_architectures(tmp_path):
    a = build_model("llama", tmp_path / "a")
    wide = build_model("llama", tmp_path / "wide", intermediate_size=64)
    neox = build_model("gpt_neox_partial_rotary_parallel", tmp_path / "neox")
    for other, needle in ((wide, "intermediate_size is 80"), (neox, "one architecture")):
        result = run_yaml(
            linear_recipe(a, other, "lmc_dm", alignment=UNALIGNED),
            tmp_path,
            tmp_path / "out",
        )
        assert result.exit_code == 1 and needle in result.output, result.output
        assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path):
    a, b = two_models("llama", tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run_yaml(linear_recipe(a, b), tmp_path, tmp_path / "out")
    assert result.exit_code == 1 and "--overwrite" in result.output
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("recipe", sorted((Path(__file__).parents[1] / "recipes").glob("*.yml")))
def test_shipped_recipes_parse(recipe):
    from mergekit import merge_methods

    from lmc_mergekit.plugin.recipe import parse_recipe

    parsed = parse_recipe(recipe.read_text())
    raw = yaml.safe_load(recipe.read_text())
    if parsed.method is None:  # a built-in recipe: mergekit knows its method
        assert merge_methods.get(raw["merge_method"]).spec.name == raw["merge_method"]
    else:  # a plugin recipe: its section is read into the method's settings, every key kept
        assert isinstance(parsed.settings, parsed.method.settings)
        given = raw.get(parsed.method.section) or {}
        assert given == {k: v for k, v in parsed.settings.model_dump().items() if k in given}


def test_staged_output_appears_whole_with_the_usual_permissions(tmp_path):
    import os

    from lmc_mergekit.runtime.publish import staged_folder

    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_folder(out) as staging:
        (staging / "half.txt").write_text("x")
        raise RuntimeError("interrupted")
    assert not out.exists() and not list(tmp_path.iterdir())
    with staged_folder(out) as staging:
        assert staging.name == out.name  # mergekit titles its card after the folder it writes
        (staging / "whole.txt").write_text("x")
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "whole.txt").is_file() and (out.stat().st_mode & 0o777) == 0o777 & ~mask


def test_a_plugin_merge_prints_no_warning_of_its_dependencies(tmp_path):
    """mergekit sets ``config.torch_dtype``, which transformers 5 deprecates with a notice
    logged once per process: the notice's memory is cleared first, so that it would be."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.warning_once.cache_clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        a, b = two_models("llama", tmp_path)
        recipe = linear_recipe(a, b, "lmc_dm", alignment=UNALIGNED)
        result = run_yaml(recipe, tmp_path, tmp_path / "out")
    finally:
        library.removeHandler(handler)
    assert result.exit_code == 0, result.output
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
