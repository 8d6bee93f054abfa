"""Multimodal Gemma 3 (``Gemma3ForConditionalGeneration``): the text model is the canonical view,
the projector moves with the residual stream, the vision tower is carried through unchanged;
every method's output loads in transformers and computes the same logits for text and for text
with an image, and mergekit keeps every tensor of such checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from safetensors.torch import save_file
from tiny_models import build_gemma3_multimodal, gemma3_image_inputs, probe_ids, stored_tensors
from tokenizer_helpers import make_tokenizer, save_tokenizer
from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

from lmc_mergekit.cli import main
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.plugin.architecture_repairs import repaired_architectures
from lmc_mergekit.plugin.cli import mergekit_yaml_main

PROJECTOR = "multi_modal_projector.mm_input_projection_weight"
RTOL = 1e-4


def vision(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors outside the text model and the projector's matrix."""
    return {
        k: v
        for k, v in stored_tensors(folder).items()
        if not k.startswith("language_model.") and k != PROJECTOR
    }


def load(folder: Path) -> Gemma3ForConditionalGeneration:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(model) is Gemma3ForConditionalGeneration
    return model


@torch.no_grad()
def outputs(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for text only and for text with an image."""
    model = load(folder)
    return model(probe_ids()).logits, model(**gemma3_image_inputs()).logits


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = float((actual - expected).abs().max() / expected.abs().max())
    assert error < RTOL, error


def run_yaml(recipe: dict, tmp_path: Path, out: Path):
    path = tmp_path / f"{out.name}.yml"
    path.write_text(yaml.safe_dump(recipe))
    return CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])


def recipe(method: str, models, weights=None, **section) -> dict:
    sections = {"lmc_dm": "alignment", "subclone_compensate": "subclone", "ls_merge": "latent"}
    weights = weights or [1.0] * len(models)
    body = {
        "merge_method": method,
        "models": [
            {"model": str(m), "parameters": {"weight": w}}
            for m, w in zip(models, weights, strict=True)
        ],
        "dtype": "float32",
    }
    if method in sections:
        body[sections[method]] = section
    return body


def relabel(source: Path, out: Path, renames: tuple[tuple[str, str], ...]) -> Path:
    """``source`` with its tensor names rewritten (another tool's layout of the same model)."""
    out.mkdir()
    named = {}
    for key, tensor in stored_tensors(source).items():
        for old, new in renames:
            key = new + key[len(old) :] if key.startswith(old) else key
        named[key] = tensor
    save_file(named, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((source / "config.json").read_text())
    return out


# The Hub's layout (transformers 4) and transformers' module names.
HUB = (("vision_tower.", "vision_tower.vision_model."),)
MODULES = (
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("language_model.lm_head.", "lm_head."),
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny multimodal Gemma 3 and its scrambled copy (untied, so that the residual map is
    any rotation the model admits and the written head is checked too)."""
    root = tmp_path_factory.mktemp("gemma3")
    model = build_gemma3_multimodal(root / "model", seed=3)
    copy = root / "scrambled"
    result = CliRunner().invoke(main, ["scramble", str(model), str(copy), "--seed", "5", "--untie"])
    assert result.exit_code == 0, result.output
    return model, copy


def test_scramble_keeps_text_and_image_logits_and_the_vision_tower(gemma3):
    model, copy = gemma3
    assert open_model(model).spec.architecture == "gemma3"
    (text, image), (text_copy, image_copy) = outputs(model), outputs(copy)
    assert_close(text_copy, text)
    assert_close(image_copy, image)
    # The image changes the logits (so the image check sees the projector).
    assert (
        image - load(model)(**{**gemma3_image_inputs(), "pixel_values": None}).logits
    ).abs().max() > 1e-2
    # The projector moved with the stream; the tower and the projector's norm did not move.
    source, moved = stored_tensors(model), stored_tensors(copy)
    assert not torch.equal(moved[PROJECTOR], source[PROJECTOR])
    tower, tower_copy = vision(model), vision(copy)
    assert tower.keys() == tower_copy.keys() and len(tower) == 33
    for key, tensor in tower.items():
        assert tensor.dtype == tower_copy[key].dtype
        assert torch.equal(tensor.view(torch.uint8), tower_copy[key].view(torch.uint8)), key
    config = json.loads((copy / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["text_config"]["tie_word_embeddings"] is False
    assert "language_model.lm_head.weight" in moved


@pytest.mark.parametrize("layout", [HUB, MODULES], ids=["hub", "module_names"])
def test_other_layouts_are_read_and_written_as_transformers_5_saves(gemma3, tmp_path, layout):
    model, copy = gemma3
    stored = relabel(copy, tmp_path / "stored", layout)
    # transformers reads that layout too: the relabelled folder computes what the copy does.
    for got, want in zip(outputs(stored), outputs(copy), strict=True):
        assert torch.equal(got, want)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["scramble", str(stored), str(out), "--seed", "6"])
    assert result.exit_code == 0, result.output
    assert stored_tensors(out).keys() == stored_tensors(copy).keys()
    (text, image), (text_out, image_out) = outputs(model), outputs(out)
    assert_close(text_out, text)
    assert_close(image_out, image)


def test_mergekit_keeps_every_tensor_of_either_layout(gemma3, tmp_path):
    """mergekit's own ``linear`` with the gemma3vl definition the plugin's merges use, on a
    transformers 5 checkpoint and one in the Hub's layout: every tensor, averaged."""
    model, copy = gemma3
    hub = relabel(copy, tmp_path / "hub", HUB)
    config = MergeConfiguration.model_validate(
        recipe("linear", [copy, hub], [0.5, 0.5])  # one model, two layouts: itself
    )
    out = tmp_path / "out"
    with repaired_architectures():
        run_merge(config, str(out), MergeOptions(quiet=True))
    written, expected = stored_tensors(out), stored_tensors(copy)
    assert written.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key
    assert_close(outputs(out)[1], outputs(model)[1])


def test_lmc_dm_aligns_a_model_with_its_scrambled_copy(gemma3, tmp_path):
    model, copy = gemma3
    out = tmp_path / "dm"
    result = run_yaml(recipe("lmc_dm", [model, copy], steps=0, evaluate=False), tmp_path, out)
    assert result.exit_code == 0, result.output
    # Every tensor of the inputs, under the names transformers 5 writes.
    assert stored_tensors(out).keys() == stored_tensors(copy).keys()
    # Weight matching undoes the scramble (the projector moves with the stream): the average
    # is the model itself, for text and for images.
    (text, image), (text_out, image_out) = outputs(model), outputs(out)
    assert_close(text_out, text)
    assert_close(image_out, image)


@pytest.mark.slow
def test_lmc_dm_merges_two_seeds(tmp_path):
    a = build_gemma3_multimodal(tmp_path / "a", seed=0)
    b = build_gemma3_multimodal(tmp_path / "b", seed=1)
    out = tmp_path / "dm"
    result = run_yaml(recipe("lmc_dm", [a, b], steps=0, evaluate=False), tmp_path, out)
    assert result.exit_code == 0, result.output
    written, first, second = stored_tensors(out), stored_tensors(a), stored_tensors(b)
    assert written.keys() == first.keys()  # the tie kept: post-norms gain nothing by untying
    for key, tensor in vision(a).items():  # not moved, so plainly averaged
        assert torch.allclose(written[key], (tensor + second[key]) / 2), key
    assert all(torch.isfinite(logits).all() for logits in outputs(out))


@pytest.fixture(scope="module")
def with_text(tmp_path_factory):
    """Two tiny multimodal Gemma 3 with a real tokenizer (for calibration)."""
    root = tmp_path_factory.mktemp("gemma3-text")
    vocab = len(make_tokenizer())
    return tuple(
        save_tokenizer(build_gemma3_multimodal(root / name, seed=seed, vocab_size=vocab))
        for seed, name in enumerate("ab")
    )


@pytest.mark.slow
def test_subclone_to_half_width_selects_the_projector_with_the_stream(with_text, tmp_path):
    donor = with_text[0]
    out = tmp_path / "small"
    body = recipe(
        "subclone_compensate",
        [donor],
        hidden_size=24,  # compensated through the post-norms (the default)
        calibration_sequences=16,
        seq_len=32,
        evaluate=False,
    )
    result = run_yaml(body, tmp_path, out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["hidden_size"] == 24
    report = json.loads((out / "subclone_report.json").read_text())
    channels = report["donors"][0]["conversion"]["residual_channels"]
    written, source = stored_tensors(out), stored_tensors(donor)
    assert torch.equal(written[PROJECTOR], source[PROJECTOR][:, channels])
    for key, tensor in vision(donor).items():
        assert torch.equal(written[key], tensor), key
    assert all(torch.isfinite(logits).all() for logits in outputs(out))


@pytest.mark.slow
def test_ls_merge_keeps_the_vision_tower(with_text, tmp_path):
    a, b = with_text
    # All weight on the second input: with residuals the merge gives it back exactly, the
    # tower included (a plain average of the inputs' towers, not the first input's).
    body = recipe("ls_merge", [b, a], [0.0, 1.0], steps=5, width=16, evaluate=False)
    out = tmp_path / "latent"
    result = run_yaml(body, tmp_path, out)
    assert result.exit_code == 0, result.output
    assert stored_tensors(out).keys() == stored_tensors(a).keys()
    for key, tensor in vision(a).items():
        assert torch.equal(stored_tensors(out)[key], tensor), key
    (text, image), (text_out, image_out) = outputs(a), outputs(out)
    assert_close(text_out, text)
    assert_close(image_out, image)
