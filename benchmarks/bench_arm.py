"""Arm kernels: executed aarch64 instructions per weight (GEMV) / per multiply-accumulate (GEMM) under qemu, and
wall time of the same source on this CPU (SIMDe on x86) against the reference backend.

    python benchmarks/bench_arm.py [--plugin /tmp/arm-insn/libsymcount.so] [--skip-count] [--skip-time] [--rotation]

Instruction counts: the standalone harness (backends/arm_neon/harness.cpp) is cross-compiled statically
(aarch64-linux-gnu-g++ -O3 -march=armv8.2-a+dotprod; the SMMLA file enables i8mm itself) and run under
``qemu-aarch64 -cpu max`` (i8mm: SDOT GEMV, SMMLA GEMM; on the default layout sdot and on layout mmla) and
``-cpu neoverse-n1`` (dotprod only: SDOT by element for both, layout sdot) with the symbol-counting plugin built by
``../shared/tools/arm-insn/build.sh``;
the count is every instruction executed inside the kernels' symbols (decode, dot products, scaling,
loop control; not the activation quantization, done once per call), divided by N·K·reps (M = 1) or
N·K·M·reps (M = 8).  N = K = 4096; BCQ uniform int4 and 8-bit at group 128, codebooks at group 32 (2-bit with
4 codebooks), and three 2-bit variants (group 128; one codebook; both).

``--rotation`` (only this): issue 27's cost of a rotated layer's randomized Hadamard input transform
(backends/_shared/rotation.h, what the binding applies before quantizing x) at M = 1 on ``-cpu max``, layout sdot,
BCQ uniform int4: instructions per call of the transform (the harness's ``rotate_input_counted`` and whatever it
calls, libc's memcpy/memset/malloc included), of the activation quantization (``prepare_acts``) and of the kernel,
each the count at 3 calls minus the count at 1 call, halved (setup excluded).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table, timeit  # noqa: E402

from qlinear import BCQLinear, CodebookLinear  # noqa: E402

ARM = Path(__file__).resolve().parents[1] / "backends" / "arm_neon"
# (harness format, group size, codebooks, label): the three formats, then 2-bit variants that show what
# the per-32-input codebook choice costs.
FORMATS = [("bcq4", 128, 1, "BCQ uniform int4 g128"), ("u8", 128, 1, "BCQ uniform 8-bit g128"),
           ("cb4", 32, 1, "codebook 4-bit g32"),
           ("cb2", 32, 4, "codebook 2-bit g32, 4 books"), ("cb2", 128, 4, "codebook 2-bit g128, 4 books"),
           ("cb2", 32, 1, "codebook 2-bit g32, 1 book"), ("cb2", 128, 1, "codebook 2-bit g128, 1 book")]
# (qemu CPU, layout, GEMV kernel, GEMM kernel)
CPUS = [("max", "sdot", "SDOT by element", "SMMLA"), ("max", "mmla", "SDOT", "SMMLA"),
        ("neoverse-n1", "sdot", "SDOT by element", "SDOT by element")]


# (N, K, group) of --rotation: SmolLM2's and Llama's layer shapes; K = 576 at group 64 (128 does not divide it)
ROTATION_SHAPES = [(576, 576, 64), (1536, 576, 64), (576, 1536, 128), (4096, 4096, 128), (4096, 11008, 128)]
ACT_QUANT = "prepare_acts"
NOT_KERNEL = f"{ACT_QUANT}|reference|weight_at|half_to_float|cpu_path"


def build(work: Path) -> Path:
    exe = work / "harness"
    subprocess.run(["aarch64-linux-gnu-g++", "-std=c++17", "-O3", "-static", "-march=armv8.2-a+dotprod",
                    *(str(ARM / f) for f in ("harness.cpp", "kernels.cpp", "kernels_i8mm.cpp")), "-o", str(exe)],
                   check=True)
    return exe


def symbols(plugin: str, cpu: str, log: Path, args: list[str], top: int = 40) -> dict[str, int]:
    """Executed instructions per symbol of one harness run under qemu (the ``top`` most executed symbols)."""
    subprocess.run(["qemu-aarch64", "-cpu", cpu, "-plugin", f"{plugin},top={top}", "-d", "plugin", "-D", str(log),
                    *args], check=True, capture_output=True)
    return {m.group(2): int(m.group(1)) for m in re.finditer(r"sym\s+(\d+)\s+(\S+)", log.read_text())}


def is_kernel(symbol: str) -> bool:
    return "qlinear_arm" in symbol and not re.search(NOT_KERNEL, symbol)


def count(plugin: str, work: Path) -> list[list[object]]:
    exe = build(work)
    rows = []
    N = K = 4096
    for cpu, layout, gemv, gemm in CPUS:
        for fmt, group, books, label in FORMATS:
            for M, kind in ((1, f"GEMV ({gemv})"), (8, f"GEMM ({gemm})")):
                log = work / f"{cpu}-{layout}-{fmt}-{group}-{books}-{M}.txt"
                syms = symbols(plugin, cpu, log, [str(exe), "bench", fmt, str(M), str(N), str(K), "2", str(group),
                                                  str(books), layout])
                n = sum(c for sym, c in syms.items() if is_kernel(sym))
                per = n / (N * K * 2 * M)
                rows.append([f"{cpu} ({layout})", label, kind, M, f"{n / 2:,.0f}", f"{per:.3f}"])
                print(rows[-1], flush=True)
    return rows


def rotation(plugin: str, work: Path, chosen: int = 0) -> list[list[object]]:
    """Per shape of ROTATION_SHAPES: the transform's instructions per call against the kernel's, with the layers'
    default block (``block_size(K)``) or, given ``chosen``, that one (``rotation_block=``) where it divides K."""
    from qlinear.backends._cpu import paley_argument
    from qlinear.formats.rotation import _split, block_size

    exe = build(work)
    rows = []
    for N, K, group in ROTATION_SHAPES:
        if chosen and K % chosen:
            continue
        block = chosen or block_size(K)
        p = _split(block)[0]
        paley = []
        if p > 1:
            (work / "paley").write_bytes(paley_argument(p).numpy().tobytes())
            paley = [str(work / "paley")]

        def per_call(b: int) -> dict[str, float]:
            runs = [symbols(plugin, "max", work / f"rotation-{N}-{K}-{b}-{reps}.txt",
                            [str(exe), "bench", "bcq4", "1", str(N), str(K), str(reps), str(group), "1", "sdot", str(b),
                             *(paley if b else [])], top=1000) for reps in (1, 3)]
            return {sym: (c - runs[0].get(sym, 0)) / 2 for sym, c in runs[1].items()}

        def rest(calls: dict[str, float]) -> dict[str, float]:  # neither the kernel nor the quantization
            return {sym: c for sym, c in calls.items() if not (is_kernel(sym) or ACT_QUANT in sym)}

        calls, plain = per_call(block), rest(per_call(0))
        kernel = sum(c for sym, c in calls.items() if is_kernel(sym))
        quant = sum(c for sym, c in calls.items() if ACT_QUANT in sym)
        # what rotating adds to a call: the transform's code and the libc it calls (setup and printf cancel out)
        added = {sym: c - plain.get(sym, 0) for sym, c in rest(calls).items() if c != plain.get(sym, 0)}
        rot = sum(added.values())
        rows.append([f"{N}x{K}", group, f"{block} = {p}·{block // p}" if p > 1 else block, f"{kernel:,.0f}",
                     f"{quant:,.0f}", f"{rot:,.0f}", f"{100 * rot / (kernel + quant):.1f} %"])
        print(rows[-1], {sym: f"{c:,.0f}" for sym, c in sorted(added.items(), key=lambda kv: -kv[1])}, flush=True)
    return rows


def timing() -> list[list[object]]:
    torch.manual_seed(0)
    rows = []
    N = K = 2048
    lin = torch.nn.Linear(K, N, bias=False)
    cases = [("codebook 2-bit g32", CodebookLinear, dict(bits=2, iters=1)),
             ("codebook 4-bit g32", CodebookLinear, dict(bits=4, iters=1)),
             ("BCQ uniform int4 g128", BCQLinear, dict(bits=4, group_size=128, init="uniform", iters=0))]
    for label, cls, cfg in cases:
        ref = cls.from_linear(lin, cfg, backend="reference")
        arm = cls.from_linear(lin, cfg, backend="arm_neon")
        for M in (1, 4, 16, 64, 256):
            x = torch.randn(M, K)
            with torch.no_grad():
                t_ref = timeit(lambda: ref(x), iters=5)
                t_arm = timeit(lambda: arm(x), iters=5)
            rows.append([label, f"{N}x{K}", M, t_ref, t_arm, t_ref / t_arm])
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plugin", default="/tmp/arm-insn/libsymcount.so")
    ap.add_argument("--skip-count", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--rotation", action="store_true", help="only the rotated layers' transform count (issue 27)")
    ap.add_argument("--rotation-block", type=int, default=0,
                    help="with --rotation: this block (rotation_block=) instead of each layer's default")
    args = ap.parse_args()
    print(f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if (args.rotation or not args.skip_count) and not (
            shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64") and Path(args.plugin).exists()):
        sys.exit("needs aarch64-linux-gnu-g++, qemu-aarch64 and the plugin (bash ../shared/tools/arm-insn/build.sh)")
    if args.rotation:
        with tempfile.TemporaryDirectory() as d:
            print(table(["N x K", "group", "block", "kernel", "activation quantization", "transform",
                         "transform / (kernel + quantization)"], rotation(args.plugin, Path(d), args.rotation_block)))
        return
    if not args.skip_count:
        with tempfile.TemporaryDirectory() as d:
            print(table(["CPU (layout)", "format", "kernel", "M", "instructions per call",
                         "per weight (M=1) / per MAC (M=8)"],
                        count(args.plugin, Path(d))))
    if not args.skip_time:
        print(table(["format", "N x K", "M", "reference (µs)", "arm_neon (µs)", "speedup"], timing()))


if __name__ == "__main__":
    main()
