"""Launch-plan sweep of the LUT GEMV, the QUICK GEMM and the mixed GEMV on one GPU: is the heuristic ``plan()`` the
best launch?

    python benchmarks/sweep_plans.py [--kernels cuda_lut,quick,async_dequant] [--shapes 576x576,...] [--bits 4]
                                     [--markdown out.md]

The first H100 run (2026-11-23, RESULTS.md) left two questions only a sweep answers: the LUT GEMV costs 16-23 µs on
SmolLM2-sized layers at every M (a grid of a few one-warp blocks), and the QUICK GEMM moves 0.8 TB/s at M = 1
(few bytes in flight).  For each (kernel, shape, M) this times every launch in a grid around the heuristic's
(LUT: ``kt`` × ``threads`` × splits; QUICK: ``tile_m`` × splits), checks each launch's output against the
heuristic's (split-K changes only the fp32 summation order), and prints the heuristic's time next to the best.
The mixed GEMV (``async_dequant``, the format's defaults without outliers) sweeps ``threads`` × splits, among them
the one-wave split its plan takes and the one more that rounding up gave before 2026-11-27 (the kernel model
predicts 55.5 -> 45.9 µs at 8192², M = 8 on an H100).  The LUT GEMV and the QUICK GEMM also time act_order layers both
ways: ``perm`` gathered inside the kernel, and ``x[:, perm]`` gathered by one
``index_select`` before the plain kernel.  Timing as in bench_gemv.py (CUDA-graph replay of a pool of weight sets).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpu_run_header, gpu_time_us, mixed_pool, pool_size, table, uniform_bcq_sets  # noqa: E402

from qlinear import ops as _ops  # noqa: E402
from qlinear.backends import async_dequant, cuda_lut, quick  # noqa: E402

SHAPES = "576x576,1536x576,576x1536,4096x4096,8192x8192,28672x8192"
SPLIT_TARGETS = (1, 2, 4, 8, 16, 32)


def lut_launches(M: int, N: int, K: int, sms: int, bits: int) -> list[tuple[int, int, int, int]]:
    """``(kt, threads, tiles_per_split, splits)`` grid for the LUT GEMV: its fixed ``kt`` (``32·words(M, bits)``),
    32..256 threads, K split into 1..64 parts; the heuristic's plan first."""
    out = [cuda_lut.plan(M, N, K, sms, bits)]
    kt = 32 * cuda_lut.words(M, bits)
    tiles = math.ceil(K / kt)
    for threads, s in itertools.product((32, 64, 128, 256), SPLIT_TARGETS + (64, 0, -1)):
        if threads > 32 * math.ceil(N / 128):
            continue
        if s <= 0:  # one (s = 0) or two (s = -1) full waves of two blocks per SM
            s = max(1, 2 * (1 - s) * sms // math.ceil(N / (4 * threads)))
        per = math.ceil(tiles / min(tiles, s))
        launch = (kt, threads, per, math.ceil(tiles / per))
        if launch not in out:
            out.append(launch)
    return out


def quick_launches(M: int, N: int, K: int, sms: int) -> list[tuple[int, int, int]]:
    """``(tile_m, tiles_per_split, splits)`` grid for the QUICK GEMM: tile_m 16..128, K split into 1..32 parts (at
    least one 64-input tile each); the heuristic's plan first."""
    out = [quick.plan(M, N, K, sms)]
    tiles = K // quick.TILE_K
    for tile_m, s in itertools.product((16, 32, 64, 128), SPLIT_TARGETS):
        per = math.ceil(tiles / min(tiles, s))
        launch = (tile_m, per, math.ceil(tiles / per))
        if launch not in out:
            out.append(launch)
    return out


def mixed_launches(M: int, N: int, K: int, sms: int, W: int) -> list[tuple[int, int, int]]:
    """``(threads, tiles_per_split, splits)`` grid for the mixed GEMV (``W`` code words per row, tiles of 4): 32..256
    threads (≤ ``MAX_THREADS_M8`` at 8 rows), K split into 1..32 parts, one wave of resident blocks (the plan's
    rounding) and one more split (rounding up, the plan before 2026-11-27); the heuristic's plan first."""
    out = [async_dequant.plan(M, N, K, W, sms)]
    tiles, resident = math.ceil(W / 4), async_dequant._resident(min(M, 8))
    for threads, s in itertools.product((32, 64, 128, 256), SPLIT_TARGETS + (0, -1)):
        if min(M, 8) == async_dequant.KERNEL_M and threads > async_dequant.MAX_THREADS_M8:
            continue
        if s <= 0:  # the most splits one wave holds (s = 0), and one more where that does not divide (s = -1)
            blocks_n, places = math.ceil(N / (2 * threads)), sms * resident // threads
            s = max(1, places // blocks_n if s == 0 else -(-places // blocks_n))
        per = math.ceil(tiles / min(tiles, s))
        launch = (threads, per, math.ceil(tiles / per))
        if launch not in out:
            out.append(launch)
    return out


def _op(kernel: str, x, bufs: dict, perm, cfg, N: int, K: int, launch):
    if kernel == "async_dequant":
        return async_dequant.linear(x, bufs, None, cfg, N, K, launch=launch)
    gs = cfg.group(K)
    if kernel == "cuda_lut":
        return torch.ops.qlinear.bcq_lut_gemv(x, bufs["lut_planes"], cuda_lut.alpha_arg(bufs), bufs.get("lut_offset"),
                                              perm, None, gs, *launch)
    return torch.ops.qlinear.quick_gemm(x, bufs["quick_qweight"], bufs["quick_scales"], bufs.get("quick_zeros"), perm,
                                        None, gs, *launch)


def weight_pool(kernel: str, N: int, K: int, bits: int, group: int) -> tuple[object, list[dict]]:
    """``(cfg, pool)``: random uniform BCQ weight sets in ``kernel``'s layout (the mixed GEMV: random mixed layers at
    the format's defaults without outliers), 3x the L2 in all (as bench_gemv)."""
    if kernel == "async_dequant":
        cfg, _, sets = mixed_pool(N, K, 0.0)
        return cfg, sets
    cfg, first = uniform_bcq_sets(N, K, bits, group, kernel, 1)
    _, rest = uniform_bcq_sets(N, K, bits, group, kernel, pool_size(sum(t.nbytes for t in first[0])) - 1)
    return cfg, [dict(zip(_ops._names("bcq", cfg.to_json(), N, K, kernel), s)) for s in first + rest]


def sweep(kernel: str, cfg, pool: list[dict], N: int, K: int, M: int, sms: int, bits: int) -> tuple[list, list]:
    """Rows ``[kernel, shape, M, launch, µs, max rel diff vs heuristic]`` for every launch, and (not for the mixed GEMV)
    the act_order row ``[kernel, shape, M, best launch, µs, µs with perm in the kernel, µs with index_select first]``."""
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    launches = {"cuda_lut": lambda: lut_launches(M, N, K, sms, bits), "quick": lambda: quick_launches(M, N, K, sms),
                "async_dequant": lambda: mixed_launches(M, N, K, sms, pool[0]["ad_codes"].numel() // N)}[kernel]()
    want = _op(kernel, x, pool[0], None, cfg, N, K, launches[0]).float()
    rows = []
    for launch in launches:
        try:
            got = _op(kernel, x, pool[0], None, cfg, N, K, launch).float()
        except RuntimeError as e:  # a launch the binding rejects
            rows.append([kernel, f"{N}x{K}", M, launch, float("nan"), str(e).splitlines()[0][:60]])
            continue
        err = ((got - want).abs().max() / want.abs().max()).item()
        us = gpu_time_us([lambda b=b, l=launch: _op(kernel, x, b, None, cfg, N, K, l) for b in pool], replays=10)
        rows.append([kernel, f"{N}x{K}", M, launch, us, f"{err:.1e}" + (" WRONG" if err > 1e-2 else "")])
    if kernel == "async_dequant":
        return rows, None
    best = min((r for r in rows if r[4] == r[4] and "WRONG" not in r[5]), key=lambda r: r[4])
    perm = torch.randperm(K, device="cuda").int()
    inside = gpu_time_us([lambda b=b: _op(kernel, x, b, perm, cfg, N, K, best[3]) for b in pool], replays=10)
    outside = gpu_time_us([lambda b=b: _op(kernel, x.index_select(1, perm), b, None, cfg, N, K, best[3])
                           for b in pool], replays=10)
    return rows, [kernel, f"{N}x{K}", M, best[3], best[4], inside, outside]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="cuda_lut,quick,async_dequant")
    ap.add_argument("--shapes", default=SHAPES, help="NxK list (out x in)")
    ap.add_argument("--lut-batches", default="1,4,8")
    ap.add_argument("--quick-batches", default="1,16,64,256")
    ap.add_argument("--mixed-batches", default="1,8")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--markdown", help="also write every row to this file")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    for k in kernels:
        why = {"cuda_lut": cuda_lut, "quick": quick, "async_dequant": async_dequant}[k].available()
        if not torch.cuda.is_available() or why:
            sys.exit(f"needs a CUDA GPU and the {k} extension: {why}")
    header, _ = gpu_run_header()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    md = Path(args.markdown) if args.markdown else None
    if md:  # every launch's row is appended as it is measured, so a run stopped at its time limit keeps them
        md.write_text(f"{header}; {args.bits}-bit g{args.group}\n\n" + table(
            ["kernel", "N x K", "M", "launch", "µs", "max rel diff vs heuristic"], []) + "\n")
    summary, acts = [], []
    for k in kernels:
        for shape in args.shapes.split(","):
            N, K = map(int, shape.split("x"))
            cfg, pool = weight_pool(k, N, K, args.bits, args.group)
            batches = {"cuda_lut": args.lut_batches, "quick": args.quick_batches, "async_dequant": args.mixed_batches}
            for M in map(int, batches[k].split(",")):
                rows, act = sweep(k, cfg, pool, N, K, M, sms, args.bits)
                if md:
                    with md.open("a") as f:
                        f.write(table([""] * 6, rows).split("\n", 2)[2] + "\n")
                if act:
                    acts.append(act)
                best = min((r for r in rows if r[4] == r[4] and "WRONG" not in r[5]), key=lambda r: r[4])
                summary.append([k, shape, M, rows[0][3], rows[0][4], best[3], best[4], rows[0][4] / best[4],
                                sum("WRONG" in r[5] for r in rows)])
                print(summary[-1], act[4:] if act else "", flush=True)
            del pool
            mixed_pool.cache_clear()  # the mixed pools are cached for bench_gemv; free this shape's
    out = "\n\n".join([
        f"{header}; {args.bits}-bit g{args.group}",
        table(["kernel", "N x K", "M", "heuristic launch", "µs", "best launch", "best µs", "heuristic / best",
               "launches off by > 1e-2"], summary),
        "act_order at the best launch: perm gathered inside the kernel vs x.index_select(1, perm) then the plain kernel",
        table(["kernel", "N x K", "M", "launch", "no perm µs", "perm in kernel µs", "index_select + kernel µs"], acts)])
    print(out)
    if md:
        with md.open("a") as f:
            f.write("\n" + out + "\n")


if __name__ == "__main__":
    main()
