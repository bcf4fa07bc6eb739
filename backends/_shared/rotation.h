// The randomized Hadamard input transform of a rotated layer (qlinear/formats/rotation.py is its definition and
// PyTorch reference), for the native kernels that stage x themselves: applied to a row before it is quantized or
// loaded, instead of a separate pass over x in PyTorch.  Torch-free; header-only.
//
//   row v [K] -> R·v, R = blockdiag(H_b, ..., H_b)·D:  v[k] *= D[k] (lowbias32 sign of (seed, k); the CPU bindings
//   get D/√b precomputed from the Python side, qlinear.formats.rotation.signs), then per block of b
//   inputs viewed as [p, n] (b = p·n, n a power of two): a Sylvester H_n (radix-2 butterflies) on each of the p rows,
//   the Paley factor H_p (from the Python side, backends/_cpu.py paley_argument) on each of the n columns, and 1/√b.
//
// Rows go through GCC/Clang vectors of the machine's width W (16 floats with AVX-512, 8 with AVX2, else 4).  Where 16
// divides n (the blocks of every model we know): D and H_W inside each vector by lane swaps, the next stages across
// up to 8 vectors in registers.  Else (n <= 8) D and H_n by scalars.  H_p in tiles of 16 floats' width, as
// multiply-adds of whole vectors over the [p, n] view (or, n <= 8, over up to 32 rows' blocks gathered as
// [p, rows·n]); a Paley II factor from its conference matrix C in half the multiply-adds (paley_apply).  Every W and
// both paths multiply each input by D/√b once, then add in the same order and multiply only by ±1 or 0 (exact; a
// fused multiply-add rounds as the pair does), so they give the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace qlinear_rotation {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QLINEAR_ROTATION_X86 1
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
#if defined(__clang__) || __GNUC__ >= 12
  v = __builtin_shufflevector(v, v, (I ^ H)...) + v * sign;
#else  // GCC before 12 has only the mask form
  typedef int32_t Mask __attribute__((vector_size(sizeof(V))));
  v = __builtin_shuffle(v, Mask{int32_t(I ^ H)...}) + v * sign;
#endif
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

// Sylvester H_n (natural order, unscaled) on u[0, n) by scalars (the blocks whose n, a power of two, is below 16;
// the same stages as the vector path): the first three as one 8-point butterfly per 8 inputs, the later ones
// radix-2.
QLINEAR_ROTATION_INLINE void scalar_sylvester(float* u, int64_t n) {
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

// out[r·stride + c] = init + Σ_j P[r][j]·t[j·stride + c] for R rows of P [·, f] (row stride f) and C vectors of
// columns: R·C independent multiply-add chains (enough to cover the FMA latency), each summed over j in order, each
// P[r][j] loaded once for the C columns.  init: 0, or (kInit) sign·init[r·stride + c].
template <int W, int R, int C, bool kInit>
QLINEAR_ROTATION_INLINE void paley_tile(const typename Vec<W>::type* t, const float* P, int64_t f, int64_t stride,
                                        typename Vec<W>::type* out, const typename Vec<W>::type* init, float sign) {
  using V = typename Vec<W>::type;
  V a[R][C] = {};
  if constexpr (kInit)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[r][c] = sign * init[r * stride + c];
  for (int64_t j = 0; j < f; ++j) {
    V v[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) v[c] = t[j * stride + c];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float s = P[r * f + j];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[r][c] += s * v[c];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) out[r * stride + c] = a[r][c];
}

// paley_tile from row i on while R rows fit (with init for a Paley II factor: the pair's other half, times sign), at
// column c; returns the first row left.
template <int W, int R, int C>
QLINEAR_ROTATION_INLINE int64_t paley_tiles(const typename Vec<W>::type* t, typename Vec<W>::type* out, int64_t stride,
                                            int64_t c, const float* factor, int64_t f, int64_t i, bool pairs,
                                            int64_t other, float sign) {
  for (; i + R <= f; i += R)
    if (pairs)
      paley_tile<W, R, C, true>(t + c, factor + i * f, f, stride, out + i * stride + c, t + i * stride + other, sign);
    else
      paley_tile<W, R, C, false>(t + c, factor + i * f, f, stride, out + i * stride + c, nullptr, 0.f);
  return i;
}

// The Paley factor's order p for a factor argument of f rows (backends/_cpu.py paley_argument): f itself (Paley I,
// ±1 [p, p]), or 2f for a Paley II conference matrix C [f, f] (f ≡ 2 mod 4, which no Hadamard order is).
inline int64_t paley_order(int64_t f) { return f % 4 == 2 ? 2 * f : f; }

// out = H_p·t over p rows of cols vectors each (row stride cols), out apart from t, in tiles of 16 floats' width
// (16/W divides cols).  Paley I: the dense ±1 factor.  Paley II, H_p = C ⊗ H_2 + I ⊗ B with B = [[1, −1], [−1, −1]]:
// t's rows taken in pairs u_j = H_2·(t_2j, t_2j+1) (in place: t is overwritten), then pair i of out is
// Σ_j C[i][j]·u_j + (u_i1, −u_i0) (that is B·(t_2i, t_2i+1)): C [f, f] over pairs of rows, 2·cols vectors wide.
template <int W>
QLINEAR_ROTATION_INLINE void paley_apply(typename Vec<W>::type* t, typename Vec<W>::type* out, int64_t cols,
                                         const float* factor, int64_t f) {
  using V = typename Vec<W>::type;
  constexpr int C = 16 / W, R = W == 16 ? 8 : 4;  // 8-16 chains; the last rows of f (even) by 4 and 2
  const bool pairs = f % 4 == 2;
  const int64_t stride = pairs ? 2 * cols : cols;
  if (pairs)
    for (int64_t j = 0; j < f; ++j)
      for (int64_t c = 0; c < cols; ++c) {
        V& a = t[2 * j * cols + c];
        V& b = t[(2 * j + 1) * cols + c];
        const V u0 = a + b, u1 = a - b;
        a = u0, b = u1;
      }
  for (int64_t c = 0; c < stride; c += C) {
    const int64_t other = c < cols ? c + cols : c - cols;  // Paley II: the pair's other half, first half positive
    const float sign = c < cols ? 1.f : -1.f;
    int64_t i = paley_tiles<W, R, C>(t, out, stride, c, factor, f, 0, pairs, other, sign);
    i = paley_tiles<W, 4, C>(t, out, stride, c, factor, f, i, pairs, other, sign);
    paley_tiles<W, 2, C>(t, out, stride, c, factor, f, i, pairs, other, sign);
  }
}

// rotate_rows for vectors of W floats.
template <int W>
QLINEAR_ROTATION_INLINE void rotate_rows_w(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                           const float* factor, int64_t f) {
  using V = typename Vec<W>::type;
  const int64_t p = paley_order(f), n = block / p;
  if (n % 16 == 0) {  // per row and block: D and H_n into t (the row itself when p == 1), then H_p back into the row
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
        if (p > 1) paley_apply<W>(t, row, cols, factor, f);
      }
    return;
  }
  for (int64_t m = 0; m < M; ++m) {  // n <= 8: D and H_n in place by scalars, then H_p on up to 32 rows at once
    float* row = x + m * K;
    for (int64_t k = 0; k < K; ++k) row[k] *= d[k];
    for (int64_t v = 0; v < K; v += n) scalar_sylvester(row + v, n);
  }
  if (p == 1) return;
  const int64_t chunk = std::min<int64_t>(32, M), stride = (chunk * n + 15) / 16 * 16;  // padding's results unused
  std::vector<float> in(p * stride), out(p * stride);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      for (int64_t j = 0; j < p; ++j) {  // in[j][m][c] = x[m0 + m][b0 + j·n + c], the padding 0 (Paley II's pair
        for (int64_t m = 0; m < rows; ++m)  // butterfly runs in place: left alone, its values would grow to inf)
          std::copy_n(x + (m0 + m) * K + b0 + j * n, n, in.data() + j * stride + m * n);
        std::fill(in.data() + j * stride + rows * n, in.data() + (j + 1) * stride, 0.f);
      }
      paley_apply<W>(reinterpret_cast<V*>(in.data()), reinterpret_cast<V*>(out.data()), stride / W, factor, f);
      for (int64_t i = 0; i < p; ++i)
        for (int64_t m = 0; m < rows; ++m)
          std::copy_n(out.data() + i * stride + m * n, n, x + (m0 + m) * K + b0 + i * n);
    }
  }
}

#ifdef QLINEAR_ROTATION_X86
// (features added to the translation unit's, not an arch=, which would drop some of a -march=native build's and so
// refuse to inline rotate_rows_w)
__attribute__((target("avx512f,avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx512(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* factor, int64_t f) {
  rotate_rows_w<16>(x, M, K, d, block, factor, f);
}
__attribute__((target("avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx2(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* factor, int64_t f) {
  rotate_rows_w<8>(x, M, K, d, block, factor, f);
}
#endif

// Rotate the M rows of x [M, K] (row stride K) in place.  d: D's diagonal times 1/√b [K] (computed once per layer by
// the caller); factor: the Paley factor as backends/_cpu.py paley_argument gives it, float [f, f] row-major (f = 1
// and unused for a power-of-two block).
QLINEAR_ROTATION_FMA inline void rotate_rows(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                             const float* factor, int64_t f) {
#ifdef QLINEAR_ROTATION_X86
  static const int width = !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("avx2") ? 4
                           : __builtin_cpu_supports("avx512f")                               ? 16
                                                                                              : 8;
  if (width == 16) return rotate_rows_avx512(x, M, K, d, block, factor, f);
  if (width == 8) return rotate_rows_avx2(x, M, K, d, block, factor, f);
#endif
  rotate_rows_w<4>(x, M, K, d, block, factor, f);
}

}  // namespace qlinear_rotation
