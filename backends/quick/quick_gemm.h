// QUICK tensor-core GEMM for BCQ weights (Kim et al., QUICK, section 3): launchers over raw pointers.
// Torch-free so it compiles with nvcc alone; binding.cpp is the only file that includes torch.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/dtype.h"

namespace qlinear {

// y[M, N] = x[M, K] · Ŵᵀ + bias with the code q = Σ_i bit_i·2^i of layout "quick" (backends/quick/__init__.py
// documents it and holds the executable PyTorch spec): Ŵ[n, k] = s·(q − z) (uniform) or Σ_i α_i·(2·bit_i − 1) + c
// (free α):
//   qweight uint32 [N/32, K/64, 64·Q]   per 32×64 tile, each lane's B-fragment codes in mma/converter order
//   scales  fp16   [G, N] (uniform s) or [G, Q, N] (free α: α of plane i at [g, i])   rows permuted within 32-row
//                                       tiles: position (r % 8)·4 + r / 8
//   zeros   uint16 [G, N/4]            uniform: same permutation, 4-bit zero points of positions 4j..4j+3 in word j
//                                       (position 4j+i at bits 4i..4i+3); null: the symmetric z = (2^Q − 1)/2
//   offsets fp16   [G, N]              free α: the offset c, same permutation; null: 0
struct QuickArgs {
  const void* x;              // [M, K], x_dtype (unused by quick_dequantize)
  const unsigned* qweight;
  const void* scales;
  const unsigned short* zeros;
  const void* offsets;        // free α only
  bool free_alpha;
  const int* perm;            // [K] int32: the kernel reads x[:, perm] (act_order layers), or nullptr
  const void* bias;           // [N] bias_dtype (fp32 or x_dtype), or nullptr
  void* y;                    // [M, N] x_dtype; quick_dequantize: Ŵ [N, K] x_dtype
  float* partial;             // [splits, M, N] fp32 workspace when splits > 1
  int M, N, K, Q, group_size;
  int tile_m;                 // rows of x per block: 16, 32, 64 or 128
  int tiles_per_split;        // consecutive 64-input K tiles per block
  int splits;                 // gridDim.z; partials summed in slice order (deterministic)
  DType x_dtype, bias_dtype;
};

// Row stride (inputs) of x as a block of 16-row tiles without perm stages it whole: its K slice plus 8 (ldmatrix
// without bank conflicts).  It stages its tile's rows of x (at most M): always for a rotated layer (R·x rounded to x's
// dtype, after the transform's work area: rotation.cuh), else where they take at most kQuickStagedMax bytes.
__host__ __device__ inline int quick_staged_ld(int K, int tiles_per_split) {
  return (K < 64 * tiles_per_split ? K : 64 * tiles_per_split) + 8;
}
constexpr size_t kQuickStagedMax = 32 * 1024;

// Launches the GEMM (and the split-K reduction when splits > 1) on `stream`; with rot.block
// > 0 each block stages R·x of its rows and K slice itself (a kernel argument of its own, as for lut_gemv; tile_m 16,
// uniform 3/4-bit layers, without perm).  Returns cudaErrorInvalidValue for an unsupported Q (2..4), tile_m, dtype, rotation or a shape that is
// not whole tiles.
cudaError_t quick_gemm(const QuickArgs& args, const Rotation& rot, cudaStream_t stream);

// Writes the dense weight Ŵ [N, K] (x_dtype) from the quick layout, for dequantize + cuBLAS at large M.
cudaError_t quick_dequantize(const QuickArgs& args, cudaStream_t stream);

}  // namespace qlinear
