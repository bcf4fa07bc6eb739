// A rotated layer's input transform inside the CUDA kernels that stage x themselves (qlinear/formats/rotation.py is
// its definition and PyTorch reference; backends/_shared/rotation.h the CPU kernels' version).  Torch-free.
//
//   R·v = blockdiag(H_b, ..., H_b)·D·v:  v[k] ·= D[k] (bit k of Rotation::sign_bits, set: −1; the host derives them from
//   the seed, bit 31 of lowbias32(k + seed·0x9E3779B9), and a bit test costs a fraction of the hash), then per
//   block of b = p·n inputs viewed as [p, n] (n a power of two): Sylvester H_n on each of the p rows, the ±1 Paley
//   factor on each of the n columns, and 1/√b; a kernel forms only the outputs of its own K slice (stage_rotated).
//
// Each value is rounded to the activation type T once at the end, so a kernel that stages R·x computes what it computes
// on the op's separately rotated x (rotation.rotate_input keeps x's dtype), up to float32 reassociation in the
// transform itself.
#pragma once
#include "common.cuh"

namespace qlinear {

// Partial sums of y[d0 .. d0 + V) (see stage_rotated_inline) over the terms j = g, g + groups, ... into out: per term one
// V-input load (16 bytes for V = 8), its D signs (V bits of one sign word: the V inputs start at a multiple of V) and
// one sign for the whole term (Paley entry, Sylvester parity), folded into those bits.  The loads of kBatch terms are
// issued before any of them is added (in term order, as one at a time would): one L2 round trip per kBatch terms,
// where ptxas, left to itself, waited for each term's loads (a 576 = 36·16 block: 36 round trips per output).
template <int V, typename T>
__device__ __forceinline__ void fold_terms(const T* xm, const Rotation& r, int b0, int n, int i, int a, int L, int lg,
                                           int d0, int g, int groups, float* out) {
  constexpr int kBatch = 4;
  const int terms = r.paley << lg;
  float acc[V];
#pragma unroll
  for (int q = 0; q < V; ++q) acc[q] = 0.f;
  for (int j0 = g; j0 < terms; j0 += kBatch * groups) {
    T v[kBatch][V];
    unsigned bits[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int j = min(j0 + u * groups, terms - 1);  // past the end: a valid term, loaded but not added
      const int ii = j >> lg, c = j & ((1 << lg) - 1), k = b0 + ii * n + c * L + d0;
      unsigned neg = __popc(a & c) & 1;
      if (r.paley > 1 && __ldg(r.paley_matrix + i * r.paley + ii) < 0) neg ^= 1u;
      bits[u] = (__ldg(r.sign_bits + (k >> 5)) >> (k & 31)) ^ (0u - neg);  // bit q: the sign of input k + q
      if constexpr (V == 8) *reinterpret_cast<uint4*>(v[u]) = __ldg(reinterpret_cast<const uint4*>(xm + k));
      else v[u][0] = xm[k];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (j0 + u * groups < terms)
#pragma unroll
        for (int q = 0; q < V; ++q)
          acc[q] += __uint_as_float(__float_as_uint(to_float<T>(v[u][q])) ^ (bits[u] << (31 - q) & 0x80000000u));
  }
#pragma unroll
  for (int q = 0; q < V; ++q) out[q] = acc[q];
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

// The smallest power of two L whose aligned segment holds offsets [lo, hi) of a Paley row.
__device__ __forceinline__ int segment_length(int lo, int hi) {
  int L = 1;
  while (lo / L != (hi - 1) / L) L *= 2;
  return L;
}

// dst[m·ld + k − k_lo] = T((R·x[m])[k]) for rows m < rows of x (row stride ldx, global memory) and inputs k in
// [k_lo, k_hi); Out is T or float (a T value widened).  Only those outputs are formed: with H_b = P ⊗ H_{n/L} ⊗ H_L
// (Sylvester in natural order, H[c][d] = (−1)^popc(c & d)), the outputs of Paley row i and L-aligned segment a of a
// block are H_L·y, y[d] = Σ_{i', c'} P[i][i']·(−1)^popc(a & c')·(D·x)[i'·n + c'·L + d], with L the smallest power of two
// whose aligned segment holds the slice's part of that row (or of its first piece, cut below): b terms and L·log2 L
// butterflies per segment, where the whole block would take b·(p + log2 n) (a split-K block's slice is a fraction of a
// Llama block of 4096-8192).  A thread sums 8 consecutive bins per term where it can (L >= 8, x 16-byte aligned), one
// otherwise.  `work` (fp32) holds max(b, 256) floats.  Called by every thread of the block; ends with a barrier, after
// which dst is complete and `work` free.
template <typename T, typename Out>
__device__ __forceinline__ void stage_rotated_inline(const T* x, int ldx, int rows, int k_lo, int k_hi, const Rotation& r,
                                                     float* work, Out* dst, int ld) {
  const int b = r.block, n = b / r.paley, threads = blockDim.x, t = threadIdx.x, W = max(b, 256);  // W: work's floats
  const float scale = 1.f / sqrtf((float)b);
  for (int m = 0; m < rows; ++m) {
    const T* xm = x + (size_t)m * ldx;
    for (int e = k_lo; e < k_hi;) {
      const int b0 = e / b * b, i = (e - b0) / n, row0 = b0 + i * n;
      int end = min(k_hi, row0 + n);
      int L = segment_length(e - row0, end - row0);
      // A slice that straddles a large aligned boundary (splits of 15 or 3 tiles) would take butterflies over a segment
      // many times its length; cut it at the boundary of its own length L0 where a second pass over the b terms costs
      // less (term loop ~7 instructions per input, a butterfly level ~3 per value: cut when 5b < 2(L·log2 L − 2·L0·log2 L0)).
      int L0 = 1;
      while (L0 < end - e) L0 *= 2;
      const long long lgL = 31 - __clz(L), lgL0 = 31 - __clz(L0);
      if (L > 2 * L0 && 5LL * b < 2 * ((long long)L * lgL - 2LL * L0 * lgL0)) {
        end = row0 + ((e - row0) / L0 + 1) * L0;
        L = segment_length(e - row0, end - row0);
      }
      // Whole Paley rows from e on are transformed together, as many as the work area holds: one set of barriers for
      // all (a 64-input slice of SmolLM2's 576 = 36·16 block is 4 rows of 16)
      int span = L;
      if (e == row0 && end == row0 + n)
        while (end + n <= k_hi && span + L <= W) end += n, span += L;
      const int a = (e - row0) / L, lg = 31 - __clz(n / L);
      const bool wide = L >= 8 && (reinterpret_cast<size_t>(xm) & 15) == 0;
      const int V = wide ? 8 : 1, units = span / V;
      // threads sharing a unit of V bins (their partials, at work[g·span + bin], summed in order), within the work area:
      // every thread of the block folds where it holds their partials (a 256-input slice of an 8192 block: 8 threads
      // per unit, each 4 terms, where 256 floats left 1 thread per unit to walk all 32)
      const int groups = max(1, min(threads / units, W / span));
      for (int u = t; u < units * groups; u += threads) {
        const int d = (u % units) * V, g = u / units, er = e + d / L * L;  // er: the start of the unit's row (span > L)
        const int b0r = er / b * b, ir = (er - b0r) / n;
        if (wide) fold_terms<8, T>(xm, r, b0r, n, ir, a, L, lg, d % L, g, groups, work + g * span + d);
        else fold_terms<1, T>(xm, r, b0r, n, ir, a, L, lg, d % L, g, groups, work + g * span + d);
      }
      __syncthreads();
      if (groups > 1) {  // each bin summed by one thread: no thread reads another's bin
        for (int d = t; d < span; d += threads) {
          float s = work[d];
          for (int g = 1; g < groups; ++g) s += work[g * span + d];
          work[d] = s;
        }
        __syncthreads();
      }
      for (int h = 1; h < L; h *= 8) {  // within each L-segment of the span
        const int radix = min(8, L / h);
        if (radix == 8) butterflies<8>(work, span, h);
        else if (radix == 4) butterflies<4>(work, span, h);
        else butterflies<2>(work, span, h);
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
