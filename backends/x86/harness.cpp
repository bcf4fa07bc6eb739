// Standalone instruction-count harness for the x86 kernels (no torch), for valgrind's callgrind
// (benchmarks/bench_x86.py --callgrind builds and runs it):
//   harness PATH M N K GROUP REPS [FORMAT BITS]
//       REPS calls of qlinear_x86::run on path PATH (1 scalar, 2 avx2, 3 avx2_vnni, 4 avx512_vnni) over all row
//       blocks of random weights, one thread; FORMAT 0 uniform codes (default; BITS 4 nibbles or 8 bytes), 1 uniform
//       LUT, 2 free-α LUT, 3 4-bit codebook, 4 2-bit codebook with 4 books (qgemm.h), BITS 1-4 (8 for FORMAT 0);
//       5 the mixed format near its defaults (qlinear_x86::mixed_run: group 16, every fourth group 4-bit (floor(G/4)
//       of them, where the format rounds G/4), 4-bit scale codes per 16 rows, round(0.002·N·K) outliers spread over
//       the rows; K a multiple of 16; GROUP and BITS ignored)
// Exits 2 when this CPU (or valgrind's emulated one) lacks the path.
#include <stdio.h>
#include <stdlib.h>

#include <vector>

#include "qgemm.h"

template <typename Rnd>
int mixed(int path, int M, int N, int K, int reps, Rnd& rnd) {
  if (K % 16) {
    fprintf(stderr, "the mixed format needs K a multiple of 16\n");
    return 1;
  }
  const int Nb = (N + 15) / 16, G = K / 16, G4 = G / 4, G2 = G - G4, S2 = (N + 15) / 16;
  const int64_t nnz = (int64_t)(0.002 * N * K + 0.5);
  std::vector<uint32_t> q2((size_t)Nb * G2 * 16), q4((size_t)Nb * G4 * 2 * 16), sc((size_t)Nb * G * 2),
      z((size_t)Nb * (G2 + 2 * G4)), kinds((G + 31) / 32);
  for (auto* v : {&q2, &q4, &sc, &z})
    for (auto& e : *v) e = rnd();
  for (int i = 3; i < G; i += 4) kinds[i / 32] |= 1u << (i % 32);
  std::vector<uint16_t> ss((size_t)S2 * G), sz((size_t)S2 * G);
  for (auto& v : ss) v = (uint16_t)(0x1c00 | ((rnd() >> 20) & 1023));
  for (auto& v : sz) v = (uint16_t)(0x1c00 | ((rnd() >> 20) & 1023));
  std::vector<int32_t> orp(N + 1), oc(nnz);
  std::vector<float> ov(nnz, 0.01f), x((size_t)M * K), y((size_t)M * N);
  for (int n = 0; n <= N; ++n) orp[n] = (int32_t)(nnz * n / N);
  for (auto& c : oc) c = (int32_t)(rnd() % K);
  for (auto& v : x) v = (float)((int)(rnd() >> 16) - 32768) / 32768.0f;
  std::vector<char> work(qlinear_x86::mixed_acts_bytes(M, K) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t(63));
  qlinear_x86::MixedActs a{};
  qlinear_x86::mixed_prepare_acts(x.data(), M, K, aligned, &a);
  qlinear_x86::MixedWeights w{N, 16, G2, G4, 4, 16, q2.data(), q4.data(), sc.data(), z.data(), ss.data(), sz.data(),
                              kinds.data(), ov.data(), oc.data(), orp.data()};
  for (int r = 0; r < reps; ++r) qlinear_x86::mixed_run(w, a, nullptr, y.data(), 0, Nb, path);
  double sum = 0;
  for (float v : y) sum += v;
  printf("%g\n", sum);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 7 && argc != 9) {
    fprintf(stderr, "usage: %s PATH M N K GROUP REPS [FORMAT BITS]\n", argv[0]);
    return 1;
  }
  const int path = atoi(argv[1]), M = atoi(argv[2]), N = atoi(argv[3]), K = atoi(argv[4]), gs = atoi(argv[5]),
            reps = atoi(argv[6]), format = argc == 9 ? atoi(argv[7]) : 0, bits = argc == 9 ? atoi(argv[8]) : 4;
  if (format == 5 ? !qlinear_x86::mixed_path_supported(path) : !qlinear_x86::path_supported(path, format)) {
    fprintf(stderr, "path %d is not supported here\n", path);
    return 2;
  }
  const int Nb = (N + 15) / 16, G = (K + gs - 1) / gs;
  unsigned state = 12345;
  auto rnd = [&state] { return state = state * 1664525u + 1013904223u; };
  if (format == 5) return mixed(path, M, N, K, reps, rnd);
  std::vector<uint8_t> qw((size_t)Nb * (K / 8) * 16 * bits), qz((size_t)Nb * G * 16);
  std::vector<uint16_t> qs((size_t)Nb * G * 16 * (format == 2 ? bits : 1)), qc((size_t)Nb * G * 16);
  for (auto& v : qw) v = (uint8_t)(rnd() >> 24);
  for (auto& v : qz) v = (uint8_t)((rnd() >> 24) % 31);
  std::vector<uint16_t> qz16(qz.begin(), qz.end());
  for (auto& v : qs) v = (uint16_t)(0x1c00 | ((rnd() >> 20) & 1023));  // fp16 in [2^-8, 2^-7)
  for (auto& v : qc) v = (uint16_t)(0x1c00 | ((rnd() >> 20) & 1023));
  std::vector<int8_t> table(16);
  std::vector<int32_t> qb((size_t)Nb * G);
  for (auto& v : table) v = (int8_t)(rnd() >> 24);
  for (auto& v : qb) v = (int32_t)rnd();
  std::vector<float> x((size_t)M * K), y((size_t)M * N);
  for (auto& v : x) v = (float)((int)(rnd() >> 16) - 32768) / 32768.0f;
  const bool tables = format == qlinear_x86::kLutUniform || format == qlinear_x86::kLutFree;
  std::vector<char> work(qlinear_x86::acts_bytes(M, K, gs, tables) + 64);
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(work.data()) + 63) & ~uintptr_t(63));
  qlinear_x86::Acts a{};
  qlinear_x86::prepare_acts(x.data(), M, K, gs, tables, aligned, &a);
  const qlinear_x86::Weights w{qw.data(), qs.data(), qz.data(), N, K, gs, format, bits, qc.data(), table.data(),
                               format == qlinear_x86::kCB2 ? qb.data() : nullptr,
                               format == qlinear_x86::kUniform && bits == 8 ? qz16.data() : nullptr};
  for (int r = 0; r < reps; ++r) qlinear_x86::run(w, a, nullptr, y.data(), 0, Nb, path);
  double sum = 0;
  for (float v : y) sum += v;
  printf("%g\n", sum);  // keeps the work observable
  return 0;
}
