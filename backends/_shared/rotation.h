// The randomized Hadamard input transform of a rotated layer (qlinear/formats/rotation.py is its definition and
// PyTorch reference), for the native kernels that stage x themselves: applied to a row before it is quantized or
// loaded, instead of a separate pass over x in PyTorch.  Torch-free; header-only.
//
//   row v [K] -> R·v, R = blockdiag(H_b, ..., H_b)·D:  v[k] *= D[k] (lowbias32 sign of (seed, k); the CPU bindings
//   get D/√b precomputed from the Python side, qlinear.formats.rotation.signs), then per block of b
//   inputs viewed as [p, n] (b = p·n, n a power of two): a Sylvester H_n (radix-2 butterflies) on each of the p rows,
//   the Paley factor H_p (from the Python side, backends/_cpu.py paley_argument) on each of the n columns, and 1/√b.
//
// Rows go through GCC/Clang vectors of the machine's width W (16 floats with AVX-512, 8 with AVX2, else 4).  A block
// is taken as f rows (paley_apply): Paley I's p rows of n, Paley II's p/2 pair rows of 2n.  Where 16 divides n (the
// blocks of every model we know): D and H_W inside each vector by lane swaps, the next stages across up to 16
// vectors in registers (8 where the machine has 16 vector registers), any left through memory (the last one, for
// p = 12, in the factor's pass).  Else D and H by scalars.  Then the factor over the rows (or, for short
// rows, over up to 32 rows' blocks gathered), one column of vectors at a time: for the Paley primes of real models
// (p = 12, 28, 36) as sums over the quadratic residues in registers (paley_residues, about q/2 additions per output
// instead of p/2 to p multiply-adds), else as multiply-adds by the factor's entries in tiles of 16 floats' width
// (paley_dense).  Every W and both paths multiply each input by D/√b once, then add in the same order and multiply
// only by ±1, 0 or 2 (exact; a fused multiply-add rounds as the pair does), so they give the same bits.
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
// The two passes over a block (the Sylvester stages, the factor): out of line where no per-ISA entry point must
// inline them (not x86): GCC for aarch64 allocates their registers better alone (576 = 36·16: 4,315 → 3,509
// instructions per row under qemu).
#ifdef QLINEAR_ROTATION_X86
#define QLINEAR_ROTATION_PASS QLINEAR_ROTATION_INLINE
#else
#define QLINEAR_ROTATION_PASS __attribute__((noinline)) QLINEAR_ROTATION_FMA inline
#endif

template <int W> struct Vec;  // W floats at any float's address
template <> struct Vec<4> { typedef float type __attribute__((vector_size(16), aligned(4), may_alias)); };
template <> struct Vec<8> { typedef float type __attribute__((vector_size(32), aligned(4), may_alias)); };
template <> struct Vec<16> { typedef float type __attribute__((vector_size(64), aligned(4), may_alias)); };

// How many vectors of W floats the register stages take at once: 16 where the machine has 32 vector registers
// (aarch64, AVX-512), else 8.
#ifdef QLINEAR_ROTATION_X86
template <int W> constexpr int kRegisterVectors = W == 16 ? 16 : 8;
#else
template <int W> constexpr int kRegisterVectors = 16;
#endif

// A per-thread buffer of at least `floats` floats, kept from call to call (no allocation per transformed row).
inline float* scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

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

// The radix-2 stages of distance H, 2H, ... < S across the C vectors r, in blocks of S (a compile-time H: the loops
// unroll whole).
template <int H, int S, int C, int W>
QLINEAR_ROTATION_INLINE void vector_stages(typename Vec<W>::type* r) {
  using V = typename Vec<W>::type;
  if constexpr (H < S) {
#pragma GCC unroll 16
    for (int i = 0; i < C; i += 2 * H)
#pragma GCC unroll 16
      for (int j = i; j < i + H; ++j) {
        const V a = r[j], b = r[j + H];
        r[j] = a + b, r[j + H] = a - b;
      }
    vector_stages<2 * H, S, C, W>(r);
  }
}

// out[0, C) = H_{W·S}·(D·x) for C vectors of x and of D, in registers, per block of S vectors (S divides C).
template <int W, int C, int S>
QLINEAR_ROTATION_INLINE void signed_sylvester(const typename Vec<W>::type* x, const typename Vec<W>::type* d,
                                              typename Vec<W>::type* out) {
  using V = typename Vec<W>::type;
  constexpr auto lanes = std::make_index_sequence<W>();
  V r[C];  // the loops over C unrolled, so that r stays in registers
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) {
    r[c] = x[c] * d[c];
    lane_stage<1, W>(r[c], lanes);
    lane_stage<2, W>(r[c], lanes);
    if constexpr (W >= 8) lane_stage<4, W>(r[c], lanes);
    if constexpr (W >= 16) lane_stage<8, W>(r[c], lanes);
  }
  vector_stages<1, S, C, W>(r);
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) out[c] = r[c];
}

// Sylvester H_n (natural order, unscaled) on u[0, n) by scalars (the rows too short for the vector path: n below 16,
// or Paley II's pair rows of 2·8; the same stages as the vector path): the first three as one 8-point butterfly per
// 8 inputs, the later ones radix-2.
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

// paley_tile from row i on while R rows fit (with init for a Paley II factor: the row's other half, times sign), at
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
inline bool paley_ii(int64_t f) { return f % 4 == 2; }
inline int64_t paley_order(int64_t f) { return paley_ii(f) ? 2 * f : f; }

// A block of b = p·n inputs is taken as f rows of b/f (f: the factor argument's rows, 1 for a power of two): Paley I's
// p rows of n, or Paley II's f pairs of rows of n as rows of 2n, since H_p ⊗ H_n = (C ⊗ I_2n + I_f ⊗ K ⊗ I_n)·(I_f ⊗
// H_2n) with K = [[0, 1], [−1, 0]] (Paley II's H_p = C ⊗ H_2 + I ⊗ B, B = [[1, −1], [−1, −1]] = K·H_2).  So the
// Sylvester stages run over each row of b/f, and the factor mixes the f rows (Paley II: each row's two halves apart).
//
// out = the factor applied to t, f rows of cols vectors each (row stride cols; Paley II: each row's halves
// [0, cols/2) and [cols/2, cols)), out apart from t.  Paley I: out_i = Σ_j H[i][j]·t_j.  Paley II: out_i = Σ_j
// C[i][j]·t_j + K·t_i, i.e. first halves Σ_j C[i][j]·t_j0 + t_i1, second halves Σ_j C[i][j]·t_j1 − t_i0.

// paley_apply for any factor, as multiply-adds by its entries, in tiles of 16 floats' width (16/W divides cols, and
// cols/2 for Paley II).
template <int W>
QLINEAR_ROTATION_INLINE void paley_dense(const typename Vec<W>::type* t, typename Vec<W>::type* out, int64_t cols,
                                         const float* factor, int64_t f) {
  constexpr int C = 16 / W, R = W == 16 ? 8 : 4;  // 8-16 chains; the last rows of f (even) by 4 and 2
  const bool pairs = paley_ii(f);
  const int64_t half = cols / 2;
  for (int64_t c = 0; c < cols; c += C) {
    const int64_t other = c < half ? c + half : c - half;  // Paley II: the row's other half, first half positive
    const float sign = c < half ? 1.f : -1.f;
    int64_t i = paley_tiles<W, R, C>(t, out, cols, c, factor, f, 0, pairs, other, sign);
    i = paley_tiles<W, 4, C>(t, out, cols, c, factor, f, i, pairs, other, sign);
    paley_tiles<W, 2, C>(t, out, cols, c, factor, f, i, pairs, other, sign);
  }
}

// The quadratic residues mod a prime q (χ(a) = +1) that Paley's Jacobsthal matrix Q[i][j] = χ(j − i) is made of
// (qlinear/formats/rotation.py _conference), as Q's row sums take them: offsets r with r + 1 a residue too, summed as
// one pair b_k = u_k + u_{k+1}, and single offsets; rows in steps of the first two pairs' distance, so that
// consecutive rows share pairs (q = 17: pairs at 1, 8, 15, step 7: each row adds one new pair).  kZero: offset 0 in
// the set too (Paley I sums each row's own input with its residues).
template <int q, bool kZero>
struct Residues {
  int pairs[q] = {}, singles[q] = {}, n_pairs = 0, n_singles = 0, step = 1;
  constexpr Residues() {
    bool residue[q] = {kZero};
    for (int i = 1; i < q; ++i) residue[i * i % q] = true;
    for (int r = kZero ? 0 : 1; r < q; ++r)
      if (residue[r] && r + 1 < q && residue[r + 1]) pairs[n_pairs++] = r++;
      else if (residue[r]) singles[n_singles++] = r;
    if (n_pairs > 1) step = pairs[1] - pairs[0];
  }
};

// Row i of Q times u is Σ_j Q[i][j]·u[j] = 2·P_i − Σ_{j ≠ i} u[j] (χ's ±1 form) with P_i = Σ_{r residue} u[(i + r)
// mod q]: about q/2 adds per row instead of q multiply-adds, once the callers fold the second sum into a term common
// to all rows.  Row i of out, for Paley I (kind 1, P_i with offset 0): 2·P_i − base; for Paley II (kind 2): (base +
// u[i] + sign·v[i][col]) + 2·P_i.  (Index sequences, not loops: GCC does not unroll the nested loops whole, and u
// then leaves the registers.  Vectors by reference, as everywhere here: by value, they would change the ABI of x86
// code compiled without the entry points' target features.)
template <int W, int q, int kind, int i, size_t... P, size_t... S>
QLINEAR_ROTATION_INLINE void residue_row(const typename Vec<W>::type* u, const typename Vec<W>::type& base,
                                         const typename Vec<W>::type* const* v, int64_t col, float sign,
                                         typename Vec<W>::type& out, std::index_sequence<P...>,
                                         std::index_sequence<S...>) {
  constexpr Residues<q, kind == 1> res;
  static_assert(res.n_pairs >= 1, "residue_row: a prime whose residues include two consecutive ones");
  typename Vec<W>::type p = u[(i + res.pairs[0]) % q] + u[(i + res.pairs[0] + 1) % q];  // pair sums merged by GCC
  ((p += u[(i + res.pairs[P + 1]) % q] + u[(i + res.pairs[P + 1] + 1) % q]), ...);
  ((p += u[(i + res.singles[S]) % q]), ...);
  if constexpr (kind == 1) out = 2.f * p - base;
  else out = (base + u[i] + sign * v[i][col]) + 2.f * p;
}

// out[i][out_col] = residue_row i for i < q, in the order of Residues::step, each stored as it is done.
template <int W, int q, int kind, size_t... T>
QLINEAR_ROTATION_INLINE void residue_rows(const typename Vec<W>::type* u, typename Vec<W>::type* const* out,
                                          int64_t out_col, const typename Vec<W>::type& base,
                                          const typename Vec<W>::type* const* v, int64_t col, float sign,
                                          std::index_sequence<T...>) {
  constexpr Residues<q, kind == 1> res;
  (residue_row<W, q, kind, T * res.step % q>(u, base, v, col, sign, out[T * res.step % q][out_col],
                                             std::make_index_sequence<res.n_pairs - 1>(),
                                             std::make_index_sequence<res.n_singles>()),
   ...);
}

// paley_apply for the Paley factor of prime q by residue sums, one column of vectors at a time in registers (kCols:
// cols known at compile time, so that every row's address is an offset; 0: not, the rows' addresses are then kept
// in registers and the column is an index, which beats recomputing them for 12 rows but not for 36).  The factor is
// rebuilt from q as qlinear/formats/rotation.py _conference builds it; the factor argument is not read.  Sums of
// the form 2·(…) − T turn an infinite input into NaN outputs where the dense product would give ±inf (x is then
// unusable either way: its int8 scale is infinite).
//
// Paley I (H = I + C, C's first row +1, first column −1, Q below): out_0 = T, out_i = 2·(t_i + P_i) − T (T: the sum
// of all rows); kFold: the rows' last Sylvester stage (distance cols/2) done here, as columns c and c + cols/2 are
// loaded.  Paley II (C symmetric, first row and column +1), per half h of the rows, u = the rows' half h, v = their
// other half, S = Σ_{j ≥ 1} u_j: (C·u)_0 = S and (C·u)_i = u_0 − S + u_i + 2·P_i, so out_0 = S ± v_0 and out_i =
// (u_0 − S + u_i ± v_i) + 2·P_i (+ for the first half).
template <int W, int q, int kind, int kCols, bool kFold = false>
QLINEAR_ROTATION_PASS void paley_residues(const typename Vec<W>::type* t, typename Vec<W>::type* out,
                                          int64_t runtime_cols) {
  using V = typename Vec<W>::type;
  constexpr auto rows = std::make_index_sequence<q>();
  const int64_t cols = kCols ? kCols : runtime_cols, half = cols / 2;
  const V* in[q + 1];
  V* to[q + 1];
#pragma GCC unroll 64
  for (int j = 0; j <= q; ++j) in[j] = t + j * cols, to[j] = out + j * cols;
  V u[q + 1];
  if constexpr (kind == 1) {
    auto column = [&](const V* x, int64_t c) {  // column c of out = H·x
      V total = x[0];
#pragma GCC unroll 64
      for (int j = 1; j <= q; ++j) total += x[j];
      to[0][c] = total;
      residue_rows<W, q, 1>(x + 1, to + 1, c, total, nullptr, 0, 0.f, rows);
    };
    for (int64_t c = 0; c < (kFold ? half : cols); ++c) {
      V w[q + 1];
#pragma GCC unroll 64
      for (int j = 0; j <= q; ++j) {
        u[j] = in[j][c];
        if constexpr (kFold) {
          const V b = in[j][c + half];
          w[j] = u[j] - b, u[j] += b;
        }
      }
      column(u, c);
      if constexpr (kFold) column(w, c + half);
    }
  } else {
    for (int64_t c = 0; c < half; ++c)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const float sign = h ? -1.f : 1.f;
        const int64_t own = c + h * half, other = c + (1 - h) * half;
#pragma GCC unroll 64
        for (int j = 0; j <= q; ++j) u[j] = in[j][own];
        V s = u[1];
#pragma GCC unroll 64
        for (int j = 2; j <= q; ++j) s += u[j];
        to[0][own] = s + sign * in[0][other];
        const V base = u[0] - s;
        residue_rows<W, q, 2>(u + 1, to + 1, own, base, in + 1, other, sign, rows);
      }
  }
}

// One radix-2 stage of distance s over `vectors` vectors h, through memory (the stages past the registers).
template <int W>
QLINEAR_ROTATION_INLINE void butterflies(typename Vec<W>::type* h, int64_t vectors, int64_t s) {
  using V = typename Vec<W>::type;
  for (int64_t i = 0; i < vectors; i += 2 * s)
    for (int64_t j = i; j < i + s; ++j) {
      const V a = h[j], b = h[j + s];
      h[j] = a + b, h[j + s] = a - b;
    }
}

// out = the factor applied to t (above): by residue sums for the factors of the blocks real models have (p = 12:
// 1536 = 12·128; p = 28: 14336 = 28·512, 448, 896; p = 36: 576 = 36·16), else by the dense multiply-adds.  pending:
// t's rows still need their last Sylvester stage (distance cols/2; t may be overwritten).
template <int W>
QLINEAR_ROTATION_INLINE void paley_apply(typename Vec<W>::type* t, typename Vec<W>::type* out, int64_t cols,
                                         const float* factor, int64_t f, bool pending) {
  constexpr int k16 = 16 / W, k32 = 32 / W;  // rows of 16 inputs (Paley I), pair rows of 2·16 (Paley II)
  if (pending && f == 12) return paley_residues<W, 11, 1, 0, true>(t, out, cols);
  if (pending) butterflies<W>(t, f * cols, cols / 2);
  switch (f) {
    case 12:
      return cols == k16 ? paley_residues<W, 11, 1, k16>(t, out, cols) : paley_residues<W, 11, 1, 0>(t, out, cols);
    case 14:
      return cols == k32 ? paley_residues<W, 13, 2, k32>(t, out, cols) : paley_residues<W, 13, 2, 0>(t, out, cols);
    case 18:
      return cols == k32 ? paley_residues<W, 17, 2, k32>(t, out, cols) : paley_residues<W, 17, 2, 0>(t, out, cols);
    default:
      return paley_dense<W>(t, out, cols, factor, f);
  }
}

// signed_sylvester over `vectors` vectors in blocks of S: as many blocks at once as fill the registers.
template <int W, int S>
QLINEAR_ROTATION_PASS void sylvester_blocks(const typename Vec<W>::type* x, const typename Vec<W>::type* d,
                                            typename Vec<W>::type* out, int64_t vectors) {
  constexpr int C = kRegisterVectors<W>;
  int64_t c = 0;
  for (; c + C <= vectors; c += C) signed_sylvester<W, C, S>(x + c, d + c, out + c);
  for (; c < vectors; c += S) signed_sylvester<W, S, S>(x + c, d + c, out + c);
}

// rotate_rows for vectors of W floats.
template <int W>
QLINEAR_ROTATION_INLINE void rotate_rows_w(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                           const float* factor, int64_t f, const float* src) {
  using V = typename Vec<W>::type;
  const int64_t n = block / f, halves = paley_ii(f) ? 2 : 1, part = n / halves;  // f rows of n (above)
  if (part % 16 == 0) {  // per row and block: D and H_n into t (the row itself when f == 1), then the factor
    const int64_t vectors = block / W, cols = n / W, reg = std::min<int64_t>(cols, kRegisterVectors<W>);
    V* t = f > 1 ? reinterpret_cast<V*>(scratch(block)) : nullptr;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b0 = 0; b0 < K; b0 += block) {
        const V* in = reinterpret_cast<const V*>(src + m * K + b0);
        V* row = reinterpret_cast<V*>(x + m * K + b0);
        const V* dv = reinterpret_cast<const V*>(d + b0);
        V* h = f > 1 ? t : row;
        switch (reg) {  // the stages within registers
          case 1: sylvester_blocks<W, 1>(in, dv, h, vectors); break;
          case 2: sylvester_blocks<W, 2>(in, dv, h, vectors); break;
          case 4: sylvester_blocks<W, 4>(in, dv, h, vectors); break;
          case 8: sylvester_blocks<W, 8>(in, dv, h, vectors); break;
          default: sylvester_blocks<W, kRegisterVectors<W>>(in, dv, h, vectors);
        }
        const bool pending = f > 1 && reg < cols;  // the last stage left to the factor's pass
        for (int64_t s = reg; s < (pending ? cols / 2 : cols); s *= 2)  // the later ones, within each row of n
          butterflies<W>(h, vectors, s);
        if (f > 1) paley_apply<W>(t, row, cols, factor, f, pending);
      }
    return;
  }
  for (int64_t m = 0; m < M; ++m) {  // else D and H_n by scalars, then the factor on up to 32 rows at once
    float* row = x + m * K;
    for (int64_t k = 0; k < K; ++k) row[k] = src[m * K + k] * d[k];
    for (int64_t v = 0; v < K; v += n) scalar_sylvester(row + v, n);
  }
  if (f == 1) return;
  // gathered as in[j][h][m][c] = x[m0 + m][b0 + j·n + h·part + c]: each half a whole number of tiles, zero padded
  // (the padding's results are unused; zeros keep its arithmetic finite)
  const int64_t chunk = std::min<int64_t>(32, M), width = (chunk * part + 15) / 16 * 16, stride = halves * width;
  float* const in = scratch(2 * f * stride);
  float* const out = in + f * stride;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      for (int64_t j = 0; j < f; ++j)
        for (int64_t h = 0; h < halves; ++h) {
          float* to = in + j * stride + h * width;
          for (int64_t m = 0; m < rows; ++m)
            std::copy_n(x + (m0 + m) * K + b0 + j * n + h * part, part, to + m * part);
          std::fill(to + rows * part, to + width, 0.f);
        }
      paley_apply<W>(reinterpret_cast<V*>(in), reinterpret_cast<V*>(out), stride / W, factor, f, false);
      for (int64_t j = 0; j < f; ++j)
        for (int64_t h = 0; h < halves; ++h)
          for (int64_t m = 0; m < rows; ++m)
            std::copy_n(out + j * stride + h * width + m * part, part, x + (m0 + m) * K + b0 + j * n + h * part);
    }
  }
}

#ifdef QLINEAR_ROTATION_X86
// (features added to the translation unit's, not an arch=, which would drop some of a -march=native build's and so
// refuse to inline rotate_rows_w)
__attribute__((target("avx512f,avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx512(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* factor, int64_t f, const float* src) {
  rotate_rows_w<16>(x, M, K, d, block, factor, f, src);
}
__attribute__((target("avx2,fma"))) QLINEAR_ROTATION_FMA inline void rotate_rows_avx2(
    float* x, int64_t M, int64_t K, const float* d, int64_t block, const float* factor, int64_t f, const float* src) {
  rotate_rows_w<8>(x, M, K, d, block, factor, f, src);
}
#endif

// x [M, K] (row stride K) = the rotated rows of src (x itself when null: in place; else src [M, K] apart from x, which
// saves the caller a copy).  d: D's diagonal times 1/√b [K] (computed once per layer by the caller); factor: the
// Paley factor as backends/_cpu.py paley_argument gives it, float [f, f] row-major (f = 1 and unused for a
// power-of-two block).
QLINEAR_ROTATION_FMA inline void rotate_rows(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                             const float* factor, int64_t f, const float* src = nullptr) {
  if (src == nullptr) src = x;
#ifdef QLINEAR_ROTATION_X86
  static const int width = !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("avx2") ? 4
                           : __builtin_cpu_supports("avx512f")                               ? 16
                                                                                              : 8;
  if (width == 16) return rotate_rows_avx512(x, M, K, d, block, factor, f, src);
  if (width == 8) return rotate_rows_avx2(x, M, K, d, block, factor, f, src);
#endif
  rotate_rows_w<4>(x, M, K, d, block, factor, f, src);
}

}  // namespace qlinear_rotation
