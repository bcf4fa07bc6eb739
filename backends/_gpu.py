"""Helpers shared by the CUDA backends: where a rotated layer's input transform runs (inside the kernel, which stages
``R·x`` in shared memory, ``backends/_cuda/rotation.cuh``; or before it, by the one-launch ``qlinear::cuda_rotate``
of ``backends/_cuda/rotate.cu``, registered here as :func:`qlinear.formats.rotation.rotate_input`'s CUDA transform)
and the ops' arguments for it."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Optional

import torch

from qlinear.formats import rotation as _rotation

from ._native import build_cuda_backend

__all__ = ["NO_ROTATION", "cuda_transform", "mma_plan", "rotation_smem_bytes", "sign_bits", "staged_rotation"]

NO_ROTATION = (None, 0, None)  # the ops' (rot_sign_bits, rot_block, rot_paley) of a layer the kernel does not rotate


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned (kernels that read it 16 bytes at a time): ``t`` itself when it is (every
    fresh allocation), else a copy."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=4096)  # per call of every layer: a lookup instead of ~2 µs of arithmetic
def mma_plan(M: int, N: int, K: int, sms: int) -> tuple[int, int, int]:
    """Launch shape ``(tile_m, tiles_per_split, splits)`` of the tensor-core GEMMs (QUICK's, ``backends/quick``, and the
    8-bit uniform one, ``backends/cuda_uniform``) for ``x`` ``[M, K]`` and ``N`` rows.

    ``tile_m`` (rows of x per block) is the smallest of 16/32/64/128 covering M (128: two warps along M).
    Blocks own 128 rows of Ŵ; K (in 64-input tiles) is split into at most ``4·SMs / blocks`` slices (one wave of
    four 128-thread blocks per SM: each thread keeps 2-4 tiles of codes and scales in flight, so four blocks give an
    SM ~100 KB of loads in flight), keeping ≥ 2 tiles per split and at most 8 MiB of fp32 partials (they stay in
    L2 for the reduction).  The 2026-11-23 heuristic aimed at two blocks per SM and capped the partials at 15 % of
    the weight bytes: at M = 64 on 8192² that left 64 blocks, one split, 128 tiles per warp (205 µs on an H100).
    A heuristic until ``benchmarks/tune_dispatch.py`` / ``sweep_plans.py`` have measured it on a GPU.
    """
    tile_m = next(t for t in (16, 32, 64, 128) if M <= t or t == 128)
    blocks = math.ceil(N / 128) * math.ceil(M / tile_m)
    tiles = K // 64
    splits = max(1, min(4 * sms // blocks, tiles // 2, (8 << 20) // (4 * M * N)))
    per_split = math.ceil(tiles / splits)
    return tile_m, per_split, math.ceil(tiles / per_split)


def rotation_smem_bytes(own: int, block: int, values: int, elem: int) -> int:
    """Shared memory (bytes) of a kernel that stages ``values`` rotated inputs of ``elem`` bytes after its own ``own``
    bytes, which the transform's float32 work area of ``max(block, 256)`` floats aliases (``rotation_smem_bytes`` of
    ``backends/_cuda/dtype.h``)."""
    return -(-max(own, 4 * max(block, 256)) // 16) * 16 + values * elem


@functools.lru_cache(maxsize=16)
def _paley(p: int, device: torch.device) -> torch.Tensor:
    return _rotation._paley(p).to(device=device, dtype=torch.int8)


@functools.lru_cache(maxsize=64)
def sign_bits(seed: int, in_features: int, device: torch.device) -> torch.Tensor:
    """``D``'s signs (:func:`qlinear.formats.rotation.signs`) as the CUDA kernels read them: int32
    ``[ceil(in_features / 32)]`` on ``device``, bit ``k % 32`` of word ``k // 32`` set where ``D[k] = −1``.  Cached per
    (seed, size, device): do not modify the result."""
    neg = (_rotation.signs(seed, in_features, device) < 0).to(torch.int64)
    neg = torch.nn.functional.pad(neg, (0, -in_features % 32)).view(-1, 32)
    words = (neg << torch.arange(32, device=device)).sum(1)
    return (words - (words >> 31 << 32)).to(torch.int32)  # two's complement: bit 31 is the sign


def staged_rotation(x: torch.Tensor, rotation: Optional[tuple[int, int]], smem: int, budget: int
                    ) -> tuple[torch.Tensor, tuple]:
    """``(x, (rot_sign_bits, rot_block, rot_paley))`` for a kernel call on a layer rotated by ``rotation = (seed, block)``
    (None: not rotated): the kernel applies ``R`` itself when staging it takes ``smem`` bytes of shared memory per
    block, at most ``budget`` (what keeps the kernel's blocks per SM); otherwise ``x`` is rotated here
    (:func:`qlinear.formats.rotation.rotate_input`: :func:`cuda_transform`'s one launch, shared by layers reading the
    same tensor) and the kernel is told :data:`NO_ROTATION`."""
    if rotation is None:
        return x, NO_ROTATION
    if smem > budget:
        return _rotation.rotate_input(x, *rotation), NO_ROTATION
    return x, _kernel_rotation(*rotation, x.shape[-1], x.device)


@functools.lru_cache(maxsize=64)
def _kernel_rotation(seed: int, block: int, in_features: int, device: torch.device) -> tuple:
    # one cache lookup per call instead of three (about 1.5 µs of a rotated layer's eager call on this CPU)
    p = _rotation._split(block)[0]
    return sign_bits(seed, in_features, device), block, _paley(p, device) if p > 1 else None


@functools.lru_cache(maxsize=16)
def _smem_optin(device: torch.device) -> int:
    """Bytes of shared memory one CUDA block of ``device`` may opt in to (48 KiB where torch does not say)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 48 * 1024)


@functools.lru_cache(maxsize=None)
def _rotate_library() -> Optional[str]:
    why = build_cuda_backend("qlinear_cuda_rotate", Path(__file__).parent / "_cuda")
    if why is not None:
        logging.getLogger("qlinear").warning("rotated layers' inputs on a GPU are transformed in PyTorch: %s", why)
    return why


def cuda_transform(x: torch.Tensor, seed: int, block: int) -> Optional[torch.Tensor]:
    """``R·x`` (:func:`qlinear.formats.rotation.rotate_input`) of an fp16/bf16 CUDA ``x`` ``[..., K]`` by
    ``qlinear::cuda_rotate`` (built on first use), or None where it does not apply: another dtype, an input that
    needs its gradient (the op has no autograd formula), a block whose fp32 work area (4·max(block, 256) bytes) exceeds
    the device's shared memory per block (a 28672 = 28·1024 block: 112 KiB, beyond a consumer GPU's 99), or a library
    that did not build (logged once)."""
    if x.dtype not in (torch.float16, torch.bfloat16) or (x.requires_grad and torch.is_grad_enabled()):
        return None
    if 4 * max(block, 256) > _smem_optin(x.device) or _rotate_library() is not None:
        return None
    return torch.ops.qlinear.cuda_rotate(x, *_kernel_rotation(seed, block, x.shape[-1], x.device))


_rotation.register_device_transform("cuda", cuda_transform)
