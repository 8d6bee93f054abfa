"""Recipes: mergekit's YAML plus, for a plugin method, its own section; validated up front.

Everything a recipe can get wrong is a one-line error before any work: YAML that is not a
mapping, a plugin section under another method or with an unknown or bad key, an invalid
mergekit configuration (including one mergekit would only refuse with a traceback, such as
``models: []``), an unknown merge method or dtype, a ``combine:`` that is no built-in method,
and weights that sum to zero under ``normalize``. The configuration keeps the paths as written:
mergekit resolves them as ``mergekit-yaml`` does, and the card quotes them as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from mergekit.common import dtype_from_name
from mergekit.config import MergeConfiguration
from pydantic import ValidationError

from lmc_mergekit.errors import LmcError
from lmc_mergekit.passes.base import Section, TextSettings
from lmc_mergekit.plugin.mergekit_hooks import without_sections
from lmc_mergekit.plugin.methods import BY_SECTION, PluginMethod, plugin_method


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: the user's text, mergekit's configuration (paths as written), and the
    plugin method's record and settings (None for built-in methods)."""

    source: str
    config: MergeConfiguration
    method: PluginMethod | None = None
    settings: Section | None = None


def read_recipe(path: str | Path) -> Recipe:
    """The recipe in the file ``path``."""
    path = Path(path)
    if not path.is_file():
        raise LmcError(f"recipe {str(path)!r} does not exist")
    return parse_recipe(path.read_text(encoding="utf-8"))


def parse_recipe(text: str) -> Recipe:
    """Parse and validate recipe text."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise LmcError(f"recipe is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise LmcError("recipe must be a YAML mapping with at least merge_method and models")
    method, settings = _section(raw.get("merge_method"), raw)
    if method is not None:
        raw.pop(method.section, None)
    try:
        config = MergeConfiguration.model_validate(raw)
    except ValidationError as error:
        raise LmcError(f"invalid recipe: {_first_error(error)}") from None
    except (RuntimeError, ValueError, TypeError) as error:  # mergekit's own validators
        raise LmcError(f"invalid recipe: {str(error).splitlines()[0]}") from None
    return _checked(text, config, method, settings)


def recipe_of(config: MergeConfiguration, text: str) -> Recipe:
    """The recipe of a configuration mergekit parsed with its plugin section kept (see
    :func:`~lmc_mergekit.plugin.mergekit_hooks.keep_plugin_sections`) from the recipe text
    ``text``, validated as :func:`parse_recipe` validates it, without parsing it again."""
    method, settings = _section(config.merge_method, config.model_extra or {})
    return _checked(text, without_sections(config), method, settings)


def _section(name: object, sections: dict) -> tuple[PluginMethod | None, Section | None]:
    """The plugin method ``name`` (None for a built-in one) and its validated section among
    ``sections`` (the recipe's top-level keys); a one-line error for another method's."""
    method = plugin_method(name)
    for section, owner in BY_SECTION.items():
        if section in sections and owner is not method:
            raise LmcError(
                f"recipe section '{section}:' belongs to merge_method: {owner.name}, but this "
                f"recipe uses {name!r}; remove the section or change the method"
            )
    if method is None:
        return None, None
    body = sections.get(method.section) or {}
    if not isinstance(body, dict):
        raise LmcError(f"recipe section '{method.section}:' must be a mapping of settings")
    return method, _validated(method.settings, body, f"'{method.section}:'")


def _checked(
    text: str, config: MergeConfiguration, method: PluginMethod | None, settings: Section | None
) -> Recipe:
    """The recipe, once what mergekit would only refuse late (or never) is checked."""
    _check_method(config.merge_method, "merge_method")
    for key in ("dtype", "out_dtype"):
        _check_dtype(key, getattr(config, key))
    if method is not None:
        combine = settings.combining_method()
        if combine is not None:
            _check_method(combine, f"recipe section '{method.section}:': combine", built_in=True)
        _check_weights(config, method.name)
        if settings.needs_plain_weights() and plain_weights(config) is None:
            raise LmcError(
                f"recipe section '{method.section}:' asks for a statistics repair, which "
                "interpolates the inputs' statistics by their weights: give each model one "
                "number as its weight (not a per-tensor filter or gradient), or set repair: false"
            )
    return Recipe(source=text, config=config, method=method, settings=settings)


def _validated(model: type[Section], body: dict, where: str) -> Section:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        # The method's own keys first, then the shared text keys.
        fields = sorted(model.model_fields, key=lambda key: key in TextSettings.model_fields)
        allowed = ", ".join(fields)
        detail = error.errors()[0]
        if detail["type"] == "extra_forbidden":
            raise LmcError(
                f"recipe section {where}: unknown key {detail['loc'][0]!r} (allowed: {allowed})"
            ) from None
        raise LmcError(f"recipe section {where}: {_first_error(error)}") from None


def _first_error(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(str(part) for part in detail["loc"])
    return f"{where}: {detail['msg']}" if where else detail["msg"]


def _check_method(name: str, where: str, built_in: bool = False) -> None:
    """A one-line error unless mergekit knows the method ``name`` (a built-in one, if asked)."""
    from mergekit import merge_methods

    known = sorted(m.spec.name for m in merge_methods.registered_methods())
    if built_in:
        known = [k for k in known if plugin_method(k) is None]
    if name not in known:
        raise LmcError(
            f"{where}: {name!r} is not a mergekit method (use one of: {', '.join(known)})"
        )


def _check_dtype(key: str, name: str | None) -> None:
    try:
        dtype_from_name(name)
    except RuntimeError:
        raise LmcError(
            f"{key}: {name!r} is not a dtype mergekit knows (use bfloat16, float16 or float32)"
        ) from None


def _weights(config: MergeConfiguration) -> list | None:
    """Each model's weight (the plugin's methods weigh a model 1 unless told), or None where
    some weight is a per-tensor filter or gradient."""
    weights = [(entry.parameters or {}).get("weight", 1.0) for entry in config.models or []]
    plain = all(isinstance(w, int | float) and not isinstance(w, bool) for w in weights)
    return weights if plain else None


def plain_weights(config: MergeConfiguration) -> tuple[float, ...] | None:
    """Each model's weight normalised to sum to 1; None where some weight is not one number,
    or they sum to zero."""
    weights = _weights(config)
    if not weights or sum(weights) == 0:
        return None
    return tuple(w / sum(weights) for w in weights)


def average_weights(config: MergeConfiguration) -> tuple[float, ...] | None:
    """Each model's weight in the weighted average a plugin method's merge writes (normalised
    unless the recipe sets ``normalize: false``); None where some weight is not one number."""
    if (config.parameters or {}).get("normalize", True):
        return plain_weights(config)
    weights = _weights(config)
    return None if weights is None else tuple(float(w) for w in weights)


def _check_weights(config: MergeConfiguration, method: str) -> None:
    """Plain weights that sum to zero under ``normalize`` (the default) would make every tensor
    0/0: refused before the pre-merge pass runs."""
    if not (config.parameters or {}).get("normalize", True):
        return
    weights = _weights(config)
    if weights and sum(weights) == 0:
        raise LmcError(
            f"the weights of the {method} recipe sum to zero, and normalize divides by their "
            "sum; give some model a non-zero weight or set parameters: normalize: false"
        )
