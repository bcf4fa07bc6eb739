"""Group-wise non-uniform codebooks small enough to sit in one 128-bit vector register.

Source: "Highly Optimized Kernels and Fine-Grained Codebooks for LLM Inference on Arm CPUs"
(§5.2, group-wise codebook-based quantization).  Each group of ``group_size`` inputs of a row has an
fp16 scale that maps it into the int8 range, picks one of ``num_codebooks`` shared codebooks of
``2^bits`` int8 centroids, and stores ``bits``-wide indices: ``w = scale · codebook[c][idx]``.
All codebooks of a layer together take at most 16 bytes (e.g. 4 × 4 centroids at 2 bits, 1 × 16
at 4 bits), so a NEON kernel keeps them in one register and dequantizes with one TBL.

Clustering (two phases, alternated until no group changes codebook or ``iters`` rounds):

0. (At most 8192 evenly strided groups take part in the clustering; every group is assigned at the end.)
   Scale each group to ``v = w / s`` with ``s = max|w| / 127``.  Initial codebooks: sort groups by
   their concentration ``mean|v| / 127`` (a shape statistic independent of the scale), split into
   ``num_codebooks`` equal buckets, and fit each bucket's centroids by weighted k-means (Lloyd,
   initialised at weighted quantiles).
1. Assignment: each group picks the codebook with the least importance-weighted squared error,
   each value mapped to its nearest centroid.
2. Refinement: per codebook, weighted k-means (a few Lloyd steps from the current centroids) over
   the values of its groups; centroids rounded to int8.
Finally each group's scale is refitted by weighted least squares given its indices (it stays an
fp16 scale into the int8 grid) and indices re-assigned.  Importance = diag(XᵀX) of the input
column when calibration data is given (else 1).  With ``codebook_scope="model"`` the codebooks are
clustered once over all layers (:func:`fit_codebooks` on every layer's groups) and shared.

Packed layout (N, K, G = K / group_size, C = num_codebooks):

* ``codes``      int32 ``[N, ceil(K·bits/32)]``: centroid indices, packed along K
* ``book_idx``   int32 ``[N, ceil(G·log2(C)/32)]`` (only when C > 1): codebook of each group
* ``scales``     fp16 ``[N, G]``
* ``codebooks``  int8 ``[C, 2^bits]``
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import rotation
from .base import (FP16_TINY, BufferSpecs, FormatConfig, check_input_split, fp16_round, group_lookup, importance,
                   on_weight_device)
from .packing import pack, packed_len, unpack_u8

NAME = "codebook"
#: float buffers Ŵ is linear in, the ones :func:`qlinear.finetune.finetune` trains (the codes stay fixed)
TUNABLE = ("scales",)
_MAX_GROUPS = 8192


@dataclasses.dataclass(frozen=True)
class Config(FormatConfig):
    """Codebook options.

    Attributes:
        bits: index width: 1, 2 or 4.
        group_size: inputs per scale/codebook choice (default 32); must divide in_features.
        num_codebooks: codebooks per layer, 1, 2 or 4; ``num_codebooks · 2^bits <= 16``.
            0 means the default: 4 at bits <= 2, 1 at bits=4.
        codebook_scope: "layer" (each layer its own) or "model" (shared by all layers of a
            replace_linear call).
        iters: assignment/refinement rounds.
        error_feedback: quantize with GPTQ error feedback when a Hessian is given.
        damp: GPTQ damping.
    """

    format = NAME
    bits: int = 2
    group_size: int = 32
    num_codebooks: int = 0
    codebook_scope: str = "layer"
    iters: int = 10
    error_feedback: bool = False
    damp: float = 0.01

    def validate(self) -> None:
        if self.bits not in (1, 2, 4):
            raise ValueError(f"codebook bits must be 1, 2 or 4, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be positive, got {self.group_size}")
        c = self.books
        if c not in (1, 2, 4):
            raise ValueError(f"num_codebooks must be 1, 2 or 4 (the codebook choice is packed in 0, 1 or 2 bits), got {c}")
        if c * (1 << self.bits) > 16:
            raise ValueError(f"{c} codebooks x {1 << self.bits} int8 centroids exceed the 16 bytes of one "
                             f"128-bit register; use num_codebooks <= {16 >> self.bits}")
        if self.codebook_scope not in ("layer", "model"):
            raise ValueError(f"codebook_scope must be 'layer' or 'model', got {self.codebook_scope!r}")
        if self.iters < 0 or not 0 <= self.damp < 1:
            raise ValueError("iters must be >= 0 and damp in [0, 1)")

    @property
    def books(self) -> int:
        """The effective number of codebooks (``num_codebooks`` or its per-bits default)."""
        return self.num_codebooks or (4 if self.bits <= 2 else 1)

    def check_shape(self, out_features: int, in_features: int) -> None:
        super().check_shape(out_features, in_features)
        if in_features % self.group_size:
            raise ValueError(f"codebook format needs in_features ({in_features}) divisible by group_size "
                             f"({self.group_size})")


def kernel_view(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """``(config the kernels see, side buffers the op applies)``: this format has none, kernels see ``cfg``."""
    return cfg, ()


def buffer_specs(out_features: int, in_features: int, cfg: Config) -> BufferSpecs:
    """``{name: (shape, dtype)}`` of the packed buffers (module docstring).  Raises ValueError for a
    shape the format cannot store."""
    cfg.check_shape(out_features, in_features)
    G = in_features // cfg.group_size
    specs: BufferSpecs = {"codes": ((out_features, packed_len(in_features, cfg.bits)), torch.int32)}
    if cfg.books > 1:
        specs["book_idx"] = ((out_features, packed_len(G, int(math.log2(cfg.books)))), torch.int32)
    specs["scales"] = ((out_features, G), torch.float16)
    specs["codebooks"] = ((cfg.books, 1 << cfg.bits), torch.int8)
    return {**specs, **rotation.specs(cfg)}


def _scale(w: torch.Tensor) -> torch.Tensor:
    return fp16_round(w.abs().amax(1) / 127).clamp(min=FP16_TINY)


def _nearest(v: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Index of the nearest centroid of the sorted ``book`` ``[L]`` for each entry of ``v``."""
    return torch.bucketize(v, (book[1:] + book[:-1]) / 2)


def _lloyd(v: torch.Tensor, d: torch.Tensor, book: torch.Tensor, steps: int) -> torch.Tensor:
    """Weighted k-means on flat values ``v`` with weights ``d`` from centroids ``book`` (float32);
    returns int8-valued float32 centroids, sorted."""
    for _ in range(steps):
        idx = _nearest(v, book)
        num = torch.zeros_like(book).index_add_(0, idx, d * v)
        den = torch.zeros_like(book).index_add_(0, idx, d)
        book = torch.where(den > 0, num / den.clamp(min=1e-30), book)
    return torch.round(book).clamp(-128, 127).sort().values


def _quantile_init(v, d, L):
    order = v.argsort()
    cw = d[order].cumsum(0)
    targets = (torch.arange(L) + 0.5) / L * cw[-1]
    return v[order][torch.searchsorted(cw, targets).clamp(max=v.numel() - 1)].clone()


@on_weight_device
def fit_codebooks(groups: torch.Tensor, weights: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Two-phase clustering of scaled groups (module docstring).

    Args:
        groups: ``[M, g]`` float32 weight groups (unscaled).
        weights: ``[M, g]`` importance of each value.

    Returns:
        int8 ``[C, 2^bits]`` codebooks.
    """
    L, C = 1 << cfg.bits, cfg.books
    if groups.shape[0] > _MAX_GROUPS:  # 16 centroids need no more: a fixed, evenly strided subsample
        step = -(-groups.shape[0] // _MAX_GROUPS)
        groups, weights = groups[::step], weights[::step]
    v = groups / _scale(groups)[:, None]
    conc = v.abs().mean(1)
    buckets = torch.argsort(torch.argsort(conc, stable=True)) * C // v.shape[0]
    books = []
    for c in range(C):
        m = buckets == c
        vv, dd = (v[m].flatten(), weights[m].flatten()) if m.any() else (v.flatten(), weights.flatten())
        books.append(_lloyd(vv, dd, _quantile_init(vv, dd, L), 10))
    books = torch.stack(books)
    assign = None
    for _ in range(cfg.iters):
        new = _assign(v, weights, books)[0]
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        for c in range(C):
            m = assign == c
            if m.any():
                books[c] = _lloyd(v[m].flatten(), weights[m].flatten(), books[c], 3)
    return books.to(torch.int8)


def _assign(v, d, books):
    """Best codebook per group ``[M]`` and the indices ``[M, g]`` under it."""
    best_err, best_c, best_idx = None, None, None
    for c in range(books.shape[0]):
        idx = _nearest(v, books[c])
        err = (d * (v - books[c][idx]) ** 2).sum(1)
        if best_err is None:
            best_err, best_c, best_idx = err, torch.zeros_like(err, dtype=torch.int64), idx
        else:
            take = err < best_err
            best_err = torch.where(take, err, best_err)
            best_c = torch.where(take, c, best_c)
            best_idx = torch.where(take[:, None], idx, best_idx)
    return best_c, best_idx


def fit_groups(w: torch.Tensor, d: torch.Tensor, books: torch.Tensor):
    """Scale, codebook choice and indices for groups ``w`` ``[M, g]`` given int8 ``books``.

    Returns ``(scale [M] fp16 values, book [M] int64, idx [M, g] int64)``."""
    bf = books.to(torch.float32)
    d = torch.broadcast_to(d, w.shape)
    s = _scale(w)
    c, idx = _assign(w / s[:, None], d, bf)
    cent = bf[c[:, None], idx]
    s_ls = fp16_round((d * w * cent).sum(1) / (d * cent * cent).sum(1).clamp(min=1e-30))
    s_ls = torch.where(s_ls > 0, s_ls, s)
    c2, idx2 = _assign(w / s_ls[:, None], d, bf)
    e1 = (d * (w - s[:, None] * cent) ** 2).sum(1)
    e2 = (d * (w - s_ls[:, None] * bf[c2[:, None], idx2]) ** 2).sum(1)
    take = e2 < e1
    return (torch.where(take, s_ls, s), torch.where(take, c2, c), torch.where(take[:, None], idx2, idx))


class GroupQuantizer:
    """Column quantizer of :mod:`qlinear.gptq` for the codebook format."""

    def __init__(self, out_features: int, in_features: int, cfg: Config, books: torch.Tensor):
        G = in_features // cfg.group_size
        self.cfg, self.books = cfg, books
        self.scales = torch.zeros(out_features, G)
        self.book = torch.zeros(out_features, G, dtype=torch.int64)
        self.codes = torch.zeros(out_features, in_features, dtype=torch.int64)

    def fit_group(self, index, start, w, d):
        s, c, _ = fit_groups(w, d, self.books)
        self.scales[:, index], self.book[:, index] = s, c
        self._cent = self.books.to(torch.float32)[c]  # [N, L]
        self._s = s

    def quantize(self, index, start, w):
        idx = (w[:, :, None] / self._s[:, None, None] - self._cent[:, None, :]).abs().argmin(-1)
        self.codes[:, start:start + w.shape[1]] = idx
        return self._s[:, None] * self._cent.gather(1, idx)

    def finish(self):
        out = {"codes": pack(self.codes, self.cfg.bits)}
        if self.cfg.books > 1:
            out["book_idx"] = pack(self.book, int(math.log2(self.cfg.books)))
        out["scales"] = self.scales.to(torch.float16)
        out["codebooks"] = self.books.clone()
        return out


@on_weight_device
def layer_groups(weight: torch.Tensor, cfg: Config, hessian: torch.Tensor | None = None):
    """``(groups [N·G, g], importance [N·G, g])`` of a layer (rotated if its config says so), the input of
    :func:`fit_codebooks`."""
    weight, hessian, cfg = rotation.rotated_problem(weight, cfg, hessian)
    N, K = weight.shape
    g = cfg.group_size
    d = importance(hessian, K)
    return weight.detach().float().reshape(N * K // g, g), d.reshape(1, K // g, g).expand(N, -1, -1).reshape(-1, g)


@on_weight_device
@rotation.rotates
def quantize(weight: torch.Tensor, cfg: Config, hessian: torch.Tensor | None = None,
             codebooks: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize ``weight`` ``[N, K]``; ``codebooks`` int8 ``[C, 2^bits]`` fixes shared (model-scope)
    codebooks, else they are clustered on this layer."""
    from .. import gptq

    N, K = weight.shape
    cfg.check_shape(N, K)
    if codebooks is None:
        codebooks = fit_codebooks(*layer_groups(weight, cfg, hessian), cfg)
    elif tuple(codebooks.shape) != (cfg.books, 1 << cfg.bits) or codebooks.dtype != torch.int8:
        raise ValueError(f"codebooks must be int8 [{cfg.books}, {1 << cfg.bits}], got {codebooks.dtype} "
                         f"{list(codebooks.shape)}")
    else:
        codebooks = codebooks.sort(dim=1).values  # nearest-centroid search assumes sorted centroids
    q = GroupQuantizer(N, K, cfg, codebooks)
    if hessian is None or not cfg.error_feedback:
        groups, d = layer_groups(weight, cfg, hessian)
        s, c, idx = fit_groups(groups, d, codebooks)
        G = K // cfg.group_size
        q.scales, q.book, q.codes = s.reshape(N, G), c.reshape(N, G), idx.reshape(N, K)
        return q.finish()
    return gptq.run(weight, cfg.group_size, q, hessian, damp=cfg.damp)


@rotation.unrotates
def dequantize(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int) -> torch.Tensor:
    """Dense weight ``[N, K]`` float32: ``scale · codebook[book][idx]``."""
    N, K, g = out_features, in_features, cfg.group_size
    G = K // g
    books = buffers["codebooks"].to(torch.float32)  # [C, 2^bits]
    if cfg.books > 1:
        books = books[unpack_u8(buffers["book_idx"], int(math.log2(cfg.books)), G).long()]  # [N, G, 2^bits]
    levels = buffers["scales"].to(torch.float32)[:, :, None] * books  # [N, G, 2^bits]: scale · centroid
    return group_lookup(levels, unpack_u8(buffers["codes"], cfg.bits, K).reshape(N, G, g)).view(N, K)


def slice_rows(buffers: dict[str, torch.Tensor], cfg: Config, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The buffers of output features ``rows`` (int64 ``[n]``, any order); the shared codebooks and ``rotation`` are
    kept."""
    return {k: v if k in ("codebooks", "rotation") else v[rows].contiguous() for k, v in buffers.items()}


def slice_inputs(buffers: dict[str, torch.Tensor], cfg: Config, out_features: int, in_features: int, start: int,
                 end: int) -> tuple[dict[str, torch.Tensor], Config]:
    """``(buffers, config)`` of input positions ``[start, end)``.

    Raises:
        ValueError: a bound that splits a quantization group, or a rotated layer.
    """
    K, g = in_features, cfg.group_size
    check_input_split(out_features, K, cfg, start, end)
    out = {"codes": pack(unpack_u8(buffers["codes"], cfg.bits, K)[:, start:end], cfg.bits)}
    if "book_idx" in buffers:
        lb = int(math.log2(cfg.books))
        out["book_idx"] = pack(unpack_u8(buffers["book_idx"], lb, K // g)[:, start // g:end // g], lb)
    out["scales"], out["codebooks"] = buffers["scales"][:, start // g:end // g].contiguous(), buffers["codebooks"]
    return out, cfg
