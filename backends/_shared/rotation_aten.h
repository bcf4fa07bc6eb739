// Torch side of rotation.h for the CPU bindings: what their kernels quantize of an op's x argument.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "rotation.h"

namespace qlinear_rotation {

// x (contiguous float32 [M, K]) rotated when block > 0 (signs: D/√b float32 [K]; paley: float32 [p, p] or none), then
// read in act_order's stored order x[:, perm] when perm is given (int32 [K]); x itself when neither applies (x is
// never written).
inline at::Tensor staged_input(const at::Tensor& x, const std::optional<at::Tensor>& perm,
                               const std::optional<at::Tensor>& signs, const std::optional<at::Tensor>& paley,
                               int64_t block) {
  const int64_t K = x.size(1);
  if (perm.has_value())
    TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->size(0) == K, "perm must be int32 [K = ",
                K, "]");
  if (block == 0) return perm.has_value() ? x.index_select(1, *perm) : x;
  const int64_t p = paley.has_value() ? paley->size(0) : 1;
  TORCH_CHECK(block > 0 && K % block == 0 && signs.has_value() && signs->scalar_type() == at::kFloat &&
                  signs->is_contiguous() && signs->numel() == K,
              "rotation: block ", block, " must divide K = ", K, " and rot_signs be contiguous float32 [K]");
  TORCH_CHECK(!paley.has_value() || (paley->scalar_type() == at::kFloat && paley->is_contiguous() && paley->dim() == 2 &&
                                     paley->size(1) == p && block % p == 0),
              "rotation: the Paley factor must be a contiguous float32 [p, p] with p dividing the block");
  at::Tensor out = x.clone();
  rotate_rows(out.data_ptr<float>(), x.size(0), K, signs->data_ptr<float>(), block,
              paley.has_value() ? paley->data_ptr<float>() : nullptr, p);
  return perm.has_value() ? out.index_select(1, *perm) : out;
}

}  // namespace qlinear_rotation
