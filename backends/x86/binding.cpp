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

// format kUniform: qw = codes uint8 [Nb, K·bits/32, 64] (bits 4: nibbles, 8: bytes); kLutUniform / kLutFree: qw =
// bit-planes uint8 [Nb, K/32, bits, 64]; uniform: qs = scales fp16 [Nb, G, 16], qz = 2·zero uint8 [Nb, G, 16] (int16
// at 8 bits: 2·zero up to 510); kLutFree: qs = α fp16 [Nb, G, bits, 16],
// qz = offsets fp16 [Nb, G, 16] (qgemm.h).  rot_block > 0: a rotated layer, x is first transformed by its randomized
// Hadamard (rot_signs = D/√b float32 [K], blocks of rot_block, Paley factor rot_paley float32 [f, f] as
// backends/_cpu.py paley_argument gives it, or none; _shared/rotation.h).
// perm (int32 [K]): an act_order layer, x is read as x[:, perm] (after the rotation).
// kCB4 / kCB2: qw = codes (kCB4 as kUniform; kCB2 crumbs uint8 [Nb, K/16, 64]), qs = scales fp16 [Nb, G, 16], qz = the
// codebooks int8 [C, 2^bits] (C·2^bits <= 16), qb = book words int32 [Nb, G] when C > 1.
// The weights of a layer in qgemm.h's layouts, checked (shapes, dtypes, format and bits); `table` receives the
// codebook formats' centroids.
qlinear_x86::Weights weights_of(const char* op, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                                const std::optional<at::Tensor>& qb, int64_t N, int64_t K, int64_t group_size,
                                int64_t bits, int64_t format, int8_t* table) {
  const int64_t Nb = (N + 15) / 16;
  TORCH_CHECK(K > 0 && K % 32 == 0 && group_size > 0 && group_size % 32 == 0,
              op, ": K and group_size must be positive multiples of 32");
  TORCH_CHECK(format >= qlinear_x86::kUniform && format <= qlinear_x86::kCB2, op, ": unknown format ", format);
  const bool u8 = format == qlinear_x86::kUniform && bits == 8;
  TORCH_CHECK(format == qlinear_x86::kUniform ? bits == 4 || u8 : bits >= 1 && bits <= 4, op, ": bits ", bits,
              " not in 1..4 (4 or 8 for format 0)");
  const int64_t G = (K + group_size - 1) / group_size;
  const bool codebook = format >= qlinear_x86::kCB4;
  const bool lut = !codebook && format != qlinear_x86::kUniform, free_alpha = format == qlinear_x86::kLutFree;
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
    TORCH_CHECK(qw.scalar_type() == at::kByte && qw.is_contiguous() && qw.numel() == Nb * (K * bits / 32) * 64,
                op, ": qw must be contiguous uint8 [", Nb, ", ", K * bits / 32, ", 64]");
  }
  if (!codebook) {
    TORCH_CHECK(qs.scalar_type() == at::kHalf && qs.is_contiguous() && qs.numel() == Nb * G * (free_alpha ? bits : 1) * 16,
                op, ": qs must be contiguous fp16 [", Nb, ", ", G, free_alpha ? ", " + std::to_string(bits) : "",
                ", 16]");
    TORCH_CHECK(qz.scalar_type() == (free_alpha ? at::kHalf : u8 ? at::kShort : at::kByte) && qz.is_contiguous() &&
                    qz.numel() == Nb * G * 16,
                op, ": qz must be contiguous ", free_alpha ? "fp16" : u8 ? "int16" : "uint8", " [", Nb, ", ", G, ", 16]");
  }
  return qlinear_x86::Weights{qw.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(qs.data_ptr<at::Half>()),
                              free_alpha || codebook || u8 ? nullptr : qz.data_ptr<uint8_t>(), (int)N, (int)K,
                              (int)group_size, (int)format, (int)bits,
                              free_alpha ? reinterpret_cast<const uint16_t*>(qz.data_ptr<at::Half>()) : nullptr,
                              table, books,
                              u8 ? reinterpret_cast<const uint16_t*>(qz.data_ptr<int16_t>()) : nullptr};
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
  const qlinear_rotation::Staged s = qlinear_rotation::stage(
      x, perm, rot_signs, rot_paley, rot_block, qlinear_x86::acts_bytes((int)M, (int)K, (int)group_size, lut), 64);
  qlinear_x86::Acts a{};
  qlinear_x86::prepare_acts(s.x, (int)M, (int)K, (int)group_size, lut, s.acts, &a);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, Nb, 4, [&](int64_t b0, int64_t b1) { qlinear_x86::run(w, a, b, out, (int)b0, (int)b1, (int)path); });
  return y;
}

// Ŵ's element type: float32 (dtype None) or bfloat16.
bool bf16_out(const char* op, const std::optional<at::ScalarType>& dtype) {
  TORCH_CHECK(!dtype.has_value() || *dtype == at::kFloat || *dtype == at::kBFloat16, op,
              ": dtype must be torch.float32 or torch.bfloat16, got ", *dtype);
  return dtype.has_value() && *dtype == at::kBFloat16;
}

// Ŵ [N, K] float32 or bfloat16 from the same buffers as x86_gemm (qgemm.h's dequantize): the backward pass's weight
// and the batched path's tiles.
at::Tensor x86_dequantize(const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                          const std::optional<at::Tensor>& qb, int64_t N, int64_t K, int64_t group_size, int64_t bits,
                          int64_t format, const std::optional<at::ScalarType>& dtype) {
  int8_t table[16] = {};
  const qlinear_x86::Weights w = weights_of("x86_dequantize", qw, qs, qz, qb, N, K, group_size, bits, format, table);
  const bool bf16 = bf16_out("x86_dequantize", dtype);
  at::Tensor out = at::empty({N, K}, qs.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, (N + 15) / 16, 4, [&](int64_t b0, int64_t b1) {
    qlinear_x86::dequantize(w, out.data_ptr(), (int)b0, (int)b1, bf16);
  });
  return out;
}

// The mixed format (qgemm.h, MixedWeights: layout x86_mixed, 16-row blocks); ov/oc/orp the CSR outliers (fp16
// values, int16 or int32 columns, int32 row pointers) or none.  The buffers of a layer with K inputs, checked, and the
// float32 outlier values and int32 columns w points into.
struct MixedBuffers {
  qlinear_x86::MixedWeights w{};
  at::Tensor ov32, oc32;
  int64_t blocks = 0;
};

MixedBuffers mixed_weights_of(const char* op, const at::Tensor& q2, const at::Tensor& q4, const at::Tensor& sc,
                              const at::Tensor& z, const at::Tensor& ss, const at::Tensor& sz, const at::Tensor& kinds,
                              const std::optional<at::Tensor>& ov, const std::optional<at::Tensor>& oc,
                              const std::optional<at::Tensor>& orp, int64_t N, int64_t K, int64_t g,
                              int64_t scale_bits, int64_t scale_group_size) {
  TORCH_CHECK(N > 0 && N < (1 << 30) && g > 0 && g % 16 == 0 && K > 0 && K < (1 << 30) && K % g == 0, op,
              ": N and K must be positive (below 2^30) and group_size a multiple of 16 dividing K");
  TORCH_CHECK(scale_bits == 2 || scale_bits == 4 || scale_bits == 8, op, ": scale_bits must be 2, 4 or 8");
  TORCH_CHECK(scale_group_size > 0, op, ": scale_group_size must be positive");
  const int64_t Nb = (N + 15) / 16, G = K / g;
  TORCH_CHECK(q2.dim() == 3 && q4.dim() == 3, op, ": q2 and q4 must be [ceil(N/16), words, 16]");
  const int64_t G2 = q2.size(1) * 16 / g, G4 = q4.size(1) * 8 / g, S2 = ss.size(0);
  TORCH_CHECK(G2 + G4 == G && q2.size(1) == G2 * g / 16 && q4.size(1) == G4 * g / 8, op,
              ": q2 and q4 must hold K/group_size groups together");
  auto words = [&](const at::Tensor& t, int64_t cols, int64_t lanes, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.numel() == Nb * cols * lanes && t.size(0) == Nb,
                op, ": ", name, " must be contiguous int32 [", Nb, ", ", cols, lanes > 1 ? ", 16]" : "]");
    return reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>());
  };
  TORCH_CHECK(ss.scalar_type() == at::kHalf && sz.scalar_type() == at::kHalf && ss.is_contiguous() &&
                  sz.is_contiguous() && ss.sizes() == sz.sizes() && ss.dim() == 2 && ss.size(1) == G &&
                  S2 == (N + scale_group_size - 1) / scale_group_size,
              op, ": ss and sz must be contiguous fp16 [ceil(N / scale_group_size), K / group_size]");
  TORCH_CHECK(kinds.scalar_type() == at::kInt && kinds.is_contiguous() && kinds.numel() == (G + 31) / 32,
              op, ": kinds must be contiguous int32 [ceil(G / 32)]");
  MixedBuffers b;
  qlinear_x86::MixedWeights& w = b.w;
  w.N = (int)N; w.group_size = (int)g; w.G2 = (int)G2; w.G4 = (int)G4;
  // a chunk of N rows or more is one chunk (S2 = 1): the clamp keeps the int exact
  w.scale_bits = (int)scale_bits; w.scale_group_size = (int)std::min(scale_group_size, N);
  w.q2 = words(q2, q2.size(1), 16, "q2"); w.q4 = words(q4, q4.size(1), 16, "q4");
  w.sc = words(sc, G * scale_bits / 2, 1, "sc"); w.z = words(z, G2 + 2 * G4, 1, "z");
  w.ss = reinterpret_cast<const uint16_t*>(ss.data_ptr<at::Half>());
  w.sz = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::Half>());
  w.kinds = reinterpret_cast<const uint32_t*>(kinds.data_ptr<int32_t>());
  int64_t n4 = 0;
  for (int64_t i = 0; i < G; ++i) n4 += (w.kinds[i / 32] >> (i % 32)) & 1u;
  TORCH_CHECK(n4 == G4, op, ": kinds marks ", n4, " 4-bit groups, q4 holds ", G4);
  if (ov.has_value()) {
    TORCH_CHECK(oc.has_value() && orp.has_value() && orp->scalar_type() == at::kInt && orp->is_contiguous() &&
                    orp->numel() == N + 1 && oc->numel() == ov->numel(),
                op, ": the outliers need values, columns and int32 row pointers [N + 1]");
    b.ov32 = ov->to(at::kFloat).contiguous();
    b.oc32 = oc->to(at::kInt).contiguous();
    w.ov = b.ov32.data_ptr<float>(); w.oc = b.oc32.data_ptr<int32_t>(); w.orp = orp->data_ptr<int32_t>();
    // every call (the op may be handed any buffers): branch-free, so that the loops vectorize
    bool rows_ok = w.orp[0] == 0 && w.orp[N] == ov->numel(), cols_ok = true;
    for (int64_t n = 0; n < N; ++n) rows_ok &= w.orp[n] <= w.orp[n + 1];
    for (int64_t i = 0; i < ov->numel(); ++i) cols_ok &= (uint32_t)w.oc[i] < (uint32_t)K;
    TORCH_CHECK(rows_ok, op, ": outlier row pointers must rise from 0 to the number of outliers");
    TORCH_CHECK(cols_ok, op, ": outlier columns must lie in [0, K)");
  }
  b.blocks = Nb;
  return b;
}

// y = x·Ŵᵀ (+ bias) for the mixed format (x transformed first for a rotated layer), int8 activations per 16 inputs.
at::Tensor x86_mixed_gemm(const at::Tensor& x, const at::Tensor& q2, const at::Tensor& q4, const at::Tensor& sc,
                          const at::Tensor& z, const at::Tensor& ss, const at::Tensor& sz, const at::Tensor& kinds,
                          const std::optional<at::Tensor>& ov, const std::optional<at::Tensor>& oc,
                          const std::optional<at::Tensor>& orp, const std::optional<at::Tensor>& bias, int64_t N,
                          int64_t group_size, int64_t scale_bits, int64_t scale_group_size, int64_t path,
                          const std::optional<at::Tensor>& rot_signs, const std::optional<at::Tensor>& rot_paley,
                          int64_t rot_block) {
  const char* op = "x86_mixed_gemm";
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              op, ": x must be a contiguous float32 CPU [M, K] tensor");
  TORCH_CHECK(path == qlinear_x86::kAuto || qlinear_x86::mixed_path_supported((int)path),
              op, ": this CPU cannot run path ", path, " for the mixed format");
  const int64_t M = x.size(0), K = x.size(1);
  const MixedBuffers mb = mixed_weights_of(op, q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, N, K, group_size,
                                           scale_bits, scale_group_size);
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, op, ": bias must have N elements");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const qlinear_rotation::Staged s = qlinear_rotation::stage(x, std::nullopt, rot_signs, rot_paley, rot_block,
                                                             qlinear_x86::mixed_acts_bytes((int)M, (int)K), 64);
  qlinear_x86::MixedActs acts;
  qlinear_x86::mixed_prepare_acts(s.x, (int)M, (int)K, s.acts, &acts);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  at::parallel_for(0, mb.blocks, 2, [&](int64_t b0, int64_t b1) {
    qlinear_x86::mixed_run(mb.w, acts, b, y.data_ptr<float>(), (int)b0, (int)b1, (int)path);
  });
  return y;
}

// Rows [16·b0, min(16·b1, N)) of Ŵ (b1 < 0: to the end) float32 or bfloat16 of the mixed format from the same buffers (qgemm.h's
// mixed_dequantize).
at::Tensor x86_mixed_dequantize(const at::Tensor& q2, const at::Tensor& q4, const at::Tensor& sc, const at::Tensor& z,
                                const at::Tensor& ss, const at::Tensor& sz, const at::Tensor& kinds,
                                const std::optional<at::Tensor>& ov, const std::optional<at::Tensor>& oc,
                                const std::optional<at::Tensor>& orp, int64_t N, int64_t K, int64_t group_size,
                                int64_t scale_bits, int64_t scale_group_size, int64_t path, int64_t b0, int64_t b1,
                                const std::optional<at::ScalarType>& dtype) {
  const char* op = "x86_mixed_dequantize";
  const MixedBuffers mb = mixed_weights_of(op, q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, N, K, group_size,
                                           scale_bits, scale_group_size);
  TORCH_CHECK(path == qlinear_x86::kAuto || path == qlinear_x86::kScalar ||
                  ((path == qlinear_x86::kAVX2 || path == qlinear_x86::kAVX512VNNI) &&
                   qlinear_x86::mixed_path_supported((int)path)),
              op, ": this CPU cannot run path ", path, " (auto, scalar, AVX2 or AVX-512)");
  if (b1 < 0 || b1 > mb.blocks) b1 = mb.blocks;
  TORCH_CHECK(b0 >= 0 && b0 < b1, op, ": empty block range [", b0, ", ", b1, ")");
  const int64_t row0 = 16 * b0, rows = std::min<int64_t>(16 * b1, N) - row0;
  const bool bf16 = bf16_out(op, dtype);
  at::Tensor out = at::empty({rows, K}, ss.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(b0, b1, 2, [&](int64_t lo, int64_t hi) {
    qlinear_x86::mixed_dequantize(mb.w, out.data_ptr(), (int)lo, (int)hi, (int)path, (int)row0, bf16);
  });
  return out;
}

// The batched path on AMX (amx.cpp): x bfloat16 [M, K] (rotated and gathered already) times the layer's Ŵ rounded
// to bfloat16, one 16-row block at a time, + bias -> y [M, N] bfloat16 (float32 sums, rounded once).
at::Tensor amx_packed(const char* op, const at::Tensor& x) {  // [ceil(M/16), K/2, 16, 2]: TDPBF16PS's B operand
  TORCH_CHECK(qlinear_x86::amx_supported(), op, ": this CPU (or OS) does not run AMX bfloat16 tiles");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 32 == 0, op,
              ": x must be a bfloat16 CPU [M, K] tensor with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), G = (M + 15) / 16;
  const at::Tensor xc = x.contiguous();
  at::Tensor p = at::empty({G, K / 2, 16, 2}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  auto* xp = reinterpret_cast<uint16_t*>(p.data_ptr());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) { qlinear_x86::amx_pack(xs, (int)M, (int)K, xp, (int)g0, (int)g1); });
  return p;
}

at::Tensor amx_run(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t N,
                   int64_t blocks, void (*dequant)(const void*, int, uint16_t*), const void* weights,
                   const at::Tensor& xp) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == N, op, ": bias must be a CPU [N] tensor");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());  // bfloat16, as x
  const auto* xb = reinterpret_cast<const uint16_t*>(xp.data_ptr());
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    qlinear_x86::amx_gemm((int)N, (int)K, (int)M, xb, bias ? b.data_ptr<float>() : nullptr,
                          reinterpret_cast<uint16_t*>(y.data_ptr()), (int)b0, (int)b1, dequant, weights);
  });
  return y;
}

// The batched path's input: x (contiguous float32 or bfloat16 CPU [M, K]) transformed as x86_gemm transforms it
// before its int8 quantization (rotated in float32, then gathered by perm), [M, K] of x's dtype.
at::Tensor x86_rotate(const at::Tensor& x, const std::optional<at::Tensor>& rot_signs,
                      const std::optional<at::Tensor>& rot_paley, int64_t rot_block,
                      const std::optional<at::Tensor>& perm) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "x86_rotate: x must be a contiguous float32 or bfloat16 CPU [M, K] tensor");
  return qlinear_rotation::staged_tensor(x, perm, rot_signs, rot_paley, rot_block);
}

// Whether amx.cpp runs here (Python: x86.amx_available).
bool x86_amx_supported() { return qlinear_x86::amx_supported(); }

// The path kAuto takes for a layout format here (cpuid; Python: x86's batch thresholds).
int64_t x86_best_path(int64_t format) { return qlinear_x86::best_path((int)format); }

at::Tensor x86_amx_gemm(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qz,
                        const std::optional<at::Tensor>& qb, const std::optional<at::Tensor>& bias, int64_t N,
                        int64_t group_size, int64_t bits, int64_t format) {
  const at::Tensor xp = amx_packed("x86_amx_gemm", x);
  int8_t table[16] = {};
  const qlinear_x86::Weights w = weights_of("x86_amx_gemm", qw, qs, qz, qb, N, x.size(1), group_size, bits, format,
                                            table);
  const auto dequant = [](const void* w, int b, uint16_t* buf) {
    qlinear_x86::dequantize(*static_cast<const qlinear_x86::Weights*>(w), buf, b, b + 1, true, 16 * b);
  };
  return amx_run("x86_amx_gemm", x, bias, N, (N + 15) / 16, dequant, &w, xp);
}

at::Tensor x86_mixed_amx_gemm(const at::Tensor& x, const at::Tensor& q2, const at::Tensor& q4, const at::Tensor& sc,
                              const at::Tensor& z, const at::Tensor& ss, const at::Tensor& sz, const at::Tensor& kinds,
                              const std::optional<at::Tensor>& ov, const std::optional<at::Tensor>& oc,
                              const std::optional<at::Tensor>& orp, const std::optional<at::Tensor>& bias, int64_t N,
                              int64_t group_size, int64_t scale_bits, int64_t scale_group_size) {
  const char* op = "x86_mixed_amx_gemm";
  const at::Tensor xp = amx_packed(op, x);
  const MixedBuffers mb = mixed_weights_of(op, q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, N, x.size(1), group_size,
                                           scale_bits, scale_group_size);
  const auto dequant = [](const void* w, int b, uint16_t* buf) {
    qlinear_x86::mixed_dequantize(*static_cast<const qlinear_x86::MixedWeights*>(w), buf, b, b + 1,
                                  qlinear_x86::kAuto, 16 * b, true);
  };
  return amx_run(op, x, bias, N, mb.blocks, dequant, &mb.w, xp);
}

}  // namespace

#ifdef QLINEAR_X86_SIMDE  // the tests' build with every path through SIMDe: its own op, qlinear_x86_simde::x86_gemm
TORCH_LIBRARY(qlinear_x86_simde, m) {
  m.def("x86_gemm", &x86_gemm);
  m.def("x86_dequantize", &x86_dequantize);
  m.def("x86_mixed_gemm", &x86_mixed_gemm);
  m.def("x86_mixed_dequantize", &x86_mixed_dequantize);
}
#else
TORCH_LIBRARY_IMPL(qlinear, CPU, m) {
  m.impl("x86_gemm", &x86_gemm);
  m.impl("x86_dequantize", &x86_dequantize);
  m.impl("x86_mixed_gemm", &x86_mixed_gemm);
  m.impl("x86_mixed_dequantize", &x86_mixed_dequantize);
  m.impl("x86_amx_gemm", &x86_amx_gemm);
  m.impl("x86_mixed_amx_gemm", &x86_mixed_amx_gemm);
  m.impl("x86_rotate", &x86_rotate);
}
TORCH_LIBRARY_IMPL(qlinear, CompositeExplicitAutograd, m) {  // no tensor arguments: no backend to dispatch on
  m.impl("x86_amx_supported", &x86_amx_supported);
  m.impl("x86_best_path", &x86_best_path);
}
#endif
