// bfloat16 rounding shared by kernels.cpp and amx.cpp.  The includer provides the AVX-512 intrinsics (<immintrin.h>
// or SIMDe's aliases) and QLINEAR_TARGET.
#pragma once

#include <cstdint>
#include <cstring>

namespace qlinear_x86 {

// float32 -> bfloat16 bits, rounded to nearest even: torch's .to(torch.bfloat16) for finite values (Ŵ and y have no NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// bf16_bits of 16 floats, in order.
QLINEAR_TARGET("avx512f,avx512bw")
inline __m256i bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 31, 29, 27, 25,
                                        23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);  // the high half of each dword
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(even, r));
}

}  // namespace qlinear_x86
