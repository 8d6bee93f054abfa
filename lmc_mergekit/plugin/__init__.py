"""The mergekit-facing layer: the method records, their registration, recipes, the pipeline
(pre-merge pass → mergekit → measurement → card), the CLI and the demo.

Importing this package registers ``lmc_dm``, ``subclone_compensate`` and ``ls_merge`` in
mergekit's method registry and repairs mergekit's architecture definitions (both idempotent):
``import lmc_mergekit.plugin`` before calling mergekit from Python.
"""

from lmc_mergekit.plugin.architecture_repairs import repair_architectures
from lmc_mergekit.plugin.mergekit_hooks import keep_plugin_sections, route_run_merge
from lmc_mergekit.plugin.methods import register_methods


def _run_plugin_merge(*args, **kwargs):
    # Imported when a plugin recipe runs: the pipeline needs all of mergekit, which may still
    # be importing when this package is loaded by the start-up hook.
    from lmc_mergekit.plugin.mergekit_entry import run_plugin_merge

    return run_plugin_merge(*args, **kwargs)


register_methods()
repair_architectures()
keep_plugin_sections()
route_run_merge(_run_plugin_merge)
