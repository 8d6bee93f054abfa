"""Finding the symmetry that aligns one model with another."""

from lmc_mergekit.matching.weight_matching import MatchResult, match_layer, match_weights

__all__ = ["MatchResult", "match_layer", "match_weights"]
