"""The learning-rate schedule every training loop of the tool uses."""

from __future__ import annotations

import math


def warmup_cosine(step: int, steps: int, warmup: int, floor: float = 0.0) -> float:
    """The learning-rate factor of (0-based) ``step`` of ``steps``: a linear warm-up over
    ``warmup`` steps to 1, then a cosine decay that reaches ``floor`` after the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
