// GEMV for the mixed 2/4/16 format (2/4/16-bit paper: intra-matrix 2-bit/4-bit groups, second-order
// quantized scales, fp16 outliers in 2-bit groups) with asynchronous dequantization (paper §5, Alg. 1).
//
// Registers: __launch_bounds__(256, 3) at M <= 2 (≤ 80 registers, 768 resident threads per SM; rotated: M = 1 only),
// (256, 2) above (≤ 128 registers, 512 threads), (128, 3) at M = 8 (≤ 168 registers, 384 threads: at 128 its async
// kernel spills 8 bytes, as the rotated M = 2 kernel does at 80 on sm_80; nvcc 13.0); ptxas -v shows no spills for
// sm_80 and sm_90a (tests/test_native_build.py).
//
// Work split: a thread owns 2 rows (lane and lane + 32 of its warp's 64 rows); per tile of 4 code words it
// issues one 16-byte load per row, so a warp reads two 512-byte contiguous segments (layout [Tf][N][4]).
// A block owns 2·threads rows and `tiles_per_split` consecutive tiles (gridDim.y = split-K slices); the
// inputs of the slice's K span sit in shared memory as fp32, and so does a word table of the slice, expanded
// from the per-layer group table (group kinds are the same for every row, so one table drives every thread:
// every branch below on a table entry is uniform across the block).
//
// A word holds 16 2-bit codes or 8 4-bit codes of consecutive inputs of one group.  Per word and row:
//   ŝ = fma(scale_scale, scale_code, scale_zero)  (second-order dequantization, fp32)
//   dot = Σ_i (q_i − z)·x_i                         (q − z exact, fp32 FMAs)
//   acc = fma(ŝ, dot, acc)
// Up to M = 4, q − z costs one LOP3 and one FADD per code: a code at bit p of its 16-bit half-word is OR-ed, in place,
// into the mantissa of 2^(23−p) (whose mantissa LSB weighs 2^−p), giving 2^(23−p) + q exactly; subtracting 2^(23−p) + z
// (one FADD per position, row and word) leaves q − z exactly: no shift per code (the 2026-11-23 kernel spent a SHF and
// two LOP3s per code on it).  Above M = 4 the FMAs dominate and the codes are shifted to bit 0 instead.
// Asynchronous mode (Alg. 1): the 16-byte code loads of tile t+1 are issued first, then the FMAs of tile t
// run, then the scales of tile t+1 are dequantized (meta and second-order loads, mostly L1 hits, plus the
// arithmetic) while those codes are still in flight: scale work hides under the weight loads.  Synchronous
// mode runs the same code in the order the paper calls synchronous: dequantize the scales of tile t, then
// load its codes (the load address carries a data dependency on the scales so the compiler cannot hoist it),
// then the FMAs.  Both modes do the same arithmetic in the same order: bitwise identical results.
//
// Outliers (CSR; 2-bit groups by default, any column works) are fused: after its main loop each block adds, in CSR order, the
// outliers of its rows whose column lies in its K span, reading x from shared memory.  Split partials are
// summed in slice order by common.cuh's reduce_splits, a second launch: deterministic, fp32 accumulation throughout.
// (Summing them in each row tile's last block instead, 2026-11-27, was slower on the H200: 30.9 -> 33.7 µs at 8192²,
// M = 1, as it was for the LUT GEMV and the QUICK GEMM; one block then reads a whole tile's partials.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "../_cuda/rotation.cuh"
#include "mixed_gemv.h"

namespace qlinear {
namespace mixed {
namespace {

__device__ __forceinline__ unsigned word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}
__device__ __forceinline__ float elem(const float4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Word table entry (shared memory): group | word-in-group << 20 | is_4bit << 31.
__device__ __forceinline__ int entry_group(int e) { return e & 0xFFFFF; }
__device__ __forceinline__ bool entry_is4(int e) { return e < 0; }
__device__ __forceinline__ int entry_kstart(int e, int gs) {
  return entry_group(e) * gs + ((e >> 20) & 0x7FF) * (entry_is4(e) ? 8 : 16);
}

// 2^(23 − p) as float bits: its mantissa LSB weighs 2^−p, so a code at bits p.. of the mantissa reads as its value.
__host__ __device__ constexpr unsigned magic_bits(int p) { return (unsigned)(150 - p) << 23; }

struct Rows {
  int n[2];                // the two rows (clamped to N - 1 for loads of inactive threads)
  int chunk[2];            // row / scale_group_size: the rows' second-order pairs are sq[chunk][g]
};

// The 4 code words of tile t for row n: full tiles [Tf][N][4], the tail tile [N][tail].
__device__ __forceinline__ uint4 load_tile(const MixedGemvArgs& a, int t, int n, int full_tiles, int tail) {
  if (t < full_tiles) return __ldg(reinterpret_cast<const uint4*>(a.codes) + (size_t)t * a.N + n);
  const unsigned* p = a.codes + (size_t)full_tiles * a.N * 4 + (size_t)n * tail;
  uint4 v = make_uint4(__ldg(p), 0u, 0u, 0u);
  if (tail > 1) v.y = __ldg(p + 1);
  if (tail > 2) v.z = __ldg(p + 2);
  return v;
}

// Two consecutive meta words of one row, kept across words (records of consecutive groups share them).
struct MetaWindow {
  int j;
  unsigned lo, hi;
};

__device__ __forceinline__ unsigned meta_record(const MixedGemvArgs& a, int n, int off, MetaWindow& w) {
  const int j = off >> 5;
  if (j != w.j) {  // uniform: every thread reads the same group
    w.lo = (j == w.j + 1) ? w.hi : __ldg(a.meta + (size_t)j * a.N + n);
    w.hi = (j + 1 < a.MW) ? __ldg(a.meta + (size_t)(j + 1) * a.N + n) : 0u;
    w.j = j;
  }
  return __funnelshift_r(w.lo, w.hi, off & 31);
}

// Second-order dequantization of the first-order scale of each word of tile t, for both rows: s = ŝ, z = the zero
// point as float.
__device__ __forceinline__ void tile_scales(const MixedGemvArgs& a, const int* wt, int w_begin, int w_end, int t,
                                            const Rows& rows, MetaWindow (&win)[2], float (&s)[4][2],
                                            float (&z)[4][2]) {
  const unsigned smask = (1u << a.scale_bits) - 1u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = 4 * t + j;
#pragma unroll
    for (int r = 0; r < 2; ++r) { s[j][r] = 0.f; z[j][r] = 0.f; }
    if (w >= w_end) continue;
    const int e = wt[w - w_begin];
    const int g = entry_group(e);
    const int zb = entry_is4(e) ? 4 : 2;
    const int off = __ldg(a.gtab + g) & 0x7FFFFFFF;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned rec = meta_record(a, rows.n[r], off, win[r]);
      const unsigned pair = __ldg(a.sq + (size_t)rows.chunk[r] * a.G + g);
      const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&pair));
      s[j][r] = fmaf(sz.x, (float)((rec >> zb) & smask), sz.y);
      z[j][r] = (float)(rec & ((1u << zb) - 1u));
    }
  }
}

// dot[r][m] = Σ_i (q_i − z_r)·x[m][i] over the 32/BITS codes of word wd[r] (code i at bits BITS·i).  Order: per run of
// 4 positions of a half-word, the low half's 4 codes, then the high half's.
// A code at bit p of its half-word is OR-ed in place into the mantissa of 2^(23 − p) (one LOP3, no shift) and
// c = 2^(23 − p) + z is subtracted: q − z exactly.
template <int BITS, int M>
__device__ __forceinline__ void word_dot(const unsigned (&wd)[2], const float (&z)[2], const float* xw, int span,
                                         float (&dot)[2][M]) {
  constexpr int kHalf = 16 / BITS;  // codes per 16-bit half-word
  constexpr unsigned kMask = (1u << BITS) - 1u;
#pragma unroll
  for (int i4 = 0; i4 < kHalf / 4; ++i4) {
    float c[2][4];
#pragma unroll
    for (int ii = 0; ii < 4; ++ii)
#pragma unroll
      for (int r = 0; r < 2; ++r) c[r][ii] = __uint_as_float(magic_bits(BITS * (4 * i4 + ii))) + z[r];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float f[2][4];
#pragma unroll
      for (int ii = 0; ii < 4; ++ii) {
        const int p = BITS * (4 * i4 + ii);
#pragma unroll
        for (int r = 0; r < 2; ++r)
          f[r][ii] = __uint_as_float(and_or(wd[r] >> (16 * h), kMask << p, magic_bits(p))) - c[r][ii];
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4 xv = *reinterpret_cast<const float4*>(xw + m * span + h * kHalf + 4 * i4);
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
#pragma unroll
          for (int r = 0; r < 2; ++r) dot[r][m] = fmaf(f[r][ii], elem(xv, ii), dot[r][m]);
      }
    }
  }
}

// acc[r][m] += Σ over the words of tile t of ŝ·Σ_i (q_i − z)·x[m][k_i].
template <int M>
__device__ __forceinline__ void tile_fma(const int* wt, int w_begin, int w_end, int t, int gs, int k_lo, int span,
                                         const float* xs, const uint4 (&code)[2], const float (&s)[4][2],
                                         const float (&z)[4][2], float (&acc)[2][M]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = 4 * t + j;
    if (w >= w_end) break;
    const int e = wt[w - w_begin];
    const float* xw = xs + (entry_kstart(e, gs) - k_lo);
    const unsigned wd[2] = {word_of(code[0], j), word_of(code[1], j)};
    float dot[2][M];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) dot[r][m] = 0.f;
    if (!entry_is4(e)) {
      word_dot<2, M>(wd, z[j], xw, span, dot);  // 16 2-bit codes: code i at bits 2i
    } else {
      word_dot<4, M>(wd, z[j], xw, span, dot);  // 8 4-bit codes: code i at bits 4i
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = fmaf(s[j][r], dot[r][m], acc[r][m]);
  }
}


__device__ __forceinline__ int span_of(int M, int K, int tiles_per_split) {
  return min(K, 64 * tiles_per_split);  // a tile covers at most 4 words × 16 inputs
}

// ROT: a rotated layer, whose blocks stage R·x themselves (an instantiation of its own: an unrotated one with a runtime
// branch spills in its main loop).
template <typename T, int M, bool ASYNC, bool ROT>
__global__ void __launch_bounds__(M == 8 ? kMaxThreadsM8 : 256, M == 8 ? 3 : M <= (ROT ? 1 : 2) ? 3 : 2)
    mixed_gemv_kernel(const MixedGemvArgs a, const Rotation rot) {
  extern __shared__ float4 smem4[];
  const int span = span_of(M, a.K, a.tiles_per_split);
  float* xs = reinterpret_cast<float*>(smem4);            // [M][span]
  int* wt = reinterpret_cast<int*>(xs + M * span);          // [4 · tiles_per_split]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = a.N, gs = a.group_size;
  const int tiles = (a.W + 3) / 4, full_tiles = a.W / 4, tail = a.W - 4 * full_tiles;
  const int t_begin = blockIdx.y * a.tiles_per_split;
  const int t_end = min(t_begin + a.tiles_per_split, tiles);
  const int w_begin = 4 * t_begin, w_end = min(4 * t_end, a.W);

  {  // expand the group table into this slice's word table: group g starts at word (g + n4)·gs/16
    const int rec2 = 2 + a.scale_bits;
    auto first_word = [&](int g, int e) { return (g + ((e & 0x7FFFFFFF) - g * rec2) / 2) * (gs / 16); };
    int lo = 0, hi = a.G - 1;  // the group holding word w_begin: the last g with first_word(g) <= w_begin
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_word(mid, __ldg(a.gtab + mid)) <= w_begin) lo = mid; else hi = mid - 1;
    }
    for (int g = lo + tid; g < a.G; g += blockDim.x) {
      const int e = __ldg(a.gtab + g), fw = first_word(g, e);
      if (fw >= w_end) break;
      const int nw = e < 0 ? gs / 8 : gs / 16;
      for (int j = max(0, w_begin - fw); j < nw && fw + j < w_end; ++j) {
        wt[fw + j - w_begin] = g | (j << 20) | (int)((unsigned)e & 0x80000000u);
      }
    }
  }
  __syncthreads();
  const int e_last = wt[w_end - 1 - w_begin];
  const int k_lo = entry_kstart(wt[0], gs);
  const int k_hi = entry_kstart(e_last, gs) + (entry_is4(e_last) ? 8 : 16);
  const T* x = static_cast<const T*>(a.x);
  if constexpr (ROT) {  // R·x of the span, rounded to T as the op's separate transform would, in a work area after wt
    float* work = reinterpret_cast<float*>(smem4) + mixed_gemv_smem_bytes(M, a.K, a.tiles_per_split, 0) / 4;
    stage_rotated<T, float>(x, a.K, M, k_lo, k_hi, rot, work, xs, span);
  } else {
    for (int i = tid; i < M * (k_hi - k_lo); i += blockDim.x) {
      const int m = i / (k_hi - k_lo), k = i - m * (k_hi - k_lo);
      xs[m * span + k] = to_float<T>(x[(size_t)m * a.K + k_lo + k]);
    }
    __syncthreads();
  }

  const int row0 = blockIdx.x * (2 * blockDim.x) + warp * 64 + lane;
  const bool active[2] = {row0 < N, row0 + 32 < N};
  if (!active[0]) return;  // no barrier below
  Rows rows;
  MetaWindow win[2] = {{-2, 0u, 0u}, {-2, 0u, 0u}};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rows.n[r] = min(row0 + 32 * r, N - 1);
    rows.chunk[r] = rows.n[r] / a.scale_group_size;
  }
  float acc[2][M];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;

  if (ASYNC) {
    uint4 nxt[2];
    float s[4][2], z[4][2];
#pragma unroll
    for (int r = 0; r < 2; ++r) nxt[r] = load_tile(a, t_begin, rows.n[r], full_tiles, tail);
    tile_scales(a, wt, w_begin, w_end, t_begin, rows, win, s, z);
    for (int t = t_begin; t < t_end; ++t) {
      const uint4 cur[2] = {nxt[0], nxt[1]};
      const bool more = t + 1 < t_end;
      if (more) {  // issue the codes of tile t+1 first: they stay in flight through the rest of this iteration
#pragma unroll
        for (int r = 0; r < 2; ++r) nxt[r] = load_tile(a, t + 1, rows.n[r], full_tiles, tail);
      }
      tile_fma<M>(wt, w_begin, w_end, t, gs, k_lo, span, xs, cur, s, z, acc);
      // second-order dequantization of tile t+1's scales while its codes are still loading
      if (more) tile_scales(a, wt, w_begin, w_end, t + 1, rows, win, s, z);
    }
  } else {
    for (int t = t_begin; t < t_end; ++t) {
      float s[4][2], z[4][2];
      tile_scales(a, wt, w_begin, w_end, t, rows, win, s, z);
      // Data dependency on the dequantized scale: the code load cannot start before the scales are done
      // (ŝ never has this NaN bit pattern, so tt == t).
      const int tt = t + (__float_as_uint(s[0][0]) == 0xFFFFFFFFu ? 1 : 0);
      uint4 cur[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) cur[r] = load_tile(a, tt, rows.n[r], full_tiles, tail);
      tile_fma<M>(wt, w_begin, w_end, t, gs, k_lo, span, xs, cur, s, z, acc);
    }
  }

  if (a.outlier_values != nullptr) {  // fused outliers: this block's rows, columns in [k_lo, k_hi), CSR order
    const __half* vals = static_cast<const __half*>(a.outlier_values);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!active[r]) continue;
      int lo = __ldg(a.outlier_row_ptr + rows.n[r]), hi = __ldg(a.outlier_row_ptr + rows.n[r] + 1);
      auto col_at = [&](int i) -> int {
        return a.cols_int32 ? __ldg(static_cast<const int*>(a.outlier_cols) + i)
                            : (int)__ldg(static_cast<const unsigned short*>(a.outlier_cols) + i);
      };
      int b = lo, e = hi;  // first index with column >= k_lo
      while (b < e) {
        const int mid = (b + e) >> 1;
        if (col_at(mid) < k_lo) b = mid + 1; else e = mid;
      }
      for (int i = b; i < hi; ++i) {
        const int col = col_at(i);
        if (col >= k_hi) break;
        const float v = __half2float(vals[i]);
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = fmaf(v, xs[m * span + col - k_lo], acc[r][m]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!active[r]) continue;
    const int n = rows.n[r];
    if (a.splits == 1) {
      T* y = static_cast<T*>(a.y);
      const float b = a.bias ? a.bias[n] : 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) y[(size_t)m * N + n] = from_float<T>(acc[r][m] + b);
    } else {
#pragma unroll
      for (int m = 0; m < M; ++m) a.partial[((size_t)blockIdx.y * M + m) * N + n] = acc[r][m];
    }
  }
}

template <typename T, int M, bool ASYNC>
cudaError_t launch(const MixedGemvArgs& a, const Rotation& rot, cudaStream_t stream) {
  const size_t smem = mixed_gemv_smem_bytes(M, a.K, a.tiles_per_split, rot.block);
  const auto kernel = rot.block ? mixed_gemv_kernel<T, M, ASYNC, true> : mixed_gemv_kernel<T, M, ASYNC, false>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(mixed_gemv_tiles(a.N, a.threads), a.splits);
  if ((a.splits > 1 && a.partial == nullptr) || (M == 8 && a.threads > kMaxThreadsM8)) return cudaErrorInvalidValue;
  kernel<<<grid, a.threads, smem, stream>>>(a, rot);
  if (a.splits > 1) reduce_splits<T>(a.partial, a.bias, DType::kFloat, a.y, a.splits, M, a.N, stream);
  return cudaGetLastError();
}

template <typename T, int M>
cudaError_t dispatch_async(const MixedGemvArgs& a, const Rotation& r, cudaStream_t s) {
  return a.async_dequant ? launch<T, M, true>(a, r, s) : launch<T, M, false>(a, r, s);
}

template <typename T>
cudaError_t dispatch_m(const MixedGemvArgs& a, const Rotation& r, cudaStream_t s) {
  switch (a.M) {
    case 1: return dispatch_async<T, 1>(a, r, s);
    case 2: return dispatch_async<T, 2>(a, r, s);
    case 3: return dispatch_async<T, 3>(a, r, s);
    case 4: return dispatch_async<T, 4>(a, r, s);
    case 5: return dispatch_async<T, 5>(a, r, s);
    case 6: return dispatch_async<T, 6>(a, r, s);
    case 7: return dispatch_async<T, 7>(a, r, s);
    case 8: return dispatch_async<T, 8>(a, r, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t mixed_gemv(const MixedGemvArgs& a, const Rotation& rot, cudaStream_t stream) {
  const int tiles = (a.W + 3) / 4;
  if (a.K % 16 || a.group_size % 16 || a.threads % 32 || a.threads < 32 || a.threads > 256 || a.W < 1 ||
      a.tiles_per_split < 1 || a.splits < 1 || (a.splits - 1) * a.tiles_per_split >= tiles ||
      a.splits * a.tiles_per_split < tiles || a.scale_bits < 1 || a.scale_bits > 8 || a.scale_group_size < 1 ||
      rotation_invalid(rot)) {
    return cudaErrorInvalidValue;
  }
  if (a.x_dtype == DType::kHalf) return dispatch_m<__half>(a, rot, stream);
  if (a.x_dtype == DType::kBFloat16) return dispatch_m<__nv_bfloat16>(a, rot, stream);
  return cudaErrorInvalidValue;
}

}  // namespace mixed
}  // namespace qlinear
