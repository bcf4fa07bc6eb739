// Torch binding of the QUICK GEMM: CUDA implementations of qlinear::quick_gemm and qlinear::quick_dequantize,
// whose schemas and fake implementations are declared in qlinear/ops.py.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../_cuda/binding.h"
#include "quick_gemm.h"

namespace {

// Checks the quick buffers against N, K and fills the weight part of the launcher arguments.
qlinear::QuickArgs weight_args(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                               int64_t group_size, int64_t N, int64_t K, const at::Device& device) {
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 3 && qweight.is_contiguous() && qweight.device() == device,
              "quick: qweight must be contiguous int32 [N/32, K/64, 64*Q] on the device of x");
  const int64_t Q = qweight.size(2) / 64;
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0 && qweight.size(0) * 32 == N && qweight.size(1) * 64 == K && Q >= 2 && Q <= 4 &&
                  qweight.size(2) == 64 * Q, "quick: qweight ", qweight.sizes(), " does not fit N=", N, ", K=", K);
  TORCH_CHECK(group_size % 32 == 0 && group_size > 0, "quick: group_size must be a positive multiple of 32");
  TORCH_CHECK(K < (1 << 20), "quick: K=", K, " must be below 2^20 (the kernel's group index arithmetic)");
  const int64_t G = (K + group_size - 1) / group_size;
  // uniform: s [G, N] and packed zero points; free α: α [G, Q, N] and fp16 offsets [G, N]
  const bool free_alpha = scales.dim() == 3;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == G &&
                  scales.size(-1) == N && scales.device() == device &&
                  (scales.dim() == 2 || (free_alpha && scales.size(1) == Q)),
              "quick: scales must be contiguous fp16 [G, N] (uniform) or [G, Q, N] (free α)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(scales.data_ptr()) % 8 == 0,
              "quick: qweight must be 16-byte and scales 8-byte aligned");
  qlinear::QuickArgs a{};
  a.qweight = reinterpret_cast<const unsigned*>(qweight.data_ptr<int>());
  a.scales = scales.data_ptr();
  a.free_alpha = free_alpha;
  if (zeros.has_value() && free_alpha) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kHalf && zeros->dim() == 2 && zeros->size(0) == G &&
                    zeros->size(1) == N && zeros->device() == device &&
                    reinterpret_cast<uintptr_t>(zeros->data_ptr()) % 8 == 0,
                "quick: the offsets of a free-α layer must be contiguous, 8-byte aligned fp16 [G, N]");
    a.offsets = zeros->data_ptr();
  } else if (zeros.has_value()) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kShort && zeros->dim() == 2 && zeros->size(0) == G &&
                    zeros->size(1) * 4 == N && zeros->device() == device,
                "quick: zeros must be contiguous int16 [G, N/4]");
    a.zeros = reinterpret_cast<const unsigned short*>(zeros->data_ptr<int16_t>());
  }
  a.N = (int)N; a.K = (int)K; a.Q = (int)Q; a.group_size = (int)group_size;
  return a;
}

at::Tensor quick_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& perm,
                      const std::optional<at::Tensor>& bias, int64_t group_size, int64_t tile_m, int64_t tiles_per_split,
                      int64_t splits, const std::optional<at::Tensor>& rot_sign_bits, int64_t rot_block,
                      const std::optional<at::Tensor>& rot_paley) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "quick_gemm: x must be a contiguous CUDA [M, K] tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "quick_gemm: x must be fp16 or bf16");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "quick_gemm: x must be 16-byte aligned");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0) * 32;
  TORCH_CHECK(M >= 1 && M * N < (int64_t{1} << 31) && M <= 65535 * 16, "quick_gemm: M=", M, " out of range (1..",
              std::min<int64_t>(65535 * 16, ((int64_t{1} << 31) - 1) / std::max<int64_t>(N, 1)), ")");
  c10::cuda::CUDAGuard guard(x.device());
  qlinear::QuickArgs a = weight_args(qweight, scales, zeros, group_size, N, K, x.device());
  TORCH_CHECK(splits >= 1 && tiles_per_split >= 1 && (splits - 1) * tiles_per_split < K / 64 &&
                  splits * tiles_per_split >= K / 64, "quick_gemm: the split plan does not cover the K tiles once");
  a.perm = qlinear::perm_ptr(perm, K, x, "quick_gemm");
  at::Tensor bias_holder, partial;
  a.bias = qlinear::bias_arg(bias, N, x, bias_holder, a.bias_dtype, "quick_gemm");
  a.partial = qlinear::split_workspace(splits, M, N, x, partial);
  TORCH_CHECK(tile_m == 16 || tile_m == 32 || tile_m == 64 || tile_m == 128, "quick_gemm: tile_m must be 16, 32, 64 or 128, got ",
              tile_m);
  at::Tensor y = at::empty({M, N}, x.options());
  a.x = x.data_ptr();
  a.y = y.data_ptr();
  a.M = (int)M; a.tile_m = (int)tile_m; a.tiles_per_split = (int)tiles_per_split; a.splits = (int)splits;
  a.x_dtype = qlinear::dtype_of(x.scalar_type(), "quick_gemm");
  const qlinear::Rotation rot = qlinear::rotation_of(rot_sign_bits, rot_block, rot_paley, K, x, "quick_gemm");
  const cudaError_t err = qlinear::quick_gemm(a, rot, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "quick_gemm launch failed: ", cudaGetErrorString(err));
  return y;
}

at::Tensor quick_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                            int64_t group_size, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(qweight.is_cuda(), "quick_dequantize: qweight must be on a CUDA device");
  TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, "quick_dequantize: dtype must be fp16 or bf16");
  const int64_t N = qweight.size(0) * 32;
  c10::cuda::CUDAGuard guard(qweight.device());
  qlinear::QuickArgs a = weight_args(qweight, scales, zeros, group_size, N, K, qweight.device());
  at::Tensor w = at::empty({N, K}, qweight.options().dtype(dtype));
  a.y = w.data_ptr();
  a.splits = 1; a.tiles_per_split = 1;
  a.x_dtype = qlinear::dtype_of(dtype, "quick_dequantize");
  const cudaError_t err = qlinear::quick_dequantize(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "quick_dequantize launch failed: ", cudaGetErrorString(err));
  return w;
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) {
  m.impl("quick_gemm", &quick_gemm);
  m.impl("quick_dequantize", &quick_dequantize);
}
