"""Layout conversion time on x86 (and Arm's uniform 4-bit layout): ``repack`` (checkpoint storage -> the x86 kernels' layout, once per layer at every
load) and ``unrepack`` (the way back, at every ``state_dict()`` / ``save_pretrained``) of one layer per format, at
Llama-2-7B's shapes.  Medians of ``--repeats`` calls on layers of random weights quantized without calibration.

    python benchmarks/bench_repack.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlinear import QLinearConfig
from qlinear.modules import module_class
from qlinear.backends import arm_neon, x86

FORMATS = {
    "RTN 4-bit g128 (uniform)": dict(format="bcq", bits=4, group_size=128, init="uniform", iters=0),
    "RTN 3-bit g128 (uniform)": dict(format="bcq", bits=3, group_size=128, init="uniform", iters=0),
    "RTN 2-bit g128 (uniform)": dict(format="bcq", bits=2, group_size=128, init="uniform", iters=0),
    "BCQ 4-bit g64 (free α, default)": dict(format="bcq", iters=0),
    "mixed 2/4/16 (defaults)": dict(format="mixed"),
    "codebook 2-bit (defaults)": dict(format="codebook"),
}
LAYOUTS = {"bcq": ("repack", "unrepack"), "mixed": ("repack_mixed", "unrepack_mixed"),
           "codebook": ("repack_codebook", "unrepack_codebook")}
SHAPES = [(4096, 4096), (11008, 4096)]


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| format | N x K | repack (load) | unrepack (save) |\n|---|---|---|---|")
    for label, opts in FORMATS.items():
        cfg = QLinearConfig(**opts)
        for N, K in SHAPES:
            torch.manual_seed(0)
            layer = module_class(cfg.format).from_linear(torch.nn.Linear(K, N, bias=False), cfg)
            canon, fc = layer.canonical(), layer.config
            repack, unrepack = (getattr(x86, f) for f in LAYOUTS[cfg.format])
            held = repack(canon, fc, N, K)
            back = unrepack(held, fc, N, K)
            if not all(torch.equal(back[k], canon[k]) for k in canon):
                raise SystemExit(f"{label} {N}x{K}: unrepack(repack(b)) != b")
            r = _median(lambda: repack(canon, fc, N, K), args.repeats)
            u = _median(lambda: unrepack(held, fc, N, K), args.repeats)
            print(f"| {label} | {N} x {K} | {1e3 * r:.0f} ms | {1e3 * u:.0f} ms |")
            if cfg.format == "bcq" and opts.get("init") == "uniform" and cfg.bits == 4:  # Arm's layout too
                held = arm_neon.repack_bcq(canon, fc, N, K)
                r = _median(lambda: arm_neon.repack_bcq(canon, fc, N, K), args.repeats)
                u = _median(lambda: arm_neon.unrepack_bcq(held, fc, N, K), args.repeats)
                print(f"| {label}, Arm layout | {N} x {K} | {1e3 * r:.0f} ms | {1e3 * u:.0f} ms |")


if __name__ == "__main__":
    main()
