"""Publishing folders: whole or not at all, with the usual permissions, and no debris left by
runs that were killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from subprocess import PIPE

import pytest
import yaml
from click.testing import CliRunner
from tiny_models import build_model
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.runtime.publish import PREVIOUS, remove_stale_staging, staged_folder


def usual_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def test_existing_folders_are_refused_replaced_or_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    with pytest.raises(ValueError, match="--overwrite"), staged_folder(out):
        pass
    with staged_folder(out, "keep") as staging:  # a cache entry a concurrent run published
        (staging / "late.txt").write_text("late")
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    with staged_folder(out, "replace") as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert (out.stat().st_mode & 0o777) == usual_mode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_what_appears_while_a_run_works_is_never_overwritten(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--overwrite"), staged_folder(out) as staging:
        (staging / "mine.txt").write_text("staged")
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    # A cache entry is kept only when complete; an incomplete one is debris and is replaced.
    entry = tmp_path / "entry"
    entry.mkdir()
    with staged_folder(entry, "keep", complete="done.json") as staging:
        (staging / "done.json").write_text("{}")
    assert [p.name for p in entry.iterdir()] == ["done.json"]
    with staged_folder(entry, "keep", complete="done.json") as staging:
        (staging / "later.json").write_text("{}")
    assert [p.name for p in entry.iterdir()] == ["done.json"]


def _pid_never_alive() -> int:
    """A process id no process can have, now or later: above the kernel's largest one (so the
    test cannot depend on when a finished process's id is reused)."""
    pid_max = Path("/proc/sys/kernel/pid_max")
    return (int(pid_max.read_text()) if pid_max.is_file() else 99_999) + 1


def test_only_staging_folders_of_dead_processes_are_removed(tmp_path):
    from lmc_mergekit.runtime.publish import _host

    host = _host()
    dead_pid = _pid_never_alive()
    # A live process whose life this test controls: it runs until its stdin closes.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=PIPE)
    try:
        stale = tmp_path / f".out.partial-{host}-{dead_pid}-abc123"
        live = tmp_path / f".out.partial-{host}-{child.pid}-def456"
        elsewhere = tmp_path / f".out.partial-otherhost-{dead_pid}-ghi789"
        other_name = tmp_path / f".cache-entry.partial-{host}-{dead_pid}-jkl012"
        unrelated = tmp_path / ".out.partial-old"
        for folder in (stale, live, elsewhere, other_name, unrelated):
            folder.mkdir()
        assert remove_stale_staging(tmp_path, "out") == [stale]
        assert remove_stale_staging(tmp_path) == [other_name]  # every name (a cache folder)
        assert all(p.is_dir() for p in (live, elsewhere, unrelated))
    finally:
        child.stdin.close()
        child.wait()


KILLED_WHILE_REPLACING = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from lmc_mergekit.runtime.publish import staged_folder

    out = Path(sys.argv[1]).absolute()

    def die_before_the_new_folder_goes_in(event, args):
        # The rename of the new folder into place: the old one has been moved aside by now.
        if event == "os.rename" and Path(args[1]) == out:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(die_before_the_new_folder_goes_in)
    with staged_folder(out, "replace") as folder:
        (folder / "new.txt").write_text("new")
    """
)


def test_replacing_keeps_the_old_folder_until_the_new_one_is_in_place(tmp_path):
    """Killed at the worst moment of a replacement (the old folder moved aside, the new one not
    yet in): the old folder is whole in the staging folder, and the next run beside it puts it
    back before anything else; an undisturbed replacement leaves only the new one."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.bin").write_bytes(bytes(range(256)) * 64)
    before = (out / "old.bin").read_bytes()
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_REPLACING, str(out)])
    assert killed.returncode == -signal.SIGKILL
    (staging,) = tmp_path.glob(".out.partial-*")
    assert not out.exists() and (staging / PREVIOUS / "old.bin").read_bytes() == before
    assert remove_stale_staging(tmp_path, "out") == [staging]
    assert [p.name for p in out.iterdir()] == ["old.bin"]
    assert (out / "old.bin").read_bytes() == before
    with staged_folder(out, "replace") as folder:
        (folder / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]


def test_a_failing_overwrite_leaves_the_old_output_byte_for_byte(tmp_path):
    a, b = (build_model("llama", tmp_path / name, seed=seed) for seed, name in enumerate("ab"))
    out = tmp_path / "out"

    def merge(weight_b: float) -> object:
        recipe = tmp_path / f"recipe-{weight_b}.yml"
        models = [
            {"model": str(a), "parameters": {"weight": 1.0}},
            {"model": str(b), "parameters": {"weight": weight_b}},
        ]
        body = {"merge_method": "linear", "models": models, "dtype": "float32"}
        recipe.write_text(yaml.safe_dump(body))
        args = [str(recipe), str(out), "--quiet", "--overwrite"]
        return CliRunner().invoke(mergekit_yaml_main, args)

    assert merge(0.5).exit_code == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    # Weights summing to zero: mergekit writes NaN into the staging folder, the run fails.
    failed = merge(-1.0)
    assert failed.exit_code == 1 and "NaN/Inf" in failed.output, failed.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert merge(0.25).exit_code == 0
    second = {p.name: p.read_bytes() for p in out.iterdir()}
    assert second.keys() == first.keys()
    assert second["model.safetensors"] != first["model.safetensors"]
    assert [p.name for p in tmp_path.glob(".out*")] == []


KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    import lmc_mergekit.plugin.pipeline as pipeline
    from lmc_mergekit.plugin.cli import mergekit_yaml_main

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    # Die outright in the middle of the pre-merge pass, after it wrote into its staging folder.
    pipeline.write_provenance = killed
    mergekit_yaml_main(sys.argv[1:])
    """
)


@pytest.mark.slow
def test_a_run_killed_outright_leaves_no_debris_after_the_next_run(tmp_path):
    a, b = (build_model("llama", tmp_path / name, seed=seed) for seed, name in enumerate("ab"))
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "merge_method": "lmc_dm",
                "models": [{"model": str(a)}, {"model": str(b)}],
                "dtype": "float32",
                "alignment": {"steps": 0, "evaluate": False},
            }
        )
    )
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = [str(recipe), str(out), "--quiet", "--lmc-cache", str(cache)]
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, *args], capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".out.partial-*")) and list(cache.glob("lmc_dm/.*.partial-*"))
    assert not out.exists()
    result = CliRunner().invoke(mergekit_yaml_main, args)
    assert result.exit_code == 0, result.output
    assert not list(tmp_path.glob(".out.partial-*"))
    assert not list(cache.rglob("*.partial-*"))
    assert (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_cache_entries_get_the_usual_permissions(tmp_path):
    a, b = (model_with_tokenizer(tmp_path / n, "llama", seed=s) for s, n in enumerate("ab"))
    cache = tmp_path / "cache"
    for method, section in (
        ("lmc_dm", {"alignment": {"steps": 0, "evaluate": False}}),
        ("ls_merge", {"latent": {"steps": 10, "width": 16, "evaluate": False}}),
    ):
        recipe = tmp_path / f"{method}.yml"
        body = {"merge_method": method, "models": [{"model": str(a)}, {"model": str(b)}]}
        recipe.write_text(yaml.safe_dump({**body, "dtype": "float32", **section}))
        out = tmp_path / f"out-{method}"
        args = [str(recipe), str(out), "--quiet", "--lmc-cache", str(cache)]
        result = CliRunner().invoke(mergekit_yaml_main, args)
        assert result.exit_code == 0, result.output
    published = [p.parent for p in cache.rglob("preparation.json")]
    published += [p.parent for p in cache.rglob("autoencoder.safetensors")]
    published += list(cache.glob("*/measurements/[!.]*"))  # not the lock files
    assert len(published) == 5
    for folder in published:
        assert (folder.stat().st_mode & 0o777) == usual_mode(), folder
