// Dequantize kernel of the codebook format: Ŵ for one cuBLAS GEMM (the format's GPU decode path, issue 24).
//
// A thread owns one row's 32 consecutive inputs: it reads `bits` code words (consecutive threads read consecutive
// words of a row, so the loads coalesce), looks each input's centroid up in its group's codebook and multiplies by the
// group's scale in fp32 (fp16 scale × int8 centroid: exact), rounds once to the output type and writes the 32 values
// as one contiguous 64-128 B run.  The codebooks (at most 16 bytes) are read through the read-only cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "codebook_dequant.h"

namespace qlinear {
namespace {

template <typename OutT, int BITS>
__global__ void __launch_bounds__(256) codebook_dequantize_kernel(const CodebookArgs a) {
  const int chunks = a.K / 32;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)a.N * chunks) return;
  const int n = (int)(t / chunks), c = (int)(t % chunks);
  unsigned words[BITS];
#pragma unroll
  for (int i = 0; i < BITS; ++i) words[i] = __ldg(a.codes + (size_t)n * a.code_words + c * BITS + i);
  const int book_bits = a.books == 4 ? 2 : a.books == 2 ? 1 : 0;
  const __half* scales = static_cast<const __half*>(a.scales) + (size_t)n * (a.K / a.group_size);
  union { OutT v[32]; uint4 u[32 * sizeof(OutT) / 16]; } out;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const unsigned code = (words[j * BITS / 32] >> (j * BITS % 32)) & ((1u << BITS) - 1u);
    const int k = c * 32 + j, g = k / a.group_size;
    unsigned book = 0;
    if (book_bits) {
      const unsigned bw = __ldg(a.book_idx + (size_t)n * a.book_words + g * book_bits / 32);
      book = (bw >> (g * book_bits % 32)) & (a.books - 1u);
    }
    const float centroid = (float)__ldg(a.codebooks + (book << BITS) + code);
    out.v[j] = from_float<OutT>(__half2float(__ldg(scales + g)) * centroid);
  }
  uint4* dst = reinterpret_cast<uint4*>(static_cast<OutT*>(a.w) + (size_t)n * a.K + c * 32);
#pragma unroll
  for (int i = 0; i < (int)(32 * sizeof(OutT) / 16); ++i) dst[i] = out.u[i];
}

template <typename OutT>
cudaError_t dispatch_bits(const CodebookArgs& a, cudaStream_t s) {
  const long long threads = (long long)a.N * (a.K / 32);
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  switch (a.bits) {
    case 1: codebook_dequantize_kernel<OutT, 1><<<blocks, 256, 0, s>>>(a); break;
    case 2: codebook_dequantize_kernel<OutT, 2><<<blocks, 256, 0, s>>>(a); break;
    case 4: codebook_dequantize_kernel<OutT, 4><<<blocks, 256, 0, s>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t codebook_dequantize(const CodebookArgs& a, DType out, cudaStream_t stream) {
  if (a.K % 32 || a.group_size <= 0 || a.K % a.group_size || (a.books != 1 && a.books != 2 && a.books != 4)) {
    return cudaErrorInvalidValue;
  }
  if (out == DType::kFloat) return dispatch_bits<float>(a, stream);
  if (out == DType::kHalf) return dispatch_bits<__half>(a, stream);
  if (out == DType::kBFloat16) return dispatch_bits<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
