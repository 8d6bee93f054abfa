"""Function-preserving symmetries of a transformer: the group elements and their actions."""

from lmc_mergekit.symmetry.sampling import random_transform
from lmc_mergekit.symmetry.transform import LayerTransform, Transform
from lmc_mergekit.symmetry.weight_actions import apply_transform

__all__ = ["LayerTransform", "Transform", "apply_transform", "random_transform"]
