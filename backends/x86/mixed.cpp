// x86 GEMV for the mixed 2/4/16 format (layout x86_mixed; qgemm.h has the buffers, backends/x86/__init__.py the
// executable spec).  Float32 activations: the int8 machinery of kernels.cpp blocks inputs by 32 and scales once per
// block, while a mixed group is 16 inputs with its own scale, zero point and width.  Each weight is rebuilt as the
// format's own value ŵ = ŝ·(q − z) (ŝ = scale_zero + scale_scale·code, each operation rounded as
// qlinear.formats.mixed.dequantize rounds it) and multiplied into 4 accumulators of 8 fp32 lanes; the outliers are
// added after.
// Built with -ffp-contract=off like kernels.cpp, so the scalar path's fmaf calls are the AVX2 path's FMAs and both
// paths give the same bits.
#ifdef QLINEAR_X86_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/fma.h>
#define QLINEAR_TARGET(features)
#else
#include <immintrin.h>
#define QLINEAR_TARGET(features) __attribute__((target(features)))
#endif

#include <cmath>
#include <vector>

#include "qgemm.h"

namespace qlinear_x86 {
namespace {

constexpr int kLanes = 8;
constexpr int kMaxM = 2;  // activation rows per pass over a weight row (4 accumulators each)
constexpr int kAcc = 4;   // accumulators per row: FMA latency needs 4 chains in flight

// Per row: the scale code, zero point and ŝ of group i of one kind (2- or 4-bit).
struct Group {
  float s;
  int z;
};

inline Group group_of(const MixedWeights& w, const uint32_t* sc_row, const uint32_t* z_row, const float* ss,
                      const float* sz, int i, int zbits) {
  const int sb = w.scale_bits;
  const unsigned code = (sc_row[i * sb / 32] >> (i * sb % 32)) & ((1u << sb) - 1u);
  const int per = 32 / zbits;
  const int z = (int)((z_row[i / per] >> (zbits * (i % per))) & ((1u << zbits) - 1u));
  const float prod = ss[i] * (float)code;
  return Group{sz[i] + prod, z};
}

// The second-order (scale_scale, scale_zero) of row chunk c as float32, both kinds: [G2] then [G4] each.
struct ChunkScales {
  int chunk = -1;
  std::vector<float> ss, sz;
  void load(const MixedWeights& w, int c) {
    if (c == chunk) return;
    const int G = w.G2 + w.G4;
    ss.resize(G);
    sz.resize(G);
    for (int i = 0; i < G; ++i) {
      ss[i] = half_to_float(w.ss[(int64_t)c * G + i]);
      sz[i] = half_to_float(w.sz[(int64_t)c * G + i]);
    }
    chunk = c;
  }
};

// y[m][n] from the accumulators: (0 + 1) + (2 + 3), then lanes l + l+4, l + l+2, 0 + 1 (the AVX2 path's
// reduction), the outliers in CSR order, the bias.
inline float finish(const float (&acc)[kAcc][kLanes], const MixedWeights& w, const float* x, int n, const float* bias) {
  float v[kLanes];
  for (int l = 0; l < kLanes; ++l) v[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  float t[4], u[2];
  for (int l = 0; l < 4; ++l) t[l] = v[l] + v[l + 4];
  for (int l = 0; l < 2; ++l) u[l] = t[l] + t[l + 2];
  float y = u[0] + u[1];
  if (w.ov != nullptr)
    for (int i = w.orp[n]; i < w.orp[n + 1]; ++i) y = std::fmaf(w.ov[i], x[w.oc[i]], y);
  return bias ? y + bias[n] : y;
}

// Scalar path: the same lanes and order as the AVX2 path.  Word j of 2-bit group i gives code l of its low half-word
// to lane l of accumulator 2·((i + j) % 2), code 8 + l to the next accumulator; the row's 4-bit words, counted t, give
// code l to accumulator t % 4.
template <int MC>
void row_scalar(const MixedWeights& w, const ChunkScales& cs, const float* x2, const float* x4, const float* x, int K2,
                int K4, int K, int n, const float* bias, float* y) {
  const int g = w.group_size, W2 = w.G2 * g / 16, W4 = w.G4 * g / 8;
  const uint32_t* q2 = w.q2 + (int64_t)n * W2;
  const uint32_t* q4 = w.q4 + (int64_t)n * W4;
  float acc[MC][kAcc][kLanes] = {};
  for (int i = 0; i < w.G2; ++i) {
    const Group gr = group_of(w, w.sc2 + (int64_t)n * w.SW2, w.z2 + (int64_t)n * w.ZW2, cs.ss.data(), cs.sz.data(),
                              i, 2);
    for (int j = 0; j < g / 16; ++j) {
      const int c = 2 * ((i + j) % 2);
      const uint32_t word = q2[i * g / 16 + j];
      const int k0 = i * g + 16 * j;
      for (int l = 0; l < kLanes; ++l) {
        const float lo = gr.s * (float)((int)((word >> (2 * l)) & 3u) - gr.z);
        const float hi = gr.s * (float)((int)((word >> (2 * l + 16)) & 3u) - gr.z);
        for (int m = 0; m < MC; ++m) {
          acc[m][c][l] = std::fmaf(lo, x2[(int64_t)m * K2 + k0 + l], acc[m][c][l]);
          acc[m][c + 1][l] = std::fmaf(hi, x2[(int64_t)m * K2 + k0 + 8 + l], acc[m][c + 1][l]);
        }
      }
    }
  }
  for (int i = 0; i < w.G4; ++i) {
    const Group gr = group_of(w, w.sc4 + (int64_t)n * w.SW4, w.z4 + (int64_t)n * w.ZW4, cs.ss.data() + w.G2,
                              cs.sz.data() + w.G2, i, 4);
    for (int j = 0; j < g / 8; ++j) {
      const int t = i * g / 8 + j;
      const uint32_t word = q4[t];
      const int k0 = i * g + 8 * j;
      for (int l = 0; l < kLanes; ++l) {
        const float v = gr.s * (float)((int)((word >> (4 * l)) & 15u) - gr.z);
        for (int m = 0; m < MC; ++m) acc[m][t % 4][l] = std::fmaf(v, x4[(int64_t)m * K4 + k0 + l], acc[m][t % 4][l]);
      }
    }
  }
  for (int m = 0; m < MC; ++m) y[(int64_t)m * w.N + n] = finish(acc[m], w, x + (int64_t)m * K, n, bias);
}

QLINEAR_TARGET("avx2,fma")
inline __m256 weights8(uint32_t word, __m256i shifts, __m256i mask, __m256i z, __m256 s) {
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), mask);
  return _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, z)));
}

// ŝ and z (as float) of groups [i0, i0 + cnt) of one kind, cnt <= 8, in lanes 0..cnt-1: eight at once from a whole
// block (the values of group_of, operation for operation), one at a time in a partial one (whose words may end the
// row).  Kept in registers: a 32-byte store read back 4 bytes at a time would stall on store forwarding.
QLINEAR_TARGET("avx2,fma")
inline void group_block(const MixedWeights& w, const uint32_t* sc_row, const uint32_t* z_row, const float* ss,
                        const float* sz, int i0, int cnt, int zbits, __m256& s_out, __m256& z_out) {
  if (cnt < 8) {
    alignas(32) float sv[8] = {}, zv[8] = {};
    for (int i = 0; i < cnt; ++i) {
      const Group gr = group_of(w, sc_row, z_row, ss, sz, i0 + i, zbits);
      sv[i] = gr.s;
      zv[i] = (float)gr.z;
    }
    s_out = _mm256_load_ps(sv);
    z_out = _mm256_load_ps(zv);
    return;
  }
  const int sb = w.scale_bits;
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i code;
  if (sb == 8) {  // 4 codes per word: lanes 0-3 from one word, 4-7 from the next
    const int lo = (int)sc_row[i0 / 4], hi = (int)sc_row[i0 / 4 + 1];
    code = _mm256_srlv_epi32(_mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi),
                             _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24));
  } else {  // 2 or 4 bits: the 8 codes sit in one word from bit i0·sb % 32
    const uint32_t word = sc_row[i0 * sb / 32] >> (i0 * sb % 32);
    code = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_mullo_epi32(lanes, _mm256_set1_epi32(sb)));
  }
  code = _mm256_and_si256(code, _mm256_set1_epi32((1 << sb) - 1));
  const uint32_t zword = z_row[i0 * zbits / 32] >> (i0 * zbits % 32);
  const __m256i z = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)zword),
                                                       _mm256_mullo_epi32(lanes, _mm256_set1_epi32(zbits))),
                                     _mm256_set1_epi32((1 << zbits) - 1));
  const __m256 prod = _mm256_mul_ps(_mm256_loadu_ps(ss + i0), _mm256_cvtepi32_ps(code));
  s_out = _mm256_add_ps(_mm256_loadu_ps(sz + i0), prod);
  z_out = _mm256_cvtepi32_ps(z);
}

// One word of 16 2-bit codes of a group whose ŝ and z are lane ii of s, z, against x[m][0..15] (stride K2 per m): the
// group's 4 weights ŝ·(k − z), twice (VPERMPS reads 3 index bits, and above a code's 2 lie the next code's), looked
// up by the codes.
template <int MC, int C>
QLINEAR_TARGET("avx2,fma")
inline void word2(__m256 s, __m256 z, int ii, uint32_t word, const float* x, int K2, __m256 (&acc)[MC][kAcc]) {
  const __m256 codes = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 0.f, 1.f, 2.f, 3.f);
  const __m256i lane = _mm256_set1_epi32(ii), wd = _mm256_set1_epi32((int)word);
  const __m256 table =
      _mm256_mul_ps(_mm256_permutevar8x32_ps(s, lane), _mm256_sub_ps(codes, _mm256_permutevar8x32_ps(z, lane)));
  const __m256i lo_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i hi_shift = _mm256_add_epi32(lo_shift, _mm256_set1_epi32(16));
  const __m256 lo = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(wd, lo_shift));
  const __m256 hi = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(wd, hi_shift));
  for (int m = 0; m < MC; ++m) {
    acc[m][C] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + (int64_t)m * K2), acc[m][C]);
    acc[m][C + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + (int64_t)m * K2 + 8), acc[m][C + 1]);
  }
}

template <int MC, int C>
QLINEAR_TARGET("avx2,fma")
inline void fma_rows(__m256 v, const float* x, int stride, __m256 (&acc)[MC][kAcc]) {
  for (int m = 0; m < MC; ++m) acc[m][C] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + (int64_t)m * stride), acc[m][C]);
}

template <int MC>
QLINEAR_TARGET("avx2,fma")
void row_avx2(const MixedWeights& w, const ChunkScales& cs, const float* x2, const float* x4, const float* x, int K2,
              int K4, int K, int n, const float* bias, float* y) {
  const int g = w.group_size, W2 = w.G2 * g / 16, W4 = w.G4 * g / 8;
  const uint32_t* q2 = w.q2 + (int64_t)n * W2;
  const uint32_t* q4 = w.q4 + (int64_t)n * W4;
  const __m256i sh4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), m4 = _mm256_set1_epi32(15);
  __m256 sv, zv;
  __m256 acc[MC][kAcc];
  for (int m = 0; m < MC; ++m)
    for (int c = 0; c < kAcc; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int i0 = 0; i0 < w.G2; i0 += 8) {
    const int cnt = w.G2 - i0 < 8 ? w.G2 - i0 : 8;
    group_block(w, w.sc2 + (int64_t)n * w.SW2, w.z2 + (int64_t)n * w.ZW2, cs.ss.data(), cs.sz.data(), i0, cnt, 2, sv,
                zv);
    if (g == 16 && cnt == 8) {  // the format's default: one word per group, 8 groups unrolled
      for (int ii = 0; ii < 8; ii += 2) {
        word2<MC, 0>(sv, zv, ii, q2[i0 + ii], x2 + (i0 + ii) * 16, K2, acc);
        word2<MC, 2>(sv, zv, ii + 1, q2[i0 + ii + 1], x2 + (i0 + ii + 1) * 16, K2, acc);
      }
    } else {
      for (int ii = 0; ii < cnt; ++ii)
        for (int j = 0; j < g / 16; ++j) {
          const int wi = (i0 + ii) * g / 16 + j;
          if ((i0 + ii + j) % 2) word2<MC, 2>(sv, zv, ii, q2[wi], x2 + 16 * wi, K2, acc);
          else word2<MC, 0>(sv, zv, ii, q2[wi], x2 + 16 * wi, K2, acc);
        }
    }
  }
  for (int i0 = 0; i0 < w.G4; i0 += 8) {
    const int cnt = w.G4 - i0 < 8 ? w.G4 - i0 : 8;
    group_block(w, w.sc4 + (int64_t)n * w.SW4, w.z4 + (int64_t)n * w.ZW4, cs.ss.data() + w.G2, cs.sz.data() + w.G2,
                i0, cnt, 4, sv, zv);
    for (int ii = 0; ii < cnt; ++ii) {
      const int i = i0 + ii;
      const __m256i lane = _mm256_set1_epi32(ii);
      const __m256 s = _mm256_permutevar8x32_ps(sv, lane);
      const __m256i z = _mm256_cvtps_epi32(_mm256_permutevar8x32_ps(zv, lane));
      for (int j = 0; j < g / 8; ++j) {
        const int t = i * g / 8 + j;
        const __m256 v = weights8(q4[t], sh4, m4, z, s);
        switch (t % 4) {  // constant indices keep the accumulators in registers
          case 0: fma_rows<MC, 0>(v, x4 + 8 * t, K4, acc); break;
          case 1: fma_rows<MC, 1>(v, x4 + 8 * t, K4, acc); break;
          case 2: fma_rows<MC, 2>(v, x4 + 8 * t, K4, acc); break;
          default: fma_rows<MC, 3>(v, x4 + 8 * t, K4, acc); break;
        }
      }
    }
  }
  for (int m = 0; m < MC; ++m) {
    alignas(32) float lanes[kAcc][kLanes];
    for (int c = 0; c < kAcc; ++c) _mm256_store_ps(lanes[c], acc[m][c]);
    y[(int64_t)m * w.N + n] = finish(lanes, w, x + (int64_t)m * K, n, bias);
  }
}

template <int MC>
void rows(const MixedWeights& w, const float* x2, const float* x4, const float* x, int K2, int K4, int K,
          const float* bias, float* y, int n0, int n1, int path) {
  ChunkScales cs;
  for (int n = n0; n < n1; ++n) {
    cs.load(w, n / w.scale_group_size);
    if (path == kScalar) row_scalar<MC>(w, cs, x2, x4, x, K2, K4, K, n, bias, y);
    else row_avx2<MC>(w, cs, x2, x4, x, K2, K4, K, n, bias, y);
  }
}

// The g weights ŝ·(q − z) of one group from its words (BITS-bit codes, code t of a word at bits BITS·t).
template <int BITS>
void group_weights(const uint32_t* q, int g, Group gr, float* dst) {
  constexpr int kPer = 32 / BITS;
  for (int wd = 0; wd < g / kPer; ++wd)
    for (int t = 0; t < kPer; ++t)
      dst[wd * kPer + t] = gr.s * (float)((int)((q[wd] >> (BITS * t)) & ((1u << BITS) - 1u)) - gr.z);
}

}  // namespace

void mixed_dequantize(const MixedWeights& w, float* out, int n0, int n1) {
  const int g = w.group_size, G = w.G2 + w.G4, K = G * g, W2 = w.G2 * g / 16, W4 = w.G4 * g / 8;
  std::vector<int> first(G);  // the input column of each group of a kind, in the kind's order: 2-bit, then 4-bit
  for (int i = 0, c2 = 0, c4 = w.G2; i < G; ++i) first[(w.kinds[i / 32] >> (i % 32)) & 1u ? c4++ : c2++] = i * g;
  ChunkScales cs;
  for (int n = n0; n < n1; ++n) {
    cs.load(w, n / w.scale_group_size);
    float* row = out + (int64_t)n * K;
    for (int i = 0; i < G; ++i) {
      const bool four = i >= w.G2;
      const int r = four ? i - w.G2 : i;
      const Group gr = four ? group_of(w, w.sc4 + (int64_t)n * w.SW4, w.z4 + (int64_t)n * w.ZW4, cs.ss.data() + w.G2,
                                       cs.sz.data() + w.G2, r, 4)
                            : group_of(w, w.sc2 + (int64_t)n * w.SW2, w.z2 + (int64_t)n * w.ZW2, cs.ss.data(),
                                       cs.sz.data(), r, 2);
      const uint32_t* q = four ? w.q4 + (int64_t)n * W4 + r * g / 8 : w.q2 + (int64_t)n * W2 + r * g / 16;
      float* dst = row + first[i];
      if (four) group_weights<4>(q, g, gr, dst);
      else group_weights<2>(q, g, gr, dst);
    }
    if (w.ov != nullptr)  // the format adds each outlier to its weight (one fp32 rounding)
      for (int i = w.orp[n]; i < w.orp[n + 1]; ++i) row[w.oc[i]] += w.ov[i];
  }
}

bool mixed_path_supported(int path) { return path == kScalar || (path == kAVX2 && path_supported(kAVX2, kU4)); }

void mixed_run(const MixedWeights& w, const float* x2, const float* x4, const float* x, int M, const float* bias,
               float* y, int n0, int n1, int path) {
  if (path == kAuto) path = mixed_path_supported(kAVX2) ? kAVX2 : kScalar;
  const int K2 = w.G2 * w.group_size, K4 = w.G4 * w.group_size, K = K2 + K4;
  for (int m0 = 0; m0 < M; m0 += kMaxM) {
    const int mc = M - m0 < kMaxM ? M - m0 : kMaxM;
    const float *a2 = x2 + (int64_t)m0 * K2, *a4 = x4 + (int64_t)m0 * K4, *a = x + (int64_t)m0 * K;
    float* out = y + (int64_t)m0 * w.N;
    switch (mc) {
      case 1: rows<1>(w, a2, a4, a, K2, K4, K, bias, out, n0, n1, path); break;
      default: rows<2>(w, a2, a4, a, K2, K4, K, bias, out, n0, n1, path); break;
    }
  }
}

}  // namespace qlinear_x86
