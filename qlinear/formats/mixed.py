"""Mixed 2/4/16: intra-matrix 2-bit / 4-bit input-channel groups plus fp16 sparse outliers.

Source: "Fast and Efficient 2-bit LLM Inference on GPU: 2/4/16-bit in a Weight Matrix with
Asynchronous Dequantization" (§3 intra-weight mixed precision, eq. 9-10; §4 exclusive 2-bit sparse
outliers).  Instead of the paper's quantization-aware finetuning we use Hessian-based group
selection and GPTQ error feedback (:mod:`qlinear.gptq`) whenever calibration data is given.

Quantization (float32 math):

1. Input channels are split into ``G = K / group_size`` groups.  Sensitivity of group i (eq. 9):
   ``S_i = Σ_{m in group} Σ_j w_{j,m}² / [H⁻¹]_{mm}²`` with H = XᵀX + damping (``H = I`` without
   calibration).  The ``round(ratio_4bit · G)`` most sensitive groups use 4-bit codes, the rest 2-bit.
   Ablation (``group_selection="random"``): the same number of 4-bit groups, picked by a random
   permutation of the G groups from a generator seeded with ``selection_seed`` (deterministic, and
   independent of the weights and of H).
2. Every (row, group) gets asymmetric uniform codes ``w ≈ ŝ·(q − z)`` with an integer zero ``z`` and
   a clipped min/max range (best of a shrink grid in diag(H)-weighted MSE).  The first-order scales
   are themselves quantized to ``scale_bits`` along the output dimension: per chunk of
   ``scale_group_size`` rows, ``ŝ = scale_zero + scale_scale · code`` with fp16 ``scale_scale`` and
   ``scale_zero`` (the chunk minimum).  This second-order quantization is applied to the 4-bit groups
   too (the paper keeps theirs in fp16), which keeps the default near 3 bits per weight.
3. Outliers: ``round(outlier_ratio · N · K)`` weights, only inside 2-bit groups (§4, "exclusive 2-bit
   sparse outliers"; at most all 2-bit weights).  A round-to-nearest pre-pass ranks all 2-bit weights by
   ``err² / [H⁻¹]_jj`` (the OBS saliency) to fix how many each column keeps; each column then keeps its
   largest-error weights as it is quantized.  They are stored as fp16 *corrections* in CSR:
   ``Ŵ = dequant(codes) + sparse(values, cols, row_ptr)``.  Ablation (``outlier_placement="any"``):
   the same count may come from any group, 4-bit ones included (the pre-pass then ranks every weight,
   each group at its own width); the CSR layout and :func:`dequantize` are unchanged.

Packed layout (N = out_features, K = in_features, g = group_size, G4 4-bit groups, G2 = G − G4,
K2 = G2·g, K4 = G4·g, S2 = ceil(N / scale_group_size), nnz outliers; packing per
:mod:`qlinear.formats.packing`):

* ``idx4``            int32 ``[G4]``  sorted indices of the 4-bit groups
* ``qweight2``        int32 ``[N, ceil(K2/16)]``  2-bit codes of the 2-bit groups' columns, ascending
* ``qweight4``        int32 ``[N, ceil(K4/8)]``   4-bit codes of the 4-bit groups' columns, ascending
* ``zeros2``          int32 ``[N, ceil(G2/16)]``  2-bit zero points;  ``zeros4`` int32 ``[N, ceil(G4/8)]``
* ``scale_codes``     int32 ``[G, ceil(N·scale_bits/32)]``  first-order scale codes, per group along N
* ``scale_scale``, ``scale_zero``  fp16 ``[G, S2]``  second-order scale and zero
* ``outlier_values``  fp16 ``[nnz]``, ``outlier_cols`` int16 (int32 if K > 32767) ``[nnz]``,
  ``outlier_row_ptr`` int32 ``[N + 1]``: CSR, rows sorted, columns ascending within a row.
"""

from __future__ import annotations

import dataclasses

import torch

from . import rotation, uniform
from .base import BufferSpecs, FormatConfig, fp16_round, on_weight_device
from .packing import pack, packed_len, unpack, unpack_u8

NAME = "mixed"
#: float buffers Ŵ is linear in, the ones :func:`qlinear.finetune.finetune` trains (the codes stay fixed)
TUNABLE = ("scale_scale", "scale_zero", "outlier_values")
_CLIP = tuple(1.0 - 0.05 * i for i in range(10))
GROUP_SELECTIONS = ("sensitivity", "random")
OUTLIER_PLACEMENTS = ("2bit", "any")


@dataclasses.dataclass(frozen=True)
class Config(FormatConfig):
    """Mixed 2/4/16 options.

    Attributes:
        bits: bits of the low-precision groups (2).
        high_bits: bits of the sensitive groups (4).
        group_size: input channels per group (default 16); must divide in_features.
        ratio_4bit: fraction of input-channel groups stored with ``high_bits``.
        scale_bits: bits of the quantized first-order scales (2..8).
        scale_group_size: first-order scales per second-order (scale, zero) pair, along N.
        outlier_ratio: fraction of all weights kept as fp16 outliers (in 2-bit groups unless
            ``outlier_placement="any"``), <= 0.005.
        damp: Hessian damping (relative to mean diag(H)).
        group_selection: how the 4-bit groups are chosen: ``"sensitivity"`` (eq. 9, the default) or
            ``"random"`` (ablation: the same count, by a permutation seeded with ``selection_seed``).
        selection_seed: seed of the ``"random"`` selection (unused for ``"sensitivity"``).
        outlier_placement: where outliers may sit: ``"2bit"`` (the paper's exclusive 2-bit outliers,
            the default) or ``"any"`` (ablation: the same count taken from all groups).

    The last three fields were added after the first checkpoints were written; a saved config
    without them loads with these defaults, which reproduce the earlier behaviour exactly.
    """

    format = NAME
    bits: int = 2
    high_bits: int = 4
    group_size: int = 16
    ratio_4bit: float = 0.25
    scale_bits: int = 4
    scale_group_size: int = 16
    outlier_ratio: float = 0.002
    damp: float = 0.01
    group_selection: str = "sensitivity"
    selection_seed: int = 0
    outlier_placement: str = "2bit"

    def validate(self) -> None:
        if self.bits != 2 or self.high_bits != 4:
            raise ValueError(f"the mixed format stores 2-bit and 4-bit groups (bits=2, high_bits=4); "
                             f"got bits={self.bits}, high_bits={self.high_bits}. Use format='bcq' for other widths")
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        if not 0 <= self.ratio_4bit <= 1:
            raise ValueError(f"ratio_4bit must be in [0, 1], got {self.ratio_4bit}")
        if self.scale_bits not in (2, 4, 8):
            raise ValueError(f"scale_bits must be 2, 4 or 8, got {self.scale_bits}")
        if self.scale_group_size < 1:
            raise ValueError(f"scale_group_size must be positive, got {self.scale_group_size}")
        if not 0 <= self.outlier_ratio <= 0.005:
            raise ValueError(f"outlier_ratio must be in [0, 0.005], got {self.outlier_ratio}")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp must be in [0, 1), got {self.damp}")
        if self.group_selection not in GROUP_SELECTIONS:
            raise ValueError(f"group_selection must be one of {GROUP_SELECTIONS}, got {self.group_selection!r}")
        if self.selection_seed < 0:
            raise ValueError(f"selection_seed must be >= 0, got {self.selection_seed}")
        if self.outlier_placement not in OUTLIER_PLACEMENTS:
            raise ValueError(f"outlier_placement must be one of {OUTLIER_PLACEMENTS}, "
                             f"got {self.outlier_placement!r}")

    def check_shape(self, out_features: int, in_features: int) -> None:
        super().check_shape(out_features, in_features)
        if in_features % self.group_size:
            raise ValueError(f"mixed format needs in_features ({in_features}) divisible by group_size "
                             f"({self.group_size})")

    def counts(self, out_features: int, in_features: int) -> tuple[int, int, int]:
        """``(G, G4, nnz)`` for a layer of this shape."""
        G = in_features // self.group_size
        G4 = int(round(self.ratio_4bit * G))
        room = G if self.outlier_placement == "any" else G - G4  # groups outliers may come from
        nnz = min(int(round(self.outlier_ratio * out_features * in_features)),
                  room * self.group_size * out_features)
        return G, G4, nnz


def kernel_view(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """``(config the kernels see, side buffers the op applies)``: this format has none, kernels see ``cfg``."""
    return cfg, ()


def buffer_specs(out_features: int, in_features: int, cfg: Config) -> BufferSpecs:
    """``{name: (shape, dtype)}`` of the packed buffers (module docstring).  Raises ValueError for a
    shape the format cannot store."""
    cfg.check_shape(out_features, in_features)
    N, g = out_features, cfg.group_size
    G, G4, nnz = cfg.counts(N, in_features)
    G2 = G - G4
    S2 = -(-N // cfg.scale_group_size)
    return {
        "idx4": ((G4,), torch.int32),
        "qweight2": ((N, packed_len(G2 * g, 2)), torch.int32),
        "qweight4": ((N, packed_len(G4 * g, 4)), torch.int32),
        "zeros2": ((N, packed_len(G2, 2)), torch.int32),
        "zeros4": ((N, packed_len(G4, 4)), torch.int32),
        "scale_codes": ((G, packed_len(N, cfg.scale_bits)), torch.int32),
        "scale_scale": ((G, S2), torch.float16),
        "scale_zero": ((G, S2), torch.float16),
        "outlier_values": ((nnz,), torch.float16),
        "outlier_cols": ((nnz,), torch.int16 if in_features <= 32767 else torch.int32),
        "outlier_row_ptr": ((N + 1,), torch.int32),
        **rotation.specs(cfg),
    }


def paper_bits_per_weight(cfg: Config) -> float:
    """Eq. 10 of the paper plus 32 bits per outlier: 2-bit groups' scales/zeros counted, 4-bit
    groups' scales and zeros, row pointers and the group map left out (2.904 at the defaults, the
    paper's "2.91")."""
    a = 1 - cfg.ratio_4bit
    g1, g2, ns = cfg.group_size, cfg.scale_group_size, cfg.scale_bits
    return a * (2 + (2 + ns) / g1 + (ns + 16) / (g1 * g2)) + (1 - a) * 4 + 32 * cfg.outlier_ratio


def sensitivity(weight: torch.Tensor, group_size: int, hinv_diag: torch.Tensor | None) -> torch.Tensor:
    """Eq. 9: ``S_i`` ``[G]`` for input groups of ``weight`` ``[N, K]``; ``hinv_diag`` ``[K]`` or None (H = I)."""
    w2 = weight.to(torch.float64) ** 2
    if hinv_diag is not None:
        w2 = w2 / hinv_diag.to(torch.float64)[None] ** 2
    return w2.sum(0).reshape(-1, group_size).sum(1)


def select_4bit_groups(weight: torch.Tensor, cfg: Config, hinv_diag: torch.Tensor | None) -> torch.Tensor:
    """Bool mask ``[G]`` of the 4-bit groups of ``weight`` ``[N, K]``: the ``G4`` largest :func:`sensitivity`
    (ties to the lower index) or, for ``cfg.group_selection == "random"``, the first ``G4`` of a permutation
    drawn from ``torch.Generator().manual_seed(cfg.selection_seed)``."""
    N, K = weight.shape
    G, G4, _ = cfg.counts(N, K)
    if cfg.group_selection == "random":
        order = torch.randperm(G, generator=torch.Generator().manual_seed(cfg.selection_seed))
    else:
        order = torch.argsort(sensitivity(weight, cfg.group_size, hinv_diag), descending=True, stable=True)
    is4 = torch.zeros(G, dtype=torch.bool)
    is4[order[:G4]] = True
    return is4


def _second_order(s: torch.Tensor, cfg: Config):
    """Quantize first-order scales ``s`` ``[N]`` along N; returns (ŝ [N], codes [N], ss [S2], zz [S2])."""
    N = s.shape[0]
    sg = min(cfg.scale_group_size, N)  # a chunk of N rows or more is one chunk
    S2 = -(-N // sg)
    pad = torch.nn.functional.pad(s, (0, S2 * sg - N), value=float("nan")).reshape(S2, sg)
    mn = torch.nan_to_num(pad, nan=float("inf")).min(1).values
    mx = torch.nan_to_num(pad, nan=float("-inf")).max(1).values
    zz = fp16_round(mn)
    ss = fp16_round((mx - zz).clamp(min=0) / ((1 << cfg.scale_bits) - 1))
    ss_r, zz_r = ss.repeat_interleave(sg)[:N], zz.repeat_interleave(sg)[:N]
    codes = torch.where(ss_r > 0, torch.round((s - zz_r) / ss_r.clamp(min=1e-30)), torch.zeros(()))
    codes = codes.clamp(0, (1 << cfg.scale_bits) - 1)
    return zz_r + ss_r * codes, codes.long(), ss, zz


class GroupQuantizer:
    """Column quantizer of :mod:`qlinear.gptq` for the mixed format (see module docstring)."""

    def __init__(self, out_features: int, in_features: int, cfg: Config, is4: torch.Tensor,
                 quota: torch.Tensor):
        N, K = out_features, in_features
        self.cfg, self.N, self.K, self.is4, self.quota = cfg, N, K, is4, quota
        G = K // cfg.group_size
        S2 = -(-N // cfg.scale_group_size)
        self.codes = torch.zeros(N, K, dtype=torch.int64)
        self.zeros = torch.zeros(N, G, dtype=torch.int64)
        self.scale_codes = torch.zeros(G, N, dtype=torch.int64)
        self.ss = torch.zeros(G, S2)
        self.zz = torch.zeros(G, S2)
        self.out_rows, self.out_cols, self.out_vals = [], [], []

    def fit_group(self, index, start, w, d):
        bits = self.cfg.high_bits if self.is4[index] else self.cfg.bits
        qmax = (1 << bits) - 1
        s, z = uniform.fit(w, bits, d[None], _CLIP)
        lo = -s * z  # clipped range start implied by the chosen (s, z)
        s_hat, codes, ss, zz = _second_order(s, self.cfg)
        self.s = s_hat
        self.z = torch.round(-lo / s_hat.clamp(min=1e-30)).clamp(0, qmax)
        self.bits = bits
        self.zeros[:, index] = self.z.long()
        self.scale_codes[index] = codes
        self.ss[index], self.zz[index] = ss, zz

    def quantize(self, index, start, w):
        c = w.shape[1]
        codes = uniform.codes_for(w, self.s.clamp(min=1e-30)[:, None], self.z[:, None], self.bits)
        w_hat = self.s[:, None] * (codes - self.z[:, None])
        self.codes[:, start:start + c] = codes
        if self.cfg.outlier_placement == "any" or not self.is4[index]:
            for j in range(c):
                k = int(self.quota[start + j])
                if k:
                    rows = (w[:, j] - w_hat[:, j]).abs().topk(k).indices
                    delta = fp16_round(w[rows, j] - w_hat[rows, j])
                    w_hat[rows, j] += delta
                    self.out_rows.append(rows)
                    self.out_cols.append(torch.full_like(rows, start + j))
                    self.out_vals.append(delta)
        return w_hat

    def finish(self):
        cfg, N, g = self.cfg, self.N, self.cfg.group_size
        idx4 = torch.nonzero(self.is4).flatten()
        idx2 = torch.nonzero(~self.is4).flatten()
        cols = lambda idx: (idx[:, None] * g + torch.arange(g)).flatten()
        rows = torch.cat(self.out_rows) if self.out_rows else torch.zeros(0, dtype=torch.int64)
        ocols = torch.cat(self.out_cols) if self.out_cols else torch.zeros(0, dtype=torch.int64)
        vals = torch.cat(self.out_vals) if self.out_vals else torch.zeros(0)
        order = torch.argsort(rows * self.K + ocols)
        row_ptr = torch.zeros(N + 1, dtype=torch.int64)
        row_ptr[1:] = torch.bincount(rows, minlength=N).cumsum(0)
        specs = buffer_specs(N, self.K, cfg)
        return {
            "idx4": idx4.to(torch.int32),
            "qweight2": pack(self.codes[:, cols(idx2)], 2),
            "qweight4": pack(self.codes[:, cols(idx4)], 4),
            "zeros2": pack(self.zeros[:, idx2], 2),
            "zeros4": pack(self.zeros[:, idx4], 4),
            "scale_codes": pack(self.scale_codes, cfg.scale_bits),
            "scale_scale": self.ss.to(torch.float16),
            "scale_zero": self.zz.to(torch.float16),
            "outlier_values": vals[order].to(torch.float16),
            "outlier_cols": ocols[order].to(specs["outlier_cols"][1]),
            "outlier_row_ptr": row_ptr.to(torch.int32),
        }


def _quotas(weight, cfg, is4, hinv_diag, nnz):
    """Outliers per column: the global top-``nnz`` weights of a round-to-nearest pre-pass, among the
    2-bit groups' weights (``outlier_placement="2bit"``) or all weights (``"any"``)."""
    N, K = weight.shape
    quota = torch.zeros(K, dtype=torch.int64)
    if nnz == 0:
        return quota
    q = GroupQuantizer(N, K, cfg, is4, quota)
    g = cfg.group_size
    sal = torch.full((N, K), -1.0)
    ones = torch.ones(g)
    for gi in range(K // g):
        if is4[gi] and cfg.outlier_placement != "any":
            continue
        s = gi * g
        w = weight[:, s:s + g]
        q.fit_group(gi, s, w, ones)
        sal[:, s:s + g] = (w - q.quantize(gi, s, w)) ** 2 / hinv_diag[s:s + g][None]
    top = sal.flatten().topk(nnz).indices
    return torch.bincount(top % K, minlength=K)


@on_weight_device
@rotation.rotates
def quantize(weight: torch.Tensor, cfg: Config, hessian: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]`` to the mixed format; with ``hessian`` ``[K, K]`` (XᵀX) the groups
    are selected by eq. 9 (or at random, ``group_selection="random"``) and quantized with GPTQ error feedback
    (without it, H = I: plain round-to-nearest under the fitted scales, groups ranked by Σ w²)."""
    from .. import gptq

    N, K = weight.shape
    cfg.check_shape(N, K)
    w = weight.detach().to(torch.float32)
    if hessian is not None:  # inputs never seen in calibration: GPTQ zeroes them, so rank them as zeros
        w = w.masked_fill((torch.diagonal(hessian) == 0)[None], 0.0)
    G, G4, nnz = cfg.counts(N, K)
    hinv_diag = None if hessian is None else torch.diagonal(gptq.damped_inverse_hessian(hessian, K, cfg.damp)).float()
    is4 = select_4bit_groups(w, cfg, hinv_diag)
    quota = _quotas(w, cfg, is4, torch.ones(K) if hinv_diag is None else hinv_diag, nnz)
    q = GroupQuantizer(N, K, cfg, is4, quota)
    return gptq.run(w, cfg.group_size, q, hessian, damp=cfg.damp)


def group_kinds(idx4: torch.Tensor, G: int) -> torch.Tensor:
    """``[G]`` bool: which of the ``G`` groups ``idx4`` (int32 ``[G4]``) stores with 4-bit codes.  An ``idx4`` that is
    not a set of distinct groups (the zero buffers of a freshly constructed module) is completed with the first
    unlisted groups, so that the kinds still count ``G4`` 4-bit groups and match ``qweight2``/``qweight4`` (kernel
    layouts that repack by kind then stay exact permutations)."""
    idx4 = idx4.long()
    is4 = torch.zeros(G, dtype=torch.bool, device=idx4.device)
    is4[idx4[(idx4 >= 0) & (idx4 < G)]] = True
    missing = idx4.numel() - int(is4.sum())
    if missing > 0:
        is4[torch.nonzero(~is4).flatten()[:missing]] = True
    return is4


def check_indices(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int) -> None:
    """ValueError unless the index tensors in ``buffers`` (any of them may be absent) are ones :func:`quantize` could
    have written: ``idx4`` distinct groups in ``[0, G)``, the outliers' CSR (``outlier_row_ptr`` int32 ``[N + 1]``
    from 0, non-decreasing, ending at their count; ``outlier_cols`` in ``[0, K)``)."""
    G = in_features // cfg.group_size
    idx4 = buffers.get("idx4")
    if idx4 is not None and idx4.numel() and (
            int(idx4.min()) < 0 or int(idx4.max()) >= G or idx4.unique().numel() != idx4.numel()):
        raise ValueError(f"idx4 must list distinct groups in [0, {G}): the checkpoint is damaged")
    cols, ptr = buffers.get("outlier_cols"), buffers.get("outlier_row_ptr")
    if cols is not None and cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= in_features):
        raise ValueError(f"outlier_cols must lie in [0, {in_features}): the checkpoint is damaged")
    if ptr is not None and (int(ptr[0]) != 0 or bool((ptr[1:] < ptr[:-1]).any())
                            or (cols is not None and int(ptr[-1]) != cols.numel())):
        raise ValueError("outlier_row_ptr must rise from 0 to the number of outliers: the checkpoint is damaged")


def decode(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int,
           in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes and group parameters of the stored weight (in the rotated basis for a rotated layer), all float32
    (the codes and zero points are small integers, exact): codes ``q`` ``[N, K]`` (2- or 4-bit by the column's group),
    zero points ``z`` ``[N, G]`` and first-order scales ``ŝ = scale_zero + scale_scale·code`` ``[N, G]`` (the
    product, then the sum, each rounded to fp32), so that without outliers ``Ŵ = ŝ·(q − z)`` per group
    (:func:`dequantize`)."""
    N, K, g = out_features, in_features, cfg.group_size
    G = K // g
    dev = buffers["scale_scale"].device
    is4 = group_kinds(buffers["idx4"], G)
    sg = min(cfg.scale_group_size, N)  # a chunk of N rows or more is one chunk
    sc = unpack(buffers["scale_codes"], cfg.scale_bits, N).to(torch.float32)  # [G, N]
    ss = buffers["scale_scale"].to(torch.float32).repeat_interleave(sg, 1)[:, :N]
    zz = buffers["scale_zero"].to(torch.float32).repeat_interleave(sg, 1)[:, :N]
    scales = (zz + ss * sc).T.contiguous()  # [N, G]
    codes = torch.empty(N, G, g, dtype=torch.float32, device=dev)
    zeros = torch.empty(N, G, dtype=torch.float32, device=dev)
    for kind, bits, qw, zw in ((~is4, 2, "qweight2", "zeros2"), (is4, 4, "qweight4", "zeros4")):
        n = int(kind.sum())
        if n:
            codes[:, kind] = unpack_u8(buffers[qw], bits, n * g).reshape(N, n, g).to(torch.float32)
            zeros[:, kind] = unpack_u8(buffers[zw], bits, n).to(torch.float32)
    return codes.reshape(N, K), zeros, scales


@rotation.unrotates
def dequantize(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int) -> torch.Tensor:
    """Dense weight ``[N, K]`` float32: uniform codes with second-order scales, plus CSR outliers."""
    N, K, g = out_features, in_features, cfg.group_size
    codes, zeros, scales = decode(buffers, cfg, N, K)
    w = (scales[:, :, None] * (codes.view(N, K // g, g) - zeros[:, :, None])).reshape(N, K)
    return add_outliers(w, buffers)


def add_outliers(w: torch.Tensor, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """``w`` ``[N, K]`` (any float dtype) plus the CSR outliers of ``buffers``, each added in ``w``'s dtype (a (row,
    column) listed twice adds twice); in place, returned."""
    vals = buffers["outlier_values"]
    if vals.numel():
        rows = torch.repeat_interleave(torch.arange(w.shape[0], device=w.device),
                                       buffers["outlier_row_ptr"].long().diff())
        w.index_put_((rows, buffers["outlier_cols"].long()), vals.to(w.dtype), accumulate=True)
    return w
