"""Why the project exists: a plain weight average of a model with a copy of itself that merely
sits elsewhere in its symmetry orbit destroys the model, though both endpoints compute the same
function; ``lmc_dm`` finds the way back."""

from __future__ import annotations

import json

import yaml
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from lmc_mergekit.cli import main
from lmc_mergekit.data import DataConfig, load_split, load_tokenizer
from lmc_mergekit.evaluation.loss import mean_token_loss
from lmc_mergekit.plugin.cli import mergekit_yaml_main


def merge(method: str, a, b, out, tmp_path, **extra) -> None:
    recipe = {
        "merge_method": method,
        "models": [
            {"model": str(a), "parameters": {"weight": 0.5}},
            {"model": str(b), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        **extra,
    }
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(mergekit_yaml_main, [str(path), str(out), "--quiet"])
    assert result.exit_code == 0, result.output


def test_linear_merge_with_a_scrambled_copy_is_much_worse_and_lmc_dm_repairs_it(
    trained_pair, tmp_path
):
    model, scrambled = trained_pair[0], tmp_path / "scrambled"
    result = CliRunner().invoke(main, ["scramble", str(model), str(scrambled), "--seed", "3"])
    assert result.exit_code == 0, result.output
    merge("linear", model, scrambled, tmp_path / "linear", tmp_path)
    evaluation = {"steps": 0, "seq_len": 64, "eval_sequences": 64, "points": 3}
    merge("lmc_dm", model, scrambled, tmp_path / "lmc_dm", tmp_path, alignment=evaluation)

    test = load_split(DataConfig(seq_len=64), load_tokenizer([model]), "test", 64)

    def loss(folder) -> float:
        return mean_token_loss(AutoModelForCausalLM.from_pretrained(folder).float(), test).loss

    original, copy = loss(model), loss(scrambled)
    linear, aligned = loss(tmp_path / "linear"), loss(tmp_path / "lmc_dm")
    assert abs(copy - original) < 1e-4  # the scrambled copy is the same function
    # Averaging the two weights is a much worse model (measured: 5.49 → 5.88 nats) ...
    assert linear > original + 0.25, (original, linear)
    # ... while weight matching finds the symmetry back: the merge is the model itself.
    assert abs(aligned - original) < 1e-4, (original, aligned)
    report = json.loads((tmp_path / "lmc_dm" / "lmc_report.json").read_text())
    assert abs(report["pairs"][0]["matched"]["barrier"]) < 1e-4
    assert report["pairs"][0]["raw"]["barrier"] > 0.25
