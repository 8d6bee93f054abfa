"""Statistics repair of a merged model: nothing to repair in a model merged with itself; after
repair, every unit's root mean square on the calibration text is the endpoints' interpolated
one, measured directly on the written checkpoint through transformers."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from tiny_models import VOCAB, build_model
from transformers import AutoConfig, AutoModelForCausalLM

from lmc_mergekit.evaluation.blockwise import MixedView
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.passes.lmc_dm.settings import REPAIRED_BY_DEFAULT
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.repair import RepairedView, repair_statistics

SEQUENCES = torch.randint(0, VOCAB, (6, 20), generator=torch.Generator().manual_seed(3))
# Gated and GQA; post-norms (sandwich norms, soft-caps); plain GELU with a parallel residual.
VARIANTS = ["llama_gqa_tied", "gemma2_softcap_windows", "olmo2", "gpt_neox_partial_rotary_parallel"]


def repaired(a, b, lam: float):
    views = [open_model(a), open_model(b)]
    merged = MixedView(views[0], views[1], lam)
    runner = BlockRunner(views[0].folder, views[0].adapter, merged.spec, torch.device("cpu"))
    return views, merged, repair_statistics(views, [1 - lam, lam], merged, runner, SEQUENCES)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_model_merged_with_itself_needs_no_repair(variant, tmp_path):
    folder = build_model(variant, tmp_path / "m", seed=0)
    _, _, repair = repaired(folder, folder, 0.5)
    for block in repair.blocks:
        for name, scales in block.tensors():
            assert torch.equal(scales, torch.ones_like(scales)), name


def unit_rms(folder, variant: str) -> dict[str, torch.Tensor]:
    """Per layer and kind, each unit's root mean square on SEQUENCES, from hooks on the
    transformers model: value dims (o_proj's input per key/value group), MLP units (the down
    projection's input) and post-norm outputs."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    head_dim = config.hidden_size // config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or head_dim
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name, value):
        seen.setdefault(name, []).append(value.detach().reshape(-1, value.shape[-1]))

    hooks = []
    for index, layer in enumerate(model.model.layers):

        def values(module, args, index=index):
            z = args[0].reshape(*args[0].shape[:-1], -1, group, head_dim).transpose(-3, -2)
            keep(f"{index}.values", z.reshape(-1, z.shape[-2] * head_dim))

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(values))
        hooks.append(
            layer.mlp.down_proj.register_forward_pre_hook(
                lambda m, args, index=index: keep(f"{index}.units", args[0])
            )
        )
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            norm = getattr(layer, name, None)
            post = variant.startswith(("gemma2", "olmo2")) and norm is not None
            if post:
                kind = "attn_post" if name.startswith("post_attention") else "mlp_post"
                hooks.append(
                    norm.register_forward_hook(
                        lambda m, a, out, key=f"{index}.{kind}": keep(key, out)
                    )
                )
    with torch.no_grad():
        model(SEQUENCES)
    for hook in hooks:
        hook.remove()
    return {k: torch.cat(v).double().pow(2).mean(0).sqrt() for k, v in seen.items()}


@pytest.mark.parametrize("variant", VARIANTS[:3])
def test_repair_restores_each_units_statistics_to_the_interpolated_target(variant, tmp_path):
    a = build_model(variant, tmp_path / "a", seed=0)
    b = build_model(variant, tmp_path / "b", seed=1)
    lam = 0.3
    views, merged, repair = repaired(a, b, lam)
    out = tmp_path / "repaired"
    views[0].adapter.save(RepairedView(merged, repair), out, views[0].folder, 2**30, False)
    target = {
        key: (1 - lam) * rms_a + lam * rms_b
        for (key, rms_a), rms_b in zip(
            unit_rms(a, variant).items(), unit_rms(b, variant).values(), strict=True
        )
    }
    got = unit_rms(out, variant)
    assert set(got) == set(target)
    assert any(key.endswith("post") for key in got) == ("llama" not in variant)
    for key, rms in got.items():
        scales = getattr(repair.blocks[int(key.split(".")[0])], key.split(".")[1])
        inside = (scales < 16) & (scales > 1 / 16)
        assert torch.allclose(rms[inside], target[key][inside], rtol=2e-4), key
    # The unrepaired merge had collapsed somewhere: repair changed it.
    assert any((s - 1).abs().max() > 0.05 for block in repair.blocks for _, s in block.tensors())
    assert type(AutoConfig.from_pretrained(out)) is type(AutoConfig.from_pretrained(a))


def run_pair(trained_pair, tmp_path, **alignment) -> dict:
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 1.0}} for m in trained_pair],
        "dtype": "float32",
        "alignment": {"steps": 0, "seq_len": 64, "eval_sequences": 32, "points": 3, **alignment},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "merged"
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return json.loads((out / "lmc_report.json").read_text())


@pytest.mark.slow
def test_a_repaired_merge_is_the_repaired_paths_midpoint(trained_pair, tmp_path):
    report = run_pair(trained_pair, tmp_path, repair=True, repair_sequences=16)
    pair = report["pairs"][0]
    assert report["repair"]["scales"]["values"]["units"] > 0
    assert report["repair"]["data"]["sequences"] == 16
    # The written merge is the repaired mix at λ = ½: its loss is the repaired path's there.
    assert report["merged"]["test_loss"] == pytest.approx(pair["repaired"]["losses"][1], abs=1e-4)
    assert pair["repaired"]["endpoint_losses"] == pytest.approx(
        pair["matched"]["endpoint_losses"], abs=1e-6
    )
    assert pair["repaired"]["losses"][1] != pytest.approx(pair["matched"]["losses"][1], abs=1e-4)
    assert "statistics were repaired" in (tmp_path / "merged" / "README.md").read_text()


@pytest.mark.slow
def test_a_recipe_without_repair_follows_the_familys_default(trained_pair, tmp_path):
    report = run_pair(trained_pair, tmp_path)
    repaired = open_model(trained_pair[0]).spec.architecture in REPAIRED_BY_DEFAULT
    assert ("repair" in report) == repaired
    assert ("repaired" in report["pairs"][0]) == repaired


def test_repair_needs_one_weight_per_model(trained_pair, tmp_path):
    recipe = {
        "merge_method": "lmc_dm",
        "models": [
            {
                "model": str(m),
                "parameters": {"weight": [{"filter": "mlp", "value": 0.3}, {"value": 0.5}]},
            }
            for m in trained_pair
        ],
        "alignment": {"repair": True},
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(tmp_path / "out")])
    assert result.exit_code != 0 and "one number as its weight" in result.output
    assert not (tmp_path / "out").exists()
