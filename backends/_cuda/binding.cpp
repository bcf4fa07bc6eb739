// Torch binding of the standalone rotation kernel (rotate.h): CUDA implementation of qlinear::cuda_rotate, whose
// schema and fake implementation are declared in qlinear/ops.py.  Built on its own (backends/_gpu.py), not into any
// backend's library.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "binding.h"
#include "rotate.h"

namespace {

at::Tensor cuda_rotate(const at::Tensor& x, const at::Tensor& rot_sign_bits, int64_t rot_block,
                       const std::optional<at::Tensor>& rot_paley, int64_t slice) {
  const char* op = "cuda_rotate";
  TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) && x.dim() >= 1, op,
              ": x must be a fp16 or bf16 CUDA tensor [..., K]");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  TORCH_CHECK(rot_block > 0, op, ": rot_block must be positive, got ", rot_block);
  TORCH_CHECK(K < (int64_t(1) << 31) && M < (int64_t(1) << 31), op, ": x ", x.sizes(), " is too large");
  TORCH_CHECK(slice >= 0 && (slice == 0 || K % slice == 0), op, ": slice must divide K = ", K, " (0: the plan's), got ",
              slice);
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const qlinear::Rotation r = qlinear::rotation_of(rot_sign_bits, rot_block, rot_paley, K, xc, op);
  at::Tensor y = at::empty_like(xc);
  if (M == 0) return y;
  const cudaError_t err = qlinear::rotate(xc.data_ptr(), y.data_ptr(), (int)M, (int)K, r,
                                          qlinear::dtype_of(xc.scalar_type(), op), c10::cuda::getCurrentCUDAStream(),
                                          (int)slice);
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) { m.impl("cuda_rotate", &cuda_rotate); }
