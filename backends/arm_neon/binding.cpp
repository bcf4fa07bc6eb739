// Torch binding of the Arm kernels: CPU implementation of qlinear::arm_gemm, whose schema and fake
// implementation are declared in qlinear/ops.py.  Activations are quantized once per call, then the
// 8-row blocks are split across threads with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../_shared/rotation_aten.h"
#include "qgemm.h"

namespace {

// rot_block > 0: a rotated layer, x is first transformed by its randomized Hadamard (_shared/rotation.h); perm (int32
// [K]): an act_order layer, x is read as x[:, perm] (after the rotation).
at::Tensor arm_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const std::optional<at::Tensor>& qz,
                    const std::optional<at::Tensor>& qb, const std::optional<at::Tensor>& books,
                    const std::optional<at::Tensor>& bias, int64_t format, int64_t num_books, int64_t N,
                    int64_t group_size, int64_t path, int64_t layout, const std::optional<at::Tensor>& rot_signs,
                    const std::optional<at::Tensor>& rot_paley, int64_t rot_block, const std::optional<at::Tensor>& perm) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "arm_gemm: x must be a contiguous float32 CPU [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), Nb = (N + 7) / 8;
  TORCH_CHECK(format >= 0 && format <= 3, "arm_gemm: unknown format ", format);
  TORCH_CHECK(layout == qlinear_arm::kLayoutMMLA || layout == qlinear_arm::kLayoutSDOT, "arm_gemm: unknown layout ",
              layout);
  TORCH_CHECK(K > 0 && K % 32 == 0 && group_size > 0 && group_size % 32 == 0,
              "arm_gemm: K and group_size must be positive multiples of 32");
  const int64_t G = (K + group_size - 1) / group_size;
  const int64_t bb = qlinear_arm::block_bytes((int)format);
  TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.numel() == Nb * (K / 32) * bb,
              "arm_gemm: qw must be contiguous uint8 [", Nb, ", ", K / 32, ", ", bb, "]");
  TORCH_CHECK(qs.scalar_type() == at::kHalf && qs.is_contiguous() && qs.numel() == Nb * G * 8,
              "arm_gemm: qs must be contiguous fp16 [", Nb, ", ", G, ", 8]");
  qlinear_arm::Weights w{};
  w.qw = qw.data_ptr<uint8_t>();
  w.qs = reinterpret_cast<const uint16_t*>(qs.data_ptr<at::Half>());
  w.format = (int)format;
  w.num_books = (int)num_books;
  w.N = (int)N;
  w.K = (int)K;
  w.group_size = (int)group_size;
  w.layout = (int)layout;
  if (qz.has_value()) {
    TORCH_CHECK(qz->is_contiguous() && qz->numel() == Nb * G * 8 &&
                    (qz->scalar_type() == at::kHalf || qz->scalar_type() == at::kFloat),
                "arm_gemm: qz must be contiguous fp16/fp32 [", Nb, ", ", G, ", 8]");
    w.qz = qz->data_ptr();
    w.qz_f32 = qz->scalar_type() == at::kFloat;
  }
  if (qb.has_value()) {
    TORCH_CHECK(qb->scalar_type() == at::kShort && qb->is_contiguous() && qb->numel() == Nb * G,
                "arm_gemm: qb must be contiguous int16 [", Nb, ", ", G, "]");
    w.qb = reinterpret_cast<const uint16_t*>(qb->data_ptr<int16_t>());
  }
  if (!qlinear_arm::has_offset((int)format)) {
    const int64_t levels = format == qlinear_arm::kCB4 ? 16 : 4;
    TORCH_CHECK(num_books >= 1 && num_books * levels <= 16,
                "arm_gemm: ", num_books, " codebooks of ", levels, " entries do not fit in 16 bytes");
    TORCH_CHECK(books.has_value() && books->scalar_type() == at::kChar && books->is_contiguous() &&
                    books->numel() == num_books * levels,
                "arm_gemm: codebooks must be contiguous int8 [", num_books, ", ", levels, "]");
    TORCH_CHECK(qb.has_value() == (num_books > 1), "arm_gemm: qb (codebook ids) is needed exactly when num_books > 1");
    w.books = books->data_ptr<int8_t>();
  }
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "arm_gemm: bias must have N elements");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const qlinear_rotation::Staged s = qlinear_rotation::stage(
      x, perm, rot_signs, rot_paley, rot_block, (int64_t)qlinear_arm::acts_bytes((int)M, (int)K, (int)group_size), 16);
  qlinear_arm::Acts a{};
  qlinear_arm::prepare_acts(s.x, (int)M, (int)K, (int)group_size, (int)format, w.layout, s.acts, &a);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, Nb, 4, [&](int64_t b0, int64_t b1) { qlinear_arm::run(w, a, b, out, (int)b0, (int)b1, (int)path); });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CPU, m) { m.impl("arm_gemm", &arm_gemm); }
