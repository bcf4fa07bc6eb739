// The standalone randomized Hadamard transform of a rotated layer's input on a GPU (rotation.cuh's stage_rotated in a
// kernel of its own), for the calls whose kernel does not stage R·x itself (its shared memory would not hold it, an
// act_order gather comes first, or dequantize + cuBLAS): one launch where the PyTorch transform
// (qlinear.formats.rotation.rotate) takes about eight.  Torch-free launcher over raw pointers; binding.cpp is the only
// file here that includes torch.
#pragma once
#include <cuda_runtime.h>

#include "dtype.h"

namespace qlinear {

// A launch of rotate_kernel: blocks of `threads` threads, each forming `slice` consecutive outputs of one row (slice
// divides the rotation block, or is a multiple of it dividing K); grid (K / slice, min(M, 65535)), rows beyond grid.y
// taken in turn.
struct RotatePlan {
  int slice, threads;
};

// Each output of a slice sums b / slice terms (p·n/L in rotation.cuh's terms) before log2 of its segment's butterfly
// levels, so small slices re-read x from L2 to make more blocks.  With 256 rotation blocks or more in the call (M = 16
// at SmolLM2's 576-input layers) there are blocks enough: one CUDA block per rotation block.  Below, one Paley row of
// n = block / p inputs (at most 512) per CUDA block: a Paley row of SmolLM2's 576 = 36·16 block is 16 outputs, so
// M = 1 takes 36 blocks.  (Not tuned on a GPU yet.)
inline RotatePlan rotate_plan(const Rotation& r, int M, int K) {
  const int n = r.block / r.paley;
  if ((long long)M * (K / r.block) >= 256) return RotatePlan{r.block, 128};
  return RotatePlan{n < 512 ? n : 512, 128};
}

// Shared memory of rotate_kernel: the transform's fp32 work area, max(n, 256) floats.
inline size_t rotate_smem_bytes(const Rotation& r) {
  const int n = r.block / r.paley;
  return 4 * (size_t)(n > 256 ? n : 256);
}

// y[m, :] = R·x[m, :] for the M rows of x [M, K] (fp16 or bf16, row-major, contiguous; y apart from x, the same dtype),
// R the rotation r (r.block > 0 dividing K): the float32 transform of rotation.cuh, rounded once to the dtype.  slice:
// outputs per CUDA block, 0 for rotate_plan's (any divisor of K is exact: benchmarks/bench_rotation.py sweeps them).
// cudaErrorInvalidValue for an invalid rotation (rotation_invalid), a block or slice not dividing K, M or K not
// positive, or a dtype other than fp16/bf16.
cudaError_t rotate(const void* x, void* y, int M, int K, const Rotation& r, DType dtype, cudaStream_t stream,
                   int slice = 0);

}  // namespace qlinear
