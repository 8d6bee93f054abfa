"""The README and docs/ cannot drift from the code: recipe keys and defaults against the
schema, shipped recipes against the parser, CLI flags against click's own command objects,
links against the files and headings they point to, every measured table against the
benchmark that writes it, every figure the README and docs/limits.md state against the tables,
and the README's demo output against what the demo prints."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from lmc_mergekit.cli import main as tools
from lmc_mergekit.plugin.cli import mergekit_yaml_main
from lmc_mergekit.plugin.methods import METHODS
from lmc_mergekit.plugin.recipe import read_recipe

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BLOCK = re.compile(
    r"<!-- begin (benchmarks/[\w./-]+\.py):([\w-]+) -->\n(.*?)<!-- end \1:\2 -->", re.S
)
WRITTEN = re.compile(
    r"Written by `python (benchmarks/[\w./-]+\.py)[^`]*` on .+, \d{4}-\d{2}-\d{2}, "
    r"commit [0-9a-f]{7,}(\+changes)?\."
)
TRANSCRIBED = re.compile(
    r"Transcribed from the output of `[^`]+`.* as of commit [0-9a-f]{7} \(\d{4}-\d{2}-\d{2}\); "
    r"not yet rewritten by the benchmark\."
)


def without_fences(text: str) -> str:
    """Markdown with its fenced code blocks blanked (flags and tables there are examples)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def sections(text: str, level: str = "## ") -> dict[str, str]:
    """Each heading of ``level`` and the text under it."""
    parts = re.split(rf"^{level}(.+)$", without_fences(text), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def table_rows(text: str) -> list[list[str]]:
    """The cells of every Markdown table row (header and separator rows included)."""
    return [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        for line in text.splitlines()
        if line.startswith("|")
    ]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_readme_is_a_short_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    heads = re.findall(r"^## (.+)$", readme, flags=re.M)
    # What a newcomer looks for first: install and demo, a real model, recipes, limits.
    for first in ("Install and run the demo", "On a real pretrained model", "Limits"):
        assert first in heads, first
    for page in ("recipes", "cli", "how-it-works", "architectures", "results", "limits"):
        assert f"](docs/{page}.md)" in readme, page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_speak_to_users_and_link_to_what_exists(page):
    text = page.read_text(encoding="utf-8")
    for phrase in ("../shared", "issue ", "the issue", "reference notes"):
        assert phrase not in text.lower(), f"{page.name} says {phrase!r}"
    for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]+))?\)", text):
        linked = (page.parent / target) if target else page
        assert linked.exists(), f"{page.name} links to missing {target}"
        if anchor:
            heads = re.findall(r"^#+ (.+)$", without_fences(linked.read_text()), flags=re.M)
            assert anchor in {slug(h) for h in heads}, f"{page.name}: no #{anchor} in {target}"


def documented_keys(section: str) -> dict[str, tuple[str, str]]:
    """The key table of one recipe section in docs/recipes.md: key -> (type, default)."""
    pages = sections((DOCS / "recipes.md").read_text(encoding="utf-8"))
    (body,) = [text for head, text in pages.items() if head.startswith(f"`{section}:`")]
    rows = table_rows(body)
    assert rows[0] == ["key", "type", "default", "effect"], rows[0]
    return {row[0].strip("`"): (row[1], row[2]) for row in rows[2:]}


def matches_default(documented: str, default) -> bool:
    """Whether a documented default states the schema's: a literal in backticks for a value,
    words (the donor's, the bundled corpus, –) for a default computed at run time."""
    literal = re.fullmatch(r"`([^`]*)`", documented)
    if default is None or default == []:
        return literal is None or literal.group(1) in ("[]", "")
    if literal is None:
        return False
    value = literal.group(1)
    if isinstance(default, bool):
        return value == str(default).lower()
    if isinstance(default, int | float):
        return float(value) == float(default)
    if isinstance(default, list):
        return [v.strip() for v in value.split(",")] == [str(v) for v in default]
    return value == str(default)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.section)
def test_every_recipe_key_is_documented_with_its_default(method):
    documented = documented_keys(method.section)
    fields = method.settings.model_fields
    assert set(documented) == set(fields), set(documented) ^ set(fields)
    for key, (kind, default) in documented.items():
        assert matches_default(default, fields[key].default), (key, default)
        assert kind, key


def test_shipped_recipes_validate_and_are_named_in_the_docs():
    recipes = sorted((ROOT / "recipes").glob("*.yml"))
    assert recipes
    page = (DOCS / "recipes.md").read_text(encoding="utf-8")
    for path in recipes:
        read_recipe(path)  # raises on any invalid key, section or value
        assert f"`recipes/{path.name}`" in page, path.name


def documented_flags() -> dict[str, set[str]]:
    """docs/cli.md's flags per command: those in a command's section, and in a table with a
    column per command, those ticked for it."""
    found: dict[str, set[str]] = {}
    for head, body in sections((DOCS / "cli.md").read_text(encoding="utf-8")).items():
        command = re.match(r"`(lmc-mergekit-yaml|lmc-mergekit \w+)", head).group(1)
        columns = None
        for line in body.splitlines():
            cells = table_rows(line)
            if cells and columns is None and all(c.startswith("`") for c in cells[0][1:-1]):
                columns = [f"lmc-mergekit {c.strip('`')}" for c in cells[0][1:-1]]
                continue
            if not line.startswith("|"):
                columns = None
            flags = set(re.findall(r"`(--[a-z][a-z0-9-]*)", line))
            owners = [command]
            if columns and cells and cells[0][0] != "---":
                owners = [c for c, tick in zip(columns, cells[0][1:-1], strict=True) if tick]
            for owner in owners:
                found.setdefault(owner, set()).update(flags)
    return found


def flags(command: click.Command) -> set[str]:
    return {
        opt
        for param in command.params
        if isinstance(param, click.Option)
        for opt in (*param.opts, *param.secondary_opts)
        if opt.startswith("--")
    }


def test_every_cli_flag_is_documented_and_every_documented_flag_exists():
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    documented = documented_flags()
    for name, command in tools.commands.items():
        assert documented.get(f"lmc-mergekit {name}") == flags(command), name
    ours = flags(mergekit_yaml_main) - flags(mergekit_yaml)
    assert ours and ours <= documented["lmc-mergekit-yaml"]
    assert documented["lmc-mergekit-yaml"] <= flags(mergekit_yaml_main)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_measured_table_is_written_by_its_benchmark(page):
    text = page.read_text(encoding="utf-8")
    blocks = BLOCK.findall(text)
    assert text.count("<!-- begin ") == text.count("<!-- end ") == len(blocks)
    for script, name, body in blocks:
        source = (ROOT / script).read_text(encoding="utf-8")
        assert "add_markdown_option(" in source and "publish(" in source, script
        first = body.strip().splitlines()[0]
        written = WRITTEN.fullmatch(first)
        assert written or TRANSCRIBED.fullmatch(first), f"{name}: {first}"
        assert written is None or written.group(1) == script, first
    if page.name not in ("README.md", "results.md"):
        return  # reference pages: their tables hold defaults, not measurements
    # A table with figures outside a block was typed by hand.
    outside = without_fences(BLOCK.sub("", text))
    for row in table_rows(outside):
        if row and not set(row[0]) <= set("-"):
            assert not any(re.search(r"\d\.\d|\d ?%|\d s\b", cell) for cell in row), row


#: A number as prose writes it: ``1,000``, ``2.978``; one with two dots is a version.
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)*"
#: The units of a measured figure: time, memory, a share, a ratio (``×`` not followed by a
#: number, which makes it a shape: ``8 × 128``), nats, points of a share.
UNIT = r"(?:s|ms|min|minutes?|seconds?|h|hours?|[KMGT]i?B|%|×(?! ?\d)|nats?|points?)(?!\w)"
#: A number not inside a word, a hash, a version, an identifier (arXiv:2606.23607) or a model's
#: size (1.5B, 135M: the letter ends it), not after a comparison (≥ 3.11) or an equals sign
#: (d=768, λ = 0.05); with its unit, or the unit of the range it starts (61–64 s).
FIGURE = re.compile(
    rf"(?<![\w.,:≥≤<>=/])(?<![≥≤<>=] )({NUMBER})(?![\w.])"
    rf"(?:\s?({UNIT})|(?=\s?–\s?{NUMBER}\s?({UNIT})))?"
)
#: A target, not a measurement: "aim 3×", "aim: 150 s", "the aim of 10 minutes", "the 90 %
#: aimed at".
AIM_BEFORE = re.compile(r"\baims?:? (?:of )?(?:the )?$")
AIM_AFTER = re.compile(r" aim")
#: Units written two ways.
SAME_UNIT = {"second": "s", "seconds": "s", "minute": "min", "minutes": "min", "hour": "h",
             "hours": "h", "nat": "nats", "point": "points"}  # fmt: skip


def unit(word: str | None) -> str:
    return SAME_UNIT.get(word, word) if word else ""


def prose(text: str) -> str:
    """Markdown as a reader reads its sentences: without blocks, fenced code, code spans, HTML
    comments and link targets, its whitespace collapsed."""
    text = without_fences(BLOCK.sub("", text))
    text = re.sub(r"<!--.*?-->|`[^`]*`", "…", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"\s+", " ", text)


def figures(text: str) -> list[tuple[str, str, str]]:
    """Each measured figure of ``text``'s prose: a number with a unit (:data:`FIGURE`), or a
    decimal of two places or more (a loss, a barrier: 2.978); aims left out. Its number, its
    unit (none for a bare decimal) and the words around it."""
    found = []
    for match in FIGURE.finditer(text):
        number, start, end = match.group(1), match.start(), match.end()
        word = match.group(2) or match.group(3)
        if number.count(".") > 1 or not (word or len(number.partition(".")[2]) >= 2):
            continue  # a version, or a count, a size or a setting
        if AIM_BEFORE.search(text[max(0, start - 16) : start]) or AIM_AFTER.match(text[end:]):
            continue
        words = text[max(0, start - 40) : end + 20]
        found.append((number.replace(",", ""), unit(word), words))
    return found


def block_figures() -> set[tuple[str, str]]:
    """Every number that stands in a block of any page, with its unit where one follows it."""
    held = set()
    for page in PAGES:
        for _, _, body in BLOCK.findall(page.read_text(encoding="utf-8")):
            for number, word in re.findall(
                rf"(?<![\d.,])(\d+(?:,\d{{3}})*(?:\.\d+)?)(?!\d)(?:\s?({UNIT}))?", body
            ):
                held.add((number.replace(",", ""), unit(word)))
    return held


def test_figure_rule_tells_measurements_from_other_numbers():
    text = prose(
        "Python ≥ 3.11, mergekit 0.1.5, Qwen2.5-Coder-1.5B at d=768 (30 layers, 9/3 heads), "
        "commit 020e598 on 2026-12-07, `lmc_dm` in `0.66 s`, [results](results.md#2.5-s), "
        "arXiv:2606.23607, λ = 0.05, 8 × 128 tokens, 49k × 576, (aim 3×; 1.5×), the 90 % aimed "
        "at, the aim of 10 minutes. Measured: 42 min, 1.26 GB (2.52×), 61–64 s, 81 %, 2.978, "
        "0.0005 and 8.82 nats, 7 points, 1,000 seconds."
    )
    assert [(number, unit) for number, unit, _ in figures(text)] == [
        ("1.5", "×"), ("42", "min"), ("1.26", "GB"), ("2.52", "×"), ("61", "s"), ("64", "s"),
        ("81", "%"), ("2.978", ""), ("0.0005", ""), ("8.82", "nats"), ("7", "points"),
        ("1000", "s"),
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["README.md", "limits.md"])
def test_the_readme_and_limits_state_only_figures_a_block_holds(name):
    """The README and docs/limits.md may state a measured figure (a number with a unit of time,
    memory, share or ratio, or a decimal of two places or more) outside a block only where a
    block of the docs holds that same number, with that unit or with none (a table's cell): a
    figure retyped from an old run, or worked out from a table, drifts from what the benchmarks
    write. Each end of a range counts; versions, model sizes, shapes, counts, dates, hashes,
    code, link targets and aims are not figures."""
    page = ROOT / name if name == "README.md" else DOCS / name
    held = block_figures()
    numbers = {number for number, _ in held}
    stray = [
        f"{number} {unit}: ...{words}..."
        for number, unit, words in figures(prose(page.read_text(encoding="utf-8")))
        if not ((number, unit) in held or (number, "") in held or (not unit and number in numbers))
    ]
    assert not stray, "\n".join(stray)


def summary_lines(text: str) -> list[str]:
    """The demo's summary with its figures and paths taken out: what it says, in order."""
    return [re.sub(r"\d+\.\d+|[~./][^\s]*", "#", line).rstrip() for line in text.splitlines()]


@pytest.mark.slow
def test_readme_shows_what_the_demo_prints(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = [b for s, n, b in BLOCK.findall(readme) if s == "benchmarks/demo.py"]
    assert WRITTEN.fullmatch(block.strip().splitlines()[0])
    shown = re.search(r"```\n(.*?)\n```", block, re.S).group(1)
    args = ["demo", str(tmp_path / "demo"), "--hidden", "32", "--layers", "2", "--steps", "8"]
    args += ["--align-steps", "2", "--zoo", str(tmp_path / "zoo"), "--lmc-cache", str(tmp_path)]
    result = CliRunner().invoke(tools, args)
    assert result.exit_code == 0, result.output
    printed = result.stdout[result.stdout.rindex("models:") :].strip()
    assert summary_lines(shown) == summary_lines(printed)


def test_the_stale_block_lister_names_each_block_to_write_again(tmp_path):
    """``benchmarks/docs_blocks.py``: a block written at the checked-out commit is current; a
    transcribed one, one from uncommitted code and one at a commit this clone lacks are
    listed, each with its reason and command, and the check fails."""
    import subprocess
    import sys

    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")

    def block(name: str, first: str) -> str:
        marker = f"benchmarks/demo.py:{name}"
        return f"<!-- begin {marker} -->\n{first}\n\n| a |\n<!-- end {marker} -->\n"

    where = "on 2 cores of a CPU, 2026-12-07"
    page = tmp_path / "page.md"
    page.write_text(
        block("now", f"Written by `python benchmarks/demo.py` {where}, commit {head}.")
        + block("hand", "Transcribed from the output of `x` as of commit 0000000 (2026-01-01).")
        + block("dirty", f"Written by `python benchmarks/demo.py` {where}, commit {head}+changes.")
        + block("gone", f"Written by `python benchmarks/demo.py --a` {where}, commit {'f' * 40}.")
    )
    script = [sys.executable, str(ROOT / "benchmarks" / "docs_blocks.py")]
    stale = subprocess.run([*script, "stale", str(page)], capture_output=True, text=True)
    assert stale.returncode == 1, stale.stderr
    lines = stale.stdout.splitlines()
    assert [line.split(": ")[0].rsplit(":", 1)[1] for line in lines] == ["hand", "dirty", "gone"]
    assert "transcribed by hand" in lines[0] and "uncommitted code" in lines[1]
    assert "does not have" in lines[2] and lines[2].endswith("run: python benchmarks/demo.py --a")
    listed = subprocess.run([*script, "list", str(page)], capture_output=True, text=True)
    assert listed.returncode == 0 and "demo.py:now: current" in listed.stdout
