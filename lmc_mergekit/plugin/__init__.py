"""The mergekit-facing layer: the method records, their registration, recipes, the pipeline
(pre-merge pass → mergekit → measurement → card), the CLI and the demo.

Importing this package registers ``lmc_dm``, ``subclone_compensate`` and ``ls_merge`` in
mergekit's method registry and repairs mergekit's architecture definitions (both idempotent):
``import lmc_mergekit.plugin`` before calling mergekit from Python.
"""

from lmc_mergekit.plugin.architecture_repairs import repair_architectures
from lmc_mergekit.plugin.methods import register_methods

register_methods()
repair_architectures()
