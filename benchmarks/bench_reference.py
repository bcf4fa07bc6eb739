"""Reference backend vs dense ``F.linear``: latency and weight memory per format.

    python benchmarks/bench_reference.py [--device cpu] [--shapes 1536x576,4096x4096] [--batches 1,16]

The reference backend dequantizes the whole weight on every call, so it is expected to be slower than
the dense matmul: it is the ground truth, not a fast path.  Ratios are against ``F.linear`` with the
dense float32 (CPU) / float16 (GPU) weight, measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, timeit  # noqa: E402

from qlinear import QLinearConfig  # noqa: E402
from qlinear.modules import module_class  # noqa: E402

CONFIGS = {"bcq 4-bit g64": QLinearConfig("bcq", bits=4, group_size=64, iters=0, init="uniform"),
           "bcq 3-bit g64": QLinearConfig("bcq", bits=3, group_size=64, iters=0, init="uniform"),
           "mixed 2/4/16": QLinearConfig("mixed"),
           "codebook 2-bit g32": QLinearConfig("codebook", bits=2, iters=2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shapes", default="1536x576,576x1536,4096x4096", help="NxK list (out x in)")
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.float32 if dev == "cpu" else torch.float16
    rows = []
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        lin = torch.nn.Linear(K, N, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
        mods = {name: module_class(c.format).from_linear(lin, c).to(dev) for name, c in CONFIGS.items()}
        lin = lin.to(dev, dtype)
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            with torch.no_grad():
                base = timeit(lambda: lin(x), device=dev)
                for name, m in mods.items():
                    t = timeit(lambda: m(x), device=dev)
                    rows.append([f"{N}x{K}", M, name, f"{m.bits_per_weight:.3f}",
                                 f"{m.memory_footprint() / (N * K * 2):.3f}", round(base, 1), round(t, 1),
                                 f"{t / base:.1f}"])
    print(f"{datetime.date.today()} | device: {dev} ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads) | torch {torch.__version__}\n")
    print(table(["N x K", "batch", "format", "bits/weight", "memory vs fp16", "dense F.linear (µs)",
                 "reference (µs)", "reference / dense"], rows))


if __name__ == "__main__":
    main()
