"""Asymmetric uniform (min/max) quantization: the round-to-nearest baseline and a building block.

``w ≈ s * (q - z)`` with integer codes ``q`` in ``[0, 2**bits)``, an fp16 scale ``s`` and an
integer zero point ``z`` per (row, group): the GPTQ/AWQ convention (Frantar et al. 2022, §3;
Lin et al. 2023).  ``clip_grid`` adds the scale-clipping search of AWQ/GPTQ's ``mse`` option:
each row tries ranges shrunk by the given factors and keeps the one of least (weighted) MSE.
"""

from __future__ import annotations

import torch

from .base import UNIFORM_MIN_SCALE, fp16_round, group_bounds, num_groups

__all__ = ["fit", "fit_symmetric", "codes_for", "rtn", "GroupQuantizer", "MSE_GRID", "pack_gptq", "unpack_gptq",
           "pack_awq", "unpack_awq"]

MSE_GRID = tuple(1 - i / 100 for i in range(21))  # GPTQ's mse search: shrink factors 1.00 ... 0.80


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

    def grid(p: float) -> tuple[torch.Tensor, torch.Tensor]:
        scale = fp16_round((hi - lo) * p / qmax).clamp(min=UNIFORM_MIN_SCALE)
        return scale, torch.round(-lo * p / scale).clamp(0, qmax)

    if len(clip_grid) == 1:
        scale, zero = grid(clip_grid[0])
        return scale, zero.long()
    best = None
    for p in clip_grid:
        scale, zero = grid(p)
        err = (w - scale[:, None] * (codes_for(w, scale[:, None], zero[:, None], bits) - zero[:, None])) ** 2
        err = (err if weight is None else err * weight).sum(1)
        if best is None:
            best = (err, scale, zero)
        else:
            take = err < best[0]
            best = (torch.where(take, err, best[0]), torch.where(take, scale, best[1]), torch.where(take, zero, best[2]))
    return best[1], best[2].long()


def fit_symmetric(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's symmetric grid for rows of ``w`` ``[M, g]``: zero point ``2^(bits-1)``, scale
    ``2·max|w| / (2^bits − 1)`` (fp16).  Returns ``(scale [M] float32, zero [M] int64)``."""
    qmax = (1 << bits) - 1
    scale = fp16_round(2 * w.abs().amax(1) / qmax).clamp(min=UNIFORM_MIN_SCALE)
    return scale, torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)


class GroupQuantizer:
    """Column quantizer of :mod:`qlinear.gptq` for uniform int codes (GPTQ's own quantizer): per group an
    fp16 scale and an integer zero point, min/max (asymmetric, range searched over ``clip_grid``) or
    :func:`fit_symmetric`."""

    def __init__(self, out_features: int, in_features: int, bits: int, group_size: int, sym: bool = False,
                 clip_grid: tuple[float, ...] = (1.0,)):
        G = num_groups(in_features, group_size)
        self.bits, self.sym, self.clip_grid = bits, sym, clip_grid
        self.scales = torch.zeros(out_features, G)
        self.zeros = torch.zeros(out_features, G, dtype=torch.int64)
        self.codes = torch.zeros(out_features, in_features, dtype=torch.int64)

    def fit_group(self, index, start, w, d):
        """Fit group ``index`` (scale and zero point per row) from its weights ``w`` ``[N, g]``."""
        s, z = fit_symmetric(w, self.bits) if self.sym else fit(w, self.bits, clip_grid=self.clip_grid)
        self.scales[:, index], self.zeros[:, index] = s, z

    def quantize(self, index, start, w):
        """Codes of columns ``start:start + w.shape[1]`` under group ``index``; returns their dequantized values."""
        s, z = self.scales[:, index, None], self.zeros[:, index, None]
        q = codes_for(w, s, z, self.bits)
        self.codes[:, start:start + w.shape[1]] = q
        return s * (q - z)

    def finish(self):
        """``{"codes" [N, K] int64, "scales" [N, G] float32, "zeros" [N, G] int64}``."""
        return {"codes": self.codes, "scales": self.scales, "zeros": self.zeros}


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


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, bits: int, checkpoint_format: str = "gptq"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`unpack_gptq`: ``codes`` ``[N, K]`` and ``zeros`` ``[N, G]`` -> ``(qweight int32
    [K·bits/32, N], qzeros int32 [G, ceil(N·bits/32)])`` in the AutoGPTQ / GPTQModel checkpoint layout.

    Raises:
        ValueError: unsupported bits/format, or K·bits not a multiple of 32.
    """
    from .packing import pack

    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ packing supports bits 2, 3, 4, 8, got {bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    if codes.shape[1] * bits % 32:
        raise ValueError(f"in_features·bits must be a multiple of 32, got {codes.shape[1]}·{bits}")
    z = zeros.long()
    if checkpoint_format == "gptq":
        if (z == 0).any():
            raise ValueError("the v1 'gptq' format stores zero points minus one and cannot hold a zero point of 0 "
                             "(other engines would read 2^bits); use checkpoint_format='gptq_v2'")
        z = z - 1
    return pack(codes, bits).T.contiguous(), pack(z.T.contiguous(), bits)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int, in_features: int,
                checkpoint_format: str = "gptq", dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack GPTQ checkpoint tensors (AutoGPTQ / GPTQModel layout) into ``(codes [N, K], zeros [N, G])``.

    Args:
        qweight: int32 ``[K·bits/32, N]``, codes packed little-endian along K.
        qzeros: int32 ``[G, ceil(N·bits/32)]``, zero points packed little-endian along N.
        bits: 2, 3, 4 or 8 (3-bit codes straddle words: one little-endian bit stream).
        checkpoint_format: "gptq" (v1: the stored zero is z − 1) or "gptq_v2" (stored as z).
        dtype: of the codes, int64 or uint8 (8x less memory; zeros stay int64).

    Raises:
        ValueError: unsupported bits/format or shapes that do not fit ``in_features``.
    """
    from .packing import unpack, unpack_u8

    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ unpacking supports bits 2, 3, 4, 8, got {bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got {checkpoint_format!r}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    N = qweight.shape[1]
    if qweight.shape[0] * 32 // bits != in_features or qzeros.shape[1] != -(-N * bits // 32):
        raise ValueError(f"qweight {list(qweight.shape)} / qzeros {list(qzeros.shape)} do not fit "
                         f"in_features={in_features}, out_features={N} at {bits} bits")
    codes = (unpack_u8 if dtype == torch.uint8 else unpack)(qweight.T.contiguous(), bits, in_features)
    zeros = unpack(qzeros, bits, N).T.contiguous()
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & ((1 << bits) - 1)
    return codes, zeros


AWQ_VERSIONS = ("gemm", "gemv")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # "gemm": nibble i of a word holds output column 8·c + AWQ_ORDER[i]


def _awq_zero_words(groups: int, group_size: int) -> int:
    """Width of a "gemv" ``qzeros`` row: ``ceil(G / 8)`` words rounded up to a multiple of 1, 2 or 4 (group size
    ≥ 128, 64 or 32), as AutoAWQ's GEMV kernel reads them."""
    multiple = 1 if group_size >= 128 else {64: 2, 32: 4}.get(group_size)
    if multiple is None:
        raise ValueError(f"AWQ's 'gemv' layout has group sizes 32, 64 or >= 128, got {group_size}; "
                         "use version='gemm'")
    words = -(-groups // 8)
    return -(-words // multiple) * multiple


def _awq_columns(n: int) -> torch.Tensor:
    return (torch.arange(n).view(-1, 8)[:, list(AWQ_ORDER)]).flatten()


def awq_version(version: str) -> str:
    """``version`` lower-cased (AutoAWQ writes "GEMM"); ValueError unless it is one of :data:`AWQ_VERSIONS`."""
    lower = version.lower() if isinstance(version, str) else version
    if lower not in AWQ_VERSIONS:
        raise ValueError(f"AWQ layout (version) must be one of {AWQ_VERSIONS}, got {version!r}; 'gemv_fast' and "
                         "'marlin' checkpoints are repacked for one kernel and not read here")
    return lower


def _check_awq(version: str, in_features: int, out_features: int, group_size: int) -> tuple[str, int, int]:
    """``(version lower-cased, group size, number of groups)`` after checking that the layout holds this shape."""
    version = awq_version(version)
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        raise ValueError(f"AWQ groups must divide in_features={in_features}, got group_size={group_size}")
    if version == "gemm" and out_features % 8:
        raise ValueError(f"AWQ's 'gemm' layout packs 8 output columns per word: out_features={out_features} is not a "
                         "multiple of 8")
    if version == "gemv" and in_features % 8:
        raise ValueError(f"AWQ's 'gemv' layout packs 8 inputs per word: in_features={in_features} is not a multiple "
                         "of 8")
    return version, g, in_features // g


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             version: str = "gemm") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit ``codes [N, K]``, ``zeros [N, G]`` and ``scales [N, G]`` in an AutoAWQ checkpoint layout
    (Lin et al. 2023, AutoAWQ's ``WQLinear_GEMM`` / ``WQLinear_GEMV``); ``ŵ = scales·(codes − zeros)``.

    Returns:
        ``(qweight, qzeros, scales)``.  "gemm": int32 ``[K, N/8]`` and ``[G, N/8]``, eight output columns per word
        in the order :data:`AWQ_ORDER`, fp16 ``[G, N]``.  "gemv": int32 ``[N, K/8]`` (eight inputs per word in
        order) and ``[N, W]`` (the groups' zero points in order, zero-padded to ``W`` words, see
        :func:`_awq_zero_words`), fp16 ``[N, 8·W]`` (zero-padded).

    Raises:
        ValueError: an unknown version, groups that do not divide K, N (gemm) or K (gemv) not a multiple of 8, a
            "gemv" group size other than 32, 64 or ≥ 128, codes or zeros outside [0, 16).
    """
    from .packing import pack

    N, K = codes.shape
    version, g, G = _check_awq(version, K, N, group_size)
    if version == "gemm":
        cols = _awq_columns(N)
        return (pack(codes.T[:, cols].contiguous(), 4), pack(zeros.long().T[:, cols].contiguous(), 4),
                scales.T.contiguous().half())
    pad = (0, 8 * _awq_zero_words(G, g) - G)
    return (pack(codes, 4), pack(torch.nn.functional.pad(zeros.long(), pad), 4),
            torch.nn.functional.pad(scales.half(), pad))


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, in_features: int,
               out_features: int, group_size: int, version: str = "gemm", dtype: torch.dtype = torch.int64
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_awq`: ``(codes [N, K] of dtype, zeros [N, G] int64, scales [N, G] fp16)``.

    Args:
        qweight, qzeros: int32 tensors in the ``version`` layout.  scales: fp16 in that layout.
        in_features, out_features: K and N.  group_size: inputs per group (-1: all of K).
        dtype: of the codes, int64 or uint8 (8x less memory).

    Raises:
        ValueError: an unknown version, non-int32 words, or shapes that do not fit K, N and ``group_size``.
        TypeError: scales that are not floating point.
    """
    from .packing import unpack, unpack_u8

    N = out_features
    version, g, G = _check_awq(version, in_features, N, group_size)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"AWQ qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    if not scales.is_floating_point():
        raise TypeError(f"AWQ scales must be fp16, got {scales.dtype}")
    if version == "gemm":
        want = {"qweight": (in_features, N // 8), "qzeros": (G, N // 8), "scales": (G, N)}
    else:
        W = _awq_zero_words(G, g)
        want = {"qweight": (N, in_features // 8), "qzeros": (N, W), "scales": (N, 8 * W)}
    got = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    for k, shape in want.items():
        if tuple(got[k].shape) != shape:
            raise ValueError(f"AWQ {version!r} {k} is {list(got[k].shape)}, expected {list(shape)} for "
                             f"in_features={in_features}, out_features={N}, group_size={group_size}")
    if version == "gemm":
        cols = torch.argsort(_awq_columns(N))
        codes = unpack_u8(qweight, 4, N).index_select(1, cols).T.contiguous()
        return (codes.to(dtype), unpack(qzeros, 4, N)[:, cols].T.contiguous(), scales.T.contiguous())
    return (unpack_u8(qweight, 4, in_features).to(dtype), unpack(qzeros, 4, 8 * W)[:, :G].contiguous(),
            scales[:, :G].contiguous())
