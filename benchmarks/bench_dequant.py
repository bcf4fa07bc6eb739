"""Dequantize kernels on one GPU (issue 24: each ≥ 70 % of copy bandwidth, bytes read + written, at 8192²).

    python benchmarks/bench_dequant.py [--shapes 8192x8192,...] [--markdown out.md]

Times, per shape, the kernels that write a dense fp16 Ŵ for cuBLAS: ``bcq_lut_dequantize`` (free-α BCQ in the
``cuda_lut`` layout, 2-4 bits, group 128, fp16 offsets), ``quick_dequantize`` (uniform BCQ in the ``quick`` layout,
2-4 bits, group 128, 4-bit zero points), ``codebook_dequantize`` (the canonical codebook buffers: 2 bits with 4
codebooks and 4 bits with 1, group 32), ``uniform_dequantize`` (8-bit uniform BCQ in its canonical storage, group
128, 8-bit zero points) and ``mixed_dequantize`` (the ``async_dequant`` layout at the mixed format's
defaults, 0.2 % outliers).  Timing as in bench_gemv.py (:func:`common.gpu_time_us`: CUDA-graph replay
over a pool of random weight sets 3x the L2); TB/s counts the packed bytes read plus the fp16 Ŵ written, and the
last column compares it with the copy bandwidth measured at the start of the run.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (codebook_sets, gpu_run_header, gpu_time_us, pool_size, report, table,  # noqa: E402
                    uniform_bcq_sets)

from qlinear import ops as _ops  # noqa: E402
from qlinear.backends import async_dequant, cuda_codebook, cuda_lut, cuda_uniform, quick  # noqa: E402
from qlinear.formats import mixed  # noqa: E402


def _rand_i32(*shape) -> torch.Tensor:
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device="cuda")


def lut_sets(N: int, K: int, q: int, g: int, n: int) -> list[tuple]:
    G = math.ceil(K / g)
    return [(_rand_i32(K // 32, q, N), torch.rand(G, q, N, device="cuda").half(), torch.randn(G, N, device="cuda").half())
            for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x8192,28672x8192")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    missing = {b.__name__: b.available() for b in (cuda_lut, quick, cuda_codebook, cuda_uniform, async_dequant)}
    if not torch.cuda.is_available() or any(missing.values()):
        sys.exit(f"needs a CUDA GPU and the extensions: {missing}")
    head, copy_bw = gpu_run_header()
    print(head, flush=True)
    rows = []

    def row(kernel, fmt, N, K, read, calls):
        t = gpu_time_us(calls)
        tbs = (read + 2 * N * K) / t / 1e6
        rows.append([kernel, fmt, f"{N}x{K}", t, tbs, f"{100 * tbs / copy_bw:.0f}%"])
        print(rows[-1], flush=True)

    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        n = pool_size(N * K // 2)
        for q in (2, 3, 4):
            G = math.ceil(K / 128)
            row("bcq_lut_dequantize", f"free α q{q} g128", N, K, q * N * K // 8 + 2 * (q + 1) * N * G,
                [lambda s=s: torch.ops.qlinear.bcq_lut_dequantize(*s, 128, torch.float16)
                 for s in lut_sets(N, K, q, 128, n)])
            cfg, sets = uniform_bcq_sets(N, K, q, 128, "quick", n)
            names = _ops._names("bcq", cfg.to_json(), N, K, "quick")
            row("quick_dequantize", f"uniform q{q} g128", N, K, sum(t.nbytes for t in sets[0]),
                [lambda s=s: quick.dequantize(dict(zip(names, s)), cfg, N, K, torch.float16) for s in sets])
            del sets
        for bits, books in ((2, 4), (4, 1)):
            sets = codebook_sets(N, K, bits, books, 32, n)
            row("codebook_dequantize", f"{bits}-bit {books} books g32", N, K,
                sum(t.nbytes for t in sets[0] if t is not None),
                [lambda s=s: torch.ops.qlinear.codebook_dequantize(*s, K, 32, bits, torch.float16) for s in sets])
            del sets
        cfg, sets = uniform_bcq_sets(N, K, 8, 128, "", pool_size(N * K))
        names = _ops._names("bcq", cfg.to_json(), N, K, "")
        row("uniform_dequantize", "uniform 8-bit g128", N, K, sum(t.nbytes for t in sets[0]),
            [lambda s=s: cuda_uniform.dequantize(dict(zip(names, s)), cfg, N, K, torch.float16) for s in sets])
        del sets
        cfg = mixed.Config(outlier_ratio=0.002)
        sets = [async_dequant.repack(async_dequant.random_buffers(N, K, cfg, seed=i, device="cuda"), cfg, N, K)
                for i in range(n)]
        row("mixed_dequantize", "mixed defaults, 0.2 % outliers", N, K, sum(t.nbytes for t in sets[0].values()),
            [lambda s=s: async_dequant.dequantize(s, cfg, N, K, torch.float16) for s in sets])
        del sets
        torch.cuda.empty_cache()
    text = head + "\n\n" + table(["kernel", "format", "N x K", "µs", "TB/s", "% copy BW"], rows)
    report(text, args.markdown)


if __name__ == "__main__":
    main()
