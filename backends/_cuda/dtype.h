// Types passed from the torch bindings to the torch-free CUDA launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace qlinear {
enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2, kNone = 3 };

// A rotated layer's randomized Hadamard input transform (qlinear/formats/rotation.py), which the kernels that stage x
// apply themselves (rotation.cuh).
struct Rotation {
  int block;                        // b; 0: the layer is not rotated (no other field read)
  int paley;                        // p, with b = p·n and n a power of two (1: no Paley factor)
  const unsigned* sign_bits;        // [ceil(K/32)] on the device: bit k % 32 of word k / 32 set where D[k] = −1
  const signed char* paley_matrix;  // [p, p] ±1, row-major, on the device (p > 1)
};

// A rotation a launcher cannot take (the bindings check the same with messages, rotation_of in binding.h).
inline bool rotation_invalid(const Rotation& r) {
  return r.block && (r.block < 0 || r.paley < 1 || r.block % r.paley || r.sign_bits == nullptr ||
                     (r.paley > 1 && r.paley_matrix == nullptr));
}

// Shared memory of a kernel that stages rotated x: its own area (aliased by the transform's fp32 work area of
// max(block, 256) floats while the transform runs), then `values` staged inputs of `elem` bytes from
// rotation_staged_offset on.
__host__ __device__ inline size_t rotation_staged_offset(size_t own_bytes, int block) {
  const size_t work = 4 * (size_t)(block > 256 ? block : 256);
  return ((own_bytes > work ? own_bytes : work) + 15) / 16 * 16;
}
__host__ __device__ inline size_t rotation_smem_bytes(size_t own_bytes, int block, size_t values, size_t elem) {
  return rotation_staged_offset(own_bytes, block) + values * elem;
}
}  // namespace qlinear
