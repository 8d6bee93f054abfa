"""subclone_compensate: a model turned into a smaller one of its family.

Exactness: a donor whose heads, key/value groups, rotary pairs, head dims, MLP units and layers
beyond the target's are dead (zero weights) must convert, with compensation and rescaling off,
into a smaller checkpoint that ``transformers`` loads and that computes the donor's logits.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from tiny_models import VARIANTS, VOCAB, build_model, logits, probe_ids, stored_tensors
from tokenizer_helpers import model_with_tokenizer
from transformers import AutoModelForCausalLM

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.adapters.base import rotary_factor
from lmc_mergekit.models.adapters.gpt_neox import GPTNeoXAdapter
from lmc_mergekit.models.adapters.llama import LlamaAdapter
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.checkpoint import model_dir
from lmc_mergekit.models.view import ModelSpec, materialize
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.subclone.compensation import (
    RIDGE_GRID,
    SELECTION,
    RidgeFit,
    RidgeSolution,
    held_out_ridge,
)
from lmc_mergekit.subclone.convert import ConversionConfig, convert_model
from lmc_mergekit.subclone.heal import choose_teacher
from lmc_mergekit.subclone.target import kept_layers, plan_rotary, resolve_target

EXACT = ConversionConfig(compensate=False, rescale="none")
CPU = torch.device("cpu")


def run_yaml(recipe: dict, tmp_path: Path, out: Path):
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


def recipe_for(*donors, weights=None, **subclone) -> dict:
    weights = weights or [1.0] * len(donors)
    return {
        "merge_method": "subclone_compensate",
        "models": [
            {"model": str(d), "parameters": {"weight": w}}
            for d, w in zip(donors, weights, strict=True)
        ],
        "dtype": "float32",
        "subclone": {"seq_len": 64, "eval_sequences": 32, "calibration_sequences": 64, **subclone},
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_block_runner_reproduces_transformers(model_dirs, variant):
    folder = model_dirs[variant]
    view = open_model(folder)
    runner = BlockRunner(folder, view.adapter, view.spec, CPU)
    ids = probe_ids()
    assert torch.allclose(runner.logits(view, ids), logits(folder, ids), atol=1e-5, rtol=0)


# ---- exactness on donors with dead structure ---------------------------------------------


def plant_dead_structure(folder: Path, out: Path, target, plan) -> Path:
    """Save ``folder``'s model with everything the target drops set to zero: the first key/value
    groups and query heads beyond the target's counts, rotary pairs off the plan, the first
    non-rotary and value dims beyond the target's head size, the first MLP units beyond its
    width (so what is kept does not sit at the same index), and the layers the target skips
    (their blocks then add nothing to the residual stream)."""
    view = materialize(open_model(folder))
    donor = view.spec
    dh, half = donor.head_dim, donor.rotary_dims // 2
    group, kv_kept = donor.group_size, target.num_kv_heads
    kept_pairs = set(plan.pairs)
    dead_qk = [j for j in range(half) if j not in kept_pairs]
    dead_qk += [j + half for j in dead_qk]
    free = dh - donor.rotary_dims - (target.head_dim - target.rotary_dims)
    dead_qk += list(range(donor.rotary_dims, donor.rotary_dims + free))
    dead_vo = list(range(dh - target.head_dim))
    live_layers = set(kept_layers(donor.num_layers, target.num_layers))

    def zero_rows(t, rows):
        if t is not None and rows:
            t[rows] = 0

    for index, block in enumerate(view.blocks):
        a, m = block.attn, block.mlp
        if index not in live_layers:
            for t in (a.o, a.o_bias, m.down, m.down_bias):
                if t is not None:
                    t.zero_()
            continue
        dead_heads = []
        for g in range(donor.num_kv_heads):
            heads = list(range(g * group, (g + 1) * group))
            if g < donor.num_kv_heads - kv_kept:
                dead_heads += heads
                zero_rows(a.k, [g * dh + t for t in range(dh)])
                zero_rows(a.k_bias, [g * dh + t for t in range(dh)])
                zero_rows(a.v, [g * dh + t for t in range(dh)])
                zero_rows(a.v_bias, [g * dh + t for t in range(dh)])
            else:
                dead_heads += heads[: group - target.group_size]
                zero_rows(a.k, [g * dh + t for t in dead_qk])
                zero_rows(a.k_bias, [g * dh + t for t in dead_qk])
                zero_rows(a.v, [g * dh + t for t in dead_vo])
                zero_rows(a.v_bias, [g * dh + t for t in dead_vo])
        for h in range(donor.num_heads):
            dims = range(dh) if h in dead_heads else dead_qk
            zero_rows(a.q, [h * dh + t for t in dims])
            zero_rows(a.q_bias, [h * dh + t for t in dims])
            cols = range(dh) if h in dead_heads else dead_vo
            a.o[:, [h * dh + t for t in cols]] = 0
        units = list(range(donor.intermediate_size - target.intermediate_size))
        zero_rows(m.up, units)
        zero_rows(m.gate, units)
        zero_rows(m.up_bias, units)
        zero_rows(m.gate_bias, units)
        m.down[:, units] = 0
    view_ = open_model(folder)
    view_.adapter.save(view, out, folder, progress=False)
    return out


def convert_exactly(donor: Path, target, plan, out: Path):
    """Convert ``donor`` without compensation or rescaling (random calibration ids) and save."""
    view = open_model(donor)
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(1))
    conversion = convert_model(view, target, plan, ids, EXACT, CPU, progress=False)
    view.adapter.save(conversion.view, out, donor, progress=False)
    return conversion, out


EXACT_CASES = {
    # variant: (sizes, donor overrides)
    "llama": ({"num_attention_heads": 2, "head_dim": 6, "intermediate_size": 40}, {}),
    "llama_gqa_tied": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "intermediate_size": 40,
        },
        {"head_dim": 8},
    ),
    "mistral_gqa": ({"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 6}, {}),
    "qwen2_gqa_bias_tied": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 6,
            "intermediate_size": 48,
        },
        {},
    ),
    "gpt_neox_partial_rotary_parallel": ({"intermediate_size": 48}, {}),
    "gpt_neox_sequential_full_rotary": ({"intermediate_size": 40}, {}),
    "gpt2_tied": ({"intermediate_size": 100}, {}),
    # QK-norm (the factor on the queries moves into its gain), every other rotary pair kept.
    "qwen3_qk_norm_gqa": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 40,
        },
        {},
    ),
    "gemma": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 40,
        },
        {},
    ),
    # A fixed query_pre_attn_scalar, soft-caps, sandwich norms and alternating windows.
    "gemma2_softcap_windows": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 40,
        },
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
    # Per-layer-type rotary bases (local layers 1e4; global 1e6, linearly scaled as Gemma 3
    # 4B and up): every other pair keeps every base at once.
    "gemma3_text": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 40,
        },
        {
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
    "phi3_partial_rotary": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "intermediate_size": 40,
        },
        {},
    ),
    # Scaled rotary embeddings act per frequency: every other pair keeps its scaled frequency.
    "llama:llama3": (
        {"num_attention_heads": 2, "head_dim": 6, "intermediate_size": 40},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama:yarn": (
        {"num_attention_heads": 2, "head_dim": 6, "intermediate_size": 40},
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    # QK-norm over the whole projection (which then averages over fewer entries: exact up to
    # its eps, made negligible here), post-norms only.
    "olmo2": (
        {
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "intermediate_size": 40,
        },
        {"rms_norm_eps": 1e-12},
    ),
}


@pytest.mark.parametrize("variant", list(EXACT_CASES))
def test_dropping_dead_structure_keeps_the_function(tmp_path, variant):
    sizes, overrides = EXACT_CASES[variant]
    layers_key = "n_layer" if variant.startswith("gpt2") else "num_hidden_layers"
    family = variant.split(":")[0]
    donor_dir = build_model(family, tmp_path / "raw", **{layers_key: 3, **overrides})
    view = open_model(donor_dir)
    target, plan = resolve_target(
        view.spec, view.adapter, {**sizes, "num_hidden_layers": 2}, folder=donor_dir
    )
    dead = plant_dead_structure(donor_dir, tmp_path / "donor", target, plan)
    conversion, out = convert_exactly(dead, target, plan, tmp_path / "small")
    if view.spec.tied_embeddings:  # one vocabulary matrix held for both, not two copies
        assert conversion.view.head().weight is conversion.view.embeddings().tokens
    small = AutoModelForCausalLM.from_pretrained(out)
    assert small.num_parameters() < AutoModelForCausalLM.from_pretrained(dead).num_parameters()
    assert conversion.record["kept_layers"] == [0, 2]
    probe = probe_ids()
    expected = logits(dead, probe)
    error = (logits(out, probe) - expected).abs().max() / expected.abs().max()
    assert error < 1e-5, f"{variant}: relative logits error {error:.2e}"


@pytest.mark.parametrize("variant", ["llama", "llama_gqa_tied", "gemma", "qwen3_qk_norm_gqa"])
def test_dropping_dead_residual_channels_is_exact_with_rescaling_everywhere(tmp_path, variant):
    # With the other channels dead, RMSNorm over the d' live ones of d gives
    # x/rms_S = (x/rms_d)·sqrt(d'/d): `rescale: all` undoes that factor on every reader
    # (exactly up to the norm's eps, made negligible here). Gemma multiplies its embeddings by
    # sqrt(d) inside the model (the stored ones take sqrt(d/d')) and ties its head.
    donor_dir = build_model(variant, tmp_path / "raw", rms_norm_eps=1e-12)
    view = materialize(open_model(donor_dir))
    dead = list(range(0, 48, 2))  # every other channel
    view.embeddings_.tokens[:, dead] = 0
    for block in view.blocks:
        block.attn.o[dead] = 0
        block.mlp.down[dead] = 0
    open_model(donor_dir).adapter.save(view, tmp_path / "donor", donor_dir, progress=False)
    donor = open_model(tmp_path / "donor")
    target, plan = resolve_target(
        donor.spec, donor.adapter, {"hidden_size": 24, "head_dim": donor.spec.head_dim}
    )
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(1))
    config = replace(EXACT, rescale="all")
    conversion = convert_model(donor, target, plan, ids, config, CPU, progress=False)
    assert conversion.record["residual_channels"] == list(range(1, 48, 2))
    out = tmp_path / "small"
    written = donor.adapter.save(conversion.view, out, donor.folder, progress=False)
    assert written.tied_embeddings == donor.spec.tied_embeddings  # the tie survives rescaling
    probe = probe_ids()
    expected = logits(donor.folder, probe)
    error = (logits(out, probe) - expected).abs().max() / expected.abs().max()
    assert error < 1e-5, f"relative logits error {error:.2e}"


def test_rescaling_multiplies_the_projections_by_the_shrink_of_their_input(model_dirs):
    view = open_model(model_dirs["llama"])  # 4 heads of 12 dims, MLP 80
    sizes = {"num_attention_heads": 2, "head_dim": 12, "intermediate_size": 20}
    target, plan = resolve_target(view.spec, view.adapter, sizes)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    plain, scaled = (
        convert_model(view, target, plan, ids, replace(EXACT, rescale=mode), CPU, False).view
        for mode in ("none", "o_down")
    )
    for a, b in zip(plain.blocks, scaled.blocks, strict=True):
        assert torch.allclose(b.attn.o, a.attn.o * math.sqrt(2))
        assert torch.allclose(b.mlp.down, a.mlp.down * 2)
        assert torch.equal(b.attn.q, a.attn.q) and torch.equal(b.mlp.up, a.mlp.up)


@pytest.mark.parametrize(
    "variant", ["llama", "qwen2_gqa_bias_tied", "gpt2_tied", "gemma2_softcap_windows", "olmo2"]
)
def test_compensation_follows_the_donor_in_sequential_blocks(model_dirs, variant):
    view = open_model(model_dirs[variant])
    target, plan = resolve_target(view.spec, view.adapter, {"intermediate_size": 24})
    ids = torch.randint(0, VOCAB, (16, 16), generator=torch.Generator().manual_seed(1))
    plain = convert_model(view, target, plan, ids, EXACT, CPU, progress=False).record
    config = replace(EXACT, compensate=True)
    compensated = convert_model(view, target, plan, ids, config, CPU, progress=False).record
    assert compensated["residual_error_before_rescale"] < plain["residual_error_before_rescale"]
    # Only MLP units were dropped: the first attention lost nothing and its refit stays exact.
    first = compensated["layers"][0]["fits"]["attn_out"]
    assert first["relative_error_selected"] < 1e-9 and first["relative_error_refit"] < 1e-9
    for layer in compensated["layers"]:
        for fit in layer["fits"].values():
            assert fit["relative_error_refit"] <= fit["relative_error_selected"] + 1e-9, fit
        down = layer["fits"]["mlp_down"]
        assert down["relative_error_refit"] < down["relative_error_selected"], down


def test_a_rotary_base_change_is_made_and_exact_when_the_pairs_need_it(tmp_path):
    # 6 rotary pairs kept as 4: no whole stride reproduces base 10000, so pairs 0-3 are kept
    # and the base becomes 10000^(8/12).
    donor_dir = build_model("llama", tmp_path / "raw")
    view = open_model(donor_dir)
    target, plan = resolve_target(view.spec, view.adapter, {"head_dim": 8})
    assert plan.pairs == (0, 1, 2, 3) and plan.adjusted
    assert math.isclose(target.rope_theta, 10000 ** (8 / 12))
    dead = plant_dead_structure(donor_dir, tmp_path / "donor", target, plan)
    _, out = convert_exactly(dead, target, plan, tmp_path / "small")
    config = json.loads((out / "config.json").read_text())
    assert math.isclose(config["rope_parameters"]["rope_theta"], 10000 ** (8 / 12))
    probe = probe_ids()
    assert torch.allclose(logits(out, probe), logits(dead, probe), atol=1e-5, rtol=0)


def test_rotary_plans():
    donor = ModelSpec(
        "llama", 512, 2, 8, 8, 64, 64, 128, 100, "rmsnorm", 1e-6, False, True, "silu", False
    )
    assert plan_rotary(donor, 32, None).pairs == tuple(range(0, 32, 2))
    assert not plan_rotary(donor, 32, None).adjusted
    assert plan_rotary(donor, 32, 10000.0).pairs == tuple(range(0, 32, 2))
    assert plan_rotary(donor, 32, 100.0).pairs == tuple(range(16))
    with pytest.raises(LmcError, match="a target base of 100, 10000"):
        plan_rotary(donor, 32, 500.0)


def test_kept_layers_are_evenly_spaced_with_first_and_last():
    assert kept_layers(4, 2) == [0, 3]
    assert kept_layers(3, 2) == [0, 2]
    assert kept_layers(4, 4) == [0, 1, 2, 3]
    assert kept_layers(24, 12) == [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]


def test_ridge_fit_recovers_a_linear_map_with_bias():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(3, 5, generator=generator), torch.randn(3, generator=generator)
    fit = RidgeFit(5, 3, bias=True, device=CPU)
    for _ in range(4):
        x = torch.randn(100, 5, generator=generator)
        fit.add(x, x @ weight.T + bias)
    solution = fit.solve(1e-10, torch.zeros(3, 5))
    assert torch.allclose(solution.weight.float(), weight, atol=1e-5)
    assert torch.allclose(solution.bias.float(), bias, atol=1e-5)
    # Exact up to the float32 products of each batch (summed in float64).
    assert solution.error_after < 1e-6 < solution.error_before
    # A strong ridge keeps the given weights; the (unshrunk) bias takes the mean residual.
    start = torch.randn(3, 5, generator=generator).double()
    held = fit.solve(1e8, start)
    assert torch.allclose(held.weight, start, atol=1e-5)
    mean_x = fit.gram[-1, :5] / fit.rows  # the bias column's row of XᵀX: sums of the features
    mean_y = fit.cross[-1] / fit.rows
    assert torch.allclose(held.bias, mean_y - start @ mean_x, atol=1e-5)


def test_a_held_out_ridge_generalizes_where_the_plain_fit_overfits():
    # 40 features fitted from 60 noisy rows: the nearly unregularised refit fits the noise.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 40, generator=generator)

    def sample(rows: int) -> RidgeFit:
        fit = RidgeFit(40, 3, bias=False, device=CPU)
        x = torch.randn(rows, 40, generator=generator)
        fit.add(x, x @ weight.T + 4 * torch.randn(rows, 3, generator=generator))
        return fit

    fit, held, fresh = sample(60), sample(60), sample(2000)
    start = torch.zeros(3, 40, dtype=torch.float64)
    strength, errors = held_out_ridge(fit, held, start)
    assert errors[SELECTION] == pytest.approx(held.error(RidgeSolution(start, None, 0, 0)), 1e-6)
    assert errors[f"{strength:g}"] == min(errors.values()) < errors[f"{RIDGE_GRID[0]:g}"]
    assert strength > RIDGE_GRID[0]
    # On rows neither saw, the chosen strength beats the plain fit.
    assert fresh.error(fit.solve(strength, start)) < fresh.error(fit.solve(RIDGE_GRID[0], start))


def test_the_recipe_chooses_each_ridge_on_held_out_calibration(shallower):
    fit = shallower[True]["conversion"]["layers"][0]["fits"]["joint"]
    errors = fit["held_out_error"]
    chosen = fit["ridge"] if fit["ridge"] == SELECTION else f"{fit['ridge']:g}"
    assert errors[chosen] == min(errors.values()) <= errors[f"{RIDGE_GRID[0]:g}"]
    assert fit["tokens"] == 64 * 64  # held-out batches are fitted too, once the ridge is chosen


def test_residual_channels_follow_activation_variance(tmp_path):
    donor_dir = build_model("llama", tmp_path / "raw")
    view = materialize(open_model(donor_dir))
    view.embeddings_.tokens[:, 7] *= 50  # one loud channel all the way down the stream
    folder = tmp_path / "loud"
    open_model(donor_dir).adapter.save(view, folder, donor_dir, progress=False)
    loud = open_model(folder)
    target, plan = resolve_target(loud.spec, loud.adapter, {"hidden_size": 24, "head_dim": 12})
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    record = convert_model(loud, target, plan, ids, EXACT, CPU, progress=False).record
    assert 7 in record["residual_channels"] and len(record["residual_channels"]) == 24
    shuffled = convert_model(
        loud, target, plan, ids, replace(EXACT, selection="random"), CPU, progress=False
    ).record
    assert shuffled["residual_channels"] != record["residual_channels"]


# ---- the recipe on a trained model ---------------------------------------------------------


def test_the_recipe_writes_a_narrower_model_that_loads_and_generates(trained_pair, tmp_path):
    # d=32 with one head of 32 dims (8 rotary) to d=16: one head of 16 dims (4 rotary).
    out = tmp_path / "out"
    result = run_yaml(
        recipe_for(trained_pair[0], hidden_size=16, intermediate_size=64), tmp_path, out
    )
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"]) == (16, 1)
    assert config["intermediate_size"] == 64
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    model = AutoModelForCausalLM.from_pretrained(out)
    generated = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 8)
    report = json.loads((out / "subclone_report.json").read_text())
    donor = report["donors"][0]
    check = donor["self_check"]
    assert check["error"] <= check["tolerance"] <= 1e-2 and check["noise"] > 0
    assert report["calibration"]["sequences"] == 64
    assert len(donor["conversion"]["residual_channels"]) == 16
    assert donor["conversion"]["rotary"]["kept_pairs"] == [0, 2]
    assert math.isclose(
        report["merged"]["test_loss"], donor["test_loss"]["converted"], rel_tol=1e-4
    )
    card = (out / "README.md").read_text()
    assert "Size conversion" in card and "not a copy of its donor's function" in card
    # Healing finds the donor the report names: the converted model's teacher by default.
    assert choose_teacher(out, None).folder == model_dir(trained_pair[0])


@pytest.fixture(scope="module")
def shallower(trained_pair, tmp_path_factory):
    """Reports of the trained d=32 GPT-NeoX converted to one layer and a quarter of its MLP,
    with and without compensation."""
    tmp = tmp_path_factory.mktemp("subclone")
    reports = {}
    for compensate in (True, False):
        out = tmp / f"out-{compensate}"
        recipe = recipe_for(
            trained_pair[0],
            num_hidden_layers=1,
            intermediate_size=32,
            compensate=compensate,
            rescale="none",
        )
        result = run_yaml(recipe, tmp, out)
        assert result.exit_code == 0, result.output
        reports[compensate] = json.loads((out / "subclone_report.json").read_text())["donors"][0]
    return reports


def test_compensation_beats_plain_selection(shallower):
    compensated, plain = shallower[True], shallower[False]
    assert compensated["test_loss"]["converted"] < plain["test_loss"]["converted"]
    assert (
        compensated["conversion"]["residual_error_before_rescale"]
        < plain["conversion"]["residual_error_before_rescale"]
    )
    (layer,) = compensated["conversion"]["layers"]
    assert layer["donor_layer"] == 0 and layer["stands_in_for"] == [1]
    fit = layer["fits"]["joint"]  # GPT-NeoX: parallel residual, one joint fit
    assert fit["relative_error_refit"] < fit["relative_error_selected"]
    assert plain["conversion"]["layers"][0]["fits"] == {}


def test_several_donors_are_converted_then_averaged(trained_pair, tmp_path):
    out = tmp_path / "out"
    recipe = recipe_for(*trained_pair, weights=[0.75, 0.25], num_hidden_layers=1, evaluate=False)
    result = run_yaml(recipe, tmp_path, out)
    assert result.exit_code == 0, result.output
    cache = Path(tmp_path / "lmc-cache" / "subclone_compensate")
    (entry,) = [p.parent for p in cache.glob("*/preparation.json")]
    a, b = (stored_tensors(entry / f"model-{i}") for i in (0, 1))
    merged = stored_tensors(out)
    assert merged.keys() == a.keys()
    for name, tensor in merged.items():
        assert torch.allclose(tensor, 0.75 * a[name] + 0.25 * b[name], atol=1e-6), name
    assert not torch.equal(
        a["gpt_neox.layers.0.mlp.dense_4h_to_h.weight"],
        b["gpt_neox.layers.0.mlp.dense_4h_to_h.weight"],
    )


# ---- bad input --------------------------------------------------------------------------------


def _llama_with_tokenizer(tmp_path):
    return model_with_tokenizer(tmp_path / "llama", "llama_gqa_tied")


def _config_file(tmp_path, donor: Path, **changes) -> str:
    config = json.loads((donor / "config.json").read_text())
    config.update(changes)
    path = tmp_path / "target.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_target_config_gives_the_shape(tmp_path):
    donor = _llama_with_tokenizer(tmp_path)  # 6 query heads in 2 groups of 8 dims, MLP 80
    target = _config_file(
        tmp_path, donor, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40
    )
    out = tmp_path / "out"
    result = run_yaml(recipe_for(donor, target_config=target, evaluate=False), tmp_path, out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (3, 1)
    assert (config["intermediate_size"], config["head_dim"], config["hidden_size"]) == (40, 8, 48)
    report = json.loads((out / "subclone_report.json").read_text())
    (layer, _) = report["donors"][0]["conversion"]["layers"]
    assert len(layer["kv_heads"]) == 1 and len(layer["heads"]) == 3
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 1


@pytest.mark.parametrize(
    ("subclone", "needle"),
    [
        ({"hidden_size": 96}, "is larger than the donor's"),
        ({"hidden_size": 28}, "is not num_attention_heads 6 × a whole head size"),
        ({"num_key_value_heads": 1}, "key/value heads cannot be merged"),
        (
            {
                "target_config": lambda tmp, donor: _config_file(
                    tmp,
                    donor,
                    head_dim=4,
                    rope_parameters={"rope_theta": 500.0, "rope_type": "default"},
                )
            },
            "no selection of the donor's rotary pairs",
        ),
        (
            {"hidden_size": 24, "head_dim": 4, "calibration_sequences": 1},
            "give at least 81 tokens, better 6 sequences of 64",
        ),
        ({"hidden_size": 24, "target_config": "x.json"}, "not both"),
    ],
)
def test_bad_targets_fail_in_one_line_and_leave_nothing(tmp_path, subclone, needle):
    donor = _llama_with_tokenizer(tmp_path)
    settings = {k: v(tmp_path, donor) if callable(v) else v for k, v in subclone.items()}
    out = tmp_path / "out"
    result = run_yaml(recipe_for(donor, **settings), tmp_path, out)
    assert result.exit_code == 1, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    cache = tmp_path / "lmc-cache" / "subclone_compensate"
    assert not cache.exists() or not [p for p in cache.iterdir() if not p.name.startswith(".")]


def test_an_unsupported_donor_fails_in_one_line(tmp_path):
    donor = tmp_path / "bert"
    donor.mkdir()
    (donor / "config.json").write_text(json.dumps({"model_type": "bert"}))
    out = tmp_path / "out"
    result = run_yaml(recipe_for(donor, hidden_size=16), tmp_path, out)
    assert result.exit_code == 1
    assert "unsupported architecture 'bert'" in result.output, result.output
    assert not out.exists()


def test_legacy_rotary_keys_are_rewritten_only_when_the_rotary_settings_change():
    from transformers import AutoConfig

    adapter = GPTNeoXAdapter()
    raw = {
        "model_type": "gpt_neox",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "vocab_size": VOCAB,
    }
    spec = adapter.spec_from_config(AutoConfig.for_model(**raw))
    assert (spec.rotary_dims, spec.rope_theta) == (4, 10000.0)
    narrower = replace(spec, hidden_size=32, num_heads=2, intermediate_size=128)
    same = adapter.updated_config(raw, narrower)
    assert same["rotary_pct"] == 0.25 and "rope_parameters" not in same
    assert same["hidden_size"] == 32 and same["num_attention_heads"] == 2

    rebased = adapter.updated_config(raw, replace(narrower, rope_theta=100.0, rotary_dims=8))
    assert "rotary_pct" not in rebased and "rotary_emb_base" not in rebased
    loaded = AutoConfig.for_model(**rebased)
    assert loaded.rope_parameters["rope_theta"] == 100.0
    assert loaded.rope_parameters["partial_rotary_factor"] == 0.5

    # transformers reads a legacy rope_scaling before rope_parameters: it must not survive.
    llama = LlamaAdapter()
    raw = {
        "model_type": "llama",
        "hidden_size": 48,
        "num_attention_heads": 4,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "default"},
    }
    spec = llama.spec_from_config(AutoConfig.for_model(**copy.deepcopy(raw)))
    rebased = llama.updated_config(raw, replace(spec, rope_theta=100.0))
    assert raw["rope_scaling"] == {"rope_type": "default"}  # the input is left alone
    assert AutoConfig.for_model(**rebased).rope_parameters["rope_theta"] == 100.0
    # 30 rotary dims of 44: the plain ratio would make transformers compute 29.
    assert int(44 * rotary_factor(30, 44)) == 30


def test_unconvertible_layouts_are_refused(tmp_path):
    gpt2 = build_model("gpt2_tied", tmp_path / "gpt2", scale_attn_by_inverse_layer_idx=True)
    view = open_model(gpt2)
    with pytest.raises(LmcError, match="scales attention by its layer index"):
        BlockRunner(gpt2, view.adapter, view.spec, CPU)

    donor = ModelSpec(
        "llama", 5120, 40, 32, 8, 128, 128, 14336, 100, "rmsnorm", 1e-5, False, True, "silu", False
    )
    target, _ = resolve_target(donor, LlamaAdapter(), {"num_hidden_layers": 20})
    assert target.head_dim == 128  # a head size not tied to the width is kept
    with pytest.raises(LmcError, match="use num_key_value_heads >= 2, a divisor"):
        resolve_target(donor, LlamaAdapter(), {"num_attention_heads": 6, "num_key_value_heads": 1})


def test_per_layer_type_rotary_bases_change_head_size_by_whole_strides_only(model_dirs):
    view = open_model(model_dirs["gemma3_text"])  # local and global layers: rotary bases each
    half = view.spec.head_dim // 2
    target, plan = resolve_target(view.spec, view.adapter, {"head_dim": half}, folder=view.folder)
    assert (target.head_dim, plan.adjusted) == (half, False)
    assert plan.pairs == tuple(range(0, view.spec.rotary_dims // 2, 2))
    with pytest.raises(LmcError, match="a new base cannot serve every attention type"):
        resolve_target(view.spec, view.adapter, {"head_dim": half + 2}, folder=view.folder)


def test_only_a_parallel_residual_with_post_norms_refuses_compensation(model_dirs):
    from lmc_mergekit.subclone.convert import check_convertible

    for variant in ("gemma2_softcap_windows", "gemma3_text", "olmo2", "qwen3_qk_norm_gqa"):
        spec = open_model(model_dirs[variant]).spec
        check_convertible(spec, ConversionConfig(compensate=True))
        parallel = replace(spec, parallel_residual=True)
        if spec.post_norms:
            with pytest.raises(LmcError, match="post-norm of its own; set compensate: false"):
                check_convertible(parallel, ConversionConfig(compensate=True))
        check_convertible(parallel, ConversionConfig(compensate=False))


def test_a_write_through_a_post_norm_is_fitted_before_the_norm_and_stays_exact():
    from lmc_mergekit.models.view import Norm
    from lmc_mergekit.subclone.convert import _before_norm

    g = torch.Generator().manual_seed(0)
    weight, inputs = torch.randn(6, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    gain = torch.tensor([1.5, -0.7, 0.0, 2.0, 1.0, 0.3])  # a dead channel among them
    norm = Norm(gain, torch.randn(6, generator=g))
    written = inputs @ weight.T
    # What the donor's norm added, over more channels than are kept (its rms is not ours).
    update = gain * written / (2.0 * written.pow(2).mean(-1, keepdim=True).sqrt()) + norm.bias
    assert torch.allclose(_before_norm(update, inputs, weight, None, norm), written, atol=1e-5)
    # Another update: its direction, scaled to the selected write's size after the gain.
    other = torch.randn(3, 7, 6, generator=g)
    target = _before_norm(other, inputs, weight, None, norm)
    live = gain != 0
    ratio = (target[..., live] * gain[live]) / (other - norm.bias)[..., live]
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), atol=1e-5)
    assert torch.equal(target[..., 2], written[..., 2])
