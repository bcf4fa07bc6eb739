"""Stored bits per weight of uniform (round-to-nearest / GPTQ) BCQ layers: the storage before 2026-11-25 (bit-planes,
one fp16 α per bit, an offset), the canonical uniform storage (codes, fp16 scale, packed zero point: what checkpoints
and CPU memory hold) and each kernel layout a GPU or Arm CPU holds in memory.

    python benchmarks/bench_storage.py

Counts, not timings: every buffer's exact bits, from layers of random uniform codes repacked by the real layout code
(``qlinear.ops.to_layout``).  Prints a Markdown table (issue 22, item 3: ≤ 4.17 bits stored, ≤ 4.2 on the GPU
layout, for GPTQ 4-bit g128).
"""

from __future__ import annotations

import dataclasses

import torch

from qlinear import backends
from qlinear.formats import bcq
from qlinear.formats.base import spec_bits
from qlinear.ops import to_layout

CONFIGS = [("RTN 4-bit g64", 4, 64, False), ("GPTQ 4-bit g128", 4, 128, False),
           ("GPTQ 4-bit g128 act_order", 4, 128, True), ("GPTQ 3-bit g128", 3, 128, False),
           ("GPTQ 2-bit g128", 2, 128, False), ("GPTQ 8-bit g128", 8, 128, False)]
SHAPES = [(4096, 4096), (11008, 4096), (576, 576)]
LAYOUTS = ["quick", "cuda_lut", "arm_neon_bcq"]


def _bits(bufs: dict, N: int, K: int) -> float:
    return spec_bits({k: (tuple(v.shape), v.dtype) for k, v in bufs.items()}) / (N * K)


def row(bits: int, group_size: int, act_order: bool, N: int, K: int) -> dict[str, float]:
    """Bits per weight of one layer in every storage and layout that can hold it (absent: the layout cannot)."""
    g = torch.Generator().manual_seed(N + K)
    G = -(-K // group_size)
    g_idx = (torch.arange(K) // group_size)[torch.randperm(K, generator=g)] if act_order else None
    cfg, canon = bcq.from_uniform(torch.randint(0, 2 ** bits, (N, K), generator=g),
                                  (torch.rand(N, G, generator=g) * 0.01 + 1e-3).half(),
                                  torch.randint(0, 2 ** bits, (N, G), generator=g), bits, group_size, g_idx)
    # GPTQ's own config (method="gptq"; its offsets were float32 before), round-to-nearest's for g64 (fp16 offsets)
    cfg = dataclasses.replace(cfg, act_order=act_order, method="gptq" if group_size == 128 else "bcq")
    out = {"before": _bits(bcq.LEGACY.repack(canon, cfg, N, K), N, K), "stored": _bits(canon, N, K)}
    for name in LAYOUTS:
        layout = backends.get_layout(name)
        kernel = next(k for k in backends.kernels("bcq") if k.layout is layout)
        if kernel.supports(cfg, N, K) is None:
            out[name] = _bits(to_layout(canon, cfg, layout, N, K), N, K)
    return out


def main() -> None:
    print("| layer | N x K | before (planes + α + offset) | stored (codes + scale + zero) | "
          + " | ".join(f"{n} layout" for n in LAYOUTS) + " |")
    print("|---|---|---|---|" + "---|" * len(LAYOUTS))
    for label, bits, gs, ao in CONFIGS:
        for N, K in SHAPES:
            r = row(bits, gs, ao, N, K)
            cells = [f"{r[n]:.3f}" if n in r else "-" for n in LAYOUTS]
            print(f"| {label} | {N} x {K} | {r['before']:.3f} | {r['stored']:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
