"""Every symmetry, alone and composed, on every architecture variant, must leave the function
unchanged: the transformed checkpoint, reloaded through transformers, reproduces the logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tiny_models import VARIANTS, build_model, logits, probe_ids

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.symmetry import LayerTransform, Transform, apply_transform, random_transform
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.symmetry.sampling import random_orthogonal, random_rope_maps


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


ATOL = 5e-5  # fp32: measured errors are ~5e-6 on logits of magnitude ~4

KINDS = ("absorb", "rotation", "scale", "head_perm", "ffn_perm", "qk", "ov", "all")


def only(kind: str, full: Transform) -> Transform:
    """The part of ``full`` of one kind (the rest identity)."""
    if kind == "all":
        return full
    base = Transform.identity(full.num_layers)
    if kind == "absorb":
        return replace(base, absorb_norms=True)
    if kind == "rotation":
        return Transform(full.num_layers, rotation=full.rotation)
    if kind == "scale":
        return replace(base, scale=full.scale)
    layers = tuple(LayerTransform(**{kind: getattr(layer, kind)}) for layer in full.layers)
    return replace(base, layers=layers)


def transformed_logits(src, out, transform, ids):
    view = open_model(src)
    spec = view.adapter.save(apply_transform(view, transform), out, src, progress=False)
    return logits(out, ids), spec


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("kind", KINDS)
def test_symmetry_preserves_logits(model_dirs, tmp_path, variant, kind):
    src = model_dirs[variant]
    spec = open_model(src).spec
    if kind == "qk" and not symmetry_group(spec).qk_maps:
        # QK-norm: a full RoPE-commuting map is refused, naming the feature; the diagonal maps
        # random_transform draws (signs and gains) are checked below.
        maps = random_rope_maps(spec.num_kv_heads, spec.head_dim, spec.rotary_dims, generator())
        layers = (LayerTransform(qk=maps),) * spec.num_layers
        with pytest.raises(LmcError, match="QK-norm"):
            apply_transform(open_model(src), Transform(spec.num_layers, layers=layers))
    transform = only(kind, random_transform(spec, seed=1))
    ids = probe_ids()
    moved, _ = transformed_logits(src, tmp_path / "out", transform, ids)
    torch.testing.assert_close(moved, logits(src, ids), atol=ATOL, rtol=0)
    # The weights really moved, so the comparison above is not between two copies.
    before, after = (
        load_file(src / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert any(k not in after or not torch.equal(v, after[k]) for k, v in before.items())


@pytest.mark.parametrize(
    ("variant", "residual"),
    [
        ("llama", "orthogonal"),
        ("qwen3_qk_norm_gqa", "orthogonal"),
        ("gemma", "orthogonal"),
        ("phi3_partial_rotary", "orthogonal"),
        ("gpt2_tied", "ones_fixing"),
        ("gemma2_softcap_windows", "signed_permutation"),
        ("gemma3_text", "signed_permutation"),
        ("olmo2", "signed_permutation"),
    ],
)
def test_the_residual_group_follows_the_norms(model_dirs, variant, residual):
    view = open_model(model_dirs[variant])
    group = symmetry_group(view.spec)
    assert group.residual == residual
    if residual == "orthogonal":
        return
    # A residual rotation outside the group is refused with the feature that forbids it.
    rotation = random_orthogonal(view.spec.hidden_size, generator())
    reason = "post-norms" if residual == "signed_permutation" else "all-ones"
    with pytest.raises(LmcError, match=reason):
        apply_transform(view, Transform(view.spec.num_layers, rotation=rotation))
    assert ("residual" in group.learnable) == (residual != "signed_permutation")


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "qwen2_gqa_bias_tied", "gpt2_tied"])
def test_tied_embeddings_are_untied_only_when_needed(model_dirs, tmp_path, variant):
    src = model_dirs[variant]
    spec = open_model(src).spec
    layers = random_transform(spec, seed=2).layers
    _, kept = transformed_logits(
        src, tmp_path / "perm", Transform(spec.num_layers, layers=layers), probe_ids()
    )
    assert kept.tied_embeddings
    _, untied = transformed_logits(
        src, tmp_path / "rot", random_transform(spec, seed=2), probe_ids()
    )
    assert not untied.tied_embeddings
    assert open_model(tmp_path / "rot").spec.tied_embeddings is False


TIED = ["llama_gqa_tied", "qwen2_gqa_bias_tied", "gpt2_tied", "gemma", "gemma3_text"]


@pytest.mark.parametrize("variant", TIED)
def test_a_kept_tie_stays_tied_and_keeps_the_function(model_dirs, tmp_path, variant):
    """``keep_tie``: a signed permutation (a permutation under LayerNorm), a global scale and
    every per-layer symmetry, with the final norm's gain kept: the written checkpoint is tied,
    stores no head, and computes the same logits."""
    src = model_dirs[variant]
    spec = open_model(src).spec
    transform = random_transform(spec, seed=4, keep_tie=True)
    assert abs(transform.scale - 1) > 0.05
    ids = probe_ids()
    moved, written = transformed_logits(src, tmp_path / "kept", transform, ids)
    torch.testing.assert_close(moved, logits(src, ids), atol=ATOL, rtol=0)
    assert written.tied_embeddings and open_model(tmp_path / "kept").spec.tied_embeddings
    stored = load_file(tmp_path / "kept" / "model.safetensors")
    assert not any(name.startswith("lm_head") for name in stored)
    group = symmetry_group(spec, keep_tie=True)
    assert group.residual == ("permutation" if spec.norm == "layernorm" else "signed_permutation")
    assert "residual" not in group.learnable
    # A rotation outside it is refused, naming the setting.
    rotation = random_orthogonal(spec.hidden_size, generator())
    with pytest.raises(LmcError, match="tied_embeddings: keep"):
        apply_transform(
            open_model(src), Transform(spec.num_layers, rotation=rotation, keep_tie=True)
        )


def test_keeping_a_tie_needs_a_tied_model(model_dirs):
    view = open_model(model_dirs["llama"])
    with pytest.raises(LmcError, match="are not tied"):
        apply_transform(view, Transform(view.spec.num_layers, keep_tie=True))


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(4, 4, 16), (4, 2, 16), (6, 3, 8), (8, 2, 8), (2, 1, 32)]),
    family=st.sampled_from(["llama_gqa_tied", "qwen2_gqa_bias_tied"]),
)
def test_random_shapes_and_seeds(tmp_path_factory, seed, shape, family):
    heads, kv_heads, head_dim = shape
    root = tmp_path_factory.mktemp("h")
    src = build_model(
        family,
        root / "src",
        seed=seed % 7,
        hidden_size=heads * head_dim // 2 * 2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=40,
    )
    transform = random_transform(open_model(src).spec, seed=seed)
    ids = probe_ids(seed)
    moved, _ = transformed_logits(src, root / "out", transform, ids)
    torch.testing.assert_close(moved, logits(src, ids), atol=ATOL, rtol=0)


@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**16), rotary_pct=st.sampled_from([0.25, 0.5, 1.0]), parallel=st.booleans()
)
def test_gpt_neox_rotary_fractions(tmp_path_factory, seed, rotary_pct, parallel):
    root = tmp_path_factory.mktemp("neox")
    src = build_model(
        "gpt_neox_partial_rotary_parallel",
        root / "src",
        seed=seed % 5,
        rotary_pct=rotary_pct,
        use_parallel_residual=parallel,
    )
    transform = random_transform(open_model(src).spec, seed=seed)
    ids = probe_ids(seed)
    moved, _ = transformed_logits(src, root / "out", transform, ids)
    torch.testing.assert_close(moved, logits(src, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["qwen3_qk_norm_gqa", "gemma3_text", "olmo2"])
def test_what_a_qk_norm_leaves_is_exact_and_nothing_more(model_dirs, tmp_path, variant):
    """Under a QK-norm, per-pair signs on the rows and scales traded between the q_norm and
    k_norm gains keep the logits; a scale that differs between heads sharing a gain, or one
    that differs within a rotary pair, is refused."""
    src = model_dirs[variant]
    view = open_model(src)
    spec, group = view.spec, symmetry_group(view.spec)
    half, hkv, dh = spec.rotary_dims // 2, spec.num_kv_heads, spec.head_dim
    values = torch.linspace(0.5, 2.0, dh - half, dtype=torch.float64)
    values = torch.where(torch.arange(dh - half) % 2 == 0, -values, values)  # signs too
    per_dim = torch.cat([values[:half], values[:half], values[half:]])
    maps = torch.diag_embed(per_dim.expand(hkv, dh).clone())
    transform = Transform(spec.num_layers, layers=(LayerTransform(qk=maps),) * spec.num_layers)
    ids = probe_ids()
    moved, _ = transformed_logits(src, tmp_path / "out", transform, ids)
    torch.testing.assert_close(moved, logits(src, ids), atol=ATOL, rtol=0)
    after = load_file(tmp_path / "out" / "model.safetensors")
    gains = [k for k in after if k.endswith("q_norm.weight")]
    assert gains and not torch.equal(
        after[gains[0]], load_file(src / "model.safetensors")[gains[0]]
    )

    split = maps.clone()
    split[:, 0, 0] *= 1.5  # the two dims of a rotary pair scaled differently (in every head)
    bad = [(split, "RoPE")]
    if group.qk == "shared_gains" and hkv > 1:
        per_head = maps.clone()
        per_head[1] *= 2.0  # heads that share a gain scaled differently
        bad.append((per_head, "differ between heads"))
    for maps, reason in bad:
        layers = (LayerTransform(qk=maps),) * spec.num_layers
        with pytest.raises(LmcError, match=reason):
            apply_transform(view, Transform(spec.num_layers, layers=layers))


@pytest.mark.parametrize("kind", ["qk", "ov"])
def test_half_precision_head_maps_are_inverted_in_float32(model_dirs, kind):
    """Under CUDA's bf16 autocast the learned head maps reach the action in bf16 (the CPU's
    autocast inverts in float32 by itself, so only this test sees it): they act as their
    float32 values would, rather than failing in ``linalg.inv``."""
    from lmc_mergekit.symmetry.weight_actions import apply_ov_maps, apply_qk_maps

    view = open_model(model_dirs["llama_gqa_tied"])
    spec, attn = view.spec, view.block(0).attn
    maps = random_rope_maps(spec.num_kv_heads, spec.head_dim, spec.rotary_dims, generator())
    half = maps.to(torch.bfloat16)
    act = apply_qk_maps if kind == "qk" else apply_ov_maps
    got, expected = act(attn, spec, half), act(attn, spec, half.float())
    for name in ("q", "k", "v", "o"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name))


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "gpt_neox_partial_rotary_parallel"])
def test_a_bf16_model_moved_in_float32_is_its_float64_move_rounded(model_dirs, variant):
    """A model stored in bf16 is moved in float32 (twice float64's speed): every tensor it
    gives is the float64 move of the same stored values rounded once to bf16, but for under
    one element in a thousand, each a neighbour of that rounding (a float32 error near a
    rounding boundary) or within float32's error of the tensor's scale (a value that cancels
    to near zero)."""
    from lmc_mergekit.models.view import iter_tensors, map_tensors, materialize
    from lmc_mergekit.symmetry.weight_actions import (
        compute_dtype,
        transform_block,
        transform_embeddings,
        transform_head,
    )

    source = open_model(model_dirs[variant])
    identity = Transform(source.spec.num_layers)
    stored = materialize(apply_transform(source, identity, torch.bfloat16))
    transform = random_transform(stored.spec, seed=5)
    moved = apply_transform(stored, transform)
    exact = transform.to(torch.float64)

    def in_float64(part):
        return map_tensors(part, lambda t: t.double() if t.is_floating_point() else t)

    pairs = [
        (moved.embeddings(), transform_embeddings(in_float64(stored.embeddings()), exact)),
        (moved.head(), transform_head(in_float64(stored.head()), exact)),
    ]
    for index in range(stored.spec.num_layers):
        block = stored.block(index)
        assert compute_dtype(block) == torch.float32
        pairs.append(
            (moved.block(index), transform_block(in_float64(block), stored.spec, exact, index))
        )
    elements = different = 0
    for got, want in pairs:
        for (name, tensor), (_, value) in zip(iter_tensors(got), iter_tensors(want), strict=True):
            assert tensor.dtype == torch.bfloat16, name
            rounded = value.to(torch.bfloat16)
            up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
            down = torch.nextafter(rounded, torch.full_like(rounded, float("-inf")))
            near = (tensor.double() - value).abs() <= 1e-5 * value.abs().max()
            assert ((tensor == rounded) | (tensor == up) | (tensor == down) | near).all(), name
            elements += tensor.numel()
            different += int((tensor != rounded).sum())
    assert different < elements / 1000, (different, elements)
