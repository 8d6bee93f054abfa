"""The model card of a plugin merge, written from the user's original recipe."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import ModelCard
from mergekit.card import generate_card

from lmc_mergekit.plugin.recipe import Recipe


def write_card(
    folder: Path,
    recipe: Recipe,
    name: str,
    prepared: dict[str, Path],
    summary: str = "",
    checked: str = "",
) -> None:
    """README.md (mergekit's card plus a section on the pre-merge pass, the sentence
    ``checked`` on how its outputs were checked and the pass's own ``summary``, in Markdown)
    and mergekit_config.yml."""
    text = generate_card(config=recipe.config, config_yaml=recipe.source, name=name)
    method = recipe.plugin_method
    settings = json.dumps(recipe.settings.model_dump(mode="json"), indent=2, sort_keys=True)
    rows = "\n".join(f"| `{source}` | `{target}` |" for source, target in prepared.items())
    text += (
        f"\n## Pre-merge pass (lmc-mergekit)\n\n"
        f"Each input went through the `{method.name}` pre-merge pass of "
        f"[lmc-mergekit](https://pypi.org/project/lmc-mergekit/) before mergekit combined the "
        f"tensors. {checked}\n\n"
        f"Settings (`{method.section}:`):\n\n```json\n{settings}\n```\n\n"
        f"| input | prepared checkpoint |\n|---|---|\n{rows}\n"
    )
    if summary:
        text += f"\n{summary}\n"
    card = ModelCard(text)
    tags = list(card.data.tags or [])
    card.data.tags = [*tags, "lmc-mergekit", method.name]
    card.save(folder / "README.md")
    (folder / "mergekit_config.yml").write_text(recipe.source, encoding="utf-8")
