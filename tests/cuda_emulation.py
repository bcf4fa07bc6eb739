"""Run a CUDA kernel's own source on the CPU: the host emulation the kernel tests share.

The ``.cu`` file is compiled with g++ against the CUDA headers: every CUDA thread of a block becomes a
std::thread, blocks run one after another over one poisoned shared-memory array, ``__syncthreads`` is a
std::barrier, ``__ldg`` a plain load, and the ``<<<>>>`` launches are either cut out (the driver launches the
kernels itself) or, with ``build(..., launches=True)``, run in place by ``run_grid`` with the grid, block and
dynamic shared memory the source's own launcher asks for (more than 48 KB only after its ``cudaFuncSetAttribute``
opt-in, at most 227 KB), so that its host code (template dispatch, grid and shared-memory sizing, the split-K
reduction's launch) runs too; a small driver per kernel reads one call from a
file and writes the output.  This runs the kernel's real index arithmetic without a GPU; what it
cannot see is GPU-only behaviour (alignment faults, coalescing, timing).  Warp-collective PTX (``ldmatrix``,
``mma``) is emulated by kernels that guard their inline assembly with ``QLINEAR_HOST_EMULATION``
(:data:`WARP_PTX`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parents[1] / "backends"

SHIM = r'''// Host emulation of a CUDA kernel source (tests/cuda_emulation.py).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <thread>
#include <vector>
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#undef __noinline__
#define __noinline__
thread_local uint3 tl_threadIdx;
dim3 g_blockIdx, g_blockDim, g_gridDim;
#define threadIdx tl_threadIdx
#define blockIdx g_blockIdx
#define blockDim g_blockDim
#define gridDim g_gridDim
std::unique_ptr<std::barrier<>> g_barrier;
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
std::atomic<int> g_sync_or{0};
inline int __syncthreads_or(int pred) {  // every thread past earlier reads, then the OR, then reset for the next call
  g_barrier->arrive_and_wait();
  if (pred) g_sync_or.store(1);
  g_barrier->arrive_and_wait();
  const int r = g_sync_or.load();
  g_barrier->arrive_and_wait();
  if (tl_threadIdx.x == 0) g_sync_or.store(0);
  return r;
}
inline void __threadfence() {}  // blocks run one after another
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
  unsigned o = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (o < v && !__atomic_compare_exchange_n(p, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return o;
}
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // byte n of the result: byte s[4n+2:4n] of {y, x}
  const unsigned long long v = (unsigned long long)y << 32 | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7))) & 255) << (8 * n);
  return r;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __fadd_rn(float a, float b) { return a + b; }  // ISO C++ (-std=c++20): no contraction into an FMA
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::min;
using std::max;
alignas(16) float4 g_smem4[228 * 1024 / 16];  // an H100/H200 SM's
std::map<const void*, int> g_smem_optin;  // each kernel's cudaFuncAttributeMaxDynamicSharedMemorySize
template <class F> cudaError_t cudaFuncSetAttribute(F* f, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) g_smem_optin[reinterpret_cast<const void*>(f)] = value;
  return cudaSuccess;
}
extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }  // a launch that fails exits the emulator
void (*g_block_start)(int threads) = nullptr;  // per-block setup of the warp PTX emulation (WARP_PTX)

// A host entry point's result: an error exits the emulator with status 3.
inline void emu_check(cudaError_t e) {
  if (e != cudaSuccess) { fprintf(stderr, "launcher returned cudaError %d\n", (int)e); exit(3); }
}

// Driver I/O: n values of T from f; y (fp16 or bf16 bits) written to path as fp32.
template <class T> std::vector<T> emu_read(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "short read\n"); exit(2); }
  return v;
}
inline void emu_write(const char* path, const std::vector<uint16_t>& y, bool bf16) {
  std::vector<float> out(y.size());
  for (size_t i = 0; i < y.size(); ++i) {
    if (bf16) { __nv_bfloat16 b; std::memcpy(&b, &y[i], 2); out[i] = __bfloat162float(b); }
    else { __half b; std::memcpy(&b, &y[i], 2); out[i] = __half2float(b); }
  }
  FILE* o = fopen(path, "wb"); fwrite(out.data(), 4, out.size(), o); fclose(o);
}

// Runs `kernel` (a callable taking no arguments, run by every thread) for every block of `grid`, `threads` threads each.
// With `smem_bytes` (the dynamic shared memory its launcher requests), a block that wrote past it fails the run.
template <class K> void run_grid(dim3 grid, int threads, K&& kernel, size_t smem_bytes = sizeof(g_smem4)) {
  g_gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        g_blockIdx = dim3(x, y, z);
        g_blockDim = dim3(threads, 1, 1);
        g_barrier = std::make_unique<std::barrier<>>(threads);
        if (g_block_start) g_block_start(threads);
        std::memset(g_smem4, 0xFF, sizeof(g_smem4));  // poison shared memory
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) ts.emplace_back([&kernel, t] { tl_threadIdx = make_uint3(t, 0, 0); kernel(); });
        for (auto& th : ts) th.join();
        const unsigned char* raw = reinterpret_cast<const unsigned char*>(g_smem4);
        for (size_t i = smem_bytes; i < sizeof(g_smem4); ++i)
          if (raw[i] != 0xFF) { fprintf(stderr, "shared memory written at byte %zu, past the %zu requested\n", i, smem_bytes); exit(4); }
      }
}

// A source's own launch of `kernel` (build(..., launches=True)): a GPU refuses more than 48 KB of dynamic shared memory
// unless the launcher raised the kernel's limit with cudaFuncSetAttribute first, and more than an H100/H200 SM's
// 227 KB at all; then run_grid.
template <class F, class K> void emu_launch(F* kernel, dim3 grid, int threads, size_t smem_bytes, K&& body) {
  const auto it = g_smem_optin.find(reinterpret_cast<const void*>(kernel));
  const size_t allowed = std::min<size_t>(it == g_smem_optin.end() ? 48 * 1024 : (size_t)it->second, 232448);
  if (smem_bytes > allowed) {
    fprintf(stderr, "launch asks for %zu bytes of dynamic shared memory, %zu allowed\n", smem_bytes, allowed);
    exit(5);
  }
  run_grid(grid, threads, body, smem_bytes);
}
'''

# Warp-collective PTX for kernels that guard their inline assembly with QLINEAR_HOST_EMULATION: every lane posts its
# operands, the warp meets at a barrier, each lane computes its own results from all lanes' operands, and the warp
# meets again before the exchange slots are reused.
WARP_PTX = r'''
#define QLINEAR_HOST_EMULATION 1
namespace emu_warp {
constexpr int kMaxWarps = 32;
std::unique_ptr<std::barrier<>> bar[kMaxWarps];
const void* addr[kMaxWarps][32];
unsigned a_reg[kMaxWarps][32][4], b_reg[kMaxWarps][32][2];
inline void reset(int threads) { for (int w = 0; w < threads / 32; ++w) bar[w] = std::make_unique<std::barrier<>>(32); }
const bool hooked = (g_block_start = reset, true);  // run_grid resets the warps' barriers for every block
inline int warp() { return threadIdx.x / 32; }
inline int lane() { return threadIdx.x % 32; }
template <typename T> float elem(unsigned reg, int half) {
  T v; std::memcpy(&v, reinterpret_cast<const char*>(&reg) + 2 * half, 2); return (float)v;
}
}  // namespace emu_warp
inline unsigned __cvta_generic_to_shared(const void* p) { return 0; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {  // one rounding, as fma.rn.f16x2
  return __halves2half2(__double2half((double)__low2float(a) * __low2float(b) + __low2float(c)),
                        __double2half((double)__high2float(a) * __high2float(b) + __high2float(c)));
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return __halves2bfloat162(__double2bfloat16((double)__low2float(a) * __low2float(b) + __low2float(c)),
                            __double2bfloat16((double)__high2float(a) * __high2float(b) + __high2float(c)));
}
namespace qlinear { namespace {
inline void cp_async16(void* smem, const void* gmem, bool valid) {
  if (valid) std::memcpy(smem, gmem, 16); else std::memset(smem, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of matrix j; lane l receives row l/4, columns 2(l%4), +1 of each.
inline void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  using namespace emu_warp;
  const int w = warp(), l = lane();
  addr[w][l] = smem;
  bar[w]->arrive_and_wait();
  for (int j = 0; j < 4; ++j) std::memcpy(&r[j], static_cast<const char*>(addr[w][8 * j + l / 4]) + 4 * (l % 4), 4);
  bar[w]->arrive_and_wait();
}
// mma.m16n8k16.row.col, fp32 accumulate: fragments per the PTX ISA tables.
template <typename T> inline void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  using namespace emu_warp;
  const int w = warp(), l = lane();
  for (int i = 0; i < 4; ++i) a_reg[w][l][i] = a[i];
  b_reg[w][l][0] = b0; b_reg[w][l][1] = b1;
  bar[w]->arrive_and_wait();
  using E = std::conditional_t<std::is_same_v<T, __half>, __half, __nv_bfloat16>;
  auto A = [&](int m, int k) {  // a0: (g, 2t..), a1: (g+8, 2t..), a2: (g, 2t+8..), a3: (g+8, 2t+8..)
    const int owner = (m % 8) * 4 + (k % 8) / 2, reg = (m / 8) + 2 * (k / 8);
    return elem<E>(a_reg[w][owner][reg], k % 2);
  };
  auto B = [&](int k, int n) {  // b0: (k = 2t, 2t+1; n = g), b1: (k + 8)
    const int owner = n * 4 + (k % 8) / 2;
    return elem<E>(b_reg[w][owner][k / 8], k % 2);
  };
  for (int i = 0; i < 4; ++i) {
    const int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + i % 2;
    double acc = d[i];
    for (int k = 0; k < 16; ++k) acc += (double)A(m, k) * B(k, n);
    d[i] = (float)acc;
  }
  bar[w]->arrive_and_wait();
}
} }  // namespace qlinear::(anonymous)
'''


def cuda_home() -> Path | None:
    """The CUDA toolkit whose headers the emulation compiles against, or None."""
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", *sorted(Path("/usr/local").glob("cuda-*"))):
        if home and (Path(home) / "include" / "cuda_fp16.h").exists():
            return Path(home)
    return None


_LAUNCH = re.compile(r"\b([\w:]+(?:<[\w:, ]+>)?)<<<([^;]*?)>>>\(([^;]*)\);")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses, brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def _emulated_launch(m: re.Match) -> str:
    grid, block, smem = (_split_top(m.group(2)) + ["0"])[:3]
    return (f"emu_launch({m.group(1)}, dim3({grid}), (int)({block}), (size_t)({smem}), "
            f"[&] {{ {m.group(1)}({m.group(3)}); }});  /* launch run (host emulation) */")


def build(dst: Path, kernel: str, shared_memory: tuple[str, str], prelude: str, driver: str,
          launches: bool = False, sanitize: bool = False) -> Path:
    """Compile ``SHIM + prelude + #include kernel + driver`` with g++.  ``kernel`` (a ``.cu`` path under
    backends/), the headers beside it and backends/_cuda are copied to ``dst`` with the ``extern __shared__``
    declaration ``shared_memory[0]`` replaced by ``shared_memory[1]`` (a pointer into the emulated shared memory) and
    the launches cut out, or with ``launches`` run by ``emu_launch`` (SHIM) where they stand (the driver then calls the
    source's host entry point).  ``sanitize``: with AddressSanitizer where g++ has it, so that a read past a buffer
    the driver passes (global memory) fails the run.  Skips the test when g++, the CUDA headers or C++20 ``<barrier>``
    are missing."""
    home = cuda_home()
    if shutil.which("g++") is None or home is None:
        pytest.skip("needs g++ and the CUDA headers")
    sources = [BACKENDS / kernel, *(BACKENDS / kernel).parent.glob("*.h"), *(BACKENDS / "_cuda").iterdir()]
    for src in sources:
        text = _LAUNCH.sub(_emulated_launch if launches else lambda m: "(void)0;  /* launch cut (host emulation) */",
                           src.read_text()).replace(*shared_memory)
        out = dst / src.relative_to(BACKENDS)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    main = dst / "emu.cpp"
    main.write_text(SHIM + prelude + f'\n#include "{kernel}"\n' + driver)
    exe = dst / "emu"
    base = ["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{home / 'include'}", "-x", "c++", str(main), "-o", str(exe)]
    if sanitize and subprocess.run(["g++", "-fsanitize=address", "-x", "c++", "-", "-o", str(dst / "asan_probe")],
                                   input="int main() { return 0; }", capture_output=True, text=True).returncode == 0:
        base[1:1] = ["-fsanitize=address", "-fno-omit-frame-pointer"]
    r = subprocess.run(base + [f"-L{home / 'lib64'}", "-lcudart"], capture_output=True, text=True)
    if r.returncode:
        r = subprocess.run(base + ["-Wl,--unresolved-symbols=ignore-all"], capture_output=True, text=True)
    if r.returncode and "barrier" in r.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def dtype_kind(t) -> int:
    """Header code of an optional buffer's element type (an offset, a bias): 0 absent, 1 fp16 (or bf16), 2 fp32."""
    import torch

    return 0 if t is None else 2 if t.dtype == torch.float32 else 1


def rotation_header(rotation, in_features: int) -> tuple[list[int], list]:
    """An emulated call's rotation: header fields ``[sign words, block, p]`` (``[0, 0, 1]`` for None: not rotated) and
    the tensors to append to its call: ``D``'s sign bits as the CUDA ops get them (:func:`qlinear.backends._gpu.sign_bits`,
    int32 ``[ceil(K/32)]``) and the int8 Paley factor ``[p, p]`` (None for ``p = 1``)."""
    import torch

    from qlinear.backends._gpu import sign_bits
    from qlinear.formats import rotation as rot

    if rotation is None:
        return [0, 0, 1], [None, None]
    seed, block = rotation
    p = rot._split(block)[0]
    bits = sign_bits(seed, in_features, torch.device("cpu"))
    return [bits.numel(), block, p], [bits, rot._paley(p).to(torch.int8) if p > 1 else None]


def rotated_reference(x, rotation):
    """``R·x`` in float64 (the exact transform a kernel's staged values approximate) and rounded once to ``x``'s dtype
    (what the op hands an unfused kernel), for the kernels' rotation tests."""
    from qlinear.formats import rotation as rot

    x64 = rot.rotate(x.double(), *rotation)
    return x64, x64.to(x.dtype)


def run(exe: Path, header: list[int], tensors: list, out_shape: tuple[int, ...]):
    """One call of an emulator: ``header`` as int32, then the raw bytes of every tensor that is not None (16-bit
    floats as their bits), in order; returns the float32 output of ``out_shape``."""
    import numpy as np
    import torch

    raw = lambda t: (t.view(torch.int16) if t.element_size() == 2 and t.is_floating_point() else t).contiguous().numpy()
    src = exe.parent / "call.bin"
    src.write_bytes(np.array(header, np.int32).tobytes() + b"".join(raw(t).tobytes() for t in tensors if t is not None))
    subprocess.run([str(exe), str(src), str(src) + ".y"], check=True, timeout=900)
    return torch.from_numpy(np.fromfile(str(src) + ".y", np.float32).reshape(out_shape).copy())
