"""x86 CPU kernels (AVX-512 VNNI + VBMI, AVX2 + AVX-VNNI, AVX2, scalar) for :class:`qlinear.BCQLinear` at 1-4 bits:
uniform (round-to-nearest, GPTQ, imported GPTQ/AWQ weights) and free-α BCQ (the BCQ fit, activation-aware or not),
and uniform at 5-8 bits, and for :class:`qlinear.CodebookLinear` at 2 and 4 bits, and for :class:`qlinear.MixedPrecisionLinear` (layout
``x86_mixed``, :func:`linear_mixed`).

The Arm paper's recipe ("Highly Optimized Kernels and Fine-Grained Codebooks for LLM Inference on Arm CPUs", §4)
carried to x86: activations quantized to int8 per 32 inputs (:func:`qlinear.backends._cpu.quantize_activations`),
weights interleaved offline for 16 rows at once, products summed exactly in int32 and scaled in fp32 per 32 inputs.
Two layouts (``qgemm.h`` has the byte-level description):

* Uniform 4-bit: the codes as nibbles, one 64-byte load feeding VPDPBUSD (x86's SDOT: u8 x s8 dot products of 4
  into int32 lanes); the zero point is applied per group with the sum of the quantized activations.  Uniform 8-bit
  (e.g. an output layer kept near lossless, GPTQ 8-bit checkpoints): the same with the codes as bytes, 16 rows x 4
  inputs per 64-byte load (5-7 bit codes take it too, a byte each); plain AVX2 multiplies the bytes as two nibbles
  (VPMADDUBSW's int16 pairs would saturate at 255·127·2).
* Every other BCQ layer (uniform 1-3 bits, but 2-bit with zero points; free α at 1-4 bits): the bit-planes, each
  summed against the activations by table lookups (LUT-GEMM's idea, "LUT-GEMM", §3; T-MAC's 16-entry tables per 4 activations looked up by a
  plane's nibble, here with VPERMB over 4 such tables at once).  Each int8 activation is split as ``16·hi + lo`` so
  that the tables' sums of 4 fit int8 exactly; VPDPBUSD adds the lookups of each row, ×1 for ``lo``, ×16 for ``hi``.
  A plane's sum ``S_i = Σ_k bit_i·x̂_k`` is therefore exact, and with ``w = Σ_i α_i·(2·bit_i − 1) + c``:
  ``Σ_k w_k·x̂_k = Σ_i 2α_i·S_i + (c − Σ_i α_i)·Σ_k x̂_k``; uniform codes give ``Σ_k code·x̂ = Σ_i 2^i·S_i``.
  Cost per weight and activation row: one lookup and one VPDPBUSD lane per 4 weights per plane, so time falls with
  the bits.  From 4 activation rows, uniform layers on the AVX-512 path turn their planes into codes instead (once
  per 4 or 8 rows) and multiply them as the 4-bit nibbles: the same integers, one VPDPBUSD lane per weight and row.

* Uniform 2-bit with zero points (round-to-nearest, GPTQ): as a 2-bit codebook layer (below) whose four books are the
  zero points' levels, book ``z`` holding ``q − z`` (:data:`UNIFORM2_BOOKS`); the same integers as the bit-plane
  lookups, and 1.2-1.9x faster than them from 8 rows (RESULTS.md, "Uniform 2-bit layers on the codebook kernel").
* Codebooks (the Arm paper's group-wise codebooks, §5): all of a layer's int8 centroids fit one 16-byte table, so
  one VPSHUFB per 64 weights turns codes, with their row's book in the bits above them, into int8 weights for
  VPDPBUSD (offset by 128 into its unsigned operand and corrected by ``128·Σ xq``); AVX2 without VNNI multiplies
  ``|w|`` by ``xq`` with ``w``'s sign (VPMADDUBSW + VPSIGNB).  4-bit codes take the uniform nibble layout, 2-bit codes
  4 per byte.

Every way the error versus the reference is the activations' rounding alone: per output ``|y − y_ref| ≤ Σ_h
(amax_h / 254) · Σ_{k∈h} |ŵ_k|`` plus fp32 rounding (``amax_h``: the largest ``|x|`` of 32-input block ``h``), as for
the Arm kernels.

Paths, chosen from cpuid once (``path`` forces one): AVX-512 VNNI (the LUT layout and the mixed format also need
VBMI, else they run on AVX2 + AVX-VNNI or AVX2), AVX2 with AVX-VNNI, AVX2 (VPMADDUBSW + VPMADDWD; the lookups by VPSHUFB), scalar C++.  All compute the
same int32 sums and the same fp32 operations in the same order, so they give the same bits.  Batches of
:func:`batched_from` rows or more (path "auto") take the batched path (:func:`_batched`): the unquantized activations
times ``Ŵ`` from the layout (:func:`dequantize`, also the backward pass's weight: AVX-512 where the CPU has it, the
same values).  Float32 activations: a cache-sized tile of rows of ``Ŵ`` at a time and a float32 GEMM, for bit-plane
layers from :func:`dequant_from` rows (by bits and size) and mixed layers.  Bfloat16 activations on a CPU with
AVX512-BF16 (every format, from 16-64 rows by format: :func:`batched_from`): ``Ŵ`` rounded once to bfloat16 and a
bfloat16 GEMM, as a dense bfloat16 layer computes; on AMX (``amx.cpp``) each 16-row block of ``Ŵ`` is dequantized
into cache and multiplied on AMX tiles (TDPBF16PS), else tiles of ``Ŵ`` go to torch's GEMM.  Error:
bfloat16 rounding of ``Ŵ`` and ``y`` (float32 sums).  Built just in time (``backends/_native.py``) with
baseline flags; each SIMD path carries its own ``target`` attribute.  Rows are split across threads with
``at::parallel_for``.

Layout ``x86`` (repacked once at load; :func:`repack` / :func:`unrepack` are exact inverses), ``Nb = ceil(N/16)``:
``x86_qw`` uint8 ``[Nb, K/8, 64]`` (uniform 4-bit: byte ``4r + j`` of 16-row block ``b``, 8-input chunk ``c`` holds
code ``[16b + r, 8c + j]`` in its low nibble and ``[16b + r, 8c + 4 + j]`` in its high nibble; uniform 8-bit
``[Nb, K/4, 64]``, byte ``4r + j`` of 4-input chunk ``c`` holding code ``[16b + r, 4c + j]``) or ``x86_lp`` uint8
``[Nb, K/32, bits, 64]`` (byte ``16g + r`` of block ``b``, 32-input block ``h``, plane ``i`` holds bit ``t`` of its low
nibble = ``bit_i[16b + r, 32h + 4g + t]``, of its high nibble ``bit_i[16b + r, 32h + 16 + 4g + t]``); uniform layers
add ``x86_qs`` fp16 ``[Nb, G, 16]`` (scales) and ``x86_qz`` uint8 ``[Nb, G, 16]`` (int16 at 8 bits) holding ``2·z``
(``2^bits − 1`` for the symmetric grid), free-α layers ``x86_qa`` fp16 ``[Nb, G, bits, 16]`` (α per plane) and ``x86_qc`` fp16 ``[Nb, G, 16]``
(the offset, 0 without one); uniform 2-bit layers with zero points instead hold ``x86_qw`` as the 2-bit codebook
layout's below, ``x86_qs`` and ``x86_qb`` (their zero points as book words).  Layout ``x86_codebook``: ``x86_qw`` (4 bits: as ``x86_qw`` above; 2 bits: uint8
``[Nb, K/16, 64]``, byte ``4r + j`` of chunk ``c`` holding code ``[16b + r, 16c + 4t + j]`` in bits ``2t..2t+1``),
``x86_qs`` fp16 ``[Nb, G, 16]`` (scales), with several codebooks ``x86_qb`` int32 ``[Nb, G]`` (bits ``2r..2r+1``: the
book of row ``16b + r``), and ``codebooks`` as stored.  :func:`spec` is the executable PyTorch specification of the
kernels' arithmetic.

The mixed format at its own granularity (``mixed.cpp``): its groups are 16·j inputs, each with its own width, scale
and zero point, so the activations are quantized to int8 per 16 inputs (``xs``, ``xq``) and 16 rows are interleaved
as for the uniform layout; per 16-input chunk ``h`` one VPDPBUSD per 4 inputs (AVX-512 VNNI: the 16 rows at once;
AVX-VNNI, or VPMADDUBSW + VPMADDWD: 8 at a time) gives each row's ``I_h = Σ q·xq`` exactly, then per group
``ŝ·Σ_h xs_h·(I_h − z·Σ xq)`` in fp32; the outliers are added with the float32 activations.  Layout ``x86_mixed``
(:func:`repack_mixed`; exact inverse :func:`unrepack_mixed`).  From :func:`batched_from` rows it takes the batched
path with Ŵ from :func:`dequantize_mixed` (the format's values bit for bit).  Error versus the float64 reference:
the activations' rounding, ``Σ_h (amax_h / 254)·Σ_{k∈h} |ŝ·(q − z)|`` (``amax_h`` over 16 inputs), plus fp32
rounding; :func:`spec_mixed` is the kernel's value before that rounding.
"""

from __future__ import annotations

import functools
import math
import platform
import sys
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq, mixed
from qlinear.formats.packing import pack, pack_planes, unpack, unpack_planes, unpack_u8

from .. import ANY, Kernel, Layout, register
from .._cpu import (pad_groups, pair_nibbles, quantize_activations, rotation_args, spec_input, supports_codebook,
                    unpad_groups, unpair_nibbles)
from .._native import OPENMP, build

__all__ = ["LAYOUT", "CODEBOOK_LAYOUT", "PATHS", "DEQUANT_FROM", "LARGE_LAYER", "BF16_BATCHED_FROM", "AMX_BATCHED_FROM",
           "FORMATS", "dequant_from", "batched_from", "batched_dtype", "amx_available", "repack", "unrepack",
           "repack_codebook", "unrepack_codebook", "MIXED_LAYOUT", "repack_mixed", "unrepack_mixed", "linear_mixed",
           "dequantize_mixed", "spec_mixed", "supports_mixed", "spec", "linear", "dequantize", "available",
           "simde_available", "supports"]

_HERE = Path(__file__).parent
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx2_vnni": 3, "avx512_vnni": 4}
FORMATS = {"uniform": 0, "planes_uniform": 1, "planes_free": 2, "cb4": 3, "cb2": 4}  # qgemm.h's Format (kUniform ... kCB2)
ROWS = 16  # rows per block (one 32-bit lane each of a 512-bit register)
# From this many rows (by bits) the bit-plane layers (all but uniform 4-bit and uniform 2-bit with zero points, and
# uniform ones where the AVX-512 path turns planes into codes: _plane_codes) dequantize Ŵ and run a float32 GEMM
# instead of the lookups (path "auto"; benchmarks/RESULTS.md, "x86 kernels, fourth slice", 2026-11-26); layers of
# LARGE_LAYER weights or more cross over later (4096², 11008x4096: about 2x the rows), so their threshold doubles
DEQUANT_FROM = {1: 256, 2: 256, 3: 128, 4: 128}
LARGE_LAYER = 8 << 20
# Above this many rows (2x for layers of LARGE_LAYER weights or more) the mixed format takes Ŵ, a tile of rows at a
# time, and a float32 GEMM (path "auto"; benchmarks/RESULTS.md, "The mixed format on x86: int8 activations",
# 2026-11-26, AVX-512 VNNI: SmolLM2's shapes cross over between 64 and 128 rows, 4096² and 11008x4096 near 128-150)
MIXED_GEMV_ROWS = 64
_TILE_BYTES = 4 << 20  # float32 rows of Ŵ per tile of the batched path: cache-sized, below glibc's mmap threshold
# Bfloat16 tiles are larger: oneDNN's per-call cost (packing x for AMX) dominates smaller ones (RESULTS.md, "x86:
# bfloat16 activations on the batched path": 16 MB tiles 1.2-2x faster than 4 MB at 64-512 rows)
_TILE_BYTES_BF16 = 16 << 20
# Rows from which layers take the batched path with bfloat16 activations on a CPU with AVX512-BF16 (bfloat16 GEMMs),
# for bit-plane layers ("planes"), the mixed format and the others (uniform layers, codebooks): on AMX
# (amx.cpp) and with torch's GEMM over tiles (RESULTS.md, "x86: bfloat16 activations on the batched path", 2026-11-26)
AMX_BATCHED_FROM = {"planes": 16, "other": 32, "mixed": 64}
BF16_BATCHED_FROM = {"planes": 32, "other": 64, "mixed": 64}
SOURCES = tuple(str(_HERE / f) for f in ("kernels.cpp", "mixed.cpp", "amx.cpp", "binding.cpp"))
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", *OPENMP)


def _row_blocks(t: torch.Tensor, N: int) -> torch.Tensor:
    """``[N, ...]`` -> ``[Nb, 16, ...]``, zero rows padding N to a multiple of 16."""
    Nb = -(-N // ROWS)
    out = t.new_zeros(Nb * ROWS, *t.shape[1:])
    out[:N] = t
    return out.view(Nb, ROWS, *t.shape[1:])


def _spread(words: torch.Tensor) -> torch.Tensor:
    """int32 words ``[...]`` -> uint8 ``[..., 4]``: byte q holds nibble q of the word's low half (bits 4q..4q+3) and,
    above it, nibble q of its high half (bits 16+4q..): a word of the nibble layout (:func:`_interleave_words`) and of
    the bit-plane layout, built from the packed words' bytes (repacking at load time is memory bound)."""
    _check_little_endian()
    return pair_nibbles(words.contiguous().view(torch.uint8).view(*words.shape, 4))


def _gather(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_spread`: uint8 ``[..., 4]`` -> int32 words ``[...]``."""
    return unpair_nibbles(b).view(torch.int32)[..., 0]


def _check_little_endian() -> None:
    if sys.byteorder != "little":  # x86 and aarch64 hosts are little-endian
        raise RuntimeError("the x86 layouts are built from the packed words' bytes on little-endian hosts only")


def _interleave_words(qweight: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """4-bit codes packed as ``qweight`` int32 ``[N, K/8]`` (code 8w+t at bits 4t of word w) -> ``x86_qw`` uint8
    ``[Nb, K/8, 64]`` (zero rows pad N to 16): byte ``4r + j`` of block b, chunk c holds code ``[16b + r, 8c + j]`` in
    its low nibble and ``[16b + r, 8c + 4 + j]`` in its high nibble."""
    blocks = _row_blocks(qweight, N)
    return _spread(blocks).transpose(1, 2).reshape(blocks.shape[0], K // 8, 64)


def _qweight_of(qw: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`_interleave_words`: ``x86_qw`` ``[Nb, K/8, 64]`` -> ``qweight`` int32 ``[N, K/8]``."""
    Nb, C, _ = qw.shape
    return _gather(qw.view(Nb, C, ROWS, 4).transpose(1, 2)).reshape(Nb * ROWS, C)[:N]


def _planes_words(planes: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Bit-planes int32 ``[bits, N, K/32]`` (input 32h+j at bit j of word h) -> ``x86_lp`` uint8
    ``[Nb, K/32, bits, 64]`` (zero rows pad N to 16): byte ``16q + r`` of block b, word h, plane i holds plane i's bits
    of row ``16b + r`` at inputs ``32h + 4q + t`` (bit t) and ``32h + 16 + 4q + t`` (bit 4 + t), t = 0..3."""
    bits = planes.shape[0]
    lp = _spread(torch.stack([_row_blocks(p, N) for p in planes]))  # (i, b, r, h, q)
    return lp.permute(1, 3, 0, 4, 2).reshape(lp.shape[1], K // 32, bits, 64)


def _words_of_planes(lp: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`_planes_words`: ``x86_lp`` ``[Nb, K/32, bits, 64]`` -> bit-planes int32 ``[bits, N, K/32]``."""
    Nb, H, bits, _ = lp.shape
    return _gather(lp.view(Nb, H, bits, 4, ROWS).permute(2, 0, 4, 1, 3)).reshape(bits, Nb * ROWS, H)[:, :N]


def _deinterleave(qw: torch.Tensor, K: int) -> torch.Tensor:
    """The codes ``[Nb·16, K]`` int64 of ``x86_qw`` ``[Nb, K/8, 64]`` (:func:`_interleave_words`), read as that
    docstring defines the layout."""
    Nb = qw.shape[0]
    b = qw.view(Nb, K // 8, ROWS, 4).to(torch.int64)
    v = torch.stack([b & 15, b >> 4], -1)  # (b, c, r, j, half)
    return v.permute(0, 2, 1, 4, 3).reshape(Nb * ROWS, K)


def _nibbles(cfg) -> bool:
    """Whether the layer takes the uniform 4-bit nibble layout."""
    return bcq.is_uniform(cfg) and cfg.bits == 4


def _bytes(cfg) -> bool:
    """Whether the layer takes the uniform 8-bit byte layout (5-7 bit codes too, a byte each)."""
    return bcq.is_uniform(cfg) and cfg.bits > 4


def _byte_words(qweight: torch.Tensor, N: int) -> torch.Tensor:
    """8-bit codes packed as ``qweight`` int32 ``[N, K/4]`` (code 4w + j in byte j of word w) -> ``x86_qw`` uint8
    ``[Nb, K/4, 64]`` (zero rows pad N to 16): byte ``4r + j`` of block b, chunk c holds code ``[16b + r, 4c + j]``."""
    _check_little_endian()
    blocks = _row_blocks(qweight, N)  # [Nb, 16, C]
    return blocks.transpose(1, 2).contiguous().view(torch.uint8).reshape(blocks.shape[0], qweight.shape[1], 64)


def _words_of_bytes(qw: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`_byte_words`: ``x86_qw`` ``[Nb, K/4, 64]`` -> ``qweight`` int32 ``[N, K/4]``."""
    _check_little_endian()
    Nb, C, _ = qw.shape
    return qw.contiguous().view(torch.int32).transpose(1, 2).reshape(Nb * ROWS, C)[:N]


def _unbytes(qw: torch.Tensor, K: int) -> torch.Tensor:
    """The codes ``[Nb·16, K]`` int64 of ``x86_qw`` ``[Nb, K/4, 64]`` (:func:`_byte_words`), read as that docstring
    defines the layout."""
    Nb = qw.shape[0]
    return qw.view(Nb, K // 4, ROWS, 4).to(torch.int64).permute(0, 2, 1, 3).reshape(Nb * ROWS, K)


def _uniform_crumbs(cfg) -> bool:
    """Whether the layer is uniform 2-bit with integer zero points, run as a 2-bit codebook layer (crumbs, one of
    :data:`UNIFORM2_BOOKS` per row and group: its zero point); other layers but uniform 4-bit take the bit-planes."""
    return bcq.is_uniform(cfg) and cfg.bits == 2 and cfg.offset


# Uniform 2-bit codes with zero point z as a codebook: book z holds q − z (q = 0..3), exactly the format's levels
UNIFORM2_BOOKS = torch.tensor([[q - z for q in range(4)] for z in range(4)], dtype=torch.int8)


def _names(cfg) -> tuple[str, ...]:
    if _uniform_crumbs(cfg):
        return "x86_qw", "x86_qs", "x86_qb"
    return (("x86_qw" if _nibbles(cfg) or _bytes(cfg) else "x86_lp"),
            *(("x86_qs", "x86_qz") if bcq.is_uniform(cfg) else ("x86_qa", "x86_qc")))


def _codes(buffers: dict, cfg, K: int) -> torch.Tensor:
    """The codes ``[Nb·16, K]`` int64 of layout ``x86`` or ``x86_codebook``."""
    if cfg.format == "codebook":
        return (_deinterleave if cfg.bits == 4 else _uncrumbs)(buffers["x86_qw"], K)
    if _uniform_crumbs(cfg):
        return _uncrumbs(buffers["x86_qw"], K)
    if _nibbles(cfg):
        return _deinterleave(buffers["x86_qw"], K)
    if _bytes(cfg):
        return _unbytes(buffers["x86_qw"], K)
    return unpack_planes(_words_of_planes(buffers["x86_lp"], buffers["x86_lp"].shape[0] * ROWS), K)


def repack(buffers: dict, cfg, N: int, K: int) -> dict:
    """Canonical BCQ (1-4 bits, uniform 5-8) -> layout ``x86`` (see the module docstring)."""
    if not bcq.is_uniform(cfg):
        alpha = buffers["alpha"]  # [bits, N, G]
        offset = buffers["offset"] if cfg.offset else torch.zeros_like(alpha[0])
        return {"x86_lp": _planes_words(buffers["planes"], N, K),
                "x86_qa": torch.stack([pad_groups(a, N, ROWS) for a in alpha], 2),
                "x86_qc": pad_groups(offset, N, ROWS)}
    packed = _nibbles(cfg) or _bytes(cfg) or _uniform_crumbs(cfg)  # layouts from the packed words, others from codes
    width = 8 if _bytes(cfg) else cfg.bits  # of the layout's packed words
    from_words = packed and "qweight" in buffers and width == cfg.bits  # the common case (RTN, GPTQ, AWQ)
    codes, s, zeros = bcq.uniform_parts(buffers, cfg, N, K, codes=None if from_words else torch.uint8)
    words = buffers["qweight"] if from_words else pack(codes, width) if packed else None
    if _uniform_crumbs(cfg):
        return {"x86_qw": _crumb_words(words, N), "x86_qs": pad_groups(s.to(torch.float16), N, ROWS),
                "x86_qb": _book_words(zeros, N)}
    z2 = torch.full_like(s, 2 ** cfg.bits - 1, dtype=torch.int64) if zeros is None else 2 * zeros
    qw = (_interleave_words(words, N, K) if _nibbles(cfg) else _byte_words(words, N) if _bytes(cfg)
          else _planes_words(pack_planes(codes, cfg.bits), N, K))
    return {_names(cfg)[0]: qw, "x86_qs": pad_groups(s.to(torch.float16), N, ROWS),
            "x86_qz": pad_groups(z2.to(torch.int16 if _bytes(cfg) else torch.uint8), N, ROWS)}


def unrepack(buffers: dict, cfg, N: int, K: int) -> dict:
    """Layout ``x86`` -> canonical BCQ buffers (exact inverse of :func:`repack`)."""
    words = codes = None  # the packed words straight from the layout's bytes, but uniform planes' codes
    if _nibbles(cfg):
        words = _qweight_of(buffers["x86_qw"], N)
    elif _bytes(cfg):
        words = _words_of_bytes(buffers["x86_qw"], N)
        if cfg.bits < 8:  # 5-7 bit codes, a byte each in the layout
            words, codes = None, unpack_u8(words.contiguous(), 8, K)
    elif _uniform_crumbs(cfg):
        words = _words_of_crumbs(buffers["x86_qw"], N)
    elif bcq.is_uniform(cfg):
        codes = unpack_planes(_words_of_planes(buffers["x86_lp"], N), K, torch.uint8)
    else:
        words = _words_of_planes(buffers["x86_lp"], N)
    words = None if words is None else words.contiguous()
    if not bcq.is_uniform(cfg):
        qa = buffers["x86_qa"]
        out = {"planes": words,
               "alpha": torch.stack([unpad_groups(qa[:, :, i], N) for i in range(cfg.bits)])}
        if cfg.offset:
            out["offset"] = unpad_groups(buffers["x86_qc"], N)
        return out
    if _uniform_crumbs(cfg):
        zeros = unpad_groups(_books(buffers["x86_qb"]), N)
    else:
        zeros = unpad_groups(buffers["x86_qz"], N).to(torch.int64) // 2 if cfg.offset else None
    return bcq.uniform_buffers(codes, unpad_groups(buffers["x86_qs"], N), zeros, cfg.bits, qweight=words)


@functools.lru_cache(maxsize=None)
def _op_names(cfg) -> tuple:
    """:func:`_weights` of a config with buffer names for the tensors (qz may be :data:`UNIFORM2_BOOKS`, qb None), the
    group size left as configured: worked out once per config (configs are frozen), as it runs on every call."""
    if cfg.format == "codebook":  # qgemm.h's Format kCB4 / kCB2; qz: the codebooks
        return ("x86_qw", "x86_qs", "codebooks", "x86_qb" if cfg.books > 1 else None, cfg.bits,
                FORMATS["cb4" if cfg.bits == 4 else "cb2"])
    if _uniform_crumbs(cfg):  # kCB2 with the zero points' books
        return "x86_qw", "x86_qs", UNIFORM2_BOOKS, "x86_qb", 2, FORMATS["cb2"]
    fmt = FORMATS["uniform" if _nibbles(cfg) or _bytes(cfg) else "planes_uniform" if bcq.is_uniform(cfg)
                  else "planes_free"]
    return (*_names(cfg), None, 8 if _bytes(cfg) else cfg.bits, fmt)


def _weights(buffers: dict, cfg, K: int) -> tuple:
    """``(qw, qs, qz, qb, group_size, bits, format)``: the op arguments (qgemm.h's ``Weights``) of a layer's buffers."""
    qw, qs, qz, qb, bits, fmt = _op_names(cfg)
    gs = K if cfg.group_size == -1 and cfg.format != "codebook" else cfg.group_size
    return (buffers[qw], buffers[qs], buffers[qz] if isinstance(qz, str) else qz, None if qb is None else buffers[qb],
            gs, bits, fmt)


def dequantize(buffers: dict, cfg, out_features: int, in_features: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Ŵ`` ``[N, K]`` float32 straight from layout ``x86`` or ``x86_codebook`` (the layouts' ``dequantize``, for
    the backward pass): the same values as the format's ``dequantize`` of the :func:`unrepack`-ed buffers;
    ``dtype=torch.bfloat16``: those values rounded to bfloat16 (RuntimeError for other dtypes)."""
    qw, qs, qz, qb, gs, bits, fmt = _weights(buffers, cfg, in_features)
    return torch.ops.qlinear.x86_dequantize(qw, qs, qz, qb, out_features, in_features, gs, bits, fmt, dtype)


LAYOUT = Layout(name="x86", names=_names, repack=repack, unrepack=unrepack, dequantize=dequantize,
                dequantize_devices=frozenset({"cpu"}))


def _transpose_crumbs(words: torch.Tensor) -> torch.Tensor:
    """int32 words, each a 4x4 matrix of 2-bit fields (field j of byte t at bits 8t + 2j) -> the transposed matrices
    (field t of byte j), by two masked swaps; the transpose is its own inverse."""
    for mask, shift in ((0x0000F0F0, 12), (0x00CC00CC, 6)):  # the off-diagonal 2x2 blocks, then their fields
        t = ((words >> shift) ^ words) & mask
        words = words ^ t ^ (t << shift)
    return words


def _crumb_words(words: torch.Tensor, N: int) -> torch.Tensor:
    """2-bit codes packed int32 ``[N, K/16]`` (code 16w + m at bits 2m of word w) -> ``x86_qw`` uint8
    ``[Nb, K/16, 64]`` (zero rows pad N to 16): byte ``4r + j`` of block b, chunk c holds code ``[16b + r, 16c + 4t + j]``
    in bits ``2t..2t+1``, the transpose of the packed word's bytes (:func:`_transpose_crumbs`)."""
    _check_little_endian()
    blocks = _transpose_crumbs(_row_blocks(words, N))  # [Nb, 16, C]
    return blocks.transpose(1, 2).contiguous().view(torch.uint8).reshape(blocks.shape[0], words.shape[1], 64)


def _words_of_crumbs(qw: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`_crumb_words`: ``x86_qw`` ``[Nb, K/16, 64]`` -> packed int32 ``[N, K/16]``."""
    _check_little_endian()
    Nb, C, _ = qw.shape
    return _transpose_crumbs(qw.contiguous().view(torch.int32).transpose(1, 2).reshape(Nb * ROWS, C)[:N])


def _uncrumbs(qw: torch.Tensor, K: int) -> torch.Tensor:
    """The codes ``[Nb·16, K]`` int64 of ``x86_qw`` ``[Nb, K/16, 64]`` (:func:`_crumb_words`), read as that
    docstring defines the layout."""
    Nb = qw.shape[0]
    v = (qw.view(Nb, K // 16, ROWS, 4).to(torch.int64)[..., None] >> (2 * torch.arange(4, device=qw.device))) & 3  # (b, c, r, j, t)
    return v.permute(0, 2, 1, 4, 3).reshape(Nb * ROWS, K)


def _codebook_names(cfg) -> tuple[str, ...]:
    return ("x86_qw", "x86_qs", *(("x86_qb",) if cfg.books > 1 else ()), "codebooks")


def _book_bits(cfg) -> int:
    return int(math.log2(cfg.books))


def repack_codebook(buffers: dict, cfg, N: int, K: int) -> dict:
    """Canonical codebook buffers (2 or 4 bits) -> layout ``x86_codebook``: ``x86_qw`` (4 bits: the nibbles of
    :func:`_interleave_words`; 2 bits: :func:`_crumb_words`), ``x86_qs`` fp16 ``[Nb, G, 16]`` (scales), ``x86_qb`` int32
    ``[Nb, G]`` with several codebooks (bits ``2r..2r+1``: the book of row r) and ``codebooks`` unchanged."""
    G = K // cfg.group_size
    out = {"x86_qw": (_interleave_words(buffers["codes"], N, K) if cfg.bits == 4
                      else _crumb_words(buffers["codes"], N)),
           "x86_qs": pad_groups(buffers["scales"], N, ROWS)}
    if cfg.books > 1:
        out["x86_qb"] = _book_words(unpack(buffers["book_idx"], _book_bits(cfg), G), N)
    out["codebooks"] = buffers["codebooks"]
    return out


def _book_words(books: torch.Tensor, N: int) -> torch.Tensor:
    """Books (0..3) ``[N, G]`` -> ``x86_qb`` int32 ``[Nb, G]``: bits ``2r..2r+1`` the book of row ``16b + r``."""
    word = (pad_groups(books.to(torch.int64), N, ROWS) << (2 * torch.arange(ROWS, device=books.device))).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def _books(qb: torch.Tensor) -> torch.Tensor:
    """``x86_qb`` ``[Nb, G]`` -> the book of each row and group ``[Nb, G, 16]`` int64."""
    return ((qb.to(torch.int64) & 0xFFFFFFFF)[..., None] >> (2 * torch.arange(ROWS, device=qb.device))) & 3


def unrepack_codebook(buffers: dict, cfg, N: int, K: int) -> dict:
    """Layout ``x86_codebook`` -> canonical codebook buffers (exact inverse of :func:`repack_codebook`)."""
    out = {"codes": (_qweight_of if cfg.bits == 4 else _words_of_crumbs)(buffers["x86_qw"], N).contiguous()}
    if cfg.books > 1:
        out["book_idx"] = pack(unpad_groups(_books(buffers["x86_qb"]), N), _book_bits(cfg))
    out["scales"] = unpad_groups(buffers["x86_qs"], N)
    out["codebooks"] = buffers["codebooks"]
    return out


CODEBOOK_LAYOUT = Layout(name="x86_codebook", names=_codebook_names, repack=repack_codebook,
                         unrepack=unrepack_codebook, dequantize=dequantize, dequantize_devices=frozenset({"cpu"}))


MIXED_NAMES = ("x86m_q2", "x86m_q4", "x86m_sc", "x86m_z", "x86m_ss", "x86m_sz", "x86m_kinds", "x86m_idx4", "x86m_ov",
               "x86m_oc", "x86m_orp")
_MIXED_SAME = (("idx4", "x86m_idx4"), ("outlier_values", "x86m_ov"), ("outlier_cols", "x86m_oc"),
               ("outlier_row_ptr", "x86m_orp"))


def _kinds(idx4: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    is4 = mixed.group_kinds(idx4, G)
    return torch.nonzero(~is4).flatten(), torch.nonzero(is4).flatten()


def _lanes(t: torch.Tensor, N: int, bits: int) -> torch.Tensor:
    """Per-(row, group) fields ``[N, n]`` -> int32 ``[Nb, n·bits/2]``: row ``16b + r``, group ``i`` at bit
    ``bits·(16i + r)`` of block ``b``."""
    v = pad_groups(t, N, ROWS)  # [Nb, n, 16]
    return pack(v.reshape(v.shape[0], v.shape[1] * ROWS), bits)


def _unlanes(words: torch.Tensor, N: int, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_lanes`: ``[N, n]`` int64."""
    return unpad_groups(unpack(words, bits, n * ROWS).view(words.shape[0], n, ROWS), N)


def repack_mixed(buffers: dict, cfg, N: int, K: int) -> dict:
    """Canonical mixed buffers -> layout ``x86_mixed`` (``qgemm.h``, MixedWeights; ``Nb = ceil(N/16)``, groups in
    layout order: the 2-bit groups, then the 4-bit groups, each ascending): ``x86m_q2`` int32 ``[Nb, K2/16, 16]`` (word
    ``c`` of lane ``r``: code ``[16b + r, 16c + 4t + j]`` of the 2-bit groups' columns in byte ``j``, bits
    ``2t..2t+1``), ``x86m_q4`` int32 ``[Nb, K4/8, 16]`` (code ``[16b + r, 8c + j]`` in the low nibble of byte ``j``,
    ``[16b + r, 8c + 4 + j]`` in its high nibble), ``x86m_sc`` int32 ``[Nb, G·scale_bits/2]`` (the scale code of row
    ``16b + r``, group ``i`` at bit ``scale_bits·(16i + r)``), ``x86m_z`` int32 ``[Nb, G2 + 2·G4]`` (zero points: of
    2-bit group ``i`` at bit ``32i + 2r``, of 4-bit group ``i`` at bit ``32·G2 + 64i + 4r``), ``x86m_ss``/``x86m_sz``
    fp16 ``[S2, G]`` (the second-order pairs in layout order), ``x86m_kinds`` int32 ``[ceil(G/32)]`` (bit ``i`` set for
    each 4-bit group ``i``), ``idx4`` and the outliers as they are.  Rows past N are zero."""
    g, sb, G = cfg.group_size, cfg.scale_bits, K // cfg.group_size
    idx2, idx4 = _kinds(buffers["idx4"], G)
    G2, G4 = idx2.numel(), idx4.numel()
    order = torch.cat([idx2, idx4])
    is4 = torch.zeros(-(-G // 32) * 32, dtype=torch.int64, device=order.device)
    is4[idx4] = 1
    out = {new: buffers[old] for old, new in _MIXED_SAME}
    # a lane's word holds the same 4 bytes as the uniform layouts' row: the 2-bit codebook crumbs, the 4-bit nibbles
    out.update({"x86m_q2": _crumb_words(buffers["qweight2"], N).view(torch.int32),
                "x86m_q4": _interleave_words(buffers["qweight4"], N, G4 * g).view(torch.int32),
                "x86m_sc": _lanes(unpack(buffers["scale_codes"], sb, N)[order].T, N, sb),
                "x86m_z": torch.cat([_lanes(unpack(buffers["zeros2"], 2, G2), N, 2),
                                     _lanes(unpack(buffers["zeros4"], 4, G4), N, 4)], 1),
                "x86m_ss": buffers["scale_scale"].T[:, order].contiguous(),
                "x86m_sz": buffers["scale_zero"].T[:, order].contiguous(),
                "x86m_kinds": pack(is4.view(-1, 32), 1).flatten()})
    return {k: out[k] for k in MIXED_NAMES}  # the module holds them in this order


def unrepack_mixed(buffers: dict, cfg, N: int, K: int) -> dict:
    """Layout ``x86_mixed`` -> canonical mixed buffers (exact inverse of :func:`repack_mixed`)."""
    sb, G = cfg.scale_bits, K // cfg.group_size
    idx2, idx4 = _kinds(buffers["x86m_idx4"], G)
    G2, G4 = idx2.numel(), idx4.numel()
    order = torch.cat([idx2, idx4])
    sc = torch.empty(G, N, dtype=torch.int64, device=order.device)
    sc[order] = _unlanes(buffers["x86m_sc"], N, G, sb).T
    ss, sz = torch.empty_like(buffers["x86m_ss"].T), torch.empty_like(buffers["x86m_sz"].T)
    ss[order], sz[order] = buffers["x86m_ss"].T, buffers["x86m_sz"].T
    out = {old: buffers[new] for old, new in _MIXED_SAME}
    out.update({"qweight2": _words_of_crumbs(buffers["x86m_q2"].view(torch.uint8), N).contiguous(),
                "qweight4": _qweight_of(buffers["x86m_q4"].view(torch.uint8), N).contiguous(),
                "zeros2": pack(_unlanes(buffers["x86m_z"][:, :G2], N, G2, 2), 2),
                "zeros4": pack(_unlanes(buffers["x86m_z"][:, G2:], N, G4, 4), 4),
                "scale_codes": pack(sc, sb), "scale_scale": ss.contiguous(), "scale_zero": sz.contiguous()})
    return {k: out[k] for k in mixed.buffer_specs(N, K, cfg)}  # the format's order


def _mixed_args(buffers: dict) -> list:
    """The op's buffer arguments: the 7 tensors, then the outliers (or three Nones)."""
    has = buffers["x86m_ov"].numel() > 0
    return [*(buffers[k] for k in MIXED_NAMES[:7]),
            *([buffers[k] for k in ("x86m_ov", "x86m_oc", "x86m_orp")] if has else [None, None, None])]


def dequantize_mixed(buffers: dict, cfg, out_features: int, in_features: int, path: str = "auto",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Ŵ`` ``[N, K]`` float32 from layout ``x86_mixed`` (``mixed.cpp``): :func:`qlinear.formats.mixed.dequantize`'s
    values bit for bit, for the batched path and the backward pass; ``dtype=torch.bfloat16``:
    those values rounded to bfloat16.  ``path`` "auto", "scalar", "avx2" or "avx512_vnni" (the same bits;
    RuntimeError "cannot run path" where this CPU lacks it)."""
    return torch.ops.qlinear.x86_mixed_dequantize(*_mixed_args(buffers), out_features, in_features, cfg.group_size,
                                                  cfg.scale_bits, cfg.scale_group_size, PATHS[path], 0, -1, dtype)


MIXED_LAYOUT = Layout(name="x86_mixed", names=lambda cfg: MIXED_NAMES, repack=repack_mixed, unrepack=unrepack_mixed,
                      dequantize=dequantize_mixed, dequantize_devices=frozenset({"cpu"}))


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    """``x`` ``[..., K]`` as the ops' contiguous float32 ``[M, K]``: ``x`` itself where it already is one (these
    wrappers run on every call: each skipped no-op conversion saves about a microsecond)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    return x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()


def _like(y: torch.Tensor, x: torch.Tensor, N: int) -> torch.Tensor:
    """An op's float32 ``[M, N]`` result in ``x``'s dtype and leading dimensions."""
    y = y if x.dtype == torch.float32 else y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)


def linear_mixed(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int, path: str = "auto",
                 simde: bool = False, rotation=None) -> torch.Tensor:
    """Registry entry for the mixed format: ``x`` ``[..., K]`` on CPU -> ``[..., N]`` of ``x.dtype`` over layout
    ``x86_mixed``, int8 activations per 16 inputs (``mixed.cpp``); from :func:`batched_from` rows (path "auto") the
    batched path instead (:func:`_batched`).  ``path`` one of :data:`PATHS` (RuntimeError "cannot run path" where this
    CPU lacks it);
    ``simde`` runs the SIMDe build; ``rotation`` (seed, block): the layer's randomized Hadamard, applied to x inside
    the op."""
    N, K = out_features, in_features
    if path == "auto" and not simde and x.numel() // K >= batched_from(cfg, N, K, x):
        held, opts = _mixed_args(buffers), (cfg.group_size, cfg.scale_bits, cfg.scale_group_size)
        return _batched(x, lambda b0, b1, dtype: torch.ops.qlinear.x86_mixed_dequantize(*held, N, K, *opts, 0, b0, b1,
                                                                                        dtype),
                        bias, N, K, rotation,
                        amx=lambda xs, b: torch.ops.qlinear.x86_mixed_amx_gemm(xs, *held, b, N, *opts))
    op = torch.ops.qlinear_x86_simde.x86_mixed_gemm if simde else torch.ops.qlinear.x86_mixed_gemm
    y = op(_rows(x, K), *_mixed_args(buffers), bias, N, cfg.group_size, cfg.scale_bits, cfg.scale_group_size,
           PATHS[path], *rotation_args(rotation, K))
    return _like(y, x, N)


def spec_mixed(x: torch.Tensor, buffers: dict, bias, cfg, N: int, K: int, rotation=None) -> torch.Tensor:
    """The mixed GEMV's arithmetic in PyTorch over layout ``x86_mixed``: ``x`` ``[M, K]`` -> ``[M, N]`` float64, the
    value the kernel rounds in fp32: ``x'`` the input (transformed first for a rotated layer: ``rotation`` (seed,
    block)), ``xq, xs`` its int8 codes and scales per 16 inputs (:func:`qlinear.backends._cpu.quantize_activations`),
    and per row ``n``, group ``i`` (scale ``ŝ``, zero ``z``, codes ``q`` of :func:`qlinear.formats.mixed.decode`)
    ``Σ_{h ∈ i} ŝ·xs_h·(Σ_{k ∈ h} q·xq − z·Σ_{k ∈ h} xq)``, plus ``Σ o·x'[col]`` over the row's outliers (float32
    activations), plus the bias."""
    xr = spec_input(x.float(), rotation)
    xq, xs = quantize_activations(xr, 16)
    canon = unrepack_mixed(buffers, cfg, N, K)
    codes, zeros, scales = mixed.decode(canon, cfg, N, K)
    M, H, per = x.shape[0], K // 16, cfg.group_size // 16
    xb = xq.view(M, H, 16).double()
    dots = torch.einsum("mhk,nhk->mnh", xb, codes.view(N, H, 16).double())
    d = dots - zeros.repeat_interleave(per, 1).double() * xb.sum(-1)[:, None, :]
    y = (scales.repeat_interleave(per, 1).double() * xs.double()[:, None, :] * d).sum(-1)
    y = y + xr.double() @ mixed.add_outliers(torch.zeros(N, K, dtype=torch.float64), canon).T
    return y if bias is None else y + bias.double()


def supports_mixed(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the mixed GEMV cannot run a layer of this config and shape (None if it can)."""
    if cfg.group_size % 16:
        return f"group_size={cfg.group_size} is not a multiple of 16"
    return None


def spec(x: torch.Tensor, buffers: dict, bias, cfg, N: int, K: int, rotation=None) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch over layout ``x86`` or ``x86_codebook``: ``x`` ``[M, K]`` -> ``[M, N]``
    float64, the value the kernels round in fp32: exact int32 sums, then per 32-input block ``h``
    ``xs_h·s·(Σ code·xq − z·Σ xq)`` (uniform), ``xs_h·(Σ_i 2α_i·Σ bit_i·xq + (c − Σ_i α_i)·Σ xq)`` (free α)
    or ``xs_h·s·Σ codebook[book][code]·xq`` (codebook).  ``rotation`` (seed, block): a rotated layer, whose
    input the kernels transform before quantizing it."""
    xq, xs = quantize_activations(spec_input(x, rotation, buffers.get("perm")))
    M, H = x.shape[0], K // 32
    gs = K if cfg.group_size == -1 else cfg.group_size
    g = torch.arange(H) * 32 // gs  # each 32-input block's group
    xb = xq.view(M, H, 32).double()
    qsum = xb.sum(-1)[:, None, :]  # [M, 1, H]
    dot = lambda c: torch.einsum("mhk,nhk->mnh", xb, c.double())  # exact integers [M, N, H]
    if cfg.format == "codebook":
        codes = _codes(buffers, cfg, K)[:N]
        books = (unpad_groups(_books(buffers["x86_qb"]), N) if "x86_qb" in buffers
                 else torch.zeros(N, K // gs, dtype=torch.int64))
        w = buffers["codebooks"].to(torch.int64)[books[:, g].repeat_interleave(32, 1), codes]  # int8 values [N, K]
        per_block = dot(w.view(N, H, 32)) * unpad_groups(buffers["x86_qs"], N).double()[:, g][None]
        y = (per_block * xs.double()[:, None, :]).sum(-1)
        return y if bias is None else y + bias.double()
    codes = _codes(buffers, cfg, K)[:N].view(N, H, 32)
    if bcq.is_uniform(cfg):
        s = unpad_groups(buffers["x86_qs"], N).double()[:, g]  # [N, H]
        z = (unpad_groups(_books(buffers["x86_qb"]), N).double() if _uniform_crumbs(cfg)
             else unpad_groups(buffers["x86_qz"], N).double() / 2)[:, g]
        per_block = (dot(codes) - z[None] * qsum) * s[None]
    else:
        alpha = [unpad_groups(buffers["x86_qa"][:, :, i], N).double()[:, g] for i in range(cfg.bits)]  # [N, H] each
        c = unpad_groups(buffers["x86_qc"], N).double()[:, g] - sum(alpha)
        per_block = sum(2 * a[None] * dot((codes >> i) & 1) for i, a in enumerate(alpha)) + c[None] * qsum
    y = (per_block * xs.double()[:, None, :]).sum(-1)
    return y if bias is None else y + bias.double()


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    return build("qlinear_x86", SOURCES, cflags=CFLAGS, ldflags=OPENMP)


@functools.lru_cache(maxsize=1)
def simde_available() -> Optional[str]:
    """For tests: build the same sources with every SIMD path through SIMDe's portable intrinsics (op
    ``qlinear_x86_simde::x86_gemm``), so that a CPU without AVX-512 or AVX-VNNI checks those paths.  None once
    loaded, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        import simde_py
    except ImportError:
        return "SIMDe headers not found (pip install 'simde-py>=0.8.2')"
    # SIMDe fuses a multiply-add only where FMA is native (else two roundings): emulate AVX-512 on native AVX2 + FMA
    flags = open("/proc/cpuinfo").read().split() if Path("/proc/cpuinfo").exists() else []
    if not {"avx2", "fma", "f16c"} <= set(flags):
        return "the SIMDe build needs a CPU with AVX2, FMA and F16C"
    return build("qlinear_x86_simde", SOURCES, ldflags=OPENMP,
                 cflags=(*CFLAGS, "-mavx2", "-mfma", "-mf16c", "-DQLINEAR_X86_SIMDE", f"-I{simde_py.get_include()}"))


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int, path: str = "auto",
           simde: bool = False, rotation=None):
    """Registry entry: ``x`` ``[..., K]`` on CPU -> ``[..., N]`` of ``x.dtype`` over layout ``x86`` (BCQ) or
    ``x86_codebook``; from :func:`batched_from` rows (path "auto") the batched path (:func:`_batched`).  ``path``
    forces one of :data:`PATHS` (RuntimeError "cannot run path" where this CPU lacks it); ``simde`` runs the build of
    :func:`simde_available` instead, where every path runs.  ``rotation`` (seed, block): the layer's randomized
    Hadamard, applied to x inside the op before its int8 quantization (the kernel ``fuses_rotation``); an act_order
    layer's ``perm`` in ``buffers`` is gathered there too, after it (``gathers_perm``)."""
    N, K = out_features, in_features
    qw, qs, qz, qb, gs, bits, fmt = _weights(buffers, cfg, K)
    if path == "auto" and not simde and x.numel() // K >= batched_from(cfg, N, K, x):
        names = _codebook_names(cfg) if cfg.format == "codebook" else _names(cfg)
        main = {n: buffers[n] for n in names if n != "codebooks"}
        return _batched(x, lambda b0, b1, dtype: dequantize({**buffers, **{n: t[b0:b1] for n, t in main.items()}},
                                                             cfg, min(N, b1 * ROWS) - b0 * ROWS, K, dtype), bias, N, K,
                        rotation, buffers.get("perm"),
                        lambda xs, b: torch.ops.qlinear.x86_amx_gemm(xs, qw, qs, qz, qb, b, N, gs, bits, fmt))
    op = torch.ops.qlinear_x86_simde.x86_gemm if simde else torch.ops.qlinear.x86_gemm
    y = op(_rows(x, K), qw, qs, qz, bias, N, gs, bits, fmt, PATHS[path], *rotation_args(rotation, K),
           buffers.get("perm"), qb)
    return _like(y, x, N)


def batched_from(cfg, out_features: int, in_features: int, x: torch.Tensor) -> float:
    """Rows from which a layer takes the batched path (path "auto").  Float32 GEMMs: bit-plane layers from
    :func:`dequant_from` rows (uniform ones only where :func:`_plane_codes` is false), mixed layers above
    :data:`MIXED_GEMV_ROWS` (twice that for layers of :data:`LARGE_LAYER` weights or more), the others never (their
    int8 GEMVs stay faster).  Bfloat16 GEMMs
    (:func:`batched_dtype`): :data:`AMX_BATCHED_FROM` on AMX, else :data:`BF16_BATCHED_FROM`, by "planes" (bit-plane
    layers), "mixed" or "other"."""
    N, K = out_features, in_features
    planes = cfg.format == "bcq" and not (_nibbles(cfg) or _bytes(cfg) or _uniform_crumbs(cfg)
                                          or (bcq.is_uniform(cfg) and _plane_codes()))
    if batched_dtype(x) == torch.bfloat16:
        kind = "planes" if planes else "mixed" if cfg.format == "mixed" else "other"
        return (AMX_BATCHED_FROM if amx_available() else BF16_BATCHED_FROM)[kind]
    if cfg.format == "mixed":
        return MIXED_GEMV_ROWS * (2 if N * K >= LARGE_LAYER else 1) + 1
    return dequant_from(cfg.bits, N, K) if planes else math.inf


def dequant_from(bits: int, out_features: int, in_features: int) -> int:
    """Rows from which a bit-plane layer of ``bits`` and shape (N, K) takes the batched path (path "auto"):
    ``DEQUANT_FROM[bits]``, doubled for layers of ``LARGE_LAYER`` weights or more.  From one run on a 2-core Xeon
    (RESULTS.md, "x86 kernels, fourth slice"): at 4096² and 11008x4096 the lookups stay faster up to about 2x the
    SmolLM2-shape crossover (11008x4096, 3-bit, 128 rows: 142 ms lookups vs 215 batched), at the cost of 4096²,
    4-bit free α between 128 and 255 rows (82 vs 72 ms at 128)."""
    return DEQUANT_FROM[bits] * (2 if out_features * in_features >= LARGE_LAYER else 1)


@functools.lru_cache(maxsize=1)
def _plane_codes() -> bool:
    """Whether uniform bit-plane layers run here as codes from 4 activation rows (the AVX-512 VBMI path of
    ``kernels.cpp``): then their int8 GEMV stays faster than the float32 batched path at every batch, as uniform
    4-bit's does, and they take the bfloat16 one where the other uniform layers do (RESULTS.md, "Uniform bit-plane
    layers as codes", 2026-11-26)."""
    return available() is None and torch.ops.qlinear.x86_best_path(FORMATS["planes_uniform"]) == PATHS["avx512_vnni"]


@functools.lru_cache(maxsize=1)
def _bf16_gemms() -> bool:
    return getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


def batched_dtype(x: torch.Tensor) -> torch.dtype:
    """The batched path's GEMM dtype for activations ``x``: bfloat16 for bfloat16 activations on a CPU with
    AVX512-BF16 (oneDNN runs bfloat16 GEMMs there on AMX tiles or VDPBF16PS, as a dense bfloat16 model's layers),
    else float32."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 and _bf16_gemms() else torch.float32


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether the batched path's bfloat16 GEMM runs on AMX tiles here (``amx.cpp``: AMX-BF16 and Linux's permission
    for the tile state; the extension built)."""
    return available() is None and torch.ops.qlinear.x86_amx_supported()


def _batched(x: torch.Tensor, rows, bias, N: int, K: int, rotation, perm=None, amx=None) -> torch.Tensor:
    """The batched path: the unquantized (rotated, gathered by ``perm``) x times Ŵ in :func:`batched_dtype`.  On AMX
    with bfloat16 (:func:`amx_available`), ``amx(x, bias)`` (the layout's op: each 16-row block of Ŵ dequantized to
    bfloat16 in cache, then TDPBF16PS; y in bfloat16 with the bias added before its rounding); else ``Ŵ`` a tile of
    rows at a time (``rows(b0, b1, dtype)``: the rows of layout blocks ``[b0, b1)``, the format's float32 values, in
    bfloat16 rounded once) into a tile buffer (a whole Ŵ of a large layer would cost more in page faults than the
    GEMM), each tile times x by torch's GEMM."""
    cd = batched_dtype(x)
    xs = x.reshape(-1, K).to(cd)  # bfloat16 x: no copy
    if rotation is not None or perm is not None:  # the lookups' transform, rotated in float32 and rounded to cd
        xs = torch.ops.qlinear.x86_rotate(xs.contiguous(), *rotation_args(rotation, K), perm)
    if cd == torch.bfloat16 and amx is not None and amx_available():
        return amx(xs, bias).reshape(*x.shape[:-1], N)  # x's dtype, bfloat16
    yt = xs.new_empty(N, xs.shape[0])  # yᵀ: a tile is the GEMM's first operand (oneDNN packs only the second)
    blocks = max(1, (_TILE_BYTES if cd == torch.float32 else _TILE_BYTES_BF16) // (xs.element_size() * K * ROWS))
    for b0 in range(0, -(-N // ROWS), blocks):
        torch.mm(rows(b0, b0 + blocks, cd), xs.T, out=yt[b0 * ROWS:(b0 + blocks) * ROWS])
    y = yt.T.contiguous()
    if bias is not None:
        y += bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernels cannot run a BCQ layer of this config and shape (None if they can).  (Bits are the
    registry's check; group sizes and in_features are multiples of 32 in every BCQ layer: the format checks that.)"""
    if cfg.fp32_offset and not bcq.is_uniform(cfg):
        return "fp32 offsets (fp32_offset=True) are not supported; the x86 layout holds fp16 offsets"
    if cfg.bits > 4 and not bcq.is_uniform(cfg):
        return f"free-α BCQ at {cfg.bits} bits: the bit-plane kernels take 1-4 planes (uniform 5-8 bits run as bytes)"
    return None


for _fmt, _bits, _supports, _layout in (("bcq", set(range(1, 9)), supports, LAYOUT),
                                        ("codebook", {2, 4}, supports_codebook, CODEBOOK_LAYOUT)):
    register(Kernel(backend="x86", format=_fmt, fn=linear, priority=15, devices=frozenset({"cpu"}),
                    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}), bits=frozenset(_bits),
                    group_sizes=ANY, max_batch=ANY, min_capability=ANY, supports=_supports, available=available,
                    layout=_layout, gathers_perm=True, fuses_rotation=True))
# mixed 2/4/16: int8 activations per 16 inputs (mixed.cpp), the batched path from batched_from rows
register(Kernel(backend="x86", format="mixed", fn=linear_mixed, priority=15, devices=frozenset({"cpu"}),
                dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}), bits=ANY, group_sizes=ANY,
                max_batch=ANY, min_capability=ANY, supports=supports_mixed, available=available,
                layout=MIXED_LAYOUT, fuses_rotation=True))
