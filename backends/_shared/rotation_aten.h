// Torch side of rotation.h for the CPU bindings: what their kernels quantize of an op's x argument.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "rotation.h"

namespace qlinear_rotation {

// x (contiguous float32 [M, K]) rotated when block > 0, then read in act_order's stored order x[:, perm] when perm is
// given (int32 [K]); x itself when neither applies (x is never written).
inline at::Tensor staged_input(const at::Tensor& x, const std::optional<at::Tensor>& perm,
                               const std::optional<at::Tensor>& paley, int64_t seed, int64_t block) {
  if (perm.has_value())
    TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->size(0) == x.size(1),
                "perm must be int32 [K = ", x.size(1), "]");
  if (block == 0) return perm.has_value() ? x.index_select(1, *perm) : x;
  const int64_t K = x.size(1);
  TORCH_CHECK(block > 0 && K % block == 0 && seed >= 0 && seed < (int64_t(1) << 31),
              "rotation: block ", block, " must divide K = ", K, " and seed ", seed, " be in [0, 2^31)");
  const int64_t p = paley.has_value() ? paley->size(0) : 1;
  TORCH_CHECK(!paley.has_value() || (paley->scalar_type() == at::kChar && paley->is_contiguous() && paley->dim() == 2 &&
                                     paley->size(1) == p && block % p == 0),
              "rotation: the Paley factor must be a contiguous int8 [p, p] with p dividing the block");
  at::Tensor out = x.clone();
  rotate_rows(out.data_ptr<float>(), x.size(0), K, (uint32_t)seed, block,
              paley.has_value() ? paley->data_ptr<int8_t>() : nullptr, p);
  return perm.has_value() ? out.index_select(1, *perm) : out;
}

}  // namespace qlinear_rotation
