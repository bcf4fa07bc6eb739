// Device helpers shared by the CUDA backends (torch-free; included by their .cu files).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "dtype.h"

namespace qlinear {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }  // dequantize kernels' fp32 output

// (a & b) | c in one LOP3 (nvcc splits the expression into two when b and c are both immediates).
__device__ __forceinline__ unsigned and_or(unsigned a, unsigned b, unsigned c) {
#ifdef __CUDA_ARCH__
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return (a & b) | c;
#endif
}

// y[i] = Σ_p partial[p, i] (in slice order: deterministic) + bias[i % N], for split-K kernels.
template <typename T>
__global__ void reduce_splits_kernel(const float* __restrict__ partial, const float* __restrict__ bias, T* __restrict__ y,
                                     int splits, int M, int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  float s = 0.f;
  for (int p = 0; p < splits; ++p) s += partial[(size_t)p * M * N + i];
  if (bias) s += bias[i % N];
  y[i] = from_float<T>(s);
}

template <typename T>
inline void reduce_splits(const float* partial, const float* bias, void* y, int splits, int M, int N, cudaStream_t stream) {
  const int total = M * N;
  reduce_splits_kernel<T><<<(total + 255) / 256, 256, 0, stream>>>(partial, bias, static_cast<T*>(y), splits, M, N);
}

}  // namespace qlinear
