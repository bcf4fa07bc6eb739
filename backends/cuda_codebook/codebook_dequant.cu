// The codebook format's GPU decode paths (issue 24): a GEMV at decode batches, and a dequantize kernel writing Ŵ for
// one cuBLAS GEMM above.
//
// Dequantize: a thread owns one row's 32 consecutive inputs: it reads `bits` code words (consecutive threads read
// consecutive words of a row, so the loads coalesce), looks each input's centroid up in its group's codebook and
// multiplies by the group's scale in fp32 (fp16 scale × int8 centroid: exact) and rounds once to the output type.  All
// codebooks of a layer fit 16 bytes (the format's rule), so a thread holds them in 4 registers and a centroid is two
// byte permutes and a select; the scale and the book come once per 16 inputs (group sizes that are multiples of 16)
// instead of once per input.  Where K is not a multiple of 32 (rows of words that do not split into 32-input chunks),
// a thread takes Ŵ's flattened elements 32t .. 32t + 31 instead, each code word and group read per element.  The
// outputs leave through store_runs.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/canonical.cuh"  // store_runs
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

// All of a layer's codebooks as 16 bytes in 4 registers, [book][code] int8, zero past their books·2^bits bytes.
template <int BITS>
__device__ __forceinline__ void load_table(const CodebookArgs& a, unsigned (&table)[4]) {
  const int entries = a.books << BITS;
#pragma unroll
  for (int i = 0; i < 4; ++i) table[i] = 0u;
  if (entries % 4 == 0 && (reinterpret_cast<size_t>(a.codebooks) & 3u) == 0) {  // whole words: 4 loads, not 16
#pragma unroll
    for (int i = 0; i < 4; ++i)  // unrolled: table stays in registers
      if (4 * i < entries) table[i] = __ldg(reinterpret_cast<const unsigned*>(a.codebooks) + i);
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e)
      if (e < entries) table[e / 4] |= (unsigned)(unsigned char)__ldg(a.codebooks + e) << (8 * (e % 4));
  }
}

// How a dequantize thread finds its 32 outputs' groups and code words.
enum class Walk {
  kPerInput,  // one row's 32 inputs (K a multiple of 32): its `bits` code words at once, the group read per input
  kPer16,     // the same, group sizes a multiple of 16: the group read once per 16 inputs
  kRagged,    // K not a multiple of 32: Ŵ's flattened elements 32t .. 32t + 31, which may span rows, one at a time
};

template <typename OutT, int BITS, Walk WALK>
__global__ void __launch_bounds__(256, 2) codebook_dequantize_kernel(const CodebookArgs a) {
  const unsigned t0 = blockIdx.x * blockDim.x, t = t0 + threadIdx.x;
  Run32<OutT> out;
  const size_t count = (size_t)a.N * a.K;  // Ŵ's elements: (count + 31) / 32 < 2^31, checked by the launcher
  const unsigned total = WALK == Walk::kRagged ? (unsigned)((count + 31) / 32) : (unsigned)a.N * (a.K / 32);
  if (t < total) {  // no early exit: every thread reaches store_runs' barrier
    unsigned table[4];  // the codebooks, [book][code] int8
    if constexpr (WALK == Walk::kRagged) {
      load_table<BITS>(a, table);
      constexpr int kPerWord = 32 / BITS;
      int n = (int)(32 * (size_t)t / a.K), k = (int)(32 * (size_t)t % a.K);
#pragma unroll 1  // unrolled, the per-element loads spill registers; the run sits in local memory instead
      for (int j = 0; j < 32; ++j) {
        float v = 0.f;  // past Ŵ's last element: staged, never stored
        if (n < a.N) {
          const unsigned word = __ldg(a.codes + (size_t)n * a.code_words + k / kPerWord);
          const unsigned code = (word >> (k % kPerWord * BITS)) & ((1u << BITS) - 1u);
          float scale;
          unsigned book;
          group_of<BITS>(a, static_cast<const __half*>(a.scales) + (size_t)n * (a.K / a.group_size),
                         a.book_idx + (size_t)n * a.book_words,
                         k / a.group_size, scale, book);
          v = scale * (float)table_byte(table, book | code);
        }
        out.v[j] = from_float<OutT>(v);
        if (++k == a.K) k = 0, ++n;
      }
    } else {
      const unsigned chunks = a.K / 32;
      const int n = (int)(t / chunks), c = (int)(t % chunks);
      unsigned words[BITS];
#pragma unroll
      for (int i = 0; i < BITS; ++i) words[i] = __ldg(a.codes + (size_t)n * a.code_words + c * BITS + i);
      load_table<BITS>(a, table);
      const __half* scales = static_cast<const __half*>(a.scales) + (size_t)n * (a.K / a.group_size);
      const unsigned* books = a.book_idx + (size_t)n * a.book_words;
      float scale[2];
      unsigned book[2];
      if constexpr (WALK == Walk::kPer16) {
#pragma unroll
        for (int h = 0; h < 2; ++h) group_of<BITS>(a, scales, books, (c * 32 + 16 * h) / a.group_size, scale[h], book[h]);
      }
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const unsigned code = (words[j * BITS / 32] >> (j * BITS % 32)) & ((1u << BITS) - 1u);
        if constexpr (WALK == Walk::kPerInput)
          group_of<BITS>(a, scales, books, (c * 32 + j) / a.group_size, scale[j / 16], book[j / 16]);
        out.v[j] = from_float<OutT>(scale[j / 16] * (float)table_byte(table, book[j / 16] | code));
      }
    }
  }
  store_runs<OutT, WALK == Walk::kRagged>(out, t0, count, static_cast<OutT*>(a.w));
}

constexpr int kGemvWarps = 4, kGemvRows = 4;  // a GEMV block's warps, each owning kGemvRows rows

// Shared memory of a GEMV block for `mt` rows of x: the 16-float centroid table, then every lane's partial sums.
constexpr size_t gemv_smem_bytes(int mt) { return 4 * (16 + (size_t)32 * kGemvWarps * kGemvRows * mt); }

// GEMV at decode batches (x [M, K], M <= 8): y = x·Ŵᵀ + b without writing Ŵ.  A warp owns kGemvRows rows; lane l walks
// the 32-input chunks l, l + 32, ... of K (the warp's loads of a row are consecutive words: coalesced), holding its
// rows' code words of a chunk, then 8 inputs at a time (one group: group sizes are multiples of 8) takes x from global
// memory (the block's warps read the same x: L1) and each input's centroid from a 16-float table in shared memory (all
// of a layer's codebooks, the format's 16-byte limit): Σ_j c_j·x_j over the 8 inputs in fp32 (each product exact: an
// int8 centroid times an fp16/bf16 input), times the group's scale, accumulated.  The lanes' sums are then added in
// lane order through shared memory (deterministic).  MT: the instantiation's rows of x (1, 2, 4 or 8; g.M of them are
// read).
template <typename T, int MT, int BITS>
__global__ void __launch_bounds__(32 * kGemvWarps) codebook_gemv_kernel(const CodebookGemvArgs g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* const table = reinterpret_cast<float*>(smem_raw);  // [16]: centroid book·2^bits + code, 0 past the books
  float* const sums = table + 16;                           // [warps][32 lanes][kGemvRows][MT]
  const CodebookArgs& a = g.w;
  if (threadIdx.x < 16) table[threadIdx.x] = (int)threadIdx.x < (a.books << BITS) ? (float)a.codebooks[threadIdx.x] : 0.f;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kGemvWarps + warp) * kGemvRows;
  const T* const x = static_cast<const T*>(g.x);
  int scale_at[kGemvRows], book_at[kGemvRows];  // where each row's scales and book_idx words start (32-bit offsets:
#pragma unroll                                  // < 2^31, as N·K < 2^34; fewer registers held than pointers)
  for (int r = 0; r < kGemvRows; ++r) {  // rows past N: row N - 1's, not written
    const int n = min(n0 + r, a.N - 1);
    scale_at[r] = n * (a.K / a.group_size);
    book_at[r] = n * a.book_words;
  }
  float acc[kGemvRows][MT];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  for (int c = lane; c < a.K / 32; c += 32) {
    unsigned words[kGemvRows][BITS];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      const unsigned* const p = a.codes + (size_t)min(n0 + r, a.N - 1) * a.code_words + c * BITS;
      if constexpr (BITS == 4) {  // one 16-byte load (codes 16-byte aligned: codebook_gemv checks)
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
        words[r][0] = v.x; words[r][1] = v.y; words[r][2] = v.z; words[r][3] = v.w;
      } else {
#pragma unroll
        for (int i = 0; i < BITS; ++i) words[r][i] = __ldg(p + i);
      }
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int k0 = c * 32 + 8 * s;
      const int grp = (int)((unsigned)k0 / (unsigned)a.group_size);  // unsigned: a cheaper division
      float xv[MT][8];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < g.M) {
          const uint4 u = __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * a.K + k0));
          const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[m][j] = to_float<T>(h[j]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) xv[m][j] = 0.f;
        }
      }
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        float scale;
        unsigned book;
        group_of<BITS>(a, static_cast<const __half*>(a.scales) + scale_at[r], a.book_idx + book_at[r], grp, scale,
                       book);
        float part[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) part[m] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // the centroid's byte offset in the table straight from the code word's bits:
          const int e = 8 * s + j, at = e * BITS % 32;  // one shift and one LOP3, no index scaling (SASS, sm_90a)
          const unsigned w = words[r][e * BITS / 32], off = (at >= 2 ? w >> (at - 2) : w << (2 - at));
          const float cj = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(table) +
                                                            ((off & (((1u << BITS) - 1u) << 2)) | (book << 2)));
#pragma unroll
          for (int m = 0; m < MT; ++m) part[m] = fmaf(cj, xv[m][j], part[m]);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[r][m] = fmaf(scale, part[m], acc[r][m]);
      }
    }
  }
  float* const mine = sums + (size_t)(warp * 32 + lane) * kGemvRows * MT;
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) mine[r * MT + m] = acc[r][m];
  __syncthreads();
  if (lane < kGemvRows * MT) {
    const int r = lane / MT, m = lane % MT, n = n0 + r;
    if (n < a.N && m < g.M) {
      float sum = 0.f;
      for (int l = 0; l < 32; ++l) sum += sums[(size_t)(warp * 32 + l) * kGemvRows * MT + lane];
      if (g.bias) sum += bias_at<T>(g.bias, g.bias_dtype, n);
      static_cast<T*>(g.y)[(size_t)m * a.N + n] = from_float<T>(sum);
    }
  }
}

template <typename T, int MT>
cudaError_t gemv_bits(const CodebookGemvArgs& g, cudaStream_t s) {
  const unsigned blocks = (unsigned)((g.w.N + kGemvWarps * kGemvRows - 1) / (kGemvWarps * kGemvRows));
  const size_t smem = gemv_smem_bytes(MT);
  switch (g.w.bits) {
    case 1: codebook_gemv_kernel<T, MT, 1><<<blocks, 32 * kGemvWarps, smem, s>>>(g); break;
    case 2: codebook_gemv_kernel<T, MT, 2><<<blocks, 32 * kGemvWarps, smem, s>>>(g); break;
    case 4: codebook_gemv_kernel<T, MT, 4><<<blocks, 32 * kGemvWarps, smem, s>>>(g); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t gemv_m(const CodebookGemvArgs& g, cudaStream_t s) {
  if (g.M == 1) return gemv_bits<T, 1>(g, s);
  if (g.M == 2) return gemv_bits<T, 2>(g, s);
  if (g.M <= 4) return gemv_bits<T, 4>(g, s);
  return gemv_bits<T, 8>(g, s);
}

template <typename OutT, int BITS>
cudaError_t dispatch_walk(const CodebookArgs& a, cudaStream_t s) {
  const long long threads = ((long long)a.N * a.K + 31) / 32;
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  const size_t smem = canonical_dequantize_smem_bytes(sizeof(OutT));
  if (a.K % 32) codebook_dequantize_kernel<OutT, BITS, Walk::kRagged><<<blocks, 256, smem, s>>>(a);
  else if (a.group_size % 16) codebook_dequantize_kernel<OutT, BITS, Walk::kPerInput><<<blocks, 256, smem, s>>>(a);
  else codebook_dequantize_kernel<OutT, BITS, Walk::kPer16><<<blocks, 256, smem, s>>>(a);
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t dispatch_bits(const CodebookArgs& a, cudaStream_t s) {
  switch (a.bits) {
    case 1: return dispatch_walk<OutT, 1>(a, s);
    case 2: return dispatch_walk<OutT, 2>(a, s);
    case 4: return dispatch_walk<OutT, 4>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

// The weights' rules both kernels share.
bool weights_invalid(const CodebookArgs& a) {
  return a.K <= 0 || a.group_size <= 0 || a.K % a.group_size || (a.books != 1 && a.books != 2 && a.books != 4) ||
         (a.books << a.bits) > 16;  // every codebook in 16 bytes (registers, or the GEMV's 16-float table)
}

}  // namespace

cudaError_t codebook_dequantize(const CodebookArgs& a, DType out, cudaStream_t stream) {
  if (weights_invalid(a) || ((long long)a.N * a.K + 31) / 32 >= (1LL << 31))  // a thread per 32 outputs, 32-bit indices
    return cudaErrorInvalidValue;
  if (out == DType::kFloat) return dispatch_bits<float>(a, stream);
  if (out == DType::kHalf) return dispatch_bits<__half>(a, stream);
  if (out == DType::kBFloat16) return dispatch_bits<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t codebook_gemv(const CodebookGemvArgs& g, cudaStream_t stream) {
  if (weights_invalid(g.w) || g.w.K % 32 || g.w.group_size % 8 || (long long)g.w.N * g.w.K >= (1LL << 34) ||  // 32-bit row offsets
      g.M < 1 || g.M > 8 || (reinterpret_cast<size_t>(g.x) & 15u) ||  // x read 16 bytes at a time, and 4-bit codes too
      (g.w.bits == 4 && (reinterpret_cast<size_t>(g.w.codes) & 15u)))
    return cudaErrorInvalidValue;
  if (g.x_dtype == DType::kHalf) return gemv_m<__half>(g, stream);
  if (g.x_dtype == DType::kBFloat16) return gemv_m<__nv_bfloat16>(g, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
