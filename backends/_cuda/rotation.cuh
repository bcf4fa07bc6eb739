// A rotated layer's input transform inside the CUDA kernels that stage x themselves (qlinear/formats/rotation.py is
// its definition and PyTorch reference; backends/_shared/rotation.h the CPU kernels' version).  Torch-free.
//
//   R·v = blockdiag(H_b, ..., H_b)·D·v:  v[k] ·= D[k] (bit 31 of lowbias32(k + seed·0x9E3779B9) set: −1), then per
//   block of b = p·n inputs viewed as [p, n] (n a power of two): Sylvester H_n on each of the p rows, the ±1 Paley
//   factor on each of the n columns, and 1/√b; a kernel forms only the outputs of its own K slice (stage_rotated).
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
// [k_lo, k_hi); Out is T or float (a T value widened).  Only those outputs are formed: with H_b = P ⊗ H_{n/L} ⊗ H_L
// (Sylvester in natural order, H[c][d] = (−1)^popc(c & d)), the outputs of Paley row i and L-aligned segment a of a
// block are H_L·y, y[d] = Σ_{i', c'} P[i][i']·(−1)^popc(a & c')·(D·x)[i'·n + c'·L + d], with L the smallest power of two
// whose aligned segment holds the slice's part of that row: b terms and L·log2 L butterflies per segment, where the
// whole block would take b·(p + log2 n) (a split-K block's slice is a fraction of a Llama block of 4096-8192).
// `work` (fp32) holds max(n, blockDim.x) floats.  Called by every thread of the block; ends with a barrier, after which
// dst is complete and `work` free.
template <typename T, typename Out>
__device__ __forceinline__ void stage_rotated_inline(const T* x, int ldx, int rows, int k_lo, int k_hi, const Rotation& r,
                                                     float* work, Out* dst, int ld) {
  const int b = r.block, p = r.paley, n = b / p, threads = blockDim.x, t = threadIdx.x;
  const float scale = 1.f / sqrtf((float)b);
  for (int m = 0; m < rows; ++m) {
    const T* xm = x + (size_t)m * ldx;
    for (int e = k_lo; e < k_hi;) {
      const int b0 = e / b * b, i = (e - b0) / n, row0 = b0 + i * n, end = min(k_hi, row0 + n);
      int L = 1;
      while ((e - row0) / L != (end - 1 - row0) / L) L *= 2;
      const int a = (e - row0) / L, lg = 31 - __clz(n / L), terms = p << lg;
      auto term = [&](int d, int j) {  // term j of y[d]: input row i' = j >> lg, segment c' = j & (n/L − 1)
        const int ii = j >> lg, c = j & ((n / L) - 1), k = b0 + ii * n + c * L + d;
        const float v = to_float<T>(xm[k]) * rotation_sign(r.seed, k);
        const float s = (__popc(a & c) & 1) ? -v : v;
        return p == 1 ? s : s * (float)__ldg(r.paley_matrix + i * p + ii);
      };
      const int groups = L >= threads ? 1 : threads / L;  // threads sharing a bin, their partials summed in order
      if (groups == 1) {
        for (int d = t; d < L; d += threads) {
          float s = 0.f;
          for (int j = 0; j < terms; ++j) s += term(d, j);
          work[d] = s;
        }
      } else if (t < groups * L) {
        float s = 0.f;
        for (int j = t / L; j < terms; j += groups) s += term(t % L, j);
        work[t] = s;
      }
      __syncthreads();
      if (groups > 1) {
        float s = 0.f;
        for (int g = 0; g < groups && t < L; ++g) s += work[g * L + t];
        __syncthreads();
        if (t < L) work[t] = s;
        __syncthreads();
      }
      for (int h = 1; h < L; h *= 8) {
        const int radix = min(8, L / h);
        if (radix == 8) butterflies<8>(work, L, h);
        else if (radix == 4) butterflies<4>(work, L, h);
        else butterflies<2>(work, L, h);
        __syncthreads();
      }
      for (int k = e + t; k < end; k += threads) dst[(size_t)m * ld + (k - k_lo)] = rounded_to<T, Out>(work[k - row0 - a * L] * scale);
      __syncthreads();
      e = end;
    }
  }
}

// The same out of line, for kernels whose registers are short at the call (their other live values are kept across it).
template <typename T, typename Out>
__device__ __noinline__ void stage_rotated(const T* x, int ldx, int rows, int k_lo, int k_hi, const Rotation r, float* work,
                                           Out* dst, int ld) {
  stage_rotated_inline<T, Out>(x, ldx, rows, k_lo, k_hi, r, work, dst, ld);
}

}  // namespace qlinear
