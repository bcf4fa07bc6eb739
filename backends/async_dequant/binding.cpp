// Torch binding of the mixed 2/4/16 GEMV and dequantize kernels: CUDA implementations of qlinear::mixed_gemv,
// qlinear::mixed_dequantize and qlinear::mixed_dequantize_canonical, whose schemas and fake implementations are
// declared in qlinear/ops.py (one file holds the whole op surface).  M > 8 runs the same GEMV over chunks of 8 rows of x.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../_cuda/binding.h"
#include "mixed_gemv.h"

namespace {
// Checks the CSR outliers of N rows on `device` (none where the values are absent or empty) and fills their fields of
// `a` (MixedGemvArgs or MixedCanonicalArgs).
template <typename Args>
void outliers_of(const std::optional<at::Tensor>& outlier_values, const std::optional<at::Tensor>& outlier_cols,
                 const std::optional<at::Tensor>& outlier_row_ptr, int64_t N, const at::Device& device, Args& a,
                 const char* op) {
  if (outlier_values.has_value() && outlier_values->numel() > 0) {
    TORCH_CHECK(outlier_cols.has_value() && outlier_row_ptr.has_value(), op, ": outliers need cols and row_ptr");
    TORCH_CHECK(outlier_values->scalar_type() == at::kHalf && outlier_values->is_contiguous() &&
                    outlier_values->device() == device, op, ": outlier values must be contiguous fp16");
    TORCH_CHECK((outlier_cols->scalar_type() == at::kShort || outlier_cols->scalar_type() == at::kInt) &&
                    outlier_cols->is_contiguous() && outlier_cols->numel() == outlier_values->numel() &&
                    outlier_cols->device() == device, op, ": outlier cols must be contiguous int16/int32 [nnz]");
    TORCH_CHECK(outlier_row_ptr->scalar_type() == at::kInt && outlier_row_ptr->numel() == N + 1 &&
                    outlier_row_ptr->is_contiguous() && outlier_row_ptr->device() == device,
                op, ": outlier row_ptr must be contiguous int32 [N + 1]");
    a.outlier_values = outlier_values->data_ptr();
    a.outlier_cols = outlier_cols->data_ptr();
    a.outlier_row_ptr = outlier_row_ptr->data_ptr<int>();
    a.cols_int32 = outlier_cols->scalar_type() == at::kInt;
  }
}

// Checks the layout's buffers and the outliers for N rows and K inputs on `device` and fills their fields of `a`; the
// op name goes into the errors.
void weights_of(const at::Tensor& codes, const at::Tensor& meta, const at::Tensor& sq, const at::Tensor& tab,
                const std::optional<at::Tensor>& outlier_values, const std::optional<at::Tensor>& outlier_cols,
                const std::optional<at::Tensor>& outlier_row_ptr, int64_t N, int64_t K, int64_t group_size,
                int64_t scale_bits, int64_t scale_group_size, const at::Device& device, qlinear::mixed::MixedGemvArgs& a,
                const char* op) {
  for (const at::Tensor* t : {&codes, &meta, &sq, &tab}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device() == device,
                op, ": codes, meta, sq and tab must be contiguous int32 on x's device");
  }
  TORCH_CHECK(K > 0 && group_size > 0 && K % 16 == 0 && group_size % 16 == 0 && K % group_size == 0 && K < (1 << 20),
              op, ": K=", K, " and group_size=", group_size, " do not fit");
  const int64_t G = K / group_size;
  TORCH_CHECK(N >= 1 && codes.numel() % N == 0, op, ": codes hold ", codes.numel(), " words, not N·W");
  const int64_t W = codes.numel() / N, T = (W + 3) / 4;  // code words per row, tiles
  TORCH_CHECK(W >= G * group_size / 16 && W <= G * group_size / 8, op, ": ", W, " words per row do not fit K=", K);
  TORCH_CHECK(meta.dim() == 2 && meta.size(1) == N, op, ": meta must be [MW, N]");
  const int64_t S2 = (N + scale_group_size - 1) / scale_group_size;
  TORCH_CHECK(sq.dim() == 3 && sq.size(0) == T && sq.size(1) == S2 && (sq.size(2) == 1 || sq.size(2) == 2 || sq.size(2) == 4),
              op, ": sq must be [T, S2, P] with P = 1, 2 or 4");
  TORCH_CHECK(tab.numel() == G + W + T, op, ": tab must hold G + W + T = ", G + W + T, " entries");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(codes.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(sq.data_ptr()) % 16 == 0,
              op, ": codes and sq must be 16-byte aligned");
  TORCH_CHECK(N < (1LL << 31) / 8 && N * W < (1LL << 31) && meta.numel() < (1LL << 31) && sq.numel() < (1LL << 31), op,
              ": N out of range (the kernels index codes, meta and sq with 32 bits)");
  a.codes = reinterpret_cast<const unsigned*>(codes.data_ptr<int>());
  a.meta = reinterpret_cast<const unsigned*>(meta.data_ptr<int>());
  a.sq = reinterpret_cast<const unsigned*>(sq.data_ptr<int>());
  a.tab = tab.data_ptr<int>();
  outliers_of(outlier_values, outlier_cols, outlier_row_ptr, N, device, a, op);
  a.N = (int)N; a.K = (int)K; a.W = (int)W; a.G = (int)G; a.MW = (int)meta.size(0); a.S2 = (int)S2; a.P = (int)sq.size(2);
  a.group_size = (int)group_size; a.scale_bits = (int)scale_bits; a.scale_group_size = (int)scale_group_size;
}

at::Tensor mixed_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& meta, const at::Tensor& sq,
                      const at::Tensor& tab, const std::optional<at::Tensor>& outlier_values,
                      const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outlier_row_ptr,
                      const std::optional<at::Tensor>& bias, int64_t N, int64_t group_size, int64_t scale_bits,
                      int64_t scale_group_size, int64_t threads, int64_t tiles_per_split, int64_t splits,
                      bool async_dequant, const std::optional<at::Tensor>& rot_sign_bits, int64_t rot_block,
                      const std::optional<at::Tensor>& rot_paley) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous(), "mixed_gemv: x must be a contiguous CUDA [M, K] tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "mixed_gemv: x must be fp16 or bf16");
  const int64_t M = x.size(0), K = x.size(1);
  c10::cuda::CUDAGuard guard(x.device());
  qlinear::mixed::MixedGemvArgs a{};
  weights_of(codes, meta, sq, tab, outlier_values, outlier_cols, outlier_row_ptr, N, K, group_size, scale_bits,
             scale_group_size, x.device(), a, "mixed_gemv");
  at::Tensor bias_holder;
  a.bias = qlinear::bias_arg(bias, N, x, bias_holder, a.bias_dtype, "mixed_gemv");
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor partial;
  a.threads = (int)threads; a.tiles_per_split = (int)tiles_per_split; a.splits = (int)splits;
  a.async_dequant = async_dequant ? 1 : 0;
  a.x_dtype = x.scalar_type() == at::kHalf ? qlinear::DType::kHalf : qlinear::DType::kBFloat16;
  a.partial = qlinear::split_workspace(splits, std::min<int64_t>(M, 8), N, x, partial);
  qlinear::check_threads(threads, "mixed_gemv");
  TORCH_CHECK(M < 8 || threads <= qlinear::mixed::kMaxThreadsM8, "mixed_gemv: blocks of 8 rows of x take at most ",
              qlinear::mixed::kMaxThreadsM8, " threads, got ", threads, " (async_dequant.plan keeps to it)");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const qlinear::Rotation rot = qlinear::rotation_of(rot_sign_bits, rot_block, rot_paley, K, x, "mixed_gemv");
  const size_t row_bytes = x.element_size();
  for (int64_t m0 = 0; m0 < M; m0 += 8) {  // M > 8: the same kernel over chunks of 8 rows
    a.M = (int)std::min<int64_t>(8, M - m0);
    a.x = static_cast<const char*>(x.data_ptr()) + m0 * K * row_bytes;
    a.y = static_cast<char*>(y.data_ptr()) + m0 * N * row_bytes;
    const cudaError_t err = qlinear::mixed::mixed_gemv(a, rot, stream);
    TORCH_CHECK(err == cudaSuccess, "mixed_gemv launch failed: ", cudaGetErrorString(err));
  }
  return y;
}

at::Tensor mixed_dequantize(const at::Tensor& codes, const at::Tensor& meta, const at::Tensor& sq, const at::Tensor& tab,
                            const std::optional<at::Tensor>& outlier_values,
                            const std::optional<at::Tensor>& outlier_cols,
                            const std::optional<at::Tensor>& outlier_row_ptr, int64_t N, int64_t K, int64_t group_size,
                            int64_t scale_bits, int64_t scale_group_size, at::ScalarType dtype) {
  TORCH_CHECK(codes.is_cuda(), "mixed_dequantize: the buffers must be on a CUDA device");
  c10::cuda::CUDAGuard guard(codes.device());
  qlinear::mixed::MixedGemvArgs a{};
  weights_of(codes, meta, sq, tab, outlier_values, outlier_cols, outlier_row_ptr, N, K, group_size, scale_bits,
             scale_group_size, codes.device(), a, "mixed_dequantize");
  TORCH_CHECK(K / group_size <= 65535, "mixed_dequantize: ", K / group_size, " groups per row (K=", K, ", group_size=",
              group_size, ") are more than its grid takes (65535): use a larger group size");
  at::Tensor w = at::empty({N, K}, codes.options().dtype(dtype));
  a.y = w.data_ptr();
  const cudaError_t err = qlinear::mixed::mixed_dequantize(a, qlinear::dtype_of(dtype, "mixed_dequantize"),
                                                           c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "mixed_dequantize launch failed: ", cudaGetErrorString(err));
  return w;
}

at::Tensor mixed_dequantize_canonical(const at::Tensor& idx4, const at::Tensor& qweight2, const at::Tensor& qweight4,
                                      const at::Tensor& zeros2, const at::Tensor& zeros4, const at::Tensor& scale_codes,
                                      const at::Tensor& scale_scale, const at::Tensor& scale_zero,
                                      const std::optional<at::Tensor>& outlier_values,
                                      const std::optional<at::Tensor>& outlier_cols,
                                      const std::optional<at::Tensor>& outlier_row_ptr, int64_t N, int64_t K,
                                      int64_t group_size, int64_t scale_bits, int64_t scale_group_size,
                                      at::ScalarType dtype) {
  const char* op = "mixed_dequantize_canonical";
  TORCH_CHECK(idx4.is_cuda(), op, ": the buffers must be on a CUDA device");
  TORCH_CHECK(N >= 1 && K >= 1 && group_size >= 1 && K % group_size == 0 && scale_bits >= 1 && scale_bits <= 16 &&
                  scale_group_size >= 1, op, ": N=", N, ", K=", K, ", group_size=", group_size, ", scale_bits=",
              scale_bits, " and scale_group_size=", scale_group_size, " do not fit");
  TORCH_CHECK((N * K + 31) / 32 < (int64_t(1) << 31), op, ": N·K/32 must be below 2^31, got N = ", N, ", K = ", K);
  const int64_t G = K / group_size, G4 = idx4.numel(), S2 = (N + scale_group_size - 1) / scale_group_size;
  TORCH_CHECK(G4 <= G, op, ": idx4 lists ", G4, " groups of ", G);
  const auto words = [](int64_t n, int64_t bits) { return (n * bits + 31) / 32; };
  const std::pair<const at::Tensor*, std::vector<int64_t>> ints[] = {
      {&idx4, {G4}}, {&qweight2, {N, words((G - G4) * group_size, 2)}}, {&qweight4, {N, words(G4 * group_size, 4)}},
      {&zeros2, {N, words(G - G4, 2)}}, {&zeros4, {N, words(G4, 4)}}, {&scale_codes, {G, words(N, scale_bits)}}};
  for (const auto& [t, shape] : ints)
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device() == idx4.device() &&
                    t->sizes() == at::IntArrayRef(shape), op, ": int32 buffer of shape ", t->sizes(), " on ",
                t->device(), " where ", at::IntArrayRef(shape), " on ", idx4.device(), " fits");
  for (const at::Tensor* t : {&scale_scale, &scale_zero})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->device() == idx4.device() &&
                    t->sizes() == at::IntArrayRef({G, S2}), op, ": scale_scale and scale_zero must be contiguous fp16 [",
                G, ", ", S2, "]");
  c10::cuda::CUDAGuard guard(idx4.device());
  qlinear::mixed::MixedCanonicalArgs a{};
  outliers_of(outlier_values, outlier_cols, outlier_row_ptr, N, idx4.device(), a, op);
  const auto u32 = [](const at::Tensor& t) { return reinterpret_cast<const unsigned*>(t.data_ptr<int>()); };
  a.idx4 = idx4.data_ptr<int>();
  a.q2 = u32(qweight2); a.q4 = u32(qweight4); a.z2 = u32(zeros2); a.z4 = u32(zeros4); a.scale_codes = u32(scale_codes);
  a.scale_scale = scale_scale.data_ptr(); a.scale_zero = scale_zero.data_ptr();
  a.N = (int)N; a.K = (int)K; a.group_size = (int)group_size; a.G4 = (int)G4; a.scale_bits = (int)scale_bits;
  a.scale_group_size = (int)scale_group_size; a.S2 = (int)S2;
  a.w2 = (int)qweight2.size(1); a.w4 = (int)qweight4.size(1); a.zw2 = (int)zeros2.size(1); a.zw4 = (int)zeros4.size(1);
  a.sw = (int)scale_codes.size(1);
  at::Tensor w = at::empty({N, K}, idx4.options().dtype(dtype));
  a.w = w.data_ptr();
  const cudaError_t err = qlinear::mixed::mixed_dequantize_canonical(a, qlinear::dtype_of(dtype, op),
                                                                     c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, " launch failed: ", cudaGetErrorString(err));
  return w;
}

}  // namespace

TORCH_LIBRARY_IMPL(qlinear, CUDA, m) {
  m.impl("mixed_gemv", &mixed_gemv);
  m.impl("mixed_dequantize", &mixed_dequantize);
  m.impl("mixed_dequantize_canonical", &mixed_dequantize_canonical);
}
