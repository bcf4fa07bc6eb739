// Arm NEON / dotprod / i8mm kernels for group-quantized weights with int8 dynamic activations.
// Source: "Highly Optimized Kernels and Fine-Grained Codebooks for LLM Inference on Arm CPUs", §4-5.
// Torch-free: used by binding.cpp (torch op) and harness.cpp (standalone tests under qemu).
//
// Weight layout "mmla" (kLayoutMMLA; repacked once at load by backends/arm_neon/__init__.py, which holds the
// executable PyTorch spec of everything below; the repack picks layout "sdot" below unless QLINEAR_ARM_LAYOUT=mmla):
//   Rows are taken in blocks of 8 (N padded to a multiple of 8 with zero rows), K in blocks of 32
//   inputs h = 0..K/32-1.  For block (b, h) the 256 int8 weights are consumed as 16 vectors V[c][p]
//   (c = 0..3 chunk of 8 inputs, p = 0..3 row pair), byte i of V[c][p] being row 8b + 2p + i/8,
//   input 32h + 8c + i%8: the order SMMLA (2 rows x 8 inputs) and SDOT with a duplicated activation
//   chunk consume them.  qw[b][h] holds them packed:
//   - 4 bits (BCQ uniform int4, codebook bits=4): 128 bytes; chunk c is bytes 32c..32c+31 = vectors
//     P0, P1; V[c][0] / V[c][1] are the low / high nibbles of P0, V[c][2] / V[c][3] those of P1.
//     BCQ stores code XOR 8 (MSB toggled), so (P << 4) and (P & 0xF0) are 16·(code − 8) as int8.
//     Codebook bits=4 stores the centroid index; decoding is one TBL per vector.
//   - 2 bits (codebook bits=2): 64 bytes; bytes 16p..16p+15 (row pair p) hold in byte i the indices of
//     V[c][p] byte i at bits 2c, 2c+1: the low nibble serves chunks 0-1 of the row pair, the high nibble
//     chunks 2-3.  TBL index = book << 4 | nibble into 64-entry tables (with one codebook: the nibble into
//     16-entry tables).
//   - 5-8 bits (BCQ uniform, kU8): 256 bytes; V[c][p] is bytes 64c + 16p .. 64c + 16p + 15, each code − 2^(q−1) as
//     int8 (at 8 bits code XOR 0x80): w = s·(int8 + 0.5) + c with BCQ's offset c = s·((2^q − 1)/2 − z).
//   qs[b][g][8] fp16 scales of the 8 rows for group g; qz[b][g][8] BCQ offsets (fp16 or fp32);
//   qb[b][g] codebook ids of the 8 rows, 2 bits each, when C > 1: row r at bits 8(r%2)+2(r/2) and the next
//   (even rows in the low byte, odd rows in the high byte; book_shift(r, layout)).
//
// Layout "sdot" (kLayoutSDOT, the default: SDOT by element, different output rows in different lanes, no pairwise
// adds; the SMMLA GEMM zips two vectors by 32-bit words into 2 rows x 8 inputs): the same bytes, packing and qs/qz,
// but byte i of V[c][p] is row 8b + 4(p/2) + i/4, input 32h + 16(p%2) + 4c + i%4 (lane i/4 = one row, 4 inputs),
// and in qb row r sits at bits 8(r/4)+2(r%4) (rows 0-3 in the low byte).  Row pairs p = 0, 1 are then rows 0-3 and
// p = 2, 3 rows 4-7, each book vector serving one 4-row quad.
//
// Per row n, in this order, identically on every path (so all paths agree bit for bit): at the start
// of each group g, BCQ only: z = fma(0.5, s, c); acc = fma(z, xsum[g], acc)  (w = s·(code − 7.5) + c, 8 bits:
// s·(code − 127.5) + c);
// then per 32-input block h of the group: isum = Σ int8 w · int8 xq (exact int32),
//   t = ws[n,g] · xs[h];  acc = fma(float(isum), t, acc);
// and y = acc + bias.  BCQ's xs is divided by 16 (the nibbles are 16x).
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace qlinear_arm {

enum Format : int { kBCQ4 = 0, kCB4 = 1, kCB2 = 2, kU8 = 3 };
// Formats with BCQ's per-group offset (uniform codes with zero points).
inline bool has_offset(int format) { return format == kBCQ4 || format == kU8; }
enum Path : int { kAuto = 0, kPlain = 1, kDot = 2, kMMLA = 3 };
enum Layout : int { kLayoutMMLA = 0, kLayoutSDOT = 1 };

struct Weights {
  const uint8_t* qw;     // [Nb][K/32][block_bytes(format)]
  const uint16_t* qs;    // fp16 bits [Nb][G][8]
  const void* qz;        // BCQ offsets [Nb][G][8] (fp16 bits or fp32), or nullptr
  const uint16_t* qb;    // codebook ids [Nb][G], or nullptr when there is one codebook
  const int8_t* books;   // codebooks [C][2^bits] (C·2^bits <= 16), or nullptr for BCQ
  int format, num_books, N, K, group_size;
  bool qz_f32;
  int layout;            // kLayoutMMLA or kLayoutSDOT
};

// Quantized activations, prepared once per call (dynamic per-32-input int8 quantization).
struct Acts {
  int M, K;
  int8_t* xd;     // [M][K/32][4][16]: chunk c duplicated, [xq(8c..8c+7), xq(8c..8c+7)] (SDOT, layout mmla
                  // only, else nullptr)
  int8_t* xq;     // [M][K/32][32]: xq as is (SDOT by element, layout sdot; the scalar reference)
  int8_t* xz;     // [M][K/32][64]: xq, then 32 zeros (the sdot assembly GEMV loads them as its zeroed int32 sums);
                  // layout sdot only, else nullptr
  int8_t* xp;     // [ceil(M/2)][K/32][4][16]: rows 2m, 2m+1 of octet o (inputs 8o..8o+7) side by side (SMMLA);
                  // slots hold octets 0-3 (layout mmla) or 0, 2, 1, 3 (layout sdot)
  float* xs;      // [M][K/32] scale (BCQ: / 16)
  float* xsum;    // [M][G] Σ x̂ over the inputs of weight group g: each block's Σ int8 · amax/127 (fp32, sequential)
  float* xsp;     // [ceil(M/2)][K/32][4]: xs of rows (2m, 2m, 2m+1, 2m+1)
  float* xsump;   // [ceil(M/2)][G][4]: xsum likewise
};

int block_bytes(int format);
// Bit position of row r's 2-bit codebook id in the qb word (see the layouts above).
inline int book_shift(int r, int layout) {
  return layout == kLayoutSDOT ? 8 * (r / 4) + 2 * (r % 4) : 8 * (r % 2) + 2 * (r / 2);
}
size_t acts_bytes(int M, int K, int group_size);
// x: [M][K] fp32.  workspace: acts_bytes(M, K, group_size) bytes, 16-byte aligned; layout: the weights'.
void prepare_acts(const float* x, int M, int K, int group_size, int format, int layout, void* workspace, Acts* out);

// Best path of this CPU (getauxval on aarch64 Linux; kMMLA under SIMDe elsewhere).
int cpu_path();
const char* path_name(int path);

// y[M][N] fp32 for the 8-row blocks [b0, b1) with `path` (kAuto, or a path above cpu_path(): cpu_path(); then
// by M: kMMLA only from 4 activation rows).
void run(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1, int path);
// Scalar implementation of the same arithmetic (the harness's ground truth).
void reference(const Weights& w, const Acts& a, const float* bias, float* y);

// i8mm translation unit (kernels_i8mm.cpp): SMMLA kernel for pairs of activation rows.  (Not inlined: the
// instruction counter attributes executed instructions per symbol.)
void run_mmla(const Weights& w, const Acts& a, const float* bias, float* y, int b0, int b1);

// 64 zero bytes: the assemblies load their int32 sums from here (one load sets four registers), and the GEMV
// uses them as the bias when there is none.
alignas(16) inline constexpr float kZeros[16] = {};

}  // namespace qlinear_arm
