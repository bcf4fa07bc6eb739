"""Helpers shared by the CPU backends (Arm NEON, x86): the int8 dynamic activations both quantize x to."""

from __future__ import annotations

import torch

__all__ = ["quantize_activations", "pad_groups", "unpad_groups"]


def pad_groups(t: torch.Tensor, N: int, rows: int) -> torch.Tensor:
    """Per-(row, group) values ``[N, G]`` -> ``[Nb, G, rows]``: the ``rows`` rows of a kernel's row block together,
    zero rows padding N to ``Nb·rows``."""
    Nb = -(-N // rows)
    out = t.new_zeros(Nb * rows, t.shape[1])
    out[:N] = t
    return out.view(Nb, rows, -1).transpose(1, 2).contiguous()


def unpad_groups(t: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`pad_groups`: ``[Nb, G, rows]`` -> ``[N, G]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:N].contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` float32 (K a multiple of 32) -> (int8-valued codes ``[M, K]`` as int64, scales ``[M, K/32]``
    float32): per 32 inputs ``q = round_half_even(x · (127 / amax))``, ``scale = amax / 127`` (0 for an all-zero
    block).  The Arm paper's dynamic int8 activations (§4); the native kernels compute the same fp32 values."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.reshape(x.shape).long(), amax / 127.0
