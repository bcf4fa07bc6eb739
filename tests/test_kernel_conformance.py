"""What every native GPU kernel must satisfy, one test per property parametrized by kernel (issue 22, item 6).

Each :class:`Subject` names the kernel's ``torch.library`` op, its launch planner, where the planner's fields sit in
the op's schema, a small layer the kernel serves and the error bound of its executable spec (from the kernel's own
test file, whose docstring derives it).  On the CPU the spec stands in for the kernel (``conftest.spec_kernel_fixture``),
so the layout machinery is checked everywhere; the GPU tests run the kernel itself.  The per-kernel test files keep
what is particular to one kernel: the spec against float64 over its configs and launch plans, the corruptions its
layout must catch, its layout's round trips, plan coverage, the host emulation of its ``.cu`` source.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import pytest
import torch
import test_async_dequant
import test_cuda_lut
import test_quick
from conftest import ref64, spec_kernel_fixture

from qlinear import BCQLinear, MixedPrecisionLinear, QLinearConfig, backends, ops
from qlinear.backends import async_dequant, cuda_lut, quick
from qlinear.modules import QuantLinear


@dataclasses.dataclass(frozen=True)
class Subject:
    op: str  # its torch.ops.qlinear op
    plan: Callable  # its launch planner
    plan_tail: int  # schema arguments after the plan's fields
    layer: Callable[[int, int], QuantLinear]  # (N, K) -> a layer with bias it serves, canonical, on the CPU
    shape: tuple[int, int]  # (N, K) of the CPU checks
    bound: Callable[[QuantLinear, torch.Tensor], torch.Tensor]  # (layer, x fp32 [M, K]) -> the spec's bound [M, N]


def _mixed_layer(N, K):
    cfg = async_dequant.mixed.Config()
    return MixedPrecisionLinear.from_packed(async_dequant.random_buffers(N, K, cfg, seed=5), K, N, cfg, torch.randn(N),
                                           backend="reference")


SUBJECTS = {
    "cuda_lut": Subject("bcq_lut_gemv", cuda_lut.plan, 0, lambda N, K: test_cuda_lut._layer(N, K, 3, 64)[0],
                        (128, 256), test_cuda_lut._bound),
    "quick": Subject("quick_gemm", quick.plan, 0, lambda N, K: BCQLinear.from_linear(
        torch.nn.Linear(K, N), QLinearConfig("bcq", bits=3, group_size=64, init="uniform", iters=0),
        backend="reference"), (96, 192), test_quick.spec_bound),
    "async_dequant": Subject("mixed_gemv", async_dequant.plan, 1, _mixed_layer, (96, 320),
                             lambda m, x: test_async_dequant._bound(m.canonical(), m.config, m.out_features,
                                                                    m.in_features, x)),
}
KERNELS = {b: (s.op, s.plan, s.plan_tail) for b, s in SUBJECTS.items()}
# the GPU kernels' layout machinery runs with their specs on the CPU, where the native CPU kernels would take the layers
pytestmark = pytest.mark.usefixtures("without_dispatch_table", "reference_on_cpu")


def _kernel(backend):
    return next(k for k in backends.kernels() if k.backend == backend)


def _cpu_layer(backend):
    torch.manual_seed(0)
    return SUBJECTS[backend].layer(*SUBJECTS[backend].shape)


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


@pytest.mark.parametrize("backend", list(SUBJECTS))
def test_registry_rejects_with_reasons(backend):
    """A GPU kernel turns down a CPU device, fp32 activations and batches above its range, each with the reason;
    a call that names it on the CPU raises ValueError with that reason, an automatic one picks another kernel."""
    k, mod = _kernel(backend), _cpu_layer(backend)
    cfg, shape = ops.kernel_view(mod.config)[0], (mod.out_features, mod.in_features)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert "device cpu" in k.reject(cfg, cpu, torch.float16, 1, shape)
    assert "dtype torch.float32" in k.reject(cfg, cuda, torch.float32, 1, shape)
    assert f"batch {k.max_batch + 1} outside" in k.reject(cfg, cuda, torch.float16, k.max_batch + 1, shape)
    with pytest.raises(ValueError, match=f"{backend}: device cpu"):
        backends.select(k.format, cfg, cpu, torch.float16, 1, backend, shape)
    assert backends.select(k.format, cfg, cpu, torch.float16, 1, None, shape).backend != backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("backend", list(SUBJECTS))
def test_unavailable_without_gpu_and_layers_stay_canonical(backend):
    k, mod = _kernel(backend), _cpu_layer(backend)
    auto = type(mod).from_packed(mod.canonical(), mod.in_features, mod.out_features, mod.config, mod.bias)
    assert k.available() is not None and auto.layout == ""
    assert backends.layout_for(k.format, ops.kernel_view(mod.config)[0], torch.device("cuda"),
                               (mod.out_features, mod.in_features)) is None  # no CUDA kernel can load
    assert auto.kernel(torch.randn(1, mod.in_features)).backend != backend


@pytest.mark.parametrize("backend", list(SUBJECTS))
def test_module_holds_the_kernel_layout_and_saves_canonical(backend, request, tmp_path):
    """With the spec standing in for the kernel: a loaded layer holds the kernel's layout, saves the canonical
    buffers bit for bit, serves batches in range within the spec's bound and larger ones through the reference
    bit-exactly, and keeps all of it across dtype moves, save/reload, torch.compile(fullgraph) and autograd."""
    spec = request.getfixturevalue(f"spec_{backend}")
    canon = _cpu_layer(backend)
    N, K = canon.out_features, canon.in_features
    sd = canon.state_dict()
    mod = type(canon)(K, N, True, canon.config)
    mod.load_state_dict(sd)
    layout = _kernel(backend).layout
    assert mod.layout == layout.name and {n for n, _ in mod.named_buffers()} == set(layout.names(ops.kernel_view(mod.config)[0]))
    # bits_per_weight counts what checkpoints hold; the layout may add a little (tables, 4-bit zero points)
    assert mod.bits_per_weight == canon.bits_per_weight and 0 <= mod.layout_bits_per_weight - canon.bits_per_weight < .1
    assert list(mod.state_dict()) == list(sd) and all(torch.equal(mod.state_dict()[k], sd[k]) for k in sd)
    x = torch.randn(2, 3, K)
    assert mod.kernel(x).backend == spec.backend
    x2 = x.reshape(-1, K)
    assert ((mod(x).reshape(-1, N).double() - ref64(canon, x2)).abs() <= SUBJECTS[backend].bound(canon, x2)).all()
    big = torch.randn(spec.max_batch + 1, K)
    with pytest.warns(UserWarning, match="converted on every such call"):
        assert mod.kernel(big).backend == "reference"
    assert torch.equal(mod(big), canon(big)) and torch.equal(mod.dequantize(), canon.dequantize())
    mod.half().float()
    assert mod.layout == layout.name and torch.equal(mod.dequantize(), canon.dequantize())
    torch.save(mod.state_dict(), tmp_path / "m.pt")
    again = type(canon)(K, N, True, canon.config)
    again.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert again.layout == layout.name and torch.equal(again(x), mod(x))
    assert torch.equal(torch.compile(again, fullgraph=True, backend="eager")(x), mod(x))
    xg = x.clone().requires_grad_(True)
    mod(xg).sum().backward()
    assert torch.allclose(xg.grad, torch.ones(2, 3, N) @ canon.dequantize(), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(SUBJECTS))
def test_kernel_under_cuda_graph_and_compile(backend):
    """compile(fullgraph, reduce-overhead: CUDA graphs) of a layer served by the kernel gives the eager output."""
    torch.manual_seed(0)
    mod = SUBJECTS[backend].layer(1536, 576)
    mod.backend = None
    mod.cuda()
    for M in (1, min(_kernel(backend).max_batch, 100)):
        x = torch.randn(M, 576, device="cuda", dtype=torch.float16)
        assert mod.kernel(x).backend == backend
        eager = mod(x)
        f = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            assert torch.equal(f(x), eager)


spec_cuda_lut = spec_kernel_fixture("cuda_lut")
spec_quick = spec_kernel_fixture("quick")
spec_async_dequant = spec_kernel_fixture("async_dequant")
