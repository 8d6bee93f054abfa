"""The two changes to mergekit that give it a plugin entry point (0.1.5 has none).

Its configuration keeps a plugin recipe's own section (which it used to drop with every key it
does not know), and ``mergekit.merge.run_merge`` hands a recipe whose method is a plugin method to a
handler (the pipeline, see :mod:`lmc_mergekit.plugin.mergekit_entry`), so ``mergekit-yaml``,
``mergekit-multi`` and every notebook that calls ``run_merge`` run plugin recipes. Any other
recipe reaches mergekit's own ``run_merge`` as mergekit parsed it, plugin sections removed:
built-in merges are exactly mergekit's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

from mergekit.config import MergeConfiguration

from lmc_mergekit.plugin.methods import BY_SECTION, plugin_method
from lmc_mergekit.runtime.post_import import when_imported


def keep_plugin_sections() -> None:
    """mergekit's configuration keeps the plugin methods' sections (``alignment:``, ...), so
    that they survive ``MergeConfiguration.model_validate``; other keys it does not know it
    still drops (idempotent)."""
    if MergeConfiguration.model_config.get("extra") == "allow":
        return
    sections = frozenset(BY_SECTION)

    def drop_other_keys(self, context, /) -> None:
        extra = self.__pydantic_extra__ or {}
        for key in [key for key in extra if key not in sections]:
            del extra[key]

    MergeConfiguration.model_config["extra"] = "allow"
    MergeConfiguration.model_post_init = drop_other_keys
    # pydantic calls model_post_init only on classes marked so when they were built.
    MergeConfiguration.__pydantic_post_init__ = "model_post_init"
    MergeConfiguration.model_rebuild(force=True)


def without_sections(config: MergeConfiguration) -> MergeConfiguration:
    """``config`` as mergekit itself would have parsed it: without the plugin sections."""
    if not config.model_extra:
        return config
    plain = config.model_copy()
    plain.__pydantic_extra__ = {}
    return plain


class _NoTorchDtypeNotice(logging.Filter):
    """Drops transformers' "`torch_dtype` is deprecated" notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`torch_dtype` is deprecated" not in record.getMessage()


@contextmanager
def without_torch_dtype_notice() -> Iterator[None]:
    """mergekit 0.1.5 sets ``config.torch_dtype`` on the merged model's config, which
    transformers 5 answers with a deprecation notice in the middle of every merge's output;
    the notice is dropped while the block runs (every other message passes)."""
    logger = logging.getLogger("transformers.configuration_utils")
    notice = _NoTorchDtypeNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def route_run_merge(handler: Callable) -> None:
    """Make ``mergekit.merge.run_merge`` call ``handler`` (with run_merge's arguments) for plugin
    recipes: now, or when ``mergekit.merge`` is imported (idempotent)."""
    when_imported("mergekit.merge", functools.partial(_wrap, handler=handler))


#: The attribute of the routing wrapper that holds the function it wraps.
ORIGINAL = "__lmc_original__"


def mergekit_run_merge():
    """The ``run_merge`` that the routing wraps (mergekit's own, or whatever else was there)."""
    import mergekit.merge

    return getattr(mergekit.merge.run_merge, ORIGINAL, mergekit.merge.run_merge)


def _wrap(module: ModuleType, handler: Callable) -> None:
    original = module.run_merge
    if hasattr(original, ORIGINAL):
        return

    @functools.wraps(original)
    def run_merge(merge_config, out_path, options, config_source=None):
        if plugin_method(merge_config.merge_method) is None:
            return original(without_sections(merge_config), out_path, options, config_source)
        return handler(merge_config, out_path, options, config_source)

    setattr(run_merge, ORIGINAL, original)
    module.run_merge = run_merge
