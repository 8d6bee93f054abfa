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
dearer start to remove. Every start is scored on the first :data:`FIRST_SEQUENCES` sequences
first; the rest are read only where those leave a decision open (it must clear its threshold
by :data:`EARLY_SIGMAS` standard errors on them): a scramble, or a base and its fine-tune, is
decided on four sequences, a close call on all. The margin and its evidence (fine-tunes of
every zoo family, pairs from different seeds) are in docs/how-it-works.md, measured by
``benchmarks/one_basin.py``.

The models as they are are not scored where their token embeddings lie at least
:data:`UNRELATED_EMBEDDINGS` apart (relative): tables that far apart share no basin (two seeds,
or a scramble, lie about √2 apart; a base and its fine-tune a few hundredths), and scoring them
costs three passes over text (their mix and each model) that could only confirm it: about a
minute at 1.5B parameters on two cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lmc_mergekit.evaluation.blockwise import MixedView, sequence_losses
from lmc_mergekit.models.block_runner import BlockRunner
from lmc_mergekit.models.view import ModelView, row_chunks
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
#: Relative distance ``||E_B - E_A|| / ||E_A||`` of the token embeddings from which the models as
#: they are are not scored as a start: as far apart as tables of equal norms at a cosine of ½
#: (unrelated ones sit near √2: 1.406 for Qwen2.5-Coder-1.5B and its scramble; a zoo base and
#: its fine-tune below 0.1, tests/test_one_basin.py).
UNRELATED_EMBEDDINGS = 1.0
#: Vocabulary rows read at a time when the embeddings are compared.
_ROWS = 16384


def embeddings_apart(reference: ModelView, other: ModelView) -> float:
    """``||E_B - E_A|| / ||E_A||`` of the two models' token embeddings as stored, a slice of
    rows at a time (infinite where their shapes differ)."""
    diff = total = 0.0
    chunks = (row_chunks(view, "embeddings", _ROWS) for view in (reference, other))
    for part_a, part_b in zip(*chunks, strict=False):
        if part_a.tokens.shape != part_b.tokens.shape:
            return math.inf
        ta, tb = part_a.tokens.float(), part_b.tokens.float()
        diff += float(torch.sub(ta, tb).pow_(2).sum())
        total += float(ta.pow(2).sum())
    if reference.spec.vocab_size != other.spec.vocab_size:
        return math.inf
    return math.sqrt(diff / max(total, 1e-300))


#: Calibration sequences every start is first scored on; the rest of :data:`SCORE_SEQUENCES`
#: are read only where these leave a decision open.
FIRST_SEQUENCES = 4
#: Standard errors by which a decision taken on the first sequences must clear its threshold
#: (a t of 5 on 3 degrees of freedom: about one chance in 130 of a sign error, where the two
#: sides are equal; a scramble or a pair from different seeds clears it by 20 or more).
EARLY_SIGMAS = 5.0


def _figures(difference: torch.Tensor) -> tuple[float, float]:
    """The mean of per-sequence ``difference`` and its standard error."""
    difference = difference.double()
    mean = float(difference.mean())
    spread = float(difference.std()) if len(difference) > 1 else 0.0
    return mean, spread / math.sqrt(len(difference))


def clearly_lower(current: torch.Tensor, candidate: torch.Tensor) -> tuple[bool, dict]:
    """Whether per-sequence losses ``candidate`` are clearly lower than ``current`` (see the
    module docstring), and the comparison's figures (mean difference, its standard error and
    the threshold it had to pass)."""
    mean, error = _figures(current - candidate)
    threshold = max(CLEAR_MARGIN, 2 * error)
    figures = {"lower_by": round(mean, 6), "standard_error": round(error, 6)}
    return mean > threshold, {**figures, "threshold": round(threshold, 6)}


def early_decision(difference: torch.Tensor, threshold: float) -> bool | None:
    """Whether the mean of per-sequence ``difference`` is above ``threshold``, where its first
    sequences already say so by :data:`EARLY_SIGMAS` standard errors; None where they do not."""
    mean, error = _figures(difference)
    if mean - EARLY_SIGMAS * error > threshold:
        return True
    if mean + EARLY_SIGMAS * error < threshold:
        return False
    return None


@dataclass
class StartScorer:
    """Scores the starts of ``other`` against ``reference`` on ``sequences``: the raw models'
    mix through ``raw_runner``, moved mixes (the reference moved by ``reference_transform``)
    through ``moved_runner`` (their norms absorbed). Each is scored on the first
    :data:`FIRST_SEQUENCES` sequences, and on the rest only where a decision needs them."""

    reference: ModelView
    other: ModelView
    reference_transform: Transform
    raw_runner: BlockRunner
    moved_runner: BlockRunner
    sequences: torch.Tensor
    #: Per start, the mean loss of its mix; ``endpoints``: the mean of the two models' own.
    scores: dict[str, float] = field(default_factory=dict)
    #: Per start, the sequences its score read.
    read: dict[str, int] = field(default_factory=dict)
    _losses: dict[str, torch.Tensor] = field(default_factory=dict)
    _mixes: dict[str, tuple] = field(default_factory=dict)

    def _scored(self, key: str, count: int) -> torch.Tensor:
        """Per sequence, ``key``'s losses on the first ``count`` sequences (those not yet read
        are run now)."""
        have = self._losses.get(key, torch.zeros(0, dtype=torch.float64))
        if len(have) < count:
            more = self.sequences[len(have) : count]
            pairs = self._mixes[key]
            losses = sum(sequence_losses(v, r, more) for v, r in pairs) / len(pairs)
            have = self._losses[key] = torch.cat([have, losses])
            self.scores[key] = round(float(have.mean()), 6)
            self.read[key] = len(have)
        return have[:count]

    def _first(self) -> int:
        return min(FIRST_SEQUENCES, len(self.sequences))

    def score(self, start: str, transform: Transform | None) -> float:
        """The mean loss of the mix at ½ of the reference and ``other`` moved by
        ``transform`` (``None``: both kept as they are), on the first sequences."""
        if transform is None:
            mix = MixedView(self.reference, self.other, 0.5)
            runner = self.raw_runner
        else:
            moved = apply_transform(self.reference, self.reference_transform)
            mix = MixedView(moved, apply_transform(self.other, transform), 0.5)
            runner = self.moved_runner
        self._mixes[start] = ((mix, runner),)
        self._mixes.setdefault(
            "endpoints", ((self.reference, self.raw_runner), (self.other, self.raw_runner))
        )
        self._scored(start, self._first())
        return self.scores[start]

    def barrier(self, start: str) -> float:
        """How far ``start``'s mix lies above the mean of the two models' own losses (on the
        sequences both were scored on)."""
        count = self.read[start]
        return float((self._scored(start, count) - self._scored("endpoints", count)).mean())

    def leaves_no_barrier(self, start: str) -> bool:
        """Whether ``start``'s mix is within :data:`CLEAR_MARGIN` of the models' own losses."""
        count = self._first()
        difference = self._scored(start, count) - self._scored("endpoints", count)
        above = early_decision(difference, CLEAR_MARGIN)
        if above is None:  # the first sequences do not say: all of them decide, by their mean
            self._extend(start, "endpoints")
            above = self.barrier(start) > CLEAR_MARGIN
        return not above

    def compare(self, current: str, candidate: str) -> tuple[bool, dict]:
        """Whether ``candidate`` (scored) replaces ``current``, and the figures."""
        count = self._first()
        difference = self._scored(current, count) - self._scored(candidate, count)
        if early_decision(difference, CLEAR_MARGIN) is None:
            self._extend(current, candidate)
        count = min(self.read[current], self.read[candidate])
        better, figures = clearly_lower(
            self._scored(current, count), self._scored(candidate, count)
        )
        return better, {**figures, "sequences": count}

    def _extend(self, *keys: str) -> None:
        for key in keys:
            self._scored(key, len(self.sequences))
