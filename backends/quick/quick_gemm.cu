// QUICK tensor-core GEMM for BCQ weights, M = 1..512: uniform (int2/int3/int4 with a per-group zero point) or free α
// (w = Σ_i α_i·(2·bit_i − 1) + c per (row, group), the BCQ fit's non-uniform levels).
//
// Why: above M ≈ 8 CUDA-core kernels (the LUT GEMV) become compute bound, and dequantize-then-cuBLAS
// re-expands the whole weight every call.  Here each warp's B fragments of `mma.m16n8k16` come straight
// from DRAM into registers (the weights were interleaved offline in fragment order, QUICK §3.1-3.2), are
// converted with one lop3 + one sub (or fma) + one fma per register pair (fp16: most pairs without a shift, see
// pair_values; free α: one of each per bit-plane), and go into the
// tensor cores: no shared memory write-back of dequantized weights and no ldmatrix for B.  Only x goes through shared memory, in a
// STAGES-deep cp.async pipeline (XOR-swizzled so ldmatrix is conflict-free), which the public QUICK kernel
// lacks.  The codes and scales of the next D K tiles (D = 2..4) are in flight in a register ring while the current
// one is multiplied.
//
// Work split: warp = 32 output rows (4 n8 blocks) × (16·MT) rows of x; block = 4 warps along N × WM warps
// along M; K is walked in 64-input tiles; gridDim.z = split-K slices (fp32 partials summed in slice order by a
// second kernel: deterministic).  Accumulation is fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../_cuda/common.cuh"
#include "../_cuda/rotation.cuh"
#include "../_cuda/x_stage.cuh"
#include "quick_gemm.h"

namespace qlinear {
namespace {

constexpr int kTileN = 32, kTileK = kStageK, kWarpsN = 4, kStages = 3;

template <typename T> struct Num;
template <> struct Num<__half> {
  using T2 = __half2;
  static constexpr unsigned kMagic = 0x64006400u;  // 1024.0 in both halves: (kMagic | q) = 1024 + q
  static __device__ __forceinline__ T2 base() { return __half2half2(__ushort_as_half(0x6400)); }
  static __device__ __forceinline__ T2 pair(float v) { return __float2half2_rn(v); }
};
template <> struct Num<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr unsigned kMagic = 0x43004300u;  // 128.0 in both halves
  static __device__ __forceinline__ T2 base() { return __bfloat162bfloat162(__ushort_as_bfloat16(0x4300)); }
  static __device__ __forceinline__ T2 pair(float v) { return __float2bfloat162_rn(v); }
};

// Words of one tile a lane owns: chunk 0 (2·c0 words, c0 = 4 for Q = 4 else 2), then chunk 1 (Q = 3: 2 words).
template <int Q> struct Words {
  static constexpr int c0 = Q == 4 ? 4 : 2;
  static constexpr int n0 = 2 * c0;
  static constexpr int n1 = Q == 3 ? 2 : 0;
  static constexpr int n = n0 + n1;
};

template <int Q>
__device__ __forceinline__ void load_tile(unsigned (&w)[Words<Q>::n], const unsigned* __restrict__ tile, int lane) {
  using W = Words<Q>;
  const uint4* p = reinterpret_cast<const uint4*>(tile + W::n0 * lane);
#pragma unroll
  for (int i = 0; i < W::n0 / 4; ++i) {
    const uint4 v = __ldg(p + i);
    w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
  }
  if constexpr (W::n1 > 0) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(tile + 32 * W::n0 + 2 * lane));
    w[W::n0] = v.x; w[W::n0 + 1] = v.y;
  }
}

// Codes of pair p (both halves of a 32-bit register), Q-bit, OR-ed with `magic` (an exponent, or 0) in the same LOP3.
template <int Q>
__device__ __forceinline__ unsigned pair_codes(const unsigned (&w)[Words<Q>::n], int p, unsigned magic = 0u) {
  // without a magic the plain AND, which the compiler can merge with what the caller does next
  const auto field = [magic](unsigned x, unsigned mask) { return magic ? and_or(x, mask, magic) : x & mask; };
  if constexpr (Q == 4) return field(w[p / 4] >> (4 * (p % 4)), 0x000f000fu);
  if constexpr (Q == 2) return field(w[p / 8] >> (2 * (p % 8)), 0x00030003u);
  return field(w[p / 8] >> (2 * (p % 8)), 0x00030003u) | (((w[Words<Q>::n0 + p / 16] >> (p % 16)) & 0x00010001u) << 2);
}

template <typename T2> __device__ __forceinline__ T2 as_pair(unsigned u) { return *reinterpret_cast<const T2*>(&u); }

// fp16 bits of ±(2^a + 2^b), a >= b (exact in fp16 for a - b <= 10)
__device__ __forceinline__ unsigned f16_pow2_sum(bool negative, int a, int b) {
  const unsigned sign = negative ? 0x8000u : 0u;
  if (a == b) return sign | (unsigned)(a + 16) << 10;
  return sign | (unsigned)(a + 15) << 10 | 1u << (10 - (a - b));
}

// The fp16 pair (1024 + 2^b·c) of the Q-bit field of pair j (of `per` in a word) in w: fields at bits 0 .. 10 - Q are
// taken in place, the rest after one shift of the word (shared by the pairs of a word after inlining).
template <int Q, int per>
__device__ __forceinline__ unsigned f16_field(unsigned w, int j, int& b) {
  constexpr int fit = (10 - Q) / Q + 1;
  constexpr unsigned mask = ((1u << Q) - 1) * 0x00010001u;
  b = Q * (j < fit ? j : j - fit);
  return and_or(j < fit ? w : w >> (Q * fit), mask << b, Num<__half>::kMagic);
}

// The codes of pair p as exact integers of T (q in both halves).  fp16 holds a code at any bit b <= 10 - Q of the
// magic 1024's mantissa, and (1024 + 2^b·q)·2^-b − 2^(10-b) = q exactly, so a word's lower codes need no shift and
// its upper ones share one (4 bits: one shift per word instead of three); 3-bit codes add their two parts with the
// same FMAs.  bf16 (7 mantissa bits) shifts each pair, and assembles 3-bit codes first.
template <typename T, int Q>
__device__ __forceinline__ typename Num<T>::T2 pair_values(const unsigned (&w)[Words<Q>::n], int p) {
  using T2 = typename Num<T>::T2;
  if constexpr (std::is_same_v<T, __half>) {
    const auto pair = [](unsigned bits) { return as_pair<T2>(bits * 0x00010001u); };
    if constexpr (Q == 3) {  // q = lo + 4·hi: (1024 + 2^b2·lo)·2^-b2 + ((1024 + 2^b1·hi)·2^(2-b1) − 2^(12-b1) − 2^(10-b2))
      int b2, b1;
      const unsigned lo = f16_field<2, 8>(w[p / 8], p % 8, b2);
      const unsigned hi = f16_field<1, 16>(w[Words<Q>::n0 + p / 16], p % 16, b1);
      const T2 t = __hfma2(as_pair<T2>(hi), pair((17u - b1) << 10),
                           pair(f16_pow2_sum(true, max(12 - b1, 10 - b2), min(12 - b1, 10 - b2))));
      return __hfma2(as_pair<T2>(lo), pair((15u - b2) << 10), t);
    } else {
      int b;
      const unsigned h = f16_field<Q, 16 / Q>(w[p / (16 / Q)], p % (16 / Q), b);
      if (b == 0) return __hsub2(as_pair<T2>(h), Num<T>::base());
      return __hfma2(as_pair<T2>(h), pair((15u - b) << 10), pair(0x8000u | (25u - b) << 10));  // 2^-b, -2^(10-b)
    }
  } else {
    return __hsub2(as_pair<T2>(pair_codes<Q>(w, p, Num<T>::kMagic)), Num<T>::base());
  }
}

// One group's raw per-row values of the lane's 4 rows, stored contiguously from pos (a multiple of 4): loaded with
// the codes that use them, converted when they are used.  Uniform: s (4 fp16) and the zero points (4 nibbles); free
// α: α of each plane (4 fp16 each) and the offset c (4 fp16, 0 without one).
template <int Q, bool FREE> struct GroupRaw {
  uint2 s;
  unsigned z;
};
template <int Q> struct GroupRaw<Q, true> {
  uint2 alpha[Q];
  uint2 c;
};

__device__ __forceinline__ uint2 load4h(const void* base, size_t at) {
  return __ldg(reinterpret_cast<const uint2*>(static_cast<const __half*>(base) + at));
}

template <int Q, bool FREE>
__device__ __forceinline__ GroupRaw<Q, FREE> load_group(const QuickArgs& a, int g, int pos) {
  GroupRaw<Q, FREE> r;
  if constexpr (FREE) {
#pragma unroll
    for (int i = 0; i < Q; ++i) r.alpha[i] = load4h(a.scales, ((size_t)g * Q + i) * a.N + pos);
    r.c = a.offsets ? load4h(a.offsets, (size_t)g * a.N + pos) : make_uint2(0u, 0u);
  } else {
    r.s = load4h(a.scales, (size_t)g * a.N + pos);
    r.z = a.zeros ? (unsigned)__ldg(a.zeros + ((size_t)g * a.N + pos) / 4) : 0u;
  }
  return r;
}

__device__ __forceinline__ void halves4(float (&v)[4], uint2 h) {
  const __half2 v01 = *reinterpret_cast<const __half2*>(&h.x), v23 = *reinterpret_cast<const __half2*>(&h.y);
  v[0] = __low2float(v01); v[1] = __high2float(v01); v[2] = __low2float(v23); v[3] = __high2float(v23);
}

// One group's dequantization of the lane's 4 rows, as T pairs, and its application to a register pair of codes.
// Uniform: s_T = T(s) and c'_T = T(−s·z) (exact in fp32: fp16 s times a 4-bit integer or half-integer; one rounding
// to T), ŵ = fma(q, s_T, c'_T).  Free α: a_i = T(2·α_i), c'_T = T(c − α_1 − ... − α_Q) (fp32, in plane order), then
// ŵ = c'_T and per plane ŵ = fma(bit_i, a_i, ŵ) (w = Σ_i α_i·(2·bit_i − 1) + c; one rounding per plane).
template <typename T, int Q, bool FREE> struct GroupDeq {
  using T2 = typename Num<T>::T2;
  T2 s[4], c[4];
  __device__ __forceinline__ void set(const GroupRaw<Q, false>& r, bool has_zeros) {
    if constexpr (std::is_same_v<T, __half>) {
      // fp16 s times z (an integer < 16, or the half-integer (2^Q − 1)/2) is exact in fp32, so one HMUL2 rounds it
      // as the float path below does; s is already fp16
      const __half2 s01 = as_pair<__half2>(r.s.x), s23 = as_pair<__half2>(r.s.y);
      __half2 z01 = __float2half2_rn(((1 << Q) - 1) * 0.5f), z23 = z01;
      if (has_zeros) {  // the 4 rows' nibbles as (z0, z1) and (z2, z3): z1 moves to bits 16..19, z3 to 24..27
        const unsigned zz = r.z | r.z << 12;
        z01 = __hsub2(as_pair<__half2>(and_or(zz, 0x000f000fu, Num<T>::kMagic)), Num<T>::base());
        z23 = __hsub2(as_pair<__half2>(and_or(zz >> 8, 0x000f000fu, Num<T>::kMagic)), Num<T>::base());
      }
      const __half2 c01 = __hneg2(__hmul2_rn(s01, z01)), c23 = __hneg2(__hmul2_rn(s23, z23));
      s[0] = __low2half2(s01); s[1] = __high2half2(s01); s[2] = __low2half2(s23); s[3] = __high2half2(s23);
      c[0] = __low2half2(c01); c[1] = __high2half2(c01); c[2] = __low2half2(c23); c[3] = __high2half2(c23);
    } else {
      float sf[4];
      halves4(sf, r.s);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float z = has_zeros ? (float)((r.z >> (4 * i)) & 15u) : ((1 << Q) - 1) * 0.5f;
        s[i] = Num<T>::pair(sf[i]);
        c[i] = Num<T>::pair(-sf[i] * z);
      }
    }
  }
  // ŵ of pair p of the lane's codes w, row `row` of its 4
  __device__ __forceinline__ unsigned weights(const unsigned (&w)[Words<Q>::n], int p, int row) const {
    const T2 r = __hfma2(pair_values<T, Q>(w, p), s[row], c[row]);
    return *reinterpret_cast<const unsigned*>(&r);
  }
};

template <typename T, int Q> struct GroupDeq<T, Q, true> {
  using T2 = typename Num<T>::T2;
  T2 a[Q][4], c[4];
  __device__ __forceinline__ void set(const GroupRaw<Q, true>& r, bool) {
    float cf[4], af[Q][4];
    halves4(cf, r.c);
#pragma unroll
    for (int i = 0; i < Q; ++i) halves4(af[i], r.alpha[i]);
#pragma unroll
    for (int row = 0; row < 4; ++row) {
#pragma unroll
      for (int i = 0; i < Q; ++i) {
        a[i][row] = Num<T>::pair(2.f * af[i][row]);
        cf[row] -= af[i][row];
      }
      c[row] = Num<T>::pair(cf[row]);
    }
  }
  __device__ __forceinline__ unsigned weights(const unsigned (&words)[Words<Q>::n], int p, int row) const {
    const unsigned codes = pair_codes<Q>(words, p);
    T2 w = c[row];
#pragma unroll
    for (int i = 0; i < Q; ++i) {
      const unsigned h = ((codes >> i) & 0x00010001u) | Num<T>::kMagic;
      const T2 b = __hsub2(*reinterpret_cast<const T2*>(&h), Num<T>::base());  // exact: bit i, 0 or 1
      w = __hfma2(b, a[i][row], w);
    }
    return *reinterpret_cast<const unsigned*>(&w);
  }
};

// What a lane holds of one K tile before its MMAs: the codes and the raw scales (α) of the tile's two 32-input halves
// (group sizes are multiples of 32, so each half has one group).
template <int Q, bool FREE>
struct TileRegs {
  unsigned w[Words<Q>::n];
  GroupRaw<Q, FREE> g[2];
};

template <int Q, bool FREE>
__device__ __forceinline__ void load_tile_regs(TileRegs<Q, FREE>& r, const QuickArgs& a, const GroupOf& group,
                                               const unsigned* tile, int k0, int pos, int lane) {
  load_tile<Q>(r.w, tile, lane);
  r.g[0] = load_group<Q, FREE>(a, group(k0), pos);
  r.g[1] = load_group<Q, FREE>(a, group(k0 + 32), pos);
}

// K tiles a lane keeps in flight (codes and scales in registers, loaded D tiles before their MMAs): deeper where
// the accumulators (and, free α, the Q α per row) leave registers for it.
template <int MT, bool FREE> constexpr int kDepth = FREE ? 2 : MT >= 4 ? 2 : 4;

// How a block reads x: through the cp.async stage pipeline (kPipelined), or staged once, its rows and K slice whole in
// shared memory, as they are (kStaged) or a rotated layer's R·x (kStagedRotated); staged x is instantiated for 16-row
// tiles without perm (decode batches, where a K slice of x fits), rotated x for every layer but free α at 2 bits (whose
// kernel spills 12 bytes with it: nvcc 13, sm_80, fp16; the LUT GEMV stages R·x for those).
enum XSource : int { kPipelined = 0, kStaged = 1, kStagedRotated = 2 };

template <typename T, int Q, int MT, int WM, bool FREE, int XS>
__global__ void __launch_bounds__(32 * kWarpsN * WM) quick_gemm_kernel(const QuickArgs a, const Rotation rot) {
  using T2 = typename Num<T>::T2;
  constexpr int BM = 16 * MT * WM, THREADS = 32 * kWarpsN * WM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const int m0 = blockIdx.y * BM, t0 = blockIdx.z * a.tiles_per_split;
  const int nt_count = min(a.tiles_per_split, a.K / kTileK - t0);

  // Staged x: the block's rows and K slice once, row r at xr + r·ldr (padded by 8 inputs, so that ldmatrix's 8 rows
  // fall in distinct banks), R·x for a rotated layer, while the first D tiles' codes come into L2.  The MMAs read their
  // A fragments straight from it (rows past M read the last row: their outputs are never stored): no stage pipeline,
  // no barrier in the loop (a third fewer instructions per tile than the pipeline).
  constexpr bool kStagedX = XS != kPipelined;
  const T* xr = nullptr;
  const int ldr = quick_staged_ld(a.K, a.tiles_per_split), last_row = min(BM, a.M - m0) - 1;
  if constexpr (kStagedX) {
    const size_t at = XS == kStagedRotated ? rotation_staged_offset(0, rot.block) : 0;
    T* staged = reinterpret_cast<T*>(smem_raw + at);
    const int n_tile = blockIdx.x * kWarpsN + (threadIdx.x >> 5) % kWarpsN, lane = threadIdx.x & 31;
    if (n_tile * kTileN < a.N && lane < 2 * Q)
      for (int j = 0; j < kDepth<MT, FREE> && j < nt_count; ++j)
        prefetch_l2(a.qweight + ((size_t)n_tile * (a.K / kTileK) + t0 + j) * (64 * Q) + lane * 32);
    const int k_lo = t0 * kTileK, chunks = nt_count * kTileK / 8;
    if constexpr (XS == kStagedRotated) {
      stage_rotated<T, T>(static_cast<const T*>(a.x) + (size_t)m0 * a.K, a.K, last_row + 1, k_lo,
                          k_lo + nt_count * kTileK, rot, reinterpret_cast<float*>(smem_raw), staged, ldr);
    } else {
      for (int i = threadIdx.x; i < (last_row + 1) * chunks; i += THREADS) {
        const int r = i / chunks, c = i - r * chunks;
        *reinterpret_cast<uint4*>(staged + r * ldr + 8 * c) =
            __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + (size_t)(m0 + r) * a.K + k_lo + 8 * c));
      }
      __syncthreads();
    }
    xr = staged - k_lo;
  }

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_n = warp % kWarpsN, warp_m = warp / kWarpsN;
  const int n_tile = blockIdx.x * kWarpsN + warp_n;
  const bool active = n_tile * kTileN < a.N;
  const int k_tiles = a.K / kTileK;
  const T* x = static_cast<const T*>(a.x);
  const unsigned* wtile = a.qweight + ((size_t)(active ? n_tile : 0) * k_tiles + t0) * (64 * Q);
  const int pos = n_tile * kTileN + (lane >> 2) * 4;
  constexpr int D = kDepth<MT, FREE>;

  float acc[MT][4][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1 && !kStagedX; ++s) {
    if (s < nt_count) load_a_stage<T, BM, THREADS>(smem + s * BM * kTileK, x, a.perm, a.M, a.K, m0, (t0 + s) * kTileK, tid);
    cp_async_commit();
  }
  // Register ring of the next D tiles' codes and scales: slot j holds tile base + j; it is refilled with tile
  // base + j + D right after its MMAs, so D tiles of loads stay in flight while tiles are multiplied.  The loop
  // over slots is unrolled (register arrays need compile-time indices); nt_count is uniform in a block, so every
  // thread leaves it at the same tile and the barriers stay matched.
  const GroupOf group(a.group_size);
  TileRegs<Q, FREE> ring[D];
#pragma unroll
  for (int j = 0; j < D; ++j)
    if (active && j < nt_count)
      load_tile_regs(ring[j], a, group, wtile + (size_t)j * 64 * Q, (t0 + j) * kTileK, pos, lane);

  for (int base = 0; base < nt_count; base += D) {
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int it = base + j;
      if (it >= nt_count) break;
      if constexpr (!kStagedX) {
        cp_async_wait<kStages - 2>();
        __syncthreads();
        const int nxt_stage = it + kStages - 1;
        if (nxt_stage < nt_count)
          load_a_stage<T, BM, THREADS>(smem + (nxt_stage % kStages) * BM * kTileK, x, a.perm, a.M, a.K, m0,
                                       (t0 + nxt_stage) * kTileK, tid);
        cp_async_commit();
      }
      if (!active) continue;
      GroupDeq<T, Q, FREE> deq[2];  // groups of k16 steps 0-1 and 2-3
      deq[0].set(ring[j].g[0], a.zeros != nullptr);
      deq[1].set(ring[j].g[1], a.zeros != nullptr);
      T* stage = smem + (it % kStages) * BM * kTileK;
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        unsigned af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int row = (warp_m * MT + mt) * 16 + (lane & 15), chunk = ks * 2 + (lane >> 4);
          if constexpr (kStagedX)
            ldmatrix_x4(af[mt], xr + min(row, last_row) * ldr + (t0 + it) * kTileK + chunk * 8);
          else
            ldmatrix_x4(af[mt], a_chunk(stage, row, chunk));
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int p = (ks * 4 + nt) * 2;
          const unsigned b0 = deq[ks >> 1].weights(ring[j].w, p, nt);
          const unsigned b1 = deq[ks >> 1].weights(ring[j].w, p + 1, nt);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma<T>(acc[mt][nt], af[mt], b0, b1);
        }
      }
      if (it + D < nt_count)
        load_tile_regs(ring[j], a, group, wtile + (size_t)(it + D) * 64 * Q, (t0 + it + D) * kTileK, pos, lane);
    }
  }
  cp_async_wait<0>();
  if (!active) return;
  const bool direct = a.splits == 1;

  float* part = direct ? nullptr : a.partial + (size_t)blockIdx.z * a.M * a.N;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int m = m0 + (warp_m * MT + mt) * 16 + (lane >> 2) + 8 * half;
      if (m >= a.M) continue;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int n = n_tile * kTileN + nt * 8 + 2 * (lane & 3);
        float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (direct) {
          if (a.bias) { v0 += bias_at<T>(a.bias, a.bias_dtype, n); v1 += bias_at<T>(a.bias, a.bias_dtype, n + 1); }
          T2 out;
          out.x = from_float<T>(v0);
          out.y = from_float<T>(v1);
          *reinterpret_cast<T2*>(static_cast<T*>(a.y) + (size_t)m * a.N + n) = out;
        } else {
          *reinterpret_cast<float2*>(part + (size_t)m * a.N + n) = make_float2(v0, v1);
        }
      }
    }
  }
}

// One warp per 32×64 tile: the lane's fragments, dequantized exactly as in the GEMM, staged in shared memory and
// written to Ŵ[n][k] in 16-byte pieces, each warp store covering 4 whole 128-byte rows (a lane's fragments alone
// would be 4-byte pieces of 8 rows per store).  Staged rows are padded by 16 bytes: the fragment writes hit 32 banks.
constexpr int kStagedRow = kTileK / 2 + 4;  // 32-bit words per staged row of 64 fp16/bf16 values
constexpr size_t kDequantSmem = 4 * kTileN * kStagedRow * sizeof(unsigned);

template <typename T, int Q, bool FREE>
__global__ void __launch_bounds__(128) quick_dequantize_kernel(const QuickArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile = blockIdx.x * 4 + warp;
  const int k_tiles = a.K / kTileK;
  const bool valid = tile < (a.N / kTileN) * k_tiles;  // no early exit: every thread reaches the barrier
  const int n_tile = tile / k_tiles, k0 = (tile % k_tiles) * kTileK;
  unsigned* staged = reinterpret_cast<unsigned*>(smem_raw) + warp * kTileN * kStagedRow;
  if (valid) {
    TileRegs<Q, FREE> r;
    load_tile_regs(r, a, GroupOf(a.group_size), a.qweight + (size_t)tile * 64 * Q, k0,
                   n_tile * kTileN + (lane >> 2) * 4, lane);
    GroupDeq<T, Q, FREE> deq;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks % 2 == 0) deq.set(r.g[ks / 2], a.zeros != nullptr);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)  // row nt·8 + lane/4, inputs ks·16 + 2·(lane % 4) + 8h and the next
          staged[(nt * 8 + (lane >> 2)) * kStagedRow + ks * 8 + (lane & 3) + 4 * h] =
              deq.weights(r.w, (ks * 4 + nt) * 2 + h, nt);
    }
  }
  __syncthreads();
  if (!valid) return;
  T* out = static_cast<T*>(a.y) + (size_t)n_tile * kTileN * a.K + k0;
#pragma unroll
  for (int i = 0; i < kTileN / 4; ++i) {  // piece c of the tile: row c / 8, 16-byte piece c % 8
    const int c = i * 32 + lane, row = c >> 3, piece = c & 7;
    *reinterpret_cast<uint4*>(out + (size_t)row * a.K + piece * 8) =
        *reinterpret_cast<const uint4*>(staged + row * kStagedRow + piece * 4);
  }
}

// The launcher's choice of XSource for a launch with BM-row tiles of elem-byte x.
int x_source(const QuickArgs& a, const Rotation& rot, int BM, size_t elem) {
  if (rot.block) return kStagedRotated;
  const size_t staged = (size_t)min(BM, a.M) * quick_staged_ld(a.K, a.tiles_per_split) * elem;
  return BM == 16 && !a.perm && staged <= kQuickStagedMax ? kStaged : kPipelined;
}

template <typename T, int Q, int MT, int WM>
cudaError_t launch(const QuickArgs& a, const Rotation& rot, cudaStream_t stream) {
  constexpr int BM = 16 * MT * WM;
  const size_t staged = (size_t)min(BM, a.M) * quick_staged_ld(a.K, a.tiles_per_split) * sizeof(T);
  const int xs = x_source(a, rot, BM, sizeof(T));
  const size_t smem = xs == kStagedRotated ? rotation_staged_offset(0, rot.block) + staged
                      : xs == kStaged      ? staged
                                           : (size_t)kStages * BM * kTileK * sizeof(T);
  auto kernel = a.free_alpha ? quick_gemm_kernel<T, Q, MT, WM, true, kPipelined>
                             : quick_gemm_kernel<T, Q, MT, WM, false, kPipelined>;
  if constexpr (MT == 1 && WM == 1) {
    if (xs != kPipelined && a.perm) return cudaErrorInvalidValue;
    if (xs == kStaged)
      kernel = a.free_alpha ? quick_gemm_kernel<T, Q, 1, 1, true, kStaged> : quick_gemm_kernel<T, Q, 1, 1, false, kStaged>;
    if (xs == kStagedRotated) {
      if (!a.free_alpha) kernel = quick_gemm_kernel<T, Q, 1, 1, false, kStagedRotated>;
      else if constexpr (Q > 2) kernel = quick_gemm_kernel<T, Q, 1, 1, true, kStagedRotated>;
      else return cudaErrorInvalidValue;  // free α at 2 bits: not instantiated, it spills (nvcc 13, sm_80)
    }
  } else {
    if (xs != kPipelined) return cudaErrorInvalidValue;
  }
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid((a.N + kTileN * kWarpsN - 1) / (kTileN * kWarpsN), (a.M + BM - 1) / BM, a.splits);
  if (a.splits > 1 && a.partial == nullptr) return cudaErrorInvalidValue;
  kernel<<<grid, 32 * kWarpsN * WM, smem, stream>>>(a, rot);
  if (a.splits > 1) reduce_splits<T>(a.partial, a.bias, a.bias_dtype, a.y, a.splits, a.M, a.N, stream);
  return cudaGetLastError();
}

template <typename T, int Q>
cudaError_t dispatch_tile(const QuickArgs& a, const Rotation& r, cudaStream_t s) {
  switch (a.tile_m) {
    case 16: return launch<T, Q, 1, 1>(a, r, s);
    case 32: return launch<T, Q, 2, 1>(a, r, s);
    case 64: return launch<T, Q, 4, 1>(a, r, s);
    case 128: return launch<T, Q, 4, 2>(a, r, s);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_q(const QuickArgs& a, const Rotation& r, cudaStream_t s, bool dequant) {
  if (dequant) {
    const int blocks = ((a.N / kTileN) * (a.K / kTileK) + 3) / 4;
    switch (a.Q * 2 + a.free_alpha) {
      case 4: quick_dequantize_kernel<T, 2, false><<<blocks, 128, kDequantSmem, s>>>(a); break;
      case 5: quick_dequantize_kernel<T, 2, true><<<blocks, 128, kDequantSmem, s>>>(a); break;
      case 6: quick_dequantize_kernel<T, 3, false><<<blocks, 128, kDequantSmem, s>>>(a); break;
      case 7: quick_dequantize_kernel<T, 3, true><<<blocks, 128, kDequantSmem, s>>>(a); break;
      case 8: quick_dequantize_kernel<T, 4, false><<<blocks, 128, kDequantSmem, s>>>(a); break;
      case 9: quick_dequantize_kernel<T, 4, true><<<blocks, 128, kDequantSmem, s>>>(a); break;
      default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  switch (a.Q) {
    case 2: return dispatch_tile<T, 2>(a, r, s);
    case 3: return dispatch_tile<T, 3>(a, r, s);
    case 4: return dispatch_tile<T, 4>(a, r, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t run(const QuickArgs& a, const Rotation& rot, cudaStream_t stream, bool dequant) {
  if (a.N % kTileN || a.K % kTileK || a.K >= (1 << 20) || a.group_size % 32 || a.splits < 1 || a.tiles_per_split < 1 ||
      rotation_invalid(rot))
    return cudaErrorInvalidValue;
  if (a.x_dtype == DType::kHalf) return dispatch_q<__half>(a, rot, stream, dequant);
  if (a.x_dtype == DType::kBFloat16) return dispatch_q<__nv_bfloat16>(a, rot, stream, dequant);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t quick_gemm(const QuickArgs& a, const Rotation& rot, cudaStream_t stream) { return run(a, rot, stream, false); }
cudaError_t quick_dequantize(const QuickArgs& a, cudaStream_t stream) { return run(a, Rotation{}, stream, true); }

}  // namespace qlinear
