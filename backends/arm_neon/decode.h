// Weight decoders and scale helpers shared by the SDOT/plain (kernels.cpp) and SMMLA (kernels_i8mm.cpp)
// kernels: each turns one packed (8-row, 32-input) block into int8 vectors V[c][p] (see qgemm.h).
#pragma once
#include <type_traits>

#include "neon.h"
#include "qgemm.h"

// GCC would otherwise call the decoders out of line, passing the decoded vectors through the stack.
#define QL_INLINE inline __attribute__((always_inline))

namespace qlinear_arm {
namespace {  // internal linkage: each translation unit (built for its own -march) keeps its own copy

// Decoders turn one packed (8-row, 32-input) block into V[c][p] two chunks at a time: pair(blk, ch, v)
// gives v[j][p] = V[2ch + j][p].  kRB: 8-row blocks per M = 1 pass (activation loads shared).

// The 4-bit formats: chunk c is the 32 bytes 32c..32c+31.
template <typename D>
struct ByChunk {
  static constexpr int kBytes = 128;
  static constexpr int kRB = 2;
  QL_INLINE void group(const Weights&, int, int) {}
  QL_INLINE void pair(const uint8_t* blk, int ch, int8x16_t v[2][4]) const {
    static_cast<const D*>(this)->chunk(blk, 2 * ch, v[0]);
    static_cast<const D*>(this)->chunk(blk, 2 * ch + 1, v[1]);
  }
};

// BCQ uniform int4: MSB-toggled nibbles, unpacked by one shift or one mask (values are 16x).
struct DecBCQ4 : ByChunk<DecBCQ4> {
  static constexpr bool kOffset = true;
  DecBCQ4() = default;
  explicit DecBCQ4(const Weights&) {}
  QL_INLINE void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const uint8x16_t p0 = vld1q_u8(blk + 32 * c), p1 = vld1q_u8(blk + 32 * c + 16);
    const uint8x16_t hi = vdupq_n_u8(0xF0);
    v[0] = vreinterpretq_s8_u8(vshlq_n_u8(p0, 4));
    v[1] = vreinterpretq_s8_u8(vandq_u8(p0, hi));
    v[2] = vreinterpretq_s8_u8(vshlq_n_u8(p1, 4));
    v[3] = vreinterpretq_s8_u8(vandq_u8(p1, hi));
  }
};

// BCQ uniform 5-8 bit: the int8 vectors as stored (code − 2^(q−1)), chunk c the 64 bytes 64c..
struct DecU8 : ByChunk<DecU8> {
  static constexpr int kBytes = 256;
  static constexpr bool kOffset = true;
  DecU8() = default;
  explicit DecU8(const Weights&) {}
  QL_INLINE void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const int8_t* at = reinterpret_cast<const int8_t*>(blk) + 64 * c;
    v[0] = vld1q_s8(at);
    v[1] = vld1q_s8(at + 16);
    v[2] = vld1q_s8(at + 32);
    v[3] = vld1q_s8(at + 48);
  }
};

// Codebook, 16 centroids, 4-bit indices: one TBL per vector.
struct DecCB4 : ByChunk<DecCB4> {
  static constexpr bool kOffset = false;
  int8x16_t table;
  DecCB4() = default;
  explicit DecCB4(const Weights& w) : table(vld1q_s8(w.books)) {}
  QL_INLINE void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const uint8x16_t p0 = vld1q_u8(blk + 32 * c), p1 = vld1q_u8(blk + 32 * c + 16);
    const uint8x16_t lo = vdupq_n_u8(0x0F);
    v[0] = vqtbl1q_s8(table, vandq_u8(p0, lo));
    v[1] = vqtbl1q_s8(table, vshrq_n_u8(p0, 4));
    v[2] = vqtbl1q_s8(table, vandq_u8(p1, lo));
    v[3] = vqtbl1q_s8(table, vshrq_n_u8(p1, 4));
  }
};

QL_INLINE int8x16_t lookup(int8x16_t t, uint8x16_t i) { return vqtbl1q_s8(t, i); }
QL_INLINE int8x16_t lookup(int8x16x4_t t, uint8x16_t i) { return vqtbl4q_s8(t, i); }

// Codebook, 2-bit indices, C <= 4 codebooks of 4 centroids.  Bytes 16p.. hold row pair p: the low nibble of
// byte i the indices of V[0][p], V[1][p] byte i, the high nibble those of V[2][p], V[3][p].  The TBL index is
// (book << 4 | nibble) (SLI inserts the lanes' books; with one codebook, the nibble itself after a mask or a
// shift), and two tables read the nibble's low / high index, so 2 TBL per index vector and no merge.
// kSdot: layout sdot (the books word and book vectors differ; see group()).
alignas(16) static const int8_t kQuadShifts[16] = {0, 0, 0, 0, -2, -2, -2, -2, -4, -4, -4, -4, -6, -6, -6, -6};
template <bool kMulti, bool kSdot>
struct DecCB2 {
  static constexpr int kBytes = 64;
  static constexpr int kRB = kMulti ? 1 : 2;  // the 64-byte tables and books leave no room for 2 blocks
  static constexpr bool kOffset = false;
  using Table = typename std::conditional<kMulti, int8x16x4_t, int8x16_t>::type;
  Table lo, hi;           // [book << 4 | j << 2 | i] -> book[i] (lo) / book[j] (hi)
  uint8x16_t books[4];    // per row pair p, the book of each lane's row (see the layouts in qgemm.h)
  uint8x16_t halves;      // layout mmla: byte 0 of the books word to lanes 0-7, byte 1 to lanes 8-15
  const uint16_t* qb;
  int G;
  DecCB2() = default;
  explicit DecCB2(const Weights& w) : qb(w.qb), G((w.K + w.group_size - 1) / w.group_size) {
    int8_t t[2][64] = {{0}};
    for (int book = 0; book < (kMulti ? w.num_books : 1); ++book)
      for (int x = 0; x < 16; ++x) {
        t[0][book * 16 + x] = w.books[book * 4 + (x & 3)];
        t[1][book * 16 + x] = w.books[book * 4 + (x >> 2)];
      }
    load(lo, t[0]);
    load(hi, t[1]);
    halves = vcombine_u8(vdup_n_u8(0), vdup_n_u8(1));
  }
  static void load(int8x16_t& t, const int8_t* p) { t = vld1q_s8(p); }
  static void load(int8x16x4_t& t, const int8_t* p) { t = vld1q_s8_x4(p); }
  // Layout mmla: the word has row 2p's book at bits 2p, 2p + 1 and row 2p + 1's at bits 8 + 2p, 9 + 2p.
  // Layout sdot: rows 0-3 (row pairs 0, 1) in the low byte, rows 4-7 (row pairs 2, 3) in the high byte.
  QL_INLINE void group(const Weights&, int b, int g) {
    if (!kMulti) return;
    const uint8x16_t word = vreinterpretq_u8_u16(vld1q_dup_u16(qb + (size_t)b * G + g));
    const uint8x16_t three = vdupq_n_u8(3);
    if constexpr (kSdot) {  // lane i: the book of row i / 4 of the quad, at bits 2(i / 4) of its byte
      const int8x16_t quads = vld1q_s8(kQuadShifts);
      books[0] = books[1] = vandq_u8(vshlq_u8(vqtbl1q_u8(word, vdupq_n_u8(0)), quads), three);
      books[2] = books[3] = vandq_u8(vshlq_u8(vqtbl1q_u8(word, vdupq_n_u8(1)), quads), three);
      return;
    }
    const uint8x16_t x = vqtbl1q_u8(word, halves);
    books[0] = vandq_u8(x, three);
    books[1] = vandq_u8(vshrq_n_u8(x, 2), three);
    books[2] = vandq_u8(vshrq_n_u8(x, 4), three);
    books[3] = vshrq_n_u8(x, 6);
  }
  QL_INLINE void pair(const uint8_t* blk, int ch, int8x16_t v[2][4]) const {
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const uint8x16_t q = vld1q_u8(blk + 16 * p);
      uint8x16_t i;
      if (kMulti)
        i = vsliq_n_u8(ch ? vshrq_n_u8(q, 4) : q, books[p], 4);
      else
        i = ch ? vshrq_n_u8(q, 4) : vandq_u8(q, vdupq_n_u8(0x0F));
      v[0][p] = lookup(lo, i);
      v[1][p] = lookup(hi, i);
    }
  }
};

// BCQ offsets of 8-row block b (nullptr when there are none); kind: 0 none, 1 fp16, 2 fp32.
inline const uint8_t* block_offsets(const Weights& w, int b, int& kind) {
  kind = w.qz == nullptr ? 0 : w.qz_f32 ? 2 : 1;
  const size_t at = (size_t)b * ((w.K + w.group_size - 1) / w.group_size) * 8;
  return kind ? static_cast<const uint8_t*>(w.qz) + at * (kind == 2 ? 4 : 2) : nullptr;
}

inline float32x4_t load_f16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Scales of one 8-row block, group after group: ws[0..1] = rows 0-3, 4-7; BCQ also z = fma(0.5, s, c).
template <bool kOffset>
struct GroupScales {
  const uint16_t* qs;
  const uint8_t* qz;
  int qz_kind;  // 0 none, 1 fp16, 2 fp32
  GroupScales() = default;
  GroupScales(const Weights& w, int b) : qs(w.qs + (size_t)b * ((w.K + w.group_size - 1) / w.group_size) * 8) {
    qz = block_offsets(w, b, qz_kind);
  }
  QL_INLINE void next(float32x4_t ws[2], float32x4_t z[2]) {
    ws[0] = load_f16x4(qs);
    ws[1] = load_f16x4(qs + 4);
    qs += 8;
    if (!kOffset) return;
    float32x4_t c0 = vdupq_n_f32(0.f), c1 = c0;
    if (qz_kind == 2) {
      c0 = vld1q_f32(reinterpret_cast<const float*>(qz));
      c1 = vld1q_f32(reinterpret_cast<const float*>(qz) + 4);
      qz += 32;
    } else if (qz_kind == 1) {
      c0 = load_f16x4(reinterpret_cast<const uint16_t*>(qz));
      c1 = load_f16x4(reinterpret_cast<const uint16_t*>(qz) + 4);
      qz += 16;
    }
    z[0] = vfmaq_f32(c0, vdupq_n_f32(0.5f), ws[0]);
    z[1] = vfmaq_f32(c1, vdupq_n_f32(0.5f), ws[1]);
  }
};

template <bool kSdot = false, typename F>
inline void with_decoder(const Weights& w, F&& f) {
  switch (w.format) {
    case kBCQ4: { DecBCQ4 d(w); f(d); break; }
    case kCB4: { DecCB4 d(w); f(d); break; }
    case kU8: { DecU8 d(w); f(d); break; }
    default:
      if (w.num_books > 1) { DecCB2<true, kSdot> d(w); f(d); } else { DecCB2<false, kSdot> d(w); f(d); }
  }
}

}  // namespace
}  // namespace qlinear_arm
