// x in shared memory for the tensor-core GEMMs (QUICK's and the 8-bit uniform one): a cp.async pipeline of stages of
// BM rows × 64 inputs.  Torch-free; tests/cuda_emulation.py (WARP_PTX) supplies host versions of the PTX wrappers.
#pragma once
#include <cuda_runtime.h>

namespace qlinear {

constexpr int kStageK = 64;  // inputs of x per stage row

#ifndef QLINEAR_HOST_EMULATION
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
#endif

// Shared memory of one stage: BM rows × 64 inputs, 16-byte chunk c of row r stored at chunk c ^ (r & 7).  Both ways the
// GEMMs read it are free of bank conflicts: ldmatrix's 8 row addresses of a matrix (one chunk column, rows r..r+7), and
// 16-byte loads of chunks 2u + h of rows r by lanes 4r + u (each quarter warp: two rows of opposite parity).
template <typename T>
__device__ __forceinline__ T* a_chunk(T* stage, int row, int chunk) { return stage + row * kStageK + ((chunk ^ (row & 7)) << 3); }

// x rows m0.. and inputs k0..k0+63 into a stage (rows >= M zero).  With perm (act_order) the inputs are
// x[:, perm[k]]: gathered with plain loads and one 16-byte shared store per chunk (cp.async cannot gather 2-byte
// elements); the next __syncthreads publishes them like a completed cp.async group.
template <typename T, int BM, int THREADS>
__device__ __forceinline__ void load_a_stage(T* stage, const T* __restrict__ x, const int* __restrict__ perm, int M,
                                             int K, int m0, int k0, int tid) {
#pragma unroll
  for (int i = tid; i < BM * 8; i += THREADS) {
    const int row = i >> 3, chunk = i & 7;
    const bool valid = m0 + row < M;
    const T* src = x + (size_t)(valid ? m0 + row : 0) * K;
    if (perm == nullptr) {
      cp_async16(a_chunk(stage, row, chunk), src + k0 + chunk * 8, valid);
    } else {
      const unsigned short* xs = reinterpret_cast<const unsigned short*>(src);
      const int* p = perm + k0 + chunk * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (valid) {
        v.x = xs[__ldg(p)] | (unsigned)xs[__ldg(p + 1)] << 16;
        v.y = xs[__ldg(p + 2)] | (unsigned)xs[__ldg(p + 3)] << 16;
        v.z = xs[__ldg(p + 4)] | (unsigned)xs[__ldg(p + 5)] << 16;
        v.w = xs[__ldg(p + 6)] | (unsigned)xs[__ldg(p + 7)] << 16;
      }
      *reinterpret_cast<uint4*>(a_chunk(stage, row, chunk)) = v;
    }
  }
}

}  // namespace qlinear
