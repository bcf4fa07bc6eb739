// x86 CPU kernels (torch-free): 4-bit weights (uniform, or free-α BCQ) times int8 dynamic activations, accumulated
// exactly in int32 by VPDPBUSD (AVX-512 VNNI, AVX-VNNI) or VPMADDUBSW + VPMADDWD (AVX2), scaled in fp32.
//
// Weight layout (backends/x86/__init__.py has the executable PyTorch spec and the exact inverse):
//   qw  uint8 [Nb, K/8, 64]: 16-row block b, 8-input chunk c; byte 4r + j holds code[16b + r][8c + j] in its low
//       nibble and code[16b + r][8c + 4 + j] in its high nibble (r = 0..15, j = 0..3): one 64-byte load gives, per
//       32-bit lane r, four codes of row r for each half of the chunk (VPDPBUSD's unsigned operand).
//   qs  fp16  [Nb, G, 16]: the scale s of each row of the block in group g.
//   qz  uint8 [Nb, G, 16]: 2·z (twice the zero point: 15 for the symmetric levels z = 7.5).
//   Rows past N are zero (codes, s and z).
// Free-α BCQ 4-bit (format kBCQ4): qw as above (code = Σ_i bit_i·2^i), and instead of qs/qz
//   qa  fp16  [Nb, G, 4, 16]: α_i of each row (plane i = 0..3);  qc  fp16 [Nb, G, 16]: the offset c (0 without).
//   w = Σ_i α_i·(2·bit_i − 1) + c, so Σ_k w·x̂ = Σ_i α_i·2^(1−i)·Σ_k (code & 2^i)·x̂ + (c − Σ_i α_i)·Σ_k x̂:
//   per plane one VPDPBUSD of the masked codes; the same activations and group sums as the uniform kernel.
// Activations: per row m and 32 inputs h, xq = round_half_even(x · (127 / amax)) in int8 and xs = amax / 127.
//
//   y[m][n] = Σ_g s[n][g] · (Σ_{h ∈ g} xs[m][h] · Σ_{k ∈ h} code[n][k]·xq[m][k]  −  z[n][g] · Σ_{h ∈ g} xs[m][h]·Σ_{k ∈ h} xq[m][k])
//
// Every path computes the same int32 sums and the same fp32 operations in the same order, so all paths give the
// same bits.
#pragma once

#include <cstdint>

namespace qlinear_x86 {

enum Path { kAuto = 0, kScalar = 1, kAVX2 = 2, kAVX2VNNI = 3, kAVX512VNNI = 4 };
enum Format { kU4 = 0, kBCQ4 = 1 };

struct Weights {
  const uint8_t* qw;
  const uint16_t* qs;  // fp16 bits (kU4)
  const uint8_t* qz;   // kU4
  int N, K, group_size;
  int format = kU4;
  const uint16_t* qa = nullptr;  // fp16 bits (kBCQ4)
  const uint16_t* qc = nullptr;  // fp16 bits (kBCQ4)
};

struct Acts {
  const int8_t* xq;    // [M, K]
  const float* xs;     // [M, K/32]
  const float* xsum;   // [M, G]: Σ_{h ∈ g} xs·Σ xq, accumulated in h order
  int M;
};

// Bytes of the work buffer prepare_acts fills (16-byte aligned by the caller).
int64_t acts_bytes(int M, int K, int group_size);
// Quantize x [M, K] (float32) into the work buffer and point `a` at its parts.
void prepare_acts(const float* x, int M, int K, int group_size, void* work, Acts* a);
// The best path this CPU runs (cpuid, read once).
int best_path();
// Whether this CPU can run `path`.
bool path_supported(int path);
// y [M, N] float32 = x Wᵀ (+ bias) for the 16-row blocks [b0, b1).
void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path);

}  // namespace qlinear_x86
