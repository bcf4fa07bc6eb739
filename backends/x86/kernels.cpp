// x86 kernels for 4-bit weights, uniform and free-α BCQ (layouts and arithmetic in qgemm.h).  Built with baseline flags: each SIMD
// path carries its own target attribute and runs only where cpuid reports its features.  Compiled with
// -ffp-contract=off so that every fp32 operation is the one written (the paths give the same bits).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "qgemm.h"

namespace qlinear_x86 {
namespace {

constexpr int kRows = 16;  // rows per block: one 32-bit lane each in a 512-bit register

inline int num_groups(const Weights& w) { return (w.K + w.group_size - 1) / w.group_size; }

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: man · 2^-24, exact
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- scalar: the arithmetic of qgemm.h, one lane at a time -----------------------------------------------------
void block_scalar(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  for (int m = 0; m < a.M; ++m) {
    float yv[kRows] = {};
    for (int g = 0; g < G; ++g) {
      float facc[kRows] = {};
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        int32_t iacc[kRows] = {};
        const int8_t* xq = a.xq + static_cast<int64_t>(m) * K + 32 * h;
        for (int c = 0; c < 4; ++c) {
          const uint8_t* v = qw + static_cast<int64_t>(4 * h + c) * 64;
          for (int r = 0; r < kRows; ++r)
            for (int j = 0; j < 4; ++j)
              iacc[r] += (v[4 * r + j] & 15) * xq[8 * c + j] + (v[4 * r + j] >> 4) * xq[8 * c + 4 + j];
        }
        const float xs = a.xs[static_cast<int64_t>(m) * H + h];
        for (int r = 0; r < kRows; ++r) facc[r] = std::fmaf(static_cast<float>(iacc[r]), xs, facc[r]);
      }
      const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
      const float xsum = a.xsum[static_cast<int64_t>(m) * G + g];
      for (int r = 0; r < kRows; ++r) {
        const float t = std::fmaf(-(static_cast<float>(w.qz[at + r]) * 0.5f), xsum, facc[r]);
        yv[r] = std::fmaf(half_to_float(w.qs[at + r]), t, yv[r]);
      }
    }
    for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
      const int n = kRows * b + r;
      y[static_cast<int64_t>(m) * w.N + n] = bias ? yv[r] + bias[n] : yv[r];
    }
  }
}

// ---- free-α BCQ 4-bit, scalar ------------------------------------------------------------------------------------
constexpr float kPlaneScale[4] = {2.0f, 1.0f, 0.5f, 0.25f};  // 2^(1−i): F_i holds 2^i·Σ bit_i·x̂

void block_scalar_bcq(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  for (int m = 0; m < a.M; ++m) {
    float yv[kRows] = {};
    for (int g = 0; g < G; ++g) {
      float F[4][kRows] = {};
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        int32_t acc[4][kRows] = {};
        const int8_t* xq = a.xq + static_cast<int64_t>(m) * K + 32 * h;
        for (int c = 0; c < 4; ++c) {
          const uint8_t* v = qw + static_cast<int64_t>(4 * h + c) * 64;
          for (int r = 0; r < kRows; ++r)
            for (int j = 0; j < 4; ++j)
              for (int i = 0; i < 4; ++i)
                acc[i][r] += (v[4 * r + j] & (1 << i)) * xq[8 * c + j] + ((v[4 * r + j] >> 4) & (1 << i)) * xq[8 * c + 4 + j];
        }
        const float xs = a.xs[static_cast<int64_t>(m) * H + h];
        for (int i = 0; i < 4; ++i)
          for (int r = 0; r < kRows; ++r) F[i][r] = std::fmaf(static_cast<float>(acc[i][r]), xs, F[i][r]);
      }
      const int64_t at = static_cast<int64_t>(b) * G + g;
      const float xsum = a.xsum[static_cast<int64_t>(m) * G + g];
      for (int r = 0; r < kRows; ++r) {
        float t = yv[r], c = half_to_float(w.qc[at * kRows + r]);
        for (int i = 0; i < 4; ++i) {
          const float al = half_to_float(w.qa[(at * 4 + i) * kRows + r]);
          t = std::fmaf(al * kPlaneScale[i], F[i][r], t);
          c = c - al;
        }
        yv[r] = std::fmaf(c, xsum, t);
      }
    }
    for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
      const int n = kRows * b + r;
      y[static_cast<int64_t>(m) * w.N + n] = bias ? yv[r] + bias[n] : yv[r];
    }
  }
}

// Independent int32 accumulator chains per activation row: VPDPBUSD's latency (~5 cycles) would otherwise bound a
// GEMV; integer sums are exact, so splitting them changes no bit.
template <int MT>
constexpr int chains() { return MT <= 2 ? 4 : MT <= 4 ? 2 : 1; }

// ---- AVX-512 VNNI: a block's 16 rows in one register, MT activation rows at a time -----------------------------
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_avx512(const Weights& w, const Acts& a,
                                                                                  const float* bias, float* y, int b,
                                                                                  int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 yv[MT];
  for (int m = 0; m < MT; ++m) yv[m] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 facc[MT];
    for (int m = 0; m < MT; ++m) facc[m] = _mm512_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      constexpr int A = chains<MT>();
      __m512i iacc[MT][A];
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < A; ++i) iacc[m][i] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qw + static_cast<int64_t>(4 * h + c) * 64);
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        const int i = A == 4 ? 2 * (c & 1) : 0, j = A == 1 ? i : i + 1;
        for (int m = 0; m < MT; ++m) {
          const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 8 * c;
          iacc[m][i] = _mm512_dpbusd_epi32(iacc[m][i], lo, _mm512_set1_epi32(load4(xp)));
          iacc[m][j] = _mm512_dpbusd_epi32(iacc[m][j], hi, _mm512_set1_epi32(load4(xp + 4)));
        }
      }
      for (int m = 0; m < MT; ++m) {
        __m512i sum = iacc[m][0];
        for (int k = 1; k < A; ++k) sum = _mm512_add_epi32(sum, iacc[m][k]);
        facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]),
                                  facc[m]);
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + at)));
    const __m512 z = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qz + at)))),
        _mm512_set1_ps(0.5f));
    for (int m = 0; m < MT; ++m) {
      const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]), facc[m]);
      yv[m] = _mm512_fmadd_ps(s, t, yv[m]);
    }
  }
  const int n0 = kRows * b;
  const __mmask16 keep = static_cast<__mmask16>(w.N - n0 >= kRows ? 0xFFFF : (1u << (w.N - n0)) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm512_mask_storeu_ps(y + static_cast<int64_t>(m0 + m) * w.N + n0, keep, bias ? _mm512_add_ps(yv[m], bv) : yv[m]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void block_avx512(const Weights& w, const Acts& a,
                                                                                   const float* bias, float* y, int b) {
  int m = 0;
  for (; m + 8 <= a.M; m += 8) tile_avx512<8>(w, a, bias, y, b, m);
  if (m + 4 <= a.M) {
    tile_avx512<4>(w, a, bias, y, b, m);
    m += 4;
  }
  switch (a.M - m) {
    case 3: tile_avx512<3>(w, a, bias, y, b, m); break;
    case 2: tile_avx512<2>(w, a, bias, y, b, m); break;
    case 1: tile_avx512<1>(w, a, bias, y, b, m); break;
    default: break;
  }
}

// ---- free-α BCQ 4-bit on AVX-512 VNNI: a VPDPBUSD per plane of the masked codes, MT ≤ 2 activation rows --------
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile_avx512_bcq(const Weights& w, const Acts& a,
                                                                                      const float* bias, float* y,
                                                                                      int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i plane[4];
  for (int i = 0; i < 4; ++i) plane[i] = _mm512_set1_epi8(static_cast<char>(1 << i));
  __m512 yv[MT];
  for (int m = 0; m < MT; ++m) yv[m] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 F[MT][4];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < 4; ++i) F[m][i] = _mm512_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m512i acc[MT][4];
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(qw + static_cast<int64_t>(4 * h + c) * 64);
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 8 * c;
          const __m512i xl = _mm512_set1_epi32(load4(xp)), xh = _mm512_set1_epi32(load4(xp + 4));
          for (int i = 0; i < 4; ++i) {
            acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], _mm512_and_si512(lo, plane[i]), xl);
            acc[m][i] = _mm512_dpbusd_epi32(acc[m][i], _mm512_and_si512(hi, plane[i]), xh);
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 xs = _mm512_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]);
        for (int i = 0; i < 4; ++i) F[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][i]), xs, F[m][i]);
      }
    }
    const int64_t at = static_cast<int64_t>(b) * G + g;
    __m512 c = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qc + at * kRows)));
    __m512 al[4];
    for (int i = 0; i < 4; ++i) {
      const __m512 ai = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qa + (at * 4 + i) * kRows)));
      al[i] = _mm512_mul_ps(ai, _mm512_set1_ps(kPlaneScale[i]));
      c = _mm512_sub_ps(c, ai);
    }
    for (int m = 0; m < MT; ++m) {
      __m512 t = yv[m];
      for (int i = 0; i < 4; ++i) t = _mm512_fmadd_ps(al[i], F[m][i], t);
      yv[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]), t);
    }
  }
  const int n0 = kRows * b;
  const __mmask16 keep = static_cast<__mmask16>(w.N - n0 >= kRows ? 0xFFFF : (1u << (w.N - n0)) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm512_mask_storeu_ps(y + static_cast<int64_t>(m0 + m) * w.N + n0, keep, bias ? _mm512_add_ps(yv[m], bv) : yv[m]);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void block_avx512_bcq(const Weights& w, const Acts& a,
                                                                                       const float* bias, float* y,
                                                                                       int b) {
  int m = 0;
  for (; m + 2 <= a.M; m += 2) tile_avx512_bcq<2>(w, a, bias, y, b, m);
  if (m < a.M) tile_avx512_bcq<1>(w, a, bias, y, b, m);
}

// ---- AVX2 (+ AVX-VNNI): the 16 rows as two 8-lane halves (bytes 0-31 and 32-63 of each chunk) ------------------
template <bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  if constexpr (VNNI) {
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
  } else {  // u8·s8 pairs into int16 (|15·127·2| < 2^15: no saturation), then pairs of those into int32
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
  }
}

template <int MT, bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) void tile_avx2(const Weights& w, const Acts& a, const float* bias,
                                                           float* y, int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 yv[MT][2];
  for (int m = 0; m < MT; ++m) yv[m][0] = yv[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256 facc[MT][2];
    for (int m = 0; m < MT; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m256i iacc[MT][2][2];  // [m][half][lo/hi]: independent chains
      for (int m = 0; m < MT; ++m)
        for (int half = 0; half < 2; ++half) iacc[m][half][0] = iacc[m][half][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const uint8_t* p = qw + static_cast<int64_t>(4 * h + c) * 64;
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
          const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 8 * c;
            iacc[m][half][0] = dot4<VNNI>(iacc[m][half][0], lo, _mm256_set1_epi32(load4(xp)));
            iacc[m][half][1] = dot4<VNNI>(iacc[m][half][1], hi, _mm256_set1_epi32(load4(xp + 4)));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m256 xs = _mm256_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]);
        for (int half = 0; half < 2; ++half)
          facc[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(iacc[m][half][0], iacc[m][half][1])),
                                          xs, facc[m][half]);
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
    alignas(32) float s[kRows];
    for (int r = 0; r < kRows; ++r) s[r] = half_to_float(w.qs[at + r]);
    for (int half = 0; half < 2; ++half) {
      const __m256 sv = _mm256_load_ps(s + 8 * half);
      const __m256 z = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qz + at + 8 * half)))),
          _mm256_set1_ps(0.5f));
      for (int m = 0; m < MT; ++m) {
        const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]),
                                          facc[m][half]);
        yv[m][half] = _mm256_fmadd_ps(sv, t, yv[m][half]);
      }
    }
  }
  const int n0 = kRows * b;
  for (int m = 0; m < MT; ++m) {
    alignas(32) float out[kRows];
    _mm256_store_ps(out, yv[m][0]);
    _mm256_store_ps(out + 8, yv[m][1]);
    for (int r = 0; r < kRows && n0 + r < w.N; ++r)
      y[static_cast<int64_t>(m0 + m) * w.N + n0 + r] = bias ? out[r] + bias[n0 + r] : out[r];
  }
}

template <bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) void block_avx2(const Weights& w, const Acts& a, const float* bias,
                                                            float* y, int b) {
  int m = 0;
  for (; m + 2 <= a.M; m += 2) tile_avx2<2, VNNI>(w, a, bias, y, b, m);
  if (m < a.M) tile_avx2<1, VNNI>(w, a, bias, y, b, m);
}

// Free-α BCQ 4-bit on AVX2: one 8-row half and one activation row at a time (4 plane accumulators, 4 sums).
template <bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) void block_avx2_bcq(const Weights& w, const Acts& a, const float* bias,
                                                                float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + static_cast<int64_t>(b) * (K / 8) * 64;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i plane[4];
  for (int i = 0; i < 4; ++i) plane[i] = _mm256_set1_epi8(static_cast<char>(1 << i));
  const int n0 = kRows * b;
  for (int m = 0; m < a.M; ++m) {
    for (int half = 0; half < 2; ++half) {
      __m256 yv = _mm256_setzero_ps();
      for (int g = 0; g < G; ++g) {
        __m256 F[4];
        for (int i = 0; i < 4; ++i) F[i] = _mm256_setzero_ps();
        const int h1 = std::min((g + 1) * w.group_size, K) / 32;
        for (int h = g * w.group_size / 32; h < h1; ++h) {
          __m256i acc[4];
          for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_si256();
          const int8_t* xp = a.xq + static_cast<int64_t>(m) * K + 32 * h;
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(qw + static_cast<int64_t>(4 * h + c) * 64 + 32 * half));
            const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            const __m256i xl = _mm256_set1_epi32(load4(xp + 8 * c)), xh = _mm256_set1_epi32(load4(xp + 8 * c + 4));
            for (int i = 0; i < 4; ++i) {
              acc[i] = dot4<VNNI>(acc[i], _mm256_and_si256(lo, plane[i]), xl);
              acc[i] = dot4<VNNI>(acc[i], _mm256_and_si256(hi, plane[i]), xh);
            }
          }
          const __m256 xs = _mm256_set1_ps(a.xs[static_cast<int64_t>(m) * H + h]);
          for (int i = 0; i < 4; ++i) F[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), xs, F[i]);
        }
        const int64_t at = static_cast<int64_t>(b) * G + g;
        alignas(32) float vals[5][8];
        for (int r = 0; r < 8; ++r) {
          for (int i = 0; i < 4; ++i) vals[i][r] = half_to_float(w.qa[(at * 4 + i) * kRows + 8 * half + r]);
          vals[4][r] = half_to_float(w.qc[at * kRows + 8 * half + r]);
        }
        __m256 c = _mm256_load_ps(vals[4]), t = yv;
        for (int i = 0; i < 4; ++i) {
          const __m256 ai = _mm256_load_ps(vals[i]);
          t = _mm256_fmadd_ps(_mm256_mul_ps(ai, _mm256_set1_ps(kPlaneScale[i])), F[i], t);
          c = _mm256_sub_ps(c, ai);
        }
        yv = _mm256_fmadd_ps(c, _mm256_set1_ps(a.xsum[static_cast<int64_t>(m) * G + g]), t);
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, yv);
      for (int r = 0; r < 8 && n0 + 8 * half + r < w.N; ++r) {
        const int n = n0 + 8 * half + r;
        y[static_cast<int64_t>(m) * w.N + n] = bias ? out[r] + bias[n] : out[r];
      }
    }
  }
}

}  // namespace

int64_t acts_bytes(int M, int K, int group_size) {
  const int64_t G = (K + group_size - 1) / group_size;
  return ((static_cast<int64_t>(M) * K + 15) / 16) * 16 + 4 * static_cast<int64_t>(M) * (K / 32 + G);
}

void prepare_acts(const float* x, int M, int K, int group_size, void* work, Acts* a) {
  const int H = K / 32, G = (K + group_size - 1) / group_size;
  int8_t* xq = static_cast<int8_t*>(work);
  float* xs = reinterpret_cast<float*>(xq + ((static_cast<int64_t>(M) * K + 15) / 16) * 16);
  float* xsum = xs + static_cast<int64_t>(M) * H;
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      const int h1 = std::min((g + 1) * group_size, K) / 32;
      for (int h = g * group_size / 32; h < h1; ++h) {
        const float* xp = x + static_cast<int64_t>(m) * K + 32 * h;
        float amax = 0.0f;
        for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xp[k]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int qsum = 0;
        for (int k = 0; k < 32; ++k) {
          const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(xp[k] * inv)));
          xq[static_cast<int64_t>(m) * K + 32 * h + k] = static_cast<int8_t>(q);
          qsum += static_cast<int>(q);
        }
        const float scale = amax / 127.0f;
        xs[static_cast<int64_t>(m) * H + h] = scale;
        const float t = scale * static_cast<float>(qsum);
        acc = acc + t;
      }
      xsum[static_cast<int64_t>(m) * G + g] = acc;
    }
  }
  a->xq = xq;
  a->xs = xs;
  a->xsum = xsum;
  a->M = M;
}

bool path_supported(int path) {
  switch (path) {
    case kScalar: return true;
    case kAVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAVX2VNNI: return path_supported(kAVX2) && __builtin_cpu_supports("avxvnni");
    case kAVX512VNNI:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int best_path() {
  static const int best = path_supported(kAVX512VNNI) ? kAVX512VNNI
                          : path_supported(kAVX2VNNI) ? kAVX2VNNI
                          : path_supported(kAVX2)     ? kAVX2
                                                      : kScalar;
  return best;
}

void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path) {
  if (path == kAuto) path = best_path();
  if (w.format == kBCQ4) {
    for (int b = b0; b < b1; ++b) {
      switch (path) {
        case kAVX512VNNI: block_avx512_bcq(w, a, bias, y, b); break;
        case kAVX2VNNI: block_avx2_bcq<true>(w, a, bias, y, b); break;
        case kAVX2: block_avx2_bcq<false>(w, a, bias, y, b); break;
        default: block_scalar_bcq(w, a, bias, y, b); break;
      }
    }
    return;
  }
  for (int b = b0; b < b1; ++b) {
    switch (path) {
      case kAVX512VNNI: block_avx512(w, a, bias, y, b); break;
      case kAVX2VNNI: block_avx2<true>(w, a, bias, y, b); break;
      case kAVX2: block_avx2<false>(w, a, bias, y, b); break;
      default: block_scalar(w, a, bias, y, b); break;
    }
  }
}

}  // namespace qlinear_x86
