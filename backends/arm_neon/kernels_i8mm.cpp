// SMMLA kernel (i8mm) for M >= 4: each instruction multiplies 2 activation rows x 8 inputs by 8 inputs x
// 2 weight rows into a 2x2 int32 tile.  Activation rows are processed two pairs at a time so that
// every decoded weight vector feeds two SMMLAs; the float epilogue is the same per (row, block)
// arithmetic as the SDOT kernel (qgemm.h), so both paths give identical results.
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.6-a+dotprod+i8mm")
#endif
#include "decode.h"

namespace qlinear_arm {

template <int MP, typename Dec>
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
        int8x16_t v[2][4];
        dec.pair(blk, ch, v);
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j)
#pragma GCC unroll 16
          for (int q = 0; q < MP; ++q) {
            const int8x16_t xa = vld1q_s8(xp + (((size_t)(mp0 + q) * H + h) * 4 + 2 * ch + j) * 16);
#pragma GCC unroll 16
            for (int p = 0; p < 4; ++p) isum[q][p] = vmmlaq_s32(isum[q][p], xa, v[j][p]);
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
#pragma GCC unroll 16
  for (int q = 0; q < MP; ++q) {
#pragma GCC unroll 16
    for (int p = 0; p < 4; ++p) {
      float out[4];
      vst1q_f32(out, acc[q][p]);
      for (int i = 0; i < 4; ++i) {
        const int m = 2 * (mp0 + q) + i / 2, n = 8 * b + 2 * p + i % 2;
        if (m < a.M && n < w.N) y[(size_t)m * w.N + n] = out[i] + (bias ? bias[n] : 0.f);
      }
    }
  }
}

__attribute__((noinline)) void qlinear_arm_mmla(const Weights& w, const Acts& a, const float* bias, float* y, int b0,
                                                int b1) {
  const int pairs = (a.M + 1) / 2;
  with_decoder(w, [&](auto& dec) {
    for (int b = b0; b < b1; ++b)
      for (int q = 0; q < pairs; q += 2) {
        if (pairs - q >= 2) mmla_tile<2>(w, a, q, bias, y, b, dec);
        else mmla_tile<1>(w, a, q, bias, y, b, dec);
      }
  });
}

void run_mmla(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1) {
  qlinear_arm_mmla(w, a, bias, y, b0, b1);
}

}  // namespace qlinear_arm
