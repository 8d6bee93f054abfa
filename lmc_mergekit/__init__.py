"""lmc-mergekit: a mergekit plugin for merges that weight averaging alone cannot do.

Importing the package registers ``lmc_dm``, ``subclone_compensate`` and ``ls_merge`` in mergekit's
method registry and repairs mergekit 0.1.5's GPT-NeoX architecture definition.
"""

from lmc_mergekit.plugin.gpt_neox_fix import repair_gpt_neox
from lmc_mergekit.plugin.methods import register_methods

__version__ = "0.2.0"

register_methods()
repair_gpt_neox()
