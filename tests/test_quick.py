"""QUICK tensor-core GEMM backend: its layout and executable fragment spec on CPU, registry rules, and the
kernel on a GPU.

Error bounds.  The kernel's weights: with ``s_T = T(s)``, ``c'_T = T(c − s·mid)`` and ``ŵ_T = T(v·s_T + c'_T)``
(v the integer code, u = 2⁻¹¹ for fp16, 2⁻⁸ for bf16; s is fp16 so u_s = 0 for fp16), every weight obeys
``|ŵ_T − ŵ| ≤ u·(|v·s| + |c'| + |ŵ|)·(1 + 2u)``.  Outputs: fp32 accumulation over K products gives
``|y − y₆₄| ≤ Σ_k |x_k|·werr_k + K·u₃₂·Σ_k |x_k|·(|ŵ_k| + werr_k) + u_T·|y₆₄|`` (last term: output rounding).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch
from conftest import poison_cuda_allocator, ref64

import qlinear.backends as backends
from qlinear import BCQLinear, QLinearConfig
from qlinear.backends import Kernel, quick
from qlinear.formats import bcq
from qlinear.formats.packing import unpack_planes

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SHAPES = [(32, 64), (96, 192), (576, 576), (1536, 576), (192, 576), (256, 2048)]


def _uniform(N, K, bits, group_size, fp32_offset=False, offset=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = bcq.Config(bits=bits, group_size=group_size, init="uniform", iters=0, offset=offset, fp32_offset=fp32_offset)
    return cfg, bcq.quantize(torch.randn(N, K, generator=g), cfg)


def _weight_error_bound(canon, cfg, N, K, dtype):
    """Per-weight bound of the module docstring, ``[N, K]`` float64."""
    g = torch.arange(K) // cfg.group(K)
    s = canon["alpha"][1].double()[:, g] if cfg.bits > 1 else 2 * canon["alpha"][0].double()[:, g]
    mid = (2 ** cfg.bits - 1) / 2
    v = unpack_planes(canon["planes"], K).double()
    c = canon["offset"].double()[:, g] if cfg.offset else torch.zeros_like(s)
    w = bcq.dequantize(canon, cfg, N, K).double()
    u = U[dtype]
    return u * ((v * s).abs() + (c - s * mid).abs() + w.abs()) * (1 + 2 * u)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("offset,fp32_offset", [(True, False), (True, True), (False, False)])
def test_layout_round_trip_is_bit_exact_and_no_bigger(bits, offset, fp32_offset):
    cfg, canon = _uniform(96, 320 - 64, bits, 64, fp32_offset, offset)
    packed = quick.repack(canon, cfg, 96, 256)
    assert tuple(packed) == quick.LAYOUT.names(cfg)
    assert packed["quick_qweight"].shape == (3, 4, 64 * bits) and packed["quick_qweight"].dtype == torch.int32
    size = lambda d: sum(t.numel() * t.element_size() for t in d.values())
    assert size(packed) <= size(canon)  # α of Q planes become one scale
    back = quick.unrepack(packed, cfg, 96, 256)
    assert set(back) == set(canon)
    assert all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype for k in canon)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("N,K", SHAPES)
def test_fragments_equal_the_ptx_table(bits, group_size, N, K):
    """Every lane's B-fragment values, decoded from the repacked words with the kernel's arithmetic, are the
    dense weight at the positions the PTX ISA assigns to that lane (exact in float32)."""
    cfg, canon = _uniform(N, K, bits, group_size, seed=N + K)
    packed = quick.repack(canon, cfg, N, K)
    w = bcq.dequantize(canon, cfg, N, K)
    assert torch.equal(quick.fragments(packed, cfg, N, K, torch.float32), quick.ptx_fragments(w))
    assert torch.equal(quick.dense_from_fragments(quick.ptx_fragments(w)), w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("fp32_offset", [False, True])
def test_fragments_in_half_precision_within_the_rounding_bound(dtype, bits, fp32_offset):
    N, K = 192, 576
    cfg, canon = _uniform(N, K, bits, 64, fp32_offset, seed=bits)
    packed = quick.repack(canon, cfg, N, K)
    frags = quick.fragments(packed, cfg, N, K, dtype)
    assert torch.equal(frags, frags.to(dtype).float())  # values a T register can hold
    err = (quick.dense_from_fragments(frags).double() - bcq.dequantize(canon, cfg, N, K).double()).abs()
    assert (err <= _weight_error_bound(canon, cfg, N, K, dtype)).all()


def test_spec_catches_a_wrong_layout():
    cfg, canon = _uniform(64, 128, 4, 64)
    packed = quick.repack(canon, cfg, 64, 128)
    w = quick.ptx_fragments(bcq.dequantize(canon, cfg, 64, 128))
    for broken in (packed["quick_qweight"].roll(8, -1), packed["quick_qweight"].flip(1)):
        assert not torch.equal(quick.fragments({**packed, "quick_qweight": broken}, cfg, 64, 128, torch.float32), w)
    swapped = {**packed, "quick_scales": canon["alpha"][1].T.contiguous()}  # scales without the row permutation
    assert not torch.equal(quick.fragments(swapped, cfg, 64, 128, torch.float32), w)


def test_repack_rejects_free_alpha_and_bad_shapes():
    cfg = bcq.Config(bits=4, group_size=64, iters=1)
    canon = bcq.quantize(torch.randn(64, 128), cfg)
    with pytest.raises(ValueError, match="uniform"):
        quick.repack(canon, dataclasses.replace(cfg, init="uniform", iters=0), 64, 128)
    ucfg, ucanon = _uniform(48, 128, 4, 64)
    with pytest.raises(ValueError, match="out_features % 32"):
        quick.repack(ucanon, ucfg, 48, 128)


def test_registry_rejects_with_reasons():
    cuda = torch.device("cuda")
    k = next(k for k in backends.kernels("bcq") if k.backend == "quick")
    rtn = bcq.Config(bits=4, group_size=128, init="uniform", iters=0)
    assert "not uniform" in k.reject(bcq.Config(bits=4), cuda, torch.float16, 16, (64, 64))
    assert "bits=8" in k.reject(bcq.Config(bits=8, method="gptq"), cuda, torch.float16, 16, (64, 64))
    assert "in_features % 64" in k.reject(rtn, cuda, torch.float16, 16, (64, 96))
    assert "dtype" in k.reject(rtn, cuda, torch.float32, 16, (64, 64))
    assert "batch 513" in k.reject(rtn, cuda, torch.float16, 513, (64, 64))
    assert "device cpu" in k.reject(rtn, torch.device("cpu"), torch.float16, 16, (64, 64))


def test_op_schema_takes_the_launch_plan_in_plan_order():
    args = [a.name for a in torch.ops.qlinear.quick_gemm.default._schema.arguments]
    ret = inspect.getsource(quick.plan).split('"""')[1].split("``(")[1].split(")``")[0]
    assert args[-3:] == [n.strip() for n in ret.split(",")] == ["tile_m", "tiles_per_split", "splits"]


@pytest.mark.parametrize("M", [1, 7, 16, 17, 33, 64, 65, 128, 300, 512])
@pytest.mark.parametrize("N,K", [(576, 576), (1536, 576), (8192, 8192), (28672, 8192), (8192, 28672), (4096, 11008)])
@pytest.mark.parametrize("sms", [1, 108, 132])
def test_plan_covers_every_tile_once(M, N, K, sms):
    tile_m, per_split, splits = quick.plan(M, N, K, sms)
    tiles = K // 64
    assert tile_m in (16, 32, 64, 128) and (tile_m >= M or tile_m == 128) and (tile_m == 16 or tile_m // 2 < M)
    assert (splits - 1) * per_split < tiles <= splits * per_split
    assert splits * M * N * 8 <= max(0.15 * N * K / 2, M * N * 8)  # split-K partials stay cheap


# --- the layout machinery, driven on CPU by a kernel that runs the spec --------------------------------
@pytest.fixture
def spec_kernel():
    """The executable spec registered as a CPU kernel with the quick layout (highest priority, batch <= 512)."""

    def fn(x, bufs, bias, cfg, N, K):
        y = quick.spec(x.reshape(-1, K), bufs, bias, cfg, N, K, torch.float16)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    k = backends.register(Kernel(backend="quick_spec", format="bcq", fn=fn, priority=100, devices=frozenset({"cpu"}),
                                 max_batch=quick.MAX_BATCH, supports=quick.supports, layout=quick.LAYOUT))
    yield k
    backends._KERNELS.remove(k)


def test_uniform_module_holds_the_quick_layout(spec_kernel, tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 96)
    cfg = QLinearConfig("bcq", bits=3, group_size=64, init="uniform", iters=0)
    canon = BCQLinear.from_linear(lin, cfg, backend="reference")
    mod = BCQLinear(192, 96, True, canon.config)
    mod.load_state_dict(canon.state_dict())
    assert mod.layout == "quick" and {n for n, _ in mod.named_buffers()} == set(quick.LAYOUT.names(canon.config))
    assert mod.memory_footprint() < canon.memory_footprint()
    assert all(torch.equal(a, b) for a, b in zip(mod.state_dict().values(), canon.state_dict().values()))
    x = torch.randn(5, 192).half().float()
    y64 = ref64(canon, x)
    werr = _weight_error_bound(canon.canonical(), canon.config, 96, 192, torch.float16)
    bound = x.double().abs() @ werr.T + 192 * 2.0 ** -24 * (x.double().abs() @ canon.dequantize(torch.float64).abs().T)
    assert ((mod(x).double() - y64).abs() <= bound + 1e-9).all()
    assert torch.equal(mod.dequantize(), canon.dequantize())
    assert mod.kernel(torch.randn(513, 192)).backend == "reference"  # above the GEMM's range: converted per call
    torch.save(mod.state_dict(), tmp_path / "m.pt")
    again = BCQLinear(192, 96, True, canon.config)
    again.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert again.layout == "quick" and torch.equal(again(x), mod(x))
    assert torch.equal(torch.compile(again, fullgraph=True, backend="eager")(x), mod(x))


def test_free_alpha_module_keeps_another_layout(spec_kernel):
    mod = BCQLinear.from_linear(torch.nn.Linear(128, 64), QLinearConfig("bcq", bits=4, group_size=64, iters=1))
    assert mod.layout != "quick" and mod.kernel(torch.randn(16, 128)).backend == "reference"


def test_act_order_gptq_layer_through_the_quick_layout(spec_kernel):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64)
    X = torch.randn(512, 256) * torch.linspace(0.1, 2.0, 256)
    m = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=64, method="gptq", act_order=True), X.T @ X)
    assert m.layout == "quick" and m._packed_names[-1] == "perm"
    x = torch.randn(3, 256).half().float()
    assert torch.allclose(m(x), x @ m.dequantize().T + lin.bias, atol=2e-2)


# --- on a GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@functools.lru_cache(maxsize=None)
def _gpu_layer(N, K, bits, group_size, bias):
    """Round-to-nearest (uniform) layer, quantized once per shape."""
    torch.manual_seed(N + K + bits)
    cfg = QLinearConfig("bcq", bits=bits, group_size=group_size, init="uniform", iters=0)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N, bias=bias), cfg, backend="reference")
    mod.backend = None
    return mod.cuda()


def _check_gpu(mod, x):
    y64 = ref64(mod, x)
    canon = {k: v.cpu() for k, v in mod.canonical().items()}
    werr = _weight_error_bound(canon, mod.config, mod.out_features, mod.in_features, x.dtype)
    xa = x.double().abs().cpu()
    bound = (xa @ werr.T + mod.in_features * 2.0 ** -24 * (xa @ (mod.dequantize(torch.float64).cpu().abs() + werr).T)
             + U[x.dtype] * y64.abs())
    poison_cuda_allocator()
    y = mod(x)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], mod.out_features)
    err = (y.double().cpu() - y64).abs()
    assert (err <= bound).all(), (x.shape, err.max().item())
    poison_cuda_allocator()
    assert torch.equal(mod(x), y)  # deterministic


@gpu
@pytest.mark.parametrize("N,K", [(576, 576), (1536, 576), (192, 576), (4096, 4096), (11008, 4096), (4096, 11008)])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_and_is_deterministic(dtype, group_size, bits, N, K):
    assert quick.available() is None, quick.available()
    mod = _gpu_layer(N, K, bits, group_size, bias=(bits != 3))
    assert mod.layout == "quick"
    for M in (1, 2, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 300):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "quick"
        _check_gpu(mod, x)


@gpu
@pytest.mark.parametrize("N,K", [(8192, 8192), (28672, 8192), (8192, 28672)])
def test_kernel_on_large_layers(N, K):
    mod = _gpu_layer(N, K, 4, 128, bias=False)
    for M in (1, 16, 64, 256, 512):
        _check_gpu(mod, torch.randn(M, K, device="cuda", dtype=torch.float16))


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_kernel_is_the_spec_bit_for_bit(bits, dtype):
    mod = _gpu_layer(1536, 576, bits, 64, bias=True)
    bufs = dict(zip(quick.LAYOUT.names(mod.config), (getattr(mod, n) for n in quick.LAYOUT.names(mod.config))))
    w = quick.dequantize(bufs, mod.config, 1536, 576, dtype)
    cpu = {k: v.cpu() for k, v in bufs.items()}
    want = quick.dense_from_fragments(quick.fragments(cpu, mod.config, 1536, 576, dtype)).to(dtype)
    assert torch.equal(w.cpu(), want)
    x = torch.randn(600, 576, device="cuda", dtype=dtype)
    assert mod.kernel(x).backend == "quick_dequant"
    _check_gpu(mod, x)


@gpu
def test_kernel_under_cuda_graph_and_compile():
    mod = _gpu_layer(1536, 576, 4, 128, bias=True)
    for M in (1, 16, 100):
        x = torch.randn(M, 576, device="cuda", dtype=torch.float16)
        eager = mod(x)
        f = torch.compile(mod, fullgraph=True, mode="reduce-overhead")
        for _ in range(3):
            assert torch.equal(f(x), eager)
