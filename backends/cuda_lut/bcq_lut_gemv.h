// LUT GEMV for BCQ weights (LUT-GEMM / nuQmm, Park et al., section 3): launcher over raw pointers.
// Torch-free so it compiles with nvcc alone; binding.cpp is the only file that includes torch.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/dtype.h"

namespace qlinear {

// y[M, N] = x[M, K] · Ŵᵀ + bias with Ŵ[n, k] = Σ_q α_q[g, n]·(±1) + offset[g, n], g = k / group_size.
// Layout "cuda_lut" (see backends/cuda_lut/__init__.py, which also holds the executable PyTorch spec):
//   planes  uint32 [K/32, Q, N]: bit j of word (w, q, n) is the sign of input 32w + j in plane q (1 = +1), Q = 1..8
//   alpha   fp16   [G, Q, N] (α_q = alpha[g, q, n]), or for a uniform layer of 5..8 planes its scales [G, N]
//           (α_q = s·2^(q−1), exact in fp32 for every fp16 s, where fp16 α would lose 8-bit scales below 2^-13)
//   offset  fp16 or fp32 [G, N], or null
struct LutGemvArgs {
  const void* x;            // [M, K], x_dtype
  const unsigned* planes;   // [K/32, Q, N]
  const void* alpha;        // [G, Q, N] fp16
  const void* offset;       // [G, N] offset_dtype, or nullptr
  const int* perm;          // [K]: the kernel reads x[:, perm] (act_order layers), or nullptr
  const void* bias;         // [N] bias_dtype (fp32 or x_dtype), or nullptr
  void* y;                  // [M, N], x_dtype
  float* partial;           // [splits, M, N] fp32 workspace when splits > 1
  int M, N, K, Q, group_size;
  bool uniform;             // alpha holds the scales [G, N] of a uniform layer (Q = 5..8 only)
  int kt;                   // inputs per K tile: must be 32 * lut_gemv_words(M, Q)
  int tiles_per_split;      // consecutive K tiles summed by one block
  int splits;               // gridDim.y; partial sums reduced in a fixed order (deterministic)
  int threads;              // threads per block; each thread owns 4 consecutive output rows
  DType x_dtype, offset_dtype, bias_dtype;
};

// Blocks along N (gridDim.x): a block owns 4·threads rows.
inline int lut_gemv_tiles(int N, int threads) { return (N + 4 * threads - 1) / (4 * threads); }

// K words (32 inputs) per tile for batch M and Q planes: the largest power of two up to 4 with W·Q <= 8 (16-byte
// plane loads held in registers per thread) and W·M <= 8 (M·W·4 KiB of tables per buffer).
constexpr int lut_gemv_words(int M, int Q) {
  int w = 4;
  while (w > 1 && (w * Q > 8 || w * M > 8)) w /= 2;
  return w;
}

// Blocks of up to 256 threads an SM holds (the kernels' register budget): two, or one past 4 planes.
constexpr int lut_gemv_blocks_per_sm(int Q) { return Q > 4 ? 1 : 2; }

// Shared memory (bytes) one block needs for (M, kt): two buffers of M·kt/8 tables of 256 floats.
__host__ __device__ inline size_t lut_gemv_smem_bytes(int M, int kt) { return 2 * sizeof(float) * (size_t)M * (kt / 8) * 256; }

// Inputs per row of x a block stages when the layer is rotated: its K slice (the whole K for act_order layers, whose
// perm reads anywhere), R·x rounded to x's dtype, after the tables (rotation.cuh).
__host__ __device__ inline int lut_gemv_rotated_span(int K, int kt, int tiles_per_split, bool perm) {
  return perm || K < kt * tiles_per_split ? K : kt * tiles_per_split;
}

// Launches the GEMV (and the split-K reduction when splits > 1) on `stream`; with rot.block
// > 0 each block stages R·x of its K slice itself.  Returns cudaErrorInvalidValue for an unsupported M (1..8), Q (1..8),
// dtype or rotation.  (The rotation is a kernel argument of its own: in LutGemvArgs, whose size then passes 128 bytes,
// nvcc 13 spills registers in the main loop of the Q >= 3 kernels.)
cudaError_t lut_gemv(const LutGemvArgs& args, const Rotation& rot, cudaStream_t stream);

// The dequantize kernel's tile (rows × inputs per block of 256 threads), grid and shared memory: per warp a table of
// 2^min(Q, 4) 32-bit slots per lane, and the staged outputs of 32 rows × tile_k, each row padded by 16 bytes.
constexpr int lut_dequantize_tile_n = 128, lut_dequantize_tile_k = 256;
inline dim3 lut_dequantize_grid(int N, int K) {
  return dim3((N + lut_dequantize_tile_n - 1) / lut_dequantize_tile_n, (K + lut_dequantize_tile_k - 1) / lut_dequantize_tile_k);
}
inline size_t lut_dequantize_smem_bytes(int Q, size_t out_bytes) {
  return (size_t)(lut_dequantize_tile_k / 32) * (128u << (Q < 4 ? Q : 4)) + 32 * (lut_dequantize_tile_k * out_bytes + 16);
}

// Writes Ŵ [N, K] of dtype `out` (fp32, fp16 or bf16) to args.y from planes, alpha and offset (the other fields
// unused): bcq.dequantize's float32 values, rounded once.  cudaErrorInvalidValue for a shape or dtype it cannot take.
cudaError_t lut_dequantize(const LutGemvArgs& args, DType out, cudaStream_t stream);

}  // namespace qlinear
