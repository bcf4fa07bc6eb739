"""Measure which kernel runs BCQ and codebook layers fastest at each batch size on this GPU; write the dispatch table.

    python benchmarks/tune_dispatch.py [--shapes 8192x8192,...] [--bits 2,3,4,8] [--groups 128]
                                       [--batches 1,2,...,512] [--codebook 4:1:64,2:4:64] [--out backends/dispatch/<gpu>.json]

For every (uniform or free α, bits, group_size, N, K) and M it times, with :func:`common.gpu_time_us` (CUDA graphs,
weights rotated through 3x L2), every path a layer can take in each layout it may hold, where the path's kernel takes
those bits.  Uniform layers: layout ``cuda_lut``: the LUT GEMV (M <= 8) and its dequantize + cuBLAS; layout ``quick``
(1-4 bits): the QUICK GEMM (M <= 512) and dequantize + cuBLAS; the canonical storage (8 bits): the tensor-core GEMV
``cuda_uniform_gemv`` (M <= 16), GEMM ``cuda_uniform_gemm`` (M <= 512) and dequantize + cuBLAS.  Free-α layers: layout ``cuda_lut``: the LUT GEMV and its
dequantize + cuBLAS; layout ``quick``: ``quick_free`` (the QUICK GEMM, dequantize + cuBLAS above 512 rows).  Codebook
layers (``--codebook bits:books:group``, canonical storage): the GEMV (M <= 8) and dequantize + cuBLAS.
:func:`qlinear.backends.dispatch.plan_from_timings` then picks per shape the layout with the smallest worst slowdown
against the best path at any M, and the per-M plan; the table (JSON, committed) is what
:func:`qlinear.backends.select` follows on this GPU model.
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
from common import codebook_sets, free_bcq_sets, gpu_time_us, op_calls, pool_size, uniform_bcq_sets  # noqa: E402

from qlinear import backends  # noqa: E402
from qlinear.backends import cuda_codebook, cuda_lut, cuda_uniform, dispatch, quick  # noqa: E402
from qlinear.formats import codebook  # noqa: E402

SHAPES = "8192x8192,4096x4096,11008x4096,4096x11008,28672x8192,8192x28672,576x576,1536x576,576x1536,192x576"
BATCHES = "1,2,4,8,16,32,64,128,256,512"
# BCQ layers: uniform or free α -> backend -> (held layout, largest M it runs)
PATHS = {True: {"cuda_lut": ("cuda_lut", cuda_lut.MAX_BATCH), "cuda_lut_dequant": ("cuda_lut", None),
                "quick": ("quick", quick.MAX_BATCH), "quick_dequant": ("quick", None),
                "cuda_uniform_gemv": ("", cuda_uniform.MAX_BATCH),
                "cuda_uniform_gemm": ("", cuda_uniform.GEMM_MAX_BATCH), "cuda_uniform": ("", None)},
         False: {"cuda_lut": ("cuda_lut", cuda_lut.MAX_BATCH), "cuda_lut_dequant": ("cuda_lut", None),
                 "quick_free": ("quick", None)}}
CODEBOOK_PATHS = {"cuda_codebook_gemv": ("", cuda_codebook.MAX_BATCH), "cuda_codebook": ("", None)}


def takes(format: str, backend: str, bits: int) -> bool:
    """Whether ``backend``'s registered kernel for ``format`` runs layers of ``bits`` bits."""
    return any(k.backend == backend and (k.bits is None or bits in k.bits) for k in backends.kernels(format))


def _time(paths, batches, K, sets_of, calls_of, dtype):
    times = {b: {} for b in paths}
    for backend, (layout, max_m) in paths.items():
        cfg, sets = sets_of(layout)
        for M in batches:
            if max_m is None or M <= max_m:
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                times[backend][M] = gpu_time_us(calls_of(x, cfg, sets, backend, layout), replays=10)
        del sets
        torch.cuda.empty_cache()
    return times


def measure(N, K, bits, g, batches, uniform=True, dtype=torch.float16):
    """``{backend: {M: µs}}`` for one BCQ layer shape, over the paths whose kernels take ``bits``."""
    paths = {b: p for b, p in PATHS[uniform].items() if takes("bcq", b, bits)}
    make = uniform_bcq_sets if uniform else free_bcq_sets
    return paths, _time(paths, batches, K, lambda layout: make(N, K, bits, g, layout, pool_size(N * K * bits // 8)),
                        lambda x, cfg, sets, backend, layout: op_calls(x, cfg, sets, N, K, backend, layout), dtype)


def measure_codebook(N, K, bits, books, g, batches, dtype=torch.float16):
    """``{backend: {M: µs}}`` for one codebook layer shape (random valid canonical buffers)."""
    cfg = codebook.Config(bits=bits, num_codebooks=books, group_size=g)
    sets = lambda layout: (cfg, [[t for t in s if t is not None]
                                 for s in codebook_sets(N, K, bits, books, g, pool_size(N * K * bits // 8))])
    calls = lambda x, cfg, sets, backend, layout: op_calls(x, cfg, sets, N, K, backend, layout, "codebook")
    return _time(CODEBOOK_PATHS, batches, K, sets, calls, dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--bits", default="2,3,4,8")
    ap.add_argument("--groups", default="128")
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--codebook", default="4:1:64,2:4:64", help="codebook layers, bits:books:group ('' = none)")
    ap.add_argument("--out", help="table file (default: backends/dispatch/<gpu name>.json)")
    ap.add_argument("--alphas", default="uniform,free", help="uniform and/or free-α layers")
    args = ap.parse_args()
    missing = {m.__name__: m.available() for m in (quick, cuda_lut, cuda_uniform, cuda_codebook)}
    if not torch.cuda.is_available() or any(missing.values()):
        sys.exit(f"needs a CUDA GPU and the extensions: {missing}")
    name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else dispatch.device_table_path(name)
    entries = []
    batches = [int(m) for m in args.batches.split(",")]

    def add(entry, times, layouts):
        layout, plan, worst = dispatch.plan_from_timings(times, layouts)
        entries.append({**entry, "layout": layout, "plan": plan, "worst_slowdown": round(worst, 3),
                        "us": {b: {str(m): round(t, 2) for m, t in ts.items()} for b, ts in times.items()}})
        print(json.dumps(entries[-1]), flush=True)

    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for bits in map(int, args.bits.split(",")):
            for gs, alphas in itertools.product(args.groups.split(","), args.alphas.split(",")):
                g, uniform = K if gs == "K" else int(gs), alphas == "uniform"
                paths, times = measure(N, K, bits, g, batches, uniform)
                add({"format": "bcq", "uniform": uniform, "bits": bits, "group_size": -1 if gs == "K" else g, "N": N,
                     "K": K}, times, {b: p[0] for b, p in paths.items()})
        for c in filter(None, args.codebook.split(",")):
            bits, books, g = map(int, c.split(":"))
            add({"format": "codebook", "bits": bits, "group_size": g, "N": N, "K": K},
                measure_codebook(N, K, bits, books, g, batches), {b: p[0] for b, p in CODEBOOK_PATHS.items()})
    out.write_text(json.dumps({"device": name, "date": str(datetime.date.today()), "torch": torch.__version__,
                               "entries": entries}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
