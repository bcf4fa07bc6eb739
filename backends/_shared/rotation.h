// The randomized Hadamard input transform of a rotated layer (qlinear/formats/rotation.py is its definition and
// PyTorch reference), for the native kernels that stage x themselves: applied to a row before it is quantized or
// loaded, instead of a separate pass over x in PyTorch.  Torch-free; header-only.
//
//   row v [K] -> R·v, R = blockdiag(H_b, ..., H_b)·D:  v[k] *= D[k] (lowbias32 sign of (seed, k)), then per block of b
//   inputs viewed as [p, n] (b = p·n, n a power of two): a Sylvester H_n (radix-2 butterflies) on each of the p rows,
//   the Paley factor (±1 [p, p], from the Python side) on each of the n columns, and 1/√b.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace qlinear_rotation {

// D[k]: bit 31 of Wellons' lowbias32 of (k + seed·0x9E3779B9) mod 2^32 set -> −1.
inline float sign(uint32_t seed, uint32_t k) {
  uint32_t h = k + seed * 0x9E3779B9u;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return (h >> 31) ? -1.0f : 1.0f;
}

// Rotate the M rows of x [M, K] (row stride K) in place.  paley: ±1 int8 [p, p] row-major, or null when p == 1.
inline void rotate_rows(float* x, int64_t M, int64_t K, uint32_t seed, int64_t block, const int8_t* paley, int64_t p) {
  const int64_t n = block / p;
  const float scale = 1.0f / std::sqrt((float)block);
  std::vector<float> d(K), tmp(p > 1 ? block : 0);
  for (int64_t k = 0; k < K; ++k) d[k] = sign(seed, (uint32_t)k) * scale;  // the 1/√b folded into the signs
  for (int64_t m = 0; m < M; ++m) {
    float* row = x + m * K;
    for (int64_t k = 0; k < K; ++k) row[k] *= d[k];
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      float* v = row + b0;
      for (int64_t r = 0; r < p; ++r) {  // H_n on each row of [p, n]
        float* u = v + r * n;
        for (int64_t h = 1; h < n; h *= 2)
          for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; ++j) {
              const float a = u[j], c = u[j + h];
              u[j] = a + c;
              u[j + h] = a - c;
            }
      }
      if (p > 1) {  // H_p on each column: tmp[i, :] = Σ_j P[i][j]·v[j, :]
        for (int64_t i = 0; i < p; ++i) {
          float* t = tmp.data() + i * n;
          for (int64_t c = 0; c < n; ++c) t[c] = 0.0f;
          for (int64_t j = 0; j < p; ++j) {
            const float s = paley[i * p + j];
            const float* src = v + j * n;
            for (int64_t c = 0; c < n; ++c) t[c] += s * src[c];
          }
        }
        for (int64_t k = 0; k < block; ++k) v[k] = tmp[k];
      }
    }
  }
}

}  // namespace qlinear_rotation
