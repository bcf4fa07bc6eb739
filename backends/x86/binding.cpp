// Torch binding of the x86 kernels: CPU implementation of qlinear::x86_gemm, whose schema and fake implementation
// are declared in qlinear/ops.py.  Activations are quantized once per call, then the 16-row blocks are split
// across threads with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <string>

#include "../_shared/rotation_aten.h"
#include "qgemm.h"

namespace {

// format kU4: qw = nibble codes uint8 [Nb, K/8, 64]; kLutUniform / kLutFree: qw = bit-planes uint8 [Nb, K/32, bits,
// 64]; uniform: qs = scales fp16 [Nb, G, 16], qz = 2·zero uint8 [Nb, G, 16]; kLutFree: qs = α fp16 [Nb, G, bits, 16],
// qz = offsets fp16 [Nb, G, 16] (qgemm.h).  rot_block > 0: a rotated layer, x is first transformed by its randomized
// Hadamard (rot_signs = D/√b float32 [K], blocks of rot_block, Paley factor rot_paley float32 [p, p] or none;
// _shared/rotation.h).
// perm (int32 [K]): an act_order layer, x is read as x[:, perm] (after the rotation).
// kCB4 / kCB2: qw = codes (kCB4 as kU4; kCB2 crumbs uint8 [Nb, K/16, 64]), qs = scales fp16 [Nb, G, 16], qz = the
// codebooks int8 [C, 2^bits] (C·2^bits <= 16), qb = book words int32 [Nb, G] when C > 1.
// The weights of a layer in qgemm.h's layouts, checked (shapes, dtypes, format and bits); `table` receives the
// codebook formats' centroids.
qlinear_x86::Weights weights_of(const char* op, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                                const std::optional<at::Tensor>& qb, int64_t N, int64_t K, int64_t group_size,
                                int64_t bits, int64_t format, int8_t* table) {
  const int64_t Nb = (N + 15) / 16;
  TORCH_CHECK(K > 0 && K % 32 == 0 && group_size > 0 && group_size % 32 == 0,
              op, ": K and group_size must be positive multiples of 32");
  TORCH_CHECK(format >= qlinear_x86::kU4 && format <= qlinear_x86::kCB2, op, ": unknown format ", format);
  TORCH_CHECK(bits >= 1 && bits <= 4 && (format != qlinear_x86::kU4 || bits == 4), op, ": bits ", bits,
              " not in 1..4 (4 for format 0)");
  const int64_t G = (K + group_size - 1) / group_size;
  const bool codebook = format >= qlinear_x86::kCB4;
  const bool lut = !codebook && format != qlinear_x86::kU4, free_alpha = format == qlinear_x86::kLutFree;
  const int32_t* books = nullptr;
  if (codebook) {
    const int64_t B = format == qlinear_x86::kCB4 ? 4 : 2;
    TORCH_CHECK(bits == B, op, ": format ", format, " takes bits=", B, ", got ", bits);
    TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.numel() == Nb * (K * B / 32) * 64,
                op, ": qw must be contiguous uint8 [", Nb, ", ", K * B / 32, ", 64]");
    TORCH_CHECK(qs.scalar_type() == at::kHalf && qs.is_contiguous() && qs.numel() == Nb * G * 16,
                op, ": qs must be contiguous fp16 [", Nb, ", ", G, ", 16]");
    TORCH_CHECK(qz.scalar_type() == at::kChar && qz.is_contiguous() && qz.dim() == 2 && qz.size(1) == (1 << B) &&
                    qz.numel() <= 16, op, ": qz (the codebooks) must be contiguous int8 [C, ", 1 << B,
                "] of at most 16 entries");
    std::memcpy(table, qz.data_ptr<int8_t>(), qz.numel());
    TORCH_CHECK(qb.has_value() == (qz.size(0) > 1), op, ": qb (book words) is needed exactly when there are "
                "several codebooks");
    if (qb.has_value()) {
      TORCH_CHECK(qb->scalar_type() == at::kInt && qb->is_contiguous() && qb->numel() == Nb * G,
                  op, ": qb must be contiguous int32 [", Nb, ", ", G, "]");
      books = qb->data_ptr<int32_t>();
    }
  } else if (lut) {
    TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.numel() == Nb * (K / 32) * bits * 64,
                op, ": qw must be contiguous uint8 [", Nb, ", ", K / 32, ", ", bits, ", 64]");
  } else {
    TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.numel() == Nb * (K / 8) * 64,
                op, ": qw must be contiguous uint8 [", Nb, ", ", K / 8, ", 64]");
  }
  if (!codebook) {
    TORCH_CHECK(qs.scalar_type() == at::kHalf && qs.is_contiguous() && qs.numel() == Nb * G * (free_alpha ? bits : 1) * 16,
                op, ": qs must be contiguous fp16 [", Nb, ", ", G, free_alpha ? ", " + std::to_string(bits) : "",
                ", 16]");
    TORCH_CHECK(qz.scalar_type() == (free_alpha ? at::kHalf : at::kByte) && qz.is_contiguous() && qz.numel() == Nb * G * 16,
                op, ": qz must be contiguous ", free_alpha ? "fp16" : "uint8", " [", Nb, ", ", G, ", 16]");
  }
  return qlinear_x86::Weights{qw.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(qs.data_ptr<at::Half>()),
                              free_alpha || codebook ? nullptr : qz.data_ptr<uint8_t>(), (int)N, (int)K,
                              (int)group_size, (int)format, (int)bits,
                              free_alpha ? reinterpret_cast<const uint16_t*>(qz.data_ptr<at::Half>()) : nullptr,
                              table, books};
}

at::Tensor x86_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                    const std::optional<at::Tensor>& bias, int64_t N, int64_t group_size, int64_t bits,
                    int64_t format, int64_t path, const std::optional<at::Tensor>& rot_signs,
                    const std::optional<at::Tensor>& rot_paley,
                    int64_t rot_block, const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& qb) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x86_gemm: x must be a contiguous float32 CPU [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), Nb = (N + 15) / 16;
  TORCH_CHECK(path >= qlinear_x86::kAuto && path <= qlinear_x86::kAVX512VNNI, "x86_gemm: unknown path ", path);
  TORCH_CHECK(path == qlinear_x86::kAuto || qlinear_x86::path_supported((int)path, (int)format),
              "x86_gemm: this CPU cannot run path ", path, " for format ", format);
  int8_t table[16] = {};
  const qlinear_x86::Weights w = weights_of("x86_gemm", qw, qs, qz, qb, N, K, group_size, bits, format, table);
  const bool lut = format == qlinear_x86::kLutUniform || format == qlinear_x86::kLutFree;
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "x86_gemm: bias must have N elements");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor work = at::empty({qlinear_x86::acts_bytes((int)M, (int)K, (int)group_size, lut) + 64},
                              x.options().dtype(at::kByte));
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(work.data_ptr()) + 63) & ~uintptr_t(63));
  qlinear_x86::Acts a{};
  const at::Tensor xr = qlinear_rotation::staged_input(x, perm, rot_signs, rot_paley, rot_block);
  qlinear_x86::prepare_acts(xr.data_ptr<float>(), (int)M, (int)K, (int)group_size, lut, aligned, &a);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, Nb, 4, [&](int64_t b0, int64_t b1) { qlinear_x86::run(w, a, b, out, (int)b0, (int)b1, (int)path); });
  return y;
}

// Ŵ [N, K] float32 from the same buffers as x86_gemm (qgemm.h's dequantize): the backward pass's weight.
at::Tensor x86_dequantize(const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                          const std::optional<at::Tensor>& qb, int64_t N, int64_t K, int64_t group_size, int64_t bits,
                          int64_t format) {
  int8_t table[16] = {};
  const qlinear_x86::Weights w = weights_of("x86_dequantize", qw, qs, qz, qb, N, K, group_size, bits, format, table);
  at::Tensor out = at::empty({N, K}, qs.options().dtype(at::kFloat));
  at::parallel_for(0, (N + 15) / 16, 4, [&](int64_t b0, int64_t b1) {
    qlinear_x86::dequantize(w, out.data_ptr<float>(), (int)b0, (int)b1);
  });
  return out;
}

}  // namespace

#ifdef QLINEAR_X86_SIMDE  // the tests' build with every path through SIMDe: its own op, qlinear_x86_simde::x86_gemm
TORCH_LIBRARY(qlinear_x86_simde, m) {
  m.def("x86_gemm", &x86_gemm);
  m.def("x86_dequantize", &x86_dequantize);
}
#else
TORCH_LIBRARY_IMPL(qlinear, CPU, m) {
  m.impl("x86_gemm", &x86_gemm);
  m.impl("x86_dequantize", &x86_dequantize);
}
#endif
