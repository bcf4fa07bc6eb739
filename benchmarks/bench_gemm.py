"""BCQLinear GEMM benchmark on one GPU, M = 1..512: the QUICK kernel (the 8-bit uniform GEMM at ``--bits 8``), the
dispatched layer, the LUT GEMV, cuBLAS fp16, tinygemm int4 and GemLite, measured in the same run.

    python benchmarks/bench_gemm.py [--quick] [--shapes 8192x8192,...] [--batches 1,...,512] [--bits 4,3,2,8]
                                    [--group 128] [--markdown out.md]

Timing as in bench_gemv.py (:func:`common.gpu_time_us`: CUDA-graph replay, weights rotated through 3x L2).
Rows: ``quick`` (the GEMM alone, uniform and free-α BCQ; 8 bits: ``cuda_uniform_gemm`` on the canonical storage),
``dispatched`` (``qlinear::linear`` with automatic kernel choice, holding the
layout :func:`qlinear.backends.layout_for` picks, i.e. following this GPU's dispatch table if it has one),
``cuda_lut`` (M <= 8), ``cuBLAS fp16`` (``F.linear``), ``tinygemm`` (``torch._weight_int4pack_mm``, bf16,
4-bit only) and ``GemLite`` (PyPI ``gemlite``, ``A16Wn`` Triton kernels, 4 and 2 bits; skipped with the reason
if it does not load: on the GPU machine, install the wheel carried there, ``pip install --no-deps gemlite-*.whl``).
Effective TB/s counts the packed weights, fp16 scales, offsets, x and y.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_gemv import cublas_calls, gemlite_calls, tinygemm_calls  # noqa: E402
from common import (free_bcq_sets, gpu_run_header, gpu_time_us, op_calls, pool_size, report, table,  # noqa: E402
                    uniform_bcq_sets)

from qlinear import backends  # noqa: E402
from qlinear.backends import cuda_lut, cuda_uniform, quick  # noqa: E402

SHAPES = "8192x8192,4096x4096,11008x4096,4096x11008,28672x8192,8192x28672"
BATCHES = "1,2,4,8,16,32,64,128,256,512"


def weight_bytes(M, N, K, q, g, offset_bytes=4):
    return q * N * K // 8 + (2 + offset_bytes) * N * math.ceil(K / g) + 2 * M * K + 2 * M * N


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--bits", default="4,3,2")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="8192x8192 only, M = 1, 16, 64, 256")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches = "8192x8192", "1,16,64,256"
    if not torch.cuda.is_available() or quick.available() is not None:
        sys.exit(f"needs a CUDA GPU and the quick extension: {quick.available()}")
    head, _ = gpu_run_header()
    head += f"; group {args.group}"
    print(head, flush=True)
    rows, g = [], args.group
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        n = pool_size(N * K // 2)
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            first = len(rows)
            t_fp16 = gpu_time_us(cublas_calls(M, N, K))
            base = lambda name, fmt, t, nbytes: [name, fmt, f"{N}x{K}", M, t,
                                                 nbytes / t / 1e6 if nbytes else "", t_fp16 / t]
            rows.append(base("cuBLAS fp16", "fp16", t_fp16, 2 * N * K + 2 * M * (N + K)))
            if K % 1024 == 0:  # tinygemm's int4 packing needs K in multiples of 1024 here
                rows.append(base("tinygemm", "int4 g128 bf16", gpu_time_us(tinygemm_calls(M, N, K)), 0))
            for q in map(int, args.bits.split(",")):
                gl = gemlite_calls(M, N, K, q, g)
                if isinstance(gl, str):
                    print(gl)
                else:
                    rows.append(base("GemLite", f"int{q} g{g}", gpu_time_us(gl), 0))
                    del gl
                if q == 8:  # canonical storage: the tensor-core GEMM of cuda_uniform, no QUICK layout
                    cfg, sets = uniform_bcq_sets(N, K, 8, g, "", n)
                    nbytes = weight_bytes(M, N, K, 8, g, offset_bytes=1)
                    if M <= cuda_uniform.GEMM_MAX_BATCH:
                        rows.append(base("cuda_uniform_gemm", f"bcq int8 g{g}",
                                         gpu_time_us(op_calls(x, cfg, sets, N, K, "cuda_uniform_gemm", "")), nbytes))
                    rows.append(base("dispatched (canonical)", f"bcq int8 g{g}",
                                     gpu_time_us(op_calls(x, cfg, sets, N, K, "", "")), nbytes))
                    del sets
                    continue
                cfg, sets = uniform_bcq_sets(N, K, q, g, "quick", n)
                nbytes = weight_bytes(M, N, K, q, g)
                if M <= quick.MAX_BATCH:
                    rows.append(base("quick", f"bcq int{q} g{g}", gpu_time_us(op_calls(x, cfg, sets, N, K, "quick", "quick")),
                                     nbytes))
                    fcfg, fsets = free_bcq_sets(N, K, q, g, "quick", n)  # q fp16 α and an fp16 offset per row, group
                    rows.append(base("quick", f"bcq free α q{q} g{g}", gpu_time_us(
                        op_calls(x, fcfg, fsets, N, K, "quick_free", "quick")), nbytes + (2 * q - 4) * N * math.ceil(K / g)))
                    del fsets
                held = backends.layout_for("bcq", cfg, x.device, (N, K))
                held = "" if held is None else held.name
                if held != "quick":
                    cfg, sets = uniform_bcq_sets(N, K, q, g, held, n)
                rows.append(base(f"dispatched ({held or 'canonical'})", f"bcq int{q} g{g}",
                                 gpu_time_us(op_calls(x, cfg, sets, N, K, "", held)), nbytes))
                if M <= cuda_lut.MAX_BATCH:
                    cfg, sets = uniform_bcq_sets(N, K, q, g, "cuda_lut", n)
                    rows.append(base("cuda_lut", f"bcq int{q} g{g}",
                                     gpu_time_us(op_calls(x, cfg, sets, N, K, "cuda_lut", "cuda_lut")), nbytes))
                del sets
                torch.cuda.empty_cache()
            for r in rows[first:]:
                print(r, flush=True)
    text = head + "\n\n" + table(["kernel", "format", "N x K", "M", "µs", "TB/s", "x cuBLAS fp16"], rows)
    report(text, args.markdown)


if __name__ == "__main__":
    main()
