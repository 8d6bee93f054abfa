"""mergekit's own entry points run plugin recipes once the package is installed: the start-up
hook loads the plugin when mergekit is imported, ``mergekit-yaml``, ``run_merge`` and
``mergekit-multi`` run what ``lmc-mergekit-yaml`` runs, built-in recipes stay mergekit's own,
and the hook can be switched off (and never runs under ``python -S``)."""

from __future__ import annotations

import filecmp
import json
import os
import pkgutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml
from recipe_standins import plugin_recipes, standin_workspace, untimed
from tiny_models import stored_tensors
from tokenizer_helpers import model_with_tokenizer

from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.plugin.methods import plugin_method

REPO = Path(__file__).parents[1]
ALIGNMENT = {"steps": 0, "eval_sequences": 8, "points": 3}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("entry-models")
    return model_with_tokenizer(root / "a", seed=1), model_with_tokenizer(root / "b", seed=2)


def recipe_file(folder: Path, pair, method: str = "lmc_dm", **extra) -> Path:
    recipe = {
        "merge_method": method,
        "models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in pair],
        "dtype": "float32",
        **extra,
    }
    if method == "lmc_dm":
        recipe.setdefault("alignment", ALIGNMENT)
    path = folder / f"{method}.yml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def assert_same_output(
    a: Path, b: Path, unordered: tuple[str, ...] = (), timed: tuple[str, ...] = ()
) -> None:
    """Same tensors bit for bit, and every other file byte for byte (card, report, config);
    the files named in ``unordered`` hold the same lines in any order, the JSON files named in
    ``timed`` the same values but for their ``seconds``."""
    mine, theirs = stored_tensors(a), stored_tensors(b)
    assert mine.keys() == theirs.keys() and mine
    assert all(mine[k].dtype == theirs[k].dtype and mine[k].equal(theirs[k]) for k in mine)
    files = sorted(p.name for p in a.iterdir() if p.suffix != ".safetensors")
    assert files == sorted(p.name for p in b.iterdir() if p.suffix != ".safetensors")
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert not errors and all(name in unordered + timed for name in mismatch), mismatch
    for name in unordered:
        lines = [sorted((folder / name).read_text().splitlines()) for folder in (a, b)]
        assert lines[0] == lines[1], name
    for name in timed:
        records = [untimed(json.loads((folder / name).read_text())) for folder in (a, b)]
        assert records[0] == records[1], name


@pytest.mark.slow
def test_mergekit_yaml_runs_a_plugin_recipe_as_lmc_mergekit_yaml_does(pair, tmp_path, monkeypatch):
    """Each with a cache of its own: both run the pass and the measurement."""
    recipe = recipe_file(tmp_path, pair)
    ours = CliRunner().invoke(
        mergekit_yaml_main,
        [str(recipe), str(tmp_path / "1" / "out"), "--lmc-cache", str(tmp_path / "cache1")],
    )
    assert ours.exit_code == 0, ours.output
    monkeypatch.setenv("LMC_MERGEKIT_CACHE", str(tmp_path / "cache2"))
    theirs = CliRunner().invoke(mergekit_yaml, [str(recipe), str(tmp_path / "2" / "out")])
    assert theirs.exit_code == 0, theirs.output
    assert list((tmp_path / "cache2" / "lmc_dm").glob("*/preparation.json"))
    # The same files, but for the seconds each run took.
    assert_same_output(tmp_path / "1" / "out", tmp_path / "2" / "out", timed=("lmc_report.json",))


def test_run_merge_reads_the_section_from_the_configuration_alone(pair, tmp_path):
    """A notebook's ``run_merge(config, out, options)``, no recipe text: the section travels in
    the configuration (mergekit used to drop it) and is honoured."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    recipe = recipe_file(tmp_path, pair, alignment={**ALIGNMENT, "matching": "none"})
    config = MergeConfiguration.model_validate(yaml.safe_load(recipe.read_text()))
    run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert report["settings"]["matching"] == "none"
    # Unaligned, lmc_dm is the linear merge of the same models.
    linear = recipe_file(tmp_path, pair, "linear")
    result = CliRunner().invoke(mergekit_yaml, [str(linear), str(tmp_path / "linear")])
    assert result.exit_code == 0, result.output
    merged, plain = stored_tensors(tmp_path / "out"), stored_tensors(tmp_path / "linear")
    assert merged.keys() == plain.keys() and all(merged[k].equal(plain[k]) for k in merged)


def test_a_plugin_error_from_run_merge_is_one_line(pair, tmp_path):
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    from lmc_mergekit.errors import LmcError

    recipe = yaml.safe_load(recipe_file(tmp_path, pair).read_text())
    recipe["alignment"]["steps"] = -1
    config = MergeConfiguration.model_validate(recipe)
    with pytest.raises(LmcError, match="'alignment:'") as error:
        run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_mergekit_yaml_replaces_a_model_folder_and_refuses_any_other(pair, tmp_path):
    recipe = recipe_file(tmp_path, pair)
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    result = CliRunner().invoke(mergekit_yaml, [str(recipe), str(out)])
    assert result.exit_code == 1 and "holds no model" in result.output
    assert len(result.output.strip().splitlines()) == 1 and (out / "notes").is_dir()
    (out / "notes").rmdir()
    for _ in range(2):  # into an empty folder, then over its own output (as mergekit does)
        result = CliRunner().invoke(mergekit_yaml, [str(recipe), str(out)])
        assert result.exit_code == 0, result.output
        assert (out / "lmc_report.json").is_file()


def test_builtin_recipes_reach_mergekit_exactly_as_it_parsed_them(pair, tmp_path, monkeypatch):
    """A built-in recipe with a key mergekit does not know: run_merge's card (written from the
    configuration when no text is given) is the one mergekit writes without the plugin."""
    import inspect

    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

    monkeypatch.chdir(tmp_path)
    text = yaml.safe_load(recipe_file(tmp_path, pair, "linear").read_text())
    text["notes"] = "not a mergekit key"
    text["alignment"] = {"steps": 0}  # a plugin section under a built-in method
    assert MergeConfiguration.model_validate(text).model_extra == {"alignment": {"steps": 0}}
    options = MergeOptions(quiet=True)
    run_merge(MergeConfiguration.model_validate(text), "routed", options)
    # mergekit alone ignores the key: its own run_merge on the recipe without it.
    ignored = {key: value for key, value in text.items() if key not in ("notes", "alignment")}
    inspect.unwrap(run_merge)(MergeConfiguration.model_validate(ignored), "original", options)
    mergekit_config = (tmp_path / "routed" / "mergekit_config.yml").read_text()
    assert "notes" not in mergekit_config and "alignment" not in mergekit_config
    assert mergekit_config == (tmp_path / "original" / "mergekit_config.yml").read_text()


def test_the_start_files_name_the_hook():
    """``lmc_mergekit.pth`` imports the hook and ``lmc_mergekit.start`` (PEP 829) names it as an
    entry point; installing it twice is harmless."""
    from lmc_mergekit import autoload

    pth = (REPO / "startup" / "lmc_mergekit.pth.in").read_text().strip()
    assert pth.startswith("import ") and "\n" not in pth
    (entry,) = (REPO / "startup" / "lmc_mergekit.start").read_text().split()
    assert pkgutil.resolve_name(entry) is autoload.install
    watchers = [f for f in sys.meta_path if getattr(f, "_lmc_mergekit_post_import", False)]
    autoload.install()
    autoload.install()
    assert [f for f in sys.meta_path if getattr(f, "_lmc_mergekit_post_import", False)] == watchers
    assert len(watchers) <= 1


def python(code: str, env: dict | None = None, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


REGISTERED = """
    import sys
    import mergekit.config  # the configuration alone loads the plugin, so its section is kept
    print("lmc_mergekit.plugin" in sys.modules)
    import mergekit.merge_methods as methods
    names = {method.spec.name for method in methods.registered_methods()}
    print(sorted(names & {"lmc_dm", "ls_merge", "subclone_compensate"}))
    print("lmc_mergekit.plugin" in sys.modules)
"""


@pytest.mark.slow
def test_the_hook_loads_the_plugin_unless_switched_off_or_under_python_s():
    loaded = python(REGISTERED)
    assert loaded.stdout.split("\n")[:3] == [
        "True",
        "['lmc_dm', 'ls_merge', 'subclone_compensate']",
        "True",
    ], loaded.stderr
    off = python(REGISTERED, {"LMC_MERGEKIT_AUTOLOAD": "0"})
    assert off.stdout.split("\n")[:3] == ["False", "[]", "False"], off.stderr
    # -S: no site-packages processing; the packages are reachable through PYTHONPATH only.
    site = sysconfig.get_paths()["purelib"]
    bare = python(REGISTERED, {"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, "-S")
    assert bare.stdout.split("\n")[:3] == ["False", "[]", "False"], bare.stderr
    # Start-up itself imports neither torch nor mergekit.
    light = python("import sys; print('torch' in sys.modules, 'mergekit' in sys.modules)")
    assert light.stdout.strip() == "False False", light.stderr


@pytest.mark.slow
def test_the_real_mergekit_multi_runs_a_plugin_recipe_among_others(pair, tmp_path):
    """A named lmc_dm merge, then a linear merge that uses it: the aligned step is what
    ``lmc-mergekit-yaml`` writes."""
    recipe = recipe_file(tmp_path, pair)
    reference = CliRunner().invoke(mergekit_yaml_main, [str(recipe), str(tmp_path / "ref" / "out")])
    assert reference.exit_code == 0, reference.output
    second = {
        "merge_method": "linear",
        "models": [
            {"model": "aligned", "parameters": {"weight": 0.5}},
            {"model": str(pair[0]), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
    }
    multi = tmp_path / "multi.yml"
    first = {"name": "aligned", **yaml.safe_load(recipe.read_text())}
    multi.write_text(yaml.safe_dump_all([first, second], sort_keys=False))
    script = Path(sys.executable).parent / "mergekit-multi"
    done = subprocess.run(
        [
            str(script),
            str(multi),
            "-I",
            str(tmp_path / "steps"),
            "--out-path",
            str(tmp_path / "final"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    aligned, ref = (
        stored_tensors(tmp_path / "steps" / "aligned"),
        stored_tensors(tmp_path / "ref" / "out"),
    )
    assert (tmp_path / "steps" / "aligned" / "lmc_report.json").is_file()
    assert aligned.keys() == ref.keys() and all(aligned[k].equal(ref[k]) for k in ref)
    assert (tmp_path / "final" / "config.json").is_file()


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> tuple[Path, Path]:
    """Every shipped plugin recipe, shortened, with stand-ins for the models it names."""
    return standin_workspace(tmp_path_factory.mktemp("recipes"))


def run_env(hub: Path, cache: Path) -> dict:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    env["LMC_MERGEKIT_CACHE"] = str(cache)
    env.pop("PYTHONPATH", None)
    return env


#: One shipped recipe of each method, run by the console script: each run is a process start
#: (most of its ten seconds), and every recipe runs through ``run_merge`` in the wheel test.
CONSOLE_RECIPES = ("lmc_dm_hub.yml", "ls_merge_self.yml", "subclone_llama_target_config.yml")


def console_recipes() -> list[Path]:
    recipes = [recipe for recipe in plugin_recipes() if recipe.name in CONSOLE_RECIPES]
    assert len(recipes) == len(CONSOLE_RECIPES), "a console recipe is no longer shipped"
    return recipes


@pytest.fixture(scope="module")
def console_outputs(standins) -> Path:
    """One shipped plugin recipe of each method run by the real ``mergekit-yaml`` of this
    environment (an editable install in CI): the folder of their outputs, one per recipe."""
    workdir, hub = standins
    outputs = workdir.parent / "console"
    script = str(Path(sys.executable).parent / "mergekit-yaml")
    for recipe in console_recipes():
        done = subprocess.run(
            [script, recipe.name, str(outputs / recipe.stem)],
            capture_output=True,
            text=True,
            env=run_env(hub, workdir.parent / "console-cache"),
            cwd=workdir,
        )
        assert done.returncode == 0, f"{recipe.name}: {done.stderr[-3000:]}"
    return outputs


@pytest.mark.slow
def test_mergekit_yaml_runs_a_shipped_plugin_recipe_of_each_method(console_outputs):
    methods = {yaml.safe_load(r.read_text())["merge_method"] for r in plugin_recipes()}
    assert {yaml.safe_load(r.read_text())["merge_method"] for r in console_recipes()} == methods
    for recipe in console_recipes():
        method = plugin_method(yaml.safe_load(recipe.read_text())["merge_method"])
        out = console_outputs / recipe.stem
        assert (out / "config.json").is_file() and (out / method.report.file_name).is_file()
        assert stored_tensors(out), recipe.name


@pytest.mark.slow
def test_a_configuration_parsed_before_the_plugin_needs_its_text(pair, tmp_path):
    """With the hook off, a notebook parses the recipe, then imports the plugin: the section
    was dropped, so run_merge runs the recipe text it is given, and without one says so."""
    recipe = recipe_file(tmp_path, pair, alignment={"steps": 0, "evaluate": False})
    code = f"""
        import yaml
        from mergekit.config import MergeConfiguration
        text = open({str(recipe)!r}).read()
        config = MergeConfiguration.model_validate(yaml.safe_load(text))
        import lmc_mergekit.plugin
        from lmc_mergekit.errors import LmcError
        from mergekit.merge import MergeOptions, run_merge
        try:
            run_merge(config, {str(tmp_path / "lost")!r}, MergeOptions(quiet=True))
        except LmcError as error:
            print("refused:", error)
        run_merge(config, {str(tmp_path / "out")!r}, MergeOptions(quiet=True), config_source=text)
    """
    done = python(code, {"LMC_MERGEKIT_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: this lmc_dm configuration was parsed before lmc-mergekit" in done.stdout
    assert not (tmp_path / "lost").exists()
    report = json.loads((tmp_path / "out" / "lmc_report.json").read_text())
    assert report["settings"]["evaluate"] is False


@pytest.mark.slow
def test_a_builtin_recipe_gives_what_mergekit_without_the_plugin_gives(pair, tmp_path):
    """The real ``mergekit-yaml`` with the hook and with it switched off: the same files, card
    included, for a built-in recipe carrying a key mergekit does not know."""
    recipe = recipe_file(tmp_path, pair, "linear", notes="not a mergekit key")
    script = str(Path(sys.executable).parent / "mergekit-yaml")
    for folder, switch in (("with", "1"), ("without", "0")):
        done = subprocess.run(
            [script, recipe.name, f"{folder}/merged"],
            capture_output=True,
            text=True,
            env={**os.environ, "LMC_MERGEKIT_AUTOLOAD": switch, "HF_HUB_OFFLINE": "1"},
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
    # mergekit's card lists the models of a set, in an order that varies between processes.
    with_hook, without = tmp_path / "with" / "merged", tmp_path / "without" / "merged"
    assert_same_output(with_hook, without, unordered=("README.md",))


@pytest.mark.slow
def test_a_wheel_install_runs_every_shipped_plugin_recipe_through_run_merge(
    standins, console_outputs, tmp_path
):
    """The built wheel installed alone into a fresh environment (its dependencies reachable
    through a path line, whose own start-up files are not run): its start-up file is what
    makes mergekit's ``run_merge`` run each recipe (a report and weights each), to the same
    output as the console script of the editable install where that ran it."""
    workdir, hub = standins
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("lmc_mergekit-*.whl")
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    fresh = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(fresh), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(fresh),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr
    assert (site / "lmc_mergekit.pth").is_file() and (site / "lmc_mergekit.start").is_file()
    outputs = tmp_path / "outputs"
    code = f"""
        import sys, yaml, lmc_mergekit
        from pathlib import Path
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions
        assert lmc_mergekit.__file__.startswith({str(site)!r}), lmc_mergekit.__file__
        for name in sys.argv[1:]:
            text = Path(name).read_text()
            config = MergeConfiguration.model_validate(yaml.safe_load(text))
            out = Path({str(outputs)!r}) / Path(name).stem
            run_merge(config, str(out), MergeOptions(quiet=True), config_source=text)
    """
    names = [recipe.name for recipe in plugin_recipes()]
    done = subprocess.run(
        [str(fresh), "-c", textwrap.dedent(code), *names],
        capture_output=True,
        text=True,
        env=run_env(hub, tmp_path / "cache"),
        cwd=workdir,  # not the repository, whose package would shadow the installed one
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for recipe in plugin_recipes():
        method = plugin_method(yaml.safe_load(recipe.read_text())["merge_method"])
        assert (outputs / recipe.stem / method.report.file_name).is_file(), recipe.name
        assert stored_tensors(outputs / recipe.stem), recipe.name
    for recipe in console_recipes():
        ours = stored_tensors(outputs / recipe.stem)
        theirs = stored_tensors(console_outputs / recipe.stem)
        assert ours.keys() == theirs.keys() and ours, recipe.name
        section = yaml.safe_load(recipe.read_text()).get("alignment") or {}
        if section.get("steps", 0) == 0:
            assert all(ours[k].equal(theirs[k]) for k in ours), recipe.name
        else:  # learned matching's float32 sums differ by ulps from process to process
            for key, tensor in ours.items():
                torch.testing.assert_close(tensor, theirs[key], rtol=1e-3, atol=1e-4)
