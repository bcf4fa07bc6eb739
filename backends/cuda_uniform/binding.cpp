// Torch binding of the uniform kernels: CUDA implementations of qlinear::uniform_dequantize and uniform_gemv, whose
// schemas and fake implementations are declared in qlinear/ops.py (one file holds the whole op surface).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../_cuda/binding.h"
#include "uniform.h"

namespace {

// Checks the canonical buffers (op: the name in the errors) and fills `a` but its output.
qlinear::UniformArgs weights_of(const at::Tensor& qweight, const at::Tensor& scales,
                                const std::optional<at::Tensor>& qzeros, int64_t K, int64_t group_size, int64_t bits,
                                const char* op) {
  TORCH_CHECK(bits == 8, op, ": 8-bit codes only, got bits=", bits);
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0, op,
              ": qweight must be contiguous, 16-byte aligned int32 CUDA [N, K/4]");
  TORCH_CHECK(K % 32 == 0 && K < (1 << 20) && group_size > 0 && group_size % 32 == 0 && qweight.size(1) == K / 4, op,
              ": qweight ", qweight.sizes(), " does not fit K=", K, " group_size=", group_size,
              " (K and group_size must be multiples of 32, K below 2^20)");
  const int64_t N = qweight.size(0), G = (K + group_size - 1) / group_size;
  TORCH_CHECK(N * (K / 32) < (int64_t(1) << 31), op, ": N·K/32 must be below 2^31, got N = ", N, ", K = ", K);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == G && scales.device() == qweight.device(), op,
              ": scales must be contiguous fp16 [N, ceil(K / group_size)] on qweight's device");
  qlinear::UniformArgs a{};
  if (qzeros.has_value()) {
    TORCH_CHECK(qzeros->scalar_type() == at::kInt && qzeros->is_contiguous() && qzeros->dim() == 2 &&
                    qzeros->size(0) == G && qzeros->size(1) == (N + 3) / 4 && qzeros->device() == qweight.device(), op,
                ": qzeros must be contiguous int32 [ceil(K / group_size), ceil(N / 4)] on qweight's device");
    a.zeros = reinterpret_cast<const unsigned*>(qzeros->data_ptr<int>());
    a.zero_words = (int)qzeros->size(1);
  }
  a.codes = reinterpret_cast<const unsigned*>(qweight.data_ptr<int>());
  a.scales = scales.data_ptr();
  a.N = (int)N; a.K = (int)K; a.bits = (int)bits; a.group_size = (int)group_size;
  a.code_words = (int)qweight.size(1);
  return a;
}

at::Tensor uniform_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& qzeros,
                              int64_t K, int64_t group_size, int64_t bits, at::ScalarType dtype) {
  const char* op = "uniform_dequantize";
  qlinear::UniformArgs a = weights_of(qweight, scales, qzeros, K, group_size, bits, op);
  c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor w = at::empty({qweight.size(0), K}, qweight.options().dtype(dtype));
  a.w = w.data_ptr();
  const cudaError_t err = qlinear::uniform_dequantize(a, qlinear::dtype_of(dtype, op), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
  return w;
}

at::Tensor uniform_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& bias,
                        int64_t group_size, int64_t bits) {
  const char* op = "uniform_gemv";
  qlinear::check_gemv_x(x, 16, op);
  qlinear::UniformGemvArgs g{};
  g.w = weights_of(qweight, scales, qzeros, x.size(1), group_size, bits, op);
  return qlinear::gemv_op(g, x, bias, qweight, qlinear::uniform_gemv, op);
}

at::Tensor uniform_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& qzeros, const std::optional<at::Tensor>& bias,
                        int64_t group_size, int64_t bits, int64_t tile_m, int64_t tiles_per_split, int64_t splits) {
  const char* op = "uniform_gemm";
  qlinear::check_gemv_x(x, 512, op);
  TORCH_CHECK(x.size(1) % 64 == 0, op, ": K must be a multiple of 64, got ", x.size(1));
  const int64_t steps = x.size(1) / 64;
  TORCH_CHECK(tile_m == 16 || tile_m == 32 || tile_m == 64 || tile_m == 128, op, ": tile_m must be 16, 32, 64 or 128");
  TORCH_CHECK(tiles_per_split >= 1 && splits >= 1 && (splits - 1) * tiles_per_split < steps &&
                  splits * tiles_per_split >= steps, op, ": ", splits, " slices of ", tiles_per_split,
              " steps do not cover K's ", steps, " steps of 64 inputs with none empty");
  qlinear::UniformGemmArgs ga{};
  ga.g.w = weights_of(qweight, scales, qzeros, x.size(1), group_size, bits, op);
  ga.tile_m = (int)tile_m; ga.tiles_per_split = (int)tiles_per_split; ga.splits = (int)splits;
  at::Tensor workspace;
  ga.partial = qlinear::split_workspace(splits, x.size(0), ga.g.w.N, x, workspace);
  return qlinear::gemv_op(ga.g, x, bias, qweight,
                          [&ga](const qlinear::UniformGemvArgs& g, cudaStream_t s) {
                            ga.g = g;
                            return qlinear::uniform_gemm(ga, s);
                          },
                          op);
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) {
  m.impl("uniform_dequantize", &uniform_dequantize);
  m.impl("uniform_gemv", &uniform_gemv);
  m.impl("uniform_gemm", &uniform_gemm);
}
