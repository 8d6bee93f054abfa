"""The memory-bounded paths give what the straightforward computations give: the checkpoint
layout without per-weight bookkeeping, the path's losses from one model interpolated in place,
the loss of a large-vocabulary batch in pieces, weight matching over row chunks of the
embeddings and the head, and mergekit's output in small shards. (How much memory they save is
measured by ``benchmarks/real_configs.py``, not here.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from tiny_models import (
    VARIANTS,
    VOCAB,
    build_gemma3_multimodal,
    build_model,
    probe_ids,
    stored_tensors,
)

from lmc_mergekit.evaluation import barrier, blockwise, loss
from lmc_mergekit.evaluation.barrier import interpolation_losses, lambda_grid
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.evaluation.selfcheck import load_fp32
from lmc_mergekit.latent.tensor_merge import PreparedLayout
from lmc_mergekit.matching import match_weights, weight_matching
from lmc_mergekit.models import block_runner
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.checkpoint import CheckpointReader, MetaReader, RowsReader
from lmc_mergekit.models.layout import checkpoint_layout
from lmc_mergekit.models.view import iter_tensors, materialize
from lmc_mergekit.symmetry import random_transform
from lmc_mergekit.transform_checkpoint import transform_checkpoint

# One of each kind of checkpoint layout: plain, tied, fused per head (GPT-NeoX), fused rows
# (Phi-3), transposed Conv1D with learned positions (GPT-2), soft-capped (Gemma 2).
FAMILIES = [
    "llama",
    "llama_gqa_tied",
    "gpt_neox_partial_rotary_parallel",
    "phi3_partial_rotary",
    "gpt2_tied",
    "gemma2_softcap_windows",
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layout_indexes_only_rearranged_keys(variant, tmp_path):
    folder = build_model(variant, tmp_path / variant)
    view = open_model(folder)
    layout = checkpoint_layout(view.adapter, view)
    checkpoint = stored_tensors(folder)
    for key, key_layout in layout.items():
        piece = key_layout.pieces[0]
        if key_layout.index is None:
            # Laid out as it is: one piece of the key's very shape, no per-weight index.
            assert len(key_layout.pieces) == 1 and piece.shape == tuple(checkpoint[key].shape)
        else:
            assert key_layout.index.dtype == torch.int32, key
    embeddings = next(k for k, v in layout.items() if v.pieces[0].kind == "embeddings.tokens")
    assert layout[embeddings].index is None
    # The lazy per-part layout of a prepared folder is the same layout, key by key.
    lazy = PreparedLayout(folder)
    for key, key_layout in layout.items():
        again = lazy[key]
        assert again.pieces == key_layout.pieces
        assert (again.index is None) == (key_layout.index is None)
        assert again.index is None or torch.equal(again.index, key_layout.index)


def test_layout_of_fused_keys_gathers_what_the_adapter_writes(tmp_path):
    """GPT-NeoX's per-head ``query_key_value`` and Phi-3's ``qkv_proj`` mix three pieces."""
    for variant in ("gpt_neox_partial_rotary_parallel", "phi3_partial_rotary"):
        folder = build_model(variant, tmp_path / variant)
        view = open_model(folder)
        checkpoint = stored_tensors(folder)
        block = dict(iter_tensors(view.block(0)))
        fused = [
            (key, key_layout)
            for key, key_layout in checkpoint_layout(view.adapter, view).items()
            if key_layout.index is not None and len(key_layout.pieces) == 3
        ]
        assert fused
        for key, key_layout in fused:
            if key_layout.pieces[0].layer != 0:
                continue
            pieces = [block[piece.kind] for piece in key_layout.pieces]
            assert torch.equal(key_layout.assemble(pieces), checkpoint[key])


def explicit_path_losses(a, b, sequences: torch.Tensor, points: int) -> list[float]:
    """The path's losses from explicitly averaged state dicts (both models loaded whole)."""
    model = load_fp32(a)
    start = {name: t.detach().clone() for name, t in model.state_dict().items()}
    end = load_fp32(b).state_dict()
    losses = []
    for lam in lambda_grid(points):
        state = {
            name: torch.lerp(x, end[name], lam) if x.is_floating_point() else x
            for name, x in start.items()
        }
        model.load_state_dict(state)
        losses.append(mean_token_loss(model, sequences).loss)
    return losses


@pytest.mark.parametrize("variant", [*FAMILIES[:4], "gemma2_softcap_windows", "gemma3_multimodal"])
def test_path_losses_equal_explicitly_averaged_models(variant, tmp_path, monkeypatch):
    if variant == "gemma3_multimodal":  # checkpoint keys renamed on load
        a = build_gemma3_multimodal(tmp_path / "a", seed=0)
        b = build_gemma3_multimodal(tmp_path / "b", seed=1)
    else:
        a, b = (build_model(variant, tmp_path / name, seed=s) for s, name in enumerate("ab"))
    sequences = probe_ids(seed=2, shape=(5, 12)) % (VOCAB - 1)  # no image token
    expected = explicit_path_losses(a, b, sequences, points=5)
    # Large tensors are read a slice of rows at a time: make every embedding large.
    monkeypatch.setattr(barrier, "SLICE_ELEMENTS", 200)
    monkeypatch.setattr(blockwise, "MIX_ROWS", 7)  # and mixed a few rows at a time
    got = interpolation_losses(a, b, sequences, points=5).losses
    assert got == pytest.approx(expected, rel=1e-6, abs=0)
    # The head's vocabulary read in slices of 9 rows (a running log-sum-exp): the same losses.
    monkeypatch.setattr(block_runner, "LOGITS_BYTES", 4 * 9 * sequences[:, 1:].numel())
    monkeypatch.setattr(blockwise, "HEAD_TOKENS", 13)  # and the tokens in several passes
    sliced = interpolation_losses(a, b, sequences, points=5).losses
    assert sliced == pytest.approx(expected, rel=1e-6, abs=0)


def test_path_refuses_models_of_different_shapes(tmp_path):
    a = build_model("llama", tmp_path / "a")
    b = build_model("llama", tmp_path / "b", intermediate_size=48)
    with pytest.raises(Exception, match="one shape"):
        interpolation_losses(a, b, probe_ids(shape=(2, 8)), points=3)


def test_large_vocabulary_batches_run_in_pieces_of_whole_sequences(tmp_path, monkeypatch):
    model = load_fp32(build_model("llama", tmp_path / "m"))
    sequences = probe_ids(seed=3, shape=(7, 12))
    whole = mean_token_loss(model, sequences, batch_size=16).loss
    seen = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    # Logits of two sequences fit, three do not.
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(loss, "LOGITS_BYTES", 2 * 12 * vocab * 4 + 1)
    pieces = mean_token_loss(model, sequences, batch_size=16).loss
    assert seen == [2, 2, 2, 1]
    # Exactly what batches of two give; the whole batch's result up to float32 rounding.
    monkeypatch.undo()
    assert pieces == mean_token_loss(model, sequences, batch_size=2).loss
    assert pieces == pytest.approx(whole, rel=1e-6)


def test_readers_give_shapes_slices_and_names_without_reading(tmp_path):
    folder = build_model("llama", tmp_path / "m")
    reader = CheckpointReader(folder)
    name = "model.embed_tokens.weight"
    whole = reader.get(name)
    assert reader.shape(name) == tuple(whole.shape)
    assert torch.equal(reader.rows(name, 5, 9), whole[5:9])
    view = open_model(folder)
    traced = MetaReader(reader)
    embeddings = view.adapter.read_embeddings(traced, view.spec)
    assert embeddings.tokens.is_meta and traced.name_of(embeddings.tokens) == name
    head = view.adapter.read_head(RowsReader(reader, "lm_head.weight", 3, 7), view.spec)
    assert torch.equal(head.weight, reader.get("lm_head.weight")[3:7])
    assert torch.equal(head.norm.weight, reader.get("model.norm.weight"))


@pytest.mark.parametrize("variant", ["llama", "llama_gqa_tied", "gpt2_tied"])
def test_vocabulary_rows_of_checkpoints_moves_and_mixes_come_a_slice_at_a_time(variant, tmp_path):
    from lmc_mergekit.evaluation.blockwise import MixedView
    from lmc_mergekit.models.view import ROW_FIELDS, row_chunks
    from lmc_mergekit.symmetry import apply_transform

    views = [open_model(build_model(variant, tmp_path / n, seed=s)) for s, n in enumerate("ab")]
    tied = views[0].spec.tied_embeddings
    moved = apply_transform(views[1], random_transform(views[1].spec, seed=3, keep_tie=tied))
    for view in (views[0], moved, MixedView(views[0], moved, 0.3)):
        for read, field in ROW_FIELDS.items():
            whole = getattr(view, read)()
            chunks = list(row_chunks(view, read, 5))
            assert len(chunks) == -(-len(getattr(whole, field)) // 5)
            for start, chunk in zip(range(0, VOCAB, 5), chunks, strict=True):
                sliced = replace(whole, **{field: getattr(whole, field)[start : start + 5]})
                for (name, got), (_, want) in zip(
                    iter_tensors(chunk), iter_tensors(sliced), strict=True
                ):
                    assert torch.equal(got, want), (read, name)


def test_large_tensors_are_read_a_slice_at_a_time(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from lmc_mergekit.models import checkpoint

    folder = build_model("llama", tmp_path / "m")
    stored = load_file(str(folder / "model.safetensors"))
    monkeypatch.setattr(checkpoint, "SCAN_ELEMENTS", 3 * stored["lm_head.weight"].shape[1] + 1)
    reads = []
    slicing = checkpoint.CheckpointReader._slice
    monkeypatch.setattr(
        checkpoint.CheckpointReader,
        "_slice",
        lambda self, *args, **within: reads.append(args) or slicing(self, *args, **within),
    )
    reader = CheckpointReader(folder)
    for name in ("lm_head.weight", "model.norm.weight"):
        got = reader.get(name)
        assert got.dtype == stored[name].dtype and torch.equal(got, stored[name])
    vocab = stored["lm_head.weight"].shape[0]
    assert reads == [("lm_head.weight", i, i + 3) for i in range(0, vocab, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tensor_larger_than_a_shard_is_streamed_into_a_shard_of_its_own(dtype, tmp_path):
    """A sink takes a tensor's values a slice at a time; one at least a shard large goes
    straight to disk in its own shard, numbered and indexed among the writer's other shards,
    readable by safetensors, our reader and mergekit's loader; an incomplete one is refused."""
    from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex

    from lmc_mergekit.models.checkpoint import ShardWriter

    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, shape in (("a", (3, 5)), ("big", (40, 30)), ("c", (7,)), ("d", (2, 2)))
    }
    writer = ShardWriter(tmp_path, 1000)
    writer.write({"a": tensors["a"]})
    flat = tensors["big"].reshape(-1)
    with writer.sink("big", (40, 30), dtype) as sink:
        assert sink._file is not None  # streamed, not gathered
        for start in range(0, flat.numel(), 317):  # slices across rows
            sink.write(flat[start : start + 317].float())  # cast to the sink's dtype
    with writer.sink("c", (7,), dtype) as small:
        assert small._file is None
        small.write(tensors["c"][:4])
        small.write(tensors["c"][4:])
    writer.write({"d": tensors["d"]})
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3 and index["a"] != index["big"] != index["c"]
    assert index["c"] == index["d"]
    assert stored_tensors(tmp_path).keys() == tensors.keys()
    loader = LazyTensorLoader(ShardedTensorIndex.from_disk(str(tmp_path)))
    reader = CheckpointReader(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(stored_tensors(tmp_path)[name], tensor)
        assert torch.equal(loader.get_tensor(name), tensor)
        assert torch.equal(reader.get(name), tensor)
    with pytest.raises(ValueError, match="1199 of its 1200 values came"):
        with ShardWriter(tmp_path / "short", 1000).sink("x", (40, 30), dtype) as sink:
            sink.write(flat[:-1])
    with pytest.raises(ValueError, match="more values than its shape"):
        with ShardWriter(tmp_path / "long", 1000).sink("x", (7,), dtype) as sink:
            sink.write(flat[:8])


@pytest.mark.parametrize("variant", [*FAMILIES, "gemma3_multimodal"])
def test_weight_matching_over_row_chunks_is_weight_matching(variant, tmp_path, monkeypatch):
    """Chunks of 7 rows (the embedding and head read a slice at a time, the final norm and
    learned positions counted once) against one chunk of the whole vocabulary."""
    if variant == "gemma3_multimodal":
        a = build_gemma3_multimodal(tmp_path / "a")
    else:
        a = build_model(variant, tmp_path / "a")
    b = tmp_path / "b"
    transform_checkpoint(a, b, random_transform(open_model(a).spec, seed=5), progress=False)

    def match(rows: int, views):
        monkeypatch.setattr(weight_matching, "ROW_CHUNK", rows)
        return match_weights(*views, max_iterations=3)

    whole = match(10**9, [open_model(a), open_model(b)])
    chunked = match(7, [open_model(a), open_model(b)])
    in_memory = match(7, [materialize(open_model(a)), materialize(open_model(b))])
    for result in (chunked, in_memory):
        assert result.iterations == whole.iterations
        # Sums over chunks round differently: the same up to float32 noise (the recovered
        # copy's distance is that noise).
        assert result.distances == pytest.approx(whole.distances, rel=1e-6, abs=1e-6)
        torch.testing.assert_close(
            result.transform.rotation, whole.transform.rotation, rtol=0, atol=1e-6
        )
        for got, want in zip(result.transform.layers, whole.transform.layers, strict=True):
            assert torch.equal(got.head_perm, want.head_perm)
            assert torch.equal(got.ffn_perm, want.ffn_perm)


def test_merged_output_is_written_in_small_shards_unless_asked(tmp_path, monkeypatch):
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from lmc_mergekit.plugin import pipeline

    a, b = (build_model("llama", tmp_path / name, seed=s) for s, name in enumerate("ab"))
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "linear",
            "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)],
            "dtype": "float32",
        }
    )
    monkeypatch.setattr(pipeline, "DEFAULT_SHARD_SIZE", 20_000)
    pipeline.merge(config, tmp_path / "small", MergeOptions(quiet=True))
    pipeline.merge(config, tmp_path / "asked", MergeOptions(quiet=True, out_shard_size=10**9))
    small, asked = (sorted((tmp_path / n).glob("*.safetensors")) for n in ("small", "asked"))
    assert len(small) > 3 and len(asked) == 1
    assert stored_tensors(tmp_path / "small").keys() == stored_tensors(tmp_path / "asked").keys()
    for key, tensor in stored_tensors(tmp_path / "asked").items():
        assert torch.equal(stored_tensors(tmp_path / "small")[key], tensor)


def test_merged_output_is_scanned_for_non_finite_values_a_slice_at_a_time(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from lmc_mergekit.models import checkpoint
    from lmc_mergekit.models.checkpoint import first_non_finite

    clean = {"a": torch.ones(40, 3), "scalar": torch.tensor(2.0), "ids": torch.arange(5)}
    bad = torch.zeros(50, 4)
    bad[33, 1], bad[47, 0] = float("nan"), float("inf")
    monkeypatch.setattr(checkpoint, "SCAN_ELEMENTS", 8)  # two rows at a time
    save_file(clean, str(tmp_path / "model-00001-of-00002.safetensors"))
    assert first_non_finite(tmp_path) is None
    save_file({"b": bad}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert first_non_finite(tmp_path) == ("b", 2)


def _objective_loss_and_grads(ends, spec_folder, ids) -> tuple[float, list[torch.Tensor]]:
    from lmc_mergekit.matching.interpolation import InterpolationObjective
    from lmc_mergekit.models.block_mixing import BlockMixer
    from lmc_mergekit.symmetry.parametrize import LearnedSymmetry

    symmetries = []
    for seed in (3, 4):
        symmetry = LearnedSymmetry(ends[0].spec)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in symmetry.parameters():
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
        symmetries.append(symmetry)
    view = open_model(spec_folder)
    runner = BlockMixer(spec_folder, view.adapter, ends[0].spec, torch.device("cpu"))
    objective = InterpolationObjective(ends, symmetries, runner)
    loss = objective(torch.tensor([0.3, 0.7]), ids)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in objective.symmetries.parameters()]


@pytest.mark.parametrize("variant", ["llama_gqa_tied", "gemma2_softcap_windows", "gpt2_tied"])
def test_learned_matching_loss_in_pieces_and_from_bf16_endpoints(variant, tmp_path, monkeypatch):
    """The loss made a few tokens at a time (and made again in the backward) is the loss of
    the whole batch, gradients included; endpoints held in bf16 run as their float32 values."""
    from lmc_mergekit.models import block_runner
    from lmc_mergekit.models.view import map_tensors
    from lmc_mergekit.symmetry import Transform, apply_transform

    folders = [build_model(variant, tmp_path / name, seed=s) for s, name in enumerate("ab")]
    views = [open_model(folder) for folder in folders]
    absorb = Transform(views[0].spec.num_layers, absorb_norms=True)
    ends = [materialize(apply_transform(view, absorb)) for view in views]
    ids = probe_ids(seed=1, shape=(3, 16))
    whole = _objective_loss_and_grads(ends, folders[0], ids)
    monkeypatch.setattr(block_runner, "LOGITS_BYTES", 7 * 4 * VOCAB)  # 7 tokens a piece
    pieces = _objective_loss_and_grads(ends, folders[0], ids)
    assert pieces[0] == pytest.approx(whole[0], rel=1e-6)
    for got, want in zip(pieces[1], whole[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    def rounded(view, dtype):
        def cast(part):
            return map_tensors(part, lambda t: t.to(dtype))

        return replace(
            view,
            embeddings_=cast(view.embeddings_),
            head_=cast(view.head_),
            blocks=[cast(block) for block in view.blocks],
        )

    held = [rounded(end, torch.bfloat16) for end in ends]
    as_float = [rounded(end, torch.float32) for end in held]
    assert (
        _objective_loss_and_grads(held, folders[0], ids)[0]
        == (_objective_loss_and_grads(as_float, folders[0], ids)[0])
    )


@pytest.mark.parametrize(
    ("variant", "keep_tie"),
    [("llama_gqa_tied", False), ("gpt2_tied", False), ("gemma2_softcap_windows", True)],
)
def test_a_tied_endpoints_head_is_read_through_its_tokens(variant, keep_tie, tmp_path, monkeypatch):
    """A tied endpoint, moved (its final norm absorbed into the head, so that head and tokens
    differ) or not, holds no second vocabulary-sized matrix for its head: a d × d map reads
    its moved tokens, giving the moved head's logits, and the objective's loss and gradients
    are those of the endpoints' held heads."""
    from lmc_mergekit.matching import interpolation
    from lmc_mergekit.matching.interpolation import InterpolationObjective
    from lmc_mergekit.models.block_mixing import BlockMixer
    from lmc_mergekit.models.block_runner import final_norm
    from lmc_mergekit.symmetry import apply_transform
    from lmc_mergekit.symmetry.weight_actions import head_through_tokens

    folders = [build_model(variant, tmp_path / name, seed=s) for s, name in enumerate("ab")]
    views = [open_model(folder) for folder in folders]
    spec = views[0].spec
    assert spec.tied_embeddings
    ends = [views[0]] + [
        apply_transform(view, random_transform(spec, seed=5, keep_tie=keep_tie))
        for view in views[1:]
    ]
    states = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for end in ends:
        head, moved = head_through_tokens(end), end.head()
        tokens = end.embeddings().tokens.double()
        assert head.bias is None and head.weight.shape == (spec.hidden_size,) * 2
        through = final_norm(head.norm, states, end.spec).double() @ head.weight.double().T
        through = through @ tokens.T
        direct = final_norm(moved.norm, states, end.spec).double() @ moved.weight.double().T
        if moved.bias is not None:
            direct = direct + moved.bias.double()
        torch.testing.assert_close(through, direct, rtol=1e-5, atol=1e-5)
    assert head_through_tokens(materialize(views[0])) is None  # not read from a checkpoint
    runner = BlockMixer(folders[0], views[0].adapter, spec, torch.device("cpu"))
    objective = InterpolationObjective(ends, [None, None], runner)
    assert objective.reads_tokens
    assert all(
        len(param) == spec.hidden_size for param in objective.head.parameters() if param.dim()
    )
    ids = probe_ids(seed=1, shape=(3, 16))
    through = _objective_loss_and_grads(ends, folders[0], ids)
    monkeypatch.setattr(interpolation, "head_through_tokens", lambda view: None)
    held = _objective_loss_and_grads(ends, folders[0], ids)
    assert through[0] == pytest.approx(held[0], rel=1e-6)
    for got, want in zip(through[1], held[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_frozen_half_precision_head_is_read_a_slice_at_a_time(monkeypatch):
    """A bf16 head read by float32 states: cast a few rows at a time in the forward and again
    in the backward, giving the product (and the states' gradient) of the whole float32 head."""
    from lmc_mergekit.models import block_runner

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 8, generator=generator).to(torch.bfloat16)
    bias = torch.randn(37, generator=generator)
    states = torch.randn(5, 8, generator=generator, requires_grad=True)
    upstream = torch.randn(5, 37, generator=generator)
    whole = block_runner.head_logits(states, weight.float(), bias)
    (expected,) = torch.autograd.grad(whole, states, upstream)
    monkeypatch.setattr(block_runner, "HEAD_ROWS", 10)  # four slices, the last of 7 rows
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sliced = block_runner.head_logits(states, weight, bias)
    (got,) = torch.autograd.grad(sliced, states, upstream)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Only the stored bf16 head is kept for the backward, no float32 copy of it.
    assert not any(t.dtype == torch.float32 and t.shape[0] >= 10 and t.dim() == 2 for t in saved)


@pytest.mark.parametrize("shape", [(37, 8), (37,), ()])
def test_prepared_inputs_merge_a_slice_of_rows_at_a_time(shape, monkeypatch):
    """The prepared-input methods' average is mergekit's linear kernel on the whole tensor,
    bit for bit, though made a few rows at a time (bf16 inputs, float32 sums)."""
    from mergekit.merge_methods.api import merge_tensors
    from mergekit.merge_methods.base import PerInputValues, TensorGroup

    from lmc_mergekit.plugin import merge_methods

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(3)]
    weights = [0.2, 0.5, 0.3]
    group = TensorGroup.from_tensors(tensors)
    values = PerInputValues(list(zip(range(3), weights, strict=True)))
    method = merge_methods.PreparedInputMerge("lmc_dm", "LMC-DM", "")
    whole = merge_tensors(tensors, "linear", parameters={"weight": weights, "normalize": True})
    monkeypatch.setattr(merge_methods, "MERGE_ELEMENTS", 80)  # ten rows of 8 at a time
    sliced = method.merge_group(group, weight=values, normalize=True)
    assert sliced.dtype == torch.bfloat16 and torch.equal(sliced, whole)
