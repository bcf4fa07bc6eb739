// Weight decoders and scale helpers shared by the SDOT/plain (kernels.cpp) and SMMLA (kernels_i8mm.cpp)
// kernels: each turns one packed (8-row, 32-input) block into int8 vectors V[c][p] (see qgemm.h).
#pragma once
#include <string.h>

#include "neon.h"
#include "qgemm.h"

namespace qlinear_arm {
namespace {  // internal linkage: each translation unit (built for its own -march) keeps its own copy

// BCQ uniform int4: MSB-toggled nibbles, unpacked by one shift or one mask (values are 16x).
struct DecBCQ4 {
  static constexpr int kBytes = 128;
  static constexpr bool kOffset = true;
  DecBCQ4() = default;
  explicit DecBCQ4(const Weights&) {}
  inline void group(const Weights&, int, int) {}
  inline void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const uint8x16_t p0 = vld1q_u8(blk + 32 * c), p1 = vld1q_u8(blk + 32 * c + 16);
    const uint8x16_t hi = vdupq_n_u8(0xF0);
    v[0] = vreinterpretq_s8_u8(vshlq_n_u8(p0, 4));
    v[1] = vreinterpretq_s8_u8(vandq_u8(p0, hi));
    v[2] = vreinterpretq_s8_u8(vshlq_n_u8(p1, 4));
    v[3] = vreinterpretq_s8_u8(vandq_u8(p1, hi));
  }
};

// Codebook, 16 centroids, 4-bit indices: one TBL per vector.
struct DecCB4 {
  static constexpr int kBytes = 128;
  static constexpr bool kOffset = false;
  int8x16_t table;
  DecCB4() = default;
  explicit DecCB4(const Weights& w) : table(vld1q_s8(w.books)) {}
  inline void group(const Weights&, int, int) {}
  inline void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const uint8x16_t p0 = vld1q_u8(blk + 32 * c), p1 = vld1q_u8(blk + 32 * c + 16);
    const uint8x16_t lo = vdupq_n_u8(0x0F);
    v[0] = vqtbl1q_s8(table, vandq_u8(p0, lo));
    v[1] = vqtbl1q_s8(table, vshrq_n_u8(p0, 4));
    v[2] = vqtbl1q_s8(table, vandq_u8(p1, lo));
    v[3] = vqtbl1q_s8(table, vshrq_n_u8(p1, 4));
  }
};

// Codebook, 2-bit indices, C <= 4 codebooks of 4 centroids all in one register: TBL index
// (book << 2 | idx) for row pairs 0, 2 and (idx << 2 | book) with the transposed table for 1, 3.
template <bool kMulti>
struct DecCB2 {
  static constexpr int kBytes = 64;
  static constexpr bool kOffset = false;
  int8x16_t table, table_t;
  uint8x16_t o[4];
  DecCB2() = default;
  explicit DecCB2(const Weights& w) {
    int8_t t[16] = {0}, tt[16] = {0};
    memcpy(t, w.books, (size_t)w.num_books * 4);
    for (int book = 0; book < 4; ++book)
      for (int idx = 0; idx < 4; ++idx) tt[idx * 4 + book] = t[book * 4 + idx];
    table = vld1q_s8(t);
    table_t = vld1q_s8(tt);
    for (int p = 0; p < 4; ++p) o[p] = vdupq_n_u8(0);
    if (kMulti) init_constants();
  }
  // The 8 rows' books of (block b, group g) -> per row pair p the book bits of its 16 lanes: one register
  // `books` with (book_r << 2) in lanes 0-7 and book_r in lanes 8-15, then one TBL per row pair.
  uint8x16_t byte_of, shift, mask, pat[4];
  inline void init_constants() {
    static const uint8_t kByteOf[16] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};
    static const int8_t kShift[16] = {2, 0, -2, -4, 2, 0, -2, -4, 0, -2, -4, -6, 0, -2, -4, -6};
    static const uint8_t kMask[16] = {12, 12, 12, 12, 12, 12, 12, 12, 3, 3, 3, 3, 3, 3, 3, 3};
    static const uint8_t kPat[4][2] = {{0, 1}, {10, 11}, {4, 5}, {14, 15}};
    byte_of = vld1q_u8(kByteOf);
    shift = vreinterpretq_u8_s8(vld1q_s8(kShift));
    mask = vld1q_u8(kMask);
    for (int p = 0; p < 4; ++p) pat[p] = vcombine_u8(vdup_n_u8(kPat[p][0]), vdup_n_u8(kPat[p][1]));
  }
  inline void group(const Weights& w, int b, int g) {
    if (!kMulti) return;
    const uint16_t word = w.qb[(size_t)b * ((w.K + w.group_size - 1) / w.group_size) + g];
    const uint8x16_t bytes = vqtbl1q_u8(vreinterpretq_u8_u16(vdupq_n_u16(word)), byte_of);
    const uint8x16_t books = vandq_u8(vshlq_u8(bytes, vreinterpretq_s8_u8(shift)), mask);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) o[p] = vqtbl1q_u8(books, pat[p]);
  }
  inline void chunk(const uint8_t* blk, int c, int8x16_t v[4]) const {
    const uint8x16_t p = vld1q_u8(blk + 16 * c), p4 = vshrq_n_u8(p, 4);
    const uint8x16_t m03 = vdupq_n_u8(0x03), m0c = vdupq_n_u8(0x0C);
    v[0] = vqtbl1q_s8(table, vorrq_u8(vandq_u8(p, m03), o[0]));
    v[1] = vqtbl1q_s8(table_t, vorrq_u8(vandq_u8(p, m0c), o[1]));
    v[2] = vqtbl1q_s8(table, vorrq_u8(vandq_u8(p4, m03), o[2]));
    v[3] = vqtbl1q_s8(table_t, vorrq_u8(vandq_u8(p4, m0c), o[3]));
  }
};

inline float32x4_t load_f16x4(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Scales of one 8-row block, group after group: ws[0..1] = rows 0-3, 4-7; BCQ also z = fma(0.5, s, c).
template <bool kOffset>
struct GroupScales {
  const uint16_t* qs;
  const uint8_t* qz;
  int qz_kind;  // 0 none, 1 fp16, 2 fp32
  GroupScales() = default;
  GroupScales(const Weights& w, int b) {
    const size_t at = (size_t)b * ((w.K + w.group_size - 1) / w.group_size) * 8;
    qs = w.qs + at;
    qz_kind = w.qz == nullptr ? 0 : w.qz_f32 ? 2 : 1;
    qz = qz_kind ? static_cast<const uint8_t*>(w.qz) + at * (qz_kind == 2 ? 4 : 2) : nullptr;
  }
  inline void next(float32x4_t ws[2], float32x4_t z[2]) {
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

template <typename F>
inline void with_decoder(const Weights& w, F&& f) {
  switch (w.format) {
    case kBCQ4: { DecBCQ4 d(w); f(d); break; }
    case kCB4: { DecCB4 d(w); f(d); break; }
    default:
      if (w.num_books > 1) { DecCB2<true> d(w); f(d); } else { DecCB2<false> d(w); f(d); }
  }
}

}  // namespace
}  // namespace qlinear_arm
