"""Tensor-parallel MLP with act_order weights: naive (all-gather, "TP-Aware Dequantization" Alg. 2) vs TP-aware
(Alg. 3, no all-gather), on CPU with gloo.

    python benchmarks/bench_tp.py [--world 2] [--shapes llama70b,granite20b] [--batches 1,2,4,8,16] [--reps 5]
    python benchmarks/bench_tp.py --single cuda      # TP=1: act_order kernel cost on one device

Each rank holds only its shards, built directly with random 4-bit g128 act_order codes (the values do not change
the timing): gate/up column-parallel (I/W output rows each), down row-parallel over its stored-order input
shard; the down permutation P2 is shared.  Naive: gate/up take their natural rows, Y1 is all-gathered and
indexed by P2's shard.  TP-aware: gate/up take P2's shard of rows, so no all-gather.  Both end with one
all-reduce.  Reported: median ms per MLP forward over ``--reps`` calls (after one warm-up) on rank 0, bytes
sent per forward by one rank, and naive/TP-aware.  The local matmuls use the ``arm_neon`` backend when it
builds (SIMDe on x86), else the reference backend.

``--single DEVICE`` times, for the gate/up and down layers of each MLP on one device (TP=1), an act_order
layer as qlinear runs it (reordered, the kernel or the op gathering ``x[..., perm]``), the same-size layer
without act_order (the kernel alone), the unreordered g_idx path of a plain PyTorch GPTQ fallback
(``W = scales[:, g_idx]·(codes − zeros[:, g_idx])`` from unpacked uint8 codes, then a dense matmul, per call)
and the dense matmul (fp16 cuBLAS on GPU, fp32 on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"llama70b": (8192, 28672, 8192), "granite20b": (6144, 24576, 6144)}


def _layer(in_f: int, out_f: int, backend: str, act_order: bool = False):
    from qlinear import BCQLinear
    from qlinear.formats import bcq

    g = torch.Generator().manual_seed(in_f * 7 + out_f)
    G = in_f // 128
    cfg, bufs = bcq.from_uniform(torch.randint(0, 16, (out_f, in_f), generator=g),
                                 (torch.rand(out_f, G, generator=g) * 0.01 + 0.001).half(),
                                 torch.randint(0, 16, (out_f, G), generator=g), 4, 128)
    cfg = dataclasses.replace(cfg, act_order=act_order)
    if act_order:
        bufs["perm"] = torch.randperm(in_f, generator=g).to(torch.int32)
    return BCQLinear.from_packed(bufs, in_f, out_f, cfg, backend=backend)


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    from qlinear.backends import arm_neon
    from qlinear.integrations import tensor_parallel as tp

    backend = "arm_neon" if arm_neon.available() is None else "reference"
    rows = []
    for shape in args.shapes.split(","):
        K1, I, N2 = SHAPES[shape]
        i0, i1 = rank * I // world, (rank + 1) * I // world
        p2 = torch.randperm(I, generator=torch.Generator().manual_seed(0))
        gate, up = _layer(K1, i1 - i0, backend), _layer(K1, i1 - i0, backend)
        down = _layer(i1 - i0, N2, backend)
        mlps = {"naive": tp.RowParallel(down, None, None, gather=p2[i0:i1]), "tp_aware": tp.RowParallel(down, None, None)}
        for M in map(int, args.batches.split(",")):
            x = torch.randn(M, K1, generator=torch.Generator().manual_seed(M))
            res = {}
            for mode, row in mlps.items():
                def fwd():
                    return row(torch.nn.functional.silu(gate(x)) * up(x))

                with torch.no_grad():
                    fwd()
                    b0 = tp.STATS["bytes"]
                    fwd()
                    sent = tp.STATS["bytes"] - b0
                    times = []
                    for _ in range(args.reps):
                        dist.barrier()
                        t = time.perf_counter()
                        fwd()
                        times.append((time.perf_counter() - t) * 1e3)
                res[mode] = (statistics.median(times), sent)
            rows.append([shape, f"{K1}->{I}->{N2}", M, res["naive"][0], res["tp_aware"][0], res["naive"][1],
                         res["tp_aware"][1], res["naive"][0] / res["tp_aware"][0]])
            if rank == 0:
                print(rows[-1], flush=True)
    if rank == 0:
        out.put((backend, rows))
    dist.destroy_process_group()


def _uniform(K: int, N: int, g_idx: bool, device: str):
    g = torch.Generator().manual_seed(K * 3 + N)
    G = K // 128
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    scales = (torch.rand(N, G, generator=g) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (N, G), generator=g)
    idx = None
    if g_idx:  # an act_order g_idx: groups of 128 consecutive inputs in a random order of the inputs
        idx = torch.empty(K, dtype=torch.int32)
        idx[torch.randperm(K, generator=g)] = (torch.arange(K) // 128).to(torch.int32)
    return codes.to(device), scales.to(device), zeros.to(device), idx if idx is None else idx.to(device)


def single_device_rows(shapes: dict, batches: list[int], device: str, reps: int = 25) -> list[list]:
    """Rows of the ``--single`` table (see the module docstring): per (MLP, layer, M) the µs of each path."""
    from qlinear import BCQLinear

    sys.path.insert(0, str(Path(__file__).parent))
    from common import gpu_time_us, timeit

    def us(fn):
        return gpu_time_us([fn], replays=reps) if device.startswith("cuda") else timeit(fn, warmup=1, iters=reps)

    rows = []
    for shape, (K1, I, N2) in shapes.items():
        for layer, (K, N) in (("gate/up", (K1, I)), ("down", (I, N2))):
            codes, scales, zeros, g_idx = _uniform(K, N, True, "cpu")
            reordered = BCQLinear.from_uniform(codes, scales, zeros, bits=4, group_size=128, g_idx=g_idx).to(device)
            plain = BCQLinear.from_uniform(codes, scales, zeros, bits=4, group_size=128).to(device)
            codes, scales, zeros, g_idx = codes.to(device), scales.to(device), zeros.to(device), g_idx.to(device).long()
            dense = plain.dequantize(torch.float16 if device.startswith("cuda") else torch.float32)
            dt = dense.dtype

            def g_idx_path(x):
                w = scales[:, g_idx].to(dt) * (codes.to(dt) - zeros[:, g_idx].to(dt))
                return x @ w.T

            for M in batches:
                x = torch.randn(M, K, device=device, dtype=dt)
                with torch.no_grad():
                    t = {"act_order": us(lambda: reordered(x)), "plain": us(lambda: plain(x)),
                         "g_idx": us(lambda: g_idx_path(x)), "dense": us(lambda: x @ dense.T)}
                rows.append([shape, layer, f"{N}x{K}", M, reordered.kernel(x).backend, t["act_order"], t["plain"],
                             t["g_idx"], t["dense"], t["act_order"] / t["plain"], t["g_idx"] / t["act_order"]])
                print(rows[-1], flush=True)
    return rows


SINGLE_HEADER = ["MLP", "layer", "NxK", "M", "kernel", "act_order reordered (us)", "no act_order (us)",
                 "g_idx dequant + matmul (us)", "dense matmul (us)", "act_order / no act_order", "g_idx / reordered"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shapes", default="llama70b,granite20b")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--single", metavar="DEVICE", help="TP=1 act_order kernel table on DEVICE (e.g. cuda)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from common import table

    if args.single:
        shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
        rows = single_device_rows(shapes, [int(b) for b in args.batches.split(",")], args.single)
        if args.single.startswith("cuda"):
            from common import gpu_run_header
            print(gpu_run_header()[0])
        print(f"{datetime.date.today()}, TP=1 on {args.single}, 4-bit g128 act_order, x and dense weight in "
              f"{'fp16' if args.single.startswith('cuda') else 'fp32'}")
        print(table(SINGLE_HEADER, rows))
        return

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    backend, rows = q.get(timeout=3600)
    for p in procs:
        p.join(timeout=600)
    print(f"{datetime.date.today()}, CPU gloo, world {args.world}, {os.cpu_count()} cores, local kernel: {backend}, "
          f"4-bit g128 act_order")
    print(table(["MLP", "K1->I->N2", "M", "naive (ms)", "TP-aware (ms)", "naive bytes sent", "TP-aware bytes sent",
                 "naive / TP-aware"], rows))


if __name__ == "__main__":
    main()
