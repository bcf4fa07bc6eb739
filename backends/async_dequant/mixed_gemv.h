// GEMV for the mixed 2/4/16 format with asynchronous dequantization (2/4/16-bit paper, section 5, Alg. 1):
// launcher over raw pointers.  Torch-free so it compiles with nvcc alone; binding.cpp is the only file
// that includes torch.  The layout is documented (and specified executably) in
// backends/async_dequant/__init__.py.
#pragma once
#include <cuda_runtime.h>

#include "../_cuda/dtype.h"

namespace qlinear {
namespace mixed {

// y[M, N] = x[M, K] · Ŵᵀ + bias, M = 1..8 per launch (the binding loops over chunks of 8 rows).
// Layout "async_dequant" (W = code words per row, T = ceil(W / 4) tiles of 4 words, Tf = W / 4 full tiles, S2 row chunks):
//   codes  uint32 [N·W]: full tiles [Tf][N][4] (one 16-byte load per row and tile), then the tail [N][W − 4·Tf]
//   meta   uint32 [MW][N]: per row, bit stream of (zero | scale_code << zero_bits) records in group order; a tile's
//          records lie in the meta words ttab[t] .. ttab[t] + 1 (+ 2 with scale_bits = 8)
//   sq     uint32 [T][S2][P]: second-order pairs per (tile, row chunk) of the P = 1, 2 or 4 groups a tile may touch, as
//          half2 bits, low = scale, high = zero
//   tab    int32  [G + W + T]: gtab [G] = bit offset of each group's record in a row's meta stream | is_4bit << 31 (the
//          offset also locates the group's first word: (g + n4) · group_size / 16 with n4 = (offset − g·(2 + scale_bits)) / 2
//          4-bit groups before g); wtab [W] = first input | record bit in the tile's meta window << 20 | pair slot << 27
//          | is_4bit << 31;
//          ttab [T] = the tile's first meta word
//   outliers: CSR (fp16 values, int16/int32 columns, int32 row pointers), or null
struct MixedGemvArgs {
  const void* x;               // [M, K], x_dtype
  const unsigned* codes;
  const unsigned* meta;
  const unsigned* sq;
  const int* tab;
  const void* outlier_values;  // [nnz] fp16, or nullptr (no fused outliers)
  const void* outlier_cols;    // [nnz] int16 (cols_int32 = 0) or int32
  const int* outlier_row_ptr;  // [N + 1]
  const void* bias;            // [N] fp32 or x_dtype (bias_dtype), or nullptr
  void* y;                     // [M, N], x_dtype
  float* partial;              // [splits, M, N] fp32 workspace when splits > 1
  int M, N, K, W, G, MW, S2, P;  // W = code words per row, P = pairs per tile and row chunk
  int group_size, scale_bits, scale_group_size;
  int threads;                 // threads per block (multiple of 32, <= 256); a thread owns 2 rows
  int tiles_per_split;         // consecutive tiles per block along K (x of their K span sits in shared memory)
  int splits;                  // gridDim.y; partial sums reduced in a fixed order (deterministic)
  int cols_int32;
  int async_dequant;           // 1: tile t+1 loaded while tile t is computed, its scales after; 0: synchronous
  DType x_dtype;               // kHalf or kBFloat16
  DType bias_dtype;            // kFloat or x_dtype
};

// Blocks along N (gridDim.x): a block owns 2·threads rows.  At M = 8 a block has at most kMaxThreadsM8 threads (its
// launch bounds; backends/async_dequant/__init__.py's plan keeps to it).
constexpr int kMaxThreadsM8 = 128;
inline int mixed_gemv_tiles(int N, int threads) { return (N + 2 * threads - 1) / (2 * threads); }

// Shared memory (bytes) one block needs: x of its K span in fp32 [M][span] and as scaled fp16 [M][span], its word and tile
// tables [5·tiles_per_split], the rows' |x| maxima [8], and for a rotated layer (rotation_block > 0) the transform's fp32
// work area of max(block, 256) floats, from the next 16-byte boundary (without a rotation: where that area starts).
__host__ __device__ inline size_t mixed_gemv_smem_bytes(int M, int K, int tiles_per_split, int rotation_block) {
  const int span = K < 64 * tiles_per_split ? K : 64 * tiles_per_split;
  const size_t own = 6 * (size_t)M * span + sizeof(int) * 5 * (size_t)tiles_per_split + 32;
  return (own + 15) / 16 * 16 + sizeof(float) * (size_t)(rotation_block > 256 ? rotation_block : rotation_block ? 256 : 0);
}

// Launches the GEMV on `stream` (with splits > 1, then reduce_splits over its partials); with rot.block > 0
// each block stages R·x of its K span itself (a kernel argument of its own, as for lut_gemv).
// Returns cudaErrorInvalidValue for an unsupported M (1..8), dtype, rotation or launch shape.
cudaError_t mixed_gemv(const MixedGemvArgs& args, const Rotation& rot, cudaStream_t stream);

// The dequantize kernel's threads per block (one (group, row) each) and shared memory: each thread's staged run of C
// outputs (C = 64 where 64 divides the group size, else 16), padded by 16 bytes.
constexpr int kDequantThreads = 128;
inline dim3 mixed_dequantize_grid(int N, int K, int group_size) {
  return dim3((N + kDequantThreads - 1) / kDequantThreads, K / group_size);
}
inline size_t mixed_dequantize_smem_bytes(int group_size, size_t out_bytes) {
  return kDequantThreads * ((group_size % 64 ? 16 : 64) * out_bytes + 16);
}

// Writes Ŵ [N, K] of dtype `out` (fp32, fp16 or bf16) to args.y from the layout and the outliers (x, bias, the launch
// fields unused): qlinear.formats.mixed.dequantize's float32 values (ŝ = zero + scale·code, ŝ·(q − z), + the outlier,
// each rounded in fp32), rounded once.  Outlier columns must ascend within a row, as the format stores them.
// Returns cudaErrorInvalidValue for a group size that is not a multiple of 16, more than 65535 groups per row or an
// unsupported dtype.
cudaError_t mixed_dequantize(const MixedGemvArgs& args, DType out, cudaStream_t stream);

// The canonical buffers (qlinear/formats/mixed.py) as a checkpoint holds them, any group size g, G = K / g groups of
// which G4 are 4-bit: what mixed_dequantize_canonical reads where the "async_dequant" layout cannot hold a layer (g not
// a multiple of 16).
struct MixedCanonicalArgs {
  const int* idx4;                    // [G4] the 4-bit groups, ascending
  const unsigned *q2, *q4;            // [N, w2], [N, w4]: codes of the 2-bit / 4-bit groups' columns, ascending
  const unsigned *z2, *z4;            // [N, zw2], [N, zw4]: their zero points, a group's at its rank among its kind
  const unsigned* scale_codes;        // [G, sw]: row n's first-order scale code at bits n·scale_bits .. of group's row
  const void *scale_scale, *scale_zero;  // fp16 [G, S2]: the second-order pair of rows n / scale_group_size
  const void* outlier_values;         // [nnz] fp16, or nullptr (no outliers)
  const void* outlier_cols;           // [nnz] int16 (cols_int32 = 0) or int32, ascending within a row
  const int* outlier_row_ptr;         // [N + 1]
  void* w;                            // [N, K] of the output dtype
  int N, K, group_size, G4, scale_bits, scale_group_size, S2;
  int w2, w4, zw2, zw4, sw;           // int32 words per row of q2, q4, z2, z4 and scale_codes
  int cols_int32;
};

// Writes Ŵ [N, K] of dtype `out` (fp32, fp16 or bf16) from the canonical buffers, the same values as mixed_dequantize
// (and qlinear.formats.mixed.dequantize: ŝ = zero + scale·code, ŝ·(q − z), + each outlier of the (row, column), each
// in fp32), rounded once.  A thread takes 32 consecutive elements of the flattened Ŵ.  Returns cudaErrorInvalidValue
// for K not a positive multiple of group_size, N < 1, scale_bits outside 1..16, ceil(N·K / 32) >= 2^31 or an
// unsupported dtype.
cudaError_t mixed_dequantize_canonical(const MixedCanonicalArgs& args, DType out, cudaStream_t stream);

}  // namespace mixed
}  // namespace qlinear
