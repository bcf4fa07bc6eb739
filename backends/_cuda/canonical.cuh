// Kernels over a format's canonical code words: codes packed little-endian along K, so that a row's 32 inputs c·32 ..
// c·32 + 31 are its `bits` int32 words c·bits .. c·bits + bits − 1 (the codebook format's codes, the uniform format's
// GPTQ qweight).  The decode-batch GEMV on CUDA cores, given a format's decoder (the codebook format's table lookup
// times a scale), and the staged write of a dequantized Ŵ (the codebook and uniform dequantize kernels).
#pragma once
#include <cuda_runtime.h>

#include "canonical.h"
#include "common.cuh"

namespace qlinear {

// GEMV at decode batches (x [M, K], M <= 8): y = x·Ŵᵀ + b without writing Ŵ.  A warp owns kGemvRows rows; lane l walks
// the 32-input chunks l, l + 32, ... of K (the warp's loads of a row are consecutive words: coalesced), holding its
// rows' code words of a chunk, then 8 inputs at a time takes x from global memory (the block's warps read the same x:
// L1) and hands each row's words to the decoder, which adds Σ_j ŵ_j·x_j over the 8 inputs (one group: group sizes are
// multiples of 8) in fp32.  The lanes' sums are then added in lane order through shared memory (deterministic).  MT:
// the instantiation's rows of x (1, 2, 4 or 8; g.M of them are read).
//
// Decoder: `Args` (the weights: codes, code_words, N, K, group_size), `kWords` (code words per 32 inputs of a row),
// `kTableFloats` (floats of shared memory its constructor fills for the block, before the barrier), `Row` and
// `row(n)` (what it needs of row n, made once per kernel) and
// `dot8<MT>(row, words, s, g, xv, acc)`: acc[m] += Σ_{j<8} Ŵ[n, k0 + j]·xv[m][j] for the inputs k0 = 32c + 8s .. k0 + 7
// of the chunk's words, in group g (s = 0 .. 3 in turn for each chunk).
template <typename T, int MT, typename Decoder>
__global__ void __launch_bounds__(32 * kGemvWarps) canonical_gemv_kernel(const GemvArgs<typename Decoder::Args> g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* const sums = reinterpret_cast<float*>(smem_raw) + Decoder::kTableFloats;  // [warps][32 lanes][kGemvRows][MT]
  const auto& a = g.w;
  const Decoder dec(a, reinterpret_cast<float*>(smem_raw));
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kGemvWarps + warp) * kGemvRows;
  const T* const x = static_cast<const T*>(g.x);
  typename Decoder::Row rows[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) rows[r] = dec.row(min(n0 + r, a.N - 1));  // rows past N: row N - 1's, not written
  float acc[kGemvRows][MT];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  for (int c = lane; c < a.K / 32; c += 32) {
    unsigned words[kGemvRows][Decoder::kWords];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      const int n = min(n0 + r, a.N - 1);
      const unsigned* const p = a.codes + (size_t)n * a.code_words + c * Decoder::kWords;
      if constexpr (Decoder::kWords % 4 == 0) {  // 16-byte loads (codes 16-byte aligned: launch_gemv checks)
#pragma unroll
        for (int i = 0; i < Decoder::kWords; i += 4) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(p + i));
          words[r][i] = v.x; words[r][i + 1] = v.y; words[r][i + 2] = v.z; words[r][i + 3] = v.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < Decoder::kWords; ++i) words[r][i] = __ldg(p + i);
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int k0 = c * 32 + 8 * s;
      const int grp = (int)((unsigned)k0 / (unsigned)a.group_size);  // unsigned: a cheaper division
      float xv[MT][8];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < g.M) {
          const uint4 u = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * a.K + k0));
          const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[m][j] = to_float<T>(h[j]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[m][j] = 0.f;
        }
      }
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) dec.template dot8<MT>(rows[r], words[r], s, grp, xv, acc[r]);
    }
  }
  float* const mine = sums + (size_t)(warp * 32 + lane) * kGemvRows * MT;
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) mine[r * MT + m] = acc[r][m];
  __syncthreads();
  if (lane < kGemvRows * MT) {
    const int r = lane / MT, m = lane % MT, n = n0 + r;
    if (n < a.N && m < g.M) {
      float sum = 0.f;
      for (int l = 0; l < 32; ++l) sum += sums[(size_t)(warp * 32 + l) * kGemvRows * MT + lane];
      if (g.bias) sum += bias_at<T>(g.bias, g.bias_dtype, n);
      static_cast<T*>(g.y)[(size_t)m * a.N + n] = from_float<T>(sum);
    }
  }
}

template <typename Decoder, typename T, int MT>
cudaError_t launch_gemv_mt(const GemvArgs<typename Decoder::Args>& g, cudaStream_t s) {
  const unsigned blocks = (unsigned)((g.w.N + kGemvWarps * kGemvRows - 1) / (kGemvWarps * kGemvRows));
  const size_t smem = canonical_gemv_smem_bytes(Decoder::kTableFloats, MT);
  canonical_gemv_kernel<T, MT, Decoder><<<blocks, 32 * kGemvWarps, smem, s>>>(g);
  return cudaGetLastError();
}

// Launches the GEMV for g.M rows of x (the instantiation for 1, 2, 4 or 8 rows) in x's dtype; cudaErrorInvalidValue for
// M outside 1..8, x not 16-byte aligned or of another dtype than fp16/bf16, or codes not 16-byte aligned where a chunk's
// words are whole 16-byte loads (kWords % 4 == 0).  The caller checks the rest of the weights.
template <typename Decoder>
cudaError_t launch_gemv(const GemvArgs<typename Decoder::Args>& g, cudaStream_t s) {
  if (g.M < 1 || g.M > 8 || (reinterpret_cast<size_t>(g.x) & 15u) ||  // x read 16 bytes at a time, and codes too
      (Decoder::kWords % 4 == 0 && (reinterpret_cast<size_t>(g.w.codes) & 15u)))  // when a chunk is whole 16 bytes
    return cudaErrorInvalidValue;
  const bool bf16 = g.x_dtype == DType::kBFloat16;
  if (!bf16 && g.x_dtype != DType::kHalf) return cudaErrorInvalidValue;
  const int mt = g.M == 1 ? 1 : g.M == 2 ? 2 : g.M <= 4 ? 4 : 8;
  switch (mt * 2 + bf16) {
    case 2: return launch_gemv_mt<Decoder, __half, 1>(g, s);
    case 3: return launch_gemv_mt<Decoder, __nv_bfloat16, 1>(g, s);
    case 4: return launch_gemv_mt<Decoder, __half, 2>(g, s);
    case 5: return launch_gemv_mt<Decoder, __nv_bfloat16, 2>(g, s);
    case 8: return launch_gemv_mt<Decoder, __half, 4>(g, s);
    case 9: return launch_gemv_mt<Decoder, __nv_bfloat16, 4>(g, s);
    case 16: return launch_gemv_mt<Decoder, __half, 8>(g, s);
    default: return launch_gemv_mt<Decoder, __nv_bfloat16, 8>(g, s);
  }
}

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
