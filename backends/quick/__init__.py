"""QUICK tensor-core GEMM for :class:`qlinear.BCQLinear` layers (Kim et al., "QUICK: Quantization-aware
Interleaving and Conflict-free Kernel for efficient LLM inference", §3.1-3.2, Fig. 4-6), uniform (kernel ``quick``)
or with free α (kernel ``quick_free``: the stretch goal of QUICK for BCQ, see below).

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16, ``M = 1..512``, BCQ with uniform α (``α_i = s·2^(i-2)``:
group-wise int2/int3/int4 with a zero point, from round-to-nearest, GPTQ or an imported GPTQ/AWQ checkpoint),
any group size that is a multiple of 32 or the whole row, fp32 accumulation with ``mma.sync.m16n8k16``,
deterministic split-K.  Weights go from DRAM straight into the registers in the order the ``mma`` consumes
them; only activations pass through shared memory (``cp.async`` pipeline + ``ldmatrix``).  The kernel is
``quick_gemm.cu``; :func:`dequantize` is the dense fp16/bf16 weight (for dequantize + cuBLAS at large M).

Layout ``quick`` (repacked once when a module lands on a GPU; :func:`unrepack` restores the canonical
uniform storage exactly).  With ``s`` the group scale and ``z`` its zero point, a weight with integer code
``q = Σ_i bit_i·2^(i-1)`` is ``ŵ = s·(q − z)`` (BCQ module docstring; ``z = (2^Q − 1)/2`` without offset).

* **Tiles.**  A warp owns a tile of 32 output rows × 64 inputs: 4 ``n8`` column blocks × 4 ``k16`` steps of
  the ``mma``'s B operand (B = Ŵᵀ, ``K × N``).  Tiles are stored row-tile-major, K-tile-minor, so a warp
  walking K streams contiguous memory.
* **Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", B operand, .f16/.bf16).**  Lane ``l`` holds
  ``b0, b1, b2, b3`` = ``B[k][n]`` with ``n = l / 4`` and ``k = 2·(l % 4) + (i % 2) + 8·(i / 2)`` for
  ``b_i``; ``(b0, b1)`` and ``(b2, b3)`` are the two 32-bit registers.  A lane thus needs, per tile,
  64 codes: the 16 fragments ``(ks, nt)``, register ``h``, element ``e``, in the order
  ``pair p = (ks·4 + nt)·2 + h`` (32 pairs), ``e`` = low/high half.
* **Converter order (Fig. 5-6).**  Codes are split into chunks of width ``c``: Q=4 → one 4-bit chunk;
  Q=3 → a 2-bit chunk (bits 0-1) and a 1-bit chunk (bit 2); Q=2 → one 2-bit chunk.  A 32-bit word of a
  width-``c`` chunk holds ``16/c`` pairs: pair ``j`` has its low element at bits ``c·j`` and its high
  element at bits ``c·j + 16``, so ``(word >> c·j) & mask`` (``mask = (2^c − 1)·0x00010001``) puts both
  codes of pair ``j`` in the two halves at once, and OR-ing the magic exponent (``0x6400`` = 1024.0 in
  fp16, ``0x4300`` = 128.0 in bf16) turns them into ``1024 + q`` (``128 + q``) without a conversion
  instruction (one ``lop3``).  Pair ``p`` sits in word ``p // (16/c)`` of its chunk.
* ``quick_qweight`` int32 ``[N/32, K/64, 64·Q]``: per tile, chunk 0's words lane-major (lane ``l`` owns
  words ``2c₀·l .. 2c₀·l + 2c₀ − 1``: one 32-byte (Q=4) or 16-byte (Q=2, 3) load), then chunk 1's (Q=3:
  2 words per lane, one 8-byte load).  A warp reads ``256·Q`` contiguous bytes per tile.
* ``quick_scales`` fp16 ``[G, N]`` (``s``) and ``quick_zeros`` int16 ``[G, N/4]`` (``z``, absent without offset:
  16-bit word ``j`` holds the 4-bit zero points of positions ``4j .. 4j + 3``, position ``4j + i`` at bits
  ``4i .. 4i + 3``; 4-bit g128: 4 + 20/128 = 4.156 bits per weight, as canonical), rows permuted
  within each 32-row tile to position ``(r % 8)·4 + r / 8``: the four rows ``nt·8 + l/4`` a lane needs are
  contiguous (one 8-byte load of scales, one 2-byte load of zero points).

**Free α** (the BCQ fit's non-uniform levels, ``ŵ = Σ_i α_i·(2·bit_i − 1) + c``): ``quick_qweight`` holds the codes
``q = Σ_i bit_i·2^i`` of the bit-planes, exactly as above; ``quick_alpha`` fp16 ``[G, Q, N]`` (α of plane ``i`` at
``[g, i]``) and ``quick_offset`` fp16 ``[G, N]`` (absent without offset) take the scales' row permutation (the same
size as the canonical planes, α and offsets).  Per group and row, once: ``a_i = T(2·α_i)`` and
``c'_T = T(c − α_1 − ... − α_Q)`` (fp32 subtractions in plane order); per register pair ``ŵ = c'_T``, then per plane
``b = (magic | bit_i) − magic`` (0 or 1, exact) and ``ŵ = fma(b, a_i, ŵ)`` (one rounding each).  fp32 offsets
(``fp32_offset=True``) are not held.

Dequantization in the kernel, per register pair, in the activation dtype T: per group and row, once,
``s_T = T(s)`` and ``c'_T = T(−s·z)`` (fp32 arithmetic, exact before the rounding); per pair
``v = (magic | q) − magic`` (exact: the integer code) and ``ŵ = fma(v, s_T, c'_T)`` (one rounding).
:func:`fragments` is the executable spec of all of this: it computes, from the repacked buffers and with the
kernel's index and bit arithmetic, the values every lane holds for every fragment; CPU tests compare it with
the dense weight placed by the PTX table (:func:`ptx_fragments`), and GPU tests compare the kernel with the
reference.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq
from qlinear.formats import rotation as _rotation
from qlinear.formats.packing import pack_planes, unpack_planes

from .. import ANY, Kernel, Layout, register
from .._native import build_cuda_backend, dense_linear
from .._gpu import mma_plan as plan  # noqa: F401  (quick.plan: the GEMM's launch shape)
from .._gpu import rotation_smem_bytes, staged_rotation
from .._native import sm_count as _sms  # module attribute: tests replace it without a GPU

__all__ = ["LAYOUT", "TILE_N", "TILE_K", "MAX_BATCH", "repack", "unrepack", "fragments", "ptx_fragments",
           "dense_from_fragments", "round_to", "spec", "dequantize", "plan", "linear", "linear_free", "linear_dequantized",
           "holds", "supports", "supports_free"]

TILE_N, TILE_K = 32, 64
MAX_BATCH = 512
BITS = (2, 3, 4)
CHUNKS = {2: (2,), 3: (2, 1), 4: (4,)}  # chunk widths, lowest code bits first
_HERE = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def _lane_slots() -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, k)`` int64 ``[32, 64]``: for lane ``l`` and slot ``f = 2·p + e`` (pair ``p``, element ``e``),
    the row (within the 32-row tile) and the input (within the 64-input tile) of the code it holds."""
    lane = torch.arange(32, device="cpu")[:, None]  # cached: not the ambient (maybe meta) default device
    f = torch.arange(64, device="cpu")[None]
    p, e = f // 2, f % 2
    ks, nt, h = p // 8, (p // 2) % 4, p % 2
    i = 2 * h + e                                   # b_i of the fragment
    row = nt * 8 + lane // 4                        # n
    k = ks * 16 + 2 * (lane % 4) + (i % 2) + 8 * (i // 2)
    return row.expand(32, 64).contiguous(), k


def _row_order(N: int) -> torch.Tensor:
    """Stored position -> row of the scale/offset permutation (rows ``(r % 8)·4 + r / 8`` within 32-row tiles)."""
    pos = torch.arange(TILE_N)
    row_of_pos = (pos % 4) * 8 + pos // 4
    return (torch.arange(0, N, TILE_N)[:, None] + row_of_pos).flatten()


def _names(cfg) -> tuple[str, ...]:
    if not bcq.is_uniform(cfg):
        return ("quick_qweight", "quick_alpha") + (("quick_offset",) if cfg.offset else ())
    return ("quick_qweight", "quick_scales") + (("quick_zeros",) if cfg.offset else ())


def repack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Canonical BCQ buffers -> layout ``quick`` (module docstring).  Raises ValueError for a config or a shape the
    layout cannot hold (see :func:`holds`)."""
    why = holds(cfg, out_features, in_features)
    if why is not None:
        raise ValueError(f"quick layout: {why}")
    N, K = out_features, in_features
    order = _row_order(N)
    if not bcq.is_uniform(cfg):
        planes = buffers["planes"]
        out = {"quick_qweight": _pack_codes(unpack_planes(planes, K), N, K, cfg.bits),
               "quick_alpha": buffers["alpha"].permute(2, 0, 1)[:, :, order.to(planes.device)].contiguous()}
        if cfg.offset:
            out["quick_offset"] = buffers["offset"].T[:, order.to(planes.device)].contiguous()
        return out
    codes, s, zeros = bcq.uniform_parts(buffers, cfg, N, K)                      # [N, K], [N, G], [N, G]
    order = order.to(codes.device)
    out = {"quick_qweight": _pack_codes(codes, N, K, cfg.bits), "quick_scales": s.T[:, order].contiguous()}
    if zeros is not None:
        z = zeros.T[:, order].reshape(-1, N // 4, 4) << torch.arange(0, 16, 4, device=zeros.device)
        z = z.sum(-1)
        out["quick_zeros"] = torch.where(z >= 2 ** 15, z - 2 ** 16, z).to(torch.int16)
    return out


def _pack_codes(codes: torch.Tensor, N: int, K: int, Q: int) -> torch.Tensor:
    """Codes ``[N, K]`` -> ``quick_qweight`` int32 ``[N/32, K/64, 64·Q]`` (fragment and converter order)."""
    row, k = (t.to(codes.device) for t in _lane_slots())
    tiles = codes.reshape(N // TILE_N, TILE_N, K // TILE_K, TILE_K).permute(0, 2, 1, 3)
    slots = tiles[:, :, row, k]                                                   # [Nt, Kt, 32, 64]
    words, shift = [], 0
    for c in CHUNKS[Q]:
        v = ((slots >> shift) & ((1 << c) - 1)).reshape(*slots.shape[:2], 32, 2 * c, 16 // c, 2)
        pos = c * torch.arange(16 // c, device=codes.device)
        w = ((v[..., 0] << pos) | (v[..., 1] << (pos + 16))).sum(-1)             # [Nt, Kt, 32, 2c]
        words.append(w.reshape(*slots.shape[:2], -1))
        shift += c
    qweight = torch.cat(words, -1)
    return torch.where(qweight >= 2 ** 31, qweight - 2 ** 32, qweight).to(torch.int32).contiguous()


def _chunk_values(qweight: torch.Tensor, Q: int) -> torch.Tensor:
    """Codes ``[Nt, Kt, 32, 64]`` (lane, slot) from ``quick_qweight`` with the kernel's shifts and masks."""
    words = qweight.long() & 0xFFFFFFFF
    codes, start, shift = 0, 0, 0
    for c in CHUNKS[Q]:
        n = 32 * 2 * c
        w = words[..., start:start + n].reshape(*words.shape[:2], 32, 2 * c, 1)   # lane l: words 2c·l ..
        j = torch.arange(16 // c, device=words.device)
        both = (w >> (c * j)) & (((1 << c) - 1) * 0x00010001)                     # pair j in the two halves
        pair = torch.stack((both & 0xFFFF, both >> 16), -1)                       # [.., 32, 2c, 16/c, 2]
        codes = codes + (pair.reshape(*words.shape[:2], 32, 64) << shift)
        start, shift = start + n, shift + c
    return codes


def unrepack(buffers: dict, cfg, out_features: int, in_features: int) -> dict:
    """Layout ``quick`` -> canonical BCQ buffers (exact inverse of :func:`repack`)."""
    N, K, Q = out_features, in_features, cfg.bits
    slots = _chunk_values(buffers["quick_qweight"], Q)
    row, k = (t.to(slots.device) for t in _lane_slots())
    tiles = torch.empty(N // TILE_N, K // TILE_K, TILE_N, TILE_K, dtype=torch.int64, device=slots.device)
    tiles[:, :, row, k] = slots
    codes = tiles.permute(0, 2, 1, 3).reshape(N, K)
    inv = torch.argsort(_row_order(N)).to(slots.device)
    if not bcq.is_uniform(cfg):
        out = {"planes": pack_planes(codes, Q), "alpha": buffers["quick_alpha"][:, :, inv].permute(1, 2, 0).contiguous()}
        if cfg.offset:
            out["offset"] = buffers["quick_offset"][:, inv].T.contiguous()
        return out
    s = buffers["quick_scales"][:, inv].T.contiguous()
    zeros = _zeros(buffers["quick_zeros"])[:, inv].T if "quick_zeros" in buffers else None
    return bcq.uniform_buffers(codes, s, zeros, Q)


def _zeros(words: torch.Tensor) -> torch.Tensor:
    """Zero points int64 ``[G, N]`` (stored positions) from ``quick_zeros`` int16 ``[G, N/4]``, as the kernel reads them."""
    w = words.long() & 0xFFFF
    return ((w[..., None] >> torch.arange(0, 16, 4, device=w.device)) & 15).reshape(w.shape[0], -1)


LAYOUT = Layout(name="quick", names=_names, repack=repack, unrepack=unrepack)


def fragments(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float16
              ) -> torch.Tensor:
    """Executable spec of the kernel's weight path: float32 ``[N/32, K/64, 4 (ks), 4 (nt), 32 (lane), 4 (b_i)]``,
    the dequantized B-fragment values each lane holds, computed from the ``quick`` buffers with the kernel's
    word addressing, shifts/masks, scale/offset addressing and rounding (``fma`` in ``dtype``)."""
    N, K, Q = out_features, in_features, cfg.bits
    v = _chunk_values(buffers["quick_qweight"], Q).double()                    # (magic | q) − magic: exact
    Nt, Kt = N // TILE_N, K // TILE_K
    lane = torch.arange(32)
    f = torch.arange(64)
    ks, nt = f // 16, (f // 4) % 4
    gs = cfg.group(K)
    group = (torch.arange(Kt)[:, None] * TILE_K + ks[None] * 16) // gs         # [Kt, 64]
    pos = (lane // 4)[:, None] * 4 + nt[None]                                   # [32, 64] position in the row tile
    col = torch.arange(Nt)[:, None, None, None] * TILE_N + pos[None, None]     # [Nt, 1, 32, 64]
    g = group[None, :, None, :]                                                # [1, Kt, 1, 64]

    def load(name):
        return buffers[name].float()[g, col]                                   # [Nt, Kt, 32, 64]

    if "quick_alpha" in buffers:                                                # free α
        alpha = buffers["quick_alpha"].float()                                  # [G, Q, N]
        c = load("quick_offset") if "quick_offset" in buffers else torch.zeros(())
        for i in range(Q):
            c = c - alpha[:, i][g, col]                                         # fp32, in plane order
        w, codes = c.to(dtype).double(), v.long()
        for i in range(Q):                                                      # fma in T per plane: one rounding each
            w = round_to(((codes >> i) & 1).double() * (2 * alpha[:, i][g, col]).to(dtype).double() + w, dtype).double()
        w = w.float()
    else:
        s = load("quick_scales")
        z = _zeros(buffers["quick_zeros"]).float()[g, col] if "quick_zeros" in buffers else (2 ** Q - 1) / 2
        c = (-s * z).to(dtype).double()                                         # c'_T: exact fp32 product, one rounding
        w = round_to(v * s.to(dtype).double() + c, dtype).float()               # fma in T: one rounding
    return w.reshape(Nt, Kt, 32, 4, 4, 4).permute(0, 1, 3, 4, 2, 5).contiguous()  # p = (ks·4 + nt)·2 + h


_FORMATS = {torch.float16: (10, -14), torch.bfloat16: (7, -126), torch.float32: (23, -126)}  # mantissa bits, emin


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded once (to nearest, ties to even) to ``dtype`` (torch's own float64 -> fp16/bf16
    conversion goes through float32 and can round twice; a fused multiply-add rounds once)."""
    mant, emin = _FORMATS[dtype]
    exp = torch.floor(torch.log2(x.abs())).clamp(min=emin)
    ulp = torch.exp2(exp - mant)
    return (torch.round(x / ulp) * ulp).to(dtype)


def ptx_fragments(weight: torch.Tensor) -> torch.Tensor:
    """The B fragments of ``Bᵀ = weight`` ``[N, K]`` straight from the PTX ISA table for ``m16n8k16``
    (lane ``l``, ``b_i``: ``n = l/4``, ``k = 2(l%4) + i%2 + 8(i/2)``), tiled like :func:`fragments`."""
    N, K = weight.shape
    lane, i = torch.arange(32)[:, None], torch.arange(4)[None]
    n, k = lane // 4, 2 * (lane % 4) + i % 2 + 8 * (i // 2)                     # [32, 4]
    t = weight.reshape(N // TILE_N, 4, 8, K // TILE_K, 4, 16).permute(0, 3, 4, 1, 2, 5)  # [Nt, Kt, ks, nt, n, k]
    return t[..., n, k]                                                          # [Nt, Kt, ks, nt, 32, 4]


def dense_from_fragments(frags: torch.Tensor) -> torch.Tensor:
    """Inverse placement of :func:`ptx_fragments`: ``[N, K]`` from fragment values."""
    Nt, Kt = frags.shape[:2]
    lane, i = torch.arange(32)[:, None], torch.arange(4)[None]
    n, k = lane // 4, 2 * (lane % 4) + i % 2 + 8 * (i // 2)
    out = frags.new_empty(Nt, 4, 8, Kt, 4, 16)
    out.permute(0, 3, 4, 1, 2, 5)[..., n, k] = frags
    return out.reshape(Nt * TILE_N, Kt * TILE_K)


def spec(x: torch.Tensor, buffers: dict, bias: Optional[torch.Tensor], cfg, out_features: int, in_features: int,
         dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """``y`` float32 ``[M, N]`` = x (rounded to ``dtype``) times the spec's fragments, fp32 accumulation."""
    w = dense_from_fragments(fragments(buffers, cfg, out_features, in_features, dtype))
    y = x.to(dtype).float() @ w.T
    return y if bias is None else y + bias.float()


def holds(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the ``quick`` layout cannot hold a BCQ layer of this config and shape (None if it can)."""
    if cfg.bits not in BITS:
        return f"bits={cfg.bits} not in {list(BITS)}"
    if cfg.fp32_offset and not bcq.is_uniform(cfg):
        return "fp32 offsets (fp32_offset=True) are not supported; the quick layout holds fp16 offsets"
    if out_features % TILE_N or in_features % TILE_K:
        return f"needs out_features % {TILE_N} == 0 and in_features % {TILE_K} == 0, got {out_features}x{in_features}"
    if in_features >= 1 << 20:  # quick_gemm.cu's GroupOf
        return f"in_features={in_features} is not below 2^20"
    return None


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why kernel ``quick`` (uniform layers) cannot run a BCQ layer of this config and shape (None if it can)."""
    if not bcq.is_uniform(cfg):
        return ("α are not uniform (needs method='gptq', round-to-nearest init='uniform' iters=0, or imported weights); "
                "free-α layers take backend 'quick_free'")
    return holds(cfg, out_features, in_features)


def supports_free(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why kernel ``quick_free`` (free-α layers) cannot run a BCQ layer of this config and shape (None if it can)."""
    if bcq.is_uniform(cfg):
        return "uniform layers take backend 'quick'"
    return holds(cfg, out_features, in_features)


def _weights(buffers: dict, cfg, in_features: int):
    """The op's ``(qweight, scales, zeros, group_size)``: free α passes ``quick_alpha`` and ``quick_offset`` there."""
    names = _names(cfg)
    return buffers[names[0]], buffers[names[1]], buffers[names[2]] if len(names) > 2 else None, cfg.group(in_features)


SMEM_BUDGET = 48 * 1024  # shared memory per block that keeps the four blocks per SM plan() counts on


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int,
           rotation: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Registry entry of the GEMM: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most 512 rows -> ``[..., N]``.  An act_order
    layer's ``perm`` (in ``buffers``) is applied as the kernel loads x into shared memory (no separate gather).  A
    rotated layer's ``rotation = (seed, block)``: on 16-row tiles without ``perm`` (but for free α at 2 bits, whose
    kernel spilled with it: nvcc 13, sm_80), where
    its blocks' ``R·x`` (their K slice, rows padded by 8 inputs) fits :data:`SMEM_BUDGET`, each block stages ``R·x``
    itself and reads its A fragments from it; otherwise x is rotated first
    (:func:`qlinear.backends._gpu.staged_rotation`)."""
    M, K = x.numel() // in_features, in_features
    tile_m, per_split, splits = launch = plan(M, out_features, K, _sms(x.device.index or 0))
    perm = buffers.get("perm")
    smem = math.inf
    if rotation is not None and tile_m == 16 and perm is None and (bcq.is_uniform(cfg) or cfg.bits > 2):
        smem = rotation_smem_bytes(0, rotation[1], min(16, M) * (min(K, TILE_K * per_split) + 8), x.element_size())
    x, rot = staged_rotation(x, rotation, smem, SMEM_BUDGET)
    qweight, scales, zeros, gs = _weights(buffers, cfg, K)
    y = torch.ops.qlinear.quick_gemm(x.reshape(-1, K).contiguous(), qweight, scales, zeros, perm, bias, gs, *launch,
                                     *rot)
    return y.reshape(*x.shape[:-1], out_features)


def dequantize(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (fp16/bf16) from the ``quick`` buffers on a GPU, rounded as in the GEMM."""
    qweight, scales, zeros, gs = _weights(buffers, cfg, in_features)
    return torch.ops.qlinear.quick_dequantize(qweight, scales, zeros, gs, in_features, dtype)


def linear_free(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int,
                rotation: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Registry entry for free-α layers, every batch: the GEMM up to :data:`MAX_BATCH` rows, dequantize + cuBLAS
    above (a layer held in the ``quick`` layout converts nothing at any batch).  Both read an act_order layer's x
    through ``perm`` (the kernel ``gathers_perm``) and a rotated layer's ``R·x`` (as :func:`linear`; rotated first
    for cuBLAS)."""
    if x.numel() // in_features <= MAX_BATCH:
        return linear(x, buffers, bias, cfg, out_features, in_features, rotation)
    x = x if rotation is None else _rotation.rotate_input(x, *rotation)
    perm = buffers.get("perm")
    x = x if perm is None else x.index_select(-1, perm)
    return linear_dequantized(x, buffers, bias, cfg, out_features, in_features)


def linear_dequantized(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry of dequantize + cuBLAS (large M): ``x`` ``[..., K]`` fp16/bf16 on CUDA -> ``[..., N]``."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_quick", _HERE)


_COMMON = dict(format="bcq", devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
               bits=frozenset(BITS), group_sizes=ANY, min_capability=(8, 0), available=available, layout=LAYOUT)
register(Kernel(backend="quick", fn=linear, priority=20, max_batch=MAX_BATCH, gathers_perm=True, fuses_rotation=True,
                supports=supports, **_COMMON))
register(Kernel(backend="quick_dequant", fn=linear_dequantized, priority=5, max_batch=ANY, supports=supports, **_COMMON))
# Free α: below the LUT GEMV and its dequantize path (priorities 10 and 4), so taken where a GPU's measured dispatch
# table (benchmarks/tune_dispatch.py) prefers it or by backend="quick_free": on an H200 (2026-11-27) it took 52.7 µs
# at 8192², 4 bits, batch 1, the LUT GEMV 26.2
register(Kernel(backend="quick_free", fn=linear_free, priority=3, max_batch=ANY, gathers_perm=True,
                fuses_rotation=True, supports=supports_free, **_COMMON))
