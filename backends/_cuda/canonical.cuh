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
// (of `count`, Ŵ flattened) in `run` when 32t < count: a block's outputs are one contiguous run, so the block stages
// them in shared memory (canonical_dequantize_smem_bytes) and writes the run with consecutive threads (each warp store
// 512 contiguous bytes at fp16), where each thread storing its own 64 bytes put 16-byte pieces 64 bytes apart in one
// store.  CUT: `count` may not be a multiple of 32 (the last run cut short), and a piece past it is written element by
// element up to it (code the kernels with whole runs leave out: it costs them registers).  Every thread of the block
// calls it (a barrier).
template <typename OutT, bool CUT = false>
__device__ __forceinline__ void store_runs(const Run32<OutT>& run, unsigned t0, size_t count, OutT* w) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRun = 32 * sizeof(OutT), kStride = kRun + 16, kPieces = kRun / 16;  // staged runs padded by 16 bytes
  constexpr int kPer = 16 / sizeof(OutT);                                              // elements per piece
  const unsigned runs = (unsigned)((count + 31) / 32);
  if (t0 + threadIdx.x < runs) {
    uint4* staged = reinterpret_cast<uint4*>(smem_raw + threadIdx.x * kStride);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) staged[i] = run.u[i];
  }
  __syncthreads();
  OutT* const out = w + 32 * (size_t)t0;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {  // piece p = i·threads + thread: 16 bytes number p % kPieces of chunk p / kPieces
    const int p = i * blockDim.x + threadIdx.x, chunk = p / kPieces, piece = p % kPieces;
    const unsigned char* src = smem_raw + chunk * kStride + piece * 16;
    OutT* const dst = out + 32 * chunk + piece * kPer;
    if (!CUT) {
      if (t0 + chunk < runs) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      const size_t at = 32 * ((size_t)t0 + chunk) + piece * kPer;
      if (at + kPer <= count) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      else
        for (int e = 0; at + e < count; ++e) dst[e] = reinterpret_cast<const OutT*>(src)[e];
    }
  }
}

}  // namespace qlinear
