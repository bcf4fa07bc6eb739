// x86 GEMV for the mixed 2/4/16 format (layout x86_mixed; qgemm.h has the buffers and the arithmetic,
// backends/x86/__init__.py the executable spec).  The Arm paper's int8 recipe at the format's own granularity:
// activations quantized per 16 inputs (a mixed group is 16·j inputs with its own scale, zero point and width), 16 rows
// interleaved so that one VPDPBUSD (AVX-512 VNNI: all 16 rows; AVX-VNNI or VPMADDUBSW + VPMADDWD: 8 at a time)
// multiplies 4 codes of each row by 4 shared activations, the codes' integer sums exact in int32, then per group
// ŝ·Σ xs·(I − z·Σ xq) in fp32; the outliers are added after in float32.
// Built with -ffp-contract=off like kernels.cpp, so the scalar path's fmaf calls are the SIMD paths' FMAs and all paths
// give the same bits.
#ifdef QLINEAR_X86_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/fma.h>
#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32
#define QLINEAR_TARGET(features)
#else
#include <immintrin.h>
#define QLINEAR_TARGET(features) __attribute__((target(features)))
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "qgemm.h"

namespace qlinear_x86 {
namespace {

constexpr int kRows = 16;  // rows per block: one 32-bit lane each of a 512-bit register (two 256-bit halves)
constexpr int kMaxM = 4;   // activation rows per pass over a block's weights

inline int scale_words(const MixedWeights& w) { return (w.G2 + w.G4) * w.scale_bits / 2; }
inline int zero_words(const MixedWeights& w) { return w.G2 + 2 * w.G4; }

// The first 16-input block of x that group i (layout order) reads.
struct Groups {
  std::vector<int> h0;      // [G]: by layout index, the group's first 16-input chunk of x
  std::vector<int> layout;  // [G]: by group of x, its layout index
  explicit Groups(const MixedWeights& w) : h0(w.G2 + w.G4), layout(w.G2 + w.G4) {
    for (int i = 0, c2 = 0, c4 = w.G2; i < w.G2 + w.G4; ++i) {
      layout[i] = (w.kinds[i / 32] >> (i % 32)) & 1u ? c4++ : c2++;
      h0[layout[i]] = i * w.group_size / 16;
    }
  }
};

// Bit offsets of row r's (r = 0..15) scale code and zero point of group i in its block's words (qgemm.h).
inline int scale_bit(const MixedWeights& w, int i, int r) { return w.scale_bits * (kRows * i + r); }
inline int zero_bit(const MixedWeights& w, int i, int r) {
  return i < w.G2 ? 32 * i + 2 * r : 32 * w.G2 + 64 * (i - w.G2) + 4 * r;
}
inline unsigned field(const uint32_t* words, int bit, int bits) {
  return (words[bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
}

// The second-order (scale_scale, scale_zero) of a block's rows as float32: one pair per group when the block's rows
// share a row chunk (`uniform`, reloaded only when the chunk changes), else one per lane and group ([G][16]).
struct BlockScales {
  bool uniform = true;
  int chunk = -1;
  std::vector<float> ss, sz;
  void load(const MixedWeights& w, int b) {
    const int G = w.G2 + w.G4, sg = w.scale_group_size, last = std::min(kRows * b + kRows, w.N) - 1;
    const int c0 = kRows * b / sg;
    uniform = c0 == last / sg;
    if (uniform) {
      if (c0 == chunk) return;
      ss.resize(G);
      sz.resize(G);
      for (int i = 0; i < G; ++i) {
        ss[i] = half_to_float(w.ss[(int64_t)c0 * G + i]);
        sz[i] = half_to_float(w.sz[(int64_t)c0 * G + i]);
      }
      chunk = c0;
      return;
    }
    chunk = -1;
    ss.resize((size_t)G * kRows);
    sz.resize((size_t)G * kRows);
    for (int r = 0; r < kRows; ++r) {
      const int c = std::min(kRows * b + r, last) / sg;  // rows past N: any chunk, their results are dropped
      for (int i = 0; i < G; ++i) {
        ss[(size_t)i * kRows + r] = half_to_float(w.ss[(int64_t)c * G + i]);
        sz[(size_t)i * kRows + r] = half_to_float(w.sz[(int64_t)c * G + i]);
      }
    }
  }
  float scale(int i, int r, unsigned code) const {  // ŝ = scale_zero + scale_scale·code, as the format rounds it
    const size_t at = uniform ? (size_t)i : (size_t)i * kRows + r;
    const float prod = ss[at] * (float)code;
    return sz[at] + prod;
  }
};

inline int load32(const void* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

// y of the block's rows from the lanes' accumulators: the outliers in CSR order, then the bias.
inline void finish(const float* acc, const MixedWeights& w, const MixedActs& a, int m, int b, const float* bias,
                   float* y) {
  const float* x = a.x + (int64_t)m * a.K;
  for (int r = 0; r < kRows && kRows * b + r < w.N; ++r) {
    const int n = kRows * b + r;
    float v = acc[r];
    if (w.ov != nullptr)
      for (int i = w.orp[n]; i < w.orp[n + 1]; ++i) v = std::fmaf(w.ov[i], x[w.oc[i]], v);
    y[(int64_t)m * w.N + n] = bias ? v + bias[n] : v;
  }
}

// A block's words: the codes of its 2-bit and 4-bit groups, its scale codes and zero points.
struct BlockWords {
  const uint32_t *q2, *q4, *sc, *z;
  BlockWords(const MixedWeights& w, int b) {
    const int g = w.group_size;
    q2 = w.q2 + (int64_t)b * (w.G2 * g / 16) * kRows;
    q4 = w.q4 + (int64_t)b * (w.G4 * g / 8) * kRows;
    sc = w.sc + (int64_t)b * scale_words(w);
    z = w.z + (int64_t)b * zero_words(w);
  }
  // Lane 0's word of chunk c (16 inputs) of group i: 2-bit groups one word per lane, 4-bit groups two (8 inputs each).
  const uint32_t* chunk(const MixedWeights& w, int i, int c) const {
    const int g = w.group_size;
    return i < w.G2 ? q2 + (int64_t)(i * g / 16 + c) * kRows : q4 + (int64_t)((i - w.G2) * g / 8 + 2 * c) * kRows;
  }
};

// Expanded word t (0..3) of lane r of a chunk: byte j = the code at input 4t + j of the chunk (qgemm.h).
inline uint32_t expand(const uint32_t* chunk, bool four, int r, int t) {
  return four ? (chunk[(t / 2) * kRows + r] >> (4 * (t % 2))) & 0x0F0F0F0Fu : (chunk[r] >> (2 * t)) & 0x03030303u;
}

// The weight s·(q − z) of byte j of an expanded word e (one fp32 rounding: the format's value).
inline float weight(uint32_t e, int j, float s, int zp) { return s * (float)((int)((e >> (8 * j)) & 0xFFu) - zp); }

template <int MC>
void block_scalar(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const MixedActs& a, int m0, int b,
                  const float* bias, float* y) {
  const BlockWords bw(w, b);
  float acc[MC][kRows] = {};
  for (int i = 0; i < w.G2 + w.G4; ++i) {
    const bool four = i >= w.G2;
    for (int r = 0; r < kRows; ++r) {
      const float s = bs.scale(i, r, field(bw.sc, scale_bit(w, i, r), w.scale_bits));
      const float zf = (float)field(bw.z, zero_bit(w, i, r), four ? 4 : 2);
      float t[MC] = {};
      for (int c = 0; c < w.group_size / 16; ++c) {
        const int h = gs.h0[i] + c;
        for (int m = 0; m < MC; ++m) {
          const int8_t* xq = a.xq + (int64_t)(m0 + m) * a.K + 16 * h;
          int I = 0;
          for (int k = 0; k < 4; ++k) {
            const uint32_t e = expand(bw.chunk(w, i, c), four, r, k);
            for (int j = 0; j < 4; ++j) I += (int)((e >> (8 * j)) & 0xFFu) * xq[4 * k + j];
          }
          const int64_t at = (int64_t)(m0 + m) * (a.K / 16) + h;
          const float d = std::fmaf(-zf, a.xsum[at], (float)I);
          t[m] = std::fmaf(a.xs[at], d, t[m]);
        }
      }
      for (int m = 0; m < MC; ++m) acc[m][r] = std::fmaf(s, t[m], acc[m][r]);
    }
  }
  for (int m = 0; m < MC; ++m) finish(acc[m], w, a, m0 + m, b, bias, y);
}

// ---- AVX2 (+ AVX-VNNI): a block's 16 rows as two 8-lane halves ---------------------------------------------------
// The 8 lanes' fields of a shifted word (lane r at bit bits·r), as int32: shifts = bits·r, mask = 2^bits − 1.
struct LaneFields {
  __m256i shifts, mask;
};
QLINEAR_TARGET("avx2,fma,avxvnni")
inline LaneFields lane_fields(int bits) {
  return {_mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits),
          _mm256_set1_epi32((1 << bits) - 1)};
}
// Lanes 8·hf .. 8·hf + 7 of the `bits`-bit fields at `bit0` (the field of lane 0): 8 bytes for 8 bits, else one
// shifted word (8·bits <= 32 bits, from a word boundary).
QLINEAR_TARGET("avx2,fma,avxvnni")
inline __m256i half_fields(const uint32_t* words, int bit0, int bits, int hf, const LaneFields& f) {
  const int bit = bit0 + 8 * bits * hf;
  if (bits == 8) return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                     reinterpret_cast<const uint8_t*>(words) + bit / 8)));
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)(words[bit / 32] >> (bit % 32))), f.shifts),
                          f.mask);
}

// Σ over one 16-input chunk of the 4 expanded code vectors times activations xq[0..15], int32 per lane, exact:
// VPDPBUSD (AVX-VNNI; two chains, its latency would otherwise bound the loop), or VPMADDUBSW pairs (at most
// 2·15·127) summed in int16 (at most 8·15·127 < 2^15) + VPMADDWD.
template <bool VNNI>
QLINEAR_TARGET("avx2,fma,avxvnni")
inline __m256i chunk_dot(const __m256i (&e)[4], const int8_t* xq) {
  __m256i x[4];
  for (int k = 0; k < 4; ++k) x[k] = _mm256_set1_epi32(load32(xq + 4 * k));
  if constexpr (VNNI) {
    const __m256i z = _mm256_setzero_si256();
    return _mm256_add_epi32(_mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, e[0], x[0]), e[1], x[1]),
                            _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, e[2], x[2]), e[3], x[3]));
  } else {
    const __m256i sum = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(e[0], x[0]), _mm256_maddubs_epi16(e[1], x[1])),
                                         _mm256_add_epi16(_mm256_maddubs_epi16(e[2], x[2]), _mm256_maddubs_epi16(e[3], x[3])));
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
  }
}

// Groups [i0, i1) of one kind (FOUR: 4-bit) of a block into acc (two 8-lane halves per activation row); p: the first
// group's code words.
template <int MC, bool UNIFORM, bool VNNI, bool FOUR>
QLINEAR_TARGET("avx2,fma,avxvnni")
inline void groups_avx2(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const MixedActs& a, int m0,
                        const BlockWords& bw, int i0, int i1, const uint32_t* p, __m256 (&acc)[MC][2]) {
  const int KH = a.K / 16, chunks = w.group_size / 16, sb = w.scale_bits;
  const __m256i mask = _mm256_set1_epi32(FOUR ? 0x0F0F0F0F : 0x03030303);
  const LaneFields fs = lane_fields(sb == 8 ? 4 : sb), fz = lane_fields(FOUR ? 4 : 2);
  for (int i = i0; i < i1; ++i, p += chunks * (FOUR ? 2 : 1) * kRows) {
    for (int hf = 0; hf < 2; ++hf) {
      const __m256i code = half_fields(bw.sc, scale_bit(w, i, 0), sb, hf, fs);
      const size_t at = UNIFORM ? (size_t)i : (size_t)i * kRows + 8 * hf;
      const __m256 ss = UNIFORM ? _mm256_set1_ps(bs.ss[at]) : _mm256_loadu_ps(&bs.ss[at]);
      const __m256 sz = UNIFORM ? _mm256_set1_ps(bs.sz[at]) : _mm256_loadu_ps(&bs.sz[at]);
      const __m256 s = _mm256_add_ps(sz, _mm256_mul_ps(ss, _mm256_cvtepi32_ps(code)));
      const __m256 zf = _mm256_cvtepi32_ps(half_fields(bw.z, zero_bit(w, i, 0), FOUR ? 4 : 2, hf, fz));
      __m256 t[MC];
      for (int m = 0; m < MC; ++m) t[m] = _mm256_setzero_ps();
      for (int c = 0; c < chunks; ++c) {
        const int h = gs.h0[i] + c;
        const uint32_t* q = p + c * (FOUR ? 2 : 1) * kRows + 8 * hf;
        __m256i e[4];
        if constexpr (FOUR) {
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kRows));
          e[0] = _mm256_and_si256(lo, mask);
          e[1] = _mm256_and_si256(_mm256_srli_epi32(lo, 4), mask);
          e[2] = _mm256_and_si256(hi, mask);
          e[3] = _mm256_and_si256(_mm256_srli_epi32(hi, 4), mask);
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
          for (int k = 0; k < 4; ++k) e[k] = _mm256_and_si256(_mm256_srli_epi32(v, 2 * k), mask);
        }
        for (int m = 0; m < MC; ++m) {
          const __m256 I = _mm256_cvtepi32_ps(chunk_dot<VNNI>(e, a.xq + (int64_t)(m0 + m) * a.K + 16 * h));
          const int64_t ah = (int64_t)(m0 + m) * KH + h;
          const __m256 d = _mm256_fnmadd_ps(zf, _mm256_set1_ps(a.xsum[ah]), I);
          t[m] = _mm256_fmadd_ps(_mm256_set1_ps(a.xs[ah]), d, t[m]);
        }
      }
      for (int m = 0; m < MC; ++m) acc[m][hf] = _mm256_fmadd_ps(s, t[m], acc[m][hf]);
    }
  }
}

template <int MC, bool UNIFORM, bool VNNI>
QLINEAR_TARGET("avx2,fma,avxvnni")
void block_avx2(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const MixedActs& a, int m0, int b,
                const float* bias, float* y) {
  const BlockWords bw(w, b);
  __m256 acc[MC][2];
  for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  groups_avx2<MC, UNIFORM, VNNI, false>(w, gs, bs, a, m0, bw, 0, w.G2, bw.q2, acc);
  groups_avx2<MC, UNIFORM, VNNI, true>(w, gs, bs, a, m0, bw, w.G2, w.G2 + w.G4, bw.q4, acc);
  for (int m = 0; m < MC; ++m) {
    alignas(32) float lanes[kRows];
    _mm256_store_ps(lanes, acc[m][0]);
    _mm256_store_ps(lanes + 8, acc[m][1]);
    finish(lanes, w, a, m0 + m, b, bias, y);
  }
}

// ---- AVX-512 VNNI: a block's 16 rows in one register ----------------------------------------------------------------
#define QLINEAR_AVX512 "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"

// The 16 lanes' `bits`-bit fields at `bit0` (lane r at bit0 + bits·r; a 32-bit boundary) as int32: for 2 and 4 bits
// one VPMULTISHIFTQB, byte r taking the 8 bits at offset bits·r of the 16 fields' word(s), duplicated per qword.
QLINEAR_TARGET(QLINEAR_AVX512)
inline __m512i fields16(const uint32_t* words, int bit0, int bits) {
  const uint32_t* p = words + bit0 / 32;
  __m128i f;
  if (bits == 8) {
    f = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    const uint64_t v = bits == 4 ? (uint64_t)p[0] | (uint64_t)p[1] << 32 : p[0];  // only the 16 fields' words
    const __m128i offsets = bits == 4 ? _mm_setr_epi8(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60)
                                      : _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    f = _mm_and_si128(_mm_multishift_epi64_epi8(offsets, _mm_set1_epi64x((long long)v)),
                      _mm_set1_epi8((char)((1 << bits) - 1)));
  }
  return _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(f));
}

// ŝ of group i for the block's 16 rows (lane r: row r), as BlockScales::scale rounds it.
QLINEAR_TARGET(QLINEAR_AVX512)
inline __m512 scales16(const MixedWeights& w, const BlockScales& bs, const BlockWords& bw, int i) {
  const __m512i code = fields16(bw.sc, scale_bit(w, i, 0), w.scale_bits);
  const __m512 ss = bs.uniform ? _mm512_set1_ps(bs.ss[i]) : _mm512_loadu_ps(&bs.ss[(size_t)i * kRows]);
  const __m512 sz = bs.uniform ? _mm512_set1_ps(bs.sz[i]) : _mm512_loadu_ps(&bs.sz[(size_t)i * kRows]);
  return _mm512_add_ps(sz, _mm512_mul_ps(ss, _mm512_cvtepi32_ps(code)));
}

// Groups [i0, i1) of one kind (FOUR: 4-bit) of a block into acc; p: the first group's code words (the kind's chunks
// follow each other: 16 words per 2-bit chunk, 32 per 4-bit chunk).
template <int MC, bool FOUR>
QLINEAR_TARGET(QLINEAR_AVX512)
inline void groups_avx512(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const MixedActs& a, int m0,
                          const BlockWords& bw, int i0, int i1, const uint32_t* p, __m512 (&acc)[MC]) {
  const int KH = a.K / 16, chunks = w.group_size / 16;
  const __m512i mask = _mm512_set1_epi32(FOUR ? 0x0F0F0F0F : 0x03030303);
  for (int i = i0; i < i1; ++i) {
    const __m512 s = scales16(w, bs, bw, i);
    const __m512 zf = _mm512_cvtepi32_ps(fields16(bw.z, zero_bit(w, i, 0), FOUR ? 4 : 2));
    __m512 t[MC];
    for (int m = 0; m < MC; ++m) t[m] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; ++c, p += (FOUR ? 2 : 1) * kRows) {
      const int h = gs.h0[i] + c;
      __m512i e[4];
      if constexpr (FOUR) {
        const __m512i lo = _mm512_loadu_si512(p), hi = _mm512_loadu_si512(p + kRows);
        e[0] = _mm512_and_si512(lo, mask);
        e[1] = _mm512_and_si512(_mm512_srli_epi32(lo, 4), mask);
        e[2] = _mm512_and_si512(hi, mask);
        e[3] = _mm512_and_si512(_mm512_srli_epi32(hi, 4), mask);
      } else {
        const __m512i v = _mm512_loadu_si512(p);
        for (int k = 0; k < 4; ++k) e[k] = _mm512_and_si512(_mm512_srli_epi32(v, 2 * k), mask);
      }
      for (int m = 0; m < MC; ++m) {
        const int8_t* xq = a.xq + (int64_t)(m0 + m) * a.K + 16 * h;
        const __m512i z = _mm512_setzero_si512();
        const __m512i I = _mm512_add_epi32(
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, e[0], _mm512_set1_epi32(load32(xq))), e[1],
                                _mm512_set1_epi32(load32(xq + 4))),
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, e[2], _mm512_set1_epi32(load32(xq + 8))), e[3],
                                _mm512_set1_epi32(load32(xq + 12))));
        const int64_t ah = (int64_t)(m0 + m) * KH + h;
        const __m512 d = _mm512_fnmadd_ps(zf, _mm512_set1_ps(a.xsum[ah]), _mm512_cvtepi32_ps(I));
        t[m] = _mm512_fmadd_ps(_mm512_set1_ps(a.xs[ah]), d, t[m]);
      }
    }
    for (int m = 0; m < MC; ++m) acc[m] = _mm512_fmadd_ps(s, t[m], acc[m]);
  }
}

template <int MC>
QLINEAR_TARGET(QLINEAR_AVX512)
void block_avx512(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const MixedActs& a, int m0, int b,
                  const float* bias, float* y) {
  const BlockWords bw(w, b);
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  groups_avx512<MC, false>(w, gs, bs, a, m0, bw, 0, w.G2, bw.q2, acc);
  groups_avx512<MC, true>(w, gs, bs, a, m0, bw, w.G2, w.G2 + w.G4, bw.q4, acc);
  for (int m = 0; m < MC; ++m) {
    alignas(64) float lanes[kRows];
    _mm512_store_ps(lanes, acc[m]);
    finish(lanes, w, a, m0 + m, b, bias, y);
  }
}

// The 16 weights s·(q − z) of one row's chunk (its word(s) at `word`, the next 8 inputs of a 4-bit chunk kRows words
// on), in input order: the scalar path's integers and its one fp32 product each.
QLINEAR_TARGET("avx2,fma")
inline void chunk_weights_avx2(const uint32_t* word, bool four, float s, int zp, float* dst) {
  const __m256i z = _mm256_set1_epi32(zp);
  const __m256 sv = _mm256_set1_ps(s);
  for (int half = 0; half < 2; ++half) {  // inputs 8·half .. 8·half + 7
    __m256i q;
    if (four)  // input 4h + j of a word at bits 8j + 4h
      q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word[half * kRows]),
                                             _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28)), _mm256_set1_epi32(15));
    else  // input 4t + j at bits 8j + 2t
      q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word[0]),
                                             _mm256_add_epi32(_mm256_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26),
                                                              _mm256_set1_epi32(4 * half))), _mm256_set1_epi32(3));
    _mm256_storeu_ps(dst + 8 * half, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, z))));
  }
}

template <int MC>
void blocks(const MixedWeights& w, const MixedActs& a, int m0, const float* bias, float* y, int b0, int b1, int path) {
  const Groups gs(w);
  BlockScales bs;
  for (int b = b0; b < b1; ++b) {
    bs.load(w, b);
    const bool u = bs.uniform;
    switch (path) {
      case kScalar: block_scalar<MC>(w, gs, bs, a, m0, b, bias, y); break;
      case kAVX2: u ? block_avx2<MC, true, false>(w, gs, bs, a, m0, b, bias, y)
                    : block_avx2<MC, false, false>(w, gs, bs, a, m0, b, bias, y); break;
      case kAVX2VNNI: u ? block_avx2<MC, true, true>(w, gs, bs, a, m0, b, bias, y)
                        : block_avx2<MC, false, true>(w, gs, bs, a, m0, b, bias, y); break;
      default: block_avx512<MC>(w, gs, bs, a, m0, b, bias, y); break;
    }
  }
}

}  // namespace

int64_t mixed_acts_bytes(int M, int K) { return ((int64_t)M * K + 63) / 64 * 64 + 2 * (int64_t)M * (K / 16) * 4; }

void mixed_prepare_acts(const float* x, int M, int K, void* work, MixedActs* a) {
  int8_t* xq = static_cast<int8_t*>(work);
  float* xs = reinterpret_cast<float*>(xq + ((int64_t)M * K + 63) / 64 * 64);
  float* xsum = xs + (int64_t)M * (K / 16);
  for (int64_t h = 0; h < (int64_t)M * (K / 16); ++h)
    xsum[h] = (float)quantize_block(x + 16 * h, 16, xq + 16 * h, xs + h);
  *a = MixedActs{xq, xs, xsum, x, M, K};
}

namespace {
QLINEAR_TARGET(QLINEAR_AVX512) inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
QLINEAR_TARGET(QLINEAR_AVX512) inline void store16(uint16_t* p, __m512 v) {  // rounded once (bf16_bits)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v));
}

// Block b's rows of Ŵ (out[r]: row r, float32, or bfloat16 without the outliers: patch_outliers) with AVX-512: per
// group the 16 rows' ŝ and zero points at once (as the GEMV's AVX-512 path), then per row and 16-input chunk the codes
// in 16 lanes; the same fp32 products as the scalar path (ŝ·(q − z), one rounding).
template <typename T>
QLINEAR_TARGET(QLINEAR_AVX512)
void block_weights_avx512(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const BlockWords& bw,
                          int rows, T* const* out) {
  // lane k = 4t + j of a chunk reads bits 8j + 2t of its word (2 bits), or 8(k % 4) + 4((k / 4) % 2) of word k / 8
  const __m512i shift2 = _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30);
  const __m512i shift4 = _mm512_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28, 0, 8, 16, 24, 4, 12, 20, 28);
  alignas(64) float sv[kRows];
  alignas(64) int32_t zv[kRows];
  for (int i = 0; i < w.G2 + w.G4; ++i) {
    const bool four = i >= w.G2;
    _mm512_store_ps(sv, scales16(w, bs, bw, i));
    _mm512_store_si512(zv, fields16(bw.z, zero_bit(w, i, 0), four ? 4 : 2));
    for (int c = 0; c < w.group_size / 16; ++c) {
      const uint32_t* chunk = bw.chunk(w, i, c);
      for (int r = 0; r < rows; ++r) {
        const __m512i q =
            four ? _mm512_and_si512(_mm512_srlv_epi32(_mm512_mask_set1_epi32(_mm512_set1_epi32((int)chunk[r]), 0xFF00,
                                                                             (int)chunk[kRows + r]), shift4),
                                    _mm512_set1_epi32(15))
                 : _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)chunk[r]), shift2), _mm512_set1_epi32(3));
        store16(out[r] + 16 * (gs.h0[i] + c),
                _mm512_mul_ps(_mm512_set1_ps(sv[r]), _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(zv[r])))));
      }
    }
  }
}

// Row r of block b in bfloat16 at the outliers' columns: ŝ·(q − z) + o in float32 (the scalar path's operations, the
// same values as every path), rounded once.
void patch_outliers(const MixedWeights& w, const Groups& gs, const BlockScales& bs, const BlockWords& bw, int b, int r,
                    uint16_t* row) {
  const int g = w.group_size, n = kRows * b + r;
  for (int o = w.orp[n]; o < w.orp[n + 1]; ++o) {
    const int col = w.oc[o], i = gs.layout[col / g], p = col % g;
    const bool four = i >= w.G2;
    const float s = bs.scale(i, r, field(bw.sc, scale_bit(w, i, r), w.scale_bits));
    const int zp = (int)field(bw.z, zero_bit(w, i, r), four ? 4 : 2);
    row[col] = bf16_bits(weight(expand(bw.chunk(w, i, p / 16), four, r, (p % 16) / 4), p % 4, s, zp) + w.ov[o]);
  }
}
}  // namespace

void mixed_dequantize(const MixedWeights& w, void* out, int b0, int b1, int path, int row0, bool bf16) {
  if (path == kAuto)
    path = mixed_path_supported(kAVX512VNNI) ? kAVX512VNNI : mixed_path_supported(kAVX2) ? kAVX2 : kScalar;
  const int g = w.group_size, K = (w.G2 + w.G4) * g;
  const Groups gs(w);
  BlockScales bs;
  // bfloat16 rows on the other paths are written as float32 first; kept between calls (the AMX GEMM asks for one block
  // at a time)
  thread_local std::vector<float> scratch;
  if (bf16 && path != kAVX512VNNI) scratch.resize((size_t)kRows * K);
  float* rows[kRows];
  for (int b = b0; b < b1; ++b) {
    bs.load(w, b);
    const BlockWords bw(w, b);
    const int n0 = kRows * b, nr = std::min(kRows, w.N - n0);
    if (bf16 && path == kAVX512VNNI) {
      uint16_t* dst[kRows];
      for (int r = 0; r < nr; ++r) dst[r] = static_cast<uint16_t*>(out) + (int64_t)(n0 + r - row0) * K;
      block_weights_avx512(w, gs, bs, bw, nr, dst);  // bfloat16 straight from the float32 values, outliers after
      if (w.ov != nullptr)
        for (int r = 0; r < nr; ++r) patch_outliers(w, gs, bs, bw, b, r, dst[r]);
      continue;
    }
    for (int r = 0; r < nr; ++r)
      rows[r] = bf16 ? scratch.data() + (size_t)r * K : static_cast<float*>(out) + (int64_t)(n0 + r - row0) * K;
    if (path == kAVX512VNNI) {
      block_weights_avx512(w, gs, bs, bw, nr, rows);
    } else {
      for (int r = 0; r < nr; ++r) {
        for (int i = 0; i < w.G2 + w.G4; ++i) {
          const bool four = i >= w.G2;
          const float s = bs.scale(i, r, field(bw.sc, scale_bit(w, i, r), w.scale_bits));
          const int zp = (int)field(bw.z, zero_bit(w, i, r), four ? 4 : 2);
          for (int c = 0; c < g / 16; ++c) {
            float* dst = rows[r] + 16 * (gs.h0[i] + c);
            if (path != kScalar) {
              chunk_weights_avx2(bw.chunk(w, i, c) + r, four, s, zp, dst);
              continue;
            }
            for (int k = 0; k < 4; ++k) {
              const uint32_t e = expand(bw.chunk(w, i, c), four, r, k);
              for (int j = 0; j < 4; ++j) dst[4 * k + j] = weight(e, j, s, zp);
            }
          }
        }
      }
    }
    for (int r = 0; r < nr; ++r) {
      if (w.ov != nullptr)  // the format adds each outlier to its weight (one fp32 rounding)
        for (int i = w.orp[n0 + r]; i < w.orp[n0 + r + 1]; ++i) rows[r][w.oc[i]] += w.ov[i];
      if (bf16) to_bf16(rows[r], static_cast<uint16_t*>(out) + (int64_t)(n0 + r - row0) * K, K);
    }
  }
}

bool mixed_path_supported(int path) {  // the AVX-512 path also needs VBMI (as the bit-plane kernels' does)
  return path >= kScalar && path <= kAVX512VNNI && path_supported(path, path == kAVX512VNNI ? kLutUniform : kUniform);
}

void mixed_run(const MixedWeights& w, const MixedActs& a, const float* bias, float* y, int b0, int b1, int path) {
  if (path == kAuto) path = best_path(kLutUniform);  // the best of the paths above on this CPU
  for (int m0 = 0; m0 < a.M; m0 += kMaxM) {
    switch (a.M - m0 < kMaxM ? a.M - m0 : kMaxM) {
      case 1: blocks<1>(w, a, m0, bias, y, b0, b1, path); break;
      case 2: blocks<2>(w, a, m0, bias, y, b0, b1, path); break;
      case 3: blocks<3>(w, a, m0, bias, y, b0, b1, path); break;
      default: blocks<4>(w, a, m0, bias, y, b0, b1, path); break;
    }
  }
}

}  // namespace qlinear_x86
