"""Why the project exists: a plain weight average of a model with a copy of itself that merely
sits elsewhere in its symmetry orbit destroys the model, though both endpoints compute the same
function."""

from __future__ import annotations

import torch
import yaml
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from lmc_mergekit.data import bundled_text_files
from lmc_mergekit.plugin.cli import main, mergekit_yaml_main

SEQ = 64


def byte_batches(split: str, count: int, batch: int, seed: int) -> list[torch.Tensor]:
    data = torch.tensor(list(bundled_text_files()[0].read_bytes()[:400_000]), dtype=torch.long)
    data = data[: len(data) * 9 // 10] if split == "train" else data[len(data) * 9 // 10 :]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - SEQ, (count, batch), generator=gen)
    return [torch.stack([data[s : s + SEQ] for s in row]) for row in starts]


@torch.no_grad()
def loss(folder, batches) -> float:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return sum(float(model(x, labels=x).loss) for x in batches) / len(batches)


def train_tiny_byte_model(folder, steps: int = 250) -> None:
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
    )
    model = GPTNeoXForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x in byte_batches("train", steps, 16, seed=0):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)


def test_linear_merge_with_a_scrambled_copy_is_much_worse(tmp_path):
    train_tiny_byte_model(tmp_path / "model")
    scrambled = CliRunner().invoke(
        main, ["scramble", str(tmp_path / "model"), str(tmp_path / "scr")]
    )
    assert scrambled.exit_code == 0, scrambled.output
    recipe = {
        "merge_method": "linear",
        "models": [
            {"model": str(tmp_path / "model"), "parameters": {"weight": 0.5}},
            {"model": str(tmp_path / "scr"), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
    }
    (tmp_path / "r.yml").write_text(yaml.safe_dump(recipe))
    merged = CliRunner().invoke(
        mergekit_yaml_main, [str(tmp_path / "r.yml"), str(tmp_path / "mid"), "--quiet"]
    )
    assert merged.exit_code == 0, merged.output

    test = byte_batches("test", 8, 16, seed=1)
    original, copy, midpoint = (loss(tmp_path / n, test) for n in ("model", "scr", "mid"))
    assert original < 3.0  # it learned something (uniform over bytes is 5.5 nats)
    assert abs(copy - original) < 1e-3  # the scrambled copy is the same function
    # Averaging the two at least doubles the perplexity (measured: 2.13 → 2.83 nats).
    assert midpoint > original + 0.5, (original, midpoint)
