// x86 CPU kernels (torch-free): quantized weights times int8 dynamic activations, the products summed exactly in
// int32, scaled in fp32 (and, at the end of this header, the mixed format's GEMV).  Three weight layouts
// (backends/x86/__init__.py has the executable PyTorch spec of each and their exact inverses):
//
// kUniform, uniform 4-bit or 8-bit codes, multiplied by VPDPBUSD (AVX-512 VNNI, AVX-VNNI) or VPMADDUBSW + VPMADDWD
// (AVX2; 8-bit codes as two nibbles there, since pairs of 255·127 overflow VPMADDUBSW's int16):
//   qw  4 bits: uint8 [Nb, K/8, 64]: 16-row block b, 8-input chunk c; byte 4r + j holds code[16b + r][8c + j] in its
//       low nibble and code[16b + r][8c + 4 + j] in its high nibble (r = 0..15, j = 0..3): one 64-byte load gives,
//       per 32-bit lane r, four codes of row r for each half of the chunk (VPDPBUSD's unsigned operand).
//       8 bits: uint8 [Nb, K/4, 64]: 4-input chunk c; byte 4r + j holds code[16b + r][4c + j].
//
// kLutUniform / kLutFree, BCQ bit-planes (1-4 bits) looked up in tables of activation sums (LUT-GEMM's idea with
// T-MAC's nibble tables on VPERMB):
//   qw  uint8 [Nb, K/32, B, 64]: block b, 32-input block h, plane i; byte 16g + r holds in its low nibble bit t =
//       bit_i[16b + r][32h + 4g + t] and in its high nibble bit t = bit_i[16b + r][32h + 16 + 4g + t] (t = 0..3,
//       g = 0..3): each 16 bytes are the 16 rows of one group of 4 inputs (one VPSHUFB lane; AVX-512 reorders to
//       4r + g so that VPDPBUSD adds a row's 4 groups).
//   Activation tables int8 [M, K/32, 4, 64] (prepare_acts): with x̂ = 16·hi + lo (lo = x̂ & 15 in 0..15, hi = x̂ >> 4
//   in −8..7), table 2·half + part holds at entry 16g + p the sum Σ_{t: bit t of p} part(x̂[32h + 16·half + 4g + t])
//   (lo sums 0..60, hi sums −32..28: both fit int8).  A plane's nibble, with its group g in bits 4-5, indexes the
//   64-byte table (VPERMB), and VPDPBUSD adds 4 lookups of one row times 1 (lo) or 16 (hi):
//   S_i[m][n][h] = Σ_{k ∈ h} bit_i[n][k]·xq[m][k], exactly.  (AVX-512, uniform layers, 4 or 8 activation rows at a
//   time: the planes are first turned into codes Σ_i 2^i·bit_i in kUniform's 4-bit order and multiplied as those codes,
//   giving the same I = Σ_i 2^i·S_i.)
//
// kCB4 / kCB2, group-wise codebooks (codebook format, 4 or 2 bits): each code, with its (row, group)'s book in the bits
// above it, indexes the layer's table of int8 centroids (all books together: 16 bytes, VPSHUFB's table):
//   qw  kCB4: as 4-bit kUniform (the codes as nibbles);  kCB2: uint8 [Nb, K/16, 64]: 16-input chunk c, byte 4r + j holds in
//       bits 2t..2t+1 code[16b + r][16c + 4t + j] (t, j = 0..3).
//   table  int8 [16]: entry (book << bits) | code = codebooks[book][code] (qz in the binding: the codebooks).
//   qb  int32 [Nb, G] (several books only, else null): bits 2r..2r+1 the book of row r in group g.
//   qs  fp16 [Nb, G, 16]: each row's scale.
//   I[m][n][h] = Σ_{k ∈ h} table[code]·xq[m][k], exactly (VNNI paths: Σ (table + 128)·xq − 128·xqsum[m][h], u8 × s8;
//   AVX2: VPMADDUBSW of |table| and xq with table's sign, |128·127·2| < 2^15);
//   y[m][n] = Σ_g s·Σ_{h ∈ g} xs[m][h]·I[m][n][h].
//
// Per-group values, qs/qz (uniform, both layouts):
//   qs  fp16  [Nb, G, 16]: the scale s of each row of the block in group g.
//   qz  uint8 [Nb, G, 16]: 2·z (twice the zero point: 2^B − 1 for the symmetric levels z = (2^B − 1)/2); 8-bit
//       layers: qz16 uint16 [Nb, G, 16] (2·z up to 510).
// and qa/qc (kLutFree):
//   qa  fp16  [Nb, G, B, 16]: α_i of each row;  qc  fp16 [Nb, G, 16]: the offset c (0 without one).
// Rows past N are zero.
// Activations: per row m and 32 inputs h, xq = round_half_even(x · (127 / amax)) in int8 and xs = amax / 127;
// xsum[m][g] = Σ_{h ∈ g} xs[m][h]·Σ_{k ∈ h} xq[m][k].
//
//   uniform: y[m][n] = Σ_g s·(Σ_{h ∈ g} xs[m][h]·I[m][n][h]  −  z·xsum[m][g]),  I = Σ_{k ∈ h} code·xq (= Σ_i 2^i·S_i)
//   free α:  y[m][n] = Σ_g (Σ_i 2α_i·Σ_{h ∈ g} xs[m][h]·S_i[m][n][h]  +  (c − Σ_i α_i)·xsum[m][g])
//            (w = Σ_i α_i·(2·bit_i − 1) + c)
//
// Every path computes the same int32 sums and the same fp32 operations in the same order, so all paths give the
// same bits.
#pragma once

#include <cstdint>

namespace qlinear_x86 {

enum Path { kAuto = 0, kScalar = 1, kAVX2 = 2, kAVX2VNNI = 3, kAVX512VNNI = 4 };
enum Format { kUniform = 0, kLutUniform = 1, kLutFree = 2, kCB4 = 3, kCB2 = 4 };

struct Weights {
  const uint8_t* qw;
  const uint16_t* qs;  // fp16 bits: scales (uniform) or α (kLutFree)
  const uint8_t* qz;   // 2·z (uniform)
  int N, K, group_size;
  int format = kUniform;
  int bits = 4;
  const uint16_t* qc = nullptr;  // fp16 bits: offsets (kLutFree)
  const int8_t* table = nullptr;  // [16] centroids (kCB4, kCB2)
  const int32_t* qb = nullptr;    // [Nb, G] book words (kCB4, kCB2 with several books)
  const uint16_t* qz16 = nullptr;  // [Nb, G, 16] 2·z of 8-bit kUniform layers (in place of qz)
};

struct Acts {
  const int8_t* xq;    // [M, K]
  const float* xs;     // [M, K/32]
  const float* xsum;   // [M, G]: Σ_{h ∈ g} xs·Σ xq, accumulated in h order
  const int8_t* tables;  // [M, K/32, 4, 64] (LUT formats only, else null)
  const int32_t* xqsum;  // [M, K/32]: Σ xq per 32 inputs
  int M;
};

// Bytes of the work buffer prepare_acts fills (64-byte aligned by the caller); `tables` for the LUT formats.
int64_t acts_bytes(int M, int K, int group_size, bool tables);
// Quantize x [M, K] (float32) into the work buffer (and build the LUT formats' tables) and point `a` at its parts.
void prepare_acts(const float* x, int M, int K, int group_size, bool tables, void* work, Acts* a);
// The best path this CPU runs for `format` (cpuid).
int best_path(int format);
// Whether this CPU can run `path` for `format` (the bit-plane formats' AVX-512 path also needs VBMI).
bool path_supported(int path, int format);
// y [M, N] float32 = x Wᵀ (+ bias) for the 16-row blocks [b0, b1).
void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path);
// Rows [16·b0, min(16·b1, N)) of Ŵ, the values of the canonical formats' dequantization
// (qlinear/formats): uniform s·(code − z); free α +0 ± α_1 ± ... ± α_B in plane order, + c; codebooks
// s·centroid.  For the backward pass (grad_x = grad·Ŵ) without converting the layout back, and for the batched path
// (a tile of rows at a time).  Row n at out + (n − row0)·K; bf16: bfloat16 bits, each value rounded once from the
// float32 one (to_bf16).
void dequantize(const Weights& w, void* out, int b0, int b1, bool bf16, int row0 = 0);

// float32 in[0..n) -> bfloat16 bits, rounded to nearest even (torch's .to(torch.bfloat16) for finite values; Ŵ has
// no NaN).
void to_bf16(const float* in, uint16_t* out, int64_t n);

// fp16 bits -> float32, exact.
float half_to_float(uint16_t h);

// Mixed 2/4/16 format (qlinear/formats/mixed.py), layout x86_mixed (mixed.cpp): int8 activations per 16 inputs, the
// weights interleaved for 16 rows at once (lane r = row 16b + r of block b; rows past N are zero).  The groups of a
// block come in layout order: the 2-bit groups (ascending), then the 4-bit groups.
//   q2  uint32 [Nb, W2, 16], W2 = G2·g/16: word c of lane r holds in byte j, bits 2t..2t+1, code[16b + r][16c + 4t + j]
//       of the 2-bit groups' columns (ascending): (word >> 2t) & 0x03030303 pairs with activations 16c + 4t .. + 3
//   q4  uint32 [Nb, W4, 16], W4 = G4·g/8: word c of lane r holds in byte j code[16b + r][8c + j] (low nibble) and
//       code[16b + r][8c + 4 + j] (high nibble) of the 4-bit groups' columns
//   sc  uint32 [Nb, G·scale_bits/2]: the first-order scale code of row 16b + r, group i at bit scale_bits·(16i + r)
//   z   uint32 [Nb, G2 + 2·G4]: the zero point of row 16b + r, 2-bit group i at bit 32i + 2r, 4-bit group i at bit
//       32·G2 + 64i + 4r
//   ss, sz  fp16 [S2, G]: scale_scale, scale_zero per row chunk (scale_group_size rows), groups in layout order
//   kinds  [ceil(G/32)]: bit i set for each 4-bit group i (group i's columns are i·g .. i·g + g − 1 of x)
//   ov, oc, orp: the outliers as CSR (float32 values, int32 columns of the layer's input, int32 row pointers) or null
// Activations (mixed_prepare_acts): per row m and 16 inputs h of x, xq = round_half_even(x·127/amax) in int8,
// xs = amax/127 and xsum = Σ_{k ∈ h} xq as float32.  Per row n, group i (zero z, scale ŝ = sz + ss·code, fp32):
//   I_h = Σ_{k ∈ h} q·xq exactly (VPDPBUSD or VPMADDUBSW + VPMADDWD), t_i = Σ_{h ∈ i} xs_h·(I_h − z·xsum_h) (fp32
//   FMAs in h order, I_h − z·xsum_h exact), y[m][n] = Σ_i ŝ_i·t_i (FMAs, groups in layout order) + Σ_outliers
//   o·x[m][col] (FMAs in CSR order) + bias[n].  Every path gives the same bits.
struct MixedWeights {
  int N, group_size, G2, G4, scale_bits, scale_group_size;
  const uint32_t *q2, *q4, *sc, *z;
  const uint16_t *ss, *sz;
  const uint32_t* kinds;
  const float* ov = nullptr;
  const int32_t* oc = nullptr;
  const int32_t* orp = nullptr;
};

struct MixedActs {
  const int8_t* xq;   // [M, K]
  const float* xs;    // [M, K/16]
  const float* xsum;  // [M, K/16]
  const float* x;     // [M, K] float32 (the outliers)
  int M, K;
};

// Per-block quantization of activations (prepare_acts' and mixed_prepare_acts' arithmetic): x[0..n) -> q, returns
// Σ q and sets scale = amax / 127.
int quantize_block(const float* x, int n, int8_t* q, float* scale);
// Bytes of the mixed format's activation buffer (64-byte aligned by the caller).
int64_t mixed_acts_bytes(int M, int K);
// Quantize x [M, K] float32 into the work buffer, per 16 inputs, and point `a` at its parts (and at x).
void mixed_prepare_acts(const float* x, int M, int K, void* work, MixedActs* a);
// Whether this CPU runs `path` for the mixed format (kScalar, kAVX2, kAVX2VNNI; kAVX512VNNI also needs VBMI).
bool mixed_path_supported(int path);
// Rows [16·b0, min(16·b1, N)) of Ŵ [N, K] float32, row n at out + (n − row0)·K: qlinear.formats.mixed.dequantize's
// values (ŝ·(q − z) per weight, each outlier added to its weight), for batches above the GEMV's and the backward pass
// (path kAuto: AVX-512 (with VBMI) or AVX2 where the CPU has it, else scalar; the same bits).  bf16: out is bfloat16 bits, each value
// rounded once (to_bf16) from the float32 one.
void mixed_dequantize(const MixedWeights& w, void* out, int b0, int b1, int path, int row0, bool bf16);
// y [M, N] float32 for the 16-row blocks [b0, b1) (path kAuto: the best this CPU runs; every path the same bits).
void mixed_run(const MixedWeights& w, const MixedActs& a, const float* bias, float* y, int b0, int b1, int path);

// AMX (amx.cpp; Linux): whether this CPU has AMX-BF16 and the OS grants the tile state (asked once).
bool amx_supported();
// y [M, N] bfloat16 bits (row-major) for the 16-row blocks [b0, b1): dequant(weights, b, buf) writes block b's rows of
// Ŵ as bfloat16 [16, K] into buf (rows past N: anything); xp is x bfloat16 packed as [ceil(M/16)][K/2][16][2]
// (activation rows padded with zeros).  Each y value: Σ over 32-input chunks of TDPBF16PS (bfloat16 products, float32
// sums), + bias[n] (float32; null: none), rounded once (bf16_bits).
void amx_gemm(int N, int K, int M, const uint16_t* xp, const float* bias, uint16_t* y, int b0, int b1,
              void (*dequant)(const void* weights, int b, uint16_t* buf), const void* weights);
// xp's activation groups [g0, g1) from x bfloat16 [M, K] (row-major; K a multiple of 32).
void amx_pack(const uint16_t* x, int M, int K, uint16_t* xp, int g0, int g1);

}  // namespace qlinear_x86
