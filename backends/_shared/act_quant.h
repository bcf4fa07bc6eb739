// Dynamic int8 activations (the Arm paper, §4), shared by the x86 and Arm kernels and mirrored by
// backends/_cpu.py quantize_activations: a block's codes are round_half_even(x · 127/amax), its scale amax/127.
#pragma once

#include <cmath>

namespace qlinear_cpu {

// max |x_k| over a block, or NaN if the block holds one (std::max and fmaxf drop a NaN)
inline float block_amax(const float* x, int n) {
  float amax = 0.0f;
  bool nan = false;
  for (int k = 0; k < n; ++k) {
    amax = std::fmax(amax, std::fabs(x[k]));
    nan |= std::isnan(x[k]);
  }
  return nan ? NAN : amax;
}

// 127/amax, or 0 where that is not finite: an all-zero block, a largest |x| below 127/FLT_MAX (about 3.7e-37, where
// 0 · inf would make NaN codes), or a NaN amax.  Such a block's codes are all 0; a NaN block keeps its NaN scale, so
// the outputs it feeds are NaN as in float arithmetic instead of finite values from saturated codes.
inline float act_inverse_scale(float amax) {
  const float inv = 127.0f / amax;
  return std::isfinite(inv) ? inv : 0.0f;
}

}  // namespace qlinear_cpu
