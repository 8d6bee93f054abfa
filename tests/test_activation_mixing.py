"""Learned matching's mixes run in activation space: each block's projections run once per
endpoint on its held weights, their inputs and outputs moved, and this is the mix of the moved
weights, outputs and gradients alike, on every family; the first endpoint's rotation and maps
moved onto the others leave the loss and its gradients; every map is inverted once a step; and
what a step holds is estimated before it runs (which blocks keep their work, whether a GPU can
hold it)."""

from __future__ import annotations

import pytest
import torch
from test_learned_matching import CPU, randomized
from tiny_models import VARIANTS, build_model, probe_ids

from lmc_mergekit.matching import interpolation
from lmc_mergekit.matching.interpolation import InterpolationObjective
from lmc_mergekit.matching.step_memory import device_shortfall, step_memory
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.block_mixing import BlockMixer
from lmc_mergekit.models.view import iter_tensors, map_named_tensors, materialize
from lmc_mergekit.symmetry import Transform, apply_transform
from lmc_mergekit.symmetry.activation_actions import activation_actions
from lmc_mergekit.symmetry.parametrize import FAMILIES
from lmc_mergekit.symmetry.weight_actions import transform_block

#: The first endpoint learns no scale (learn_symmetries: only ratios matter).
FIRST = tuple(f for f in FAMILIES if f != "scale")


def pair(tmp_path, variant: str, dtype: torch.dtype | None = None):
    """Two tiny endpoints of ``variant`` (norms absorbed; in ``dtype``), their runner and
    symmetries moved away from the identity."""
    folders = [build_model(variant, tmp_path / name, seed=s) for s, name in ((1, "a"), (2, "b"))]
    views = [open_model(folder) for folder in folders]
    absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
    ends = [materialize(apply_transform(view, absorb, dtype)) for view in views]
    spec = ends[0].spec
    runner = BlockMixer(folders[0], views[0].adapter, spec, CPU)
    symmetries = [randomized(spec, families=FIRST, seed=3), randomized(spec, seed=4)]
    return ends, runner, symmetries


def weight_space_output(ends, transforms, weights, runner, residual, index):
    """Block ``index`` of the mix of the moved weights, as the stock module runs it: the
    definition the activation-space mix must meet."""
    spec = ends[0].spec
    moved = [
        transform_block(end.block(index), spec, t, index)
        for end, t in zip(ends, transforms, strict=True)
    ]
    named = [dict(iter_tensors(block)) for block in moved]

    def mixed(name: str, _) -> torch.Tensor:
        return sum(w * tensors[name] for w, tensors in zip(weights, named, strict=True))

    return runner.output(map_named_tensors(moved[0], mixed), residual, index)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_mix_run_in_activation_space_is_the_mix_of_the_moved_weights(tmp_path, variant):
    """Every block of every family: what the runner makes of the endpoints' held blocks and
    their moves is what the stock block makes of the mix of the moved weights, with the same
    gradients with respect to every symmetry parameter and the residual stream; under bf16
    autocast (the GPU's precision, its CPU twin) the same within bf16's rounding."""
    ends, runner, symmetries = pair(tmp_path, variant)
    spec = ends[0].spec
    weights = [0.3, 0.7]
    generator = torch.Generator().manual_seed(0)
    # Longer than Gemma's sliding window of 8: the windows bite.
    residual = torch.randn(2, 12, spec.hidden_size, generator=generator).requires_grad_()
    upstream = torch.randn(2, 12, spec.hidden_size, generator=generator)
    names = [f"{i}.{n}" for i, s in enumerate(symmetries) for n, _ in s.named_parameters()]
    names.append("residual")
    params = [p for s in symmetries for p in s.parameters()] + [residual]
    # Made once (as a step makes them), shared by every block and both ways of running it.
    transforms = [s.transform() for s in symmetries]
    actions = activation_actions(transforms, spec)

    outputs = {"weights": [], "activations": [], "bf16": []}
    for index in range(spec.num_layers):
        expected = weight_space_output(ends, transforms, weights, runner, residual, index)
        states = [runner.lay_out(end.block(index), index) for end in ends]
        got = runner.mixed_output(states, actions, weights, residual, index)
        scale = float(expected.detach().abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
        # The objective's bf16: the maps made in float32, the mix run under autocast.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = runner.mixed_output(states, actions, weights, residual, index)
        torch.testing.assert_close(low.float(), expected, rtol=0, atol=0.04 * scale)
        for kind, output in zip(outputs, (expected, got, low), strict=True):
            outputs[kind].append((output.float() * upstream).sum())
    # The gradients of every block's output at once (one backward each way).
    want, have, low = (
        torch.autograd.grad(sum(terms), params, retain_graph=True) for terms in outputs.values()
    )
    for name, expected, got, rounded in zip(names, want, have, low, strict=True):
        assert float(expected.abs().max()) > 0, name  # every parameter reaches the blocks
        atol = 2e-4 * float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=name)
        assert torch.isfinite(rounded).all(), name


@pytest.mark.parametrize(
    "variant",
    ["gpt_neox_partial_rotary_parallel", "gpt2_tied", "llama_gqa_tied", "gemma2_softcap_windows"],
)
def test_moving_the_first_endpoints_rotation_onto_the_others_keeps_loss_and_gradients(
    tmp_path, variant, monkeypatch
):
    """The objective rotates the others by ``Q_i·Q_0ᵀ`` and the first not at all (its maps
    moved the same way): the loss and every gradient are those of each endpoint moved by its
    own symmetry (ones-fixing rotations, learned positions, heads read through tokens; a
    learned permutation stays on its endpoint)."""
    ends, runner, symmetries = pair(tmp_path, variant)
    objective = InterpolationObjective(ends, symmetries, runner)
    ids = probe_ids(shape=(2, 16))

    def loss_and_gradients():
        objective.symmetries.zero_grad()
        loss = objective(torch.tensor([0.4, 0.6]), ids)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in objective.symmetries.parameters()]

    moved = loss_and_gradients()
    monkeypatch.setattr(interpolation, "_first_unrotated", lambda transforms, *_: transforms)
    own = loss_and_gradients()
    assert moved[0] == pytest.approx(own[0], rel=1e-6)
    # float32 sums in another order: to a few 1e-5 of the largest gradient (a scale's, a
    # sum of terms that nearly cancel, differs by more of its own size).
    largest = max(float(g.abs().max()) for g in own[1])
    for got, want in zip(moved[1], own[1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * largest)


def test_every_map_is_inverted_once_a_step_in_one_batched_call(tmp_path, monkeypatch):
    """A step inverts all the QK and OV maps of every endpoint and layer in one call (not per
    block, nor again where a block's work is recomputed), and the batched maps are the
    per-layer ones: the second endpoint's ``M_1·M_0⁻¹`` with its inverse, the first's none."""
    ends, runner, symmetries = pair(tmp_path, "gpt_neox_partial_rotary_parallel")
    spec = ends[0].spec
    transforms = [s.frozen_transform() for s in symmetries]
    first, second = activation_actions(transforms, spec)
    assert first.qk is None and first.ov is None
    for layer in range(spec.num_layers):
        for kind, inverse in (("qk", "qk_inverse"), ("ov", "ov_inverse")):
            maps = [getattr(t.layers[layer], kind) for t in transforms]
            relative = maps[1] @ torch.linalg.inv(maps[0])
            torch.testing.assert_close(getattr(second, kind)[layer], relative)
            undo = torch.linalg.inv(relative)
            undo = undo.mT if kind == "qk" else undo
            torch.testing.assert_close(getattr(second, inverse)[layer], undo)
    calls = []
    invert = torch.linalg.inv
    monkeypatch.setattr(torch.linalg, "inv", lambda a: calls.append(a.shape) or invert(a))
    objective = InterpolationObjective(ends, symmetries, runner)
    for free in (None, 0):  # every block keeping its work, then every block recomputing it
        calls.clear()
        objective.free = free
        objective(torch.tensor([0.5, 0.5]), probe_ids(shape=(2, 16))).backward()
        assert calls == [(4, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim)]


def test_blocks_that_recompute_their_work_give_the_same_loss_and_gradients(tmp_path, monkeypatch):
    """Keeping a block's work for the backward or recomputing it there is one computation."""
    ends, runner, symmetries = pair(tmp_path, "qwen2_gqa_bias_tied")
    objective = InterpolationObjective(ends, symmetries, runner)
    ids = probe_ids(shape=(2, 16))
    results = []
    for kept in (ends[0].spec.num_layers, 0):
        monkeypatch.setattr(objective, "kept_blocks", lambda _, kept=kept: kept)
        objective.symmetries.zero_grad()
        loss = objective(torch.tensor([0.5, 0.5]), ids)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in objective.symmetries.parameters()]))
    (kept, kept_grads), (redone, redone_grads) = results
    torch.testing.assert_close(redone, kept, rtol=1e-6, atol=0)
    for got, want in zip(redone_grads, kept_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("variant", "dtype"),
    [(variant, torch.float32) for variant in sorted(VARIANTS)]
    + [("qwen2_gqa_bias_tied", torch.bfloat16)],
)
def test_the_estimate_of_a_blocks_work_bounds_what_it_keeps(tmp_path, variant, dtype, monkeypatch):
    """What autograd keeps for a block's backward (the step with every block keeping its work
    against the step with none), per block, is below :func:`step_memory`'s estimate and
    within three times of it, for every family, and for bf16 endpoints run in float32 (a
    kept block keeps their float32 copies)."""
    ends, runner, symmetries = pair(tmp_path, variant, dtype)
    objective = InterpolationObjective(ends, symmetries, runner)
    held = {p.untyped_storage().data_ptr() for p in objective.parameters()}
    ids = probe_ids(shape=(8, 64))

    def kept_bytes(kept: int) -> int:
        monkeypatch.setattr(objective, "kept_blocks", lambda _: kept)
        storages = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in held:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            objective(torch.tensor([0.5, 0.5]), ids)
        return sum(storages.values())

    layers = ends[0].spec.num_layers
    measured = (kept_bytes(layers) - kept_bytes(0)) / layers
    estimate = objective.memory(ids.numel(), ids.shape[-1]).block
    assert measured <= estimate <= 3 * measured, (measured, estimate)


def test_blocks_keep_their_work_while_it_fits_the_endpoints_and_the_device():
    """Blocks keep their work up to the endpoints' own bytes (a Pythia-160M pair in float32 at
    4 × 128 tokens: every block; a bf16 pair at 16 × 128: a few), and no more than ``free``
    holds; the need grows with each block kept."""
    spec = neox_spec(
        hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072, vocab_size=4096
    )
    small = step_memory(spec, 2, 4, 4 * 128, 128)
    assert small.kept_blocks() == 12
    large = step_memory(spec, 2, 2, 16 * 128, 128)
    assert 0 < large.kept_blocks() < 12
    kept = large.kept_blocks()
    assert kept * large.block <= large.endpoints < (kept + 1) * large.block
    assert small.need(0) == small.need(1)  # one block's work at least: the one running
    assert small.need(12) - small.need(1) == 11 * small.block
    free = small.need(5)
    assert small.kept_blocks(free) == 5 and small.kept_blocks(small.need(0) - 1) == 0
    sharded = step_memory(spec, 2, 4, 4 * 128, 128, processes=2)
    assert sharded.held() == sharded.endpoints // 2 + sharded.part


def test_a_step_that_cannot_fit_one_gpu_says_how_many_it_needs():
    """Before any endpoint is moved: the memory a step needs against what a GPU has free, in
    one line naming both and the fix: sharding the endpoints over enough processes
    (torchrun), or a smaller batch where the working set alone does not fit."""
    spec = neox_spec(
        hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=11008, vocab_size=32000
    )
    memory = step_memory(spec, 2, 2, 16 * 128, 128)  # a 7B pair held in bf16: 27 GB
    assert device_shortfall(memory, memory.need(0)) is None
    free = 20 * 2**30
    message = device_shortfall(memory, free)
    count = int(message.split("--nproc_per_node ")[1].split()[0])
    assert memory.need(0, count) <= free < memory.need(0, count - 1)
    assert "\n" not in message and "torchrun --nproc_per_node" in message
    assert f"{memory.need(0) / 2**30:.1f} GiB" in message and "20.0 GiB is free" in message
    working = memory.need(0) - memory.held()
    tight = device_shortfall(memory, working // 2)
    assert "lower alignment batch_size" in tight and "torchrun" not in tight


def neox_spec(**sizes):
    """A GPT-NeoX spec of these sizes (as the scale benchmark's shapes)."""
    from lmc_mergekit.models.view import ModelSpec

    d, heads = sizes["hidden_size"], sizes["num_heads"]
    return ModelSpec(
        architecture="gpt_neox",
        num_kv_heads=heads,
        head_dim=d // heads,
        rotary_dims=d // heads // 4,
        norm="layernorm",
        norm_eps=1e-5,
        parallel_residual=True,
        gated_mlp=False,
        activation="gelu",
        tied_embeddings=False,
        **sizes,
    )


def test_the_cayley_map_has_autograds_gradient_without_solving_again():
    """The Cayley map's backward (two products, no solve) is the gradient of the solve."""
    from lmc_mergekit.symmetry.parametrize import cayley, skew

    generator = torch.Generator().manual_seed(0)
    params = torch.randn(3, 6, 6, generator=generator, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(cayley, (params,))
    eye = torch.eye(6, dtype=torch.float64).expand(3, 6, 6)
    solved = torch.linalg.solve(eye - skew(params), eye + skew(params))
    upstream = torch.randn(3, 6, 6, generator=generator, dtype=torch.float64)
    (want,) = torch.autograd.grad((solved * upstream).sum(), params)
    (got,) = torch.autograd.grad((cayley(params) * upstream).sum(), params)
    torch.testing.assert_close(got, want)


def test_a_ones_fixing_rotation_is_made_by_rank_one_updates():
    """``H·diag(1, C)·H`` made by rank-one updates is ``11ᵀ/d + U·C·Uᵀ`` for ``U`` the
    reflection's columns after the first, a basis of the complement of all-ones: orthogonal,
    fixing all-ones."""
    from lmc_mergekit.symmetry.parametrize import cayley, ones_reflection, reflected

    d = 48
    generator = torch.Generator().manual_seed(0)
    inner = cayley(0.3 * torch.randn(d - 1, d - 1, generator=generator, dtype=torch.float64))
    v = ones_reflection(d)
    basis = (torch.eye(d, dtype=torch.float64) - 2 * torch.outer(v, v))[:, 1:]
    ones = torch.ones(d, dtype=torch.float64)
    torch.testing.assert_close(basis.T @ basis, torch.eye(d - 1, dtype=torch.float64))
    torch.testing.assert_close(basis.T @ ones, torch.zeros(d - 1, dtype=torch.float64))
    rotation = reflected(inner, v)
    torch.testing.assert_close(rotation, torch.outer(ones, ones) / d + basis @ inner @ basis.T)
    torch.testing.assert_close(rotation @ ones, ones)
