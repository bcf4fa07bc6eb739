// Torch binding of the LUT GEMV: CUDA implementation of qlinear::bcq_lut_gemv, whose schema and fake
// implementation are declared in qlinear/ops.py (one file holds the whole op surface).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../_cuda/binding.h"
#include "bcq_lut_gemv.h"

namespace {

// Checks the layout's buffers (K = 32 · words) and fills their fields of `a`; the op name goes into the errors.
void weights_of(const at::Tensor& planes, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
                int64_t group_size, qlinear::LutGemvArgs& a, const char* op) {
  TORCH_CHECK(planes.is_cuda() && planes.scalar_type() == at::kInt && planes.dim() == 3 && planes.is_contiguous(),
              op, ": planes must be contiguous int32 CUDA [K/32, Q, N]");
  const int64_t K = planes.size(0) * 32, Q = planes.size(1), N = planes.size(2);
  TORCH_CHECK(Q >= 1 && Q <= 8 && N % 4 == 0, op, ": planes ", planes.sizes(), " need 1..8 planes and N % 4 == 0");
  a.uniform = alpha.dim() == 2;  // a uniform layer's scales
  TORCH_CHECK(!a.uniform || Q > 4, op, ": scales [G, N] in place of alpha need 5..8 planes (1..4 take α [G, Q, N])");
  TORCH_CHECK(alpha.scalar_type() == at::kHalf && (a.uniform || (alpha.dim() == 3 && alpha.size(1) == Q)) &&
                  alpha.size(-1) == N && alpha.is_contiguous(), op,
              ": alpha must be contiguous fp16 [G, Q, N] (α), or [G, N] (a uniform layer's scales, 5..8 planes)");
  TORCH_CHECK(group_size % 32 == 0 && group_size > 0 && alpha.size(0) == (K + group_size - 1) / group_size,
              op, ": alpha has ", alpha.size(0), " groups, K=", K, " group_size=", group_size);
  TORCH_CHECK(alpha.device() == planes.device() && (!offset.has_value() || offset->device() == planes.device()),
              op, ": planes, alpha and offset must be on the same device");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(planes.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(alpha.data_ptr()) % 8 == 0, op, ": planes and alpha must be aligned");
  a.planes = reinterpret_cast<const unsigned*>(planes.data_ptr<int>());
  a.alpha = alpha.data_ptr();
  a.offset_dtype = qlinear::DType::kNone;
  if (offset.has_value()) {
    TORCH_CHECK(offset->is_contiguous() && offset->dim() == 2 && offset->size(0) == alpha.size(0) && offset->size(1) == N,
                op, ": offset must be contiguous [G, N]");
    a.offset = offset->data_ptr();
    a.offset_dtype = qlinear::dtype_of(offset->scalar_type(), op);
  }
  a.N = (int)N; a.K = (int)K; a.Q = (int)Q; a.group_size = (int)group_size;
}

at::Tensor bcq_lut_gemv(const at::Tensor& x, const at::Tensor& planes, const at::Tensor& alpha,
                        const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& perm,
                        const std::optional<at::Tensor>& bias,
                        int64_t group_size, int64_t kt, int64_t threads, int64_t tiles_per_split, int64_t splits,
                        const std::optional<at::Tensor>& rot_sign_bits, int64_t rot_block,
                        const std::optional<at::Tensor>& rot_paley) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "bcq_lut_gemv: x must be a contiguous CUDA [M, K] tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "bcq_lut_gemv: x must be fp16 or bf16");
  c10::cuda::CUDAGuard guard(x.device());
  qlinear::LutGemvArgs a{};
  weights_of(planes, alpha, offset, group_size, a, "bcq_lut_gemv");
  const int64_t M = x.size(0), N = a.N;
  TORCH_CHECK(M >= 1 && M <= 8, "bcq_lut_gemv: M must be in 1..8, got ", M);
  TORCH_CHECK(x.size(1) == a.K, "bcq_lut_gemv: x has K=", x.size(1), " but planes ", planes.sizes(), " hold K=", a.K);
  TORCH_CHECK(planes.device() == x.device() && (!bias.has_value() || bias->device() == x.device()),
              "bcq_lut_gemv: x, weights and bias must be on the same device");
  a.x = x.data_ptr();
  a.perm = qlinear::perm_ptr(perm, a.K, x, "bcq_lut_gemv");
  at::Tensor bias_holder, partial;
  a.bias = qlinear::bias_arg(bias, N, x, bias_holder, a.bias_dtype, "bcq_lut_gemv");
  a.partial = qlinear::split_workspace(splits, M, N, x, partial);
  qlinear::check_threads(threads, "bcq_lut_gemv");
  at::Tensor y = at::empty({M, N}, x.options());
  a.y = y.data_ptr();
  a.M = (int)M;
  a.kt = (int)kt; a.tiles_per_split = (int)tiles_per_split; a.splits = (int)splits; a.threads = (int)threads;
  a.x_dtype = qlinear::dtype_of(x.scalar_type(), "bcq_lut_gemv");
  const qlinear::Rotation rot = qlinear::rotation_of(rot_sign_bits, rot_block, rot_paley, a.K, x, "bcq_lut_gemv");
  const cudaError_t err = qlinear::lut_gemv(a, rot, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "bcq_lut_gemv launch failed: ", cudaGetErrorString(err));
  return y;
}

at::Tensor bcq_lut_dequantize(const at::Tensor& planes, const at::Tensor& alpha, const std::optional<at::Tensor>& offset,
                              int64_t group_size, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(planes.device());
  qlinear::LutGemvArgs a{};
  weights_of(planes, alpha, offset, group_size, a, "bcq_lut_dequantize");
  TORCH_CHECK(qlinear::lut_dequantize_grid(a.N, a.K).y <= 65535, "bcq_lut_dequantize: K=", a.K, " is over ",
              qlinear::lut_dequantize_tile_k, " * 65535");
  at::Tensor w = at::empty({a.N, a.K}, planes.options().dtype(dtype));
  a.y = w.data_ptr();
  const cudaError_t err = qlinear::lut_dequantize(a, qlinear::dtype_of(dtype, "bcq_lut_dequantize"),
                                                  c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "bcq_lut_dequantize launch failed: ", cudaGetErrorString(err));
  return w;
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) {
  m.impl("bcq_lut_gemv", &bcq_lut_gemv);
  m.impl("bcq_lut_dequantize", &bcq_lut_dequantize);
}
