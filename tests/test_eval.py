"""The mean token loss and the ``lmc-mergekit eval`` command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from tiny_models import build_model
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.cli import main
from lmc_mergekit.data import DataConfig, bundled_text_files, load_split, load_tokenizer
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import (
    LossResult,
    load_causal_lm,
    mean_token_loss,
    resolve_device,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eval-models")
    return {
        variant: model_with_tokenizer(root / variant, variant, seed=3)
        for variant in ("llama", "gpt_neox_partial_rotary_parallel")
    }


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(bundled_text_files()[1].read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return path


def random_sequences(n: int, length: int, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(n))


@torch.no_grad()
def labels_loss(model, sequences: torch.Tensor) -> float:
    """transformers' own per-sequence loss, weighted by the tokens each sequence predicts."""
    total = sum(float(model(s[None], labels=s[None]).loss) * (len(s) - 1) for s in sequences)
    return total / (sequences.shape[0] * (sequences.shape[1] - 1))


@pytest.mark.parametrize("variant", ["llama", "gpt_neox_partial_rotary_parallel"])
def test_mean_token_loss_is_the_cross_entropy(models, variant):
    model = load_causal_lm(models[variant])
    sequences = random_sequences(7, 12)
    result = mean_token_loss(model, sequences, batch_size=3)
    assert result.tokens == 7 * 11
    assert result.loss == pytest.approx(labels_loss(model, sequences), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    # Random weights: far from the uniform loss log(300), so a wrong shift would show.
    assert abs(result.loss - math.log(300)) > 0.1
    for batch_size in (1, 2, 7, 16):
        other = mean_token_loss(model, sequences, batch_size=batch_size)
        assert other.loss == pytest.approx(result.loss, rel=1e-6)


def test_mean_token_loss_sets_eval_mode_and_checks_its_input(models):
    model = load_causal_lm(models["llama"]).train()
    mean_token_loss(model, random_sequences(2, 5))
    assert not model.training
    with pytest.raises(LmcError, match="token id 300 is outside the model's vocabulary of 300"):
        mean_token_loss(model, torch.full((1, 4), 300))
    with pytest.raises(LmcError, match=r"shape \(n >= 1, length >= 2\), got \(3, 1\)"):
        mean_token_loss(model, random_sequences(3, 1))


def test_loss_result_to_dict():
    result = LossResult(loss=math.log(4.0), tokens=10)
    assert result.to_dict() == {
        "loss": math.log(4.0),
        "perplexity": pytest.approx(4.0),
        "tokens": 10,
    }


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(LmcError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")


def test_eval_command_writes_the_loss(models, data_file, tmp_path):
    folder = models["llama"]
    out = tmp_path / "reports" / "eval.json"
    args = ["eval", str(folder), "--data", str(data_file), "--seq-len", "16", "--split", "test"]
    args += ["--max-sequences", "6", "--batch-size", "4", "--device", "cpu", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text(encoding="utf-8"))

    config = DataConfig(source=str(data_file), seq_len=16)
    sequences = load_split(config, load_tokenizer([folder]), "test", max_sequences=6)
    expected = mean_token_loss(load_causal_lm(folder), sequences)
    assert report["loss"] == pytest.approx(expected.loss, rel=1e-6)
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)  # exp(loss)
    assert report["tokens"] == expected.tokens == 6 * 15
    assert report["sequences"] == 6 and report["seq_len"] == 16 and report["split"] == "test"
    assert report["model"] == str(folder.resolve()) and report["data"] == str(data_file)
    assert f"loss {expected.loss:.4f} nats/token" in result.output


def test_eval_command_defaults_to_the_bundled_corpus(models):
    args = ["eval", str(models["llama"]), "--seq-len", "16", "--max-sequences", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "over 30 tokens (2 sequences of 16, test split of bundled corpus)" in result.output


def test_eval_command_errors_are_one_line(models, data_file, tmp_path):
    def error_of(*args: str) -> str:
        result = CliRunner().invoke(main, ["eval", *args])
        assert result.exit_code == 1, result.output
        (line,) = result.output.strip().splitlines()
        return line

    assert "does not exist" in error_of(str(tmp_path / "missing"))
    bare = build_model("llama", tmp_path / "bare")
    assert "evaluation needs the model's tokenizer" in error_of(str(bare))
    folder = str(models["llama"])
    assert "missing.txt' does not exist" in error_of(
        folder, "--data", str(tmp_path / "missing.txt")
    )
    short = tmp_path / "short.txt"
    short.write_text("Too short.\n", encoding="utf-8")
    assert "fewer than one sequence of 128" in error_of(folder, "--data", str(short))
