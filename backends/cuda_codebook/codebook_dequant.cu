// Dequantize kernel of the codebook format: Ŵ for one cuBLAS GEMM (the format's GPU decode path, issue 24).
//
// A thread owns one row's 32 consecutive inputs: it reads `bits` code words (consecutive threads read consecutive
// words of a row, so the loads coalesce), looks each input's centroid up in its group's codebook and multiplies by the
// group's scale in fp32 (fp16 scale × int8 centroid: exact) and rounds once to the output type.  All codebooks of a
// layer fit 16 bytes (the format's rule), so a thread holds them in 4 registers and a centroid is two byte permutes and
// a select; the scale and the book come once per 16 inputs (group sizes are multiples of 16) instead of once per input.
// Thread t's 32 outputs are Ŵ's elements 32t .. 32t + 31, so a block's outputs are one contiguous run: the block
// stages them in shared memory and writes the run with consecutive threads (each warp store 512 contiguous bytes at
// fp16), where each thread storing its own 64 bytes put 16-byte pieces 64 bytes apart in one store.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "codebook_dequant.h"

namespace qlinear {
namespace {

// Byte e (0..15) of the 16-byte table t, sign-extended: the int8 centroid at index book·2^bits + code.
__device__ __forceinline__ int table_byte(const unsigned (&t)[4], unsigned e) {
  const unsigned lo = __byte_perm(t[0], t[1], e & 7u), hi = __byte_perm(t[2], t[3], e & 7u);
  return (int)(signed char)(e & 8u ? hi : lo);
}

// A group's scale (fp32) and book · 2^bits (the centroid index's high part), for row n.
template <int BITS>
__device__ __forceinline__ void group_of(const CodebookArgs& a, const __half* scales, int n, int g, float& scale,
                                         unsigned& book) {
  scale = __half2float(__ldg(scales + g));
  book = 0;
  if (a.books > 1) {
    const int book_bits = a.books == 4 ? 2 : 1;
    const unsigned bw = __ldg(a.book_idx + (size_t)n * a.book_words + g * book_bits / 32);
    book = ((bw >> (g * book_bits % 32)) & (a.books - 1u)) << BITS;
  }
}

// PER16: group_size is a multiple of 16, so the scale and book are read once per 16 inputs, else once per input.
template <typename OutT, int BITS, bool PER16>
__global__ void __launch_bounds__(256, 2) codebook_dequantize_kernel(const CodebookArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRun = 32 * sizeof(OutT), kStride = kRun + 16, kPieces = kRun / 16;  // staged runs padded by 16 bytes
  const unsigned chunks = a.K / 32, total = (unsigned)a.N * chunks;  // < 2^31: checked by the launcher
  const unsigned t0 = blockIdx.x * blockDim.x, t = t0 + threadIdx.x;
  if (t < total) {  // no early exit: every thread reaches the barrier
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
    float scale[2];
    unsigned book[2];
    if (PER16) {
#pragma unroll
      for (int h = 0; h < 2; ++h) group_of<BITS>(a, scales, n, (c * 32 + 16 * h) / a.group_size, scale[h], book[h]);
    }
    union { OutT v[32]; uint4 u[kPieces]; } out;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const unsigned code = (words[j * BITS / 32] >> (j * BITS % 32)) & ((1u << BITS) - 1u);
      if (!PER16) group_of<BITS>(a, scales, n, (c * 32 + j) / a.group_size, scale[j / 16], book[j / 16]);
      out.v[j] = from_float<OutT>(scale[j / 16] * (float)table_byte(table, book[j / 16] | code));
    }
    uint4* staged = reinterpret_cast<uint4*>(smem_raw + threadIdx.x * kStride);
#pragma unroll
    for (int i = 0; i < kPieces; ++i) staged[i] = out.u[i];
  }
  __syncthreads();
  OutT* const run = static_cast<OutT*>(a.w) + 32 * (size_t)t0;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {  // piece p = i·threads + thread: 16 bytes number p % kPieces of chunk p / kPieces
    const int p = i * blockDim.x + threadIdx.x, chunk = p / kPieces, piece = p % kPieces;
    if (t0 + chunk < total)
      *reinterpret_cast<uint4*>(run + 32 * chunk + piece * (16 / sizeof(OutT))) =
          *reinterpret_cast<const uint4*>(smem_raw + chunk * kStride + piece * 16);
  }
}

template <typename OutT>
cudaError_t dispatch_bits(const CodebookArgs& a, cudaStream_t s) {
  const long long threads = (long long)a.N * (a.K / 32);
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  const size_t smem = codebook_dequantize_smem_bytes(sizeof(OutT));
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

}  // namespace

cudaError_t codebook_dequantize(const CodebookArgs& a, DType out, cudaStream_t stream) {
  if (a.K % 32 || a.group_size <= 0 || a.K % a.group_size || (a.books != 1 && a.books != 2 && a.books != 4) ||
      (a.books << a.bits) > 16 ||  // the kernel holds every codebook in 16 bytes of registers
      (long long)a.N * (a.K / 32) >= (1LL << 31)) {  // one thread per 32 outputs, indexed in 32 bits
    return cudaErrorInvalidValue;
  }
  if (out == DType::kFloat) return dispatch_bits<float>(a, stream);
  if (out == DType::kHalf) return dispatch_bits<__half>(a, stream);
  if (out == DType::kBFloat16) return dispatch_bits<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
