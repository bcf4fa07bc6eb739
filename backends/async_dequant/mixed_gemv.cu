// GEMV for the mixed 2/4/16 format (2/4/16-bit paper: intra-matrix 2-bit/4-bit groups, second-order
// quantized scales, fp16 outliers in 2-bit groups) with asynchronous dequantization (paper §5, Alg. 1).
//
// Registers: __launch_bounds__(256, 3) at M = 1 (≤ 80 registers, 768 resident threads per SM), (256, 2) above (≤ 128
// registers, 512 threads; at 80 the M = 2 kernel spills), (128, 3) at M = 8 (≤ 168 registers, 384 threads); ptxas -v
// shows no spills for sm_80 and sm_90a (tests/test_native_build.py).
//
// Work split: a thread owns 2 rows (lane and lane + 32 of its warp's 64 rows).  A block owns 2·threads rows and
// `tiles_per_split` consecutive tiles of 4 code words (gridDim.y = split-K slices).  Per tile and row one load stage
// brings everything the tile needs: its 16 bytes of codes (layout [Tf][N][4]: a warp reads two 512-byte segments),
// the meta window holding its groups' records (2-3 coalesced words) and the second-order pairs of its words (one
// 4-16-byte load).  The block copies its slice of the per-layer word and tile tables into shared memory (group kinds are the
// same for every row, so one table drives every thread: every branch on a table entry is uniform across the block).
//
// Products on half2 (the recipe of the fastest fp16 GEMVs: two codes per instruction).  Each block stages its slice of
// x once in fp32 (R·x for a rotated layer), then as fp16 scaled per row of x by 2^s with max |x·2^s| <= 1024 (exact for
// fp16 and bf16 inputs but below fp16's normal range; no word's half2 sum can overflow: 8·3·1024 or 4·15·1024 < 65504), the inputs i and i + n/2 of
// each word of n codes side by side.  A word holds 16 2-bit codes or 8 4-bit codes; code i of each 16-bit half-word is
// OR-ed in place (one LOP3 for both halves) into the mantissa of 2^(10 − p) (p its bit position: 0..6 of the word, then
// of the word >> 8), and one HSUB2 of 2^(10 − p) + z leaves q − z exactly; one HFMA2 per code pair and row of x adds it
// times x into the word's half2 sum (fp16 rounding, at most 8 products per lane).  Per word and row:
//   ŝ = fma(scale_scale, scale_code, scale_zero)   (second-order dequantization, fp32)
//   acc = fma(ŝ, lo + hi, acc)                      (fp32), and acc·2^−s at the end
// Asynchronous mode (Alg. 1): the loads of tile t+1 are issued first, then tile t's arithmetic runs, then tile t+1's
// scales and zeros are dequantized.  Synchronous mode runs the same code in the order the paper calls synchronous:
// tile t's records and pairs loaded and dequantized, then its codes loaded (the load address carries a data dependency
// on the scales so the compiler cannot hoist it), then the arithmetic.  Same arithmetic in the same order: bitwise
// identical results.  (The kernel before, fp32 products and the records read group by group through a moving meta
// window, issued about 7.6 instructions per weight at the format's defaults; this one about 4.75, RESULTS.md.)
//
// Outliers (CSR; 2-bit groups by default, any column works) are fused: after its main loop each block adds, in CSR
// order and fp32, the outliers of its rows whose column lies in its K span, reading x from shared memory.  Split
// partials are summed in slice order by common.cuh's reduce_splits, a second launch: deterministic.
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
__device__ __forceinline__ __half2 as_h2(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }

// Word table entry (shared memory): first input | record bit in the tile's meta window << 20 | pair slot << 27 |
// same group as the tile's previous word << 30 | is_4bit << 31.
__device__ __forceinline__ int entry_k(int e) { return e & 0xFFFFF; }
__device__ __forceinline__ int entry_rbit(int e) { return (e >> 20) & 0x7F; }
__device__ __forceinline__ int entry_slot(int e) { return (e >> 27) & 3; }
__device__ __forceinline__ bool entry_cont(int e) { return (e >> 30) & 1; }
__device__ __forceinline__ bool entry_is4(int e) { return e < 0; }

// fp16 bits of 2^(10 − p) in both halves: its mantissa LSB weighs 2^−p, so a code at bits p.. of the mantissa reads as
// its value; and of 2^(10 − p) − 1024 (p > 0), which turns 2^10 + z into 2^(10 − p) + z exactly.
__host__ __device__ constexpr unsigned magic2(int p) { return ((25u - p) << 10) * 0x10001u; }
__host__ __device__ constexpr unsigned shift2(int p) { return (0xE000u | (unsigned)((1024 - (1 << (10 - p)) - 512) * 2)) * 0x10001u; }

struct Rows {
  int n[2];                // the two rows (clamped to N - 1 for loads of inactive threads)
  int chunk[2];            // row / scale_group_size: the rows' second-order pairs are sq[t][chunk][j]
};

// One tile's loads for the two rows: codes, the meta window from word ttab[t], second-order pairs.
struct Stage {
  uint4 code[2];
  unsigned win[2][3];
  uint4 sq[2];
};

// The 4 code words of tile t for row n: full tiles [Tf][N][4], the tail tile [N][tail].  Indices are 32-bit (the binding
// refuses N·W >= 2^31): one multiply-add and one widening per address.
__device__ __forceinline__ uint4 load_tile(const MixedGemvArgs& a, int t, int n, int full_tiles, int tail) {
  if (t < full_tiles) return __ldg(reinterpret_cast<const uint4*>(a.codes) + (unsigned)(t * a.N + n));
  const unsigned* p = a.codes + (unsigned)(full_tiles * a.N * 4 + n * tail);
  uint4 v = make_uint4(__ldg(p), 0u, 0u, 0u);
  if (tail > 1) v.y = __ldg(p + 1);
  if (tail > 2) v.z = __ldg(p + 2);
  return v;
}

__device__ __forceinline__ void load_codes(const MixedGemvArgs& a, int t, const Rows& rows, int full_tiles, int tail,
                                           Stage& st) {
#pragma unroll
  for (int r = 0; r < 2; ++r) st.code[r] = load_tile(a, t, rows.n[r], full_tiles, tail);
}

// The meta window (words j0, j0 + 1 and, with 8-bit scale codes, j0 + 2; 0 past the stream) and the P pairs of tile t,
// as word j's pair in component j: P = 4 stores them so; with P < 4 the tile's group slots (wt: its word entries,
// nw valid) pick them.
__device__ __forceinline__ void load_meta(const MixedGemvArgs& a, int t, int j0, const int* wt, int nw, const Rows& rows,
                                          Stage& st) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const unsigned i = (unsigned)(j0 * a.N + rows.n[r]);
    st.win[r][0] = __ldg(a.meta + i);
    st.win[r][1] = j0 + 1 < a.MW ? __ldg(a.meta + (i + a.N)) : 0u;
    st.win[r][2] = a.scale_bits > 4 && j0 + 2 < a.MW ? __ldg(a.meta + (i + 2 * a.N)) : 0u;
    const unsigned* q = a.sq + (unsigned)((t * a.S2 + rows.chunk[r]) * a.P);
    if (a.P == 4) {
      st.sq[r] = __ldg(reinterpret_cast<const uint4*>(q));
    } else {
      const uint2 v = a.P == 2 ? __ldg(reinterpret_cast<const uint2*>(q)) : make_uint2(__ldg(q), 0u);
      unsigned p[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = j < nw && entry_slot(wt[j]) ? v.y : v.x;
      st.sq[r] = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
}

// Second-order dequantization of the first-order scale of each word of tile t, for both rows: s = ŝ, zc = 2^10 + z as
// half2 bits (both halves).
__device__ __forceinline__ void tile_scales(const MixedGemvArgs& a, const int* wt, int w_begin, int w_end, int t,
                                            const Stage& st, float (&s)[4][2], unsigned (&zc)[4][2]) {
  const unsigned smask = (1u << a.scale_bits) - 1u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = 4 * t + j;
    if (w >= w_end) break;  // the tail tile's missing words: tile_fma stops there too
    const int e = wt[w - w_begin], rb = entry_rbit(e);
    if (j > 0 && entry_cont(e)) {  // a 4-bit group's second word: the same scale and zero
#pragma unroll
      for (int r = 0; r < 2; ++r) { s[j][r] = s[j - 1][r]; zc[j][r] = zc[j - 1][r]; }
      continue;
    }
    const int zb = entry_is4(e) ? 4 : 2;
    const unsigned zmask = ((1u << zb) - 1u) * 0x10001u;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned lo = rb < 32 ? st.win[r][0] : st.win[r][1], hi = rb < 32 ? st.win[r][1] : st.win[r][2];
      const unsigned rec = __funnelshift_r(lo, hi, rb);
      const float2 sz = __half22float2(as_h2(word_of(st.sq[r], j)));
      s[j][r] = fmaf(sz.x, (float)((rec >> zb) & smask), sz.y);
      zc[j][r] = and_or(__byte_perm(rec, 0u, 0x4040), zmask, magic2(0));  // the record's low byte in both halves
    }
  }
}

// dot[r][m] = Σ_i (q_i − z_r)·x'[m][i] over the 32/BITS codes of word wd[r] (code i at bits BITS·i): half2 lanes, the
// low one code i of the low half-word times input i, the high one code i of the high half-word times input i + 16/BITS
// (xw holds them side by side), fp16 FMAs in order of i, then lo + hi in fp32.
template <int BITS, int M>
__device__ __forceinline__ void word_dot(const unsigned (&wd)[2], const unsigned (&zc)[2], const __half2* xw, int span2,
                                         float (&dot)[2][M]) {
  constexpr int kPairs = 16 / BITS;  // code pairs per word
  constexpr int kPos = 8 / BITS;     // code positions within a byte: the word gives kPos pairs, the word >> 8 the rest
  constexpr unsigned kMask = ((1u << BITS) - 1u) * 0x10001u;
  __half2 c[2][kPos];  // 2^(10 − BITS·p) + z
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    c[r][0] = as_h2(zc[r]);
#pragma unroll
    for (int p = 1; p < kPos; ++p) c[r][p] = __hadd2(c[r][0], as_h2(shift2(BITS * p)));
  }
  __half2 h[2][M];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) h[r][m] = as_h2(0u);
#pragma unroll
  for (int i4 = 0; i4 < kPairs; i4 += 4) {  // 4 pairs per 16-byte load of x'
    uint4 xv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) xv[m] = *reinterpret_cast<const uint4*>(xw + m * span2 + i4);
#pragma unroll
    for (int ii = 0; ii < 4; ++ii) {
      const int i = i4 + ii, p = BITS * (i % kPos);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const unsigned src = i < kPos ? wd[r] : wd[r] >> 8;
        const __half2 d = __hsub2(as_h2(and_or(src, kMask << p, magic2(p))), c[r][i % kPos]);
#pragma unroll
        for (int m = 0; m < M; ++m) h[r][m] = __hfma2(d, as_h2(word_of(xv[m], ii)), h[r][m]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) dot[r][m] = __low2float(h[r][m]) + __high2float(h[r][m]);
}

// acc[r][m] += Σ over the words of tile t of ŝ·Σ_i (q_i − z)·x'[m][k_i].
template <int M>
__device__ __forceinline__ void tile_fma(const int* wt, int w_begin, int w_end, int t, int k_lo, int span2,
                                         const __half2* xh, const uint4 (&code)[2], const float (&s)[4][2],
                                         const unsigned (&zc)[4][2], float (&acc)[2][M]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = 4 * t + j;
    if (w >= w_end) break;
    const int e = wt[w - w_begin];
    const __half2* xw = xh + (entry_k(e) - k_lo) / 2;
    const unsigned wd[2] = {word_of(code[0], j), word_of(code[1], j)};
    float dot[2][M];
    if (!entry_is4(e)) {
      word_dot<2, M>(wd, zc[j], xw, span2, dot);
    } else {
      word_dot<4, M>(wd, zc[j], xw, span2, dot);
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

// 2^s (inverse: 2^−s) for a row of x whose largest non-NaN |x| has float bits `amax`: max |x·2^s| <= 1024, s <= 126;
// s = 0 for 0, inf or NaN (async_dequant.x_scale_exponent).
__device__ __forceinline__ float x_scale(unsigned amax, bool inverse) {
  const int e = (int)((amax >> 23) & 255u);
  const int s = amax == 0u || e == 255 ? 0 : min(126, 136 - max(e, 1));
  return __uint_as_float((unsigned)(127 + (inverse ? -s : s)) << 23);
}

// ROT: a rotated layer, whose blocks stage R·x themselves (an instantiation of its own: an unrotated one with a runtime
// branch spills in its main loop).
template <typename T, int M, bool ASYNC, bool ROT>
__global__ void __launch_bounds__(M == 8 ? kMaxThreadsM8 : 256, M == 8 || M == 1 ? 3 : 2)
    mixed_gemv_kernel(const MixedGemvArgs a, const Rotation rot) {
  extern __shared__ float4 smem4[];
  const int span = span_of(M, a.K, a.tiles_per_split), span2 = span / 2;
  float* xs = reinterpret_cast<float*>(smem4);                          // [M][span] fp32
  __half2* xh = reinterpret_cast<__half2*>(xs + M * span);              // [M][span2] scaled fp16, word pairs
  int* wt = reinterpret_cast<int*>(xh + M * span2);                     // [4 · tiles_per_split] word table slice
  int* tt = wt + 4 * a.tiles_per_split;                                 // [tiles_per_split] tile table slice
  unsigned* amax = reinterpret_cast<unsigned*>(tt + a.tiles_per_split);  // [8] float bits of max |x| per row of x

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int N = a.N;
  const int tiles = (a.W + 3) / 4, full_tiles = a.W / 4, tail = a.W - 4 * full_tiles;
  const int t_begin = blockIdx.y * a.tiles_per_split;
  const int t_end = min(t_begin + a.tiles_per_split, tiles);
  const int w_begin = 4 * t_begin, w_end = min(4 * t_end, a.W), nw = w_end - w_begin;
  {
    const int* wtab = a.tab + a.G;
    for (int i = tid; i < nw; i += blockDim.x) wt[i] = __ldg(wtab + w_begin + i);
    for (int i = tid; i < t_end - t_begin; i += blockDim.x) tt[i] = __ldg(wtab + a.W + t_begin + i);
    if (tid < M) amax[tid] = 0u;
  }
  __syncthreads();
  const int e_last = wt[nw - 1];
  const int k_lo = entry_k(wt[0]), k_hi = entry_k(e_last) + (entry_is4(e_last) ? 8 : 16);
  const T* x = static_cast<const T*>(a.x);
  if constexpr (ROT) {  // R·x of the span, rounded to T as the op's separate transform would, in a work area after amax
    float* work = reinterpret_cast<float*>(smem4) + mixed_gemv_smem_bytes(M, a.K, a.tiles_per_split, 0) / 4;
    stage_rotated<T, float>(x, a.K, M, k_lo, k_hi, rot, work, xs, span);
  } else {
    for (int i = tid; i < M * (k_hi - k_lo); i += blockDim.x) {
      const int m = i / (k_hi - k_lo), k = i - m * (k_hi - k_lo);
      xs[m * span + k] = to_float<T>(x[(size_t)m * a.K + k_lo + k]);
    }
    __syncthreads();
  }
  for (int m = 0; m < M; ++m) {  // the rows' largest |x| (fmaxf skips NaN), then x' = x·2^s as fp16, word pairs
    float mx = 0.f;
    for (int k = tid; k < k_hi - k_lo; k += blockDim.x) mx = fmaxf(mx, fabsf(xs[m * span + k]));
    if (mx > 0.f) atomicMax(amax + m, __float_as_uint(mx));
  }
  __syncthreads();
  for (int i = tid; i < M * nw; i += blockDim.x) {
    const int m = i / nw, e = wt[i - m * nw], k0 = entry_k(e) - k_lo, half = entry_is4(e) ? 4 : 8;
    const float sc = x_scale(amax[m], false);
    const float* src = xs + m * span + k0;
    for (int p = 0; p < half; ++p) xh[m * span2 + k0 / 2 + p] = __floats2half2_rn(src[p] * sc, src[half + p] * sc);
  }
  __syncthreads();

  const int row0 = blockIdx.x * (2 * blockDim.x) + warp * 64 + lane;
  const bool active[2] = {row0 < N, row0 + 32 < N};
  if (!active[0]) return;  // no barrier below
  Rows rows;
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

  float s[4][2];
  unsigned zc[4][2];
  if (ASYNC) {
    Stage nxt;
    load_codes(a, t_begin, rows, full_tiles, tail, nxt);
    load_meta(a, t_begin, tt[0], wt, min(4, nw), rows, nxt);
    tile_scales(a, wt, w_begin, w_end, t_begin, nxt, s, zc);
    for (int t = t_begin; t < t_end; ++t) {
      const uint4 cur[2] = {nxt.code[0], nxt.code[1]};
      const bool more = t + 1 < t_end;
      if (more) {  // issue tile t+1's loads first: they stay in flight through the rest of this iteration
        load_codes(a, t + 1, rows, full_tiles, tail, nxt);
        load_meta(a, t + 1, tt[t + 1 - t_begin], wt + 4 * (t + 1 - t_begin), min(4, nw - 4 * (t + 1 - t_begin)), rows, nxt);
      }
      tile_fma<M>(wt, w_begin, w_end, t, k_lo, span2, xh, cur, s, zc, acc);
      // second-order dequantization of tile t+1's scales once its records and pairs have arrived
      if (more) tile_scales(a, wt, w_begin, w_end, t + 1, nxt, s, zc);
    }
  } else {
    for (int t = t_begin; t < t_end; ++t) {
      Stage st;
      load_meta(a, t, tt[t - t_begin], wt + 4 * (t - t_begin), min(4, nw - 4 * (t - t_begin)), rows, st);
      tile_scales(a, wt, w_begin, w_end, t, st, s, zc);
      // Data dependency on the dequantized scale: the code load cannot start before the scales are done
      // (ŝ never has this NaN bit pattern, so tt == t).
      const int t2 = t + (__float_as_uint(s[0][0]) == 0xFFFFFFFFu ? 1 : 0);
      load_codes(a, t2, rows, full_tiles, tail, st);
      tile_fma<M>(wt, w_begin, w_end, t, k_lo, span2, xh, st.code, s, zc, acc);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const float inv = x_scale(amax[m], true);
#pragma unroll
    for (int r = 0; r < 2; ++r) acc[r][m] *= inv;
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
      const float b = a.bias ? bias_at<T>(a.bias, a.bias_dtype, n) : 0.f;
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
  if (a.splits > 1) reduce_splits<T>(a.partial, a.bias, a.bias_dtype, a.y, a.splits, M, a.N, stream);
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
  if (a.K % 16 || a.K >= (1 << 20) || (a.P != 1 && a.P != 2 && a.P != 4) || a.group_size % 16 || a.threads % 32 || a.threads < 32 || a.threads > 256 || a.W < 1 ||
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
