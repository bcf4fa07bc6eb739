"""The GPU paths of 8-bit uniform BCQ layers read as stored (``cuda_uniform_gemv`` at decode batches,
``cuda_uniform_gemm`` up to 128 rows, ``cuda_uniform``: dequantize kernel + cuBLAS): their CUDA source under the host
emulation against float64 ``s·(q − z)`` formed from the integer codes (bit for bit for ``Ŵ``; within fp32 summation
error for the GEMV and GEMM), the Python entry points on the emulated ops, the registry's choices, and on a GPU the ops
and the forward pass."""

from __future__ import annotations

import pytest
import torch
from conftest import poison_cuda_allocator

from qlinear import BCQLinear, QLinearConfig
from qlinear.backends import cuda_uniform
from qlinear.formats import bcq

# K, group size (-1: the whole row), zero points; 160 with 64: a ragged last group of 32; 2^31 - 32: one group, where
# K + group_size overflows an int
CASES = [(256, 128, True), (256, 64, False), (160, 64, True), (256, 32, False), (96, -1, True), (1536, 32, True),
         (64, 2 ** 31 - 32, True)]

_DRIVER = r'''
// Driver: reads one call from argv[1] (header, codes, zeros, scales; for the GEMV and GEMM then x and bias), runs the
// source's own uniform_dequantize, uniform_gemv or uniform_gemm (checks, template dispatch and launch, the GEMM's split-K
// reduction) and writes Ŵ or y (as fp32) to argv[2].  Header: N, K, group size, zero words (0: symmetric), output
// (0/1/2: Ŵ in fp32/fp16/bf16, 3: the GEMV, 4: the GEMM), M, x in bf16, bias (0 none, 1 in x's dtype, 2 fp32); the GEMM's
// then tile_m, tiles per split, splits.
int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 8);
  const auto launch = emu_read<int>(f, h[4] == 4 ? 3 : 0);
  const int N = h[0], K = h[1], gs = h[2], zero_words = h[3], G = (K - 1) / gs + 1, M = h[5], bf16 = h[6];
  auto codes = emu_read<unsigned>(f, (size_t)N * K / 4);
  auto zeros = emu_read<unsigned>(f, (size_t)G * zero_words);
  auto scales = emu_read<uint16_t>(f, (size_t)N * G);
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  std::vector<char> bias = emu_read<char>(f, (size_t)N * (h[7] == 2 ? 4 : h[7] == 1 ? 2 : 0));
  fclose(f);
  UniformArgs a{codes.data(), scales.data(), zero_words ? zeros.data() : nullptr, nullptr, N, K, 8, gs, K / 4,
                zero_words};
  if (h[4] == 3 || h[4] == 4) {
    std::vector<uint16_t> y((size_t)M * N, 0x7E00);  // NaN-poisoned
    UniformGemvArgs g{a, x.data(), h[7] ? bias.data() : nullptr, y.data(), M, bf16 ? DType::kBFloat16 : DType::kHalf,
                      h[7] == 2 ? DType::kFloat : bf16 ? DType::kBFloat16 : DType::kHalf};
    if (h[4] == 3) {
      emu_check(uniform_gemv(g, nullptr));
    } else {
      std::vector<float> partial((size_t)launch[2] * M * N, NAN);
      emu_check(uniform_gemm(UniformGemmArgs{g, launch[2] > 1 ? partial.data() : nullptr, launch[0], launch[1],
                                             launch[2]}, nullptr));
    }
    emu_write(argv[2], y, bf16);
    return 0;
  }
  if (h[4] == 0) {  // fp32 Ŵ
    std::vector<float> w((size_t)N * K, NAN);
    a.w = w.data();
    emu_check(uniform_dequantize(a, DType::kFloat, nullptr));
    FILE* o = fopen(argv[2], "wb"); fwrite(w.data(), 4, w.size(), o); fclose(o);
    return 0;
  }
  std::vector<uint16_t> w((size_t)N * K, 0x7E00);  // fp16 (h[4] = 1) or bf16 (2) Ŵ, written as fp32
  a.w = w.data();
  emu_check(uniform_dequantize(a, h[4] == 1 ? DType::kHalf : DType::kBFloat16, nullptr));
  emu_write(argv[2], w, h[4] == 2);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(tmp_path_factory.mktemp("uniform_emu"), "cuda_uniform/uniform.cu",
                                ("extern __shared__ __align__(16) unsigned char smem_raw[];",
                                 "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(::g_smem4);"),
                                cuda_emulation.WARP_PTX, _DRIVER, launches=True, sanitize=True)


def _weights(N, K, group_size, zeros, seed=0):
    """Random 8-bit uniform storage: every code and zero point from 0 to 255 (q − z reaches ±255), fp16 scales over
    2^-20 .. 2^-2 (an imported checkpoint's may be far below what fp16 α could hold).  Returns the buffers, the config
    and ``Ŵ`` in float64 from the integers: ``s·(q − z)``, exact (11 × 9 significant bits)."""
    gen = torch.Generator().manual_seed(seed)
    g = K if group_size == -1 else group_size
    G = -(-K // g)
    codes = torch.randint(0, 256, (N, K), generator=gen)
    codes[0, :2] = torch.tensor([0, 255])
    s = (2.0 ** torch.randint(-20, -2, (N, G), generator=gen) * (1 + torch.rand(N, G, generator=gen))).half()
    z = torch.randint(0, 256, (N, G), generator=gen) if zeros else None
    if zeros:
        z[0, 0] = 255
    cfg = bcq.Config(bits=8, group_size=group_size, init="uniform", iters=0, offset=zeros)
    gidx = torch.arange(K) // g
    zf = z.double()[:, gidx] if zeros else torch.tensor(127.5, dtype=torch.float64)
    w64 = s.double()[:, gidx] * (codes.double() - zf)
    return bcq.uniform_buffers(codes, s, z, 8), cfg, w64


def _header(N, K, group_size, bufs):
    return [N, K, K if group_size == -1 else group_size, bufs["qzeros"].shape[1] if "qzeros" in bufs else 0]


@pytest.mark.parametrize("K,group_size,zeros", CASES)
def test_dequantize_source_under_host_emulation_is_exact(emulator, K, group_size, zeros):
    """uniform.cu's dequantize kernel under the host emulation: ``s·(q − z)`` rounded once to fp32 (float64 from the
    integers, then rounded), and that value rounded to fp16 and bf16, compared as integers; the same as the format's
    own dequantize.  N = 41 rows: the last block is cut short, and the zero points' last word is partly padding."""
    from cuda_emulation import run

    N = 41
    bufs, cfg, w64 = _weights(N, K, group_size, zeros, seed=K + group_size)
    want = w64.float()
    assert torch.equal(bcq.dequantize(bufs, cfg, N, K), want)
    hdr = _header(N, K, group_size, bufs)
    for code, dtype, as_int in ((0, torch.float32, torch.int32), (1, torch.float16, torch.int16),
                                (2, torch.bfloat16, torch.int16)):
        w = run(emulator, hdr + [code, 0, 0, 0], [bufs["qweight"], bufs.get("qzeros"), bufs["scales"]], (N, K))
        assert torch.equal(w.to(dtype).view(as_int), want.to(dtype).view(as_int)), dtype


@pytest.mark.parametrize("K,group_size,zeros", CASES)
def test_gemv_source_under_host_emulation(emulator, K, group_size, zeros):
    """uniform_gemv (the source's launcher and tensor-core kernel, its mma fragments emulated) under the host emulation
    at every M in 1..16 (the instantiations for x rows 0-7 and 0-15, with and without split groups), fp16 and bf16,
    with and without a bias, rows not a multiple of the block's 16 (N = 41): within ``(K/16 + 2·K/64 + 4)·u₃₂·Σ|ŵ·x|``
    of the float64 product (exact products summed in fp32 over each mma's 16 inputs and its 4 mmas, scaled, then
    accumulated over K/64 steps and the block's 4 warps) plus one rounding to x's dtype (absolute below fp16's
    normal range: rows of scales near 2^-20 give outputs there)."""
    from cuda_emulation import dtype_kind, run

    N = 41
    bufs, cfg, w64 = _weights(N, K, group_size, zeros, seed=3 * K + group_size)
    bias32 = torch.randn(N)
    for M in range(1, 17):
        dtype = torch.bfloat16 if M % 2 else torch.float16
        eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        tiny = {torch.float16: 2.0 ** -25, torch.bfloat16: 0.0}[dtype]  # half the spacing of fp16's subnormals
        x = torch.randn(M, K).to(dtype)
        bias = None if M % 3 == 0 else bias32 if M % 3 == 1 else bias32.to(dtype)
        y64 = x.double() @ w64.T + (0 if bias is None else bias.double())
        y = run(emulator, _header(N, K, group_size, bufs) + [3, M, int(dtype == torch.bfloat16), dtype_kind(bias)],
                [bufs["qweight"], bufs.get("qzeros"), bufs["scales"], x, bias], (M, N))
        bound = (K / 16 + 2 * K / 64 + 4) * 2.0 ** -24 * (x.double().abs() @ w64.abs().T) + eps * y64.abs() + tiny
        assert ((y.double() - y64).abs() <= bound).all(), (M, (y.double() - y64).abs().max().item())


GEMM_CASES = [c for c in CASES if c[0] % 64 == 0] + [(192, -1, False)]


@pytest.mark.parametrize("K,group_size,zeros", GEMM_CASES)
def test_gemm_source_under_host_emulation(emulator, K, group_size, zeros):
    """uniform_gemm (the source's launcher, tiles, cp.async stages, shared-memory reads in lane order, mma fragment use,
    register ring, split-K reduction and output mapping) under the host emulation, fp16 and bf16, with and without a
    bias, N = 41 (a block's 128 rows cut short, rows past N computed and never stored), M from 1 to 130 (rows past M in
    every tile size) under mma_plan's launch for 132 and for 1 SM and one tile size larger: B is ``Ŵ`` rounded once to
    x's dtype (``s·(q − z)``, bit for bit the dequantize kernel's), so the result is within ``(K/16 + splits + 2)·u₃₂``
    of the float64 product with that ``Ŵ`` (products exact, fp32 sums per mma, over the K/16 mmas and the slices) plus
    one rounding to x's dtype."""
    from cuda_emulation import dtype_kind, run
    from qlinear.backends._gpu import mma_plan

    N = 41
    bufs, cfg, w64 = _weights(N, K, group_size, zeros, seed=5 * K + group_size)
    bias32 = torch.randn(N)
    steps = K // 64
    for i, M in enumerate((1, 17, 40, 70, 130)):
        dtype = torch.bfloat16 if i % 2 else torch.float16
        eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        tiny = {torch.float16: 2.0 ** -25, torch.bfloat16: 0.0}[dtype]
        wt = w64.float().to(dtype).double()  # what the kernel's B holds
        x = torch.randn(M, K).to(dtype)
        bias = None if i % 3 == 0 else bias32 if i % 3 == 1 else bias32.to(dtype)
        y64 = x.double() @ wt.T + (0 if bias is None else bias.double())
        tile = mma_plan(M, N, K, 132)[0]
        launches = {mma_plan(M, N, K, 132), mma_plan(M, N, K, 1), (min(2 * tile, 128), steps, 1)}
        for launch in launches:
            y = run(emulator, _header(N, K, group_size, bufs) + [4, M, int(dtype == torch.bfloat16), dtype_kind(bias),
                                                                 *launch],
                    [bufs["qweight"], bufs.get("qzeros"), bufs["scales"], x, bias], (M, N))
            bound = (K / 16 + launch[2] + 2) * 2.0 ** -24 * (x.double().abs() @ wt.abs().T) + eps * y64.abs() + tiny
            assert ((y.double() - y64).abs() <= bound).all(), (M, launch, (y.double() - y64).abs().max().item())


@pytest.mark.parametrize("what", ["K", "group", "zeros", "M", "gemm K", "gemm M", "gemm tile", "gemm slices",
                                  "gemm empty slice"])
def test_launchers_refuse_what_they_cannot_run(emulator, what):
    """The host entry points return an error (the emulator exits 3) rather than read out of bounds."""
    import subprocess

    from cuda_emulation import run

    N, K, g, zero_words, M, launch = 8, 64, 32, 2, 1, []
    if what.startswith("gemm"):
        K, launch = 128, [16, 2, 1]
    if what == "K":
        K = 48
    elif what == "group":
        g = 48  # a multiple of 8 (the codebook GEMV takes it), not of 32
    elif what == "zeros":
        zero_words = 1  # must be ceil(N / 4) = 2
    elif what == "M":
        M = 17
    elif what == "gemm K":
        K, launch = 96, [16, 2, 1]  # the GEMV takes it (a multiple of 32), not the GEMM's 64-input steps
    elif what == "gemm M":
        M = 513
    elif what == "gemm tile":
        launch = [48, 2, 1]
    elif what == "gemm slices":
        launch = [16, 1, 1]  # one slice of one step: K's second step missed
    elif what == "gemm empty slice":
        launch = [16, 1, 3]  # a third slice past K's two steps
    G = -(-K // g)
    hdr = [N, K, g, zero_words, 4 if launch else 3, M, 0, 0] + launch
    tensors = [torch.zeros(N, K // 4, dtype=torch.int32), torch.zeros(G, zero_words, dtype=torch.int32),
               torch.ones(N, G).half(), torch.randn(M, K).half(), None]
    with pytest.raises(subprocess.CalledProcessError) as e:
        run(emulator, hdr, tensors, (M, N))
    assert e.value.returncode == 3


def test_supports():
    """What the kernels take: uniform 8-bit layers with K % 32 == 0 (the format's groups are multiples of 32 or the
    whole row)."""
    u8 = bcq.Config(bits=8, group_size=128, init="uniform", iters=0)
    assert cuda_uniform.supports(u8, 64, 256) is None
    assert cuda_uniform.supports(bcq.Config(bits=8, group_size=-1, init="uniform", iters=0), 64, 96) is None
    assert "not uniform" in cuda_uniform.supports(bcq.Config(bits=8, group_size=128), 64, 256)
    assert "multiple of 32" in cuda_uniform.supports(u8, 64, 272)
    assert "multiple of 32" in cuda_uniform.supports(bcq.Config(bits=8, group_size=-1, init="uniform", iters=0), 64, 784)
    assert "too large" in cuda_uniform.supports(u8, 1 << 22, 1 << 15)
    assert "below 2^20" in cuda_uniform.supports(u8, 64, 1 << 20)
    assert cuda_uniform.supports_gemm(u8, 64, 256) is None
    assert "multiple of 64" in cuda_uniform.supports_gemm(bcq.Config(bits=8, group_size=32, init="uniform", iters=0),
                                                          64, 96)
    assert "not uniform" in cuda_uniform.supports_gemm(bcq.Config(bits=8, group_size=128), 64, 256)


def test_gpu_choices(posing_gpu):
    """On a GPU an 8-bit uniform layer stays in its canonical storage (the GEMV up to M = 16, the GEMM up to 128 where
    K is a multiple of 64, dequantize + cuBLAS above); 5-7 bit uniform layers keep the LUT layout."""
    from qlinear import backends

    dev = torch.device("cuda")
    u8 = bcq.Config(bits=8, group_size=32, init="uniform", iters=0)
    for cfg, shape, layout, gemv, mid, large in (
            (bcq.Config(bits=8, group_size=128, method="gptq"), (4096, 4096), None, "cuda_uniform_gemv",
             "cuda_uniform_gemm", "cuda_uniform"),
            (bcq.Config(bits=8, group_size=-1, init="uniform", iters=0), (50257, 768), None, "cuda_uniform_gemv",
             "cuda_uniform_gemm", "cuda_uniform"),
            (u8, (256, 96), None, "cuda_uniform_gemv", "cuda_uniform", "cuda_uniform"),
            (bcq.Config(bits=6, group_size=64, init="uniform", iters=0), (256, 512), "cuda_lut", "cuda_lut",
             "cuda_lut_dequant", "cuda_lut_dequant")):
        held = backends.layout_for("bcq", cfg, dev, shape)
        assert (held and held.name) == layout, cfg
        big = 16 if gemv == "cuda_uniform_gemv" else 8
        for M, want in ((1, gemv), (big, gemv), (big + 1, mid), (128, mid), (129, large), (4096, large)):
            assert backends.select("bcq", cfg, dev, torch.float16, M, shape=shape).backend == want, (cfg, M)


@pytest.fixture
def emulated_ops(emulator, monkeypatch):
    """``torch.ops.qlinear.uniform_gemv`` / ``uniform_gemm`` / ``uniform_dequantize`` served by uniform.cu under the host
    emulation (CPU tensors; the GEMM's launch planned for 132 SMs): the Python entry points run as on a GPU."""
    from cuda_emulation import dtype_kind, run

    def header(qweight, scales, qzeros, K, group_size):
        return [qweight.shape[0], K, group_size, 0 if qzeros is None else qzeros.shape[1]]

    def gemv(x, qweight, scales, qzeros, bias, group_size, bits):
        assert bits == 8 and x.is_contiguous() and qweight.data_ptr() % 16 == 0
        M, K = x.shape
        hdr = header(qweight, scales, qzeros, K, group_size) + [3, M, int(x.dtype == torch.bfloat16), dtype_kind(bias)]
        return run(emulator, hdr, [qweight, qzeros, scales, x, bias], (M, qweight.shape[0])).to(x.dtype)

    def gemm(x, qweight, scales, qzeros, bias, group_size, bits, *launch):
        assert bits == 8 and x.is_contiguous() and qweight.data_ptr() % 16 == 0
        M, K = x.shape
        hdr = header(qweight, scales, qzeros, K, group_size) + [4, M, int(x.dtype == torch.bfloat16), dtype_kind(bias),
                                                               *launch]
        return run(emulator, hdr, [qweight, qzeros, scales, x, bias], (M, qweight.shape[0])).to(x.dtype)

    def dequantize(qweight, scales, qzeros, K, group_size, bits, dtype):
        code = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
        hdr = header(qweight, scales, qzeros, K, group_size) + [code, 0, 0, 0]
        return run(emulator, hdr, [qweight, qzeros, scales], (qweight.shape[0], K)).to(dtype)

    monkeypatch.setattr(cuda_uniform, "_sms", lambda index: 132)
    monkeypatch.setattr(torch.ops.qlinear, "uniform_gemv", gemv)
    monkeypatch.setattr(torch.ops.qlinear, "uniform_gemm", gemm, raising=False)
    monkeypatch.setattr(torch.ops.qlinear, "uniform_dequantize", dequantize)


@pytest.mark.parametrize("opts", [dict(group_size=64, offset=True), dict(group_size=-1, offset=False)])
def test_entry_points_on_the_emulated_ops(emulated_ops, opts):
    """:func:`cuda_uniform.linear_gemv`, :func:`cuda_uniform.linear_gemm` and :func:`cuda_uniform.linear` of a
    round-to-nearest layer: ``[..., N]`` in x's dtype, the bias added, within the GEMV's bound of the float64 product
    (the GEMM's: of the product with ``Ŵ`` in fp16; and fp16 GEMM rounding for the dequantize path); x that is not
    contiguous and codes that are not 16-byte aligned are copied, not refused."""
    N, K = 40, 256
    torch.manual_seed(1)
    cfg = QLinearConfig("bcq", bits=8, init="uniform", iters=0, **opts)
    mod = BCQLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    bufs = mod.canonical()
    w64 = bcq.dequantize(bufs, mod.config, N, K).double()
    misaligned = torch.empty(bufs["qweight"].numel() + 1, dtype=torch.int32)[1:].view_as(bufs["qweight"])
    misaligned.copy_(bufs["qweight"])
    assert misaligned.data_ptr() % 16
    for qweight in (bufs["qweight"], misaligned):
        b = {**bufs, "qweight": qweight}
        for shape in ((1, K), (2, 3, K), (13, K)):
            x = torch.randn(*shape[:-1], 2 * K).half()[..., ::2]  # not contiguous
            y64 = x.double().reshape(-1, K) @ w64.T + mod.bias.double()
            mag = x.double().abs().reshape(-1, K) @ w64.abs().T
            y = cuda_uniform.linear_gemv(x, b, mod.bias, mod.config, N, K)
            assert y.shape == (*shape[:-1], N) and y.dtype == torch.float16
            bound = (K / 16 + 2 * K / 64 + 4) * 2.0 ** -24 * mag + 2.0 ** -11 * y64.abs() + 2.0 ** -25
            assert ((y.reshape(-1, N).double() - y64).abs() <= bound).all()
        wt = w64.float().half().double()
        for shape in ((1, K), (2, 20, K)):
            x = torch.randn(*shape[:-1], 2 * K).half()[..., ::2]
            y64 = x.double().reshape(-1, K) @ wt.T + mod.bias.double()
            y = cuda_uniform.linear_gemm(x, b, mod.bias, mod.config, N, K)
            assert y.shape == (*shape[:-1], N) and y.dtype == torch.float16
            bound = (K / 16 + 4) * 2.0 ** -24 * (x.double().abs().reshape(-1, K) @ wt.abs().T) + 2.0 ** -11 * y64.abs()
            assert ((y.reshape(-1, N).double() - y64).abs() <= bound + 2.0 ** -25).all()
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(cuda_uniform.dequantize(b, mod.config, N, K, dtype), w64.float().to(dtype))


# --- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("K,group_size,zeros", CASES)
def test_ops_and_forward_on_the_gpu(K, group_size, zeros):
    """The ops: ``Ŵ`` exactly as the float64 formula rounds; a layer holding these buffers stays canonical, takes the
    GEMV at M <= 16, the GEMM up to 128 (K a multiple of 64) and dequantize + cuBLAS above, within fp16 GEMM rounding,
    deterministically."""
    assert cuda_uniform.available() is None, cuda_uniform.available()
    N = 1538
    bufs, cfg, w64 = _weights(N, K, group_size, zeros)
    dev = {k: v.cuda() for k, v in bufs.items()}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_cuda_allocator()
        assert torch.equal(cuda_uniform.dequantize(dev, cfg, N, K, dtype).cpu(), w64.float().to(dtype)), dtype
    mod = BCQLinear.from_packed(bufs, K, N, QLinearConfig("bcq", bits=8, group_size=group_size, init="uniform", iters=0,
                                                          offset=zeros), bias=torch.randn(N)).cuda()
    assert mod.layout == ""
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
    for dtype in (torch.float16, torch.bfloat16):
        for M in (1, 5, 8, 9, 16, 17, 40, 100, 128, 129, 300):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            gemm = "cuda_uniform_gemm" if K % 64 == 0 and M <= 128 else "cuda_uniform"
            assert mod.kernel(x).backend == ("cuda_uniform_gemv" if M <= 16 else gemm)
            y64 = x.double().cpu() @ w64.T + mod.bias.detach().double().cpu()
            mag = x.double().abs().cpu() @ w64.abs().T
            y = mod(x)
            err = (y.double().cpu() - y64).abs()
            assert (err <= 3 * eps[dtype] * (mag + y64.abs()) + 1e-3).all(), (dtype, M, err.max().item())
            poison_cuda_allocator()
            assert torch.equal(mod(x), y), (dtype, M)  # deterministic
