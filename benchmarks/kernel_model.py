"""Performance models of the LUT GEMV and the mixed GEMV (issue 23) and the QUICK GEMM (issue 24): predict their H100
time for a shape, batch and launch plan, no GPU.

    python benchmarks/kernel_model.py [--results benchmarks/results/h100-2026-11-23-bench_gemv.md]
    python benchmarks/kernel_model.py --quick --shapes 8192x8192 --batches 1,16,32,64,128   # the QUICK GEMM
    python benchmarks/kernel_model.py --mixed --shapes 8192x8192 --batches 1,8              # the mixed GEMV
    python benchmarks/kernel_model.py --uniform8 --shapes 8192x8192 --batches 16,32,64,128  # the 8-bit GEMM

The model reads four things and fits a few machine constants:

(a) bytes moved, exact from the layout: plane words, fp16 α, offsets, x, y, split-K partials (written and read);
(b) from the kernel's SASS (``nvcc -cubin`` + ``cuobjdump -sass``, so it runs on a CPU machine): the registers of
    each instantiation, the bytes of global loads a thread issues per iteration of its lookup loop (the innermost
    loop with shared-memory loads, nested loops excluded) before it consumes them, and whether that loop is
    software-pipelined (a global load issued after the loop's first lookup, i.e. for a later iteration);
(c) residency per SM from the registers, the shared memory of the launch plan and the block size (H100 limits);
(d) machine constants fitted on half of the committed H100 rows: ``t0`` (launch and tail, µs), ``t_red`` (the
    split-K reduction kernel),
    ``L`` (loaded DRAM round trip), ``L_tab`` (a K tile's table phase: x from L2, the barriers) and ``c_tab`` (per table a warp builds), ``c_lds`` (µs per warp-wide table lookup on one SM, bank
    conflicts included) and ``BW`` (TB/s), each with a weak log-space prior around its physical value.

Per block the kernel walks ``tiles_per_split`` K tiles of ``W`` words; per word each resident warp issues
``16·Q·M`` lookups, which the SM's shared memory serves one warp after another (``step = warps/SM · 16QM · c_lds``),
and a tile's tables cost ``tab = L_tab + ceil(4·M·W / warps per block) · c_tab``.  Not pipelined (the 2026-11-23
kernel), every loop iteration waits a round trip first::

    chain = tiles · tab + iterations · (L + step)       one iteration per word

Pipelined (the 2026-11-25 kernel: the next tile's words are loaded while this tile is looked up)::

    chain = L + tiles · max(tab + W · step, L)          one iteration per tile

The blocks run in ``waves`` full waves of ``SMs × residency`` blocks (``warps_sm`` warps per SM) and, when the grid
does not divide, a tail wave of the rest (``tail_warps_sm`` warps per SM: fewer, so its lookups queue less), and
``t = t0 + t_red·[splits > 1] + max(waves · chain + chain_tail, bytes / BW)``.  (Until 2026-11-26 the model took
``max(1, blocks / slots)`` waves: a tail of 16 blocks cost 6 % of a chain; on an H200 it cost about 20 %.)  :func:`check` fits the constants on every
other measured row (sorted by shape, M, bits), predicts the rest and reports the median and worst ratio; the model
is useful when the held-out median error is within ±30 % and no row is off by more than 2x
(``tests/test_kernel_model.py`` keeps that true).  Predictions for a kernel that never ran are predictions, not
measurements: RESULTS.md marks them so.

The QUICK GEMM's model (:func:`quick_predict`) has the same shape: per 64-input K tile every resident warp converts
its codes and issues its MMAs (``c_cvt``, ``c_mma`` per m16 tile), and waits ``L`` for the tile's codes and scales
unless the register ring keeps ``depth`` tiles in flight; fitted on the 2-bit rows of the H100 dispatch table
(``backends/dispatch/nvidia-h100-80gb-hbm3.json``: 4 shapes, M = 1..512), checked on its 4-bit rows.  For the
register-ring kernel it also reads the main loop's instructions per K tile from the SASS and bounds the time by the
SM's instruction issue and by its HMMA rate (one constant each, read off one row of the kernel's first H200 run), and
is checked on the other rows of that run.

The mixed GEMV's model (:func:`mixed_predict`) is issue-bound: ``t = t0 + t_red·[splits > 1] + max(warp-tiles of the
busiest SM × instructions per tile / rate, bytes / BW)``.  Its instructions per tile are static SASS counts of the
main loop, built once with every word 2-bit and once with every word 4-bit (:func:`mixed_sass`), mixed in the
proportion of the format's defaults; ``rate`` (warp instructions per ns and SM) is fitted with ``t0``, ``t_red`` and
``BW`` on half of the 2026-11-23 H100 rows, checked on the other half and, with nothing refitted but the H200's
bandwidth, on H200 rows: of the fitted kernel's source (12432ac) and of two later kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "h100-2026-11-23-bench_gemv.md"
MEASURED_COMMIT = "30bf025"  # the kernel source the 2026-11-23 H100 rows were measured with
LUT_SOURCE = "backends/cuda_lut/bcq_lut_gemv.cu"
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v")
# The SASS features of MEASURED_COMMIT's kernel per nvcc build (--save-measured-sass): that source never changes, so
# they are data; an nvcc without an entry compiles it (~90 s on 2 cores)
MEASURED_SASS = ROOT / "benchmarks" / "results" / f"lut-sass-{MEASURED_COMMIT}.json"

# H100 SXM (sm_90) residency limits
SMS, REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED, THREADS_PER_SM, BLOCKS_PER_SM = 132, 65536, 233472, 1024, 2048, 32

CONSTANTS = ("t0", "t_red", "L", "L_tab", "c_tab", "c_lds", "BW")
UNITS = {"t0": "µs", "t_red": "µs", "L": "µs", "L_tab": "µs", "c_tab": "µs per table per warp",
         "c_lds": "µs per warp lookup per SM", "BW": "TB/s"}
# Physical starting points and log-space prior widths: launch + tail of a replayed graph node, one more node, a loaded
# HBM round trip, an L2 round trip plus two barriers, ~70 dependent instructions, 3.15 wavefronts at 1.755 GHz, and
# the ~2.9 TB/s cuBLAS fp16 reads its weights at in the same run.  The priors keep the fit physical where the rows
# cannot tell two constants apart (small layers: launch vs table phase).
PRIOR = {"t0": (3.0, 0.5), "t_red": (2.0, 0.5), "L": (0.8, 0.5), "L_tab": (0.8, 0.7), "c_tab": (0.1, 1.0),
         "c_lds": (1.8e-3, 0.7), "BW": (2.9, 0.1)}


# --- SASS ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sass:
    """What the model reads from one kernel instantiation's SASS."""

    regs: int          # registers per thread (ptxas)
    loop_bytes: int    # global-load bytes per iteration of the lookup loop, nested loops excluded
    pipelined: bool    # that loop issues a global load after its first shared-memory load


def cuobjdump() -> Optional[str]:
    """Path of cuobjdump (on PATH or from the ``nvidia-cuda-cuobjdump`` wheel) where the nvdisasm it runs for ``-sass``
    is beside it or on PATH (the ``nvidia-cuda-nvdisasm`` wheel; CUDA 13.5's cuobjdump fails without it), or None."""
    import site

    found = [shutil.which("cuobjdump")] + [str(hit) for base in [*site.getsitepackages(), site.getusersitepackages()]
                                           for hit in sorted(Path(base).glob("nvidia/cu*/bin/cuobjdump"))]
    for path in filter(None, found):
        if (Path(path).parent / "nvdisasm").exists() or shutil.which("nvdisasm"):
            return path
    return None


def nvcc() -> Optional[str]:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = Path(home) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(found) if found.exists() else None)


_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _load_bytes(op: str) -> int:
    """Bytes of one LDG instruction from its modifiers (``LDG.E.128.CONSTANT`` -> 16; no width -> 4)."""
    return next((_WIDTH[m] for m in op.split(".")[1:] if m in _WIDTH), 4)


def parse_sass(text: str) -> dict[str, list[tuple[int, str]]]:
    """``cuobjdump -sass`` text -> {function name: [(address, instruction), ...]}."""
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def loop_bodies(instrs: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Each loop's own instructions ``[(address, instruction), ...]``: a backward branch closes a loop, and the
    instructions of loops nested in it are left out."""
    loops = [(int(m.group(1), 16), a) for a, i in instrs
             if (m := re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", i)) and int(m.group(1), 16) < a]

    def own(lo, hi):
        nested = [lp for lp in loops if lo <= lp[0] and lp[1] <= hi and lp != (lo, hi)]
        return [(a, i) for a, i in instrs if lo <= a <= hi and not any(n0 <= a <= n1 for n0, n1 in nested)]

    return [own(lo, hi) for lo, hi in loops]


def lookup_loop(instrs: list[tuple[int, str]]) -> tuple[int, bool]:
    """``(loop_bytes, pipelined)`` of the lookup loop (see :class:`Sass`): among the loops whose own instructions
    (nested loops excluded) hold both global and shared-memory loads, the one with the most shared-memory loads (a
    rotated layer's input transform has small loops of both kinds); (0, False) if there is none."""
    bodies = [[(a, i.split()[1] if i.startswith("@") else i.split()[0]) for a, i in body]
              for body in loop_bodies(instrs)]
    found = [ops for ops in bodies
             if any(op.startswith("LDG") for _, op in ops) and any(op.startswith("LDS") for _, op in ops)]
    if not found:
        return 0, False
    ops = max(found, key=lambda ops: sum(op.startswith("LDS") for _, op in ops))
    loads = [(a, op) for a, op in ops if op.startswith("LDG")]
    first_lds = min(a for a, op in ops if op.startswith("LDS"))
    return sum(_load_bytes(op) for _, op in loads), any(a > first_lds for a, _ in loads)


def nvcc_version() -> str:
    """nvcc's build line (``Build cuda_13.0.r13.0/compiler.36424714_0``): the key of :data:`MEASURED_SASS`."""
    return subprocess.run([nvcc(), "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[-2]


def compile_cubin(cu: Path, work: Path) -> tuple[Path, str]:
    """``nvcc -cubin`` of ``cu`` for sm_90a with ``-Xptxas -v`` into ``work``: (the cubin, nvcc's output)."""
    work.mkdir(parents=True, exist_ok=True)
    cubin = work / (cu.stem + ".cubin")
    r = subprocess.run([nvcc(), *NVCC_FLAGS, str(cu), "-o", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed on {cu}:\n{r.stderr[-2000:]}")
    return cubin, r.stdout + r.stderr


def ptxas_registers(log: str) -> dict[str, int]:
    """``nvcc -Xptxas -v`` output -> {mangled kernel name: registers per thread}."""
    regs, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        name = m.group(1) if m else name
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            regs[name] = int(m.group(1))
    return regs


def built_sass(source: Path, work: Path, build: Callable[[Path], tuple[Path, str]] = None
               ) -> tuple[dict[str, int], dict[str, list[tuple[int, str]]]]:
    """``(registers, SASS)`` of every kernel of ``source``, by mangled name: ptxas's registers and
    :func:`parse_sass`'s instructions, built by ``build`` (source -> (cubin, nvcc output); :func:`compile_cubin` into
    ``work`` by default)."""
    cubin, log = (build or (lambda cu: compile_cubin(cu, work)))(source)
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return ptxas_registers(log), parse_sass(sass)


def lut_sass(source_root: Path, work: Path, build: Callable[[Path], tuple[Path, str]] = None
             ) -> dict[tuple[int, int], Sass]:
    """SASS features of every fp16 ``lut_gemv_kernel`` instantiation built from ``source_root`` (a tree holding
    backends/), keyed by (M, Q).  ``build`` (source -> (cubin, nvcc output), :func:`compile_cubin` into ``work`` by
    default) lets a caller share one build; needs nvcc and cuobjdump."""
    regs, kernels = built_sass(source_root / LUT_SOURCE, work, build)
    out = {}
    for fname, instrs in kernels.items():
        m = re.search(r"lut_gemv_kernelI6__halfLi(\d)ELi(\d)E", fname)
        if m:
            out[int(m.group(1)), int(m.group(2))] = Sass(regs[fname], *lookup_loop(instrs))
    return out


def checkout(commit: str, dst: Path, kernel_dir: str = "backends/cuda_lut") -> Path:
    """``kernel_dir`` and backends/_cuda of ``commit`` extracted under ``dst`` (git archive), returned as the source
    root."""
    dst.mkdir(parents=True, exist_ok=True)
    tar = dst / "src.tar"
    with tar.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", commit, kernel_dir, "backends/_cuda"], stdout=f, check=True)
    with tarfile.open(tar) as t:
        t.extractall(dst, filter="data")
    return dst


# --- the kernel versions ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Version:
    """A LUT GEMV build: its launch plan, shared memory per block, K words per lookup-loop iteration, SASS."""

    name: str
    plan: Callable[[int, int, int, int, int], tuple[int, int, int, int]]
    smem: Callable[[int, int], int]
    words_per_iteration: Callable[[int, int], int]  # of (M, Q), given kt
    sass: dict


def plan_2026_11_23(M: int, N: int, K: int, sms: int, bits: int) -> tuple[int, int, int, int]:
    """The launch plan the 2026-11-23 measurements ran (``cuda_lut.plan`` at commit 30bf025)."""
    kt = max(32, 256 // M // 32 * 32)
    tiles = math.ceil(K / kt)
    threads = next((t for t in (256, 128, 64) if math.ceil(N / (4 * t)) * tiles >= sms), 32)
    threads = min(threads, 32 * math.ceil(N / 128))
    blocks_n = math.ceil(N / (4 * threads))
    per_split = math.ceil(tiles / min(tiles, math.ceil(2 * sms / blocks_n)))
    return kt, threads, per_split, math.ceil(tiles / per_split)


def _sass_json(sass: dict) -> dict:
    return {f"{M},{Q}": [f.regs, f.loop_bytes, f.pipelined] for (M, Q), f in sorted(sass.items())}


def measured_sass(work: Path) -> dict[tuple[int, int], Sass]:
    """The SASS features of the 2026-11-23 kernel: :data:`MEASURED_SASS`'s entry for this nvcc, else compiled from
    MEASURED_COMMIT (git history)."""
    saved = json.loads(MEASURED_SASS.read_text()) if MEASURED_SASS.exists() else {}
    entry = saved.get(nvcc_version())
    if entry is None:
        src = checkout(MEASURED_COMMIT, work / "measured")
        return lut_sass(src, src)
    return {tuple(map(int, k.split(","))): Sass(*v) for k, v in entry.items()}


def measured_version(work: Path) -> Version:
    """The kernel of the 2026-11-23 H100 rows: one word per loop iteration, tables ``4·M·(32·kt + kt/32 + kt)`` B."""
    return Version("2026-11-23", plan_2026_11_23, lambda M, kt: 4 * M * (kt // 8 * 256 + kt // 32 + kt),
                   lambda M, kt: 1, measured_sass(work))


def current_version(work: Path, build: Callable[[Path], tuple[Path, str]] = None) -> Version:
    """This checkout's kernel: one tile per loop iteration, two table buffers (``build``: see :func:`lut_sass`)."""
    from qlinear.backends import cuda_lut

    return Version("current", cuda_lut.plan, lambda M, kt: 2 * 4 * M * (kt // 8) * 256, lambda M, kt: kt // 32,
                   lut_sass(ROOT, work / "current", build))


# --- the model ----------------------------------------------------------------------------------------------------
def lut_bytes(M: int, N: int, K: int, q: int, g: int, splits: int, offset_bytes: int = 2) -> int:
    """Bytes the LUT GEMV moves: bench_gemv's count (planes, α, offsets, x, y) plus split-K partials written and
    read back as fp32."""
    G = math.ceil(K / g)
    partials = 2 * 4 * splits * M * N if splits > 1 else 0
    return q * N * K // 8 + 2 * q * N * G + offset_bytes * N * G + 2 * M * K + 2 * M * N + partials


def residency(threads: int, regs: int, smem: int) -> int:
    """Blocks per SM an H100 holds for a block of ``threads`` threads, ``regs`` registers each and ``smem`` bytes."""
    warp_regs = math.ceil(regs * 32 / 256) * 256  # registers are allocated per warp in units of 256
    by_regs = REGS_PER_SM // (warp_regs * (threads // 32))
    return max(1, min(by_regs, SMEM_PER_SM // (smem + SMEM_RESERVED), THREADS_PER_SM // threads, BLOCKS_PER_SM))


def features(v: Version, M: int, N: int, K: int, q: int, g: int) -> dict:
    """Everything the time formula needs for one (version, shape, M, bits, group) at its plan."""
    kt, threads, per_split, splits = v.plan(M, N, K, SMS, q)
    s = v.sass[M, q]
    blocks = math.ceil(N / (4 * threads)) * splits
    bps = residency(threads, s.regs, v.smem(M, kt))
    waves, tail = divmod(blocks, SMS * bps)
    return dict(W=kt // 32, tiles=per_split, tables_per_warp=math.ceil(4 * M * (kt // 32) / (threads // 32)),
                splits=splits, waves=waves, warps_sm=bps * threads // 32,
                tail_warps_sm=math.ceil(tail / SMS) * threads // 32, lookups=16 * q * M,
                bytes=lut_bytes(M, N, K, q, g, splits), pipelined=s.pipelined,
                iterations=per_split * kt // 32 // v.words_per_iteration(M, kt))


def predict(f: dict, c: dict) -> float:
    """Model time in µs for features ``f`` and constants ``c`` (see the module docstring)."""
    tab = c["L_tab"] + f["tables_per_warp"] * c["c_tab"]

    def chain(warps_sm: int) -> float:
        if not warps_sm:
            return 0.0
        step = warps_sm * f["lookups"] * c["c_lds"]
        if f["pipelined"]:
            return c["L"] + f["tiles"] * max(tab + f["W"] * step, c["L"])
        return f["tiles"] * tab + f["iterations"] * (c["L"] + step)

    work = f["waves"] * chain(f["warps_sm"]) + chain(f["tail_warps_sm"])
    return c["t0"] + reduction(f, c) + max(work, f["bytes"] / c["BW"] / 1e6)


def reduction(f: dict, c: dict) -> float:
    """``t_red`` where a split launch ends with the separate reduction kernel."""
    return c["t_red"] if f["splits"] > 1 else 0.0


def read_rows(path: Path = RESULTS) -> list[tuple[int, int, int, int, int, float]]:
    """``(N, K, M, q, group, µs)`` of every ``cuda_lut`` row of a bench_gemv markdown table."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 4 and cells[0] == "cuda_lut":
            m = re.match(r"bcq q(\d) g(\d+|K)", cells[1])
            N, K = map(int, cells[2].split("x"))
            rows.append((N, K, int(cells[3]), int(m.group(1)), K if m.group(2) == "K" else int(m.group(2)),
                         float(cells[4])))
    return sorted(rows)


def fit(samples: list[tuple[dict, float]], model: Callable[[dict, dict], float] = None, prior: dict = None) -> dict:
    """Constants minimising the squared log error over ``samples`` of (features, measured µs) plus the log-space
    priors (Nelder-Mead from the priors' centres, restarted where it stalls on the max() kinks).  ``model`` and
    ``prior``: the LUT GEMV's :func:`predict` and :data:`PRIOR` by default, :func:`quick_predict` and
    :data:`QUICK_PRIOR` for the QUICK GEMM."""
    from scipy.optimize import minimize

    model, prior = model or predict, prior or PRIOR
    names = list(prior)

    def loss(logc):
        c = {k: math.exp(min(max(v, -30.0), 30.0)) for k, v in zip(names, logc)}
        err = sum((math.log(model(f, c)) - math.log(t)) ** 2 for f, t in samples)
        return err + sum(((v - math.log(prior[k][0])) / prior[k][1]) ** 2 for k, v in zip(names, logc)) / 10

    x = [math.log(prior[k][0]) for k in names]
    for _ in range(4):
        x = minimize(loss, x, method="Nelder-Mead", options=dict(maxiter=6000, xatol=1e-4, fatol=1e-9)).x
    return {k: math.exp(min(max(v, -30.0), 30.0)) for k, v in zip(names, x)}


@dataclass
class Check:
    constants: dict
    held_out: list  # (N, K, M, q, g, measured µs, predicted µs)

    @property
    def ratios(self) -> list[float]:
        return [p / t for *_, t, p in self.held_out]

    @property
    def median_error(self) -> float:
        r = sorted(abs(x - 1) for x in self.ratios)
        return r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2

    @property
    def worst_factor(self) -> float:
        return max(max(x, 1 / x) for x in self.ratios)


def check(measured: Version, rows=None) -> Check:
    """Fit on the even rows (sorted by shape, M, bits, group), predict the odd ones."""
    rows = rows or read_rows()
    samples = [(features(measured, M, N, K, q, g), t) for N, K, M, q, g, t in rows]
    c = fit(samples[0::2])
    held = [(*r[:5], r[5], predict(f, c)) for r, (f, _) in zip(rows[1::2], samples[1::2])]
    return Check(c, held)


# --- the QUICK GEMM (issue 24) -------------------------------------------------------------------------------------
# Its H100 rows: the dispatch table tune_dispatch.py measured on 2026-11-23 (4 shapes, 2 and 4 bits, M = 1..512)
QUICK_TABLE = ROOT / "backends" / "dispatch" / "nvidia-h100-80gb-hbm3.json"
# ptxas -v registers of the measured kernel by tile_m (RESULTS.md, "QUICK GEMM (quick) and the dispatch table")
QUICK_REGS_2026_11_23 = {16: 72, 32: 96, 64: 128, 128: 128}
# t0, t_red: as the LUT GEMV's; L: a K tile's wait for its codes and scales (two dependent DRAM round trips in the
# measured kernel); c_cvt, c_mma: µs per warp per K tile on one SM for the code conversion and per m16 tile of MMAs
QUICK_PRIOR = {"t0": (3.0, 0.5), "t_red": (2.0, 0.5), "L": (1.5, 0.7), "c_cvt": (0.02, 1.5), "c_mma": (0.02, 1.5),
               "BW": (2.9, 0.1)}


def quick_plan_2026_11_23(M: int, N: int, K: int, sms: int) -> tuple[int, int, int]:
    """The launch plan the 2026-11-23 H100 rows ran (``quick.plan`` at commit 30bf025)."""
    tile_m = next(t for t in (16, 32, 64, 128) if M <= t or t == 128)
    blocks = math.ceil(N / 128) * math.ceil(M / tile_m)
    tiles = K // 64
    cap = max(1, int(0.15 * N * K / 2 / (8 * M * N)))
    per_split = math.ceil(tiles / max(1, min(math.ceil(2 * sms / blocks), tiles // 2, cap)))
    return tile_m, per_split, math.ceil(tiles / per_split)


def quick_features(M: int, N: int, K: int, q: int, g: int, plan=quick_plan_2026_11_23, regs=None,
                   depth=lambda tile_m: 1, ins: float = 0.0) -> dict:
    """Everything :func:`quick_predict` needs for one shape, M and bits at ``plan``: blocks of 4·WM warps (32 rows of
    Ŵ each along N, WM = 2 at tile_m 128) walking ``tiles`` 64-input K tiles with ``depth(tile_m)`` tiles of codes and
    scales in flight per warp (1 in the measured kernel), x staged in 3 shared-memory stages; ``ins`` instructions per
    warp and tile (0: no issue term, as for the 2026-11-23 kernel, whose SASS the fit does not read)."""
    tile_m, per_split, splits = plan(M, N, K, SMS)
    wm = 2 if tile_m == 128 else 1
    threads = 128 * wm
    blocks = math.ceil(N / 128) * math.ceil(M / tile_m) * splits
    bps = residency(threads, (regs or QUICK_REGS_2026_11_23)[tile_m], 3 * tile_m * 64 * 2)
    waves, tail = divmod(blocks, SMS * bps)
    G = math.ceil(K / g)
    nbytes = q * N * K // 8 + 2 * N * G + q * N * G // 8 + 2 * M * K + 2 * M * N + (8 * splits * M * N if splits > 1
                                                                                   else 0)
    return dict(tiles=per_split, mt=tile_m // 16 // wm, splits=splits, waves=waves, warps_sm=bps * threads // 32,
                tail_warps_sm=math.ceil(tail / SMS) * threads // 32, bytes=nbytes, depth=depth(tile_m), ins=ins)


def quick_predict(f: dict, c: dict) -> float:
    """QUICK GEMM time in µs: per K tile every resident warp of an SM converts its codes and issues its MMAs one after
    another (``step = warps/SM · (c_cvt + MT·c_mma)``); with one tile in flight (``depth`` 1) each tile also waits
    ``L``, with ``depth`` D tiles in flight the wait overlaps D tiles::

        chain = tiles · (L + step)                 depth 1
        chain = L + tiles · max(L / D, step)       depth D > 1

    ``t = t0 + t_red·[splits > 1] + max(waves · chain + chain_tail, issue, bytes / BW)``, as the LUT GEMV's, with
    ``issue = (waves · warps/SM + tail warps/SM) · tiles · ins / QUICK_ISSUE_PER_NS``: the SM's instruction issue,
    which bounds the register-ring kernel at small M (ncu, 2026-11-27), and ``mma``, the same warp tiles' 16·MT
    HMMAs shared by 4 sub-partitions at :data:`QUICK_HMMA_CYCLES` each, which bounds it from M = 64; the latency
    terms, fitted on a kernel that waited on every tile, see neither (both are 0 without ``ins``)."""
    def chain(warps_sm: int) -> float:
        if not warps_sm:
            return 0.0
        step = warps_sm * (c["c_cvt"] + f["mt"] * c["c_mma"])
        if f["depth"] == 1:
            return f["tiles"] * (c["L"] + step)
        return c["L"] + f["tiles"] * max(c["L"] / f["depth"], step)

    work = f["waves"] * chain(f["warps_sm"]) + chain(f["tail_warps_sm"])
    warp_tiles = (f["waves"] * f["warps_sm"] + f["tail_warps_sm"]) * f["tiles"]  # per SM, in the order they run
    issue = warp_tiles * f.get("ins", 0.0) / QUICK_ISSUE_PER_NS / 1e3
    mma = warp_tiles * f["mt"] * 16 / 4 * QUICK_HMMA_CYCLES / CLOCK_GHZ / 1e3 if f.get("ins") else 0.0
    return c["t0"] + reduction(f, c) + max(work, issue, mma, f["bytes"] / c["BW"] / 1e6)


def quick_rows(path: Path = QUICK_TABLE) -> list[tuple[int, int, int, int, int, float]]:
    """``(N, K, M, q, group, µs)`` of every ``quick`` time in a dispatch table (tune_dispatch.py)."""
    rows = []
    for e in json.loads(path.read_text())["entries"]:
        for M, t in e["us"].get("quick", {}).items():
            rows.append((e["N"], e["K"], int(M), e["bits"], e["group_size"], t))
    return sorted(rows)


QUICK_SOURCE = "backends/quick/quick_gemm.cu"
# Warp instructions an SM issues per ns while the QUICK GEMM is bound by issue: 4 schedulers × 0.61 issued per cycle
# (ncu, H200, 2026-11-27: 8192², 4-bit, M = 1, the register-ring kernel) × 1.98 GHz (the H100's and H200's boost clock)
QUICK_ISSUE_PER_NS = 4 * 0.61 * 1.98
# Cycles of an SM sub-partition per HMMA.16816.F32 (mma.sync m16n8k16, fp32 accumulate) while the GEMM is bound by
# its MMAs: read off one row, the same run's 8192², 4-bit, M = 256 (191 µs: 128 blocks of 8 warps, 1 per SM, each warp
# 128 K tiles × 4 m16 tiles × 16 MMAs), the other rows are predictions
QUICK_HMMA_CYCLES = 22.8
CLOCK_GHZ = 1.98


def quick_depth(tile_m: int, free: bool) -> int:
    """K tiles in the register ring (``kDepth`` in quick_gemm.cu): 4 at tile_m 16/32, 2 at 64/128 and for free α."""
    return 2 if free or tile_m >= 64 else 4


def main_loop(instrs: list[tuple[int, str]], marker: Callable[[str], bool]) -> int:
    """Instructions of a kernel's main loop: the loop with the most instructions of its own (nested loops excluded)
    among those holding an instruction ``marker`` accepts (0 if none)."""
    return max((len(body) for body in loop_bodies(instrs) if any(marker(i) for _, i in body)), default=0)


def main_loop_instructions(instrs: list[tuple[int, str]]) -> int:
    """Instructions of the QUICK GEMM's main loop (its loop with MMAs; the act_order gathers of x, nested and not
    taken without perm, excluded)."""
    return main_loop(instrs, lambda i: "HMMA" in i)


QUICK_STAGED_MAX = 32 * 1024  # kQuickStagedMax in quick_gemm.h


def quick_staged(M: int, K: int, plan: tuple[int, int, int]) -> bool:
    """Whether the launcher stages x whole (``x_source`` in quick_gemm.cu, an unrotated layer without perm): 16-row
    tiles whose rows of the K slice, padded by 8 inputs, take at most :data:`QUICK_STAGED_MAX` bytes of fp16."""
    tile_m, per_split, _ = plan
    return tile_m == 16 and min(16, M) * (min(K, 64 * per_split) + 8) * 2 <= QUICK_STAGED_MAX


def quick_sass(source_root: Path, work: Path, build: Callable[[Path], tuple[Path, str]] = None
               ) -> dict[tuple[int, int, bool, bool], tuple[int, float]]:
    """``(registers, instructions per K tile)`` of every fp16 ``quick_gemm_kernel`` instantiation built from
    ``source_root`` for unrotated layers, keyed by (bits, tile_m, free α, x staged whole): ptxas's registers and the
    main loop's instructions (one iteration walks the ring's tiles) per tile; needs nvcc and cuobjdump."""
    regs, kernels = built_sass(source_root / QUICK_SOURCE, work, build)
    out = {}
    for name, instrs in kernels.items():
        k = re.search(r"quick_gemm_kernelI6__halfLi(\d)ELi(\d)ELi(\d)ELb(\d)E(?:Li(\d)E)?", name)
        if k and k.group(5) != "2":  # kernels before 2026-11-27 have no XSource argument; kStagedRotated is left out
            q, mt, wm, free = map(int, k.groups()[:4])
            tile_m = 16 * mt * wm
            out[q, tile_m, bool(free), k.group(5) == "1"] = (
                regs[name], main_loop_instructions(instrs) / quick_depth(tile_m, bool(free)))
    return out


def quick_current(M: int, N: int, K: int, q: int, g: int, sass: dict, free: bool = False) -> dict:
    """:func:`quick_features` of a register-ring GEMM (this checkout's, or another commit's :func:`quick_sass`): its plan
    (``quick.plan``), registers, ring depth and instructions per tile."""
    from qlinear.backends import quick

    plan = quick.plan(M, N, K, SMS)
    staged = quick_staged(M, K, plan) and (q, 16, free, True) in sass
    regs = {t: sass[q, t, free, staged and t == 16][0] for t in (16, 32, 64, 128)}
    return quick_features(M, N, K, q, g, quick.plan, regs, lambda tm: quick_depth(tm, free),
                          sass[q, plan[0], free, staged][1])


# The register-ring kernel's first GPU rows: bench_gemm --quick on an H200 at commit QUICK_RING_COMMIT
QUICK_RING_ROWS = ROOT / "benchmarks" / "results" / "h200-2026-11-27-bench_gemm-quick.md"
QUICK_RING_COMMIT = "588ebaf"
H200_BW = 4.15  # TB/s, the copy bandwidth measured in that run


def quick_bench_rows(path: Path = QUICK_RING_ROWS) -> list[tuple[int, int, int, int, int, float]]:
    """``(N, K, M, q, group, µs)`` of the uniform ``quick`` rows of a bench_gemm markdown table."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"bcq int(\d) g(\d+)$", cells[1]) if len(cells) > 4 and cells[0] == "quick" else None
        if m:
            N, K = map(int, cells[2].split("x"))
            rows.append((N, K, int(cells[3]), int(m.group(1)), int(m.group(2)), float(cells[4])))
    return sorted(set(rows))


def quick_ring_check(constants: dict, sass: dict, rows=None) -> Check:
    """The fitted constants (H100 latencies, :data:`H200_BW`) with the ``QUICK_RING_COMMIT`` kernel's SASS against its
    H200 rows: nothing here is fitted on them but the issue rate, which ncu read off one of them."""
    c = {**constants, "BW": H200_BW}
    return Check(c, [(N, K, M, q, g, t, quick_predict(quick_current(M, N, K, q, g, sass), c))
                     for N, K, M, q, g, t in rows or quick_bench_rows()])


def quick_check(rows=None) -> Check:
    """The QUICK model fitted on the even rows of :func:`quick_rows` (sorted by shape, M, bits), the odd ones held out."""
    rows = rows or quick_rows()
    samples = [(quick_features(M, N, K, q, g), t) for N, K, M, q, g, t in rows]
    c = fit(samples[0::2], quick_predict, QUICK_PRIOR)
    return Check(c, [(*r[:5], r[5], quick_predict(f, c)) for r, (f, _) in zip(rows[1::2], samples[1::2])])


# --- the 8-bit uniform GEMM (cuda_uniform_gemm, issue 24): QUICK's block and ring over the canonical codes ----------
UNIFORM_SOURCE = "backends/cuda_uniform/uniform.cu"


def uniform_depth(tile_m: int) -> int:
    """Steps in the 8-bit GEMM's register ring (``kGemmDepth`` in uniform.cu): 3 at 16/32 rows of x per warp, else 2."""
    return 3 if tile_m <= 32 else 2


def uniform_gemm_sass(source_root: Path, work: Path, build: Callable[[Path], tuple[Path, str]] = None
                      ) -> dict[tuple[int, bool], tuple[int, float]]:
    """``(registers, instructions per 64-input step)`` of every fp16 ``uniform_gemm_kernel`` instantiation built from
    ``source_root``, keyed by (tile_m, symmetric grid): the main loop (the loop with MMAs) walks the ring's steps."""
    regs, kernels = built_sass(source_root / UNIFORM_SOURCE, work, build)
    out = {}
    for name, instrs in kernels.items():
        k = re.search(r"uniform_gemm_kernelI6__halfLi(\d)ELi(\d)ELb(\d)E", name)
        if k:
            mt, wm, sym = map(int, k.groups())
            tile_m = 16 * mt * wm
            out[tile_m, bool(sym)] = (regs[name], main_loop_instructions(instrs) / uniform_depth(tile_m))
    return out


def uniform_gemm_features(M: int, N: int, K: int, g: int, sass: dict, sym: bool = False) -> dict:
    """:func:`quick_features` of the 8-bit GEMM: ``mma_plan``'s launch, its registers, ring depth and instructions per
    step (``sass``: :func:`uniform_gemm_sass`); bytes: the codes, fp16 scales and byte zero points, x, y, partials."""
    from qlinear.backends._gpu import mma_plan

    tile_m = mma_plan(M, N, K, SMS)[0]
    regs = {t: sass[t, sym][0] for t in (16, 32, 64, 128)}
    return quick_features(M, N, K, 8, g, mma_plan, regs, uniform_depth, sass[tile_m, sym][1])


# --- the mixed 2/4/16 GEMV (issue 23) ------------------------------------------------------------------------------
MIXED_SOURCE = "backends/async_dequant/mixed_gemv.cu"
# Its measured rows (bench_gemv, async scale dequantization, no outliers, the format's defaults) and the commit each
# ran: the H100 rows fit and check the model; the H200 rows (12432ac: the fitted kernel's source, then two later
# kernels) check that it carries over to another card and to kernels it was not fitted on
MIXED_H100 = ("30bf025", RESULTS)
MIXED_H200 = (("12432ac", ROOT / "benchmarks" / "results" / "h200-2026-11-26-bench_gemv.md"),
              ("588ebaf", ROOT / "benchmarks" / "results" / "h200-2026-11-27-bench_gemv.md"),
              ("ac34c79", ROOT / "benchmarks" / "results" / "h200-2026-11-27-run2-bench_gemv.md"))
# Their SASS features per nvcc build (--save-measured-sass), as MEASURED_SASS for the LUT GEMV
MIXED_SASS = ROOT / "benchmarks" / "results" / "mixed-sass.json"
# t0, t_red: as the LUT GEMV's; rate: warp instructions an SM issues per ns in the main loop (prior: QUICK's ncu
# figure); BW as the LUT GEMV's
MIXED_PRIOR = {"t0": (3.0, 0.5), "t_red": (2.0, 0.5), "rate": (QUICK_ISSUE_PER_NS, 0.5), "BW": (2.9, 0.1)}
_IS4 = re.compile(r"(bool entry_is4\(int e\) \{ return )e < 0(; \})")
_GLOBAL_LOAD = re.compile(r"\bLDG[.\s]")  # predicated or not; not LDGSTS


def mixed_sass(source_root: Path, work: Path) -> dict[tuple[int, bool], tuple[int, int, int]]:
    """``(registers, instructions per tile with 2-bit words, with 4-bit words)`` of every fp16, unrotated
    ``mixed_gemv_kernel`` instantiation built from ``source_root``, keyed by (M, async).  A tile walks 4 words whose
    kind (``entry_is4``) is a runtime branch, uniform per block: the source is built twice with ``entry_is4``
    returning false, then true, and each build's main loop (the loop with the most instructions that loads from
    global memory) counted.  Static counts: code the layout never takes (tail tiles, P < 4 pairs, 8-bit scale codes,
    a 4-bit group's second word) is counted too.  Registers are the unpatched build's.  Needs nvcc and cuobjdump."""
    src = source_root / MIXED_SOURCE
    text = src.read_text()
    out: dict = {}
    for variant, body in (("plain", text), ("2bit", _IS4.sub(r"\g<1>false\2", text)),
                          ("4bit", _IS4.sub(r"\g<1>true\2", text))):
        if body == text and variant != "plain":
            raise RuntimeError(f"{src}: no entry_is4 definition to specialise")
        tree = work / variant
        shutil.copytree(source_root / "backends", tree / "backends", dirs_exist_ok=True)
        (tree / MIXED_SOURCE).write_text(body)
        regs, kernels = built_sass(tree / MIXED_SOURCE, tree)
        for name, instrs in kernels.items():
            m = re.search(r"mixed_gemv_kernelI6__halfLi(\d)ELb(\d)E(?:Lb(\d)E)?", name)
            if m and m.group(3) != "1":  # kernels before 2026-11-27 have no ROT parameter
                key = (int(m.group(1)), m.group(2) == "1")
                out.setdefault(key, [0, 0, 0])
                if variant == "plain":
                    out[key][0] = regs[name]
                else:
                    out[key][1 if variant == "2bit" else 2] = main_loop(instrs, _GLOBAL_LOAD.search)
    return {k: tuple(v) for k, v in out.items()}


def mixed_sass_json(sass: dict[tuple[int, bool], tuple[int, int, int]]) -> dict:
    """:func:`mixed_sass` features as :data:`MIXED_SASS` stores them per commit: ``{"M,async": [regs, ins2, ins4]}``."""
    return {f"{M},{int(a)}": list(v) for (M, a), v in sorted(sass.items())}


def mixed_sass_from_json(entry: dict) -> dict[tuple[int, bool], tuple[int, int, int]]:
    """The inverse of :func:`mixed_sass_json`."""
    return {(int(k.split(",")[0]), k.split(",")[1] == "1"): tuple(v) for k, v in entry.items()}


def mixed_measured_sass(commit: str, work: Path) -> dict[tuple[int, bool], tuple[int, int, int]]:
    """:func:`mixed_sass` of ``commit``'s kernel: :data:`MIXED_SASS`'s entry for this nvcc, else compiled from git
    history (raises CalledProcessError where the commit is not in it)."""
    entry = json.loads(MIXED_SASS.read_text()).get(nvcc_version(), {}).get(commit) if MIXED_SASS.exists() else None
    if entry is None:
        src = checkout(commit, work / commit, "backends/async_dequant")
        return mixed_sass(src, src)
    return mixed_sass_from_json(entry)


def mixed_plan_2026_11_23(M: int, N: int, K: int, W: int, sms: int) -> tuple[int, int, int]:
    """The launch plan ``(threads, tiles_per_split, splits)`` of every measured kernel (``async_dequant.plan`` from
    30bf025 to ac34c79): 768 resident threads at M <= 2, 512 above, x staged as fp32."""
    M, T, resident = min(M, 8), -(-W // 4), 768 if M <= 2 else 512
    best = None
    for threads in (256, 128, 64, 32):
        blocks_n = -(-N // (2 * threads))
        cap = min(48 * 1024, 224 * 1024 * threads // resident)
        tps_max = T if M * K * 4 + 16 * T <= cap else max(1, (cap - 16) // (M * 64 * 4 + 16))
        want = max(1, -(-sms * resident // threads // blocks_n))
        splits = max(-(-T // tps_max), min(want, T))
        per = -(-T // splits)
        splits = -(-T // per)
        cost = blocks_n * K * 2 + splits * N * 8 * (splits > 1) + (threads < 64) * N * K // 64
        if best is None or cost < best[0]:
            best = (cost, threads, per, splits)
    return best[1:]


def mixed_words(N: int, K: int) -> tuple[int, float]:
    """``(W, f4)`` of the format's defaults: code words per row (a 2-bit group of g inputs takes g/16 words, a 4-bit
    one g/8) and the fraction of them holding 4-bit codes."""
    from qlinear.formats import mixed

    cfg = mixed.Config()
    G, G4, _ = cfg.counts(N, K)
    W = (G + G4) * cfg.group_size // 16
    return W, 2 * G4 * cfg.group_size / 16 / W


def mixed_smem_2026_11_23(M: int, K: int, tiles_per_split: int) -> int:
    """Shared memory of a block of the measured kernels: x of its span in fp32 and its word table."""
    return M * min(K, 64 * tiles_per_split) * 4 + 16 * tiles_per_split


def mixed_features(M: int, N: int, K: int, nbytes: float, sass: dict, plan=mixed_plan_2026_11_23,
                   smem=mixed_smem_2026_11_23, async_dequant: bool = True) -> dict:
    """What :func:`mixed_predict` needs for the defaults' layer ``[N, K]`` at batch ``M`` (1..8: one launch):
    ``bytes`` (``nbytes``, the layout's, x's and y's: bench_gemv's count) plus the fp32 split partials, and
    ``warp_tiles``, the tiles (4 code words of a warp's 64 rows) the busiest SM walks: its full waves of resident
    blocks, then its share of the tail, at ``ins`` instructions per tile (the executed mix of 2- and 4-bit words).
    ``sass``: :func:`mixed_sass` of the kernel; ``plan`` ``(M, N, K, W, SMs) -> (threads, tiles/split, splits)`` and
    ``smem`` ``(M, K, tiles/split) -> bytes per block``: the kernel's launch.

    Raises:
        ValueError: M outside 1..8 (a larger batch runs ceil(M / 8) launches).
    """
    if not 1 <= M <= 8:
        raise ValueError(f"the mixed GEMV runs batches of 1..8 per launch, got M = {M}")
    W, f4 = mixed_words(N, K)
    threads, per, splits = plan(M, N, K, W, SMS)
    regs, ins2, ins4 = sass[M, async_dequant]
    blocks = math.ceil(N / (2 * threads)) * splits
    bps = residency(threads, regs, smem(M, K, per))
    waves, tail = divmod(blocks, SMS * bps)
    warp_tiles = (waves * bps + math.ceil(tail / SMS)) * threads // 32 * per
    return dict(splits=splits, warp_tiles=warp_tiles, ins=(1 - f4) * ins2 + f4 * ins4,
                bytes=nbytes + (8 * splits * M * N if splits > 1 else 0))


def mixed_predict(f: dict, c: dict) -> float:
    """Mixed GEMV time in µs: ``t0 + t_red·[splits > 1] + max(warp_tiles · ins / rate, bytes / BW)``: each SM issues
    its warp-tiles' instructions at ``rate`` (latency hidden by the tile loaded one ahead and 12-24 resident warps),
    or the weights stream at ``BW``, whichever takes longer."""
    return c["t0"] + reduction(f, c) + max(f["warp_tiles"] * f["ins"] / c["rate"] / 1e3, f["bytes"] / c["BW"] / 1e6)


def mixed_rows(path: Path, mode: str = "async") -> list[tuple[int, int, int, float, float]]:
    """``(N, K, M, µs, bytes)`` of the outlier-free mixed rows of a bench_gemv markdown table with ``mode``
    ("async" or "sync") scale dequantization (bytes = its TB/s × µs)."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 5 and cells[0] == "async_dequant" and cells[1] == f"mixed o0 {mode} (0 outliers)":
            N, K = map(int, cells[2].split("x"))
            t = float(cells[4])
            rows.append((N, K, int(cells[3]), t, float(cells[5]) * t * 1e6))
    return sorted(rows)


def mixed_check(sass: dict, rows=None) -> Check:
    """The mixed model fitted on the even H100 rows of :data:`MIXED_H100` (sorted by shape and M), the odd ones held
    out; ``sass``: that kernel's :func:`mixed_sass`."""
    rows = rows or mixed_rows(MIXED_H100[1])
    samples = [(mixed_features(M, N, K, b, sass), t) for N, K, M, t, b in rows]
    c = fit(samples[0::2], mixed_predict, MIXED_PRIOR)
    return Check(c, [(N, K, M, 0, 16, t, mixed_predict(f, c))
                     for (N, K, M, t, _), (f, _) in zip(rows[1::2], samples[1::2])])


def mixed_h200_check(constants: dict, sass_by_commit: dict) -> Check:
    """The H100 fit with the H200's copy bandwidth (:data:`H200_BW`) against the H200 rows of :data:`MIXED_H200`,
    each with its own kernel's SASS: nothing is fitted on them."""
    c = {**constants, "BW": H200_BW}
    return Check(c, [(N, K, M, 0, 16, t, mixed_predict(mixed_features(M, N, K, b, sass_by_commit[commit]), c))
                     for commit, path in MIXED_H200 for N, K, M, t, b in mixed_rows(path)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--shapes", default="8192x8192,12288x12288,28672x8192,576x576,1536x576")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--bw", type=float, help="DRAM bandwidth (TB/s) replacing the fitted one, to predict another card "
                    "with the H100's latencies (H200: its bandwidth ratio to the H100 times the fitted value)")
    ap.add_argument("--save-measured-sass", action="store_true", help=f"compile {MEASURED_COMMIT}'s LUT GEMV and the "
                    f"measured mixed GEMVs with this nvcc and add their SASS features to "
                    f"{MEASURED_SASS.relative_to(ROOT)} and {MIXED_SASS.relative_to(ROOT)}")
    ap.add_argument("--quick", action="store_true", help="the QUICK GEMM's model instead: its fit on the H100 dispatch "
                    "table's rows and predictions for this checkout's GEMM (needs nvcc for its registers)")
    ap.add_argument("--mixed", action="store_true", help="the mixed GEMV's model instead: its fit on the H100 rows, its "
                    "check on H200 rows of it and two later kernels, predictions for this checkout's kernel")
    ap.add_argument("--uniform8", action="store_true", help="the 8-bit uniform GEMM (cuda_uniform_gemm) on the QUICK "
                    "model's constants: predictions for this checkout's kernel (never measured)")
    args = ap.parse_args()
    if args.quick:
        return quick_main(args)
    if args.uniform8:
        return uniform8_main(args)
    if args.mixed:
        return mixed_main(args)
    if nvcc() is None or cuobjdump() is None:
        sys.exit("needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    sys.path.insert(0, str(ROOT))
    if args.save_measured_sass:
        with tempfile.TemporaryDirectory() as tmp:
            src = checkout(MEASURED_COMMIT, Path(tmp))
            entry = _sass_json(lut_sass(src, src))
        saved = json.loads(MEASURED_SASS.read_text()) if MEASURED_SASS.exists() else {}
        saved[nvcc_version()] = entry
        MEASURED_SASS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in saved.items())
                                 + "\n}\n")
        print(f"{MEASURED_SASS}: {nvcc_version()}: {len(entry)} instantiations")
        with tempfile.TemporaryDirectory() as tmp:
            mixed = {c: mixed_sass(src, src) for c in (MIXED_H100[0], *(c for c, _ in MIXED_H200))
                     for src in [checkout(c, Path(tmp) / c, "backends/async_dequant")]}
        saved = json.loads(MIXED_SASS.read_text()) if MIXED_SASS.exists() else {}
        saved[nvcc_version()] = {c: mixed_sass_json(f) for c, f in mixed.items()}
        MIXED_SASS.write_text(json.dumps(saved, indent=1) + "\n")
        print(f"{MIXED_SASS}: {nvcc_version()}: {len(mixed)} mixed GEMV kernels")
        return
    with tempfile.TemporaryDirectory() as tmp:
        measured, current = measured_version(Path(tmp)), current_version(Path(tmp))
    res = check(measured, read_rows(Path(args.results)))
    print("constants: " + ", ".join(f"{k} = {v:.4g} {UNITS[k]}" for k, v in res.constants.items()))
    print(f"held-out rows: {len(res.held_out)}, median |error| {100 * res.median_error:.1f} %, "
          f"worst {res.worst_factor:.2f}x")
    print("\n| N x K | M | bits | measured µs | predicted µs | ratio |\n|---|---|---|---|---|---|")
    for N, K, M, q, g, t, p in res.held_out:
        print(f"| {N}x{K} | {M} | {q} | {t:.3g} | {p:.3g} | {p / t:.2f} |")
    card = "H100"
    if args.bw:
        res.constants["BW"], card = args.bw, f"H100 latencies, BW = {args.bw} TB/s"
    print(f"\nPredictions for this checkout's kernel (group 128, fp16 offsets), {card}:\n")
    print("| N x K | M | bits | plan (kt, threads, tiles/split, splits) | regs | B/iter | pipelined | predicted µs |"
          " measured 2026-11-23 µs |\n|---|---|---|---|---|---|---|---|---|")
    meas = {(N, K, M, q): t for N, K, M, q, g, t in read_rows(Path(args.results)) if g == 128}
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            for q in (2, 3, 4):
                f = features(current, M, N, K, q, 128)
                s = current.sass[M, q]
                print(f"| {N}x{K} | {M} | {q} | {current.plan(M, N, K, SMS, q)} | {s.regs} | {s.loop_bytes} | "
                      f"{s.pipelined} | {predict(f, res.constants):.3g} | {meas.get((N, K, M, q), float('nan')):.3g} |")


def quick_main(args) -> None:
    """``--quick``: the QUICK model's held-out check, its check against the register-ring kernel's H200 rows, and its
    predictions for this checkout's GEMM (markdown)."""
    if nvcc() is None or cuobjdump() is None:
        sys.exit("needs nvcc and cuobjdump (the registers and instructions of the QUICK GEMM)")
    sys.path.insert(0, str(ROOT))
    res = quick_check()
    print(f"QUICK GEMM, fitted on {len(quick_rows()) - len(res.held_out)} of the H100 dispatch table's rows (2-bit), "
          f"held out the other {len(res.held_out)} (4-bit): median |error| {100 * res.median_error:.1f} %, worst {res.worst_factor:.2f}x")
    print("constants: " + ", ".join(f"{k} = {v:.4g}" for k, v in res.constants.items()))
    with tempfile.TemporaryDirectory() as tmp:
        sass = quick_sass(ROOT, Path(tmp))
        src = checkout(QUICK_RING_COMMIT, Path(tmp) / "ring", "backends/quick")
        ring = quick_sass(src, src)
    chk = quick_ring_check(res.constants, ring)
    print(f"\nAgainst the {len(chk.held_out)} H200 rows of {QUICK_RING_ROWS.name} ({QUICK_RING_COMMIT}'s kernel, "
          f"BW = {H200_BW} TB/s): median |error| {100 * chk.median_error:.1f} %, worst {chk.worst_factor:.2f}x\n"
          "\n| N x K | bits | M | instructions per tile | measured µs | predicted µs |\n|---|---|---|---|---|---|")
    from qlinear.backends import quick

    for N, K, M, q, g, t, p in chk.held_out:
        print(f"| {N}x{K} | {q} | {M} | {ring[q, quick.plan(M, N, K, SMS)[0], False, False][1]:.0f} | {t:.3g} | "
              f"{p:.3g} |")
    meas = {(N, K, M, q): t for N, K, M, q, g, t in quick_bench_rows()}
    card = f"H100 latencies, BW = {args.bw} TB/s" if args.bw else "H100"
    c = {**res.constants, **({"BW": args.bw} if args.bw else {})}
    print(f"\nPredictions for this checkout's GEMM, uniform α, group 128, {card} (the H200 rows of "
          f"{QUICK_RING_COMMIT}'s kernel beside):\n\n| N x K | bits | M | plan (tile_m, tiles/split, splits) | regs | "
          "instructions per tile | predicted µs | measured H200 µs |\n|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for q in (2, 3, 4):
            for M in map(int, args.batches.split(",")):
                plan = quick.plan(M, N, K, SMS)
                regs, ins = sass[q, plan[0], False, quick_staged(M, K, plan)]
                print(f"| {N}x{K} | {q} | {M} | {plan} | {regs} | {ins:.0f} | "
                      f"{quick_predict(quick_current(M, N, K, q, 128, sass), c):.3g} | "
                      f"{meas.get((N, K, M, q), float('nan')):.3g} |")


def uniform8_main(args) -> None:
    """``--uniform8``: predictions for this checkout's 8-bit GEMM with the QUICK model's constants (fitted on the QUICK
    GEMM: a prediction for a kernel no GPU has run), markdown."""
    if nvcc() is None or cuobjdump() is None:
        sys.exit("needs nvcc and cuobjdump (the registers and instructions of the 8-bit GEMM)")
    sys.path.insert(0, str(ROOT))
    from qlinear.backends._gpu import mma_plan

    res = quick_check()
    c = {**res.constants, **({"BW": args.bw} if args.bw else {})}
    with tempfile.TemporaryDirectory() as tmp:
        sass = uniform_gemm_sass(ROOT, Path(tmp))
    card = f"H100 latencies, BW = {c['BW']:.3g} TB/s"
    print(f"Predictions for this checkout's 8-bit GEMM, zero points stored, group 128, {card} (QUICK's constants; "
          "never measured):\n\n| N x K | M | plan (tile_m, tiles/split, splits) | regs | instructions per step | "
          "predicted µs | bytes / BW µs |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            f = uniform_gemm_features(M, N, K, 128, sass)
            plan = mma_plan(M, N, K, SMS)
            regs, ins = sass[plan[0], False]
            print(f"| {N}x{K} | {M} | {plan} | {regs} | {ins:.0f} | {quick_predict(f, c):.3g} | "
                  f"{f['bytes'] / c['BW'] / 1e6:.3g} |")


def mixed_main(args) -> None:
    """``--mixed``: the mixed GEMV model's held-out check on the H100 rows, its check on the H200 rows, what it says of
    sync against async, and its predictions for this checkout's kernel (markdown)."""
    if nvcc() is None or cuobjdump() is None:
        sys.exit("needs nvcc and cuobjdump (the registers and instructions of the mixed GEMV)")
    sys.path.insert(0, str(ROOT))
    from common import mixed_bytes
    from qlinear.backends import async_dequant
    from qlinear.formats import mixed

    with tempfile.TemporaryDirectory() as tmp:
        measured = {c: mixed_measured_sass(c, Path(tmp)) for c in (MIXED_H100[0], *(c for c, _ in MIXED_H200))}
        current = mixed_sass(ROOT, Path(tmp) / "current")
    rows = mixed_rows(MIXED_H100[1])
    res = mixed_check(measured[MIXED_H100[0]], rows)
    print(f"Mixed GEMV, fitted on {len(rows) - len(res.held_out)} of the H100 rows ({MIXED_H100[0]}), held out the "
          f"other {len(res.held_out)}: median |error| {100 * res.median_error:.1f} %, worst {res.worst_factor:.2f}x")
    print("constants: " + ", ".join(f"{k} = {v:.4g}" for k, v in res.constants.items()))
    print("\n| N x K | M | measured µs | predicted µs |\n|---|---|---|---|")
    for N, K, M, _, _, t, p in res.held_out:
        print(f"| {N}x{K} | {M} | {t:.3g} | {p:.3g} |")
    h200 = [(commit, r) for commit, path in MIXED_H200 for r in mixed_rows(path)]
    chk = mixed_h200_check(res.constants, measured)
    print(f"\nAgainst the {len(chk.held_out)} H200 rows of {', '.join(c for c, _ in MIXED_H200)} (BW = {H200_BW} TB/s): "
          f"median |error| {100 * chk.median_error:.1f} %, worst {chk.worst_factor:.2f}x\n"
          "\n| kernel | N x K | M | instructions per tile (2-bit / 4-bit words) | measured µs | predicted µs |"
          "\n|---|---|---|---|---|---|")
    for (commit, _), (N, K, M, _, _, t, p) in zip(h200, chk.held_out):
        _, i2, i4 = measured[commit][M, True]
        print(f"| {commit} | {N}x{K} | {M} | {i2} / {i4} | {t:.3g} | {p:.3g} |")
    # sync: the same fit with the sync kernel's own SASS, against the measured sync/async ratio of each H100 row
    sync = {(N, K, M): t for N, K, M, t, _ in mixed_rows(MIXED_H100[1], "sync")}
    ratios = [(sync[N, K, M] / t, mixed_predict(mixed_features(M, N, K, b, measured[MIXED_H100[0]],
                                                               async_dequant=False), res.constants)
               / mixed_predict(mixed_features(M, N, K, b, measured[MIXED_H100[0]]), res.constants))
              for N, K, M, t, b in rows if (N, K, M) in sync]
    print(f"\nSync against async on the {len(ratios)} H100 rows: measured {min(r for r, _ in ratios):.3f}-"
          f"{max(r for r, _ in ratios):.3f}x, predicted {min(p for _, p in ratios):.3f}-{max(p for _, p in ratios):.3f}x")
    cfg = mixed.Config(outlier_ratio=0.0)
    c = {**res.constants, **({"BW": args.bw} if args.bw else {})}
    card = f"H100 constants, BW = {args.bw} TB/s" if args.bw else "H100"
    print(f"\nPredictions for this checkout's kernel, the format's defaults without outliers, {card}:\n"
          "\n| N x K | M | plan (threads, tiles/split, splits) | regs | instructions per tile (2-bit / 4-bit words) | "
          "predicted µs | sync µs |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            nbytes = mixed_bytes(M, N, K, cfg)
            regs, i2, i4 = current[M, True]
            t = [mixed_predict(mixed_features(M, N, K, nbytes, current, async_dequant.plan, async_dequant._smem, a), c)
                 for a in (True, False)]
            print(f"| {N}x{K} | {M} | {async_dequant.plan(M, N, K, mixed_words(N, K)[0], SMS)} | {regs} | {i2} / {i4} | "
                  f"{t[0]:.3g} | {t[1]:.3g} |")


if __name__ == "__main__":
    main()
