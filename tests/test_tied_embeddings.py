"""Tied embeddings through lmc_dm: ``keep`` (the default) keeps every prepared input and the
merge tied, with the function kept; ``tied_embeddings: untie`` writes a separate head and says
what it adds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from safetensors import safe_open
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.cli import main
from lmc_mergekit.plugin.cli import mergekit_yaml_main

EVAL = {"seq_len": 32, "eval_sequences": 8, "points": 3, "batch_size": 2}


@pytest.fixture(scope="module")
def tied_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tied")
    return tuple(model_with_tokenizer(root / f"m{s}", "llama_gqa_tied", seed=s) for s in (1, 2))


def run(pair, tmp_path: Path, output: list | None = None, **alignment) -> Path:
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in pair],
        "dtype": "float32",
        "alignment": {"steps": 3, **EVAL, **alignment},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "merged"
    quiet = [] if output is not None else ["--quiet"]
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), *quiet])
    assert result.exit_code == 0, result.output
    if output is not None:
        output.append(result.output)
    return out


def keys(folder: Path) -> set[str]:
    found = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fp:
            found |= set(fp.keys())
    return found


def tied(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text())["tie_word_embeddings"]


@pytest.mark.slow
def test_an_asked_untie_is_reported_with_the_head_it_adds(tied_pair, tmp_path):
    """Untying widens a pre-norm family's residual group (any rotation): done where asked,
    and the command, the report and the card give what it adds."""
    output = []
    out = run(tied_pair, tmp_path, output, tied_embeddings="untie", one_basin_check=False)
    report = json.loads((out / "lmc_report.json").read_text())
    record = report["tied_embeddings"]
    config = json.loads((tied_pair[0] / "config.json").read_text())
    assert record["kept"] is False
    assert record["added_parameters"] == config["vocab_size"] * config["hidden_size"]
    assert record["added_bytes"] == 4 * record["added_parameters"]
    assert not tied(out) and "lm_head.weight" in keys(out)
    assert "untied it (`tied_embeddings: untie`)" in (out / "README.md").read_text()
    assert f"LM head untied: the merge adds {record['added_parameters']:,} parameters" in output[0]


@pytest.mark.slow
def test_keep_writes_tied_inputs_and_a_tied_merge(tied_pair, tmp_path):
    """The default: tied inputs stay tied through every stage."""
    out = run(tied_pair, tmp_path, one_basin_check=False)
    report = json.loads((out / "lmc_report.json").read_text())
    assert report["tied_embeddings"] == {"kept": True, "added_parameters": 0, "added_bytes": 0}
    assert "residual" not in report["learning"]["families"]  # signed permutations are discrete
    assert tied(out) and "lm_head.weight" not in keys(out)
    for prepared in (tmp_path / "lmc-cache" / "lmc_dm").glob("*/model-*"):
        assert tied(prepared) and "lm_head.weight" not in keys(prepared)
    pair = report["pairs"][0]
    # Every stage keeps both endpoints' own function (and loss).
    for stage in ("matched", "learned"):
        assert pair[stage]["endpoint_losses"] == pytest.approx(
            pair["raw"]["endpoint_losses"], abs=1e-4
        )
    assert "keeps it tied" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def tied_and_untied(tied_pair, tmp_path_factory) -> tuple[Path, Path]:
    """A tied model and a scrambled copy of it saved untied: one function, two tie states
    (as a tied base and a fine-tune saved with its own head)."""
    copy = tmp_path_factory.mktemp("mixed") / "untied"
    args = ["scramble", str(tied_pair[0]), str(copy), "--seed", "4", "--untie"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert not tied(copy) and tied(tied_pair[0])
    return tied_pair[0], copy


@pytest.mark.parametrize("order", ["tied_first", "untied_first"])
@pytest.mark.parametrize("ties", ["untie", "keep"])
@pytest.mark.slow
def test_a_tied_model_and_an_untied_copy_are_aligned_measured_and_merged(
    tied_and_untied, tmp_path, order, ties
):
    pair = tied_and_untied if order == "tied_first" else tied_and_untied[::-1]
    # Random models: a mix of one and its scramble scores as well as either (one basin, by
    # the score); the alignment itself is what is tested here.
    out = run(pair, tmp_path, steps=0, tied_embeddings=ties, one_basin_check=False)
    report = json.loads((out / "lmc_report.json").read_text())
    paths = report["pairs"][0]
    # The raw path is measured although one end is tied and the other not: both ends compute
    # one function, so their losses agree, and matching undoes the scramble.
    ends = paths["raw"]["endpoint_losses"]
    assert ends[0] == pytest.approx(ends[1], abs=1e-4)
    assert abs(paths["raw"]["losses"][1] - ends[0]) > 0.05  # the raw mix is another model
    assert abs(paths["matched"]["barrier"]) < 1e-3
    assert report["merged"]["test_loss"] == pytest.approx(ends[0], abs=1e-3)
    # A tie cannot be kept with an untied input: the tied one is untied, and that is said.
    record = report["tied_embeddings"]
    assert record["kept"] is False and record["added_parameters"] > 0
    assert record["inputs_tied"] == ([True, False] if order == "tied_first" else [False, True])
    assert not tied(out) and "lm_head.weight" in keys(out)
    assert "the others store a head of their own" in (out / "README.md").read_text()


SECTIONS = {
    "subclone_compensate": (
        "subclone",
        {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 1, "seq_len": 32},
    ),
    "ls_merge": ("latent", {"steps": 30, "width": 32, "seq_len": 32, "noise_floor": False}),
}


@pytest.mark.parametrize("method", sorted(SECTIONS))
@pytest.mark.slow
def test_every_method_merges_a_tied_and_an_untied_input(tied_and_untied, tmp_path, method):
    """A tied model and an untied copy of it: converted or merged like any pair; the output
    keeps a head of its own (the untied input's head is not dropped), and is measured."""
    section, settings = SECTIONS[method]
    recipe = {
        "merge_method": method,
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in tied_and_untied],
        "dtype": "float32",
        section: {**settings, "eval_sequences": 8},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "merged"
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert not tied(out) and "lm_head.weight" in keys(out)
    report = json.loads(next(out.glob("*_report.json")).read_text())
    assert report["merged"]["test_loss"] > 0


@pytest.mark.parametrize("method", sorted(SECTIONS))
def test_every_method_writes_tied_inputs_tied(tied_pair, tmp_path, method):
    section, settings = SECTIONS[method]
    recipe = {
        "merge_method": method,
        "models": [{"model": str(p), "parameters": {"weight": 0.5}} for p in tied_pair],
        "dtype": "float32",
        section: {**settings, "evaluate": False},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "merged"
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert tied(out) and "lm_head.weight" not in keys(out)
