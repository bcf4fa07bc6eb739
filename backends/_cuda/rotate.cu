// rotate.h's launcher and its kernel.
#include "rotate.h"
#include "rotation.cuh"

namespace qlinear {
namespace {

template <typename T>
__global__ void __launch_bounds__(128) rotate_kernel(const T* __restrict__ x, T* __restrict__ y, int M, int K,
                                                     const Rotation r, int slice) {
  extern __shared__ __align__(16) float rotate_work[];
  const int k_lo = blockIdx.x * slice;
  for (int m = blockIdx.y; m < M; m += gridDim.y) {
    const size_t row = (size_t)m * K;
    stage_rotated_inline<T, T>(x + row, K, 1, k_lo, k_lo + slice, r, rotate_work, y + row + k_lo, 0);
  }
}

template <typename T>
cudaError_t launch(const void* x, void* y, int M, int K, const Rotation& r, cudaStream_t stream, int slice) {
  RotatePlan plan = rotate_plan(r, M, K);
  if (slice) plan.slice = slice;
  const size_t smem = rotate_smem_bytes(r);
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(rotate_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(K / plan.slice, M < 65535 ? M : 65535);
  rotate_kernel<T><<<grid, plan.threads, smem, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), M, K, r,
                                                         plan.slice);
  return cudaGetLastError();
}

}  // namespace

cudaError_t rotate(const void* x, void* y, int M, int K, const Rotation& r, DType dtype, cudaStream_t stream,
                   int slice) {
  if (M <= 0 || K <= 0 || r.block <= 0 || rotation_invalid(r) || K % r.block || slice < 0 || (slice && K % slice))
    return cudaErrorInvalidValue;
  if (dtype == DType::kHalf) return launch<__half>(x, y, M, K, r, stream, slice);
  if (dtype == DType::kBFloat16) return launch<__nv_bfloat16>(x, y, M, K, r, stream, slice);
  return cudaErrorInvalidValue;
}

}  // namespace qlinear
