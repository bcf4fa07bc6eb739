"""GPU decode path of :class:`qlinear.CodebookLinear` (group-wise codebooks, Arm paper §5.2): dequantize + cuBLAS.

``y = x Ŵᵀ + b`` for ``x`` ``[M, K]`` fp16/bf16 at any batch, ``K`` a multiple of 32 and of the group size.  The
kernel (``codebook_dequant.cu``) writes ``Ŵ`` ``[N, K]`` in ``x``'s dtype straight from the canonical buffers (no
kernel layout: what a checkpoint holds is what the GPU reads), one thread per row and 32 inputs, as the format's
float32 ``scale · centroid`` (exact: an fp16 scale times an int8 centroid) rounded once; then one dense GEMM.  A GEMV
that looks the centroids up per weight would read 4-8x fewer bytes at decode batches; the issue asks for it only where
the kernel model says it pays, and this path is first what keeps codebook layers off the PyTorch reference on a GPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import codebook

from .. import ANY, Kernel, register
from .._native import build_cuda_backend, dense_linear

__all__ = ["dequantize", "linear", "supports"]

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


def supports(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the kernel cannot run a codebook layer of this config and shape (None if it can)."""
    if in_features % 32:
        return f"in_features={in_features} is not a multiple of 32"
    return None


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None once the extension is built and loaded, else why it cannot be."""
    return build_cuda_backend("qlinear_cuda_codebook", _HERE)


register(Kernel(backend="cuda_codebook", format=codebook.NAME, fn=linear, priority=5, devices=frozenset({"cuda"}),
                dtypes=frozenset({torch.float16, torch.bfloat16}), bits=frozenset({1, 2, 4}), group_sizes=ANY,
                min_capability=(8, 0), max_batch=ANY, supports=supports, available=available))
