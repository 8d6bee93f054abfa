"""Two runs of one recipe at once on one cache (two shells, two notebooks, a launcher retrying):
one prepares the inputs while the other waits, then reuses them; nothing is corrupted."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
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
            Run([str(script), str(recipe), str(tmp_path / f"out{i}"), "--device", "cpu", "-v"], env)
            for i in range(2)
        ]
        for run in runs:
            run.waiting.wait(timeout=600)
            assert "another run is preparing" in run.text(), run.text()[-3000:]
    for run in runs:
        assert run.finish() == 0, run.text()[-3000:]
    # One prepared the inputs; the other, once the lock was its own, reused them.
    reused = ["reusing prepared inputs" in run.text() for run in runs]
    assert sorted(reused) == [False, True], [run.text()[-2000:] for run in runs]
    one, two = stored_tensors(tmp_path / "out0"), stored_tensors(tmp_path / "out1")
    assert one.keys() == two.keys() and all(one[k].equal(two[k]) for k in one)
    # One entry, complete; no resumable state or staging folder left behind.
    assert (entry / "preparation.json").is_file()
    leftovers = [p.name for p in (cache / "lmc_dm").iterdir() if ".partial-" in p.name]
    assert not leftovers and not (entry.parent / f".{entry.name}.state").exists()


class Run:
    """A real process whose stderr is read as it comes (so that it never blocks on a full pipe),
    with an event set when it reports that it waits for another run."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.waiting = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)
            if "another run is preparing" in line:
                self.waiting.set()
        self.waiting.set()  # ended: the waiter wakes and the assertion says why

    def finish(self) -> int:
        code = self.process.wait(timeout=600)
        self.reader.join()
        return code

    def text(self) -> str:
        return "".join(self.lines)
