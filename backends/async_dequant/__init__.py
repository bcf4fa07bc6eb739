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
  meta word of consecutive rows is contiguous (coalesced).  The records of the (at most four) groups a tile
  touches lie within 64 bits (96 with ``scale_bits = 8``) from meta word ``ttab[t]``: a tile loads that window
  with its codes, and a word's record is a funnel shift of it.
* ``ad_sqt`` int32 ``[T, S2, P]``: second-order (scale_scale, scale_zero) as the two fp16 halves of one word, per
  tile, chunk of ``scale_group_size`` rows and slot: one 16-, 8- or 4-byte load per row and tile.  ``P``
  (:func:`pairs_per_tile`) is the most groups a tile can touch: 4 at group size 16, where the slots are the tile's
  words (a 4-bit group's pair is stored for both its words, so the kernel picks word j's pair without a select);
  1 where 64 divides it, else 2, where they are the tile's groups in order (0 for an unused slot).  A group
  straddling two tiles has its pair in both.
* ``ad_tab`` int32 ``[G + W + T]``, the per-layer tables (the sequence of group kinds is the same for every row:
  ``idx4`` is per layer, so they drive every thread's loop): ``gtab [G]`` = ``offset | is_4bit << 31`` with
  ``offset`` the bit offset of the group's record in a row's meta stream (which also gives the number of 4-bit
  groups before group ``i``, ``n4 = (offset − i·(2 + scale_bits)) / 2``, hence its first word ``(i + n4)·g/16``);
  ``wtab [W]`` = ``k_start | record_bit << 20 | slot << 27 | same_group << 30 | is_4bit << 31`` per word (its first
  input, its group's record bit counted from the start of its tile's meta window, its pair's slot in ``ad_sqt``, and
  whether the tile's previous word is of the same group);
  ``ttab [T]`` = each tile's first meta word.  A block
  copies its slice of ``wtab`` and ``ttab`` into shared memory.
* ``ad_idx4``: empty when ``idx4`` is a sorted set of distinct groups (it is then read back from ``gtab``),
  else (the zero buffers of a freshly constructed module) ``idx4`` verbatim, so :func:`unrepack` stays exact.
* ``ad_outlier_values`` / ``ad_outlier_cols`` / ``ad_outlier_row_ptr``: the canonical CSR, unchanged.

Bits: the code words and records are exactly the canonical bits without the canonical per-row padding of
``zeros2``/``zeros4`` and without ``idx4``; the meta stream pads each row to a word (≤ 31 bits), the per-tile
second-order pairs repeat a group's pair in both tiles where it straddles two, for both words of a 4-bit group at
group size 16, and leave unused slots empty, and
the tables add ``32·(G + W + T)`` bits per layer.  :func:`layout_bits` gives the exact count; the tests check it
stays ≤ canonical + 0.05 bits per weight.

Kernel (``mixed_gemv.cu``): a thread owns 2 rows; per tile and row it loads the 16 bytes of codes, the meta window
and the tile's second-order pairs in one stage.  ``async_dequant=True`` issues tile t+1's loads, runs tile t's
arithmetic, then dequantizes tile t+1's scales (ŝ = scale_zero + scale_scale·code) and zeros; ``async_dequant=False``
runs the same code synchronously (records and pairs loaded and dequantized, then the codes loaded) for the
benchmark.  The products run on half2: each block stages its slice of x once as fp16, scaled per row of x by a
power of two ``2^s`` (max |x·2^s| ≤ 1024, so no word's partial sum can overflow; exact for fp16 and bf16 inputs
but where ``x·2^s`` falls below fp16's normal range, 2^-14),
with a word's inputs ``i`` and ``i + n/2`` paired; a code pair becomes ``q − z`` as half2 exactly (one ``lop3`` into the
mantissa of ``2^(10−p)``, one ``hsub2``) and one ``hfma2`` per pair adds it into the word's half2 sum (≤ 8 products
per lane, fp16 rounding); the word's sum goes to fp32, ``acc = fma(ŝ, sum, acc)`` in fp32, and ``acc·2^−s`` at the end.
Outliers are fused: each block adds its rows' outliers whose column lies in its K slice after its main loop (fp32,
any column, so ``outlier_placement="any"`` works too); ``linear(..., outliers="separate")`` runs the kernel without
them plus a torch.sparse CSR SpMV, for the benchmark's comparison.

:func:`spec` is the executable specification: the same tiles, splits, tables, meta windows and funnel shifts,
index arithmetic of the tile-major codes and pairs, ŝ = fma(scale_scale, code, scale_zero), scaled fp16 inputs,
per-word half2 sums (fp16 rounding, in the kernel's order) and fused outliers, in PyTorch; CPU tests check it
against the reference backend, GPU tests check the kernel against both.

``mixed_canonical`` (every batch): layers the layout cannot hold (group sizes not a multiple of 16) stay canonical;
:func:`dequantize_canonical` writes their ``Ŵ`` from the canonical buffers (``mixed_dequant.cu``, any group size),
then cuBLAS.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
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
NAMES = ("ad_codes", "ad_meta", "ad_sqt", "ad_tab", "ad_idx4", "ad_outlier_values", "ad_outlier_cols",
         "ad_outlier_row_ptr")
_OUTLIERS = (("outlier_values", "ad_outlier_values"), ("outlier_cols", "ad_outlier_cols"),
             ("outlier_row_ptr", "ad_outlier_row_ptr"))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & _MASK32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _valid_idx4(idx4: torch.Tensor, G: int) -> bool:
    i = idx4.long()
    return bool(((i >= 0) & (i < G)).all()) and bool((i.diff() > 0).all())


def _record_layout(is4: torch.Tensor, scale_bits: int):
    """``(zero_bits [G], width [G], offset [G], MW)`` of the per-row meta records."""
    zb = torch.where(is4, 4, 2)
    width = zb + scale_bits
    off = torch.cumsum(width, 0) - width
    return zb, width, off, -(-int(width.sum()) // 32)


def _tables(is4: torch.Tensor, g: int, scale_bits: int) -> dict:
    """The layout's per-layer tables from the group kinds ``is4`` ``[G]`` bool (module docstring), int64:
    ``gtab [G]``, ``wtab [W]``, ``ttab [T]``, each group's first word ``first [G]``, and per word its group ``grp [W]``,
    its pair's ``slot [W]`` and its column ``src [W]`` in ``cat([qweight2, qweight4], 1)``."""
    dev = is4.device
    per = torch.where(is4, g // 8, g // 16)                                  # words per group
    grp = torch.repeat_interleave(torch.arange(is4.numel(), device=dev), per)
    first = torch.cumsum(per, 0) - per
    sub = torch.arange(grp.numel(), device=dev) - first[grp]
    w4 = is4[grp]
    rank2 = torch.cumsum(~is4, 0) - (~is4).long()                             # rank among 2-bit groups
    rank4 = torch.cumsum(is4, 0) - is4.long()
    words2 = int((~is4).sum()) * (g // 16)
    src = torch.where(w4, words2 + rank4[grp] * (g // 8) + sub, rank2[grp] * (g // 16) + sub)
    _, _, off, _ = _record_layout(is4, scale_bits)
    W = grp.numel()
    tile = torch.arange(W, device=dev) // 4
    ttab = off[grp[::4]] >> 5                                                  # the group of each tile's first word
    record_bit = off[grp] - 32 * ttab[tile]
    k_start = grp * g + sub * torch.where(w4, 8, 16)
    new = torch.ones(W, dtype=torch.bool, device=dev)                        # a word opening a group in its tile
    new[1:] = (grp[1:] != grp[:-1]) | (tile[1:] != tile[:-1])
    if pairs_per_tile(g, int(is4.sum()), is4.numel()) == 4:
        slot = torch.arange(W, device=dev) % 4                                # a pair per word
    else:
        slot = torch.cumsum(new, 0) - 1
        slot = slot - slot[4 * tile]                                          # its group's place among the tile's
        if W and int(slot.max()) >= 2:  # the layout invariant the kernel's two pair slots rely on
            raise RuntimeError(f"async_dequant layout bug: a tile touches {int(slot.max()) + 1} groups, the "
                               f"kernel reads at most 2 (group_size {g}); please report it")
    return {"gtab": off | (is4.long() << 31),
            "wtab": k_start | (record_bit << 20) | (slot << 27) | ((~new).long() << 30) | (w4.long() << 31),
            "ttab": ttab,
            "first": first, "grp": grp, "src": src, "slot": slot}


def pairs_per_tile(group_size: int, G4: int, G: int) -> int:
    """``P``, the second-order pairs ``ad_sqt`` holds per tile and row chunk (one 4-, 8- or 16-byte load): the most
    groups a tile of 4 words can touch, for ``G4`` of ``G`` groups 4-bit.  A group takes ``g/16`` (2-bit) or ``g/8``
    words: with one word per group (2-bit groups of 16) a tile touches 4; where every group's word count is a multiple
    of 4 (it starts on a tile) 1; else 2 (groups of ≥ 2 words, starting on even words where each has 2)."""
    sizes = {n for n, present in ((group_size // 16, G4 < G), (group_size // 8, G4 > 0)) if present}
    return 4 if 1 in sizes else 1 if all(n % 4 == 0 for n in sizes) else 2


def _sq_words(buffers: dict) -> torch.Tensor:
    """Canonical second-order pairs as int32 ``[S2, G]``: fp16 scale_scale (low half), scale_zero (high half)."""
    return torch.stack([buffers["scale_scale"].T, buffers["scale_zero"].T], -1).contiguous().view(torch.int32)[..., 0]


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
    tab = _tables(is4, g, sb)
    W = tab["src"].numel()
    words = torch.cat([buffers["qweight2"], buffers["qweight4"]], 1)[:, tab["src"]]   # [N, W], K order
    Tf, T = W // 4, -(-W // 4)
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
    sq = _sq_words(buffers)                                            # [S2, G]
    sqt = torch.zeros(T, pairs_per_tile(g, idx4.numel(), G), sq.shape[0], dtype=torch.int32, device=dev)
    sqt[torch.arange(W, device=dev) // 4, tab["slot"]] = sq[:, tab["grp"]].T
    out = {"ad_codes": codes.contiguous(), "ad_meta": _to_int32(meta[:, :MW].T.contiguous()),
           "ad_sqt": sqt.transpose(1, 2).contiguous(),
           "ad_tab": _to_int32(torch.cat([tab["gtab"], tab["wtab"], tab["ttab"]])),
           "ad_idx4": buffers["idx4"][:0] if _valid_idx4(buffers["idx4"], G) else buffers["idx4"]}
    out.update({new: buffers[old] for old, new in _OUTLIERS})
    return out


def unrepack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Layout ``async_dequant`` -> canonical mixed buffers (exact inverse of :func:`repack`)."""
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    G = K // g
    gtab = buffers["ad_tab"][:G].long() & _MASK32
    dev = gtab.device
    is4 = mixed.group_kinds(buffers["ad_idx4"], G) if buffers["ad_idx4"].numel() else (gtab >> 31) == 1
    idx2, idx4 = torch.nonzero(~is4).flatten(), torch.nonzero(is4).flatten()
    W = buffers["ad_codes"].numel() // N
    tab = _tables(is4, g, sb)
    src = tab["src"]
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
    first = tab["first"]
    pair = buffers["ad_sqt"][first // 4, :, tab["slot"][first]].T.reshape(-1).view(torch.float16).reshape(-1, G, 2)
    out = {"idx4": buffers["ad_idx4"] if buffers["ad_idx4"].numel() else idx4.to(torch.int32),
           # copies even where .contiguous() would hand back a view of cat (an empty slice: no 4-bit groups)
           "qweight2": cat[:, :n2].clone(memory_format=torch.contiguous_format),
           "qweight4": cat[:, n2:].clone(memory_format=torch.contiguous_format),
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
    return torch.ops.qlinear.mixed_dequantize(buffers["ad_codes"], buffers["ad_meta"], buffers["ad_sqt"],
                                              buffers["ad_tab"], *ov, out_features, in_features, cfg.group_size,
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
    T = -(-W // 4)
    rep = 32 * (N * W + MW * N + T * S2 * pairs_per_tile(g, G4, G) + G + W + T) + spec_bits({k: canon[k] for k, _ in _OUTLIERS})
    return spec_bits(canon) / (N * K), rep / (N * K)


MAX_THREADS_M8 = 128  # threads per block of the 8-row kernels (kMaxThreadsM8 in mixed_gemv.h)


def _resident(M: int) -> int:
    """Threads per SM the kernel's register budget allows at ``M`` rows per launch (its ``__launch_bounds__``)."""
    return 768 if M == 1 else 384 if M == KERNEL_M else 512


def _block_smem_cap(M: int, threads: int) -> int:
    """Shared memory a block of ``threads`` may take at the occupancy :func:`plan` aims at."""
    return min(SMEM_CAP, 224 * 1024 * threads // _resident(M))


@functools.lru_cache(maxsize=4096)  # per call of every layer: a lookup instead of ~2 µs of arithmetic
def plan(M: int, N: int, K: int, W: int, sms: int) -> tuple[int, int, int]:
    """Launch shape ``(threads, tiles_per_split, splits)`` for ``x`` ``[M, K]`` (M > 8 runs chunks of 8),
    ``N`` rows and ``W`` code words per row.

    A thread owns 2 rows and a block ``2·threads`` rows; we aim at the resident threads per SM the kernel's
    register budget allows (768 at M = 1, ≤ 80 registers; 512 above, ≤ 128 registers; 384 at M = 8, ≤ 168
    registers, blocks of at most 128 threads) with the most splits whose blocks all fit on the GPU at once: one more
    split would leave a tail wave that costs a whole block's time (benchmarks/kernel_model.py --mixed; on the H100 on
    2026-11-23, 28672x8192 took 205 µs at M = 4, with 280 blocks for 264 places, against 130 at M = 2 and 217 at
    M = 8).  Among 256/128/64/32-thread blocks we pick the split that minimises the L2 traffic it adds: the x slices
    staged per block (``blocks_n·K·2`` bytes per row of x) plus the fp32 split partials (``splits·N·8``).  A slice's
    inputs (``M·min(K, 64·tiles)·6`` bytes: fp32 and scaled fp16) and tables must fit the shared memory a block may
    take at that occupancy (≤ 48 KiB)."""
    M = min(M, KERNEL_M)
    T = -(-W // 4)
    resident = _resident(M)
    best = None
    for threads in (256, 128, 64, 32):
        if M == KERNEL_M and threads > MAX_THREADS_M8:
            continue
        blocks_n = -(-N // (2 * threads))
        cap = _block_smem_cap(M, threads)
        tps_max = T if _smem(M, K, T) <= cap else max(1, (cap - 64) // (M * 64 * 6 + 20))
        want = max(1, sms * resident // threads // blocks_n)
        splits = max(-(-T // tps_max), min(want, T))
        per = -(-T // splits)
        splits = -(-T // per)
        cost = blocks_n * K * 2 + splits * N * 8 * (splits > 1) + (threads < 64) * N * K // 64
        if best is None or cost < best[0]:
            best = (cost, threads, per, splits)
    return best[1:]


def _smem(M: int, K: int, tiles_per_split: int) -> int:
    """Shared memory of a block without a rotation (``mixed_gemv_smem_bytes`` in ``mixed_gemv.h``): x of its span in
    fp32 and as scaled fp16, the slice's word and tile tables, the rows' |x| maxima, rounded up to 16 bytes."""
    own = 6 * min(M, KERNEL_M) * min(K, 64 * tiles_per_split) + 20 * tiles_per_split + 32
    return -(-own // 16) * 16


def _entry(e: int) -> tuple[int, int, bool, int]:
    """Word table entry -> (first input, record bit in the tile's meta window, is_4bit, inputs in the word); bits 27-28
    hold its pair's slot in ``ad_sqt``, bit 30 whether the tile's previous word is of the same group."""
    e &= _MASK32
    is4 = bool(e >> 31)
    return e & 0xFFFFF, (e >> 20) & 0x7F, is4, 8 if is4 else 16


def num_words(buffers: dict, cfg) -> int:
    """``W``, the code words per row of a layer held in layout ``async_dequant``: ``ad_tab`` holds ``G + W + T``
    entries with ``T = ceil(W/4)`` tiles (the first dimension of ``ad_sqt``) and ``W = (G + G4)·g/16``."""
    T, n = buffers["ad_sqt"].shape[0], buffers["ad_tab"].numel()
    # n − T = G + W = G + (G + G4)·g/16, with G4 the negative entries among the first G
    for W in range(max(0, 4 * T - 3), 4 * T + 1):
        G = n - T - W
        if 0 < G <= W and (G + int((buffers["ad_tab"][:G] < 0).sum())) * cfg.group_size // 16 == W:
            return W
    raise ValueError("ad_tab and ad_sqt do not describe an async_dequant layout")


def x_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The power of two ``s`` ``[M]`` int64 by which a block scales each row of its x slice before rounding it to fp16:
    ``max |x·2^s| ≤ 1024`` (from the exponent field of ``amax``, the largest non-NaN |x| of the row in float32), so a
    word's half2 sum cannot overflow; 0 where ``amax`` is 0, inf or NaN; at most 126."""
    bits = amax.float().view(torch.int32).long()
    e = (bits >> 23) & 255
    s = (136 - e.clamp(min=1)).clamp(max=126)
    return torch.where((amax == 0) | (e == 255), 0, s)


def _fma16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fma.rn.f16``: ``a·b + c`` rounded once to fp16.  The sum is exact in float64 for the kernel's operands (fp16
    values, integer ``a``); numpy rounds float64 to fp16 directly, where torch would round through float32 (twice)."""
    exact = (a.double() * b.double() + c.double()).cpu().numpy()
    return torch.from_numpy(exact.astype(np.float16)).to(c.device)


def spec(x: torch.Tensor, buffers: dict, bias: Optional[torch.Tensor], cfg, out_features: int, in_features: int,
         launch: tuple[int, int, int], fused_outliers: bool = True) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, ``x`` ``[M, K]`` -> ``[M, N]`` float32.

    Follows ``mixed_gemv_kernel``: per split (``tiles_per_split`` tiles), the K span ``[k_lo, k_hi)`` of its words
    (``wtab``) and x of that span scaled per row by ``2^s`` (:func:`x_scale_exponent`) and rounded to fp16; per tile,
    the meta window from word ``ttab[t]`` and the pairs ``ad_sqt[t, chunk]``; per word, its record a funnel shift of
    the window by its record bit, ``ŝ = fma(scale_scale, code, scale_zero)``, the code word of row n at ``(t·N + n)·4 +
    j`` (full tiles) or ``4·Tf·N + n·tail + j`` (tail), the half2 sums ``Σ_i (q_i − z)·x_i`` over the word's inputs
    ``i`` and ``i + n/2`` (fp16 fused multiply-adds in order), ``acc = fma(ŝ, lo + hi, acc)``; then ``acc·2^−s``, the
    split's outliers with columns in its span (CSR order), partials summed in split order, then the bias.
    """
    _, per, splits = launch
    N, K, g, sb = out_features, in_features, cfg.group_size, cfg.scale_bits
    M, dev = x.shape[0], x.device
    G = K // g
    xf = x.float()
    codes = buffers["ad_codes"].long() & _MASK32
    meta = buffers["ad_meta"].long() & _MASK32                            # [MW, N]
    meta = torch.cat([meta, torch.zeros(2, N, dtype=torch.int64, device=dev)])  # reads past MW give 0, as the kernel's
    sqt = buffers["ad_sqt"].reshape(-1).view(torch.float16).reshape(*buffers["ad_sqt"].shape, 2)  # [T, S2, P, 2]
    tab = [int(v) & _MASK32 for v in buffers["ad_tab"].cpu()]
    T = sqt.shape[0]
    W = len(tab) - G - T
    wtab, ttab = tab[G:G + W], tab[G + W:]
    Tf = W // 4
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
        k_lo = _entry(wtab[w0])[0]
        last = _entry(wtab[w1 - 1])
        k_hi = last[0] + last[3]
        xs = xf[:, k_lo:k_hi]
        e = x_scale_exponent(xs.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(1))
        xh = (xs * torch.ldexp(torch.ones(M, device=dev), e)[:, None]).half()
        acc = torch.zeros(M, N, device=dev)
        for t in range(t0, t1):
            j0 = ttab[t]
            win = [meta[j0 + i] for i in range(3)]                    # j0 < MW: the padding covers j0 + 2
            for j in range(4):
                w = 4 * t + j
                if w >= w1:
                    break
                k0, rb, is4, cnt = _entry(wtab[w])
                slot = (wtab[w] >> 27) & 3
                lo, hi = (win[0], win[1]) if rb < 32 else (win[1], win[2])
                rec = (((hi << 32) | lo) >> (rb & 31)) & _MASK32
                zb = 4 if is4 else 2
                z, code = rec & ((1 << zb) - 1), (rec >> zb) & ((1 << sb) - 1)
                ss, zz = sqt[t, chunk, slot, 0].double(), sqt[t, chunk, slot, 1].double()
                s_hat = (ss * code + zz).float()                             # one rounding, as fmaf
                word = codes[(t * N + n) * 4 + j] if t < Tf else codes[4 * Tf * N + n * tail + j]
                q = (word[:, None] >> (zb * torch.arange(cnt, device=dev))) & ((1 << zb) - 1)
                d = (q - z[:, None]).half()                                  # [N, cnt], exact
                half = cnt // 2
                lanes = []
                for lane in range(2):
                    h = torch.zeros(M, N, dtype=torch.float16, device=dev)
                    for i in range(half):
                        c = lane * half + i
                        h = _fma16(d[None, :, c], xh[:, k0 - k_lo + c, None], h)
                    lanes.append(h.float())
                # fmaf: float64 holds the product exactly; the sum is rounded twice where it needs more than 53 bits
                acc = (s_hat.double() * (lanes[0] + lanes[1]).double() + acc.double()).float()
        acc = acc * torch.ldexp(torch.ones(M, device=dev), -e)[:, None]
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
    """Shared memory of a block staging a rotated layer's ``R·x``: :func:`_smem`, then the transform's fp32 work area
    of ``max(block, 256)`` floats (``mixed_gemv_smem_bytes`` in ``mixed_gemv.h``)."""
    return _smem(M, K, tiles_per_split) + 4 * max(block, 256)


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int,
           async_dequant: bool = True, outliers: str = "fused", rotation: Optional[tuple[int, int]] = None,
           launch: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """Registry entry: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most ``MAX_BATCH`` rows -> ``[..., N]``.

    ``async_dequant=False`` runs the same kernel synchronously (scales dequantized, then codes loaded), for
    the benchmark.  ``outliers="separate"`` leaves them out of the kernel and adds a torch.sparse CSR SpMV
    (fp32) instead, for the benchmark's comparison; ``"fused"`` (default) adds them inside the kernel.  A rotated
    layer's ``rotation = (seed, block)``: each block stages ``R·x`` of its span (of each chunk of 8 rows) itself where
    the transform's work area still fits its share of shared memory (:func:`staged_smem_bytes`), else x is rotated
    first (:func:`qlinear.backends._gpu.staged_rotation`).  ``launch`` ``(threads, tiles_per_split, splits)``
    replaces :func:`plan`'s (benchmarks/sweep_plans.py); the binding refuses one that does not cover the layer.
    """
    N, K = out_features, in_features
    M = x.numel() // K
    rotated = rotation is not None
    threads, per_split, _ = launch = launch or plan(M, N, K, buffers["ad_codes"].numel() // N,
                                                    _sms(x.device.index or 0))
    smem = staged_smem_bytes(M, K, per_split, rotation[1]) if rotated else math.inf
    x, rot = staged_rotation(x, rotation, smem, _block_smem_cap(min(M, KERNEL_M), threads))
    x2 = x.reshape(-1, K).contiguous()
    fused = outliers == "fused"
    has = buffers["ad_outlier_values"].numel() > 0
    ov = [buffers[k] for _, k in _OUTLIERS] if fused and has else [None, None, None]
    y = torch.ops.qlinear.mixed_gemv(x2, buffers["ad_codes"], buffers["ad_meta"], buffers["ad_sqt"],
                                     buffers["ad_tab"], *ov, bias if fused or not has else None, N, cfg.group_size,
                                     cfg.scale_bits, cfg.scale_group_size, *launch, async_dequant, *rot)
    if not fused and has:
        yo = (_sparse(buffers, N, K, torch.float32) @ x2.float().T).T
        y = (y.float() + yo + (0 if bias is None else bias.float())).to(x.dtype)
    return y.reshape(*x.shape[:-1], N)


def linear_dequantized(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry above the GEMV's batches: :func:`dequantize` to ``x``'s dtype, then cuBLAS.  ``x`` ``[..., K]``
    fp16/bf16 on CUDA -> ``[..., N]``."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


def dequantize_canonical(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
                         ) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (float32, fp16 or bf16) from the canonical mixed buffers on a GPU, any group
    size (``mixed_dequant.cu``'s ``mixed_dequantize_canonical``): :func:`qlinear.formats.mixed.dequantize`'s float32
    values, outliers included, rounded once."""
    ov = [buffers[k] for k, _ in _OUTLIERS] if buffers["outlier_values"].numel() else [None, None, None]
    return torch.ops.qlinear.mixed_dequantize_canonical(
        *(buffers[k] for k in ("idx4", "qweight2", "qweight4", "zeros2", "zeros4", "scale_codes", "scale_scale",
                               "scale_zero")), *ov, out_features, in_features, cfg.group_size, cfg.scale_bits,
        cfg.scale_group_size, dtype)


def linear_canonical(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry for layers held canonical on a GPU (group sizes the layout cannot hold):
    :func:`dequantize_canonical` to ``x``'s dtype, then cuBLAS."""
    return dense_linear(x, dequantize_canonical(buffers, cfg, out_features, in_features, x.dtype), bias)


def supports_canonical(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why ``mixed_canonical`` cannot run a mixed layer of this shape (None if it can)."""
    if -(-out_features * in_features // 32) >= 1 << 31:
        return f"{out_features}x{in_features} is too large (N·K/32 must be below 2^31)"
    return None


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernel cannot run a mixed layer of this config and shape (None if it can)."""
    if cfg.group_size % 16:
        return f"group_size={cfg.group_size} is not a multiple of 16"
    if in_features >= 1 << 20:
        return f"in_features={in_features} is too large for the word table (at most {(1 << 20) - 1})"
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
    bad = [k for k, (s, d) in specs.items() if tuple(out[k].shape) != tuple(s) or out[k].dtype != d]
    if bad:
        raise RuntimeError(f"random mixed buffers do not match the format's specs: {bad}")
    return out


_COMMON = dict(format="mixed", devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}), bits=ANY,
               group_sizes=ANY, min_capability=(8, 0), supports=supports, available=available, layout=LAYOUT)
register(Kernel(backend="async_dequant", fn=linear, priority=10, max_batch=MAX_BATCH, fuses_rotation=True, **_COMMON))
# every batch beyond: dequantize + cuBLAS, so that no mixed layer falls back to the reference on a GPU
register(Kernel(backend="mixed_dequant", fn=linear_dequantized, priority=5, max_batch=ANY, **_COMMON))
# and the same from the canonical buffers, for the layers the layout cannot hold (group sizes not a multiple of 16)
register(Kernel(backend="mixed_canonical", fn=linear_canonical, priority=4, max_batch=ANY,
                **{**_COMMON, "supports": supports_canonical, "layout": None}))
