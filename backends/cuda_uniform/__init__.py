"""GPU paths of 8-bit uniform :class:`qlinear.BCQLinear` layers read as stored (GPTQ's ``qweight``, ``scales`` and
``qzeros``, :mod:`qlinear.formats.bcq`; no kernel layout): a GEMV on tensor cores at decode batches, a GEMM on tensor
cores up to 128 rows, dequantize + cuBLAS above.

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16 with ``Ŵ = s·(q − z)``, ``K`` a multiple of 32 (the format's groups
are multiples of 32 or the whole row; the last may be shorter), with or without zero points, act_order and rotated
layers through the op (which gathers and rotates x first).  The kernels are in ``uniform.cu``:

* ``cuda_uniform_gemv`` (``M <= 16``): reads the codes (half an fp16 weight's bytes) and never writes ``Ŵ``.  Each lane
  loads 16 consecutive codes of a row and the same 16 inputs of x, and ``mma.m16n8k16`` sums their products with the
  step's inputs assigned to k-slots so that no value moves between lanes (QUICK's idea, no interleaved layout needed
  at 8 bits); B holds the integers ``q − z`` (``2q − 255`` on the symmetric grid), exact in fp16 and bf16, so every
  product is exact and the sums fp32, scaled per group and accumulated in fp32; the warps' sums are added in a fixed
  order (deterministic).  One kernel for every M up to 16: its instructions per weight barely grow with M, where a
  CUDA-core GEMV's grow with M (an fp32 FMA per weight and row of x).
* ``cuda_uniform_gemm`` (``M <= 128``, ``K`` a multiple of 64; the kernel takes up to 512): QUICK's block (:mod:`qlinear.backends.quick`: 4 warps
  of 32 rows of Ŵ, x in a cp.async pipeline of swizzled shared-memory stages, the next steps' codes and scales in a
  register ring, deterministic split-K with :func:`qlinear.backends._gpu.mma_plan`'s launch shape) over the stored
  codes, with the GEMV's k-slot assignment in place of QUICK's interleaved layout.  The mma computes ``yᵀ = Ŵ·xᵀ``:
  x's words, two 16-byte shared loads per row, are B's registers as loaded; A is ``Ŵ`` in x's dtype, ``s·(q − z)``
  rounded once (the value ``cuda_uniform`` writes), converted once per 64 inputs and used by every 8 rows of x in the
  block; fp32 accumulation.  Without it, 17-128 rows took dequantize + cuBLAS, which writes and reads ``Ŵ`` in fp16
  (five bytes moved per weight where cuBLAS alone moves two).  Registered up to 128 rows: beyond, the kernel model
  (``benchmarks/kernel_model.py --uniform8``, QUICK's measured rate of ``mma.sync``) predicts it slower than
  dequantize + cuBLAS, as QUICK's GEMM measured there.
* ``cuda_uniform`` (every batch): writes ``Ŵ`` ``[N, K]`` in ``x``'s dtype as the format's float32 ``s·(q − z)``
  rounded once; then one dense GEMM.

8-bit only: the LUT GEMV (:mod:`qlinear.backends.cuda_lut`) takes time in proportion to the bit-planes, so 8-bit layers
took about twice its 4-bit time there, where this GEMV's time follows the bytes.  1-4 bit uniform layers run on QUICK
and the LUT GEMV; 5-7 bit ones (codes straddling words) on the LUT GEMV.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import bcq

from .. import ANY, Kernel, register
from .._gpu import aligned16, mma_plan
from .._native import build_cuda_backend, dense_linear
from .._native import sm_count as _sms  # module attribute: tests replace it without a GPU

__all__ = ["dequantize", "linear", "linear_gemv", "linear_gemm", "supports", "supports_gemm", "MAX_BATCH", "GEMM_MAX_BATCH"]

MAX_BATCH = 16
GEMM_MAX_BATCH = 128

_HERE = Path(__file__).parent


def dequantize(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (float32, fp16 or bf16) from an 8-bit layer's uniform storage on a GPU, in
    stored input order (an act_order layer's ``perm`` not applied): the format's float32 ``s·(q − z)``
    (:func:`qlinear.formats.bcq.dequantize`), rounded once."""
    return torch.ops.qlinear.uniform_dequantize(aligned16(buffers["qweight"]), buffers["scales"], buffers.get("qzeros"),
                                                in_features, cfg.group(in_features), cfg.bits, dtype)


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry: ``x`` ``[..., K]`` fp16/bf16 on CUDA -> ``[..., N]``: :func:`dequantize` to ``x``'s dtype, then
    cuBLAS."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


def linear_gemv(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry of the GEMV: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most :data:`MAX_BATCH` rows ->
    ``[..., N]``."""
    y = torch.ops.qlinear.uniform_gemv(aligned16(x.reshape(-1, in_features)), aligned16(buffers["qweight"]),
                                       buffers["scales"], buffers.get("qzeros"), bias, cfg.group(in_features), cfg.bits)
    return y.reshape(*x.shape[:-1], out_features)


def linear_gemm(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry of the GEMM: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most :data:`GEMM_MAX_BATCH` rows, ``K`` a
    multiple of 64 -> ``[..., N]``, launched as :func:`qlinear.backends._gpu.mma_plan` says."""
    x2 = x.reshape(-1, in_features)
    launch = mma_plan(x2.shape[0], out_features, in_features, _sms(x.device.index or 0))
    y = torch.ops.qlinear.uniform_gemm(aligned16(x2), aligned16(buffers["qweight"]), buffers["scales"],
                                       buffers.get("qzeros"), bias, cfg.group(in_features), cfg.bits, *launch)
    return y.reshape(*x.shape[:-1], out_features)


def supports_gemm(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the GEMM cannot run a BCQ layer of this config and shape (None if it can): :func:`supports`, and ``K`` a
    multiple of 64 (its steps)."""
    why = supports(cfg, out_features, in_features)
    if why is None and in_features % 64:
        return f"in_features={in_features} is not a multiple of 64"
    return why


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernels cannot run a BCQ layer of this config and shape (None if they can)."""
    if not bcq.is_uniform(cfg):
        return "α are not uniform (the kernels read the uniform storage: GPTQ, round-to-nearest, imported weights)"
    if in_features % 32:
        return f"in_features={in_features} is not a multiple of 32"
    if in_features >= 1 << 20:
        return f"in_features={in_features} is not below 2^20"
    if out_features * (in_features // 32) >= 1 << 31:
        return f"{out_features}x{in_features} is too large (N·K/32 must be below 2^31)"
    return None


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_cuda_uniform", _HERE)


_COMMON = dict(format=bcq.NAME, devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
               bits=frozenset({8}), group_sizes=ANY, min_capability=(8, 0), supports=supports, available=available)
# above the LUT GEMV (priority 10) and its dequantize path (4), so that 8-bit uniform layers stay in their canonical
# storage on a GPU (layers past the kernels' size limits keep the LUT layout)
register(Kernel(backend="cuda_uniform_gemv", fn=linear_gemv, priority=15, max_batch=MAX_BATCH, **_COMMON))
# between the GEMV and dequantize + cuBLAS: M = 17..128
register(Kernel(backend="cuda_uniform_gemm", fn=linear_gemm, priority=14, max_batch=GEMM_MAX_BATCH,
                **{**_COMMON, "supports": supports_gemm}))
register(Kernel(backend="cuda_uniform", fn=linear, priority=6, max_batch=ANY, **_COMMON))
