"""Activation matching: it must exactly undo any symmetry, from what the models compute."""

from __future__ import annotations

import pytest
import torch
from test_weight_matching import _max_relative_gap
from tiny_models import VARIANTS, probe_ids

from lmc_mergekit.matching.activation_matching import match_activations
from lmc_mergekit.matching.align import block_runner
from lmc_mergekit.models.adapters import open_model
from lmc_mergekit.models.view import materialize
from lmc_mergekit.symmetry import Transform, apply_transform, random_transform
from lmc_mergekit.symmetry.group import symmetry_group
from lmc_mergekit.transform_checkpoint import transform_checkpoint


@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_matching_undoes_a_scramble_exactly(variant, model_dirs, tmp_path):
    source = model_dirs[variant]
    view = open_model(source)
    spec = view.spec
    scrambled = tmp_path / "scrambled"
    transform_checkpoint(source, scrambled, random_transform(spec, seed=11), progress=False)
    absorbed = apply_transform(view, Transform(spec.num_layers, absorb_norms=True))
    runner = block_runner(view, absorbed.spec, torch.device("cpu"))

    result = match_activations(view, open_model(scrambled), runner, probe_ids(shape=(8, 32)))

    recovered = materialize(apply_transform(open_model(scrambled), result.transform))
    # Discrete residual maps come out exact; continuous ones as exact as the float32
    # activations they are fitted to (weight matching fits to float64 weights: 1e-5 there).
    discrete = symmetry_group(spec).residual == "signed_permutation"
    assert _max_relative_gap(materialize(absorbed), recovered) < (1e-6 if discrete else 5e-4)
    before, after = result.stream_cosine
    assert after == pytest.approx(1.0, abs=1e-6) and before < 0.9
    assert result.record()["tokens"] == 8 * 32
