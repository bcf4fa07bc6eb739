"""Decode GEMV benchmark on one GPU: qlinear kernels vs cuBLAS fp16 and tinygemm int4, in the same run.

    python benchmarks/bench_gemv.py [--quick] [--shapes 8192x8192,...] [--batches 1,2,4,8] [--bits 2,3,4] [--gemlite-bits 2,4]
                                    [--groups 64,128,K] [--mixed-shapes ...] [--outliers 0,0.002,0.005]
                                    [--mixed-large-batches 16,32,64] [--no-mixed] [--codebook 4:1:64,2:4:64]
                                    [--codebook-shapes 8192x8192,576x576] [--uniform8 128,K]
                                    [--uniform8-shapes 8192x8192,576x576] [--markdown out.md]

Timing (:func:`common.gpu_time_us`): CUDA-graph replay, median of 25 replays, weights rotated through a
pool three times the L2 size so every call reads its weights from DRAM.  Per row: µs per call,
effective TB/s (every byte the kernel must read or write: codes, scales, offsets, x, y), that as a
percentage of the device-copy bandwidth measured at the start of the run, and the speedup versus
cuBLAS fp16 ``F.linear`` and versus ``torch._weight_int4pack_mm`` (tinygemm, bf16, group 128) at
the same shape and batch.  GemLite's A16Wn kernels (int2/int4, group 128, fp16 scales and zeros; the wheel carried to
the GPU machine, see gpu_checks.sh) are baseline rows of their own, with the same columns.

Mixed 2/4/16 rows (``async_dequant``, issue 9), over ``--mixed-shapes`` × ``--batches`` with cuBLAS fp16 and the
LUT GEMV at 2 and 3 bits (group 128) in the same run: per outlier ratio the kernel with asynchronous and with
synchronous dequantization, and (ratio > 0) the kernel without outliers plus a separate torch.sparse CSR SpMV.
Weights are random but valid mixed buffers at the format defaults (25 % 4-bit groups of 16, 4-bit second-order
scales per 16 rows), built on the GPU (the real quantizer would take minutes on these layers).  Their TB/s
counts every stored byte of the repacked layer (codes, records, second-order pairs, tables, outliers, row
pointers) plus x and y.  ``--mixed-large-batches`` adds M = 16..64 rows (the kernel over chunks of 8) against
cuBLAS fp16 and the reference dequantize + cuBLAS (wall clock with synchronisation, :func:`common.timeit`:
its dequantization is not graph-capturable), to confirm ``async_dequant.MAX_BATCH``.  A summary checks the
targets at 8192², M = 1: ≤ 11 µs, outliers at 0.2 % cost ≤ 5 %, async ≥ 1.2× sync, fused vs separate outliers.

Codebook rows (``--codebook bits:books:group,...`` over ``--codebook-shapes`` × ``--batches``; '' = none): the GEMV
(``cuda_codebook_gemv``) and the dequantize kernel + cuBLAS (``cuda_codebook``, what the format ran at every batch
before the GEMV) on random valid canonical buffers, with cuBLAS fp16 in the same run; TB/s counts the codes, book
indices, scales and codebooks plus x and y.

8-bit uniform rows (``--uniform8 group,...`` over ``--uniform8-shapes`` × ``--batches``; '' = none): the GEMV on the
canonical storage (``cuda_uniform_gemv``), its dequantize kernel + cuBLAS (``cuda_uniform``) and the LUT GEMV at 8
planes (``cuda_lut``, what 8-bit layers ran before), with cuBLAS fp16 in the same run; TB/s counts the codes, scales
and zero points plus x and y.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import (codebook_sets, gpu_run_header, gpu_time_us, mixed_bytes, mixed_pool, pool_size, report,  # noqa: E402
                    table, timeit, uniform_bcq_sets)

from qlinear import ops as _ops  # noqa: E402
from qlinear.backends import async_dequant, cuda_codebook, cuda_lut, cuda_uniform  # noqa: E402

SHAPES = "4096x4096,8192x8192,12288x12288,28672x8192,8192x28672,576x576,1536x576"
MIXED_SHAPES = "4096x4096,8192x8192,11008x4096,4096x11008,28672x8192"


def lut_bytes(M: int, N: int, K: int, q: int, g: int, offset_bytes: int = 2) -> int:
    """Bytes the LUT GEMV reads and writes: bit-planes, fp16 α, offsets, fp16 x and y."""
    G = math.ceil(K / g)
    return q * N * K // 8 + 2 * q * N * G + offset_bytes * N * G + 2 * M * K + 2 * M * N


def lut_calls(M, N, K, q, g, sms):
    """Closures running the LUT GEMV over a pool of random weight sets (values do not change the timing)."""
    G = math.ceil(K / g)
    n = pool_size(lut_bytes(M, N, K, q, g))
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    launch = cuda_lut.plan(M, N, K, sms, q)
    sets = [(torch.randint(-2**31, 2**31 - 1, (K // 32, q, N), dtype=torch.int32, device="cuda"),
             torch.rand(G, q, N, device="cuda").half(), torch.randn(G, N, device="cuda").half()) for _ in range(n)]
    return [lambda s=s: torch.ops.qlinear.bcq_lut_gemv(x, s[0], s[1], s[2], None, None, g, *launch) for s in sets]


def cublas_calls(M, N, K):
    n = pool_size(2 * N * K)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) for _ in range(n)]
    return [lambda w=w: F.linear(x, w) for w in ws]


def tinygemm_calls(M, N, K, group=128):
    n = pool_size(N * K // 2 + 4 * N * K // group)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    sets = []
    for _ in range(n):
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        sz = torch.rand(K // group, N, 2, device="cuda").to(torch.bfloat16)
        sets.append((torch._convert_weight_to_int4pack(w, 8), sz))
    return [lambda s=s: torch._weight_int4pack_mm(x, s[0], group, s[1]) for s in sets]


def gemlite_calls(M, N, K, bits, group=128):
    """GemLite A16Wn (int codes, fp16 scales and zeros) over a pool of weight sets, or a string saying why it cannot
    run (not installed, bits it lacks, Triton failing)."""
    try:
        from gemlite.helper import A16Wn
    except Exception as e:
        return f"gemlite not usable: {e!r}"[:200]
    if bits not in (1, 2, 4, 8):
        return f"gemlite has no {bits}-bit kernel"
    n = pool_size(N * K * bits // 8 + 4 * N * K // group)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    try:
        layers = [A16Wn(device="cuda").from_weights(
            torch.randint(0, 2 ** bits, (N, K), device="cuda", dtype=torch.uint8),
            torch.rand(N, K // group, device="cuda", dtype=torch.float16) * 0.01,
            torch.full((N, K // group), 2 ** (bits - 1), device="cuda", dtype=torch.float16), bits, group)
            for _ in range(n)]
        layers[0](x)
    except Exception as e:
        return f"gemlite failed: {e!r}"[:300]
    return [lambda lay=lay: lay(x) for lay in layers]


def mixed_calls(M, N, K, outlier_ratio, async_dequant_on=True, outliers="fused"):
    """Closures running the mixed GEMV (``async_dequant.linear``) over the pool."""
    cfg, _, sets = mixed_pool(N, K, outlier_ratio)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    return [lambda s=s: async_dequant.linear(x, s, None, cfg, N, K, async_dequant_on, outliers) for s in sets]


def mixed_reference_us(M, N, K, outlier_ratio):
    """µs of the reference backend (dequantize + cuBLAS) on one layer, wall clock (not graph-capturable)."""
    from qlinear.backends import reference

    cfg, canon, _ = mixed_pool(N, K, outlier_ratio)
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    return timeit(lambda: reference.linear(x, canon, None, cfg, N, K), device="cuda")


def codebook_calls(M, N, K, bits, books, g, gemv=True):
    """``(closures, bytes read)``: the codebook GEMV (or the dequantize kernel + cuBLAS) over a pool of random layers."""
    sets = codebook_sets(N, K, bits, books, g, pool_size(N * K * bits // 8))
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    if gemv:
        calls = [lambda s=s: torch.ops.qlinear.codebook_gemv(x, *s, None, g, bits) for s in sets]
    else:
        calls = [lambda s=s: F.linear(x, torch.ops.qlinear.codebook_dequantize(*s, K, g, bits, torch.float16))
                 for s in sets]
    return calls, sum(t.nbytes for t in sets[0] if t is not None) + 2 * M * (N + K)


def uniform8_calls(M, N, K, g, gemv=True):
    """``(closures, bytes read)``: the 8-bit uniform GEMV (or the dequantize kernel + cuBLAS) over a pool of random
    canonical layers."""
    cfg, sets = uniform_bcq_sets(N, K, 8, g, "", pool_size(N * K))
    names = _ops._names("bcq", cfg.to_json(), N, K, "")
    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
    fn = cuda_uniform.linear_gemv if gemv else cuda_uniform.linear
    calls = [lambda s=s: fn(x, dict(zip(names, s)), None, cfg, N, K) for s in sets]
    return calls, sum(t.nbytes for t in sets[0]) + 2 * M * (N + K)


def _time(calls):
    try:
        return gpu_time_us(calls)
    except Exception as e:  # e.g. a path that cannot be captured in a CUDA graph: report, keep going
        print(f"  timing failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="NxK list (out x in)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--groups", default="64,128,K")
    ap.add_argument("--mixed-shapes", default=MIXED_SHAPES, help="NxK list for the mixed 2/4/16 rows")
    ap.add_argument("--outliers", default="0,0.002,0.005", help="outlier ratios of the mixed rows")
    ap.add_argument("--mixed-large-batches", default="16,32,64", help="M > 8 rows of the mixed kernel ('' = none)")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed 2/4/16 rows")
    ap.add_argument("--gemlite-bits", default="2,4", help="GemLite A16Wn g128 baseline rows ('' = none)")
    ap.add_argument("--codebook", default="4:1:64,2:4:64", help="codebook rows, bits:books:group ('' = none)")
    ap.add_argument("--codebook-shapes", default="8192x8192,576x576", help="NxK list for the codebook rows")
    ap.add_argument("--uniform8", default="128,K", help="8-bit uniform rows, group sizes ('' = none)")
    ap.add_argument("--uniform8-shapes", default="8192x8192,576x576", help="NxK list for the 8-bit uniform rows")
    ap.add_argument("--quick", action="store_true", help="8192x8192 only, M=1 and 8, group 128")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches, args.groups = "8192x8192", "1,8", "128"
        args.mixed_shapes, args.outliers, args.mixed_large_batches = "8192x8192", "0,0.002", "16"
        args.codebook_shapes, args.uniform8_shapes, args.uniform8 = "8192x8192", "8192x8192", "128"
    if not args.no_mixed and async_dequant.available() is not None:
        print(f"skipping the mixed rows: async_dequant extension unavailable: {async_dequant.available()}", flush=True)
        args.no_mixed = True
    if not torch.cuda.is_available() or cuda_lut.available() is not None:
        sys.exit(f"needs a CUDA GPU and the cuda_lut extension: {cuda_lut.available()}")
    props = torch.cuda.get_device_properties(0)
    head, copy_bw = gpu_run_header()
    print(head, flush=True)
    rows = []
    fp16_us, int4_us = {}, {}
    gemlite_bits = [int(b) for b in args.gemlite_bits.split(",") if b]

    def baselines(N, K, M):
        if (N, K, M) not in fp16_us:
            fp16_us[N, K, M] = gpu_time_us(cublas_calls(M, N, K))
            int4_us[N, K, M] = gpu_time_us(tinygemm_calls(M, N, K)) if K % 1024 == 0 and N % 8 == 0 else float("nan")
            t = fp16_us[N, K, M]
            rows.append(["cuBLAS fp16", "fp16", f"{N}x{K}", M, t, (2 * N * K + 2 * M * (N + K)) / t / 1e6, "", 1.0,
                         int4_us[N, K, M] / t])
            for q in gemlite_bits:
                gl = gemlite_calls(M, N, K, q) if K % 128 == 0 else "K not a multiple of 128"
                if isinstance(gl, str):
                    print(gl, flush=True)
                    continue
                tg = gpu_time_us(gl)
                nb = q * N * K // 8 + 4 * N * K // 128 + 2 * M * (N + K)
                rows.append(["GemLite", f"int{q} g128", f"{N}x{K}", M, tg, nb / tg / 1e6,
                             f"{100 * nb / tg / 1e6 / copy_bw:.0f}%", t / tg, int4_us[N, K, M] / tg])
                del gl
        return fp16_us[N, K, M], int4_us[N, K, M]

    def lut_row(N, K, M, q, gs):
        t_fp16, t_int4 = baselines(N, K, M)
        g = K if gs == "K" else int(gs)
        t = gpu_time_us(lut_calls(M, N, K, q, g, props.multi_processor_count))
        tbs = lut_bytes(M, N, K, q, g) / t / 1e6
        rows.append(["cuda_lut", f"bcq q{q} g{gs}", f"{N}x{K}", M, t, tbs, f"{100 * tbs / copy_bw:.0f}%", t_fp16 / t,
                     t_int4 / t])
        print(rows[-1], flush=True)

    def gemv_pair(backend, fmt, N, K, M, calls_of):
        """Rows of a format's GEMV (``backend + "_gemv"``) and of its dequantize kernel + cuBLAS (``backend``);
        ``calls_of(gemv) -> (closures, bytes read)``."""
        t_fp16, t_int4 = baselines(N, K, M)
        for label, gemv in (("GEMV", True), ("dequantize + cuBLAS", False)):
            calls, nbytes = calls_of(gemv)
            t = _time(calls)
            del calls
            tbs = nbytes / t / 1e6
            rows.append([backend + ("_gemv" if gemv else ""), f"{fmt} ({label})", f"{N}x{K}", M, t, tbs,
                         f"{100 * tbs / copy_bw:.0f}%", t_fp16 / t, t_int4 / t])
            print(rows[-1], flush=True)

    done = set()
    for shape in args.shapes.split(","):
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            for q in map(int, args.bits.split(",")):
                for gs in args.groups.split(","):
                    lut_row(N, K, M, q, gs)
                    done.add((N, K, M, q, gs))
    mixed_us = {}
    if not args.no_mixed:
        ratios = [float(r) for r in args.outliers.split(",")]
        large = [int(m) for m in args.mixed_large_batches.split(",") if m]
        for shape in args.mixed_shapes.split(","):
            N, K = map(int, shape.split("x"))
            for M in map(int, args.batches.split(",")):
                for q in (2, 3):  # the LUT GEMV at 2 and 3 bits in the same run
                    if (N, K, M, q, "128") not in done:
                        lut_row(N, K, M, q, "128")
                        done.add((N, K, M, q, "128"))
                t_fp16, t_int4 = baselines(N, K, M)
                for ratio in ratios:
                    cfg = mixed_pool(N, K, ratio)[0]
                    nbytes = mixed_bytes(M, N, K, cfg)
                    variants = [("async", True, "fused"), ("sync", False, "fused")]
                    if ratio > 0:
                        variants.append(("async, separate SpMV", True, "separate"))
                    for label, on, outl in variants:
                        t = _time(mixed_calls(M, N, K, ratio, on, outl))
                        mixed_us[N, K, M, ratio, label] = t
                        tbs = nbytes / t / 1e6
                        rows.append(["async_dequant", f"mixed o{ratio:g} {label} ({cfg.counts(N, K)[2]} outliers)",
                                     f"{N}x{K}", M, t, tbs, f"{100 * tbs / copy_bw:.0f}%", t_fp16 / t, t_int4 / t])
                        print(rows[-1], flush=True)
            for M in large:  # M > 8: the kernel over chunks of 8 vs cuBLAS fp16 and dequantize + cuBLAS
                t_fp16, t_int4 = baselines(N, K, M)
                ratio = 0.002
                cfg = mixed_pool(N, K, ratio)[0]
                t = _time(mixed_calls(M, N, K, ratio))
                t_ref = mixed_reference_us(M, N, K, ratio)
                rows.append(["async_dequant", f"mixed o{ratio:g} async (x{t_ref / t:.2f} vs dequant+cuBLAS "
                             f"{t_ref:.0f} µs wall)", f"{N}x{K}", M, t, mixed_bytes(M, N, K, cfg) / t / 1e6, "",
                             t_fp16 / t, t_int4 / t])
                print(rows[-1], flush=True)
            mixed_pool.cache_clear()  # free this shape's pools
    codebooks = [tuple(map(int, c.split(":"))) for c in args.codebook.split(",") if c]
    if codebooks and cuda_codebook.available() is not None:
        print(f"skipping the codebook rows: cuda_codebook unavailable: {cuda_codebook.available()}", flush=True)
        codebooks = []
    for shape in args.codebook_shapes.split(",") if codebooks else ():
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            for bits, books, g in codebooks:
                gemv_pair("cuda_codebook", f"codebook {bits}-bit {books} books g{g}", N, K, M,
                          lambda gemv: codebook_calls(M, N, K, bits, books, g, gemv))
    groups8 = [g for g in args.uniform8.split(",") if g]
    if groups8 and cuda_uniform.available() is not None:
        print(f"skipping the 8-bit uniform rows: cuda_uniform unavailable: {cuda_uniform.available()}", flush=True)
        groups8 = []
    for shape in args.uniform8_shapes.split(",") if groups8 else ():
        N, K = map(int, shape.split("x"))
        for M in map(int, args.batches.split(",")):
            for gs in groups8:
                g = K if gs == "K" else int(gs)
                gemv_pair("cuda_uniform", f"uniform 8-bit g{gs}", N, K, M, lambda gemv: uniform8_calls(M, N, K, g, gemv))
                if (N, K, M, 8, gs) not in done:
                    lut_row(N, K, M, 8, gs)
                    done.add((N, K, M, 8, gs))
    text = head + "\n\n" + table(["kernel", "format", "N x K", "M", "µs", "TB/s", "% copy BW", "x cuBLAS fp16",
                                  "x tinygemm int4"], rows)
    key = (8192, 8192, 1)
    if all((*key, r, "async") in mixed_us for r in (0.0, 0.002)):
        t0, t2 = mixed_us[(*key, 0.0, "async")], mixed_us[(*key, 0.002, "async")]
        ts = mixed_us.get((*key, 0.002, "sync"), float("nan"))
        tsep = mixed_us.get((*key, 0.002, "async, separate SpMV"), float("nan"))
        text += (f"\n\nTargets, 8192x8192, M=1, mixed defaults: {t2:.1f} µs (target <= 11); outliers at 0.2 % cost "
                 f"{100 * (t2 / t0 - 1):+.1f} % (target <= 5 %); async {ts / t2:.2f}x sync (target >= 1.2); fused "
                 f"outliers {t2:.1f} µs vs separate SpMV {tsep:.1f} µs (keep the faster)")
    report(text, args.markdown)


if __name__ == "__main__":
    main()
