"""lmc_dm with weight matching, end to end on a pair of models trained from different seeds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import probe_ids
from transformers import AutoModelForCausalLM

from lmc_mergekit.cli import main
from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.barrier import interpolation_losses
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.passes.lmc_dm.records import LINKED
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.runtime.provenance import PROVENANCE_FILE

EVAL = {"seq_len": 64, "eval_sequences": 64, "points": 5}


def run_recipe(recipe: dict, tmp_path, out):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


def pair_recipe(a, b, **alignment) -> dict:
    return {
        "merge_method": "lmc_dm",
        "models": [
            {"model": str(a), "parameters": {"weight": 1.0}},
            {"model": str(b), "parameters": {"weight": 1.0}},
        ],
        "dtype": "float32",
        "alignment": {"steps": 0, **EVAL, **alignment},
    }


@pytest.fixture(scope="module")
def weight_matched(trained_pair, tmp_path_factory):
    """The merged output folder of an ``lmc_dm`` recipe with ``steps: 0`` on the trained pair."""
    tmp = tmp_path_factory.mktemp("lmc_dm")
    out = tmp / "merged"
    result = run_recipe(pair_recipe(*trained_pair), tmp, out)
    assert result.exit_code == 0, result.output
    return out


def test_weight_matching_lowers_the_barrier(weight_matched):
    report = json.loads((weight_matched / "lmc_report.json").read_text())
    pair = report["pairs"][0]
    raw, aligned = pair["raw"]["barrier"], pair["matched"]["barrier"]
    assert raw > 0.2, "the trained pair should show a barrier to begin with"
    assert aligned < 0.5 * raw
    # Independently trained: matching moves most units (they sit in different basins).
    assert report["matching"][0]["units_moved"] > 100 and not report["one_basin"]
    # Alignment moves no endpoint: both still compute their source's function.
    assert pair["matched"]["endpoint_losses"] == pytest.approx(
        pair["raw"]["endpoint_losses"], abs=1e-4
    )
    assert (
        report["matching"][0]["relative_distance"]["after"]
        < report["matching"][0]["relative_distance"]["before"]
    )
    assert (weight_matched / "lmc_barrier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (weight_matched / "README.md").read_text()
    assert f"{raw:.3f}" in card and f"{aligned:.3f}" in card


def test_the_report_equals_a_full_evaluation_of_every_path(trained_pair, tmp_path):
    """Each function is evaluated once (the moved endpoints are the raw path's, the merged
    model is the matched path's midpoint), and every figure equals what evaluating each path
    point on its own gives: the mixes of the prepared checkpoints and the merged model as
    transformers loads it."""
    recipe = pair_recipe(*trained_pair, points=3, eval_sequences=16)
    out = tmp_path / "merged"
    assert run_recipe(recipe, tmp_path, out).exit_code == 0
    report = json.loads((out / "lmc_report.json").read_text())
    assert len(report["reused"]) == 2 and "merged model's own loss" in report["reused"][1]
    sequences = load_split(
        DataConfig(seq_len=EVAL["seq_len"]), load_tokenizer(list(trained_pair)), "test", 16
    )
    prepared = sorted((tmp_path / "lmc-cache" / "lmc_dm").glob("*/model-*"))
    pair = report["pairs"][0]
    for kind, (a, b) in (("raw", trained_pair), ("matched", prepared)):
        full = interpolation_losses(a, b, sequences, points=3)
        assert pair[kind]["losses"] == pytest.approx(list(full.losses), abs=1e-4), kind
    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    loss = mean_token_loss(model, sequences).loss
    assert report["merged"]["test_loss"] == pytest.approx(loss, abs=1e-5)
    assert pair["matched"]["losses"][1] == report["merged"]["test_loss"]


def test_unaligned_baseline_reports_the_raw_path_only(trained_pair, tmp_path):
    result = run_recipe(pair_recipe(*trained_pair, matching="none"), tmp_path, tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert "matched" not in report["pairs"][0] and report["matching"] == []
    midpoint = report["pairs"][0]["raw"]["losses"][2]
    assert report["merged"]["test_loss"] == pytest.approx(midpoint, abs=1e-4)


def test_barrier_command_matches_the_report(weight_matched, trained_pair, tmp_path):
    a, b = trained_pair
    args = ["barrier", str(a), str(b), "--seq-len", "64", "--max-sequences", "64", "--points", "5"]
    args += ["--json", str(tmp_path / "path.json"), "--plot", str(tmp_path / "path.png")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "path.json").read_text())["curves"]["test loss"]
    report = json.loads((weight_matched / "lmc_report.json").read_text())
    assert written["losses"] == pytest.approx(report["pairs"][0]["raw"]["losses"], abs=1e-6)
    assert f"barrier {written['barrier']:.4f}" in result.output
    assert (tmp_path / "path.png").stat().st_size > 1000


def test_barrier_reads_the_split_it_is_given(trained_pair, tmp_path):
    a, b = trained_pair
    common = ["--seq-len", "64", "--max-sequences", "16", "--split", "validation"]
    args = ["barrier", str(a), str(b), *common, "--points", "3", "--json", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    curve = json.loads((tmp_path / "p.json").read_text())["curves"]["validation loss"]
    for model, loss in ((a, curve["losses"][0]), (b, curve["losses"][-1])):
        args = ["eval", str(model), *common, "--json", str(tmp_path / "e.json")]
        assert CliRunner().invoke(main, args).exit_code == 0
        measured = json.loads((tmp_path / "e.json").read_text())["loss"]
        assert measured == pytest.approx(loss, abs=1e-5)


def test_barrier_refuses_models_of_different_shapes(trained_pair, model_dirs):
    result = CliRunner().invoke(main, ["barrier", str(trained_pair[0]), str(model_dirs["llama"])])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.slow
def test_three_models_are_all_aligned_to_the_first(trained_pair, tmp_path):
    a, b = trained_pair
    scrambled = tmp_path / "scrambled"
    assert CliRunner().invoke(main, ["scramble", str(a), str(scrambled)]).exit_code == 0
    recipe = pair_recipe(a, b)
    recipe["models"].append({"model": str(scrambled), "parameters": {"weight": 1.0}})
    result = run_recipe(recipe, tmp_path, tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert [pair["b"] for pair in report["pairs"]] == [str(b), str(scrambled)]
    assert len(report["matching"]) == 2
    # The scrambled copy of the first model is matched back onto it exactly.
    assert abs(report["pairs"][1]["matched"]["barrier"]) < 1e-4
    assert report["pairs"][0]["matched"]["barrier"] < report["pairs"][0]["raw"]["barrier"]
    # transformers finds every weight it needs in the merged output (none left at random
    # initialisation) and nothing it does not know.
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.isfinite(merged(probe_ids()).logits).all()


@pytest.fixture(scope="module")
def base_and_finetune(trained_pair, tmp_path_factory):
    """A model trained on the bundled corpus and a fine-tune of it on the King James Bible."""
    from lmc_mergekit.data import bundled_text_files
    from lmc_mergekit.zoo.finetune import finetune

    base = trained_pair[0]
    bible = next(f for f in bundled_text_files() if "kjv" in f.name)
    data = DataConfig(source=str(bible), seq_len=64)
    tuned = finetune(
        base, tmp_path_factory.mktemp("finetune") / "kjv", data, steps=20, lr=1e-3, progress=False
    )
    return base, tuned


@pytest.mark.parametrize("matching", ["weights", "activations"])
@pytest.mark.slow
def test_a_base_and_its_finetune_are_merged_as_mergekit_linear_merges_them(
    base_and_finetune, tmp_path, matching
):
    """Matching permutes no unit of a fine-tune of the first model: the pair sits in one
    basin, so it is merged as it is (nothing learned, even with steps), tensor for tensor what
    mergekit's linear merge writes, and the report and the card say so."""
    base, tuned = base_and_finetune
    recipe = pair_recipe(base, tuned, matching=matching, steps=5, batch_size=4)
    out = tmp_path / "dm"
    result = run_recipe(recipe, tmp_path, out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "lmc_report.json").read_text())
    assert report["one_basin"] and report["learning"] is None
    assert report["matching"][0]["units_moved"] == 0
    assert [p for p in report["pairs"][0] if p in ("matched", "learned")] == []
    assert "already sit in one basin" in (out / "README.md").read_text()
    linear = {**recipe, "merge_method": "linear"}
    del linear["alignment"]
    assert run_recipe(linear, tmp_path, tmp_path / "linear").exit_code == 0
    merged, plain = (load_file(tmp_path / n / "model.safetensors") for n in ("dm", "linear"))
    assert merged.keys() == plain.keys()
    assert all(torch.equal(merged[k], plain[k]) for k in merged)
    # Nothing was written for mergekit to read as the inputs are: each prepared input links
    # to its input's files, and the pass's marker stays in the prepared folder.
    cache = Path(os.environ["LMC_MERGEKIT_CACHE"]) / "lmc_dm"
    prepared = sorted(cache.glob("*/model-*"))
    assert len(prepared) == 2 and report["self_check"] == [LINKED, LINKED]
    for folder, source in zip(prepared, (base, tuned), strict=True):
        links = [p for p in folder.iterdir() if p.name != PROVENANCE_FILE]
        assert links and all(p.is_symlink() for p in links)
        assert {p.resolve().parent for p in links} == {source.resolve()}
        assert (folder / PROVENANCE_FILE).is_file() and not (source / PROVENANCE_FILE).exists()


@pytest.mark.slow
def test_repair_true_repairs_a_merge_of_one_basin(base_and_finetune, tmp_path):
    """An explicit ``repair: true`` repairs what a base and its fine-tune merge into (kept as
    they are): the report measures the repaired straight path next to the raw one."""
    recipe = pair_recipe(*base_and_finetune, repair=True, repair_sequences=8, points=3)
    result = run_recipe(recipe, tmp_path, tmp_path / "dm")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "dm" / "lmc_report.json").read_text())
    assert report["one_basin"] and report["repair"]["scales"]["units"]["units"] > 0
    pair = report["pairs"][0]
    assert pair["repaired"]["endpoint_losses"] == pytest.approx(pair["raw"]["endpoint_losses"])
    assert report["merged"]["test_loss"] == pytest.approx(pair["repaired"]["losses"][1], abs=1e-4)


def test_a_bf16_pair_is_written_on_the_way_of_its_last_round(trained_pair, tmp_path):
    """Stored in bf16, with one weight-matching round: the reference is written on the way of
    the round and the other model by the round that moved it (no block moved twice); the
    report says how many rounds ran and why they stopped, and the merge evaluates as the
    models it came from do."""
    from test_selfcheck import bf16_copy

    from lmc_mergekit.models.checkpoint import copy_tagalong_files

    pair = [bf16_copy(folder, tmp_path / f"bf16-{i}") for i, folder in enumerate(trained_pair)]
    for source, copy in zip(trained_pair, pair, strict=True):
        copy_tagalong_files(source, copy)  # the tokenizer the evaluation reads
    recipe = {
        **pair_recipe(*pair, max_iterations=1, one_basin_check=False, points=3),
        "dtype": "bfloat16",
    }
    out = tmp_path / "merged"
    result = run_recipe(recipe, tmp_path, out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "lmc_report.json").read_text())
    match = report["matching"][0]
    assert match["iterations"] == 1 and match["written_by_last_round"]
    assert match["stopped"] == "max_iterations (1) rounds ran"
    pair_paths = report["pairs"][0]
    assert pair_paths["matched"]["barrier"] < pair_paths["raw"]["barrier"]


def test_a_linked_input_keeps_its_own_marker_apart(tmp_path):
    """An input linked as it is stored: every entry but a provenance marker is a link, and the
    pass's marker written into the link folder leaves the input's own untouched."""
    from lmc_mergekit.models.checkpoint import link_checkpoint
    from lmc_mergekit.runtime.provenance import write_provenance

    source = tmp_path / "input"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    write_provenance(source, "subclone_compensate", {"source": "donor"})
    marker = (source / PROVENANCE_FILE).read_text()
    link_checkpoint(source, tmp_path / "linked")
    assert sorted(p.name for p in (tmp_path / "linked").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    write_provenance(tmp_path / "linked", "lmc_dm", {"source": str(source)})
    assert (source / PROVENANCE_FILE).read_text() == marker
    assert (tmp_path / "linked" / "model.safetensors").read_bytes() == b"weights"
