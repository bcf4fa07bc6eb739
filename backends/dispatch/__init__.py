"""Measured kernel choice per GPU: which kernel runs a layer at each batch size, and which layout it holds.

Several kernels can run the same layer (for uniform BCQ on a GPU: the LUT GEMV, the QUICK GEMM and
dequantize + cuBLAS), and which is fastest depends on (bits, group_size, N, K, M) and the GPU.
``benchmarks/tune_dispatch.py`` measures them on a GPU and writes ``<gpu name>.json`` beside this file;
:func:`preferred_backend` and :func:`preferred_layout` read it (``default.json`` for GPUs never measured,
which may have no entries: then the registry's priorities decide).  Because a layer holds one packed
layout (no second copy of its weights), the tuner picks per shape the layout whose kernels are best over
all measured M, and per M the fastest kernel that reads that layout.

File format (JSON)::

    {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-22", "entries": [
        {"format": "bcq", "bits": 4, "group_size": 128, "N": 8192, "K": 8192, "layout": "quick",
         "plan": [[8, "quick"], [256, "quick"], [null, "quick_dequant"]]}, ...]}

(``"uniform": false`` marks an entry measured on free-α BCQ layers; without it an entry is for uniform ones.)

``plan`` is read in order: the first ``[max_batch, backend]`` with ``batch <= max_batch`` (null = any) wins.
A layer's shape is matched to the entry of the same format, bits and group size with the nearest (N, K) in
log scale, within a factor of 2 in both; otherwise the layer has no entry.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

__all__ = ["device_table_path", "table_path", "entries", "lookup", "preferred_backend", "preferred_layout", "plan_from_timings"]

_HERE = Path(__file__).parent


def device_table_path(device_name: str) -> Path:
    """Where the measured table of a GPU model lives: its name lower-cased, non-alphanumerics as ``-``."""
    return _HERE / (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json")


def table_path(device_name: str) -> Path:
    """The table used for a GPU model: its measured one if it exists, else ``default.json``."""
    path = device_table_path(device_name)
    return path if path.is_file() else _HERE / "default.json"


def state() -> tuple:
    """What a dispatch choice depends on besides its arguments: the table folder, the device-name lookup and the tables
    read so far (part of :func:`qlinear.backends.generation`, so cached resolutions follow a reloaded table)."""
    return _HERE, id(_device_name), entries.cache_info().misses


@functools.lru_cache(maxsize=None)
def entries(device_name: str) -> tuple[dict, ...]:
    """Entries of the table for ``device_name`` (empty if there is none).  Raises ValueError for a malformed file."""
    path = table_path(device_name)
    if not path.is_file():
        return ()
    try:
        data = json.loads(path.read_text())
        rows = tuple(data["entries"])
        for e in rows:
            for key in ("format", "bits", "group_size", "N", "K", "plan"):
                if key not in e:
                    raise KeyError(key)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"dispatch table {path} is malformed ({err!r}); re-run benchmarks/tune_dispatch.py") from None
    return rows


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> Optional[str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=4096)
def _lookup(device_name: str, format: str, bits: int, group_size: int, uniform: bool, N: int, K: int
            ) -> Optional[dict]:
    best, dist = None, math.inf
    for e in entries(device_name):
        if (e["format"], e["bits"], e["group_size"], e.get("uniform", True)) != (format, bits, group_size, uniform):
            continue
        dn, dk = abs(math.log2(e["N"] / N)), abs(math.log2(e["K"] / K))
        if dn <= 1 and dk <= 1 and dn + dk < dist:
            best, dist = e, dn + dk
    return best


def lookup(format: str, cfg, device: torch.device, shape: tuple[int, int]) -> Optional[dict]:
    """The measured entry for a ``format`` layer with config ``cfg`` and ``shape`` = (N, K) on ``device``, or None.
    BCQ layers with free α match only entries measured on free α (``"uniform": false``; entries without the key were
    measured on uniform layers)."""
    name = _device_name(device)
    if name is None:
        return None
    from qlinear.formats import bcq

    uniform = format != bcq.NAME or bcq.is_uniform(cfg)
    return _lookup(name, format, getattr(cfg, "bits", 0), getattr(cfg, "group_size", 0), uniform, *shape)


def preferred_backend(format: str, cfg, device: torch.device, shape: tuple[int, int], batch: int) -> Optional[str]:
    """The backend the table names for this layer at ``batch`` rows, or None."""
    e = lookup(format, cfg, device, shape)
    if e is None:
        return None
    return next((b for m, b in e["plan"] if m is None or batch <= m), None)


def preferred_layout(format: str, cfg, device: torch.device, shape: tuple[int, int]) -> Optional[str]:
    """The layout the table says this layer should hold ("" = canonical), or None if it has no entry."""
    e = lookup(format, cfg, device, shape)
    return None if e is None else e.get("layout", "")


def plan_from_timings(timings: dict[str, dict[int, float]], layouts: dict[str, str]
                      ) -> tuple[str, list[list], float]:
    """The layout a layer should hold and its per-batch plan, from measured times.

    Args:
        timings: µs per call, ``{backend: {M: µs}}``; a missing M means the backend cannot run it.
        layouts: the layout each backend reads (``""`` = canonical).

    Returns:
        ``(layout, plan, worst)``: for each layout, the fastest backend reading it at every M; the layout whose
        worst slowdown against the fastest backend of any layout (``worst``, ≥ 1) is smallest wins (ties: the
        smaller total time); ``plan`` merges consecutive M with the same backend, the last open-ended.

    Raises:
        ValueError: no layout has a backend for every measured M.
    """
    Ms = sorted({m for t in timings.values() for m in t})
    best = {m: min(t[m] for t in timings.values() if m in t) for m in Ms}
    options = []
    for layout in sorted(set(layouts.values())):
        choice = {}
        for m in Ms:
            cands = [(t[m], b) for b, t in timings.items() if layouts[b] == layout and m in t]
            if not cands:
                break
            choice[m] = min(cands)
        else:
            worst = max(choice[m][0] / best[m] for m in Ms)
            options.append((worst, sum(v[0] for v in choice.values()), layout, choice))
    if not options:
        raise ValueError("no layout has a kernel for every measured batch size")
    worst, _, layout, choice = min(options)
    plan: list[list] = []
    for m in Ms:
        if plan and plan[-1][1] == choice[m][1]:
            plan[-1][0] = m
        else:
            plan.append([m, choice[m][1]])
    plan[-1][0] = None
    return layout, plan, worst
