"""The ``torch.library`` custom ops every module calls, declared once with their fake implementations.

Following bitsandbytes' ``_ops.py``: the op surface is this file.  Both ops take the packed buffers
as a list in the order of the format's ``buffer_specs`` and the format config as JSON, so
``torch.compile(fullgraph=True)`` traces them as single opaque nodes (no graph breaks) and the fake
implementations give output shapes without running any kernel.

* ``qlinear::linear(x, packed, bias, format, config, out_features, in_features, backend, layout) -> y``:
  ``y = x Ŵᵀ + b``, ``x`` ``[..., K]`` (fp32/fp16/bf16) -> ``[..., N]`` of ``x.dtype``; the kernel is
  chosen at run time by :func:`qlinear.backends.select` (``backend=""`` means automatic).
* ``qlinear::dequantize(packed, format, config, out_features, in_features, dtype, layout) -> Ŵ`` ``[N, K]``.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch

from . import backends
from .formats import config_from_dict, get_format, rotation
from .formats.base import place_inputs


@functools.lru_cache(maxsize=1024)
def parse_config(config: str):
    """Format config from its JSON text (cached: the same string arrives on every forward)."""
    return config_from_dict(json.loads(config))


@functools.lru_cache(maxsize=1024)
def kernel_view(cfg):
    """``(config the kernels see, names of side buffers the op applies itself)``: the format's ``kernel_view``
    (e.g. :func:`qlinear.formats.bcq.kernel_view`: an act_order layer's ``perm``) of the config without its rotation
    (:mod:`qlinear.formats.rotation`: the op rotates ``x``, the ``rotation`` buffer is a side buffer), cached."""
    if cfg.rotation == "none":
        return get_format(cfg.format).kernel_view(cfg)
    kcfg, side = get_format(cfg.format).kernel_view(rotation.unrotated(cfg))
    return kcfg, side + ("rotation",)


@functools.lru_cache(maxsize=4096)
def _names(format: str, config: str, out_features: int, in_features: int, layout: str = "") -> tuple[str, ...]:
    cfg = parse_config(config)
    if layout:
        kcfg, side = kernel_view(cfg)
        return tuple(backends.get_layout(layout).names(kcfg)) + side
    return tuple(get_format(format).buffer_specs(out_features, in_features, cfg))


def _buffers(format: str, config: str, packed, out_features: int, in_features: int, layout: str = ""):
    return parse_config(config), dict(zip(_names(format, config, out_features, in_features, layout), packed))


def canonical(bufs: dict, cfg, layout: str, out_features: int, in_features: int) -> dict:
    """Buffers held in kernel ``layout`` ("" = already canonical) back in the format's canonical layout."""
    if not layout:
        return bufs
    return _convert(bufs, cfg, backends.get_layout(layout).unrepack, out_features, in_features)


def to_layout(bufs: dict, cfg, layout, out_features: int, in_features: int) -> dict:
    """Canonical buffers repacked into kernel ``layout`` (a :class:`qlinear.backends.Layout`).  Raises what the
    layout's ``repack`` raises (ValueError for data it cannot hold)."""
    return _convert(bufs, cfg, layout.repack, out_features, in_features)


def _convert(bufs: dict, cfg, fn, out_features: int, in_features: int) -> dict:
    # layouts see the kernels' view of the config; side buffers (an act_order perm) pass through unchanged
    kcfg, side = kernel_view(cfg)
    main = fn({k: v for k, v in bufs.items() if k not in side}, kcfg, out_features, in_features)
    return {**main, **{k: bufs[k] for k in side}}


class Call:
    """A resolved ``qlinear::linear`` call: the kernel for one (layer config and layout, device, dtype, batch), with
    everything decided once (buffer names, rotation, act_order gather, layout conversion); ``call(x, packed, bias)``
    runs it.

    ``converts`` is True when the kernel reads another layout than the one held: the buffers are then converted on
    every call (a fallback, e.g. the reference kernel above a GEMV's batch range).  ``rotation`` is the (seed, block)
    of a rotated layer's input transform, applied here before the act_order gather."""

    __slots__ = ("kernel", "cfg", "names", "perm", "gather", "layout", "converts", "shape", "rotation", "fused")

    def __init__(self, kernel, cfg, names, side, layout, shape, rotation=None):
        self.kernel, self.cfg, self.names, self.layout, self.shape = kernel, cfg, names, layout, shape
        self.perm, self.rotation = "perm" in side, rotation
        self.gather = self.perm and not kernel.gathers_perm
        # a kernel that rotates x itself, unless the op must gather act_order's perm first (x is rotated, then gathered)
        self.fused = {"rotation": rotation} if rotation is not None and kernel.fuses_rotation and not self.gather else {}
        self.converts = ("" if kernel.layout is None else kernel.layout.name) != layout

    def __call__(self, x: torch.Tensor, packed, bias: Optional[torch.Tensor]) -> torch.Tensor:
        N, K = self.shape
        bufs = dict(zip(self.names, packed))
        if self.rotation is not None:
            bufs.pop("rotation")
            if not self.fused:
                x = rotation.rotate_input(x, *self.rotation)
        perm = bufs.pop("perm") if self.perm else None
        if self.gather:
            x, perm = x.index_select(-1, perm), None
        if self.converts:
            bufs = canonical(bufs, self.cfg, self.layout, N, K)
            if self.kernel.layout is not None:
                bufs = to_layout(bufs, self.cfg, self.kernel.layout, N, K)
        if perm is not None:
            bufs["perm"] = perm
        return self.kernel.fn(x, bufs, bias, self.cfg, N, K, **self.fused)


@functools.lru_cache(maxsize=4096)
def resolve(format: str, config: str, out_features: int, in_features: int, layout: str, device: torch.device,
            dtype: torch.dtype, batch: int, backend: str, generation: tuple[int, int]) -> Call:
    """The :class:`Call` for a layer (``format``, JSON ``config``, shape, held ``layout``) on ``batch`` rows of
    ``dtype`` on ``device`` with ``backend`` (:func:`qlinear.backends.effective_backend`: "" = automatic).
    ``generation`` is :func:`qlinear.backends.generation`: registering or removing a kernel, or reloading the
    dispatch table, resolves anew.

    Raises:
        ValueError: no kernel (or not the requested backend) supports the call; the message says why.
    """
    full = parse_config(config)
    cfg, side = kernel_view(full)
    kernel = backends.select(format, cfg, device, dtype, batch, backend or None, (out_features, in_features), layout)
    return Call(kernel, cfg, _names(format, config, out_features, in_features, layout), side, layout,
                (out_features, in_features), rotation.params(full, in_features))


def why_not_held(format: str, cfg, layout: str, device: torch.device, dtype: torch.dtype, batch: int,
                 shape: tuple[int, int], backend: Optional[str] = None) -> str:
    """Why no kernel reading the held ``layout`` serves this call (for the per-call conversion warning)."""
    held = [k for k in backends.kernels(format) if ("" if k.layout is None else k.layout.name) == layout
            and (backend is None or k.backend == backend)]
    reasons = [f"{k.backend}: {k.reject(cfg, device, dtype, batch, shape)}" for k in held]
    return "; ".join(reasons) or f"no {backend or ''} kernel reads layout {layout or 'canonical'}".replace("  ", " ")


@torch.library.custom_op("qlinear::linear", mutates_args=())
def linear(x: torch.Tensor, packed: list[torch.Tensor], bias: Optional[torch.Tensor], format: str, config: str,
           out_features: int, in_features: int, backend: str, layout: str) -> torch.Tensor:
    """``y = x Ŵᵀ + b``: ``x`` ``[..., K]`` -> ``[..., N]`` of ``x.dtype`` with the kernel the registry picks.
    ``packed`` is in kernel ``layout`` ("" = canonical); a kernel with another layout gets the buffers
    converted (a fallback, e.g. the reference kernel for large batches).
    Raises ValueError if no kernel (or not the requested ``backend``) supports the call."""
    batch = x.numel() // max(x.shape[-1], 1)
    if batch == 0:  # like nn.Linear (e.g. an MoE expert that received no tokens)
        return x.new_empty(*x.shape[:-1], out_features)
    call = resolve(format, config, out_features, in_features, layout, x.device, x.dtype, batch,
                   backends.effective_backend(backend), backends.generation())
    y = call(x, packed, bias)
    # kernels reshape their [M, N] result to x's leading dims: a view, which autograd would refuse to let the model
    # modify in place (Falcon's `mlp_output += attention_output`); aten's matmul returns such results the same way
    return y if y._base is None else torch.ops.aten._unsafe_view(y, y.shape)


@linear.register_fake
def _(x, packed, bias, format, config, out_features, in_features, backend, layout):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("qlinear::dequantize", mutates_args=())
def dequantize(packed: list[torch.Tensor], format: str, config: str, out_features: int, in_features: int,
               dtype: torch.dtype, layout: str) -> torch.Tensor:
    """Reference dequantization ``Ŵ`` ``[N, K]`` of ``dtype`` from the packed buffers held in kernel ``layout`` ("" =
    canonical).  The conversion back to the canonical buffers happens inside the op, where torch.compile does not
    trace it (its bit unpacking has data-dependent checks)."""
    cfg, bufs = _buffers(format, config, packed, out_features, in_features, layout)
    held = backends.get_layout(layout) if layout else None
    if held is not None and held.dequantize is not None and packed[0].device.type in held.dequantize_devices:
        return _dequantize_held(held, bufs, cfg, out_features, in_features).to(dtype)
    bufs = canonical(bufs, cfg, layout, out_features, in_features)
    return get_format(format).dequantize(bufs, cfg, out_features, in_features).to(dtype)


def _dequantize_held(held, bufs: dict, cfg, out_features: int, in_features: int) -> torch.Tensor:
    # the layout's Ŵ of the kernels' view, then the side buffers undone as the format's dequantize undoes them
    kcfg, side = kernel_view(cfg)
    w = held.dequantize({k: v for k, v in bufs.items() if k not in side}, kcfg, out_features, in_features)
    if "perm" in side:
        w = place_inputs(w, bufs["perm"])
    p = rotation.params(cfg, in_features)
    return w if p is None else rotation.rotate(w, *p, inverse=True)


@dequantize.register_fake
def _(packed, format, config, out_features, in_features, dtype, layout):
    return packed[0].new_empty(out_features, in_features, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, packed, bias, format, config, out_features, in_features, backend, layout = inputs
    ctx.save_for_backward(*packed)
    ctx.meta = (format, config, out_features, in_features, x.dtype, bias is not None, layout)


def _backward(ctx, grad):
    """Gradients for ``x`` (``grad @ Ŵ``) and the bias; the packed weights are frozen (QLoRA-style).  ``saved_tensors``
    is read once: activation checkpointing allows only one unpack per saved tensor."""
    format, config, out_features, in_features, dtype, has_bias, layout = ctx.meta
    packed = list(ctx.saved_tensors)
    grad_x = None
    if ctx.needs_input_grad[0]:
        w = dequantize(packed, format, config, out_features, in_features, grad.dtype, layout)
        grad_x = (grad @ w).to(dtype)
    grad_b = grad.reshape(-1, out_features).sum(0) if has_bias and ctx.needs_input_grad[2] else None
    return grad_x, [None] * len(packed), grad_b, *[None] * 6


linear.register_autograd(_backward, setup_context=_setup_context)


# Ops implemented by native backends (their bindings only register TORCH_LIBRARY_IMPL kernels) ---------
_lib = torch.library.Library("qlinear", "FRAGMENT")
_lib.define("bcq_lut_gemv(Tensor x, Tensor planes, Tensor alpha, Tensor? offset, Tensor? perm, Tensor? bias, "
            "int group_size, int kt, int threads, int tiles_per_split, int splits, Tensor? rot_sign_bits=None, "
            "int rot_block=0, Tensor? rot_paley=None) -> Tensor")


@torch.library.register_fake("qlinear::bcq_lut_gemv")
def _(x, planes, alpha, offset, perm, bias, group_size, kt, threads, tiles_per_split, splits, rot_sign_bits=None,
      rot_block=0, rot_paley=None):
    """LUT GEMV of :mod:`qlinear.backends.cuda_lut`: ``x`` ``[M, K]`` fp16/bf16 (read as ``x[:, perm]`` if given; a
    rotated layer's ``R·x`` with ``rot_block`` > 0, :func:`qlinear.backends._gpu.staged_rotation`) -> ``[M, N]``."""
    return x.new_empty(x.shape[0], planes.shape[2])
_lib.define("bcq_lut_dequantize(Tensor planes, Tensor alpha, Tensor? offset, int group_size, ScalarType dtype) -> Tensor")


@torch.library.register_fake("qlinear::bcq_lut_dequantize")
def _(planes, alpha, offset, group_size, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from the :mod:`qlinear.backends.cuda_lut` layout."""
    return planes.new_empty(planes.shape[2], planes.shape[0] * 32, dtype=dtype)
_lib.define("codebook_dequantize(Tensor codes, Tensor? book_idx, Tensor scales, Tensor codebooks, int K, int group_size, "
            "int bits, ScalarType dtype) -> Tensor")


@torch.library.register_fake("qlinear::codebook_dequantize")
def _(codes, book_idx, scales, codebooks, K, group_size, bits, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from canonical codebook buffers (:mod:`qlinear.backends.cuda_codebook`)."""
    return codes.new_empty(codes.shape[0], K, dtype=dtype)
_lib.define("codebook_gemv(Tensor x, Tensor codes, Tensor? book_idx, Tensor scales, Tensor codebooks, Tensor? bias, "
            "int group_size, int bits) -> Tensor")


@torch.library.register_fake("qlinear::codebook_gemv")
def _(x, codes, book_idx, scales, codebooks, bias, group_size, bits):
    """Codebook GEMV of :mod:`qlinear.backends.cuda_codebook`: ``x`` ``[M, K]`` fp16/bf16, ``M <= 8`` -> ``[M, N]``."""
    return x.new_empty(x.shape[0], codes.shape[0])
_lib.define("uniform_dequantize(Tensor qweight, Tensor scales, Tensor? qzeros, int K, int group_size, int bits, "
            "ScalarType dtype) -> Tensor")


@torch.library.register_fake("qlinear::uniform_dequantize")
def _(qweight, scales, qzeros, K, group_size, bits, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from the uniform BCQ storage (:mod:`qlinear.backends.cuda_uniform`)."""
    return qweight.new_empty(qweight.shape[0], K, dtype=dtype)
_lib.define("uniform_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? bias, int group_size, "
            "int bits) -> Tensor")


@torch.library.register_fake("qlinear::uniform_gemv")
def _(x, qweight, scales, qzeros, bias, group_size, bits):
    """Uniform GEMV of :mod:`qlinear.backends.cuda_uniform`: ``x`` ``[M, K]`` fp16/bf16, ``M <= 16`` -> ``[M, N]``."""
    return x.new_empty(x.shape[0], qweight.shape[0])


_lib.define("uniform_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? qzeros, Tensor? bias, int group_size, "
            "int bits, int tile_m, int tiles_per_split, int splits) -> Tensor")


@torch.library.register_fake("qlinear::uniform_gemm")
def _(x, qweight, scales, qzeros, bias, group_size, bits, tile_m, tiles_per_split, splits):
    """Uniform GEMM of :mod:`qlinear.backends.cuda_uniform`: ``x`` ``[M, K]`` fp16/bf16, ``M <= 512``, ``K`` a multiple
    of 64 -> ``[M, N]``."""
    return x.new_empty(x.shape[0], qweight.shape[0])


_lib.define("arm_gemm(Tensor x, Tensor qw, Tensor qs, Tensor? qz, Tensor? qb, Tensor? books, Tensor? bias, "
            "int format, int num_books, int N, int group_size, int path, int layout, Tensor? rot_signs=None, "
            "Tensor? rot_paley=None, int rot_block=0, Tensor? perm=None) -> Tensor")


@torch.library.register_fake("qlinear::arm_gemm")
def _(x, qw, qs, qz, qb, books, bias, format, num_books, N, group_size, path, layout, rot_signs=None, rot_paley=None,
      rot_block=0, perm=None):
    """Arm NEON/SDOT/SMMLA kernels of :mod:`qlinear.backends.arm_neon`: ``x`` ``[M, K]`` fp32 -> ``[M, N]`` fp32."""
    return x.new_empty(x.shape[0], N)
_lib.define("x86_gemm(Tensor x, Tensor qw, Tensor qs, Tensor qz, Tensor? bias, int N, int group_size, int bits, "
            "int format, int path, Tensor? rot_signs=None, Tensor? rot_paley=None, int rot_block=0, Tensor? perm=None, "
            "Tensor? qb=None) -> Tensor")


@torch.library.register_fake("qlinear::x86_gemm")
def _(x, qw, qs, qz, bias, N, group_size, bits, format, path, rot_signs=None, rot_paley=None, rot_block=0, perm=None,
      qb=None):
    """x86 AVX-512 VNNI / AVX2 kernels of :mod:`qlinear.backends.x86`: ``x`` ``[M, K]`` fp32 -> ``[M, N]`` fp32."""
    return x.new_empty(x.shape[0], N)
_lib.define("x86_dequantize(Tensor qw, Tensor qs, Tensor qz, Tensor? qb, int N, int K, int group_size, int bits, "
            "int format, ScalarType? dtype=None) -> Tensor")


@torch.library.register_fake("qlinear::x86_dequantize")
def _(qw, qs, qz, qb, N, K, group_size, bits, format, dtype=None):
    """``Ŵ`` ``[N, K]`` float32 (``dtype`` None) or bfloat16 from the :mod:`qlinear.backends.x86` layouts."""
    return qs.new_empty(N, K, dtype=dtype or torch.float32)


_lib.define("x86_mixed_gemm(Tensor x, Tensor q2, Tensor q4, Tensor sc, Tensor z, Tensor ss, Tensor sz, Tensor kinds, "
            "Tensor? ov, Tensor? oc, Tensor? orp, Tensor? bias, int N, int group_size, int scale_bits, "
            "int scale_group_size, int path, Tensor? rot_signs=None, Tensor? rot_paley=None, "
            "int rot_block=0) -> Tensor")


@torch.library.register_fake("qlinear::x86_mixed_gemm")
def _(x, q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, bias, N, group_size, scale_bits, scale_group_size, path,
      rot_signs=None, rot_paley=None, rot_block=0):
    """The mixed format's x86 GEMV (:mod:`qlinear.backends.x86`): ``x`` ``[M, K]`` fp32 -> ``[M, N]`` fp32."""
    return x.new_empty(x.shape[0], N)


_lib.define("x86_mixed_dequantize(Tensor q2, Tensor q4, Tensor sc, Tensor z, Tensor ss, Tensor sz, Tensor kinds, "
            "Tensor? ov, Tensor? oc, Tensor? orp, int N, int K, int group_size, int scale_bits, int scale_group_size, "
            "int path=0, int b0=0, int b1=-1, ScalarType? dtype=None) -> Tensor")


@torch.library.register_fake("qlinear::x86_mixed_dequantize")
def _(q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, N, K, group_size, scale_bits, scale_group_size, path=0, b0=0, b1=-1,
      dtype=None):
    """Rows ``[16·b0, min(16·b1, N))`` (``b1 < 0``: to N) of ``Ŵ`` ``[N, K]`` float32 (``dtype`` None) or bfloat16 of
    the mixed format from layout ``x86_mixed``."""
    end = N if b1 < 0 else min(16 * b1, N)
    return ss.new_empty(end - 16 * b0, K, dtype=dtype or torch.float32)


_lib.define("x86_amx_supported() -> bool")
_lib.define("x86_best_path(int format) -> int")
_lib.define("x86_amx_gemm(Tensor x, Tensor qw, Tensor qs, Tensor qz, Tensor? qb, Tensor? bias, int N, int group_size, "
            "int bits, int format) -> Tensor")
_lib.define("x86_mixed_amx_gemm(Tensor x, Tensor q2, Tensor q4, Tensor sc, Tensor z, Tensor ss, Tensor sz, "
            "Tensor kinds, Tensor? ov, Tensor? oc, Tensor? orp, Tensor? bias, int N, int group_size, int scale_bits, "
            "int scale_group_size) -> Tensor")


@torch.library.register_fake("qlinear::x86_amx_gemm")
def _(x, qw, qs, qz, qb, bias, N, group_size, bits, format):
    """``y`` ``[M, N]`` bfloat16: bfloat16 ``x`` ``[M, K]`` times Ŵ (layouts ``x86``/``x86_codebook``) on AMX tiles,
    summed in float32, + ``bias``, rounded once."""
    return x.new_empty(x.shape[0], N)


@torch.library.register_fake("qlinear::x86_mixed_amx_gemm")
def _(x, q2, q4, sc, z, ss, sz, kinds, ov, oc, orp, bias, N, group_size, scale_bits, scale_group_size):
    """``y`` ``[M, N]`` bfloat16: bfloat16 ``x`` ``[M, K]`` times Ŵ (layout ``x86_mixed``) on AMX tiles, + ``bias``."""
    return x.new_empty(x.shape[0], N)


_lib.define("x86_rotate(Tensor x, Tensor? rot_signs, Tensor? rot_paley, int rot_block, Tensor? perm=None) -> Tensor")


@torch.library.register_fake("qlinear::x86_rotate")
def _(x, rot_signs, rot_paley, rot_block, perm=None):
    """``x`` ``[M, K]`` float32 or bfloat16 transformed as ``x86_gemm`` transforms it (a rotated layer's ``R·x`` in
    float32, rounded once to x's dtype, then act_order's gather): the batched path's input."""
    return torch.empty_like(x)


_lib.define("cuda_rotate(Tensor x, Tensor rot_sign_bits, int rot_block, Tensor? rot_paley, int slice=0) -> Tensor")


@torch.library.register_fake("qlinear::cuda_rotate")
def _(x, rot_sign_bits, rot_block, rot_paley, slice=0):
    """``R·x`` of a rotated layer's input ``x`` ``[..., K]`` fp16/bf16 on a GPU, the same dtype and shape (one kernel,
    ``backends/_cuda/rotate.cu``; ``rot_*`` as the CUDA ops take them, :func:`qlinear.backends._gpu.staged_rotation`;
    ``slice``: outputs per CUDA block, a divisor of K, 0 for the kernel's plan).  Contiguous, as the kernel writes it."""
    return x.new_empty(x.shape)


_lib.define("quick_gemm(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? perm, Tensor? bias, "
            "int group_size, int tile_m, int tiles_per_split, int splits, Tensor? rot_sign_bits=None, int rot_block=0, "
            "Tensor? rot_paley=None) -> Tensor")
_lib.define("quick_dequantize(Tensor qweight, Tensor scales, Tensor? zeros, int group_size, int K, ScalarType dtype) "
            "-> Tensor")


@torch.library.register_fake("qlinear::quick_gemm")
def _(x, qweight, scales, zeros, perm, bias, group_size, tile_m, tiles_per_split, splits, rot_sign_bits=None, rot_block=0,
      rot_paley=None):
    """QUICK GEMM of :mod:`qlinear.backends.quick`: ``x`` ``[M, K]`` fp16/bf16 (read as ``x[:, perm]`` if given; a
    rotated layer's ``R·x`` with ``rot_block`` > 0, :func:`qlinear.backends._gpu.staged_rotation`) -> ``[M, N]``.  Uniform layers: ``scales`` fp16 ``[G, N]``, ``zeros`` int16 ``[G, N/4]`` (packed zero points) or
    None; free-α layers: ``scales`` the α, fp16 ``[G, Q, N]``, ``zeros`` the fp16 offsets ``[G, N]`` or None."""
    return x.new_empty(x.shape[0], qweight.shape[0] * 32)


@torch.library.register_fake("qlinear::quick_dequantize")
def _(qweight, scales, zeros, group_size, K, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from the :mod:`qlinear.backends.quick` layout."""
    return qweight.new_empty(qweight.shape[0] * 32, K, dtype=dtype)


_lib.define("mixed_dequantize(Tensor codes, Tensor meta, Tensor sq, Tensor tab, Tensor? outlier_values, "
            "Tensor? outlier_cols, Tensor? outlier_row_ptr, int N, int K, int group_size, int scale_bits, "
            "int scale_group_size, ScalarType dtype) -> Tensor")


@torch.library.register_fake("qlinear::mixed_dequantize")
def _(codes, meta, sq, tab, outlier_values, outlier_cols, outlier_row_ptr, N, K, group_size, scale_bits,
      scale_group_size, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from the :mod:`qlinear.backends.async_dequant` layout."""
    return codes.new_empty(N, K, dtype=dtype)


_lib.define("mixed_dequantize_canonical(Tensor idx4, Tensor qweight2, Tensor qweight4, Tensor zeros2, Tensor zeros4, "
            "Tensor scale_codes, Tensor scale_scale, Tensor scale_zero, Tensor? outlier_values, Tensor? outlier_cols, "
            "Tensor? outlier_row_ptr, int N, int K, int group_size, int scale_bits, int scale_group_size, "
            "ScalarType dtype) -> Tensor")


@torch.library.register_fake("qlinear::mixed_dequantize_canonical")
def _(idx4, qweight2, qweight4, zeros2, zeros4, scale_codes, scale_scale, scale_zero, outlier_values, outlier_cols,
      outlier_row_ptr, N, K, group_size, scale_bits, scale_group_size, dtype):
    """Dense ``Ŵ`` ``[N, K]`` of ``dtype`` from the canonical mixed buffers (any group size)."""
    return idx4.new_empty(N, K, dtype=dtype)


_lib.define("mixed_gemv(Tensor x, Tensor codes, Tensor meta, Tensor sq, Tensor tab, Tensor? outlier_values, "
            "Tensor? outlier_cols, Tensor? outlier_row_ptr, Tensor? bias, int N, int group_size, int scale_bits, "
            "int scale_group_size, int threads, int tiles_per_split, int splits, bool async_dequant, "
            "Tensor? rot_sign_bits=None, int rot_block=0, Tensor? rot_paley=None) -> Tensor")


@torch.library.register_fake("qlinear::mixed_gemv")
def _(x, codes, meta, sq, tab, outlier_values, outlier_cols, outlier_row_ptr, bias, N, group_size, scale_bits,
      scale_group_size, threads, tiles_per_split, splits, async_dequant, rot_sign_bits=None, rot_block=0, rot_paley=None):
    """Mixed 2/4/16 GEMV of :mod:`qlinear.backends.async_dequant`: ``x`` ``[M, K]`` fp16/bf16 (a rotated layer's
    ``R·x`` with ``rot_block`` > 0, :func:`qlinear.backends._gpu.staged_rotation`) -> ``[M, N]``."""
    return x.new_empty(x.shape[0], N)
