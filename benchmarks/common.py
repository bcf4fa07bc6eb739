"""Shared benchmark helpers: one timer and one table printer for every benchmark in this folder."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def timeit(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20, device: str = "cpu") -> float:
    """Median wall time of ``fn()`` in microseconds (CUDA-synchronised on GPU)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table."""
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
