"""Measure which kernel runs BCQ layers fastest at each batch size on this GPU; write the dispatch table.

    python benchmarks/tune_dispatch.py [--shapes 8192x8192,...] [--bits 2,3,4] [--groups 128]
                                       [--batches 1,2,...,512] [--out backends/dispatch/<gpu>.json]

For every (uniform or free α, bits, group_size, N, K) and M it times, with :func:`common.gpu_time_us` (CUDA graphs,
weights rotated through 3x L2), every path a layer can take in each layout it may hold.  Uniform layers: layout
``cuda_lut``: the LUT GEMV (M <= 8) and, above, the reference kernel on converted buffers; layout ``quick``: the QUICK
GEMM (M <= 512) and dequantize + cuBLAS.  Free-α layers: layout ``cuda_lut``: the LUT GEMV and its dequantize +
cuBLAS; layout ``quick``: ``quick_free`` (the QUICK GEMM, dequantize + cuBLAS above 512 rows).  :func:`qlinear.backends.dispatch.plan_from_timings`
then picks per shape the layout with the smallest worst slowdown against the best path at any M, and the
per-M plan; the table (JSON, committed) is what :func:`qlinear.backends.select` follows on this GPU model.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import free_bcq_sets, gpu_time_us, op_calls, pool_size, uniform_bcq_sets  # noqa: E402

from qlinear.backends import cuda_lut, dispatch, quick  # noqa: E402

SHAPES = "8192x8192,4096x4096,11008x4096,4096x11008,28672x8192,8192x28672,576x576,1536x576,576x1536,192x576"
BATCHES = "1,2,4,8,16,32,64,128,256,512"
# uniform or free α -> backend -> (held layout, largest M it runs)
PATHS = {True: {"cuda_lut": ("cuda_lut", cuda_lut.MAX_BATCH), "reference": ("cuda_lut", None),
                "quick": ("quick", quick.MAX_BATCH), "quick_dequant": ("quick", None)},
         False: {"cuda_lut": ("cuda_lut", cuda_lut.MAX_BATCH), "cuda_lut_dequant": ("cuda_lut", None),
                 "quick_free": ("quick", None)}}


def measure(N, K, bits, g, batches, uniform=True, dtype=torch.float16):
    """``{backend: {M: µs}}`` for one layer shape."""
    paths = PATHS[uniform]
    times = {b: {} for b in paths}
    for backend, (layout, max_m) in paths.items():
        slow = backend == "reference"  # converts and dequantizes in fp32 on every call: ms, not µs, per call
        make = uniform_bcq_sets if uniform else free_bcq_sets
        cfg, sets = make(N, K, bits, g, layout, 2 if slow else pool_size(N * K * bits // 8))
        for M in batches:
            if max_m is not None and M > max_m or slow and M <= cuda_lut.MAX_BATCH:
                continue
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            times[backend][M] = gpu_time_us(op_calls(x, cfg, sets, N, K, backend, layout), replays=3 if slow else 10)
        del sets
        torch.cuda.empty_cache()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--out", help="table file (default: backends/dispatch/<gpu name>.json)")
    ap.add_argument("--alphas", default="uniform,free", help="uniform and/or free-α layers")
    args = ap.parse_args()
    if not torch.cuda.is_available() or quick.available() or cuda_lut.available():
        sys.exit(f"needs a CUDA GPU and both extensions: quick: {quick.available()}, cuda_lut: {cuda_lut.available()}")
    name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else dispatch.device_table_path(name)
    entries = []
    batches = [int(m) for m in args.batches.split(",")]
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for bits in map(int, args.bits.split(",")):
            for gs, alphas in itertools.product(args.groups.split(","), args.alphas.split(",")):
                g, uniform = K if gs == "K" else int(gs), alphas == "uniform"
                times = measure(N, K, bits, g, batches, uniform)
                layout, plan, worst = dispatch.plan_from_timings(times, {b: p[0] for b, p in PATHS[uniform].items()})
                entries.append({"format": "bcq", "uniform": uniform, "bits": bits,
                                "group_size": -1 if gs == "K" else g, "N": N, "K": K,
                                "layout": layout, "plan": plan, "worst_slowdown": round(worst, 3),
                                "us": {b: {str(m): round(t, 2) for m, t in ts.items()} for b, ts in times.items()}})
                print(json.dumps(entries[-1]), flush=True)
    out.write_text(json.dumps({"device": name, "date": str(datetime.date.today()), "torch": torch.__version__,
                               "entries": entries}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
