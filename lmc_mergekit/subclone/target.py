"""The shape a donor is converted to, checked against the donor, and the rotary pairs it keeps.

Rotary embeddings rotate pair ``j`` of a head at frequency ``θ^(-2j/R)`` (``R`` rotary dims,
base ``θ``). A smaller head keeps ``R'/2`` whole pairs; the target's pair ``i`` must turn at
the target's frequency ``θ'^(-2i/R')``, so the kept donor pairs are ``j = i·s`` for a whole
stride ``s`` with ``θ' = θ^(s·R'/R)``. Halving the head keeps every other pair at the same base;
other ratios need another base, which the conversion then writes and reports. A whole stride
at the same base reproduces every base at once, so families with rotary parameters per layer
type (Gemma 3's local and global layers) change head size by such strides (and only so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmc_mergekit.errors import LmcError
from lmc_mergekit.models.adapters.base import Adapter, load_config, rotary_dims
from lmc_mergekit.models.functional import module_config
from lmc_mergekit.models.view import ModelSpec

# What a target config must share with its donor (converting changes sizes, nothing else).
SAME_KIND = (
    "norm",
    "parallel_residual",
    "gated_mlp",
    "activation",
    "vocab_size",
    "norm_offset",
    "pre_norms",
    "post_norms",
    "qk_norm",
)
# Scaled rotary types act on each frequency alone, so the kept pairs can keep their scaled
# frequencies; these cannot (per-dimension factors, or one set of parameters per layer type).
UNSCALABLE_ROPE = {"longrope": "scales every rotary dimension by a factor of its own"}
PER_LAYER_TYPE = "per-layer-type"
SIZES = (
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("intermediate_size", "intermediate_size"),
    ("rotary_dims", "rotary dims per head"),
)


def kept_layers(layers: int, target: int) -> list[int]:
    """Donor layers a ``target``-layer model keeps: evenly spaced, first and last included."""
    if target == 1:
        return [0]
    return [round(i * (layers - 1) / (target - 1)) for i in range(target)]


@dataclass(frozen=True)
class RotaryPlan:
    """Donor rotary pairs kept, in target order, and the target's rotary base."""

    pairs: tuple[int, ...]
    theta: float
    adjusted: bool

    def to_dict(self) -> dict:
        return {"kept_pairs": list(self.pairs), "rope_theta": self.theta, "adjusted": self.adjusted}


def resolve_target(
    donor: ModelSpec,
    adapter: Adapter,
    sizes: dict[str, int | None],
    target_config: str | Path | None = None,
    folder: Path | None = None,
) -> tuple[ModelSpec, RotaryPlan]:
    """The target spec of ``donor`` and the rotary pairs it keeps, or a one-line error saying
    which size cannot be met. The target is the config.json ``target_config``, or ``sizes``
    (config.json names: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``intermediate_size``; None keeps the donor's). A
    donor with scaled rotary embeddings changes head size only when the target's scaled
    frequencies are the kept pairs' (checked on the donor checkpoint in ``folder``)."""
    if target_config is not None:
        given = _target_from_config(Path(target_config), adapter, donor)
        target, theta = given, given.rope_theta
    else:
        target, theta = _target_from_sizes(donor, adapter, sizes), None
    _check_shrinks(donor, target)
    plan = plan_rotary(donor, target.rotary_dims, theta)
    target = replace(
        target,
        rope_theta=plan.theta,
        embedding_multiplier=adapter.embedding_multiplier(target.hidden_size),
    )
    if donor.layer_types and target_config is None:  # the kept layers keep their types
        kept = kept_layers(donor.num_layers, target.num_layers)
        target = replace(target, layer_types=tuple(donor.layer_types[i] for i in kept))
    if plan.pairs != tuple(range(donor.rotary_dims // 2)) and donor.rope_type != "default":
        _check_scaled_rotary(donor, target, plan, adapter, folder)
    return target, plan


def _check_scaled_rotary(
    donor: ModelSpec, target: ModelSpec, plan: RotaryPlan, adapter: Adapter, folder: Path | None
) -> None:
    """A one-line error unless the target's scaled rotary frequencies (of every layer type,
    where each has its own) are the kept pairs'."""
    kind = donor.rope_type
    if kind == PER_LAYER_TYPE and plan.adjusted:
        raise LmcError(
            f"a head of {target.head_dim} dims keeps no whole stride of the donor's rotary "
            "pairs, and a new base cannot serve every attention type (each has rotary "
            f"parameters of its own); choose a head size that divides {donor.head_dim} "
            f"(e.g. {donor.head_dim // 2})"
        )
    if folder is None:
        _refuse_rotary(
            kind, UNSCALABLE_ROPE.get(kind, "is not one the tool can check per frequency")
        )
    made_config = module_config(folder, adapter, target)
    kept_config = adapter.text_config(load_config(folder))
    params = kept_config.rope_parameters or {}
    for layer_type in list(params) if kind == PER_LAYER_TYPE else [None]:
        kept = _frequencies(kept_config, layer_type)[list(plan.pairs)]
        made = _frequencies(made_config, layer_type)
        gap = float(((made - kept).abs() / kept.abs()).max())
        if gap > 1e-5:
            which = "" if layer_type is None else f" of {layer_type}"
            raise LmcError(
                f"the target's rotary frequencies{which} "
                f"are not the kept pairs' (relative gap {gap:.1e}); choose a head size that "
                "keeps every s-th pair at the donor's base"
            )


def _frequencies(config, layer_type: str | None) -> torch.Tensor:
    """The rotary frequencies ``config`` gives (those of ``layer_type``, where each type has
    its own), or a one-line error where they are not one per pair."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    kind = params.get("rope_type", "default")
    if kind == "default":
        head_dim = getattr(config, "head_dim", None)
        dims = rotary_dims(config, head_dim or config.hidden_size // config.num_attention_heads)
        steps = torch.arange(0, dims, 2, dtype=torch.float64) / dims
        return float(params["rope_theta"]) ** -steps
    reason = UNSCALABLE_ROPE.get(kind)
    if reason is None and kind not in ROPE_INIT_FUNCTIONS:
        reason = "is not one the tool can check per frequency"
    if reason is not None:
        _refuse_rotary(kind, reason)
    init = ROPE_INIT_FUNCTIONS[kind]
    return init(config, torch.device("cpu"), layer_type=layer_type)[0].double()


def _refuse_rotary(kind: str, reason: str) -> None:
    raise LmcError(
        f"the donor's rotary embedding (type {kind!r}) {reason}; its head size cannot "
        "change: keep head_dim (and the rotary dims) of the donor"
    )


def _target_from_sizes(donor: ModelSpec, adapter: Adapter, sizes: dict) -> ModelSpec:
    hidden = sizes.get("hidden_size") or donor.hidden_size
    heads = sizes.get("num_attention_heads") or donor.num_heads
    if sizes.get("head_dim") is not None:
        if adapter.head_dim_from_hidden:
            raise LmcError(
                f"{donor.architecture} derives the head size from hidden_size / "
                "num_attention_heads; remove head_dim from subclone:"
            )
        head_dim = sizes["head_dim"]
    elif not adapter.head_dim_from_hidden and donor.hidden_size != donor.num_heads * donor.head_dim:
        head_dim = donor.head_dim  # the donor's head size is not tied to its width either
    elif hidden % heads:
        raise LmcError(
            f"target hidden_size {hidden} is not num_attention_heads {heads} × a whole head "
            f"size; choose sizes with hidden_size = heads × head size (e.g. {heads} × "
            f"{max(1, hidden // heads)} = {heads * max(1, hidden // heads)})"
        )
    else:
        head_dim = hidden // heads
    kv_heads = sizes.get("num_key_value_heads")
    if kv_heads is None:
        if donor.num_kv_heads == donor.num_heads:
            kv_heads = heads
        elif heads % donor.group_size == 0:
            kv_heads = heads // donor.group_size
        else:
            raise LmcError(
                f"{heads} query heads do not divide into the donor's groups of "
                f"{donor.group_size}; set num_key_value_heads under subclone:"
            )
    # Keep the donor's rotary fraction.
    rotary = donor.rotary_dims * head_dim / donor.head_dim
    if rotary != int(rotary) or int(rotary) % 2:
        raise LmcError(
            f"a head of {head_dim} dims keeps {rotary:g} of the donor's rotary dims "
            f"({donor.rotary_dims} of {donor.head_dim}), not a whole number of pairs; choose "
            "another head size"
        )
    return replace(
        donor,
        hidden_size=hidden,
        num_layers=sizes.get("num_hidden_layers") or donor.num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dims=int(rotary),
        intermediate_size=sizes.get("intermediate_size") or donor.intermediate_size,
    )


def _target_from_config(path: Path, adapter: Adapter, donor: ModelSpec) -> ModelSpec:
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise LmcError(
            f"target_config {str(path)!r} is no readable config.json; give the config of a "
            "model of the target shape"
        ) from None
    model_type = raw.pop("model_type", None) if isinstance(raw, dict) else None
    if model_type not in adapter.model_types:
        raise LmcError(
            f"target_config is a {model_type} model but the donor is {donor.architecture}; "
            "convert within one family"
        )
    target = adapter.spec_from_config(AutoConfig.for_model(model_type, **raw))
    for key in SAME_KIND:
        if getattr(target, key) != getattr(donor, key):
            raise LmcError(
                f"target_config differs from the donor in {key} ({getattr(target, key)} vs "
                f"{getattr(donor, key)}); only sizes can change"
            )
    return replace(
        target,
        architecture=donor.architecture,
        norm_eps=donor.norm_eps,
        tied_embeddings=donor.tied_embeddings,
        learned_positions=min(target.learned_positions, donor.learned_positions),
    )


def _check_shrinks(donor: ModelSpec, target: ModelSpec) -> None:
    for key, name in SIZES:
        if getattr(target, key) > getattr(donor, key):
            raise LmcError(
                f"the target's {name} ({getattr(target, key)}) is larger than the donor's "
                f"({getattr(donor, key)}); subclone_compensate only makes models smaller"
            )
    if target.num_heads % target.num_kv_heads:
        raise LmcError(
            f"num_attention_heads {target.num_heads} is not a multiple of num_key_value_heads "
            f"{target.num_kv_heads}"
        )
    if target.group_size > donor.group_size:
        raise LmcError(
            f"the target shares each key/value head among {target.group_size} query heads, "
            f"the donor among {donor.group_size}: key/value heads cannot be merged by "
            f"selection; use num_key_value_heads >= {-(-target.num_heads // donor.group_size)}, "
            "a divisor of num_attention_heads"
        )
    free, donor_free = target.head_dim - target.rotary_dims, donor.head_dim - donor.rotary_dims
    if free > donor_free:
        raise LmcError(
            f"the target's heads have {free} non-rotary dims, the donor's only {donor_free}; "
            "rotary dims cannot become non-rotary ones"
        )


def plan_rotary(donor: ModelSpec, rotary_dims: int, theta: float | None) -> RotaryPlan:
    """The donor pairs whose frequencies the target's rotary pairs reproduce.

    With ``theta`` None the donor's base is kept when the ratio of rotary dims allows it;
    otherwise the base is chosen for the closest whole stride (``adjusted``).
    """
    have, want = donor.rotary_dims // 2, rotary_dims // 2
    base = donor.rope_theta
    if want <= 1:
        return RotaryPlan(tuple(range(want)), base if theta is None else theta, False)
    most = (have - 1) // (want - 1)
    if theta is None:
        stride = min(max(1, round(donor.rotary_dims / rotary_dims)), most)
        if stride * rotary_dims == donor.rotary_dims:
            return RotaryPlan(tuple(range(0, stride * want, stride)), base, False)
        theta = base ** (stride * rotary_dims / donor.rotary_dims)
        return RotaryPlan(tuple(range(0, stride * want, stride)), theta, True)
    exact = donor.rotary_dims * math.log(theta) / (rotary_dims * math.log(base))
    stride = round(exact)
    if stride < 1 or abs(stride - exact) > 1e-6 or stride > most:
        options = ", ".join(
            f"{base ** (k * rotary_dims / donor.rotary_dims):.6g}" for k in range(1, most + 1)
        )
        raise LmcError(
            f"no selection of the donor's rotary pairs (base {base:g}, {donor.rotary_dims} "
            f"dims) turns at the target's frequencies (base {theta:g}, {rotary_dims} dims); "
            f"a target base of {options} would work"
        )
    return RotaryPlan(tuple(range(0, stride * want, stride)), theta, False)
