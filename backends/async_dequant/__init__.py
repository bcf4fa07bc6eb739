"""CUDA GEMV for :class:`qlinear.MixedPrecisionLinear` with asynchronous dequantization (2/4/16-bit paper, §3-5).

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16, mixed 2/4-bit input-channel groups (``group_size`` a
multiple of 16), second-order quantized scales, fp16 CSR outliers (inside 2-bit groups by default), fp32 accumulation,
deterministic split-K.  The kernel (``mixed_gemv.cu``) runs M = 1..8 per launch; larger batches run it over
chunks of 8 rows.  It is registered up to ``MAX_BATCH = 64``: that this beats the fallback (dequantize +
cuBLAS) at M = 9..64, and where it stops beating cuBLAS fp16, must be confirmed by
``benchmarks/bench_gemv.py`` on the GPU (not measured yet).

Layout ``async_dequant`` (repacked once at load; exact inverse :func:`unrepack`).  With ``W = K2/16 + K4/8``
code words per row, ``T = ceil(W/4)`` tiles of 4 words, ``Tf = W // 4`` full tiles:

* ``ad_codes`` int32 ``[N·W]``: a *word* holds 16 2-bit codes or 8 4-bit codes of consecutive inputs of one
  group (canonical ``qweight2``/``qweight4`` words are exactly such words, so the code part is a permutation
  of canonical words).  Each row's words are merged in K order (a 4-bit group between 2-bit groups
  contributes ``g/8`` words, so a 4-bit group may straddle two tiles: the paper's alignment), then stored
  tile-major ``[Tf][N][4]`` (one aligned 16-byte load per row and tile, a warp reads 512 contiguous bytes)
  followed by the tail ``[N][W − 4·Tf]``: no padding.
* ``ad_meta`` int32 ``[MW, N]``: first-order zeros and scale codes, per row a bit stream of records
  ``zero | scale_code << zero_bits`` (``zero_bits`` 2 or 4 by group kind) in K order, word-major so the same
  meta word of consecutive rows is contiguous (coalesced); a record of group ``i`` starts at bit ``ad_gtab[i]``
  and may straddle two words (read with one funnel shift).
* ``ad_sq`` int32 ``[S2, G]``: second-order (scale_scale, scale_zero) as the two fp16 halves of one word,
  per chunk of ``scale_group_size`` rows and group (a row's sequence over K is contiguous).
* ``ad_gtab`` int32 ``[G]``: the per-layer group table, ``offset | is_4bit << 31`` with ``offset`` the bit
  offset of the group's record in a row's meta stream.  The sequence of group kinds is the same for every row
  (``idx4`` is per layer), so this one table drives every thread's loop: the offset also gives the number of
  4-bit groups before group ``i`` (``n4 = (offset − i·(2 + scale_bits)) / 2``), hence its first word
  ``(i + n4)·g/16``; each block expands its slice into a word table (``group | word_in_group << 20 |
  is_4bit << 31``) in shared memory.
* ``ad_idx4``: empty when ``idx4`` is a sorted set of distinct groups (it is then read back from ``ad_gtab``),
  else (the zero buffers of a freshly constructed module) ``idx4`` verbatim, so :func:`unrepack` stays exact.
* ``ad_outlier_values`` / ``ad_outlier_cols`` / ``ad_outlier_row_ptr``: the canonical CSR, unchanged.

Bits: the code words and records are exactly the canonical bits without the canonical per-row padding of
``zeros2``/``zeros4`` and without ``idx4``; the meta stream pads each row to a word (≤ 31 bits) and the
group table adds ``32·G`` bits per layer.  On the benchmark shapes the repacked form costs +0.0001 to +0.007
bit/weight; at K = 576 it is 0.02 *smaller* (the canonical per-row padding of the zeros weighs more there);
:func:`layout_bits` gives the exact count and the tests check it stays ≤ canonical + 0.02.

Why the records are not interleaved with the codes (the paper packs scales/zeros next to their codes): the
asynchronous pipeline dequantizes the scales of tile t+1 while that tile's codes are still in flight, so the
records must arrive ahead of the codes; a separate coalesced stream, read one group ahead through a two-word
register window, gives that, at the cost of one extra (mostly L1-hit) load stream.

Kernel (``mixed_gemv.cu``): a thread owns 2 rows, one 16-byte code load per row and tile; ``async_dequant=True``
issues the codes of tile t+1, runs the FMAs of tile t, then dequantizes tile t+1's scales (ŝ = scale_zero +
scale_scale·code) under those loads; ``async_dequant=False`` runs the same code synchronously (scales, then
codes, then FMAs) for the benchmark.  Outliers are fused: each block adds its rows' outliers whose column lies
in its K slice after its main loop, reading x from shared memory (any column, so ``outlier_placement="any"``
works too); ``linear(..., outliers="separate")`` runs the kernel without them plus a torch.sparse CSR SpMV,
for the benchmark's comparison.

:func:`spec` is the executable specification: the same tiles, splits, table decoding, funnel shift, index
arithmetic of the tile-major codes, ŝ = fma(scale_scale, code, scale_zero), per-word dot products and fused
outliers, in PyTorch; CPU tests check it against the reference backend, GPU tests check the kernel against
both.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import mixed
from qlinear.formats.base import spec_bits
from qlinear.formats.packing import pack, unpack

from .. import ANY, Kernel, Layout, register
from .._gpu import staged_rotation
from .._native import build_cuda_backend, dense_linear
from .._native import sm_count as _sms  # module attribute: tests replace it without a GPU

__all__ = ["LAYOUT", "MAX_BATCH", "NAMES", "plan", "spec", "repack", "unrepack", "linear", "supports", "available",
           "layout_bits", "num_words", "random_buffers", "dequantize", "linear_dequantized"]

MAX_BATCH = 64      # kernel M <= 8 per launch; 9..64 loops over chunks of 8 (to be confirmed by the benchmark)
KERNEL_M = 8
SMEM_CAP = 48 * 1024
_HERE = Path(__file__).parent
_MASK32 = 0xFFFFFFFF
NAMES = ("ad_codes", "ad_meta", "ad_sq", "ad_gtab", "ad_idx4", "ad_outlier_values", "ad_outlier_cols",
         "ad_outlier_row_ptr")
_OUTLIERS = (("outlier_values", "ad_outlier_values"), ("outlier_cols", "ad_outlier_cols"),
             ("outlier_row_ptr", "ad_outlier_row_ptr"))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & _MASK32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _valid_idx4(idx4: torch.Tensor, G: int) -> bool:
    i = idx4.long()
    return bool(((i >= 0) & (i < G)).all()) and bool((i.diff() > 0).all())


def _word_table(is4: torch.Tensor, g: int):
    """``(wtab int64 [W], src [W])``: word entries in K order (the kernel's shared-memory word table) and, per
    word, its column in ``cat([qweight2, qweight4], 1)``."""
    dev = is4.device
    per = torch.where(is4, g // 8, g // 16)                                  # words per group
    group = torch.repeat_interleave(torch.arange(is4.numel(), device=dev), per)
    first = torch.cumsum(per, 0) - per
    sub = torch.arange(group.numel(), device=dev) - first[group]
    w4 = is4[group]
    rank2 = torch.cumsum(~is4, 0) - (~is4).long()                             # rank among 2-bit groups
    rank4 = torch.cumsum(is4, 0) - is4.long()
    words2 = int((~is4).sum()) * (g // 16)
    src = torch.where(w4, words2 + rank4[group] * (g // 8) + sub, rank2[group] * (g // 16) + sub)
    wtab = group | (sub << 20) | (w4.long() << 31)
    return wtab, src


def _record_layout(is4: torch.Tensor, scale_bits: int):
    """``(zero_bits [G], width [G], offset [G], MW)`` of the per-row meta records."""
    zb = torch.where(is4, 4, 2)
    width = zb + scale_bits
    off = torch.cumsum(width, 0) - width
    return zb, width, off, -(-int(width.sum()) // 32)


def repack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Canonical mixed buffers -> layout ``async_dequant`` (module docstring).  Raises ValueError for a
    config the layout cannot hold (see :func:`supports`)."""
    why = supports(cfg, out_features, in_features)
    if why is not None:
        raise ValueError(why)
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    G = K // g
    dev = buffers["qweight2"].device
    is4 = mixed.group_kinds(buffers["idx4"], G)
    idx2, idx4 = torch.nonzero(~is4).flatten(), torch.nonzero(is4).flatten()
    _, src = _word_table(is4, g)
    W = src.numel()
    words = torch.cat([buffers["qweight2"], buffers["qweight4"]], 1)[:, src]          # [N, W], K order
    Tf = W // 4
    codes = torch.cat([words[:, :4 * Tf].reshape(N, Tf, 4).transpose(0, 1).reshape(-1), words[:, 4 * Tf:].reshape(-1)])
    z = torch.empty(N, G, dtype=torch.int64, device=dev)
    z[:, idx2] = unpack(buffers["zeros2"], 2, idx2.numel()).long()
    z[:, idx4] = unpack(buffers["zeros4"], 4, idx4.numel()).long()
    sc = unpack(buffers["scale_codes"], sb, N).long().T                                # [N, G]
    zb, width, off, MW = _record_layout(is4, sb)
    rec = z | (sc << zb)
    meta = torch.zeros(N, MW + 1, dtype=torch.int64, device=dev)
    j, sh = (off >> 5).expand(N, G), (off & 31)
    meta.scatter_add_(1, j, (rec << sh) & _MASK32)                    # records never overlap: sum == or
    meta.scatter_add_(1, j + 1, rec >> (32 - sh))
    sq = torch.stack([buffers["scale_scale"].T, buffers["scale_zero"].T], -1).contiguous().view(torch.int32)
    out = {"ad_codes": codes.contiguous(), "ad_meta": _to_int32(meta[:, :MW].T.contiguous()),
           "ad_sq": sq.reshape(sq.shape[0], G).contiguous(), "ad_gtab": _to_int32(off | (is4.long() << 31)),
           "ad_idx4": buffers["idx4"][:0] if _valid_idx4(buffers["idx4"], G) else buffers["idx4"]}
    out.update({new: buffers[old] for old, new in _OUTLIERS})
    return out


def unrepack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Layout ``async_dequant`` -> canonical mixed buffers (exact inverse of :func:`repack`)."""
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    G = K // g
    gtab = buffers["ad_gtab"].long() & _MASK32
    dev = gtab.device
    is4 = mixed.group_kinds(buffers["ad_idx4"], G) if buffers["ad_idx4"].numel() else (gtab >> 31) == 1
    idx2, idx4 = torch.nonzero(~is4).flatten(), torch.nonzero(is4).flatten()
    W = buffers["ad_codes"].numel() // N
    _, src = _word_table(is4, g)
    Tf = W // 4
    flat = buffers["ad_codes"]
    words = torch.empty(N, W, dtype=torch.int32, device=dev)
    words[:, :4 * Tf] = flat[:4 * Tf * N].reshape(Tf, N, 4).transpose(0, 1).reshape(N, 4 * Tf)
    words[:, 4 * Tf:] = flat[4 * Tf * N:].reshape(N, W - 4 * Tf)
    cat = torch.empty_like(words)
    cat[:, src] = words
    n2 = idx2.numel() * g // 16
    zb, width, off, MW = _record_layout(is4, sb)
    meta = torch.cat([buffers["ad_meta"].long().T & _MASK32, torch.zeros(N, 1, dtype=torch.int64, device=dev)], 1)
    j = (off >> 5).expand(N, G)
    rec = ((meta.gather(1, j) | (meta.gather(1, j + 1) << 32)) >> (off & 31)) & ((1 << width) - 1)
    z, sc = rec & ((1 << zb) - 1), rec >> zb
    pair = buffers["ad_sq"].contiguous().view(torch.float16).reshape(-1, G, 2)
    out = {"idx4": buffers["ad_idx4"] if buffers["ad_idx4"].numel() else idx4.to(torch.int32),
           "qweight2": cat[:, :n2].contiguous(), "qweight4": cat[:, n2:].contiguous(),
           "zeros2": pack(z[:, idx2], 2), "zeros4": pack(z[:, idx4], 4), "scale_codes": pack(sc.T.contiguous(), sb),
           "scale_scale": pair[..., 0].T.contiguous(), "scale_zero": pair[..., 1].T.contiguous()}
    out.update({old: buffers[new] for old, new in _OUTLIERS})
    return out


def dequantize(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (float32, fp16 or bf16) from the ``async_dequant`` buffers on a GPU
    (``mixed_dequant.cu``): :func:`qlinear.formats.mixed.dequantize`'s float32 values, outliers included, rounded once.
    With the default float32 it is the layout's ``dequantize`` (the backward pass)."""
    has = buffers["ad_outlier_values"].numel() > 0
    ov = [buffers[k] for _, k in _OUTLIERS] if has else [None, None, None]
    return torch.ops.qlinear.mixed_dequantize(buffers["ad_codes"], buffers["ad_meta"], buffers["ad_sq"],
                                              buffers["ad_gtab"], *ov, out_features, in_features, cfg.group_size,
                                              cfg.scale_bits, cfg.scale_group_size, dtype)


LAYOUT = Layout(name="async_dequant", names=lambda cfg: NAMES, repack=repack, unrepack=unrepack, dequantize=dequantize,
                dequantize_devices=frozenset({"cuda"}))


def layout_bits(cfg, out_features: int, in_features: int) -> tuple[float, float]:
    """``(canonical, repacked)`` exact bits per weight of a layer of this shape (every stored bit: codes,
    records, second-order pairs, tables, outliers, row pointers)."""
    N, K, g = out_features, in_features, cfg.group_size
    canon = mixed.buffer_specs(N, K, cfg)
    G, G4, nnz = cfg.counts(N, K)
    W = (G - G4) * g // 16 + G4 * g // 8
    MW = -(-((G - G4) * (2 + cfg.scale_bits) + G4 * (4 + cfg.scale_bits)) // 32)
    S2 = -(-N // cfg.scale_group_size)
    rep = 32 * (N * W + MW * N + S2 * G + G) + spec_bits({k: canon[k] for k, _ in _OUTLIERS})
    return spec_bits(canon) / (N * K), rep / (N * K)


MAX_THREADS_M8 = 128  # threads per block of the 8-row kernels (kMaxThreadsM8 in mixed_gemv.h)


def _resident(M: int, rotated: bool = False) -> int:
    """Threads per SM the kernel's register budget allows at ``M`` rows per launch (its ``__launch_bounds__``)."""
    return 768 if M <= (1 if rotated else 2) else 384 if M == KERNEL_M else 512


def _block_smem_cap(M: int, threads: int, rotated: bool = False) -> int:
    """Shared memory a block of ``threads`` may take at the occupancy :func:`plan` aims at."""
    return min(SMEM_CAP, 224 * 1024 * threads // _resident(M, rotated))


@functools.lru_cache(maxsize=4096)  # per call of every layer: a lookup instead of ~2 µs of arithmetic
def plan(M: int, N: int, K: int, W: int, sms: int, rotated: bool = False) -> tuple[int, int, int]:
    """Launch shape ``(threads, tiles_per_split, splits)`` for ``x`` ``[M, K]`` (M > 8 runs chunks of 8),
    ``N`` rows and ``W`` code words per row; ``rotated``: for the kernels that stage a rotated layer's ``R·x``.

    A thread owns 2 rows and a block ``2·threads`` rows; we aim at the resident threads per SM the kernel's
    register budget allows (768 at M <= 2, ≤ 80 registers, but 512 for a rotated layer at M = 2; 512 above, ≤ 128
    registers; 384 at M = 8, ≤ 168 registers, blocks of at most 128 threads) and pick, among 256/128/64/32-thread
    blocks, the split that minimises the L2 traffic it adds: the x slices staged per block (``blocks_n·K·2`` bytes
    per row of x) plus the fp32 split partials (``splits·N·8``).  A slice's inputs (``M·min(K, 64·tiles)·4`` bytes)
    must fit the shared memory a block may take at that occupancy (≤ 48 KiB)."""
    M = min(M, KERNEL_M)
    T = -(-W // 4)
    resident = _resident(M, rotated)
    best = None
    for threads in (256, 128, 64, 32):
        if M == KERNEL_M and threads > MAX_THREADS_M8:
            continue
        blocks_n = -(-N // (2 * threads))
        cap = _block_smem_cap(M, threads, rotated)
        tps_max = T if M * K * 4 + 16 * T <= cap else max(1, (cap - 16) // (M * 64 * 4 + 16))
        want = max(1, -(-sms * resident // threads // blocks_n))
        splits = max(-(-T // tps_max), min(want, T))
        per = -(-T // splits)
        splits = -(-T // per)
        cost = blocks_n * K * 2 + splits * N * 8 * (splits > 1) + (threads < 64) * N * K // 64
        if best is None or cost < best[0]:
            best = (cost, threads, per, splits)
    return best[1:]


def _entry(e: int, g: int) -> tuple[int, bool, int, int]:
    """Word table entry -> (group, is_4bit, first input, inputs in the word)."""
    e &= _MASK32
    grp, sub, is4 = e & 0xFFFFF, (e >> 20) & 0x7FF, bool(e >> 31)
    return grp, is4, grp * g + sub * (8 if is4 else 16), 8 if is4 else 16


def num_words(buffers: dict, cfg) -> int:
    """``W``, the code words per row of a layer held in layout ``async_dequant``."""
    G4 = int((buffers["ad_gtab"] < 0).sum())
    return (buffers["ad_gtab"].numel() - G4) * cfg.group_size // 16 + G4 * cfg.group_size // 8


def _slice_words(gtab: list, g: int, scale_bits: int, w_begin: int, w_end: int) -> list:
    """The word table of words ``[w_begin, w_end)``, expanded from the group table as a block of the kernel does:
    binary search for the group holding ``w_begin`` (group i starts at word ``(i + n4)·g/16``), then every group
    up to ``w_end`` writes its words."""
    first = lambda i: (i + ((gtab[i] & 0x7FFFFFFF) - i * (2 + scale_bits)) // 2) * (g // 16)
    lo, hi = 0, len(gtab) - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        lo, hi = (mid, hi) if first(mid) <= w_begin else (lo, mid - 1)
    words = [None] * (w_end - w_begin)
    for i in range(lo, len(gtab)):
        fw = first(i)
        if fw >= w_end:
            break
        is4 = (gtab[i] & _MASK32) >> 31
        for j in range(max(0, w_begin - fw), g // 8 if is4 else g // 16):
            if fw + j >= w_end:
                break
            words[fw + j - w_begin] = i | (j << 20) | (is4 << 31)
    assert None not in words, "group table does not cover the slice"
    return words


def spec(x: torch.Tensor, buffers: dict, bias: Optional[torch.Tensor], cfg, out_features: int, in_features: int,
         launch: tuple[int, int, int], fused_outliers: bool = True) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32), ``x`` ``[M, K]`` -> ``[M, N]`` float32.

    Follows ``mixed_gemv_kernel``: per split (``tiles_per_split`` tiles), the word table of its words expanded
    from the group table and the K span ``[k_lo, k_hi)`` of those words; per tile and word, the entry gives
    group, kind and first input; the code word of row n sits
    at ``(t·N + n)·4 + j`` (full tiles) or ``4·Tf·N + n·tail + j`` (tail); the record of the group is a
    funnel shift of meta words ``off >> 5`` and ``+1`` by ``off & 31``; ``ŝ = fma(scale_scale, code,
    scale_zero)``; ``acc += ŝ·Σ_i (q_i − z)·x_i``; then the split adds its rows' outliers with columns in its
    span (CSR order); partials are summed in split order, then the bias.
    """
    _, per, splits = launch
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    M, dev = x.shape[0], x.device
    xf = x.float()
    codes = buffers["ad_codes"].long() & _MASK32
    meta = buffers["ad_meta"].long() & _MASK32                            # [MW, N]
    MW = meta.shape[0]
    pair = buffers["ad_sq"].contiguous().view(torch.float16).reshape(-1, K // g, 2)
    gtab = [int(v) & _MASK32 for v in buffers["ad_gtab"].cpu()]
    W = num_words(buffers, cfg)
    T, Tf = -(-W // 4), W // 4
    tail = W - 4 * Tf
    n = torch.arange(N, device=dev)
    chunk = n // cfg.scale_group_size
    rows = torch.repeat_interleave(n, buffers["ad_outlier_row_ptr"].long().diff())
    ocols = buffers["ad_outlier_cols"].long()
    ovals = buffers["ad_outlier_values"].float()
    partial = torch.zeros(splits, M, N, device=dev)
    for s in range(splits):
        t0, t1 = s * per, min((s + 1) * per, T)
        w0, w1 = 4 * t0, min(4 * t1, W)
        wt = _slice_words(gtab, g, sb, w0, w1)                          # the block's shared-memory word table
        k_lo = _entry(wt[0], g)[2]
        last = _entry(wt[-1], g)
        k_hi = last[2] + last[3]
        acc = torch.zeros(M, N, device=dev)
        for t in range(t0, t1):
            for j in range(4):
                w = 4 * t + j
                if w >= w1:
                    break
                grp, is4, k0, cnt = _entry(wt[w - w0], g)
                word = codes[(t * N + n) * 4 + j] if t < Tf else codes[4 * Tf * N + n * tail + j]
                off = gtab[grp] & 0x7FFFFFFF
                lo = meta[off >> 5]
                hi = meta[(off >> 5) + 1] if (off >> 5) + 1 < MW else torch.zeros_like(lo)
                rec = (((hi << 32) | lo) >> (off & 31)) & _MASK32
                zb = 4 if is4 else 2
                z, code = rec & ((1 << zb) - 1), (rec >> zb) & ((1 << sb) - 1)
                ss, zz = pair[chunk, grp, 0].double(), pair[chunk, grp, 1].double()
                s_hat = (ss * code + zz).float()                             # one rounding, as fmaf
                q = (word[:, None] >> (zb * torch.arange(cnt, device=dev))) & ((1 << zb) - 1)
                f = (q - z[:, None]).float()                                 # [N, cnt], exact
                dot = xf[:, k0:k0 + cnt] @ f.T                               # [M, N]
                acc = acc + s_hat * dot
        if fused_outliers and ocols.numel():
            sel = (ocols >= k_lo) & (ocols < k_hi)
            acc.index_add_(1, rows[sel], ovals[sel] * xf[:, ocols[sel]])
        partial[s] = acc
    y = partial[0].clone()
    for s in range(1, splits):
        y += partial[s]
    return y if bias is None else y + bias.float()


def _sparse(buffers: dict, N: int, K: int, dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(buffers["ad_outlier_row_ptr"], buffers["ad_outlier_cols"].int(),
                                       buffers["ad_outlier_values"].to(dtype), (N, K), check_invariants=False)


def staged_smem_bytes(M: int, K: int, tiles_per_split: int, block: int) -> int:
    """Shared memory of a block staging a rotated layer's ``R·x``: x of its span in fp32, its word table, then the
    transform's fp32 work area of ``max(block, 256)`` floats (``mixed_gemv_smem_bytes`` in ``mixed_gemv.h``)."""
    own = 4 * min(M, KERNEL_M) * min(K, 64 * tiles_per_split) + 16 * tiles_per_split
    return -(-own // 16) * 16 + 4 * max(block, 256)


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int,
           async_dequant: bool = True, outliers: str = "fused", rotation: Optional[tuple[int, int]] = None
           ) -> torch.Tensor:
    """Registry entry: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most ``MAX_BATCH`` rows -> ``[..., N]``.

    ``async_dequant=False`` runs the same kernel synchronously (scales dequantized, then codes loaded), for
    the benchmark.  ``outliers="separate"`` leaves them out of the kernel and adds a torch.sparse CSR SpMV
    (fp32) instead, for the benchmark's comparison; ``"fused"`` (default) adds them inside the kernel.  A rotated
    layer's ``rotation = (seed, block)``: each block stages ``R·x`` of its span (of each chunk of 8 rows) itself where
    the transform's work area still fits its share of shared memory (:func:`staged_smem_bytes`), else x is rotated
    first (:func:`qlinear.backends._gpu.staged_rotation`).
    """
    N, K = out_features, in_features
    M = x.numel() // K
    rotated = rotation is not None
    threads, per_split, _ = launch = plan(M, N, K, buffers["ad_codes"].numel() // N, _sms(x.device.index or 0), rotated)
    smem = staged_smem_bytes(M, K, per_split, rotation[1]) if rotated else math.inf
    x, rot = staged_rotation(x, rotation, smem, _block_smem_cap(min(M, KERNEL_M), threads, rotated))
    x2 = x.reshape(-1, K).contiguous()
    fused = outliers == "fused"
    has = buffers["ad_outlier_values"].numel() > 0
    ov = [buffers[k] for _, k in _OUTLIERS] if fused and has else [None, None, None]
    y = torch.ops.qlinear.mixed_gemv(x2, buffers["ad_codes"], buffers["ad_meta"], buffers["ad_sq"],
                                     buffers["ad_gtab"], *ov, bias if fused or not has else None, N, cfg.group_size,
                                     cfg.scale_bits, cfg.scale_group_size, *launch, async_dequant, *rot)
    if not fused and has:
        yo = (_sparse(buffers, N, K, torch.float32) @ x2.float().T).T
        y = (y.float() + yo + (0 if bias is None else bias.float())).to(x.dtype)
    return y.reshape(*x.shape[:-1], N)


def linear_dequantized(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry above the GEMV's batches: :func:`dequantize` to ``x``'s dtype, then cuBLAS.  ``x`` ``[..., K]``
    fp16/bf16 on CUDA -> ``[..., N]``."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernel cannot run a mixed layer of this config and shape (None if it can)."""
    if cfg.group_size % 16:
        return f"group_size={cfg.group_size} is not a multiple of 16"
    if cfg.group_size > 16 * 2047:
        return f"group_size={cfg.group_size} is too large for the word table"
    if in_features // cfg.group_size >= 1 << 20:
        return f"in_features={in_features} has too many groups for the word table"
    return None


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_async_dequant", _HERE)


def random_buffers(out_features: int, in_features: int, cfg, seed: int = 0, device="cpu",
                   is4: Optional[torch.Tensor] = None) -> dict:
    """Random but valid canonical mixed buffers (benchmarks and GPU tests: quantizing large layers is slow).

    Codes, zeros and scale codes uniform; second-order scales/zeros give first-order scales in ~[0.002, 0.02];
    ``cfg.counts`` outliers at distinct random positions of 2-bit groups.  ``is4`` ``[G]`` bool overrides
    which groups are 4-bit (default: a random ``ratio_4bit`` fraction)."""
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    G, G4, nnz = cfg.counts(N, K)
    if is4 is None:
        is4 = torch.zeros(G, dtype=torch.bool, device=dev)
        is4[torch.randperm(G, generator=gen, device=dev)[:G4]] = True
    is4 = is4.to(dev)
    G4 = int(is4.sum())
    idx4, idx2 = torch.nonzero(is4).flatten(), torch.nonzero(~is4).flatten()
    G2 = G - G4
    S2 = -(-N // cfg.scale_group_size)
    r = lambda hi, *shape: torch.randint(0, hi, shape, generator=gen, device=dev)
    u = lambda *shape: torch.rand(shape, generator=gen, device=dev)
    specs = mixed.buffer_specs(N, K, cfg)
    out = {"idx4": idx4.to(torch.int32), "qweight2": pack(r(4, N, G2 * g), 2), "qweight4": pack(r(16, N, G4 * g), 4),
           "zeros2": pack(r(4, N, G2), 2), "zeros4": pack(r(16, N, G4), 4), "scale_codes": pack(r(1 << sb, G, N), sb),
           "scale_scale": (u(G, S2) * 0.018 / ((1 << sb) - 1)).half(), "scale_zero": (0.002 + 0.001 * u(G, S2)).half()}
    n2 = G2 * g                                     # outliers: distinct random positions among the 2-bit columns
    nnz = min(nnz, N * n2)
    flat = torch.zeros(0, dtype=torch.int64, device=dev)
    while flat.numel() < nnz:                       # sorted distinct draws (rejection: nnz <= 0.5% of the weights)
        flat = torch.unique(torch.cat([flat, r(N * n2, nnz + 64)]))
    flat = flat[torch.randperm(flat.numel(), generator=gen, device=dev)[:nnz]].sort().values
    rows, cols = flat // max(n2, 1), (idx2[:, None] * g + torch.arange(g, device=dev)).flatten()[flat % max(n2, 1)]
    order = torch.argsort(rows * K + cols)
    rows, cols = rows[order], cols[order]
    row_ptr = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    row_ptr[1:] = torch.bincount(rows, minlength=N).cumsum(0)
    out.update({"outlier_values": (0.05 * torch.randn(nnz, generator=gen, device=dev)).half(),
                "outlier_cols": cols.to(specs["outlier_cols"][1]), "outlier_row_ptr": row_ptr.to(torch.int32)})
    assert all(tuple(out[k].shape) == tuple(s) and out[k].dtype == d for k, (s, d) in specs.items()), "spec mismatch"
    return out


_COMMON = dict(format="mixed", devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), bits=ANY,
               group_sizes=ANY, min_capability=(8, 0), supports=supports, available=available, layout=LAYOUT)
register(Kernel(backend="async_dequant", fn=linear, priority=10, max_batch=MAX_BATCH, fuses_rotation=True, **_COMMON))
# every batch beyond: dequantize + cuBLAS, so that no mixed layer falls back to the reference on a GPU
register(Kernel(backend="mixed_dequant", fn=linear_dequantized, priority=5, max_batch=ANY, **_COMMON))
