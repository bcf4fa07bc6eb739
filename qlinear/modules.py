"""Quantized ``nn.Linear`` replacements: :class:`QuantLinear` and one subclass per format.

A module owns only packed buffers (the format's ``buffer_specs``: integer codes, fp16 scales,
int8 codebooks) and an optional bias; ``forward`` calls the ``qlinear::linear`` custom op, which
asks the backend registry for a kernel by (format, device, dtype, batch).  ``.to(device)`` moves the
buffers; ``.to(dtype)`` / ``.half()`` cast only the bias, never the packed buffers, so codes and fp16
scales stay bit-exact.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from . import backends, ops
from .formats import FormatConfig, bcq, check_buffers, get_format, rotation, spec_bits
from .formats.base import FP16_MAX, quantize_device
from .formats.uniform import pack_awq, pack_gptq, unpack_awq, unpack_gptq
from .gptq import check_hessian

logger = logging.getLogger("qlinear")
_WARNED_PREFERENCES: set = set()  # (backend, device type) a configured backend could not serve, warned once

__all__ = ["QuantLinear", "BCQLinear", "MixedPrecisionLinear", "CodebookLinear", "module_class", "format_config",
           "describe"]


def format_config(format: str, config: Any = None) -> tuple[FormatConfig, Optional[str]]:
    """``(format config, backend)`` from a :class:`qlinear.QLinearConfig`, a format config, a dict of
    options or None (the format's defaults).

    Raises:
        TypeError: an unsupported config type.
        ValueError: a config for another format, or invalid options.
    """
    fmt = get_format(format)
    if config is None:
        return fmt.Config(), None
    if isinstance(config, FormatConfig):
        if config.format != format:
            raise ValueError(f"a {config.format!r} config cannot build a {format!r} layer")
        return config, None
    if hasattr(config, "format_config") and hasattr(config, "backend"):
        fc = config.format_config()
        if fc.format != format:
            raise ValueError(f"a {fc.format!r} config cannot build a {format!r} layer")
        return fc, config.backend
    if isinstance(config, dict):
        return fmt.Config.from_dict({"format": format, **config}), None
    raise TypeError(f"config must be a QLinearConfig, a {format} format config, a dict or None; got {type(config).__name__}")


def _eager(x: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether a forward may skip the ``qlinear::linear`` op: a plain tensor (no fake, functional or meta tensor), no
    compiler, tracer or autograd graph to record the op for."""
    return (type(x) is torch.Tensor and not x.is_meta and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing()
            and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))))


class QuantLinear(nn.Module):
    """Base of the quantized linear layers: ``y = x Ŵᵀ + b`` with ``Ŵ`` ``[out_features, in_features]``
    stored in the packed layout of format :attr:`format`.

    Args:
        in_features: K.  out_features: N.  bias: whether to hold a bias ``[N]``.
        config: QLinearConfig, format config, dict of format options, or None (defaults).
        backend: kernel backend override (e.g. "reference"); None picks automatically.
        device, dtype: of the empty buffers / the bias (packed buffers keep their own dtypes).

    Raises:
        ValueError: a layer shape the format cannot store (the message says which constraint).
    """

    format: ClassVar[str] = ""
    #: whether ``state_dict()`` includes the packed buffers (False only while a loader fills them itself,
    #: e.g. :func:`qlinear.tensor_parallel.load_shards`)
    packed_in_state_dict: bool = True
    _warned_conversion: bool = False  # set once this layer has warned about per-call layout conversions
    _placed_on: Optional[torch.device] = None  # the device repack_for_device last chose the layout for

    def __init__(self, in_features: int, out_features: int, bias: bool = True, config: Any = None, *,
                 backend: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (in_features, out_features)):
            raise TypeError(f"in_features and out_features must be positive ints, got {in_features!r}, "
                            f"{out_features!r}")
        cfg, cfg_backend = format_config(self.format, config)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.config = cfg
        self._backend, self._calls = backend or cfg_backend, {}
        # a config's backend (e.g. saved in a checkpoint) is a preference: used on devices where it can run
        self._preferred_backend = None if backend else cfg_backend
        self._config_json = cfg.to_json()
        self._specs = get_format(self.format).buffer_specs(out_features, in_features, cfg)
        for name, (shape, dt) in self._specs.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device))
        if cfg.rotation != "none" and self.rotation.device.type != "meta":  # known from the config alone
            self.rotation.copy_(rotation.record(cfg, self.in_features)["rotation"])
        self._packed_names = tuple(self._specs)
        self._layout: Optional[backends.Layout] = None
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.float32),
                                 requires_grad=False) if bias else None
        self.repack_for_device()

    # construction -------------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Any = None, hessian: Optional[torch.Tensor] = None, *,
                    backend: Optional[str] = None, **quantize_kwargs) -> "QuantLinear":
        """Quantize ``linear`` (weight ``[N, K]``, any float dtype) into a new module on its device.

        Args:
            hessian: optional ``[K, K]`` XᵀX of calibration inputs (see :func:`qlinear.calibrate`).
            quantize_kwargs: passed to the format's ``quantize`` (e.g. ``codebooks=`` for shared codebooks).

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` or its weight is not floating point.
            ValueError: NaN/Inf weights, a shape the format cannot store, a wrong Hessian.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        cfg, cfg_backend = format_config(cls.format, config)
        buffers = cls.quantize_weight(w, cfg, hessian, **quantize_kwargs)
        return cls.from_packed(buffers, w.shape[1], w.shape[0], config if cfg_backend else cfg, linear.bias,
                               backend=backend, device=w.device)

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: Any = None, hessian: Optional[torch.Tensor] = None,
                        **quantize_kwargs) -> dict[str, torch.Tensor]:
        """The canonical packed buffers (the format's ``buffer_specs``) of ``weight`` ``[N, K]`` (any float dtype and
        device) quantized with ``config`` (as for the constructor): what :meth:`from_linear` holds, without building a
        layer (the quantize-on-load path hands these straight to transformers).

        The quantizer runs in float32 (float64 where the format says so) on the weight's device when it is a CPU or
        a CUDA device, else on the CPU (e.g. MPS has no float64); the buffers are returned on that device.  CUDA and
        CPU results differ only by float rounding order: on the test layers of ``tests/test_quantize_device.py``
        ≥ 99% of the dequantized weights are equal and the reconstruction error ‖W − Ŵ‖ is within 1%.

        Raises:
            TypeError: a weight that is not floating point.
            ValueError: NaN/Inf weights, weights beyond fp16's range, a meta weight, a shape the format cannot store,
                a wrong Hessian.
        """
        w = weight
        if not w.is_floating_point():
            raise TypeError(f"weight must be floating point, got {w.dtype}")
        if w.device.type == "meta":
            raise ValueError("cannot quantize a weight on the meta device; load the weights first")
        if not torch.isfinite(w).all():
            raise ValueError("weight contains NaN or Inf values")
        peak = float(w.detach().abs().max()) if w.numel() else 0.0
        if peak > FP16_MAX:
            raise ValueError(f"weight magnitudes up to {peak:.4g} exceed fp16's range ({FP16_MAX:g}), which the "
                             f"formats' scales are stored in; scale the layer (and its input) first")
        if hessian is not None:
            check_hessian(hessian, w.shape[1])
        cfg = format_config(cls.format, config)[0]
        cfg.check_shape(*w.shape)
        device = quantize_device(w)
        return get_format(cls.format).quantize(w.detach().to(device, torch.float32), cfg,
                                               None if hessian is None else hessian.detach().to(device),
                                               **quantize_kwargs)

    @classmethod
    def from_packed(cls, buffers: dict[str, torch.Tensor], in_features: int, out_features: int, config: Any,
                    bias: Optional[torch.Tensor] = None, *, backend: Optional[str] = None, device=None) -> "QuantLinear":
        """A layer holding ``buffers`` (canonical names, shapes and dtypes of ``config``'s ``buffer_specs``) and a
        copy of ``bias`` ``[N]``, on ``device`` (default: the buffers' device).

        Raises:
            ValueError: buffers that do not match the config's specs (names, shapes, dtypes, values), a bias that is
                not ``[N]`` or not finite.
            TypeError: a bias that is not a floating point tensor.
        """
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
                raise TypeError(f"bias must be a floating point tensor, got "
                                f"{bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__}")
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"bias must be [{out_features}] (out_features), got {list(bias.shape)}")
            if not bool(torch.isfinite(bias).all()):
                raise ValueError(f"bias has {int((~torch.isfinite(bias)).sum())} non-finite values (inf or NaN)")
        if not buffers:
            raise ValueError("no packed buffers given: from_packed takes the format's buffers (buffer_specs), e.g. "
                             "another layer's canonical()")
        device = torch.device(device) if device is not None else next(iter(buffers.values())).device
        mod = cls(in_features, out_features, bias is not None, config, backend=backend, device="meta")
        mod.load_packed({k: v.to(device) for k, v in buffers.items()})  # repacked once, for the final device
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return mod.to(device)

    def load_packed(self, buffers: dict[str, torch.Tensor]) -> None:
        """Set the packed buffers from ``buffers`` (names, shapes and dtypes must match exactly).

        Raises:
            ValueError: a missing/unexpected name, a shape or dtype mismatch, or values no quantizer writes
                (:func:`qlinear.formats.check_buffers`: NaN/Inf, a perm that is not a permutation, bad indices).
        """
        if set(buffers) != set(self._specs):
            raise ValueError(f"packed buffers {sorted(buffers)} do not match {sorted(self._specs)}")
        for name, (shape, dtype) in self._specs.items():
            new = buffers[name]
            if tuple(new.shape) != tuple(shape) or new.dtype != dtype:
                raise ValueError(f"buffer {name!r}: expected {dtype} {list(shape)}, got {new.dtype} "
                                 f"{list(new.shape)}")
        check_buffers(buffers, self.config, self.out_features, self.in_features)
        self._set_packed({n: buffers[n] for n in self._specs}, None)
        self.repack_for_device()

    def adopt(self, other: "QuantLinear") -> None:
        """Take over ``other``'s shape, config and packed buffers in place, keeping this module object, its
        bias and any hooks on it (used where the object itself is referenced elsewhere, e.g. by the forward
        wrappers transformers' tensor-parallel styles install).

        Raises:
            TypeError: ``other`` is a layer of another class.
        """
        if type(other) is not type(self):
            raise TypeError(f"a {type(self).__name__} cannot adopt a {type(other).__name__}")
        for name in self._packed_names:
            self._buffers.pop(name, None)
        self.in_features, self.out_features = other.in_features, other.out_features
        self.config, self._config_json, self._specs = other.config, other._config_json, other._specs
        self._set_packed({n: other._buffers[n] for n in other._packed_names}, other._layout)

    @property
    def buffer_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of the canonical packed buffers (what checkpoints hold; the format's
        ``buffer_specs`` for this layer's shape and config)."""
        return dict(self._specs)

    # kernel resolution ---------------------------------------------------------------------------
    @property
    def backend(self) -> Optional[str]:
        """Kernel backend override ("reference", "cuda_lut", ...) or None (automatic); setting it resolves anew and
        repacks the buffers into the layout the new choice reads (as ``.to()`` does).

        Set here (or as the ``backend`` argument) it is a requirement: a call it cannot serve raises ValueError.  The
        backend of a config (``QLinearConfig(backend=...)``, also as saved with a checkpoint) is a preference instead:
        on a device where none of its kernels can run the layer, the layer warns once and chooses automatically."""
        return self._backend

    @backend.setter
    def backend(self, value: Optional[str]) -> None:
        self._backend = value
        self._preferred_backend = None
        self._calls = {}
        known = value is None or any(k.backend == value for k in backends.kernels(self.format))
        if known and not self.offloaded():  # an unknown name raises on the first call, saying which names exist
            self.repack_for_device()

    def _apply_preference(self, device: torch.device) -> None:
        """Use the config's preferred backend on ``device`` if one of its kernels can run this layer there."""
        pref = self._preferred_backend
        if pref is None:
            return
        why = backends.why_not_runnable(self.format, ops.kernel_view(self.config)[0], device,
                                        (self.out_features, self.in_features), pref)
        if why is not None and (pref, device.type) not in _WARNED_PREFERENCES:
            _WARNED_PREFERENCES.add((pref, device.type))
            warnings.warn(f"the configured backend {pref!r} cannot run {self._describe()} on {device.type} ({why}): "
                          f"qlinear chooses kernels automatically there (set QuantLinear.backend to insist)",
                          stacklevel=3)
        backend = None if why is not None else pref
        if backend != self._backend:
            self._backend, self._calls = backend, {}

    def _call(self, device: torch.device, dtype: torch.dtype, batch: int) -> ops.Call:
        key = (device, dtype, batch, backends.generation())
        return self._calls.get(key) or self._resolve(key)

    def _resolve(self, key: tuple) -> ops.Call:
        """The :class:`qlinear.ops.Call` for ``key`` = (device, dtype, batch, registry generation), cached on the
        layer (cleared by ``.to()``, state-dict loads, repacks and backend changes); logs the choice, and warns once
        per layer when the kernel needs the buffers converted on every call."""
        device, dtype, batch, gen = key
        if self._placed_on != self._buffers[self._packed_names[0]].device and not self.offloaded():
            # buffers set from outside (accelerate's load_checkpoint_and_dispatch): take this device's layout once
            self.repack_for_device()
        call = ops.resolve(self.format, self._config_json, self.out_features, self.in_features, self.layout, device,
                           dtype, batch, backends.effective_backend(self.backend), gen)
        if len(self._calls) >= 64:  # many distinct prompt lengths: start over rather than grow
            self._calls.clear()
        self._calls[key] = call
        logger.info("%s: %s %s batch %d -> kernel %s, layout %s", self._describe(), device, dtype, batch,
                    call.kernel.backend, self.layout or "canonical")
        if call.converts and not self._warned_conversion and not self.offloaded():  # offloaded: expected
            self._warned_conversion = True
            why = ops.why_not_held(self.format, call.cfg, self.layout, device, dtype, batch, call.shape, self.backend)
            warnings.warn(f"{self._describe()} holds layout {self.layout or 'canonical'} but kernel "
                          f"{call.kernel.backend} serves {device.type} {dtype} batch {batch}: its buffers are "
                          f"converted on every such call ({why})", stacklevel=3)
        return call

    def _describe(self) -> str:
        return f"{type(self).__name__}({self.in_features}->{self.out_features}, {self.format} {self.config.bits}-bit)"

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_calls"] = {}  # resolved calls hold kernel functions: resolve again after unpickling
        return state

    def __setstate__(self, state):
        if "backend" in state and "_backend" not in state:  # pickled before backend became a property
            state["_backend"] = state.pop("backend")
        state.setdefault("_calls", {})
        state.setdefault("_preferred_backend", None)
        super().__setstate__(state)
        specs = get_format(self.format).buffer_specs(self.out_features, self.in_features, self.config)
        if self._layout is None and set(self._specs) != set(specs):  # pickled in an older storage: convert it
            self._specs = specs
            saved = self.saved_layout(self._packed_names)
            if saved is None:
                raise ValueError(f"{self._describe()} was pickled with buffers {list(self._packed_names)}, which are "
                                 f"neither the storage of this qlinear version nor an older one it can convert")
            held = {n: self._buffers[n] for n in self._packed_names}
            self._set_packed(ops.canonical(held, self.config, saved.name, self.out_features, self.in_features), None)

    # kernel layouts -----------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        """Name of the kernel layout the packed buffers are in on this device ("" = the format's canonical one)."""
        return "" if self._layout is None else self._layout.name

    def canonical(self) -> dict[str, torch.Tensor]:
        """The packed buffers in the format's canonical layout (what checkpoints hold), by name; empty meta tensors of
        their shapes for a layer on the meta device (a layout's conversion reads values)."""
        bufs = {n: self._buffers[n] for n in self._packed_names}
        if self.layout and any(t.device.type == "meta" for t in bufs.values()):
            return {n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt) in self._specs.items()}
        return ops.canonical(bufs, self.config, self.layout, self.out_features, self.in_features)

    def _set_packed(self, buffers: dict[str, torch.Tensor], layout) -> None:
        for name in self._packed_names:
            self._buffers.pop(name, None)
        self._buffers.update(buffers)
        self._packed_names, self._layout = tuple(buffers), layout
        self._calls = {}

    def repack_for_device(self) -> None:
        """Hold the packed buffers in the layout of the kernel that serves single-row inputs on their device
        (:func:`qlinear.backends.layout_for`): repacked once here, not per call.  Runs on every ``.to()``,
        load and state-dict load; call it after assigning packed buffers by hand.  A layer whose data the
        kernel's layout cannot hold stays canonical (with a warning) and runs on the fallback kernel."""
        devices = {self._buffers[n].device for n in self._packed_names}
        if len(devices) != 1:  # mid-load (some buffers still on meta): wait until all have landed
            return
        device = devices.pop()
        if device.type == "meta":  # nothing to convert yet (an empty module, or one waiting for a loader)
            return
        for n in self._packed_names:  # views set from outside (from_packed, load_state_dict(assign=True)): kernels
            if not self._buffers[n].is_contiguous():  # and layouts read dense memory
                self._buffers[n] = self._buffers[n].contiguous()
        if "rotation" in self._buffers:  # loaded from outside: refuse a checkpoint rotated otherwise than the config
            rotation.check_record(self._buffers["rotation"], self.config, self.in_features)
        self._placed_on = device
        self._apply_preference(device)
        want = backends.layout_for(self.format, ops.kernel_view(self.config)[0], device,
                                   (self.out_features, self.in_features), self.backend)
        if want is not self._layout:
            bufs = self.canonical()
            if want is not None:
                try:
                    bufs = ops.to_layout(bufs, self.config, want, self.out_features, self.in_features)
                except ValueError as e:  # data the kernel cannot hold (e.g. α not uniform): stay canonical
                    warnings.warn(f"{type(self).__name__} {self.out_features}x{self.in_features} keeps the canonical "
                                  f"layout instead of {want.name}: {e}", stacklevel=2)
                    want = None
            self._set_packed(bufs, want)

    # device/dtype moves keep the packed dtypes ----------------------------------------------------
    def _apply(self, fn, recurse=True):
        record = self._buffers.get("rotation")
        # the (seed, block) record follows from the config: an empty layer's (meta) is written, not left to fn (which
        # to_empty makes uninitialised memory); one that disagrees with the config stays, for repack_for_device to
        # refuse
        derived = record is not None and (record.device.type == "meta" or
                                          tuple(record.tolist()) == rotation.params(self.config, self.in_features))
        for name in self._packed_names:
            buf = self._buffers.get(name)
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        packed = {n: self._buffers.pop(n) for n in self._packed_names if n in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(packed)
        if derived:
            self._buffers["rotation"] = torch.tensor(rotation.params(self.config, self.in_features), dtype=torch.int32,
                                                     device=self._buffers["rotation"].device)
        self.repack_for_device()
        return self

    # checkpoints hold the canonical layout; older storages are converted on load --------------------------------
    def saved_layout(self, names) -> Optional[backends.Layout]:
        """The format's older storage (e.g. :data:`qlinear.formats.bcq.LEGACY`) that a checkpoint holding the packed
        tensor ``names`` (of this layer, without prefix) was saved in, or None (the canonical storage, or unknown
        names)."""
        names = set(names)
        if set(self._specs) <= names:
            return None
        for layout in getattr(get_format(self.format), "LAYOUTS", ()):
            specs = self._saved_specs(layout)
            if specs is not None and set(specs) <= names:
                return layout
        return None

    def _saved_specs(self, layout) -> Optional[dict]:
        specs = layout.saved_specs(self.out_features, self.in_features, self.config)
        if specs is None:
            return None
        side = ops.kernel_view(self.config)[1]
        return {**specs, **{n: self._specs[n] for n in side}}

    def held_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` a loader fills: the canonical specs, or those of the older storage the layer
        holds while loading it (:meth:`hold_saved_layout`)."""
        if self._layout is not None and self._layout.saved_specs is not None:
            return self._saved_specs(self._layout)
        return dict(self._specs)

    def hold_saved_layout(self, layout) -> None:
        """Hold empty meta buffers of the older storage ``layout`` (see :meth:`saved_layout`) for a loader that fills
        buffers by name (transformers); the first move to a device (or :meth:`repack_for_device`) converts them to
        the canonical storage, exactly.  ``state_dict()`` lists them under their own names meanwhile.

        Raises:
            ValueError: ``layout`` is not an older storage of this layer's format and config.
        """
        specs = None if layout.saved_specs is None else self._saved_specs(layout)
        if specs is None:
            raise ValueError(f"{layout.name} is not an older storage of {self._describe()}")
        self._set_packed({n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt) in specs.items()}, layout)

    def release_packed(self) -> dict[str, torch.Tensor]:
        """Hand the packed tensors over to an offloader and hold empty meta buffers of the canonical specs instead.

        Returns the canonical buffers by name (converted from the held kernel layout).  For accelerate's offload
        hooks, which load the tensors before each call and drop them after it; the layer then keeps the canonical
        layout (see :meth:`offloaded`).
        """
        bufs = self.canonical()
        self._set_packed({n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in bufs.items()}, None)
        self._placed_on = None
        return bufs

    def offloaded(self) -> bool:
        """Whether an accelerate hook holds this layer's packed tensors elsewhere (CPU or disk) and brings them in for
        each call (``AlignDevicesHook`` with ``offload`` and ``offload_buffers``).  Such a layer stays in the
        canonical layout: its tensors are replaced on every call, so a kernel layout would be rebuilt each time."""
        hook = getattr(self, "_hf_hook", None)
        return any(getattr(h, "offload", False) and getattr(h, "offload_buffers", False)
                   for h in getattr(hook, "hooks", (hook,)))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        holds_saved = self._layout is not None and self._layout.saved_specs is not None
        held = {n: self._buffers[n] for n in self._packed_names}
        for name, t in ((held if holds_saved else self.canonical()) if self.packed_in_state_dict else {}).items():
            destination[prefix + name] = t if keep_vars else t.detach()
        packed = {n: self._buffers.pop(n) for n in self._packed_names}
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._buffers.update(packed)

    def _check_entries(self, state_dict, prefix: str) -> None:
        """ValueError unless this layer's canonical entries in ``state_dict`` (those present) have its specs' shapes
        and dtypes and values :func:`qlinear.formats.check_buffers` accepts; nothing is changed."""
        for name, (shape, dtype) in self._specs.items():
            t = state_dict.get(prefix + name)
            if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != dtype):
                raise ValueError(f"checkpoint tensor {prefix + name} is {t.dtype} {list(t.shape)} but this "
                                 f"{type(self).__name__} ({self.config.to_json()}) expects {dtype} "
                                 f"{list(shape)}: the checkpoint was saved with another config or shape")
        try:
            check_buffers({n: state_dict[prefix + n] for n in self._specs if prefix + n in state_dict}, self.config,
                          self.out_features, self.in_features)
        except ValueError as e:
            raise ValueError(f"{prefix.rstrip('.') or type(self).__name__}: {e}") from None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        saved = self.saved_layout(k[len(prefix):] for k in state_dict if k.startswith(prefix))
        if saved is not None:  # an older storage: checked against its own specs, converted to the canonical one
            bufs = {}
            for name, (shape, dtype) in self._saved_specs(saved).items():
                t = state_dict.pop(prefix + name)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"checkpoint tensor {prefix + name} is {t.dtype} {list(t.shape)} but this "
                                     f"{type(self).__name__} ({self.config.to_json()}) saved as {saved.name} has "
                                     f"{dtype} {list(shape)}: the checkpoint was saved with another config or shape")
                bufs[name] = t
            state_dict.update({prefix + n: t for n, t in ops.canonical(bufs, self.config, saved.name, self.out_features,
                                                                      self.in_features).items()})
        self._check_entries(state_dict, prefix)
        if self._layout is not None:  # load into canonical buffers; those the state dict replaces are not converted
            device = self._buffers[self._packed_names[0]].device
            if all(prefix + n in state_dict for n in self._specs):
                self._set_packed({n: torch.empty(shape, dtype=dt, device=device) for n, (shape, dt) in
                                  self._specs.items()}, None)
            else:
                self._set_packed(self.canonical(), None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.repack_for_device()

    # compute ------------------------------------------------------------------------------------
    def packed(self) -> list[torch.Tensor]:
        """The packed buffers as held (``buffer_specs`` order, or the kernel layout's; the op's ``packed``)."""
        return [self._buffers[n] for n in self._packed_names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` float32/float16/bfloat16 -> ``[..., out_features]`` of ``x.dtype``.

        Raises:
            TypeError: non-floating input.  ValueError: last dimension is not ``in_features``.
        """
        self._check_input(x)
        if _eager(x, self.bias):  # plain eager inference: the layer's cached call, no op dispatch or registry walk
            batch = x.numel() // self.in_features
            if batch == 0:
                return x.new_empty(*x.shape[:-1], self.out_features)
            return self._call(x.device, x.dtype, batch)(x, self.packed(), self.bias)
        return ops.linear(x, self.packed(), self.bias, self.format, self._config_json, self.out_features,
                          self.in_features, self.backend or "", self.layout)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense ``Ŵ`` ``[out_features, in_features]`` of ``dtype`` (reference dequantization).

        Raises:
            TypeError: ``dtype`` is not a floating point torch dtype.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        return ops.dequantize(self.packed(), self.format, self._config_json, self.out_features, self.in_features,
                              dtype, self.layout)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{type(self).__name__} input must be float32, float16 or bfloat16, got {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__} expects input [..., {self.in_features}], got {list(x.shape)}")

    def kernel(self, x: torch.Tensor) -> backends.Kernel:
        """The kernel that runs input ``x`` (resolved as ``forward`` resolves it; an empty batch: that of one row).

        Raises:
            TypeError, ValueError: an input ``forward`` refuses.  ValueError: no kernel (or not the requested backend)
            supports ``x``; the message says why.
        """
        self._check_input(x)
        return self._call(x.device, x.dtype, max(1, x.numel() // self.in_features)).kernel

    @property
    def bits_per_weight(self) -> float:
        """Exact stored bits per weight of the canonical storage (what checkpoints hold, the same on every device):
        every packed buffer counted (codes, scales, zeros, indices, codebooks, outliers), the bias not."""
        return spec_bits(self._specs) / (self.in_features * self.out_features)

    @property
    def layout_bits_per_weight(self) -> float:
        """Bits per weight of the buffers as held in memory now: the kernel layout's (e.g. BCQ's α derived from a
        uniform layer's scales for the LUT GEMV), or :attr:`bits_per_weight` when the layer holds the canonical
        storage."""
        return spec_bits({n: (tuple(b.shape), b.dtype) for n, b in zip(self._packed_names, self.packed())}) / (
            self.in_features * self.out_features)

    def memory_footprint(self) -> int:
        """Bytes held by the module: packed buffers plus bias."""
        n = sum(b.numel() * b.element_size() for b in self.packed())
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        group = getattr(self.config, "group_size", None)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}, bits={self.config.bits}, group_size={group}, "
                f"bits_per_weight={self.bits_per_weight:.3f}, backend={self.backend or 'auto'}")


class BCQLinear(QuantLinear):
    """Binary-coding quantized linear layer (:mod:`qlinear.formats.bcq`; LUT-GEMM / nuQmm)."""

    format = "bcq"

    @classmethod
    def from_uniform(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, bits: int,
                     group_size: int, g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                     backend: Optional[str] = None) -> "BCQLinear":
        """Exact layer from uniform integer weights ``scales·(codes − zeros)`` (GPTQ/AWQ convention), held in BCQ's
        uniform storage (codes, fp16 scale, packed zero point per group).

        Args:
            codes: ``[N, K]`` integers in ``[0, 2**bits)`` (unpacked ``qweight``).
            scales: ``[N, G]`` fp16 values (fp16 or fp32 tensor).  zeros: ``[N, G]`` integer zero points (unpacked ``qzeros``).
            g_idx: optional ``[K]`` int group of each input (GPTQ act_order).
            bias: optional ``[N]``.

        Raises:
            ValueError: inconsistent shapes, codes or zero points out of range, scales that are not fp16 values.
        """
        cfg, buffers = bcq.from_uniform(codes, scales, zeros, bits, group_size, g_idx)
        return cls.from_packed(buffers, codes.shape[1], codes.shape[0], cfg, bias, backend=backend, device=codes.device)

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int,
                  group_size: int, g_idx: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                  checkpoint_format: str = "gptq", backend: Optional[str] = None) -> "BCQLinear":
        """Exact BCQ layer from GPTQ checkpoint tensors (``qweight`` int32 ``[K·bits/32, N]``, ``qzeros``
        int32 ``[G, N·bits/32]``, ``scales`` fp16 ``[G, N]``, optional ``g_idx`` ``[K]``); see
        :func:`qlinear.formats.uniform.unpack_gptq` for ``checkpoint_format``.

        Raises:
            ValueError: unsupported bits or inconsistent shapes.
        """
        if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
            raise TypeError(f"qweight must be a 2-D int32 tensor [K·bits/32, N], got "
                            f"{type(qweight).__name__ if not isinstance(qweight, torch.Tensor) else list(qweight.shape)}")
        if bits not in (2, 3, 4, 8):
            raise ValueError(f"GPTQ checkpoints hold 2, 3, 4 or 8-bit codes, got bits={bits!r}")
        K = qweight.shape[0] * 32 // bits
        codes, zeros = unpack_gptq(qweight, qzeros, bits, K, checkpoint_format, dtype=torch.uint8)
        return cls.from_uniform(codes, scales.T, zeros, bits=bits, group_size=group_size, g_idx=g_idx, bias=bias,
                                backend=backend)

    def to_gptq(self, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
        """This layer as GPTQ checkpoint tensors (AutoGPTQ / GPTQModel layout, the inverse of :meth:`from_gptq`):
        ``qweight`` int32 ``[K·bits/32, N]``, ``qzeros`` int32 ``[G, ceil(N·bits/32)]``, ``scales`` fp16
        ``[G, N]``, ``g_idx`` int32 ``[K]`` (``k // group_size`` unless act_order), plus the fp16 ``bias`` if any.

        Raises:
            ValueError: the layer's α are not uniform (only GPTQ / round-to-nearest / imported layers have
                int codes), bits not in (2, 3, 4, 8), offsets that are not integer zero points, a rotated layer, or
                a bias beyond fp16's range.
        """
        codes, scales, zeros, g_idx = self._uniform_export("GPTQ", (2, 3, 4, 8))
        qweight, qzeros = pack_gptq(codes, zeros, self.config.bits, checkpoint_format)
        if g_idx is None:
            g_idx = (torch.arange(self.in_features) // self.config.group(self.in_features)).to(torch.int32)
        out = {"qweight": qweight, "qzeros": qzeros, "scales": scales.T.contiguous().half(), "g_idx": g_idx}
        if self.bias is not None:
            out["bias"] = self._fp16_bias("GPTQ")
        return out

    def _fp16_bias(self, engine: str) -> torch.Tensor:
        """The bias in fp16, as ``engine``'s checkpoints and kernels hold it; ValueError if fp16 cannot hold it."""
        bias = self.bias.detach().cpu().half()
        if not bool(torch.isfinite(bias).all()):
            raise ValueError(f"{engine} checkpoints store the bias in fp16, which cannot hold this layer's (largest "
                             f"|bias| {float(self.bias.detach().abs().max()):g}, fp16's largest 65504)")
        return bias

    def _uniform_export(self, engine: str, bits: tuple[int, ...]):
        """``bcq.to_uniform`` of this layer on the CPU, after refusing bits ``engine``'s checkpoints do not hold and a
        rotated layer."""
        if self.config.bits not in bits:
            raise ValueError(f"{engine} checkpoints hold {'/'.join(map(str, bits))}-bit codes, this layer has "
                             f"{self.config.bits}")
        if self.config.rotation != "none":
            raise ValueError(f"a rotated layer (rotation='hadamard') has no {engine} checkpoint form: {engine} kernels "
                             "do not rotate their input; quantize without rotation to export")
        return bcq.to_uniform({k: v.cpu() for k, v in self.canonical().items()}, self.config, self.out_features,
                              self.in_features)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, in_features: int,
                 out_features: int, group_size: int, version: str = "gemm", bias: Optional[torch.Tensor] = None,
                 backend: Optional[str] = None) -> "BCQLinear":
        """Exact 4-bit BCQ layer from AutoAWQ checkpoint tensors (Lin et al. 2023; AutoAWQ's ``WQLinear_GEMM`` /
        ``WQLinear_GEMV`` layouts, see :func:`qlinear.formats.uniform.pack_awq`): the same weights
        ``scales·(codes − zeros)``, held in BCQ's uniform storage.

        Args:
            qweight, qzeros: int32 in the ``version`` layout.  scales: fp16 in that layout.
            in_features, out_features: K and N.  group_size: inputs per group, -1 for one group.
            version: "gemm" or "gemv".
            bias: optional ``[N]``.

        Raises:
            ValueError: an unknown version or tensors whose shapes do not fit K, N and ``group_size``.
        """
        codes, zeros, s = unpack_awq(qweight, qzeros, scales, in_features, out_features, group_size, version,
                                     dtype=torch.uint8)
        return cls.from_uniform(codes, s, zeros, bits=4, group_size=group_size, bias=bias, backend=backend)

    def to_awq(self, version: str = "gemm") -> dict[str, torch.Tensor]:
        """This layer as AutoAWQ checkpoint tensors (the inverse of :meth:`from_awq`): ``qweight``, ``qzeros``,
        ``scales`` in the ``version`` layout, plus fp16 ``bias`` if any.

        Raises:
            ValueError: not 4 bits, non-uniform α, an act_order or rotated layer (AWQ holds neither a ``g_idx`` nor
                a transform), a shape the layout cannot pack, or a bias beyond fp16's range.
        """
        codes, scales, zeros, g_idx = self._uniform_export("AWQ", (4,))
        if g_idx is not None:
            raise ValueError("an act_order layer (a g_idx, stored reordered) has no AWQ checkpoint form: AWQ groups "
                             "are contiguous; export it with save_gptq, or quantize with act_order=False")
        qweight, qzeros, s = pack_awq(codes, zeros, scales, self.config.group_size, version)
        out = {"qweight": qweight, "qzeros": qzeros, "scales": s}
        if self.bias is not None:
            out["bias"] = self._fp16_bias("AWQ")
        return out


class MixedPrecisionLinear(QuantLinear):
    """2/4-bit intra-matrix mixed precision with fp16 sparse outliers (:mod:`qlinear.formats.mixed`)."""

    format = "mixed"


class CodebookLinear(QuantLinear):
    """Group-wise int8 codebook layer (:mod:`qlinear.formats.codebook`; Arm fine-grained codebooks)."""

    format = "codebook"


_CLASSES = {c.format: c for c in (BCQLinear, MixedPrecisionLinear, CodebookLinear)}


def _check_quantized_entries(model, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook on a model holding quantized layers: every layer's entries are checked
    (:meth:`QuantLinear._check_entries`) before torch copies anything into any module, so that a state dict one of
    whose layers is wrong raises with the model as it was (torch loads module by module)."""
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            at = f"{prefix}{name}." if name else prefix
            if mod.saved_layout(k[len(at):] for k in state_dict if k.startswith(at)) is None:  # older: at its load
                mod._check_entries(state_dict, at)


def watch_loads(model: nn.Module) -> nn.Module:
    """Make ``model.load_state_dict`` check every quantized layer's entries before loading any (idempotent; done by
    :func:`qlinear.replace_linear`, ``from_pretrained`` and the GPTQ/AWQ loaders).  Returns ``model``."""
    if not getattr(model, "_qlinear_watches_loads", False):
        model.register_load_state_dict_pre_hook(_check_quantized_entries)
        model._qlinear_watches_loads = True
    return model


def module_class(format: str) -> type[QuantLinear]:
    """The QuantLinear subclass of ``format``.  Raises ValueError for an unknown format."""
    get_format(format)
    return _CLASSES[format]


def describe(model: nn.Module, batch: int = 1, dtype: Optional[torch.dtype] = None) -> str:
    """A Markdown table of ``model``'s quantized layers: name, class, ``in -> out``, format and bits, stored bits per
    weight, the layout held, the kernel that serves ``batch`` rows of ``dtype`` (default: float16 on CUDA, float32
    elsewhere) on the layer's device, or why none does, and why the kernels ranked before it were passed over.  Like
    ``QLINEAR_BACKEND``, a layer's ``backend`` override is honoured.
    """
    rows = ["| layer | class | in -> out | format | bits/weight | layout (bits/weight) | kernel | passed over |",
            "|---|---|---|---|---|---|---|---|"]
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        device = m.packed()[0].device
        dt = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
        passed: list[str] = []
        try:
            kernel = m._call(device, dt, batch).kernel.backend
            backends.select(m.format, ops.kernel_view(m.config)[0], device, dt, batch,
                            backends.effective_backend(m.backend) or None, (m.out_features, m.in_features), m.layout,
                            passed_over=passed)
        except ValueError as e:
            kernel = f"none: {e}"
        rows.append(f"| {name} | {type(m).__name__} | {m.in_features} -> {m.out_features} | {m.format} "
                    f"{m.config.bits}-bit | {m.bits_per_weight:.3f} | {m.layout or 'canonical'} "
                    f"({m.layout_bits_per_weight:.3f}) | {kernel} | {'; '.join(passed) or '-'} |")
    return "\n".join(rows)
