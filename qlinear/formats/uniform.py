"""Asymmetric uniform (min/max) quantization: the round-to-nearest baseline and a building block.

``w ≈ s * (q - z)`` with integer codes ``q`` in ``[0, 2**bits)``, an fp16 scale ``s`` and an
integer zero point ``z`` per (row, group): the GPTQ/AWQ convention (Frantar et al. 2022, §3;
Lin et al. 2023).  ``clip_grid`` adds the scale-clipping search of AWQ/GPTQ's ``mse`` option:
each row tries ranges shrunk by the given factors and keeps the one of least (weighted) MSE.
"""

from __future__ import annotations

import torch

from .base import fp16_round, group_bounds

__all__ = ["fit", "codes_for", "rtn"]


def fit(w: torch.Tensor, bits: int, weight: torch.Tensor | None = None,
        clip_grid: tuple[float, ...] = (1.0,)) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zero points for rows of ``w`` ``[M, g]`` (float32).

    Args:
        weight: optional per-element importance, broadcastable to ``w`` (e.g. diag(H) ``[g]``).
        clip_grid: range shrink factors to try (1.0 = plain min/max).

    Returns:
        ``(scale [M] float32 holding fp16 values, zero [M] int64 in [0, 2**bits))``.
    """
    qmax = (1 << bits) - 1
    lo = w.min(dim=1).values.clamp(max=0)
    hi = w.max(dim=1).values.clamp(min=0)
    best = None
    for p in clip_grid:
        scale = fp16_round(((hi - lo) * p / qmax).clamp(min=1e-8))
        zero = torch.round(-lo * p / scale).clamp(0, qmax)
        if len(clip_grid) == 1:
            return scale, zero.long()
        err = (w - scale[:, None] * (torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, qmax)
                                     - zero[:, None])) ** 2
        if weight is not None:
            err = err * weight
        err = err.sum(1)
        if best is None:
            best = (err, scale, zero)
        else:
            take = err < best[0]
            best = (torch.where(take, err, best[0]), torch.where(take, scale, best[1]), torch.where(take, zero, best[2]))
    return best[1], best[2].long()


def codes_for(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round-to-nearest codes ``clamp(round(w / s) + z, 0, 2**bits - 1)`` (int64), broadcasting."""
    return torch.clamp(torch.round(w / scale) + zero, 0, (1 << bits) - 1).long()


def rtn(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain round-to-nearest, per group of ``group_size`` inputs (last group may be shorter).

    Args:
        weight: ``[N, K]`` float.

    Returns:
        ``(codes [N, K] int64, scales [N, G] float32 with fp16 values, zeros [N, G] int64)``;
        the dequantized weight is ``scales[:, g] * (codes - zeros[:, g])``.
    """
    w = weight.detach().to(torch.float32)
    codes = torch.empty(w.shape, dtype=torch.int64)
    scales, zeros = [], []
    for s, e in group_bounds(w.shape[1], group_size):
        sc, z = fit(w[:, s:e], bits)
        codes[:, s:e] = codes_for(w[:, s:e], sc[:, None], z[:, None], bits)
        scales.append(sc)
        zeros.append(z)
    return codes, torch.stack(scales, 1), torch.stack(zeros, 1)
