"""The start-up hook: makes mergekit's own commands and functions run the plugin's methods.

Python runs it at start-up (``lmc_mergekit.pth``, or ``lmc_mergekit.start`` where PEP 829
applies) in every interpreter of the environment the package is installed in, so it costs
this module and :mod:`lmc_mergekit.runtime.post_import` (``os`` and ``sys`` only): it imports
neither torch nor mergekit. When mergekit's configuration, method registry or ``mergekit.merge``
is imported, it loads :mod:`lmc_mergekit.plugin`, which registers the methods, lets the
configuration keep a plugin section and routes plugin recipes given to ``run_merge`` (so
``mergekit-yaml``, ``mergekit-multi`` and Python callers) through the plugin's pipeline.
Built-in recipes are left exactly as mergekit runs them.

``LMC_MERGEKIT_AUTOLOAD=0`` turns it off (mergekit then knows nothing of the plugin unless
``lmc_mergekit.plugin`` is imported); ``python -S`` never runs it.
"""

from __future__ import annotations

import os
import sys

SWITCH = "LMC_MERGEKIT_AUTOLOAD"
OFF = frozenset({"0", "false", "no", "off"})
#: The first of these to finish importing loads the plugin (the configuration: so that a recipe
#: validated before anything else of mergekit is imported keeps its plugin section).
TRIGGERS = ("mergekit.config", "mergekit.merge_methods", "mergekit.merge")

_installed = False
_loaded = False


def enabled() -> bool:
    """Whether the environment lets the hook load the plugin."""
    return os.environ.get(SWITCH, "1").strip().lower() not in OFF


def install() -> None:
    """Load the plugin when mergekit is imported (once; nothing when switched off)."""
    global _installed
    if _installed or not enabled():
        return
    _installed = True
    from lmc_mergekit.runtime.post_import import when_imported

    for name in TRIGGERS:
        when_imported(name, _load_plugin)


def _load_plugin(module) -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    # A broken plugin must not break mergekit's own merges: say so once and carry on.
    try:
        import lmc_mergekit.plugin  # noqa: F401 - importing it is what loads the plugin
    except Exception as error:  # anything at all, reported on one line
        print(
            f"lmc-mergekit: not loaded into mergekit ({type(error).__name__}: {error}); "
            f"{SWITCH}=0 turns this off",
            file=sys.stderr,
        )
