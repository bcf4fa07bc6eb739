"""One error-feedback engine for every format: GPTQ's Algorithm 1.

Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers" (2022), Alg. 1: columns are quantized left to right; the error of column ``j``,
divided by the ``j``-th diagonal entry of the upper Cholesky factor ``U`` of the damped inverse
Hessian, is spread over the not yet quantized columns (``W[:, j:] -= err ⊗ U[j, j:]``), lazily per
block of columns.  Group parameters (scales, BCQ alphas, codebook choice) are fitted when the first
column of a group is reached, from the error-updated weights of the whole group, so later columns
absorb earlier columns' error.  Blocks are multiples of the group size, so a group never straddles
two blocks.

The format plugs in a *group quantizer* with three methods:

* ``fit_group(index, start, w, d)``: fit group ``index`` (columns ``start:start + w.shape[1]``)
  from ``w`` ``[N, g]`` float32 with per-column importance ``d`` ``[g]`` (diag(H) or ones);
* ``quantize(index, start, w)``: quantize columns ``start:start + w.shape[1]`` of that group,
  record their codes, return the dequantized values ``[N, c]`` float32;
* ``finish()``: return the packed buffers.

Without a Hessian the same quantizer runs group by group with no feedback (round to nearest
under the fitted group parameters), which is what GPTQ reduces to with ``H = I``.
"""

from __future__ import annotations

import torch

from .formats.base import group_bounds, importance

__all__ = ["run", "damped_inverse_hessian"]


def check_hessian(hessian: torch.Tensor, in_features: int) -> None:
    """Raise TypeError/ValueError unless ``hessian`` is a finite float ``[in_features, in_features]`` tensor."""
    if not isinstance(hessian, torch.Tensor) or not hessian.is_floating_point():
        raise TypeError(f"hessian must be a float tensor, got {getattr(hessian, 'dtype', type(hessian).__name__)}")
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"hessian must be [{in_features}, {in_features}] for in_features={in_features}, "
                         f"got {list(hessian.shape)}")
    if not torch.isfinite(hessian).all():
        raise ValueError("hessian contains NaN or Inf")


def _damped(hessian: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H + damp·mean(diag H)·I`` in float64 with ``H_jj = 1`` for dead columns, dead-column mask)."""
    K = hessian.shape[0]
    H = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    H += damp * torch.diagonal(H).mean() * torch.eye(K, dtype=H.dtype)
    return H, dead


def damped_inverse_hessian(hessian: torch.Tensor, in_features: int, damp: float = 0.01) -> torch.Tensor:
    """``(H + damp·mean(diag H)·I)⁻¹`` in float64 ``[K, K]`` (columns never seen get ``H_jj = 1``).

    Raises:
        ValueError: H not ``[in_features, in_features]``, NaN/Inf entries, or not positive definite
            even after damping.
    """
    check_hessian(hessian, in_features)
    H, _ = _damped(hessian, damp)
    try:
        return torch.cholesky_inverse(torch.linalg.cholesky(H))
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"hessian is not positive definite after damping {damp}; raise damp") from e


def run(weight: torch.Tensor, group_size: int, quantizer, hessian: torch.Tensor | None = None, *,
        damp: float = 0.01, activation_aware: bool = True, block_size: int = 128) -> dict[str, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]`` with ``quantizer`` (see module docstring), with error feedback
    when ``hessian`` ``[K, K]`` (= XᵀX over calibration inputs) is given.

    Args:
        activation_aware: pass diag(H) as per-column importance to ``fit_group`` (else ones).
        damp: relative Tikhonov damping of H (GPTQ's ``percdamp``).

    Returns:
        ``quantizer.finish()``.

    Raises:
        ValueError: wrong Hessian shape, non-finite or not positive definite Hessian.
    """
    W = weight.detach().to(torch.float32).clone()
    N, K = W.shape
    bounds = group_bounds(K, group_size)
    if hessian is None:
        ones = torch.ones(K)
        for gi, (s, e) in enumerate(bounds):
            quantizer.fit_group(gi, s, W[:, s:e], ones[s:e])
            quantizer.quantize(gi, s, W[:, s:e])
        return quantizer.finish()

    check_hessian(hessian, K)
    H, dead = _damped(hessian, damp)
    W[:, dead] = 0.0  # inputs never seen in calibration: GPTQ's convention
    d = importance(hessian if activation_aware else None, K)
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).to(torch.float32)
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"hessian is not positive definite after damping {damp}; raise damp") from e
    bs = max(block_size // group_size, 1) * group_size
    gi = 0
    for i1 in range(0, K, bs):
        i2 = min(i1 + bs, K)
        W1 = W[:, i1:i2]
        U1 = U[i1:i2, i1:i2]
        Err = torch.zeros(N, i2 - i1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                gi = col // group_size
                s, e = bounds[gi]
                quantizer.fit_group(gi, s, W[:, s:e], d[s:e])
            w = W1[:, i].clone()
            q = quantizer.quantize(gi, col, w[:, None])[:, 0]
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err[:, i] = err
        W[:, i2:] -= Err @ U[i1:i2, i2:]
    return quantizer.finish()
