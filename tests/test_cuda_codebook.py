"""The codebook format's GPU paths (``cuda_codebook_gemv`` at decode batches, ``cuda_codebook``: dequantize kernel +
cuBLAS): their CUDA source under the host emulation against the format's dequantize (bit for bit) and the float64
product; on a GPU the ops and the forward pass."""

from __future__ import annotations

import pytest
import torch
from conftest import poison_cuda_allocator

from qlinear import CodebookLinear, QLinearConfig
from qlinear.backends import cuda_codebook
from qlinear.formats import codebook

# bits, books, group_size; group sizes not a multiple of 16 take the kernel's per-input group path
CASES = [(1, 4, 32), (2, 4, 64), (2, 2, 32), (2, 1, 128), (4, 1, 32), (4, 1, 16), (2, 4, 8), (4, 1, 128),
         (1, 1, 32),  # 2 table bytes: the byte-wise table load
         (4, 1, 8), (1, 2, 8)]

_DRIVER = r'''
// Driver: reads one call from argv[1] (header, codes, book_idx, scales, codebooks; for the GEMV then x and bias), runs
// the source's own codebook_dequantize or codebook_gemv (template dispatch and launch) and writes Ŵ or y (as fp32) to
// argv[2].  Header: N, K, bits, group size, books, code words, book words, output (0/1/2: Ŵ in fp32/fp16/bf16, 3: the
// GEMV), M, x in bf16, bias (0 none, 1 in x's dtype, 2 fp32).
int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 11);
  const int N = h[0], K = h[1], bits = h[2], gs = h[3], books = h[4], code_words = h[5], book_words = h[6];
  auto codes = emu_read<unsigned>(f, (size_t)N * code_words);
  auto book_idx = emu_read<unsigned>(f, (size_t)N * book_words);
  auto scales = emu_read<uint16_t>(f, (size_t)N * (K / gs));
  auto books_i8 = emu_read<signed char>(f, (size_t)books << bits);
  const int M = h[8], bf16 = h[9], bias_kind = h[10];
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  std::vector<char> bias = emu_read<char>(f, (size_t)N * (bias_kind == 2 ? 4 : bias_kind == 1 ? 2 : 0));
  fclose(f);
  CodebookArgs a{codes.data(), book_words ? book_idx.data() : nullptr, scales.data(), books_i8.data(), nullptr,
                 N, K, bits, gs, books, code_words, book_words};
  if (h[7] == 3) {
    std::vector<uint16_t> y((size_t)M * N, 0x7E00);  // NaN-poisoned
    CodebookGemvArgs g{a, x.data(), bias_kind ? bias.data() : nullptr, y.data(), M,
                       bf16 ? DType::kBFloat16 : DType::kHalf,
                       bias_kind == 2 ? DType::kFloat : bf16 ? DType::kBFloat16 : DType::kHalf};
    emu_check(codebook_gemv(g, nullptr));
    emu_write(argv[2], y, bf16);
    return 0;
  }
  if (h[7] == 0) {  // fp32 Ŵ
    std::vector<float> w((size_t)N * K, NAN);
    a.w = w.data();
    emu_check(codebook_dequantize(a, DType::kFloat, nullptr));
    FILE* o = fopen(argv[2], "wb"); fwrite(w.data(), 4, w.size(), o); fclose(o);
    return 0;
  }
  std::vector<uint16_t> w((size_t)N * K, 0x7E00);  // fp16 (h[7] = 1) or bf16 (2) Ŵ, written as fp32
  a.w = w.data();
  emu_check(codebook_dequantize(a, h[7] == 1 ? DType::kHalf : DType::kBFloat16, nullptr));
  emu_write(argv[2], w, h[7] == 2);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(tmp_path_factory.mktemp("codebook_emu"), "cuda_codebook/codebook_dequant.cu",
                                ("extern __shared__ __align__(16) unsigned char smem_raw[];",
                                 "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(::g_smem4);"), "", _DRIVER,
                                launches=True, sanitize=True)


def _layer(N, K, bits, books, group_size, seed=0):
    torch.manual_seed(seed)
    cfg = QLinearConfig("codebook", bits=bits, num_codebooks=books, group_size=group_size)
    return CodebookLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")


# K not a multiple of 32 (a thread's 32 outputs span rows), N·K too where its last run is cut short: bits, books,
# group_size, N, K
RAGGED = [(1, 4, 8, 41, 200), (2, 2, 16, 41, 48), (4, 1, 48, 7, 48), (2, 4, 24, 5, 72), (1, 1, 8, 3, 8),
          (4, 1, 20, 9, 100), (2, 1, 5, 3, 25)]


@pytest.mark.parametrize("bits,books,group_size,N,K", [c + (40, 256) for c in CASES] + RAGGED)
def test_kernel_source_under_host_emulation_is_the_format_bit_for_bit(emulator, bits, books, group_size, N, K):
    """codebook_dequant.cu itself under the host emulation: the format's float32 Ŵ and its one rounding to fp16 and
    bf16, compared as integers.  40x256: 320 chunks of 32 inputs, the second block of 256 cut short."""
    from cuda_emulation import run

    mod = _layer(N, K, bits, books, group_size, seed=bits * 10 + books)
    bufs, cfg = mod.canonical(), mod.config
    assert cfg.books == books and ("book_idx" in bufs) == (books > 1)
    idx = bufs.get("book_idx")
    hdr = [N, K, bits, group_size, books, bufs["codes"].shape[1], 0 if idx is None else idx.shape[1]]
    want = codebook.dequantize(bufs, cfg, N, K)
    for code, dtype, as_int in ((0, torch.float32, torch.int32), (1, torch.float16, torch.int16),
                                (2, torch.bfloat16, torch.int16)):
        w = run(emulator, hdr + [code, 0, 0, 0], [bufs["codes"], idx, bufs["scales"], bufs["codebooks"]], (N, K))
        assert torch.equal(w.to(dtype).view(as_int), want.to(dtype).view(as_int)), dtype


GEMV_CASES = CASES + [(4, 1, 96), (2, 4, 24)]  # a group of 96 (SmolLM2's best 4-bit row) and of 24 (8 divides it)


@pytest.mark.parametrize("bits,books,group_size", GEMV_CASES)
def test_gemv_source_under_host_emulation(emulator, bits, books, group_size):
    """codebook_gemv (the source's launcher and kernel) under the host emulation, at every M in 1..8 (each runs the
    instantiation for 1, 2, 4 or 8 rows of x), fp16 and bf16, with and without a bias, rows not a multiple of the
    block's 16 (N = 40): within ``(K/8 + 2)·u₃₂·Σ|ŵ·x|`` of the float64 product (fp32 sums of exact products, 8 at a
    time, scaled, then accumulated over K/8 such sums and 32 lanes) plus one rounding to x's dtype."""
    from cuda_emulation import dtype_kind, run

    N, K = 40, 1536  # 48 chunks of 32 inputs: lanes 0..15 walk two, the others one
    mod = _layer(N, K, bits, books, group_size, seed=bits * 10 + books + group_size)
    bufs, cfg = mod.canonical(), mod.config
    idx = bufs.get("book_idx")
    w64 = codebook.dequantize(bufs, cfg, N, K).double()
    hdr = [N, K, bits, group_size, books, bufs["codes"].shape[1], 0 if idx is None else idx.shape[1], 3]
    for M in range(1, 9):
        dtype = torch.bfloat16 if M % 2 else torch.float16
        eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        x = torch.randn(M, K).to(dtype)
        bias = None if M % 3 == 0 else mod.bias.detach() if M % 3 == 1 else mod.bias.detach().to(dtype)
        y64 = x.double() @ w64.T + (0 if bias is None else bias.double())
        y = run(emulator, hdr + [M, int(dtype == torch.bfloat16), dtype_kind(bias)],
                [bufs["codes"], idx, bufs["scales"], bufs["codebooks"], x, bias], (M, N))
        bound = (K / 8 + 2 + 32) * 2.0 ** -24 * (x.double().abs() @ w64.abs().T) + eps * y64.abs()
        assert ((y.double() - y64).abs() <= bound).all(), (M, (y.double() - y64).abs().max().item())


def test_supports_and_errors():
    assert cuda_codebook.supports(None, 64, 256) is None
    assert cuda_codebook.supports(None, 64, 48) is None
    assert "multiple of 32" in cuda_codebook.supports_gemv(codebook.Config(bits=2, group_size=16), 64, 48)
    assert cuda_codebook.supports(None, 1 << 18, 1 << 16) is None
    assert "too large" in cuda_codebook.supports(None, 1 << 20, 1 << 16)
    assert "too large" in cuda_codebook.supports_gemv(codebook.Config(bits=2, group_size=64), 1 << 18, 1 << 16)
    cfg = codebook.Config(bits=2, group_size=12)
    assert "multiple of 8" in cuda_codebook.supports_gemv(cfg, 64, 384)
    assert cuda_codebook.supports_gemv(codebook.Config(bits=2, group_size=24), 64, 384) is None


# --- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("bits,books,group_size,N,K", [c + (1536, 640) for c in CASES] +  # 640: every CASES group
                         [(1, 4, 8, 1537, 200), (2, 1, 5, 3, 25)])
def test_dequantize_op_and_forward_on_the_gpu(bits, books, group_size, N, K):
    """The op: the format's float32 Ŵ exactly, and its one rounding to fp16/bf16; the layer is served by it at every
    batch (the GEMV where K is a multiple of 32), within fp16 GEMM rounding of the float64 product."""
    assert cuda_codebook.available() is None, cuda_codebook.available()
    mod = _layer(N, K, bits, books, group_size)
    want = codebook.dequantize(mod.canonical(), mod.config, N, K)
    mod.backend = None
    mod.cuda()
    bufs = {k: v for k, v in mod.named_buffers()}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_cuda_allocator()
        assert torch.equal(cuda_codebook.dequantize(bufs, mod.config, N, K, dtype).cpu(), want.to(dtype)), dtype
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
    for dtype in (torch.float16, torch.bfloat16):
        for M in (1, 5, 8, 9, 300):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            gemv = M <= 8 and K % 32 == 0 and group_size % 8 == 0
            assert mod.kernel(x).backend == ("cuda_codebook_gemv" if gemv else "cuda_codebook")
            y64 = x.double().cpu() @ want.double().T + mod.bias.detach().double().cpu()
            mag = x.double().abs().cpu() @ want.double().abs().T
            y = mod(x)
            err = (y.double().cpu() - y64).abs()
            assert (err <= 3 * eps[dtype] * (mag + y64.abs()) + 1e-3).all(), (dtype, M, err.max().item())
            poison_cuda_allocator()
            assert torch.equal(mod(x), y), (dtype, M)  # deterministic
