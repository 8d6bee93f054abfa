"""Healing after a size conversion, and the training loop it shares with the zoo: held-out
losses along the way, resuming to the same weights, rollback, and what is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import build_model
from tokenizer_helpers import model_with_tokenizer
from transformers import AutoModelForCausalLM

import lmc_mergekit.subclone.heal as healing
import lmc_mergekit.zoo.finetune as finetuning
from lmc_mergekit.cli import main
from lmc_mergekit.errors import LmcError
from lmc_mergekit.zoo.train import continue_training

STEPS = 8


@pytest.fixture(scope="module")
def donor(tmp_path_factory) -> Path:
    """A tiny bf16 Llama with the tests' tokenizer."""
    folder = model_with_tokenizer(tmp_path_factory.mktemp("heal") / "llama")
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


class Interrupted(Exception):
    """Stands for a kill: raised from inside the loop after a step."""


def stop_after(step: int):
    def after_step(n: int) -> None:
        if n == step:
            raise Interrupted(f"stopped after step {n}")

    return after_step


def tiny_run(folder: Path, **options):
    model = AutoModelForCausalLM.from_pretrained(build_model("llama", folder), dtype=torch.float32)
    ids = torch.randint(
        0, model.config.vocab_size, (24, 16), generator=torch.Generator().manual_seed(0)
    )
    test = ids[:4]

    def evaluate(model) -> dict[str, float]:
        with torch.no_grad():
            return {"test": float(model(input_ids=test, labels=test).loss)}

    settings = {"seed": 3, "steps": 6, "batch_size": 4, "lr": 1e-2, "progress": False, **options}
    record = continue_training(model, ids[4:], evaluate=evaluate, evaluate_at=[0, 3, 6], **settings)
    return model, record


def test_the_training_loop_resumes_to_the_same_weights(tmp_path):
    whole, record = tiny_run(tmp_path / "a")
    assert [e["step"] for e in record["evaluations"]] == [0, 3, 6]
    assert record["evaluations"][-1]["test"] < record["evaluations"][0]["test"]
    checkpoint = tmp_path / "state.pt"
    resumable = dict(checkpoint=checkpoint, identity={"run": "tiny"}, checkpoint_every=2)
    with pytest.raises(Interrupted):
        tiny_run(tmp_path / "b", after_step=stop_after(5), **resumable)
    assert checkpoint.is_file()
    # Another run's identity does not resume this one's state.
    _, fresh = tiny_run(tmp_path / "c", **{**resumable, "identity": {"run": "other"}})
    assert fresh["resumed_at"] == 0
    with pytest.raises(Interrupted):
        tiny_run(tmp_path / "b", after_step=stop_after(5), **resumable)
    resumed, again = tiny_run(tmp_path / "b", **resumable)
    assert again["resumed_at"] == 4 and not checkpoint.exists()
    losses = [{k: v for k, v in e.items() if k != "seconds"} for e in record["evaluations"]]
    assert [{k: v for k, v in e.items() if k != "seconds"} for e in again["evaluations"]] == losses
    assert all(e["seconds"] >= 0 for e in again["evaluations"])
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


def test_a_diverging_run_rolls_back_then_stops_with_the_fix(tmp_path):
    with pytest.raises(LmcError, match=r"training diverged .* set a smaller learning rate"):
        tiny_run(tmp_path / "a", lr=1e6, checkpoint_every=1)


def heal_args(donor: Path, out: Path, text: Path, *extra: str) -> list[str]:
    return [
        "heal", str(donor), str(out), "--steps", str(STEPS), "--eval-every", "4",
        "--data", str(text), "--seq-len", "32", "--eval-sequences", "4", "--lr", "3e-3", *extra,
    ]  # fmt: skip


def test_heal_writes_the_trained_model_in_its_dtype_and_resumes(donor, text, tmp_path, monkeypatch):
    out = tmp_path / "healed"
    result = CliRunner().invoke(main, heal_args(donor, out, text))
    assert result.exit_code == 0, result.output
    record = json.loads((out / healing.HEAL_INFO).read_text())
    losses = [e["test"] for e in record["evaluations"]]
    assert [e["step"] for e in record["evaluations"]] == [0, 4, 8]
    assert losses[-1] < losses[0] and f"{losses[0]:.4f} -> {losses[-1]:.4f}" in result.output
    healed = load_file(out / "model.safetensors")
    before = load_file(donor / "model.safetensors")
    assert {t.dtype for t in healed.values()} == {torch.bfloat16}
    assert any(not torch.equal(healed[n], before[n]) for n in before)
    assert (out / "tokenizer.json").is_file()
    AutoModelForCausalLM.from_pretrained(out)

    # Interrupted after step 6 (a checkpoint a step), the same command resumes there and
    # writes the same weights; nothing looks finished in between.
    interrupted = tmp_path / "interrupted"
    train = finetuning.continue_training  # the loop healing runs, through train_checkpoint
    monkeypatch.setattr(
        finetuning, "continue_training", lambda *a, **k: train(*a, **k, after_step=stop_after(6))
    )
    failed = CliRunner().invoke(main, heal_args(donor, interrupted, text))
    assert isinstance(failed.exception, Interrupted) and not interrupted.exists()
    monkeypatch.setattr(finetuning, "continue_training", train)
    resumed = CliRunner().invoke(main, heal_args(donor, interrupted, text))
    assert resumed.exit_code == 0, resumed.output
    assert "resumed at step 6" in resumed.output
    again = load_file(interrupted / "model.safetensors")
    assert all(torch.equal(healed[n], again[n]) for n in healed)


def test_heal_refuses_bad_input_in_one_line(donor, text, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    taken = CliRunner().invoke(main, heal_args(donor, out, text))
    assert taken.exit_code == 1 and "already exists" in taken.output
    bad_lr = CliRunner().invoke(main, heal_args(donor, tmp_path / "x", text, "--lr", "-1"))
    assert bad_lr.exit_code == 1 and "learning rate must be positive" in bad_lr.output
    assert not (tmp_path / "x").exists() and (out / "mine.txt").read_text() == "keep"
