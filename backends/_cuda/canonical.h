// Launch arguments and shared-memory sizes of the kernels that read a format's canonical code words (canonical.cuh):
// torch-free, for their launchers and bindings alike.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "dtype.h"

namespace qlinear {

// A GEMV at decode batches: y [M, N] = x [M, K] · Ŵᵀ + bias in x's dtype (fp16/bf16), fp32 accumulation, M up to the
// kernel's limit.  W: the format's weight arguments (CodebookArgs, UniformArgs).
template <typename W>
struct GemvArgs {
  W w;
  const void* x;     // [M, K], 16-byte aligned
  const void* bias;  // [N] of bias_dtype (fp32, or x's dtype), or null
  void* y;           // [M, N]
  int M;
  DType x_dtype, bias_dtype;
};

// Shared memory of a dequantize block of 256 threads: each thread's 32 outputs of `out_bytes`, padded by 16 bytes.
inline size_t canonical_dequantize_smem_bytes(size_t out_bytes) { return 256 * (32 * out_bytes + 16); }

}  // namespace qlinear
