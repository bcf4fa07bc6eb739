// The uniform BCQ storage's GPU paths (issue 24): a GEMV on tensor cores at decode batches (M <= 16), a GEMM on tensor
// cores for M up to 512, and a dequantize kernel writing Ŵ for one cuBLAS GEMM above.  8-bit codes: the 1-4 bit layers
// run on QUICK's and the LUT GEMV's layouts.
//
// Dequantize: a code becomes a float with one byte permute: byte q into the second byte of 0x4B000000 is 2^23 + 256·q,
// and that minus the zero point's 2^23 + 256·z is 256·(q − z) exactly (an integer below 2^16, also for the symmetric
// grid's z = 127.5, with at most 8 significant bits); times the group's scale / 256 (exact) it gives s·(q − z) with
// the format's single fp32 rounding.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../_cuda/canonical.cuh"  // store_runs
#include "../_cuda/x_stage.cuh"
#include "uniform.h"

namespace qlinear {
namespace {

// 2^23 + 256·b as a float, b = byte i of `word`.
__device__ __forceinline__ float byte_float(unsigned word, unsigned i) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7404u | (i << 4)));
}

constexpr float kSymmetricZero = 8388608.f + 256.f * 127.5f;  // byte_float of the symmetric grid's z = 127.5

// Group g's scale / 256 and byte_float of its zero point, for row n (scales: the row's [G]).
__device__ __forceinline__ void group_of(const UniformArgs& a, const __half* scales, int n, int g, float& scale,
                                         float& zero) {
  scale = __half2float(__ldg(scales + g)) * (1.f / 256.f);
  zero = a.zeros ? byte_float(__ldg(a.zeros + g * a.zero_words + n / 4), n % 4) : kSymmetricZero;
}

// A thread owns one row's 32 consecutive inputs, one group's (group sizes are multiples of 32): two 16-byte loads of
// codes (consecutive threads read consecutive pieces of a row), the group's scale and zero point, and its outputs leave
// through store_runs.
template <typename OutT>
__global__ void __launch_bounds__(256, 2) uniform_dequantize_kernel(const UniformArgs a) {
  const unsigned chunks = a.K / 32, total = (unsigned)a.N * chunks;  // < 2^31: checked by the launcher
  const unsigned t0 = blockIdx.x * blockDim.x, t = t0 + threadIdx.x;
  Run32<OutT> out;
  if (t < total) {  // no early exit: every thread reaches store_runs' barrier
    const int n = (int)(t / chunks), c = (int)(t % chunks);
    const int groups = (a.K - 1) / a.group_size + 1;  // ceil(K / group_size), without overflow for any group size
    const uint4* const p = reinterpret_cast<const uint4*>(a.codes + (size_t)n * a.code_words + c * 8);
    const uint4 lo = __ldg(p), hi = __ldg(p + 1);
    const unsigned words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float scale, zero;
    group_of(a, static_cast<const __half*>(a.scales) + (size_t)n * groups, n, c * 32 / a.group_size, scale, zero);
#pragma unroll
    for (int e = 0; e < 32; ++e) out.v[e] = from_float<OutT>(scale * (byte_float(words[e / 4], e % 4) - zero));
  }
  store_runs(out, t0, 32 * (size_t)total, static_cast<OutT*>(a.w));
}

// ---- the GEMV (M <= 16) on tensor cores ----
//
// A warp owns kTiles·8 rows and walks K in steps of 64 inputs (the block's kWarps warps take steps round-robin and
// add their sums in warp order at the end: deterministic).  Lane l = 4·r + u holds, per step, the 16 codes of its rows
// n0 + 8i + r at inputs 64s + 16u .. + 15 (one 16-byte load per row: a row's 64 bytes come from 4 lanes) and row r
// (and r + 8) of x at the same 16 inputs.  mma j (j = 0..3) gives k-slots 2u, 2u + 1 the inputs 16u + 4j, + 1 and k-slots
// 8 + 2u, + 1 the inputs 16u + 4j + 2, + 3: A's and B's slots of lane l depend on u only, so each mma sums x·Ŵ over
// 16 of the step's inputs without moving any value between lanes, and the 4 mmas cover all 64.  B holds the codes
// as 16-bit integers q − z (or 2q − 255 on the symmetric grid, whose z = 127.5; the scale is then halved), exact in
// fp16 and bf16 (at most 8 significant bits), so the products are exact and the sums fp32 (tensor cores may truncate
// rather than round inside an mma: the GPU test's bound allows for it); each step's sums are scaled by the group's
// scale and accumulated in fp32.  Groups are multiples of 32: when they are not multiples of 64 (SPLIT), a step's two
// halves may lie in two groups, and each half runs its own 4 mmas with the other half's x zeroed.
constexpr int kWarps = 4, kTiles = 2;  // a block: kWarps warps over K, each kTiles tiles of 8 rows (16 rows)

// Bytes of shared memory of a GEMV block: every lane's sums (kTiles × 4 floats) per warp.
constexpr size_t kGemvSmem = 4 * kWarps * 32 * kTiles * 4;

// B's pair of fp16/bf16 integers for codes 2p, 2p + 1 of `w` (p = 0, 1): q − z from `zc` (code_zero), or 2q − 255
// (SYM: the symmetric grid).
template <typename T, bool SYM>
__device__ __forceinline__ unsigned code_pair(unsigned w, int p, unsigned zc);
template <>  // 0x64qq as fp16 is 1024 + q exactly (bytes q, 0x64, q', 0x64: one permute)
__device__ __forceinline__ unsigned code_pair<__half, false>(unsigned w, int p, unsigned zc) {
  const unsigned h = __byte_perm(w, 0x64646464u, p ? 0x5342u : 0x5140u);
  const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&h), *reinterpret_cast<const __half2*>(&zc));
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>  // 2·(1024 + q) − 2048 = 2q, then 2q − 255: both exact (integers of at most 10 bits)
__device__ __forceinline__ unsigned code_pair<__half, true>(unsigned w, int p, unsigned) {
  const unsigned h = __byte_perm(w, 0x64646464u, p ? 0x5342u : 0x5140u);
  const __half2 q2 = __hfma2(*reinterpret_cast<const __half2*>(&h), __float2half2_rn(2.f), __float2half2_rn(-2048.f));
  const __half2 v = __hsub2(q2, __float2half2_rn(255.f));
  return *reinterpret_cast<const unsigned*>(&v);
}
template <bool SYM>
__device__ __forceinline__ unsigned bf16_pair(unsigned w, int p, unsigned zc) {
  float d[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {  // 2^23 + q (one permute), minus 2^23 + z: exact
    const float f = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (2 * p + e)));
    d[e] = SYM ? fmaf(f - 8388608.f, 2.f, -255.f) : f - __uint_as_float(zc);
  }
  const __nv_bfloat162 v = __floats2bfloat162_rn(d[0], d[1]);  // integers of at most 8 significant bits: exact
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned code_pair<__nv_bfloat16, false>(unsigned w, int p, unsigned zc) {
  return bf16_pair<false>(w, p, zc);
}
template <>
__device__ __forceinline__ unsigned code_pair<__nv_bfloat16, true>(unsigned w, int p, unsigned zc) {
  return bf16_pair<true>(w, p, zc);
}

// What code_pair subtracts for zero point z (0..255): 1024 + z as fp16 twice, or 2^23 + z as fp32 bits.
template <typename T>
__device__ __forceinline__ unsigned code_zero(unsigned z) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __float2half2_rn(1024.f + (float)z);
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    return 0x4B000000u | z;
  }
}

// A lane's fixed addresses (rows past N: row N − 1's, never written).
struct Lane {
  const uint4* codes[kTiles];      // its row of each tile, as 16-byte pieces
  const unsigned* zeros[kTiles];   // the zero points' word of that row in group 0 (null: symmetric)
  unsigned zero_shift[kTiles];     // the row's byte in it, as a shift
  const __half* scales[kTiles][2];  // [tile][e]: the scale rows of its C columns 2u + e
};

// One lane's loads for one step, issued a step ahead of their use.
template <bool M16>
struct Step {
  uint4 codes[kTiles];         // 16 codes of its row of each tile
  uint4 x[M16 ? 2 : 1][2];     // x rows r (and r + 8), its 16 inputs
  unsigned zero[kTiles];       // the zero point of each row in its inputs' group
  __half scale[kTiles][2][2];  // [tile][half][e]: each half's group's scale of its C columns
};

template <typename T, bool M16>
__device__ __forceinline__ void load_step(Step<M16>& st, const GemvArgs<UniformArgs>& g, const Lane& ln,
                                          const GroupOf& group_of, int last_group, int s, int r, int u) {
  const UniformArgs& a = g.w;
  const int k = 64 * s + 16 * u;
  const bool valid = k < a.K;  // K % 32 == 0: a lane's 16 inputs are all in K or all past it
  const T* const x = static_cast<const T*>(g.x);
#pragma unroll
  for (int h = 0; h < (M16 ? 2 : 1); ++h) {
    const int m = r + 8 * h;
    const bool load = valid && m < g.M;
#pragma unroll
    for (int p = 0; p < 2; ++p)
      st.x[h][p] = load ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)m * a.K + k) + p) : make_uint4(0, 0, 0, 0);
  }
  const int gl = min(group_of(64 * s + 32 * (u / 2)), last_group);  // past K (a last step of 32): any group
  int gh[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) gh[h] = min(group_of(64 * s + 32 * h), last_group);
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    st.codes[i] = valid ? __ldg(ln.codes[i] + k / 16) : make_uint4(0, 0, 0, 0);
    st.zero[i] = ln.zeros[i] ? (__ldg(ln.zeros[i] + gl * a.zero_words) >> ln.zero_shift[i]) & 255u : 0u;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) st.scale[i][h][e] = __ldg(ln.scales[i][e] + gh[h]);
  }
}

template <typename T, bool SPLIT, bool M16, bool SYM>
__device__ __forceinline__ void mma_step(const Step<M16>& st, int u, float (&acc)[kTiles][4]) {
  unsigned b[kTiles][8];  // [tile][pair]: pair 2j + p holds codes 4j + 2p, + 1
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const unsigned w[4] = {st.codes[i].x, st.codes[i].y, st.codes[i].z, st.codes[i].w};
    const unsigned zc = SYM ? 0u : code_zero<T>(st.zero[i]);
#pragma unroll
    for (int q = 0; q < 8; ++q) b[i][q] = code_pair<T, SYM>(w[q / 2], q % 2, zc);
  }
  const unsigned* const xa = reinterpret_cast<const unsigned*>(&st.x[0][0]);  // 8 pairs of row r (and r + 8)
  const unsigned* const xb = reinterpret_cast<const unsigned*>(&st.x[M16 ? 1 : 0][0]);
#pragma unroll
  for (int h = 0; h < (SPLIT ? 2 : 1); ++h) {
    const bool mine = !SPLIT || u / 2 == h;  // SPLIT: this half's mmas see only the x of lanes u = 2h, 2h + 1
    float c[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned fa[4] = {mine ? xa[2 * j] : 0u, M16 && mine ? xb[2 * j] : 0u, mine ? xa[2 * j + 1] : 0u,
                              M16 && mine ? xb[2 * j + 1] : 0u};
#pragma unroll
      for (int i = 0; i < kTiles; ++i) mma<T>(c[i], fa, b[i][2 * j], b[i][2 * j + 1]);
    }
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)  // SYM: B held 2q − 255 = 2·(q − z), so the scale is halved (exact)
        acc[i][e] = fmaf(__half2float(st.scale[i][h][e % 2]) * (SYM ? 0.5f : 1.f), c[i][e], acc[i][e]);
  }
}

template <typename T, bool SPLIT, bool M16>
__global__ void __launch_bounds__(32 * kWarps) uniform_gemv_kernel(const GemvArgs<UniformArgs> g) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* const sums = reinterpret_cast<float*>(smem_raw);  // [warps][32 lanes][kTiles][4]
  const UniformArgs& a = g.w;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, u = lane % 4;
  const int n0 = blockIdx.x * 8 * kTiles, steps = (a.K + 63) / 64;
  const int groups = (a.K - 1) / a.group_size + 1;  // ceil(K / group_size), without overflow for any group size
  const GroupOf group_of(a.group_size);
  Lane ln;
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
    const int n = min(n0 + 8 * i + r, a.N - 1);
    ln.codes[i] = reinterpret_cast<const uint4*>(a.codes + (size_t)n * a.code_words);
    ln.zeros[i] = a.zeros ? a.zeros + n / 4 : nullptr;
    ln.zero_shift[i] = 8 * (n % 4);
#pragma unroll
    for (int e = 0; e < 2; ++e)
      ln.scales[i][e] = static_cast<const __half*>(a.scales) + (size_t)min(n0 + 8 * i + 2 * u + e, a.N - 1) * groups;
  }
  float acc[kTiles][4];
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[i][c] = 0.f;
  Step<M16> cur, next;
  if (warp < steps) load_step<T, M16>(cur, g, ln, group_of, groups - 1, warp, r, u);
  for (int s = warp; s < steps; s += kWarps) {
    if (s + kWarps < steps) load_step<T, M16>(next, g, ln, group_of, groups - 1, s + kWarps, r, u);
    if (a.zeros) mma_step<T, SPLIT, M16, false>(cur, u, acc);
    else mma_step<T, SPLIT, M16, true>(cur, u, acc);
    cur = next;
  }
  float* const mine = sums + (size_t)(warp * 32 + lane) * kTiles * 4;
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[i * 4 + e] = acc[i][e];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = r + 8 * (e / 2), n = n0 + 8 * i + 2 * u + e % 2;
        if (m < g.M && n < a.N) {
          float sum = 0.f;
          for (int w = 0; w < kWarps; ++w) sum += sums[(size_t)(w * 32 + lane) * kTiles * 4 + i * 4 + e];
          if (g.bias) sum += bias_at<T>(g.bias, g.bias_dtype, n);
          static_cast<T*>(g.y)[(size_t)m * a.N + n] = from_float<T>(sum);
        }
      }
  }
}

template <typename T, bool SPLIT, bool M16>
cudaError_t launch_mma(const GemvArgs<UniformArgs>& g, cudaStream_t s) {
  const unsigned blocks = (unsigned)((g.w.N + 8 * kTiles - 1) / (8 * kTiles));
  uniform_gemv_kernel<T, SPLIT, M16><<<blocks, 32 * kWarps, kGemvSmem, s>>>(g);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gemv_as(const GemvArgs<UniformArgs>& g, cudaStream_t s) {
  switch ((g.w.group_size % 64 != 0) * 2 + (g.M > 8)) {
    case 0: return launch_mma<T, false, false>(g, s);
    case 1: return launch_mma<T, false, true>(g, s);
    case 2: return launch_mma<T, true, false>(g, s);
    default: return launch_mma<T, true, true>(g, s);
  }
}

// ---- the GEMM (M up to 512) on tensor cores ----
//
// QUICK's block (quick_gemm.cu) over the canonical codes: 4 warps along N, each 32 rows of Ŵ, × WM warps along M, each
// 16·MT rows of x; K walked in 64-input steps, x through a 3-stage cp.async pipeline in the swizzled stages of
// x_stage.cuh, the next D steps' codes, scales and zero points in flight in a register ring; split-K slices summed in
// slice order by a second kernel (deterministic).  The mma computes yᵀ = Ŵ·xᵀ: A is Ŵ (two tiles of 16 rows per warp),
// B is xᵀ (tiles of 8 rows of x).  A lane 4r + u holds, as in the GEMV, the 16 codes of its rows n0 + 8i + r at inputs
// 64s + 16u .. + 15 (one 16-byte load per row) and reads the same 16 inputs of its row r of each x tile (two 16-byte
// shared loads): the GEMV's k-slot assignment, so no value moves between lanes and no layout is needed, and the loaded
// words of x are B's registers as they arrive (x as A would pair rows r and r + 8 in each register quad: a move per
// register).  A is Ŵ in x's dtype, s·(q − z) rounded once (Deq8): the value uniform_dequantize writes, converted once
// per step and used by every x tile; accumulation in fp32.
constexpr int kGemmWarpsN = 4, kGemmStages = 3;

// One lane's loads for one step: its rows' codes, each row's scale (fp16 bits) and zero-point word (the byte is picked
// when used, not when loaded, so that no instruction waits on the load before the ring has moved on).
struct GemmStep {
  uint4 codes[4];
  unsigned short scale[4];
  unsigned zero[4];
};

// The mma's A registers of Ŵ = s·(q − z) in T for one row and group: q − z (q − 127.5 on the symmetric grid) exact in
// T or fp32, then one rounding of the product (exact before it: at most 9 significant bits times fp16's 11).
template <typename T, bool SYM> struct Deq8;
template <bool SYM> struct Deq8<__half, SYM> {
  __half2 s, zc;  // zc: 1024 + z twice (1024 on the symmetric grid)
  __device__ __forceinline__ void set(unsigned short scale, unsigned zero_word, int shift) {
    s = __half2half2(__ushort_as_half(scale));
    zc = __float2half2_rn(1024.f + (SYM ? 0.f : (float)((zero_word >> shift) & 255u)));
  }
  // codes 2p, 2p + 1 of word w
  __device__ __forceinline__ unsigned pair(unsigned w, int p) const {
    const unsigned h = __byte_perm(w, 0x64646464u, p ? 0x5342u : 0x5140u);  // 1024 + q, exact
    __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&h), zc);
    if constexpr (SYM) v = __hsub2(v, __float2half2_rn(127.5f));
    const __half2 w2 = __hmul2(v, s);
    return *reinterpret_cast<const unsigned*>(&w2);
  }
};
template <bool SYM> struct Deq8<__nv_bfloat16, SYM> {  // bf16 holds neither 1024 + q nor s: fp32 until the rounding
  float s, zc;  // zc: 2^23 + z
  __device__ __forceinline__ void set(unsigned short scale, unsigned zero_word, int shift) {
    s = __half2float(__ushort_as_half(scale));
    zc = __uint_as_float(0x4B000000u | (SYM ? 0u : (zero_word >> shift) & 255u));
  }
  __device__ __forceinline__ unsigned pair(unsigned w, int p) const {
    float d[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float f = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (2 * p + e))) - zc;  // q − z, exact
      d[e] = (SYM ? f - 127.5f : f) * s;
    }
    const __nv_bfloat162 v = __floats2bfloat162_rn(d[0], d[1]);
    return *reinterpret_cast<const unsigned*>(&v);
  }
};

// Step t's loads for the lane's rows n[i] (clamped to N − 1: rows past N are computed, never stored).
template <bool SYM>
__device__ __forceinline__ void load_gemm_step(GemmStep& st, const UniformArgs& a, const int (&n)[4], int groups,
                                               const GroupOf& group_of, int t, int u) {
  const int k = 64 * t + 16 * u, g = group_of(64 * t + 32 * (u / 2));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    st.codes[i] = __ldg(reinterpret_cast<const uint4*>(a.codes + (size_t)n[i] * a.code_words + k / 4));
    st.scale[i] = __ldg(static_cast<const unsigned short*>(a.scales) + (size_t)n[i] * groups + g);
    if constexpr (!SYM) st.zero[i] = __ldg(a.zeros + (size_t)g * a.zero_words + n[i] / 4);
  }
}

template <int MT> constexpr int kGemmDepth = MT >= 4 ? 2 : 3;

template <typename T, int MT, int WM, bool SYM>
__global__ void __launch_bounds__(32 * kGemmWarpsN * WM) uniform_gemm_kernel(const UniformGemmArgs ga) {
  constexpr int BM = 16 * MT * WM, THREADS = 32 * kGemmWarpsN * WM, D = kGemmDepth<MT>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  const GemvArgs<UniformArgs>& g = ga.g;
  const UniformArgs& a = g.w;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, r = lane >> 2, u = lane & 3;
  const int warp_n = warp % kGemmWarpsN, warp_m = warp / kGemmWarpsN;
  const int m0 = blockIdx.y * BM, t0 = blockIdx.z * ga.tiles_per_split;
  const int nt_count = min(ga.tiles_per_split, a.K / kStageK - t0);
  const int n0 = (blockIdx.x * kGemmWarpsN + warp_n) * 32;
  const bool active = n0 < a.N;
  const int groups = (a.K - 1) / a.group_size + 1;
  const GroupOf group_of(a.group_size);
  const T* const x = static_cast<const T*>(g.x);
  int n[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) n[i] = min(n0 + 8 * i + r, a.N - 1);

  float acc[2][2 * MT][4];  // [Ŵ tile][x tile]: the mma's D of 16 rows of Ŵ × 8 rows of x
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int v = 0; v < 2 * MT; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[t][v][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kGemmStages - 1; ++s) {
    if (s < nt_count)
      load_a_stage<T, BM, THREADS>(smem + s * BM * kStageK, x, nullptr, g.M, a.K, m0, (t0 + s) * kStageK, tid);
    cp_async_commit();
  }
  // slot j of the ring holds step base + j and is refilled with step base + j + D after its mmas (QUICK's ring)
  GemmStep ring[D];
#pragma unroll
  for (int j = 0; j < D; ++j)
    if (active && j < nt_count) load_gemm_step<SYM>(ring[j], a, n, groups, group_of, t0 + j, u);

  for (int base = 0; base < nt_count; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int it = base + j;
      if (it >= nt_count) break;
      cp_async_wait<kGemmStages - 2>();
      __syncthreads();
      const int next = it + kGemmStages - 1;
      if (next < nt_count)
        load_a_stage<T, BM, THREADS>(smem + (next % kGemmStages) * BM * kStageK, x, nullptr, g.M, a.K, m0,
                                     (t0 + next) * kStageK, tid);
      cp_async_commit();
      if (!active) continue;
      Deq8<T, SYM> dq[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) dq[i].set(ring[j].scale[i], ring[j].zero[i], 8 * (n[i] % 4));
      const T* const stage = smem + (it % kGemmStages) * BM * kStageK;
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // chunk 2u + h of the lane's rows: inputs 16u + 8h .., k-slots of mmas 2h, 2h + 1
        unsigned af[2][2][4];  // [Ŵ tile][mma 2h + jj]: A fragments, converted once, used by every 8 rows of x
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const uint4 lo = ring[j].codes[2 * t], hi = ring[j].codes[2 * t + 1];  // rows r + 16t and r + 16t + 8
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {  // word 2h + jj of the lane's codes: inputs 16u + 8h + 4jj .. + 3
            const unsigned wl = h == 0 ? (jj ? lo.y : lo.x) : (jj ? lo.w : lo.z);
            const unsigned wh = h == 0 ? (jj ? hi.y : hi.x) : (jj ? hi.w : hi.z);
            af[t][jj][0] = dq[2 * t].pair(wl, 0);
            af[t][jj][1] = dq[2 * t + 1].pair(wh, 0);
            af[t][jj][2] = dq[2 * t].pair(wl, 1);
            af[t][jj][3] = dq[2 * t + 1].pair(wh, 1);
          }
        }
#pragma unroll
        for (int v = 0; v < 2 * MT; ++v) {  // x rows 8v + r of the warp's: B's column r, its words in load order
          const uint4 xv = *reinterpret_cast<const uint4*>(a_chunk(stage, warp_m * MT * 16 + 8 * v + r, 2 * u + h));
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            mma<T>(acc[t][v], af[t][0], xv.x, xv.y);
            mma<T>(acc[t][v], af[t][1], xv.z, xv.w);
          }
        }
      }
      if (it + D < nt_count) load_gemm_step<SYM>(ring[j], a, n, groups, group_of, t0 + it + D, u);
    }
  }
  cp_async_wait<0>();
  if (!active) return;
  const bool direct = ga.splits == 1;
  float* const part = direct ? nullptr : ga.partial + (size_t)blockIdx.z * g.M * a.N;
#pragma unroll
  for (int t = 0; t < 2; ++t)
#pragma unroll
    for (int v = 0; v < 2 * MT; ++v)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // D: row r (+ 8) of the Ŵ tile, column 2u (+ 1) of the x tile
        const int col = n0 + 16 * t + r + 8 * (e / 2), m = m0 + warp_m * MT * 16 + 8 * v + 2 * u + e % 2;
        if (m >= g.M || col >= a.N) continue;
        float y = acc[t][v][e];
        if (!direct) { part[(size_t)m * a.N + col] = y; continue; }
        if (g.bias) y += bias_at<T>(g.bias, g.bias_dtype, col);
        static_cast<T*>(g.y)[(size_t)m * a.N + col] = from_float<T>(y);
      }
}

template <typename T, int MT, int WM>
cudaError_t launch_gemm(const UniformGemmArgs& ga, cudaStream_t s) {
  constexpr int BM = 16 * MT * WM;
  const size_t smem = (size_t)kGemmStages * BM * kStageK * sizeof(T);  // at most 48 KB: no opt-in
  const dim3 grid((ga.g.w.N + 32 * kGemmWarpsN - 1) / (32 * kGemmWarpsN), (ga.g.M + BM - 1) / BM, ga.splits);
  if (ga.g.w.zeros) uniform_gemm_kernel<T, MT, WM, false><<<grid, 32 * kGemmWarpsN * WM, smem, s>>>(ga);
  else uniform_gemm_kernel<T, MT, WM, true><<<grid, 32 * kGemmWarpsN * WM, smem, s>>>(ga);
  if (ga.splits > 1) reduce_splits<T>(ga.partial, ga.g.bias, ga.g.bias_dtype, ga.g.y, ga.splits, ga.g.M, ga.g.w.N, s);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gemm_as(const UniformGemmArgs& ga, cudaStream_t s) {
  switch (ga.tile_m) {
    case 16: return launch_gemm<T, 1, 1>(ga, s);
    case 32: return launch_gemm<T, 2, 1>(ga, s);
    case 64: return launch_gemm<T, 4, 1>(ga, s);
    case 128: return launch_gemm<T, 4, 2>(ga, s);
    default: return cudaErrorInvalidValue;
  }
}

// The weights' rules the kernels share (N·K/32 < 2^31: 32-bit indices; K < 2^20: GroupOf).
bool weights_invalid(const UniformArgs& a) {
  return a.bits != 8 || a.K % 32 || a.K >= (1 << 20) || a.group_size <= 0 || a.group_size % 32 ||
         a.code_words != a.K / 4 || (a.zeros && a.zero_words != (a.N + 3) / 4) ||
         (reinterpret_cast<size_t>(a.codes) & 15u) || (long long)a.N * (a.K / 32) >= (1LL << 31);
}

template <typename OutT>
cudaError_t dequantize_as(const UniformArgs& a, cudaStream_t s) {
  const unsigned blocks = (unsigned)(((long long)a.N * (a.K / 32) + 255) / 256);
  uniform_dequantize_kernel<OutT><<<blocks, 256, canonical_dequantize_smem_bytes(sizeof(OutT)), s>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t uniform_dequantize(const UniformArgs& a, DType out, cudaStream_t stream) {
  if (weights_invalid(a)) return cudaErrorInvalidValue;
  if (out == DType::kFloat) return dequantize_as<float>(a, stream);
  if (out == DType::kHalf) return dequantize_as<__half>(a, stream);
  if (out == DType::kBFloat16) return dequantize_as<__nv_bfloat16>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t uniform_gemv(const UniformGemvArgs& g, cudaStream_t stream) {
  if (weights_invalid(g.w) || g.M < 1 || g.M > 16 || (reinterpret_cast<size_t>(g.x) & 15u))  // x: 16-byte loads
    return cudaErrorInvalidValue;
  if (g.x_dtype == DType::kHalf) return gemv_as<__half>(g, stream);
  if (g.x_dtype == DType::kBFloat16) return gemv_as<__nv_bfloat16>(g, stream);
  return cudaErrorInvalidValue;
}

cudaError_t uniform_gemm(const UniformGemmArgs& ga, cudaStream_t stream) {
  const UniformArgs& a = ga.g.w;
  const int steps = a.K / kStageK;
  if (weights_invalid(a) || a.K % kStageK || ga.g.M < 1 || ga.g.M > 512 || (reinterpret_cast<size_t>(ga.g.x) & 15u) ||
      ga.tiles_per_split < 1 || ga.splits < 1 || (long long)(ga.splits - 1) * ga.tiles_per_split >= steps ||
      (long long)ga.splits * ga.tiles_per_split < steps ||
      (ga.splits > 1 && ga.partial == nullptr))
    return cudaErrorInvalidValue;
  if (ga.g.x_dtype == DType::kHalf) return gemm_as<__half>(ga, stream);
  if (ga.g.x_dtype == DType::kBFloat16) return gemm_as<__nv_bfloat16>(ga, stream);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
