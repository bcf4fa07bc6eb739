"""Six calls of one GPU kernel on random weights, for a profiler (ncu) to capture the last.

    ncu --set full -k regex:lut_gemv_kernel --launch-skip 5 --launch-count 1 \\
        python benchmarks/profile_one.py --shape 8192x8192 --bits 4 --M 1 [--kernel cuda_lut|quick]

Random weights (values do not change the work), fp16 x, group 128, the kernel's heuristic launch plan: the LUT GEMV
(``lut_gemv_kernel``) or its dequantize kernel (``lut_dequantize_kernel``, ``--kernel lut_dequant``) on random plane
words, α and offsets, or the QUICK GEMM (``quick_gemm_kernel``) through ``qlinear::linear`` on random uniform codes,
scales and zero points.
"""

from __future__ import annotations

import argparse

import torch

from qlinear.backends import cuda_lut


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192x8192", help="NxK")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--M", type=int, default=1)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--kernel", default="cuda_lut", choices=("cuda_lut", "quick", "lut_dequant"))
    args = ap.parse_args()
    N, K = map(int, args.shape.split("x"))
    if args.kernel == "quick":
        from common import op_calls, uniform_bcq_sets

        cfg, sets = uniform_bcq_sets(N, K, args.bits, args.group, "quick", 1)
        call = op_calls(torch.randn(args.M, K, device="cuda", dtype=torch.float16), cfg, sets, N, K, "quick", "quick")[0]
        for _ in range(6):
            call()
        torch.cuda.synchronize()
        return
    if cuda_lut.available() is not None:
        raise SystemExit(f"cuda_lut unavailable: {cuda_lut.available()}")
    q, G = args.bits, K // args.group
    planes = torch.randint(-2**31, 2**31 - 1, (K // 32, q, N), dtype=torch.int32, device="cuda")
    alpha = torch.rand(G, q, N, device="cuda").half()
    offset = torch.randn(G, N, device="cuda").half()
    x = torch.randn(args.M, K, device="cuda", dtype=torch.float16)
    launch = cuda_lut.plan(args.M, N, K, torch.cuda.get_device_properties(0).multi_processor_count, q)
    print("launch (kt, threads, tiles_per_split, splits):", launch)
    for _ in range(6):
        if args.kernel == "lut_dequant":  # Ŵ in fp16, as the free-α path above batch 8 writes it for cuBLAS
            torch.ops.qlinear.bcq_lut_dequantize(planes, alpha, offset, args.group, torch.float16)
        else:
            torch.ops.qlinear.bcq_lut_gemv(x, planes, alpha, offset, None, None, args.group, *launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
