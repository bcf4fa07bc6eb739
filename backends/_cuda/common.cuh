// Device helpers shared by the CUDA backends (torch-free; included by their .cu files).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

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

#ifndef QLINEAR_HOST_EMULATION  // tests/cuda_emulation.py (WARP_PTX) supplies a host version
// d += a·b on tensor cores: mma.sync m16n8k16, row-major A (fp16/bf16 pairs: a0 rows 0-7 / k 0-7, a1 rows 8-15, a2 and
// a3 k 8-15), column-major B (b0 k 0-7, b1 k 8-15), fp32 accumulators (PTX ISA, the m16n8k16 fragment tables).
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
#endif

// k / group_size for k a multiple of 32 without a division per tile: floor(2n·m / 2^32) with n = k / 32 and
// m = ceil(2^31 / d), d = group_size / 32, is exact while n·d < 2^31 (the launchers require K < 2^20).
struct GroupOf {
  unsigned m;
  __device__ __forceinline__ explicit GroupOf(int group_size)
      : m((0x80000000u + group_size / 32 - 1) / (group_size / 32)) {}
  __device__ __forceinline__ int operator()(int k) const { return (int)__umulhi((unsigned)k >> 4, m); }
};

// Bias of output n: fp32, or the kernel's own T (the bindings pass a layer's fp16/bf16 bias as it is, rather than
// converting it to fp32 in an extra launch per call); fp16/bf16 -> fp32 is exact, so either gives the same sum.
template <typename T>
__device__ __forceinline__ float bias_at(const void* bias, DType dtype, int n) {
  return dtype == DType::kFloat ? static_cast<const float*>(bias)[n] : to_float<T>(static_cast<const T*>(bias)[n]);
}

// Starts moving the line holding `p` (global memory) into L2; holds no register.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// y[i] = Σ_p partial[p, i] (in slice order: deterministic) + bias[i % N] (bias_at), the split-K reduction of the LUT GEMV,
// the QUICK GEMM and the mixed GEMV: a second launch, one thread per output.  (Their reduction in each tile's last block
// to finish was slower on the H200 at every split launch measured: +2.5 µs at 576² M = 1, +26-28 µs at M = 8, since one
// block then sums a whole tile's partials; RESULTS.md, 2026-11-27.)
template <typename T>
__global__ void reduce_splits_kernel(const float* __restrict__ partial, const void* __restrict__ bias, DType bias_dtype,
                                     T* __restrict__ y, int splits, int M, int N) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  float s = 0.f;
  for (int p = 0; p < splits; ++p) s += partial[(size_t)p * M * N + i];
  if (bias) s += bias_at<T>(bias, bias_dtype, i % N);
  y[i] = from_float<T>(s);
}

template <typename T>
inline void reduce_splits(const float* partial, const void* bias, DType bias_dtype, void* y, int splits, int M, int N,
                          cudaStream_t stream) {
  const int total = M * N;
  reduce_splits_kernel<T><<<(total + 255) / 256, 256, 0, stream>>>(partial, bias, bias_dtype, static_cast<T*>(y), splits,
                                                                    M, N);
}

}  // namespace qlinear
