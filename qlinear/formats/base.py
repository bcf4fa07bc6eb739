"""What every weight format shares: the config base class, group slicing and the format table.

A format is a module exposing ``Config`` (a frozen dataclass deriving :class:`FormatConfig`),
``buffer_specs(out_features, in_features, cfg)``, ``quantize(weight, cfg, hessian=None)``,
``dequantize(buffers, cfg, out_features, in_features)`` (both wrapped by :func:`qlinear.formats.rotation.rotates` /
``unrotates``, which handle a rotated config for every format), ``kernel_view(cfg)`` (the config kernels see and the side
buffers the op applies, e.g. BCQ's act_order ``perm``), optionally ``slice_rows`` / ``slice_inputs`` (tensor
parallelism), ``LAYOUTS`` (older storages a checkpoint may hold) and ``check_indices`` (its index tensors' values,
for :func:`qlinear.formats.check_buffers`), and its column quantizer for the
error-feedback engine (:mod:`qlinear.gptq`).
Packed buffer shapes depend only on ``(out_features, in_features, cfg)``, so an empty module can
be built before a checkpoint is loaded into it, and ``bits_per_weight`` is exact by construction:
it counts every stored bit of every buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable, ClassVar, Optional

import torch

from . import rotation

BufferSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A packed layout other than the format's canonical one: a kernel's own (derived once at load from the
    canonical buffers), or an older storage of the format that checkpoints may still hold (converted on load).

    ``repack(buffers, cfg, N, K) -> dict`` and its exact inverse ``unrepack`` map between the
    canonical buffers (:func:`qlinear.formats.get_format` ``.buffer_specs``) and the kernel's buffers.
    A module on a device where this layout's kernel is the one :func:`layout_for` picks holds only the
    repacked buffers (no second copy); checkpoints always hold the canonical ones.  ``saved_specs(N, K, cfg)``
    (older storages only) gives the buffer specs such a checkpoint holds, or None for configs it does not apply to.
    ``dequantize(buffers, cfg, N, K) -> Ŵ`` float32 ``[N, K]`` (optional): the format's ``dequantize`` of the
    unrepacked buffers, value for value, computed from the layout directly (the backward pass's weight); ``cfg`` is
    the kernels' view (:func:`qlinear.ops.kernel_view`), so act_order's ``perm`` and a rotation are not its business;
    ``dequantize_devices``: the device types it runs on (buffers held elsewhere, e.g. by CPU tests standing a spec
    kernel in for a GPU kernel, are unrepacked and take the format's dequantize).
    """

    name: str
    names: Callable  # cfg -> tuple of the repacked buffer names, in the order the module holds them
    repack: Callable
    unrepack: Callable
    saved_specs: Optional[Callable] = None
    dequantize: Optional[Callable] = None
    dequantize_devices: frozenset = frozenset()

    def __reduce__(self):
        # its functions (often lambdas) do not pickle: a pickled module (torch.save(model)) finds it again by name
        from qlinear.backends import get_layout

        return get_layout, (self.name,)


@dataclasses.dataclass(frozen=True)
class FormatConfig:
    """Base of the per-format configs: validated on construction, JSON round trip.

    Keyword-only options every format shares (incoherence processing, :mod:`qlinear.formats.rotation`; QuIP# §3,
    QuaRot §3): ``rotation`` "none" (default) or "hadamard" (quantize ``W·Rᵀ`` for a randomized Hadamard ``R`` and
    apply ``R`` to the input at run time), ``rotation_seed`` in ``[0, 2^31)`` (the random signs), ``rotation_block``
    (0: the largest Hadamard order dividing each layer's in_features; else that block size for every layer).

    Raises:
        ValueError: a field outside its documented range.
        TypeError: a field of the wrong type.
    """

    format: ClassVar[str] = ""
    bits: int = 4
    group_size: int = 64
    rotation: str = dataclasses.field(default="none", kw_only=True)
    rotation_seed: int = dataclasses.field(default=0, kw_only=True)
    rotation_block: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{type(self).__name__}.{f.name} must be an int, got {v!r}")
            if f.type in ("float", float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a number, got {v!r}")
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a bool, got {v!r}")
        rotation.validate(self)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for out-of-range fields (overridden per format)."""

    def to_dict(self) -> dict[str, Any]:
        """All fields plus ``"format"``; :meth:`from_dict` inverts it."""
        return {"format": self.format, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FormatConfig":
        """Build and validate from a dict; ValueError for another format or unknown keys."""
        d = dict(d)
        fmt = d.pop("format", cls.format)
        if fmt != cls.format:
            raise ValueError(f"{cls.__name__} expects format={cls.format!r}, got {fmt!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown options for format {cls.format!r}: {unknown}; valid: {sorted(names)}")
        return cls(**d)

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Raise ValueError if a layer of this shape cannot be stored in this format."""
        if out_features < 1 or in_features < 1:
            raise ValueError(f"empty layer {out_features}x{in_features}")
        rotation.params(self, in_features)  # a rotation block must fit in_features


def group_bounds(in_features: int, group_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the input groups; the last one may be shorter (ragged)."""
    return [(s, min(s + group_size, in_features)) for s in range(0, in_features, group_size)]


def check_input_split(out_features: int, in_features: int, cfg: FormatConfig, start: int, end: int) -> None:
    """ValueError unless input positions ``[start, end)`` of an ``out_features x in_features`` layer of config ``cfg``
    (groups of ``cfg.group_size``, -1: the whole row) start and end on group boundaries (a tensor-parallel shard), and
    the layer is not rotated (a shard would need the signs of its own input positions: not supported yet)."""
    if cfg.rotation != "none":
        raise ValueError(f"a rotated layer ({out_features}x{in_features}, rotation={cfg.rotation!r}) cannot be split "
                         f"along its inputs (row-parallel); quantize the row-parallel layers with rotation='none' "
                         f"(per_module)")
    g = in_features if cfg.group_size == -1 else cfg.group_size
    if start % g or (end % g and end != in_features):
        raise ValueError(f"input shard [{start}, {end}) of a {out_features}x{in_features} layer splits a quantization "
                         f"group of {g}: the shard size must be a multiple of the group size")


def num_groups(in_features: int, group_size: int) -> int:
    """Number of input groups, the last one possibly shorter."""
    return math.ceil(in_features / group_size)


def expand_groups(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Repeat a per-group tensor ``[..., G]`` to per-input ``[..., in_features]``."""
    return t.repeat_interleave(group_size, dim=-1)[..., :in_features]


def spec_bits(specs: BufferSpecs) -> int:
    """Total stored bits of a set of buffers."""
    return sum(math.prod(shape) * (torch.finfo(dt).bits if dt.is_floating_point else torch.iinfo(dt).bits)
               for shape, dt in specs.values())


FP16_TINY = 2.0 ** -24  # smallest positive fp16 (subnormal): the floor of every stored scale
FP16_MAX = 65504.0  # largest fp16: the formats' scales and levels are fp16 values
# floor of uniform-grid scales: s/2 (BCQ's α_1 = s·2^-1) stays a normal fp16 value, so uniform α are exact
UNIFORM_MIN_SCALE = 2.0 ** -13


def importance(hessian: torch.Tensor | None, in_features: int) -> torch.Tensor:
    """Per-input importance ``[K]`` float32 for weighted fits: diag(H) (never exactly zero), or ones."""
    if hessian is None:
        return torch.ones(in_features)
    d = torch.diagonal(hessian).float().clamp(min=0)
    return d + 1e-6 * d.mean() + 1e-12


def group_lookup(levels: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Each weight's value from its (row, group)'s levels: ``levels`` float ``[N, G, L]``, ``codes`` uint8 ``[N, G, g]``
    (values < L) -> ``levels[n, g, codes[n, g, j]]`` ``[N, G, g]``.  One gather over a flat int32 index (int64 for
    layers of 2^31 levels or more): the dequantization paths' replacement of per-weight arithmetic."""
    N, G, L = levels.shape
    dtype = torch.int32 if N * G * L < 2 ** 31 else torch.int64
    base = (torch.arange(N * G, device=codes.device, dtype=dtype) * L).view(N, G, 1)
    index = codes.to(dtype).add_(base).reshape(-1)
    return levels.reshape(-1).index_select(0, index).view(codes.shape)


def quantize_device(weight: torch.Tensor) -> torch.device:
    """Where the quantizers run for ``weight``: its device if a CPU or a CUDA device, else the CPU (the fits need
    float64, which e.g. MPS lacks)."""
    return weight.device if weight.device.type in ("cpu", "cuda") else torch.device("cpu")


def on_weight_device(quantizer: Callable) -> Callable:
    """Decorator: run ``quantizer(weight, ...)`` on the weight's device.

    Its tensor arguments (Hessian, fixed codebooks, ...) are moved to that device, and torch's default device is set
    to it while the quantizer runs (``with torch.device(...)``), so the tensors it allocates without naming a device
    (``torch.zeros``, ``arange``, ``eye``...) land beside the weight.  The context is skipped when that device is
    already the default: it costs a Python dispatch on every torch call."""

    @functools.wraps(quantizer)
    def run(weight, *args, **kwargs):
        dev = weight.device
        move = lambda a: a.to(dev) if isinstance(a, torch.Tensor) else a
        args, kwargs = [move(a) for a in args], {k: move(v) for k, v in kwargs.items()}
        if torch.get_default_device() == dev:
            return quantizer(weight, *args, **kwargs)
        with torch.device(dev):
            return quantizer(weight, *args, **kwargs)

    return run


def place_inputs(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``W`` ``[N, K]`` in input order from its stored columns ``w`` ``[N, K]``, stored position ``j`` being input
    ``perm[j]`` (int ``[K]``; an act_order layer, GPTQ's ``g_idx`` order)."""
    out = torch.empty_like(w)
    out[:, perm.long()] = w
    return out


def fp16_round(t: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest fp16 (saturating), returned as float32."""
    return t.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).to(torch.float32)
