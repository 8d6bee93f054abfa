"""Which start each model keeps before learning: as it is, weight matching or activation
matching, decided on held-out calibration text.

A start is scored by the loss of its mix with the reference at λ = ½, sequence by sequence, on
:data:`SCORE_SEQUENCES` calibration sequences that matching did not read. Starts are tried
from the cheapest and least invasive one: the models **kept** as they are (what mergekit's
``linear`` merge averages: a base and its fine-tunes, which sit in one basin), then weight
matching, then activation matching. A later start replaces the current one only when its mix
is lower by a clear margin: more than :data:`CLEAR_MARGIN` nats and more than twice the
standard error of the per-sequence differences (paired: both mixes read the same sequences).
No further start is tried once the current one leaves no barrier at ½ (its mix no more than
:data:`CLEAR_MARGIN` above the mean of the two models' own losses): nothing is left for a
dearer start to remove. The margin and its evidence (fine-tunes of every zoo family, pairs from
different seeds) are in docs/how-it-works.md, measured by ``benchmarks/one_basin.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lmc_mergekit.evaluation.blockwise import MixedView, sequence_losses
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import ModelView
from lmc_mergekit.symmetry import Transform, apply_transform

#: Calibration sequences (after those activation matching reads) that score the starts.
SCORE_SEQUENCES = 16
#: Nats by which a dearer start's mix must be lower to replace the current one, and the
#: barrier at ½ below which no dearer start is tried. benchmarks/one_basin.py, seven zoo
#: families: matching a fine-tune onto its base lowered the mix by at most 0.034 nats (its
#: barrier as it is: -0.13 or lower), matching models from different seeds by at least 0.37
#: (barrier +1.3 or more); the margin sits between, three times from each.
CLEAR_MARGIN = 0.1
#: Starts in the order they are tried.
ORDER = ("kept", "weights", "activations")


def clearly_lower(current: torch.Tensor, candidate: torch.Tensor) -> tuple[bool, dict]:
    """Whether per-sequence losses ``candidate`` are clearly lower than ``current`` (see the
    module docstring), and the comparison's figures (mean difference, its standard error and
    the threshold it had to pass)."""
    difference = (current - candidate).double()
    mean = float(difference.mean())
    spread = float(difference.std()) if len(difference) > 1 else 0.0
    error = spread / math.sqrt(len(difference))
    threshold = max(CLEAR_MARGIN, 2 * error)
    figures = {"lower_by": round(mean, 6), "standard_error": round(error, 6)}
    return mean > threshold, {**figures, "threshold": round(threshold, 6)}


@dataclass
class StartScorer:
    """Scores the starts of ``other`` against ``reference`` on ``sequences``: the raw models'
    mix through ``raw_runner``, moved mixes (the reference moved by ``reference_transform``)
    through ``moved_runner`` (their norms absorbed)."""

    reference: ModelView
    other: ModelView
    reference_transform: Transform
    raw_runner: BlockRunner
    moved_runner: BlockRunner
    sequences: torch.Tensor
    #: Per start, the mean loss of its mix; ``endpoints``: the mean of the two models' own.
    scores: dict[str, float] = field(default_factory=dict)
    _losses: dict[str, torch.Tensor] = field(default_factory=dict)

    def _endpoints(self) -> torch.Tensor:
        """Per sequence, the mean of the two models' own losses (computed once)."""
        if "endpoints" not in self._losses:
            ends = [
                sequence_losses(v, self.raw_runner, self.sequences)
                for v in (self.reference, self.other)
            ]
            self._losses["endpoints"] = (ends[0] + ends[1]) / 2
            self.scores["endpoints"] = round(float(self._losses["endpoints"].mean()), 6)
        return self._losses["endpoints"]

    def score(self, start: str, transform: Transform | None) -> float:
        """The mean loss of the mix at ½ of the reference and ``other`` moved by
        ``transform`` (``None``: both kept as they are)."""
        if transform is None:
            mix = MixedView(self.reference, self.other, 0.5)
            runner = self.raw_runner
        else:
            moved = apply_transform(self.reference, self.reference_transform)
            mix = MixedView(moved, apply_transform(self.other, transform), 0.5)
            runner = self.moved_runner
        self._losses[start] = sequence_losses(mix, runner, self.sequences)
        self.scores[start] = round(float(self._losses[start].mean()), 6)
        return self.scores[start]

    def barrier(self, start: str) -> float:
        """How far ``start``'s mix lies above the mean of the two models' own losses."""
        return float((self._losses[start] - self._endpoints()).mean())

    def leaves_no_barrier(self, start: str) -> bool:
        """Whether ``start``'s mix is within :data:`CLEAR_MARGIN` of the models' own losses."""
        return self.barrier(start) <= CLEAR_MARGIN

    def compare(self, current: str, candidate: str) -> tuple[bool, dict]:
        """Whether ``candidate`` (scored) replaces ``current``, and the figures."""
        return clearly_lower(self._losses[current], self._losses[candidate])
