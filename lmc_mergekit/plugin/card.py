"""The model card of a merge, written from the recipe as the user wrote it.

mergekit's own template, with the models listed by the paths the recipe gives (as
``mergekit-yaml`` lists them) and ``base_model:`` metadata naming only Hub ids, decided without
asking the Hub (mergekit asks it about every relative local path, which fails offline). A plugin
merge adds a section on its pre-merge pass and the method's report.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from mergekit.card import CARD_TEMPLATE, method_md
from mergekit.common import ModelReference

from lmc_mergekit.plugin.inputs import is_hub_id, references
from lmc_mergekit.plugin.recipe import Recipe

CONFIG_FILE = "mergekit_config.yml"
CARD_FILE = "README.md"


def _paths(ref: ModelReference) -> list[str]:
    return [ref.model.path] + ([ref.lora.path] if ref.lora else [])


def _model_md(ref: ModelReference) -> str:
    return " + ".join(
        f"[{path}](https://huggingface.co/{path})" if is_hub_id(path) else path
        for path in _paths(ref)
    )


def recipe_card(recipe: Recipe, name: str, tags: tuple[str, ...] = ()) -> str:
    """mergekit's card for the recipe, titled ``name``."""
    config = recipe.config
    merged = set(config.referenced_models())
    models = [ref for ref in references(config) if ref in merged]
    hub = [path for ref in models for path in _paths(ref) if is_hub_id(path)]
    base = None if config.merge_method == "slerp" else config.base_model  # as mergekit does
    metadata = {"base_model": hub, "tags": ["mergekit", "merge", *tags]}
    return CARD_TEMPLATE.format(
        metadata=yaml.dump({**metadata, "library_name": "transformers"}),
        model_list="\n".join("* " + _model_md(ref) for ref in models if ref != base),
        base_text="" if base is None else f" using {_model_md(base)} as a base",
        merge_method=method_md(config.merge_method),
        name=name,
        config_yaml=recipe.source,
    )


def write_card(
    folder: Path, recipe: Recipe, name: str, prepared: dict[str, str] | None = None, report=None
) -> None:
    """README.md and mergekit_config.yml. For a plugin merge the card adds a section on the
    pre-merge pass (``prepared``: each input as written → its prepared checkpoint in the cache)
    and the ``report``'s own section."""
    method = recipe.method
    if method is None:
        text = recipe_card(recipe, name)
    else:
        settings = json.dumps(recipe.settings.model_dump(mode="json"), indent=2, sort_keys=True)
        rows = "\n".join(f"| `{source}` | `{target}` |" for source, target in prepared.items())
        text = recipe_card(recipe, name, ("lmc-mergekit", method.name)) + (
            f"\n## Pre-merge pass (lmc-mergekit)\n\n"
            f"Each input went through the `{method.name}` pre-merge pass of "
            f"[lmc-mergekit](https://pypi.org/project/lmc-mergekit/) before mergekit combined "
            f"the tensors. {method.checked}\n\n"
            f"Settings (`{method.section}:`):\n\n```json\n{settings}\n```\n\n"
            f"| input | prepared checkpoint (in the lmc-mergekit cache) |\n|---|---|\n{rows}\n"
        )
        section = "" if report is None else report.card_section()
        if section:
            text += f"\n{section}\n"
    (folder / CARD_FILE).write_text(text, encoding="utf-8")
    (folder / CONFIG_FILE).write_text(recipe.source, encoding="utf-8")
