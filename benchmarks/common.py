"""Shared benchmark helpers: one timer and one table printer for every benchmark in this folder."""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
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


def report(text: str, markdown) -> None:
    """Print a benchmark's ``text`` and, given a path ``markdown`` (its ``--markdown``), write it there too."""
    print(text)
    if markdown:
        Path(markdown).write_text(text + "\n")


def gpu_time_us(calls: list[Callable[[], object]], replays: int = 25) -> float:
    """Median µs per call on the GPU: ``calls`` (one per weight set of a pool larger than L2, so every call
    reads its weights from DRAM) are captured once in a CUDA graph, then the graph is replayed ``replays``
    times; each replay's time is divided by ``len(calls)``.  Launch overhead is therefore that of a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: lazy init, JIT builds, allocator pools
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def pool_size(bytes_per_set: int, factor: float = 3.0, cap_bytes: int = 8 << 30) -> int:
    """How many weight sets of ``bytes_per_set`` make a pool ``factor`` times the GPU's L2 (at least 2)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(2, min(int(factor * l2 // max(bytes_per_set, 1)) + 1, cap_bytes // max(bytes_per_set, 1)))


def copy_bandwidth_tbs(nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in TB/s, (read + write bytes) / time of an elementwise kernel (``torch.neg``) over
    ``nbytes``.  Not ``dst.copy_(src)`` (a memcpy node once captured in a graph): that measured 2.70 TB/s on an H200
    (2026-11-26) while cuBLAS's GEMV read its weight at 4.36 TB/s in the same run, so it was no ceiling."""
    src = torch.randn(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    us = gpu_time_us([lambda: torch.neg(src, out=dst)], replays=10)
    return 2 * nbytes / (us * 1e-6) / 1e12


def gpu_run_header() -> tuple[str, float]:
    """``(line, copy TB/s)``: device, SMs, L2, torch version, date and the copy bandwidth measured now, for the
    head of a GPU benchmark table."""
    import datetime

    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth_tbs()
    return (f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, torch "
            f"{torch.__version__}, {datetime.date.today()}; copy bandwidth {copy_bw:.2f} TB/s (read+write)"), copy_bw


def uniform_bcq_sets(N: int, K: int, bits: int, group_size: int, layout: str, n: int, device: str = "cuda"):
    """``(cfg, [packed list, ...])``: ``n`` random uniform BCQ weight sets (int codes with fp16 scales and zero points,
    as round-to-nearest or GPTQ produce) on ``device``, in kernel ``layout`` ("" = canonical).  Values do not
    change the timing, so no quantizer runs (it would take minutes on big layers)."""
    from qlinear import backends
    from qlinear.formats import bcq
    from qlinear.ops import to_layout

    G = -(-K // group_size)
    sets, cfg = [], None
    for _ in range(n):
        codes = torch.randint(0, 2 ** bits, (N, K), device=device)
        scales = (torch.rand(N, G, device=device) * 0.01 + 0.001).half().float()
        zeros = torch.randint(0, 2 ** bits, (N, G), device=device)
        cfg, canon = bcq.from_uniform(codes, scales, zeros, bits, group_size)
        bufs = to_layout(canon, cfg, backends.get_layout(layout), N, K) if layout else canon
        sets.append(list(bufs.values()))
    return cfg, sets


def free_bcq_sets(N: int, K: int, bits: int, group_size: int, layout: str, n: int, device: str = "cuda"):
    """``(cfg, [packed list, ...])`` as :func:`uniform_bcq_sets` for free-α BCQ: random bit-planes, fp16 α and
    offsets (the BCQ fit's storage)."""
    from qlinear import backends
    from qlinear.formats import bcq
    from qlinear.ops import to_layout

    G = -(-K // group_size)
    cfg = bcq.Config(bits=bits, group_size=group_size)
    sets = []
    for _ in range(n):
        canon = {"planes": torch.randint(-2 ** 31, 2 ** 31, (bits, N, K // 32), device=device, dtype=torch.int32),
                 "alpha": (torch.rand(bits, N, G, device=device) * 0.01 + 0.001).half(),
                 "offset": (torch.rand(N, G, device=device) * 0.01).half()}
        bufs = to_layout(canon, cfg, backends.get_layout(layout), N, K) if layout else canon
        sets.append(list(bufs.values()))
    return cfg, sets


def op_calls(x: torch.Tensor, cfg, sets, N: int, K: int, backend: str, layout: str, format: str = "bcq"
             ) -> list[Callable[[], object]]:
    """Closures calling ``qlinear::linear`` on each weight set (buffers in the format's order) of a ``format`` layer
    with ``backend`` ("" = dispatched) and held ``layout``."""
    from qlinear.ops import linear

    cfg_json = cfg.to_json()
    return [lambda s=s: linear(x, s, None, format, cfg_json, N, K, backend, layout) for s in sets]


def codebook_sets(N: int, K: int, bits: int, books: int, g: int, n: int) -> list[tuple]:
    """``n`` random valid canonical codebook layers on the GPU, each ``(codes, book_idx or None, scales, codebooks)`` (the
    ops' argument order; values do not change the timing)."""
    G, lb = K // g, (books - 1).bit_length()
    i32 = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, device="cuda")
    return [(i32(N, K * bits // 32), i32(N, -(-G * lb // 32)) if books > 1 else None,
             torch.rand(N, G, device="cuda").half(), torch.randint(-128, 128, (books, 2 ** bits), dtype=torch.int8,
                                                                     device="cuda")) for _ in range(n)]


def mixed_bytes(M: int, N: int, K: int, cfg) -> int:
    """Bytes the mixed GEMV reads and writes: every stored byte of the repacked layer, fp16 x and y."""
    from qlinear.backends import async_dequant

    return round(async_dequant.layout_bits(cfg, N, K)[1] * N * K / 8) + 2 * M * K + 2 * M * N


@functools.lru_cache(maxsize=None)
def mixed_pool(N: int, K: int, outlier_ratio: float):
    """``(cfg, canonical buffers, [repacked buffers, ...])``: one random valid mixed layer at the format defaults,
    its repacked form cloned into a pool larger than L2 (values do not change the timing)."""
    from qlinear.backends import async_dequant
    from qlinear.formats import mixed

    cfg = mixed.Config(outlier_ratio=outlier_ratio)
    canon = async_dequant.random_buffers(N, K, cfg, seed=N + K, device="cuda")
    bufs = async_dequant.repack(canon, cfg, N, K)
    n = pool_size(mixed_bytes(8, N, K, cfg))
    return cfg, canon, [{k: v.clone() for k, v in bufs.items()} for _ in range(n)]
