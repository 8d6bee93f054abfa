"""The group structure of transforms: composition, inversion, files, and refusal of elements
that are not symmetries of the model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from lmc_mergekit.cli import main
from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import iter_tensors, materialize
from lmc_mergekit.symmetry import LayerTransform, Transform, apply_transform, random_transform
from lmc_mergekit.symmetry.sampling import random_orthogonal
from lmc_mergekit.symmetry.transform import load_transform, save_transform


def assert_views_close(a, b, atol=1e-9):
    for i in range(a.spec.num_layers):
        for (name, x), (_, y) in zip(
            iter_tensors(a.block(i)), iter_tensors(b.block(i)), strict=True
        ):
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=f"block {i} {name}")
    for part in ("embeddings", "head"):
        for (name, x), (_, y) in zip(
            iter_tensors(getattr(a, part)()), iter_tensors(getattr(b, part)()), strict=True
        ):
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=f"{part} {name}")


@pytest.fixture
def view64(model_dirs):
    """A float64 copy of the GQA Qwen2 view, so that algebra checks can be tight."""
    from lmc_mergekit.models.view import map_tensors

    view = materialize(open_model(model_dirs["qwen2_gqa_bias_tied"]))
    view.embeddings_ = map_tensors(view.embeddings_, torch.Tensor.double)
    view.blocks = [map_tensors(b, torch.Tensor.double) for b in view.blocks]
    view.head_ = map_tensors(view.head_, torch.Tensor.double)
    return view


def test_composition_equals_sequential_application(view64):
    a, b = random_transform(view64.spec, 1), random_transform(view64.spec, 2)
    sequential = materialize(apply_transform(materialize(apply_transform(view64, a)), b))
    assert_views_close(sequential, apply_transform(view64, a.then(b)))


def test_inverse_undoes_up_to_absorption(view64):
    t = random_transform(view64.spec, 3)
    round_trip = materialize(apply_transform(materialize(apply_transform(view64, t)), t.inverse()))
    absorbed = apply_transform(view64, Transform(view64.spec.num_layers, absorb_norms=True))
    assert_views_close(round_trip, absorbed)
    assert round_trip.spec.norm_eps == pytest.approx(view64.spec.norm_eps)


def test_only_a_transform_that_moves_nothing_is_the_identity(view64):
    """What a transform moves, each part alone, makes it other than the identity (a copy of
    the model that only it describes may be linked instead of written)."""
    t = random_transform(view64.spec, seed=1)
    identity = Transform.identity(t.num_layers)
    assert identity.is_identity() and t.then(t.inverse()).is_identity() is False
    layer = replace(LayerTransform(), ffn_perm=t.layers[0].ffn_perm)
    for moved in (
        replace(identity, absorb_norms=True),
        replace(identity, rotation=torch.eye(view64.spec.hidden_size)),
        replace(identity, scale=2.0),
        replace(identity, layers=(layer, *identity.layers[1:])),
    ):
        assert not moved.is_identity()


def test_save_and_load_round_trip(tmp_path, view64):
    t = random_transform(view64.spec, 4)
    save_transform(t, tmp_path / "t.safetensors")
    loaded = load_transform(tmp_path / "t.safetensors")
    assert loaded.scale == t.scale and loaded.absorb_norms
    assert torch.equal(loaded.rotation, t.rotation)
    for x, y in zip(loaded.layers, t.layers, strict=True):
        assert torch.equal(x.head_perm, y.head_perm) and torch.equal(x.qk, y.qk)
    assert_views_close(apply_transform(view64, loaded), apply_transform(view64, t))


def test_refuses_elements_that_are_not_symmetries(model_dirs):
    llama = open_model(model_dirs["llama_gqa_tied"]).spec
    neox = open_model(model_dirs["gpt_neox_partial_rotary_parallel"]).spec
    good = random_transform(llama, 0)
    cases = {
        "layers": replace(good, num_layers=3, layers=(LayerTransform(),) * 3),
        "not orthogonal": replace(good, rotation=good.rotation * 1.01),
        "between key/value groups": replace(
            good, layers=(LayerTransform(head_perm=torch.tensor([1, 3, 2, 0, 4, 5])),) * 2
        ),
        "commute with RoPE": replace(
            good,
            layers=(LayerTransform(qk=torch.eye(8).repeat(2, 1, 1) + 0.1 * torch.rand(2, 8, 8)),)
            * 2,
        ),
        "permutation": replace(
            good, layers=(LayerTransform(ffn_perm=torch.zeros(80, dtype=torch.long)),) * 2
        ),
    }
    for needle, t in cases.items():
        with pytest.raises(LmcError, match=needle):
            t.check_fits(llama)
    general = Transform(
        neox.num_layers, rotation=random_orthogonal(neox.hidden_size, torch.Generator())
    )
    with pytest.raises(LmcError, match="all-ones"):
        general.check_fits(neox)


def test_transform_command_refuses_a_file_for_another_model(model_dirs, tmp_path):
    neox = open_model(model_dirs["gpt_neox_partial_rotary_parallel"]).spec
    save_transform(random_transform(neox, 0), tmp_path / "t.safetensors")
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["transform", str(model_dirs["llama"]), str(tmp_path / "t.safetensors"), str(out)]
    )
    assert result.exit_code == 1
    assert "hidden size" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("part", ["rotation", "layer 1 QK maps", "scale"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_transform_command_refuses_a_file_with_nan_before_writing(
    model_dirs, tmp_path, part, inverse
):
    """A saved transform with one NaN (a damaged file, a diverged run) is refused when the file
    is read, naming the part: never applied, self-checked and found wrong after writing."""
    llama = model_dirs["llama"]
    transform = random_transform(open_model(llama).spec, 0)
    if part == "scale":
        transform = replace(transform, scale=float("nan"))
    elif part == "rotation":
        rotation = transform.rotation.clone()
        rotation[3, 5] = float("nan")
        transform = replace(transform, rotation=rotation)
    else:
        qk = transform.layers[1].qk.clone()
        qk[0, 1, 1] = float("inf")
        layers = list(transform.layers)
        layers[1] = replace(layers[1], qk=qk)
        transform = replace(transform, layers=tuple(layers))
    path = tmp_path / "t.safetensors"
    save_transform(transform, path)
    out = tmp_path / "out"
    args = ["transform", str(llama), str(path), str(out)] + (["--inverse"] if inverse else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert f"NaN or Inf values in the transform's {part}" in line, line
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
    with pytest.raises(LmcError, match=f"transform's {part};"):
        transform.check_fits(open_model(llama).spec)


def test_a_signed_permutation_turns_by_moving_columns_exactly():
    """``turned`` moves columns for a fixed signed permutation (no product) and multiplies
    otherwise; either way it is ``x·Q`` exactly."""
    from lmc_mergekit.symmetry.sampling import random_orthogonal, random_signed_permutation
    from lmc_mergekit.symmetry.weight_actions import turned

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=generator)
    for q in (
        random_signed_permutation(7, generator),
        random_signed_permutation(7, generator).abs(),
        random_orthogonal(7, generator),
    ):
        assert torch.equal(turned(x, q), x @ q)
    learned = random_signed_permutation(7, generator).requires_grad_()
    turned(x, learned).sum().backward()  # a learned one keeps its gradient
    assert learned.grad is not None
