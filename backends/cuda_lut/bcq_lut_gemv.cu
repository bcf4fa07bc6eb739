// LUT GEMV for BCQ weights (LUT-GEMM / nuQmm, Park et al., section 3), decode batches M = 1..8.
//
// Why a table: a BCQ weight is Σ_q α_q·b_q + c with b_q = ±1, so for one bit-plane and 8 consecutive
// inputs, Σ_j b_j·x_j takes one of 256 values.  Each block computes those 256 partial sums for every
// 8 inputs of its K tile once (in fp32, shared memory) and then every weight byte of every plane of
// every row it owns is a single table lookup instead of 8 multiply-adds.  One warp builds a table in
// registers as T[b] = lo[b & 31] + hi[b >> 5] (lo over inputs 0..4, hi over 5..7): one add per entry and
// eight conflict-free stores per lane.  Lookups are random per lane (~3.2 shared-memory wavefronts per
// warp lookup for uniform bytes): see benchmarks/RESULTS.md for what that costs.
//
// Work split: thread = 4 consecutive output rows (one 16-byte load gives the same plane word of all
// four), block = `threads` threads × K tile of `kt` inputs (kt·M ≤ 256 keeps the tables ≤ 32 KB),
// gridDim.y = split-K slices of `tiles_per_split` tiles so small layers still fill the GPU.  With
// splits > 1 each slice writes fp32 partial sums and a second kernel adds them in slice order, so the
// result is deterministic (no atomics).  Accumulation is fp32 throughout; α and the offset are
// applied per 32-input word (the group of a word is uniform because group_size is a multiple of 32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "bcq_lut_gemv.h"

namespace qlinear {
namespace {

__device__ __forceinline__ void half4_to_float(uint2 v, float out[4]) {
  const __half2 lo = *reinterpret_cast<const __half2*>(&v.x), hi = *reinterpret_cast<const __half2*>(&v.y);
  const float2 a = __half22float2(lo), b = __half22float2(hi);
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int r) {
  return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w;
}

template <typename T, int M, int Q>
__global__ void __launch_bounds__(256) lut_gemv_kernel(const LutGemvArgs a) {
  extern __shared__ float smem[];
  const int kt = a.kt;
  float* lut = smem;                        // [M][kt/8][256]
  float* xsum = lut + M * (kt / 8) * 256;   // [M][kt/32]: Σx over each 32-input word
  float* xs = xsum + M * (kt / 32);         // [M][kt]

  const T* x = static_cast<const T*>(a.x);
  const int N = a.N, K = a.K, tid = threadIdx.x;
  const int n0 = (blockIdx.x * blockDim.x + tid) * 4;
  const bool active = n0 < N;
  const int tiles = (K + kt - 1) / kt;
  const int t_begin = blockIdx.y * a.tiles_per_split;
  const int t_end = min(t_begin + a.tiles_per_split, tiles);
  const uint4* planes = reinterpret_cast<const uint4*>(a.planes);
  const uint2* alpha = reinterpret_cast<const uint2*>(a.alpha);

  float acc[M][4];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[m][r] = 0.f;

  for (int t = t_begin; t < t_end; ++t) {
    const int k0 = t * kt, kw = min(kt, K - k0);  // kw: multiple of 32
    __syncthreads();  // the previous tile's lookups are done
    for (int i = tid; i < M * kw; i += blockDim.x) {
      const int m = i / kw, k = i - m * kw;
      xs[m * kt + k] = to_float<T>(x[(size_t)m * K + (a.perm ? __ldg(a.perm + k0 + k) : k0 + k)]);  // act_order: x[:, perm]
    }
    __syncthreads();
    for (int i = tid; i < M * (kw / 32); i += blockDim.x) {
      const int m = i / (kw / 32), w = i - m * (kw / 32);
      const float* xv = xs + m * kt + 32 * w;
      float s = 0.f;
      for (int j = 0; j < 32; ++j) s += xv[j];
      xsum[m * (kt / 32) + w] = s;
    }
    // One warp per 256-entry table: lane t writes entries t + 32i, i = 0..7, as lo[t] + hi[i] where lo sums
    // inputs 0..4 (signs from t) and hi inputs 5..7 (signs from i): 8 conflict-free stores per lane.
    for (int tb = tid >> 5; tb < M * (kw / 8); tb += blockDim.x >> 5) {
      const int m = tb / (kw / 8), c = tb - m * (kw / 8), lane = tid & 31;
      const float* xv = xs + m * kt + 8 * c;
      float lo = 0.f;
#pragma unroll
      for (int j = 0; j < 5; ++j) lo += ((lane >> j) & 1) ? xv[j] : -xv[j];
      float* tab = lut + (m * (kt / 8) + c) * 256 + lane;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float hi = ((i & 1) ? xv[5] : -xv[5]) + ((i & 2) ? xv[6] : -xv[6]) + ((i & 4) ? xv[7] : -xv[7]);
        tab[32 * i] = lo + hi;
      }
    }
    __syncthreads();
    if (!active) continue;

    int cur_g = -1;
    float al[Q][4], off[4] = {0.f, 0.f, 0.f, 0.f};
    for (int w = 0; w < kw / 32; ++w) {
      const int kword = k0 / 32 + w;
      const int g = kword * 32 / a.group_size;
      uint4 bits[Q];
#pragma unroll
      for (int q = 0; q < Q; ++q) bits[q] = __ldg(planes + ((size_t)kword * Q + q) * (N / 4) + n0 / 4);
      if (g != cur_g) {  // uniform across the block: every thread is at the same word
        cur_g = g;
#pragma unroll
        for (int q = 0; q < Q; ++q) half4_to_float(__ldg(alpha + ((size_t)g * Q + q) * (N / 4) + n0 / 4), al[q]);
        if (a.offset_dtype == DType::kHalf) {
          half4_to_float(__ldg(reinterpret_cast<const uint2*>(a.offset) + ((size_t)g * N + n0) / 4), off);
        } else if (a.offset_dtype == DType::kFloat) {
          const float4 o = __ldg(reinterpret_cast<const float4*>(a.offset) + ((size_t)g * N + n0) / 4);
          off[0] = o.x; off[1] = o.y; off[2] = o.z; off[3] = o.w;
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float* L = lut + (m * (kt / 8) + 4 * w) * 256;
        const float xw = xsum[m * (kt / 32) + w];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float v = off[r] * xw;
#pragma unroll
          for (int q = 0; q < Q; ++q) {
            const unsigned bw = word_of(bits[q], r);
            const float s = L[bw & 255] + L[256 + ((bw >> 8) & 255)] + L[512 + ((bw >> 16) & 255)] + L[768 + (bw >> 24)];
            v = fmaf(al[q][r], s, v);
          }
          acc[m][r] += v;
        }
      }
    }
  }
  if (!active) return;
  if (a.splits == 1) {
    T* y = static_cast<T*>(a.y);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        y[(size_t)m * N + n0 + r] = from_float<T>(acc[m][r] + (a.bias ? a.bias[n0 + r] : 0.f));
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m)
      *reinterpret_cast<float4*>(a.partial + ((size_t)blockIdx.y * M + m) * N + n0) =
          make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
  }
}

template <typename T, int M, int Q>
cudaError_t launch(const LutGemvArgs& a, cudaStream_t stream) {
  const size_t smem = lut_gemv_smem_bytes(M, a.kt);
  auto kernel = lut_gemv_kernel<T, M, Q>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid((a.N + 4 * a.threads - 1) / (4 * a.threads), a.splits);
  kernel<<<grid, a.threads, smem, stream>>>(a);
  if (a.splits > 1) {
    reduce_splits<T>(a.partial, a.bias, a.y, a.splits, a.M, a.N, stream);
  }
  return cudaGetLastError();
}

template <typename T, int M>
cudaError_t dispatch_q(const LutGemvArgs& a, cudaStream_t s) {
  switch (a.Q) {
    case 1: return launch<T, M, 1>(a, s);
    case 2: return launch<T, M, 2>(a, s);
    case 3: return launch<T, M, 3>(a, s);
    case 4: return launch<T, M, 4>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_m(const LutGemvArgs& a, cudaStream_t s) {
  switch (a.M) {
    case 1: return dispatch_q<T, 1>(a, s);
    case 2: return dispatch_q<T, 2>(a, s);
    case 3: return dispatch_q<T, 3>(a, s);
    case 4: return dispatch_q<T, 4>(a, s);
    case 5: return dispatch_q<T, 5>(a, s);
    case 6: return dispatch_q<T, 6>(a, s);
    case 7: return dispatch_q<T, 7>(a, s);
    case 8: return dispatch_q<T, 8>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t lut_gemv_smem_bytes(int M, int kt) {
  return sizeof(float) * (size_t)M * ((kt / 8) * 256 + kt / 32 + kt);
}

cudaError_t lut_gemv(const LutGemvArgs& a, cudaStream_t stream) {
  if (a.kt % 32 || a.group_size % 32 || a.K % 32 || a.N % 4 || a.threads % 32 || a.threads > 256) {
    return cudaErrorInvalidValue;
  }
  if (a.x_dtype == DType::kHalf) return dispatch_m<__half>(a, stream);
  if (a.x_dtype == DType::kBFloat16) return dispatch_m<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
