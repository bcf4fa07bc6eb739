"""BCQ: binary-coding quantization, ``w ≈ Σ_{i=1..q} α_i b_i + c`` with ``b_i ∈ {-1, +1}``.

Sources: Xu et al., "Alternating Multi-bit Quantization for Recurrent Neural Networks" (ICLR 2018)
for the alternating refinement; Park et al., "LUT-GEMM" / nuQmm (§2-3) for the format and its
bit-plane storage.  Uniform int-q with a zero point is BCQ with ``α_i = s·2^(i-2)`` (i = 1..q) and
the per-group offset ``c = s·((2^q − 1)/2 − z)``, so GPTQ/AWQ checkpoints map onto it exactly.

Packed layouts (``N = out_features``, ``K = in_features``, ``G = ceil(K / group_size)``; the last
group may be shorter than ``group_size``).  Layers whose levels are uniform (:func:`is_uniform`: round-to-nearest,
GPTQ, imported GPTQ/AWQ) are stored as the GPTQ ecosystem stores them, ``ŵ = s·(q − z)``; BCQ's α and offset are a
view derived from them exactly (:func:`as_bcq`) where a kernel needs it:

* ``qweight`` int32 ``[N, K·bits/32]``: the integer codes ``q = Σ_i bit_i·2^(i-1)`` packed little-endian along K
  (:func:`qlinear.formats.packing.pack`; 3-bit codes straddle words as in GPTQ's 3-bit checkpoints).
* ``scales``  fp16 ``[N, G]``: the group scale ``s``.
* ``qzeros``  int32 ``[G, ceil(N·bits/32)]`` (only with ``offset=True``): the integer zero points ``z`` in
  ``[0, 2^bits)``, packed along N as GPTQ packs them (little padding: at most one word per group).  Without offset the grid is symmetric, ``z = (2^bits − 1)/2``.
  4-bit g128: 4 + (16 + 4)/128 = 4.156 bits per weight, GPTQModel's own figure.

Other (free-α) BCQ layers:

* ``planes``  int32 ``[bits, N, K/32]``: plane ``i`` is the sign vector ``b_{i+1}``; bit ``j`` of word
  ``w`` of row ``r`` is input ``32w + j`` (1 → +1, 0 → −1).  Equivalently the integer code
  ``Σ_i bit_i·2^i`` indexes the ``2^q`` levels of the group.
* ``alpha``   fp16 ``[bits, N, G]``: α per (bit, row, group).
* ``offset``  fp16 ``[N, G]`` (only with ``offset=True``; float32 with ``fp32_offset=True``): the
  per-group offset ``c``.

Both: ``perm`` int32 ``[K]`` (only with ``act_order=True``): stored input position ``j`` holds input column
``perm[j]``; the other buffers describe the reordered weight ``W[:, perm]``, whose groups are contiguous (GPTQ
act_order reordered as in "TP-Aware Dequantization", Alg. 1: every kernel runs it as a plain grouped layer on
``x[..., perm]``).

Checkpoints saved before the uniform storage hold uniform layers in the free-α buffers; :data:`LEGACY` is that
storage as a layout, converted exactly on load (round-to-nearest layers then dequantize to ``s·(q − z)`` instead of
an fp16-rounded offset: within one fp16 rounding of the offset).

Quantizer (float32 math): per (row, group), the better (in weighted squared error) of two inits,
greedy residual binarization (``b_i = sign(r)``, ``α_i = mean|r|``, ``r -= α_i b_i``) and the
uniform min/max grid written as BCQ; then ``iters`` rounds of alternating refinement: weighted least
squares for ``(α, c)`` given ``b`` (stored as fp16 straight away), then each weight to the nearest of
the ``2^q`` levels given ``α``; the best iterate per (row, group) is kept, so refinement is never
worse than either init.  The weights of the least squares are diag(XᵀX) of calibration inputs
when a Hessian is given and ``activation_aware=True`` (else 1).
"""

from __future__ import annotations

import dataclasses

import torch

from . import rotation, uniform
from .base import (UNIFORM_MIN_SCALE, BufferSpecs, FormatConfig, Layout, check_input_split, fp16_round, on_weight_device,
                   group_lookup, importance, num_groups, place_inputs)
from .packing import pack, pack_planes, packed_len, unpack, unpack_planes, unpack_u8

NAME = "bcq"
#: float buffers Ŵ is linear in, the ones :func:`qlinear.finetune.finetune` trains (the codes stay fixed)
TUNABLE = ("scales", "alpha", "offset")


@dataclasses.dataclass(frozen=True)
class Config(FormatConfig):
    """BCQ options.

    Attributes:
        bits: number of binary planes q, 1..8.
        group_size: inputs per α group: a multiple of 32, or -1 for one group per row.
        offset: store a per-group offset ``c`` (needed for asymmetric / uniform-import weights).
        iters: alternating-refinement rounds (0 = best init only).
        init: "best" (of greedy and uniform), "greedy" or "uniform".
        activation_aware: weight the least squares by diag(H) when a Hessian is given.
        error_feedback: quantize with GPTQ error feedback (:mod:`qlinear.gptq`) when a Hessian is given.
        damp: GPTQ damping (relative to mean diag(H)).
        act_order: GPTQ act_order (``desc_act``): columns are quantized by decreasing diag(H)
            and the layer stores them reordered so its groups are contiguous, plus ``perm``.
        fp32_offset: store the offset in float32 (set by :func:`from_uniform`, which makes the
            import bit-exact: ``s·((2^q−1)/2 − z)`` needs up to 19 mantissa bits).
        method: "bcq" (this module's BCQ fit) or "gptq" (GPTQ's uniform int codes with scales and
            zero points, :func:`qlinear.gptq.quantize_uniform`, stored exactly as BCQ; bits 2/3/4/8).
        sym: GPTQ's symmetric grid (method "gptq").
        mse: GPTQ's ``mse`` grid search (method "gptq", asymmetric grid): each group's range is shrunk by the
            factor in 1.00, 0.99, ..., 0.80 of least squared error (GPTQ's reference code, ``maxshrink=0.8``,
            ``grid=100``; QuaRot's weight clipping).
        static_groups: GPTQ's ``static_groups`` with act_order: groups fitted up front in input
            order, so no reordering is needed (method "gptq").
    """

    format = NAME
    bits: int = 4
    group_size: int = 64
    offset: bool = True
    iters: int = 8
    init: str = "best"
    activation_aware: bool = True
    error_feedback: bool = False
    damp: float = 0.01
    act_order: bool = False
    fp32_offset: bool = False
    method: str = "bcq"
    sym: bool = False
    mse: bool = False
    static_groups: bool = False

    def validate(self) -> None:
        if self.method not in ("bcq", "gptq"):
            raise ValueError(f"BCQ method must be 'bcq' or 'gptq', got {self.method!r}")
        if self.method == "gptq" and (self.bits not in (2, 3, 4, 8) or not self.offset):
            raise ValueError(f"method='gptq' needs bits in (2, 3, 4, 8) and offset=True, got bits={self.bits}, "
                             f"offset={self.offset}")
        if (self.sym or self.static_groups or self.mse) and self.method != "gptq":
            raise ValueError("sym, mse and static_groups are options of method='gptq'")
        if self.sym and self.mse:
            raise ValueError("mse searches the asymmetric grid's range; drop sym or mse")
        if self.static_groups and not self.act_order:
            raise ValueError("static_groups only changes act_order quantization; set act_order=True or drop it")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"BCQ bits must be in 1..8, got {self.bits}")
        if self.group_size != -1 and (self.group_size < 32 or self.group_size % 32):
            raise ValueError(f"BCQ group_size must be a multiple of 32 or -1 (whole row), got {self.group_size}")
        if self.iters < 0:
            raise ValueError(f"iters must be >= 0, got {self.iters}")
        if self.init not in ("best", "greedy", "uniform"):
            raise ValueError(f"init must be 'best', 'greedy' or 'uniform', got {self.init!r}")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp must be in [0, 1), got {self.damp}")

    def check_shape(self, out_features: int, in_features: int) -> None:
        super().check_shape(out_features, in_features)
        if in_features % 32:
            raise ValueError(f"BCQ needs in_features divisible by 32 (one int32 word holds 32 inputs), got {in_features}")

    def group(self, in_features: int) -> int:
        """The effective group size for a layer with ``in_features`` inputs: a ``group_size`` of -1, or of at least
        ``in_features``, is one group per row."""
        return in_features if self.group_size == -1 else min(self.group_size, in_features)


def buffer_specs(out_features: int, in_features: int, cfg: Config) -> BufferSpecs:
    """``{name: (shape, dtype)}`` of the packed buffers (module docstring).  Raises ValueError if
    in_features is not a multiple of 32."""
    cfg.check_shape(out_features, in_features)
    N, K, q = out_features, in_features, cfg.bits
    G = num_groups(K, cfg.group(K))
    if is_uniform(cfg):
        specs: BufferSpecs = {"qweight": ((N, K * q // 32), torch.int32), "scales": ((N, G), torch.float16)}
        if cfg.offset:
            specs["qzeros"] = ((G, packed_len(N, q)), torch.int32)
    else:
        specs = _bcq_specs(N, K, cfg)
    if cfg.act_order and not cfg.static_groups:
        specs["perm"] = ((K,), torch.int32)
    return {**specs, **rotation.specs(cfg)}


def _bcq_specs(N: int, K: int, cfg: Config, fp32_offset: bool = False) -> BufferSpecs:
    G = num_groups(K, cfg.group(K))
    specs: BufferSpecs = {"planes": ((cfg.bits, N, K // 32), torch.int32),
                          "alpha": ((cfg.bits, N, G), torch.float16)}
    if cfg.offset:
        specs["offset"] = ((N, G), torch.float32 if fp32_offset or cfg.fp32_offset else torch.float16)
    return specs


def kernel_view(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """``(config every kernel and kernel layout sees, side buffers the op applies itself)``.  An act_order layer is
    stored reordered with contiguous groups plus ``perm``: the op (or a kernel that says it ``gathers_perm``) reads
    ``x[..., perm]`` and the kernels see a plain grouped layer ("TP-Aware Dequantization", Alg. 1)."""
    if cfg.act_order and not cfg.static_groups:
        return dataclasses.replace(cfg, act_order=False), ("perm",)
    return cfg, ()


def is_uniform(cfg: Config) -> bool:
    """Whether every layer of this config has uniform α (α_i = s·2^(i-2)): GPTQ, imported uniform weights or
    round-to-nearest (``init="uniform", iters=0``)."""
    return cfg.method == "gptq" or (cfg.init == "uniform" and cfg.iters == 0)


def _signs(bits: int) -> torch.Tensor:
    """``[2^q, q]`` float32: row ``l`` holds ``b_i = 2·bit_i(l) − 1``."""
    lv = torch.arange(1 << bits)[:, None]
    return (((lv >> torch.arange(bits)) & 1) * 2 - 1).to(torch.float32)


def uniform_alpha(s: torch.Tensor, bits: int) -> torch.Tensor:
    """Uniform α ``[bits, *s.shape]`` float32: ``α_i = s·2^(i-2)``, i = 1..bits (exact for fp16 scales ≥ 2^-13)."""
    return s.float()[None] * (2.0 ** (torch.arange(bits, dtype=torch.float32, device=s.device) - 1)).view(
        -1, *([1] * s.dim()))


def uniform_scale(alpha: torch.Tensor, hint: str = "") -> torch.Tensor:
    """The scale ``s`` (``alpha[1:].shape[1:]``, α's dtype) of uniform α ``[bits, ...]`` (``α_i = s·2^(i-2)``).

    Raises:
        ValueError: α are not uniform (free BCQ values); ``hint`` is appended to the message.
    """
    s = alpha[1] if alpha.shape[0] > 1 else alpha[0] * 2
    if not torch.equal(alpha.float(), uniform_alpha(s, alpha.shape[0])):
        raise ValueError("α are not uniform (α_i = s·2^(i-2)): only round-to-nearest (init='uniform', iters=0), "
                         "GPTQ and imported GPTQ/AWQ layers have int codes" + (f"; {hint}" if hint else ""))
    return s


def levels(alpha: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """The ``2^q`` levels ``[M, 2^q]`` of rows with ``alpha`` ``[M, q]``, indexed by integer code."""
    lv = alpha @ _signs(alpha.shape[1]).T
    return lv if offset is None else lv + offset[:, None]


def nearest(lv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Code (int64 ``[M, g]``) of the level of ``lv`` ``[M, L]`` nearest to each entry of ``w``; a weight on the
    midpoint of two levels (as float32 computes the midpoint) takes the lower one."""
    vals, perm = lv.sort(dim=1)
    mids = (vals[:, :-1] + vals[:, 1:]) * 0.5
    if lv.shape[1] <= 16:  # a few compares per weight beat a batched binary search
        cols = mids.T.contiguous()[:, :, None]  # [L-1, M, 1]: contiguous broadcasts
        pick = torch.zeros(w.shape, dtype=torch.uint8, device=w.device)
        above = torch.empty(w.shape, dtype=torch.bool, device=w.device)
        for col in cols:
            pick += torch.gt(w, col, out=above)
        return perm.gather(1, pick.long())
    return perm.gather(1, torch.searchsorted(mids.contiguous(), w.contiguous()))


def _err(w, d, lv, codes):
    return (d * (w - lv.gather(1, codes)) ** 2).sum(1)


def _greedy(w, d, bits, use_offset):
    c = (d * w).sum(1) / d.sum(1) if use_offset else torch.zeros(w.shape[0])
    r = w - c[:, None]
    alphas, codes = [], torch.zeros(w.shape, dtype=torch.int64)
    for i in range(bits):
        b = r >= 0
        a = (d * r.abs()).sum(1) / d.sum(1)
        alphas.append(a)
        codes |= b.long() << i
        r = r - a[:, None] * (b.float() * 2 - 1)
    return fp16_round(torch.stack(alphas, 1)), (fp16_round(c) if use_offset else None), codes


def _uniform(w, bits, use_offset):
    if use_offset:
        s, z = uniform.fit(w, bits)
        codes = uniform.codes_for(w, s[:, None], z[:, None], bits)
        c = fp16_round(s * ((2 ** bits - 1) / 2 - z))
    else:
        s = fp16_round(w.abs().max(1).values / ((2 ** bits - 1) / 2)).clamp(min=UNIFORM_MIN_SCALE)
        c, codes = None, None
    alpha = fp16_round(uniform_alpha(s, bits).T)
    if codes is None:
        codes = nearest(levels(alpha, None), w)
    return alpha, c, codes


def fit(w: torch.Tensor, d: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Fit BCQ to rows ``w`` ``[M, g]`` (float32) with importance ``d`` (broadcastable to ``w``).

    Returns:
        ``(alpha [M, q], offset [M] or None, codes [M, g] int64)``, alpha/offset holding fp16 values.
    """
    bits, use_offset = cfg.bits, cfg.offset
    d = torch.broadcast_to(d, w.shape).to(torch.float32)
    d = d / d.mean(1, keepdim=True).clamp(min=1e-30)  # scale-free importance (only ratios matter)
    cands = []
    if cfg.init in ("best", "greedy"):
        cands.append(_greedy(w, d, bits, use_offset))
    if cfg.init in ("best", "uniform"):
        cands.append(_uniform(w, bits, use_offset))
    best = None
    for alpha, c, codes in cands:
        e = _err(w, d, levels(alpha, c), codes)
        best = (e, alpha, c, codes) if best is None else _keep(best, (e, alpha, c, codes))
    err, alpha, c, codes = best
    S = _signs(bits)
    eye = torch.eye(bits + use_offset, dtype=torch.float64)
    # the least squares' design row of a weight with code l is S[l] (plus 1 for the offset), so the normal equations
    # only need, per row, the summed importance and importance-weighted value of each code: [M, 2^q] each
    Sx = torch.cat([S, torch.ones(len(S), 1)], 1) if use_offset else S
    Sx, d64, dw64 = Sx.double(), d.double(), (d * w).double()
    # a round is a function of the codes alone: a row whose codes came back unchanged sits at a fixed point and
    # leaves the loop (most rows do within 2-3 rounds)
    rows, cur = torch.arange(w.shape[0]), codes.clone()
    for _ in range(cfg.iters):
        if rows.numel() == 0:
            break
        rc = cur[rows]
        hist = torch.zeros(len(rows), len(S), dtype=torch.float64).scatter_add_(1, rc, d64[rows])
        hist_w = torch.zeros_like(hist).scatter_add_(1, rc, dw64[rows])
        lhs = torch.einsum("ml,li,lj->mij", hist, Sx, Sx)
        # a tiny ridge keeps degenerate groups (two equal planes, a constant plane) solvable
        lhs = lhs + eye * (1e-9 * lhs.diagonal(dim1=1, dim2=2).mean(1) + 1e-30)[:, None, None]
        sol = torch.linalg.solve(lhs, (hist_w @ Sx)[:, :, None])[:, :, 0].float()
        a = fp16_round(sol[:, :bits])
        o = fp16_round(sol[:, bits]) if use_offset else None
        lv = levels(a, o)
        wr = w[rows]
        new = nearest(lv, wr)
        e = _err(wr, d[rows], lv, new)
        take = e < err[rows]
        if take.any():
            t = rows[take]
            err[t], alpha[t], codes[t] = e[take], a[take], new[take]
            if use_offset:
                c[t] = o[take]
        moved = (new != rc).any(1)
        cur[rows] = new
        rows = rows[moved]
    return alpha, c, codes


def _keep(a, b):
    take = b[0] < a[0]
    c = None if a[2] is None else torch.where(take, b[2], a[2])
    return (torch.where(take, b[0], a[0]), torch.where(take[:, None], b[1], a[1]), c,
            torch.where(take[:, None], b[3], a[3]))


class GroupQuantizer:
    """Column quantizer of :mod:`qlinear.gptq` for BCQ."""

    def __init__(self, out_features: int, in_features: int, cfg: Config):
        self.cfg, self.K = cfg, in_features
        G = num_groups(in_features, cfg.group(in_features))
        self.alpha = torch.zeros(cfg.bits, out_features, G)
        self.offset = torch.zeros(out_features, G)
        self.codes = torch.zeros(out_features, in_features, dtype=torch.int64)
        self._lv = {}

    def fit_group(self, index, start, w, d):
        alpha, c, _ = fit(w, d, self.cfg)
        self.alpha[:, :, index] = alpha.T
        if c is not None:
            self.offset[:, index] = c
        self._lv[index] = levels(alpha, c)

    def quantize(self, index, start, w):
        lv = self._lv[index]
        codes = nearest(lv, w)
        self.codes[:, start:start + w.shape[1]] = codes
        return lv.gather(1, codes)

    def quantize_all(self, w, d):
        """No-feedback path: fit every group at once (vectorized over rows x groups)."""
        N, K = w.shape
        g = self.cfg.group(K)
        full = K // g * g
        for s, e in ((0, full), (full, K)):
            if e == s:
                continue
            n = e - s
            size = min(g, n)
            blocks = w[:, s:e].reshape(N * (n // size), size)
            dd = d[s:e].reshape(1, n // size, size).expand(N, -1, -1).reshape(-1, size)
            alpha, c, codes = fit(blocks, dd, self.cfg)
            self.codes[:, s:e] = codes.reshape(N, n)
            g0 = s // g
            self.alpha[:, :, g0:g0 + n // size] = alpha.reshape(N, n // size, -1).permute(2, 0, 1)
            if c is not None:
                self.offset[:, g0:g0 + n // size] = c.reshape(N, n // size)
        return self.finish()

    def finish(self):
        out = {"planes": pack_planes(self.codes, self.cfg.bits), "alpha": self.alpha.to(torch.float16)}
        if self.cfg.offset:
            out["offset"] = self.offset.to(torch.float32 if self.cfg.fp32_offset else torch.float16)
        return out


@on_weight_device
@rotation.rotates
def quantize(weight: torch.Tensor, cfg: Config, hessian: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]`` to BCQ buffers (see module docstring).

    ``hessian`` ``[K, K]`` (XᵀX) enables activation-aware least squares and, with
    ``cfg.error_feedback``, GPTQ error feedback; ``method="gptq"`` always uses it (GPTQ on uniform codes).
    """
    N, K = weight.shape
    cfg.check_shape(N, K)
    from .. import gptq

    g = cfg.group(K)
    if cfg.method == "gptq":
        codes, scales, zeros, g_idx = gptq.quantize_uniform(
            weight, cfg.bits, g, hessian, sym=cfg.sym, mse=cfg.mse, damp=cfg.damp,
            act_order=cfg.act_order, static_groups=cfg.static_groups)
        bufs = from_uniform(codes, scales, zeros, cfg.bits, g, g_idx)[1]
        if cfg.act_order and not cfg.static_groups:  # identity order (no Hessian, or already sorted) included
            bufs.setdefault("perm", torch.arange(K, dtype=torch.int32))
        return bufs
    q = GroupQuantizer(N, K, cfg)
    if hessian is None or not cfg.error_feedback:
        if cfg.act_order:
            raise ValueError("BCQ act_order needs a Hessian and error_feedback=True (it orders GPTQ's columns)")
        d = importance(hessian if cfg.activation_aware else None, K)
        bufs = q.quantize_all(weight.detach().float(), d)
    else:
        bufs = gptq.run(weight, g, q, hessian, damp=cfg.damp, activation_aware=cfg.activation_aware,
                        act_order=cfg.act_order)
    return as_uniform(bufs, cfg, N, K) if is_uniform(cfg) else bufs


@rotation.unrotates
def dequantize(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int) -> torch.Tensor:
    """Dense weight ``[N, K]`` float32 from BCQ buffers: ``s·(q − z)`` for the uniform storage, else
    ``±α_1 ± α_2 ...`` summed in plane order from +0, plus the offset.

    The codes are unpacked to one byte per weight.  When a group's ``2^q`` levels are no more than its weights, the
    levels are computed once per (row, group) and each weight is one lookup; otherwise the planes are added per
    weight.  Both give the same float32 values.
    """
    g, K, N, q = cfg.group(in_features), in_features, out_features, cfg.bits
    uniform = "qweight" in buffers
    codes = (unpack_u8(buffers["qweight"], q, K) if uniform else unpack_planes(buffers["planes"], K, torch.uint8))
    G = num_groups(K, g)
    if G * g != K:  # a ragged last group is padded
        codes = torch.nn.functional.pad(codes, (0, G * g - K))
    codes = codes.view(N, G, g)
    lookup = (1 << q) <= g
    values = torch.arange(1 << q, device=codes.device).view(1, 1, -1) if lookup else codes
    if uniform:
        s = buffers["scales"].to(torch.float32)[..., None]
        z = (unpack(buffers["qzeros"], q, N).T.to(torch.float32)[..., None] if "qzeros" in buffers
             else torch.tensor((2 ** q - 1) / 2, device=s.device))
        w = s * (values.to(torch.float32) - z)  # exact difference, one rounding: GPTQ's s·(q − z) in float32
    else:
        alpha = buffers["alpha"].to(torch.float32)
        w = None
        for i in range(q):  # one plane at a time keeps the peak at two float32 copies
            a = alpha[i][..., None]
            term = torch.where(((values >> i) & 1).bool(), a, -a)
            w = term.add_(0.0) if w is None else w.add_(term)  # + 0.0: an all-zero sum is +0, as in a sum from 0
        if cfg.offset:
            w = w.add_(buffers["offset"].to(torch.float32)[..., None])
    if lookup:  # w holds the levels [N, G, 2^q]: look each weight up
        w = group_lookup(w, codes)
    w = w.reshape(N, G * g)[:, :K]
    return place_inputs(w, buffers["perm"]) if "perm" in buffers else w


# Uniform storage <-> BCQ view -----------------------------------------------------------------------------------
def uniform_offset(scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """BCQ's offset ``c = s·((2^q − 1)/2 − z)`` float32 (exact: at most 19 significant bits) of fp16 ``scales`` and
    integer ``zeros`` of the same shape."""
    return scales.to(torch.float32) * ((2 ** bits - 1) / 2 - zeros.to(torch.float32))


def uniform_zeros(scales: torch.Tensor, offset: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`uniform_offset`: integer zero points int64 (offsets holding fp16 values, as round-to-nearest
    fits them, in fp16 or in float32 with ``fp32_offset=True``, are matched after rounding to fp16).  A group of
    scale 0 (all its weights are 0) gets the zero point 0: its offset holds no other.

    Raises:
        ValueError: offsets that are not ``s·((2^q−1)/2 − z)`` for integers ``z`` in ``[0, 2^q)``.
    """
    s = scales.to(torch.float32)
    c = offset.to(torch.float32)
    z = torch.round((2 ** bits - 1) / 2 - c / torch.where(s == 0, 1.0, s))
    z = torch.where(s == 0, 0.0, z)
    recon = uniform_offset(s, z, bits)
    if torch.equal(fp16_round(c), c):
        recon = fp16_round(recon)
    if not torch.equal(recon, c) or (z.numel() and (int(z.min()) < 0 or int(z.max()) >= 1 << bits)):
        raise ValueError("offsets are not s·((2^q−1)/2 − z) for integer zero points z in [0, 2^q)")
    return z.long()


def uniform_parts(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int,
                  codes: torch.dtype | None = torch.int64
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(codes [N, K] in stored order, scales [N, G] fp16, zeros [N, G] int64 or None without offset)`` from the
    uniform storage, or from free-α buffers whose α happen to be uniform (``perm`` is not read).  ``codes``: their
    dtype, int64 or uint8 (a layout builder's, 8x less memory); None: the uniform storage's ``qweight`` is not
    unpacked (codes None), for callers that read its words themselves.

    Raises:
        ValueError: free-α buffers whose α or offsets are not uniform.
    """
    K, q = in_features, cfg.bits
    if "qweight" in buffers:
        zeros = unpack(buffers["qzeros"], q, out_features).T if "qzeros" in buffers else None
        words = buffers["qweight"]
        c = None if codes is None else unpack_u8(words, q, K) if codes == torch.uint8 else unpack(words, q, K)
        return c, buffers["scales"], zeros
    s = uniform_scale(buffers["alpha"])
    zeros = uniform_zeros(s, buffers["offset"], q) if "offset" in buffers else None
    return unpack_planes(buffers["planes"], K, codes or torch.int64), s.to(torch.float16), zeros


def uniform_buffers(codes: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, *,
                    qweight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The uniform storage (``qweight``, ``scales``, ``qzeros`` without ``perm``) of codes ``[N, K]``, scales
    ``[N, G]`` (fp16 values) and integer zeros ``[N, G]`` (None: symmetric grid, no offset); ``qweight``: the codes
    already packed (``codes`` is then not read)."""
    out = {"qweight": pack(codes, bits) if qweight is None else qweight, "scales": scales.to(torch.float16)}
    if zeros is not None:
        out["qzeros"] = pack(zeros.T.contiguous(), bits)
    return out


def as_uniform(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int
               ) -> dict[str, torch.Tensor]:
    """Buffers in the uniform storage (unchanged if already; ``perm`` passes through).  Raises ValueError for free-α
    buffers whose α are not uniform."""
    if "qweight" in buffers:
        return buffers
    out = uniform_buffers(*uniform_parts(buffers, cfg, out_features, in_features), cfg.bits)
    return {**out, **({"perm": buffers["perm"]} if "perm" in buffers else {})}


def as_bcq(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int,
           offset_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """BCQ's view (``planes``, ``alpha``, ``offset``; ``perm`` passes through) of the buffers: unchanged for free-α
    layers; for the uniform storage ``α_i = s·2^(i−2)`` in fp16 and the offset of :func:`uniform_offset` in
    ``offset_dtype`` (float32: exact).

    Raises:
        ValueError: a scale whose ``s·2^(i−2)`` fp16 cannot hold (below 2^-13 or above 65504/2^(bits−2)).
    """
    if "qweight" not in buffers:
        return buffers
    codes, s, zeros = uniform_parts(buffers, cfg, out_features, in_features)
    alpha = uniform_alpha(s, cfg.bits)
    if not torch.equal(alpha.to(torch.float16).to(torch.float32), alpha):
        raise ValueError(f"scales·2^(i-2) for i = 1..{cfg.bits} are not all fp16 values (scales between "
                         f"{2.0 ** -13:g} and {65504 / 2 ** (cfg.bits - 2):g} are): BCQ's α cannot represent them")
    out = {"planes": pack_planes(codes, cfg.bits), "alpha": alpha.to(torch.float16)}
    if zeros is not None:
        out["offset"] = uniform_offset(s, zeros, cfg.bits).to(offset_dtype)
    return {**out, **({"perm": buffers["perm"]} if "perm" in buffers else {})}


def _legacy_specs(out_features: int, in_features: int, cfg: Config) -> BufferSpecs | None:
    if not is_uniform(cfg):
        return None
    return _bcq_specs(out_features, in_features, cfg, fp32_offset=cfg.method == "gptq")


def _legacy_repack(buffers, cfg, out_features, in_features):
    fp32 = cfg.method == "gptq" or cfg.fp32_offset  # the offset dtype of _legacy_specs
    return as_bcq(buffers, cfg, out_features, in_features, torch.float32 if fp32 else torch.float16)


#: The storage of uniform layers in checkpoints saved before the uniform storage (free-α buffers; offsets float32
#: for ``method="gptq"`` and imported layers, else fp16), as a layout: a layer holding it converts on load.
LEGACY = Layout(name="bcq_legacy", names=lambda cfg: ("planes", "alpha") + (("offset",) if cfg.offset else ()),
                repack=_legacy_repack, unrepack=as_uniform, saved_specs=_legacy_specs)
LAYOUTS = (LEGACY,)


# Tensor-parallel slicing (the packed data is cut, never dequantized) ------------------------------------------------
def slice_rows(buffers: dict[str, torch.Tensor], cfg: Config, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The canonical buffers of output features ``rows`` (int64 ``[n]``, any order); ``perm`` and ``rotation`` are
    kept."""
    planes = "planes" in buffers  # free-α buffers hold the row in dim 1 of planes and alpha
    out = {k: v if k in ("perm", "qzeros", "rotation") else (v[:, rows] if planes and k in ("planes", "alpha") else v[rows])
           for k, v in buffers.items()}
    if "qzeros" in buffers:  # packed along the rows
        out["qzeros"] = pack(unpack(buffers["qzeros"], cfg.bits, buffers["scales"].shape[0])[:, rows], cfg.bits)
    return {k: v.contiguous() for k, v in out.items()}


def slice_inputs(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int, start: int,
                 end: int) -> tuple[dict[str, torch.Tensor], Config]:
    """``(buffers, config)`` of stored input positions ``[start, end)`` (``perm`` dropped: an act_order layer's
    slice reads ``x[..., perm[start:end]]``).

    Raises:
        ValueError: a bound that splits a quantization group, or a rotated layer.
    """
    K, g, q = in_features, cfg.group(in_features), cfg.bits
    check_input_split(out_features, K, cfg, start, end)
    gs, ge = start // g, -(-end // g)
    if "qweight" in buffers:  # start and end are multiples of 32: whole words of codes
        out = {"qweight": buffers["qweight"][:, start * q // 32:end * q // 32], "scales": buffers["scales"][:, gs:ge]}
        if "qzeros" in buffers:
            out["qzeros"] = buffers["qzeros"][gs:ge]
    else:
        out = {"planes": buffers["planes"][:, :, start // 32:end // 32], "alpha": buffers["alpha"][:, :, gs:ge]}
        if "offset" in buffers:
            out["offset"] = buffers["offset"][:, gs:ge]
    return {k: v.contiguous() for k, v in out.items()}, dataclasses.replace(cfg, act_order=False, static_groups=False)


def from_uniform(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group_size: int,
                 g_idx: torch.Tensor | None = None) -> tuple[Config, dict[str, torch.Tensor]]:
    """The buffers of uniform integer weights ``scales[:, g] * (codes - zeros[:, g])`` (GPTQ/AWQ convention).

    Args:
        codes: ``[N, K]`` integers in ``[0, 2**bits)``.
        scales: ``[N, G]`` fp16 values (fp16 or fp32 tensor).
        zeros: ``[N, G]`` integer zero points in ``[0, 2**bits)``.
        g_idx: optional ``[K]`` group of each column (GPTQ act_order); default ``k // group_size``.  An
            unordered ``g_idx`` makes an act_order layer stored reordered (``perm``, contiguous groups).

    Returns:
        ``(Config, buffers)`` in the uniform storage: :func:`dequantize` (float32) equals
        ``scales·(codes − zeros)`` computed in float32 bit for bit.

    Raises:
        ValueError: inconsistent shapes, codes or zero points out of range, scales that are not fp16 values.
        TypeError: scales that are not floating point, a ``g_idx`` that is not integer.
    """
    if codes.dim() != 2:
        raise ValueError(f"codes must be [N, K], got {list(codes.shape)}")
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"group_size must be -1 or a positive integer, got {group_size!r}")
    N, K = codes.shape
    G = num_groups(K, group_size if group_size != -1 else K)
    if scales.shape != (N, G) or zeros.shape != (N, G):
        raise ValueError(f"scales and zeros must be [{N}, {G}] for codes {list(codes.shape)} and group_size "
                         f"{group_size}; got {list(scales.shape)} and {list(zeros.shape)}")
    if not scales.is_floating_point():
        raise TypeError(f"scales must be a floating-point tensor of fp16 values, got {scales.dtype}")
    if g_idx is not None and (g_idx.is_floating_point() or g_idx.is_complex() or g_idx.dtype == torch.bool):
        raise TypeError(f"g_idx must be an integer tensor, got {g_idx.dtype}")
    cfg = Config(bits=bits, group_size=group_size, offset=True, iters=0, init="uniform", act_order=g_idx is not None)
    cfg.check_shape(N, K)
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
            raise ValueError(f"g_idx must be [{K}] with values in [0, {G})")
        perm = torch.argsort(g_idx, stable=True)
        natural = torch.arange(K, device=g_idx.device) // cfg.group(K)
        if torch.equal(g_idx, natural):  # GPTQ writes g_idx without act_order too
            perm = None
            cfg = dataclasses.replace(cfg, act_order=False)
        elif not torch.equal(g_idx[perm], natural):
            raise ValueError(f"g_idx must put exactly group_size={cfg.group(K)} inputs in each group (the last may "
                             f"hold fewer), as GPTQ writes it; got group sizes {torch.bincount(g_idx).tolist()[:8]}...")
        if perm is not None:
            codes = codes[:, perm]
    s = scales.to(torch.float32)
    if not torch.equal(s.to(torch.float16).to(torch.float32), s):
        raise ValueError(f"scales must be fp16 values; got values in [{float(s.min()):g}, {float(s.max()):g}] that "
                         f"fp16 rounds (cast them with .half() first if that is intended)")
    if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) >= 1 << bits):
        raise ValueError(f"zero points must lie in [0, {1 << bits}) for bits={bits}")
    out = uniform_buffers(codes, s, zeros, bits)
    if perm is not None:
        out["perm"] = perm.to(torch.int32)
    return cfg, out


def to_uniform(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`from_uniform`: ``(codes [N, K] in input order, scales [N, G] fp16 values as float32,
    zeros [N, G] int64, g_idx [K] int32 or None)``.  A layer without offset has the symmetric grid's zero point,
    which is not an integer: ValueError.

    Raises:
        ValueError: no offset, or free-α buffers whose α or offsets are not uniform.
    """
    K = in_features
    codes, s, zeros = uniform_parts(buffers, cfg, out_features, in_features)
    if zeros is None:
        raise ValueError("a layer without offset has the zero point (2^q − 1)/2, not an integer: GPTQ and AWQ "
                         "checkpoints cannot hold it (quantize with offset=True to export)")
    g_idx = None
    if "perm" in buffers:
        perm = buffers["perm"].long()
        in_order = torch.empty_like(codes)
        in_order[:, perm] = codes
        codes = in_order
        g_idx = torch.empty(K, dtype=torch.int32, device=perm.device)
        g_idx[perm] = (torch.arange(K, device=perm.device) // cfg.group(K)).to(torch.int32)
    return codes, s.to(torch.float32), zeros, g_idx
