"""Helpers shared by the CPU backends (Arm NEON, x86): the int8 dynamic activations both quantize x to, the
arguments of the rotated layers' transform both fuse (``backends/_shared/rotation.h``), and which codebook layers
both serve."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from qlinear.formats import rotation as _rotation

__all__ = ["quantize_activations", "pad_groups", "unpad_groups", "rotation_args", "paley_argument", "spec_input",
           "supports_codebook", "pair_nibbles", "unpair_nibbles"]


@functools.lru_cache(maxsize=64)
def rotation_args(rotation: Optional[tuple[int, int]], K: int) -> tuple:
    """The ops' ``(rot_signs, rot_paley, rot_block)`` for a layer's ``(seed, block)`` with ``K`` inputs (None: not
    rotated, block 0): ``D``'s signs times 1/√b as float32 ``[K]`` and :func:`paley_argument` (None for a
    power-of-two block), computed once per layer shape."""
    if rotation is None:
        return None, None, 0
    seed, block = rotation
    p = _rotation._split(block)[0]
    signs = _rotation.signs(seed, K, "cpu") / math.sqrt(block)
    return signs, (paley_argument(p) if p > 1 else None), block


def paley_argument(p: int) -> torch.Tensor:
    """The Paley factor of order ``p`` as the CPU kernels take it (``rot_paley``; ``backends/_shared/rotation.h``):
    float32 ``[p, p]`` ±1 for Paley I, or for Paley II its symmetric conference matrix ``[p/2, p/2]`` (an order ≡ 2
    mod 4, which no Hadamard matrix has), which the kernels apply in half the multiply-adds."""
    c, kind = _rotation._conference(p)
    return (c if kind == 2 else _rotation._paley(p)).float()


def spec_input(x: torch.Tensor, rotation: Optional[tuple[int, int]], perm: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """What a kernel's spec quantizes: ``x``, for a rotated layer its transform ``x·Rᵀ``, then for an act_order layer
    read in stored order ``[..., perm]``."""
    x = x if rotation is None else _rotation.rotate(x.float(), *rotation)
    return x if perm is None else x.index_select(-1, perm.long())


def pad_groups(t: torch.Tensor, N: int, rows: int) -> torch.Tensor:
    """Per-(row, group) values ``[N, G]`` -> ``[Nb, G, rows]``: the ``rows`` rows of a kernel's row block together,
    zero rows padding N to ``Nb·rows``."""
    Nb = -(-N // rows)
    out = t.new_zeros(Nb * rows, t.shape[1])
    out[:N] = t
    return out.view(Nb, rows, -1).transpose(1, 2).contiguous()


def pair_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2n]`` -> uint8 ``[..., 2n]``: out byte ``2m`` holds the low nibbles of bytes ``m`` (low) and
    ``n + m`` (high), out byte ``2m + 1`` their high nibbles.  On packed 4-bit codes (two per byte, lowest first)
    this puts code ``j`` of the first half and code ``j`` of the second half into one byte: the CPU kernels' nibble
    layouts, built from the packed words' bytes at load time."""
    n = b.shape[-1] // 2
    lo, hi = b[..., :n], b[..., n:]
    out = torch.empty(b.shape, dtype=torch.uint8, device=b.device)  # contiguous, whatever b's strides
    out[..., 0::2] = (lo & 15) | (hi << 4)
    out[..., 1::2] = (lo >> 4) | (hi & 0xF0)
    return out


def unpair_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pair_nibbles`."""
    n = b.shape[-1] // 2
    even, odd = b[..., 0::2], b[..., 1::2]
    out = torch.empty(b.shape, dtype=torch.uint8, device=b.device)  # contiguous, whatever b's strides
    out[..., :n] = (even & 15) | (odd << 4)
    out[..., n:] = (even >> 4) | (odd & 0xF0)
    return out


def unpad_groups(t: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`pad_groups`: ``[Nb, G, rows]`` -> ``[N, G]``."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1])[:N].contiguous()


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` float32 (K a multiple of ``block``) -> (int8-valued codes ``[M, K]`` as int64, scales
    ``[M, K/block]`` float32): per ``block`` inputs ``q = round_half_even(x · (127 / amax))``, ``scale = amax / 127``.
    Where ``127 / amax`` is not finite (an all-zero block, amax below about 3.7e-37, a NaN in the block) the codes are
    0; a NaN block's scale is NaN, so its outputs are.  The Arm paper's dynamic int8 activations (§4); the native
    kernels compute the same fp32 values (``backends/_shared/act_quant.h``; blocks of 32, the x86 mixed GEMV's of
    16)."""
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1)
    inv = 127.0 / amax
    inv = torch.where(inv.isfinite(), inv, torch.zeros_like(inv))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.reshape(x.shape).long(), amax / 127.0


def supports_codebook(cfg, out_features: int, in_features: int) -> Optional[str]:
    """Why the CPU kernels cannot run a codebook layer of this config (None if they can): 2- and 4-bit codes (the
    registry checks the bits too) in groups of a multiple of 32 inputs (one int8 activation scale per 32)."""
    if cfg.bits not in (2, 4):
        return f"bits={cfg.bits}: only 2- and 4-bit codebooks are supported"
    if cfg.group_size % 32:
        return f"group_size={cfg.group_size} is not a multiple of 32"
    return None
