"""The self-check every written checkpoint passes: block by block, it computes what
``transformers`` computes; the exact transform must keep the source's logits to float32
precision, and every written tensor must be that exact transform rounded once to its dtype, so
that a real mistake fails in bf16 as in float32."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VARIANTS, logits, probe_ids
from transformers import AutoModelForCausalLM

from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.selfcheck import (
    check_transformed,
    checkpoint_logits,
    relative_logits_error,
    units_in_last_place,
)
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.symmetry import random_transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_blockwise_logits_are_the_transformers_logits(model_dirs, variant):
    folder = model_dirs[variant]
    ids = probe_ids()
    expected = logits(folder, ids)
    actual = checkpoint_logits(folder, ids)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=1e-5)


def _copy_with(source, target, change):
    shutil.copytree(source, target)
    (shard,) = target.glob("*.safetensors")
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return target


def _moved(source, tmp_path, seed=3):
    """``source`` moved by a random symmetry (self-checked), and that transform."""
    transform = random_transform(open_model(source).spec, seed)
    transform_checkpoint(source, tmp_path / "moved", transform, progress=False)
    return tmp_path / "moved", transform


def bf16_copy(source, target):
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.bfloat16)
    model.save_pretrained(target)
    return target


def test_a_changed_weight_is_refused(model_dirs, tmp_path):
    source = model_dirs["llama_gqa_tied"]
    moved, transform = _moved(source, tmp_path)
    assert check_transformed(open_model(source), transform, moved).error < 1e-5

    def perturb(tensors):
        name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
        tensors[name] = tensors[name] * 1.01

    candidate = _copy_with(moved, tmp_path / "changed", perturb)
    with pytest.raises(LmcError, match=r"stores block 0 mlp.down .* units in the last place"):
        check_transformed(open_model(source), transform, candidate)


@pytest.mark.parametrize(
    ("variant", "tensor", "where"),
    [
        ("llama_gqa_tied", "model.embed_tokens.weight", "embeddings tokens"),
        ("llama", "lm_head.weight", "head weight"),
    ],
)
def test_a_changed_vocabulary_row_is_refused_when_checked_a_slice_at_a_time(
    model_dirs, tmp_path, monkeypatch, variant, tensor, where
):
    from lmc_mergekit.evaluation import selfcheck

    monkeypatch.setattr(selfcheck, "CHECK_ROWS", 7)  # the vocabulary in slices of 7 rows
    source = model_dirs[variant]
    moved, transform = _moved(source, tmp_path)
    assert check_transformed(open_model(source), transform, moved).error < 1e-5

    def perturb(tensors):
        tensors[tensor][-1] = tensors[tensor][-1] * 1.01  # the last slice's last row

    candidate = _copy_with(moved, tmp_path / "changed", perturb)
    with pytest.raises(LmcError, match=rf"stores {where} .* units in the last place"):
        check_transformed(open_model(source), transform, candidate)


def test_a_small_bfloat16_mistake_that_rounding_would_hide_is_refused(model_dirs, tmp_path):
    """In bf16 a few units in the last place of one head's output projection move the logits
    less than the old tolerance (5e-2 of the largest logit) allowed: the check sees them."""
    source = bf16_copy(model_dirs["qwen2_gqa_bias_tied"], tmp_path / "bf16")
    moved, transform = _moved(source, tmp_path)
    error = check_transformed(open_model(source), transform, moved).error
    assert error < 1e-4  # float32 precision, although the weights are bf16

    def nudge(tensors):
        name = "model.layers.1.self_attn.o_proj.weight"
        weight = tensors[name].float()
        weight[:, :4] *= 1 + 4 * 2**-8  # four units in bf16's last place, one head's columns
        tensors[name] = weight.to(torch.bfloat16)

    candidate = _copy_with(moved, tmp_path / "nudged", nudge)
    ids = probe_ids()
    old_measure = relative_logits_error(logits(candidate, ids), logits(moved, ids))
    assert 0 < old_measure < 5e-2
    with pytest.raises(LmcError, match=r"o .* units in the last place \(torch.bfloat16\)"):
        check_transformed(open_model(source), transform, candidate)


def test_a_config_that_breaks_the_function_is_refused(model_dirs, tmp_path):
    """A written config.json that forgot the norms' eps·g² (with g far from 1): every tensor is
    right, the function is not."""
    source = model_dirs["llama"]
    moved, transform = _moved(source, tmp_path)
    assert abs(transform.scale - 1) > 0.2
    config = json.loads((moved / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # norms now see a different function of their input
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(LmcError, match="is not a symmetry of this model"):
        check_transformed(open_model(source), transform, moved)


def test_units_in_the_last_place():
    exact = torch.tensor([1.0, 1.0, -3.0, 1e-3], dtype=torch.float64)
    stored = exact.to(torch.bfloat16)
    assert units_in_last_place(stored, exact.float()) <= 0.5  # rounding: half a unit at most
    nudged = stored.clone()
    nudged[2] = torch.nextafter(torch.nextafter(nudged[2], nudged[2] * 2), nudged[2] * 2)
    assert units_in_last_place(nudged, exact.float()) == pytest.approx(2, abs=0.5)


def test_units_in_the_last_place_of_a_matrix_compared_a_slice_at_a_time(monkeypatch):
    from lmc_mergekit.evaluation import selfcheck

    exact = torch.randn(9, 4, generator=torch.Generator().manual_seed(0))
    stored = exact.to(torch.bfloat16)
    for _ in range(3):  # three units away from the rounded value, in the fourth slice
        stored[7, 2] = torch.nextafter(stored[7, 2], stored[7, 2] * 4)
    whole = units_in_last_place(stored, exact)
    monkeypatch.setattr(selfcheck, "COMPARE_ELEMENTS", 8)  # two rows at a time
    assert units_in_last_place(stored, exact) == whole and 2.5 <= whole <= 3.5


def test_a_layout_transformers_would_not_load_is_refused(model_dirs, tmp_path):
    """A tensor our reader never asks for still fails the check: transformers would refuse it."""
    source = model_dirs["qwen3_qk_norm_gqa"]
    moved, transform = _moved(source, tmp_path)

    def add(tensors):
        tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)

    candidate = _copy_with(moved, tmp_path / "extra", add)
    with pytest.raises(LmcError, match=r"unexpected keys in extra.*extra_proj"):
        check_transformed(open_model(source), transform, candidate)


def test_a_shard_that_reads_back_otherwise_is_refused(tmp_path):
    """Written tensors are read back and compared byte for byte: one byte changed on disk
    after writing (what a failing disk or a concurrent writer does) is caught."""
    from lmc_mergekit.models.checkpoint import ShardWriter

    generator = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(64, 32, generator=generator).bfloat16() for i in range(3)}
    writer = ShardWriter(tmp_path, 6000, verify=True)  # a shard per tensor
    writer.write(tensors)
    with writer.sink("streamed", (2, 3000), torch.bfloat16) as sink:  # straight into a shard
        sink.write(torch.ones(6000))
    writer.close()  # verified: every byte as written
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x01  # the lowest mantissa bit of its tensor's last value
    shard.write_bytes(bytes(data))
    with pytest.raises(LmcError, match=r"reads back from its shard other than it was written"):
        writer.verify()


def _ill_conditioned(spec, condition: float, seed: int = 3):
    """A random symmetry whose per-head QK and OV maps have singular values spread over
    ``condition``: exact, but its float32 computation is ``condition`` times noisier."""
    from dataclasses import replace

    from lmc_mergekit.symmetry.sampling import random_rope_maps, random_well_conditioned

    generator = torch.Generator().manual_seed(seed)
    heads, dh = spec.num_kv_heads, spec.head_dim
    layers = tuple(
        replace(
            layer,
            qk=random_rope_maps(heads, dh, spec.rotary_dims, generator, condition),
            ov=random_well_conditioned((heads,), dh, generator, condition),
        )
        for layer in random_transform(spec, seed).layers
    )
    return replace(random_transform(spec, seed), layers=layers)


def test_a_symmetry_at_the_noise_edge_is_kept(model_dirs, tmp_path):
    """Per-head maps of condition 1e4 make the moved model's float32 logits differ from the
    source's by more than the old fixed tolerance (1e-4) allowed; its own float32 noise sets
    the tolerance now, and the exact transform passes."""
    source = model_dirs["llama"]
    transform = _ill_conditioned(open_model(source).spec, 1e4)
    _, check = transform_checkpoint(source, tmp_path / "moved", transform, progress=False)
    ids = probe_ids()
    float32_gap = relative_logits_error(
        checkpoint_logits(tmp_path / "moved", ids), checkpoint_logits(source, ids)
    )
    assert float32_gap > 1e-4  # what the fixed tolerance refused
    assert check.error <= check.tolerance < 1e-2
    assert check.tolerance == pytest.approx(16 * check.noise)


@pytest.mark.parametrize("condition", [None, 1e4], ids=["bf16", "maps-of-condition-1e4"])
def test_a_writer_handed_a_part_that_is_not_the_symmetry_publishes_nothing(
    model_dirs, tmp_path, condition
):
    """The check of a checkpoint being written: one block moved by another transform than the
    rest is refused, and nothing appears at the output; also among per-head maps of condition
    1e4, whose float32 noise widens the tolerance."""
    from lmc_mergekit.symmetry import apply_transform
    from lmc_mergekit.transform_checkpoint import CheckedWriter

    if condition is None:
        source = open_model(bf16_copy(model_dirs["llama_gqa_tied"], tmp_path / "bf16"))
        right, wrong = (random_transform(source.spec, seed) for seed in (3, 4))
    else:
        source = open_model(model_dirs["llama"])
        right, wrong = (_ill_conditioned(source.spec, condition, seed) for seed in (3, 4))
    right, wrong = (apply_transform(source, t, torch.float32) for t in (right, wrong))
    with pytest.raises(LmcError, match="is not a symmetry of this model"):
        with CheckedWriter(source, right.spec, tmp_path / "out", progress=False) as writer:
            for chunk in right.row_chunks("embeddings", 16384):
                writer.embeddings(chunk)
            for index in range(source.spec.num_layers):
                writer.block(index, (wrong if index == 1 else right).block(index))
            for chunk in right.row_chunks("head", 16384):
                writer.head(chunk)
            writer.publish()
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_transform_too_noisy_to_check_is_refused(model_dirs, tmp_path):
    """Maps of condition 1e5 make float32 noise that could hide a mistake: refused, said so."""
    source = model_dirs["llama"]
    transform = _ill_conditioned(open_model(source).spec, 1e5)
    with pytest.raises(LmcError, match=r"self-check cannot tell: .* ill-conditioned"):
        transform_checkpoint(source, tmp_path / "moved", transform, progress=False)
    assert not (tmp_path / "moved").exists()
