"""CUDA LUT GEMV for :class:`qlinear.BCQLinear` at decode batch sizes (LUT-GEMM / nuQmm, Park et al. §3).

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16, ``M <= 8``, BCQ with 1..8 bit-planes, any group size
(multiple of 32 or the whole row), with or without offset, fp32 accumulation, deterministic split-K.
The kernel (``bcq_lut_gemv.cu``) builds, per K tile, the 256 partial sums ``±x_j`` of every 8 inputs
in shared memory and turns every weight byte into one table lookup; each thread keeps the plane words, α and
offsets of a whole K tile (``words(M, bits)`` words) in flight while the tables are built and looked up.
Above ``M = 8`` the second kernel of this backend, ``cuda_lut_dequant``, writes ``Ŵ`` in fp16/bf16 from the same
layout (:func:`dequantize`: per row and 32-input word a table of the 2^Q possible outputs, one lookup per weight,
rows written whole through shared memory) for one cuBLAS GEMM; it is also the layout's ``dequantize`` for the
backward pass.

Layout ``cuda_lut`` (repacked once when a module lands on a GPU; a permutation of the canonical
buffers, so it costs no extra memory beyond the padding rows below, and :func:`unrepack` restores them exactly):

* ``lut_planes`` int32 ``[K/32, Q, N]`` = canonical ``planes`` ``[Q, N, K/32]`` permuted: the same
  plane word of consecutive rows is contiguous, so a thread reads 4 rows with one 16-byte load and a
  warp reads 512 contiguous bytes.
* ``lut_alpha`` fp16 ``[G, Q, N]`` and ``lut_offset`` ``[G, N]`` (fp16, or fp32 for layers in the uniform
  storage, whose α and offsets are derived from scales and zero points): BCQ's ``alpha`` / ``offset`` transposed
  the same way.
* A uniform layer (:func:`qlinear.formats.bcq.is_uniform`) of 5-8 bits holds its fp16 ``scales`` transposed as
  ``lut_scales`` ``[G, N]`` instead of α (those kernels form ``α_q = s·2^(q−1)`` in float32, exactly: fp16 α could not
  hold 8-bit scales below 2^-13) beside the float32 offsets.  (The 1-4 plane kernels, at their register budget,
  read α.)
* ``N`` is padded with zero rows to a multiple of 4 (the 16-byte loads of 4 rows; at most 3 rows, so an output
  layer of GPT-2's 50257 tokens runs here too): the kernels compute those rows as 0 and :func:`linear` /
  :func:`dequantize` drop them.

:func:`spec` is the executable specification of the kernel: the same tiles, tables, byte-to-index
arithmetic and per-word α/offset application over the repacked buffers, in PyTorch; CPU tests check
it against the reference backend, GPU tests check the kernel against both.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq
from qlinear.formats.packing import pack_planes, unpack_planes

from .. import ANY, Kernel, Layout, register
from .._gpu import NO_ROTATION, rotation_smem_bytes, staged_rotation
from .._native import build_cuda_backend, dense_linear
from .._native import sm_count as _sms  # module attribute: tests replace it without a GPU

__all__ = ["LAYOUT", "MAX_BATCH", "words", "plan", "spec", "repack", "unrepack", "alpha_arg", "linear", "dequantize",
           "linear_dequantized"]

MAX_BATCH = 8
_HERE = Path(__file__).parent


# canonical name -> (layout name, permutation of its dims): planes [Q, N, K/32] -> [K/32, Q, N], alpha [Q, N, G] ->
# [G, Q, N], offset [N, G] -> [G, N]
_PERMS = {"planes": ("lut_planes", (2, 0, 1)), "alpha": ("lut_alpha", (2, 0, 1)), "offset": ("lut_offset", (1, 0))}


def _holds_scales(cfg) -> bool:
    return bcq.is_uniform(cfg) and cfg.bits > 4


def _names(cfg) -> tuple[str, ...]:
    return ("lut_planes", "lut_scales" if _holds_scales(cfg) else "lut_alpha") + (("lut_offset",) if cfg.offset else ())


def padded(out_features: int) -> int:
    """Rows the layout holds for ``out_features``: the next multiple of 4."""
    return -(-out_features // 4) * 4


def repack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Canonical BCQ buffers -> layout ``cuda_lut`` (see the module docstring): a uniform layer's float32 offsets and
    its α (1-4 bits, :func:`qlinear.formats.bcq.as_bcq`) or scales (5-8 bits) are derived from its scales and zero
    points; rows padded with zeros to :func:`padded`.  Raises ValueError for 1-4 bit scales whose α fp16 cannot
    hold."""
    if _holds_scales(cfg):
        codes, s, zeros = bcq.uniform_parts(buffers, cfg, out_features, in_features, codes=torch.uint8)
        out = {"lut_planes": pack_planes(codes, cfg.bits).permute(2, 0, 1), "lut_scales": s.T}
        if zeros is not None:
            out["lut_offset"] = bcq.uniform_offset(s, zeros, cfg.bits).T
    else:
        buffers = bcq.as_bcq(buffers, cfg, out_features, in_features)
        out = {name: buffers[key].permute(*dims) for key, (name, dims) in _PERMS.items() if key in buffers}
    rows = padded(out_features)  # N is every buffer's last dim here
    return {name: _padded_copy(t, rows) for name, t in out.items()}


def _padded_copy(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A contiguous copy of ``t`` ``[..., N]`` (never a view of it) with zero rows up to ``rows`` in its last dim."""
    if t.shape[-1] == rows:
        return t.clone(memory_format=torch.contiguous_format)
    out = t.new_zeros(*t.shape[:-1], rows)
    out[..., :t.shape[-1]] = t
    return out


def unrepack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Layout ``cuda_lut`` -> canonical BCQ buffers (exact inverse of :func:`repack`; never views of the layout's:
    a state dict of them must not carry, or write through to, the layer's own storage)."""
    held = {t.untyped_storage().data_ptr() for t in buffers.values()}
    buffers = {name: t[..., :out_features] for name, t in buffers.items()}
    out = {key: buffers[name].permute(*sorted(range(len(dims)), key=dims.__getitem__))
           for key, (name, dims) in _PERMS.items() if name in buffers}
    if "lut_scales" not in buffers:
        out = bcq.as_uniform(out, cfg, out_features, in_features) if bcq.is_uniform(cfg) else out
    else:
        s = buffers["lut_scales"].T
        zeros = bcq.uniform_zeros(s, out["offset"], cfg.bits) if "offset" in out else None
        out = bcq.uniform_buffers(unpack_planes(out["planes"], in_features), s, zeros, cfg.bits)
    return {k: t.clone(memory_format=torch.contiguous_format) if t.untyped_storage().data_ptr() in held
            else t.contiguous() for k, t in out.items()}


def _alpha(buffers: dict, bits: int) -> torch.Tensor:
    """α float32 ``[G, Q, N]`` of the layout's buffers: ``lut_alpha``, or a uniform layer's ``s·2^(q−1)``."""
    if "lut_alpha" in buffers:
        return buffers["lut_alpha"].float()
    return bcq.uniform_alpha(buffers["lut_scales"], bits).transpose(0, 1)





def words(M: int, bits: int) -> int:
    """K words (32 inputs) per tile for batch ``M`` and ``bits`` planes: the largest power of two up to 4 with
    ``W·bits <= 8`` (plane words held in registers per thread) and ``W·M <= 8`` (tables); ``lut_gemv_words`` in
    ``bcq_lut_gemv.h``."""
    w = 4
    while w > 1 and (w * bits > 8 or w * M > 8):
        w //= 2
    return w


@functools.lru_cache(maxsize=4096)  # per call of every layer: a lookup instead of ~2 µs of arithmetic
def plan(M: int, N: int, K: int, sms: int, bits: int) -> tuple[int, int, int, int]:
    """Launch shape ``(kt, threads, tiles_per_split, splits)`` for ``x`` ``[M, K]``, ``N`` rows and ``bits`` planes.

    ``kt = 32·words(M, bits)`` inputs per K tile (fixed by the kernel's template); blocks of ``threads`` threads own
    ``4·threads`` rows: the most rows per block that still gives :func:`resident` blocks per SM (tables are built
    once per block, so big blocks amortise them), but at least ``64·M·W`` threads (two of a tile's ``4·M·W`` tables per warp: on
    small layers the table build, not the weights, is the critical path; kernel_model.py predicts 576², M=1,
    2 bits 11.3 → 8.4 µs on an H100 for this floor) and no more than the rows need.  K is then split into whole tiles
    until there are at most that many blocks per SM (the kernel's register budget lets them reside on an SM):
    28672x8192, 4 bits, M=1 on an H200 took 99.7 µs with 280 blocks (a second wave of 16) and 83 µs with 252
    (RESULTS.md, 2026-11-26).
    """
    W = words(M, bits)
    tiles = math.ceil(K / (32 * W))
    wave = resident(bits) * sms
    threads = next((t for t in (256, 128, 64) if math.ceil(N / (4 * t)) * tiles >= wave), 32)
    threads = min(max(threads, 64 * M * W, 32), 256, 32 * math.ceil(N / 128))
    blocks_n = math.ceil(N / (4 * threads))
    per_split = math.ceil(tiles / min(tiles, max(1, wave // blocks_n)))  # one wave: a second costs a whole chain
    return 32 * W, threads, per_split, math.ceil(tiles / per_split)


def resident(bits: int) -> int:
    """Blocks of the GEMV an SM holds for ``bits`` planes (``lut_gemv_blocks_per_sm`` in ``bcq_lut_gemv.h``): two,
    or one past 4 planes, whose plane words take more than half the registers."""
    return 2 if bits <= 4 else 1


def _signs(bits: int) -> torch.Tensor:
    """``[2^bits, bits]`` float32: row ``e`` holds ±1 for bit ``j`` of ``e`` (1 → +1)."""
    return (((torch.arange(2 ** bits)[:, None] >> torch.arange(bits)) & 1) * 2 - 1).float()


def spec(x: torch.Tensor, buffers: dict, bias: Optional[torch.Tensor], cfg, out_features: int, in_features: int,
         launch: tuple[int, int, int, int]) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch (float32), ``x`` ``[M, K]`` -> ``[M, N]`` float32.

    Follows ``lut_gemv_kernel``: for each split and tile, 256-entry tables over 8 inputs built as
    ``T[b] = lo[b & 31] + hi[b >> 5]`` (signed sums of inputs 0..4 and 5..7), byte ``j`` of a plane word indexes the
    table of inputs ``32w + 8j .. 32w + 8j + 7``, the four lookups of a word are scaled by α of the
    word's group and the offset multiplies Σx of the word (the sum of its four tables' entry 255, which holds the
    sum of their 8 inputs); split partials are summed in order.
    """
    kt, _, per_split, splits = launch
    planes, alpha = buffers["lut_planes"], _alpha(buffers, cfg.bits)
    M, K, N = x.shape[0], in_features, planes.shape[-1]  # N: the padded rows, dropped at the end
    offset = buffers["lut_offset"].float() if cfg.offset else None
    gs = cfg.group(K)
    xf = x.float()
    sign5, sign3 = _signs(5).to(x.device), _signs(3).to(x.device)
    b = torch.arange(256, device=x.device)
    shifts = (8 * torch.arange(4, device=x.device)).view(1, 4, 1, 1)
    tiles = math.ceil(K / kt)
    partial = torch.zeros(splits, M, N, device=x.device)
    for s in range(splits):
        for t in range(s * per_split, min((s + 1) * per_split, tiles)):
            k0 = t * kt
            kw = min(kt, K - k0)
            xs = xf[:, k0:k0 + kw]
            x8 = xs.reshape(M, kw // 8, 8)
            lo = x8[..., :5] @ sign5.T                                     # [M, kw/8, 32]
            hi = x8[..., 5:] @ sign3.T                                     # [M, kw/8, 8]
            lut = lo[:, :, b & 31] + hi[:, :, b >> 5]                      # [M, kw/8, 256]
            ends = lut[:, :, 255].reshape(M, kw // 32, 4)                 # Σ of each table's 8 inputs
            xsum = ((ends[..., 0] + ends[..., 1]) + ends[..., 2]) + ends[..., 3]  # [M, W]: Σx over each word
            words = planes[k0 // 32:(k0 + kw) // 32].long() & 0xFFFFFFFF   # [W, Q, N]
            idx = (words[:, None] >> shifts) & 255                         # [W, 4, Q, N]
            W = words.shape[0]
            chunk = (4 * torch.arange(W, device=x.device)[:, None] + torch.arange(4, device=x.device))
            sums = lut[:, chunk[:, :, None, None], idx].sum(2)             # [M, W, Q, N]
            g = (k0 // 32 + torch.arange(W, device=x.device)) * 32 // gs
            contrib = (alpha[g] * sums).sum(2)                             # [M, W, N]
            if offset is not None:
                contrib = contrib + offset[g] * xsum[:, :, None]
            partial[s] += contrib.sum(1)
    y = partial.sum(0)[:, :out_features]
    return y if bias is None else y + bias.float()


def alpha_arg(buffers: dict) -> torch.Tensor:
    """The ops' ``alpha`` argument: ``lut_alpha`` fp16 ``[G, Q, N]``, or a uniform layer's ``lut_scales`` ``[G, N]``."""
    return buffers["lut_alpha"] if "lut_alpha" in buffers else buffers["lut_scales"]


SMEM_BUDGET = 100 * 1024  # shared memory per block that keeps two blocks per SM (228 KB on an H100/H200)


def rotated_span(K: int, launch: tuple[int, int, int, int], perm: bool) -> int:
    """Inputs per row of x a block stages for a rotated layer: its K slice, or the whole K with act_order's ``perm``
    (``lut_gemv_rotated_span`` in ``bcq_lut_gemv.h``)."""
    kt, _, per_split, _ = launch
    return K if perm or K < kt * per_split else kt * per_split


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int,
           rotation: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Registry entry: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most 8 rows -> ``[..., N]``.  An act_order layer's
    ``perm`` (in ``buffers``) is applied as the kernel loads x into shared memory (no separate gather); a rotated
    layer's ``rotation = (seed, block)`` too, where its block's ``R·x`` fits :data:`SMEM_BUDGET`
    (:func:`qlinear.backends._gpu.staged_rotation`)."""
    M, K, N = x.numel() // in_features, in_features, padded(out_features)
    launch = plan(M, N, K, _sms(x.device.index or 0), cfg.bits)
    perm = buffers.get("perm")
    rot = NO_ROTATION
    if rotation is not None:
        smem = rotation_smem_bytes(8 * M * launch[0] * 32, rotation[1], M * rotated_span(K, launch, perm is not None),
                                   x.element_size())
        x, rot = staged_rotation(x, rotation, smem, SMEM_BUDGET)
    if bias is not None and N != out_features:  # the kernel adds it before its one rounding: pad it with the rows
        bias = torch.nn.functional.pad(bias, (0, N - out_features))
    y = torch.ops.qlinear.bcq_lut_gemv(x.reshape(-1, K).contiguous(), buffers["lut_planes"], alpha_arg(buffers),
                                       buffers.get("lut_offset"), perm, bias, cfg.group(K), *launch, *rot)
    if N != out_features:  # only then: a no-op slice still costs each decode call ~1.6 µs of Python (this CPU)
        y = y[:, :out_features].contiguous()
    return y.reshape(*x.shape[:-1], out_features)


def dequantize(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (float32, fp16 or bf16) from the ``cuda_lut`` buffers on a GPU: the format's
    float32 values (:func:`qlinear.formats.bcq.dequantize` of the :func:`unrepack`-ed buffers), rounded once.  With
    the default float32 it is the layout's ``dequantize`` (the backward pass, :func:`qlinear.ops.dequantize`)."""
    return torch.ops.qlinear.bcq_lut_dequantize(buffers["lut_planes"], alpha_arg(buffers), buffers.get("lut_offset"),
                                                cfg.group(in_features), dtype)[:out_features]


LAYOUT = Layout(name="cuda_lut", names=_names, repack=repack, unrepack=unrepack, dequantize=dequantize,
                dequantize_devices=frozenset({"cuda"}))


def linear_dequantized(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry above the GEMV's batches: :func:`dequantize` to ``x``'s dtype, then cuBLAS.  ``x`` ``[..., K]``
    fp16/bf16 on CUDA (an act_order layer's ``x`` arrives gathered by ``perm``) -> ``[..., N]``."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_cuda_lut", _HERE)


_COMMON = dict(format="bcq", devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
               bits=frozenset(range(1, 9)), group_sizes=ANY, min_capability=(8, 0), available=available, layout=LAYOUT)
register(Kernel(backend="cuda_lut", fn=linear, priority=10, max_batch=MAX_BATCH, gathers_perm=True,
                fuses_rotation=True, **_COMMON))
# every batch: free-α BCQ layers (which QUICK cannot take) never fall back to the reference on a GPU; below
# quick_dequant, so that uniform layers (held in the quick layout) keep theirs
register(Kernel(backend="cuda_lut_dequant", fn=linear_dequantized, priority=4, max_batch=ANY, **_COMMON))
