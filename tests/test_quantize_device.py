"""The quantizers run on the weight's device (issue 22 item 5).

Without a GPU: every quantizer runs with the default device set to ``meta``, so a tensor it allocates without naming
the weight's device lands on ``meta`` and the first op mixing it with the weight fails (or leaves values that are not
the CPU run's).  With a GPU: the CUDA quantization agrees with the CPU one within the tolerance of
:meth:`qlinear.QuantLinear.quantize_weight`'s docstring.
"""

import pytest
import torch

from qlinear import QLinearConfig
from qlinear.formats import get_format
from qlinear.modules import format_config, module_class

from conftest import random_hessian

N, K = 48, 256
CASES = {
    "bcq": (QLinearConfig("bcq", bits=3, group_size=64, iters=3), False),
    "bcq_uniform": (QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0), False),
    "bcq_aware_feedback_act_order": (QLinearConfig("bcq", bits=2, group_size=64, iters=2, error_feedback=True,
                                                   act_order=True), True),
    "gptq_act_order": (QLinearConfig("bcq", bits=4, group_size=64, method="gptq", act_order=True), True),
    "gptq_static_sym": (QLinearConfig("bcq", bits=3, group_size=64, method="gptq", act_order=True,
                                      static_groups=True, sym=True), True),
    "mixed": (QLinearConfig("mixed"), False),
    "mixed_calibrated": (QLinearConfig("mixed"), True),
    "codebook": (QLinearConfig("codebook", bits=2), False),
    "codebook_calibrated": (QLinearConfig("codebook", bits=4), True),
}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * (torch.rand(K, generator=g) + 0.2)
    w[3, 17] = 9.0  # an outlier for the mixed format
    return w, random_hessian(K, n=1024, seed=seed)


def _quantize(case, w, h):
    cfg, calibrated = CASES[case]
    return module_class(cfg.format).quantize_weight(w, cfg, h if calibrated else None)


@pytest.mark.parametrize("case", list(CASES))
def test_quantizers_allocate_on_the_weights_device(case):
    w, h = _inputs()
    expected = _quantize(case, w, h)
    prev = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        got = _quantize(case, w, h)
    finally:
        torch.set_default_device(prev)
    assert got.keys() == expected.keys()
    for name, t in got.items():
        assert t.device.type == "cpu" and t.dtype == expected[name].dtype, name
        assert torch.equal(t, expected[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_quantization_matches_the_cpu(case):
    w, h = _inputs()
    cfg = CASES[case][0]
    cpu = _quantize(case, w, h)
    gpu = _quantize(case, w.cuda(), h.cuda())
    assert all(t.device.type == "cuda" for t in gpu.values())
    fmt, fcfg = get_format(cfg.format), format_config(cfg.format, cfg)[0]
    wc = fmt.dequantize(cpu, fcfg, N, K).double()
    wg = fmt.dequantize({k: v.cpu() for k, v in gpu.items()}, fcfg, N, K).double()
    err_c, err_g = (w.double() - wc).norm(), (w.double() - wg).norm()
    assert abs(err_g - err_c) <= 0.01 * err_c  # the same quality
    assert (wc == wg).double().mean() >= 0.99  # and nearly every weight the same value
