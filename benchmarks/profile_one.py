"""One LUT GEMV call on random weights, after warm-up, for a profiler (ncu) to capture.

    ncu --set full -k regex:lut_gemv_kernel --launch-skip 5 --launch-count 1 \\
        python benchmarks/profile_one.py --shape 8192x8192 --bits 4 --M 1

Random plane words, α and offsets (values do not change the work), fp16 x, group 128, the heuristic launch plan.
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
    args = ap.parse_args()
    N, K = map(int, args.shape.split("x"))
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
        torch.ops.qlinear.bcq_lut_gemv(x, planes, alpha, offset, None, None, args.group, *launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
