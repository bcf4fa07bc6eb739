// Torch binding of the codebook kernels: CUDA implementations of qlinear::codebook_dequantize and codebook_gemv, whose
// schemas and fake implementations are declared in qlinear/ops.py (one file holds the whole op surface).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../_cuda/binding.h"
#include "codebook_dequant.h"

namespace {

// Checks the canonical buffers (op: the name in the errors) and fills `a` but its output.
qlinear::CodebookArgs weights_of(const at::Tensor& codes, const std::optional<at::Tensor>& book_idx,
                                 const at::Tensor& scales, const at::Tensor& codebooks, int64_t K, int64_t group_size,
                                 int64_t bits, const char* op) {
  TORCH_CHECK(codes.is_cuda() && codes.scalar_type() == at::kInt && codes.dim() == 2 && codes.is_contiguous(), op,
              ": codes must be contiguous int32 CUDA [N, K·bits/32]");
  TORCH_CHECK((bits == 1 || bits == 2 || bits == 4) && K > 0 && group_size > 0 && K % group_size == 0 &&
                  codes.size(1) == (K * bits + 31) / 32, op, ": codes ", codes.sizes(), " do not fit K=", K, " bits=",
              bits, " group_size=", group_size, " (K must be a multiple of group_size)");
  const int64_t N = codes.size(0), G = K / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == G, op, ": scales must be contiguous fp16 [N, G]");
  TORCH_CHECK(codebooks.scalar_type() == at::kChar && codebooks.is_contiguous() && codebooks.dim() == 2 &&
                  codebooks.size(1) == (1 << bits), op, ": codebooks must be contiguous int8 [C, 2^bits]");
  const int64_t C = codebooks.size(0);
  TORCH_CHECK(C == 1 || C == 2 || C == 4, op, ": 1, 2 or 4 codebooks, got ", C);
  TORCH_CHECK((C << bits) <= 16, op, ": ", C, " codebooks of 2^", bits, " int8 centroids exceed the format's 16 bytes");
  TORCH_CHECK(C == 1 || book_idx.has_value(), op, ": book_idx is needed with ", C, " codebooks");
  TORCH_CHECK(scales.device() == codes.device() && codebooks.device() == codes.device() &&
                  (!book_idx.has_value() || book_idx->device() == codes.device()), op,
              ": all buffers must be on one device");
  qlinear::CodebookArgs a{};
  a.codes = reinterpret_cast<const unsigned*>(codes.data_ptr<int>());
  if (C > 1) {
    const int64_t lb = C == 4 ? 2 : 1;
    TORCH_CHECK(book_idx->scalar_type() == at::kInt && book_idx->is_contiguous() && book_idx->dim() == 2 &&
                    book_idx->size(0) == N && book_idx->size(1) == (G * lb + 31) / 32, op,
                ": book_idx must be contiguous int32 [N, ceil(G·log2 C / 32)]");
    a.book_idx = reinterpret_cast<const unsigned*>(book_idx->data_ptr<int>());
    a.book_words = (int)book_idx->size(1);
  }
  a.scales = scales.data_ptr();
  a.codebooks = codebooks.data_ptr<int8_t>();
  a.N = (int)N; a.K = (int)K; a.bits = (int)bits; a.group_size = (int)group_size; a.books = (int)C;
  a.code_words = (int)codes.size(1);
  return a;
}

at::Tensor codebook_dequantize(const at::Tensor& codes, const std::optional<at::Tensor>& book_idx,
                               const at::Tensor& scales, const at::Tensor& codebooks, int64_t K, int64_t group_size,
                               int64_t bits, at::ScalarType dtype) {
  const char* op = "codebook_dequantize";
  qlinear::CodebookArgs a = weights_of(codes, book_idx, scales, codebooks, K, group_size, bits, op);
  TORCH_CHECK((codes.size(0) * K + 31) / 32 < (int64_t(1) << 31), op,
              ": N·K/32 must be below 2^31 (a thread per 32 outputs), got N = ", codes.size(0), ", K = ", K);
  c10::cuda::CUDAGuard guard(codes.device());
  at::Tensor w = at::empty({codes.size(0), K}, codes.options().dtype(dtype));
  a.w = w.data_ptr();
  const cudaError_t err = qlinear::codebook_dequantize(a, qlinear::dtype_of(dtype, op), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
  return w;
}

at::Tensor codebook_gemv(const at::Tensor& x, const at::Tensor& codes, const std::optional<at::Tensor>& book_idx,
                         const at::Tensor& scales, const at::Tensor& codebooks, const std::optional<at::Tensor>& bias,
                         int64_t group_size, int64_t bits) {
  const char* op = "codebook_gemv";
  qlinear::check_gemv_x(x, 8, op);
  TORCH_CHECK(group_size % 8 == 0 && x.size(1) % 32 == 0, op, ": group_size must be a multiple of 8 and K of 32, got ",
              group_size, " and ", x.size(1));
  qlinear::CodebookGemvArgs g{};
  g.w = weights_of(codes, book_idx, scales, codebooks, x.size(1), group_size, bits, op);
  TORCH_CHECK(codes.size(0) * x.size(1) < (int64_t(1) << 34), op, ": N·K must be below 2^34 (32-bit offsets), got N = ",
              codes.size(0), ", K = ", x.size(1));
  TORCH_CHECK(bits != 4 || reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0, op,
              ": 4-bit codes must be 16-byte aligned (read 16 bytes at a time)");
  return qlinear::gemv_op(g, x, bias, codes, qlinear::codebook_gemv, op);
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) {
  m.impl("codebook_dequantize", &codebook_dequantize);
  m.impl("codebook_gemv", &codebook_gemv);
}
