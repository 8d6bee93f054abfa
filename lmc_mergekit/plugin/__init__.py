"""The mergekit-facing layer: the method records, their registration, recipes, the pipeline
(pre-merge pass → mergekit → measurement → card), the CLI and the demo.

Importing this package (the start-up hook does, when mergekit is imported) registers
``lmc_dm``, ``subclone_compensate`` and ``ls_merge`` in mergekit's method registry, lets
mergekit's configuration keep a plugin section, and routes ``mergekit.merge.run_merge`` so that
plugin recipes run through the pipeline (all idempotent). Its merges use repaired architecture
definitions; mergekit's own merges of built-in recipes are left as they are.
"""

from lmc_mergekit.plugin.mergekit_hooks import keep_plugin_sections, route_run_merge
from lmc_mergekit.plugin.methods import register_methods


def _run_plugin_merge(*args, **kwargs):
    # Imported when a plugin recipe runs: the pipeline needs all of mergekit, which may still
    # be importing when this package is loaded by the start-up hook.
    from lmc_mergekit.plugin.mergekit_entry import run_plugin_merge

    return run_plugin_merge(*args, **kwargs)


register_methods()
keep_plugin_sections()
route_run_merge(_run_plugin_merge)
