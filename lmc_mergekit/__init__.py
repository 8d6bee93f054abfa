"""lmc-mergekit: a mergekit plugin for merges that weight averaging alone cannot do.

Installed, it loads itself into mergekit when mergekit is imported (the start-up hook,
:mod:`lmc_mergekit.autoload`; ``LMC_MERGEKIT_AUTOLOAD=0`` turns that off): mergekit's own
``mergekit-yaml``, ``mergekit-multi`` and ``run_merge`` then run recipes of ``lmc_dm``,
``subclone_compensate`` and ``ls_merge``, as ``lmc-mergekit-yaml`` does. Importing the package's
math (``lmc_mergekit.symmetry``, ``lmc_mergekit.matching``, ...) changes nothing in mergekit.
"""

__version__ = "0.6.0"
