"""Arm NEON / dotprod / i8mm CPU kernels for :class:`qlinear.CodebookLinear` (bits 2 and 4) and uniform 4-8 bit
:class:`qlinear.BCQLinear` (Arm paper: "Highly Optimized Kernels and Fine-Grained Codebooks for LLM Inference
on Arm CPUs", §4 kernels, §5 codebooks).

``y = x Ŵᵀ + b`` for ``x`` ``[..., K]`` fp32/bf16/fp16 on CPU: activations are quantized to int8 per 32
inputs (one fp32 scale each, round half to even), weights decoded to int8 (MSB-toggled nibbles with
one shift or mask for BCQ, none at 5-8 bits; one table lookup per 16 weights for codebooks: ``vqtbl1q_s8`` into the
16-byte codebook register at 4 bits; at 2 bits, a lookup of two 2-bit indices (a nibble) into 16-entry
tables, or with several codebooks of (codebook id, nibble) into 64-entry ``vqtbl4q_s8`` tables),
products accumulated exactly in int32 by SDOT (decode, M ≤ 3) or SMMLA (M ≥ 4, i8mm), then
scaled in fp32.  Runtime dispatch by CPU features (``getauxval``), plain-NEON fallback.  On aarch64 the
M = 1 GEMVs (both layouts) and the 4-bit SMMLA tile for two activation-row pairs are inline assembly with the
same arithmetic as the intrinsics (checked bit for bit by the qemu harness).  Built just in time
(``backends/_native.py``); on x86 the same source compiles through SIMDe (intrinsics only).

Layouts (repacked once at load; :func:`repack_bcq` / :func:`repack_codebook` and their inverses are
exact, and the codes take the same bytes as the canonical ones): 8-row blocks (N padded with zero
rows), 32-input blocks, 16-byte vectors ``V[c][p]``: of 4 rows x 4 inputs in layout ``sdot`` (the default: SDOT
by element, ``vdotq_laneq_s32``, a row per lane and no horizontal adds in the GEMV; the SMMLA GEMM zips two such
vectors into 2 rows x 8 inputs), of 2 rows x 8 inputs in layout ``mmla`` (SMMLA without zips, but a pairwise add
per 4 rows and 32 inputs in the GEMV: for prompt-heavy use on i8mm CPUs, ``QLINEAR_ARM_LAYOUT=mmla``, see
:func:`default_layout`); the byte order is documented in ``qgemm.h``.
BCQ must be uniform (the uniform storage: round-to-nearest with ``init="uniform", iters=0``, GPTQ, or imported
GPTQ/AWQ weights): its layout stores the int4 code XOR 8, one fp16 ``s`` per group and BCQ's offset
``c = s·(7.5 − z)`` in float32 (``w = s·(code − 7.5) + c``); at 5-8 bits ``code − 2^(q−1)`` as an int8 byte (256
bytes per block: the vectors ``V[c][p]`` as they are; at 8 bits the code XOR 0x80) and ``c = s·((2^q − 1)/2 − z)``.

:func:`spec` is the executable PyTorch specification of the kernels' arithmetic over these layouts.
Error versus the reference backend comes only from the int8 activations: per output
``|y − y_ref| ≤ Σ_h (amax_h / 254) · Σ_{k∈h} |ŵ_k|`` plus fp32 rounding, where ``amax_h`` is the largest
``|x|`` of 32-input block ``h`` (round to nearest on a step of ``amax_h / 127``).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq
from qlinear.formats.packing import pack, unpack, unpack_u8

from .. import ANY, Kernel, Layout, register
from .._cpu import (pad_groups, pair_nibbles, quantize_activations, rotation_args, spec_input, supports_codebook,
                    unpad_groups, unpair_nibbles)
from .._native import OPENMP, build

__all__ = ["BCQ_LAYOUT", "CODEBOOK_LAYOUT", "LAYOUT", "default_layout", "spec", "linear", "available", "PATHS"]

_HERE = Path(__file__).parent
PATHS = {"auto": 0, "neon": 1, "dotprod": 2, "i8mm": 3}
_FMT_BCQ4, _FMT_CB4, _FMT_CB2, _FMT_U8 = 0, 1, 2, 3


# Per layout: the [Nb·8, K] codes viewed as (Nb, row bits.., H, input bits..) and the permutation to
# [Nb, H, c, p, i] (see _blocks).
_BLOCK_VIEWS = {
    "mmla": ((4, 2, -1, 4, 8), (0, 3, 4, 1, 2, 5)),        # (Nb, p, i//8, H, c, i%8)
    "sdot": ((2, 4, -1, 2, 4, 4), (0, 3, 5, 1, 4, 2, 6)),  # (Nb, p//2, i//4, H, p%2, c, i%4)
}


def _layout_arg(layout: Optional[str]) -> str:
    """``layout``, or the default (:data:`LAYOUT`) for None.  Raises ValueError for an unknown one."""
    layout = LAYOUT if layout is None else layout
    if layout not in _BLOCK_VIEWS:
        raise ValueError(f"layout {layout!r} is not one of {sorted(_BLOCK_VIEWS)}")
    return layout


def _blocks(codes: torch.Tensor, N: int, K: int, layout: str) -> torch.Tensor:
    """``[N, K]`` -> ``[Nb, H, 4 (chunk c), 4 (row pair p), 16]`` (zero rows pad N to 8): byte ``i`` of ``V[c][p]``
    of block ``(b, h)`` is, in layout ``mmla``, row ``8b + 2p + i // 8``, input ``32h + 8c + i % 8`` (2 rows x 8
    inputs, SMMLA), in layout ``sdot`` row ``8b + 4(p // 2) + i // 4``, input ``32h + 16(p % 2) + 4c + i % 4``
    (a row per 4-byte lane, SDOT by element)."""
    Nb, H = math.ceil(N / 8), K // 32
    padded = codes.new_zeros(Nb * 8, K)
    padded[:N] = codes
    shape, perm = _BLOCK_VIEWS[layout]
    return padded.view(Nb, *[H if d == -1 else d for d in shape]).permute(*perm).reshape(Nb, H, 4, 4, 16)


def _unblocks(v: torch.Tensor, N: int, K: int, layout: str) -> torch.Tensor:
    """Inverse of :func:`_blocks`."""
    Nb, H = v.shape[:2]
    shape, perm = _BLOCK_VIEWS[layout]
    dims = [Nb] + [H if d == -1 else d for d in shape]
    inv = [perm.index(i) for i in range(len(perm))]
    return v.reshape([dims[i] for i in perm]).permute(*inv).reshape(Nb * 8, K)[:N]


def _pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """``V[c][p]`` values 0..15 -> 128 bytes per block: bytes ``32c + 16P + i`` hold ``V[c][2P]`` (low
    nibble) and ``V[c][2P+1]`` (high)."""
    lo, hi = v[:, :, :, 0::2], v[:, :, :, 1::2]
    return (lo | (hi << 4)).to(torch.uint8).reshape(*v.shape[:2], 128)


def _unpack_nibbles(qw: torch.Tensor) -> torch.Tensor:
    b = qw.view(*qw.shape[:2], 4, 2, 16)
    return torch.stack([b & 15, b >> 4], 4).reshape(*qw.shape[:2], 4, 4, 16)


def _pack_crumbs(v: torch.Tensor) -> torch.Tensor:
    """``V[c][p]`` values 0..3 -> 64 bytes per block: byte ``16p + i`` holds the index of ``V[c][p]`` byte ``i``
    at bits ``2c, 2c + 1`` (its low nibble serves chunks 0-1 of row pair ``p``, its high nibble chunks 2-3)."""
    Nb, H = v.shape[:2]
    return sum(v[:, :, c] << (2 * c) for c in range(4)).to(torch.uint8).reshape(Nb, H, 64)


def _unpack_crumbs(qw: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_crumbs`: ``[Nb, H, 64]`` -> ``[Nb, H, 4, 4, 16]``."""
    Nb, H = qw.shape[:2]
    b = qw.view(Nb, H, 1, 4, 16)
    return (b >> (2 * torch.arange(4, device=qw.device, dtype=qw.dtype)).view(1, 1, 4, 1, 1)) & 3


def _book_shifts(device, layout: str) -> torch.Tensor:
    """Bit position of row ``r``'s 2-bit codebook id in the ``arm_qb`` word: layout ``mmla``, even rows in the low
    byte and odd rows in the high byte (one byte per lane half of a row-pair vector); layout ``sdot``, rows 0-3
    in the low byte and rows 4-7 in the high byte (one byte per 4-row vector)."""
    r = torch.arange(8, device=device)
    return 8 * (r % 2) + 2 * (r // 2) if layout == "mmla" else 8 * (r // 4) + 2 * (r % 4)


def _word_books(qb: torch.Tensor, layout: str) -> torch.Tensor:
    """``arm_qb`` int16 ``[Nb, G]`` -> the 8 rows' codebook ids int64 ``[Nb, G, 8]``."""
    word = qb.to(torch.int64) & 0xFFFF
    return (word[..., None] >> _book_shifts(qb.device, layout)) & 3


def _sdot_words(qweight: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """:func:`_pack_nibbles` of the layout ``sdot`` :func:`_blocks` of the codes ^ 8, straight from the uniform 4-bit
    ``qweight`` int32 ``[N, K/8]`` (code 8w + t at bits 4t of word w; little-endian hosts): a byte of the layout holds
    inputs ``32h + 4c + t`` and ``32h + 16 + 4c + t`` of one row (low, high nibble), the nibble pairs of the 16 bytes
    that pack those 32 inputs (:func:`pair_nibbles`), and its 4-byte groups (t = 0..3) move whole."""
    Nb, H = -(-N // 8), K // 32
    units = torch.zeros(Nb * 8, H, 16, dtype=torch.uint8, device=qweight.device)
    units[:N] = pair_nibbles(qweight.contiguous().view(torch.uint8).view(N, H, 16)) ^ 0x88
    v = units.view(torch.int32).view(Nb, 2, 4, H, 4)  # (b, P, row in the 4, h, c)
    return v.permute(0, 3, 4, 1, 2).contiguous().view(torch.uint8).view(Nb, H, 128)


def _words_of_sdot(qw: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`_sdot_words`: ``arm_qw`` ``[Nb, H, 128]`` of layout ``sdot`` -> ``qweight`` int32 ``[N, K/8]``."""
    Nb, H, _ = qw.shape
    v = qw.contiguous().view(torch.int32).view(Nb, H, 4, 2, 4).permute(0, 3, 4, 1, 2)  # (b, P, row, h, c)
    units = v.reshape(Nb * 8, H, 4)[:N].contiguous().view(torch.uint8).view(N, H, 16) ^ 0x88
    return unpair_nibbles(units).view(torch.int32).view(N, H * 4)


def repack_bcq(buffers: dict, cfg, N: int, K: int, layout: Optional[str] = None) -> dict:
    """Canonical uniform 4-bit or 5-8 bit BCQ -> ``layout`` (None: :data:`LAYOUT`) (``arm_qw`` uint8
    ``[Nb, K/32, 128]``, at 5-8 bits ``[Nb, K/32, 256]``, ``arm_qs`` fp16 ``[Nb, G, 8]``, ``arm_qz`` float32
    ``[Nb, G, 8]``).  Raises ValueError for non-uniform α or an unknown layout."""
    layout = _layout_arg(layout)
    words = cfg.bits == 4 and layout == "sdot" and "qweight" in buffers and sys.byteorder == "little"
    codes, s, zeros = bcq.uniform_parts(buffers, cfg, N, K, codes=None if words else torch.uint8)
    if words:
        qw = _sdot_words(buffers["qweight"], N, K)
    elif cfg.bits > 4:  # code − 2^(q−1) as int8 bytes
        stored = (codes.to(torch.int16) - 2 ** (cfg.bits - 1)).to(torch.int8).view(torch.uint8)
        qw = _blocks(stored, N, K, layout).reshape(-1, K // 32, 256).contiguous()
    else:
        qw = _pack_nibbles(_blocks(codes ^ 8, N, K, layout))
    out = {"arm_qw": qw, "arm_qs": pad_groups(s, N, 8)}
    if zeros is not None:
        out["arm_qz"] = pad_groups(bcq.uniform_offset(s, zeros, cfg.bits), N, 8)
    return out


def unrepack_bcq(buffers: dict, cfg, N: int, K: int, layout: Optional[str] = None) -> dict:
    """``layout`` (None: :data:`LAYOUT`) -> canonical BCQ buffers (exact inverse of :func:`repack_bcq`)."""
    layout = _layout_arg(layout)
    words = cfg.bits == 4 and layout == "sdot" and sys.byteorder == "little"
    qweight = _words_of_sdot(buffers["arm_qw"], N) if words else None
    codes = None
    if cfg.bits > 4:
        stored = _unblocks(_vectors(buffers["arm_qw"], cfg.bits).view(torch.int8), N, K, layout)
        codes = (stored.to(torch.int16) + 2 ** (cfg.bits - 1)).to(torch.uint8)
    elif not words:
        codes = _unblocks(_unpack_nibbles(buffers["arm_qw"]), N, K, layout) ^ 8
    s = unpad_groups(buffers["arm_qs"], N)
    zeros = bcq.uniform_zeros(s, unpad_groups(buffers["arm_qz"], N), cfg.bits) if "arm_qz" in buffers else None
    return bcq.uniform_buffers(codes, s, zeros, cfg.bits, qweight=qweight)


def _vectors(qw: torch.Tensor, bits: int) -> torch.Tensor:
    """A BCQ layer's ``arm_qw`` -> its stored values ``[Nb, H, 4, 4, 16]`` (codes XOR 8; at 5-8 bits the bytes)."""
    return qw.view(*qw.shape[:2], 4, 4, 16) if bits > 4 else _unpack_nibbles(qw)


def repack_codebook(buffers: dict, cfg, N: int, K: int, layout: Optional[str] = None) -> dict:
    """Canonical codebook buffers -> ``layout`` (None: :data:`LAYOUT`) (``arm_qw`` uint8 ``[Nb, K/32, 32·bits]``,
    ``arm_qs`` fp16 ``[Nb, G, 8]``, ``arm_qb`` int16 ``[Nb, G]`` when C > 1, ``codebooks`` unchanged).  Raises
    ValueError for an unknown layout."""
    layout = _layout_arg(layout)
    G, C = K // cfg.group_size, cfg.books
    v = _blocks(unpack_u8(buffers["codes"], cfg.bits, K), N, K, layout)
    qw = _pack_nibbles(v) if cfg.bits == 4 else _pack_crumbs(v)
    out = {"arm_qw": qw, "arm_qs": pad_groups(buffers["scales"], N, 8)}
    if C > 1:
        books = pad_groups(unpack(buffers["book_idx"], int(math.log2(C)), G), N, 8)  # [Nb, G, 8]
        word = (books << _book_shifts(books.device, layout)).sum(-1)                   # 16 bits
        out["arm_qb"] = torch.where(word >= 32768, word - 65536, word).to(torch.int16)
    out["codebooks"] = buffers["codebooks"]
    return out


def unrepack_codebook(buffers: dict, cfg, N: int, K: int, layout: Optional[str] = None) -> dict:
    """``layout`` (None: :data:`LAYOUT`) -> canonical codebook buffers (exact inverse of :func:`repack_codebook`)."""
    layout = _layout_arg(layout)
    C = cfg.books
    qw = buffers["arm_qw"]
    v = _unpack_nibbles(qw) if cfg.bits == 4 else _unpack_crumbs(qw)
    out = {"codes": pack(_unblocks(v, N, K, layout), cfg.bits)}
    if C > 1:
        out["book_idx"] = pack(unpad_groups(_word_books(buffers["arm_qb"], layout), N), int(math.log2(C)))
    out["scales"] = unpad_groups(buffers["arm_qs"], N)
    out["codebooks"] = buffers["codebooks"]
    return out


def default_layout() -> str:
    """The layout the repack produces (:data:`LAYOUT`, read once at import): the environment variable
    ``QLINEAR_ARM_LAYOUT`` if set (case and spaces ignored), else ``sdot``.  ``sdot`` is the faster GEMV
    (decoding) on every CPU; ``mmla`` the faster SMMLA GEMM (prompt processing, 4+ rows) on i8mm CPUs: per
    benchmarks/RESULTS.md, instructions per weight / multiply-accumulate.  Both run everywhere and give the same bits.  Raises ValueError for another
    value (at import, the backend then reports that error as the reason it is unavailable)."""
    layout = os.environ.get("QLINEAR_ARM_LAYOUT", "").strip().lower() or "sdot"
    if layout not in _BLOCK_VIEWS:
        raise ValueError(f"QLINEAR_ARM_LAYOUT={layout!r} is not one of {sorted(_BLOCK_VIEWS)}; unset it for sdot")
    return layout


try:
    LAYOUT, _LAYOUT_ERROR = default_layout(), None
except ValueError as e:  # importing qlinear still works; only this backend is off
    LAYOUT, _LAYOUT_ERROR = "sdot", str(e)
_SUFFIX = "" if LAYOUT == "sdot" else "_mmla"
BCQ_LAYOUT = Layout(name="arm_neon_bcq" + _SUFFIX,
                    names=lambda cfg: ("arm_qw", "arm_qs") + (("arm_qz",) if cfg.offset else ()),
                    repack=repack_bcq, unrepack=unrepack_bcq)
CODEBOOK_LAYOUT = Layout(name="arm_neon_codebook" + _SUFFIX,
                         names=lambda cfg: ("arm_qw", "arm_qs") + (("arm_qb",) if cfg.books > 1 else ()) + ("codebooks",),
                         repack=repack_codebook, unrepack=unrepack_codebook)


def _weights_int8(buffers: dict, format: int, cfg, N: int, K: int, layout: str) -> torch.Tensor:
    """The int8 weights ``[Nb·8, K]`` (int64) the kernels decode, read through the packed ``layout``."""
    qw = buffers["arm_qw"]
    if format == _FMT_U8:  # the bytes read as int8: code − 2^(q−1)
        return _unblocks(_vectors(qw, 8).view(torch.int8), qw.shape[0] * 8, K, layout).to(torch.int64)
    idx = _unpack_crumbs(qw) if format == _FMT_CB2 else _unpack_nibbles(qw)
    rows = _unblocks(idx, qw.shape[0] * 8, K, layout).to(torch.int64)
    if format == _FMT_BCQ4:
        return torch.where(rows >= 8, rows - 16, rows) * 16  # (nibble << 4) as int8 = 16·(code − 8)
    book = torch.zeros_like(rows)
    if cfg.books > 1:
        books = _word_books(buffers["arm_qb"], layout).transpose(1, 2)  # [Nb, 8, G]
        book = books.reshape(-1, books.shape[-1]).repeat_interleave(cfg.group_size, 1)
    return buffers["codebooks"].to(torch.int64)[book, rows]


def spec(x: torch.Tensor, buffers: dict, bias, cfg, format: int, N: int, K: int,
         layout: Optional[str] = None, rotation=None) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch over buffers packed in ``layout`` (None: :data:`LAYOUT`): ``x`` ``[M, K]``
    -> ``[M, N]`` float32 (equal to the native op up to the order of fp32 roundings).  ``rotation`` (seed, block): a
    rotated layer, whose input the kernels transform before quantizing it."""
    layout = _layout_arg(layout)
    gs = K if cfg.group_size == -1 else cfg.group_size
    x = spec_input(x, rotation, buffers.get("perm"))
    xq, xs = quantize_activations(x)
    M, H = x.shape[0], K // 32
    w = _weights_int8(buffers, format, cfg, N, K, layout)                      # [Nb·8, K]
    isum = torch.einsum("mhk,nhk->mnh", xq.view(M, H, 32).double(), w.view(-1, H, 32).double())  # exact
    s = unpad_groups(buffers["arm_qs"], buffers["arm_qs"].shape[0] * 8).float()  # [Nb·8, G]
    per = gs // 32
    t = s.repeat_interleave(per, 1)[:, :H] * (xs * (0.0625 if format == _FMT_BCQ4 else 1.0))[:, None, :]
    y = (isum.float() * t).sum(-1)
    if format in (_FMT_BCQ4, _FMT_U8):
        c = unpad_groups(buffers["arm_qz"], s.shape[0]).float() if cfg.offset else torch.zeros_like(s)
        z = c + 0.5 * s                                                        # [Nb·8, G]
        xb = xq.view(M, H, 32).sum(-1).float() * xs       # [M, H]: Σ x̂ per block (the int8 values the codes multiply)
        xsum = torch.stack([xb[:, h:h + per].sum(1) for h in range(0, H, per)], 1)  # [M, G]
        y = y + xsum @ z.T
    y = y[:, :N]
    return y if bias is None else y + bias.float()


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    if _LAYOUT_ERROR:
        return _LAYOUT_ERROR
    sources = tuple(str(_HERE / f) for f in ("kernels.cpp", "kernels_i8mm.cpp", "binding.cpp"))
    if platform.machine() in ("aarch64", "arm64"):
        flags = ("-O3", "-std=c++17", "-march=armv8.2-a+dotprod")
    else:
        try:
            import simde_py
        except ImportError:
            return "SIMDe headers not found (pip install 'simde-py>=0.8.2')"
        flags = ("-O3", "-std=c++17", "-march=native", f"-I{simde_py.get_include()}")
    return build("qlinear_arm_neon", sources, cflags=flags + OPENMP, ldflags=OPENMP)


def _format(cfg) -> int:
    if cfg.format == "bcq":
        return _FMT_U8 if cfg.bits > 4 else _FMT_BCQ4
    return _FMT_CB4 if cfg.bits == 4 else _FMT_CB2


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int, path: str = "auto",
           layout: Optional[str] = None, rotation=None):
    """Registry entry: ``x`` ``[..., K]`` on CPU -> ``[..., N]`` of ``x.dtype``, over buffers packed in ``layout``
    (default: :data:`LAYOUT`, what the repack produces).  ``rotation`` (seed, block): the layer's randomized Hadamard,
    applied to x inside the op before its int8 quantization (the kernel ``fuses_rotation``); an act_order layer's
    ``perm`` in ``buffers`` is gathered there too, after it (``gathers_perm``)."""
    layout = _layout_arg(layout)
    x2 = x.reshape(-1, in_features).float().contiguous()
    gs = in_features if cfg.group_size == -1 else cfg.group_size
    y = torch.ops.qlinear.arm_gemm(x2, buffers["arm_qw"], buffers["arm_qs"], buffers.get("arm_qz"),
                                   buffers.get("arm_qb"), buffers.get("codebooks"), bias, _format(cfg),
                                   getattr(cfg, "books", 1), out_features, gs, PATHS[path],
                                   0 if layout == "mmla" else 1, *rotation_args(rotation, in_features),
                                   buffers.get("perm"))
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def supports_bcq(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernel cannot run a BCQ layer of this config (None if it can)."""
    if cfg.bits < 4:
        return f"bits={cfg.bits}: only 4-8 bit uniform BCQ is supported"
    if not bcq.is_uniform(cfg):
        return "α must be uniform (GPTQ, round-to-nearest init='uniform', iters=0, or imported GPTQ/AWQ weights)"
    if cfg.group_size != -1 and cfg.group_size % 32:
        return f"group_size={cfg.group_size} is not a multiple of 32"
    return None


# Preferred on Arm; on x86 (SIMDe emulation) below the reference unless benchmarks/bench_arm.py shows a win.
_PRIORITY = 20 if platform.machine() in ("aarch64", "arm64") else -10
for _fmt, _bits, _layout, _supports in (("codebook", {2, 4}, CODEBOOK_LAYOUT, supports_codebook),
                                        ("bcq", {4, 5, 6, 7, 8}, BCQ_LAYOUT, supports_bcq)):
    register(Kernel(backend="arm_neon", format=_fmt, fn=linear, priority=_PRIORITY, devices=frozenset({"cpu"}),
                    bits=frozenset(_bits), group_sizes=ANY, max_batch=ANY, min_capability=ANY,
                    dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}), supports=_supports,
                    available=available, layout=_layout, gathers_perm=True, fuses_rotation=True))
