"""A plugin recipe is resolved once in a process into the plan every stage is handed, and what
the stages read from the inputs' folders is read once a process: a real two-input ``lmc_dm``
recipe on tiny models, run here through ``lmc-mergekit-yaml`` and mergekit's own
``mergekit-yaml``, with every file it opens for reading counted by an audit hook."""

from __future__ import annotations

import collections
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml
from tokenizer_helpers import model_with_tokenizer
from transformers import AutoTokenizer

from lmc_mergekit.plugin.cli import mergekit_yaml_main

#: The counters of the runs being counted: (path, whether a byte copy opened it) → times
#: opened for reading.
_COUNTING: list[collections.Counter] = []


def _count_reads(event: str, args: tuple) -> None:
    if event == "open" and _COUNTING and isinstance(args[0], str | bytes | os.PathLike):
        if args[2] & os.O_ACCMODE == os.O_RDONLY:
            copied = sys._getframe(1).f_code is shutil.copyfile.__code__
            _COUNTING[-1][os.fsdecode(args[0]), copied] += 1


sys.addaudithook(_count_reads)  # for good (hooks cannot be removed): it counts only in reads()


@contextmanager
def reads() -> Iterator[collections.Counter]:
    """How many times each file was opened for reading inside the block, by its resolved
    path; a file a byte copy read is counted under ``(path, "copy")``."""
    counter: collections.Counter = collections.Counter()
    _COUNTING.append(counter)
    try:
        yield counter
    finally:
        _COUNTING.remove(counter)
        opened = dict(counter)
        counter.clear()
        for (name, copied), count in opened.items():
            path = Path(name).resolve()
            counter[(path, "copy") if copied else path] += count


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    """Inputs of the test's own: nothing this process read before is of help."""
    return model_with_tokenizer(tmp_path / "a", seed=1), model_with_tokenizer(
        tmp_path / "b", seed=2
    )


def recipe_file(folder: Path, pair) -> Path:
    recipe = {
        "merge_method": "lmc_dm",
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
        "dtype": "float32",
        "alignment": {"steps": 0, "eval_sequences": 8, "points": 3},
    }
    path = folder / "recipe.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


INPUT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def bounds(model: Path, tmp_path: Path) -> dict[str, int]:
    """How often a process may open each of :data:`INPUT_FILES` of an input like ``model``,
    however many runs (pass, merge, finishing step, measurement, card) it makes: as one load of
    its tokenizer by transformers does, and config.json twice more (its JSON read once, and
    once by transformers' AutoConfig). Byte copies into the prepared checkpoints are apart."""
    copy = shutil.copytree(model, tmp_path / f"{model.name}-tokenizer-alone")
    with reads() as counted:
        AutoTokenizer.from_pretrained(copy, local_files_only=True)
    found = {name: counted[copy.resolve() / name] for name in INPUT_FILES}
    return {**found, "config.json": found["config.json"] + 2}


def assert_inputs_read(files: collections.Counter, pair, limits: dict[str, int]) -> None:
    """Each input's files opened at least once and within ``limits``, and copied at most once
    (into its prepared checkpoint)."""
    for model in pair:
        for name, bound in limits.items():
            path = (model / name).resolve()
            assert 1 <= files[path] <= bound, (model.name, name, files[path], bound)
            assert files[path, "copy"] <= 1, (model.name, name, files[path, "copy"])


def assert_read_once(files: collections.Counter, recipe: Path) -> None:
    """The recipe opened once, and the pass's record (wherever it is) once."""
    assert files[recipe.resolve()] == 1
    records = [n for path, n in files.items() if getattr(path, "name", "") == "preparation.json"]
    assert records and all(count == 1 for count in records), records


def test_a_run_reads_each_input_file_and_record_once(pair, tmp_path):
    """A first run prepares and measures, a second (in the same process) reuses both: each
    reads the recipe and the pass's record once, and the inputs' files are read within
    :func:`bounds` by both together."""
    recipe = recipe_file(tmp_path, pair)
    limits = bounds(pair[0], tmp_path)
    both: collections.Counter = collections.Counter()
    for out in ("first", "again"):
        with reads() as files:
            args = [str(recipe), str(tmp_path / out), "--quiet"]
            result = CliRunner().invoke(mergekit_yaml_main, args)
        assert result.exit_code == 0, result.output
        assert_read_once(files, recipe)
        both += files
    assert_inputs_read(both, pair, limits)


def test_mergekit_yaml_hands_over_the_recipe_it_parsed(pair, tmp_path):
    """Through mergekit's own ``mergekit-yaml`` the recipe is read and parsed once (by
    mergekit: the plugin takes the configuration it parsed), the inputs' files as above."""
    recipe = recipe_file(tmp_path, pair)
    limits = bounds(pair[0], tmp_path)
    parsed = collections.Counter()

    def count_parses(frame, event, arg) -> None:
        if event == "call" and frame.f_code is yaml.safe_load.__code__:
            parsed["yaml"] += 1

    with reads() as files:
        sys.setprofile(count_parses)
        try:
            args = [str(recipe), str(tmp_path / "out"), "--quiet"]
            result = CliRunner().invoke(mergekit_yaml, args)
        finally:
            sys.setprofile(None)
    assert result.exit_code == 0, result.output
    assert parsed["yaml"] == 1
    assert_read_once(files, recipe)
    assert_inputs_read(files, pair, limits)
