"""The reference backend: dequantize with the format's reference code, then a dense matmul.

Runs everywhere and supports every format, bit width, group size and dtype; every other kernel is
tested against it.  The matmul runs in the activation dtype, except on CPU where it runs in float32
(half-precision CPU matmuls are slow and less accurate); the result is cast back to ``x.dtype``.
"""

from __future__ import annotations

import torch

from qlinear.formats import FORMATS

from .. import ANY, Kernel, register


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """``y = x Ŵᵀ + b`` with ``Ŵ`` the reference dequantization; ``x`` ``[..., K]`` -> ``[..., N]``."""
    w = FORMATS[cfg.format].dequantize(buffers, cfg, out_features, in_features)
    cd = torch.float32 if x.device.type == "cpu" else x.dtype
    y = torch.nn.functional.linear(x.to(cd), w.to(cd), None if bias is None else bias.to(cd))
    return y.to(x.dtype)


for _name in FORMATS:
    register(Kernel(backend="reference", format=_name, fn=linear, priority=0, devices=ANY, dtypes=ANY, bits=ANY,
                    group_sizes=ANY, max_batch=ANY, min_capability=ANY))
