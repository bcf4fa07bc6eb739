"""QUICK tensor-core GEMM backend: its layout and executable fragment spec on CPU, registry rules, and the
kernel on a GPU.

Error bounds.  The kernel's weights: with ``s_T = T(s)``, ``c'_T = T(c − s·mid)`` and ``ŵ_T = T(v·s_T + c'_T)``
(v the integer code, u = 2⁻¹¹ for fp16, 2⁻⁸ for bf16; s is fp16 so u_s = 0 for fp16), every weight obeys
``|ŵ_T − ŵ| ≤ u·(|v·s| + |c'| + |ŵ|)·(1 + 2u)``.  Free α: ``c'_T = T(c − Σ_i α_i)`` (fp32 subtractions) and Q fmas
``ŵ ← T(bit_i·T(2α_i) + ŵ)``; every partial value is at most ``A = |c| + 3·Σ_i |α_i|``, so
``|ŵ_T − ŵ| ≤ u·((Q + 1)·A + 2·Σ_i |α_i|)·(1 + 2u) + Q·2⁻²⁴·A``.  Outputs: fp32 accumulation over K products gives
``|y − y₆₄| ≤ Σ_k |x_k|·werr_k + K·u₃₂·Σ_k |x_k|·(|ŵ_k| + werr_k) + u_T·|y₆₄|`` (last term: output rounding).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
import torch
from conftest import poison_cuda_allocator, spec_kernel_fixture

import qlinear.backends as backends
from qlinear import BCQLinear, QLinearConfig
from qlinear.backends import quick
from qlinear.formats import bcq

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SHAPES = [(32, 64), (96, 192), (576, 576), (1536, 576), (192, 576), (256, 2048)]


def _uniform(N, K, bits, group_size, imported=False, offset=True, seed=0):
    """A round-to-nearest layer, or (``imported``) random codes, scales and zero points over their whole range as a
    GPTQ checkpoint may hold them."""
    g = torch.Generator().manual_seed(seed)
    if imported:
        G = -(-K // group_size)
        codes = torch.randint(0, 2 ** bits, (N, K), generator=g)
        zeros = torch.randint(0, 2 ** bits, (N, G), generator=g)
        zeros[0, 0], zeros[-1, -1] = 0, 2 ** bits - 1
        return bcq.from_uniform(codes, (torch.rand(N, G, generator=g) * 0.02 + 1e-3).half(), zeros, bits, group_size)
    cfg = bcq.Config(bits=bits, group_size=group_size, init="uniform", iters=0, offset=offset)
    return cfg, bcq.quantize(torch.randn(N, K, generator=g), cfg)


def _free(N, K, bits, group_size, offset=True, seed=0):
    """A free-α layer (the BCQ fit with error feedback, a few iterations) with its config."""
    cfg = bcq.Config(bits=bits, group_size=group_size, iters=2, offset=offset)
    return cfg, bcq.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)), cfg)


def _weight_error_bound(canon, cfg, N, K, dtype):
    """Per-weight bound of the module docstring, ``[N, K]`` float64: ``ŵ = fma(q, s_T, T(−s·z))`` rounds twice (free
    α: once per plane, plus ``c'``)."""
    g = torch.arange(K) // cfg.group(K)
    u = U.get(dtype, 2.0 ** -24)
    if not bcq.is_uniform(cfg):
        alpha = canon["alpha"].double().abs()[:, :, g].sum(0)  # Σ_i |α_i| per weight
        A = (canon["offset"].double().abs()[:, g] if "offset" in canon else 0) + 3 * alpha
        return u * ((cfg.bits + 1) * A + 2 * alpha) * (1 + 2 * u) + cfg.bits * 2.0 ** -24 * A
    codes, s, z = bcq.uniform_parts(canon, cfg, N, K)
    s = s.double()[:, g]
    z = z.double()[:, g] if z is not None else (2 ** cfg.bits - 1) / 2
    w = bcq.dequantize(canon, cfg, N, K).double()
    return u * ((codes.double() * s).abs() + (s * z).abs() + w.abs()) * (1 + 2 * u)


def spec_bound(mod: BCQLinear, x: torch.Tensor) -> torch.Tensor:
    """The bound of the module docstring for :func:`quick.spec` with fp16 fragments and float32 x and output
    (``[M, N]`` float64): the fragments' rounding plus fp32 accumulation over K."""
    N, K = mod.out_features, mod.in_features
    werr = _weight_error_bound(mod.canonical(), mod.config, N, K, torch.float16)
    xa = x.double().abs()
    return xa @ werr.T + K * 2.0 ** -24 * (xa @ (mod.dequantize(torch.float64).abs() + werr).T)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("offset,imported", [(True, False), (True, True), (False, False)])
def test_layout_round_trip_is_bit_exact_and_no_bigger(bits, offset, imported):
    cfg, canon = _uniform(96, 320 - 64, bits, 64, imported, offset)
    packed = quick.repack(canon, cfg, 96, 256)
    assert tuple(packed) == quick.LAYOUT.names(cfg)
    assert packed["quick_qweight"].shape == (3, 4, 64 * bits) and packed["quick_qweight"].dtype == torch.int32
    size = lambda d: sum(t.numel() * t.element_size() for t in d.values())
    assert size(packed) <= size(canon) + offset * 96 * 4 * (4 - bits) / 8  # zero points take 4 bits, canonical Q
    back = quick.unrepack(packed, cfg, 96, 256)
    assert set(back) == set(canon)
    assert all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype for k in canon)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("offset", [True, False])
def test_free_alpha_layout_round_trip_is_bit_exact_and_the_same_size(bits, offset):
    cfg, canon = _free(96, 256, bits, 64, offset, seed=bits)
    packed = quick.repack(canon, cfg, 96, 256)
    assert tuple(packed) == quick.LAYOUT.names(cfg) == ("quick_qweight", "quick_alpha") + ("quick_offset",) * offset
    assert packed["quick_alpha"].shape == (4, bits, 96) and packed["quick_alpha"].dtype == torch.float16
    size = lambda d: sum(t.numel() * t.element_size() for t in d.values())
    assert size(packed) == size(canon)
    back = quick.unrepack(packed, cfg, 96, 256)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) for k in canon)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_free_alpha_fragments_are_the_ptx_table_of_the_weight_within_the_rounding_bound(dtype, bits, group_size):
    """Free α: each lane's fragment values, decoded from the repacked words, α and offsets with the kernel's
    arithmetic (one fma per plane), are the float64 weight at the PTX ISA's positions, within the module docstring's
    bound (fp32: the fp32 subtractions of c' alone), and values a T register holds."""
    N, K = 192, 576
    cfg, canon = _free(N, K, bits, group_size, seed=bits + group_size)
    packed = quick.repack(canon, cfg, N, K)
    frags = quick.fragments(packed, cfg, N, K, dtype)
    assert torch.equal(frags, frags.to(dtype).float())
    w = bcq.dequantize(canon, cfg, N, K).double()
    err = (quick.dense_from_fragments(frags).double() - w).abs()
    bound = _weight_error_bound(canon, cfg, N, K, dtype)
    assert (err <= bound).all()
    misplaced = quick.ptx_fragments(w.roll(1, 0)) - frags.double()  # a row off: far outside the bound
    assert (misplaced.abs() > quick.ptx_fragments(bound)).any()


def test_layout_of_a_gptq_4bit_g128_layer_takes_4_156_bits():
    """Issue 22's GPU target (≤ 4.2 bits per weight): codes, an fp16 scale and a 4-bit zero point per group of 128."""
    cfg, canon = _uniform(256, 1024, 4, 128, imported=True)
    bits = lambda d: 8 * sum(t.numel() * t.element_size() for t in d.values()) / (256 * 1024)
    assert bits(quick.repack(canon, cfg, 256, 1024)) == bits(canon) == 4 + (16 + 4) / 128


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
@pytest.mark.parametrize("imported", [False, True])
def test_fragments_in_half_precision_within_the_rounding_bound(dtype, bits, imported):
    N, K = 192, 576
    cfg, canon = _uniform(N, K, bits, 64, imported, seed=bits)
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
    swapped = {**packed, "quick_scales": canon["scales"].T.contiguous()}  # scales without the row permutation
    assert not torch.equal(quick.fragments(swapped, cfg, 64, 128, torch.float32), w)
    nibbles = {**packed, "quick_zeros": packed["quick_zeros"].flip(1)}  # zero points of other rows
    assert not torch.equal(quick.fragments(nibbles, cfg, 64, 128, torch.float32), w)


def test_repack_rejects_fp32_offsets_a_wrong_storage_and_bad_shapes():
    cfg = bcq.Config(bits=4, group_size=64, iters=1)
    canon = bcq.quantize(torch.randn(64, 128), cfg)
    with pytest.raises(ValueError, match="uniform"):
        quick.repack(canon, dataclasses.replace(cfg, init="uniform", iters=0), 64, 128)
    with pytest.raises(ValueError, match="fp32 offsets"):
        quick.repack({**canon, "offset": canon["offset"].float()}, dataclasses.replace(cfg, fp32_offset=True), 64, 128)
    ucfg, ucanon = _uniform(48, 128, 4, 64)
    with pytest.raises(ValueError, match="out_features % 32"):
        quick.repack(ucanon, ucfg, 48, 128)


def test_registry_rejects_unsupported_configs():
    """(The reasons every GPU kernel gives are checked in test_kernel_conformance.py.)"""
    cuda = torch.device("cuda")
    k = next(k for k in backends.kernels("bcq") if k.backend == "quick")
    rtn = bcq.Config(bits=4, group_size=128, init="uniform", iters=0)
    assert "not uniform" in k.reject(bcq.Config(bits=4), cuda, torch.float16, 16, (64, 64))
    free = next(k for k in backends.kernels("bcq") if k.backend == "quick_free")
    assert free.priority < min(k.priority for k in backends.kernels("bcq") if k.backend.startswith("cuda_lut"))
    assert quick.supports_free(bcq.Config(bits=4), 64, 64) is None
    assert "fp32 offsets" in free.reject(bcq.Config(bits=4, fp32_offset=True), cuda, torch.float16, 16, (64, 64))
    assert "uniform layers take backend 'quick'" in free.reject(rtn, cuda, torch.float16, 16, (64, 64))
    assert "bits=8" in k.reject(bcq.Config(bits=8, method="gptq"), cuda, torch.float16, 16, (64, 64))
    assert "in_features % 64" in k.reject(rtn, cuda, torch.float16, 16, (64, 96))


def test_plan_covers_every_tile_once():
    """Every batch 1..512 (and a few beyond the GEMM's range) on real and odd shapes and GPU sizes: the smallest row
    tile that covers M, every K tile in exactly one split, at most one wave of four blocks per SM when K is split,
    split-K partials within 8 MiB."""
    shapes = [(576, 576), (1536, 576), (8192, 8192), (28672, 8192), (8192, 28672), (4096, 11008), (32, 64), (96, 320)]
    for (N, K), sms, M in itertools.product(shapes, (1, 78, 108, 132), [*range(1, 513), 600, 4096]):
        tile_m, per_split, splits = quick.plan(M, N, K, sms)
        tiles, case = K // 64, (M, N, K, sms)
        assert tile_m in (16, 32, 64, 128) and (tile_m >= M or tile_m == 128) and (tile_m == 16 or tile_m // 2 < M), case
        assert (splits - 1) * per_split < tiles <= splits * per_split, case
        blocks = math.ceil(N / 128) * math.ceil(M / tile_m)
        assert splits == 1 or blocks * splits <= 4 * sms, case
        assert splits == 1 or splits * M * N * 4 <= 8 << 20, case  # the partials stay in L2 for the reduction


def test_free_alpha_entry_above_512_rows_gathers_x_and_dequantizes(monkeypatch):
    """``linear_free`` beyond the GEMM's batch range: Ŵ from the dequantize kernel (here the spec's fragments) times
    ``x[:, perm]`` for an act_order layer (the registry leaves the gather to a kernel that ``gathers_perm``)."""
    N, K = 64, 256
    cfg, canon = _free(N, K, 3, 64, seed=7)
    bufs = quick.repack(canon, cfg, N, K)
    bufs["perm"] = torch.randperm(K, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    w = quick.dense_from_fragments(quick.fragments(bufs, cfg, N, K, torch.float32))
    monkeypatch.setattr(quick, "dequantize", lambda b, c, n, k, dtype: w.to(dtype))
    monkeypatch.setattr(quick, "linear", lambda *a: pytest.fail("the GEMM above MAX_BATCH"))
    x = torch.randn(quick.MAX_BATCH + 1, K)
    want = x.double()[:, bufs["perm"].long()] @ w.double().T
    assert torch.allclose(quick.linear_free(x, bufs, None, cfg, N, K).double(), want, atol=1e-4)


# --- the layout machinery, driven on CPU by a kernel that runs the spec --------------------------------
spec_kernel = spec_kernel_fixture("quick")
spec_free = spec_kernel_fixture("quick_free")


def test_free_alpha_module_runs_on_the_quick_layout(spec_free):
    """A free-α layer takes the quick layout and kernel ``quick_free`` (here its spec on the CPU, ranked first),
    within the fragments' bound of its float64 weight."""
    lin = torch.nn.Linear(128, 64)
    mod = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=3, group_size=64, iters=1))
    x = torch.randn(16, 128)
    assert mod.layout == "quick" and mod.kernel(x).backend == "quick_free_spec"
    assert ((mod(x).double() - x.double() @ mod.dequantize(torch.float64).T - lin.bias.double()).abs()
            <= spec_bound(mod, x) + 1e-5).all()


# --- on a GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
pytestmark = pytest.mark.usefixtures("without_dispatch_table")


@functools.lru_cache(maxsize=None)
def _gpu_layer(N, K, bits, group_size, bias):
    """Round-to-nearest (uniform) layer, quantized once per shape."""
    torch.manual_seed(N + K + bits)
    cfg = QLinearConfig("bcq", bits=bits, group_size=group_size, init="uniform", iters=0)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N, bias=bias), cfg, backend="reference")
    mod.backend = None
    return mod.cuda()


def _gpu_reference(mod, dtype):
    """``(Ŵ, per-weight error bound)`` float64 ``[N, K]`` on the GPU (float64 reference without a CPU round trip)."""
    return (mod.dequantize(torch.float64),
            _weight_error_bound(mod.canonical(), mod.config, mod.out_features, mod.in_features, dtype))


def _check_gpu(mod, x, ref, acc_eps=2.0 ** -24):
    """Kernel output vs the float64 reference within the module docstring's bound; ``ref`` from
    :func:`_gpu_reference`; ``acc_eps``: unit roundoff of the accumulation (fp32 in the QUICK kernel; cuBLAS
    half-precision GEMMs may reduce in half precision)."""
    w64, werr = ref
    xa = x.double().abs()
    y64 = x.double() @ w64.T + (0 if mod.bias is None else mod.bias.double())
    bound = xa @ werr.T + mod.in_features * acc_eps * (xa @ (w64.abs() + werr).T) + U[x.dtype] * y64.abs()
    poison_cuda_allocator()
    y = mod(x)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], mod.out_features)
    err = (y.double() - y64).abs()
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
    ref = _gpu_reference(mod, dtype)
    for M in range(1, 301) if N * K <= 1536 * 576 else (1, 2, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128,
                                                        129, 255, 300):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "quick"
        _check_gpu(mod, x, ref)


@gpu
@pytest.mark.parametrize("N,K", [(8192, 8192), (28672, 8192), (8192, 28672)])
def test_kernel_on_large_layers(N, K):
    mod = _gpu_layer(N, K, 4, 128, bias=False)
    ref = _gpu_reference(mod, torch.float16)
    for M in (1, 16, 64, 256, 512):
        _check_gpu(mod, torch.randn(M, K, device="cuda", dtype=torch.float16), ref)


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
    _check_gpu(mod, x, _gpu_reference(mod, dtype), acc_eps=U[dtype])


@gpu
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,group_size", [(1536, 576, 64), (4096, 4096, 128)])
def test_free_alpha_kernel_matches_reference_and_its_dequantize_is_the_spec(N, K, group_size, dtype, bits):
    """``quick_free`` on a GPU: within the module docstring's bound of the float64 weight at every tile size, split-K
    and beyond 512 rows (dequantize + cuBLAS, whose Ŵ is the spec's bit for bit), deterministic."""
    assert quick.available() is None, quick.available()
    torch.manual_seed(N + bits)
    cfg = QLinearConfig("bcq", bits=bits, group_size=group_size, iters=1)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N).cuda(), cfg, backend="quick_free")  # quantized on the GPU
    assert mod.layout == "quick"
    ref = _gpu_reference(mod, dtype)
    for M in (1, 3, 8, 16, 17, 64, 129, 300, 512):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "quick_free"
        _check_gpu(mod, x, ref)
    names = quick.LAYOUT.names(mod.config)
    bufs = {n: getattr(mod, n) for n in names}
    want = quick.dense_from_fragments(quick.fragments({k: v.cpu() for k, v in bufs.items()}, mod.config, N, K, dtype))
    assert torch.equal(quick.dequantize(bufs, mod.config, N, K, dtype).cpu(), want.to(dtype))
    _check_gpu(mod, torch.randn(600, K, device="cuda", dtype=dtype), ref, acc_eps=U[dtype])


# --- the kernel's own source, run on the CPU under the host emulation (tests/cuda_emulation.py) -------------
_QUICK_DRIVER = r'''
// Driver: reads one call from argv[1] (header, x, qweight, scales or α, zeros or offsets, bias, perm), runs the source's
// own quick_gemm or quick_dequantize (kernel choice, grid, shared memory, split-K reduction) and writes y or Ŵ (fp32)
// to argv[2].
int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 17);
  const int M = h[0], N = h[1], K = h[2], Q = h[3], gs = h[4], bf16 = h[8], has_zeros = h[9], bias_kind = h[10];
  const int dequant = h[11], free_alpha = h[13], G = (K + gs - 1) / gs;
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  auto qweight = emu_read<unsigned>(f, (size_t)N * K * Q / 32);
  auto scales = emu_read<uint16_t>(f, (size_t)G * N * (free_alpha ? Q : 1));
  std::vector<unsigned short> zeros = emu_read<unsigned short>(f, has_zeros ? (size_t)G * N / (free_alpha ? 1 : 4) : 0);
  std::vector<char> bias = emu_read<char>(f, (size_t)N * (bias_kind == 2 ? 4 : bias_kind == 1 ? 2 : 0));
  std::vector<int> perm = emu_read<int>(f, h[12] ? K : 0);
  std::vector<unsigned> sign_bits = emu_read<unsigned>(f, h[14]);
  std::vector<signed char> paley = emu_read<signed char>(f, h[16] > 1 ? h[16] * h[16] : 0);
  fclose(f);
  const Rotation rot{h[15], h[16], sign_bits.data(), paley.data()};
  QuickArgs a{};
  a.perm = h[12] ? perm.data() : nullptr;
  a.x = x.data(); a.qweight = qweight.data(); a.scales = scales.data();
  a.free_alpha = free_alpha;
  if (free_alpha) a.offsets = has_zeros ? zeros.data() : nullptr;
  else a.zeros = has_zeros ? zeros.data() : nullptr;
  a.bias = bias_kind ? bias.data() : nullptr;
  a.bias_dtype = bias_kind == 2 ? DType::kFloat : bf16 ? DType::kBFloat16 : DType::kHalf;
  const size_t outs = dequant ? (size_t)N * K : (size_t)M * N;
  std::vector<uint16_t> y(outs, 0x7E00);  // NaN-poisoned output
  std::vector<float> partial((size_t)h[7] * M * N, NAN);
  a.y = y.data(); a.partial = partial.data();
  a.M = M; a.N = N; a.K = K; a.Q = Q; a.group_size = gs; a.tile_m = h[5]; a.tiles_per_split = h[6]; a.splits = h[7];
  a.x_dtype = bf16 ? DType::kBFloat16 : DType::kHalf;
  emu_check(dequant ? quick_dequantize(a, nullptr) : quick_gemm(a, rot, nullptr));
  emu_write(argv[2], y, bf16);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(
        tmp_path_factory.mktemp("quick_emu"), "quick/quick_gemm.cu",
        ("extern __shared__ __align__(16) unsigned char smem_raw[];",
         "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(::g_smem4);"), cuda_emulation.WARP_PTX, _QUICK_DRIVER,
        launches=True)


def _emulate(exe, x, bufs, bias, cfg, N, K, launch, dequant=False, perm=None, rotation=None):
    """The kernel (or, with ``dequant``, the dequantize kernel) run by the emulator: float32 ``[M, N]`` (``[N, K]``);
    with ``perm`` the kernel reads ``x[:, perm]``; with ``rotation = (seed, block)`` (16-row tiles) it stages ``R·x``."""
    from cuda_emulation import dtype_kind, rotation_header, run

    free = "quick_alpha" in bufs
    zeros = bufs.get("quick_offset" if free else "quick_zeros")
    rot, rot_tensors = rotation_header(rotation, K)
    hdr = [x.shape[0], N, K, cfg.bits, cfg.group(K), *launch, int(x.dtype == torch.bfloat16), int(zeros is not None),
           dtype_kind(bias), int(dequant), int(perm is not None), int(free), *rot]
    tensors = [x, bufs["quick_qweight"], bufs["quick_alpha" if free else "quick_scales"], zeros,
               bias, perm, *rot_tensors]
    return run(exe, hdr, tensors, (N, K) if dequant else (x.shape[0], N))


@pytest.mark.parametrize("bits,imported,dtype", [(4, True, torch.float16), (3, False, torch.bfloat16),
                                                    (2, True, torch.bfloat16), (4, False, torch.float16),
                                                    (2, True, torch.float16), (3, True, torch.float16),
                                                    (4, "symmetric", torch.float16),
                                                    (4, "free", torch.bfloat16), (3, "free", torch.float16)])
def test_kernel_source_under_host_emulation(emulator, bits, imported, dtype):
    """quick_gemm.cu itself (its tiles, cp.async stages or x staged whole at 16-row tiles, swizzle, ldmatrix/mma
    fragment use, split-K and output mapping) on the CPU: within the error bound of the float64 reference for every tile_m, one split and several,
    M not a multiple of the tile; its dequantize kernel equals the spec bit for bit.  Uniform layers (round-to-nearest,
    ``"symmetric"``: without zero points, or imported; fp16 and bf16 decode codes differently) and free-α ones
    (``imported="free"``)."""
    N, K = 160, 192
    make = (lambda N, K, bits, g, seed: _free(N, K, bits, g, seed=seed)) if imported == "free" else (
        lambda N, K, bits, g, seed: _uniform(N, K, bits, g, imported is True, offset=imported != "symmetric",
                                             seed=seed))
    cfg, canon = make(N, K, bits, 64, bits)
    bufs = quick.repack(canon, cfg, N, K)
    w64 = bcq.dequantize(canon, cfg, N, K).double()
    werr = _weight_error_bound(canon, cfg, N, K, dtype)
    bias = torch.randn(N)
    for M, tile_m, per_split, splits in ((1, 16, 3, 1), (5, 16, 1, 3), (20, 32, 2, 2), (40, 64, 3, 1),
                                         (130, 128, 1, 3)):
        x = torch.randn(M, K).to(dtype)
        y = _emulate(emulator, x, bufs, bias, cfg, N, K, (tile_m, per_split, splits))
        xa = x.double().abs()
        y64 = x.double() @ w64.T + bias.double()
        bound = xa @ werr.T + K * 2.0 ** -24 * (xa @ (w64.abs() + werr).T) + U[dtype] * y64.abs()
        assert ((y.double() - y64).abs() <= bound).all(), (M, tile_m, splits)
        if M in (5, 40):  # a bias in x's dtype (split and direct epilogues): the same sums as it widened to fp32
            b = bias.to(dtype)
            assert torch.equal(_emulate(emulator, x, bufs, b, cfg, N, K, (tile_m, per_split, splits)),
                               _emulate(emulator, x, bufs, b.float(), cfg, N, K, (tile_m, per_split, splits)))
    w = _emulate(emulator, torch.zeros(1, K).to(dtype), bufs, None, cfg, N, K, (16, 3, 1), dequant=True)
    assert torch.equal(w, quick.dense_from_fragments(quick.fragments(bufs, cfg, N, K, dtype)))
    # a K walk longer than the register ring (4 tiles in flight at tile_m 16, 2 at 64): slots refilled and reused
    N2, K2 = 64, 640
    cfg2, canon2 = make(N2, K2, bits, 128, bits + 10)
    bufs2 = quick.repack(canon2, cfg2, N2, K2)
    w64_2, werr2 = bcq.dequantize(canon2, cfg2, N2, K2).double(), _weight_error_bound(canon2, cfg2, N2, K2, dtype)
    for M, launch in ((3, (16, 10, 1)), (7, (16, 7, 2)), (40, (64, 5, 2))):
        x = torch.randn(M, K2).to(dtype)
        xa, y64 = x.double().abs(), x.double() @ w64_2.T
        bound = xa @ werr2.T + K2 * 2.0 ** -24 * (xa @ (w64_2.abs() + werr2).T) + U[dtype] * y64.abs()
        y = _emulate(emulator, x, bufs2, None, cfg2, N2, K2, launch)
        assert ((y.double() - y64).abs() <= bound).all(), (M, launch)
    # act_order: the kernel gathers x[:, perm] while loading x (bitwise the same as gathering first)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    for M, launch in ((3, (16, 1, 3)), (70, (128, 3, 1))):
        x = torch.randn(M, K).to(dtype)
        y = _emulate(emulator, x, bufs, bias, cfg, N, K, launch, perm=perm)
        assert torch.equal(y, _emulate(emulator, x[:, perm.long()], bufs, bias, cfg, N, K, launch))



@pytest.mark.parametrize("bits,imported,dtype", [(4, True, torch.float16), (4, False, torch.bfloat16),
                                                    (3, False, torch.float16), (2, False, torch.float16),
                                                    (3, "free", torch.bfloat16), (4, "free", torch.float16)])
def test_kernel_source_stages_a_rotated_input(emulator, bits, imported, dtype):
    """A rotated layer on 16-row tiles (uniform 2/3/4-bit, free α 3/4-bit): each block of quick_gemm.cu stages ``R·x`` of its rows and K slice itself
    (rotation.cuh) and reads its A fragments from it (rows past M from a zero chunk), under the host emulation: the
    float64 product with the exact ``R·x`` within the emulation test's bound plus one rounding of ``R·x`` to x's dtype,
    for Paley and power-of-two blocks, K slices cutting through blocks, M = 1..16, one split or several."""
    from cuda_emulation import rotated_reference

    N, K = 160, 640
    cfg, canon = (_free(N, K, bits, 128, seed=3) if imported == "free" else
                  _uniform(N, K, bits, 128, imported is True, seed=3))
    bufs = quick.repack(canon, cfg, N, K)
    w64 = bcq.dequantize(canon, cfg, N, K).double()
    werr = _weight_error_bound(canon, cfg, N, K, dtype)
    bias = torch.randn(N)
    for block, M, per_split, splits in ((640, 1, 10, 1), (128, 5, 3, 4), (40, 16, 4, 3), (80, 2, 10, 1)):
        x = torch.randn(M, K).to(dtype)
        x64, _ = rotated_reference(x, (5, block))
        xa, y64 = x64.abs(), x64 @ w64.T + bias.double()
        mag = xa @ (w64.abs() + werr).T
        bound = xa @ werr.T + K * 2.0 ** -24 * mag + U[dtype] * y64.abs() + 2 * U[dtype] * mag
        y = _emulate(emulator, x, bufs, bias, cfg, N, K, (16, per_split, splits), rotation=(5, block))
        assert ((y.double() - y64).abs() <= bound).all(), (block, M, per_split, splits)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("free", [False, True])
def test_rotated_decode_asks_the_kernel_only_for_what_it_stages(monkeypatch, bits, free):
    """quick.linear hands a rotated layer's transform to the kernel (16-row tiles, no perm) for every layer the
    launcher instantiates staged R·x for (quick_gemm.cu: all but free α at 2 bits, which spilled), and rotates x first
    otherwise; the op's rot_block says which (CPU: the op and the SM count stubbed)."""
    from qlinear.backends import _gpu

    N, K = 128, 576
    cfg, canon = _free(N, K, bits, 64) if free else _uniform(N, K, bits, 64)
    bufs = quick.repack(canon, cfg, N, K)
    seen = []
    monkeypatch.setattr(quick, "_sms", lambda index: 132)
    monkeypatch.setattr(torch.ops.qlinear, "quick_gemm", lambda x, *a: seen.append(a[-2]) or x.new_zeros(x.shape[0], N),
                        raising=False)
    monkeypatch.setattr(_gpu, "_kernel_rotation", lambda *a: ("bits", a[1], None))
    quick.linear(torch.randn(1, K, dtype=torch.float16), bufs, None, cfg, N, K, rotation=(3, 576))
    assert seen == [0 if free and bits == 2 else 576]
