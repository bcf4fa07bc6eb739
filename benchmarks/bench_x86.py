"""x86 CPU kernels versus dense torch and PyTorch's own int4 CPU kernel, per layer and end to end (issue 25).

    python benchmarks/bench_x86.py                 # layers, then SmolLM2 greedy decode
    python benchmarks/bench_x86.py --no-e2e --shapes 4096x4096 --batches 1,8 --formats u4,u2,bcq4,bcq2
    python benchmarks/bench_x86.py --callgrind    # instructions per weight of each M=1 path under valgrind

Per layer (median µs, torch's threads as set): dense fp32 and bf16 ``F.linear``; PyTorch's int4 CPU kernel
(``aten._weight_int4pack_mm_for_cpu``, bf16 activations, the same group size); qlinear's reference backend
(dequantize + matmul); qlinear's x86 kernels on each path this CPU has, and "auto" (what a layer runs: the best path,
or from ``x86.dequant_from`` rows (by bits and size) of a bit-plane layer the batched path), for each of ``--formats``: uniform u4 (nibble
layout, VPDPBUSD) and u3/u2, free-α bcq4/3/2 (bit-plane lookup tables), codebooks cb4/cb2 (4 books at 2 bits;
codes looked up in the layer's 16-byte table), the mixed format at its defaults (int8 activations per 16 inputs, ``mixed.cpp``); group 128 (64 where K is not a multiple of
128, e.g. SmolLM2's 576).  End to end: SmolLM2-135M greedy decode tokens/s, float32 versus
round-to-nearest 4-bit g64 through the x86 backend and through the reference, in the same run.
``--callgrind``: the torch-free harness (``backends/x86/harness.cpp``) built with g++ and run under valgrind's
callgrind, instructions executed inside ``qlinear_x86::run`` per weight (repeatable on a noisy machine; valgrind
emulates neither AVX-512 nor AVX-VNNI, so those paths report "not run").
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from common import table, timeit
from qlinear.backends import x86
from qlinear.formats import bcq, codebook, get_format, mixed

SHAPES = [(4096, 4096), (11008, 4096), (576, 576), (1536, 576), (576, 1536)]
PATHS = ("avx512_vnni", "avx2_vnni", "avx2", "scalar")


def _op(cfg):
    """The backend's entry for a layer of ``cfg``."""
    return x86.linear_mixed if cfg.format == "mixed" else x86.linear


def _runs(path: str, x, packed, cfg, N, K) -> bool:
    try:
        _op(cfg)(x, packed, None, cfg, N, K, path=path)
        return True
    except RuntimeError as e:
        if "cannot run path" in str(e):
            return False
        raise


FORMATS = {  # name -> config at group size gs; u4 takes the nibble layout, u8 the byte one, u2 the 2-bit codebook
    # one, BCQ's others the bit-plane LUT layout
    "u4": lambda gs: bcq.Config(bits=4, group_size=gs, init="uniform", iters=0),
    "u8": lambda gs: bcq.Config(bits=8, group_size=gs, init="uniform", iters=0),
    "u3": lambda gs: bcq.Config(bits=3, group_size=gs, init="uniform", iters=0),
    "u2": lambda gs: bcq.Config(bits=2, group_size=gs, init="uniform", iters=0),
    "bcq4": lambda gs: bcq.Config(bits=4, group_size=gs, iters=1),
    "bcq3": lambda gs: bcq.Config(bits=3, group_size=gs, iters=1),
    "bcq2": lambda gs: bcq.Config(bits=2, group_size=gs, iters=1),
    "cb4": lambda gs: codebook.Config(bits=4, group_size=gs, iters=1),  # codebooks: the table-lookup layout
    "cb2": lambda gs: codebook.Config(bits=2, group_size=gs, iters=1),
    "mixed": lambda gs: mixed.Config(),  # its own defaults (group 16, 25 % 4-bit groups, 0.2 % outliers)
}


def _quantize(w, cfg):
    """``(canonical buffers, layout x86 buffers)`` of ``w`` in config ``cfg``."""
    N, K = w.shape
    canon = get_format(cfg.format).quantize(w, cfg)
    repack = {"codebook": x86.repack_codebook, "mixed": x86.repack_mixed}.get(cfg.format, x86.repack)
    return canon, repack(canon, cfg, N, K)


def _format_code(cfg) -> int:
    """qgemm.h's Format of a layer (the callgrind harness's FORMAT)."""
    if cfg.format == "mixed":  # the harness's mixed layer at the format's defaults
        return 5
    if cfg.format == "codebook" or x86._uniform_crumbs(cfg):  # uniform 2-bit: the 2-bit codebook kernel, 4 books
        return 3 if cfg.bits == 4 else 4
    return 0 if bcq.is_uniform(cfg) and cfg.bits in (4, 8) else 1 if bcq.is_uniform(cfg) else 2


def layers(shapes, batches, iters, formats, act=torch.float32):
    rows = []
    for N, K in shapes:
        gs = 128 if K % 128 == 0 else 64
        w = torch.randn(N, K) * 0.02
        u4 = FORMATS["u4"](gs)
        canon = bcq.quantize(w, u4)
        codes, s, z = bcq.uniform_parts(canon, u4, N, K)
        int4 = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # tinygemm's (scale, zero) convention: w = (q - 8)·scale + zero, so zero = (8 − z)·s
        sz = torch.stack([s.float().T, ((8 - z) * s.float()).T], -1).to(torch.bfloat16).contiguous()
        wd = bcq.dequantize(canon, u4, N, K)
        wb = wd.bfloat16()
        slow = N * K >= 4096 * 4096
        for M in batches:
            x = torch.randn(M, K)
            xb = x.bfloat16()
            base = {"fp32": timeit(lambda: torch.nn.functional.linear(x, wd), iters=iters),
                    "bf16": timeit(lambda: torch.nn.functional.linear(xb, wb), iters=iters),
                    "int4": timeit(lambda: torch._weight_int4pack_mm_for_cpu(xb, int4, gs, sz), iters=iters)}
            ours_u4, x = None, x.to(act)  # qlinear's rows take x in --activations
            for name in formats:
                cfg = FORMATS[name](gs)
                canon, packed = _quantize(w, cfg)
                deq = get_format(cfg.format).dequantize
                t = dict(base, ref=timeit(lambda: torch.nn.functional.linear(x, deq(canon, cfg, N, K).to(x.dtype)),
                                          warmup=1, iters=3 if slow else iters))
                for p in PATHS:
                    if (p != "scalar" or N * K * M <= 4096 * 4096) and _runs(p, x, packed, cfg, N, K):
                        t[p] = timeit(lambda p=p: _op(cfg)(x, packed, None, cfg, N, K, path=p), iters=iters)
                t["auto"] = timeit(lambda: _op(cfg)(x, packed, None, cfg, N, K), iters=iters)
                best = min(t[p] for p in (*PATHS, "auto") if p in t)
                ours_u4 = best if name == "u4" else ours_u4
                rows.append([f"{N}x{K}", M, gs, name, *[t.get(k, float("nan")) for k in ("fp32", "bf16", "int4", "ref",
                                                                                        *PATHS, "auto")],
                             t["int4"] / best, t["bf16"] / best, best / ours_u4 if ours_u4 else float("nan")])
    return rows


def callgrind(shapes, formats):
    """Instructions per weight of each path at M=1 (callgrind, one call, one thread), per format."""
    here = Path(x86.__file__).parent
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "harness"
        subprocess.run(["g++", "-O3", "-std=c++17", "-ffp-contract=off", *(str(here / f) for f in
                        ("kernels.cpp", "mixed.cpp", "harness.cpp")), "-o", str(exe)], check=True)
        for N, K in shapes:
            gs = 128 if K % 128 == 0 else 64
            for name in formats:
                cfg = FORMATS[name](gs)
                fmt = _format_code(cfg)
                row = [f"{N}x{K}", cfg.group_size, name]
                for p in PATHS:
                    r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out",
                                        "--toggle-collect=qlinear_x86::run*", "--toggle-collect=qlinear_x86::mixed_run*",
                                        str(exe), str(x86.PATHS[p]), "1",
                                        str(N), str(K), str(gs), "1", str(fmt), str(cfg.bits)],
                                       capture_output=True, text=True)
                    m = re.search(r"Collected : (\d+)", r.stderr)
                    row.append(int(m.group(1)) / (N * K) if r.returncode == 0 and m else "not run")
                rows.append(row)
    return rows


def decode(tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qlinear
    from qlinear.evaluation import smollm2_checkpoint

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = []
    rtn = dict(bits=4, group_size=64, init="uniform", iters=0)
    head8 = dict(rtn, modules_to_not_convert=[], per_module={  # the tied output layer too, at 8 bits per row
        "lm_head": qlinear.QLinearConfig("bcq", bits=8, group_size=-1, init="uniform", iters=0, backend="x86")})
    for label, backend, kw in (("float32", None, None), ("RTN 4-bit g64, x86", "x86", rtn),
                               ("RTN 4-bit g64, lm_head 8-bit, x86", "x86", head8),
                               ("RTN 4-bit g64, reference", "reference", rtn),
                               ("BCQ 4-bit g64 (free α), x86", "x86", dict(bits=4, group_size=64)),
                               ("BCQ 2-bit g64 (free α), x86", "x86", dict(bits=2, group_size=64))):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if backend is not None:
            qlinear.replace_linear(model, qlinear.QLinearConfig("bcq", **kw, backend=backend), progress=False)
        gen = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        with torch.no_grad():
            model.generate(ids, **gen)  # warm-up
            t = time.perf_counter()
            model.generate(ids, **gen)
            out.append([label, tokens / (time.perf_counter() - t)])
    for r in out:
        r.append(r[1] / out[0][1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK list")
    ap.add_argument("--batches", default="1,8,64,512", help="M list")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--formats", default="u4", help=f"comma list of {', '.join(FORMATS)} (u4 first for the last column)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens (end to end)")
    ap.add_argument("--activations", default="float32", choices=("float32", "bfloat16"),
                    help="qlinear's activations (bfloat16: the batched path's bfloat16 GEMM on CPUs with AVX512-BF16)")
    ap.add_argument("--no-e2e", action="store_true", help="skip the SmolLM2 decode")
    ap.add_argument("--no-layers", action="store_true", help="only the SmolLM2 decode")
    ap.add_argument("--callgrind", action="store_true", help="only the instruction counts (needs g++ and valgrind)")
    args = ap.parse_args()
    assert x86.available() is None, x86.available()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.callgrind:
        print(f"{time.strftime('%Y-%m-%d')}: instructions per weight inside qlinear_x86::run (mixed: mixed_run), M=1 "
              "(callgrind)")
        print(table(["N x K", "group", "format", *[f"x86 {p}" for p in PATHS]],
                    callgrind(shapes, args.formats.split(","))))
        return
    batches = [int(b) for b in args.batches.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{time.strftime('%Y-%m-%d')}, {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "median µs per call; formats: u8/u4/u3/u2 uniform (round-to-nearest), bcq4/3/2 free α (BCQ fit), "
          f"cb4/cb2 codebooks; qlinear activations {args.activations}")
    if not args.no_layers:
        print(table(["N x K", "M", "group", "format", "dense fp32", "dense bf16", "PyTorch int4", "qlinear reference",
                     *[f"x86 {p}" for p in PATHS], "x86 auto", "int4 / best x86", "bf16 / best x86",
                     "best x86 / u4's"],
                    layers(shapes, batches, args.iters, args.formats.split(","), getattr(torch, args.activations))))
    if not args.no_e2e:
        print(f"\nSmolLM2-135M greedy decode, {args.tokens} tokens after a 5-token prompt, batch 1")
        print(table(["model", "tokens/s", "vs float32"], decode(args.tokens)))


if __name__ == "__main__":
    main()
