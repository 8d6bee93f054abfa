"""The weight autoencoder of ls_merge: chunking, training, encoding and decoding one tensor."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_model, stored_tensors

from lmc_mergekit.errors import LmcError
from lmc_mergekit.latent.autoencoder import (
    AutoencoderConfig,
    WeightAutoencoder,
    Windows,
    load_autoencoder,
    save_autoencoder,
)
from lmc_mergekit.latent.chunks import NamedTensor, from_chunks, model_tensors, to_chunks
from lmc_mergekit.latent.codec import decode_tensor, encode_tensor, relative_error
from lmc_mergekit.latent.merging import gaussian_transport, posterior_average, weighted_average
from lmc_mergekit.latent.training import (
    TrainingConfig,
    WindowStream,
    autoencoder_config_for,
    train_autoencoder,
)
from lmc_mergekit.models.adapters import open_model

TINY = {"chunk_size": 16, "width": 32, "depth": 1, "heads": 2, "window": 8}


@pytest.mark.parametrize("shape", [(7, 5), (33,), (1,), (2, 3, 4)])
def test_chunks_round_trip(shape):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1
    chunks, norm = to_chunks(tensor, 16)
    assert chunks.shape == (-(-tensor.numel() // 16), 16)
    assert torch.allclose(from_chunks(chunks, norm).float(), tensor, atol=1e-5)
    constant = torch.ones(shape)
    assert torch.equal(from_chunks(*to_chunks(constant, 16)).float(), constant)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("latent") / "llama")


@pytest.fixture(scope="module")
def tensors(llama):
    return model_tensors(open_model(llama))


@pytest.fixture(scope="module")
def trained(tensors):
    config = autoencoder_config_for(tensors, **TINY)
    return train_autoencoder(tensors, config, TrainingConfig(steps=300, lr=3e-3), progress=False)


def mean_error(model, tensors) -> float:
    errors = [
        relative_error(t.tensor, decode_tensor(model, encode_tensor(model, t))) for t in tensors
    ]
    return sum(errors) / len(errors)


def test_model_tensors_are_named_by_kind_and_layer(tensors):
    names = {(t.kind, t.layer) for t in tensors}
    assert ("embeddings.tokens", -1) in names and ("head.weight", -1) in names
    assert {("attn.q", 0), ("attn.q", 1), ("mlp.gate", 1), ("attn_norm.weight", 0)} <= names


def test_training_learns_to_reconstruct_the_weights(tensors, trained):
    model, record = trained
    torch.manual_seed(0)
    untrained = WeightAutoencoder(model.config).eval()
    assert mean_error(model, tensors) < 0.6 * mean_error(untrained, tensors)
    assert record["autoencoder_steps"] == 150 and record["final_kl"] > 0
    assert record["chunks"] == sum(-(-t.tensor.numel() // 16) for t in tensors)
    assert model.config.latent_dim == 10  # 16 / 1.6


def test_the_window_stream_draws_what_a_bank_of_every_window_holds(tensors):
    """Training draws its windows from the tensors as it goes; each is the window that cutting
    every tensor into chunks and windows up front gives (values, positions, padding, tags)."""
    model = WeightAutoencoder(autoencoder_config_for(tensors, **TINY))
    bank, kinds, layers = [], [], []
    for named in tensors:
        windows = Windows.of(to_chunks(named.tensor, 16)[0], 8)
        bank.append(windows)
        tags = model.tags(named.kind, named.layer, windows.chunks.shape[0])
        kinds.append(tags[0])
        layers.append(tags[1])
    stream = WindowStream(model, tensors, "cpu")
    assert len(stream) == sum(w.chunks.shape[0] for w in bank) and len(stream) > 20
    picks = torch.randperm(len(stream), generator=torch.Generator().manual_seed(0))
    drawn, drawn_kinds, drawn_layers = stream.draw(picks)
    for field in ("chunks", "positions", "valid"):
        whole = torch.cat([getattr(w, field) for w in bank])
        assert torch.equal(getattr(drawn, field), whole[picks]), field
    assert torch.equal(drawn_kinds, torch.cat(kinds)[picks])
    assert torch.equal(drawn_layers, torch.cat(layers)[picks])


def test_one_tensor_encodes_and_decodes_alone_and_the_model_saves(tensors, trained, tmp_path):
    model, _ = trained
    named = next(t for t in tensors if t.kind == "mlp.down" and t.layer == 1)
    encoded = encode_tensor(model, named)
    assert encoded.mean.shape == (-(-named.tensor.numel() // 16), 10)
    decoded = decode_tensor(model, encoded)
    assert decoded.shape == named.tensor.shape
    sample = posterior_average(encoded.mean, encoded.log_var, 1, torch.Generator().manual_seed(0))
    assert not torch.equal(sample, encoded.mean)
    assert decode_tensor(model, encoded, sample).shape == named.tensor.shape

    save_autoencoder(model, tmp_path / "ae.safetensors")
    loaded = load_autoencoder(tmp_path / "ae.safetensors")
    assert loaded.config == model.config
    assert torch.equal(decode_tensor(loaded, encode_tensor(loaded, named)), decoded)


def test_a_tensor_encodes_and_decodes_the_same_in_batches_of_windows(tensors, trained, monkeypatch):
    from lmc_mergekit.latent import codec

    model, _ = trained
    named = max(tensors, key=lambda t: t.tensor.numel())
    whole = encode_tensor(model, named)
    decoded = decode_tensor(model, whole)
    monkeypatch.setattr(codec, "WINDOW_BATCH", 3)
    windows_of_three = 3 * model.config.window
    assert len(list(codec._batch_rows(model, 200))) == -(-200 // windows_of_three)
    batched = encode_tensor(model, named)
    torch.testing.assert_close(batched.mean, whole.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched.log_var, whole.log_var, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_tensor(model, whole), decoded, atol=1e-5, rtol=1e-5)


def test_tensors_the_autoencoder_cannot_encode_are_refused(trained):
    model, _ = trained
    with pytest.raises(LmcError, match=r"not trained on tensors of kind 'attn\.qq'"):
        encode_tensor(model, NamedTensor("attn.qq", 0, torch.zeros(4, 4)))
    with pytest.raises(LmcError, match="knows layers 0-1, not layer 5"):
        encode_tensor(model, NamedTensor("attn.q", 5, torch.zeros(4, 4)))
    with pytest.raises(LmcError, match=r"compression ratio 0\.5 is outside"):
        AutoencoderConfig(kinds=("a",), layers=1, compression_ratio=0.5)


def test_weighted_average_and_posterior_average(trained, tensors):
    a, b = torch.ones(3, 2), torch.zeros(3, 2)
    assert torch.allclose(weighted_average([a, b], [3.0, 1.0]), torch.full((3, 2), 0.75).double())
    assert torch.allclose(weighted_average([a, b], [3.0, 1.0], normalize=False), 3 * a.double())
    with pytest.raises(LmcError, match="different shapes"):
        weighted_average([a, torch.zeros(2, 2)], [1.0, 1.0])
    with pytest.raises(LmcError, match="sum to zero"):
        weighted_average([a, b], [1.0, -1.0])
    model, _ = trained
    encoded = encode_tensor(model, tensors[0])

    def average(samples: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return posterior_average(encoded.mean, encoded.log_var, samples, generator)

    assert torch.equal(average(0), encoded.mean.double())
    # Averaging samples converges to the posterior mean.
    assert (average(400) - encoded.mean).norm() < 0.2 * (average(1) - encoded.mean).norm()


def test_posterior_draws_made_a_slice_of_rows_at_a_time_are_independent(monkeypatch):
    """Draws are made a few rows at a time: every slice draws its own noise (no slice repeats
    another's), each row's draw is the mean's plus noise of its own spread, and the average
    of many draws still converges to the mean."""
    from lmc_mergekit.latent import merging

    monkeypatch.setattr(merging, "SLICE", 8)  # two rows of four latents a slice
    mean = torch.arange(24.0).reshape(6, 4)
    log_var = torch.log(torch.tensor([1e-4, 1e-2, 1.0, 4.0])).expand(6, 4)

    def draw(samples):
        return posterior_average(mean, log_var, samples, torch.Generator().manual_seed(0))

    noise = draw(1) - mean.double()
    for first, second in ((0, 2), (0, 4), (2, 4)):
        assert not torch.allclose(noise[first : first + 2], noise[second : second + 2])
    spread = noise.abs().mean(0)
    assert spread[0] < 0.05 and spread[1] < 0.5 and spread[3] > spread[2] > spread[1]
    assert (draw(400) - mean).abs().max() < 0.5


def test_gaussian_transport_moves_one_distribution_onto_the_other():
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(4000, 3, generator=generator) @ torch.tensor(
        [[2.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.0, 0.3, 0.2]]
    ) + torch.tensor([1.0, -2.0, 0.5])
    target = torch.randn(3000, 3, generator=generator) * torch.tensor([0.5, 3.0, 1.0]) - 1.0
    transport = gaussian_transport(source, target, shrinkage=0.0)
    moved = transport(source).double()
    assert torch.allclose(moved.mean(0), target.double().mean(0), atol=1e-6)
    assert torch.allclose(torch.cov(moved.T), torch.cov(target.double().T), atol=1e-6)
    # The map is symmetric positive definite (the Brenier map of two Gaussians).
    assert torch.allclose(transport.matrix, transport.matrix.T, atol=1e-10)
    assert torch.linalg.eigvalsh(transport.matrix).min() > 0
    identity = gaussian_transport(target, target, shrinkage=0.3)
    assert torch.allclose(identity.matrix, torch.eye(3, dtype=torch.float64), atol=1e-8)
    with pytest.raises(LmcError, match="common dimension"):
        gaussian_transport(source, target[:, :2])


def test_a_prepared_folder_streamed_shard_by_shard_holds_what_it_holds_written_whole(
    llama, trained, tmp_path, monkeypatch
):
    """Tensors at least a shard large are decoded, compared and written a batch of windows at
    a time, each into a shard of its own (so that a vocabulary-sized decode, residual or
    latent matrix is never held whole). With shards so small that every tensor streams, the
    prepared folder holds exactly what it holds when every tensor is gathered and written
    whole, and reports the same reconstruction errors."""
    from lmc_mergekit.latent import codec, prepare, store

    model, _ = trained
    monkeypatch.setattr(codec, "WINDOW_BATCH", 2)  # several slices per tensor, both runs
    folders, entries = [tmp_path / "whole", tmp_path / "streamed"], []
    for folder in folders:
        if folder.name == "streamed":
            monkeypatch.setattr(prepare, "DEFAULT_SHARD_SIZE", 64)
            monkeypatch.setattr(store, "SHARD_SIZE", 64)
        inputs = [prepare.LatentInput.read(open_model(llama))]
        entries += prepare.prepare_latents(
            model, tmp_path / "ae.safetensors", inputs, [folder], False, 0.0, False
        )[0]
    for sub in (".", "latents", "latents/residuals"):
        whole, streamed = (stored_tensors(folder / sub) for folder in folders)
        assert whole.keys() == streamed.keys() and len(whole) > 3, sub
        for key, tensor in whole.items():
            assert torch.equal(streamed[key], tensor), (sub, key)
        files = [sorted((folder / sub).glob("*.safetensors")) for folder in folders]
        assert len(files[1]) > len(files[0]), sub  # the streamed tensors' own shards
    errors = [entry["reconstruction_error"] for entry in entries]
    assert errors[0].keys() == errors[1].keys()
    assert errors[1] == pytest.approx(errors[0], rel=1e-9, abs=1e-12)
