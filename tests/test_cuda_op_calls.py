"""Each CUDA backend's registry entry calls its op with the schema's arguments in order, checked without a GPU:
on meta tensors the op runs its fake implementation, which type-checks every argument against the schema."""

from __future__ import annotations

import pytest
import torch

from qlinear import BCQLinear, MixedPrecisionLinear, QLinearConfig, ops
from qlinear.backends import async_dequant, cuda_lut, quick


def _case(backend):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    if backend is async_dequant:
        mod = MixedPrecisionLinear.from_linear(lin, QLinearConfig("mixed", outlier_ratio=0.005), backend="reference")
    elif backend is quick:  # act_order: the kernel gathers x by perm itself
        X = torch.randn(256, 128) * torch.linspace(0.1, 2.0, 128)
        mod = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=3, group_size=64, method="gptq", act_order=True),
                                    X.T @ X, backend="reference")
        bufs = mod.canonical()
        return mod, {**backend.repack({k: v for k, v in bufs.items() if k != "perm"}, ops.kernel_view(mod.config)[0],
                                      64, 128), "perm": bufs["perm"]}
    else:
        mod = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=3, group_size=64, iters=0), backend="reference")
    return mod, backend.repack(mod.canonical(), mod.config, 64, 128)


@pytest.mark.parametrize("backend", [cuda_lut, quick, async_dequant], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("M", [1, 5, 40])
def test_linear_passes_schema_typed_arguments(backend, with_bias, M, monkeypatch):
    if M > getattr(backend, "MAX_BATCH", 8):
        pytest.skip("above the kernel's batch range")
    monkeypatch.setattr(backend, "_sms", lambda index: 132)
    mod, bufs = _case(backend)
    meta = {k: v.to("meta") for k, v in bufs.items()}
    x = torch.empty(2, M, 128, dtype=torch.float16, device="meta")
    bias = torch.empty(64, dtype=torch.float16, device="meta") if with_bias else None
    y = backend.linear(x, meta, bias, ops.kernel_view(mod.config)[0], 64, 128)
    assert y.shape == (2, M, 64) and y.dtype == torch.float16 and y.device.type == "meta"
