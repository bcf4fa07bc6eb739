// The batched path on AMX (Sapphire Rapids and later): each 16-row block of Ŵ is dequantized to bfloat16 into a
// buffer that stays in cache (dequantize / mixed_dequantize: the format's values rounded once), then multiplied by
// the activations on AMX tiles (TDPBF16PS: bfloat16 products summed in float32).  Ŵ is never written to memory
// whole, and x is packed once per call.  Layout of the operands (qgemm.h, amx_gemm):
//   A  tile 0: 16 rows of Ŵ × 32 inputs (64 bytes per row, row stride K bfloat16: the block buffer);
//   B  tile 1: x packed as xp[g][k/2][m][2] (g: 16 activation rows, pairs of inputs per 32-bit element, as TDPBF16PS
//      reads them), 16 pairs × 16 rows = 64 bytes per tile row;
//   C  tiles 2..7: yᵀ for the block's 16 rows × 16 activation rows each, float32; up to 6 activation groups per pass.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qgemm.h"

#if defined(__linux__) && !defined(QLINEAR_X86_SIMDE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QLINEAR_AMX 1
#define QLINEAR_TARGET(features) __attribute__((target(features)))
#include "bf16.h"
#endif

namespace qlinear_x86 {

#ifdef QLINEAR_AMX
namespace {
constexpr int kRows = 16, kGroups = 6;

template <typename T>
struct Aligned {  // a buffer's first 64-byte boundary
  T* p;
  T* data() const { return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63)); }
};

// One pass over activation groups g0 .. g0 + NG − 1: C tile 2 + j accumulates group g0 + j over all of K.
template <int NG>
__attribute__((target("amx-tile,amx-bf16"))) void pass(const uint16_t* wb, int K, const uint16_t* xp, int g0,
                                                        float* yt, int ldy) {
#define QLINEAR_C(j, stmt) \
  if (NG > j) stmt;
  QLINEAR_C(0, _tile_zero(2)) QLINEAR_C(1, _tile_zero(3)) QLINEAR_C(2, _tile_zero(4))
  QLINEAR_C(3, _tile_zero(5)) QLINEAR_C(4, _tile_zero(6)) QLINEAR_C(5, _tile_zero(7))
  const int64_t group = static_cast<int64_t>(K / 2) * 32;  // bfloat16 elements of one group's packed x
  for (int c = 0; c < K / 32; ++c) {
    _tile_loadd(0, wb + 32 * c, 2 * K);
    const uint16_t* b = xp + static_cast<int64_t>(g0) * group + static_cast<int64_t>(c) * 16 * 32;
#define QLINEAR_STEP(j, tile) \
  if (NG > j) {                          \
    _tile_loadd(1, b + (j) * group, 64); \
    _tile_dpbf16ps(tile, 0, 1);          \
  }
    QLINEAR_STEP(0, 2) QLINEAR_STEP(1, 3) QLINEAR_STEP(2, 4) QLINEAR_STEP(3, 5) QLINEAR_STEP(4, 6) QLINEAR_STEP(5, 7)
#undef QLINEAR_STEP
  }
  float* o = yt + 16 * g0;
  QLINEAR_C(0, _tile_stored(2, o, 4 * ldy)) QLINEAR_C(1, _tile_stored(3, o + 16, 4 * ldy))
  QLINEAR_C(2, _tile_stored(4, o + 32, 4 * ldy)) QLINEAR_C(3, _tile_stored(5, o + 48, 4 * ldy))
  QLINEAR_C(4, _tile_stored(6, o + 64, 4 * ldy)) QLINEAR_C(5, _tile_stored(7, o + 80, 4 * ldy))
#undef QLINEAR_C
}

// Palette 1, tiles 0..7 of 16 rows × 64 bytes (LDTILECFG's 64-byte layout: palette, start row, 14 reserved bytes,
// 16 column widths (uint16), 16 row counts; every unused byte must be zero).
__attribute__((target("amx-tile"))) void configure() {
  alignas(64) uint8_t cfg[64];
  std::memset(cfg, 0, sizeof(cfg));
  cfg[0] = 1;
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;
    cfg[48 + t] = 16;
  }
  asm volatile("" : : "r"(cfg) : "memory");  // GCC 12 assumes LDTILECFG reads 16 bytes and drops the other stores
  _tile_loadconfig(cfg);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// r[j] lane i = s[i][j] for a 16x16 block of 32-bit values (rows of s past `in_rows` read as zero).  Unpacks of 32-
// and 64-bit pairs, then two rounds of 128-bit lane shuffles.
__attribute__((target("avx512f"))) inline void transpose16(const uint32_t* s, int64_t ls, int in_rows, __m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < in_rows ? _mm512_loadu_si512(s + i * ls) : _mm512_setzero_si512();
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: lane L holds rows 2i, 2i+1 at columns 4L, 4L+1 / 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j]: lane L holds column 4L + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // 0x88: lanes 0, 2 of each operand; 0xDD: lanes 1, 3
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j: lane q from r[4q + j] lane L
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// y[m][n0 + r] = c[r][m] + bias[n0 + r] for m < M, r < rows (c: a block's yᵀ, row stride ldc), rounded once to
// bfloat16 bits.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void write_block(const float* c, int ldc, int M, const float* bias,
                                                                      int n0, int rows, int N, uint16_t* y) {
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int m0 = 0; m0 < M; m0 += 16) {
    __m512i r[16];
    transpose16(reinterpret_cast<const uint32_t*>(c + m0), ldc, kRows, r);
    for (int i = 0; i < std::min(16, M - m0); ++i) {
      const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[i]), bv);
      _mm256_mask_storeu_epi16(y + static_cast<int64_t>(m0 + i) * N + n0, keep, bf16x16(v));
    }
  }
}
}  // namespace

__attribute__((target("avx512f"))) void amx_pack(const uint16_t* x, int M, int K, uint16_t* xp, int g0, int g1) {
  // a pair of bfloat16 inputs is one 32-bit value: per group, 16 rows x K/2 pairs transposed to K/2 x 16
  const auto* x32 = reinterpret_cast<const uint32_t*>(x);
  auto* p32 = reinterpret_cast<uint32_t*>(xp);
  const int P = K / 2;
  for (int g = g0; g < g1; ++g)
    for (int p = 0; p < P; p += 16) {
      __m512i r[16];
      transpose16(x32 + static_cast<int64_t>(16) * g * P + p, P, std::min(16, M - 16 * g), r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(p32 + (static_cast<int64_t>(g) * P + p + i) * 16, r[i]);
    }
}

bool amx_supported() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXCompPerm = 0x1023, kXTileData = 18;  // Linux: the process asks to use the tile state
    return syscall(SYS_arch_prctl, kReqXCompPerm, kXTileData) == 0;
  }();
  return ok;
}

void amx_gemm(int N, int K, int M, const uint16_t* xp, const float* bias, uint16_t* y, int b0, int b1,
              void (*dequant)(const void*, int, uint16_t*), const void* weights) {
  // R blocks of Ŵ (≤ 1 MB of bfloat16) share each pass's activation groups, so a group's packed x is read from
  // memory once per R blocks, not once per block
  const int G = (M + 15) / 16, ldy = 16 * G, R = std::max(1, (1 << 20) / (2 * kRows * K));
  // kept between calls (a fresh 1 MB buffer would cost its page faults); tile rows 64-byte aligned: rows that straddle
  // two cache lines made TDPBF16PS ~3x slower (23 vs 64-72 cycles per instruction, K = 4096)
  thread_local std::vector<uint16_t> wb_store;
  thread_local std::vector<float> yt_store;
  wb_store.resize(static_cast<size_t>(R) * kRows * K + 32);
  yt_store.resize(static_cast<size_t>(R) * kRows * ldy + 16);
  const Aligned<uint16_t> wb{wb_store.data()};
  const Aligned<float> yt{yt_store.data()};
  configure();
  for (int s = b0; s < b1; s += R) {
    const int nb = std::min(R, b1 - s);
    for (int i = 0; i < nb; ++i) dequant(weights, s + i, wb.data() + static_cast<size_t>(i) * kRows * K);
    for (int g0 = 0; g0 < G; g0 += kGroups) {
      for (int i = 0; i < nb; ++i) {
        const uint16_t* a = wb.data() + static_cast<size_t>(i) * kRows * K;
        float* c = yt.data() + static_cast<size_t>(i) * kRows * ldy;
        switch (std::min(kGroups, G - g0)) {
          case 1: pass<1>(a, K, xp, g0, c, ldy); break;
          case 2: pass<2>(a, K, xp, g0, c, ldy); break;
          case 3: pass<3>(a, K, xp, g0, c, ldy); break;
          case 4: pass<4>(a, K, xp, g0, c, ldy); break;
          case 5: pass<5>(a, K, xp, g0, c, ldy); break;
          default: pass<6>(a, K, xp, g0, c, ldy); break;
        }
      }
    }
    for (int i = 0; i < nb; ++i) {  // block by block: its 16 rows of yᵀ stay in L1 while y is written
      const int n0 = kRows * (s + i);
      write_block(yt.data() + static_cast<size_t>(i) * kRows * ldy, ldy, M, bias, n0, std::min(kRows, N - n0), N, y);
    }
  }
  release();
}
#else
bool amx_supported() { return false; }

void amx_gemm(int, int, int, const uint16_t*, const float*, uint16_t*, int, int, void (*)(const void*, int, uint16_t*),
              const void*) {}
void amx_pack(const uint16_t*, int, int, uint16_t*, int, int) {}
#endif

}  // namespace qlinear_x86
