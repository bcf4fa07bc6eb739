// SMMLA kernel (i8mm) for M >= 4: each instruction multiplies 2 activation rows x 8 inputs by 8 inputs x
// 2 weight rows into a 2x2 int32 tile.  Activation rows are processed two pairs at a time so that
// every decoded weight vector feeds two SMMLAs; the float epilogue is the same per (row, block)
// arithmetic as the SDOT kernel (qgemm.h), so both paths give identical results.  Layout mmla holds the
// SMMLA operands as they are; layout sdot (4 rows x 4 inputs per vector) is zipped into them.
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.6-a+dotprod+i8mm")
#endif
#include "decode.h"

namespace qlinear_arm {

// out[q][p][i]: activation row 2(mp0 + q) + i / 2, weight row 8b + 2p + i % 2.
static void store_tile(const Weights& w, const Acts& a, int mp0, int MP, const float* out, const float* bias, float* y,
                       int b) {
  const int n0 = 8 * b;
  for (int q = 0; q < MP; ++q) {
    const int m0 = 2 * (mp0 + q);
    const float* o = out + q * 16;
    if (m0 + 1 < a.M && n0 + 8 <= w.N) {  // both rows, all 8 outputs; lanes (m0, n), (m0, n+1), (m1, n), (m1, n+1)
      const float32x4_t t0 = vld1q_f32(o), t1 = vld1q_f32(o + 4), t2 = vld1q_f32(o + 8), t3 = vld1q_f32(o + 12);
      float32x4_t r[4] = {vcombine_f32(vget_low_f32(t0), vget_low_f32(t1)),
                          vcombine_f32(vget_low_f32(t2), vget_low_f32(t3)),
                          vcombine_f32(vget_high_f32(t0), vget_high_f32(t1)),
                          vcombine_f32(vget_high_f32(t2), vget_high_f32(t3))};
      // acc + 0 without a bias, as on every other path (turns -0 into +0)
      const float32x4_t b0 = bias ? vld1q_f32(bias + n0) : vdupq_n_f32(0.f);
      const float32x4_t b1 = bias ? vld1q_f32(bias + n0 + 4) : vdupq_n_f32(0.f);
      r[0] = vaddq_f32(r[0], b0);
      r[1] = vaddq_f32(r[1], b1);
      r[2] = vaddq_f32(r[2], b0);
      r[3] = vaddq_f32(r[3], b1);
      float* y0 = y + (size_t)m0 * w.N + n0;
      vst1q_f32(y0, r[0]);
      vst1q_f32(y0 + 4, r[1]);
      vst1q_f32(y0 + w.N, r[2]);
      vst1q_f32(y0 + w.N + 4, r[3]);
      continue;
    }
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 4; ++i) {
        const int m = m0 + i / 2, n = n0 + 2 * p + i % 2;
        if (m < a.M && n < w.N) y[(size_t)m * w.N + n] = o[p * 4 + i] + (bias ? bias[n] : 0.f);
      }
  }
}

// Layout sdot: the decoded V[c][p] (rows 4(p/2).. x inputs 16(p%2) + 4c..) of chunks c = 2ch, 2ch + 1 zipped by
// 32-bit words into SMMLA operands, 2 rows x 8 inputs: row pairs 2(p/2), 2(p/2) + 1 and octet (inputs 8o..8o + 7)
// o = 2(p%2) + ch.
static inline void zip_pairs(const int8x16_t (&v)[2][4], int8x16_t (&u)[2][4]) {
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    const int32x4_t a = vreinterpretq_s32_s8(v[0][p]), b = vreinterpretq_s32_s8(v[1][p]);
    u[p % 2][p / 2 * 2] = vreinterpretq_s8_s32(vzip1q_s32(a, b));
    u[p % 2][p / 2 * 2 + 1] = vreinterpretq_s8_s32(vzip2q_s32(a, b));
  }
}

template <int MP, bool kSdot, typename Dec>
static void mmla_tile(const Weights& w, const Acts& a, int mp0, const float* bias, float* y, int b, Dec& dec) {
  const int H = w.K / 32, per_group = w.group_size / 32, G = (w.K + w.group_size - 1) / w.group_size;
  const float* xsp = a.xsp;
  const int8_t* xp = a.xp;
  float32x4_t acc[MP][4];  // [activation pair][row pair]: (m0,na) (m0,nb) (m1,na) (m1,nb)
#pragma GCC unroll 16
  for (int q = 0; q < MP; ++q)
#pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) acc[q][p] = vdupq_n_f32(0.f);
  const uint8_t* blk = w.qw + (size_t)b * H * Dec::kBytes;
  float32x4_t ws[2], z[2], wsp[4];
  GroupScales<Dec::kOffset> scales(w, b);
  for (int h = 0, g = 0, left = 0; h < H; ++h, blk += Dec::kBytes, --left) {
    if (left == 0) {  // a new weight group (no division in the loop)
      dec.group(w, b, g);
      scales.next(ws, z);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {  // (w_2p, w_2p+1, w_2p, w_2p+1)
        const float32x2_t s2 = p % 2 ? vget_high_f32(ws[p / 2]) : vget_low_f32(ws[p / 2]);
        wsp[p] = vcombine_f32(s2, s2);
      }
      if (Dec::kOffset) {
#pragma GCC unroll 16
        for (int q = 0; q < MP; ++q) {
          const float32x4_t xsum = vld1q_f32(a.xsump + ((size_t)(mp0 + q) * G + g) * 4);
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) {
            const float32x2_t z2 = p % 2 ? vget_high_f32(z[p / 2]) : vget_low_f32(z[p / 2]);
            acc[q][p] = vfmaq_f32(acc[q][p], vcombine_f32(z2, z2), xsum);
          }
        }
      }
      ++g;
      left = per_group;
    }
    {
      int32x4_t isum[MP][4];
#pragma GCC unroll 16
      for (int q = 0; q < MP; ++q)
#pragma GCC unroll 16
        for (int p = 0; p < 4; ++p) isum[q][p] = vdupq_n_s32(0);
#pragma GCC unroll 2
      for (int ch = 0; ch < 2; ++ch) {
        // v[j]: chunk 2ch + j; mmla: v[j][row pair] is octet 2ch + j, sdot: u[j][row pair] octet ch + 2j; both
        // against slot 2ch + j of xp
        int8x16_t v[2][4], u[2][4];
        dec.pair(blk, ch, v);
        if constexpr (kSdot) zip_pairs(v, u);
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j)
#pragma GCC unroll 16
          for (int q = 0; q < MP; ++q) {
            const int8x16_t xa = vld1q_s8(xp + (((size_t)(mp0 + q) * H + h) * 4 + 2 * ch + j) * 16);
#pragma GCC unroll 16
            for (int p = 0; p < 4; ++p) isum[q][p] = vmmlaq_s32(isum[q][p], xa, kSdot ? u[j][p] : v[j][p]);
          }
      }
#pragma GCC unroll 16
      for (int q = 0; q < MP; ++q) {
        const size_t at = ((size_t)(mp0 + q) * H + h) * 4;
        const float32x4_t xs = vld1q_f32(xsp + at);
#pragma GCC unroll 16
        for (int p = 0; p < 4; ++p)
          acc[q][p] = vfmaq_f32(acc[q][p], vcvtq_f32_s32(isum[q][p]), vmulq_f32(wsp[p], xs));
      }
    }
  }
  float out[MP][4][4];
#pragma GCC unroll 16
  for (int q = 0; q < MP; ++q)
#pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) vst1q_f32(out[q][p], acc[q][p]);
  store_tile(w, a, mp0, MP, &out[0][0][0], bias, y, b);
}

#if defined(__aarch64__)
// mmla_tile<2> for the 4-bit formats in assembly (GCC spills in that loop): same arithmetic in the same order, bit
// for bit.  Needs group_size to divide K.  Registers: v0 table (codebook) or 0.5 (BCQ), v1 nibble mask, v2-v3
// activation chunk of pair 0 / 1 (v2 also the duplicated z at a BCQ group start), v4-v5 their activation scales,
// v6-v7 Σx of the group (BCQ; layout sdot: also row pairs 0 / 1 of the zipped codes), v8-v11 / v12-v15 acc of pair
// 0 / 1 by row pair, v16-v19 / v20-v23 int32 sums likewise (loaded from kZeros), v24-v27 (w_2p, w_2p+1) twice,
// v28-v29 packed codes of a chunk (sdot: v28-v31 those of two chunks, then v28 / v30 row pairs 2 / 3 of the zipped
// codes; at a BCQ group start: offsets, then z), v30-v31 temps (at a group start: the scales of rows 0-3 / 4-7).
#define QL_MM_SCALES                    \
  "ldp d30, d31, [%[qs]], #16\n"        \
  "fcvtl v30.4s, v30.4h\n"              \
  "fcvtl v31.4s, v31.4h\n"              \
  "dup v24.2d, v30.d[0]\n"              \
  "dup v25.2d, v30.d[1]\n"              \
  "dup v26.2d, v31.d[0]\n"              \
  "dup v27.2d, v31.d[1]\n"
// BCQ at a group start: z = fma(0.5, s, c) per row, then acc = fma((z_2p, z_2p+1) twice, Σx, acc).
#define QL_MM_Z(ZS, LANE, P0, P1)               \
  "dup v2.2d, " ZS ".d[" LANE "]\n"             \
  "fmla " P0 ".4s, v2.4s, v6.4s\n"              \
  "fmla " P1 ".4s, v2.4s, v7.4s\n"
#define QL_MM_BCQ_SETUP(OFFSETS)                                                            \
  QL_MM_SCALES OFFSETS                                                                      \
  "fmla v28.4s, v30.4s, v0.4s\n"                                                            \
  "fmla v29.4s, v31.4s, v0.4s\n"                                                            \
  "ldr q6, [%[xsum0]], #16\n"                                                               \
  "ldr q7, [%[xsum1]], #16\n"                                                               \
  QL_MM_Z("v28", "0", "v8", "v12") QL_MM_Z("v28", "1", "v9", "v13") QL_MM_Z("v29", "0", "v10", "v14") \
  QL_MM_Z("v29", "1", "v11", "v15")
#define QL_MM_C16                \
  "ldp d28, d29, [%[qz]], #16\n" \
  "fcvtl v28.4s, v28.4h\n"       \
  "fcvtl v29.4s, v29.4h\n"
#define QL_MM_C32 "ldp q28, q29, [%[qz]], #32\n"
#define QL_MM_C0      \
  "movi v28.4s, #0\n" \
  "movi v29.4s, #0\n"
#define QL_MM_SMMLA(V, S0, S1)                  \
  "smmla " S0 ".4s, v2.16b, " V ".16b\n"        \
  "smmla " S1 ".4s, v3.16b, " V ".16b\n"
#define QL_MM_LOAD_CHUNK                  \
  "ldr q2, [%[xp0]], #16\n"               \
  "ldr q3, [%[xp1]], #16\n"               \
  "ldp q28, q29, [%[qw]], #32\n"
#define QL_MM_BCQ_CHUNK                                                  \
  QL_MM_LOAD_CHUNK                                                       \
  "shl v30.16b, v28.16b, #4\n" QL_MM_SMMLA("v30", "v16", "v20")          \
  "and v28.16b, v28.16b, v1.16b\n" QL_MM_SMMLA("v28", "v17", "v21")      \
  "shl v30.16b, v29.16b, #4\n" QL_MM_SMMLA("v30", "v18", "v22")          \
  "and v29.16b, v29.16b, v1.16b\n" QL_MM_SMMLA("v29", "v19", "v23")
#define QL_MM_CB4_CHUNK                                                                        \
  QL_MM_LOAD_CHUNK                                                                             \
  "and v30.16b, v28.16b, v1.16b\n"                                                             \
  "tbl v30.16b, {v0.16b}, v30.16b\n" QL_MM_SMMLA("v30", "v16", "v20")                          \
  "ushr v28.16b, v28.16b, #4\n"                                                                \
  "tbl v28.16b, {v0.16b}, v28.16b\n" QL_MM_SMMLA("v28", "v17", "v21")                          \
  "and v30.16b, v29.16b, v1.16b\n"                                                             \
  "tbl v30.16b, {v0.16b}, v30.16b\n" QL_MM_SMMLA("v30", "v18", "v22")                          \
  "ushr v29.16b, v29.16b, #4\n"                                                                \
  "tbl v29.16b, {v0.16b}, v29.16b\n" QL_MM_SMMLA("v29", "v19", "v23")
// acc = fma(float(isum), w · xs, acc) for row pair p of both activation pairs.
#define QL_MM_SCALE(S0, S1, A0, A1, WS)         \
  "scvtf " S0 ".4s, " S0 ".4s\n"                \
  "scvtf " S1 ".4s, " S1 ".4s\n"                \
  "fmul v30.4s, " WS ".4s, v4.4s\n"             \
  "fmul v31.4s, " WS ".4s, v5.4s\n"             \
  "fmla " A0 ".4s, " S0 ".4s, v30.4s\n"         \
  "fmla " A1 ".4s, " S1 ".4s, v31.4s\n"
// Layout sdot, chunks 2ch and 2ch + 1 (their packed P0, P1): zipped by words (zip_pairs) into row pairs 0 / 1 in v6 /
// v7 and 2 / 3 in v28 / v30, low nibbles the octet ch (xp slot 2ch), high nibbles the octet 2 + ch (slot 2ch + 1).
#define QL_MS_LOAD_ZIP                    \
  "ld1 {v28.16b-v31.16b}, [%[qw]], #64\n" \
  "zip1 v6.4s, v28.4s, v30.4s\n"          \
  "zip2 v7.4s, v28.4s, v30.4s\n"          \
  "zip1 v28.4s, v29.4s, v31.4s\n"         \
  "zip2 v30.4s, v29.4s, v31.4s\n"
#define QL_MS_LOADX           \
  "ldr q2, [%[xp0]], #16\n" \
  "ldr q3, [%[xp1]], #16\n"
// LO(Z, T): T = the low-nibble weights of Z; HI(Z): Z = its high-nibble weights.
#define QL_MS_CHUNKS(LO, HI)                                                                              \
  QL_MS_LOAD_ZIP QL_MS_LOADX                                                                              \
  LO("v6", "v29") QL_MM_SMMLA("v29", "v16", "v20") LO("v7", "v31") QL_MM_SMMLA("v31", "v17", "v21")      \
  LO("v28", "v29") QL_MM_SMMLA("v29", "v18", "v22") LO("v30", "v31") QL_MM_SMMLA("v31", "v19", "v23")    \
  QL_MS_LOADX                                                                                             \
  HI("v6") QL_MM_SMMLA("v6", "v16", "v20") HI("v7") QL_MM_SMMLA("v7", "v17", "v21")                       \
  HI("v28") QL_MM_SMMLA("v28", "v18", "v22") HI("v30") QL_MM_SMMLA("v30", "v19", "v23")
#define QL_MS_BCQ_LO(Z, T) "shl " T ".16b, " Z ".16b, #4\n"
#define QL_MS_BCQ_HI(Z) "and " Z ".16b, " Z ".16b, v1.16b\n"
#define QL_MS_CB4_LO(Z, T) "and " T ".16b, " Z ".16b, v1.16b\n" "tbl " T ".16b, {v0.16b}, " T ".16b\n"
#define QL_MS_CB4_HI(Z) "ushr " Z ".16b, " Z ".16b, #4\n" "tbl " Z ".16b, {v0.16b}, " Z ".16b\n"
#define QL_MM_BLOCK(BODY)                                                                          \
  "ld1 {v16.4s-v19.4s}, [%[zero]]\n"                                                               \
  "ld1 {v20.4s-v23.4s}, [%[zero]]\n"                                                               \
  BODY                                                                                             \
  "ldr q4, [%[xsp0]], #16\n"                                                                       \
  "ldr q5, [%[xsp1]], #16\n"                                                                       \
  QL_MM_SCALE("v16", "v20", "v8", "v12", "v24") QL_MM_SCALE("v17", "v21", "v9", "v13", "v25")      \
  QL_MM_SCALE("v18", "v22", "v10", "v14", "v26") QL_MM_SCALE("v19", "v23", "v11", "v15", "v27")
// One loop when a group is one 32-input block (group_size 32), else a loop over the group's blocks.
#define QL_MM_LOOPS(SETUP, BLOCK)                                                                  \
  "movi v8.4s, #0\n" "movi v9.4s, #0\n" "movi v10.4s, #0\n" "movi v11.4s, #0\n"                    \
  "movi v12.4s, #0\n" "movi v13.4s, #0\n" "movi v14.4s, #0\n" "movi v15.4s, #0\n"                  \
  "cmp %[per_group], #1\n"                                                                         \
  "b.ne 3f\n"                                                                                      \
  "1:\n" SETUP BLOCK                                                                               \
  "subs %[groups], %[groups], #1\n"                                                                \
  "b.ne 1b\n"                                                                                      \
  "b 5f\n"                                                                                         \
  "3:\n" SETUP                                                                                     \
  "mov %[left], %[per_group]\n"                                                                    \
  "4:\n" BLOCK                                                                                     \
  "subs %[left], %[left], #1\n"                                                                    \
  "b.ne 4b\n"                                                                                      \
  "subs %[groups], %[groups], #1\n"                                                                \
  "b.ne 3b\n"                                                                                      \
  "5:\n"                                                                                           \
  "st1 {v8.4s-v11.4s}, [%[out]], #64\n"                                                            \
  "st1 {v12.4s-v15.4s}, [%[out]]\n"
#define QL_MM_OPERANDS                                                                                      \
  : [qw] "+r"(qw), [qs] "+r"(qs), [qz] "+r"(qz), [xp0] "+r"(xp0), [xp1] "+r"(xp1), [xsp0] "+r"(xsp0),        \
    [xsp1] "+r"(xsp1), [xsum0] "+r"(xsum0), [xsum1] "+r"(xsum1), [groups] "+r"(groups), [left] "+r"(left),  \
    [out] "+r"(out_p)                                                                                       \
  : [table] "r"(table), [per_group] "r"(per_group), [zero] "r"(kZeros)                                    \
  : "cc", "memory", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "v13", \
    "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28", \
    "v29", "v30", "v31"
#define QL_MM_BCQ_BODY QL_MM_BCQ_CHUNK QL_MM_BCQ_CHUNK QL_MM_BCQ_CHUNK QL_MM_BCQ_CHUNK
#define QL_MS_BCQ_BODY QL_MS_CHUNKS(QL_MS_BCQ_LO, QL_MS_BCQ_HI) QL_MS_CHUNKS(QL_MS_BCQ_LO, QL_MS_BCQ_HI)
#define QL_MM_CB4_BODY QL_MM_CB4_CHUNK QL_MM_CB4_CHUNK QL_MM_CB4_CHUNK QL_MM_CB4_CHUNK
#define QL_MS_CB4_BODY QL_MS_CHUNKS(QL_MS_CB4_LO, QL_MS_CB4_HI) QL_MS_CHUNKS(QL_MS_CB4_LO, QL_MS_CB4_HI)
#define QL_MM_BCQ_ASM(BODY, OFFSETS)                                                            \
  asm volatile("fmov v0.4s, #0.5\n"                                                             \
               "movi v1.16b, #0xf0\n" QL_MM_LOOPS(QL_MM_BCQ_SETUP(OFFSETS), QL_MM_BLOCK(BODY))   \
                   QL_MM_OPERANDS)
#define QL_MM_CB4_ASM(BODY)                                                                                   \
  asm volatile("ld1 {v0.16b}, [%[table]]\n"                                                                   \
               "movi v1.16b, #0x0f\n" QL_MM_LOOPS(QL_MM_SCALES, QL_MM_BLOCK(BODY)) QL_MM_OPERANDS)
// One asm statement per decoder and layout (mmla: QL_MM_*_BODY, sdot: QL_MS_*_BODY).
#define QL_MM_ALL(L)            \
  if constexpr (std::is_same<Dec, DecCB4>::value) \
    QL_MM_CB4_ASM(L##_CB4_BODY);                   \
  else if (qz_kind == 1)                           \
    QL_MM_BCQ_ASM(L##_BCQ_BODY, QL_MM_C16);        \
  else if (qz_kind == 2)                           \
    QL_MM_BCQ_ASM(L##_BCQ_BODY, QL_MM_C32);        \
  else                                             \
    QL_MM_BCQ_ASM(L##_BCQ_BODY, QL_MM_C0)

template <typename Dec>
constexpr bool kHasMmlaAsm = std::is_same<Dec, DecBCQ4>::value || std::is_same<Dec, DecCB4>::value;

template <bool kSdot, typename Dec>
__attribute__((noinline)) static void mmla_tile2_asm(const Weights& w, const Acts& a, int mp0, const float* bias,
                                                     float* y, int b, const Dec& dec) {
  const int H = w.K / 32, G = w.K / w.group_size;
  const uint8_t* qw = w.qw + (size_t)b * H * Dec::kBytes;
  const uint16_t* qs = w.qs + (size_t)b * G * 8;
  const int8_t* xp0 = a.xp + (size_t)mp0 * H * 64;
  const int8_t* xp1 = xp0 + (size_t)H * 64;
  const float* xsp0 = a.xsp + (size_t)mp0 * H * 4;
  const float* xsp1 = xsp0 + (size_t)H * 4;
  const float* xsum0 = a.xsump + (size_t)mp0 * G * 4;
  const float* xsum1 = xsum0 + (size_t)G * 4;
  const uint8_t* qz = nullptr;
  int qz_kind = 0;  // BCQ offsets: none, fp16, fp32
  const void* table = nullptr;
  if constexpr (std::is_same<Dec, DecBCQ4>::value) {
    qz = block_offsets(w, b, qz_kind);
  } else {
    table = &dec.table;
  }
  long groups = G, left = 0;
  const long per_group = w.group_size / 32;
  float out[2][4][4];
  float* out_p = &out[0][0][0];
  if constexpr (kSdot) {
    QL_MM_ALL(QL_MS);
  } else {
    QL_MM_ALL(QL_MM);
  }
  store_tile(w, a, mp0, 2, &out[0][0][0], bias, y, b);
}
#undef QL_MM_SCALES
#undef QL_MM_Z
#undef QL_MM_BCQ_SETUP
#undef QL_MM_C16
#undef QL_MM_C32
#undef QL_MM_C0
#undef QL_MM_SMMLA
#undef QL_MM_LOAD_CHUNK
#undef QL_MM_BCQ_CHUNK
#undef QL_MM_CB4_CHUNK
#undef QL_MM_SCALE
#undef QL_MM_BLOCK
#undef QL_MM_LOOPS
#undef QL_MM_OPERANDS
#undef QL_MM_BCQ_ASM
#undef QL_MS_LOAD_ZIP
#undef QL_MS_LOADX
#undef QL_MS_CHUNKS
#undef QL_MS_BCQ_LO
#undef QL_MS_BCQ_HI
#undef QL_MS_CB4_LO
#undef QL_MS_CB4_HI
#undef QL_MM_BCQ_BODY
#undef QL_MS_BCQ_BODY
#undef QL_MM_CB4_BODY
#undef QL_MS_CB4_BODY
#undef QL_MM_CB4_ASM
#undef QL_MM_ALL
#endif

template <bool kSdot, typename Dec>
static void tile2(const Weights& w, const Acts& a, int mp0, const float* bias, float* y, int b, Dec& dec) {
#if defined(__aarch64__)
  if constexpr (kHasMmlaAsm<Dec>) {
    if (w.K % w.group_size == 0) return mmla_tile2_asm<kSdot>(w, a, mp0, bias, y, b, dec);
  }
#endif
  mmla_tile<2, kSdot>(w, a, mp0, bias, y, b, dec);
}

template <bool kSdot>
static void mmla_rows(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1) {
  const int pairs = (a.M + 1) / 2;
  with_decoder<kSdot>(w, [&](auto& dec) {
    for (int b = b0; b < b1; ++b)
      for (int q = 0; q < pairs; q += 2) {
        if (pairs - q >= 2) tile2<kSdot>(w, a, q, bias, y, b, dec);
        else mmla_tile<1, kSdot>(w, a, q, bias, y, b, dec);
      }
  });
}

__attribute__((noinline)) void run_mmla(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1) {
  if (w.layout == kLayoutSDOT)
    mmla_rows<true>(w, a, bias, y, b0, b1);
  else
    mmla_rows<false>(w, a, bias, y, b0, b1);
}

}  // namespace qlinear_arm
