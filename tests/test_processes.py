"""Several processes, as launchers start them: each takes its own accelerator from
``LOCAL_RANK``, weight matching runs once and its result reaches every process bit for bit, and a
process that fails stops every process with its one-line error instead of leaving them waiting.

The processes are real ones, joined through a TCP store this test hosts on a port the OS picks
(as ``torchrun``'s agent hosts it), without ``torchrun``'s agent, which would kill the other
processes when one fails and hide a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_models import build_model
from tokenizer_helpers import model_with_tokenizer
from torch.distributed import TCPStore

from lmc_mergekit.data.corpus import bundled_text_files
from lmc_mergekit.runtime.distributed import Processes, process_device

WORKER = Path(__file__).with_name("process_worker.py")


def test_each_process_takes_the_accelerator_of_its_local_rank():
    unindexed = torch.device("cuda")
    assert process_device(unindexed, {"LOCAL_RANK": "1"}) == torch.device("cuda", 1)
    assert process_device(unindexed, {}) == unindexed  # no launcher: the device as given
    named = torch.device("cuda", 0)
    assert process_device(named, {"LOCAL_RANK": "1"}) == named  # --device cuda:0 is obeyed
    assert process_device(torch.device("cpu"), {"LOCAL_RANK": "1"}) == torch.device("cpu")


def test_one_process_checks_and_computes_in_place():
    procs = Processes()
    with procs.together():
        pass
    assert procs.from_main(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad"):  # its own error, as raised
        with procs.together():
            raise ValueError("bad")


def launch(commands: list[list[str]], cwds: list[Path], timeout: float = 240):
    """Start one process per command as rank 0, 1, ... of one group (the store on a port the
    OS picks); wait for all of them. Returns each one's exit code and stderr."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WORLD_SIZE": str(len(commands)),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        # Every process is a client of the store hosted here, as under torchrun's agent.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    started = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, (command, cwd) in enumerate(zip(commands, cwds, strict=True))
    ]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in started]
        return [(p.returncode, err) for p, err in zip(started, errors, strict=True)]
    finally:
        for process in started:  # one that hung past the timeout
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.slow
def test_weight_matching_runs_once_and_every_process_gets_its_result(tmp_path):
    a = build_model("llama_gqa_tied", tmp_path / "a", seed=1)
    b = build_model("llama_gqa_tied", tmp_path / "b", seed=2)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(WORKER), str(out), str(a), str(b)]
    done = launch([command, command], [tmp_path, tmp_path])
    assert [code for code, _ in done] == [0, 0], [err[-2000:] for _, err in done]
    facts = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Each process takes the accelerator of its LOCAL_RANK (what pass_device gives for cuda).
    assert [f["cuda"] for f in facts] == ["cuda:0", "cuda:1"]
    assert [f["world_size"] for f in facts] == [2, 2]
    # The second process never matched (the worker made that an error there): it holds the
    # first one's result, bit for bit.
    assert facts[1]["matching"] == facts[0]["matching"] and facts[0]["matching"][0]["iterations"]
    for index in (0, 1):
        first, second = (load_file(out / f"rank{r}-{index}.safetensors") for r in (0, 1))
        assert first.keys() == second.keys()
        for name, tensor in first.items():
            assert torch.equal(second[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("missing", "problem"),
    [("data", "data path 'text.txt' does not exist"), ("model", "'b'")],
)
def test_a_process_that_fails_stops_every_process_with_its_one_line_error(
    tmp_path, missing, problem
):
    """The second process cannot read the calibration text or a model (relative paths, and it
    runs in another folder): both stop, each with one line naming the problem, none waits
    (a model is resolved before the pass, the text inside it)."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    models = [model_with_tokenizer(here / n, "llama", seed=s) for s, n in enumerate("ab")]
    (here / "text.txt").write_text(bundled_text_files()[0].read_text())
    if missing == "model":
        (elsewhere / "text.txt").write_text(bundled_text_files()[0].read_text())
    named = [str(models[0]), "b" if missing == "model" else str(models[1])]
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": m, "parameters": {"weight": 1.0}} for m in named],
        "dtype": "float32",
        "alignment": {
            "steps": 2,
            "batch_size": 2,
            "seq_len": 16,
            "evaluate": False,
            "data": "text.txt",
        },
    }
    path = tmp_path / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe))
    script = Path(sys.executable).parent / "lmc-mergekit-yaml"
    command = [str(script), str(path), str(tmp_path / "out"), "--lmc-cache", str(tmp_path / "c")]
    done = launch([command, command], [here, elsewhere])
    (code0, err0), (code1, err1) = done
    assert code0 != 0 and code1 != 0, (err0[-2000:], err1[-2000:])
    lines = [err.strip().splitlines() for err in (err0, err1)]
    assert len(lines[1]) == 1 and problem in lines[1][0], err1
    assert len(lines[0]) == 1, err0
    assert "process 1 of 2 failed: " in lines[0][0] and problem in lines[0][0], err0
    assert not (tmp_path / "out").exists()
