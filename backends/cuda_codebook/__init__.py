"""GPU paths of :class:`qlinear.CodebookLinear` (group-wise codebooks, Arm paper §5.2): a GEMV at decode batches,
dequantize + cuBLAS above.

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16, ``K`` a multiple of the group size, straight from the
canonical buffers (no kernel layout: what a checkpoint holds is what the GPU reads), both kernels in
``codebook_dequant.cu``:

* ``cuda_codebook_gemv`` (``M <= 8``, group sizes that 8 divides, ``K`` a multiple of 32): reads the codes, never writes ``Ŵ``: 1/16 (1 bit)
  to 1/4 (4 bits) of an fp16 weight's bytes, plus the scales.  A warp owns 4 rows and its lanes walk K 32 inputs
  apart; each input's centroid comes from a 16-float table in shared memory (all of a layer's codebooks, the format's
  16-byte limit), ``Σ centroid·x`` over 8 inputs of one group in fp32 (exact products), times the group's scale,
  accumulated in fp32; the lanes' sums are added in lane order (deterministic).
* ``cuda_codebook`` (every batch, every ``K``): writes ``Ŵ`` ``[N, K]`` in ``x``'s dtype, one thread per 32 outputs, as the
  format's float32 ``scale · centroid`` (exact: an fp16 scale times an int8 centroid) rounded once; then one dense
  GEMM.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import codebook

from .. import ANY, Kernel, register
from .._gpu import aligned16
from .._native import build_cuda_backend, dense_linear

__all__ = ["dequantize", "linear", "linear_gemv", "supports", "supports_gemv", "MAX_BATCH"]

MAX_BATCH = 8

_HERE = Path(__file__).parent


def dequantize(buffers: dict, cfg, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` (float32, fp16 or bf16) from the canonical codebook buffers on a GPU: the
    format's float32 values (:func:`qlinear.formats.codebook.dequantize`), rounded once."""
    return torch.ops.qlinear.codebook_dequantize(buffers["codes"], buffers.get("book_idx"), buffers["scales"],
                                                 buffers["codebooks"], in_features, cfg.group_size, cfg.bits, dtype)


def linear(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry: ``x`` ``[..., K]`` fp16/bf16 on CUDA -> ``[..., N]``: :func:`dequantize` to ``x``'s dtype, then
    cuBLAS."""
    return dense_linear(x, dequantize(buffers, cfg, out_features, in_features, x.dtype), bias)


def linear_gemv(x: torch.Tensor, buffers: dict, bias, cfg, out_features: int, in_features: int) -> torch.Tensor:
    """Registry entry of the GEMV: ``x`` ``[..., K]`` fp16/bf16 on CUDA, at most :data:`MAX_BATCH` rows ->
    ``[..., N]``."""
    y = torch.ops.qlinear.codebook_gemv(aligned16(x.reshape(-1, in_features)), aligned16(buffers["codes"]),
                                        buffers.get("book_idx"), buffers["scales"], buffers["codebooks"], bias,
                                        cfg.group_size, cfg.bits)
    return y.reshape(*x.shape[:-1], out_features)


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the dequantize kernel cannot run a codebook layer of this config and shape (None if it can)."""
    if -(-out_features * in_features // 32) >= 1 << 31:
        return f"{out_features}x{in_features} is too large (N·K/32 must be below 2^31)"
    return None


def supports_gemv(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the GEMV cannot run a codebook layer of this config and shape (None if it can)."""
    if cfg.group_size % 8:
        return f"group_size={cfg.group_size} is not a multiple of 8"
    if in_features % 32:
        return f"in_features={in_features} is not a multiple of 32"
    if out_features * in_features >= 1 << 34:
        return f"{out_features}x{in_features} is too large for the GEMV (N·K must be below 2^34)"
    return supports(cfg, out_features, in_features)


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_cuda_codebook", _HERE)


_COMMON = dict(format=codebook.NAME, devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16}),
               bits=frozenset({1, 2, 4}), group_sizes=ANY, min_capability=(8, 0), available=available)
register(Kernel(backend="cuda_codebook_gemv", fn=linear_gemv, priority=10, max_batch=MAX_BATCH, supports=supports_gemv,
                **_COMMON))
register(Kernel(backend="cuda_codebook", fn=linear, priority=5, max_batch=ANY, supports=supports, **_COMMON))
