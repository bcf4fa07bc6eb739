// Dequantize kernel of the mixed 2/4/16 format (issue 24: no mixed layer falls back to the reference on a GPU): Ŵ from
// layout "async_dequant" for one cuBLAS GEMM above the GEMV's batches, and for the backward pass.
//
// A thread owns one (group, row): consecutive threads take consecutive rows of one group, so the code words (tile-major,
// 16 B per row and tile), the meta words (word-major) and the second-order pairs load coalesced, and each thread
// writes its group's g outputs as one contiguous run.  The group's first code word follows from the group table alone
// (its record offset counts the 4-bit groups before it), so no word table is needed.  Arithmetic follows
// qlinear.formats.mixed.dequantize in fp32, operation by operation (no fused multiply-add): ŝ = zz + ss·code, then
// ŝ·(q − z), then + the outlier; one rounding to the output type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "mixed_gemv.h"

namespace qlinear {
namespace mixed {
namespace {

// Code word w of row n in the tile-major layout.
__device__ __forceinline__ unsigned code_word(const MixedGemvArgs& a, int n, int w) {
  const int full = a.W / 4, t = w >> 2;
  return t < full ? __ldg(a.codes + ((size_t)t * a.N + n) * 4 + (w & 3))
                  : __ldg(a.codes + (size_t)4 * full * a.N + (size_t)n * (a.W - 4 * full) + (w - 4 * full));
}

__device__ __forceinline__ int outlier_col(const MixedGemvArgs& a, int i) {
  return a.cols_int32 ? __ldg(static_cast<const int*>(a.outlier_cols) + i)
                      : (int)__ldg(static_cast<const short*>(a.outlier_cols) + i);
}

// The g outputs of one (row, group) of ZB-bit codes from word `first` on, 16 at a time (one 2-bit word, two 4-bit ones):
// ŝ·(q − z), plus the outliers o.. of the row whose columns fall there, then one rounding.
template <typename OutT, int ZB>
__device__ __forceinline__ void write_group(const MixedGemvArgs& a, int n, int k_first, int g, int first, float s, float z,
                                            int o, int o_end, OutT* dst) {
  constexpr int kPerWord = 32 / ZB;
  for (int k0 = 0; k0 < g; k0 += 16) {
    const int wi = first + k0 / kPerWord;
    unsigned long long codes16 = code_word(a, n, wi);
    if (ZB == 4) codes16 |= (unsigned long long)code_word(a, n, wi + 1) << 32;
    union { OutT v[16]; uint4 u[16 * sizeof(OutT) / 16]; } out;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const float q = (float)((unsigned)(codes16 >> (ZB * e)) & ((1u << ZB) - 1u));
      float v = __fmul_rn(s, q - z);
      const int k = k_first + k0 + e;
      while (o < o_end && outlier_col(a, o) < k) ++o;  // (a repeated column would be skipped, as none is stored)
      if (o < o_end && outlier_col(a, o) == k) {
        v = __fadd_rn(v, __half2float(__ldg(static_cast<const __half*>(a.outlier_values) + o)));
        ++o;
      }
      out.v[e] = from_float<OutT>(v);
    }
    uint4* d = reinterpret_cast<uint4*>(dst + k0);
#pragma unroll
    for (int c = 0; c < (int)(16 * sizeof(OutT) / 16); ++c) d[c] = out.u[c];
  }
}

template <typename OutT>
__global__ void __launch_bounds__(256) mixed_dequantize_kernel(const MixedGemvArgs a) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int G = a.K / a.group_size;
  if (t >= (long long)G * a.N) return;
  const int grp = (int)(t / a.N), n = (int)(t % a.N), g = a.group_size;
  const unsigned entry = (unsigned)__ldg(a.gtab + grp), off = entry & 0x7FFFFFFFu;
  const bool is4 = entry >> 31;
  const int zb = is4 ? 4 : 2, n4 = (int)(off - (unsigned)grp * (2 + a.scale_bits)) / 2;
  // the record: a funnel shift of the meta words off / 32 and the next
  const int mw = (int)(off >> 5);
  const unsigned lo = __ldg(a.meta + (size_t)mw * a.N + n), hi = mw + 1 < a.MW ? __ldg(a.meta + (size_t)(mw + 1) * a.N + n) : 0u;
  const unsigned rec = __funnelshift_r(lo, hi, off & 31);
  const float z = (float)(rec & ((1u << zb) - 1u)), code = (float)((rec >> zb) & ((1u << a.scale_bits) - 1u));
  const unsigned pair = __ldg(a.sq + (size_t)(n / a.scale_group_size) * G + grp);
  const float ss = __half2float(__ushort_as_half((unsigned short)(pair & 0xFFFFu)));
  const float zz = __half2float(__ushort_as_half((unsigned short)(pair >> 16)));
  const float s = __fadd_rn(zz, __fmul_rn(ss, code));
  // this row's outliers with columns in the group (ascending within the row: a binary search for the first)
  int o = 0, o_end = 0;
  if (a.outlier_values) {
    int lo_i = __ldg(a.outlier_row_ptr + n), hi_i = __ldg(a.outlier_row_ptr + n + 1);
    o_end = hi_i;
    while (lo_i < hi_i) {
      const int mid = (lo_i + hi_i) / 2;
      if (outlier_col(a, mid) < grp * g) lo_i = mid + 1; else hi_i = mid;
    }
    o = lo_i;
  }
  OutT* dst = static_cast<OutT*>(a.y) + (size_t)n * a.K + (size_t)grp * g;
  const int first = (grp + n4) * (g / 16);
  if (is4) write_group<OutT, 4>(a, n, grp * g, g, first, s, z, o, o_end, dst);
  else write_group<OutT, 2>(a, n, grp * g, g, first, s, z, o, o_end, dst);
}

}  // namespace

cudaError_t mixed_dequantize(const MixedGemvArgs& a, DType out, cudaStream_t stream) {
  if (a.group_size % 16 || a.K % a.group_size || a.W < 0) return cudaErrorInvalidValue;
  const long long threads = (long long)(a.K / a.group_size) * a.N;
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  if (out == DType::kFloat) mixed_dequantize_kernel<float><<<blocks, 256, 0, stream>>>(a);
  else if (out == DType::kHalf) mixed_dequantize_kernel<__half><<<blocks, 256, 0, stream>>>(a);
  else if (out == DType::kBFloat16) mixed_dequantize_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a);
  else return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace mixed
}  // namespace qlinear
