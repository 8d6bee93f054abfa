"""Adapters: exact round trips, sharded checkpoints, head names, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VARIANTS, logits, probe_ids

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import iter_tensors


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_is_exact(model_dirs, tmp_path, variant):
    src = model_dirs[variant]
    view = open_model(src)
    view.adapter.save(view, tmp_path / "out", src, progress=False)
    before, after = (
        load_file(src / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sharded_checkpoints_are_read_and_written(model_dirs, tmp_path):
    src = model_dirs["llama"]
    view = open_model(src)
    view.adapter.save(view, tmp_path / "sharded", src, max_shard_size=20_000, progress=False)
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    again = open_model(tmp_path / "sharded")
    for (name, x), (_, y) in zip(
        iter_tensors(view.block(1)), iter_tensors(again.block(1)), strict=True
    ):
        assert torch.equal(x, y), name
    torch.testing.assert_close(logits(tmp_path / "sharded", probe_ids()), logits(src, probe_ids()))


def test_gpt_neox_head_read_under_either_name(model_dirs, tmp_path):
    src = model_dirs["gpt_neox_partial_rotary_parallel"]
    folder = tmp_path / "renamed"
    shutil.copytree(src, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(open_model(folder).head().weight, open_model(src).head().weight)


def test_unsupported_architecture(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(
        BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    ).save_pretrained(tmp_path)
    supported = r"supported: gemma, gemma2, gemma3, gemma3_text, "
    with pytest.raises(LmcError, match=r"unsupported architecture 'bert'; " + supported):
        open_model(tmp_path)


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(LmcError, match="does not exist"):
        open_model(tmp_path / "nope")
    with pytest.raises(LmcError, match=r"no config\.json"):
        open_model(tmp_path)


def test_nan_weights_are_refused(model_dirs, tmp_path, monkeypatch):
    from lmc_mergekit.models import checkpoint

    monkeypatch.setattr(checkpoint, "SCAN_ELEMENTS", 1)  # checked a row at a time
    folder = tmp_path / "nan"
    shutil.copytree(model_dirs["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][-1, 4] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LmcError, match=r"'model.layers.1.mlp.up_proj.weight' holds 1 NaN/Inf"):
        open_model(folder).block(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_value_anywhere_is_found(dtype, bad):
    """A single NaN or infinity at any position of a tensor (first, last, inside a vectorised
    stretch, in a strided view) makes it not finite; finite tensors, extremes included, are."""
    from lmc_mergekit.models.checkpoint import all_finite

    gen = torch.Generator().manual_seed(0)
    tensor = torch.randn(37, 129, generator=gen).to(dtype)
    tensor[0, 0], tensor[-1, -1] = torch.finfo(dtype).max, torch.finfo(dtype).min
    assert all_finite(tensor) and all_finite(tensor[:0])
    for flat in (0, 1, 17, 64, 4000, tensor.numel() - 1):
        spoilt = tensor.clone()
        spoilt.view(-1)[flat] = bad
        assert not all_finite(spoilt) and not all_finite(spoilt.T)
    assert not all_finite(spoilt[:, ::2]) and all_finite(spoilt[:, 1::2])  # the last column


def test_remote_code_is_not_run(model_dirs, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(model_dirs["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom_thing", auto_map={"AutoConfig": "evil.Config"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(LmcError, match="unsupported architecture 'custom_thing'"):
        open_model(folder)
