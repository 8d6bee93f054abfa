"""Two runs of one recipe at once on one cache (two shells, two notebooks, a launcher retrying):
one prepares the inputs while the other waits, then reuses them; nothing is corrupted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_models import stored_tensors
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.plugin.cache import preparation_key
from lmc_mergekit.plugin.recipe import read_recipe
from lmc_mergekit.runtime.locks import entry_lock


@pytest.mark.slow
def test_two_runs_at_once_share_one_cache_entry(tmp_path):
    pair = [model_with_tokenizer(tmp_path / name, seed=seed) for seed, name in enumerate("ab")]
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "merge_method": "lmc_dm",
                "models": [{"model": str(m)} for m in pair],
                "dtype": "float32",
                # Learned steps: the pass keeps resumable state beside the entry.
                "alignment": {"steps": 4, "batch_size": 2, "eval_sequences": 8, "points": 3},
            }
        )
    )
    cache = tmp_path / "cache"
    settings = read_recipe(recipe).settings
    entry = cache / "lmc_dm" / preparation_key("lmc_dm", settings, pair, "cpu")
    script = Path(sys.executable).with_name("lmc-mergekit-yaml")
    env = {**os.environ, "LMC_MERGEKIT_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    # The test holds the entry's lock until both runs report that they wait for it: then they
    # are certainly running at the same moment, whatever the machine's speed.
    with entry_lock(entry):
        runs = [
            subprocess.Popen(
                [str(script), str(recipe), str(tmp_path / f"out{i}"), "--device", "cpu"],
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(2)
        ]
        for run in runs:
            seen = []
            for line in run.stderr:
                seen.append(line)
                if "another run is preparing" in line:
                    break
            else:
                pytest.fail("a run ended without waiting:\n" + "".join(seen))
    for run in runs:
        _, rest = run.communicate(timeout=600)
        assert run.returncode == 0, rest
    one, two = stored_tensors(tmp_path / "out0"), stored_tensors(tmp_path / "out1")
    assert one.keys() == two.keys() and all(one[k].equal(two[k]) for k in one)
    # One entry, complete; no resumable state or staging folder left behind.
    assert (entry / "preparation.json").is_file()
    leftovers = [p.name for p in (cache / "lmc_dm").iterdir() if ".partial-" in p.name]
    assert not leftovers and not (entry.parent / f".{entry.name}.state").exists()
