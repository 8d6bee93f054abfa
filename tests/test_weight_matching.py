"""Weight matching: it must exactly undo any symmetry, and fit per-head maps sensibly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VARIANTS, build_model, probe_ids

from lmc_mergekit.evaluation.barrier import interpolation_losses
from lmc_mergekit.matching import assignment, match_weights, weight_matching
from lmc_mergekit.matching.head_maps import fit_free_maps, fit_rope_maps
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import MLP, iter_tensors, materialize
from lmc_mergekit.runtime import precision
from lmc_mergekit.symmetry import Transform, apply_transform, random_transform
from lmc_mergekit.symmetry.rope import rope_commutation_error
from lmc_mergekit.symmetry.sampling import random_rope_maps, random_well_conditioned
from lmc_mergekit.transform_checkpoint import transform_checkpoint


def _max_relative_gap(a, b) -> float:
    parts = [(a.embeddings(), b.embeddings()), (a.head(), b.head())]
    parts += [(a.block(i), b.block(i)) for i in range(a.spec.num_layers)]
    gap = 0.0
    for part_a, part_b in parts:
        for (_, x), (_, y) in zip(iter_tensors(part_a), iter_tensors(part_b), strict=True):
            gap = max(gap, float((x - y).abs().max() / x.abs().max().clamp_min(1e-12)))
    return gap


@pytest.mark.parametrize("variant", VARIANTS)
def test_matching_undoes_a_scramble_exactly(variant, model_dirs, tmp_path):
    source = model_dirs[variant]
    spec = open_model(source).spec
    scrambled = tmp_path / "scrambled"
    transform_checkpoint(source, scrambled, random_transform(spec, seed=11), progress=False)

    result = match_weights(open_model(source), open_model(scrambled))

    recovered = materialize(apply_transform(open_model(scrambled), result.transform))
    original = materialize(
        apply_transform(open_model(source), Transform(spec.num_layers, absorb_norms=True))
    )
    assert _max_relative_gap(original, recovered) < 1e-5
    assert result.distances[0] > 0.5 and result.distance < 1e-6 and result.iterations <= 3
    if spec.norm == "layernorm":
        ones = torch.ones(spec.hidden_size, dtype=torch.float64)
        assert torch.allclose(ones @ result.transform.rotation, ones, atol=1e-10)
    # Written out, the recovered copy lies on a flat path with the (absorbed) original.
    absorb = Transform(spec.num_layers, absorb_norms=True)
    transform_checkpoint(source, tmp_path / "a", absorb, progress=False)
    transform_checkpoint(scrambled, tmp_path / "b", result.transform, progress=False)
    ids = probe_ids(shape=(4, 32))
    losses = interpolation_losses(tmp_path / "a", tmp_path / "b", ids, points=3).losses
    assert max(losses) - min(losses) < 1e-5


def test_free_maps_recover_a_hidden_map_and_improve_unrelated_heads():
    gen = torch.Generator().manual_seed(0)
    xa = torch.randn(3, 8, 40, generator=gen, dtype=torch.float64)
    ya = torch.randn(3, 8, 30, generator=gen, dtype=torch.float64)
    hidden = random_well_conditioned((3,), 8, gen)
    xb, yb = torch.linalg.solve(hidden, xa), hidden.mT @ ya  # A = hidden maps (xb, yb) to (xa, ya)
    fitted = fit_free_maps(xa, ya, xb, yb)
    assert torch.allclose(fitted, hidden, atol=1e-8)

    xc = torch.randn(3, 8, 40, generator=gen, dtype=torch.float64)
    yc = torch.randn(3, 8, 30, generator=gen, dtype=torch.float64)
    fitted = fit_free_maps(xa, ya, xc, yc)
    moved = (fitted @ xc - xa).norm() ** 2 + (torch.linalg.solve(fitted.mT, yc) - ya).norm() ** 2
    unmoved = (xc - xa).norm() ** 2 + (yc - ya).norm() ** 2
    assert moved < unmoved


@pytest.mark.parametrize("rotary_dims", [4, 8])
def test_rope_maps_commute_with_rope_and_recover_a_hidden_rope_map(rotary_dims):
    gen = torch.Generator().manual_seed(1)
    xa = torch.randn(2, 8, 40, generator=gen, dtype=torch.float64)
    ya = torch.randn(2, 8, 40, generator=gen, dtype=torch.float64)
    hidden = random_rope_maps(2, 8, rotary_dims, gen)
    xb, yb = torch.linalg.solve(hidden, xa), hidden.mT @ ya
    fitted = fit_rope_maps(xa, ya, xb, yb, rotary_dims)
    assert torch.allclose(fitted, hidden, atol=1e-8)

    xc = torch.randn(2, 8, 40, generator=gen, dtype=torch.float64)
    fitted = fit_rope_maps(xa, ya, xc, ya.flip(-1), rotary_dims)
    assert rope_commutation_error(fitted, rotary_dims) < 1e-12
    assert torch.linalg.matrix_rank(fitted).min() == 8


def test_steady_layers_are_not_solved_again_and_that_costs_nothing(trained_pair, monkeypatch):
    """Keeping a layer's assignment while the rotation barely moves must not change the result
    the full descent reaches; the first round assigns every layer."""
    a, b = (open_model(folder) for folder in trained_pair)
    fast = match_weights(a, b)
    monkeypatch.setattr(weight_matching, "STEADY_ROTATION", 0.0)  # solve every layer, always
    full = match_weights(a, b)
    layers = a.spec.num_layers
    assert fast.solved[0] == layers and all(n == layers for n in full.solved)
    assert fast.distance < fast.distances[0]
    assert abs(fast.distance - full.distance) <= 1e-3 * full.distance


def _planted(n: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A similarity of rows with shuffled, noisy copies of themselves, and the shuffle."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, 64, generator=generator, dtype=torch.float64)
    shuffle = torch.randperm(n, generator=generator)
    copies = torch.empty_like(rows)
    copies[shuffle] = rows + noise * torch.randn(n, 64, generator=generator, dtype=torch.float64)
    return rows @ copies.T, shuffle


def _dense_optimum(similarity: torch.Tensor) -> float:
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(similarity.numpy(), maximize=True)
    return float(similarity[rows, cols].sum())


@pytest.mark.parametrize(("n", "noise"), [(24, 3.0), (600, 0.8)])
def test_assignment_on_candidates_finds_the_optimum(n, noise):
    # 24 ≤ CANDIDATES: every edge is a candidate; 600: the best partners are among the top.
    similarity, shuffle = _planted(n, noise, seed=n)
    perm, score = assignment.best_permutation(similarity)
    assert score == pytest.approx(_dense_optimum(similarity), rel=1e-12)
    assert sorted(perm.tolist()) == list(range(n))
    if n > assignment.CANDIDATES:
        assert torch.equal(perm, shuffle)


def test_assignment_on_candidates_reaches_partners_behind_columns_every_row_prefers():
    # 40 columns are every row's favourites (as neurons that fire on every token): no row's
    # own top candidates hold its partner, each column's top rows do.
    n, hubs = 200, 40
    similarity, shuffle = _planted(n, 0.1, seed=3)
    similarity[:, :hubs] += 2 * float(similarity.max())
    perm, score = assignment.best_permutation(similarity)
    assert torch.equal(perm, shuffle)
    assert score == pytest.approx(_dense_optimum(similarity), rel=1e-12)


def test_assignment_on_candidates_never_loses_to_the_current_one():
    # Unrelated rows: the optimum may use edges outside the candidates; the current assignment
    # (the dense optimum itself, here) is always one of them, so it is never lost.
    generator = torch.Generator().manual_seed(0)
    similarity = torch.randn(300, 300, generator=generator, dtype=torch.float64)
    from scipy.optimize import linear_sum_assignment

    _, best = linear_sum_assignment(similarity.numpy(), maximize=True)
    _, score = assignment.best_permutation(similarity, torch.as_tensor(best))
    assert score == pytest.approx(_dense_optimum(similarity), rel=1e-12)
    _, from_identity = assignment.best_permutation(similarity)
    assert float(similarity.diagonal().sum()) < from_identity <= score + 1e-9


def test_int8_neuron_products_assign_as_the_float_ones(monkeypatch):
    # B's neurons: A's, shuffled, each weight mixed with noise (partners' cosine 0.3), biases
    # included; then one input feature of A made 8× the others (as LLM weights have: it sets
    # every row's int8 scale, six times coarser). Rounded to int8, each product stays close
    # to the float one on the scale of unrelated neurons' products, and the assignment is
    # the same.
    gen = torch.Generator().manual_seed(0)
    n, d, cos = 512, 96, 0.3

    def noisy(t):
        return cos * t + (1 - cos**2) ** 0.5 * torch.randn(t.shape, generator=gen)

    parts = dict(up=(n, d), down=(d, n), gate=(n, d), up_bias=(n,), gate_bias=(n,))
    a = MLP(**{k: torch.randn(shape, generator=gen) for k, shape in parts.items()})
    shuffle = torch.randperm(n, generator=gen)
    b = MLP(
        **{
            k: noisy(v)[:, shuffle] if k == "down" else noisy(v)[shuffle]
            for k, v in vars(a).items()
            if v is not None
        }
    )
    a.up[:, 5] *= 8
    sims = {}
    for int8 in (True, False):
        monkeypatch.setattr(assignment, "native_int8", lambda device, int8=int8: int8)
        sims[int8] = assignment.neuron_similarity(a, b)
    exact = a.up.double() @ b.up.double().T + a.down.double().T @ b.down.double()
    exact += a.gate.double() @ b.gate.double().T
    exact += (
        a.up_bias.double()[:, None] * b.up_bias.double()
        + a.gate_bias.double()[:, None] * b.gate_bias.double()
    )
    spread = float(exact.std())
    assert float((sims[False] - exact).abs().max()) < 1e-4 * spread
    error = (sims[True] - exact).abs() / spread
    assert float(error.mean()) < 0.05 and float(error.max()) < 0.6
    assert sims[True].dtype == torch.float32 and torch.isfinite(sims[True]).all()
    perms = [assignment.best_permutation(sim)[0] for sim in sims.values()]
    assert torch.equal(*perms)
    # (The outlier's shared term moves a few neurons off their planted partners, in both.)
    assert float((perms[1] == torch.argsort(shuffle)).float().mean()) > 0.98


def test_the_proposal_finds_shuffled_neurons_and_is_a_permutation_when_favourites_clash():
    """Projected products find a shuffle of A's neurons (each one's favourite is its own
    partner); where A holds a neuron twice, both copies favour one neuron of B, and the
    proposal is still a permutation (the assignment of the projected products) that gives
    each copy one of B's two."""
    gen = torch.Generator().manual_seed(0)
    n, d = 1024, 64
    parts = dict(up=(n, d), down=(d, n), gate=(n, d))
    a = MLP(**{k: torch.randn(shape, generator=gen) for k, shape in parts.items()})
    shuffle = torch.randperm(n, generator=gen)

    def shuffled(mlp):
        return MLP(
            **{
                k: getattr(mlp, k)[:, shuffle] if k == "down" else getattr(mlp, k)[shuffle]
                for k in parts
            }
        )

    inverse = torch.argsort(shuffle)
    assert torch.equal(assignment.proposed_permutation(a, shuffled(a)), inverse)
    a.up[7], a.gate[7], a.down[:, 7] = a.up[3], a.gate[3], a.down[:, 3]
    perm = assignment.proposed_permutation(a, shuffled(a))
    assert torch.equal(perm.sort().values, torch.arange(n))
    assert {int(perm[3]), int(perm[7])} == {int(inverse[3]), int(inverse[7])}


@pytest.mark.parametrize("int8", [True, False])
def test_matching_undoes_a_scramble_with_either_neuron_products(int8, model_dirs, monkeypatch):
    # The int8 products are chosen by the CPU (VNNI, AMX): both paths run on any CPU here.
    monkeypatch.setattr(assignment, "native_int8", lambda device: int8)
    source = model_dirs["llama_gqa_tied"]
    spec = open_model(source).spec
    scrambled = apply_transform(open_model(source), random_transform(spec, seed=5))
    result = match_weights(open_model(source), scrambled)
    assert result.distances[0] > 0.5 and result.distance < 1e-6


def test_int8_products_follow_the_cpu_probes(monkeypatch):
    for native in (False, True):
        for probe in precision.INT8_PROBES:
            monkeypatch.setattr(torch.cpu, probe, lambda native=native: native, raising=False)
        assert precision.native_int8(torch.device("cpu")) is native
    assert not precision.native_int8(torch.device("cuda"))


def _bf16_pair(source, tmp_path):
    """``source`` in bf16 and a scrambled bf16 copy of it (the shape users hold)."""
    from test_selfcheck import bf16_copy

    a = bf16_copy(source, tmp_path / "a-bf16")
    spec = open_model(a).spec
    transform_checkpoint(a, tmp_path / "b-bf16", random_transform(spec, seed=5), progress=False)
    return a, tmp_path / "b-bf16"


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "gpt_neox_partial_rotary_parallel"])
def test_a_last_round_writes_the_checkpoints_it_moved_and_they_pass_the_check(
    variant, model_dirs, tmp_path
):
    """A round known to be the last hands the parts it moved to a writer, and the first round
    the reference's (norms absorbed): each folder published is the one transform_checkpoint
    writes for the same transform (to a unit in the last place: both round a float32
    computation once) and passes the self-check."""
    from lmc_mergekit.evaluation.selfcheck import check_transformed
    from lmc_mergekit.transform_checkpoint import CheckedWriter

    a, b = _bf16_pair(model_dirs[variant], tmp_path)
    reference, other = open_model(a), open_model(b)

    def writer(view, name):
        return lambda spec: CheckedWriter(view, spec, tmp_path / name, progress=False)

    result = match_weights(
        reference,
        other,
        max_iterations=1,
        writer=writer(other, "fused-b"),
        reference_writer=writer(reference, "fused-a"),
    )
    assert result.iterations == 1 and "max_iterations (1)" in result.stopped
    assert not (tmp_path / "fused-b").exists() and not (tmp_path / "fused-a").exists()
    absorb = Transform(reference.spec.num_layers, absorb_norms=True)
    moves = {"a": (a, reference, absorb), "b": (b, other, result.transform)}
    for name, pending in (("a", result.written_reference), ("b", result.written)):
        pending.publish()
        source, view, transform = moves[name]
        assert check_transformed(view, transform, tmp_path / f"fused-{name}").error < 1e-4
        transform_checkpoint(source, tmp_path / f"apart-{name}", transform, progress=False)
        fused, apart = (
            open_model(tmp_path / f"fused-{name}"),
            open_model(tmp_path / f"apart-{name}"),
        )
        parts = [(fused.embeddings(), apart.embeddings()), (fused.head(), apart.head())]
        parts += [(fused.block(i), apart.block(i)) for i in range(fused.spec.num_layers)]
        for x, y in parts:
            for (field, got), (_, want) in zip(iter_tensors(x), iter_tensors(y), strict=True):
                assert got.dtype == want.dtype
                assert ulps_apart(got, want) <= 1, (name, field)


def ulps_apart(stored: torch.Tensor, other: torch.Tensor) -> float:
    from lmc_mergekit.evaluation.selfcheck import units_in_last_place

    return units_in_last_place(stored, other.double())


def test_a_bf16_scramble_is_undone_in_one_round_at_its_rounding_floor(model_dirs, tmp_path):
    """The first round brings a scrambled bf16 copy within its own rounding of the original:
    matching stops there instead of running a round that only confirms it."""
    a, b = _bf16_pair(model_dirs["llama_gqa_tied"], tmp_path)
    result = match_weights(open_model(a), open_model(b))
    assert result.iterations == 1 and "the rounding of the stored weights" in result.stopped
    assert result.distances[0] > 0.5 and result.distance < 1e-2


def test_a_scramble_s_neurons_are_assigned_from_the_proposal(model_dirs, tmp_path, monkeypatch):
    """In a scramble's first round every layer's neurons are assigned from the projected
    proposal (no ``dff × dff`` similarity is computed); where a proposal is wrong, the layer
    is solved exactly instead, both give the same transform, and after a miss before any
    proposal landed no other layer is proposed (an unrelated pair's never land)."""
    a, b = _bf16_pair(model_dirs["llama_gqa_tied"], tmp_path)
    exact = []
    similarity = weight_matching.neuron_similarity
    monkeypatch.setattr(
        weight_matching, "neuron_similarity", lambda *x: exact.append(1) or similarity(*x)
    )
    proposed = match_weights(open_model(a), open_model(b))
    assert proposed.iterations == 1 and exact == []
    # A wrong proposal (the identity): every layer lands far above B's rounding, then is solved.
    proposals = []
    monkeypatch.setattr(
        weight_matching,
        "proposed_permutation",
        lambda mlp, _: proposals.append(1) or torch.arange(len(mlp.up)),
    )
    solved = match_weights(open_model(a), open_model(b))
    assert len(exact) == open_model(a).spec.num_layers > 1 and len(proposals) == 1
    assert solved.distance == proposed.distance and solved.stopped == proposed.stopped
    for got, want in zip(proposed.transform.layers, solved.transform.layers, strict=True):
        assert torch.equal(got.ffn_perm, want.ffn_perm) and torch.equal(got.qk, want.qk)


def test_a_miss_after_a_landed_proposal_leaves_the_next_layers_proposed(tmp_path, monkeypatch):
    """One layer of a scramble whose proposal misses (a real model's layer of near-identical
    neurons) is solved exactly, and the layers after it are still proposed: the transform is
    the one every proposal landing gives."""
    source = build_model("llama_gqa_tied", tmp_path / "three", num_hidden_layers=3)
    a, b = _bf16_pair(source, tmp_path)
    right = match_weights(open_model(a), open_model(b))
    calls, exact = [], []
    proposal, similarity = weight_matching.proposed_permutation, weight_matching.neuron_similarity

    def second_wrong(mlp, other):
        calls.append(1)
        return torch.arange(len(mlp.up)) if len(calls) == 2 else proposal(mlp, other)

    monkeypatch.setattr(weight_matching, "proposed_permutation", second_wrong)
    monkeypatch.setattr(
        weight_matching, "neuron_similarity", lambda *x: exact.append(1) or similarity(*x)
    )
    missed = match_weights(open_model(a), open_model(b))
    assert len(calls) == 3 and len(exact) == 1
    assert missed.distance == right.distance and missed.stopped == right.stopped
    for got, want in zip(missed.transform.layers, right.transform.layers, strict=True):
        assert torch.equal(got.ffn_perm, want.ffn_perm)


def test_layers_at_the_rounding_floor_still_count_where_a_next_round_runs(
    model_dirs, tmp_path, monkeypatch
):
    """A layer matched to B's storage rounding in the first round is left out of the next
    rotation's fit until the round ends above the floor; then it is read again and counted:
    the descent is the one that never defers (same assignments, same rotation to float64
    summation order)."""
    from safetensors.torch import load_file, save_file

    a, b = _bf16_pair(model_dirs["llama_gqa_tied"], tmp_path)
    (shard,) = b.glob("*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.1.mlp.down_proj.weight"  # layer 1 only: layer 0 stays at the floor
    noise = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(0))
    tensors[name] = (tensors[name].float() + 0.5 * tensors[name].float().std() * noise).bfloat16()
    save_file(tensors, shard, metadata={"format": "pt"})
    deferring = match_weights(open_model(a), open_model(b), max_iterations=3)
    monkeypatch.setattr(weight_matching, "ROUNDING_FLOOR", 0.0)
    plain = match_weights(open_model(a), open_model(b), max_iterations=3)
    assert deferring.iterations == plain.iterations > 1
    torch.testing.assert_close(
        deferring.transform.rotation, plain.transform.rotation, rtol=0, atol=1e-9
    )
    for got, want in zip(deferring.transform.layers, plain.transform.layers, strict=True):
        assert torch.equal(got.head_perm, want.head_perm)
        assert torch.equal(got.ffn_perm, want.ffn_perm)


def test_a_float32_model_is_not_written_by_the_round(model_dirs, tmp_path):
    """A model stored in float32 is moved in float64 to be written: the round's float32 parts
    are not what it writes, so no writer is made."""
    source = model_dirs["llama"]
    scrambled = tmp_path / "scrambled"
    transform_checkpoint(source, scrambled, random_transform(open_model(source).spec, 11))
    made = []
    result = match_weights(
        open_model(source), open_model(scrambled), max_iterations=1, writer=made.append
    )
    assert made == [] and result.written is None


def _apart_with_writers(model_dirs, tmp_path):
    """Two bf16 models trained apart, and a writer maker for the second (into ``fused``) that
    keeps every writer it made."""
    from test_selfcheck import bf16_copy

    from lmc_mergekit.transform_checkpoint import CheckedWriter

    a = bf16_copy(model_dirs["llama_gqa_tied"], tmp_path / "a-bf16")
    b = build_model("llama_gqa_tied", tmp_path / "b", seed=1)
    other = open_model(bf16_copy(b, tmp_path / "b-bf16"))
    writers = []

    def writer(spec):
        writers.append(CheckedWriter(other, spec, tmp_path / "fused", progress=False))
        return writers[-1]

    return a, other, writers, writer


def test_a_writer_is_discarded_when_the_last_round_is_not_the_result(model_dirs, tmp_path):
    """Where the last round does not improve on the one before, its writer is discarded and
    the first round's, which took the result's parts, is the one returned: it writes what
    moving the model by the result writes."""
    from safetensors.torch import load_file

    a, other, writers, writer = _apart_with_writers(model_dirs, tmp_path)

    # Two models trained apart: a second round gains far less than half and is not kept.
    result = match_weights(open_model(a), other, max_iterations=2, tolerance=0.5, writer=writer)
    assert result.iterations == 2 and "round 1's result kept" in result.stopped
    assert len(writers) == 2 and result.written is writers[0]
    spec, _ = result.written.publish()
    assert len(list(tmp_path.glob(".fused*"))) == 0 and spec.num_layers == other.spec.num_layers
    moved = transform_checkpoint(
        other.folder, tmp_path / "moved", result.transform, progress=False
    )[0]
    assert not moved.shape_mismatch(spec)
    fused, plain = (
        load_file(next((tmp_path / name).glob("*.safetensors"))) for name in ("fused", "moved")
    )
    assert fused.keys() == plain.keys()
    assert all(torch.equal(fused[name], plain[name]) for name in fused)


def test_a_first_round_writer_is_discarded_when_a_later_round_is_the_result(model_dirs, tmp_path):
    """Where a second round improves on the first, the first round's writer is discarded and
    nothing it staged is left."""
    a, other, writers, writer = _apart_with_writers(model_dirs, tmp_path)

    result = match_weights(open_model(a), other, max_iterations=3, tolerance=0.0, writer=writer)
    assert result.iterations > 1 and result.distance < result.distances[1]
    assert result.written is not writers[0]
    assert not (tmp_path / "fused").exists()
    staged = list(tmp_path.glob(".fused*"))
    assert len(staged) == (result.written is not None)
