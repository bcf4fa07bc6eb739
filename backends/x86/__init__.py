"""x86 CPU kernels (AVX-512 VNNI, AVX2 + AVX-VNNI, AVX2, scalar) for 4-bit :class:`qlinear.BCQLinear`: uniform
(round-to-nearest, GPTQ, imported GPTQ/AWQ weights) and free-α BCQ (the BCQ fit, activation-aware or not).

The Arm paper's recipe ("Highly Optimized Kernels and Fine-Grained Codebooks for LLM Inference on Arm CPUs", §4)
carried to x86: activations quantized to int8 per 32 inputs (:func:`qlinear.backends._cpu.quantize_activations`),
weights interleaved offline so that one 64-byte load feeds VPDPBUSD (x86's SDOT: u8 x s8 dot products of 4 into
int32 lanes) for 16 rows at once, products accumulated exactly in int32 and scaled in fp32 per 32 inputs.  The
zero point is applied per group with the sum of the quantized activations.  Free-α BCQ runs one VPDPBUSD per
bit-plane of the same packed codes (``code & 2^i``) and scales each plane's sum by its α per group: with ``w = Σ_i
α_i·(2·bit_i − 1) + c``, ``Σ_k w_k·x̂_k = Σ_i α_i·2^(1−i)·Σ_k (code_k & 2^i)·x̂_k + (c − Σ_i α_i)·Σ_k x̂_k`` (LUT-GEMM's
binary-coding arithmetic, with int8 dot products in place of its tables).  Either way the error versus the
reference is the activations' rounding alone: per output ``|y − y_ref| ≤ Σ_h (amax_h / 254) · Σ_{k∈h} |ŵ_k|`` plus fp32
rounding (``amax_h``: the largest ``|x|`` of 32-input block ``h``), as for the Arm kernels.

Paths, chosen from cpuid once (``path`` forces one): AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2 (VPMADDUBSW +
VPMADDWD), scalar C++.  All compute the same int32 sums and the same fp32 operations in the same order: they give
the same bits.  Built just in time (``backends/_native.py``) with baseline flags; each SIMD path carries its own
``target`` attribute.  Rows are split across threads with ``at::parallel_for``.

Layout ``x86_4bit`` (repacked once at load; :func:`repack` / :func:`unrepack` are exact inverses): see
``qgemm.h``: ``x86_qw`` uint8 ``[Nb, K/8, 64]`` (16-row blocks, 8-input chunks, byte ``4r + j`` holds code
``[16b + r, 8c + j]`` in its low nibble and ``[16b + r, 8c + 4 + j]`` in its high nibble); uniform layers add
``x86_qs`` fp16 ``[Nb, G, 16]`` and ``x86_qz`` uint8 ``[Nb, G, 16]`` holding ``2·z`` (15 for the symmetric grid's
``z = 7.5``), free-α layers ``x86_qa`` fp16 ``[Nb, G, 4, 16]`` (α per plane) and ``x86_qc`` fp16 ``[Nb, G, 16]`` (the
offset, 0 without one).
:func:`spec` is the executable PyTorch specification of the kernels' arithmetic over this layout.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq
from qlinear.formats.packing import pack_planes, unpack_planes

from .. import ANY, Kernel, Layout, register
from .._cpu import pad_groups, quantize_activations, unpad_groups
from .._native import OPENMP, build

__all__ = ["LAYOUT", "PATHS", "repack", "unrepack", "spec", "linear", "available", "supports"]

_HERE = Path(__file__).parent
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx2_vnni": 3, "avx512_vnni": 4}
ROWS = 16  # rows per block (one 32-bit lane each of a 512-bit register)


def _interleave(codes: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Codes ``[N, K]`` (0..15) -> ``x86_qw`` uint8 ``[Nb, K/8, 64]`` (zero rows pad N to 16)."""
    Nb = -(-N // ROWS)
    padded = codes.new_zeros(Nb * ROWS, K)
    padded[:N] = codes
    v = padded.view(Nb, ROWS, K // 8, 2, 4).permute(0, 2, 1, 4, 3)  # (b, chunk c, row r, j, half)
    return (v[..., 0] | (v[..., 1] << 4)).to(torch.uint8).reshape(Nb, K // 8, 64)


def _deinterleave(qw: torch.Tensor, K: int) -> torch.Tensor:
    """Inverse of :func:`_interleave`: ``[Nb, K/8, 64]`` -> codes ``[Nb·16, K]`` int64."""
    Nb = qw.shape[0]
    b = qw.view(Nb, K // 8, ROWS, 4).to(torch.int64)
    v = torch.stack([b & 15, b >> 4], -1)  # (b, c, r, j, half)
    return v.permute(0, 2, 1, 4, 3).reshape(Nb * ROWS, K)


def repack(buffers: dict, cfg, N: int, K: int) -> dict:
    """Canonical 4-bit BCQ -> layout ``x86_4bit`` (see the module docstring)."""
    if not bcq.is_uniform(cfg):
        alpha = buffers["alpha"]  # [4, N, G]
        offset = buffers["offset"] if cfg.offset else torch.zeros_like(alpha[0])
        return {"x86_qw": _interleave(unpack_planes(buffers["planes"], K), N, K),
                "x86_qa": torch.stack([pad_groups(a, N, ROWS) for a in alpha], 2),
                "x86_qc": pad_groups(offset, N, ROWS)}
    codes, s, zeros = bcq.uniform_parts(buffers, cfg, N, K)
    z2 = torch.full_like(s, 15, dtype=torch.int64) if zeros is None else 2 * zeros
    return {"x86_qw": _interleave(codes, N, K), "x86_qs": pad_groups(s.to(torch.float16), N, ROWS),
            "x86_qz": pad_groups(z2.to(torch.uint8), N, ROWS)}


def unrepack(buffers: dict, cfg, N: int, K: int) -> dict:
    """Layout ``x86_4bit`` -> canonical BCQ buffers (exact inverse of :func:`repack`)."""
    codes = _deinterleave(buffers["x86_qw"], K)[:N]
    if not bcq.is_uniform(cfg):
        qa = buffers["x86_qa"]
        out = {"planes": pack_planes(codes, 4),
               "alpha": torch.stack([unpad_groups(qa[:, :, i], N) for i in range(4)])}
        if cfg.offset:
            out["offset"] = unpad_groups(buffers["x86_qc"], N)
        return out
    zeros = unpad_groups(buffers["x86_qz"], N).to(torch.int64) // 2 if cfg.offset else None
    return bcq.uniform_buffers(codes, unpad_groups(buffers["x86_qs"], N), zeros, 4)


def _names(cfg) -> tuple[str, ...]:
    return ("x86_qw", "x86_qs", "x86_qz") if bcq.is_uniform(cfg) else ("x86_qw", "x86_qa", "x86_qc")


LAYOUT = Layout(name="x86_4bit", names=_names, repack=repack, unrepack=unrepack)


def spec(x: torch.Tensor, buffers: dict, bias, cfg, N: int, K: int) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch over layout ``x86_4bit``: ``x`` ``[M, K]`` -> ``[M, N]`` float64, the value
    the kernels round in fp32: exact int32 sums, then per 32-input block ``h`` ``xs_h·s·(Σ code·xq − z·Σ xq)``
    (uniform) or ``xs_h·(Σ_i α_i·2^(1−i)·Σ (code & 2^i)·xq + (c − Σ_i α_i)·Σ xq)`` (free α)."""
    xq, xs = quantize_activations(x)
    M, H = x.shape[0], K // 32
    gs = K if cfg.group_size == -1 else cfg.group_size
    codes = _deinterleave(buffers["x86_qw"], K)[:N].view(N, H, 32)
    g = torch.arange(H) * 32 // gs  # each 32-input block's group
    xb = xq.view(M, H, 32).double()
    qsum = xb.sum(-1)[:, None, :]  # [M, 1, H]
    dot = lambda c: torch.einsum("mhk,nhk->mnh", xb, c.double())  # exact integers [M, N, H]
    if bcq.is_uniform(cfg):
        s = unpad_groups(buffers["x86_qs"], N).double()[:, g]  # [N, H]
        z = unpad_groups(buffers["x86_qz"], N).double()[:, g] / 2
        per_block = (dot(codes) - z[None] * qsum) * s[None]
    else:
        alpha = [unpad_groups(buffers["x86_qa"][:, :, i], N).double()[:, g] for i in range(4)]  # [N, H] each
        c = unpad_groups(buffers["x86_qc"], N).double()[:, g] - sum(alpha)
        per_block = sum(a[None] * 2.0 ** (1 - i) * dot(codes & (1 << i)) for i, a in enumerate(alpha)) + c[None] * qsum
    y = (per_block * xs.double()[:, None, :]).sum(-1)
    return y if bias is None else y + bias.double()


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    sources = tuple(str(_HERE / f) for f in ("kernels.cpp", "binding.cpp"))
    return build("qlinear_x86", sources, cflags=("-O3", "-std=c++17", "-ffp-contract=off", *OPENMP), ldflags=OPENMP)


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int, path: str = "auto"):
    """Registry entry: ``x`` ``[..., K]`` on CPU -> ``[..., N]`` of ``x.dtype`` over layout ``x86_4bit``."""
    x2 = x.reshape(-1, in_features).float().contiguous()
    gs = in_features if cfg.group_size == -1 else cfg.group_size
    _, qs, qz = _names(cfg)
    y = torch.ops.qlinear.x86_gemm(x2, buffers["x86_qw"], buffers[qs], buffers[qz], bias, out_features, gs,
                                   0 if bcq.is_uniform(cfg) else 1, PATHS[path])
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernels cannot run a BCQ layer of this config and shape (None if they can).  (Bits are the
    registry's check; group sizes and in_features are multiples of 32 in every BCQ layer: the format checks that.)"""
    if cfg.fp32_offset and not bcq.is_uniform(cfg):
        return "fp32 offsets (fp32_offset=True) are not supported; the x86 layout holds fp16 offsets"
    return None


register(Kernel(backend="x86", format="bcq", fn=linear, priority=15, devices=frozenset({"cpu"}),
                dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}), bits=frozenset({4}),
                group_sizes=ANY, max_batch=ANY, min_capability=ANY, supports=supports, available=available,
                layout=LAYOUT))
