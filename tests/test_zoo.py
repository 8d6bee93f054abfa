"""The model zoo: tokenizer, configs, reproducible training, cached builds and the CLI, all at a
tiny size (width 32, 2 layers, 384 tokens, 30 steps on a 60 kB excerpt of the bundled text)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import lmc_mergekit.zoo as zoo
from lmc_mergekit.cli import main
from lmc_mergekit.data import bundled_text_files
from lmc_mergekit.data.sequences import DataConfig, load_split
from lmc_mergekit.errors import LmcError
from lmc_mergekit.evaluation.loss import DEFAULT_EVAL_SEQUENCES, mean_token_loss
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.zoo import build_zoo, build_zoo_model, parse_seeds, read_zoo_info
from lmc_mergekit.zoo.architectures import zoo_config
from lmc_mergekit.zoo.tokenizer import cached_tokenizer, train_tokenizer
from lmc_mergekit.zoo.train import train_model

TINY = dict(seq_len=32, vocab_size=384, batch_size=8, progress=False)
STEPS = 30


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """60 kB of the bundled text: about 800 training sequences of 32 tokens."""
    path = tmp_path_factory.mktemp("text") / "excerpt.txt"
    path.write_text(bundled_text_files()[0].read_text(encoding="utf-8")[:60_000])
    return path


@pytest.fixture(scope="module")
def tokenizer(text, tmp_path_factory):
    folder = cached_tokenizer(tmp_path_factory.mktemp("zoo"), text, vocab_size=384)
    return AutoTokenizer.from_pretrained(str(folder))


def train_tiny(text, tokenizer, seed: int, arch: str = "gpt_neox"):
    config = zoo_config(arch, 32, 2, len(tokenizer), 32, tokenizer.eos_token_id)
    data = DataConfig(source=str(text), seq_len=32)
    return train_model(
        config, tokenizer, data, seed=seed, steps=STEPS, batch_size=8, progress=False
    )


def build_tiny(root: Path, text: Path, seed: int = 0, arch: str = "gpt_neox", hidden: int = 32):
    return build_zoo_model(root, arch, hidden, 2, seed=seed, steps=STEPS, data_source=text, **TINY)


def test_tokenizer_is_deterministic_byte_level_and_cached(text, tmp_path):
    data = DataConfig(source=str(text))
    first, second = train_tokenizer(data, 300), train_tokenizer(data, 300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 300 and first.eos_token == first.pad_token == "<|endoftext|>"
    sample = "Anne Elliot — naïve “quotes” ☃"  # bytes outside the corpus still round-trip
    assert first.decode(first(sample)["input_ids"]) == sample

    folder = cached_tokenizer(tmp_path, text, vocab_size=300)
    mtime = (folder / "tokenizer.json").stat().st_mtime_ns
    assert cached_tokenizer(tmp_path, text, vocab_size=300) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == mtime
    assert cached_tokenizer(tmp_path, text, vocab_size=320) != folder
    with pytest.raises(LmcError, match="too small"):
        train_tokenizer(data, 100)


@pytest.mark.parametrize(
    ("arch", "hidden", "heads", "kv_heads", "intermediate"),
    [("gpt_neox", 128, 4, 4, 512), ("llama", 128, 4, 2, 352), ("llama", 96, 3, 1, 256)],
)
def test_configs_follow_the_zoo_shapes(arch, hidden, heads, kv_heads, intermediate):
    config = zoo_config(arch, hidden, 4, 4096, 128)
    model = AutoModelForCausalLM.from_config(config)
    assert config.num_attention_heads == heads and config.intermediate_size == intermediate
    assert getattr(config, "num_key_value_heads", heads) == kv_heads
    assert not config.tie_word_embeddings
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    if arch == "gpt_neox":
        assert config.rope_parameters["partial_rotary_factor"] == 0.25
        assert config.use_parallel_residual


@pytest.mark.parametrize("hidden", [0, 48, 100])
def test_width_must_be_whole_heads(hidden):
    with pytest.raises(LmcError, match="multiple of 32") as error:
        zoo_config("gpt_neox", hidden, 2, 512, 32)
    assert "\n" not in str(error.value)


def test_seed_fixes_the_weights_and_training_learns(text, tokenizer):
    model_a, record = train_tiny(text, tokenizer, seed=0)
    model_b, _ = train_tiny(text, tokenizer, seed=0)
    model_c, _ = train_tiny(text, tokenizer, seed=1)
    a, b, c = (m.state_dict() for m in (model_a, model_b, model_c))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert all(not torch.equal(a[name], c[name]) for name in a if a[name].ndim == 2)
    # Uniform guessing is ln(384) = 5.95 nats; 30 steps get well below it.
    assert record["first_train_loss"] > 5.5
    assert record["train_loss"] < record["first_train_loss"] - 0.5
    assert record["validation_loss"] < 5.3 and record["test_loss"] < 5.3
    assert record["steps"] == STEPS and record["tokens_seen"] == STEPS * 8 * 32
    assert record["parameters"] == sum(p.numel() for p in model_a.parameters())


@pytest.mark.parametrize(("arch", "hidden"), [("gpt_neox", 32), ("llama", 64)])
def test_build_saves_a_stock_checkpoint_and_reuses_it(text, tmp_path, monkeypatch, arch, hidden):
    path = build_tiny(tmp_path, text, arch=arch, hidden=hidden)
    assert path.parent == tmp_path and path.name.endswith("-seed0")
    assert path.name.startswith(f"{arch}-d{hidden}-l2-s{STEPS}-v384-ctx32-b8-data")
    assert (path / "model.safetensors").is_file()
    info = read_zoo_info(path)
    assert info["architecture"] == arch and info["data"]["source"] == str(text)

    # The saved model is the trained one: its held-out loss is the recorded one.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    validation = load_split(
        DataConfig(str(text), seq_len=32), tokenizer, "validation", DEFAULT_EVAL_SEQUENCES
    )
    loss = mean_token_loss(model, validation).loss
    assert loss == pytest.approx(info["training"]["validation_loss"], abs=1e-5)
    assert open_model(str(path)).spec.num_layers == 2  # the project's own adapters read it

    # A second build trains nothing and leaves the folder as it was.
    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(zoo, "train_model", no_training)
    weights = load_file(path / "model.safetensors")
    assert build_tiny(tmp_path, text, arch=arch, hidden=hidden) == path
    assert read_zoo_info(path) == info
    after = load_file(path / "model.safetensors")
    assert all(torch.equal(weights[name], after[name]) for name in weights)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, LmcError])
def test_an_interrupted_build_leaves_no_finished_looking_folder(
    text, tmp_path, monkeypatch, failure
):
    import lmc_mergekit.zoo.train as train

    def fail(*args, **kwargs):
        raise failure("stopped during the final evaluation")

    monkeypatch.setattr(train, "mean_token_loss", fail)
    with pytest.raises(failure):
        build_tiny(tmp_path, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tokenizers"]
    # A bad argument inside training fails the same way.
    with pytest.raises(LmcError, match="learning rate"):
        build_zoo_model(tmp_path, "gpt_neox", 32, 2, steps=STEPS, data_source=text, lr=-1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tokenizers"]


def test_a_foreign_folder_under_the_model_name_is_refused(text, tmp_path):
    name = build_tiny(tmp_path / "probe", text).name
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine")
    with pytest.raises(LmcError, match="no finished zoo model"):
        build_tiny(tmp_path, text)
    assert (tmp_path / name / "notes.txt").read_text() == "mine"


def test_names_and_seeds():
    assert zoo.zoo_model_name("gpt_neox", 128, 4, 0, 1500) == "gpt_neox-d128-l4-s1500-seed0"
    assert parse_seeds("0,1") == [0, 1]
    assert parse_seeds(" 2, 0-3,5") == [2, 0, 1, 3, 5]
    for bad in ("", "a", "1,,2", "-1", "3-1", "1.5"):
        with pytest.raises(LmcError, match="bad seed"):
            parse_seeds(bad)


def test_build_zoo_gives_one_model_per_seed(text, tmp_path):
    paths = build_zoo(
        tmp_path, "gpt_neox", 32, 2, seeds=[3, 4], steps=STEPS, data_source=text, **TINY
    )
    assert [p.name[-6:] for p in paths] == ["-seed3", "-seed4"]
    assert all(
        read_zoo_info(p)["training"]["seed"] == s for p, s in zip(paths, [3, 4], strict=True)
    )


def test_cli_trains_then_reuses(text, tmp_path):
    args = [
        "zoo", str(tmp_path / "zoo"), "--hidden", "32", "--layers", "2", "--seeds", "0,1",
        "--steps", str(STEPS), "--data", str(text), "--seq-len", "32", "--vocab-size", "384",
        "--batch-size", "8",
    ]  # fmt: skip
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    lines = [line for line in first.output.splitlines() if "validation loss" in line]
    assert len(lines) == 2 and all("trained in" in line for line in lines)
    assert "-seed0" in lines[0] and "-seed1" in lines[1]

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert again.output.count("(reused)") == 2

    bad = CliRunner().invoke(main, [*args[:7], "0,x"])
    assert bad.exit_code == 1 and "Error: bad seed 'x'" in bad.output
    narrow = CliRunner().invoke(main, ["zoo", str(tmp_path / "z2"), "--hidden", "40"])
    assert narrow.exit_code == 1 and "multiple of 32" in narrow.output
    # Progress bars share CliRunner's output: the folder name is what precedes the loss.
    name = re.search(r"/(gpt_neox-[^/\s]+-seed0)  validation loss", first.output).group(1)
    info = json.loads((tmp_path / "zoo" / name / "zoo_model.json").read_text())
    assert info["training"]["seed"] == 0


def test_models_trained_on_different_texts_share_a_tokenizer_trained_on_both(tmp_path):
    from lmc_mergekit.data.tokenizer import shares_tokenizer

    texts = tmp_path / "texts"
    for name, source in (("kjv", "kjv"), ("austen", "austen_persuasion")):
        (texts / name).mkdir(parents=True)
        whole = next(p for p in bundled_text_files() if p.stem.startswith(source))
        (texts / name / "excerpt.txt").write_text(whole.read_text(encoding="utf-8")[:30_000])
    own, shared = (
        [
            build_zoo_model(
                tmp_path / "zoo", "gpt_neox", 32, 2, seed=seed, steps=STEPS,
                data_source=texts / name, tokenizer_data=words, **TINY,
            )
            for seed, name in enumerate(("kjv", "austen"))
        ]
        for words in (None, texts)
    )  # fmt: skip
    assert not shares_tokenizer(*own)  # a tokenizer per text: the rows are other tokens
    assert shares_tokenizer(*shared)
    assert all("-tok" in p.name and "-tok" not in q.name for p, q in zip(shared, own, strict=True))
    assert read_zoo_info(shared[1])["tokenizer"]["source"] == str(texts)
    assert read_zoo_info(shared[1])["data"]["source"] == str(texts / "austen")


def test_a_finetune_of_the_last_layers_leaves_the_rest_as_they_were(text, tmp_path):
    """``last_layers``: the last decoder layer trains, every other weight (embeddings,
    earlier layers, final norm, head) is the base's bit for bit; a count the model does not
    have is refused before any step."""
    from lmc_mergekit.zoo.finetune import finetune

    base = build_tiny(tmp_path, text, arch="llama", hidden=64)
    data = DataConfig(source=str(text), seq_len=32)
    tuned = finetune(
        base, tmp_path / "tuned", data, steps=3, lr=1e-2, progress=False, last_layers=1
    )
    before, after = (load_file(f / "model.safetensors") for f in (base, tuned))
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith("model.layers.1.") for name in changed), changed
    record = json.loads((tuned / "finetune.json").read_text())
    assert record["last_layers"] == 1
    with pytest.raises(LmcError, match="last 3 decoder layers"):
        finetune(base, tmp_path / "bad", data, steps=1, progress=False, last_layers=3)
    assert not (tmp_path / "bad").exists()
