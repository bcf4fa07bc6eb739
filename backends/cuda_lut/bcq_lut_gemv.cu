// LUT GEMV for BCQ weights (LUT-GEMM / nuQmm, Park et al., section 3), decode batches M = 1..8.
//
// Why a table: a BCQ weight is Σ_q α_q·b_q + c with b_q = ±1, so for one bit-plane and 8 consecutive
// inputs, Σ_j b_j·x_j takes one of 256 values.  Each block computes those 256 partial sums for every
// 8 inputs of its K tile once (in fp32, shared memory) and then every weight byte of every plane of
// every row it owns is a single table lookup instead of 8 multiply-adds.  One warp builds a table in
// registers as T[b] = lo[b & 31] + hi[b >> 5] (lo over inputs 0..4, hi over 5..7), reading its 8 inputs
// straight from x (one 16-byte load); the table is antisymmetric (T[255 - b] = -T[b], exactly, since
// rounding is symmetric), so each lane computes 4 sums and stores 8 entries, conflict-free.  Lookups are
// random per lane (~3.2 shared-memory wavefronts per warp lookup for uniform bytes).
//
// Memory pipeline (the kernel is bound by the weight stream, so it keeps it in flight): a thread owns 4
// consecutive output rows and, per K tile of W words (32 inputs each), holds the tile's plane words
// (one 16-byte load per plane and word gives the 4 rows), α and offsets in registers.  The first tile's
// loads are issued before any table is built; as soon as word w of tile t has been looked up, word w of
// tile t+1 is loaded into the same registers, so W·Q 16-byte loads per thread stay in flight while the
// next tables are built.  The inputs of the next tile's tables are loaded right after the barrier too, so the
// lookups hide their latency.  Tables are double-buffered in shared memory: one barrier per tile.
//
// Work split: block = `threads` threads × 4 rows, K tiles of kt = 32·W inputs (W·Q ≤ 8 and W·M ≤ 8 bound
// the registers and the tables), gridDim.y = split-K slices of `tiles_per_split` tiles so small layers
// still fill the GPU.  With splits > 1 each slice writes fp32 partial sums and a second kernel adds them
// in slice order (common.cuh's reduce_splits), so the result is deterministic.  Accumulation is fp32 throughout; α and
// the offset are applied per 32-input word (group_size is a multiple of 32, so a word has one group).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/common.cuh"
#include "../_cuda/rotation.cuh"
#include "bcq_lut_gemv.h"

namespace qlinear {
namespace {

__device__ __forceinline__ void half4_to_float(uint2 v, float out[4]) {
  const __half2 lo = *reinterpret_cast<const __half2*>(&v.x), hi = *reinterpret_cast<const __half2*>(&v.y);
  const float2 a = __half22float2(lo), b = __half22float2(hi);
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int r) {
  return r == 0 ? v.x : r == 1 ? v.y : r == 2 ? v.z : v.w;
}

// Entry (byte j of w) of table j of a word's four (inputs 8j..8j+7): written on byte addresses so that it compiles to
// PRMT + LEA + LDS with the table offset as the immediate.
__device__ __forceinline__ float lookup(const float* L, unsigned w, int j) {
  const char* base = reinterpret_cast<const char*>(L) + 1024 * j;
  return *reinterpret_cast<const float*>(base + 4 * __byte_perm(w, 0u, 0x4440u + j));
}

// The 8 inputs x[m, k .. k+7] (x[m, perm[k .. k+7]] for act_order layers), raw: 8 fp16/bf16 values in 16 bytes, from
// global memory or (`staged`: a rotated layer's R·x) shared memory.
template <typename T>
__device__ __forceinline__ uint4 load_x8(const T* x, const int* perm, bool vec, bool staged, int k) {
  if (vec) return staged ? *reinterpret_cast<const uint4*>(x + k) : __ldg(reinterpret_cast<const uint4*>(x + k));
  const unsigned short* xs = reinterpret_cast<const unsigned short*>(x);
  unsigned u[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int k0 = perm ? __ldg(perm + k + 2 * j) : k + 2 * j, k1 = perm ? __ldg(perm + k + 2 * j + 1) : k + 2 * j + 1;
    u[j] = (unsigned)xs[k0] | (unsigned)xs[k1] << 16;
  }
  return make_uint4(u[0], u[1], u[2], u[3]);
}

// Table of 8 inputs: lane t writes T[t + 32i] = lo[t] + hi[i] and T[255 - t - 32i] = -(lo[t] + hi[i]), i = 0..3.
template <typename T>
__device__ __forceinline__ void build_table(uint4 raw, int lane, float* tab) {
  const T* h = reinterpret_cast<const T*>(&raw);
  float xv[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) xv[j] = to_float<T>(h[j]);
  float lo = 0.f;
#pragma unroll
  for (int j = 0; j < 5; ++j) lo += ((lane >> j) & 1) ? xv[j] : -xv[j];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float hi = ((i & 1) ? xv[5] : -xv[5]) + ((i & 2) ? xv[6] : -xv[6]) + ((i & 4) ? xv[7] : -xv[7]);
    tab[lane + 32 * i] = lo + hi;
    tab[255 - lane - 32 * i] = -(lo + hi);
  }
}


// Layers of 5..8 planes share the kernels instantiated for kMaxQ, with their plane count read at run time (a.Q): few
// layers have them (8-bit GPTQ, an 8-bit output layer), and one instantiation per count would double the build.
constexpr int kMaxQ = 8;
template <int Q>
__device__ __forceinline__ int planes_of(const LutGemvArgs& a) { return Q <= 4 ? Q : a.Q; }
// Only the kMaxQ kernels take a uniform layer's scales: the 1..4-plane ones are at their register budget.
template <int Q>
__device__ __forceinline__ bool uniform_of(const LutGemvArgs& a) { return Q > 4 && a.uniform; }

// Registers of one K word for the 4 rows of a thread: the plane words, α (fp16; a uniform layer's scales in alpha[0])
// and the offset (raw bits).
template <int Q>
struct Word {
  uint4 bits[Q];
  uint2 alpha[Q];
  uint4 offset;
};

template <int Q>
__device__ __forceinline__ void load_word(Word<Q>& wd, const LutGemvArgs& a, int kword, int n0) {
  const int N = a.N, g = kword * 32 / a.group_size, nq = planes_of<Q>(a);
  const uint4* planes = reinterpret_cast<const uint4*>(a.planes);
  const uint2* alpha = reinterpret_cast<const uint2*>(a.alpha);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q >= nq) break;
    wd.bits[q] = __ldg(planes + ((size_t)kword * nq + q) * (N / 4) + n0 / 4);
    if (q == 0)  // a uniform layer's scales [G, N]: alpha[0] only (word_alpha reads it for every plane)
      wd.alpha[0] = __ldg(alpha + (size_t)g * (uniform_of<Q>(a) ? 1 : nq) * (N / 4) + n0 / 4);
    else if (!uniform_of<Q>(a))
      wd.alpha[q] = __ldg(alpha + ((size_t)g * nq + q) * (N / 4) + n0 / 4);
  }
  if (a.offset_dtype == DType::kHalf) {
    const uint2 o = __ldg(reinterpret_cast<const uint2*>(a.offset) + ((size_t)g * N + n0) / 4);
    wd.offset = make_uint4(o.x, o.y, 0u, 0u);
  } else if (a.offset_dtype == DType::kFloat) {
    wd.offset = __ldg(reinterpret_cast<const uint4*>(a.offset) + ((size_t)g * N + n0) / 4);
  }
}

// load_word's addresses into L2 (no registers held).
template <int Q>
__device__ __forceinline__ void prefetch_word(const LutGemvArgs& a, int kword, int n0) {
  const int N = a.N, g = kword * 32 / a.group_size, nq = planes_of<Q>(a);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q >= nq) break;
    prefetch_l2(a.planes + ((size_t)kword * nq + q) * N + n0);
    if (!uniform_of<Q>(a) || q == 0)
      prefetch_l2(static_cast<const unsigned short*>(a.alpha) + ((size_t)g * (uniform_of<Q>(a) ? 1 : nq) + q) * N + n0);
  }
  if (a.offset_dtype != DType::kNone)
    prefetch_l2(static_cast<const char*>(a.offset) + ((size_t)g * N + n0) * (a.offset_dtype == DType::kFloat ? 4 : 2));
}

// The 4 rows' α of a word's planes as float: the fp16 α, or a uniform layer's s·2^(q−1) (exact).
template <int Q>
__device__ __forceinline__ void word_alpha(const Word<Q>& wd, const LutGemvArgs& a, float (&al)[Q][4]) {
  const bool uniform = uniform_of<Q>(a);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q >= planes_of<Q>(a)) break;  // (planes past the layer's are never loaded, nor read)
    half4_to_float(uniform ? wd.alpha[0] : wd.alpha[q], al[q]);
    const float scale = uniform ? 0.5f * (float)(1 << q) : 1.f;
#pragma unroll
    for (int r = 0; r < 4; ++r) al[q][r] *= scale;
  }
}

// The 4 rows' offsets of a word as float (0 without offsets).
template <int Q>
__device__ __forceinline__ void word_offsets(const Word<Q>& wd, DType offset_dtype, float (&off)[4]) {
  off[0] = off[1] = off[2] = off[3] = 0.f;
  if (offset_dtype == DType::kHalf) {
    half4_to_float(make_uint2(wd.offset.x, wd.offset.y), off);
  } else if (offset_dtype == DType::kFloat) {
    off[0] = __uint_as_float(wd.offset.x); off[1] = __uint_as_float(wd.offset.y);
    off[2] = __uint_as_float(wd.offset.z); off[3] = __uint_as_float(wd.offset.w);
  }
}

// Two blocks per SM, but one for the kMaxQ kernels: their 8 plane words per row quad need more than 128 registers.
template <typename T, int M, int Q, int W>
__global__ void __launch_bounds__(256, lut_gemv_blocks_per_sm(Q)) lut_gemv_kernel(const LutGemvArgs a, const Rotation rot) {
  constexpr int kt = 32 * W, kTables = M * (kt / 8);  // tables per tile, [M][kt/8][256] floats per buffer
  // tables a warp loads the inputs of at once (plan() gives most warps at most two per tile; one where registers are short)
  constexpr int kXBatch = M * Q >= 16 ? 1 : 2;
  extern __shared__ __align__(16) float smem[];

  const T* x = static_cast<const T*>(a.x);
  const int N = a.N, K = a.K, tid = threadIdx.x, lane = tid & 31;
  const int n0 = (blockIdx.x * blockDim.x + tid) * 4;
  const bool active = n0 < N;
  const int tiles = (K + kt - 1) / kt;
  const int t_begin = blockIdx.y * a.tiles_per_split;
  const int t_end = min(t_begin + a.tiles_per_split, tiles);
  // a rotated layer reads R·x of its K slice [k_lo, k_lo + span) from shared memory, after the tables
  const int span = lut_gemv_rotated_span(K, kt, a.tiles_per_split, a.perm != nullptr);
  const int k_lo = a.perm ? 0 : t_begin * kt;
  T* xr = rot.block ? reinterpret_cast<T*>(reinterpret_cast<char*>(smem) +
                                             rotation_staged_offset(lut_gemv_smem_bytes(M, kt), rot.block))
                      : nullptr;
  const bool vec = a.perm == nullptr && (xr || (reinterpret_cast<size_t>(a.x) & 15) == 0);

  const int first_words = min(kt, K - t_begin * kt) / 32;
  if (xr) {  // R·x staged while the first tile's weights come into L2 (held in registers, they would spill)
    if (active)
      for (int w = 0; w < first_words; ++w) prefetch_word<Q>(a, t_begin * W + w, n0);
    stage_rotated<T, T>(x, K, M, k_lo, a.perm ? K : min(K, t_end * kt), rot, smem, xr, span);
  }
  const T* xsrc = xr ? xr - k_lo : x;  // row m of (R·)x at xsrc + m·ldx, input k at [k]
  const int ldx = xr ? span : K;
  Word<Q> wd[W];
  if (active) {
#pragma unroll
    for (int w = 0; w < W; ++w)
      if (w < first_words) load_word<Q>(wd[w], a, t_begin * W + w, n0);
  }

  float acc[M][4];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[m][r] = 0.f;

  // A warp builds tables tb = warp + u·warps (u = 0, 1, ...) of a tile; the inputs of its first kXBatch are loaded one
  // tile ahead (right after the barrier, so the lookups hide their latency), any further ones when they are built.
  const int warp = tid >> 5, warps = blockDim.x >> 5;
  auto load_inputs = [&](int t, int u0, uint4 (&xv)[kXBatch]) {
    const int words = min(kt, K - t * kt) / 32;
#pragma unroll
    for (int u = 0; u < kXBatch; ++u) {
      const int tb = warp + (u0 + u) * warps, m = tb / (words * 4), c = tb - m * (words * 4);
      if (tb < M * words * 4) xv[u] = load_x8<T>(xsrc + (size_t)m * ldx, a.perm, vec, xr, t * kt + 8 * c);
    }
  };
  auto build_tables = [&](int t, int u0, const uint4 (&xv)[kXBatch], float* lut) {
    const int words = min(kt, K - t * kt) / 32;
#pragma unroll
    for (int u = 0; u < kXBatch; ++u) {
      const int tb = warp + (u0 + u) * warps, m = tb / (words * 4), c = tb - m * (words * 4);
      if (tb < M * words * 4) build_table<T>(xv[u], lane, lut + (m * (kt / 8) + c) * 256);
    }
  };
  uint4 xnext[kXBatch];
  load_inputs(t_begin, 0, xnext);

  for (int t = t_begin; t < t_end; ++t) {
    const int k0 = t * kt, words = min(kt, K - k0) / 32;
    float* lut = smem + (t & 1) * kTables * 256;
    // The other buffer was read by tile t-1's lookups, which every thread finished before the barrier below
    // of iteration t-1; this buffer was last read by tile t-2's, finished before the barrier of iteration t-1.
    build_tables(t, 0, xnext, lut);
    for (int u0 = kXBatch; warp + u0 * warps < M * words * 4; u0 += kXBatch) {
      uint4 xv[kXBatch];
      load_inputs(t, u0, xv);
      build_tables(t, u0, xv, lut);
    }
    __syncthreads();
    if (t + 1 < t_end) load_inputs(t + 1, 0, xnext);
    if (!active) continue;

    const int next_words = t + 1 < t_end ? min(kt, K - k0 - kt) / 32 : 0;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      if (w >= words) break;
      float al[Q][4], off[4];
      word_alpha<Q>(wd[w], a, al);
      word_offsets<Q>(wd[w], a.offset_dtype, off);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float* L = lut + (m * (kt / 8) + 4 * w) * 256;
        // Σx over the word: entry 255 of each table is the sum of its 8 inputs
        const float xw = a.offset_dtype == DType::kNone ? 0.f : ((L[255] + L[511]) + L[767]) + L[1023];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float v = off[r] * xw;
#pragma unroll
          for (int q = 0; q < Q; ++q) {
            if (q >= planes_of<Q>(a)) break;
            const unsigned bw = word_of(wd[w].bits[q], r);
            const float s = (lookup(L, bw, 0) + lookup(L, bw, 1)) + (lookup(L, bw, 2) + lookup(L, bw, 3));
            v = fmaf(al[q][r], s, v);
          }
          acc[m][r] += v;
        }
      }
      if (w < next_words) load_word<Q>(wd[w], a, (t + 1) * W + w, n0);  // word w of the next tile, in flight now
    }
  }
  if (!active) return;
  if (a.splits == 1) {
    T* y = static_cast<T*>(a.y);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        y[(size_t)m * N + n0 + r] = from_float<T>(acc[m][r] + (a.bias ? bias_at<T>(a.bias, a.bias_dtype, n0 + r) : 0.f));
  } else {
#pragma unroll
    for (int m = 0; m < M; ++m)
      *reinterpret_cast<float4*>(a.partial + ((size_t)blockIdx.y * M + m) * N + n0) =
          make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
  }
}

// Ŵ [N, K] of OutT (float, fp16 or bf16) from the layout, for dequantize + cuBLAS above the GEMV's batches and for the
// backward pass: bcq.dequantize's float32 values (the planes' ±α summed from +0 in plane order, then the offset), rounded
// once to OutT.  A weight's value depends only on its row, group and Q-bit sign code, so per (row, 32-input word) a
// thread first writes the 2^Q possible outputs, each computed in exactly that order, to a table of its own in shared
// memory ([slot][lane] words: lookups never conflict), and then every weight is one lookup: ~13 instructions per
// weight at Q = 4 (SASS) where computing each weight took ~27.  The codes come from the plane words by a bit transpose (nibble i of
// nib[s] is the code of input 4i + s).  Past 4 planes (the kMaxQ kernel) the table holds the float sums of planes 0..3
// and each weight adds the further planes' ±α and then the offset, the same additions in the same order.
// Block: 256 threads over 128 rows × 256 inputs; lane = row quad (the plane, α and offset loads coalesce as in the
// GEMV), warp = word.  Per row of its quad the block stages its 32 rows' outputs in shared memory and writes each
// 512-byte (fp16/bf16) or 1 KB (fp32) row run with whole-warp 16-byte stores: the lanes' own runs are 64-128 B of 32
// different rows, half-sector pieces per store.
constexpr int kDqWarps = lut_dequantize_tile_k / 32;  // words per block, one per warp

template <typename OutT>
__device__ __forceinline__ unsigned table_entry(float v) {
  if constexpr (sizeof(OutT) == 4) {
    return __float_as_uint(v);
  } else {
    const OutT h = from_float<OutT>(v);
    return *reinterpret_cast<const unsigned short*>(&h);
  }
}

template <typename OutT, int Q>
__global__ void __launch_bounds__(256) lut_dequantize_kernel(const LutGemvArgs a) {
  extern __shared__ __align__(16) float smem[];
  constexpr bool kWide = Q > 4;  // planes past the table's 4, added per weight
  constexpr int kTabQ = kWide ? 4 : Q, kSlots = 1 << kTabQ, kRun = kDqWarps * 32 * sizeof(OutT), kPieces = kRun / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n_tile = blockIdx.x * lut_dequantize_tile_n, kw0 = blockIdx.y * kDqWarps;
  const int n0 = n_tile + 4 * lane, kword = kw0 + warp;
  const bool valid = n0 < a.N && kword < a.K / 32;  // no early exit: every thread reaches the barriers
  const int nq = planes_of<Q>(a);
  unsigned* table = reinterpret_cast<unsigned*>(smem) + warp * kSlots * 32 + lane;
  char* staged = reinterpret_cast<char*>(smem) + kDqWarps * kSlots * 128;
  Word<Q> wd;
  float al[Q][4], off[4];
  if (valid) {
    load_word<Q>(wd, a, kword, n0);
    word_alpha<Q>(wd, a, al);
    word_offsets<Q>(wd, a.offset_dtype, off);
  }
  // The block writes a phase's staged rows in passes of kPass rows: thread t writes 16-byte piece t % kPieces of staged
  // row t / kPieces + i·kPass (Ŵ row n_tile + 4·that + r).
  constexpr int kPer16 = 16 / sizeof(OutT), kPass = 256 / kPieces;  // weights per piece, rows per pass
  const int row0 = threadIdx.x / kPieces, piece = threadIdx.x % kPieces;
  const bool k_in = kw0 * 32 + piece * kPer16 < a.K;
  OutT* yr = static_cast<OutT*>(a.y) + (size_t)(n_tile + 4 * row0) * a.K + kw0 * 32 + piece * kPer16;  // row r's
  const size_t pass_stride = (size_t)4 * kPass * a.K;
  const char* const from0 = staged + row0 * (kRun + 16) + piece * 16;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if (valid) {
      float s[kSlots];  // s[c]: the sum for sign code c (bit q: plane q, 1 = +α), built plane by plane
      s[0] = 0.f + -al[0][r];
      s[1] = 0.f + al[0][r];
#pragma unroll
      for (int q = 1; q < kTabQ; ++q)
#pragma unroll
        for (int c = 0; c < (1 << q); ++c) {
          s[c + (1 << q)] = s[c] + al[q][r];
          s[c] = s[c] + -al[q][r];
        }
#pragma unroll
      for (int c = 0; c < kSlots; ++c)
        table[32 * c] = kWide ? __float_as_uint(s[c])
                              : table_entry<OutT>(a.offset_dtype == DType::kNone ? s[c] : s[c] + off[r]);
      unsigned nib[4] = {0u, 0u, 0u, 0u}, nib_hi[4] = {0u, 0u, 0u, 0u};  // nib_hi: planes 4.. the same way
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (q >= nq) break;
        const unsigned p = word_of(wd.bits[q], r);
        const int b = q & 3;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const unsigned moved = t >= b ? p >> (t - b) : p << (b - t);
          if (q < 4) nib[t] = and_or(moved, 0x11111111u << b, nib[t]);
          else nib_hi[t] = and_or(moved, 0x11111111u << b, nib_hi[t]);
        }
      }
      // staged row `lane`, padded by 16 bytes: a quarter warp's 16-byte writes cover the 32 banks
      uint4* dst = reinterpret_cast<uint4*>(staged + lane * (kRun + 16) + warp * (kRun / kDqWarps));
#pragma unroll
      for (int c = 0; c < 32 / kPer16; ++c) {
        unsigned e[kPer16];
#pragma unroll
        for (int j = 0; j < kPer16; ++j) {  // input k: nibble k / 4 of nib[k % 4], as a byte offset 128·code
          const int k = c * kPer16 + j, i = k / 4, t = k % 4;
          const unsigned byte = (4 * i <= 7 ? nib[t] << (7 - 4 * i) : nib[t] >> (4 * i - 7)) & 0x780u;
          e[j] = *reinterpret_cast<const unsigned*>(reinterpret_cast<const char*>(table) + byte);
          if constexpr (kWide) {
            float v = __uint_as_float(e[j]);
#pragma unroll
            for (int q = 4; q < Q; ++q) {
              if (q >= nq) break;
              v = v + (((nib_hi[t] >> (4 * i + q - 4)) & 1u) ? al[q][r] : -al[q][r]);
            }
            e[j] = table_entry<OutT>(a.offset_dtype == DType::kNone ? v : v + off[r]);
          }
        }
        if constexpr (kPer16 == 4) {
          dst[c] = make_uint4(e[0], e[1], e[2], e[3]);
        } else {
          unsigned u[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) u[j] = __byte_perm(e[2 * j], e[2 * j + 1], 0x5410);  // two 16-bit entries
          dst[c] = make_uint4(u[0], u[1], u[2], u[3]);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 32 / kPass; ++i)
      if (k_in && n_tile + 4 * (row0 + i * kPass) < a.N)
        *reinterpret_cast<uint4*>(yr + i * pass_stride) = *reinterpret_cast<const uint4*>(from0 + i * kPass * (kRun + 16));
    yr += a.K;
    __syncthreads();
  }
}

template <typename T, int M, int Q>
cudaError_t launch(const LutGemvArgs& a, const Rotation& rot, cudaStream_t stream) {
  constexpr int W = lut_gemv_words(M, Q);
  if (a.kt != 32 * W) return cudaErrorInvalidValue;
  const size_t smem = rot.block ? rotation_smem_bytes(lut_gemv_smem_bytes(M, a.kt), rot.block,
                                                        (size_t)M * lut_gemv_rotated_span(a.K, a.kt, a.tiles_per_split,
                                                                                          a.perm != nullptr), sizeof(T))
                                  : lut_gemv_smem_bytes(M, a.kt);
  auto kernel = lut_gemv_kernel<T, M, Q, W>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(lut_gemv_tiles(a.N, a.threads), a.splits);
  if (a.splits > 1 && a.partial == nullptr) return cudaErrorInvalidValue;
  kernel<<<grid, a.threads, smem, stream>>>(a, rot);
  if (a.splits > 1) reduce_splits<T>(a.partial, a.bias, a.bias_dtype, a.y, a.splits, a.M, a.N, stream);
  return cudaGetLastError();
}

template <typename T, int M>
cudaError_t dispatch_q(const LutGemvArgs& a, const Rotation& r, cudaStream_t s) {
  switch (a.Q) {
    case 1: return launch<T, M, 1>(a, r, s);
    case 2: return launch<T, M, 2>(a, r, s);
    case 3: return launch<T, M, 3>(a, r, s);
    case 4: return launch<T, M, 4>(a, r, s);
    case 5: case 6: case 7: case 8: return launch<T, M, kMaxQ>(a, r, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_m(const LutGemvArgs& a, const Rotation& r, cudaStream_t s) {
  switch (a.M) {
    case 1: return dispatch_q<T, 1>(a, r, s);
    case 2: return dispatch_q<T, 2>(a, r, s);
    case 3: return dispatch_q<T, 3>(a, r, s);
    case 4: return dispatch_q<T, 4>(a, r, s);
    case 5: return dispatch_q<T, 5>(a, r, s);
    case 6: return dispatch_q<T, 6>(a, r, s);
    case 7: return dispatch_q<T, 7>(a, r, s);
    case 8: return dispatch_q<T, 8>(a, r, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename OutT, int Q>
cudaError_t dequantize_launch(const LutGemvArgs& a, cudaStream_t s) {
  const size_t smem = lut_dequantize_smem_bytes(Q, sizeof(OutT));
  if (smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(lut_dequantize_kernel<OutT, Q>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid = lut_dequantize_grid(a.N, a.K);
  lut_dequantize_kernel<OutT, Q><<<grid, 256, smem, s>>>(a);
  return cudaGetLastError();
}

template <typename OutT>
cudaError_t dequantize_q(const LutGemvArgs& a, cudaStream_t s) {
  switch (a.Q) {
    case 1: return dequantize_launch<OutT, 1>(a, s);
    case 2: return dequantize_launch<OutT, 2>(a, s);
    case 3: return dequantize_launch<OutT, 3>(a, s);
    case 4: return dequantize_launch<OutT, 4>(a, s);
    case 5: case 6: case 7: case 8: return dequantize_launch<OutT, kMaxQ>(a, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t lut_gemv(const LutGemvArgs& a, const Rotation& rot, cudaStream_t stream) {
  if (a.kt % 32 || a.group_size % 32 || a.K % 32 || a.N % 4 || a.threads % 32 || a.threads > 256 ||
      (a.uniform && a.Q <= 4) || rotation_invalid(rot)) {
    return cudaErrorInvalidValue;
  }
  if (a.x_dtype == DType::kHalf) return dispatch_m<__half>(a, rot, stream);
  if (a.x_dtype == DType::kBFloat16) return dispatch_m<__nv_bfloat16>(a, rot, stream);
  return cudaErrorInvalidValue;
}

cudaError_t lut_dequantize(const LutGemvArgs& a, DType out, cudaStream_t stream) {
  if (a.group_size % 32 || a.K % 32 || a.N % 4 || (a.uniform && a.Q <= 4) || lut_dequantize_grid(a.N, a.K).y > 65535)
    return cudaErrorInvalidValue;
  if (out == DType::kFloat) return dequantize_q<float>(a, stream);
  if (out == DType::kHalf) return dequantize_q<__half>(a, stream);
  if (out == DType::kBFloat16) return dequantize_q<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
