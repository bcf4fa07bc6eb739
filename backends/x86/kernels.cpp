// x86 kernels for uniform 4-bit codes, BCQ bit-planes and codebooks (layouts and arithmetic in qgemm.h).  Built
// with baseline flags: each SIMD
// path carries its own target attribute and runs only where cpuid reports its features.  Compiled with
// -ffp-contract=off so that every fp32 operation is the one written (the paths give the same bits).
#ifdef QLINEAR_X86_SIMDE
// Tests only: every path through SIMDe's portable intrinsics, so that a CPU without AVX-512 or AVX-VNNI checks
// those paths' arithmetic against the others (tests/test_x86.py).
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32
#define _mm512_cvtepu8_epi32(a) _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(a))  // not in SIMDe 0.8
#define _mm512_cvtepu8_epi16(a)                                                  \
  _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a))), \
                     _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)), 1)  // not in SIMDe 0.8
inline void simde_store_masked(float* p, simde__mmask16 k, simde__m512 a) {  // SIMDe 0.8 writes all 16 lanes
  alignas(64) float v[16];
  simde_mm512_store_ps(v, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) p[i] = v[i];
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) simde_store_masked(p, k, a)
inline simde__m512 simde_load_masked(simde__mmask16 k, const float* p) {  // SIMDe 0.8 reads all 16 lanes
  alignas(64) float v[16] = {};
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) v[i] = p[i];
  return simde_mm512_load_ps(v);
}
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) simde_load_masked(k, p)
#define QLINEAR_TARGET(features)
#define QLINEAR_HAS(feature) true
#else
#include <immintrin.h>
#define QLINEAR_TARGET(features) __attribute__((target(features)))
#define QLINEAR_HAS(feature) __builtin_cpu_supports(feature)
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../_shared/act_quant.h"
#include "bf16.h"
#include "qgemm.h"

namespace qlinear_x86 {

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

namespace {

constexpr int kRows = 16;  // rows per block: one 32-bit lane each in a 512-bit register

inline int num_groups(const Weights& w) { return (w.K + w.group_size - 1) / w.group_size; }


inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Bytes of a kUniform layer's 16-row block: K/8 chunks of 64 at 4 bits, K/4 at 8 bits.
inline int64_t codes_block(const Weights& w, int b) { return static_cast<int64_t>(b) * w.K * w.bits * 2; }

// 2·z of a uniform layer's row at index i of qz (qz16 at 8 bits).
inline float zero2(const Weights& w, int64_t i) {
  return static_cast<float>(w.qz16 ? w.qz16[i] : w.qz[i]);
}

// ---- scalar: the arithmetic of qgemm.h, one lane at a time -----------------------------------------------------
void block_scalar(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + codes_block(w, b);
  for (int m = 0; m < a.M; ++m) {
    float yv[kRows] = {};
    for (int g = 0; g < G; ++g) {
      float facc[kRows] = {};
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        int32_t iacc[kRows] = {};
        const int8_t* xq = a.xq + static_cast<int64_t>(m) * K + 32 * h;
        if (w.bits == 8) {
          for (int c = 0; c < 8; ++c) {
            const uint8_t* v = qw + static_cast<int64_t>(8 * h + c) * 64;
            for (int r = 0; r < kRows; ++r)
              for (int j = 0; j < 4; ++j) iacc[r] += v[4 * r + j] * xq[4 * c + j];
          }
        } else {
          for (int c = 0; c < 4; ++c) {
            const uint8_t* v = qw + static_cast<int64_t>(4 * h + c) * 64;
            for (int r = 0; r < kRows; ++r)
              for (int j = 0; j < 4; ++j)
                iacc[r] += (v[4 * r + j] & 15) * xq[8 * c + j] + (v[4 * r + j] >> 4) * xq[8 * c + 4 + j];
          }
        }
        const float xs = a.xs[static_cast<int64_t>(m) * H + h];
        for (int r = 0; r < kRows; ++r) facc[r] = std::fmaf(static_cast<float>(iacc[r]), xs, facc[r]);
      }
      const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
      const float xsum = a.xsum[static_cast<int64_t>(m) * G + g];
      for (int r = 0; r < kRows; ++r) {
        const float t = std::fmaf(-(zero2(w, at + r) * 0.5f), xsum, facc[r]);
        yv[r] = std::fmaf(half_to_float(w.qs[at + r]), t, yv[r]);
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

// y[m0 + m][16b + r] = yv[m] lane r (+ bias), for the block's rows below N.
template <int MT>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") inline void store_avx512(const Weights& w, const float* bias,
                                                                                  float* y, int b, int m0,
                                                                                  const __m512* yv) {
  const int n0 = kRows * b;
  const __mmask16 keep = static_cast<__mmask16>(w.N - n0 >= kRows ? 0xFFFF : (1u << (w.N - n0)) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m)
    _mm512_mask_storeu_ps(y + static_cast<int64_t>(m0 + m) * w.N + n0, keep, bias ? _mm512_add_ps(yv[m], bv) : yv[m]);
}

// The same from two 8-lane halves per activation row.
template <int MT>
QLINEAR_TARGET("avx2,fma,f16c") inline void store_avx2(const Weights& w, const float* bias, float* y, int b, int m0,
                                                        const __m256 (*yv)[2]) {
  const int n0 = kRows * b;
  for (int m = 0; m < MT; ++m) {
    alignas(32) float out[kRows];
    _mm256_store_ps(out, yv[m][0]);
    _mm256_store_ps(out + 8, yv[m][1]);
    for (int r = 0; r < kRows && n0 + r < w.N; ++r)
      y[static_cast<int64_t>(m0 + m) * w.N + n0 + r] = bias ? out[r] + bias[n0 + r] : out[r];
  }
}

// zero2 of the block's 16 rows at qz index at.
QLINEAR_TARGET("avx512f,avx512bw,avx512vl") inline __m512 zeros2_avx512(const Weights& w, int64_t at) {
  return _mm512_cvtepi32_ps(w.qz16 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qz16 + at)))
                                   : _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qz + at))));
}

// The end of group g of a uniform layer: yv[m] += s·(F[m] − z·xsum[m][g]) (qgemm.h), the block's 16 rows at once.
template <int MT>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") inline void uniform_group_end(const Weights& w, const Acts& a,
                                                                                       int b, int g, int m0,
                                                                                       const __m512* F, __m512* yv) {
  const int G = num_groups(w);
  const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + at)));
  const __m512 z = _mm512_mul_ps(zeros2_avx512(w, at), _mm512_set1_ps(0.5f));
  for (int m = 0; m < MT; ++m) {
    const __m512 t = _mm512_fnmadd_ps(z, _mm512_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]), F[m]);
    yv[m] = _mm512_fmadd_ps(s, t, yv[m]);
  }
}

// facc[m] += xs[m0 + m][h]·(the sum of iacc[m]'s chains).
template <int MT, int A>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") inline void fold(const __m512i (&iacc)[MT][A], __m512* facc,
                                                                          const Acts& a, int H, int m0, int h) {
  for (int m = 0; m < MT; ++m) {
    __m512i sum = iacc[m][0];
    for (int k = 1; k < A; ++k) sum = _mm512_add_epi32(sum, iacc[m][k]);
    facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]), facc[m]);
  }
}

// ---- AVX-512 VNNI: a block's 16 rows in one register, MT activation rows at a time -----------------------------
template <int MT, bool U8>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") void tile_avx512(const Weights& w, const Acts& a,
                                                                                  const float* bias, float* y, int b,
                                                                                  int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + codes_block(w, b);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  constexpr int A = chains<MT>();
  __m512 yv[MT] = {};
  for (int g = 0; g < G; ++g) {
    __m512 facc[MT] = {};
    for (int h = g * w.group_size / 32, h1 = std::min((g + 1) * w.group_size, K) / 32; h < h1; ++h) {
      __m512i iacc[MT][A] = {};
      for (int c = 0; U8 && c < 8; ++c) {  // a chunk's 64 bytes: 4 codes of each row, one VPDPBUSD per row of x
        const __m512i v = _mm512_loadu_si512(qw + static_cast<int64_t>(8 * h + c) * 64);
        for (int m = 0; m < MT; ++m)
          iacc[m][c % A] = _mm512_dpbusd_epi32(
              iacc[m][c % A], v, _mm512_set1_epi32(load4(a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 4 * c)));
      }
      for (int c = 0; !U8 && c < 4; ++c) {  // a chunk's 64 bytes: 8 codes of each row as nibbles
        const __m512i v = _mm512_loadu_si512(qw + static_cast<int64_t>(4 * h + c) * 64);
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        const int i = A == 4 ? 2 * (c & 1) : 0, j = A == 1 ? i : i + 1;
        for (int m = 0; m < MT; ++m) {  // lo and hi per row: this order measured ~7 % faster at 8 rows than rows first
          const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 8 * c;
          iacc[m][i] = _mm512_dpbusd_epi32(iacc[m][i], lo, _mm512_set1_epi32(load4(xp)));
          iacc[m][j] = _mm512_dpbusd_epi32(iacc[m][j], hi, _mm512_set1_epi32(load4(xp + 4)));
        }
      }
      fold<MT, A>(iacc, facc, a, H, m0, h);
    }
    uniform_group_end<MT>(w, a, b, g, m0, facc, yv);
  }
  store_avx512<MT>(w, bias, y, b, m0, yv);
}

template <bool U8>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") void block_avx512(const Weights& w, const Acts& a,
                                                                                   const float* bias, float* y, int b) {
  int m = 0;
  for (; m + 8 <= a.M; m += 8) tile_avx512<8, U8>(w, a, bias, y, b, m);
  if (m + 4 <= a.M) {
    tile_avx512<4, U8>(w, a, bias, y, b, m);
    m += 4;
  }
  switch (a.M - m) {
    case 3: tile_avx512<3, U8>(w, a, bias, y, b, m); break;
    case 2: tile_avx512<2, U8>(w, a, bias, y, b, m); break;
    case 1: tile_avx512<1, U8>(w, a, bias, y, b, m); break;
    default: break;
  }
}

// ---- AVX2 (+ AVX-VNNI): the 16 rows as two 8-lane halves (bytes 0-31 and 32-63 of each chunk) ------------------
template <bool VNNI>
QLINEAR_TARGET("avx2,fma,f16c,avxvnni") inline __m256i dot4(__m256i acc, __m256i u8, __m256i s8) {
  if constexpr (VNNI) {
    return _mm256_dpbusd_avx_epi32(acc, u8, s8);
  } else {  // u8·s8 pairs into int16 (|15·127·2| < 2^15: no saturation), then pairs of those into int32
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
  }
}

template <int MT, bool VNNI, bool U8>
QLINEAR_TARGET("avx2,fma,f16c,avxvnni") void tile_avx2(const Weights& w, const Acts& a, const float* bias,
                                                           float* y, int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + codes_block(w, b);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  // 8-bit codes without VNNI: chain 1 sums the high nibbles' products, weighed 16 when the chains are added
  constexpr int kHiShift = U8 && !VNNI ? 4 : 0;
  __m256 yv[MT][2];
  for (int m = 0; m < MT; ++m) yv[m][0] = yv[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256 facc[MT][2];
    for (int m = 0; m < MT; ++m) facc[m][0] = facc[m][1] = _mm256_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m256i iacc[MT][2][2];  // [m][half][chain]: independent chains
      for (int m = 0; m < MT; ++m)
        for (int half = 0; half < 2; ++half) iacc[m][half][0] = iacc[m][half][1] = _mm256_setzero_si256();
      for (int c = 0; c < (U8 ? 8 : 4); ++c) {
        const uint8_t* p = qw + static_cast<int64_t>((U8 ? 8 : 4) * h + c) * 64;
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
          if constexpr (U8 && VNNI) {
            for (int m = 0; m < MT; ++m)
              iacc[m][half][c & 1] = _mm256_dpbusd_avx_epi32(
                  iacc[m][half][c & 1], v,
                  _mm256_set1_epi32(load4(a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 4 * c)));
            continue;
          }
          const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + (U8 ? 4 : 8) * c;
            iacc[m][half][0] = dot4<VNNI>(iacc[m][half][0], lo, _mm256_set1_epi32(load4(xp)));
            iacc[m][half][1] = dot4<VNNI>(iacc[m][half][1], hi, _mm256_set1_epi32(load4(xp + (U8 ? 0 : 4))));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m256 xs = _mm256_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]);
        for (int half = 0; half < 2; ++half)
          facc[m][half] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(_mm256_add_epi32(iacc[m][half][0], _mm256_slli_epi32(iacc[m][half][1], kHiShift))),
              xs, facc[m][half]);
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
    for (int half = 0; half < 2; ++half) {
      const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + at + 8 * half)));
      const __m128i z2 = U8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qz16 + at + 8 * half))
                            : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qz + at + 8 * half));
      const __m256 z = _mm256_mul_ps(_mm256_cvtepi32_ps(U8 ? _mm256_cvtepu16_epi32(z2) : _mm256_cvtepu8_epi32(z2)),
                                     _mm256_set1_ps(0.5f));
      for (int m = 0; m < MT; ++m) {
        const __m256 t = _mm256_fnmadd_ps(z, _mm256_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]),
                                          facc[m][half]);
        yv[m][half] = _mm256_fmadd_ps(sv, t, yv[m][half]);
      }
    }
  }
  store_avx2<MT>(w, bias, y, b, m0, yv);
}

template <bool VNNI, bool U8>
QLINEAR_TARGET("avx2,fma,f16c,avxvnni") void block_avx2(const Weights& w, const Acts& a, const float* bias,
                                                            float* y, int b) {
  int m = 0;
  for (; m + 2 <= a.M; m += 2) tile_avx2<2, VNNI, U8>(w, a, bias, y, b, m);
  if (m < a.M) tile_avx2<1, VNNI, U8>(w, a, bias, y, b, m);
}

// ---- LUT formats: plane sums S_i from the activation tables (qgemm.h) -------------------------------------------
constexpr int kMaxBits = 4;

inline int64_t lut_block(const Weights& w, int b) { return static_cast<int64_t>(b) * (w.K / 32) * w.bits * 64; }

// The per-group epilogue on one lane (scalar path); the SIMD paths do the same operations lane-wise.
inline float lut_epilogue(const Weights& w, int64_t at, int r, const float* F, float xsum, float y) {
  if (w.format == kLutUniform) {
    const float t = std::fmaf(-(static_cast<float>(w.qz[at * kRows + r]) * 0.5f), xsum, F[0]);
    return std::fmaf(half_to_float(w.qs[at * kRows + r]), t, y);
  }
  float c = half_to_float(w.qc[at * kRows + r]);
  for (int i = 0; i < w.bits; ++i) {
    const float al = half_to_float(w.qs[(at * w.bits + i) * kRows + r]);
    y = std::fmaf(al + al, F[i], y);
    c = c - al;
  }
  return std::fmaf(c, xsum, y);
}

void block_scalar_lut(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w), B = w.bits;
  const uint8_t* lp = w.qw + lut_block(w, b);
  for (int m = 0; m < a.M; ++m) {
    float yv[kRows] = {};
    for (int g = 0; g < G; ++g) {
      float F[kRows][kMaxBits] = {};
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        const int8_t* T = a.tables + (static_cast<int64_t>(m) * H + h) * 256;
        const float xs = a.xs[static_cast<int64_t>(m) * H + h];
        for (int r = 0; r < kRows; ++r) {
          int32_t S[kMaxBits] = {};
          for (int i = 0; i < B; ++i) {
            const uint8_t* v = lp + (static_cast<int64_t>(h) * B + i) * 64 + r;
            for (int gg = 0; gg < 4; ++gg) {
              const int lo = (v[16 * gg] & 15) | (gg << 4), hi = (v[16 * gg] >> 4) | (gg << 4);
              S[i] += T[lo] + 16 * T[64 + lo] + T[128 + hi] + 16 * T[192 + hi];
            }
          }
          if (w.format == kLutUniform) {
            int32_t I = 0;
            for (int i = 0; i < B; ++i) I += S[i] * (1 << i);
            F[r][0] = std::fmaf(static_cast<float>(I), xs, F[r][0]);
          } else {
            for (int i = 0; i < B; ++i) F[r][i] = std::fmaf(static_cast<float>(S[i]), xs, F[r][i]);
          }
        }
      }
      const int64_t at = static_cast<int64_t>(b) * G + g;
      const float xsum = a.xsum[static_cast<int64_t>(m) * G + g];
      for (int r = 0; r < kRows; ++r) yv[r] = lut_epilogue(w, at, r, F[r], xsum, yv[r]);
    }
    for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
      const int n = kRows * b + r;
      y[static_cast<int64_t>(m) * w.N + n] = bias ? yv[r] + bias[n] : yv[r];
    }
  }
}

// AVX-512 VBMI: a VPERMB moves byte 16q + r of a plane to 4r + q, so that after the lookups (VPERMB of the nibbles
// in a 64-byte table: 4 groups of 16 entries) VPDPBUSD adds the 4 lookups of each row (×1 for the lo table, ×16 for
// the hi table).  MT activation rows share each plane load.
#define QLINEAR_AVX512_LUT QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")

QLINEAR_AVX512_LUT inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int MT, int B>
QLINEAR_AVX512_LUT void tile_avx512_lut(const Weights& w, const Acts& a, const float* bias, float* y, int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const bool uniform = w.format == kLutUniform;
  const uint8_t* lp = w.qw + lut_block(w, b);
  // after the reordering, byte 4r + g of a register is row r, group g; gid puts g << 4 there
  const __m512i nib = _mm512_set1_epi8(0x0F), gid = _mm512_set1_epi32(0x30201000);
  const __m512i one = _mm512_set1_epi8(1), sixteen = _mm512_set1_epi8(16);
  alignas(64) int8_t order[64];
  for (int e = 0; e < 64; ++e) order[e] = static_cast<int8_t>(16 * (e % 4) + e / 4);
  const __m512i to_rows = _mm512_load_si512(order);
  __m512 yv[MT];
  for (int m = 0; m < MT; ++m) yv[m] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512 F[MT][B];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < B; ++i) F[m][i] = _mm512_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m512i acc[MT][B];
      for (int i = 0; i < B; ++i) {
        const __m512i v = _mm512_permutexvar_epi8(to_rows, _mm512_loadu_si512(lp + (static_cast<int64_t>(h) * B + i) * 64));
        // (v & 0x0F) | gid: ternary-logic truth table 0xEA = (A & B) | C with A = v, B = nib, C = gid
        const __m512i ilo = _mm512_ternarylogic_epi32(v, nib, gid, 0xEA);
        const __m512i ihi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nib, gid, 0xEA);
        for (int m = 0; m < MT; ++m) {
          const int8_t* T = a.tables + (static_cast<int64_t>(m0 + m) * H + h) * 256;
          __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), one, _mm512_permutexvar_epi8(ilo, _mm512_loadu_si512(T)));
          __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), one, _mm512_permutexvar_epi8(ihi, _mm512_loadu_si512(T + 128)));
          s = _mm512_dpbusd_epi32(s, sixteen, _mm512_permutexvar_epi8(ilo, _mm512_loadu_si512(T + 64)));
          t = _mm512_dpbusd_epi32(t, sixteen, _mm512_permutexvar_epi8(ihi, _mm512_loadu_si512(T + 192)));
          acc[m][i] = _mm512_add_epi32(s, t);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 xs = _mm512_set1_ps(a.xs[static_cast<int64_t>(m0 + m) * H + h]);
        if (uniform) {
          __m512i I = acc[m][0];
          for (int i = 1; i < B; ++i) I = _mm512_add_epi32(I, _mm512_slli_epi32(acc[m][i], i));
          F[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), xs, F[m][0]);
        } else {
          for (int i = 0; i < B; ++i) F[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][i]), xs, F[m][i]);
        }
      }
    }
    const int64_t at = static_cast<int64_t>(b) * G + g;
    if (uniform) {
      __m512 F0[MT];
      for (int m = 0; m < MT; ++m) F0[m] = F[m][0];
      uniform_group_end<MT>(w, a, b, g, m0, F0, yv);
    } else {
      __m512 al[B], c = half16(w.qc + at * kRows);
      for (int i = 0; i < B; ++i) {
        al[i] = half16(w.qs + (at * B + i) * kRows);
        c = _mm512_sub_ps(c, al[i]);
      }
      for (int m = 0; m < MT; ++m) {
        __m512 t = yv[m];
        for (int i = 0; i < B; ++i) t = _mm512_fmadd_ps(_mm512_add_ps(al[i], al[i]), F[m][i], t);
        yv[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(a.xsum[static_cast<int64_t>(m0 + m) * G + g]), t);
      }
    }
  }
  store_avx512<MT>(w, bias, y, b, m0, yv);
}

// Uniform bit-planes, several activation rows at a time: a block's B planes of 32 inputs become codes Σ 2^i·bit_i in
// the uniform 4-bit kernel's VPDPBUSD order (per plane and 4 inputs of the 16 rows: one VPERMB spreads each row's
// nibble pair over its lane, a VPTESTMB per half picks bit j for byte j, a masked add weighs it 2^i), shared by MT
// rows.  I = Σ code·xq is the lookups' Σ 2^i·S_i, the same int32, so the same bits; per row it costs one VPDPBUSD per
// 64 weights where the lookups take B·(2 VPERMB + 2 VPDPBUSD) per 256, and the decoding is paid once per MT rows.
struct PlaneSpread {
  alignas(64) uint8_t idx[4][64];  // idx[q]: byte 4r + j <- byte 16q + r
};
constexpr PlaneSpread plane_spread() {
  PlaneSpread t{};
  for (int q = 0; q < 4; ++q)
    for (int e = 0; e < 64; ++e) t.idx[q][e] = static_cast<uint8_t>(16 * q + e / 4);
  return t;
}
constexpr PlaneSpread kPlaneSpread = plane_spread();

template <int MT, int B>
QLINEAR_AVX512_LUT void tile_avx512_planes(const Weights& w, const Acts& a, const float* bias, float* y, int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* lp = w.qw + lut_block(w, b);
  const __m512i bit[2] = {_mm512_set1_epi32(0x08040201), _mm512_set1_epi32(static_cast<int>(0x80402010u))};
  constexpr int A = chains<MT>();
  __m512 yv[MT] = {};
  for (int g = 0; g < G; ++g) {
    __m512 facc[MT] = {};
    for (int h = g * w.group_size / 32, h1 = std::min((g + 1) * w.group_size, K) / 32; h < h1; ++h) {
      __m512i iacc[MT][A] = {};
      const uint8_t* pl = lp + static_cast<int64_t>(h) * B * 64;
      for (int q = 0; q < 4; ++q) {
        const __m512i idx = _mm512_load_si512(kPlaneSpread.idx[q]);
        __m512i X[B];
        for (int i = 0; i < B; ++i) X[i] = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(pl + i * 64));
        __m512i code[2];
        for (int half = 0; half < 2; ++half) {
          code[half] = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(X[0], bit[half]), _mm512_set1_epi8(1));
          for (int i = 1; i < B; ++i)
            code[half] = _mm512_mask_add_epi8(code[half], _mm512_test_epi8_mask(X[i], bit[half]), code[half],
                                              _mm512_set1_epi8(1 << i));
        }
        const int i = (2 * q) % A, j = (2 * q + 1) % A;
        for (int m = 0; m < MT; ++m) {  // both halves per row, as tile_avx512
          const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 4 * q;
          iacc[m][i] = _mm512_dpbusd_epi32(iacc[m][i], code[0], _mm512_set1_epi32(load4(xp)));
          iacc[m][j] = _mm512_dpbusd_epi32(iacc[m][j], code[1], _mm512_set1_epi32(load4(xp + 16)));
        }
      }
      fold<MT, A>(iacc, facc, a, H, m0, h);
    }
    uniform_group_end<MT>(w, a, b, g, m0, facc, yv);
  }
  store_avx512<MT>(w, bias, y, b, m0, yv);
}

template <int B>
QLINEAR_AVX512_LUT void block_avx512_lut_bits(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  constexpr int MT = B <= 2 ? 4 : 2;  // registers: MT·B int32 sums and MT·B fp32 group sums
  int m = 0;
  if (w.format == kLutUniform) {
    for (; m + 8 <= a.M; m += 8) tile_avx512_planes<8, B>(w, a, bias, y, b, m);
    if (m + 4 <= a.M) {
      tile_avx512_planes<4, B>(w, a, bias, y, b, m);
      m += 4;
    }
  }
  for (; m + MT <= a.M; m += MT) tile_avx512_lut<MT, B>(w, a, bias, y, b, m);
  for (; m < a.M; ++m) tile_avx512_lut<1, B>(w, a, bias, y, b, m);
}

QLINEAR_AVX512_LUT void block_avx512_lut(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  switch (w.bits) {
    case 1: block_avx512_lut_bits<1>(w, a, bias, y, b); break;
    case 2: block_avx512_lut_bits<2>(w, a, bias, y, b); break;
    case 3: block_avx512_lut_bits<3>(w, a, bias, y, b); break;
    default: block_avx512_lut_bits<4>(w, a, bias, y, b); break;
  }
}

// AVX2: VPSHUFB looks 32 nibbles up at once, lane 0 in one group's 16-entry table and lane 1 in the next group's
// (the layout puts 16 rows of one group in each 16 bytes).  Per plane and 32 inputs: 8 lookups, added in pairs
// (lo-table sums ≤ 120, hi-table sums ≥ −64: int8), interleaved lo/hi per row and weighted 1/16 by VPMADDUBSW into
// int16; the two lanes' groups are added at the end of the 32 inputs.  AVX-VNNI would not help: nothing here is a
// 4-byte dot product.  One activation row at a time, the group epilogue per lane as the scalar path computes it.
template <int B>
QLINEAR_TARGET("avx2,fma,f16c") void block_avx2_lut(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* lp = w.qw + lut_block(w, b);
  const __m256i nib = _mm256_set1_epi8(0x0F), weights = _mm256_set1_epi16(0x1001);  // bytes (1, 16)
  for (int m = 0; m < a.M; ++m) {
    __m256 yv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int g = 0; g < G; ++g) {
      __m256 f[B][2];
      for (int i = 0; i < B; ++i) f[i][0] = f[i][1] = _mm256_setzero_ps();
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        const int8_t* T = a.tables + (static_cast<int64_t>(m) * H + h) * 256;
        // 32 bytes k = 2·(2·half + part) + q2 of the tables: groups 2·q2, 2·q2 + 1 of inputs 16·half.. (part 0: lo)
        __m256i tab[8];
        for (int k = 0; k < 8; ++k) tab[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(T + 32 * k));
        const __m256i lo00 = tab[0], lo01 = tab[1], hi00 = tab[2], hi01 = tab[3];
        const __m256i lo10 = tab[4], lo11 = tab[5], hi10 = tab[6], hi11 = tab[7];
        const __m256 xs = _mm256_set1_ps(a.xs[static_cast<int64_t>(m) * H + h]);
        __m256i S[B][2];
        for (int i = 0; i < B; ++i) {
          const uint8_t* p = lp + (static_cast<int64_t>(h) * B + i) * 64;
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
          const __m256i n0 = _mm256_and_si256(v0, nib), n1 = _mm256_and_si256(v1, nib);  // inputs 0..15
          const __m256i m0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib);                // inputs 16..31
          const __m256i m1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
          const __m256i slo = _mm256_add_epi8(_mm256_shuffle_epi8(lo00, n0), _mm256_shuffle_epi8(lo01, n1));
          const __m256i shi = _mm256_add_epi8(_mm256_shuffle_epi8(hi00, n0), _mm256_shuffle_epi8(hi01, n1));
          const __m256i tlo = _mm256_add_epi8(_mm256_shuffle_epi8(lo10, m0), _mm256_shuffle_epi8(lo11, m1));
          const __m256i thi = _mm256_add_epi8(_mm256_shuffle_epi8(hi10, m0), _mm256_shuffle_epi8(hi11, m1));
          // int16 per (row, lane): rows 0-7 from the low halves of the lanes, rows 8-15 from the high halves
          const __m256i r07 = _mm256_add_epi16(_mm256_maddubs_epi16(weights, _mm256_unpacklo_epi8(slo, shi)),
                                               _mm256_maddubs_epi16(weights, _mm256_unpacklo_epi8(tlo, thi)));
          const __m256i r815 = _mm256_add_epi16(_mm256_maddubs_epi16(weights, _mm256_unpackhi_epi8(slo, shi)),
                                                _mm256_maddubs_epi16(weights, _mm256_unpackhi_epi8(tlo, thi)));
          // add the lanes (the other groups): rows 0-7 in lane 0, 8-15 in lane 1; widen to int32
          const __m256i rows = _mm256_add_epi16(_mm256_permute2x128_si256(r07, r815, 0x20),
                                                _mm256_permute2x128_si256(r07, r815, 0x31));
          S[i][0] = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(rows));
          S[i][1] = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(rows, 1));
        }
        for (int half = 0; half < 2; ++half) {
          if (w.format == kLutUniform) {
            __m256i I = S[0][half];
            for (int i = 1; i < B; ++i) I = _mm256_add_epi32(I, _mm256_slli_epi32(S[i][half], i));
            f[0][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), xs, f[0][half]);
          } else {
            for (int i = 0; i < B; ++i) f[i][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[i][half]), xs, f[i][half]);
          }
        }
      }
      const int64_t at = static_cast<int64_t>(b) * G + g;
      const __m256 xsum = _mm256_set1_ps(a.xsum[static_cast<int64_t>(m) * G + g]);
      auto half8 = [](const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
      for (int half = 0; half < 2; ++half) {
        if (w.format == kLutUniform) {
          const __m256 s = _mm256_cvtph_ps(half8(w.qs + at * kRows + 8 * half));
          const __m256 z = _mm256_mul_ps(
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qz + at * kRows + 8 * half)))),
              _mm256_set1_ps(0.5f));
          yv[half] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, xsum, f[0][half]), yv[half]);
        } else {
          __m256 c = _mm256_cvtph_ps(half8(w.qc + at * kRows + 8 * half)), t = yv[half];
          for (int i = 0; i < B; ++i) {
            const __m256 al = _mm256_cvtph_ps(half8(w.qs + (at * B + i) * kRows + 8 * half));
            t = _mm256_fmadd_ps(_mm256_add_ps(al, al), f[i][half], t);
            c = _mm256_sub_ps(c, al);
          }
          yv[half] = _mm256_fmadd_ps(c, xsum, t);
        }
      }
    }
    alignas(32) float out[kRows];
    _mm256_store_ps(out, yv[0]);
    _mm256_store_ps(out + 8, yv[1]);
    for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
      const int n = kRows * b + r;
      y[static_cast<int64_t>(m) * w.N + n] = bias ? out[r] + bias[n] : out[r];
    }
  }
}

// ---- codebooks (kCB4, kCB2): codes and their row's book index the layer's 16-byte table (qgemm.h) --------------
inline int64_t cb_block(const Weights& w, int b, int B) { return static_cast<int64_t>(b) * 2 * w.K * B; }

// The book of row r in group g (0 with a single book).
inline int cb_book(const Weights& w, int b, int g, int r) {
  return w.qb ? (w.qb[static_cast<int64_t>(b) * num_groups(w) + g] >> (2 * r)) & 3 : 0;
}

// The code of row r at input 32h + k of a block's codes (layout of qgemm.h).
template <int B>
inline int cb_code(const uint8_t* qw, int h, int k, int r) {
  if constexpr (B == 4) {
    const uint8_t v = qw[static_cast<int64_t>(4 * h + k / 8) * 64 + 4 * r + k % 4];
    return (k % 8) < 4 ? v & 15 : v >> 4;
  } else {
    const uint8_t v = qw[static_cast<int64_t>(2 * h + k / 16) * 64 + 4 * r + k % 4];
    return (v >> (2 * ((k % 16) / 4))) & 3;
  }
}

template <int B>
void block_scalar_cb_bits(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  const uint8_t* qw = w.qw + cb_block(w, b, B);
  for (int m = 0; m < a.M; ++m) {
    float yv[kRows] = {};
    for (int g = 0; g < G; ++g) {
      float F[kRows] = {};
      const int h1 = std::min((g + 1) * w.group_size, K) / 32;
      for (int h = g * w.group_size / 32; h < h1; ++h) {
        const int8_t* xq = a.xq + static_cast<int64_t>(m) * K + 32 * h;
        const float xs = a.xs[static_cast<int64_t>(m) * H + h];
        for (int r = 0; r < kRows; ++r) {
          const int book = cb_book(w, b, g, r) << B;
          int32_t I = 0;
          for (int k = 0; k < 32; ++k) I += w.table[book | cb_code<B>(qw, h, k, r)] * xq[k];
          F[r] = std::fmaf(static_cast<float>(I), xs, F[r]);
        }
      }
      const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
      for (int r = 0; r < kRows; ++r) yv[r] = std::fmaf(half_to_float(w.qs[at + r]), F[r], yv[r]);
    }
    for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
      const int n = kRows * b + r;
      y[static_cast<int64_t>(m) * w.N + n] = bias ? yv[r] + bias[n] : yv[r];
    }
  }
}

void block_scalar_cb(const Weights& w, const Acts& a, const float* bias, float* y, int b) {
  w.format == kCB4 ? block_scalar_cb_bits<4>(w, a, bias, y, b) : block_scalar_cb_bits<2>(w, a, bias, y, b);
}

// Per 64 bytes of codes: kCB4 2 sub-vectors (nibbles, inputs 8c + 4·sub..), kCB2 4 (crumbs, inputs 16c + 4·sub..).
template <int B>
constexpr int cb_subs() { return 8 / B; }

// AVX-512: 16 rows in one register; the table (offset by 128: VPDPBUSD's unsigned operand) in every 128-bit lane.
template <int MT, int B>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") void tile_avx512_cb(const Weights& w, const Acts& a,
                                                                             const float* bias, float* y, int b,
                                                                             int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  constexpr int S = cb_subs<B>(), L = B;  // sub-vectors per 64-byte load, loads per 32 inputs
  const uint8_t* qw = w.qw + cb_block(w, b, B);
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.table)), _mm_set1_epi8(-128)));
  const __m512i mask = _mm512_set1_epi8((1 << B) - 1);
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  __m512 yv[MT];
  for (int m = 0; m < MT; ++m) yv[m] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m512i books = _mm512_setzero_si512();  // byte 4r + j: row r's book << B
    if (w.qb) {
      const __m512i id = _mm512_and_si512(
          _mm512_srlv_epi32(_mm512_set1_epi32(w.qb[static_cast<int64_t>(b) * G + g]), shifts), _mm512_set1_epi32(3));
      books = _mm512_mullo_epi32(_mm512_slli_epi32(id, B), _mm512_set1_epi32(0x01010101));
    }
    __m512 F[MT];
    for (int m = 0; m < MT; ++m) F[m] = _mm512_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m512i acc[MT][2];
      for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
      for (int c = 0; c < L; ++c) {
        const __m512i v = _mm512_loadu_si512(qw + static_cast<int64_t>(L * h + c) * 64);
        for (int t = 0; t < S; ++t) {
          // ((v >> B·t) & mask) | books: ternary-logic truth table 0xEA = (A & B) | C
          const __m512i idx = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, B * t), mask, books, 0xEA);
          const __m512i wv = _mm512_shuffle_epi8(table, idx);
          for (int m = 0; m < MT; ++m) {
            const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 32 / L * c + 4 * t;
            acc[m][t & 1] = _mm512_dpbusd_epi32(acc[m][t & 1], wv, _mm512_set1_epi32(load4(xp)));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t mh = static_cast<int64_t>(m0 + m) * H + h;
        const __m512i I =
            _mm512_sub_epi32(_mm512_add_epi32(acc[m][0], acc[m][1]), _mm512_set1_epi32(128 * a.xqsum[mh]));
        F[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_set1_ps(a.xs[mh]), F[m]);
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + at)));
    for (int m = 0; m < MT; ++m) yv[m] = _mm512_fmadd_ps(s, F[m], yv[m]);
  }
  store_avx512<MT>(w, bias, y, b, m0, yv);
}

template <int B>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vnni") void block_avx512_cb(const Weights& w, const Acts& a,
                                                                              const float* bias, float* y, int b) {
  int m = 0;
  for (; m + 4 <= a.M; m += 4) tile_avx512_cb<4, B>(w, a, bias, y, b, m);
  for (; m < a.M; ++m) tile_avx512_cb<1, B>(w, a, bias, y, b, m);
}

// AVX2 (+ AVX-VNNI): the 16 rows as two 8-lane halves.  Without VNNI the products are VPMADDUBSW's of |w| and xq
// with w's sign (VPSIGNB), so the signed table needs no offset.
template <int MT, int B, bool VNNI>
QLINEAR_TARGET("avx2,fma,f16c,avxvnni") void tile_avx2_cb(const Weights& w, const Acts& a, const float* bias,
                                                              float* y, int b, int m0) {
  const int K = w.K, H = K / 32, G = num_groups(w);
  constexpr int S = cb_subs<B>(), L = B;
  const uint8_t* qw = w.qw + cb_block(w, b, B);
  const __m128i t16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.table));
  const __m256i table = _mm256_broadcastsi128_si256(VNNI ? _mm_xor_si128(t16, _mm_set1_epi8(-128)) : t16);
  const __m256i mask = _mm256_set1_epi8((1 << B) - 1), ones = _mm256_set1_epi16(1);
  __m256 yv[MT][2];
  for (int m = 0; m < MT; ++m) yv[m][0] = yv[m][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    __m256i books[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if (w.qb) {
      const __m256i word = _mm256_set1_epi32(w.qb[static_cast<int64_t>(b) * G + g]);
      for (int half = 0; half < 2; ++half) {
        const __m256i sh = _mm256_add_epi32(_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), _mm256_set1_epi32(16 * half));
        const __m256i id = _mm256_and_si256(_mm256_srlv_epi32(word, sh), _mm256_set1_epi32(3));
        books[half] = _mm256_mullo_epi32(_mm256_slli_epi32(id, B), _mm256_set1_epi32(0x01010101));
      }
    }
    __m256 F[MT][2];
    for (int m = 0; m < MT; ++m) F[m][0] = F[m][1] = _mm256_setzero_ps();
    const int h1 = std::min((g + 1) * w.group_size, K) / 32;
    for (int h = g * w.group_size / 32; h < h1; ++h) {
      __m256i acc[MT][2];
      for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
      for (int c = 0; c < L; ++c) {
        const uint8_t* p = qw + static_cast<int64_t>(L * h + c) * 64;
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * half));
          for (int t = 0; t < S; ++t) {
            const __m256i idx = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, B * t), mask), books[half]);
            const __m256i wv = _mm256_shuffle_epi8(table, idx);
            const __m256i wabs = VNNI ? wv : _mm256_abs_epi8(wv);
            for (int m = 0; m < MT; ++m) {
              const int8_t* xp = a.xq + static_cast<int64_t>(m0 + m) * K + 32 * h + 32 / L * c + 4 * t;
              const __m256i xv = _mm256_set1_epi32(load4(xp));
              if constexpr (VNNI) {
                acc[m][half] = _mm256_dpbusd_avx_epi32(acc[m][half], wv, xv);
              } else {
                acc[m][half] = _mm256_add_epi32(
                    acc[m][half], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), ones));
              }
            }
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const int64_t mh = static_cast<int64_t>(m0 + m) * H + h;
        const __m256 xs = _mm256_set1_ps(a.xs[mh]);
        for (int half = 0; half < 2; ++half) {
          const __m256i I = VNNI ? _mm256_sub_epi32(acc[m][half], _mm256_set1_epi32(128 * a.xqsum[mh])) : acc[m][half];
          F[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), xs, F[m][half]);
        }
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows;
    for (int half = 0; half < 2; ++half) {
      const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + at + 8 * half)));
      for (int m = 0; m < MT; ++m) yv[m][half] = _mm256_fmadd_ps(sv, F[m][half], yv[m][half]);
    }
  }
  store_avx2<MT>(w, bias, y, b, m0, yv);
}

template <int B, bool VNNI>
QLINEAR_TARGET("avx2,fma,f16c,avxvnni") void block_avx2_cb(const Weights& w, const Acts& a, const float* bias,
                                                               float* y, int b) {
  int m = 0;
  for (; m + 2 <= a.M; m += 2) tile_avx2_cb<2, B, VNNI>(w, a, bias, y, b, m);
  if (m < a.M) tile_avx2_cb<1, B, VNNI>(w, a, bias, y, b, m);
}

}  // namespace

namespace {
int64_t quant_bytes(int M, int K, int group_size) {
  const int64_t G = (K + group_size - 1) / group_size;
  return ((static_cast<int64_t>(M) * K + 15) / 16) * 16 + 4 * static_cast<int64_t>(M) * (2 * (K / 32) + G);
}

// The LUT formats' tables (qgemm.h) of one row's int8 activations xq [K] into T [K/32, 4, 64].
void build_tables(const int8_t* xq, int K, int8_t* T) {
  for (int h = 0; h < K / 32; ++h) {
    for (int half = 0; half < 2; ++half) {
      int8_t part[2][16];
      for (int k = 0; k < 16; ++k) {
        const int v = xq[32 * h + 16 * half + k], lo = v & 15;
        part[0][k] = static_cast<int8_t>(lo);
        part[1][k] = static_cast<int8_t>((v - lo) / 16);
      }
      for (int pt = 0; pt < 2; ++pt) {
        int8_t* t = T + (static_cast<int64_t>(h) * 4 + 2 * half + pt) * 64;
        for (int g = 0; g < 4; ++g) {
          t[16 * g] = 0;
          for (int p = 1; p < 16; ++p)  // the subset p = (p without its lowest bit) + that bit's input
            t[16 * g + p] = static_cast<int8_t>(t[16 * g + (p & (p - 1))] + part[pt][4 * g + __builtin_ctz(p)]);
        }
      }
    }
  }
}

// The same tables with AVX-512 VBMI, per 32 inputs: lo = x̂ & 15 and hi = x̂ >> 4 (arithmetic: ((x̂ ^ 0x80) >> 4) − 8),
// then per table entry 16g + p the sum over bits t of p of part[16·half + 4g + t] as four VPERMB gathers, each added
// where bit t of p is set (the same int8 sums: entries ≤ 60 or ≥ −32 in magnitude, no wrap).
struct TableGather {
  alignas(64) uint8_t idx[2][4][64];  // [half][t]: byte 16g + p <- input 16·half + 4g + t
};
constexpr TableGather table_gather() {
  TableGather t{};
  for (int half = 0; half < 2; ++half)
    for (int b = 0; b < 4; ++b)
      for (int e = 0; e < 64; ++e) t.idx[half][b][e] = static_cast<uint8_t>(16 * half + 4 * (e / 16) + b);
  return t;
}
constexpr TableGather kTableGather = table_gather();

QLINEAR_AVX512_LUT void build_tables_avx512(const int8_t* xq, int K, int8_t* T) {
  constexpr uint64_t kHas[4] = {0xAAAAAAAAAAAAAAAAull, 0xCCCCCCCCCCCCCCCCull, 0xF0F0F0F0F0F0F0F0ull,
                                0xFF00FF00FF00FF00ull};  // entries p (mod 16) with bit t set
  const __m512i low = _mm512_set1_epi8(15);
  for (int h = 0; h < K / 32; ++h) {
    const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * h)));
    const __m512i part[2] = {
        _mm512_and_si512(v, low),
        _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(_mm512_xor_si512(v, _mm512_set1_epi8(-128)), 4), low),
                        _mm512_set1_epi8(8))};
    for (int half = 0; half < 2; ++half)
      for (int pt = 0; pt < 2; ++pt) {
        __m512i out = _mm512_setzero_si512();
        for (int b = 0; b < 4; ++b)
          out = _mm512_mask_add_epi8(out, kHas[b], out,
                                     _mm512_permutexvar_epi8(_mm512_load_si512(kTableGather.idx[half][b]), part[pt]));
        _mm512_storeu_si512(T + (static_cast<int64_t>(h) * 4 + 2 * half + pt) * 64, out);
      }
  }
}

// quantize_block for n = 16 or 32 in two registers: the same operations lane-wise (max of |x| is exact in any order,
// one rounding to nearest even, the same clamp), so the same xq, scale and Σ xq.
QLINEAR_TARGET("avx512f,avx512bw,avx512vl") int quantize_block_avx512(const float* x, int n, int8_t* q, float* scale) {
  const __m512 a = _mm512_loadu_ps(x), b = n == 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
  const bool nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);  // max drops NaN
  const float amax = nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(qlinear_cpu::act_inverse_scale(amax)), hi = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int half = 0; half < n / 16; ++half) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(half ? b : a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(_mm512_set1_ps(-127.0f), r)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * half), _mm512_cvtsepi32_epi8(v));  // |v| <= 127: exact
    sum = _mm512_add_epi32(sum, v);
  }
  *scale = amax / 127.0f;
  // Σ of the 16 lanes (SIMDe 0.8 has no _mm512_reduce_add_epi32)
  const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}
}  // namespace

int quantize_block(const float* x, int n, int8_t* q, float* scale) {
  // once per process, not per block: this runs for every 16 or 32 activations
  static const bool avx512 = QLINEAR_HAS("avx512f") && QLINEAR_HAS("avx512bw") && QLINEAR_HAS("avx512vl");
  if ((n == 16 || n == 32) && avx512) return quantize_block_avx512(x, n, q, scale);
  const float amax = qlinear_cpu::block_amax(x, n);
  const float inv = qlinear_cpu::act_inverse_scale(amax);
  int qsum = 0;
  for (int k = 0; k < n; ++k) {
    const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[k] * inv)));
    q[k] = static_cast<int8_t>(v);
    qsum += static_cast<int>(v);
  }
  *scale = amax / 127.0f;
  return qsum;
}

int64_t acts_bytes(int M, int K, int group_size, bool tables) {
  return quant_bytes(M, K, group_size) + (tables ? 64 + static_cast<int64_t>(M) * (K / 32) * 256 : 0);
}

void prepare_acts(const float* x, int M, int K, int group_size, bool tables, void* work, Acts* a) {
  const int H = K / 32, G = (K + group_size - 1) / group_size;
  int8_t* xq = static_cast<int8_t*>(work);
  float* xs = reinterpret_cast<float*>(xq + ((static_cast<int64_t>(M) * K + 15) / 16) * 16);
  float* xsum = xs + static_cast<int64_t>(M) * H;
  int32_t* xqsum = reinterpret_cast<int32_t*>(xsum + static_cast<int64_t>(M) * G);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
      const int h1 = std::min((g + 1) * group_size, K) / 32;
      for (int h = g * group_size / 32; h < h1; ++h) {
        const int64_t at = static_cast<int64_t>(m) * K + 32 * h;
        float scale;
        const int qsum = quantize_block(x + at, 32, xq + at, &scale);
        xs[static_cast<int64_t>(m) * H + h] = scale;
        xqsum[static_cast<int64_t>(m) * H + h] = qsum;
        const float t = scale * static_cast<float>(qsum);
        acc = acc + t;
      }
      xsum[static_cast<int64_t>(m) * G + g] = acc;
    }
  }
  a->xq = xq;
  a->xs = xs;
  a->xsum = xsum;
  a->xqsum = xqsum;
  a->M = M;
  a->tables = nullptr;
  if (tables) {
    const uintptr_t end = reinterpret_cast<uintptr_t>(work) + quant_bytes(M, K, group_size);
    int8_t* T = reinterpret_cast<int8_t*>((end + 63) & ~uintptr_t(63));
    const bool vbmi = QLINEAR_HAS("avx512bw") && QLINEAR_HAS("avx512vbmi");
    for (int m = 0; m < M; ++m)
      (vbmi ? build_tables_avx512 : build_tables)(xq + static_cast<int64_t>(m) * K, K, T + static_cast<int64_t>(m) * (K / 32) * 256);
    a->tables = T;
  }
}

bool path_supported(int path, int format) {
  switch (path) {
    case kScalar: return true;
    case kAVX2: return QLINEAR_HAS("avx2") && QLINEAR_HAS("fma") && QLINEAR_HAS("f16c");
    case kAVX2VNNI: return path_supported(kAVX2, format) && QLINEAR_HAS("avxvnni");
    case kAVX512VNNI:  // the bit-plane kernels' VPERMB needs VBMI (Ice Lake, Zen 4 and later)
      return QLINEAR_HAS("avx512f") && QLINEAR_HAS("avx512bw") && QLINEAR_HAS("avx512vl") &&
             QLINEAR_HAS("avx512vnni") && (format == kUniform || format >= kCB4 || QLINEAR_HAS("avx512vbmi"));
    default: return false;
  }
}

int best_path(int format) {
  for (int path : {kAVX512VNNI, kAVX2VNNI, kAVX2})
    if (path_supported(path, format)) return path;
  return kScalar;
}

void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path) {
  if (path == kAuto) path = best_path(w.format);
  if (w.format >= kCB4) {
    const bool four = w.format == kCB4;
    for (int b = b0; b < b1; ++b) {
      switch (path) {
        case kAVX512VNNI: four ? block_avx512_cb<4>(w, a, bias, y, b) : block_avx512_cb<2>(w, a, bias, y, b); break;
        case kAVX2VNNI: four ? block_avx2_cb<4, true>(w, a, bias, y, b) : block_avx2_cb<2, true>(w, a, bias, y, b); break;
        case kAVX2: four ? block_avx2_cb<4, false>(w, a, bias, y, b) : block_avx2_cb<2, false>(w, a, bias, y, b); break;
        default: block_scalar_cb(w, a, bias, y, b); break;
      }
    }
    return;
  }
  if (w.format != kUniform) {
    for (int b = b0; b < b1; ++b) {
      switch (path) {
        case kAVX512VNNI: block_avx512_lut(w, a, bias, y, b); break;
        case kAVX2VNNI:
        case kAVX2:
          switch (w.bits) {
            case 1: block_avx2_lut<1>(w, a, bias, y, b); break;
            case 2: block_avx2_lut<2>(w, a, bias, y, b); break;
            case 3: block_avx2_lut<3>(w, a, bias, y, b); break;
            default: block_avx2_lut<4>(w, a, bias, y, b); break;
          }
          break;
        default: block_scalar_lut(w, a, bias, y, b); break;
      }
    }
    return;
  }
  const bool u8 = w.bits == 8;
  for (int b = b0; b < b1; ++b) {
    switch (path) {
      case kAVX512VNNI: u8 ? block_avx512<true>(w, a, bias, y, b) : block_avx512<false>(w, a, bias, y, b); break;
      case kAVX2VNNI: u8 ? block_avx2<true, true>(w, a, bias, y, b) : block_avx2<true, false>(w, a, bias, y, b); break;
      case kAVX2: u8 ? block_avx2<false, true>(w, a, bias, y, b) : block_avx2<false, false>(w, a, bias, y, b); break;
      default: block_scalar(w, a, bias, y, b); break;
    }
  }
}

namespace {
// The codes c[r][k] of a block's 16 rows at inputs 32h + k (layouts of qgemm.h).
void block_codes(const Weights& w, const uint8_t* blk, int h, uint8_t (*c)[32]) {
  if (w.format == kUniform || w.format == kCB4) {
    for (int q = 0; q < 4; ++q) {
      const uint8_t* v = blk + static_cast<int64_t>(4 * h + q) * 64;
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < 4; ++j) {
          c[r][8 * q + j] = v[4 * r + j] & 15;
          c[r][8 * q + 4 + j] = v[4 * r + j] >> 4;
        }
    }
  } else if (w.format == kCB2) {
    for (int q = 0; q < 2; ++q) {
      const uint8_t* v = blk + static_cast<int64_t>(2 * h + q) * 64;
      for (int r = 0; r < kRows; ++r)
        for (int t = 0; t < 4; ++t)
          for (int j = 0; j < 4; ++j) c[r][16 * q + 4 * t + j] = (v[4 * r + j] >> (2 * t)) & 3;
    }
  } else {  // bit-planes: byte 16g + r of plane i holds bit i of inputs 4g + t (low nibble) and 16 + 4g + t (high)
    static constexpr auto spread = [] {  // nibble -> its 4 bits in the low bit of 4 bytes (little-endian)
      struct { uint32_t v[16]; } t{};
      for (uint32_t n = 0; n < 16; ++n) t.v[n] = (n & 1) | ((n >> 1 & 1) << 8) | ((n >> 2 & 1) << 16) | ((n >> 3) << 24);
      return t;
    }();
    uint32_t acc[kRows][8] = {};
    for (int i = 0; i < w.bits; ++i) {
      const uint8_t* v = blk + (static_cast<int64_t>(h) * w.bits + i) * 64;
      for (int g = 0; g < 4; ++g)
        for (int r = 0; r < kRows; ++r) {
          acc[r][g] |= spread.v[v[16 * g + r] & 15] << i;
          acc[r][4 + g] |= spread.v[v[16 * g + r] >> 4] << i;
        }
    }
    std::memcpy(c, acc, sizeof(acc));
  }
}

// block_codes with AVX-512 (F, BW, VL): the same codes.  A and B hold in 128-bit lane l the codes 0..15 and 16..31
// of row r0 + 4l; they go to c[r0 + 4l].
QLINEAR_TARGET("avx512f,avx512bw,avx512vl")
inline void store_rows(__m512i A, __m512i B, uint8_t (*c)[32], int r0) {
  const __m512i lo = _mm512_shuffle_i64x2(_mm512_shuffle_i64x2(A, B, 0x44), _mm512_shuffle_i64x2(A, B, 0x44), 0xD8);
  const __m512i hi = _mm512_shuffle_i64x2(_mm512_shuffle_i64x2(A, B, 0xEE), _mm512_shuffle_i64x2(A, B, 0xEE), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[r0]), _mm512_castsi512_si256(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[r0 + 4]), _mm512_extracti64x4_epi64(lo, 1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[r0 + 8]), _mm512_castsi512_si256(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[r0 + 12]), _mm512_extracti64x4_epi64(hi, 1));
}

QLINEAR_TARGET("avx512f,avx512bw,avx512vl")
inline void block_codes_avx512(const Weights& w, const uint8_t* blk, int h, uint8_t (*c)[32]) {
  const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
  if (w.format == kUniform || w.format == kCB4) {  // lane l of chunk q: rows 4l..4l+3, 4 bytes (8 codes) each
    __m512i P[4], Q[4];
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(blk + static_cast<int64_t>(4 * h + q) * 64);
      const __m512i L = _mm512_and_si512(v, m4), H = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      P[q] = _mm512_unpacklo_epi32(L, H);  // rows 4l, 4l + 1: codes 8q .. 8q + 7 each
      Q[q] = _mm512_unpackhi_epi32(L, H);  // rows 4l + 2, 4l + 3
    }
    store_rows(_mm512_unpacklo_epi64(P[0], P[1]), _mm512_unpacklo_epi64(P[2], P[3]), c, 0);
    store_rows(_mm512_unpackhi_epi64(P[0], P[1]), _mm512_unpackhi_epi64(P[2], P[3]), c, 1);
    store_rows(_mm512_unpacklo_epi64(Q[0], Q[1]), _mm512_unpacklo_epi64(Q[2], Q[3]), c, 2);
    store_rows(_mm512_unpackhi_epi64(Q[0], Q[1]), _mm512_unpackhi_epi64(Q[2], Q[3]), c, 3);
  } else if (w.format == kCB2) {  // chunk q, crumb t of a row's 4 bytes: codes 16q + 4t .. 16q + 4t + 3
    __m512i R[2][4];
    for (int q = 0; q < 2; ++q) {
      const __m512i v = _mm512_loadu_si512(blk + static_cast<int64_t>(2 * h + q) * 64);
      __m512i S[4];
      for (int t = 0; t < 4; ++t) S[t] = _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * t)), m2);
      const __m512i a = _mm512_unpacklo_epi32(S[0], S[1]), b = _mm512_unpacklo_epi32(S[2], S[3]);
      const __m512i d = _mm512_unpackhi_epi32(S[0], S[1]), e = _mm512_unpackhi_epi32(S[2], S[3]);
      R[q][0] = _mm512_unpacklo_epi64(a, b);  // row 4l
      R[q][1] = _mm512_unpackhi_epi64(a, b);  // row 4l + 1
      R[q][2] = _mm512_unpacklo_epi64(d, e);
      R[q][3] = _mm512_unpackhi_epi64(d, e);
    }
    for (int k = 0; k < 4; ++k) store_rows(R[0][k], R[1][k], c, k);
  } else {  // bit-planes: per plane a 32-bit mask per row (bit k: input 32h + k), then each code byte's bit i
    alignas(64) uint32_t m[kMaxBits][kRows];
    for (int i = 0; i < w.bits; ++i) {
      const uint8_t* v = blk + (static_cast<int64_t>(h) * w.bits + i) * 64;
      __m512i acc = _mm512_setzero_si512();
      for (int g = 0; g < 4; ++g) {  // byte 16g + r: inputs 4g + t (low nibble), 16 + 4g + t (high)
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * g)));
        acc = _mm512_or_si512(acc, _mm512_sll_epi32(_mm512_and_si512(x, _mm512_set1_epi32(15)),
                                                    _mm_cvtsi32_si128(4 * g)));
        acc = _mm512_or_si512(acc, _mm512_sll_epi32(_mm512_srli_epi32(x, 4), _mm_cvtsi32_si128(16 + 4 * g)));
      }
      _mm512_store_si512(m[i], acc);
    }
    for (int r = 0; r < kRows; ++r) {
      __m256i code = _mm256_setzero_si256();
      for (int i = 0; i < w.bits; ++i)
        code = _mm256_or_si256(code, _mm256_and_si256(_mm256_movm_epi8(static_cast<__mmask32>(m[i][r])),
                                                      _mm256_set1_epi8(static_cast<char>(1 << i))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(c[r]), code);
    }
  }
}

// The 2^bits weight values of row r of block b in group g.
void levels(const Weights& w, int b, int g, int r, float* lv) {
  const int64_t at = (static_cast<int64_t>(b) * num_groups(w) + g) * kRows + r;
  const int L = 1 << w.bits;
  if (w.format >= kCB4) {
    const int book = cb_book(w, b, g, r) << w.bits;
    const float scale = half_to_float(w.qs[at]);
    for (int c = 0; c < L; ++c) lv[c] = scale * static_cast<float>(w.table[book | c]);
  } else if (w.format == kLutFree) {
    const int64_t ab = (static_cast<int64_t>(b) * num_groups(w) + g) * w.bits;
    float al[kMaxBits];
    for (int i = 0; i < w.bits; ++i) al[i] = half_to_float(w.qs[(ab + i) * kRows + r]);
    const float offset = half_to_float(w.qc[at]);
    for (int c = 0; c < L; ++c) {
      float v = 0.0f;
      for (int i = 0; i < w.bits; ++i) v = v + ((c >> i) & 1 ? al[i] : -al[i]);
      lv[c] = v + offset;
    }
  } else {
    const float s = half_to_float(w.qs[at]), z = static_cast<float>(w.qz[at]) * 0.5f;
    for (int c = 0; c < L; ++c) lv[c] = s * (static_cast<float>(c) - z);
  }
}
}  // namespace

namespace {
QLINEAR_TARGET("avx512f,avx512bw")
inline void to_bf16_avx512(__m512 v, uint16_t* out) {  // bf16_bits of 16 floats
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16x16(v));
}

QLINEAR_TARGET("avx512f")
inline __m512 fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// levels() of a block's 16 rows in group g, with AVX-512 (the same fp32 operations), as T: lt[r][c].
template <typename T>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl")
inline void levels16_avx512(const Weights& w, int b, int g, T (*lt)[32]) {
  const int64_t at = (static_cast<int64_t>(b) * num_groups(w) + g) * kRows;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float s[kRows], z[kRows], al[kMaxBits][kRows];
  __m512 lv[kRows];
  if (w.format == kLutFree) {
    const int64_t ab = (static_cast<int64_t>(b) * num_groups(w) + g) * w.bits;
    for (int i = 0; i < w.bits; ++i) _mm512_store_ps(al[i], fp16(w.qs + (ab + i) * kRows));
    _mm512_store_ps(z, fp16(w.qc + at));
    constexpr __mmask16 kBit[kMaxBits] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};  // codes with bit i set
    for (int r = 0; r < kRows; ++r) {
      __m512 v = _mm512_setzero_ps();
      for (int i = 0; i < w.bits; ++i)
        v = _mm512_add_ps(v, _mm512_mask_blend_ps(kBit[i], _mm512_set1_ps(-al[i][r]), _mm512_set1_ps(al[i][r])));
      lv[r] = _mm512_add_ps(v, _mm512_set1_ps(z[r]));
    }
  } else if (w.format >= kCB4) {
    _mm512_store_ps(s, fp16(w.qs + at));
    const __m512i tab = _mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.table))));
    for (int r = 0; r < kRows; ++r) {
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(cb_book(w, b, g, r) << w.bits), _mm512_cvtps_epi32(iota));
      lv[r] = _mm512_mul_ps(_mm512_set1_ps(s[r]), _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(idx, tab)));
    }
  } else {
    _mm512_store_ps(s, fp16(w.qs + at));
    _mm512_store_ps(z, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qz + at)))),
                                     _mm512_set1_ps(0.5f)));
    for (int r = 0; r < kRows; ++r) lv[r] = _mm512_mul_ps(_mm512_set1_ps(s[r]), _mm512_sub_ps(iota, _mm512_set1_ps(z[r])));
  }
  for (int r = 0; r < kRows; ++r) {
    if constexpr (std::is_same<T, float>::value)
      _mm512_storeu_ps(lt[r], lv[r]);
    else
      to_bf16_avx512(lv[r], lt[r]);
  }
}
}  // namespace

namespace {
// Ŵ of 32 inputs of one row: o[k] = lv[c[k]], lv the row's (up to) 16 levels for the group (AVX-512: one
// VPERMPS per 16 float32 outputs, one VPERMW per 32 bfloat16 ones); the same values as the scalar loop.
QLINEAR_TARGET("avx512f,avx512bw")
inline void lookup32_avx512(const float* lv, const uint8_t* c, float* o) {
  const __m512 t = _mm512_loadu_ps(lv);
  for (int k = 0; k < 32; k += 16)
    _mm512_storeu_ps(o + k, _mm512_permutexvar_ps(
                                _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k))), t));
}

QLINEAR_TARGET("avx512f,avx512bw")
inline void lookup32_avx512(const uint16_t* lv, const uint8_t* c, uint16_t* o) {
  const __m512i t = _mm512_loadu_si512(lv);  // lv has 32 entries (16 used)
  _mm512_storeu_si512(o, _mm512_permutexvar_epi16(
                             _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c))), t));
}

// block_codes of a bit-plane block with VBMI: per plane and pair of rows one VPERMB puts under each of the rows' 32 code
// bytes the plane byte holding its bit (byte 16g + r: inputs 4g + t in the low nibble, 16 + 4g + t in the high), a
// VPTESTMB picks that bit, a masked add weighs it 2^i (~3 instructions per 64 codes and plane, where block_codes_avx512
// builds 32-bit row masks first).
struct PlaneDecode {
  alignas(64) uint8_t idx[64];  // rows 0 and 1; + 2p for rows 2p, 2p + 1
  alignas(64) uint8_t bit[64];
};
constexpr PlaneDecode plane_decode() {
  PlaneDecode t{};
  for (int e = 0; e < 64; ++e) {
    const int k = e % 32;
    t.idx[e] = static_cast<uint8_t>(16 * ((k % 16) / 4) + e / 32);
    t.bit[e] = static_cast<uint8_t>(1u << (4 * (k / 16) + k % 4));
  }
  return t;
}
constexpr PlaneDecode kPlaneDecode = plane_decode();

QLINEAR_TARGET("avx512f,avx512bw,avx512vl,avx512vbmi")
void block_codes_planes_vbmi(const Weights& w, const uint8_t* blk, int h, uint8_t (*c)[32]) {
  const __m512i base = _mm512_load_si512(kPlaneDecode.idx), bit = _mm512_load_si512(kPlaneDecode.bit);
  __m512i P[kMaxBits];
  for (int i = 0; i < w.bits; ++i) P[i] = _mm512_loadu_si512(blk + (static_cast<int64_t>(h) * w.bits + i) * 64);
  for (int p = 0; p < kRows / 2; ++p) {
    const __m512i idx = _mm512_add_epi8(base, _mm512_set1_epi8(static_cast<char>(2 * p)));
    __m512i code = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(_mm512_permutexvar_epi8(idx, P[0]), bit),
                                         _mm512_set1_epi8(1));
    for (int i = 1; i < w.bits; ++i)
      code = _mm512_mask_add_epi8(code, _mm512_test_epi8_mask(_mm512_permutexvar_epi8(idx, P[i]), bit), code,
                                  _mm512_set1_epi8(static_cast<char>(1 << i)));
    _mm512_storeu_si512(c[2 * p], code);  // rows 2p and 2p + 1
  }
}

// dequantize over blocks [b0, b1) with AVX-512 (F, BW, VL; VBMI for bit-planes where the CPU has it): the same values
// as dequantize_scalar.
template <typename T>
QLINEAR_TARGET("avx512f,avx512bw,avx512vl")
void dequantize_avx512(const Weights& w, T* out, int b0, int b1, int row0) {
  const int K = w.K, G = num_groups(w);
  const bool planes = w.format == kLutUniform || w.format == kLutFree;
  const bool vbmi = planes && QLINEAR_HAS("avx512vbmi");
  alignas(64) T lt[kRows][32] = {};  // the levels as T (bfloat16: rounded once from float32)
  alignas(64) uint8_t c[kRows][32];
  for (int b = b0; b < b1; ++b) {
    const uint8_t* blk = w.qw + (planes ? lut_block(w, b) : cb_block(w, b, w.format == kCB2 ? 2 : 4));
    const int rows = std::min(kRows, w.N - kRows * b);
    for (int g = 0; g < G; ++g) {
      levels16_avx512(w, b, g, lt);
      for (int h = g * w.group_size / 32; h < std::min((g + 1) * w.group_size, K) / 32; ++h) {
        if (vbmi)
          block_codes_planes_vbmi(w, blk, h, c);
        else
          block_codes_avx512(w, blk, h, c);
        for (int r = 0; r < rows; ++r) lookup32_avx512(lt[r], c[r], out + static_cast<int64_t>(kRows * b + r - row0) * K + 32 * h);
      }
    }
  }
}

template <typename T>
void dequantize_scalar(const Weights& w, T* out, int b0, int b1, int row0) {
  const int K = w.K, G = num_groups(w);
  const bool planes = w.format == kLutUniform || w.format == kLutFree;
  float lv[16] = {};
  uint8_t c[kRows][32];
  for (int b = b0; b < b1; ++b) {
    const uint8_t* blk = w.qw + (planes ? lut_block(w, b) : cb_block(w, b, w.format == kCB2 ? 2 : 4));
    const int rows = std::min(kRows, w.N - kRows * b);
    T lt[kRows][16];
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < rows; ++r) {
        levels(w, b, g, r, lv);
        for (int l = 0; l < 16; ++l) {
          if constexpr (std::is_same<T, float>::value)
            lt[r][l] = lv[l];
          else
            lt[r][l] = bf16_bits(lv[l]);
        }
      }
      for (int h = g * w.group_size / 32; h < std::min((g + 1) * w.group_size, K) / 32; ++h) {
        block_codes(w, blk, h, c);
        for (int r = 0; r < rows; ++r) {
          T* o = out + static_cast<int64_t>(kRows * b + r - row0) * K + 32 * h;
          for (int k = 0; k < 32; ++k) o[k] = lt[r][c[r][k]];
        }
      }
    }
  }
}

// dequantize of an 8-bit kUniform layer: s·(code − z) per weight, as levels() computes each level.
template <typename T>
void dequantize_u8(const Weights& w, T* out, int b0, int b1, int row0) {
  const int K = w.K, G = num_groups(w);
  for (int b = b0; b < b1; ++b) {
    const uint8_t* blk = w.qw + codes_block(w, b);
    for (int r = 0; r < std::min(kRows, w.N - kRows * b); ++r) {
      T* o = out + static_cast<int64_t>(kRows * b + r - row0) * K;
      for (int g = 0; g < G; ++g) {
        const int64_t at = (static_cast<int64_t>(b) * G + g) * kRows + r;
        const float s = half_to_float(w.qs[at]), z = zero2(w, at) * 0.5f;
        for (int k = g * w.group_size; k < std::min((g + 1) * w.group_size, K); ++k) {
          const float v = s * (static_cast<float>(blk[static_cast<int64_t>(k / 4) * 64 + 4 * r + k % 4]) - z);
          if constexpr (std::is_same<T, float>::value)
            o[k] = v;
          else
            o[k] = bf16_bits(v);
        }
      }
    }
  }
}

template <typename T>
void dequantize_blocks(const Weights& w, T* out, int b0, int b1, int row0) {
  if (w.format == kUniform && w.bits == 8)
    dequantize_u8(w, out, b0, b1, row0);
  else if (QLINEAR_HAS("avx512f") && QLINEAR_HAS("avx512bw") && QLINEAR_HAS("avx512vl"))
    dequantize_avx512(w, out, b0, b1, row0);
  else
    dequantize_scalar(w, out, b0, b1, row0);
}
}  // namespace

namespace {
QLINEAR_TARGET("avx512f,avx512bw")
int64_t to_bf16_avx512(const float* in, uint16_t* out, int64_t n) {  // the first n − n % 16 values
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) to_bf16_avx512(_mm512_loadu_ps(in + k), out + k);
  return k;
}
}  // namespace

void to_bf16(const float* in, uint16_t* out, int64_t n) {
  int64_t k = QLINEAR_HAS("avx512f") && QLINEAR_HAS("avx512bw") ? to_bf16_avx512(in, out, n) : 0;
  for (; k < n; ++k) out[k] = bf16_bits(in[k]);
}

void dequantize(const Weights& w, void* out, int b0, int b1, bool bf16, int row0) {
  if (bf16)
    dequantize_blocks(w, static_cast<uint16_t*>(out), b0, b1, row0);
  else
    dequantize_blocks(w, static_cast<float*>(out), b0, b1, row0);
}

}  // namespace qlinear_x86
