// GPU kernels of the uniform BCQ storage read as stored (GPTQ's qweight, scales and qzeros; no kernel layout):
// launchers over raw pointers.  Torch-free so it compiles with nvcc alone; binding.cpp is the only file that includes
// torch.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/canonical.h"

namespace qlinear {

// The canonical uniform buffers of an 8-bit layer (qlinear/formats/bcq.py), G = ceil(K / group_size) (group sizes are
// multiples of 32, or K; the last group may be shorter):
//   codes   int32 [N, K/4]          qweight: the code q of input k in byte k % 4 of word k / 4
//   scales  fp16  [N, G]            s
//   zeros   int32 [G, ceil(N/4)]    qzeros: the zero point z of row n in byte n % 4 of word n / 4; null: the symmetric
//                                   grid, z = 127.5
// Ŵ[n, k] = s·(q − z), as the format computes it in fp32 (one rounding).
struct UniformArgs {
  const unsigned* codes;  // 16-byte aligned
  const void* scales;
  const unsigned* zeros;
  void* w;                // [N, K] of the output dtype
  int N, K, bits, group_size;
  int code_words, zero_words;  // int32 words per row of codes and per group of zeros
};

// Writes Ŵ as `out` (fp32, fp16 or bf16).  cudaErrorInvalidValue for bits != 8, K % 32 != 0, K >= 2^20,
// group_size % 32 != 0, codes not 16-byte aligned, N · K / 32 >= 2^31 (a thread per 32 outputs, 32-bit indices) or a
// dtype it cannot write.
cudaError_t uniform_dequantize(const UniformArgs& args, DType out, cudaStream_t stream);

// The GEMV at decode batches (canonical.h's arguments): y [M, N] = x [M, K] · Ŵᵀ + bias, M = 1..16, on tensor cores.
using UniformGemvArgs = GemvArgs<UniformArgs>;

// cudaErrorInvalidValue for the weights uniform_dequantize refuses, M outside 1..16, x not 16-byte aligned or of
// another dtype than fp16/bf16.
cudaError_t uniform_gemv(const UniformGemvArgs& args, cudaStream_t stream);

// The GEMM: y [M, N] = x [M, K] · Ŵᵀ + bias, M = 1..512, on tensor cores, with blocks of tile_m rows of x (16, 32, 64
// or 128) × 128 rows of Ŵ, each over tiles_per_split consecutive 64-input steps of K (its split-K slice).
struct UniformGemmArgs {
  UniformGemvArgs g;
  float* partial;  // [splits, M, N] fp32 workspace when splits > 1
  int tile_m, tiles_per_split, splits;
};

// cudaErrorInvalidValue for the weights uniform_dequantize refuses, K % 64 != 0, M outside 1..512, x not 16-byte
// aligned or of another dtype than fp16/bf16, a tile_m other than 16/32/64/128, slices that leave one empty or miss a
// step, or no
// workspace for several.
cudaError_t uniform_gemm(const UniformGemmArgs& args, cudaStream_t stream);

}  // namespace qlinear
