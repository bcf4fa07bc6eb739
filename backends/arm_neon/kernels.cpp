// Activation quantization, the SDOT GEMV (M = 1..3 rows at once; larger M in chunks of 3 when the CPU
// has no i8mm), the plain-NEON fallback of the same kernel, runtime dispatch and the scalar reference.
// Layout mmla: weight vector V[c][p] = 2 rows x 8 inputs, activation = the 8 inputs twice, so the four
// int32 lanes are (row a, inputs 0-3), (row a, 4-7), (row b, 0-3), (row b, 4-7): different output
// rows in different lanes; one pairwise add per 32-input block turns 2 row pairs into 4 row sums.
// Layout sdot (the default): V[c][p] = 4 rows x 4 inputs, SDOT by element (vdotq_laneq_s32) against
// 4 inputs: each lane one row's sum, no horizontal adds.
#include <math.h>
#include <string.h>

#include <algorithm>

#include "../_shared/act_quant.h"
#include "decode.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace qlinear_arm {

int block_bytes(int format) { return format == kCB2 ? 64 : format == kU8 ? 256 : 128; }

static inline size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

size_t acts_bytes(int M, int K, int group_size) {
  const size_t H = K / 32, P = (M + 1) / 2, G = (K + group_size - 1) / group_size;
  return align16(M * H * 32) + align16(M * H * 64) + align16(P * H * 64) + align16(M * H * 4) + align16(M * G * 4) + align16(P * H * 16) + align16(P * G * 16);
}

void prepare_acts(const float* x, int M, int K, int group_size, int format, int layout, void* workspace, Acts* a) {
  const int H = K / 32, P = (M + 1) / 2, G = (K + group_size - 1) / group_size;
  char* ws = static_cast<char*>(workspace);
  auto take = [&](size_t bytes) { char* at = ws; ws += align16(bytes); return at; };
  a->M = M;
  a->K = K;
  a->xq = reinterpret_cast<int8_t*>(take((size_t)M * H * 32));
  // the GEMV's 64 bytes per block: the layout's (xd: mmla, xz: sdot)
  int8_t* const x64 = reinterpret_cast<int8_t*>(take((size_t)M * H * 64));
  a->xd = layout == kLayoutSDOT ? nullptr : x64;
  a->xz = layout == kLayoutSDOT ? x64 : nullptr;
  a->xp = reinterpret_cast<int8_t*>(take((size_t)P * H * 64));
  a->xs = reinterpret_cast<float*>(take((size_t)M * H * 4));
  a->xsum = reinterpret_cast<float*>(take((size_t)M * G * 4));
  a->xsp = reinterpret_cast<float*>(take((size_t)P * H * 16));
  a->xsump = reinterpret_cast<float*>(take((size_t)P * G * 16));
  const float unit = format == kBCQ4 ? 0.0625f : 1.f;  // BCQ nibbles are 16x their value
  memset(a->xp, 0, (size_t)P * H * 64);  // an odd M leaves the last pair's second row zero
  memset(a->xsp, 0, (size_t)P * H * 16);
  memset(a->xsump, 0, (size_t)P * G * 16);
  const int per_group = group_size / 32;
  for (int m = 0; m < M; ++m) {
    const float* xm = x + (size_t)m * K;
    float* const xsum = a->xsum + (size_t)m * G;
    memset(xsum, 0, (size_t)G * 4);
    for (int h = 0; h < H; ++h) {
      const float* xv = xm + 32 * h;
      const float amax = qlinear_cpu::block_amax(xv, 32);
      const float inv = qlinear_cpu::act_inverse_scale(amax);
      int8_t q[32];
      for (int k = 0; k < 32; ++k) {
        const float r = nearbyintf(xv[k] * inv);  // round half to even
        q[k] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
      }
      const float xs = amax / 127.f * unit;
      a->xs[(size_t)m * H + h] = xs;
      // the offset term's Σ x of the group, over the int8 values the codes multiply (Σ of the float x would leave
      // Σ_k (ŵ_k − z)·(x_k − x̂_k) uncancelled: large for a group far from its zero point, and nonzero for a zero row)
      int qsum = 0;
      for (int k = 0; k < 32; ++k) qsum += q[k];
      xsum[h / per_group] += (float)qsum * (amax / 127.f);
      memcpy(a->xq + ((size_t)m * H + h) * 32, q, 32);
      if (a->xz) {
        memcpy(a->xz + ((size_t)m * H + h) * 64, q, 32);
        memset(a->xz + ((size_t)m * H + h) * 64 + 32, 0, 32);
      }
      int8_t* d = a->xd ? a->xd + ((size_t)m * H + h) * 64 : nullptr;
      int8_t* p = a->xp + ((size_t)(m / 2) * H + h) * 64 + (m % 2) * 8;
      for (int c = 0; c < 4; ++c) {
        if (a->xd) {
          memcpy(d + 16 * c, q + 8 * c, 8);
          memcpy(d + 16 * c + 8, q + 8 * c, 8);
        }
        // layout sdot: slot 2ch + j holds the octet ch + 2j (zip_pairs in kernels_i8mm.cpp)
        memcpy(p + 16 * (layout == kLayoutSDOT ? 2 * (c % 2) + c / 2 : c), q + 8 * c, 8);
      }
      float* sp = a->xsp + ((size_t)(m / 2) * H + h) * 4 + (m % 2) * 2;
      sp[0] = sp[1] = xs;
    }
    for (int g = 0; g < G; ++g) {
      float* up = a->xsump + ((size_t)(m / 2) * G + g) * 4 + (m % 2) * 2;
      up[0] = up[1] = xsum[g];
    }
  }
}

int cpu_path() {
#if defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw2 & HWCAP2_I8MM) return kMMLA;
  if (hw & HWCAP_ASIMDDP) return kDot;
  return kPlain;
#elif defined(__aarch64__)
  return kPlain;
#else
  return kMMLA;  // SIMDe emulates every instruction
#endif
}

const char* path_name(int path) {
  switch (path) {
    case kPlain: return "neon";
    case kDot: return "dotprod";
    case kMMLA: return "i8mm";
    default: return "auto";
  }
}

// dot: acc lanes j += Σ_{i<4} a[4j+i]·b[4j+i];  lane: acc lanes j += Σ_{i<4} a[4j+i]·b[4l+i] (l constant
// once inlined)
struct DotSDOT {
  static inline int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) { return vdotq_s32(acc, a, b); }
  static QL_INLINE int32x4_t lane(int32x4_t acc, int8x16_t a, int8x16_t b, int l) {
    switch (l) {
      case 0: return vdotq_laneq_s32(acc, a, b, 0);
      case 1: return vdotq_laneq_s32(acc, a, b, 1);
      case 2: return vdotq_laneq_s32(acc, a, b, 2);
      default: return vdotq_laneq_s32(acc, a, b, 3);
    }
  }
};
struct DotPlain {  // without the dotprod extension: widening multiplies and pairwise adds
  static inline int32x4_t dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    const int16x8_t hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
  }
  static QL_INLINE int32x4_t lane(int32x4_t acc, int8x16_t a, int8x16_t b, int l) {
    const int32x4_t b32 = vreinterpretq_s32_s8(b);
    int32x4_t d;
    switch (l) {
      case 0: d = vdupq_laneq_s32(b32, 0); break;
      case 1: d = vdupq_laneq_s32(b32, 1); break;
      case 2: d = vdupq_laneq_s32(b32, 2); break;
      default: d = vdupq_laneq_s32(b32, 3); break;
    }
    return dot(acc, a, vreinterpretq_s8_s32(d));
  }
};

// Row outputs out[0..7] of 8-row block b (+ bias) into y (one activation row), rows past N dropped.
static inline void store_block(const Weights& w, const float* bias, float* y, int b, const float* out) {
  if (8 * b + 8 <= w.N) {  // a full block: + bias, or + 0 (which turns -0 into +0 like the scalar form)
    const float32x4_t b0 = bias ? vld1q_f32(bias + 8 * b) : vdupq_n_f32(0.f);
    const float32x4_t b1 = bias ? vld1q_f32(bias + 8 * b + 4) : vdupq_n_f32(0.f);
    vst1q_f32(y + 8 * b, vaddq_f32(vld1q_f32(out), b0));
    vst1q_f32(y + 8 * b + 4, vaddq_f32(vld1q_f32(out + 4), b1));
    return;
  }
  for (int i = 0; i < 8 && 8 * b + i < w.N; ++i) y[8 * b + i] = out[i] + (bias ? bias[8 * b + i] : 0.f);
}

// One 32-input block h of RB 8-row blocks for M activation rows: acc += float(isum)·(ws·xs).
// Layout mmla: V[c][p] against the duplicated chunk c, int32 sums per row pair; one pairwise add turns row pairs
// 0-1 / 2-3 into rows 0-3 / 4-7.  Layout sdot: V[c][p] holds rows 4(p/2).. (one per lane) and inputs
// 16(p%2) + 4c..: SDOT by element c of activation vector p%2 sums rows 0-3 / 4-7 directly.
template <int M, int RB, typename Dot, bool kSdot, typename Dec>
QL_INLINE void block(const Acts& a, int m0, int h, int H, const Dec* dec, const uint8_t* const* blk,
                     const float32x4_t (*ws)[2], float32x4_t (*acc)[RB][2]) {
  constexpr int S = kSdot ? 2 : 4;  // int32 sums per (activation row, 8-row block)
  int32x4_t isum[M][RB][S];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int q = 0; q < S; ++q) isum[m][r][q] = vdupq_n_s32(0);
#pragma GCC unroll 2
  for (int ch = 0; ch < 2; ++ch) {
    int8x16_t x[M][2];  // mmla: chunks 2ch, 2ch + 1; sdot: inputs 0-15, 16-31
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j)
        x[m][j] = vld1q_s8(kSdot ? a.xq + ((size_t)(m0 + m) * H + h) * 32 + 16 * j
                                 : a.xd + (((size_t)(m0 + m) * H + h) * 4 + 2 * ch + j) * 16);
#pragma GCC unroll 2
    for (int r = 0; r < RB; ++r) {
      int8x16_t v[2][4];
      dec[r].pair(blk[r], ch, v);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j)
#pragma GCC unroll 4
          for (int p = 0; p < 4; ++p) {
            if constexpr (kSdot)
              isum[m][r][p / 2] = Dot::lane(isum[m][r][p / 2], v[j][p], x[m][p % 2], 2 * ch + j);
            else
              isum[m][r][p] = Dot::dot(isum[m][r][p], v[j][p], x[m][j]);
          }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const float xs = a.xs[(size_t)(m0 + m) * H + h];
#pragma GCC unroll 2
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) {
        const int32x4_t rows = kSdot ? isum[m][r][q] : vpaddq_s32(isum[m][r][2 * q], isum[m][r][(2 * q + 1) % S]);
        acc[m][r][q] = vfmaq_f32(acc[m][r][q], vcvtq_f32_s32(rows), vmulq_n_f32(ws[r][q], xs));
      }
  }
}

// M activation rows x RB blocks of 8 weight rows per pass (RB = Dec::kRB for M = 1 shares the activation
// loads and loop control between blocks).
template <int M, int RB, typename Dot, bool kSdot, typename Dec>
static void gemv_pass(const Weights& w, const Acts& a, int m0, const float* bias, float* y, int b, const Dec& proto) {
  const int H = w.K / 32, per_group = w.group_size / 32, G = (w.K + w.group_size - 1) / w.group_size;
  float32x4_t acc[M][RB][2];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) acc[m][r][0] = acc[m][r][1] = vdupq_n_f32(0.f);
  Dec dec[RB];
  const uint8_t* blk[RB];
  float32x4_t ws[RB][2], z[RB][2];
  GroupScales<Dec::kOffset> scales[RB];
#pragma GCC unroll 2
  for (int r = 0; r < RB; ++r) {
    dec[r] = proto;
    blk[r] = w.qw + (size_t)(b + r) * H * Dec::kBytes;
    scales[r] = GroupScales<Dec::kOffset>(w, b + r);
  }
  const float* xsum = a.xsum + (size_t)m0 * G;
  for (int h = 0, g = 0, left = 0; h < H; ++h, --left) {
    if (left == 0) {  // a new weight group (no division in the loop)
#pragma GCC unroll 2
      for (int r = 0; r < RB; ++r) {
        dec[r].group(w, b + r, g);
        scales[r].next(ws[r], z[r]);
        if (Dec::kOffset) {
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) {
            acc[m][r][0] = vfmaq_n_f32(acc[m][r][0], z[r][0], xsum[(size_t)m * G + g]);
            acc[m][r][1] = vfmaq_n_f32(acc[m][r][1], z[r][1], xsum[(size_t)m * G + g]);
          }
        }
      }
      ++g;
      left = per_group;
    }
    block<M, RB, Dot, kSdot>(a, m0, h, H, dec, blk, ws, acc);
#pragma GCC unroll 2
    for (int r = 0; r < RB; ++r) blk[r] += Dec::kBytes;
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
    for (int r = 0; r < RB; ++r) {
      float out[8];
      vst1q_f32(out, acc[m][r][0]);
      vst1q_f32(out + 4, acc[m][r][1]);
      store_block(w, bias, y + (size_t)(m0 + m) * w.N, b + r, out);
    }
}

#if defined(__aarch64__)
// The M = 1 GEMVs with DotSDOT (gemv_pass with DecCB2<..., kSdot>, DecCB4 or DecBCQ4, both layouts) in assembly: with
// intrinsics GCC spills and reloads the 64-byte tables of several codebooks, and keeps fewer values in
// registers elsewhere.  Same arithmetic in the same order, bit for bit.  Needs group_size to divide K (whole
// groups; codebook layers always have them).  Instructions per weight: benchmarks/RESULTS.md.
// Registers: v12-v13 acc, v14-v15 scales, v16-v19 activations (layout mmla: chunks 0-3 duplicated; sdot: v16-v17
// inputs 0-15 / 16-31, v18-v19 the int32 sums of rows 0-3 / 4-7, loaded as zeros with them), v24-v27 mmla's int32
// sums of row pairs 0-3 (loaded from kZeros; v24-v25 also the books word at a group start, v25 / v27 also t = ws·xs
// in the epilogue), sdot: v24 a pair's activation scales, v26-v27 t; v29 temp, v30 the activation scale of a block
// alone (mmla with several codebooks: of a pair; with one codebook also the high-nibble indices); 2 bits: v0-v3 /
// v4-v7 tables lo / hi (v0 / v4 with one codebook), v8-v11 books of row pair 0-3 (sdot: v8-v9 of rows 0-3 / 4-7,
// v10-v11 the next group's, v25 their shifts), v20-v23 packed codes of row pair 0-3, v28 0xF0, v31 0x33 (sdot:
// 0x30; 0x0F with one codebook); 4 bits: v2-v9 packed codes; codebook: v0 table, v31 0x0F; BCQ: v0 0.5, v1 0xF0,
// v20-v21 offsets then z, v22 Σx of the group. At group 32 a pair of groups loads its scales at once, the second's
// held in v28 (sdot with several codebooks: v30; mmla with several codebooks has no register left for it).
#define QL_CALL(M, ...) M(__VA_ARGS__)
#define QL_ASM_SCALES            \
  "ldp d14, d15, [%[qs]], #16\n" \
  "fcvtl v14.4s, v14.4h\n"       \
  "fcvtl v15.4s, v15.4h\n"
// The scales of two consecutive groups: the first's to v14-v15 and the second's held in vH (SCALES2B).
#define QL_SCALES2A(H)                   \
  "ldp q14, q" H ", [%[qs]], #32\n"     \
  "fcvtl2 v15.4s, v14.8h\n"             \
  "fcvtl v14.4s, v14.4h\n"
#define QL_SCALES2B(H)        \
  "fcvtl2 v15.4s, v" H ".8h\n" \
  "fcvtl v14.4s, v" H ".4h\n"
// Per layout (QL_MM: mmla, QL_SD: sdot): the activation load, the zeroed int32 sums, the epilogue, and for each
// decoded vector W[c][p] its sums and activation operand: _AXc lists (sums, operand) of W[c][0..3], _Pp lists
// (packed codes, books, sums, operands of W[0..3][p]).
#define QL_MM_LOADX "ld1 {v16.16b-v19.16b}, [%[xd]], #64\n"
#define QL_SD_LOADX "ld1 {v16.16b-v19.16b}, [%[xd]], #64\n"
#define QL_MM_ZERO "ld1 {v24.16b-v27.16b}, [%[zero]]\n"
#define QL_SD_ZERO
// The epilogue: int32 sums to float, times t = ws·xs, into acc.  EPI1 for a block alone (its activation scale
// in v30); a pair of blocks loads both scales at once (EPIA) into a register the block bodies leave alone
// (mmla: v11, or v30 with several codebooks, whose books v11 holds: EPIMA / EPIMB; sdot: v24).
#define QL_MM_EPI(LOAD, X)             \
  "addp v24.4s, v24.4s, v25.4s\n"      \
  "addp v26.4s, v26.4s, v27.4s\n" LOAD \
  "scvtf v24.4s, v24.4s\n"             \
  "scvtf v26.4s, v26.4s\n"             \
  "fmul v25.4s, v14.4s, " X "\n"       \
  "fmul v27.4s, v15.4s, " X "\n"       \
  "fmla v12.4s, v24.4s, v25.4s\n"      \
  "fmla v13.4s, v26.4s, v27.4s\n"
#define QL_SD_EPI(LOAD, X)             \
  LOAD                                 \
  "scvtf v18.4s, v18.4s\n"             \
  "scvtf v19.4s, v19.4s\n"             \
  "fmul v26.4s, v14.4s, " X "\n"       \
  "fmul v27.4s, v15.4s, " X "\n"       \
  "fmla v12.4s, v18.4s, v26.4s\n"      \
  "fmla v13.4s, v19.4s, v27.4s\n"
#define QL_EPI_ONE "ldr s30, [%[xs]], #4\n"
#define QL_MM_EPI1 QL_MM_EPI(QL_EPI_ONE, "v30.s[0]")
#define QL_MM_EPIA QL_MM_EPI("ldr d11, [%[xs]], #8\n", "v11.s[0]")
#define QL_MM_EPIB QL_MM_EPI(, "v11.s[1]")
#define QL_MM_EPIMA QL_MM_EPI("ldr d30, [%[xs]], #8\n", "v30.s[0]")
#define QL_MM_EPIMB QL_MM_EPI(, "v30.s[1]")
#define QL_SD_EPI1 QL_SD_EPI(QL_EPI_ONE, "v30.s[0]")
#define QL_SD_EPIA QL_SD_EPI("ldr d24, [%[xs]], #8\n", "v24.s[0]")
#define QL_SD_EPIB QL_SD_EPI(, "v24.s[1]")
#define QL_SD_EPIMA QL_SD_EPIA
#define QL_SD_EPIMB QL_SD_EPIB
#define QL_MM_AX(v) "v24", v, "v25", v, "v26", v, "v27", v
#define QL_MM_AX0 QL_MM_AX("v16.16b")
#define QL_MM_AX1 QL_MM_AX("v17.16b")
#define QL_MM_AX2 QL_MM_AX("v18.16b")
#define QL_MM_AX3 QL_MM_AX("v19.16b")
#define QL_SD_AX(c) "v18", "v16.4b[" #c "]", "v18", "v17.4b[" #c "]", "v19", "v16.4b[" #c "]", "v19", "v17.4b[" #c "]"
#define QL_SD_AX0 QL_SD_AX(0)
#define QL_SD_AX1 QL_SD_AX(1)
#define QL_SD_AX2 QL_SD_AX(2)
#define QL_SD_AX3 QL_SD_AX(3)
#define QL_MM_P(q, b, acc) q, b, acc, "v16.16b", "v17.16b", "v18.16b", "v19.16b"
#define QL_MM_P0 QL_MM_P("v20", "v8", "v24")
#define QL_MM_P1 QL_MM_P("v21", "v9", "v25")
#define QL_MM_P2 QL_MM_P("v22", "v10", "v26")
#define QL_MM_P3 QL_MM_P("v23", "v11", "v27")
#define QL_SD_P(q, b, acc, x) q, b, acc, x ".4b[0]", x ".4b[1]", x ".4b[2]", x ".4b[3]"
#define QL_SD_P0 QL_SD_P("v20", "v8", "v18", "v16")
#define QL_SD_P1 QL_SD_P("v21", "v8", "v18", "v17")
#define QL_SD_P2 QL_SD_P("v22", "v9", "v19", "v16")
#define QL_SD_P3 QL_SD_P("v23", "v9", "v19", "v17")
#define QL_SDOT(ACC, W, X) "sdot " ACC ".4s, " W ".16b, " X "\n"
// For each of nblk 8-row blocks: when a group is one 32-input block (group_size 32), one loop over the groups,
// four per iteration after one and two alone (a pair of groups: SETUP2A BLOCKA SETUP2B BLOCKB); otherwise a
// loop over the group's blocks, two per iteration after one alone (SETUP at each group start).  Then y[0..7] =
// acc + bias[0..7] (+ 0 without a bias: the same bits as store_block).
#define QL_ASM_LOOPS(SETUP, SETUP2A, SETUP2B, BLOCK1, BLOCKA, BLOCKB) \
  "7:\n"                                            \
  "mov %[xd], %[xd0]\n"                             \
  "mov %[xs], %[xs0]\n"                             \
  "mov %[xsum], %[xsum0]\n"                         \
  "mov %[groups], %[G]\n"                           \
  "movi v12.4s, #0\n"                               \
  "movi v13.4s, #0\n"                               \
  "cmp %[per_group], #1\n"                          \
  "b.ne 3f\n"                                       \
  "tbz %[groups], #0, 1f\n" SETUP BLOCK1            \
  "subs %[groups], %[groups], #1\n"                 \
  "b.eq 5f\n"                                       \
  "1:\n"                                            \
  "tbz %[groups], #1, 2f\n"                          \
  SETUP2A BLOCKA SETUP2B BLOCKB                     \
  "subs %[groups], %[groups], #2\n"                 \
  "b.eq 5f\n"                                       \
  "2:\n"                                            \
  SETUP2A BLOCKA SETUP2B BLOCKB                     \
  SETUP2A BLOCKA SETUP2B BLOCKB                     \
  "subs %[groups], %[groups], #4\n"                 \
  "b.ne 2b\n"                                       \
  "b 5f\n"                                          \
  "3:\n" SETUP                                      \
  "mov %[left], %[per_group]\n"                     \
  "tbz %[left], #0, 4f\n" BLOCK1                    \
  "subs %[left], %[left], #1\n"                     \
  "b.eq 6f\n"                                       \
  "4:\n" BLOCKA BLOCKB                              \
  "subs %[left], %[left], #2\n"                     \
  "b.ne 4b\n"                                       \
  "6:\n"                                            \
  "subs %[groups], %[groups], #1\n"                 \
  "b.ne 3b\n"                                       \
  "5:\n"                                            \
  "ldp q29, q30, [%[bp]]\n"                         \
  "add %[bp], %[bp], %[bstep]\n"                    \
  "fadd v12.4s, v12.4s, v29.4s\n"                   \
  "fadd v13.4s, v13.4s, v30.4s\n"                   \
  "stp q12, q13, [%[yo]], #32\n"                    \
  "subs %[nblk], %[nblk], #1\n"                     \
  "b.ne 7b\n"

// 2 bits, several codebooks, at a group start: the book vectors with each lane's book at bits 4-5 and bits 6-7
// clear (SRI and BIT read only their high nibble).  mmla: the books word to lane halves (byte 0, even rows, to
// lanes 0-7), then pair 0 = (x & 0x33) << 4, pair 1 = (x << 4) >> 2, pair 2 = x & 0x33, pair 3 = x >> 2.
// sdot: byte 0 (rows 0-3) and byte 1 (rows 4-7) to all lanes, lane i shifted by 4 - 2(i / 4) (v25: the
// decoder's kQuadShifts + 4), masked by 0x30.
#define QL_MM_CB2_INIT "movi v31.16b, #0x33\n"
#define QL_MM_CB2_BOOKS                  \
  "ld2r {v24.8b, v25.8b}, [%[qb]], #2\n" \
  "mov v24.d[1], v25.d[0]\n"             \
  "and v10.16b, v24.16b, v31.16b\n"      \
  "shl v8.16b, v10.16b, #4\n"            \
  "shl v9.16b, v24.16b, #4\n"            \
  "ushr v9.16b, v9.16b, #2\n"            \
  "ushr v11.16b, v24.16b, #2\n" QL_ASM_SCALES
#define QL_SD_CB2_INIT            \
  "movi v31.16b, #0x30\n"         \
  "ld1 {v25.16b}, [%[shifts]]\n"  \
  "movi v11.16b, #4\n"            \
  "add v25.16b, v25.16b, v11.16b\n"
#define QL_SD_CB2_BOOKV(A, B)               \
  "ushl v8.16b, " A ".16b, v25.16b\n"       \
  "ushl v9.16b, " B ".16b, v25.16b\n"       \
  "and v8.16b, v8.16b, v31.16b\n"          \
  "and v9.16b, v9.16b, v31.16b\n"
#define QL_SD_CB2_BOOKS                  \
  "ld2r {v8.16b, v9.16b}, [%[qb]], #2\n" \
  QL_SD_CB2_BOOKV("v8", "v9") QL_ASM_SCALES
// The setups of a pair of groups (group 32).  sdot: both books words at once, the second's kept in v10-v11;
// mmla has no register left for it.
#define QL_SD_CB2_SETUP2A                                     \
  "ld4r {v8.16b, v9.16b, v10.16b, v11.16b}, [%[qb]], #4\n" \
  QL_SD_CB2_BOOKV("v8", "v9") QL_SCALES2A("30")
#define QL_SD_CB2_SETUP2B QL_SD_CB2_BOOKV("v10", "v11") QL_SCALES2B("30")
#define QL_MM_CB2_SETUP2A QL_MM_CB2_BOOKS
#define QL_MM_CB2_SETUP2B QL_MM_CB2_BOOKS
// Row pair: index vectors Q (chunks 0-1) and IB (chunks 2-3), each read by the lo and hi tables.
#define QL_CB2_DOTS(LO, HI, Q, IB, ACC, X0, X1, X2, X3) \
  "tbl v29.16b, " LO ", " Q ".16b\n"                    \
  "tbl " Q ".16b, " HI ", " Q ".16b\n"                  \
  QL_SDOT(ACC, "v29", X0) QL_SDOT(ACC, Q, X1)           \
  "tbl v29.16b, " LO ", " IB ".16b\n"                   \
  "tbl " Q ".16b, " HI ", " IB ".16b\n"                 \
  QL_SDOT(ACC, "v29", X2) QL_SDOT(ACC, Q, X3)
#define QL_CB2_LO4 "{v0.16b-v3.16b}"
#define QL_CB2_HI4 "{v4.16b-v7.16b}"
// Several codebooks: SRI writes the high-nibble index into the book vector's low nibble, BIT copies the book
// (its high nibble) into the codes for the low-nibble index; both keep the book for the next row pair or block.
#define QL_CB2_MULTI(Q, B, ACC, X0, X1, X2, X3) \
  "sri " B ".16b, " Q ".16b, #4\n"              \
  "bit " Q ".16b, " B ".16b, v28.16b\n"         \
  QL_CB2_DOTS(QL_CB2_LO4, QL_CB2_HI4, Q, B, ACC, X0, X1, X2, X3)
// One codebook: the nibbles index 16-entry tables.
#define QL_CB2_ONE(Q, B, ACC, X0, X1, X2, X3) \
  "ushr v30.16b, " Q ".16b, #4\n"             \
  "and " Q ".16b, " Q ".16b, v31.16b\n"       \
  QL_CB2_DOTS("{v0.16b}", "{v4.16b}", Q, "v30", ACC, X0, X1, X2, X3)
#define QL_CB2_BLOCK(L, PAIR, E)                                                                  \
  "ld1 {v20.16b-v23.16b}, [%[qw]], #64\n" L##_LOADX L##_ZERO QL_CALL(PAIR, L##_P0)              \
  QL_CALL(PAIR, L##_P1) QL_CALL(PAIR, L##_P2) QL_CALL(PAIR, L##_P3) L##_EPI##E
// 4 bits, chunk c: P0 holds W[c][0] / W[c][1] in its low / high nibbles, P1 W[c][2] / W[c][3].
#define QL_CB4_CHUNK(P0, P1, A0, X0, A1, X1, A2, X2, A3, X3) \
  "and v29.16b, " P0 ".16b, v31.16b\n"                        \
  "ushr " P0 ".16b, " P0 ".16b, #4\n"                         \
  "tbl v29.16b, {v0.16b}, v29.16b\n"                          \
  "tbl " P0 ".16b, {v0.16b}, " P0 ".16b\n"                    \
  QL_SDOT(A0, "v29", X0) QL_SDOT(A1, P0, X1)                  \
  "and v29.16b, " P1 ".16b, v31.16b\n"                        \
  "ushr " P1 ".16b, " P1 ".16b, #4\n"                         \
  "tbl v29.16b, {v0.16b}, v29.16b\n"                          \
  "tbl " P1 ".16b, {v0.16b}, " P1 ".16b\n"                    \
  QL_SDOT(A2, "v29", X2) QL_SDOT(A3, P1, X3)
// BCQ uniform int4, same nibble order: the MSB-toggled codes are 16·(code − 8) after one shift or mask.
#define QL_BCQ_CHUNK(P0, P1, A0, X0, A1, X1, A2, X2, A3, X3) \
  "shl v29.16b, " P0 ".16b, #4\n"                             \
  "and " P0 ".16b, " P0 ".16b, v1.16b\n"                      \
  QL_SDOT(A0, "v29", X0) QL_SDOT(A1, P0, X1)                  \
  "shl v29.16b, " P1 ".16b, #4\n"                             \
  "and " P1 ".16b, " P1 ".16b, v1.16b\n"                      \
  QL_SDOT(A2, "v29", X2) QL_SDOT(A3, P1, X3)
#define QL_4BIT_BLOCK(L, CHUNK, E)                                                                         \
  "ld1 {v2.16b-v5.16b}, [%[qw]], #64\n"                                                                    \
  "ld1 {v6.16b-v9.16b}, [%[qw]], #64\n" L##_LOADX L##_ZERO QL_CALL(CHUNK, "v2", "v3", L##_AX0)            \
  QL_CALL(CHUNK, "v4", "v5", L##_AX1) QL_CALL(CHUNK, "v6", "v7", L##_AX2) QL_CALL(CHUNK, "v8", "v9", L##_AX3) \
  L##_EPI##E
// BCQ at a group start: offsets c (OFFSETS: fp16, fp32 or none) into v20-v21, z = fma(0.5, s, c), then
// acc = fma(z, xsum[g], acc).
#define QL_BCQ_SETUP(SCALES, OFFSETS)     \
  SCALES OFFSETS                          \
  "fmla v20.4s, v14.4s, v0.4s\n"          \
  "fmla v21.4s, v15.4s, v0.4s\n"          \
  "ldr s22, [%[xsum]], #4\n"              \
  "fmla v12.4s, v20.4s, v22.s[0]\n"       \
  "fmla v13.4s, v21.4s, v22.s[0]\n"
#define QL_BCQ_C16               \
  "ldp d20, d21, [%[qz]], #16\n" \
  "fcvtl v20.4s, v20.4h\n"       \
  "fcvtl v21.4s, v21.4h\n"
#define QL_BCQ_C32 "ldp q20, q21, [%[qz]], #32\n"
#define QL_BCQ_C0   \
  "movi v20.4s, #0\n" \
  "movi v21.4s, #0\n"
// One asm statement per decoder and layout L.
#define QL_ASM_CB2_MULTI(L)                                                                                 \
  asm volatile("ld1 {v0.16b-v3.16b}, [%[lo]]\n"                                                              \
               "ld1 {v4.16b-v7.16b}, [%[hi]]\n"                                                              \
               "movi v28.16b, #0xf0\n" L##_CB2_INIT                                                          \
               QL_ASM_LOOPS(L##_CB2_BOOKS, L##_CB2_SETUP2A, L##_CB2_SETUP2B, QL_CB2_BLOCK(L, QL_CB2_MULTI, 1), \
                            QL_CB2_BLOCK(L, QL_CB2_MULTI, MA), QL_CB2_BLOCK(L, QL_CB2_MULTI, MB))          \
               QL_ASM_OPERANDS)
// The other formats hold the second group's scales of a pair in v28.
#define QL_SCALES28A QL_SCALES2A("28")
#define QL_SCALES28B QL_SCALES2B("28")
#define QL_ASM_CB2_ONE(L)                                                                                       \
  asm volatile("ld1 {v0.16b}, [%[lo]]\n"                                                                         \
               "ld1 {v4.16b}, [%[hi]]\n"                                                                         \
               "movi v31.16b, #0x0f\n"                                                                           \
               QL_ASM_LOOPS(QL_ASM_SCALES, QL_SCALES28A, QL_SCALES28B, QL_CB2_BLOCK(L, QL_CB2_ONE, 1),          \
                            QL_CB2_BLOCK(L, QL_CB2_ONE, A), QL_CB2_BLOCK(L, QL_CB2_ONE, B))              \
               QL_ASM_OPERANDS)
#define QL_ASM_CB4(L)                                                                                        \
  asm volatile("ld1 {v0.16b}, [%[lo]]\n"                                                                      \
               "movi v31.16b, #0x0f\n"                                                                        \
               QL_ASM_LOOPS(QL_ASM_SCALES, QL_SCALES28A, QL_SCALES28B, QL_4BIT_BLOCK(L, QL_CB4_CHUNK, 1),    \
                            QL_4BIT_BLOCK(L, QL_CB4_CHUNK, A), QL_4BIT_BLOCK(L, QL_CB4_CHUNK, B))       \
               QL_ASM_OPERANDS)
#define QL_ASM_BCQ(L, OFFSETS)                                                                               \
  asm volatile("fmov v0.4s, #0.5\n"                                                                          \
               "movi v1.16b, #0xf0\n"                                                                      \
               QL_ASM_LOOPS(QL_BCQ_SETUP(QL_ASM_SCALES, OFFSETS), QL_BCQ_SETUP(QL_SCALES28A, OFFSETS),     \
                            QL_BCQ_SETUP(QL_SCALES28B, OFFSETS), QL_4BIT_BLOCK(L, QL_BCQ_CHUNK, 1),          \
                            QL_4BIT_BLOCK(L, QL_BCQ_CHUNK, A), QL_4BIT_BLOCK(L, QL_BCQ_CHUNK, B))           \
               QL_ASM_OPERANDS)
#define QL_ASM_BCQ16(L) QL_ASM_BCQ(L, QL_BCQ_C16)
#define QL_ASM_BCQ32(L) QL_ASM_BCQ(L, QL_BCQ_C32)
#define QL_ASM_BCQ0(L) QL_ASM_BCQ(L, QL_BCQ_C0)
#define QL_BY_LAYOUT(X) \
  if constexpr (kSdot)  \
    X(QL_SD);           \
  else                  \
    X(QL_MM)

// nblk 8-row blocks from b: y[8 per block] = acc + bp[8] (bp advancing by bstep bytes per block).
template <bool kSdot, typename Dec>
__attribute__((noinline)) static void gemv_asm_blocks(const Weights& w, const Acts& a, int m0, const float* bp,
                                                      long bstep, float* yo, int b, long nblk, const Dec& dec) {
  const int H = w.K / 32;
  const long G = w.K / w.group_size;
  const uint8_t* qw = w.qw + (size_t)b * H * Dec::kBytes;
  const int8_t* const xd0 = kSdot ? a.xz + (size_t)m0 * H * 64 : a.xd + (size_t)m0 * H * 64;
  const float* const xs0 = a.xs + (size_t)m0 * H;
  const uint16_t* qs = w.qs + (size_t)b * G * 8;
  const uint16_t* qb = std::is_same<Dec, DecCB2<true, kSdot>>::value ? w.qb + (size_t)b * G : nullptr;
  const float* xsum0 = nullptr;
  const uint8_t* qz = nullptr;
  int qz_kind = 0;  // BCQ offsets: none, fp16, fp32
  if constexpr (std::is_same<Dec, DecBCQ4>::value) {
    xsum0 = a.xsum + (size_t)m0 * G;
    qz = block_offsets(w, b, qz_kind);
  }
  const void* lo = nullptr;
  const void* hi = nullptr;
  if constexpr (std::is_same<Dec, DecCB4>::value) {
    lo = hi = &dec.table;
  } else if constexpr (!std::is_same<Dec, DecBCQ4>::value) {
    lo = &dec.lo;
    hi = &dec.hi;
  }
  const int8_t* xd;
  const float *xs, *xsum;
  long groups, left;
  const long per_group = w.group_size / 32;
#define QL_ASM_OPERANDS                                                                                         \
  : [qw] "+r"(qw), [xd] "=&r"(xd), [xs] "=&r"(xs), [qs] "+r"(qs), [qb] "+r"(qb), [groups] "=&r"(groups),       \
    [left] "=&r"(left), [qz] "+r"(qz), [xsum] "=&r"(xsum), [yo] "+r"(yo), [bp] "+r"(bp), [nblk] "+r"(nblk)      \
  : [lo] "r"(lo), [hi] "r"(hi), [per_group] "r"(per_group), [shifts] "r"(kQuadShifts), [zero] "r"(kZeros),    \
    [xd0] "r"(xd0), [xs0] "r"(xs0), [xsum0] "r"(xsum0), [G] "r"(G), [bstep] "r"(bstep)                           \
  : "cc", "memory", "v0", "v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "v13",     \
    "v14", "v15", "v16", "v17", "v18", "v19", "v20", "v21", "v22", "v23", "v24", "v25", "v26", "v27", "v28",     \
    "v29", "v30", "v31"
  if constexpr (std::is_same<Dec, DecCB2<true, kSdot>>::value) {
    QL_BY_LAYOUT(QL_ASM_CB2_MULTI);
  } else if constexpr (std::is_same<Dec, DecCB2<false, kSdot>>::value) {
    QL_BY_LAYOUT(QL_ASM_CB2_ONE);
  } else if constexpr (std::is_same<Dec, DecCB4>::value) {
    QL_BY_LAYOUT(QL_ASM_CB4);
  } else if (qz_kind == 1) {
    QL_BY_LAYOUT(QL_ASM_BCQ16);
  } else if (qz_kind == 2) {
    QL_BY_LAYOUT(QL_ASM_BCQ32);
  } else {
    QL_BY_LAYOUT(QL_ASM_BCQ0);
  }
#undef QL_ASM_OPERANDS
}

// Blocks [b0, b1): the full ones in one call writing y directly, a last partial one through a padded buffer.
template <bool kSdot, typename Dec>
static void gemv_asm(const Weights& w, const Acts& a, int m0, const float* bias, float* y, int b0, int b1,
                     const Dec& dec) {
  y += (size_t)m0 * w.N;
  const int full = std::min(b1, w.N / 8);
  if (b0 < full)
    gemv_asm_blocks<kSdot>(w, a, m0, bias ? bias + 8 * b0 : kZeros, bias ? 32 : 0, y + 8 * b0, b0, full - b0, dec);
  for (int b = std::max(b0, full); b < b1; ++b) {
    alignas(16) float bpad[8] = {0.f}, out[8];
    const int rows = std::min(8, w.N - 8 * b);
    for (int i = 0; i < rows && bias; ++i) bpad[i] = bias[8 * b + i];
    gemv_asm_blocks<kSdot>(w, a, m0, bpad, 0, out, b, 1, dec);
    for (int i = 0; i < rows; ++i) y[8 * b + i] = out[i];
  }
}
#undef QL_CALL
#undef QL_ASM_SCALES
#undef QL_SCALES2A
#undef QL_SCALES2B
#undef QL_SD_CB2_BOOKV
#undef QL_SD_CB2_SETUP2A
#undef QL_SD_CB2_SETUP2B
#undef QL_MM_CB2_SETUP2A
#undef QL_MM_CB2_SETUP2B
#undef QL_SCALES28A
#undef QL_SCALES28B
#undef QL_MM_LOADX
#undef QL_SD_LOADX
#undef QL_MM_ZERO
#undef QL_SD_ZERO
#undef QL_MM_EPI
#undef QL_SD_EPI
#undef QL_EPI_ONE
#undef QL_MM_EPI1
#undef QL_MM_EPIA
#undef QL_MM_EPIB
#undef QL_MM_EPIMA
#undef QL_MM_EPIMB
#undef QL_SD_EPI1
#undef QL_SD_EPIA
#undef QL_SD_EPIB
#undef QL_SD_EPIMA
#undef QL_SD_EPIMB
#undef QL_MM_AX
#undef QL_MM_AX0
#undef QL_MM_AX1
#undef QL_MM_AX2
#undef QL_MM_AX3
#undef QL_SD_AX
#undef QL_SD_AX0
#undef QL_SD_AX1
#undef QL_SD_AX2
#undef QL_SD_AX3
#undef QL_MM_P
#undef QL_MM_P0
#undef QL_MM_P1
#undef QL_MM_P2
#undef QL_MM_P3
#undef QL_SD_P
#undef QL_SD_P0
#undef QL_SD_P1
#undef QL_SD_P2
#undef QL_SD_P3
#undef QL_SDOT
#undef QL_ASM_LOOPS
#undef QL_MM_CB2_INIT
#undef QL_MM_CB2_BOOKS
#undef QL_SD_CB2_INIT
#undef QL_SD_CB2_BOOKS
#undef QL_CB2_DOTS
#undef QL_CB2_LO4
#undef QL_CB2_HI4
#undef QL_CB2_MULTI
#undef QL_CB2_ONE
#undef QL_CB2_BLOCK
#undef QL_CB4_CHUNK
#undef QL_BCQ_CHUNK
#undef QL_4BIT_BLOCK
#undef QL_BCQ_SETUP
#undef QL_BCQ_C16
#undef QL_BCQ_C32
#undef QL_BCQ_C0
#undef QL_ASM_CB2_MULTI
#undef QL_ASM_CB2_ONE
#undef QL_ASM_CB4
#undef QL_ASM_BCQ
#undef QL_ASM_BCQ16
#undef QL_ASM_BCQ32
#undef QL_ASM_BCQ0
#undef QL_BY_LAYOUT
#endif

template <int M, typename Dot, bool kSdot, typename Dec>
static void gemv(const Weights& w, const Acts& a, int m0, const float* bias, float* y, int b0, int b1, Dec& dec) {
  int b = b0;
#if defined(__aarch64__)
  if constexpr (M == 1 && std::is_same<Dot, DotSDOT>::value && !std::is_same<Dec, DecU8>::value) {
    // every decoder but the 8-bit one has an assembly GEMV
    if (w.K % w.group_size == 0) return gemv_asm<kSdot>(w, a, m0, bias, y, b0, b1, dec);
  }
#endif
  if (M == 1 && Dec::kRB == 2)
    for (; b + 2 <= b1; b += 2) gemv_pass<M, 2, Dot, kSdot>(w, a, m0, bias, y, b, dec);
  for (; b < b1; ++b) gemv_pass<M, 1, Dot, kSdot>(w, a, m0, bias, y, b, dec);
}

template <typename Dot, bool kSdot>
static void run_rows(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1) {
  with_decoder<kSdot>(w, [&](auto& dec) {
    for (int m0 = 0; m0 < a.M; m0 += 3) {
      switch (a.M - m0 >= 3 ? 3 : a.M - m0) {
        case 1: gemv<1, Dot, kSdot>(w, a, m0, bias, y, b0, b1, dec); break;
        case 2: gemv<2, Dot, kSdot>(w, a, m0, bias, y, b0, b1, dec); break;
        default: gemv<3, Dot, kSdot>(w, a, m0, bias, y, b0, b1, dec); break;
      }
    }
  });
}

template <typename Dot>
static void run_layout(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1) {
  if (w.layout == kLayoutSDOT)
    run_rows<Dot, true>(w, a, bias, y, b0, b1);
  else
    run_rows<Dot, false>(w, a, bias, y, b0, b1);
}

// Named, non-inlined entry points: the instruction counter attributes executed instructions per symbol.
__attribute__((noinline)) void qlinear_arm_sdot(const Weights& w, const Acts& a, const float* bias, float* y, int b0,
                                                int b1) {
  run_layout<DotSDOT>(w, a, bias, y, b0, b1);
}
__attribute__((noinline)) void qlinear_arm_plain(const Weights& w, const Acts& a, const float* bias, float* y, int b0,
                                                 int b1) {
  run_layout<DotPlain>(w, a, bias, y, b0, b1);
}

void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path) {
  if (path == kAuto || path > cpu_path()) path = cpu_path();  // never an instruction this CPU lacks
  if (path == kMMLA && a.M < 4) path = kDot;  // decode: SDOT GEMV; SMMLA pays off from 4 rows
  if (path == kMMLA) return run_mmla(w, a, bias, y, b0, b1);
  if (path == kDot) return qlinear_arm_sdot(w, a, bias, y, b0, b1);
  qlinear_arm_plain(w, a, bias, y, b0, b1);
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023;
  uint32_t bits;
  if (e == 31) {
    bits = sign | 0x7F800000u | (f << 13);
  } else if (e) {
    bits = sign | ((e + 112) << 23) | (f << 13);
  } else {
    float v = ldexpf((float)f, -24);
    memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

// int8 weight of row r (0..7) at input k (0..31) of block (b, h), decoded from the packed layout.
static int weight_at(const Weights& w, int b, int h, int r, int k) {
  const bool sdot = w.layout == kLayoutSDOT;
  const int H = w.K / 32, c = sdot ? k % 16 / 4 : k / 8, p = sdot ? 2 * (r / 4) + k / 16 : r / 2;
  const int i = sdot ? 4 * (r % 4) + k % 4 : (r % 2) * 8 + k % 8;
  const uint8_t* blk = w.qw + ((size_t)b * H + h) * block_bytes(w.format);
  if (w.format == kU8) return (int8_t)blk[64 * c + 16 * p + i];
  if (w.format == kCB2) {
    const int idx = (blk[16 * p + i] >> (2 * c)) & 3;
    int book = 0;
    if (w.num_books > 1) {
      const int G = (w.K + w.group_size - 1) / w.group_size, g = h / (w.group_size / 32);
      book = (w.qb[(size_t)b * G + g] >> book_shift(r, w.layout)) & 3;
    }
    return w.books[book * 4 + idx];
  }
  const uint8_t byte = blk[32 * c + 16 * (p / 2) + i];
  const int nib = (p % 2) ? byte >> 4 : byte & 15;
  if (w.format == kCB4) return w.books[nib];
  return (int8_t)(nib << 4);  // BCQ: 16·(code − 8)
}

void reference(const Weights& w, const Acts& a, const float* bias, float* y) {
  const int H = w.K / 32, per_group = w.group_size / 32, Nb = (w.N + 7) / 8;
  const int G = (w.K + w.group_size - 1) / w.group_size;
  for (int m = 0; m < a.M; ++m) {
    for (int b = 0; b < Nb; ++b) {
      for (int r = 0; r < 8; ++r) {
        float acc = 0.f;
        for (int h = 0; h < H; ++h) {
          const size_t at = ((size_t)b * G + h / per_group) * 8 + r;
          const float s = half_to_float(w.qs[at]);
          if (has_offset(w.format) && h % per_group == 0) {
            const float c = w.qz_f32 ? static_cast<const float*>(w.qz)[at]
                            : w.qz   ? half_to_float(static_cast<const uint16_t*>(w.qz)[at])
                                     : 0.f;
            acc = fmaf(fmaf(0.5f, s, c), a.xsum[(size_t)m * G + h / per_group], acc);
          }
          const int8_t* xq = a.xq + ((size_t)m * H + h) * 32;
          int32_t isum = 0;
          for (int k = 0; k < 32; ++k) isum += weight_at(w, b, h, r, k) * xq[k];
          acc = fmaf((float)isum, s * a.xs[(size_t)m * H + h], acc);
        }
        if (8 * b + r < w.N) y[(size_t)m * w.N + 8 * b + r] = acc + (bias ? bias[8 * b + r] : 0.f);
      }
    }
  }
}

}  // namespace qlinear_arm
