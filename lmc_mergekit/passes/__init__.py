"""Each plugin method's work on whole models, in two stages with their settings next to them.

The *pre-merge pass* (``prepare``) turns the recipe's input checkpoints into one prepared
checkpoint per input, which mergekit then combines; the *measurement* (``measure``) runs after
the merge and writes the method's report. :mod:`lmc_mergekit.plugin` caches both stages and is
the only code that runs mergekit (a measurement that needs comparison merges declares them).
"""
