"""Issue 27, cost: the online input transform of a Hadamard-rotated layer against the layer's own time.

    python benchmarks/bench_rotation.py                      # SmolLM2 and Llama-7B input widths, M = 1, 8, 128
    python benchmarks/bench_rotation.py --shapes 576x576 --batches 1 --threads 1
    python benchmarks/bench_rotation.py --device cuda --batches 1,4,8 --backend cuda_lut   # or quick, async_dequant
    python benchmarks/bench_rotation.py --shapes 576x576 --batches 32 --dtype bfloat16 --bits 3 --free-alpha
    python benchmarks/bench_rotation.py --device cuda --slice-sweep           # qlinear::cuda_rotate's launch plans

Per (N x K layer, M rows), µs with torch's threads as set (the best of ``--rounds`` interleaved medians, each round
starting with the next function): the layer unrotated (RTN 4-bit g64 unless ``--bits``/``--free-alpha``, the kernel
the registry picks here: x86 on x86 machines), the same weights rotated (``rotation="hadamard"``: the CPU kernels
transform x themselves, backends/_shared/rotation.h, and the x86 batched path through ``qlinear::x86_rotate``), and
the transform alone (``qlinear.formats.rotation.rotate_input`` on a fresh ``x``: what the op pays once per group of
layers reading the same input, q/k/v or gate/up, where the kernel does not transform x itself; the PyTorch reference
on the CPU, the one-launch ``qlinear::cuda_rotate`` of backends/_cuda/rotate.cu on a GPU, whose ``torch transform µs``
column is the PyTorch reference).  ``overhead`` is rotated
over unrotated minus one; the issue's target is ≤ 5% at M = 1.

``--device cuda``: fp16 layers on the GPU (``--backend`` picks the kernel; mixed layers for ``async_dequant``), each
call timed end to end with a synchronisation, as eager decoding sees it; ``op transform µs`` is the rotated layer with
the transform forced back into PyTorch (what a CUDA kernel does where its shared memory cannot hold ``R·x``), so
``fused`` against it is what staging ``R·x`` in the kernel (backends/_cuda/rotation.cuh) saves or costs.  The ``graph``
columns time both layers as 20 calls per CUDA-graph replay (weights in L2 at these sizes): the kernels' own cost,
without eager Python and launch gaps, which is what the ≤ 5% target is about; "graph op transform" is the rotated layer
with its transform forced out of the kernel (one ``cuda_rotate`` launch per call, then the kernel on R·x): which of the
two a decode under CUDA graphs should take.

``--slice-sweep``: the one-launch transform alone (``qlinear::cuda_rotate``, backends/_cuda/rotate.cu) at each
``--inputs`` width and batch, with its plan (``slice`` 0) and every power-of-two slice from 16 to the block plus the
block itself, as 20 calls per graph replay, next to the PyTorch transform; each slice's output is checked against the
float64 transform (slices sum their terms in other orders: within fp16's rounding, not bit for bit).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import gpu_time_us, table, timeit
from qlinear import QLinearConfig
from qlinear.modules import module_class
from qlinear.formats import rotation

SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (4096, 11008)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="comma list of NxK (default: SmolLM2's and Llama-7B's)")
    ap.add_argument("--batches", default="1,8,128")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds; the best median of each counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", help="the kernel to run (default: the registry's choice)")
    ap.add_argument("--dtype", help="activations (default: float16 on CUDA, else float32; bfloat16 on x86 takes "
                                    "the batched path from a few rows)")
    ap.add_argument("--bits", type=int, default=4, help="BCQ bits (RTN layers unless --free-alpha)")
    ap.add_argument("--free-alpha", action="store_true", help="BCQ's own fit (non-uniform, bit-plane layouts: the "
                                                                "x86 batched path from DEQUANT_FROM rows)")
    ap.add_argument("--slice-sweep", action="store_true", help="time qlinear::cuda_rotate's launch plans (GPU)")
    ap.add_argument("--inputs", default="576,1536,4096,11008", help="--slice-sweep's input widths K")
    args = ap.parse_args()
    if args.slice_sweep:
        return slice_sweep(map(int, args.inputs.split(",")), map(int, args.batches.split(",")))
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float16 if dev.type == "cuda" else torch.float32
    fmt = "mixed" if args.backend == "async_dequant" else "bcq"
    opts = {} if fmt == "mixed" else dict(bits=args.bits, group_size=64) if args.free_alpha else dict(
        bits=args.bits, group_size=64, init="uniform", iters=0)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for N, K in shapes:
        torch.manual_seed(0)
        lin = torch.nn.Linear(K, N, bias=False)
        layers = {rot: module_class(fmt).from_linear(lin, QLinearConfig(fmt, **opts, rotation=rot), backend=args.backend).to(
            dev, dtype) for rot in ("none", "hadamard")}
        seed, block = rotation.params(layers["hadamard"].config, K)
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            kernel = layers["hadamard"].kernel(x)
            fns = {"plain": lambda: layers["none"](x.clone()),
                   "rotated": lambda: layers["hadamard"](x.clone()),  # a fresh tensor: no shared transform
                   "alone": lambda: rotation.rotate_input(x.clone(), seed, block), "copy": lambda: x.clone()}
            if dev.type == "cuda":
                fns["torch alone"] = lambda: rotation.rotate(x.clone(), seed, block)
                if kernel.fuses_rotation:
                    fns["op transform"] = lambda: _unfused(kernel, lambda: layers["hadamard"](x.clone()))
            best = {k: float("inf") for k in fns}
            with torch.no_grad():
                names = list(fns)
                for r in range(args.rounds):  # interleaved rounds, best median of each: robust to a busy machine
                    for k in names[r % len(names):] + names[:r % len(names)]:  # each first in turn: the order moves
                        best[k] = min(best[k], timeit(fns[k], device=args.device))  # sub-µs times by ~0.5 µs
            plain, rotated, alone, copy = best["plain"], best["rotated"], best["alone"], best["copy"]
            rows.append([f"{N}x{K}", block, M, kernel.backend, plain - copy, rotated - copy,
                         best.get("op transform", float("nan")) - copy, alone - copy,
                         f"{(rotated - plain) / (plain - copy):+.0%}"])
            if dev.type == "cuda":  # the kernels alone: 20 calls per CUDA-graph replay, no Python, no launch gaps
                with torch.no_grad():
                    # (rotate_input's q/k/v sharing cache cleared before each call: where x is rotated outside the
                    # kernel, every call pays its transform)
                    graph = [gpu_time_us([lambda r=r: _fresh(lambda: layers[r](x))] * 20) for r in ("none", "hadamard")]
                    separate = (gpu_time_us([lambda: _fresh(lambda: _unfused(kernel, lambda: layers["hadamard"](x)))]
                                            * 20) if kernel.fuses_rotation else float("nan"))
                rows[-1] += [best["torch alone"] - copy, graph[0], graph[1], f"{graph[1] / graph[0] - 1:+.0%}",
                             separate]
    graph_cols = (["torch transform µs", "graph unrotated µs", "graph rotated µs", "graph overhead",
                   "graph op transform µs"]
                  if dev.type == "cuda" else [])
    print(table(["N x K", "block", "M", "kernel", "unrotated µs", "rotated µs", "op transform µs",
                 "transform alone µs", "overhead", *graph_cols], rows))


def slice_sweep(widths, batches) -> None:
    """``--slice-sweep`` (see the module docstring); fp16, seed 0."""
    from qlinear.backends import _gpu

    if not torch.cuda.is_available() or _gpu._rotate_library() is not None:
        sys.exit(f"needs a CUDA GPU and the cuda_rotate library: {_gpu._rotate_library()}")
    batches, rows = list(batches), []
    for K in widths:
        block = rotation.block_size(K)
        args = _gpu._kernel_rotation(0, block, K, torch.device("cuda"))
        n = block // rotation._split(block)[0]
        slices = [0, *(s for s in (16 << i for i in range(12)) if s <= block and K % s == 0), block]
        for M in batches:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            want = rotation.rotate(x.double(), 0, block)
            torch_us = gpu_time_us([lambda: rotation.rotate(x, 0, block)] * 20)
            for s in dict.fromkeys(slices):
                err = ((torch.ops.qlinear.cuda_rotate(x, *args, s).double() - want).abs().max() / want.abs().max()).item()
                us = gpu_time_us([lambda s=s: torch.ops.qlinear.cuda_rotate(x, *args, s)] * 20)
                rows.append([K, f"{block} (n = {n})", M, s or "plan", us, torch_us,
                             f"{err:.1e}" + (" WRONG" if err > 2.0 ** -9 else "")])
                print(rows[-1], flush=True)  # a run cut by its time limit keeps what it measured
    print(table(["K", "block", "M", "slice", "cuda_rotate µs", "PyTorch transform µs", "max rel error vs float64"],
                rows))


def _fresh(call):
    """``call()`` with rotate_input's sharing cache cleared first, so that a transform outside the kernel runs."""
    rotation._last = ()
    return call()


def _unfused(kernel, call):
    """``call()`` with ``kernel``'s module told that no rotated x fits its shared memory (the op's transform runs)."""
    module = sys.modules[kernel.fn.__module__]
    real = module.staged_rotation
    module.staged_rotation = lambda x, r, smem, budget: real(x, r, float("inf"), 0)
    try:
        return call()
    finally:
        module.staged_rotation = real


if __name__ == "__main__":
    main()
