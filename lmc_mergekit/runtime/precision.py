"""Which 16-bit and 8-bit products a device runs natively, and running a 16-bit model's
products in float32 where it does not.

A CPU without AVX512-BF16 or AMX emulates bf16 products, about three times slower than it
multiplies float32 (SmolLM2's bf16 forward: 4.3 s against 1.5 s on a Xeon without them); a
GPU and such CPUs run them at twice float32's rate. A 16-bit model kept in its dtype (half the
memory) can still compute in float32: :class:`Float32Products` casts each linear layer's weight
as it runs, one weight at a time, so the activations flow in float32 (SmolLM2: 1.5 s, and ten
times closer to the float32 model's states than its bf16 forward). A CPU with VNNI or AMX
multiplies int8 into int32 (``torch._int_mm``) at about five times its float32 rate: rankings
that need no more than eight bits per weight run there (:func:`native_int8`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: ``torch.cpu``'s probes of native 16-bit products, per dtype (private: absent ones count as no).
CPU_PROBES = {
    torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
    torch.float16: ("_is_amx_fp16_supported",),
}
INT8_PROBES = ("_is_vnni_supported", "_is_amx_tile_supported")
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def native_16bit(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` multiplies ``dtype`` (bf16 or fp16) natively: always on a GPU, on a
    CPU where ``torch.cpu`` reports the instructions."""
    return device.type != "cpu" or _cpu_reports(CPU_PROBES.get(dtype, ()))


def native_int8(device: torch.device) -> bool:
    """Whether ``device`` is a CPU that multiplies int8 natively (VNNI or AMX, as ``torch.cpu``
    reports them), where ``torch._int_mm`` runs at about five times float32's rate (0.31 s
    against 1.5 s for a 4096³ product on one core of a Xeon without bf16). Never on a GPU: its
    bf16 products are fast already, and ``_int_mm``'s CUDA kernels want shapes in multiples
    of 8."""
    return device.type == "cpu" and _cpu_reports(INT8_PROBES)


def _cpu_reports(probes: tuple[str, ...]) -> bool:
    """Whether any of ``torch.cpu``'s private probes ``probes`` says yes (absent ones: no)."""
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


class Float32Products(TorchFunctionMode):
    """Within it, ``F.linear`` with a 16-bit weight multiplies in float32 (weight and bias
    cast, one layer's at a time, the input too) and returns float32, which the rest of the
    forward then carries (type promotion): a 16-bit model computed in float32 from its stored
    weights, at float32's speed on a device that emulates 16-bit products, in its own memory
    but for one weight and the float32 activations."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            # F.linear(input, weight, bias=None), its arguments given by position or name.
            named = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            x, weight, bias = named["input"], named["weight"], named.get("bias")
            if weight.dtype in SIXTEEN_BIT:
                bias = None if bias is None else bias.float()
                return F.linear(x.float(), weight.float(), bias)
        return func(*args, **kwargs)
