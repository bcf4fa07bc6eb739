// Dequantize kernel and GEMV of the codebook format on a GPU (Arm paper §5.2's format): launchers over raw pointers.
// Torch-free so it compiles with nvcc alone; binding.cpp is the only file that includes torch.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/canonical.h"

namespace qlinear {

// The canonical codebook buffers (qlinear/formats/codebook.py), G = K / group_size, C = books:
//   codes      int32 [N, ceil(K·bits/32)]  centroid index of input k at bits (k % (32/bits))·bits of word k / (32/bits)
//   book_idx   int32 [N, ceil(G·log2 C / 32)], or null when C = 1: codebook of each group, packed the same way
//   scales     fp16  [N, G]
//   codebooks  int8  [C, 2^bits]
struct CodebookArgs {
  const unsigned* codes;
  const unsigned* book_idx;
  const void* scales;
  const signed char* codebooks;
  void* w;                  // [N, K] of the output dtype
  int N, K, bits, group_size, books;
  int code_words, book_words;  // int32 words per row of codes and of book_idx
};

// Writes Ŵ[n, k] = scale[n, g] · codebooks[book(n, g)][code(n, k)] (fp32, exact, then one rounding) as `out` (fp32,
// fp16 or bf16).  cudaErrorInvalidValue for K not a positive multiple of group_size, bits not in {1, 2, 4}, books not
// in {1, 2, 4}, books · 2^bits > 16 (the format's limit), ceil(N · K / 32) >= 2^31 or a dtype it cannot write.
cudaError_t codebook_dequantize(const CodebookArgs& args, DType out, cudaStream_t stream);

// The GEMV at decode batches (canonical.h): y [M, N] = x [M, K] · Ŵᵀ + bias, M = 1..8.
using CodebookGemvArgs = GemvArgs<CodebookArgs>;

// cudaErrorInvalidValue for the weights codebook_dequantize refuses, K % 32 != 0, N · K >= 2^34, group_size % 8 != 0, M outside
// 1..8, x not 16-byte aligned or of another dtype than fp16/bf16, 4-bit codes not 16-byte aligned.
cudaError_t codebook_gemv(const CodebookGemvArgs& args, cudaStream_t stream);

}  // namespace qlinear
