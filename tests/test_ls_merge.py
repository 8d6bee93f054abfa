"""ls_merge end to end: the checkpoint layout, the pre-merge pass, the registered method inside
mergekit's executor (weights per tensor, posterior samples), heterogeneous merges, the report,
the autoencoder cache and its resumable training, and every bad input of the issue."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from tiny_models import VARIANTS, build_model, stored_tensors
from tokenizer_helpers import make_tokenizer, model_with_tokenizer, save_tokenizer
from transformers import AutoModelForCausalLM

from lmc_mergekit.latent.chunks import Normalisation, model_tensors
from lmc_mergekit.latent.codec import EncodedTensor
from lmc_mergekit.latent.heterogeneous import layer_map, resample_rows, transport_source
from lmc_mergekit.latent.merging import posterior_average, weighted_average
from lmc_mergekit.latent.store import open_store
from lmc_mergekit.latent.tensor_merge import autoencoder_at, decode_key, prepared_layout
from lmc_mergekit.latent.training import TrainingConfig, autoencoder_config_for, train_autoencoder
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.layout import OUTSIDE_BLOCKS, Piece, checkpoint_layout
from lmc_mergekit.plugin.cli import mergekit_yaml_main

# Small enough for seconds per recipe; the benchmarks train real autoencoders.
FAST = {"steps": 30, "width": 32, "seq_len": 32, "eval_sequences": 8, "noise_floor": False}


def run_yaml(recipe: dict, tmp_path: Path, out: Path):
    path = tmp_path / f"recipe-{time.monotonic_ns()}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


def recipe_for(*models, weights=None, base=None, **latent) -> dict:
    weights = weights or [1.0] * len(models)
    recipe = {
        "merge_method": "ls_merge",
        "models": [
            {"model": str(m), "parameters": {"weight": w}}
            for m, w in zip(models, weights, strict=True)
        ],
        "dtype": "float32",
        "latent": {**FAST, **latent},
    }
    if base is not None:
        recipe["base_model"] = str(base)
    return recipe


def merged_ok(result, out: Path) -> dict:
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    return json.loads((out / "ls_report.json").read_text())


def prepared_folders(report: dict) -> list[Path]:
    """The prepared folder of each input, as the report names it."""
    return [Path(entry["prepared"]) for entry in report["inputs"]]


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    return (
        model_with_tokenizer(tmp_path / "a", "llama", seed=0),
        model_with_tokenizer(tmp_path / "b", "llama", seed=1),
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_layout_rebuilds_every_checkpoint_tensor_from_canonical_pieces(variant, tmp_path):
    folder = build_model(variant, tmp_path / variant)
    view = open_model(folder)
    layout = checkpoint_layout(view.adapter, view)
    stored = stored_tensors(folder)
    canonical = {(t.kind, t.layer): t.tensor for t in model_tensors(view)}
    assert set(layout) == set(stored)
    used = []
    for key, key_layout in layout.items():
        pieces = [canonical[(p.kind, p.layer)] for p in key_layout.pieces]
        assert torch.equal(key_layout.assemble(pieces), stored[key]), key
        used += [(p.kind, p.layer) for p in key_layout.pieces]
    # Every canonical tensor feeds exactly one key (a tied head feeds none).
    assert len(used) == len(set(used))
    missing = set(canonical) - set(used)
    assert missing <= {("head.weight", OUTSIDE_BLOCKS)}
    assert bool(missing) == view.spec.tied_embeddings


@pytest.mark.slow
def test_merge_happens_in_mergekit_with_per_tensor_weights(pair, tmp_path):
    a, b = pair
    recipe = recipe_for(a, b, noise_floor=True)
    # mergekit's own per-tensor filters: the MLPs come from a alone, the rest half and half.
    recipe["models"][1]["parameters"]["weight"] = [{"filter": "mlp", "value": 0.0}, {"value": 1.0}]
    out = tmp_path / "merged"
    report = merged_ok(run_yaml(recipe, tmp_path, out), out)
    merged, original_a = stored_tensors(out), stored_tensors(a)
    prepared = prepared_folders(report)
    decoded_a = stored_tensors(prepared[0])
    # With the residuals kept (the default), all weight on a gives a's own weights back.
    mlp = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(merged[mlp], original_a[mlp], rtol=0, atol=1e-6)
    # Attention: the decode of the averaged latents (not the average of the decodes) plus the
    # averaged residuals.
    q = "model.layers.0.self_attn.q_proj.weight"
    stores = [open_store(str(folder)) for folder in prepared]
    (za, sa), (zb, sb) = (store.get(q) for store in stores)
    autoencoder = autoencoder_at(str(stores[0].autoencoder), "cpu")
    decoded = decode_key(
        autoencoder, prepared_layout(str(prepared[0]))[q], (za[0] + zb[0]) / 2, (sa + sb) / 2
    )
    residual = (stores[0].residual(q) + stores[1].residual(q)) / 2
    torch.testing.assert_close(merged[q], (decoded + residual).float(), rtol=0, atol=1e-5)
    assert not torch.allclose(merged[q], (original_a[q] + stored_tensors(b)[q]) / 2, atol=1e-4)
    # Without them: the paper's plain decode (same prepared inputs, only the merge differs).
    plain = tmp_path / "plain"
    recipe["latent"]["keep_residuals"] = False
    merged_ok(run_yaml(recipe, tmp_path, plain), plain)
    plain_tensors = stored_tensors(plain)
    torch.testing.assert_close(plain_tensors[mlp], decoded_a[mlp], rtol=0, atol=1e-6)
    torch.testing.assert_close(plain_tensors[q], decoded.float(), rtol=0, atol=1e-5)
    # The report: reconstruction per tensor, λ = 0 losses, merged, weight average, noise floor.
    view = open_model(a)
    assert len(report["inputs"][0]["reconstruction_error"]) == len(model_tensors(view))
    for entry in report["inputs"]:
        assert set(entry["test_loss"]) == {"original", "decoded"}
    assert report["merged"]["test_loss"] > 0
    assert report["weight_average"]["test_loss"] > 0
    noise = report["noise_floor"]
    assert noise["seeds"] == [0, 1] and noise["spread"] == pytest.approx(
        abs(noise["merged_test_losses"][0] - noise["merged_test_losses"][1])
    )
    card = (out / "README.md").read_text()
    assert "Latent-space merge" in card and "Noise floor" in card


def test_bfloat16_checkpoints_merge_and_stay_bfloat16(tmp_path):
    folders = []
    for seed in (0, 1):
        folder = model_with_tokenizer(tmp_path / f"m{seed}", "llama", seed=seed)
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(folder)
        folders.append(folder)
    recipe = recipe_for(*folders, evaluate=False)
    recipe["dtype"] = "bfloat16"
    out = tmp_path / "merged"
    merged_ok(run_yaml(recipe, tmp_path, out), out)
    assert {t.dtype for t in stored_tensors(out).values()} == {torch.bfloat16}


@pytest.mark.slow
def test_second_recipe_over_the_same_models_reuses_the_autoencoder(pair, tmp_path):
    a, b = pair
    first = merged_ok(run_yaml(recipe_for(a, b), tmp_path, tmp_path / "one"), tmp_path / "one")
    assert first["autoencoders"][0]["record"]["source"] == "trained"
    # A setting the autoencoder does not depend on: new prepared inputs, same autoencoder.
    second_recipe = recipe_for(a, b, weights=[0.7, 0.3], shrinkage=0.2, evaluate=False)
    second = merged_ok(run_yaml(second_recipe, tmp_path, tmp_path / "two"), tmp_path / "two")
    assert second["autoencoders"][0]["record"]["source"] == "cache"
    assert second["autoencoders"][0]["path"] == first["autoencoders"][0]["path"]


def test_extra_models_train_the_autoencoder_and_must_share_the_family(pair, tmp_path):
    a, b = pair
    extra = model_with_tokenizer(tmp_path / "extra", "llama", seed=2)
    out = tmp_path / "merged"
    recipe = recipe_for(a, b, evaluate=False, extra_models=[str(extra)])
    report = merged_ok(run_yaml(recipe, tmp_path, out), out)
    assert str(extra.resolve()) in report["autoencoders"][0]["record"]["models"]
    assert len(report["inputs"]) == 2  # trained on, not merged
    other = model_with_tokenizer(tmp_path / "other", "gpt_neox_partial_rotary_parallel")
    refused_out = tmp_path / "refused"
    recipe = recipe_for(a, b, extra_models=[str(other)])
    refused(run_yaml(recipe, tmp_path, refused_out), refused_out, "one family")


def test_a_tensor_merges_a_slice_at_a_time_as_it_merges_whole(pair, tmp_path, monkeypatch):
    """The merge reads, draws, averages, decodes and adds the residuals a slice at a time (no
    input's latents, decode or residual held whole): with slices of a few rows, the merged
    tensor is bit for bit the one computed from the whole tensors."""
    from lmc_mergekit.latent import codec, merging, tensor_merge

    out = tmp_path / "merged"
    report = merged_ok(run_yaml(recipe_for(*pair, evaluate=False), tmp_path, out), out)
    folders = [str(folder) for folder in prepared_folders(report)]
    stores = [open_store(folder) for folder in folders]
    autoencoder = autoencoder_at(str(stores[0].autoencoder), "cpu")
    monkeypatch.setattr(merging, "SLICE", 64)  # draws and averages of 6 rows of latents
    monkeypatch.setattr(codec, "WINDOW_BATCH", 2)  # decodes of 16 chunks, across rows
    weights, samples, seed = [0.3, 0.7], 2, 7
    for key in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight"):
        draws, stats = [], []
        for index, store in enumerate(stores):
            latents, normalisations = store.get(key)
            generator = tensor_merge._generator(seed, key, index)
            draws.append(posterior_average(latents[0], latents[1], samples, generator))
            stats.append(normalisations)
        layout = prepared_layout(folders[0])[key]
        decoded = decode_key(
            autoencoder, layout, weighted_average(draws, weights), weighted_average(stats, weights)
        )
        residual = weighted_average([store.residual(key) for store in stores], weights)
        got = tensor_merge.merge_key(
            key, folders, weights, True, samples, seed, True, torch.device("cpu"), torch.float32
        )
        assert torch.equal(got, (decoded + residual).float()), key


@pytest.mark.slow
def test_self_merge_averages_posterior_samples(tmp_path):
    model = model_with_tokenizer(tmp_path / "m", "llama", seed=0)

    def merge(name: str, **latent) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        merged_ok(run_yaml(recipe_for(model, evaluate=False, **latent), tmp_path, out), out)
        return stored_tensors(out)

    one, sixteen = merge("one", samples=1), merge("sixteen", samples=16)
    again = merge("again", samples=16)
    other_seed = merge("other", samples=16, sample_seed=1)
    report = json.loads((tmp_path / "one" / "ls_report.json").read_text())
    assert report["kind"] == "self-merge"
    mean = stored_tensors(model)  # the residual kept: the posterior mean gives the weights back
    key = "model.layers.0.mlp.up_proj.weight"
    assert all(torch.equal(sixteen[k], again[k]) for k in sixteen)
    assert not torch.equal(sixteen[key], other_seed[key])
    # Averaging K draws shrinks the distance to the posterior mean's weights (about 1/√K).
    far = sum(float((one[k] - mean[k]).norm()) for k in mean)
    near = sum(float((sixteen[k] - mean[k]).norm()) for k in mean)
    assert 0 < near < 0.6 * far


@pytest.mark.slow
def test_heterogeneous_merge_decodes_with_the_target_shapes(tmp_path):
    target = model_with_tokenizer(tmp_path / "target", "llama", seed=0)
    vocab = len(make_tokenizer())
    source = build_model(
        "llama",
        tmp_path / "source",
        seed=1,
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=3,
        intermediate_size=64,
    )
    save_tokenizer(source)
    out = tmp_path / "merged"
    recipe = recipe_for(target, source, weights=[0.9, 0.1], base=target)
    report = merged_ok(run_yaml(recipe, tmp_path, out), out)
    assert report["kind"] == "heterogeneous"
    assert [e["role"] for e in report["inputs"]] == ["target", "source"]
    assert report["transport"]["layer_map"] == {"-1": -1, "0": 0, "1": 2}
    merged, original = stored_tensors(out), stored_tensors(target)
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in original.items()}
    # λ = 0 gives the target back (residual kept), or its plain encode–decode (not kept).
    decoded_target = stored_tensors(prepared_folders(report)[0])
    for keep, expected in ((True, original), (False, decoded_target)):
        zero = tmp_path / f"zero-{keep}"
        recipe = recipe_for(
            target, source, weights=[1.0, 0.0], base=target, evaluate=False, keep_residuals=keep
        )
        merged_ok(run_yaml(recipe, tmp_path, zero), zero)
        for key, value in stored_tensors(zero).items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], original[q], atol=1e-4)
    # The same inputs without naming the target: refused, although their encodings are cached.
    refused_out = tmp_path / "no-target"
    recipe = recipe_for(target, source, weights=[0.9, 0.1], evaluate=False)
    refused(run_yaml(recipe, tmp_path, refused_out), refused_out, "heterogeneous", "base_model")


def test_layer_map_and_resampling():
    assert layer_map(4, 2) == {OUTSIDE_BLOCKS: OUTSIDE_BLOCKS, 0: 0, 1: 3}
    assert layer_map(2, 4) == {OUTSIDE_BLOCKS: OUTSIDE_BLOCKS, 0: 0, 1: 0, 2: 1, 3: 1}
    rows = torch.randn(5, 3)
    resampled = resample_rows(rows, 9)
    assert resampled.shape == (9, 3)
    assert torch.allclose(resampled[0], rows[0]) and torch.allclose(resampled[-1], rows[-1])
    assert torch.allclose(resampled[2], rows[1])  # 9 rows put every other one on an original


def test_transported_source_takes_on_each_target_layer_distribution():
    generator = torch.Generator().manual_seed(0)

    def encoded(kind: str, layer: int, rows: int, shift: float) -> EncodedTensor:
        mean = torch.randn(rows, 4, generator=generator) * (1 + layer) + shift
        return EncodedTensor(kind, layer, mean, torch.zeros(rows, 4), Normalisation((rows,), 0, 1))

    kinds = ("attn.q", "mlp.up")
    source = {(k, layer): encoded(k, layer, 30, 5.0) for k in kinds for layer in range(3)}
    target = {(k, layer): encoded(k, layer, 60, -2.0) for k in kinds for layer in range(2)}
    pieces = [Piece(k, layer, (60,)) for k in kinds for layer in range(2)]
    moved, record = transport_source(source, target, pieces, layer_map(3, 2), 0.0, "source")
    assert record["1"]["source_layer"] == 2
    for layer in range(2):
        got = torch.cat([moved[(k, layer)].mean for k in kinds]).double()
        want = torch.cat([target[(k, layer)].mean for k in kinds]).double()
        assert got.shape == want.shape
        # Resampling interpolates rows, so the moments match closely rather than exactly.
        assert torch.allclose(got.mean(0), want.mean(0), atol=0.3)
        assert moved[("attn.q", layer)].norm == target[("attn.q", layer)].norm


@pytest.mark.slow
def test_autoencoder_training_resumes_after_a_kill(tmp_path):
    """A training process killed right after it reported its first checkpoint resumes to the
    weights of an uninterrupted run. The child stops at the checkpoint and says so on its
    stdout; the parent kills it on that line (no polling window a fast machine could miss)."""
    script = f"""
import sys, threading, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from tiny_models import build_model
from lmc_mergekit.latent.chunks import model_tensors
from lmc_mergekit.latent.training import TrainingConfig, autoencoder_config_for, train_autoencoder
from lmc_mergekit.models.adapters import open_model

def stop(step):
    print(f"checkpoint {{step}}", flush=True)
    threading.Event().wait()  # held here until the parent kills this process

torch.set_num_threads(1)
named = model_tensors(open_model(build_model("llama", Path(sys.argv[1]))))
train_autoencoder(named, autoencoder_config_for(named, width=16, depth=1),
    TrainingConfig(steps=300, batch_size=4), progress=False, checkpoint=Path(sys.argv[2]),
    checkpoint_every=20, on_checkpoint=stop)
"""
    checkpoint = tmp_path / "state" / "ae.pt"
    args = [sys.executable, "-c", script, str(tmp_path / "m"), str(checkpoint)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    reported = ""
    try:
        # Each line blocks until the child writes one; it stops writing at its checkpoint.
        reported = next((line for line in process.stdout if line.startswith("checkpoint")), "")
    finally:
        process.kill()
        process.wait()
        process.stdout.close()
    assert reported == "checkpoint 20\n", f"the child ended without a checkpoint: {reported!r}"
    saved = torch.load(checkpoint, weights_only=False)["step"]
    assert saved == 20
    named = model_tensors(open_model(tmp_path / "m"))
    config = autoencoder_config_for(named, width=16, depth=1)
    training = TrainingConfig(steps=300, batch_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed process's arithmetic, to the bit
    try:
        resumed, record = train_autoencoder(
            named, config, training, progress=False, checkpoint=checkpoint
        )
        uninterrupted, _ = train_autoencoder(named, config, training, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert record["resumed_at"] == saved and not checkpoint.exists()
    for name, value in uninterrupted.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)


# ---- bad input: each a one-line error, nothing written --------------------------------------


def refused(result, out: Path, *phrases: str) -> None:
    assert result.exit_code != 0
    message = result.output.strip().splitlines()[-1]
    for phrase in phrases:
        assert phrase in message, message
    assert not out.exists()


def test_models_of_different_families_are_refused(tmp_path):
    a = model_with_tokenizer(tmp_path / "a", "llama")
    b = model_with_tokenizer(tmp_path / "b", "gpt_neox_partial_rotary_parallel")
    out = tmp_path / "out"
    refused(run_yaml(recipe_for(a, b), tmp_path, out), out, "one family", "gpt_neox")


def test_models_of_different_shapes_need_a_target(tmp_path):
    a = model_with_tokenizer(tmp_path / "a", "llama")
    b = build_model("llama", tmp_path / "b", vocab_size=len(make_tokenizer()), num_hidden_layers=3)
    save_tokenizer(b)
    out = tmp_path / "out"
    refused(run_yaml(recipe_for(a, b), tmp_path, out), out, "heterogeneous", "base_model")


def test_heterogeneous_pair_without_a_layer_mapping_is_refused(tmp_path):
    vocab = len(make_tokenizer())
    target = build_model("llama", tmp_path / "t", vocab_size=vocab, attention_bias=True)
    source = build_model("llama", tmp_path / "s", vocab_size=vocab, hidden_size=32)
    for folder in (target, source):
        save_tokenizer(folder)
    out = tmp_path / "out"
    result = run_yaml(recipe_for(target, source, base=target), tmp_path, out)
    refused(result, out, "no layer mapping", "_bias")


def test_across_tokenizers_and_families_the_target_keeps_its_own_tensors(tmp_path):
    """The LS-Merge paper's setting (one family's model injected into another's): blocks map by
    relative depth and tensors by role; what has no counterpart (embeddings and head across
    tokenizers, the norms only the target's family has) keeps the target's own latents."""
    target = model_with_tokenizer(tmp_path / "t", "gemma2_softcap_windows", book=0)
    source = model_with_tokenizer(tmp_path / "s", "llama", vocab_size=280, book=1)
    out = tmp_path / "out"
    recipe = recipe_for(target, source, weights=[0.9, 0.1], base=target, eval_sequences=4)
    report = merged_ok(run_yaml(recipe, tmp_path, out), out)
    assert report["kind"] == "heterogeneous"
    assert [e["role"] for e in report["inputs"]] == ["target", "source"]
    kept = set(report["transport"]["target_only"])
    assert {"embeddings.tokens@-1", "head.norm.weight@-1"} <= kept  # other tokenizer
    assert {"attn_post_norm.weight@0", "mlp_post_norm.weight@1"} <= kept  # only Gemma 2 has
    assert "attn.q@0" not in kept
    merged, original = stored_tensors(out), stored_tensors(target)
    assert merged.keys() == original.keys()
    for key in ("model.embed_tokens.weight", "model.layers.0.post_attention_layernorm.weight"):
        torch.testing.assert_close(merged[key], original[key], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], original[q], atol=1e-4)
    # Each input is measured with its own tokenizer; the merge with the target's.
    assert all(set(entry["test_loss"]) == {"original", "decoded"} for entry in report["inputs"])
    # Without a target named, models of two families are refused.
    refused_out = tmp_path / "refused"
    recipe = recipe_for(target, source, evaluate=False)
    refused(run_yaml(recipe, tmp_path, refused_out), refused_out, "one family", "base_model")


def test_an_autoencoder_that_does_not_fit_is_refused(pair, tmp_path):
    a, b = pair
    first = merged_ok(
        run_yaml(recipe_for(a, b, evaluate=False), tmp_path, tmp_path / "m"), tmp_path / "m"
    )
    trained = first["autoencoders"][0]["path"]
    neox = [
        model_with_tokenizer(tmp_path / f"n{i}", "gpt_neox_partial_rotary_parallel", seed=i)
        for i in range(2)
    ]
    out = tmp_path / "out"
    result = run_yaml(recipe_for(*neox, autoencoder=trained), tmp_path, out)
    refused(result, out, "does not fit", "kind")
    deeper = [
        build_model(
            "llama",
            tmp_path / f"d{i}",
            seed=i,
            vocab_size=len(make_tokenizer()),
            num_hidden_layers=3,
        )
        for i in range(2)
    ]
    for folder in deeper:
        save_tokenizer(folder)
    result = run_yaml(recipe_for(*deeper, autoencoder=trained), tmp_path, out)
    refused(result, out, "does not fit", "layers 0-1")
    result = run_yaml(
        recipe_for(a, b, autoencoder=str(tmp_path / "nope.safetensors")), tmp_path, out
    )
    refused(result, out, "does not exist")


@pytest.mark.parametrize("ratio, phrase", [(0.5, "greater than or equal to 1"), (100, "less")])
def test_compression_ratio_out_of_range_is_refused(pair, tmp_path, ratio, phrase):
    out = tmp_path / "out"
    result = run_yaml(recipe_for(*pair, compression_ratio=ratio), tmp_path, out)
    refused(result, out, "compression_ratio", phrase)


def test_one_model_without_self_merge_setting_is_refused(pair, tmp_path):
    out = tmp_path / "out"
    refused(run_yaml(recipe_for(pair[0]), tmp_path, out), out, "one model", "samples")
    # Also when a self-merge of it is cached (samples steer only the merge, not the pass).
    merged_ok(
        run_yaml(recipe_for(pair[0], samples=1), tmp_path, tmp_path / "self"), tmp_path / "self"
    )
    refused(run_yaml(recipe_for(pair[0]), tmp_path, out), out, "one model", "samples")


def test_recipes_without_weights_are_compared_with_weight_averaging(pair, tmp_path):
    recipe = recipe_for(*pair)
    for entry in recipe["models"]:
        del entry["parameters"]  # the plugin weighs every model 1; mergekit's linear needs it
    report = merged_ok(run_yaml(recipe, tmp_path, tmp_path / "out"), tmp_path / "out")
    assert report["weight_average"]["test_loss"] > 0
    assert report["noise_floor"] is None  # evaluated, without a second autoencoder (FAST)


# ---- a damaged cache: computed again, never a traceback -------------------------------------


def _truncate(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: len(text) // 2], encoding="utf-8")


@pytest.mark.slow
def test_a_damaged_cache_is_computed_again(pair, tmp_path, caplog):
    """Truncated preparation and report records, then a missing and a truncated training.json
    of the cached autoencoder: each rerun warns, computes the damaged entry again and writes
    the same merged weights as the first run."""
    cache = tmp_path / "cache"
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe_for(*pair)))

    def run(name: str) -> bytes:
        out = tmp_path / name
        args = [str(path), str(out), "--quiet", "--lmc-cache", str(cache)]
        result = CliRunner().invoke(mergekit_yaml_main, args)
        merged_ok(result, out)
        return (out / "model.safetensors").read_bytes()

    first = run("first")
    (preparation,) = cache.glob("ls_merge/*/preparation.json")
    (report,) = cache.glob("ls_merge/measurements/*/ls_report.json")
    (training,) = cache.glob("ls_merge/autoencoders/*/training.json")
    damages = {
        "records": lambda: (_truncate(preparation), _truncate(report)),
        "missing": lambda: (_truncate(preparation), training.unlink()),
        "truncated": lambda: (_truncate(preparation), _truncate(training)),
    }
    for name, damage in damages.items():
        damage()
        caplog.clear()
        assert run(name) == first, name
        warned = " | ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert f"cache entry {preparation.parent} is damaged" in warned, warned
        if name == "records":
            assert f"cache entry {report.parent} is damaged" in warned, warned
        else:
            assert f"cached autoencoder {training.parent} is damaged" in warned, warned
        assert json.loads(preparation.read_text())["autoencoder"]["record"]
        assert json.loads(training.read_text())["steps"] == FAST["steps"]
        assert json.loads(report.read_text())["merged"]
    assert not list(cache.rglob(".*partial-*"))
