"""The plugin layer's structure: layers that only point down, registration only when the
plugin is used, one record per method, and preparing cached apart from measuring."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from lmc_mergekit.plugin.cli import mergekit_yaml_main

PACKAGE = Path(__file__).parents[1] / "lmc_mergekit"
# Bottom to top; a module may import only from its own layer or the ones below.
LAYERS = [
    {"errors", "runtime"},
    {"data", "models"},
    {"evaluation", "symmetry", "latent", "subclone", "zoo", "repair"},
    {"matching", "transform_checkpoint"},
    {"passes"},
    {"plugin", "autoload", "cli"},
]


def imports() -> dict[str, set[str]]:
    """Module → the package's modules it imports (anywhere in the file, lazily or not; ``from
    package import module`` counts as importing that module)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmc_mergekit"):
                for alias in node.names:
                    module = f"{node.module}.{alias.name}"
                    found.add(module if module in files else node.module)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("lmc_mergekit")}
        graph[name] = found - {name}
    return graph


def layer_of(module: str) -> int:
    """The layer of a module (the top-level package, which only holds the version, is below
    everything)."""
    if "." not in module:
        return 0
    top = module.split(".")[1]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_the_import_graph_has_no_cycle_and_points_down():
    graph = imports()
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as error:
        raise AssertionError(f"import cycle: {error.args[1]}") from None
    upward = [
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, upward


@pytest.mark.slow
def test_only_the_plugin_touches_mergekit_when_imported():
    """With the start-up hook off, the package's math leaves mergekit alone (with it on,
    importing mergekit loads the plugin: tests/test_mergekit_entry.py)."""
    code = (
        "import lmc_mergekit, lmc_mergekit.symmetry, lmc_mergekit.matching.align, "
        "lmc_mergekit.passes.lmc_dm.stages\n"
        "from mergekit import merge_methods\n"
        "from mergekit.architecture import json_definitions as j\n"
        "names = {m.spec.name for m in merge_methods.registered_methods()}\n"
        "neox = j.NAME_TO_ARCH['GPTNeoXForCausalLM'][0]\n"
        "print(sorted(names & {'lmc_dm', 'ls_merge', 'subclone_compensate'}))\n"
        "import lmc_mergekit.plugin\n"
        "names = {m.spec.name for m in merge_methods.registered_methods()}\n"
        "print(sorted(names & {'lmc_dm', 'ls_merge', 'subclone_compensate'}))\n"
        "print(neox is j.NAME_TO_ARCH['GPTNeoXForCausalLM'][0])\n"
    )
    env = {**os.environ, "LMC_MERGEKIT_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    before, after, neox_unchanged = done.stdout.strip().splitlines()
    assert before == "[]" and neox_unchanged == "True"  # repairs: only in the plugin's merges
    assert after == "['lmc_dm', 'ls_merge', 'subclone_compensate']"


def test_the_repairs_hold_inside_the_plugins_merges_only():
    from mergekit.architecture import json_definitions

    from lmc_mergekit.plugin.architecture_repairs import REPAIRS, repaired_architectures

    def definitions():
        return {r.architecture: json_definitions.NAME_TO_ARCH[r.architecture] for r in REPAIRS}

    mergekit_own = definitions()
    with repaired_architectures():
        repaired = definitions()
        found = []

        def walk(node):  # the weights named like a stale GPT-NeoX buffer, in the definition
            if isinstance(node, dict):
                if str(node.get("name", "")).endswith("attention.masked_bias"):
                    found.append(node)
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(repaired["GPTNeoXForCausalLM"][0].model_dump(mode="json"))
        assert found and all(weight["optional"] for weight in found)
        assert all(repaired[name] != mergekit_own[name] for name in mergekit_own)
    assert definitions() == mergekit_own
    assert all(definitions()[name] is mergekit_own[name] for name in mergekit_own)


def test_one_record_drives_registration_sections_and_the_pipeline():
    from mergekit import merge_methods

    from lmc_mergekit.plugin.methods import METHODS
    from lmc_mergekit.plugin.recipe import parse_recipe

    smallest = {"subclone": {"hidden_size": 8}}
    for method in METHODS:
        registered = merge_methods.get(method.name)
        assert registered.spec.pretty_name == method.pretty_name
        assert registered.spec.reference_url == method.reference_url
        section = smallest.get(method.section, {})
        body = {"merge_method": method.name, "models": [{"model": "x"}], method.section: section}
        recipe = parse_recipe(yaml.safe_dump(body))
        assert recipe.method is method and isinstance(recipe.settings, method.settings)


@pytest.mark.slow
def test_changing_only_the_evaluation_reuses_the_prepared_inputs(trained_pair, tmp_path):
    cache = tmp_path / "cache"

    def run(name: str, **alignment) -> dict:
        recipe = tmp_path / f"{name}.yml"
        body = {
            "merge_method": "lmc_dm",
            "models": [{"model": str(p)} for p in trained_pair],
            "dtype": "float32",
            "alignment": {"steps": 0, "seq_len": 32, **alignment},
        }
        recipe.write_text(yaml.safe_dump(body))
        args = [str(recipe), str(tmp_path / name), "--quiet", "--lmc-cache", str(cache)]
        result = CliRunner().invoke(mergekit_yaml_main, args)
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / name / "lmc_report.json").read_text())

    first = run("first", eval_sequences=16, points=3)
    (prepared,) = cache.glob("lmc_dm/*/model-1/model.safetensors")
    stamp = prepared.stat().st_mtime_ns
    second = run("second", eval_sequences=24, points=5)
    third = run("third", evaluate=False)
    again = run("again", eval_sequences=24, points=5)
    # One prepared entry, written once: weight matching ran for the first recipe only.
    assert list(cache.glob("lmc_dm/*/model-1/model.safetensors")) == [prepared]
    assert prepared.stat().st_mtime_ns == stamp
    assert first["matching"] == second["matching"] == third["matching"]
    # Each measurement follows its own settings; the same one again comes from its cache.
    assert len(first["pairs"][0]["raw"]["lambdas"]) == 3
    assert len(second["pairs"][0]["raw"]["lambdas"]) == 5 and second["data"]["sequences"] == 24
    assert third["pairs"] == [] and "merged" not in third
    assert again == second
    assert len(list(cache.glob("lmc_dm/measurements/[!.]*"))) == 3  # not the lock files


def test_the_prepared_key_follows_the_text_and_the_device(tmp_path):
    from lmc_mergekit.passes.subclone import SubcloneSettings
    from lmc_mergekit.plugin.cache import preparation_key

    text = tmp_path / "text.txt"
    text.write_text("some calibration text")
    settings = SubcloneSettings(hidden_size=8, data=str(text))
    model = tmp_path / "model"
    model.mkdir()
    key = preparation_key("subclone_compensate", settings, [model], "cpu")
    text.write_text("other calibration text, edited in place")
    edited = preparation_key("subclone_compensate", settings, [model], "cpu")
    assert edited != key
    assert preparation_key("subclone_compensate", settings, [model], "cuda") != edited
    assert preparation_key("subclone_compensate", settings, [model], "cpu") == edited
