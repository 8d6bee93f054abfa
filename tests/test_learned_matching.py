"""Learned matching: parametrised symmetries, the functional objective, the training loop, and
``lmc_dm`` with ``steps > 0`` end to end (resume, two processes, three models, combine)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import VARIANTS, build_model, logits, probe_ids

from lmc_mergekit.errors import LmcError
from lmc_mergekit.matching.interpolation import InterpolationObjective
from lmc_mergekit.matching.learned_matching import (
    CHECKPOINT_FILE,
    LearningConfig,
    learn_symmetries,
    mixing_weights,
    watched_mixes,
)
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_mixing import BlockMixer
from lmc_mergekit.models.view import iter_tensors, materialize
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.runtime.rollback import SETTLE_TOLERANCE
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.symmetry.parametrize import FAMILIES, PARAMETRIZATIONS, LearnedSymmetry
from lmc_mergekit.symmetry.projection import nearest_permutation
from lmc_mergekit.symmetry.rope import rope_commutation_error
from lmc_mergekit.symmetry.transform import is_signed_permutation, save_transform

ATOL = 5e-5
#: A rate far too high for the small trained model: unwatched, learning wrecks an exact
#: alignment.
LEARN_TOO_FAST = 0.1
EVAL = {"seq_len": 64, "eval_sequences": 64, "points": 5}
CPU = torch.device("cpu")


def randomized(spec, parametrization="polar", families=FAMILIES, seed=0) -> LearnedSymmetry:
    """A learned symmetry with every parameter moved away from the identity."""
    symmetry = LearnedSymmetry(spec, families, parametrization)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in symmetry.named_parameters():
            # Scores far enough from the identity's that the learned permutation moves.
            spread = 2.0 if name == "residual_scores" else 0.2
            param.copy_(spread * torch.randn(param.shape, generator=generator))
    return symmetry


@pytest.mark.parametrize(
    ("variant", "parametrization"),
    [(variant, "polar") for variant in sorted(VARIANTS)]
    + [
        (v, p)
        for v in ("gpt_neox_partial_rotary_parallel", "qwen2_gqa_bias_tied")
        for p in PARAMETRIZATIONS
        if p != "polar"
    ],
)
def test_learned_symmetries_keep_the_function(model_dirs, tmp_path, variant, parametrization):
    src = model_dirs[variant]
    view = open_model(src)
    transform = randomized(view.spec, parametrization).frozen_transform()
    transform.check_fits(view.spec)  # orthogonal, ones-fixing for LayerNorm, RoPE-commuting
    learnable = symmetry_group(view.spec).learnable
    assert transform.rotation is not None  # a rotation, or a learned (signed) permutation
    if "permutation" in learnable:
        eye = torch.eye(view.spec.hidden_size, dtype=transform.rotation.dtype)
        assert is_signed_permutation(transform.rotation) and not torch.equal(
            transform.rotation.abs(), eye
        )
    assert transform.scale != 1.0
    assert (transform.layers[0].qk is not None) == ("qk" in learnable)
    if view.spec.rotary_dims and "qk" in learnable:
        assert rope_commutation_error(transform.layers[0].qk, view.spec.rotary_dims) < 1e-12
    view.adapter.save(apply_transform(view, transform), tmp_path / "out", src, progress=False)
    ids = probe_ids()
    torch.testing.assert_close(logits(tmp_path / "out", ids), logits(src, ids), atol=ATOL, rtol=0)


def test_a_learned_permutation_is_exact_with_the_gradient_of_its_scores(model_dirs):
    """The straight-through estimator: the value is the exact signed permutation that best
    fits the scores (what gets written), the gradient reaches the scores unchanged."""
    spec = open_model(model_dirs["gemma2_softcap_windows"]).spec
    symmetry = randomized(spec, families=("permutation",), seed=5)
    rotation = symmetry.rotation()
    assert is_signed_permutation(rotation.detach().double())
    best = nearest_permutation(symmetry.residual_scores.detach() + torch.eye(spec.hidden_size))
    assert torch.equal(rotation.detach().double(), best)
    target = torch.randn(rotation.shape, generator=torch.Generator().manual_seed(0))
    (rotation * target).sum().backward()
    assert torch.equal(symmetry.residual_scores.grad, target)
    written = symmetry.frozen_transform().rotation
    assert torch.equal(written, best)  # exactly ±1 and 0, no straight-through residue


def test_zero_parameters_are_the_identity(model_dirs):
    spec = open_model(model_dirs["gpt_neox_partial_rotary_parallel"]).spec
    for parametrization in PARAMETRIZATIONS:
        transform = LearnedSymmetry(spec, parametrization=parametrization).frozen_transform()
        torch.testing.assert_close(transform.rotation, torch.eye(spec.hidden_size).double())
        eye = torch.eye(spec.head_dim).double().expand(spec.num_kv_heads, -1, -1)
        torch.testing.assert_close(transform.layers[1].qk, eye)
        torch.testing.assert_close(transform.layers[1].ov, eye)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_objective_is_the_loss_of_the_mixed_checkpoint(tmp_path, variant):
    """The objective's loss (each block's projections run per endpoint on their held weights,
    moved in activation space) equals transformers' on the saved mix of the moved models."""
    a = build_model(variant, tmp_path / "a", seed=1)
    b = build_model(variant, tmp_path / "b", seed=2)
    views = [open_model(a), open_model(b)]
    absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
    ends = [materialize(apply_transform(v, absorb)) for v in views]
    # As learn_symmetries: no scale for the first (its checkpoint's eps is the mix's).
    first = tuple(f for f in FAMILIES if f != "scale")
    symmetries = [
        randomized(ends[0].spec, families=first, seed=3),
        randomized(ends[0].spec, seed=4),
    ]
    model = BlockMixer(a, views[0].adapter, ends[0].spec, CPU)
    weights = torch.tensor([0.3, 0.7])
    ids = probe_ids(shape=(3, 16))
    with torch.no_grad():
        loss = InterpolationObjective(ends, symmetries, model)(weights, ids)
    # The same mix, written as checkpoints and averaged through transformers' own state dicts.
    from transformers import AutoModelForCausalLM

    folders = []
    for index, (view, symmetry) in enumerate(zip(views, symmetries, strict=True)):
        moved = apply_transform(view, symmetry.frozen_transform())
        view.adapter.save(moved, tmp_path / f"m{index}", view.folder, progress=False)
        folders.append(tmp_path / f"m{index}")
    models = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32) for f in folders]
    state = models[1].state_dict()
    mixed = {k: 0.3 * v + 0.7 * state[k] for k, v in models[0].state_dict().items()}
    models[0].load_state_dict(mixed)
    with torch.no_grad():
        expected = models[0].eval()(input_ids=ids, labels=ids).loss
    assert float(loss) == pytest.approx(float(expected), abs=1e-4)


def test_mixing_weights_samplers():
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([mixing_weights(3, "uniform", generator) for _ in range(2000)])
    assert torch.allclose(draws.sum(1), torch.ones(2000))
    assert (draws > 0).all() and abs(float(draws.mean()) - 1 / 3) < 0.02
    band = torch.stack([mixing_weights(2, "band", generator) for _ in range(500)])
    assert band.min() >= 0.4 - 1e-6 and band.max() <= 0.6 + 1e-6 and band.std() > 0.03
    assert torch.equal(mixing_weights(2, "half", generator), torch.tensor([0.5, 0.5]))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny GPT-NeoX endpoints (norms absorbed), their functional model and token data."""
    root = tmp_path_factory.mktemp("pair")
    a = build_model("gpt_neox_partial_rotary_parallel", root / "a", seed=1)
    b = build_model("gpt_neox_partial_rotary_parallel", root / "b", seed=2)
    views = [open_model(a), open_model(b)]
    absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
    ends = [materialize(apply_transform(v, absorb)) for v in views]
    model = BlockMixer(a, views[0].adapter, ends[0].spec, CPU)
    data = probe_ids(shape=(32, 16))
    return ends, model, data


ABLATIONS = [
    {"dual": False},
    *({"parametrization": p} for p in PARAMETRIZATIONS),
    *({"families": tuple(f for f in FAMILIES if f != off)} for off in FAMILIES),
    {"sampler": "band"},
    {"sampler": "half"},
]


@pytest.mark.parametrize("change", ABLATIONS, ids=lambda c: "-".join(map(str, c.values())))
def test_every_ablation_setting_learns_what_it_says(tiny_pair, change):
    ends, model, data = tiny_pair
    # Random tokens: nothing held out (the watch is tested on text, below).
    config = replace(LearningConfig(steps=4, lr=0.05, batch_size=4, heldout_sequences=0), **change)
    result = learn_symmetries(ends, model, data, config, progress=False)
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    first, second = result.transforms
    spec = ends[0].spec
    for transform in result.transforms:
        transform.check_fits(spec)
    families = config.families
    assert (second.rotation is not None) == ("residual" in families)
    assert (second.scale != 1.0) == ("scale" in families)
    assert (second.layers[0].qk is not None) == ("qk" in families)
    assert (second.layers[0].ov is not None) == ("ov" in families)
    if "residual" in families:
        assert not torch.allclose(second.rotation, torch.eye(spec.hidden_size).double())
    # One-sided: the first endpoint stays where it is; dual: it moves too (never its scale).
    assert (first.rotation is None) == (not config.dual or "residual" not in families)
    assert first.scale == 1.0


def test_a_diverging_run_rolls_back_with_a_lower_rate_and_recovers(tiny_pair, tmp_path):
    ends, model, data = tiny_pair
    # Far too high a rate: every try diverges until rollbacks have halved it enough (nothing
    # held out: the data are random tokens, on which no state beats the start held out).
    config = LearningConfig(
        steps=12,
        lr=1e4,
        batch_size=4,
        warmup=0.0,
        checkpoint_every=2,
        max_rollbacks=30,
        heldout_sequences=0,
    )
    result = learn_symmetries(ends, model, data, config, state_dir=tmp_path, progress=False)
    assert len(result.losses) == 12 and all(map(math.isfinite, result.losses))
    assert len(result.rollbacks) >= 5
    assert all(r["back_to"] <= r["step"] and not r["loss"] < 2 for r in result.rollbacks)
    saved = torch.load(tmp_path / CHECKPOINT_FILE, weights_only=False)
    assert saved["step"] == 12 and saved["lr_scale"] <= 0.5 ** len(result.rollbacks)


def test_a_run_that_keeps_diverging_without_a_floor_stops_with_a_clear_error(tiny_pair):
    ends, model, data = tiny_pair
    config = LearningConfig(steps=12, lr=1e4, batch_size=4, warmup=0.0, heldout_sequences=0)
    with pytest.raises(LmcError, match=r"diverged 4 times .* set a smaller alignment lr"):
        learn_symmetries(ends, model, data, config, progress=False)


def test_a_run_that_keeps_diverging_keeps_its_start(tiny_pair):
    """Watched on held-out sequences, a run whose rollbacks run out stops at its best state:
    here the start, so the transforms are the identity and the mixes are what matching gave."""
    ends, model, data = tiny_pair
    config = LearningConfig(steps=12, lr=1e4, batch_size=4, warmup=0.0)
    result = learn_symmetries(ends, model, data, config, progress=False)
    watch = result.held_out
    assert watch["stopped_early"] and watch["kept_step"] == 0 and watch["best"] == watch["start"]
    assert len(result.rollbacks) == config.max_rollbacks + 1
    identity = Transform(ends[0].spec.num_layers, absorb_norms=True)
    ids = probe_ids(seed=2, shape=(2, 16))
    for end, transform in zip(ends, result.transforms, strict=True):
        moved = materialize(apply_transform(end, transform))
        still = materialize(apply_transform(end, identity))
        torch.testing.assert_close(model.logits(moved, ids), model.logits(still, ids))
    assert "did not improve on matching" in result.outcome()


@pytest.fixture(scope="module")
def exact_pair(trained_pair, tmp_path_factory):
    """A model trained on text and its scrambled copy, moved back exactly by weight matching,
    with calibration text."""
    from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
    from lmc_mergekit.matching.align import AlignConfig, align
    from lmc_mergekit.symmetry import random_transform
    from lmc_mergekit.transform_checkpoint import transform_checkpoint

    source = trained_pair[0]
    copy = tmp_path_factory.mktemp("exact") / "copy"
    transform = random_transform(open_model(source).spec, seed=9)
    transform_checkpoint(source, copy, transform, progress=False)
    views = [open_model(source), open_model(copy)]
    matched = align(views, AlignConfig("weights"), progress=False).matched
    ends = [materialize(apply_transform(v, t)) for v, t in zip(views, matched, strict=True)]
    runner = BlockMixer(source, views[0].adapter, ends[0].spec, CPU)
    text = load_split(DataConfig(seq_len=32), load_tokenizer([source]), "train", 64)
    return ends, runner, text


@pytest.mark.slow  # its fixture trains a pair (40 s)
@pytest.mark.parametrize("watched", [True, False], ids=["watched", "unwatched"])
def test_learning_from_an_exact_alignment_ends_no_worse_than_it_started(exact_pair, watched):
    """Unwatched, a rate too high for the model takes the mixes away from the exact alignment
    (the old behaviour, kept as the control); watched, the run ends at its best state."""
    ends, runner, data = exact_pair
    held = 16 if watched else 0
    config = LearningConfig(
        steps=8, lr=LEARN_TOO_FAST, batch_size=8, checkpoint_every=2, heldout_sequences=held
    )
    result = learn_symmetries(ends, runner, data, config, progress=False)
    pairs = zip(ends, result.transforms, strict=True)
    moved = [materialize(apply_transform(e, t)) for e, t in pairs]

    def score(models) -> float:  # the watch's: the worst of the mixes at λ = ¼, ½, ¾
        objective = InterpolationObjective(models, [None, None], runner)
        with torch.no_grad():
            return max(float(objective(w, data[-16:])) for w in watched_mixes(2))

    before, after = score(ends), score(moved)
    if not watched:
        assert after > before + 0.01
        return
    watch = result.held_out
    assert watch["best"] <= watch["start"]
    assert all(score >= watch["best"] for _, score in watch["scores"])
    # What is written is the state kept: within the settling tolerance of the best.
    assert after == pytest.approx(watch["kept_score"], abs=1e-4)
    assert after <= before * (1 + SETTLE_TOLERANCE) + 1e-4


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_learning_lowers_the_interpolated_loss(tiny_pair, tmp_path, precision):
    """In float32 and under bf16 autocast (the GPU's path, run here on the CPU: one code path
    whatever the device) the midpoint's loss falls, and the transforms written are exact
    symmetries in float64: the moved float32 models compute what their sources compute."""
    ends, model, data = tiny_pair
    # The tokens are random: nothing learned on some of them carries over to others, so none
    # is held out (the watch is tested on text of a pattern, below).
    config = LearningConfig(
        steps=40, lr=0.03, batch_size=8, sampler="half", precision=precision, heldout_sequences=0
    )
    result = learn_symmetries(ends, model, data, config, progress=False)
    moved = [
        materialize(apply_transform(e, t)) for e, t in zip(ends, result.transforms, strict=True)
    ]
    half = torch.tensor([0.5, 0.5])
    with torch.no_grad():  # both measured in float32, without autocast
        before = InterpolationObjective(ends, [None, None], model)(half, data)
        after = InterpolationObjective(moved, [None, None], model)(half, data)
    assert float(after) < float(before) - 0.05, (float(before), float(after))
    ids = probe_ids(seed=2, shape=(2, 16))
    for source, target, transform in zip(ends, moved, result.transforms, strict=True):
        transform.check_fits(source.spec)  # orthogonal: no bf16 rounding in the rotation
        assert {t.dtype for _, t in iter_tensors(target.block(0))} == {torch.float32}
        expected = model.logits(source, ids)
        # float32 rounding through the learned (invertible, not orthogonal) head maps: ~5e-5.
        torch.testing.assert_close(
            model.logits(target, ids), expected, atol=1e-4 * float(expected.abs().max()), rtol=0
        )
        save_transform(transform, tmp_path / "t.safetensors")
        assert {t.dtype for t in load_file(tmp_path / "t.safetensors").values()} == {torch.float64}


# ---- lmc_dm with learned matching, end to end on trained models -----------------------------


def recipe_for(models: list[Path], **alignment) -> dict:
    return {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in models],
        "dtype": "float32",
        "alignment": {"batch_size": 8, "checkpoint_every": 10, **EVAL, **alignment},
    }


def write_recipe(tmp_path: Path, models: list[Path], **alignment) -> Path:
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe_for(models, **alignment)))
    return path


LEARNED = {"steps": 80, "lr": 0.02}


def run_yaml(recipe: Path, out: Path, cache: Path):
    return CliRunner().invoke(
        mergekit_yaml_main, [str(recipe), str(out), "--quiet", "--lmc-cache", str(cache)]
    )


@pytest.fixture(scope="module")
def learned(trained_pair, tmp_path_factory):
    """An lmc_dm recipe with learned matching on the trained pair, run once for the module."""
    tmp = tmp_path_factory.mktemp("learned")
    recipe = write_recipe(tmp, list(trained_pair), **LEARNED)
    result = run_yaml(recipe, tmp / "merged", tmp / "cache")
    assert result.exit_code == 0, result.output
    return tmp


@pytest.mark.slow
def test_learned_matching_lowers_the_barrier_below_weight_matching(learned):
    report = json.loads((learned / "merged" / "lmc_report.json").read_text())
    pair = report["pairs"][0]
    raw, matched, after = (pair[k]["barrier"] for k in ("raw", "matched", "learned"))
    assert after < matched < raw, (raw, matched, after)
    # Every stage keeps each endpoint's function.
    for kind in ("matched", "learned"):
        assert pair[kind]["endpoint_losses"] == pytest.approx(
            pair["raw"]["endpoint_losses"], abs=1e-4
        )
    assert report["learning"]["steps"] == 80 and not report["learning"]["rollbacks"]
    assert report["learning"]["last_loss"] < report["learning"]["first_loss"]
    card = (learned / "merged" / "README.md").read_text()
    assert "learned matching" in card and f"{after:.3f}" in card
    # The pass's resumable state is gone once the pass succeeded.
    assert not list((learned / "cache" / "lmc_dm").glob(".*.state"))


#: What learned matching logs (at -v) once a checkpoint is written.
CHECKPOINTED = re.compile(r"learned matching: step (\d+) checkpointed")


def lmc_command(recipe: Path, out: Path, cache: Path) -> list[str]:
    script = Path(sys.executable).parent / "lmc-mergekit-yaml"
    return [str(script), str(recipe), str(out), "--quiet", "--lmc-cache", str(cache)]


def quiet_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_a_killed_run_resumes_and_ends_where_an_uninterrupted_one_does(trained_pair, tmp_path):
    recipe = write_recipe(
        tmp_path, list(trained_pair), steps=60, checkpoint_every=20, evaluate=False
    )
    # Both runs in processes with the same thread count, so that their arithmetic is identical.
    whole = subprocess.run(
        lmc_command(recipe, tmp_path / "whole", tmp_path / "cache-whole"),
        env=quiet_env(),
        capture_output=True,
    )
    assert whole.returncode == 0, whole.stderr.decode()[-2000:]
    cache = tmp_path / "cache"
    # -v: the child logs each checkpoint it has written; it is killed on the first line at or
    # after step 30 (step 40), two thirds of the way.
    process = subprocess.Popen(
        [*lmc_command(recipe, tmp_path / "out", cache), "-v"],
        env=quiet_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(600, process.kill)  # a child that hangs silently fails the test
    watchdog.start()
    reported = None
    for line in process.stderr:  # ends when the child exits
        found = CHECKPOINTED.search(line)
        if found and int(found[1]) >= 30:
            reported = int(found[1])
            break
    watchdog.cancel()
    assert reported is not None, "the run ended without reporting the checkpoint of step 30"
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert not (tmp_path / "out").exists()
    resumed = subprocess.run(
        lmc_command(recipe, tmp_path / "out", cache), env=quiet_env(), capture_output=True
    )
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert report["learning"]["resumed_from_step"] >= reported
    assert [m.get("reused") for m in report["matching"]] != [None]  # matching was not redone
    merged, expected = (load_file(tmp_path / f / "model.safetensors") for f in ("out", "whole"))
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.slow
def test_two_sharded_processes_learn_what_one_process_learns(trained_pair, tmp_path):
    """Two gloo processes, each holding half of every endpoint (FSDP) and half of each batch,
    end with the symmetries one process learns."""
    recipe = write_recipe(tmp_path, list(trained_pair), steps=20, evaluate=False)
    single = run_yaml(recipe, tmp_path / "one", tmp_path / "cache-one")
    assert single.exit_code == 0, single.output
    torchrun = Path(sys.executable).with_name("torchrun")
    # --standalone: the rendezvous picks a free port.
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "--no-python"]
    command += lmc_command(recipe, tmp_path / "two", tmp_path / "cache-two")
    done = subprocess.run(command, env=quiet_env(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    for index in (0, 1):
        one, two = (
            load_file(next((tmp_path / c).glob(f"lmc_dm/*/model-{index}/model.safetensors")))
            for c in ("cache-one", "cache-two")
        )
        # Sums reduce in another order over two processes (halves of each batch, of the used
        # embedding rows, of the loss pieces); Adam's normalised steps carry that rounding
        # through 20 steps to a few 1e-5. A sharding bug moves weights by 1e-2 or more.
        for name, tensor in one.items():
            torch.testing.assert_close(two[name], tensor, atol=1e-4, rtol=1e-4)
    # Both ran the same 20 steps on the same global batches.
    losses = [
        json.loads((tmp_path / f / "lmc_report.json").read_text())["learning"]["losses"]
        for f in ("one", "two")
    ]
    assert len(losses[0]) == 20 and losses[1] == pytest.approx(losses[0], abs=1e-5)
    learning = [
        json.loads((tmp_path / f / "lmc_report.json").read_text())["learning"]
        for f in ("one", "two")
    ]
    assert [record["processes"] for record in learning] == [1, 2]
    held = [record["endpoint_mib_per_process"] for record in learning]
    assert held[1] == pytest.approx(held[0] / 2, rel=0.02)  # each process held half
    # One process holds every part whole; sharded, a part is gathered only while it runs.
    assert learning[0]["parts_held_whole"] == learning[0]["parts"]
    assert learning[1]["parts_held_whole"] == 1 < learning[1]["parts"]
    merged = [load_file(tmp_path / f / "model.safetensors") for f in ("one", "two")]
    for name, tensor in merged[0].items():
        torch.testing.assert_close(merged[1][name], tensor, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_combine_hands_the_aligned_models_to_another_mergekit_method(learned, trained_pair):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from lmc_mergekit.plugin.architecture_repairs import repaired_architectures

    a, b = trained_pair
    recipe = recipe_for([a, b], **LEARNED, combine="slerp")
    recipe.update(base_model=str(a), parameters={"t": 0.3})
    for entry in recipe["models"]:
        entry.pop("parameters")
    path = learned / "slerp.yml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_yaml(path, learned / "slerp", learned / "cache")
    assert result.exit_code == 0, result.output
    # combine does not change the pass: the aligned models come from the cache.
    prepared = sorted((learned / "cache" / "lmc_dm").glob("*/model-*"))
    assert len(prepared) == 2
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "slerp",
            "base_model": str(prepared[0]),
            "models": [{"model": str(p)} for p in prepared],
            "parameters": {"t": 0.3},
            "dtype": "float32",
        }
    )
    with repaired_architectures():  # mergekit's GPT-NeoX definition, as the plugin repairs it
        run_merge(config, str(learned / "expected"), MergeOptions(quiet=True))
    got, expected = (load_file(learned / f / "model.safetensors") for f in ("slerp", "expected"))
    average = load_file(learned / "merged" / "model.safetensors")
    assert any(not torch.equal(got[k], average[k]) for k in got)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0)


@pytest.mark.slow
def test_three_models_are_learned_into_one_basin(trained_pair, zoo_root, tmp_path):
    from conftest import SMALL_ZOO

    from lmc_mergekit.zoo import build_zoo

    third = build_zoo(zoo_root, seeds=(2,), progress=False, **SMALL_ZOO)[0]
    recipe = write_recipe(tmp_path, [*trained_pair, third], **LEARNED)
    result = run_yaml(recipe, tmp_path / "out", tmp_path / "cache")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert [pair["b"] for pair in report["pairs"]] == [str(trained_pair[1]), str(third)]
    matched = [pair["matched"]["barrier"] for pair in report["pairs"]]
    after = [pair["learned"]["barrier"] for pair in report["pairs"]]
    assert all(x < pair["raw"]["barrier"] for x, pair in zip(after, report["pairs"], strict=True))
    assert sum(after) < sum(matched), (matched, after)
    assert len(list((tmp_path / "cache" / "lmc_dm").glob("*/model-*"))) == 3


def test_a_block_weight_the_adapter_leaves_out_is_refused(tiny_pair, monkeypatch):
    ends, runner, _ = tiny_pair
    written = runner.adapter.block_tensors

    def without_first(block, spec, index):
        return dict(list(written(block, spec, index).items())[1:])

    monkeypatch.setattr(runner.adapter, "block_tensors", without_first)
    residual = torch.zeros(1, 4, ends[0].spec.hidden_size)
    with pytest.raises(LmcError, match="does not name the module's block weights"):
        runner.output(ends[0].block(0), residual)
