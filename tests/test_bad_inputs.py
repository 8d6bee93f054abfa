"""Bad input ends in one line naming the problem and the fix, never a traceback, and leaves
nothing that looks like an output: corrupt checkpoints, recipe mistakes mergekit itself would
only find late, and merges that would write NaN."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from tiny_models import build_model

from lmc_mergekit.plugin.cli import mergekit_yaml_main

METHODS = {
    "linear": {},
    "lmc_dm": {"alignment": {"matching": "none", "evaluate": False}},
}


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    return build_model("llama", tmp_path / "a", seed=1), build_model(
        "llama", tmp_path / "b", seed=2
    )


def recipe_for(a: Path, b: Path, method: str, **extra) -> dict:
    return {
        "merge_method": method,
        "models": [
            {"model": str(a), "parameters": {"weight": 0.5}},
            {"model": str(b), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        **METHODS[method],
        **extra,
    }


def run(recipe: dict, tmp_path: Path):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(tmp_path / "out"), "--quiet"])


def refused(result, tmp_path: Path, needle: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert needle in lines[0], lines[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def _truncate(folder: Path) -> None:
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def _garble(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"not a safetensors file" * 8)


def _missing_shard(folder: Path) -> None:
    """Split into two shards and lose the second (as an interrupted copy would)."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    (folder / "model.safetensors").unlink()
    save_file({name: tensors[name] for name in names[:3]}, folder / next(iter(shards)))
    weight_map = {name: shard for shard, part in shards.items() for name in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _bad_config(folder: Path) -> None:
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[: len(text) // 2])


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (_truncate, "is not a readable safetensors file"),
        (_garble, "is not a readable safetensors file"),
        (_missing_shard, "which is missing"),
        (_bad_config, "config.json is not valid JSON"),
    ],
)
def test_corrupt_checkpoints(pair, tmp_path, method, damage, needle):
    damage(pair[1])
    refused(run(recipe_for(*pair, method), tmp_path), tmp_path, needle)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda r: r.update(models=[]), "Exactly one of 'models', 'slices', or 'modules'"),
        (lambda r: r.update(dtype="float8"), "dtype: 'float8' is not a dtype mergekit knows"),
        (lambda r: r.update(out_dtype="half"), "out_dtype: 'half' is not a dtype"),
        (lambda r: r.update(merge_method="averaging"), "'averaging' is not a mergekit method"),
        (lambda r: r.update(models="a"), "invalid recipe: models"),
    ],
)
def test_recipe_mistakes_mergekit_would_find_late(pair, tmp_path, method, change, needle):
    recipe = recipe_for(*pair, method)
    change(recipe)
    if recipe["merge_method"] != method:
        recipe.pop("alignment", None)
    refused(run(recipe, tmp_path), tmp_path, needle)


def test_weights_summing_to_zero_never_write_nan(pair, tmp_path):
    recipe = recipe_for(*pair, "linear")
    recipe["models"][1]["parameters"]["weight"] = -0.5
    refused(run(recipe, tmp_path), tmp_path, "NaN/Inf values (weights that sum to zero")
    # Per-tensor weights that sum to zero for some tensors only: caught in the merged output.
    recipe["models"][1]["parameters"]["weight"] = [{"filter": "mlp", "value": -0.5}, {"value": 1}]
    refused(run(recipe, tmp_path), tmp_path, "mlp")
    # Plugin methods refuse plain zero-sum weights before their pre-merge pass.
    dm = recipe_for(*pair, "lmc_dm")
    dm["models"][1]["parameters"]["weight"] = -0.5
    refused(run(dm, tmp_path), tmp_path, "sum to zero")
    assert not (tmp_path / "lmc-cache" / "lmc_dm").exists()


def test_errors_mergekit_finds_while_planning_are_one_line(pair, tmp_path):
    recipe = recipe_for(*pair, "linear")
    recipe["models"][0]["parameters"] = {}  # linear needs every model's weight
    refused(run(recipe, tmp_path), tmp_path, "mergekit: Missing required parameter weight")


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Matching and learning fail the test if they start: a refusal must come first."""
    from lmc_mergekit.matching import align

    def started(*args, **kwargs):
        raise AssertionError("heavy work started before the inputs were checked")

    for name in ("match_all", "learn_symmetries", "block_runner"):
        monkeypatch.setattr(align, name, started)


def _wider(tmp_path: Path, a: Path, b: Path) -> tuple[Path, Path]:
    return a, build_model("llama", tmp_path / "wide", seed=2, hidden_size=64)


def _post_norm_pair(tmp_path: Path, a: Path, b: Path) -> tuple[Path, Path]:
    return tuple(build_model("olmo2", tmp_path / f"o{s}", seed=s) for s in (1, 2))


def _other_vocabulary(tmp_path: Path, a: Path, b: Path) -> tuple[Path, Path]:
    from tokenizer_helpers import model_with_tokenizer

    return (
        model_with_tokenizer(tmp_path / "t1", "llama", seed=1, book=0),
        model_with_tokenizer(tmp_path / "t2", "llama", seed=2, book=1),
    )


@pytest.mark.parametrize(
    ("inputs", "alignment", "needle"),
    [
        (_wider, {"steps": 0}, "lmc_dm needs models of one shape: hidden_size"),
        (_post_norm_pair, {"learn": ["residual"], "steps": 5}, "admits none"),
        (_other_vocabulary, {"steps": 0, "seq_len": 16}, "vocabular"),
    ],
    ids=["shape", "nothing_to_learn", "tokenizers"],
)
def test_a_recipe_that_will_be_refused_is_refused_before_any_matching(
    pair, tmp_path, no_heavy_work, inputs, alignment, needle
):
    a, b = inputs(tmp_path, *pair)
    recipe = recipe_for(a, b, "lmc_dm")
    recipe["alignment"] = alignment
    refused(run(recipe, tmp_path), tmp_path, needle)
