// The codebook format's GPU decode paths (issue 24): its decoder for the canonical GEMV (../_cuda/canonical.cuh) at
// decode batches, and a dequantize kernel writing Ŵ for one cuBLAS GEMM above.
//
// Dequantize: a thread owns one row's 32 consecutive inputs: it reads `bits` code words (consecutive threads read
// consecutive words of a row, so the loads coalesce), looks each input's centroid up in its group's codebook and
// multiplies by the group's scale in fp32 (fp16 scale × int8 centroid: exact) and rounds once to the output type.  All
// codebooks of a layer fit 16 bytes (the format's rule), so a thread holds them in 4 registers and a centroid is two
// byte permutes and a select; the scale and the book come once per 16 inputs (group sizes are multiples of 16) instead
// of once per input.  The outputs leave through store_runs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/canonical.cuh"
#include "codebook_dequant.h"

namespace qlinear {
namespace {

// Byte e (0..15) of the 16-byte table t, sign-extended: the int8 centroid at index book·2^bits + code.
__device__ __forceinline__ int table_byte(const unsigned (&t)[4], unsigned e) {
  const unsigned lo = __byte_perm(t[0], t[1], e & 7u), hi = __byte_perm(t[2], t[3], e & 7u);
  return (int)(signed char)(e & 8u ? hi : lo);
}

// A group's scale (fp32) and book · 2^bits (the centroid index's high part): g of the row whose scales and book_idx
// words start at `scales` and `books`.
template <int BITS>
__device__ __forceinline__ void group_of(const CodebookArgs& a, const __half* scales, const unsigned* books, int g,
                                         float& scale, unsigned& book) {
  scale = __half2float(__ldg(scales + g));
  book = 0;
  if (a.books > 1) {
    const int book_bits = a.books == 4 ? 2 : 1;
    book = ((__ldg(books + g * book_bits / 32) >> (g * book_bits % 32)) & (a.books - 1u)) << BITS;
  }
}

// PER16: group_size is a multiple of 16, so the scale and book are read once per 16 inputs, else once per input.
template <typename OutT, int BITS, bool PER16>
__global__ void __launch_bounds__(256, 2) codebook_dequantize_kernel(const CodebookArgs a) {
  const unsigned chunks = a.K / 32, total = (unsigned)a.N * chunks;  // < 2^31: checked by the launcher
  const unsigned t0 = blockIdx.x * blockDim.x, t = t0 + threadIdx.x;
  Run32<OutT> out;
  if (t < total) {  // no early exit: every thread reaches store_runs' barrier
    const int n = (int)(t / chunks), c = (int)(t % chunks);
    unsigned words[BITS];
#pragma unroll
    for (int i = 0; i < BITS; ++i) words[i] = __ldg(a.codes + (size_t)n * a.code_words + c * BITS + i);
    unsigned table[4] = {0u, 0u, 0u, 0u};  // the codebooks, [book][code] int8, zero past their books·2^bits bytes
    const int entries = a.books << BITS;
    if (entries % 4 == 0 && (reinterpret_cast<size_t>(a.codebooks) & 3u) == 0) {  // whole words: 4 loads, not 16
#pragma unroll
      for (int i = 0; i < 4; ++i)  // unrolled: table stays in registers
        if (4 * i < entries) table[i] = __ldg(reinterpret_cast<const unsigned*>(a.codebooks) + i);
    } else {
#pragma unroll
      for (int e = 0; e < 16; ++e)
        if (e < entries) table[e / 4] |= (unsigned)(unsigned char)__ldg(a.codebooks + e) << (8 * (e % 4));
    }
    const __half* scales = static_cast<const __half*>(a.scales) + (size_t)n * (a.K / a.group_size);
    const unsigned* books = a.book_idx + (size_t)n * a.book_words;
    float scale[2];
    unsigned book[2];
    if (PER16) {
#pragma unroll
      for (int h = 0; h < 2; ++h) group_of<BITS>(a, scales, books, (c * 32 + 16 * h) / a.group_size, scale[h], book[h]);
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const unsigned code = (words[j * BITS / 32] >> (j * BITS % 32)) & ((1u << BITS) - 1u);
      if (!PER16) group_of<BITS>(a, scales, books, (c * 32 + j) / a.group_size, scale[j / 16], book[j / 16]);
      out.v[j] = from_float<OutT>(scale[j / 16] * (float)table_byte(table, book[j / 16] | code));
    }
  }
  store_runs(out, t0, total, static_cast<OutT*>(a.w));
}

// The GEMV's decoder (canonical.cuh): each input's centroid comes from a 16-float table in shared memory (all of a
// layer's codebooks, the format's 16-byte limit); Σ_j c_j·x_j over the 8 inputs in fp32 (each product exact: an int8
// centroid times an fp16/bf16 input), times the group's scale, accumulated.
template <int BITS>
struct CodebookGemvDecoder {
  using Args = CodebookArgs;
  static constexpr int kWords = BITS, kTableFloats = 16;  // table[book·2^bits + code], 0 past the books
  struct Row {
    int scales, books;  // where the row's scales and book_idx words start (32-bit offsets: fewer registers held)
  };
  const CodebookArgs& a;
  const float* table;

  __device__ CodebookGemvDecoder(const CodebookArgs& a, float* smem) : a(a), table(smem) {
    if (threadIdx.x < 16) smem[threadIdx.x] = (int)threadIdx.x < (a.books << BITS) ? (float)a.codebooks[threadIdx.x] : 0.f;
  }

  __device__ Row row(int n) const {
    return {n * (a.K / a.group_size), n * a.book_words};  // < 2^31: N·K < 2^34 (codebook_gemv)
  }

  template <int MT>
  __device__ __forceinline__ void dot8(const Row& row, const unsigned (&words)[BITS], int s, int g,
                                       const float (&xv)[MT][8], float (&acc)[MT]) const {
    float scale;
    unsigned book;
    group_of<BITS>(a, static_cast<const __half*>(a.scales) + row.scales, a.book_idx + row.books, g, scale, book);
    float part[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) part[m] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // the centroid's byte offset in the table straight from the code word's bits:
      const int e = 8 * s + j, at = e * BITS % 32;  // one shift and one LOP3, no index scaling (SASS, sm_90a)
      const unsigned w = words[e * BITS / 32], off = (at >= 2 ? w >> (at - 2) : w << (2 - at));
      const float cj = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(table) +
                                                        ((off & (((1u << BITS) - 1u) << 2)) | (book << 2)));
#pragma unroll
      for (int m = 0; m < MT; ++m) part[m] = fmaf(cj, xv[m][j], part[m]);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = fmaf(scale, part[m], acc[m]);
  }
};

template <typename OutT>
cudaError_t dispatch_bits(const CodebookArgs& a, cudaStream_t s) {
  const long long threads = (long long)a.N * (a.K / 32);
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  const size_t smem = canonical_dequantize_smem_bytes(sizeof(OutT));
  const bool per16 = a.group_size % 16 == 0;
  switch (a.bits * 2 + per16) {
    case 2: codebook_dequantize_kernel<OutT, 1, false><<<blocks, 256, smem, s>>>(a); break;
    case 3: codebook_dequantize_kernel<OutT, 1, true><<<blocks, 256, smem, s>>>(a); break;
    case 4: codebook_dequantize_kernel<OutT, 2, false><<<blocks, 256, smem, s>>>(a); break;
    case 5: codebook_dequantize_kernel<OutT, 2, true><<<blocks, 256, smem, s>>>(a); break;
    case 8: codebook_dequantize_kernel<OutT, 4, false><<<blocks, 256, smem, s>>>(a); break;
    case 9: codebook_dequantize_kernel<OutT, 4, true><<<blocks, 256, smem, s>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// The weights' rules both kernels share.
bool weights_invalid(const CodebookArgs& a) {
  return a.K % 32 || a.group_size <= 0 || a.K % a.group_size || (a.books != 1 && a.books != 2 && a.books != 4) ||
         (a.books << a.bits) > 16;  // every codebook in 16 bytes (registers, or the GEMV's 16-float table)
}

}  // namespace

cudaError_t codebook_dequantize(const CodebookArgs& a, DType out, cudaStream_t stream) {
  if (weights_invalid(a) || (long long)a.N * (a.K / 32) >= (1LL << 31))  // a thread per 32 outputs, 32-bit indices
    return cudaErrorInvalidValue;
  if (out == DType::kFloat) return dispatch_bits<float>(a, stream);
  if (out == DType::kHalf) return dispatch_bits<__half>(a, stream);
  if (out == DType::kBFloat16) return dispatch_bits<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t codebook_gemv(const CodebookGemvArgs& g, cudaStream_t stream) {
  if (weights_invalid(g.w) || g.w.group_size % 8 || (long long)g.w.N * g.w.K >= (1LL << 34))  // Row's 32-bit offsets
    return cudaErrorInvalidValue;
  switch (g.w.bits) {
    case 1: return launch_gemv<CodebookGemvDecoder<1>>(g, stream);
    case 2: return launch_gemv<CodebookGemvDecoder<2>>(g, stream);
    case 4: return launch_gemv<CodebookGemvDecoder<4>>(g, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace qlinear
