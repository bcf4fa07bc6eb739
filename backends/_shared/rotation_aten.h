// Torch side of rotation.h for the CPU bindings: what their kernels quantize of an op's x argument.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "rotation.h"

namespace qlinear_rotation {

// An op's scratch: its kernel's activation buffer, and the rows of x that the kernel reads.
struct Staged {
  at::Tensor work;    // owns both
  const float* x;     // x itself, or its staged copy in work
  void* acts;         // acts_bytes, aligned to the op's alignment
};

// The checks (TORCH_CHECK) of a rotated or act_order layer's transform arguments for x [M, K] (see
// stage()); the factor's row count f (1: none).
inline int64_t check_transform(const at::Tensor& x, const std::optional<at::Tensor>& perm,
                               const std::optional<at::Tensor>& signs, const std::optional<at::Tensor>& paley,
                               int64_t block) {
  const int64_t K = x.size(1);
  if (perm.has_value()) {
    TORCH_CHECK(perm->scalar_type() == at::kInt && perm->is_contiguous() && perm->dim() == 1 && perm->size(0) == K,
                "perm must be contiguous int32 [K = ", K, "]");
    const int32_t* idx = perm->data_ptr<int32_t>();
    TORCH_CHECK(std::all_of(idx, idx + K, [K](int32_t k) { return k >= 0 && k < K; }), "perm must lie in [0, K)");
  }
  const int64_t f = paley.has_value() ? paley->size(0) : 1;
  if (block != 0) {
    TORCH_CHECK(block > 0 && K % block == 0 && signs.has_value() && signs->scalar_type() == at::kFloat &&
                    signs->is_contiguous() && signs->numel() == K,
                "rotation: block ", block, " must divide K = ", K, " and rot_signs be contiguous float32 [K]");
    TORCH_CHECK(!paley.has_value() || (paley->scalar_type() == at::kFloat && paley->is_contiguous() &&
                                       paley->dim() == 2 && paley->size(1) == f && f >= 2 && f % 2 == 0 &&
                                       block % paley_order(f) == 0),
                "rotation: the Paley factor must be a contiguous float32 [f, f] (backends/_cpu.py paley_argument) "
                "whose order divides the block");
    const int64_t n = block / paley_order(f);  // the Sylvester order: the transform's loops take a power of two
    TORCH_CHECK((n & (n - 1)) == 0, "rotation: block ", block, " over the Paley order ", paley_order(f),
                " must be a power of two");
  }
  return f;
}

// rows [M, K] (float32) = src's rows [M, K] (rows itself: in place) rotated where block > 0 (check_transform's
// arguments), then read in act_order's order where idx (perm) is given.
inline void transform_rows(float* rows, const float* src, int64_t M, int64_t K, const int32_t* idx,
                           const std::optional<at::Tensor>& signs, const std::optional<at::Tensor>& paley,
                           int64_t block, int64_t f) {
  if (block != 0)
    rotate_rows(rows, M, K, signs->data_ptr<float>(), block, paley.has_value() ? paley->data_ptr<float>() : nullptr, f,
                src);
  else if (src != rows)
    std::copy_n(src, M * K, rows);
  if (idx == nullptr) return;
  std::vector<float> row(K);
  for (int64_t m = 0; m < M; ++m) {
    std::copy_n(rows + m * K, K, row.data());
    for (int64_t k = 0; k < K; ++k) rows[m * K + k] = row[idx[k]];
  }
}

// One allocation for acts_bytes of activations (aligned to align, a power of two) and, where the layer rotates x
// (block > 0: signs D/√b float32 [K], the Paley factor float32 [f, f] as backends/_cpu.py paley_argument gives it,
// or none) or reads it in act_order's stored order x[:, perm] (int32 [K], after the rotation), x's staged copy
// [M, K]; x (contiguous float32 [M, K]) is never written.
inline Staged stage(const at::Tensor& x, const std::optional<at::Tensor>& perm,
                    const std::optional<at::Tensor>& signs, const std::optional<at::Tensor>& paley, int64_t block,
                    int64_t acts_bytes, int64_t align) {
  const int64_t M = x.size(0), K = x.size(1), f = check_transform(x, perm, signs, paley, block);
  const bool copy = block != 0 || perm.has_value();
  const int64_t staged = copy ? (M * K * (int64_t)sizeof(float) + align - 1) / align * align : 0;
  Staged s{at::empty({staged + acts_bytes + align}, x.options().dtype(at::kByte)), x.data_ptr<float>(), nullptr};
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(s.work.data_ptr()) + align - 1) &
                                       ~uintptr_t(align - 1));
  s.acts = base + staged;
  if (!copy) return s;
  float* out = reinterpret_cast<float*>(base);
  transform_rows(out, s.x, M, K, perm.has_value() ? perm->data_ptr<int32_t>() : nullptr, signs, paley, block, f);
  s.x = out;
  return s;
}

// x (contiguous float32 or bfloat16 [M, K]) as stage() stages it (rotated in float32, then read in act_order's
// order), as a tensor of x's dtype (rounded once; x itself where neither applies): the batched paths' input.  Rows go
// through a float32 buffer 32 at a time, so that a bfloat16 x takes no float32 copy of itself.
inline at::Tensor staged_tensor(const at::Tensor& x, const std::optional<at::Tensor>& perm,
                                const std::optional<at::Tensor>& signs, const std::optional<at::Tensor>& paley,
                                int64_t block) {
  const int64_t f = check_transform(x, perm, signs, paley, block), M = x.size(0), K = x.size(1);
  if (block == 0) return perm.has_value() ? x.index_select(1, *perm) : x;
  at::Tensor out = at::empty_like(x);
  const int32_t* idx = perm.has_value() ? perm->data_ptr<int32_t>() : nullptr;
  std::vector<float> buf(std::min<int64_t>(M, 32) * K);
  auto run = [&](const auto* src, auto* dst) {  // float32 or bfloat16, through torch's own conversions
    using T = std::remove_pointer_t<decltype(dst)>;
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int64_t n = std::min<int64_t>(32, M - m0) * K;
      std::transform(src + m0 * K, src + m0 * K + n, buf.begin(), [](T v) { return static_cast<float>(v); });
      transform_rows(buf.data(), buf.data(), n / K, K, idx, signs, paley, block, f);
      std::transform(buf.begin(), buf.begin() + n, dst + m0 * K, [](float v) { return static_cast<T>(v); });
    }
  };
  if (x.scalar_type() == at::kBFloat16) run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  else run(x.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace qlinear_rotation
