// What the kernels over a format's canonical code words share (codes packed little-endian along K, so that a row's 32
// inputs c·32 .. c·32 + 31 are its `bits` int32 words c·bits .. c·bits + bits − 1: the codebook format's codes, the
// uniform format's GPTQ qweight): the staged write of a dequantized Ŵ, one thread per 32 outputs.
#pragma once
#include <cuda_runtime.h>

#include "canonical.h"
#include "common.cuh"

namespace qlinear {

// One thread's 32 consecutive outputs of a dequantize kernel, as values and as 16-byte pieces.
template <typename OutT>
union Run32 {
  OutT v[32];
  uint4 u[2 * sizeof(OutT)];
};

// The write of a dequantize kernel whose thread t = t0 + threadIdx.x of a block of 256 holds Ŵ's elements 32t .. 32t + 31
// in `run` when t < total: a block's outputs are one contiguous run, so the block stages them in shared memory
// (canonical_dequantize_smem_bytes) and writes the run with consecutive threads (each warp store 512 contiguous bytes at
// fp16), where each thread storing its own 64 bytes put 16-byte pieces 64 bytes apart in one store.  Every thread of
// the block calls it (a barrier).
template <typename OutT>
__device__ __forceinline__ void store_runs(const Run32<OutT>& run, unsigned t0, unsigned total, OutT* w) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRun = 32 * sizeof(OutT), kStride = kRun + 16, kPieces = kRun / 16;  // staged runs padded by 16 bytes
  if (t0 + threadIdx.x < total) {
    uint4* staged = reinterpret_cast<uint4*>(smem_raw + threadIdx.x * kStride);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) staged[i] = run.u[i];
  }
  __syncthreads();
  OutT* const out = w + 32 * (size_t)t0;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {  // piece p = i·threads + thread: 16 bytes number p % kPieces of chunk p / kPieces
    const int p = i * blockDim.x + threadIdx.x, chunk = p / kPieces, piece = p % kPieces;
    if (t0 + chunk < total)
      *reinterpret_cast<uint4*>(out + 32 * chunk + piece * (16 / sizeof(OutT))) =
          *reinterpret_cast<const uint4*>(smem_raw + chunk * kStride + piece * 16);
  }
}

}  // namespace qlinear
