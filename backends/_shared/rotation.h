// The randomized Hadamard input transform of a rotated layer (qlinear/formats/rotation.py is its definition and
// PyTorch reference), for the native kernels that stage x themselves: applied to a row before it is quantized or
// loaded, instead of a separate pass over x in PyTorch.  Torch-free; header-only.
//
//   row v [K] -> R·v, R = blockdiag(H_b, ..., H_b)·D:  v[k] *= D[k] (lowbias32 sign of (seed, k); the CPU bindings
//   get D/√b precomputed from the Python side, qlinear.formats.rotation.signs), then per block of b
//   inputs viewed as [p, n] (b = p·n, n a power of two): a Sylvester H_n (radix-2 butterflies) on each of the p rows,
//   the Paley factor (±1 [p, p], from the Python side) on each of the n columns, and 1/√b.
#pragma once

#include <cstdint>
#include <algorithm>
#include <vector>

namespace qlinear_rotation {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QLINEAR_ROTATION_CLONES __attribute__((target_clones("avx2", "default")))  // 8-wide where the CPU has it
#else
#define QLINEAR_ROTATION_CLONES
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
// the caller); paley: the ±1 Paley factor as float [p, p] row-major (unused when p == 1).  The Paley
// factor runs on up to 32 rows at once, their [p, n] blocks gathered as [p, rows·n] (padded to a multiple of 16
// columns, whose results go unused): two output rows at a time, 16 columns at a time, summed in registers over j.
QLINEAR_ROTATION_CLONES inline void rotate_rows(float* x, int64_t M, int64_t K, const float* d, int64_t block,
                                                const float* paley, int64_t p) {
  const int64_t n = block / p, chunk = std::min<int64_t>(32, M), w = 16;
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
