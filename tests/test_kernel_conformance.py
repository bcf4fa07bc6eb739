"""What every native kernel must satisfy, one test per property parametrized by kernel (issue 22, item 6).

Each :class:`Subject` names a kernel (backend and format), the device type it runs on, a few layers it serves, and
the error bound against the float64 reference (from the kernel's own test file, whose docstring derives it: the GPU
kernels' executable specs; the CPU kernels' int8 activations); a GPU kernel also names its ``torch.library`` op, its
launch planner and where the planner's fields sit in the op's schema.  On the CPU a GPU kernel's spec stands in for
it (``conftest.spec_kernel_fixture``), so its layout machinery is checked everywhere, and the native CPU kernels (x86;
arm_neon through SIMDe on x86) run themselves; the GPU tests run the GPU kernels.  The per-kernel test files keep
what is particular to one kernel: the spec against float64 over its configs and launch plans, the corruptions its
layout must catch, its layout's round trips, plan coverage, every dispatch path, the host emulation of its ``.cu``
source or the qemu run of its aarch64 build.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional

import pytest
import torch
import test_async_dequant
import test_cuda_lut
import test_quick
import test_x86
from conftest import dense64, int8_activation_bound, ref64, spec_kernel_fixture

from qlinear import BCQLinear, CodebookLinear, MixedPrecisionLinear, QLinearConfig, backends, ops
from qlinear.backends import async_dequant, cuda_lut, quick
from qlinear.modules import QuantLinear


@dataclasses.dataclass(frozen=True)
class Subject:
    backend: str
    format: str
    device: str  # where the kernel runs: "cuda" (its spec stands in on the CPU) or "cpu" (the kernel itself)
    layers: dict[str, Callable[[], QuantLinear]]  # name -> a layer with bias it serves, canonical, on the CPU
    # (layer as the kernel sees it, x fp32 [M, K] as it sees it) -> bound [M, N] on |y - float64 reference|
    bound: Callable[[QuantLinear, torch.Tensor], torch.Tensor]
    op: Optional[str] = None  # a GPU kernel's torch.ops.qlinear op
    plan: Optional[Callable] = None  # its launch planner
    plan_tail: int = 0  # schema arguments after the plan's fields (trailing flags, then the rotation's three)
    model_config: Optional[QLinearConfig] = None  # a GPU kernel's config for the compiled-model check
    layout_slack: float = 0.1  # bits per weight the layout may take more or less than the canonical buffers

    def kernel(self):
        return next(k for k in backends.kernels(self.format) if k.backend == self.backend)


def _mixed_layer(N, K):
    cfg = async_dequant.mixed.Config()
    return MixedPrecisionLinear.from_packed(async_dequant.random_buffers(N, K, cfg, seed=5), K, N, cfg, torch.randn(N),
                                           backend="reference")


def _layer(cls, N, K, opts, calibrated=False):
    """``() ->`` a reference layer of ``opts`` quantized from a seeded ``Linear(K, N)`` (``calibrated``: with the
    Hessian of inputs of unequal scales, which makes act_order reorder)."""
    def build():
        torch.manual_seed(N + K)
        lin = torch.nn.Linear(K, N)
        X = torch.randn(512, K) * torch.linspace(0.1, 2.0, K)
        return cls.from_linear(lin, QLinearConfig(cls.format, **opts), X.T @ X if calibrated else None,
                               backend="reference")
    return build


GPTQ4_ACT_ORDER = dict(bits=4, group_size=64, method="gptq", act_order=True)
RTN4 = dict(bits=4, group_size=64, init="uniform", iters=0)
FREE4_ACT_ORDER = dict(bits=4, group_size=64, iters=1, error_feedback=True, act_order=True)  # free α


def _int8_bound(twin, x):
    return int8_activation_bound(dense64(twin.format, twin.canonical(), twin.config, twin.out_features,
                                         twin.in_features), x)


SUBJECTS = {s.backend + ("" if s.device == "cuda" else f"/{s.format}"): s for s in (
    Subject("cuda_lut", "bcq", "cuda", {"free α 3-bit g64": lambda: test_cuda_lut._layer(128, 256, 3, 64)[0],
                                        "free α 2-bit g64, 66 rows (2 padding rows)":
                                            lambda: test_cuda_lut._layer(66, 256, 2, 64)[0],
                                        "free α 3-bit error feedback act_order": _layer(BCQLinear, 64, 256, dict(
                                            bits=3, group_size=64, iters=1, error_feedback=True, act_order=True),
                                            True)},
            test_cuda_lut._bound, "bcq_lut_gemv", cuda_lut.plan, 3,
            QLinearConfig("bcq", bits=4, group_size=64, init="best", iters=1)),
    Subject("quick", "bcq", "cuda", {"RTN 3-bit g64": _layer(BCQLinear, 96, 192, dict(RTN4, bits=3)),
                                     "GPTQ 4-bit act_order": _layer(BCQLinear, 64, 256, GPTQ4_ACT_ORDER, True)},
            test_quick.spec_bound, "quick_gemm", quick.plan, 3, QLinearConfig("bcq", **RTN4)),
    Subject("quick_free", "bcq", "cuda", {"free α 4-bit error feedback act_order": _layer(BCQLinear, 64, 256,
                                                                                          FREE4_ACT_ORDER, True)},
            test_quick.spec_bound, "quick_gemm", quick.plan, 3,
            QLinearConfig("bcq", bits=4, group_size=64, iters=1, backend="quick_free")),  # the LUT GEMV outranks it
    Subject("async_dequant", "mixed", "cuda", {"mixed": lambda: _mixed_layer(96, 320)},
            lambda m, x: test_async_dequant._bound(m.canonical(), m.config, m.out_features, m.in_features, x),
            "mixed_gemv", async_dequant.plan, 4, QLinearConfig("mixed"),
            layout_slack=0.2),  # per-tile pairs and the per-layer tables weigh most on this 96x320 layer (+0.15; ≤ 0.04 from 576²)
    Subject("x86", "bcq", "cpu", {
        "RTN 4-bit g64": _layer(BCQLinear, 48, 320, RTN4),
        "GPTQ 4-bit act_order": _layer(BCQLinear, 48, 320, dict(GPTQ4_ACT_ORDER, group_size=128), True),
        "GPTQ 3-bit g64": _layer(BCQLinear, 48, 320, dict(bits=3, group_size=64, method="gptq"), True),
        "GPTQ 2-bit act_order (codebook kernel)": _layer(BCQLinear, 48, 320, dict(bits=2, group_size=64,
                                                                                  method="gptq", act_order=True), True),
        "free α 4-bit error feedback act_order": _layer(BCQLinear, 48, 320, dict(
            bits=4, group_size=64, iters=2, error_feedback=True, act_order=True), True),
        "free α 2-bit g32 activation-aware": _layer(BCQLinear, 48, 320, dict(
            bits=2, group_size=32, iters=2, activation_aware=True), True)}, _int8_bound),
    Subject("x86", "codebook", "cpu", {
        "2-bit 4 books g64": _layer(CodebookLinear, 48, 320, dict(bits=2, group_size=64)),
        "4-bit": _layer(CodebookLinear, 48, 320, dict(bits=4))}, _int8_bound),
    Subject("x86", "mixed", "cpu", {"mixed": lambda: _mixed_layer(96, 320)},
            lambda m, x: test_x86._mixed_bound(m.canonical(), m.config, m.out_features, m.in_features, x)),
    Subject("arm_neon", "bcq", "cpu", {"RTN 4-bit g64": _layer(BCQLinear, 48, 128, RTN4),
                                       "GPTQ 4-bit act_order": _layer(BCQLinear, 48, 256, GPTQ4_ACT_ORDER, True)},
            _int8_bound, layout_slack=0.5),  # an fp32 offset per group of 64 where checkpoints pack a 4-bit zero
    Subject("arm_neon", "codebook", "cpu", {"2-bit": _layer(CodebookLinear, 48, 128, dict(bits=2)),
                                            "4-bit": _layer(CodebookLinear, 48, 128, dict(bits=4))}, _int8_bound,
            layout_slack=0.2),  # the book ids of 8 rows in 16 bits, where checkpoints give each row an int32 word
)}
GPU_SUBJECTS = [name for name, s in SUBJECTS.items() if s.device == "cuda"]
KERNELS = {b: (SUBJECTS[b].op, SUBJECTS[b].plan, SUBJECTS[b].plan_tail) for b in GPU_SUBJECTS}
# kernel choice by priority, not by a GPU's measured dispatch table
pytestmark = pytest.mark.usefixtures("without_dispatch_table")


@functools.lru_cache(maxsize=None)
def _canonical(subject: str, name: str) -> QuantLinear:
    return SUBJECTS[subject].layers[name]()


def _twin(mod: QuantLinear) -> tuple[QuantLinear, Optional[torch.Tensor]]:
    """``(layer as the kernels see it, perm)``: an act_order layer's stored (reordered) weights as a plain grouped
    layer without ``perm``, which takes ``x[..., perm]`` (``bcq.kernel_view``); other layers are their own twin."""
    canon = mod.canonical()
    if "perm" not in canon:
        return mod, None
    twin = type(mod).from_packed({k: v for k, v in canon.items() if k != "perm"}, mod.in_features, mod.out_features,
                                 ops.kernel_view(mod.config)[0], mod.bias, backend=mod.backend)
    return twin, canon["perm"].long()


def _kernel_here(subject: str, request):
    """The kernel under test on this machine: a GPU kernel's spec registered for the CPU (with the native CPU kernels
    set aside, so fallbacks take the reference's exact math), or the native CPU kernel itself."""
    s = SUBJECTS[subject]
    if s.device == "cuda":
        request.getfixturevalue("reference_on_cpu_here")
        return request.getfixturevalue(f"spec_{subject}")
    k = s.kernel()
    if k.available() is not None:
        pytest.skip(f"{s.backend}: {k.available()}")
    return k


@pytest.mark.parametrize("backend", list(KERNELS))
def test_op_schema_takes_the_launch_plan_in_plan_order(backend):
    """``linear()`` passes ``*plan(...)`` positionally: the schema must name the plan's fields, in the order its
    docstring returns them, right before any trailing flags."""
    op, plan, tail = KERNELS[backend]
    args = [a.name for a in getattr(torch.ops.qlinear, op).default._schema.arguments]
    fields = [n.strip() for n in inspect.getsource(plan).split('"""')[1].split("``(")[1].split(")``")[0].split(",")]
    assert len(fields) >= 3 and args[len(args) - tail - len(fields):len(args) - tail] == fields


@pytest.mark.parametrize("subject", list(SUBJECTS))
def test_registered_with_a_layout_for_its_device_only(subject):
    """Every native kernel is registered for its one device type with its own layout and explicit dtypes; a GPU
    kernel gives a reason when its extension is unavailable (never a bare failure on a machine without a GPU)."""
    s = SUBJECTS[subject]
    k = s.kernel()
    assert k.devices == frozenset({s.device}) and k.layout is not None
    assert k.dtypes == frozenset({torch.float16, torch.bfloat16} | ({torch.float32} if s.device == "cpu" else set()))
    if s.device == "cuda" and not torch.cuda.is_available():
        assert k.reject(_cfg(k.format), torch.device("cuda"), torch.float16, 1)


def _cfg(fmt):
    from qlinear.formats import get_format

    uniform = {"bits": 4, "group_size": 64, "init": "uniform", "iters": 0}
    return get_format(fmt).Config(**(uniform if fmt == "bcq" else {}))


@pytest.mark.parametrize("subject", list(SUBJECTS))
def test_registry_rejects_with_reasons(subject, request):
    """A kernel turns down the other device type, dtypes it lacks and batches above its range, each with the
    reason; a call that names it there raises ValueError with that reason, an automatic one picks another kernel."""
    s = SUBJECTS[subject]
    k, mod = s.kernel(), _canonical(subject, next(iter(s.layers)))
    if s.device == "cuda":
        request.getfixturevalue("reference_on_cpu_here")
    cfg, shape = ops.kernel_view(mod.config)[0], (mod.out_features, mod.in_features)
    here, there = torch.device(s.device), torch.device("cpu" if s.device == "cuda" else "cuda")
    assert f"device {there.type}" in k.reject(cfg, there, torch.float16, 1, shape)
    for dtype in {torch.float32, torch.float16, torch.bfloat16} - k.dtypes:
        assert f"dtype {dtype}" in k.reject(cfg, here, dtype, 1, shape)
    if k.max_batch is not backends.ANY:
        assert f"batch {k.max_batch + 1} outside" in k.reject(cfg, here, torch.float16, k.max_batch + 1, shape)
    with pytest.raises(ValueError, match=f"{k.backend}: device {there.type}"):
        backends.select(k.format, cfg, there, torch.float16, 1, k.backend, shape)
    assert backends.select(k.format, cfg, there, torch.float16, 1, None, shape).backend != k.backend


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("backend", GPU_SUBJECTS)
def test_unavailable_without_gpu_and_layers_stay_canonical(backend, reference_on_cpu_here):
    k, mod = SUBJECTS[backend].kernel(), _canonical(backend, next(iter(SUBJECTS[backend].layers)))
    auto = type(mod).from_packed(mod.canonical(), mod.in_features, mod.out_features, mod.config, mod.bias)
    assert k.available() is not None and auto.layout == ""
    assert backends.layout_for(k.format, ops.kernel_view(mod.config)[0], torch.device("cuda"),
                               (mod.out_features, mod.in_features)) is None  # no CUDA kernel can load
    assert auto.kernel(torch.randn(1, mod.in_features)).backend != backend


CASES = [pytest.param(s, n, id=f"{s}-{n}") for s in SUBJECTS for n in SUBJECTS[s].layers]
OUT_EPS = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # twice the unit roundoff


@pytest.mark.parametrize("subject,name", CASES)
def test_module_holds_the_kernel_layout_and_saves_canonical(subject, name, request, tmp_path):
    """A loaded layer holds the kernel's layout (a GPU kernel's: with its spec standing in on the CPU), saves the
    canonical buffers bit for bit, serves every dtype within the kernel's bound of the float64 reference (an act_order
    layer: the kernel reads ``x[..., perm]`` itself), deterministically, larger batches than its range through the
    reference bit-exactly, and keeps all of it across dtype moves, save/reload and torch.compile(fullgraph); the
    gradient of x is ``Ŵ`` by the independent float64 formula."""
    s = SUBJECTS[subject]
    k = _kernel_here(subject, request)
    canon = _canonical(subject, name)
    twin, perm = _twin(canon)
    N, K = canon.out_features, canon.in_features
    sd = canon.state_dict()
    # a GPU kernel's spec outranks every CPU kernel; a CPU kernel is asked for (arm_neon ranks low on x86)
    mod = type(canon)(K, N, True, canon.config, backend=None if s.device == "cuda" else s.backend)
    mod.load_state_dict(sd)
    kcfg, side = ops.kernel_view(mod.config)
    assert mod.layout == k.layout.name and {n for n, _ in mod.named_buffers()} == {*k.layout.names(kcfg), *side}
    # bits_per_weight counts what checkpoints hold, whatever the layout; a layout takes about as much (whole row
    # blocks here: no padding rows)
    assert mod.bits_per_weight == canon.bits_per_weight
    assert abs(mod.layout_bits_per_weight - canon.bits_per_weight) <= s.layout_slack
    assert list(mod.state_dict()) == list(sd) and all(torch.equal(mod.state_dict()[n], sd[n]) for n in sd)
    x = torch.randn(2, 3, K)
    assert mod.kernel(x).backend == k.backend and not mod._call(x.device, x.dtype, 6).gather
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        y = mod(xd)
        assert y.dtype == dtype and y.shape == (2, 3, N) and torch.equal(mod(xd), y)
        x2, y2 = xd.reshape(-1, K).float(), y.reshape(-1, N).double()
        bound = s.bound(twin, x2 if perm is None else x2[:, perm]) + OUT_EPS[dtype] * y2.abs()
        assert ((y2 - ref64(canon, x2)).abs() <= bound).all(), dtype
    if perm is not None and s.device == "cuda":
        assert k.gathered  # the spec got perm and x unpermuted: the op did not gather first
    if k.max_batch is not backends.ANY:
        big = torch.randn(k.max_batch + 1, K)
        with pytest.warns(UserWarning, match="converted on every such call"):
            assert mod.kernel(big).backend == "reference"
        assert torch.equal(mod(big), canon(big))
    assert torch.equal(mod.dequantize(), canon.dequantize())
    mod.half().float()
    assert mod.layout == k.layout.name and torch.equal(mod.dequantize(), canon.dequantize())
    torch.save(mod.state_dict(), tmp_path / "m.pt")
    again = type(canon)(K, N, True, canon.config, backend=mod.backend)
    again.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert again.layout == k.layout.name and torch.equal(again(x), mod(x))
    torch._dynamo.reset()  # a fresh cache per case: many layers of one class would hit the recompile limit
    assert torch.equal(torch.compile(again, fullgraph=True, backend="eager")(x), mod(x))
    xg = x.clone().requires_grad_(True)
    mod(xg).sum().backward()
    w64 = dense64(canon.format, canon.canonical(), canon.config, N, K)
    assert torch.allclose(xg.grad.double(), torch.ones(2, 3, N, dtype=torch.float64) @ w64, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("subject,name", [c for c in CASES if SUBJECTS[c.values[0]].device == "cpu"])
def test_cpu_layout_converts_on_the_gpu(subject, name):
    """A layer quantized on the CPU holds a CPU kernel's layout; ``.cuda()`` converts it back on the GPU (the buffers
    move first): the layout's repack and unrepack run on the buffers' device, bit for bit as on the CPU."""
    canon = _canonical(subject, name)
    layout, (kcfg, side) = SUBJECTS[subject].kernel().layout, ops.kernel_view(canon.config)
    N, K = canon.out_features, canon.in_features
    bufs = {k: v for k, v in canon.canonical().items() if k not in side}
    held = layout.repack(bufs, kcfg, N, K)
    on_gpu = layout.repack({k: v.cuda() for k, v in bufs.items()}, kcfg, N, K)
    assert all(on_gpu[k].is_cuda and torch.equal(on_gpu[k].cpu(), held[k]) for k in held)
    back = layout.unrepack({k: v.cuda() for k, v in held.items()}, kcfg, N, K)
    assert all(back[k].is_cuda and torch.equal(back[k].cpu(), bufs[k]) for k in bufs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_SUBJECTS)
def test_kernel_under_cuda_graph_and_compile(backend):
    """compile(fullgraph, reduce-overhead: CUDA graphs) of a layer served by the kernel gives the eager output."""
    torch.manual_seed(0)
    s = SUBJECTS[backend]
    mod = (_mixed_layer(1536, 576) if s.format == "mixed" else
           BCQLinear.from_linear(torch.nn.Linear(576, 1536), s.model_config))
    mod.backend = s.model_config.backend
    mod.cuda()
    max_batch = s.kernel().max_batch
    for M in (1, 100 if max_batch is backends.ANY else min(max_batch, 100)):
        x = torch.randn(M, 576, device="cuda", dtype=torch.float16)
        assert mod.kernel(x).backend == backend
        eager = mod(x)
        f = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            assert torch.equal(f(x), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_SUBJECTS)
def test_smollm2_shaped_model_compiled_matches_eager(backend):
    """A SmolLM2-135M-shaped Llama (4 of its 30 layers, random weights: the real checkpoint cannot reach the GPU
    machine) quantized with the kernel's config: generate's own compile of the decode step (static cache, fullgraph,
    reduce-overhead: CUDA graphs) decodes the same tokens as eager, through the kernel."""
    from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

    import qlinear

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    qlinear.replace_linear(model, SUBJECTS[backend].model_config, progress=False)
    model = model.to("cuda", torch.float16)
    assert model.model.layers[0].mlp.down_proj.layout == SUBJECTS[backend].kernel().layout.name
    ids = torch.randint(0, 49152, (1, 8), device="cuda")
    # transformers compiles the decode step itself (marking each CUDA-graph step); compiling model.forward by hand
    # fails in its static cache (an output of one graph replay overwritten by the next)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kw)
        compiled = model.generate(ids, compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"), **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled run did compile
    assert torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in GPU_SUBJECTS if SUBJECTS[b].format == "bcq"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_act_order_layer_gathers_x_inside_the_kernel(backend, dtype):
    """An act_order layer (GPTQ; the BCQ fit for the free-α kernel) held in the kernel's layout: the kernel reads
    ``x[:, perm]`` as it loads x, bitwise equal to the same weights without perm given ``x[:, perm]``."""
    torch.manual_seed(0)
    X = torch.randn(1024, 576) * torch.linspace(0.1, 2.0, 576)
    opts = FREE4_ACT_ORDER if backend == "quick_free" else GPTQ4_ACT_ORDER
    mod = BCQLinear.from_linear(torch.nn.Linear(576, 1536), QLinearConfig("bcq", **opts), X.T @ X, backend=backend)
    twin, perm = _twin(mod)
    mod.cuda(), twin.cuda()
    max_batch = SUBJECTS[backend].kernel().max_batch
    for M in [M for M in (1, 8, 37, 300) if max_batch is backends.ANY or M <= max_batch]:
        x = torch.randn(M, 576, device="cuda", dtype=dtype)
        assert mod.kernel(x).backend == backend and twin.kernel(x).backend == backend
        assert torch.equal(mod(x), twin(x[:, perm.cuda()]))


spec_cuda_lut = spec_kernel_fixture("cuda_lut")
spec_quick = spec_kernel_fixture("quick")
spec_quick_free = spec_kernel_fixture("quick_free")
spec_async_dequant = spec_kernel_fixture("async_dequant")
