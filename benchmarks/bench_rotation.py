"""Issue 27, cost: the online input transform of a Hadamard-rotated layer against the layer's own time, on this CPU.

    python benchmarks/bench_rotation.py                      # SmolLM2 and Llama-7B input widths, M = 1, 8, 128
    python benchmarks/bench_rotation.py --shapes 576x576 --batches 1 --threads 1

Per (N x K layer, M rows), µs with torch's threads as set (the best of ``--rounds`` interleaved medians): the layer unrotated (RTN 4-bit g64, the kernel the
registry picks here: x86 on x86 machines), the same weights rotated (``rotation="hadamard"``, the op's unfused
transform ``x·Rᵀ`` before the kernel), and the transform alone (``qlinear.formats.rotation.rotate`` on a fresh
``x``: what one group of layers reading the same input, q/k/v or gate/up, pays once).  ``overhead`` is rotated over
unrotated minus one.  The issue's target (≤ 5% at M = 1) is for the transform fused into the kernels; this measures
the unfused path every kernel runs today.
"""

from __future__ import annotations

import argparse

import torch

from common import table, timeit
from qlinear import BCQLinear, QLinearConfig
from qlinear.formats import rotation

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (4096, 11008)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma list of NxK (default: SmolLM2's and Llama-7B's)")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds; the best median of each counts")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for N, K in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(K, N, bias=False)
        layers = {rot: BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0,
                                                                rotation=rot)) for rot in ("none", "hadamard")}
        seed, block = rotation.params(layers["hadamard"].config, K)
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K)
            fns = {"plain": lambda: layers["none"](x.clone()),
                   "rotated": lambda: layers["hadamard"](x.clone()),  # a fresh tensor: no shared transform
                   "alone": lambda: rotation.rotate(x.clone(), seed, block), "copy": lambda: x.clone()}
            best = {k: float("inf") for k in fns}
            with torch.no_grad():
                for _ in range(args.rounds):  # interleaved rounds, best median of each: robust to a busy machine
                    for k, fn in fns.items():
                        best[k] = min(best[k], timeit(fn))
            plain, rotated, alone, copy = best["plain"], best["rotated"], best["alone"], best["copy"]
            rows.append([f"{N}x{K}", block, M, layers["none"].kernel(x).backend, plain - copy, rotated - copy,
                         alone - copy, f"{(rotated - plain) / (plain - copy):+.0%}"])
    print(table(["N x K", "block", "M", "kernel", "unrotated µs", "rotated µs", "transform alone µs", "overhead"],
                rows))


if __name__ == "__main__":
    main()
