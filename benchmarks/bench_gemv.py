"""Decode GEMV benchmark on one GPU: qlinear kernels vs cuBLAS fp16 and tinygemm int4, in the same run.

    python benchmarks/bench_gemv.py [--quick] [--shapes 8192x8192,...] [--batches 1,2,4,8] [--bits 2,3,4]
                                    [--groups 64,128,K] [--markdown out.md]

Timing (:func:`common.gpu_time_us`): CUDA-graph replay, median of 25 replays, weights rotated through a
pool three times the L2 size so every call reads its weights from DRAM.  Per row: µs per call,
effective TB/s (every byte the kernel must read or write: codes, scales, offsets, x, y), that as a
percentage of the device-copy bandwidth measured at the start of the run, and the speedup versus
cuBLAS fp16 ``F.linear`` and versus ``torch._weight_int4pack_mm`` (tinygemm, bf16, group 128) at
the same shape and batch.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth_tbs, gpu_time_us, pool_size, table  # noqa: E402

from qlinear.backends import cuda_lut  # noqa: E402

SHAPES = "4096x4096,8192x8192,12288x12288,28672x8192,8192x28672,576x576,1536x576"


def lut_bytes(M: int, N: int, K: int, q: int, g: int, offset_bytes: int = 2) -> int:
    """Bytes the LUT GEMV reads and writes: bit-planes, fp16 α, offsets, fp16 x and y."""
    G = math.ceil(K / g)
    return q * N * K // 8 + 2 * q * N * G + offset_bytes * N * G + 2 * M * K + 2 * M * N


def lut_calls(M, N, K, q, g, sms):
    """Closures running the LUT GEMV over a pool of random weight sets (values do not change the timing)."""
    G = math.ceil(K / g)
    n = pool_size(lut_bytes(M, N, K, q, g))
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    launch = cuda_lut.plan(M, N, K, sms)
    sets = [(torch.randint(-2**31, 2**31 - 1, (K // 32, q, N), dtype=torch.int32, device="cuda"),
             torch.rand(G, q, N, device="cuda").half(), torch.randn(G, N, device="cuda").half()) for _ in range(n)]
    return [lambda s=s: torch.ops.qlinear.bcq_lut_gemv(x, s[0], s[1], s[2], None, g, *launch) for s in sets]


def cublas_calls(M, N, K):
    n = pool_size(2 * N * K)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) for _ in range(n)]
    return [lambda w=w: F.linear(x, w) for w in ws]


def tinygemm_calls(M, N, K, group=128):
    n = pool_size(N * K // 2 + 4 * N * K // group)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    sets = []
    for _ in range(n):
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        sz = torch.rand(K // group, N, 2, device="cuda").to(torch.bfloat16)
        sets.append((torch._convert_weight_to_int4pack(w, 8), sz))
    return [lambda s=s: torch._weight_int4pack_mm(x, s[0], group, s[1]) for s in sets]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="NxK list (out x in)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--groups", default="64,128,K")
    ap.add_argument("--quick", action="store_true", help="8192x8192 only, M=1 and 8, group 128")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches, args.groups = "8192x8192", "1,8", "128"
    if not torch.cuda.is_available() or cuda_lut.available() is not None:
        sys.exit(f"needs a CUDA GPU and the cuda_lut extension: {cuda_lut.available()}")
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth_tbs()
    head = (f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, torch "
            f"{torch.__version__}, {datetime.date.today()}; copy bandwidth {copy_bw:.2f} TB/s (read+write)")
    print(head, flush=True)
    rows = []
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            t_fp16 = gpu_time_us(cublas_calls(M, N, K))
            t_int4 = gpu_time_us(tinygemm_calls(M, N, K)) if K % 1024 == 0 and N % 8 == 0 else float("nan")
            rows.append(["cuBLAS fp16", "fp16", f"{N}x{K}", M, t_fp16, (2 * N * K + 2 * M * (N + K)) / t_fp16 / 1e6,
                         "", 1.0, t_int4 / t_fp16])
            for q in map(int, args.bits.split(",")):
                for gs in args.groups.split(","):
                    g = K if gs == "K" else int(gs)
                    t = gpu_time_us(lut_calls(M, N, K, q, g, props.multi_processor_count))
                    tbs = lut_bytes(M, N, K, q, g) / t / 1e6
                    rows.append(["cuda_lut", f"bcq q{q} g{gs}", f"{N}x{K}", M, t, tbs, f"{100 * tbs / copy_bw:.0f}%",
                                 t_fp16 / t, t_int4 / t])
                    print(rows[-1], flush=True)
    text = head + "\n\n" + table(["kernel", "format", "N x K", "M", "µs", "TB/s", "% copy BW", "x cuBLAS fp16",
                                  "x tinygemm int4"], rows)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
