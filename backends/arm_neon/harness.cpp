// Standalone test and instruction-count harness for the Arm kernels (no torch).  Cross-compiled
// statically and run under qemu-aarch64 in CI (see .ci/run):
//   harness test                      every available path vs the scalar reference, bit for bit, on
//                                     random weights in both layouts (mmla, sdot): all formats, 1/2/4
//                                     codebooks, group 32/64/96/128 (also a partial last group),
//                                     N not a multiple of 8, M = 1..9; prints the dispatched path
//   harness bench FORMAT M N K REPS [GROUP [BOOKS [LAYOUT [BLOCK [PALEY]]]]]
//                                     REPS calls of activation quantization and the auto-dispatched kernel
//                                     (for the qemu plugin that counts executed instructions per symbol);
//                                     FORMAT bcq4|cb4|cb2|u8, GROUP 128 (bcq4) / 32, BOOKS 4 (cb2) / 1, LAYOUT
//                                     sdot (the default repack's) / mmla; BLOCK > 0: a rotated layer, each
//                                     call first transforms x in rotate_input_counted (seed 1; PALEY: a file of
//                                     backends/_cpu.py paley_argument's float32 factor when the block has one)
//   harness rotate K BLOCK SEED [PALEY] < x > y
//                                     the same transform of float32 rows [*, K] (stdin to stdout)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../_shared/rotation.h"
#include "qgemm.h"

using namespace qlinear_arm;

static uint32_t rng_state = 12345;
static uint32_t rnd() {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 17;
  rng_state ^= rng_state << 5;
  return rng_state;
}
static uint16_t rnd_half(int emin, int emax) {  // positive normal fp16 with exponent in [emin, emax]
  return (uint16_t)(((emin + 15 + (int)(rnd() % (emax - emin + 1))) << 10) | (rnd() & 1023));
}

struct Layer {
  std::vector<uint8_t> qw;
  std::vector<uint16_t> qs, qz16, qb;
  std::vector<float> qz32;
  std::vector<int8_t> books;
  Weights w;
};

static void make_layer(Layer& L, int format, int books, int N, int K, int group, int offset_kind, int layout) {
  const int Nb = (N + 7) / 8, H = K / 32, G = (K + group - 1) / group;
  L.qw.resize((size_t)Nb * H * block_bytes(format));
  for (auto& v : L.qw) v = (uint8_t)rnd();
  L.qs.resize((size_t)Nb * G * 8);
  for (auto& v : L.qs) v = rnd_half(-8, 0);
  L.qz16.assign((size_t)Nb * G * 8, 0);
  L.qz32.assign((size_t)Nb * G * 8, 0.f);
  for (auto& v : L.qz16) v = rnd_half(-8, -1) | ((rnd() & 1) << 15);
  for (auto& v : L.qz32) v = ((int)(rnd() % 2001) - 1000) / 1024.f;
  L.qb.resize((size_t)Nb * G);
  for (auto& v : L.qb) {
    uint16_t word = 0;
    for (int r = 0; r < 8; ++r) word |= (uint16_t)((rnd() % books) << book_shift(r, layout));
    v = word;
  }
  L.books.resize(16);
  for (auto& v : L.books) v = (int8_t)(rnd() % 255 - 127);
  L.w = Weights{L.qw.data(), L.qs.data(), nullptr, books > 1 ? L.qb.data() : nullptr,
                has_offset(format) ? nullptr : L.books.data(), format, books, N, K, group, false, layout};
  if (has_offset(format) && offset_kind == 1) L.w.qz = L.qz16.data();
  if (has_offset(format) && offset_kind == 2) { L.w.qz = L.qz32.data(); L.w.qz_f32 = true; }
}

// The activation workspace starts as junk, as torch's at::empty may leave it: prepare_acts must set what is read.
static const char kJunk = 0x5A;

static int test() {
  const int best = cpu_path();
  printf("dispatch: %s\n", path_name(best));
  int failures = 0, cases = 0;
  const int formats[] = {kBCQ4, kCB4, kCB2, kU8};
  const int shapes[][2] = {{8, 32}, {13, 96}, {24, 128}, {40, 160}, {64, 256}, {3, 64}, {16, 192}, {8, 480}};
  for (int layout : {kLayoutMMLA, kLayoutSDOT})
  for (int f : formats) {
    const int book_opts[3] = {1, f == kCB2 ? 2 : 1, f == kCB2 ? 4 : 1};
    for (int bi = 0; bi < 3; ++bi) {
      for (int group : {32, 64, 96, 128}) {
        for (auto& s : shapes) {
          const int N = s[0], K = s[1];
          for (int M = 1; M <= 9; ++M) {
            Layer L;
            // BCQ: offsets none, fp16, fp32
            make_layer(L, f, book_opts[bi], N, K, group, has_offset(f) ? bi : 0, layout);
            std::vector<float> x((size_t)M * K), bias(N);
            for (auto& v : x) v = ((int)(rnd() % 20001) - 10000) / 3000.f;
            if (M == 5) for (int k = 0; k < K; ++k) x[k] = 0.f;  // an all-zero row
            for (auto& v : bias) v = ((int)(rnd() % 201) - 100) / 64.f;
            std::vector<char> ws(acts_bytes(M, K, group) + 16, kJunk);
            void* aligned = (void*)(((uintptr_t)ws.data() + 15) & ~(uintptr_t)15);
            Acts a;
            prepare_acts(x.data(), M, K, group, f, layout, aligned, &a);
            std::vector<float> ref((size_t)M * N), out((size_t)M * N);
            const float* b = M % 4 == 3 ? nullptr : bias.data();  // some cases without a bias
            reference(L.w, a, b, ref.data());
            for (int path = kPlain; path <= best; ++path) {
              std::fill(out.begin(), out.end(), -12345.f);
              const int Nb = (N + 7) / 8;
              run(L.w, a, b, out.data(), 0, Nb / 2, path);  // two ranges, like the threads
              run(L.w, a, b, out.data(), Nb / 2, Nb, path);
              ++cases;
              if (memcmp(out.data(), ref.data(), out.size() * 4)) {
                ++failures;
                if (failures < 10)
                  printf("MISMATCH layout=%d format=%d books=%d group=%d N=%d K=%d M=%d path=%s\n", layout, f,
                         book_opts[bi], group, N, K, M, path_name(path));
              }
            }
          }
        }
      }
    }
  }
  // BCQ, no bias, a tiny negative scale and zero codes: z·Σx underflows to -0, and every path must return
  // acc + 0 = +0, like the reference.
  for (int layout : {kLayoutMMLA, kLayoutSDOT})
  for (int M : {1, 4}) {
    Layer L;
    make_layer(L, kBCQ4, 1, 8, 128, 128, 0, layout);
    std::fill(L.qw.begin(), L.qw.end(), 0);
    std::fill(L.qs.begin(), L.qs.end(), 0x8001);
    std::vector<float> x((size_t)M * 128, 1.4e-45f), ref((size_t)M * 8), out((size_t)M * 8);
    std::vector<char> ws(acts_bytes(M, 128, 128) + 16, kJunk);
    Acts a;
    prepare_acts(x.data(), M, 128, 128, kBCQ4, layout, (void*)(((uintptr_t)ws.data() + 15) & ~(uintptr_t)15), &a);
    reference(L.w, a, nullptr, ref.data());
    for (int path = kPlain; path <= best; ++path) {
      run(L.w, a, nullptr, out.data(), 0, 1, path);
      ++cases;
      if (memcmp(out.data(), ref.data(), out.size() * 4)) {
        ++failures;
        printf("MISMATCH signed zero M=%d path=%s\n", M, path_name(path));
      }
    }
  }
  printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}

struct Rotation {
  int64_t block = 0, f = 1;
  std::vector<float> d, paley;  // D/√b [K] (backends/_cpu.py's rot_signs), the Paley factor [f, f] or none
};

// D: qlinear.formats.rotation.signs, lowbias32 of (k + seed·0x9E3779B9) mod 2^32, computed here; the Paley factor
// (backends/_cpu.py paley_argument) is read from the file the caller wrote.  False (and a message) if they do not fit.
static bool make_rotation(Rotation& r, int K, int block, uint32_t seed, const char* paley_file) {
  FILE* f = paley_file ? fopen(paley_file, "rb") : nullptr;
  for (float v; f && fread(&v, 4, 1, f) == 1;) r.paley.push_back(v);
  if (f) fclose(f);
  if (paley_file) r.f = (int64_t)sqrtf((float)r.paley.size());
  const int64_t p = qlinear_rotation::paley_order(r.f);
  const int64_t n = block > 0 && p > 0 ? block / p : 0;  // the Sylvester order: a power of two
  if (K <= 0 || n == 0 || K % block || block % p || (n & (n - 1)) || (paley_file && r.f % 2) ||
      (paley_file && r.f * r.f != (int64_t)r.paley.size())) {
    fprintf(stderr, "bad rotation: K=%d block=%d paley=%s\n", K, block, paley_file ? paley_file : "none");
    return false;
  }
  r.block = block;
  r.d.resize(K);
  for (int k = 0; k < K; ++k) {
    uint32_t h = (uint32_t)k + seed * 0x9E3779B9u;
    h ^= h >> 16, h *= 0x7FEB352Du, h ^= h >> 15, h *= 0x846CA68Bu, h ^= h >> 16;
    r.d[k] = (h >> 31 ? -1.f : 1.f) / sqrtf((float)block);
  }
  return true;
}

// What the binding does to x of a rotated layer before quantizing it (_shared/rotation_aten.h stage: x rotated
// into the staging buffer); its own symbol, so that the plugin counts it apart from the kernel and the activation
// quantization.
__attribute__((noinline)) static void rotate_input_counted(const float* x, float* out, int M, int K,
                                                           const Rotation& r) {
  qlinear_rotation::rotate_rows(out, M, K, r.d.data(), r.block, r.f > 1 ? r.paley.data() : nullptr, r.f, x);
}

static int rotate(int K, int block, uint32_t seed, const char* paley_file) {
  Rotation r;
  if (!make_rotation(r, K, block, seed, paley_file)) return 2;
  std::vector<float> x(K), y(K);
  while (fread(x.data(), 4, K, stdin) == (size_t)K) {
    rotate_input_counted(x.data(), y.data(), 1, K, r);
    fwrite(y.data(), 4, K, stdout);
  }
  return 0;
}

static int bench(const char* fmt, int M, int N, int K, int reps, int group, int books, int layout, int block,
                 const char* paley_file) {
  if (layout < 0) {
    fprintf(stderr, "LAYOUT must be sdot or mmla\n");
    return 2;
  }
  Rotation rot;
  if (block && !make_rotation(rot, K, block, 1, paley_file)) return 2;
  const int f = !strcmp(fmt, "bcq4") ? kBCQ4 : !strcmp(fmt, "cb4") ? kCB4 : !strcmp(fmt, "u8") ? kU8 : kCB2;
  Layer L;
  make_layer(L, f, books, N, K, group, has_offset(f) ? 1 : 0, layout);
  std::vector<float> x((size_t)M * K), xr(block ? (size_t)M * K : 0), y((size_t)M * N);
  for (auto& v : x) v = ((int)(rnd() % 2001) - 1000) / 100.f;
  std::vector<char> ws(acts_bytes(M, K, group) + 16, kJunk);
  void* aligned = (void*)(((uintptr_t)ws.data() + 15) & ~(uintptr_t)15);
  Acts a;
  for (int i = 0; i < reps; ++i) {
    if (block) rotate_input_counted(x.data(), xr.data(), M, K, rot);
    prepare_acts(block ? xr.data() : x.data(), M, K, group, f, layout, aligned, &a);
    run(L.w, a, nullptr, y.data(), 0, (N + 7) / 8, kAuto);
  }
  printf("%s M=%d N=%d K=%d reps=%d path=%s layout=%s block=%d weights=%lld y0=%g\n", fmt, M, N, K, reps,
         path_name(M >= 4 ? cpu_path() : (cpu_path() == kMMLA ? kDot : cpu_path())),
         layout == kLayoutSDOT ? "sdot" : "mmla", block, (long long)N * K * reps, y[0]);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && !strcmp(argv[1], "test")) return test();
  if (argc >= 7 && !strcmp(argv[1], "bench")) {
    const bool bcq = !strcmp(argv[2], "bcq4"), cb2 = !strcmp(argv[2], "cb2");
    return bench(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]),
                 argc >= 8 ? atoi(argv[7]) : bcq ? 128 : 32, argc >= 9 ? atoi(argv[8]) : cb2 ? 4 : 1,
                 argc < 10 || !strcmp(argv[9], "sdot") ? kLayoutSDOT : !strcmp(argv[9], "mmla") ? kLayoutMMLA : -1,
                 argc >= 11 ? atoi(argv[10]) : 0, argc >= 12 ? argv[11] : nullptr);
  }
  if (argc >= 5 && !strcmp(argv[1], "rotate"))
    return rotate(atoi(argv[2]), atoi(argv[3]), (uint32_t)strtoul(argv[4], nullptr, 10), argc >= 6 ? argv[5] : nullptr);
  fprintf(stderr, "usage: harness test | harness bench bcq4|cb4|cb2 M N K REPS [GROUP [BOOKS [sdot|mmla [BLOCK [PALEY]]]]]"
                  " | harness rotate K BLOCK SEED [PALEY]\n");
  return 2;
}
