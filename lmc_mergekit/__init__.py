"""lmc-mergekit: a mergekit plugin for merges that weight averaging alone cannot do.

Importing the package (or any of its math: ``lmc_mergekit.symmetry``, ``lmc_mergekit.matching``,
...) changes nothing in mergekit. The plugin is used through ``lmc-mergekit-yaml``, or in Python
by importing :mod:`lmc_mergekit.plugin`, which registers ``lmc_dm``, ``subclone_compensate``
and ``ls_merge`` in mergekit's method registry and repairs mergekit 0.1.5's architecture
definitions that current checkpoints do not match.
"""

__version__ = "0.6.0"
