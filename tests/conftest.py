"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import os
import sys

# Nothing the tests run may reach the Hub; huggingface_hub reads this once, when imported.
os.environ["HF_HUB_OFFLINE"] = "1"
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import torch
from tiny_models import VARIANTS, build_model


def pytest_configure(config):
    """Under pytest-xdist each worker, and every process it starts, gets its share of the
    cores: torch's default of a thread per core in every worker makes the threads wait on
    each other (the suite then takes longer than with one worker)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per architecture variant."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in VARIANTS}


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """Nothing the tests run writes into the user's cache, module fixtures included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMC_MERGEKIT_CACHE", str(tmp_path_factory.mktemp("session-cache")))
        yield


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Each test gets its own prepared-input cache."""
    monkeypatch.setenv("LMC_MERGEKIT_CACHE", str(tmp_path / "lmc-cache"))


# About the smallest zoo setting that still shows a clear barrier between seeds (~0.6 nats).
SMALL_ZOO = {"arch": "gpt_neox", "hidden": 32, "layers": 2, "steps": 150}


@pytest.fixture(scope="session")
def text(tmp_path_factory) -> Path:
    """40 kB of the bundled text as a training file (a module may define its own)."""
    from lmc_mergekit.data import bundled_text_files

    path = tmp_path_factory.mktemp("text") / "excerpt.txt"
    path.write_text(bundled_text_files()[0].read_text(encoding="utf-8")[:40_000])
    return path


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory) -> Path:
    """The test session's zoo folder."""
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def trained_pair(zoo_root) -> tuple[Path, Path]:
    """Two small GPT-NeoX models trained here on the bundled corpus from seeds 0 and 1."""
    from lmc_mergekit.zoo import build_zoo

    a, b = build_zoo(zoo_root, seeds=(0, 1), progress=False, **SMALL_ZOO)
    return a, b
