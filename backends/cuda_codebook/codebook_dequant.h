// Dequantize kernel and GEMV of the codebook format on a GPU (Arm paper §5.2's format): launchers over raw pointers.
// Torch-free so it compiles with nvcc alone; binding.cpp is the only file that includes torch.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/dtype.h"

namespace qlinear {

// The canonical codebook buffers (qlinear/formats/codebook.py), G = K / group_size, C = books:
//   codes      int32 [N, K·bits/32]      centroid index of input k at bits (k % (32/bits))·bits of word k / (32/bits)
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

// Shared memory of the kernel's blocks of 256 threads: each thread's 32 outputs of `out_bytes`, padded by 16 bytes.
inline size_t codebook_dequantize_smem_bytes(size_t out_bytes) { return 256 * (32 * out_bytes + 16); }

// Writes Ŵ[n, k] = scale[n, g] · codebooks[book(n, g)][code(n, k)] (fp32, exact, then one rounding) as `out` (fp32,
// fp16 or bf16).  cudaErrorInvalidValue for K % 32 != 0, bits not in {1, 2, 4}, books not in {1, 2, 4}, books · 2^bits
// > 16 (the format's limit), N · K / 32 >= 2^31 or a dtype it cannot write.
cudaError_t codebook_dequantize(const CodebookArgs& args, DType out, cudaStream_t stream);

// The GEMV at decode batches: y [M, N] = x [M, K] · Ŵᵀ + bias in x's dtype (fp16/bf16), fp32 accumulation, M = 1..8.
struct CodebookGemvArgs {
  CodebookArgs w;      // the weights (w.w unused)
  const void* x;       // [M, K], 16-byte aligned
  const void* bias;    // [N] of bias_dtype (fp32, or x's dtype), or null
  void* y;             // [M, N]
  int M;
  DType x_dtype, bias_dtype;
};

constexpr int kGemvWarps = 4, kGemvRows = 4;  // a block's warps, each owning kGemvRows rows

// Shared memory of a GEMV block for `mt` rows of x (its instantiation's): the 16-float centroid table, then every
// lane's partial sums of its warp's rows.
inline size_t codebook_gemv_smem_bytes(int mt) { return 4 * (16 + (size_t)32 * kGemvWarps * kGemvRows * mt); }

// cudaErrorInvalidValue for the weights codebook_dequantize refuses, group_size % 8 != 0, M outside 1..8, x not
// 16-byte aligned or of another dtype than fp16/bf16.
cudaError_t codebook_gemv(const CodebookGemvArgs& args, cudaStream_t stream);

}  // namespace qlinear
