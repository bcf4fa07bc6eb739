"""CUDA LUT GEMV backend: its layout and executable spec on CPU, registry rules, and the kernel on a GPU.

Error bound used throughout (fp32 accumulation): every output is a sum of K products ``ŵ·x`` formed as
table sums of 8 inputs, four lookups per word, per-word α/offset scaling and a sequential sum over
the words, so ``|y − y₆₄| ≤ (K/8 + 64)·u₃₂ · Σ_k (Σ_q|α_q| + |c|)·|x_k|`` with ``u₃₂ = 2⁻²⁴``, plus one
rounding of the output (``u_out·|y|``) for fp16/bf16 outputs.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from conftest import poison_cuda_allocator, ref64, spec_kernel_fixture

from qlinear import BCQLinear, backends
from qlinear.backends import cuda_lut
from qlinear.formats import bcq

U32 = 2.0 ** -24


def _layer(N, K, bits, group_size, offset=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N)
    cfg = bcq.Config(bits=bits, group_size=group_size, offset=offset, iters=1)
    return BCQLinear.from_linear(lin, cfg, backend="reference"), lin


def _bound(mod: BCQLinear, x: torch.Tensor, out_eps: float = 0.0, y64=None):
    bufs = {k: v.cpu() for k, v in mod.canonical().items()}
    K, cfg = mod.in_features, mod.config
    gidx = torch.arange(K) // cfg.group(K)
    if "qweight" in bufs:  # uniform storage: α_q = s·2^(q−1) and c = s·((2^Q−1)/2 − z), in float64
        _, s, z = bcq.uniform_parts(bufs, cfg, mod.out_features, K, codes=None)
        alpha = s.double()[None] * 2.0 ** (torch.arange(cfg.bits, dtype=torch.float64) - 1)[:, None, None]
        bufs = {"alpha": alpha, **({} if z is None else {"offset": s.double() * ((2 ** cfg.bits - 1) / 2 - z)})}
    a = bufs["alpha"].double().abs().sum(0)[:, gidx]                    # [N, K]
    if "offset" in bufs:
        a = a + bufs["offset"].double().abs()[:, gidx]
    mag = x.double().abs().cpu() @ a.T
    bound = (K / 8 + 64) * U32 * mag
    if out_eps:
        bound = bound + out_eps * y64.abs()
    return bound


SHAPES = [(64, 64), (128, 96), (576, 576), (1536, 576), (256, 2048), (50, 64)]  # 50 rows: 2 padding rows


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("N,K", SHAPES)
def test_spec_matches_reference_in_float64(bits, group_size, N, K):
    mod, _ = _layer(N, K, bits, group_size, offset=(bits % 2 == 1 or group_size == 64))
    bufs = cuda_lut.repack(mod.canonical(), mod.config, N, K)
    for M in (1, 3, 8):
        x = torch.randn(M, K)
        y64 = ref64(mod, x)
        for sms in (1, 132):  # one split and many splits
            launch = cuda_lut.plan(M, N, K, sms, bits)
            y = cuda_lut.spec(x, bufs, mod.bias, mod.config, N, K, launch)
            err = (y.double() - y64).abs()
            assert (err <= _bound(mod, x)).all(), (launch, err.max().item())


def test_spec_catches_a_wrong_layout():
    """The spec reads the repacked buffers, so feeding it the canonical order must fail the bound."""
    mod, _ = _layer(128, 256, 2, 64)
    bufs = cuda_lut.repack(mod.canonical(), mod.config, 128, 256)
    bufs["lut_planes"] = bufs["lut_planes"].flip(0).contiguous()
    x = torch.randn(1, 256)
    y = cuda_lut.spec(x, bufs, mod.bias, mod.config, 128, 256, cuda_lut.plan(1, 128, 256, 4, 2))
    assert not ((y.double() - ref64(mod, x)).abs() <= _bound(mod, x)).all()


@pytest.mark.parametrize("offset,fp32_offset", [(True, False), (False, False), (True, True)])
def test_layout_round_trip_is_bit_exact(offset, fp32_offset):
    cfg = bcq.Config(bits=3, group_size=64, offset=offset, fp32_offset=fp32_offset, iters=0)
    canon = bcq.quantize(torch.randn(96, 320), cfg)
    packed = cuda_lut.repack(canon, cfg, 96, 320)
    assert tuple(packed) == cuda_lut.LAYOUT.names(cfg)
    assert sum(t.numel() * t.element_size() for t in packed.values()) == sum(
        t.numel() * t.element_size() for t in canon.values())
    assert packed["lut_planes"].shape == (10, 3, 96) and packed["lut_alpha"].shape == (5, 3, 96)
    back = cuda_lut.unrepack(packed, cfg, 96, 320)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype
                                           for k in canon)


@pytest.mark.parametrize("opts", [dict(bits=2, iters=1), dict(bits=3, init="uniform", iters=0),
                                  dict(bits=8, init="uniform", iters=0, offset=False)], ids=["free", "uniform3", "uniform8"])
@pytest.mark.parametrize("N,K,group_size", [(93, 128, 64), (94, 128, 64), (95, 128, 64), (96, 128, 64), (97, 128, 64),
                                            (96, 128, -1), (95, 32, 32)])
def test_layout_pads_rows_to_a_multiple_of_4_and_round_trips(opts, N, K, group_size):
    """Every buffer's row dimension (the last) is padded with zeros to the next multiple of 4 (fewer than 4 rows);
    unrepack drops them.  Neither side is ever a view of the other, also where a permutation only moves dimensions of
    size 1 (one group per row, K = 32), which ``.contiguous()`` would hand back as it is."""
    cfg = bcq.Config(group_size=group_size, **opts)
    canon = bcq.quantize(torch.randn(N, K), cfg)
    packed = cuda_lut.repack(canon, cfg, N, K)
    rows = cuda_lut.padded(N)
    assert rows % 4 == 0 and 0 <= rows - N < 4
    assert all(t.shape[-1] == rows and t.is_contiguous() for t in packed.values())
    assert all(not t[..., N:].any() for t in packed.values())
    back = cuda_lut.unrepack(packed, cfg, N, K)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype
                                           and back[k].is_contiguous() for k in canon)
    storage = lambda ts: {t.untyped_storage().data_ptr() for t in ts}
    assert not storage(packed.values()) & storage(canon.values())
    assert not storage(back.values()) & storage(packed.values())


def _uniform8_small(N, K, group_size, seed=0):
    """An 8-bit uniform layer (reference backend) whose scales are all below 2^-13, as an imported GPTQ checkpoint's
    may be (our quantizer floors them there): a round-to-nearest layer's scales times 2^-6."""
    torch.manual_seed(seed)
    cfg = bcq.Config(bits=8, group_size=group_size, init="uniform", iters=0)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    mod.scales.mul_(2.0 ** -6)
    assert mod.scales.float().max() < 2.0 ** -13
    return mod


@pytest.mark.parametrize("bits,offset", [(5, False), (6, True), (8, True)])
def test_uniform_layout_holds_scales_and_round_trips(bits, offset):
    """A uniform layer of 5-8 bits holds its fp16 scales as they are (not α) and float32 offsets, and unpacks to the
    same bytes."""
    cfg = bcq.Config(bits=bits, group_size=64, offset=offset, init="uniform", iters=0)
    canon = bcq.quantize(torch.randn(96, 320), cfg)
    assert "qweight" in canon
    packed = cuda_lut.repack(canon, cfg, 96, 320)
    assert tuple(sorted(packed)) == tuple(sorted(cuda_lut.LAYOUT.names(cfg)))
    assert packed["lut_planes"].shape == (10, bits, 96) and torch.equal(packed["lut_scales"], canon["scales"].T)
    assert ("lut_offset" in packed) == offset and "lut_alpha" not in packed
    back = cuda_lut.unrepack(packed, cfg, 96, 320)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype
                                           for k in canon)
    # contiguous copies (safetensors saves only those), never views of the layout's buffers
    assert all(t.is_contiguous() and t.data_ptr() != p.data_ptr() for t in back.values() for p in packed.values())


def test_uniform_8bit_scales_below_fp16_alpha():
    """Scales below 2^-13, whose α = s/2 fp16 cannot hold (as_bcq refuses them): the layout keeps the scales, and the
    spec still matches the float64 reference."""
    mod = _uniform8_small(96, 320, 64)
    canon = mod.canonical()
    with pytest.raises(ValueError, match="fp16"):
        bcq.as_bcq(canon, mod.config, 96, 320)
    bufs = cuda_lut.repack(canon, mod.config, 96, 320)
    for M in (1, 8):
        x = torch.randn(M, 320)
        y64 = ref64(mod, x)
        y = cuda_lut.spec(x, bufs, mod.bias, mod.config, 96, 320, cuda_lut.plan(M, 96, 320, 132, 8))
        assert ((y.double() - y64).abs() <= _bound(mod, x)).all()


def test_plan_covers_every_tile_once_within_limits():
    shapes = [(576, 576), (1536, 576), (4096, 4096), (8192, 8192), (28672, 8192), (8192, 28672), (64, 64),
              (12288, 12288), (96, 320)]
    for M, bits, (N, K), sms in itertools.product(range(1, 9), range(1, 9), shapes, (1, 78, 132)):
        kt, threads, per_split, splits = cuda_lut.plan(M, N, K, sms, bits)
        W = kt // 32
        assert W in (1, 2, 4) and W * bits <= 8 and W * M <= 8 and (W == 4 or 2 * W * max(bits, M) > 8)
        tiles = math.ceil(K / kt)
        assert threads % 32 == 0 and 32 <= threads <= 256 and 4 * threads <= 128 * math.ceil(N / 128)
        assert threads >= min(256, 64 * M * W, 32 * math.ceil(N / 128))  # at most two tables per warp and tile
        assert (splits - 1) * per_split < tiles <= splits * per_split
        assert 2 * 4 * M * (kt // 8) * 256 <= 64 * 1024  # two table buffers


def test_python_words_match_the_kernel_header(tmp_path):
    """words() and resident() must agree with the header's lut_gemv_words (which picks the kernel template) and
    lut_gemv_blocks_per_sm (its launch bounds) for every M and Q."""
    import shutil
    import subprocess

    from cuda_emulation import BACKENDS, cuda_home

    if shutil.which("g++") is None or cuda_home() is None:
        pytest.skip("needs g++ and the CUDA headers")
    src = tmp_path / "w.cpp"
    src.write_text('#include "cuda_lut/bcq_lut_gemv.h"\n#include <cstdio>\nint main() { for (int m = 1; m <= 8; ++m)'
                   ' for (int q = 1; q <= 8; ++q) printf("%d %d ", qlinear::lut_gemv_words(m, q),'
                   ' qlinear::lut_gemv_blocks_per_sm(q)); }\n')
    subprocess.run(["g++", "-std=c++17", f"-I{BACKENDS}", f"-I{cuda_home() / 'include'}", str(src), "-o",
                    str(tmp_path / "w")], check=True)
    got = subprocess.run([str(tmp_path / "w")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(w) for w in got] == [v for m in range(1, 9) for q in range(1, 9)
                                     for v in (cuda_lut.words(m, q), cuda_lut.resident(q))]


# --- the layout machinery, driven on CPU by a kernel that runs the spec --------------------------------
spec_kernel = spec_kernel_fixture("cuda_lut")


def test_reference_backend_keeps_canonical_layout(spec_kernel):
    mod, _ = _layer(64, 64, 2, 32)
    assert mod.layout == ""  # built with backend="reference"
    auto = BCQLinear(64, 64, True, mod.config)
    auto.load_state_dict(mod.state_dict())
    assert auto.layout == "cuda_lut"
    auto.backend = "reference"
    auto.repack_for_device()
    assert auto.layout == "" and torch.equal(auto.planes, mod.planes)


# --- on a GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
pytestmark = pytest.mark.usefixtures("without_dispatch_table")


@functools.lru_cache(maxsize=None)
def _gpu_layer(N, K, bits, group_size):
    """Quantized once per shape (greedy BCQ init, no refinement: fast, and α are not uniform)."""
    torch.manual_seed(N + K + bits)
    cfg = bcq.Config(bits=bits, group_size=group_size, offset=bits != 2, init="greedy", iters=0)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    mod.backend = None
    return mod.cuda()


# (group_size, bits, N, K), ids as gpu_checks.sh selects them ("128-4-576-576"); 5-8 planes share one kernel (kMaxQ):
# fewer cases, so the GPU session's test slot stays about the same size
_GPU_CASES = [(g, q, N, K) for g in (64, 128, -1) for q in (1, 2, 3, 4)
              for N, K in ((576, 576), (1536, 576), (4096, 4096), (1024, 8192))]
_GPU_CASES += [(g, q, N, K) for g in (64, -1) for q in (5, 8) for N, K in ((1536, 576), (1024, 8192))]
_GPU_CASES += [(128, 2, 1538, 576), (-1, 8, 1537, 576)]  # rows padded to a multiple of 4 in the layout


@gpu
@pytest.mark.parametrize("group_size,bits,N,K", _GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_and_is_deterministic(dtype, group_size, bits, N, K):
    assert cuda_lut.available() is None, cuda_lut.available()
    mod = _gpu_layer(N, K, bits, group_size)
    assert mod.layout == "cuda_lut"
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    for M in range(1, 9):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "cuda_lut"
        y64 = ref64(mod, x)
        poison_cuda_allocator()
        y = mod(x)
        assert y.dtype == dtype and y.shape == (M, N)
        err = (y.double().cpu() - y64).abs()
        assert (err <= _bound(mod, x, eps, y64)).all(), err.max().item()
        poison_cuda_allocator()
        assert torch.equal(mod(x), y)
    # above the GEMV's batches: the dequantize kernel + cuBLAS, within the bound plus Ŵ's rounding to dtype
    w = bcq.dequantize({k: v.cpu() for k, v in mod.canonical().items()}, mod.config, N, K).double()
    for M in (9, 64):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "cuda_lut_dequant"
        y64 = ref64(mod, x)
        err = (mod(x).double().cpu() - y64).abs()
        assert (err <= _bound(mod, x, eps, y64) + eps * (x.double().abs().cpu() @ w.abs().T)).all(), err.max().item()


@gpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("group_size", [64, -1])
def test_dequantize_kernel_is_the_format_bit_for_bit(bits, group_size):
    """``bcq_lut_dequantize``: the format's float32 Ŵ exactly, and its one rounding to fp16 / bf16."""
    mod = _gpu_layer(1536, 576, bits, group_size)
    held = dict(mod.named_buffers())
    want = bcq.dequantize({k: v.cpu() for k, v in mod.canonical().items()}, mod.config, 1536, 576)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_cuda_allocator()
        assert torch.equal(cuda_lut.dequantize(held, mod.config, 1536, 576, dtype).cpu(), want.to(dtype)), dtype
    assert torch.equal(mod.dequantize().cpu(), want)  # the layout's dequantize: what the backward pass uses


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_uniform_8bit_layer_with_small_scales_runs_on_the_kernels(dtype, monkeypatch):
    """An 8-bit uniform layer whose scales fp16 α could not hold: the GEMV and the dequantize path on its scales (the
    layout such layers hold where the canonical 8-bit kernels, registered above, cannot run them)."""
    monkeypatch.setattr(backends, "_KERNELS", [k for k in backends._KERNELS if not k.backend.startswith("cuda_uniform")])
    mod = _uniform8_small(1536, 576, 128)
    mod.backend = None
    mod = mod.cuda()
    assert mod.layout == "cuda_lut" and "lut_scales" in dict(mod.named_buffers())
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    w = bcq.dequantize({k: v.cpu() for k, v in mod.canonical().items()}, mod.config, 1536, 576)
    assert torch.equal(mod.dequantize().cpu(), w)
    for M, backend in ((1, "cuda_lut"), (8, "cuda_lut"), (64, "cuda_lut_dequant")):
        x = torch.randn(M, 576, device="cuda").to(dtype)
        assert mod.kernel(x).backend == backend
        y64 = ref64(mod, x)
        bound = _bound(mod, x, eps, y64) + (eps * (x.double().abs().cpu() @ w.double().abs().T) if M > 8 else 0)
        assert ((mod(x).double().cpu() - y64).abs() <= bound).all(), M


# --- the kernel's own source, run on the CPU under the host emulation (tests/cuda_emulation.py) -------------
_LUT_DRIVER = r'''
// Driver: reads one call from argv[1] (header, x, planes, alpha or a uniform layer's scales, offset, bias), runs the
// source's own host entry point (lut_gemv or lut_dequantize: template dispatch, launch sizes, split-K reduction) and
// writes y (fp32) to argv[2].

int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 18);
  const int M = h[0], N = h[1], K = h[2], Q = h[3], gs = h[4], bf16 = h[9], off_kind = h[10], bias_kind = h[11];
  const int G = (K + gs - 1) / gs;
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  auto planes = emu_read<unsigned>(f, (size_t)K / 32 * Q * N);
  auto alpha = emu_read<uint16_t>(f, (size_t)G * (h[17] ? 1 : Q) * N);
  std::vector<char> offset = emu_read<char>(f, (size_t)G * N * (off_kind == 2 ? 4 : off_kind == 1 ? 2 : 0));
  std::vector<char> bias = emu_read<char>(f, (size_t)N * (bias_kind == 2 ? 4 : bias_kind == 1 ? 2 : 0));
  std::vector<int> perm = emu_read<int>(f, h[12] ? K : 0);
  std::vector<unsigned> sign_bits = emu_read<unsigned>(f, h[14]);
  std::vector<signed char> paley = emu_read<signed char>(f, h[16] > 1 ? h[16] * h[16] : 0);
  fclose(f);
  LutGemvArgs a{};
  a.perm = h[12] ? perm.data() : nullptr;
  a.x = x.data(); a.planes = planes.data(); a.alpha = alpha.data();
  a.offset = off_kind ? offset.data() : nullptr;
  a.offset_dtype = off_kind == 2 ? DType::kFloat : off_kind == 1 ? DType::kHalf : DType::kNone;
  a.bias = bias_kind ? bias.data() : nullptr;
  a.bias_dtype = bias_kind == 2 ? DType::kFloat : bf16 ? DType::kBFloat16 : DType::kHalf;
  std::vector<uint16_t> y((size_t)M * N, 0x7E00);  // NaN-poisoned output
  std::vector<float> partial((size_t)h[8] * M * N, NAN);
  a.y = y.data(); a.partial = partial.data();
  a.M = M; a.N = N; a.K = K; a.Q = Q; a.group_size = gs; a.uniform = h[17];
  a.kt = h[5]; a.threads = h[6]; a.tiles_per_split = h[7]; a.splits = h[8];
  a.x_dtype = bf16 ? DType::kBFloat16 : DType::kHalf;
  const Rotation rot{h[15], h[16], sign_bits.data(), paley.data()};
  if (h[13] == 1) {  // the dequantize kernel: Ŵ [N, K] float32
    std::vector<float> w((size_t)N * K, NAN);
    a.y = w.data();
    emu_check(lut_dequantize(a, DType::kFloat, nullptr));
    FILE* o = fopen(argv[2], "wb"); fwrite(w.data(), 4, w.size(), o); fclose(o);
    return 0;
  }
  if (h[13]) {  // Ŵ in x's dtype (fp16 or bf16), written as float32
    std::vector<uint16_t> w((size_t)N * K, 0x7E00);
    a.y = w.data();
    emu_check(lut_dequantize(a, a.x_dtype, nullptr));
    emu_write(argv[2], w, bf16);
    return 0;
  }
  emu_check(lut_gemv(a, rot, nullptr));
  emu_write(argv[2], y, bf16);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(
        tmp_path_factory.mktemp("lut_emu"), "cuda_lut/bcq_lut_gemv.cu",
        ("extern __shared__ __align__(16) float smem[];", "float* smem = reinterpret_cast<float*>(::g_smem4);"), "", _LUT_DRIVER,
        launches=True)


def _emulate(exe, x, bufs, bias, cfg, N, K, launch, perm=None, dequant=None, rotation=None):
    """The GEMV (float32 ``[M, N]``) or, with ``dequant`` (torch.float32 or ``x``'s dtype), the dequantize kernel
    writing ``Ŵ`` ``[N, K]`` in that dtype (returned as float32; ``x`` only gives the dtype) run by the emulator; ``rotation = (seed, block)`` has the kernel stage ``R·x`` itself."""
    from cuda_emulation import dtype_kind, rotation_header, run

    off = bufs.get("lut_offset")
    rot, rot_tensors = rotation_header(rotation, K)
    hdr = [x.shape[0], N, K, cfg.bits, cfg.group(K), *launch, int(x.dtype == torch.bfloat16), dtype_kind(off),
           dtype_kind(bias), int(perm is not None), {None: 0, torch.float32: 1}.get(dequant, 2), *rot,
           int("lut_scales" in bufs)]
    tensors = [x, bufs["lut_planes"], cuda_lut.alpha_arg(bufs), off, bias, perm, *rot_tensors]
    return run(exe, hdr, tensors, (x.shape[0], N) if dequant is None else (N, K))


@pytest.mark.parametrize("bits,group_size,offset,fp32_offset,dtype", [
    (1, 32, False, False, torch.float16), (2, 64, True, False, torch.bfloat16), (3, -1, True, True, torch.float16),
    (4, 128, True, False, torch.float16), (5, 32, False, False, torch.bfloat16), (6, 64, True, True, torch.bfloat16),
    (7, -1, False, False, torch.float16), (8, 64, True, False, torch.float16)])
def test_kernel_source_under_host_emulation(emulator, bits, group_size, offset, fp32_offset, dtype):
    """bcq_lut_gemv.cu itself (tables, lookups, α/offset per word, split-K and reduction) on the CPU, against the
    float64 reference within the module docstring's bound, for M = 1, 3, 8 and one split or many."""
    N, K = 96, 320
    torch.manual_seed(bits)
    cfg = bcq.Config(bits=bits, group_size=group_size, offset=offset, fp32_offset=fp32_offset, iters=0)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    bufs = cuda_lut.repack(mod.canonical(), cfg, N, K)
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    for M in (1, 3, 8):
        x = torch.randn(M, K).to(dtype)
        y64 = ref64(mod, x)
        for sms in (1, 132):
            launch = cuda_lut.plan(M, N, K, sms, bits)
            y = _emulate(emulator, x, bufs, mod.bias, cfg, N, K, launch)
            err = (y.double() - y64).abs()
            assert (err <= _bound(mod, x, eps, y64)).all(), (M, launch, err.max().item())
            if M == 3:  # a bias in x's dtype is read as it is: the same sums as that bias widened to fp32, in the
                b = mod.bias.detach().to(dtype)  # split launch's reduction and in the kernel's own epilogue (one split)
                for lc in (launch, (*launch[:2], -(-K // launch[0]), 1)):
                    assert torch.equal(_emulate(emulator, x, bufs, b, cfg, N, K, lc),
                                       _emulate(emulator, x, bufs, b.float(), cfg, N, K, lc)), lc
    # the dequantize kernel (row and K tiles cut by N = 96 or 288 and K = 320): the format's float32 Ŵ bit for bit, and its one
    # rounding to x's dtype, also for a round-to-nearest layer, whose s·(q − z) storage the layout holds as its scales
    # and float32 offsets (at 8 bits also one of scales below 2^-13, which fp16 α could not hold); the GEMV for those too
    layers = [(mod, bufs)]
    if (offset and bits > 1) or bits > 4:  # (a uniform layer of 5-8 bits holds its scales, with or without offsets)
        ucfg = bcq.Config(bits=bits, group_size=group_size, init="uniform", iters=0, offset=offset,
                          fp32_offset=fp32_offset)
        uniform = [BCQLinear.from_linear(torch.nn.Linear(K, N), ucfg, backend="reference")]
        if bits == 8:
            uniform.append(_uniform8_small(N, K, group_size))
        for umod in uniform:
            assert "qweight" in umod.canonical()
            ubufs = cuda_lut.repack(umod.canonical(), umod.config, N, K)
            layers.append((umod, ubufs))
            for M in (1, 8):
                x = torch.randn(M, K).to(dtype)
                y64 = ref64(umod, x)
                y = _emulate(emulator, x, ubufs, umod.bias, umod.config, N, K, cuda_lut.plan(M, N, K, 132, bits))
                assert ((y.double() - y64).abs() <= _bound(umod, x, eps, y64)).all(), M
    wide = BCQLinear.from_linear(torch.nn.Linear(K, 288), cfg, backend="reference")  # 3 row tiles, the last cut short
    layers.append((wide, cuda_lut.repack(wide.canonical(), cfg, 288, K)))
    for m, b in layers:
        n = m.out_features
        want = bcq.dequantize(m.canonical(), m.config, n, K)
        for out in (torch.float32, dtype):
            w = _emulate(emulator, torch.zeros(1, K).to(dtype), b, None, m.config, n, K, (32, 32, 1, 1), dequant=out)
            assert torch.equal(w.to(out).view(torch.int16 if out != torch.float32 else torch.int32),
                               want.to(out).view(torch.int16 if out != torch.float32 else torch.int32)), out
    # act_order: the kernel reads x[:, perm] as it loads x (bitwise the same as gathering first)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    x = torch.randn(3, K).to(dtype)
    launch = cuda_lut.plan(3, N, K, 132, bits)
    assert torch.equal(_emulate(emulator, x, bufs, mod.bias, cfg, N, K, launch, perm=perm),
                       _emulate(emulator, x[:, perm.long()], bufs, mod.bias, cfg, N, K, launch))



@pytest.mark.parametrize("bits", [1, 3, 4, 6])
def test_launcher_dispatches_every_batch(emulator, bits):
    """The source's own ``lut_gemv`` picks the kernel instantiation for every M in 1..8 and each plane count (5-8:
    the run-time count of ``kMaxQ``), sizes its launch and reduces the splits: within the bound at every M; a launch
    plan whose tile does not match the instantiation's is refused (cudaErrorInvalidValue), not run."""
    import subprocess

    N, K = 40, 256
    mod, _ = _layer(N, K, bits, 64, seed=bits)
    bufs = cuda_lut.repack(mod.canonical(), mod.config, N, K)
    Np = cuda_lut.padded(N)
    for M in range(1, 9):
        x = torch.randn(M, K).half()
        y64 = ref64(mod, x) - mod.bias.double()
        launch = cuda_lut.plan(M, Np, K, 132, bits)
        y = _emulate(emulator, x, bufs, None, mod.config, Np, K, launch)[:, :N]
        assert ((y.double() - y64).abs() <= _bound(mod, x, 2.0 ** -11, y64)).all(), M
    wrong = (2 * launch[0], *launch[1:])
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _emulate(emulator, x, bufs, None, mod.config, Np, K, wrong)
    assert refused.value.returncode == 3  # emu_check's exit for a launcher's error


@pytest.fixture
def emulated_ops(emulator, monkeypatch):
    """``torch.ops.qlinear.bcq_lut_gemv`` and ``bcq_lut_dequantize`` run by the host emulation of bcq_lut_gemv.cu (no
    rotation), so that :func:`cuda_lut.linear` and :func:`cuda_lut.dequantize` themselves run on the CPU."""
    import types

    def call(x, planes, alpha, offset, group_size, bias=None, perm=None, launch=(32, 32, 1, 1), dequant=None):
        bufs = {"lut_planes": planes, "lut_scales" if alpha.dim() == 2 else "lut_alpha": alpha, "lut_offset": offset}
        cfg = types.SimpleNamespace(bits=planes.shape[1], group=lambda K: group_size)
        K, N = planes.shape[0] * 32, planes.shape[2]
        return _emulate(emulator, x, {k: v for k, v in bufs.items() if v is not None}, bias, cfg, N, K, launch,
                        perm=perm, dequant=dequant)

    def gemv(x, planes, alpha, offset, perm, bias, group_size, kt, threads, per_split, splits, *rot):
        assert rot == cuda_lut.NO_ROTATION
        assert bias is None or bias.numel() == planes.shape[2]  # the binding's check: one bias entry per held row
        return call(x, planes, alpha, offset, group_size, bias, perm, (kt, threads, per_split, splits)).to(x.dtype)

    def dequantize(planes, alpha, offset, group_size, dtype):
        return call(torch.zeros(1, planes.shape[0] * 32).half(), planes, alpha, offset, group_size,
                    dequant=dtype).to(dtype)

    monkeypatch.setattr(torch.ops.qlinear, "bcq_lut_gemv", gemv)
    monkeypatch.setattr(torch.ops.qlinear, "bcq_lut_dequantize", dequantize)
    monkeypatch.setattr(cuda_lut, "_sms", lambda index: 132)


@pytest.mark.parametrize("opts", [dict(bits=2, iters=1), dict(bits=3, init="uniform", iters=0),
                                  dict(bits=8, init="uniform", iters=0)], ids=["free", "uniform3", "uniform8"])
@pytest.mark.parametrize("N", [50, 95])
def test_padded_rows_are_dropped_by_linear_and_dequantize(emulated_ops, opts, N):
    """A layer whose rows are not a multiple of 4 (e.g. GPT-2's 50257 output rows): the kernels run on the padded
    layout and :func:`cuda_lut.linear` returns ``[..., N]`` (contiguous, bias added once) within the module
    docstring's bound of the float64 reference; :func:`cuda_lut.dequantize` gives the format's ``Ŵ`` bit for bit."""
    K = 256
    torch.manual_seed(N)
    cfg = bcq.Config(group_size=64, **opts)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    bufs = cuda_lut.repack(mod.canonical(), cfg, N, K)
    eps = 2.0 ** -11
    for bias in (mod.bias, None):
        for shape in ((1, K), (1, 3, K), (8, K)):
            x = torch.randn(shape).half()
            y = cuda_lut.linear(x, bufs, bias, cfg, N, K)
            assert y.shape == (*shape[:-1], N) and y.is_contiguous() and y.dtype == torch.float16
            x2 = x.reshape(-1, K)
            y64 = ref64(mod, x2) - (mod.bias.double() if bias is None else 0)
            assert ((y.reshape(-1, N).double() - y64).abs() <= _bound(mod, x2, eps, y64)).all()
    want = bcq.dequantize(mod.canonical(), cfg, N, K)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(cuda_lut.dequantize(bufs, cfg, N, K, dtype), want.to(dtype)), dtype


@pytest.mark.parametrize("bits", [5, 7])
def test_dequantize_kernel_adds_in_the_formats_order_past_four_planes(emulator, bits):
    """With tiny α on planes 0-3, large ones above and a tiny offset, float32 sums depend on their order: the kernel's
    table of planes 0-3, then planes 4.. per weight, then the offset, must give bcq.dequantize's values bit for bit
    (adding the offset before planes 4.. would not)."""
    N, K = 32, 64
    cfg = bcq.Config(bits=bits, group_size=64, offset=True, iters=0)
    torch.manual_seed(3)
    canon = {k: v.clone() for k, v in bcq.quantize(torch.randn(N, K), cfg).items()}
    tiny = torch.tensor([3 * 2.0 ** -24, 2.0 ** -20, 2.0 ** -18, 2.0 ** -16])
    canon["alpha"] = torch.cat([tiny, 2.0 ** (7 + torch.arange(4, bits))]).half().view(-1, 1, 1).expand(-1, N, 1).clone()
    canon["offset"] = torch.full((N, 1), 2.0 ** -13, dtype=torch.float16)
    want = bcq.dequantize(canon, cfg, N, K)
    codes = bcq.unpack_planes(canon["planes"], K).view(N, 1, K)  # the other order, in float32, to show it differs
    a, sign = canon["alpha"].float(), lambda q: ((codes >> q) & 1) * 2.0 - 1
    other = sum((sign(q) * a[q][..., None] for q in range(1, 4)), sign(0) * a[0][..., None] + 0.0)
    other = other + canon["offset"].float()[..., None]
    for q in range(4, bits):
        other = other + sign(q) * a[q][..., None]
    assert not torch.equal(other.view(N, K), want)
    got = _emulate(emulator, torch.zeros(1, K).half(), cuda_lut.repack(canon, cfg, N, K), None, cfg, N, K,
                   (32, 32, 1, 1), dequant=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits,dtype", [(2, torch.float16), (4, torch.bfloat16), (8, torch.float16)])
def test_kernel_source_stages_a_rotated_input(emulator, bits, dtype):
    """A rotated layer's ``R·x`` staged by bcq_lut_gemv.cu itself (rotation.cuh: signs, butterflies, Paley factor,
    in the tables' shared memory) under the host emulation: the float64 product with the exact ``R·x`` within the
    module docstring's bound plus one rounding of ``R·x`` to x's dtype, for power-of-two and Paley blocks, K slices
    that cut through blocks (split-K) and an act_order ``perm`` read from the staged values."""
    from cuda_emulation import rotated_reference

    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    # (N, K, block, M, SMs or a launch, act_order).  512 x 1024: 128-thread blocks fold 64-128-input slices of
    # 512-input rotation blocks with more threads per bin than 256 floats of partials would hold.  K = 2048 in splits of
    # 3 tiles: the slice that straddles input 1024 is cut there (rotation.cuh), its pieces transformed one by one.
    kt = 32 * cuda_lut.words(1, bits)
    for N, K, block, M, sms, gather in ((96, 384, 384, 1, 132, False), (96, 384, 128, 3, 1, False),
                                        (96, 384, 24, 1, 132, False), (96, 384, 12, 3, 132, True),
                                        (512, 1024, 512, 1, 132, False),
                                        (96, 2048, 2048, 1, (kt, 64, 3, -(-2048 // (3 * kt))), False)):
        mod, _ = _layer(N, K, bits, 64, seed=bits)
        cfg = mod.config
        bufs = cuda_lut.repack(mod.canonical(), cfg, N, K)
        w64 = bcq.dequantize(mod.canonical(), cfg, N, K).double()
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(2)).to(torch.int32)
        x = torch.randn(M, K).to(dtype)
        x64, _ = rotated_reference(x, (7, block))
        if gather:
            x64 = x64[:, perm.long()]
        y64 = x64 @ w64.T + mod.bias.double()
        launch = sms if isinstance(sms, tuple) else cuda_lut.plan(M, N, K, sms, bits)
        y = _emulate(emulator, x, bufs, mod.bias, cfg, N, K, launch, perm=perm if gather else None,
                     rotation=(7, block))
        mag = _bound(mod, x64) / ((K / 8 + 64) * U32)  # Σ_k (Σ_q|α_q| + |c|)·|(R·x)_k|
        bound = _bound(mod, x64, eps, y64) + 2 * eps * mag
        assert ((y.double() - y64).abs() <= bound).all(), (block, M, launch, gather)
