"""What comes out is the model that went in: a base and its fine-tune merge as mergekit's
``linear`` writes them (tie and shape kept, from either matching start), models from different
seeds are never taken for one basin, and a tie is kept unless untying buys something."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import SMALL_ZOO
from safetensors.torch import load_file

from lmc_mergekit.data import DataConfig, bundled_text_files
from lmc_mergekit.matching.starts import (
    CLEAR_MARGIN,
    UNRELATED_EMBEDDINGS,
    clearly_lower,
    early_decision,
)
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.symmetry.group import untying_gains

EVAL = {"seq_len": 64, "eval_sequences": 16, "points": 3, "activation_sequences": 16}


def test_a_start_replaces_another_only_when_clearly_lower():
    """The rule: lower by more than the margin and by more than twice the standard error of
    the paired per-sequence differences."""
    gen = torch.Generator().manual_seed(0)
    current = 4 + torch.rand(16, generator=gen, dtype=torch.float64)
    noise = 0.001 * torch.randn(16, generator=gen, dtype=torch.float64)
    assert not clearly_lower(current, current - CLEAR_MARGIN / 2 + noise)[0]  # too small
    assert clearly_lower(current, current - 0.5 + noise)[0]
    spread = torch.tensor([1.0, -1.0] * 8, dtype=torch.float64)  # mean 0.1 lower, SE 0.26
    kept, figures = clearly_lower(current, current - 0.1 + spread)
    assert not kept and figures["threshold"] > 0.1 and figures["lower_by"] == pytest.approx(0.1)
    assert not clearly_lower(current, current + 0.5)[0]  # higher


def test_a_decision_is_taken_early_only_when_the_first_sequences_clear_it():
    noise = torch.tensor([0.01, -0.01, 0.02, -0.02], dtype=torch.float64)
    assert early_decision(1.0 + noise, CLEAR_MARGIN) is True  # a scramble's barrier
    assert early_decision(-0.2 + noise, CLEAR_MARGIN) is False  # a fine-tune's
    assert early_decision(CLEAR_MARGIN + 10 * noise, CLEAR_MARGIN) is None  # a close call


def test_clear_starts_are_scored_on_the_first_sequences_only(tmp_path):
    """A clear barrier check, and a comparison with a mix that is the raw one itself, are
    decided on the first sequences, as all sequences decide them; a close call reads all."""
    from tiny_models import build_model, probe_ids

    from lmc_mergekit.evaluation.blockwise import MixedView, sequence_losses
    from lmc_mergekit.matching.starts import FIRST_SEQUENCES, StartScorer
    from lmc_mergekit.models.adapters import open_model
    from lmc_mergekit.models.block_runner import BlockRunner
    from lmc_mergekit.symmetry import Transform, random_transform
    from lmc_mergekit.transform_checkpoint import transform_checkpoint

    source = build_model("llama", tmp_path / "m")
    spec = open_model(source).spec
    scrambled = tmp_path / "s"
    transform_checkpoint(source, scrambled, random_transform(spec, seed=1), progress=False)
    views = [open_model(source), open_model(scrambled)]
    runner = BlockRunner(source, views[0].adapter, spec, torch.device("cpu"))
    identity = Transform(spec.num_layers)
    sequences = probe_ids(seed=3, shape=(16, 24))
    scorer = StartScorer(*views, identity, runner, runner, sequences)
    scorer.score("kept", None)
    no_barrier = scorer.leaves_no_barrier("kept")
    mix = sequence_losses(MixedView(*views, 0.5), runner, sequences)
    ends = sum(sequence_losses(view, runner, sequences) for view in views) / 2
    assert no_barrier == (float((mix - ends).mean()) <= CLEAR_MARGIN)
    scorer.score("itself", identity)  # the scrambled copy as it is: the same mix
    better, figures = scorer.compare("kept", "itself")
    assert not better and figures["sequences"] == FIRST_SEQUENCES
    assert scorer.read == {"kept": 4, "endpoints": 4, "itself": 4}
    # Two mixes whose per-sequence differences straddle the margin: all sequences decide.
    scorer._losses["close"] = (
        scorer._losses["kept"]
        - CLEAR_MARGIN
        + torch.tensor([0.3, -0.3, 0.3, -0.3], dtype=torch.float64)
    )
    scorer._mixes["close"] = scorer._mixes["kept"]
    scorer.read["close"] = 4
    scorer.compare("kept", "close")
    assert scorer.read["kept"] == scorer.read["close"] == 16


def test_a_match_at_the_rounding_floor_is_kept_without_scoring(tmp_path):
    """A bf16 scramble matched to within its storage rounding is the reference itself: weight
    matching is kept without scoring its mix (no pass over text), and a later start (here
    activation matching) is not run; a match above the floor is scored as before."""
    from test_selfcheck import bf16_copy
    from tiny_models import build_model, probe_ids

    from lmc_mergekit.matching.align import AlignConfig, choose_start, match_pair
    from lmc_mergekit.matching.starts import StartScorer
    from lmc_mergekit.models.adapters import open_model
    from lmc_mergekit.models.block_runner import BlockRunner
    from lmc_mergekit.symmetry import Transform, random_transform
    from lmc_mergekit.transform_checkpoint import transform_checkpoint

    source = bf16_copy(build_model("llama", tmp_path / "m"), tmp_path / "m-bf16")
    spec = open_model(source).spec
    scrambled = tmp_path / "s"
    transform_checkpoint(source, scrambled, random_transform(spec, seed=1), progress=False)
    other = open_model(build_model("llama", tmp_path / "o", seed=1))
    reference = Transform(spec.num_layers, absorb_norms=True)
    runner = BlockRunner(source, open_model(source).adapter, spec, torch.device("cpu"))
    for view, floor in ((open_model(scrambled), True), (other, False)):
        ran = []

        def match(kind, view=view, ran=ran):
            ran.append(kind)
            config = AlignConfig(matching=kind)
            found = match_pair(
                kind, open_model(source), view, config, False, False, "cpu", None, None
            )
            return found[:2]

        sequences = probe_ids(seed=3, shape=(16, 24))
        scorer = StartScorer(open_model(source), view, reference, runner, runner, sequences)
        # Past the floor, activation matching would be next: it must not run.
        kinds = ("weights", "activations") if floor else ("weights",)
        _, record = choose_start(kinds, match, scorer, None)
        assert record["matching"] == "weights" and ran == ["weights"]
        assert ("weights" in scorer.scores) != floor
        assert ("kept without scoring" in record["decision"]) == floor


def run(models: list[Path], tmp_path: Path, name: str, method="lmc_dm", **alignment):
    recipe = {
        "merge_method": method,
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in models],
        "dtype": "float32",
    }
    if method == "lmc_dm":
        recipe["alignment"] = {"steps": 0, **EVAL, **alignment}
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / name
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for shard in folder.glob("*.safetensors"):
        found |= load_file(shard)
    return found


def config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def gemma3_and_finetune(zoo_root, tmp_path_factory):
    """A tied Gemma 3 zoo model (post-norms: its stream admits signed permutations only) and
    a short fine-tune of it on the King James Bible."""
    from lmc_mergekit.zoo import build_zoo_model
    from lmc_mergekit.zoo.finetune import finetune

    settings = {**SMALL_ZOO, "arch": "gemma3"}
    base = build_zoo_model(zoo_root, **settings, tied=True, progress=False)
    bible = next(f for f in bundled_text_files() if "kjv" in f.name)
    data = DataConfig(source=str(bible), seq_len=64)
    out = tmp_path_factory.mktemp("finetune") / "kjv"
    return base, finetune(base, out, data, steps=20, lr=1e-3, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("matching", ["weights", "activations", "auto"])
def test_a_tied_post_norm_base_and_its_finetune_merge_as_linear_writes_them(
    gemma3_and_finetune, tmp_path, matching
):
    pair = list(gemma3_and_finetune)
    assert config(pair[0])["tie_word_embeddings"] and config(pair[1])["tie_word_embeddings"]
    out, output = run(pair, tmp_path, "dm", matching=matching)
    linear, _ = run(pair, tmp_path, "linear", method="linear")
    merged, plain = tensors(out), tensors(linear)
    assert merged.keys() == plain.keys() and "lm_head.weight" not in merged
    assert all(torch.equal(merged[k], plain[k]) for k in merged)
    assert config(out)["tie_word_embeddings"]
    report = json.loads((out / "lmc_report.json").read_text())
    record = report["matching"][0]
    assert report["one_basin"] and record["matching"] == "kept" and record["units_moved"] == 0
    assert report["tied_embeddings"] == {"kept": True, "added_parameters": 0, "added_bytes": 0}
    assert "tied embeddings kept" in output and "already sit in one basin" in output
    # The raw mix at ½ scores no worse than the models: no matching is even run.
    assert record["scores"]["kept"] <= record["scores"]["endpoints"] + CLEAR_MARGIN
    assert "not run" in record["decision"] and record["tried"] == {}
    assert record["embeddings_apart"] < 0.1 * UNRELATED_EMBEDDINGS


@pytest.mark.slow
def test_an_untie_that_buys_nothing_is_ignored_and_said(gemma3_and_finetune, tmp_path):
    """Untying a post-norm family's head widens no symmetry: the tie is kept, with one line
    saying why (printed, in the report and on the card)."""
    from lmc_mergekit.models.adapters import open_model

    assert not untying_gains(open_model(gemma3_and_finetune[0]).spec)
    out, output = run(list(gemma3_and_finetune), tmp_path, "dm", tied_embeddings="untie")
    line = next(line for line in output.splitlines() if "untie ignored" in line)
    assert "signed permutations only" in line and "buy nothing" in line
    assert config(out)["tie_word_embeddings"] and "lm_head.weight" not in tensors(out)
    report = json.loads((out / "lmc_report.json").read_text())
    assert report["tied_embeddings"]["kept"] and report["tied_embeddings"]["untie_ignored"] == line
    assert "untie ignored" in (out / "README.md").read_text()


@pytest.fixture(scope="module")
def tied_llama_seeds(zoo_root) -> list[Path]:
    """Two tied Llama zoo models trained from different seeds."""
    from lmc_mergekit.zoo import build_zoo

    return build_zoo(
        zoo_root, seeds=(0, 1), progress=False, **{**SMALL_ZOO, "arch": "llama"}, tied=True
    )


@pytest.mark.slow
def test_tied_models_from_different_seeds_are_aligned_and_stay_tied(tied_llama_seeds, tmp_path):
    """Independently trained models are never one basin: their token embeddings lie as far
    apart as unrelated tables, so the models as they are are not scored (their barrier, which
    the evaluation measures, is far above the margin) and a matching is kept; a recipe without
    ``tied_embeddings`` keeps the tie and the inputs' size."""
    out, output = run(tied_llama_seeds, tmp_path, "dm")
    report = json.loads((out / "lmc_report.json").read_text())
    record = report["matching"][0]
    assert not report["one_basin"] and record["matching"] in ("weights", "activations")
    assert record["embeddings_apart"] >= UNRELATED_EMBEDDINGS and "kept" not in record["scores"]
    assert "models as they are not scored" in record["decision"]
    assert record["units_moved"] > 10
    pair = report["pairs"][0]
    assert pair["raw"]["barrier"] > 3 * CLEAR_MARGIN
    assert pair["matched"]["barrier"] < pair["raw"]["barrier"] - CLEAR_MARGIN
    assert config(out)["tie_word_embeddings"] and "lm_head.weight" not in tensors(out)
    sizes = {name: t.shape for name, t in tensors(out).items()}
    assert sizes == {name: t.shape for name, t in tensors(tied_llama_seeds[0]).items()}
    assert "tied embeddings kept" in output
