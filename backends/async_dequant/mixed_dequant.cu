// Dequantize kernel of the mixed 2/4/16 format (issue 24: no mixed layer falls back to the reference on a GPU): Ŵ from
// layout "async_dequant" for one cuBLAS GEMM above the GEMV's batches, and for the backward pass.
//
// A thread owns one (group, row): a block takes 128 consecutive rows of one group (gridDim.y = groups), so the code words (tile-major,
// 16 B per row and tile), the meta words (word-major) and the second-order pairs (those of the group's first word)
// load coalesced.  The group's first code
// word follows from the group table alone (its record offset counts the 4-bit groups before it), so no word table is
// needed.  The block stages its rows' outputs in shared memory C at a time (C = 64, or 16 where the group size is not a
// multiple of 64) and writes each row's C-output run with consecutive threads: whole 128-byte lines (fp16, C = 64),
// where each thread writing its own run put 16-byte pieces of 32 rows in one store.  A row's outliers are walked with
// the next column in a register and patched into its staged outputs after each chunk.  Arithmetic follows
// qlinear.formats.mixed.dequantize in fp32, operation by operation (no fused multiply-add): ŝ = zz + ss·code, then
// ŝ·(q − z), then + the outlier; one rounding to the output type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/canonical.cuh"  // Run32, store_runs
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

// Column of outlier i (Args: MixedGemvArgs or MixedCanonicalArgs, which hold the outliers alike).
template <typename Args>
__device__ __forceinline__ int outlier_col(const Args& a, int i) {
  return a.cols_int32 ? __ldg(static_cast<const int*>(a.outlier_cols) + i)
                      : (int)__ldg(static_cast<const short*>(a.outlier_cols) + i);
}

// Outliers of one row from index o on, the next one's column held in a register (INT_MAX past the row's last).
struct OutlierCursor {
  int o, end, col;
  template <typename Args>
  __device__ __forceinline__ void load(const Args& a) { col = o < end ? outlier_col(a, o) : 0x7FFFFFFF; }
  // At row n's first outlier in column col0 or after (columns ascend within a row: a binary search).
  template <typename Args>
  __device__ __forceinline__ void seek(const Args& a, int n, int col0) {
    int lo = __ldg(a.outlier_row_ptr + n), hi = __ldg(a.outlier_row_ptr + n + 1);
    end = hi;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (outlier_col(a, mid) < col0) lo = mid + 1; else hi = mid;
    }
    o = lo;
    load(a);
  }
};

// 16 outputs of one (row, group) of ZB-bit codes from code word `wi` (and wi + 1): ŝ·(q − z), one rounding;
// written as 16-byte pieces to dst.  No outlier test here: they are patched in afterwards (patch_outliers).
template <typename OutT, int ZB>
__device__ __forceinline__ void write16(const MixedGemvArgs& a, int n, int wi, float s, float z, uint4* dst) {
  unsigned long long codes16 = code_word(a, n, wi);
  if constexpr (ZB == 4) codes16 |= (unsigned long long)code_word(a, n, wi + 1) << 32;
  union { OutT v[16]; uint4 u[16 * sizeof(OutT) / 16]; } out;
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const float q = (float)((unsigned)(codes16 >> (ZB * e)) & ((1u << ZB) - 1u));
    out.v[e] = from_float<OutT>(__fmul_rn(s, q - z));
  }
#pragma unroll
  for (int c = 0; c < (int)(16 * sizeof(OutT) / 16); ++c) dst[c] = out.u[c];
}

// The row's outliers in group columns [k0, k_end) (the cursor at the first with column >= k0): each staged output
// there (row[k - k0]) rewritten as ŝ·(q − z) + outlier, rounded once, its code read again (columns ascend within a
// row, one outlier each: a repeat would be skipped, as before).  Outliers are ~0.2 % of the weights, so this loop
// keeps their test out of the unrolled write16: with it inlined per output the kernel was 7816 instructions (sm_90a)
// and ran at 35 % of copy bandwidth on an H200 where the other dequantize kernels, 0.6-1.7 K, reach 66-88 %.
template <typename OutT>
__device__ void patch_outliers(const MixedGemvArgs& a, int n, int zb, int first, int col0, int k0, int k_end,
                               float s, float z, OutlierCursor& cur, OutT* row) {
  while (cur.col < col0 + k_end) {
    const int col = cur.col, k = col - col0, per = 32 / zb;
    const unsigned q = code_word(a, n, first + k / per) >> (zb * (k % per)) & ((1u << zb) - 1u);
    const float w = __half2float(__ldg(static_cast<const __half*>(a.outlier_values) + cur.o));
    row[k - k0] = from_float<OutT>(__fadd_rn(__fmul_rn(s, (float)q - z), w));
    do { ++cur.o; cur.load(a); } while (cur.col == col);
  }
}

template <typename OutT, int C>
__global__ void __launch_bounds__(kDequantThreads, 4) mixed_dequantize_kernel(const MixedGemvArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int kRow = C * sizeof(OutT) + 16, kPieces = C * sizeof(OutT) / 16;  // staged row bytes (padded), pieces
  const int g = a.group_size, grp = blockIdx.y, n = blockIdx.x * kDequantThreads + threadIdx.x;
  const bool valid = n < a.N;  // no early exit: every thread reaches the barriers
  unsigned char* staged = smem_raw;
  const unsigned entry = (unsigned)__ldg(a.tab + grp), off = entry & 0x7FFFFFFFu;
  const bool is4 = entry >> 31;  // the block's group: one kind for all its threads
  const int zb = is4 ? 4 : 2, n4 = (int)(off - (unsigned)grp * (2 + a.scale_bits)) / 2;
  const int first = (grp + n4) * (g / 16);  // the group's first code word
  float s = 0.f, z = 0.f;
  OutlierCursor cur{0, 0, 0x7FFFFFFF};
  if (valid) {
    // the record: a funnel shift of the meta words off / 32 and the next
    const int mw = (int)(off >> 5);
    const unsigned lo = __ldg(a.meta + (size_t)mw * a.N + n), hi = mw + 1 < a.MW ? __ldg(a.meta + (size_t)(mw + 1) * a.N + n) : 0u;
    const unsigned rec = __funnelshift_r(lo, hi, off & 31);
    z = (float)(rec & ((1u << zb) - 1u));
    const float code = (float)((rec >> zb) & ((1u << a.scale_bits) - 1u));
    const int slot = (__ldg(a.tab + a.G + first) >> 27) & 3;  // the pair's place among its tile's
    const unsigned pair = __ldg(a.sq + ((size_t)(first >> 2) * a.S2 + n / a.scale_group_size) * a.P + slot);
    const float ss = __half2float(__ushort_as_half((unsigned short)(pair & 0xFFFFu)));
    const float zz = __half2float(__ushort_as_half((unsigned short)(pair >> 16)));
    s = __fadd_rn(zz, __fmul_rn(ss, code));
    if (a.outlier_values) cur.seek(a, n, grp * g);  // this row's outliers with columns in the group
  }
  for (int k0 = 0; k0 < g; k0 += C) {
    if (valid) {
      uint4* dst = reinterpret_cast<uint4*>(staged + threadIdx.x * kRow);
#pragma unroll
      for (int c = 0; c < C; c += 16) {
        const int k = k0 + c;
        if (is4) write16<OutT, 4>(a, n, first + k / 8, s, z, dst + c * sizeof(OutT) / 16);
        else write16<OutT, 2>(a, n, first + k / 16, s, z, dst + c * sizeof(OutT) / 16);
      }
      patch_outliers<OutT>(a, n, zb, first, grp * g, k0, k0 + C, s, z, cur, reinterpret_cast<OutT*>(dst));
    }
    __syncthreads();
    // the block's chunk, each staged row's C outputs one contiguous run: piece p = i·threads + thread
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int p = i * kDequantThreads + threadIdx.x, row = p / kPieces, piece = p % kPieces;
      const int nr = blockIdx.x * kDequantThreads + row;
      if (nr < a.N)
        *reinterpret_cast<uint4*>(static_cast<OutT*>(a.y) + (size_t)nr * a.K + (size_t)grp * g + k0 +
                                  piece * (16 / sizeof(OutT))) =
            *reinterpret_cast<const uint4*>(staged + row * kRow + piece * 16);
    }
    __syncthreads();
  }
}

template <typename OutT>
cudaError_t launch_dequantize(const MixedGemvArgs& a, dim3 grid, cudaStream_t stream) {
  const size_t smem = mixed_dequantize_smem_bytes(a.group_size, sizeof(OutT));
  if (a.group_size % 64) mixed_dequantize_kernel<OutT, 16><<<grid, kDequantThreads, smem, stream>>>(a);
  else mixed_dequantize_kernel<OutT, 64><<<grid, kDequantThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

// --- from the canonical buffers, any group size: a thread takes Ŵ's flattened elements 32t .. 32t + 31 (which may span
// rows), each row's group state (kind, rank among its kind, ŝ, z) found at the thread's first element of it and
// stepped at each group boundary, its outliers walked with a cursor.  An edge path (layers the layout cannot hold):
// plain per-element loads, no staging of the code words.

// `width` (1..16) bits of the little-endian stream `words` from bit `bit` on (qlinear.formats.packing).
__device__ __forceinline__ unsigned stream_bits(const unsigned* words, long long bit, int width) {
  const unsigned lo = __ldg(words + bit / 32), at = (unsigned)(bit % 32);
  const unsigned hi = at + width > 32 ? __ldg(words + bit / 32 + 1) : 0u;
  return __funnelshift_r(lo, hi, at) & ((1u << width) - 1u);
}

// One (row, group)'s codes and parameters.
struct CanonicalGroup {
  const unsigned* codes;  // the row's codes of the group's kind
  long long first;        // bit of the group's first code there
  int bits;
  float s, z;
};

__device__ CanonicalGroup canonical_group(const MixedCanonicalArgs& a, int n, int grp, bool is4, int rank) {
  CanonicalGroup c;
  c.bits = is4 ? 4 : 2;
  c.codes = is4 ? a.q4 + (size_t)n * a.w4 : a.q2 + (size_t)n * a.w2;
  c.first = (long long)rank * a.group_size * c.bits;
  c.z = (float)stream_bits(is4 ? a.z4 + (size_t)n * a.zw4 : a.z2 + (size_t)n * a.zw2, (long long)rank * c.bits, c.bits);
  const float code = (float)stream_bits(a.scale_codes + (size_t)grp * a.sw, (long long)n * a.scale_bits, a.scale_bits);
  const size_t pair = (size_t)grp * a.S2 + n / a.scale_group_size;
  const float ss = __half2float(__ldg(static_cast<const __half*>(a.scale_scale) + pair));
  const float zz = __half2float(__ldg(static_cast<const __half*>(a.scale_zero) + pair));
  c.s = __fadd_rn(zz, __fmul_rn(ss, code));
  return c;
}

template <typename OutT>
__global__ void __launch_bounds__(256) mixed_canonical_dequantize_kernel(const MixedCanonicalArgs a) {
  const size_t count = (size_t)a.N * a.K;
  const unsigned total = (unsigned)((count + 31) / 32);  // < 2^31: checked by the launcher
  const unsigned t0 = blockIdx.x * blockDim.x, t = t0 + threadIdx.x;
  const int g = a.group_size;
  Run32<OutT> out;
  if (t < total) {  // no early exit: every thread reaches store_runs' barrier
    int n = (int)(32 * (size_t)t / a.K), k = (int)(32 * (size_t)t % a.K);
    int grp = -1, r4 = 0, end = 0;  // grp -1: the row's group state not found yet
    bool is4 = false;
    CanonicalGroup c{};
    OutlierCursor cur{0, 0, 0x7FFFFFFF};
    for (int j = 0; j < 32; ++j) {
      float v = 0.f;  // past Ŵ's last element: staged, never stored
      if (n < a.N) {
        if (grp < 0) {  // the thread's first element of row n: k's group, its rank (binary searches), its outliers
          grp = k / g;
          int lo = 0, hi = a.G4;
          while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (__ldg(a.idx4 + mid) < grp) lo = mid + 1; else hi = mid;
          }
          r4 = lo;
          is4 = r4 < a.G4 && __ldg(a.idx4 + r4) == grp;
          c = canonical_group(a, n, grp, is4, is4 ? r4 : grp - r4);
          end = (grp + 1) * g;
          if (a.outlier_values) cur.seek(a, n, k);
        } else if (k == end) {  // the next group of the row
          r4 += is4;
          ++grp;
          is4 = r4 < a.G4 && __ldg(a.idx4 + r4) == grp;
          c = canonical_group(a, n, grp, is4, is4 ? r4 : grp - r4);
          end += g;
        }
        const unsigned q = stream_bits(c.codes, c.first + (long long)(k - (end - g)) * c.bits, c.bits);
        v = __fmul_rn(c.s, (float)q - c.z);
        if (a.outlier_values) {
          for (; cur.col == k; ++cur.o, cur.load(a))  // each listing of (n, k) adds, as the format's dequantize does
            v = __fadd_rn(v, __half2float(__ldg(static_cast<const __half*>(a.outlier_values) + cur.o)));
        }
      }
      out.v[j] = from_float<OutT>(v);
      if (++k == a.K) k = 0, ++n, grp = -1, cur = OutlierCursor{0, 0, 0x7FFFFFFF};
    }
  }
  store_runs<OutT, true>(out, t0, count, static_cast<OutT*>(a.w));
}

template <typename OutT>
cudaError_t launch_canonical(const MixedCanonicalArgs& a, cudaStream_t stream) {
  const long long threads = ((long long)a.N * a.K + 31) / 32;
  mixed_canonical_dequantize_kernel<OutT><<<(unsigned)((threads + 255) / 256), 256,
                                            canonical_dequantize_smem_bytes(sizeof(OutT)), stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t mixed_dequantize(const MixedGemvArgs& a, DType out, cudaStream_t stream) {
  if (a.group_size % 16 || a.K % a.group_size || a.W < 0) return cudaErrorInvalidValue;
  const dim3 grid = mixed_dequantize_grid(a.N, a.K, a.group_size);
  if (grid.y > 65535) return cudaErrorInvalidValue;
  if (out == DType::kFloat) return launch_dequantize<float>(a, grid, stream);
  if (out == DType::kHalf) return launch_dequantize<__half>(a, grid, stream);
  if (out == DType::kBFloat16) return launch_dequantize<__nv_bfloat16>(a, grid, stream);
  return cudaErrorInvalidValue;
}

cudaError_t mixed_dequantize_canonical(const MixedCanonicalArgs& a, DType out, cudaStream_t stream) {
  if (a.N < 1 || a.K < 1 || a.group_size < 1 || a.K % a.group_size || a.scale_bits < 1 || a.scale_bits > 16 ||
      a.scale_group_size < 1 || ((long long)a.N * a.K + 31) / 32 >= (1LL << 31))
    return cudaErrorInvalidValue;
  if (out == DType::kFloat) return launch_canonical<float>(a, stream);
  if (out == DType::kHalf) return launch_canonical<__half>(a, stream);
  if (out == DType::kBFloat16) return launch_canonical<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mixed
}  // namespace qlinear
