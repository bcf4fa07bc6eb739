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

from .formats.base import group_bounds, importance, on_weight_device

__all__ = ["run", "quantize_uniform", "damped_inverse_hessian"]


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


@on_weight_device
def run(weight: torch.Tensor, group_size: int, quantizer, hessian: torch.Tensor | None = None, *,
        damp: float = 0.01, activation_aware: bool = True, block_size: int = 128, act_order: bool = False,
        static_groups: bool = False) -> dict[str, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]`` with ``quantizer`` (see module docstring), with error feedback
    when ``hessian`` ``[K, K]`` (= XᵀX over calibration inputs) is given.

    Args:
        activation_aware: pass diag(H) as per-column importance to ``fit_group`` (else ones).
        damp: relative Tikhonov damping of H (GPTQ's ``percdamp``).
        act_order: process columns by decreasing diag(H) (GPTQ's ``desc_act``).  Groups are then
            formed in that order: the quantizer sees processing positions, not input indices, and
            the result gets ``perm`` (int32 ``[K]``, position -> input column), so its groups are
            contiguous in the stored order (the reordering of "TP-Aware Dequantization", Alg. 1).
        static_groups: with ``act_order``, fit every group up front on the original weights in the
            original column order (GPTQ's ``static_groups``): codes keep the input order, no ``perm``.

    Returns:
        ``quantizer.finish()`` (plus ``"perm"`` for ``act_order`` without ``static_groups``).

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
    order = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(K)
    static = act_order and static_groups
    if static:
        for gi, (s, e) in enumerate(bounds):
            quantizer.fit_group(gi, s, W[:, s:e], d[s:e])
    W, H, d = W[:, order], H[order][:, order], d[order]
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
            pos = i1 + i
            if static:  # the input column's own group, fitted up front; codes stored in input order
                col = int(order[pos])
                gi = col // group_size
            else:  # groups of consecutive processing positions, fitted from the error-updated weights
                col = pos
                if pos % group_size == 0:
                    gi = pos // group_size
                    s, e = bounds[gi]
                    quantizer.fit_group(gi, s, W[:, s:e], d[s:e])
            w = W1[:, i].clone()
            q = quantizer.quantize(gi, col, w[:, None])[:, 0]
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err[:, i] = err
        W[:, i2:] -= Err @ U[i1:i2, i2:]
    out = quantizer.finish()
    if act_order and not static:
        out["perm"] = order.to(torch.int32)
    return out


@on_weight_device
def quantize_uniform(weight: torch.Tensor, bits: int, group_size: int, hessian: torch.Tensor | None = None, *,
                     sym: bool = False, mse: bool = False, damp: float = 0.01, act_order: bool = False,
                     static_groups: bool = False,
                     block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ (Frantar et al. 2022, Alg. 1) for group-wise uniform integer codes, as GPTQ checkpoints hold them.

    Args:
        weight: ``[N, K]`` float.  hessian: ``[K, K]`` XᵀX of calibration inputs (None: round to nearest).
        bits: 2, 3, 4 or 8.  group_size: inputs per group (-1: whole row).
        sym: symmetric grid (zero point fixed at ``2^(bits-1)``, scale ``2·max|w| / (2^bits − 1)``).
        mse: search each group's range shrink factor (1.00 down to 0.80 in steps of 0.01) for the least squared
            error, as GPTQ's reference ``Quantizer(mse=True)`` (asymmetric grid only).
        damp: GPTQ's ``damp_percent`` as a fraction of mean(diag H).
        act_order, static_groups: GPTQ's ``desc_act`` and ``static_groups`` (see :func:`run`).

    Returns:
        ``(codes [N, K] int64 in input order, scales [N, G] float32 holding fp16 values, zeros [N, G]
        int64, g_idx [K] int32 or None)``: ``w ≈ scales[n, g] · (codes[n, k] − zeros[n, g])`` with
        ``g = g_idx[k]`` (``k // group_size`` when ``g_idx`` is None).

    Raises:
        ValueError: unsupported bits, a bad Hessian.
    """
    from .formats import uniform

    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ bits must be 2, 3, 4 or 8, got {bits}")
    N, K = weight.shape
    g = K if group_size == -1 else group_size
    q = uniform.GroupQuantizer(N, K, bits, g, sym, uniform.MSE_GRID if mse else (1.0,))
    out = run(weight, g, q, hessian, damp=damp, activation_aware=False, block_size=block_size,
              act_order=act_order and hessian is not None, static_groups=static_groups)
    codes, scales, zeros = out["codes"], out["scales"], out["zeros"]
    if "perm" not in out:
        return codes, scales, zeros, None
    perm = out["perm"].long()
    in_order = torch.empty_like(codes)
    in_order[:, perm] = codes
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // g).to(torch.int32)
    return in_order, scales, zeros, g_idx
