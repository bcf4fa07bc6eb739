// Helpers shared by the torch bindings of the CUDA backends (binding.cpp files only: this header needs torch).
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>

#include "dtype.h"

namespace qlinear {

inline DType dtype_of(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    default: TORCH_CHECK_TYPE(false, op, ": unsupported dtype ", t);
  }
}

// The bias for a kernel's bias / bias_dtype fields: a contiguous fp32 bias, or one in x's dtype, is passed as it is (no
// launch); any other is converted to contiguous fp32 (kept alive in `holder`).  nullptr without one.
inline const void* bias_arg(const std::optional<at::Tensor>& bias, int64_t N, const at::Tensor& x, at::Tensor& holder,
                            DType& dtype, const char* op) {
  dtype = DType::kNone;
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->device() == x.device(), op, ": bias must have N = ", N, " elements on x's device");
  const bool as_is = bias->is_contiguous() && (bias->scalar_type() == at::kFloat || bias->scalar_type() == x.scalar_type());
  holder = as_is ? *bias : bias->to(at::kFloat).contiguous();
  dtype = dtype_of(holder.scalar_type(), op);
  return holder.data_ptr();
}

// An act_order input permutation (contiguous int32 [K] on x's device) the kernel gathers x by, or nullptr.
inline const int* perm_ptr(const std::optional<at::Tensor>& perm, int64_t K, const at::Tensor& x, const char* op) {
  if (!perm.has_value()) return nullptr;
  TORCH_CHECK(perm->scalar_type() == at::kInt && perm->dim() == 1 && perm->size(0) == K && perm->is_contiguous() &&
                  perm->device() == x.device(), op, ": perm must be contiguous int32 [K] on x's device");
  return perm->data_ptr<int>();
}

// A rotated layer's input transform for the kernels that stage x (qlinear.formats.rotation; block 0: not rotated): D's
// signs as int32 bits [ceil(K/32)] on x's device (backends/_gpu.py's sign_bits), the block size dividing K and, for a
// block p·2^a with p > 1, its ±1 Paley factor int8 [p, p] on x's device.
inline Rotation rotation_of(const std::optional<at::Tensor>& sign_bits, int64_t block,
                            const std::optional<at::Tensor>& paley, int64_t K, const at::Tensor& x, const char* op) {
  Rotation r{0, 1, nullptr, nullptr};
  if (block == 0) return r;
  TORCH_CHECK(block > 0 && K % block == 0, op, ": rotation block ", block, " must divide K = ", K);
  TORCH_CHECK(sign_bits.has_value() && sign_bits->scalar_type() == at::kInt && sign_bits->dim() == 1 &&
                  sign_bits->numel() == (K + 31) / 32 && sign_bits->is_contiguous() && sign_bits->device() == x.device(),
              op, ": a rotated call needs D's signs as contiguous int32 [ceil(K/32)] on x's device ",
              "(qlinear.backends._gpu.sign_bits)");
  int64_t p = 1;
  if (paley.has_value()) {
    p = paley->size(0);
    TORCH_CHECK(paley->scalar_type() == at::kChar && paley->dim() == 2 && paley->size(1) == p && paley->is_contiguous() &&
                    paley->device() == x.device() && block % p == 0, op,
                ": the Paley factor must be contiguous int8 [p, p] on x's device with p dividing the block ", block);
    r.paley_matrix = paley->data_ptr<signed char>();
  }
  const int64_t n = block / p;
  TORCH_CHECK((n & (n - 1)) == 0, op, ": rotation block ", block, " / Paley order ", p, " is not a power of two");
  r.block = (int)block;
  r.paley = (int)p;
  r.sign_bits = reinterpret_cast<const unsigned*>(sign_bits->data_ptr<int>());
  return r;
}

// fp32 [splits, M, N] workspace for split-K partial sums (kept alive in `holder`), or nullptr for one split.
inline float* split_workspace(int64_t splits, int64_t M, int64_t N, const at::Tensor& x, at::Tensor& holder) {
  if (splits <= 1) return nullptr;
  holder = at::empty({splits, M, N}, x.options().dtype(at::kFloat));
  return holder.data_ptr<float>();
}

// x of a GEMV over canonical code words (canonical.h): a contiguous, 16-byte aligned fp16/bf16 CUDA [M, K], M in 1..max_m.
inline void check_gemv_x(const at::Tensor& x, int64_t max_m, const char* op) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= max_m, op,
              ": x must be a contiguous CUDA [M, K] tensor with M in 1..", max_m);
  TORCH_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op, ": x must be fp16 or bf16");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, op, ": x must be 16-byte aligned");
}

// Runs such a GEMV: g.w filled from `weights` (checked by check_gemv_x's caller), fills the rest of g (GemvArgs) from x
// and the bias, launches `launch(g, stream)` on the current stream and returns y [M, N] in x's dtype.
template <typename Args, typename Launch>
at::Tensor gemv_op(Args& g, const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& weights,
                   Launch launch, const char* op) {
  TORCH_CHECK(weights.device() == x.device(), op, ": x and the weights must be on the same device");
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor bias_holder;
  g.bias = bias_arg(bias, g.w.N, x, bias_holder, g.bias_dtype, op);
  at::Tensor y = at::empty({x.size(0), g.w.N}, x.options());
  g.x = x.data_ptr(); g.y = y.data_ptr(); g.M = (int)x.size(0);
  g.x_dtype = dtype_of(x.scalar_type(), op);
  const cudaError_t err = launch(g, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
  return y;
}

// A launch plan's threads per block: whole warps, at most the kernels' 256 (checked before any arithmetic uses it).
inline void check_threads(int64_t threads, const char* op) {
  TORCH_CHECK(threads >= 32 && threads <= 256 && threads % 32 == 0, op, ": threads must be a multiple of 32 in 32..256, got ",
              threads);
}

}  // namespace qlinear
