"""The same recipe on the same inputs writes the same files: every method run twice, each run a
whole command in a fresh process with a fresh cache and another hash seed (set and dict order,
memory layout), writes bit-identical safetensors and the same report but for its seconds."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from recipe_standins import standin_workspace, untimed
from tokenizer_helpers import model_with_tokenizer
from transformers import AutoModelForCausalLM

#: Shipped recipes (shortened, on stand-in models) and what each variant changes in them.
RECIPES = {
    "lmc_dm-weights": ("lmc_dm_weight_matching.yml", {}),
    "lmc_dm-activations": ("lmc_dm_weight_matching.yml", {"matching": "activations"}),
    "lmc_dm-learned": ("lmc_dm_learned.yml", {}),
    "subclone_compensate": ("subclone_gpt_neox.yml", {}),
    "ls_merge": ("ls_merge_self.yml", {}),
}
REPORTS = ("lmc_report.json", "subclone_report.json", "ls_report.json", "heal.json")
#: Report entries that time the run (besides ``seconds``).
TIMED = ("wall_time_s", "tokens_per_s", "chunks_per_second")


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    workdir, _ = standin_workspace(tmp_path_factory.mktemp("same-output"))
    return workdir


def comparable(record, cache: str):
    """A report as two runs must agree on it: without its timings, the run's cache folder
    named ``<cache>``."""
    if isinstance(record, dict):
        return {k: comparable(v, cache) for k, v in untimed(record).items() if k not in TIMED}
    if isinstance(record, list):
        return [comparable(value, cache) for value in record]
    return record.replace(cache, "<cache>") if isinstance(record, str) else record


def fingerprint(folder: Path, cache: Path) -> dict:
    """Every safetensors file's sha256, and the reports but for their timings."""
    hashes = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.glob("*.safetensors"))
    }
    reports = {
        name: comparable(json.loads((folder / name).read_text()), str(cache))
        for name in REPORTS
        if (folder / name).is_file()
    }
    assert hashes and reports, f"{folder} holds no output or no report"
    return {"tensors": hashes, "reports": reports}


def differences(a, b, where: str = "") -> list[str]:
    """The paths at which two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def run_twice(command: list[str], cwd: Path, out: str) -> list[dict]:
    """``command`` (its output folder ``out`` and a cache appended) run twice, each a fresh
    process with its own cache and hash seed; the fingerprints of both outputs."""
    prints = []
    for run in ("1", "2"):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": run}
        cache = cwd / f"cache-{out}-{run}"
        env["LMC_MERGEKIT_CACHE"] = str(cache)
        env.pop("PYTHONPATH", None)
        done = subprocess.run(
            [*command, f"{out}-{run}"], capture_output=True, text=True, env=env, cwd=cwd
        )
        assert done.returncode == 0, done.stderr[-3000:]
        prints.append(fingerprint(cwd / f"{out}-{run}", cache))
    return prints


@pytest.mark.slow  # ten whole commands, each a process start and a short run
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_run_twice_writes_the_same_files(standins, name):
    recipe_file, changes = RECIPES[name]
    recipe = yaml.safe_load((standins / recipe_file).read_text())
    section = "alignment" if recipe["merge_method"] == "lmc_dm" else None
    if section and changes:
        recipe[section] = {**recipe[section], **changes}
    if section:  # the measurement is not what is compared
        recipe[section]["evaluate"] = False
    (standins / f"{name}.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    script = str(Path(sys.executable).parent / "lmc-mergekit-yaml")
    first, second = run_twice([script, f"{name}.yml"], standins, name)
    assert not differences(first, second)


@pytest.mark.slow
def test_a_heal_run_twice_writes_the_same_files(tmp_path, text):
    donor = model_with_tokenizer(tmp_path / "donor")
    AutoModelForCausalLM.from_pretrained(donor).to(torch.bfloat16).save_pretrained(donor)
    script = str(Path(sys.executable).parent / "lmc-mergekit")
    command = [script, "heal", str(donor), "--steps", "3", "--data", str(text), "--lr", "3e-3"]
    command += ["--seq-len", "32", "--eval-sequences", "4", "--eval-every", "3"]
    first, second = run_twice(command, tmp_path, "healed")  # OUT last: after the options
    assert not differences(first, second)
