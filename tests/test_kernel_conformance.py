"""What every native kernel must satisfy, one test per property parametrized by kernel (issue 22, item 6).

Each entry names the kernel's ``torch.library`` op, its launch planner and where the planner's fields sit in the
op's schema; the per-kernel test files keep what is particular to one kernel.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from qlinear import backends
from qlinear.backends import async_dequant, cuda_lut, quick

# backend: (op, plan function, number of schema arguments after the plan's fields)
KERNELS = {
    "cuda_lut": ("bcq_lut_gemv", cuda_lut.plan, 0),
    "quick": ("quick_gemm", quick.plan, 0),
    "async_dequant": ("mixed_gemv", async_dequant.plan, 1),
}


@pytest.mark.parametrize("backend", list(KERNELS))
def test_op_schema_takes_the_launch_plan_in_plan_order(backend):
    """``linear()`` passes ``*plan(...)`` positionally: the schema must name the plan's fields, in the order its
    docstring returns them, right before any trailing flags."""
    op, plan, tail = KERNELS[backend]
    args = [a.name for a in getattr(torch.ops.qlinear, op).default._schema.arguments]
    fields = [n.strip() for n in inspect.getsource(plan).split('"""')[1].split("``(")[1].split(")``")[0].split(",")]
    assert len(fields) >= 3 and args[len(args) - tail - len(fields):len(args) - tail] == fields


@pytest.mark.parametrize("backend", list(KERNELS))
def test_registered_with_a_layout_on_cuda_only(backend):
    """Every native GPU kernel is registered for CUDA with its own layout, explicit capabilities and a reason when
    its extension is unavailable (never a bare failure on a machine without a GPU)."""
    ks = [k for k in backends.kernels() if k.backend == backend]
    assert ks and all(k.devices == frozenset({"cuda"}) and k.layout is not None for k in ks)
    assert all(k.dtypes == frozenset({torch.float16, torch.bfloat16}) for k in ks)
    if not torch.cuda.is_available():
        assert all(k.reject(_cfg(k.format), torch.device("cuda"), torch.float16, 1) for k in ks)


def _cfg(fmt):
    from qlinear.formats import get_format

    uniform = {"bits": 4, "group_size": 64, "init": "uniform", "iters": 0}
    return get_format(fmt).Config(**(uniform if fmt == "bcq" else {}))
