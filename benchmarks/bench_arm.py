"""Arm kernels: executed aarch64 instructions per weight (GEMV) / per multiply-accumulate (GEMM) under qemu, and
wall time of the same source on this CPU (SIMDe on x86) against the reference backend.

    python benchmarks/bench_arm.py [--plugin /tmp/arm-insn/libsymcount.so] [--skip-count] [--skip-time]

Instruction counts: the standalone harness (backends/arm_neon/harness.cpp) is cross-compiled statically
(aarch64-linux-gnu-g++ -O3 -march=armv8.2-a+dotprod; the SMMLA file enables i8mm itself) and run under
``qemu-aarch64 -cpu max`` (i8mm: SDOT GEMV, SMMLA GEMM; on the default layout sdot and on layout mmla) and
``-cpu neoverse-n1`` (dotprod only: SDOT by element for both, layout sdot) with the symbol-counting plugin built by
``../shared/tools/arm-insn/build.sh``;
the count is every instruction executed inside the kernels' symbols (decode, dot products, scaling,
loop control; not the activation quantization, done once per call), divided by N·K·reps (M = 1) or
N·K·M·reps (M = 8).  N = K = 4096; BCQ uniform int4 at group 128, codebooks at group 32 (2-bit with
4 codebooks), and three 2-bit variants (group 128; one codebook; both).
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
FORMATS = [("bcq4", 128, 1, "BCQ uniform int4 g128"), ("cb4", 32, 1, "codebook 4-bit g32"),
           ("cb2", 32, 4, "codebook 2-bit g32, 4 books"), ("cb2", 128, 4, "codebook 2-bit g128, 4 books"),
           ("cb2", 32, 1, "codebook 2-bit g32, 1 book"), ("cb2", 128, 1, "codebook 2-bit g128, 1 book")]
# (qemu CPU, layout, GEMV kernel, GEMM kernel)
CPUS = [("max", "sdot", "SDOT by element", "SMMLA"), ("max", "mmla", "SDOT", "SMMLA"),
        ("neoverse-n1", "sdot", "SDOT by element", "SDOT by element")]


def count(plugin: str, work: Path) -> list[list[object]]:
    exe = work / "harness"
    subprocess.run(["aarch64-linux-gnu-g++", "-std=c++17", "-O3", "-static", "-march=armv8.2-a+dotprod",
                    *(str(ARM / f) for f in ("harness.cpp", "kernels.cpp", "kernels_i8mm.cpp")), "-o", str(exe)],
                   check=True)
    rows = []
    N = K = 4096
    for cpu, layout, gemv, gemm in CPUS:
        for fmt, group, books, label in FORMATS:
            for M, kind in ((1, f"GEMV ({gemv})"), (8, f"GEMM ({gemm})")):
                log = work / f"{cpu}-{layout}-{fmt}-{group}-{books}-{M}.txt"
                subprocess.run(["qemu-aarch64", "-cpu", cpu, "-plugin", f"{plugin},top=40", "-d", "plugin", "-D",
                                str(log), str(exe), "bench", fmt, str(M), str(N), str(K), "2", str(group), str(books),
                                layout],
                               check=True, capture_output=True)
                n = sum(int(m.group(1)) for m in re.finditer(r"sym\s+(\d+)\s+(\S*qlinear_arm\S*)", log.read_text())
                        if not re.search("prepare_acts|reference|weight_at|half_to_float|cpu_path",
                                         m.group(2)))
                per = n / (N * K * 2 * M)
                rows.append([f"{cpu} ({layout})", label, kind, M, f"{n / 2:,.0f}", f"{per:.3f}"])
                print(rows[-1], flush=True)
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
    args = ap.parse_args()
    print(f"{datetime.date.today()}, {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_count:
        if not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64") and Path(args.plugin).exists()):
            sys.exit("needs aarch64-linux-gnu-g++, qemu-aarch64 and the plugin (bash ../shared/tools/arm-insn/build.sh)")
        with tempfile.TemporaryDirectory() as d:
            print(table(["CPU (layout)", "format", "kernel", "M", "instructions per call",
                         "per weight (M=1) / per MAC (M=8)"],
                        count(args.plugin, Path(d))))
    if not args.skip_time:
        print(table(["format", "N x K", "M", "reference (µs)", "arm_neon (µs)", "speedup"], timing()))


if __name__ == "__main__":
    main()
