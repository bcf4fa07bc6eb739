// The standalone randomized Hadamard transform of a rotated layer's input on a GPU (rotation.cuh's stage_rotated in a
// kernel of its own), for the calls whose kernel does not stage R·x itself (its shared memory would not hold it, an
// act_order gather comes first, or dequantize + cuBLAS): one launch where the PyTorch transform
// (qlinear.formats.rotation.rotate) takes about eight.  Torch-free launcher over raw pointers; only the bindings
// (binding.h, binding.cpp) include torch.
#pragma once
#include <cuda_runtime.h>

#include "dtype.h"

namespace qlinear {

// A launch of rotate_kernel: blocks of `threads` threads, each forming `slice` consecutive outputs of one row (any
// divisor of K: a slice may cut or cross Paley rows and rotation blocks); grid (K / slice, min(M, 65535)), rows beyond
// grid.y taken in turn.
struct RotatePlan {
  int slice, threads;
};

// Each output of a slice sums b / L terms (L ≤ n: its segment of a Paley row, rotation.cuh) before log2 L butterfly
// levels, so small slices re-read x from L2 to make more blocks.  With 256 rotation blocks or more in the call (M = 256
// at SmolLM2's 576-input layers, M = 6 at Llama's 11008 = 43 blocks of 256) there are blocks enough: one CUDA block per
// rotation block.  Below, whole Paley rows of n = block / p inputs, doubled up to 64 inputs where the block allows (at
// least 64 outputs per block), at most 512 (one 512-input piece of a longer row): SmolLM2's 576 = 36·16 at M = 1
// takes 9 blocks of 4 rows.  (Not tuned on a GPU yet: benchmarks/bench_rotation.py --slice-sweep.)
inline RotatePlan rotate_plan(const Rotation& r, int M, int K) {
  if ((long long)M * (K / r.block) >= 256) return RotatePlan{r.block, 128};
  int slice = r.block / r.paley;
  while (slice < 64 && r.block % (2 * slice) == 0) slice *= 2;
  return RotatePlan{slice < 512 ? slice : 512, 128};
}

// Shared memory of rotate_kernel: the transform's fp32 work area, max(block, 256) floats (as the fused kernels give it).
inline size_t rotate_smem_bytes(const Rotation& r) { return 4 * (size_t)(r.block > 256 ? r.block : 256); }

// y[m, :] = R·x[m, :] for the M rows of x [M, K] (fp16 or bf16, row-major, contiguous; y apart from x, the same dtype),
// R the rotation r (r.block > 0 dividing K): the float32 transform of rotation.cuh, rounded once to the dtype.  slice:
// outputs per CUDA block, 0 for rotate_plan's (any divisor of K: the same transform up to float32 summation order;
// benchmarks/bench_rotation.py sweeps them).
// cudaErrorInvalidValue for an invalid rotation (rotation_invalid), a block or slice not dividing K, M or K not
// positive, or a dtype other than fp16/bf16.
cudaError_t rotate(const void* x, void* y, int M, int K, const Rotation& r, DType dtype, cudaStream_t stream,
                   int slice = 0);

}  // namespace qlinear
