// The randomized Hadamard input transform of a rotated layer (qlinear/formats/rotation.py is its definition and
// PyTorch reference), for the native kernels that stage x themselves: applied to a row before it is quantized or
// loaded, instead of a separate pass over x in PyTorch.  Torch-free; header-only.
//
//   row v [K] -> R·v, R = blockdiag(H_b, ..., H_b)·D:  v[k] *= D[k] (lowbias32 sign of (seed, k); the CPU bindings
//   get D/√b precomputed from the Python side, qlinear.formats.rotation.signs), then per block of b
//   inputs viewed as [p, n] (b = p·n, n a power of two): a Sylvester H_n (radix-2 butterflies) on each of the p rows,
//   the Paley factor (±1 [p, p], from the Python side) on each of the n columns, and 1/√b.
//
// Where 16 divides n (the blocks of every model we know) a row goes through GCC/Clang vectors of the machine's width
// W (16 floats with AVX-512, 8 with AVX2, else 4): H_W inside each vector by lane swaps, the next stages across up to
// 8 vectors in registers, the Paley factor as multiply-adds of whole vectors.  Other blocks take the scalar path.
// Both paths and every W add in the same order and multiply only by ±1 (exact; a fused multiply-add rounds as the
// pair does), so they give the same bits.
#pragma once

#include <cstdint>
#include <algorithm>
#include <utility>
#include <vector>

namespace qlinear_rotation {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QLINEAR_ROTATION_CLONES __attribute__((target_clones("avx2", "default")))  // 8-wide where the CPU has it
#define QLINEAR_ROTATION_X86 1
#else
#define QLINEAR_ROTATION_CLONES
#endif
#if defined(__GNUC__) && !defined(__clang__)
// multiply-adds contracted (the kernels' -ffp-contract=off keeps their specs bit-exact; here products are by ±1)
#define QLINEAR_ROTATION_FMA __attribute__((optimize("fp-contract=fast")))
#else
#define QLINEAR_ROTATION_FMA
#endif
#define QLINEAR_ROTATION_INLINE __attribute__((always_inline)) QLINEAR_ROTATION_FMA inline

template <int W> struct Vec;  // W floats at any float's address
template <> struct Vec<4> { typedef float type __attribute__((vector_size(16), aligned(4), may_alias)); };
template <> struct Vec<8> { typedef float type __attribute__((vector_size(32), aligned(4), may_alias)); };
template <> struct Vec<16> { typedef float type __attribute__((vector_size(64), aligned(4), may_alias)); };

// The radix-2 stage of distance H < W inside a vector: lane j becomes v[j ^ H] ± v[j] (+ where bit H of j is clear).
// (Vectors are named by W, never deduced: a deduced type drops the typedef's alignment of 4.)
template <int H, int W, size_t... I>
QLINEAR_ROTATION_INLINE void lane_stage(typename Vec<W>::type& v, std::index_sequence<I...>) {
  using V = typename Vec<W>::type;
  const V sign = {((I & H) ? -1.f : 1.f)...};
  v = __builtin_shufflevector(v, v, (I ^ H)...) + v * sign;
}

// The radix-2 stages of distance H, 2H, ... < C across the C vectors r (a compile-time H: the loops unroll whole).
template <int H, int C, int W>
QLINEAR_ROTATION_INLINE void vector_stages(typename Vec<W>::type* r) {
  using V = typename Vec<W>::type;
  if constexpr (H < C) {
#pragma GCC unroll 8
    for (int i = 0; i < C; i += 2 * H)
#pragma GCC unroll 8
      for (int j = i; j < i + H; ++j) {
        const V a = r[j], b = r[j + H];
        r[j] = a + b, r[j + H] = a - b;
      }
    vector_stages<2 * H, C, W>(r);
  }
}

// out[0, C) = H_{W·C}·(D·x) for C vectors of x and of D, in registers.
template <int W, int C>
QLINEAR_ROTATION_INLINE void signed_sylvester(const typename Vec<W>::type* x, const typename Vec<W>::type* d,
                                              typename Vec<W>::type* out) {
  using V = typename Vec<W>::type;
  constexpr auto lanes = std::make_index_sequence<W>();
  V r[C];  // the loops over C unrolled, so that r stays in registers
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    r[c] = x[c] * d[c];
    lane_stage<1, W>(r[c], lanes);
    lane_stage<2, W>(r[c], lanes);
    if constexpr (W >= 8) lane_stage<4, W>(r[c], lanes);
    if constexpr (W >= 16) lane_stage<8, W>(r[c], lanes);
  }
  vector_stages<1, C, W>(r);
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) out[c] = r[c];
}

// out[r·cols + c] = Σ_j P[r][j]·t[j·cols + c] for R rows of P [·, p] (row stride p) and C column vectors: R·C
// independent multiply-add chains (enough to cover the FMA latency), each summed over j in order, each P[r][j]
// loaded once for the C columns.
template <int W, int R, int C>
QLINEAR_ROTATION_INLINE void paley_tile(const typename Vec<W>::type* t, const float* P, int64_t p, int64_t cols,
                                        typename Vec<W>::type* out) {
  using V = typename Vec<W>::type;
  V a[R][C] = {};
  for (int64_t j = 0; j < p; ++j) {
    V v[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) v[c] = t[j * cols + c];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float s = P[r * p + j];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[r][c] += s * v[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) out[r * cols + c] = a[r][c];
}

// rotate_rows where W divides n: per row and block, D and H_n into t (the row itself when p == 1, else a scratch
// block), then row[i] = Σ_j P[i][j]·t[j] in tiles of R rows by 16 floats (p > 2 is a multiple of 4).
template <int W>
QLINEAR_ROTATION_INLINE void rotate_rows_vec(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                             const float* paley, int64_t p) {
  using V = typename Vec<W>::type;
  const int64_t vectors = block / W, cols = vectors / p, reg = std::min<int64_t>(cols, 8);
  std::vector<float> scratch(p > 1 ? block : 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      V* row = reinterpret_cast<V*>(x + m * K + b0);
      const V* dv = reinterpret_cast<const V*>(d + b0);
      V* t = p > 1 ? reinterpret_cast<V*>(scratch.data()) : row;
      for (int64_t c = 0; c < vectors; c += reg) switch (reg) {  // the stages within 8 vectors
          case 1: signed_sylvester<W, 1>(row + c, dv + c, t + c); break;
          case 2: signed_sylvester<W, 2>(row + c, dv + c, t + c); break;
          case 4: signed_sylvester<W, 4>(row + c, dv + c, t + c); break;
          default: signed_sylvester<W, 8>(row + c, dv + c, t + c);
        }
      for (int64_t h = 8; h < cols; h *= 2)  // the later ones, within each of the p rows of n
        for (int64_t i = 0; i < vectors; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) {
            const V a = t[j], b = t[j + h];
            t[j] = a + b, t[j + h] = a - b;
          }
      if (p == 1) continue;
      constexpr int C = 16 / W, R = W == 16 ? 8 : 4;  // tiles of 16 floats' width (16 divides n), 8-16 chains
      for (int64_t c = 0; c < cols; c += C) {
        int64_t i = 0;
        for (; i + R <= p; i += R) paley_tile<W, R, C>(t + c, paley + i * p, p, cols, row + i * cols + c);
        if (i < p) paley_tile<W, 4, C>(t + c, paley + i * p, p, cols, row + i * cols + c);
      }
    }
}

#ifdef QLINEAR_ROTATION_X86
// (features added to the translation unit's, not an arch=, which would drop some of a -march=native build's and so
// refuse to inline rotate_rows_vec)
__attribute__((target("avx512f,avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx512(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* paley, int64_t p) {
  rotate_rows_vec<16>(x, M, K, d, block, paley, p);
}
__attribute__((target("avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx2(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* paley, int64_t p) {
  rotate_rows_vec<8>(x, M, K, d, block, paley, p);
}
#endif

// Sylvester H_n (natural order, unscaled) on u[0, n), n a power of two: the first three radix-2 stages as one 8-point
// butterfly per 8 inputs (no short inner loops), the later ones over runs of h >= 8 contiguous inputs.
QLINEAR_ROTATION_CLONES inline void sylvester(float* u, int64_t n) {
  int64_t h = 1;
  if (n >= 8) {
    for (int64_t i = 0; i < n; i += 8) {
      float* v = u + i;
      const float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
      const float a4 = v[4] + v[5], a5 = v[4] - v[5], a6 = v[6] + v[7], a7 = v[6] - v[7];
      const float b0 = a0 + a2, b1 = a1 + a3, b2 = a0 - a2, b3 = a1 - a3;
      const float b4 = a4 + a6, b5 = a5 + a7, b6 = a4 - a6, b7 = a5 - a7;
      v[0] = b0 + b4, v[1] = b1 + b5, v[2] = b2 + b6, v[3] = b3 + b7;
      v[4] = b0 - b4, v[5] = b1 - b5, v[6] = b2 - b6, v[7] = b3 - b7;
    }
    h = 8;
  }
  for (; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = u[j], c = u[j + h];
        u[j] = a + c;
        u[j + h] = a - c;
      }
}

// Rotate the M rows of x [M, K] (row stride K) in place.  d: D's diagonal times 1/√b [K] (computed once per layer by
// the caller); paley: the ±1 Paley factor as float [p, p] row-major (unused when p == 1).  Where 16 divides n, the
// vector path above; else the scalar one, whose Paley factor runs on up to 32 rows at once, their [p, n] blocks
// gathered as [p, rows·n] (padded to a multiple of 16 columns, whose results go unused): two output rows at a time,
// 16 columns at a time, summed in registers over j.
QLINEAR_ROTATION_CLONES inline void rotate_rows(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                                const float* paley, int64_t p) {
  const int64_t n = block / p, chunk = std::min<int64_t>(32, M), w = 16;
  if (n % 16 == 0) {
#ifdef QLINEAR_ROTATION_X86
    static const int width = !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("avx2") ? 4
                             : __builtin_cpu_supports("avx512f")                               ? 16
                                                                                                : 8;
    if (width == 16) return rotate_rows_avx512(x, M, K, d, block, paley, p);
    if (width == 8) return rotate_rows_avx2(x, M, K, d, block, paley, p);
#endif
    return rotate_rows_vec<4>(x, M, K, d, block, paley, p);
  }
  for (int64_t m = 0; m < M; ++m) {
    float* row = x + m * K;
    for (int64_t k = 0; k < K; ++k) row[k] *= d[k];
    for (int64_t v = 0; v < K; v += n) sylvester(row + v, n);  // H_n on each row of every block's [p, n]
  }
  if (p == 1) return;
  const int64_t stride = (chunk * n + w - 1) / w * w;
  std::vector<float> in(p * stride), out(p * stride);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0), len = (rows * n + w - 1) / w * w;
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      for (int64_t j = 0; j < p; ++j)  // in[j][m][c] = x[m0 + m][b0 + j·n + c]
        for (int64_t m = 0; m < rows; ++m)
          std::copy_n(x + (m0 + m) * K + b0 + j * n, n, in.data() + j * stride + m * n);
      for (int64_t i = 0; i < p; i += 2)  // H_p on each column: out[i] = Σ_j P[i][j]·in[j] (p > 1 is even)
        for (int64_t e0 = 0; e0 < len; e0 += w) {
          float a0[w] = {}, a1[w] = {};
          for (int64_t j = 0; j < p; ++j) {
            const float s0 = paley[i * p + j], s1 = paley[(i + 1) * p + j], *src = in.data() + j * stride + e0;
            // vectorized along e (4 vectors at most), then unrolled: unrolled first, GCC's x86 clones would vectorize
            // across j instead (5x slower)
#pragma GCC unroll 4
            for (int64_t e = 0; e < w; ++e) a0[e] += s0 * src[e], a1[e] += s1 * src[e];
          }
          std::copy_n(a0, w, out.data() + i * stride + e0);
          std::copy_n(a1, w, out.data() + (i + 1) * stride + e0);
        }
      for (int64_t i = 0; i < p; ++i)
        for (int64_t m = 0; m < rows; ++m)
          std::copy_n(out.data() + i * stride + m * n, n, x + (m0 + m) * K + b0 + i * n);
    }
  }
}

}  // namespace qlinear_rotation
