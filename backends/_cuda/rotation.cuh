// A rotated layer's input transform inside the CUDA kernels that stage x themselves (qlinear/formats/rotation.py is
// its definition and PyTorch reference; backends/_shared/rotation.h the CPU kernels' version).  Torch-free.
//
//   R·v = blockdiag(H_b, ..., H_b)·D·v:  v[k] ·= D[k] (bit 31 of lowbias32(k + seed·0x9E3779B9) set: −1), then per
//   block of b = p·n inputs viewed as [p, n] (n a power of two): Sylvester H_n on each of the p rows (radix-2
//   butterflies, up to three stages per pass in registers), the ±1 Paley factor on each of the n columns, and 1/√b.
//
// Each value is rounded to the activation type T once at the end, so a kernel that stages R·x computes what it computes
// on the op's separately rotated x (rotation.rotate_input keeps x's dtype), up to float32 reassociation in the
// transform itself.
#pragma once
#include "common.cuh"

namespace qlinear {

__device__ __forceinline__ float rotation_sign(unsigned seed, int k) {
  unsigned h = (unsigned)k + seed * 0x9E3779B9u;  // lowbias32 (C. Wellons), as rotation.signs
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return (h >> 31) ? -1.f : 1.f;
}

// Radix-2 stages at distances h, 2h, .., (R/2)·h over `total` floats of u (a multiple of h·R): one group of R values
// at stride h per thread and pass.
template <int R>
__device__ __forceinline__ void butterflies(float* u, int total, int h) {
  for (int i = threadIdx.x; i < total / R; i += blockDim.x) {
    const int base = (i / h) * (h * R) + i % h;
    float v[R];
#pragma unroll
    for (int j = 0; j < R; ++j) v[j] = u[base + j * h];
#pragma unroll
    for (int s = 1; s < R; s *= 2)
#pragma unroll
      for (int j = 0; j < R; ++j)
        if (!(j & s)) {
          const float a = v[j], c = v[j + s];
          v[j] = a + c;
          v[j + s] = a - c;
        }
#pragma unroll
    for (int j = 0; j < R; ++j) u[base + j * h] = v[j];
  }
}

template <typename T, typename Out>
__device__ __forceinline__ Out rounded_to(float v) {
  if constexpr (sizeof(Out) == sizeof(float)) return to_float<T>(from_float<T>(v));
  else return from_float<T>(v);
}

// dst[m·ld + k − k_lo] = T((R·x[m])[k]) for rows m < rows of x (row stride ldx, global memory) and inputs k in
// [k_lo, k_hi); Out is T or float (a T value widened).  The rotation blocks covering [k_lo, k_hi) are transformed in
// `work` (fp32, work_floats >= b), as many (row, block) vectors at a time as it holds.  Called by every thread of the
// block; ends with a barrier, after which dst is complete and `work` free.
template <typename T, typename Out>
__device__ void stage_rotated(const T* x, int ldx, int rows, int k_lo, int k_hi, const Rotation& r, float* work,
                              int work_floats, Out* dst, int ld) {
  const int b = r.block, p = r.paley, n = b / p;
  const int first = k_lo / b, blocks = (k_hi + b - 1) / b - first, vectors = rows * blocks;
  const int at_once = min(vectors, work_floats / b);
  const float scale = 1.f / sqrtf((float)b);
  for (int v0 = 0; v0 < vectors; v0 += at_once) {
    const int total = min(at_once, vectors - v0) * b;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      const int v = v0 + i / b, k = (first + v % blocks) * b + i % b;
      work[i] = to_float<T>(x[(size_t)(v / blocks) * ldx + k]) * rotation_sign(r.seed, k);
    }
    __syncthreads();
    for (int h = 1; h < n; h *= 8) {
      const int radix = min(8, n / h);
      if (radix == 8) butterflies<8>(work, total, h);
      else if (radix == 4) butterflies<4>(work, total, h);
      else butterflies<2>(work, total, h);
      __syncthreads();
    }
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      const int v = v0 + i / b, e = i % b, k = (first + v % blocks) * b + e;
      if (k < k_lo || k >= k_hi) continue;
      float s;
      if (p == 1) {
        s = work[i];
      } else {  // row e / n of the Paley factor times column e % n of the [p, n] block
        const float* col = work + (i - e) + e % n;
        const signed char* prow = r.paley_matrix + (e / n) * p;
        s = 0.f;
        for (int j = 0; j < p; ++j) s = fmaf((float)__ldg(prow + j), col[j * n], s);
      }
      dst[(size_t)(v / blocks) * ld + (k - k_lo)] = rounded_to<T, Out>(s * scale);
    }
    __syncthreads();
  }
}

}  // namespace qlinear
