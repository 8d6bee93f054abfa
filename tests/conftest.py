"""Shared fixtures: tiny checkpoints built once per test session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import VARIANTS, build_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved tiny model per architecture variant."""
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in VARIANTS}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Each test gets its own prepared-input cache."""
    monkeypatch.setenv("LMC_MERGEKIT_CACHE", str(tmp_path / "lmc-cache"))
