"""``lmc_dm``: move every input into one basin by symmetries, then measure the paths.

The pre-merge pass writes every input with its norms absorbed, moved by weight or activation
matching onto the first (``matching: weights | activations``) and, with ``steps > 0``, by the
continuous symmetries learned matching trained for all of them
(:func:`lmc_mergekit.matching.align.align`); each is self-checked, and one that nothing moves
(a base and its fine-tune, one basin) is linked as it is stored instead. The measurement
evaluates the loss along the path from the first input to each other one on the test split,
for the raw checkpoints, after matching and after learned matching, and the merged model's own
loss; it writes ``lmc_report.json`` and ``lmc_barrier.png``.

:mod:`.settings` holds the ``alignment:`` section, :mod:`.records` what the method records and
its card prose, :mod:`.stages` the pass, the repair and the measurement; the method's one
record is :mod:`lmc_mergekit.plugin.methods`.
"""
