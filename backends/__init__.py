"""Kernel registry: each kernel declares what it supports; :func:`select` returns the best one.

Modelled on GPTQModel's kernel classes (capabilities as data, selection by priority).  A kernel is
a :class:`Kernel` record registered with :func:`register`; ``select(format, cfg, device, dtype,
batch)`` walks the kernels of that format from highest priority down and returns the first that
supports the call.  Overrides, strongest first: the ``backend`` argument (set per module or per
config), then the environment variable ``QLINEAR_BACKEND``.  The ``reference`` backend (pure
PyTorch) supports everything and is the ground truth for every other kernel.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch

from qlinear.formats.base import Layout

__all__ = ["Kernel", "Layout", "ANY", "register", "kernels", "select", "layout_for", "why_not_runnable", "get_layout",
           "generation", "effective_backend", "ENV_VAR"]

ENV_VAR = "QLINEAR_BACKEND"
_KERNELS: list["Kernel"] = []


def get_layout(name: str) -> Layout:
    """The layout called ``name``: a registered kernel's, or a format's own (an older storage, e.g.
    :data:`qlinear.formats.bcq.LEGACY`).  Raises ValueError if none has that name."""
    from qlinear.formats import FORMATS

    for layout in [k.layout for k in _KERNELS] + [lay for f in FORMATS.values() for lay in getattr(f, "LAYOUTS", ())]:
        if layout is not None and layout.name == name:
            return layout
    raise ValueError(f"no registered kernel or format has the packed layout {name!r}")


#: A capability that holds for every value (``Kernel(dtypes=ANY)``): to be written out, never assumed.
ANY = None


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


_UNSET = _Unset()
CAPABILITIES = ("devices", "dtypes", "bits", "group_sizes", "max_batch", "min_capability")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel and what it supports.

    Every field of :data:`CAPABILITIES` must be declared, so that no kernel claims a capability by leaving a field
    out (GPTQModel's ``SUPPORTS_*`` discipline): ``devices`` (device types), ``dtypes``, ``bits`` and ``group_sizes``
    as a frozenset, ``max_batch`` as an int ≥ ``min_batch`` (rows of x, all leading dims together),
    ``min_capability`` as a CUDA compute capability ``(major, minor)``; each may be :data:`ANY` instead.  TypeError
    otherwise.

    ``fn(x, buffers, bias, cfg, out_features, in_features) -> y`` computes ``y = x Wᵀ + b`` for
    ``x`` ``[..., K]`` with the packed ``buffers`` (dict of the format's buffer names, or of
    ``layout``'s buffer names when the kernel has its own layout; plus ``perm`` for an act_order layer when
    ``gathers_perm``, which then reads ``x[..., perm]`` as it loads x instead of the op gathering it first; and the
    keyword ``rotation=(seed, block)`` for a rotated layer when ``fuses_rotation``, which then applies the layer's
    randomized Hadamard to x itself, :mod:`qlinear.formats.rotation`, instead of the op transforming x first).  ``supports(cfg, N, K)`` returns
    why a config or shape cannot run (None if it can); ``available()`` returns why the kernel cannot
    run on this machine (e.g. its native extension failed to build), None if it can.
    """

    backend: str
    format: str
    fn: Callable
    priority: int = 0
    devices: Optional[frozenset] = _UNSET
    dtypes: Optional[frozenset] = _UNSET
    bits: Optional[frozenset] = _UNSET
    group_sizes: Optional[frozenset] = _UNSET
    min_capability: Optional[tuple] = _UNSET
    min_batch: int = 1
    max_batch: Optional[int] = _UNSET
    supports: Optional[Callable[..., Optional[str]]] = None
    available: Optional[Callable[[], Optional[str]]] = None
    layout: Optional[Layout] = None
    gathers_perm: bool = False  # takes an act_order layer's ``perm`` in ``buffers`` and gathers x itself
    fuses_rotation: bool = False  # takes a rotated layer's ``rotation=(seed, block)`` and transforms x itself

    def __post_init__(self) -> None:
        me = f"kernel {self.backend!r} for format {self.format!r}"
        unset = [f for f in CAPABILITIES if getattr(self, f) is _UNSET]
        if unset:
            raise TypeError(f"{me} must declare {', '.join(unset)}: a frozenset of what it supports (max_batch: an int, "
                            f"min_capability: (major, minor)), or qlinear.backends.ANY for anything")
        for f in ("devices", "dtypes", "bits", "group_sizes"):
            if getattr(self, f) is not ANY and not isinstance(getattr(self, f), frozenset):
                raise TypeError(f"{me}: {f} must be a frozenset or ANY, got {getattr(self, f)!r}")
        if not isinstance(self.min_batch, int) or self.min_batch < 1:
            raise TypeError(f"{me}: min_batch must be an int >= 1, got {self.min_batch!r}")
        if self.max_batch is not ANY and (not isinstance(self.max_batch, int) or self.max_batch < self.min_batch):
            raise TypeError(f"{me}: max_batch must be an int >= min_batch={self.min_batch} or ANY, got {self.max_batch!r}")
        cap = self.min_capability
        if cap is not ANY and not (isinstance(cap, tuple) and len(cap) == 2 and all(isinstance(c, int) for c in cap)):
            raise TypeError(f"{me}: min_capability must be a (major, minor) tuple of ints or ANY, got {cap!r}")

    def reject(self, cfg, device: torch.device, dtype: Optional[torch.dtype], batch: int,
               shape: Optional[tuple[int, int]] = None) -> Optional[str]:
        """Why this kernel cannot run the call (``dtype=None``: any dtype; ``shape`` = (N, K)), or None."""
        if self.devices is not None and device.type not in self.devices:
            return f"device {device.type} not in {sorted(self.devices)}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype} not supported"
        if self.bits is not None and cfg.bits not in self.bits:
            return f"bits={cfg.bits} not in {sorted(self.bits)}"
        if self.group_sizes is not None and cfg.group_size not in self.group_sizes:
            return f"group_size={cfg.group_size} not in {sorted(self.group_sizes)}"
        if batch < self.min_batch or (self.max_batch is not None and batch > self.max_batch):
            return f"batch {batch} outside [{self.min_batch}, {self.max_batch}]"
        if self.supports is not None and shape is not None:
            why = self.supports(cfg, *shape)
            if why is not None:
                return why
        if self.min_capability is not None and device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if torch.cuda.get_device_capability(device) < self.min_capability:
                return f"compute capability below {self.min_capability}"
        if self.available is not None:
            why = self.available()
            if why is not None:
                return f"not available: {why}"
        return None


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (replacing one with the same backend and format)."""
    global _REGISTERED
    _KERNELS[:] = [k for k in _KERNELS if (k.backend, k.format) != (kernel.backend, kernel.format)]
    _KERNELS.append(kernel)
    _KERNELS.sort(key=lambda k: -k.priority)
    _REGISTERED += 1
    return kernel


_REGISTERED = 0


def generation() -> tuple:
    """Changes whenever a kernel is registered or removed or the dispatch table is reloaded: resolved calls
    (:func:`qlinear.ops.resolve`, the modules' caches) are keyed by it."""
    return _REGISTERED, len(_KERNELS), dispatch.state()


def effective_backend(backend: Optional[str]) -> str:
    """``backend``, else the ``QLINEAR_BACKEND`` environment variable, else "" (automatic)."""
    return backend or os.environ.get(ENV_VAR) or ""


def kernels(format: Optional[str] = None) -> list[Kernel]:
    """Registered kernels, highest priority first, optionally of one format."""
    return [k for k in _KERNELS if format is None or k.format == format]


def _candidates(format: str, backend: Optional[str]) -> list[Kernel]:
    cands = kernels(format)
    if backend is not None:
        named = [k for k in cands if k.backend == backend]
        if not named:
            known = sorted({k.backend for k in _KERNELS})
            raise ValueError(f"backend {backend!r} has no kernel for format {format!r}; known backends: {known}")
        cands = named
    return cands


def _layout_name(k: Kernel) -> str:
    return "" if k.layout is None else k.layout.name


def select(format: str, cfg, device: torch.device, dtype: torch.dtype, batch: int,
           backend: Optional[str] = None, shape: Optional[tuple[int, int]] = None,
           layout: Optional[str] = None, passed_over: Optional[list[str]] = None) -> Kernel:
    """The kernel to run a ``format`` layer with config ``cfg`` and ``shape`` = (N, K) on ``batch``
    rows of ``dtype`` on ``device``, for a layer holding packed ``layout`` ("" = canonical, None = unknown).

    Without an explicit backend, a kernel named by the device's measured dispatch table
    (:mod:`qlinear.backends.dispatch`) for this shape and batch comes first, if it reads the held layout or the
    canonical one (what the tuner measured; a kernel of a third layout would repack on every call); then
    priorities decide.  ``passed_over``, if given, receives "backend: reason" for each kernel ranked before the chosen
    one that cannot run the call.

    Raises:
        ValueError: the requested backend does not exist or cannot run this call (the message says why),
            or no kernel supports the call.
    """
    backend = effective_backend(backend) or None
    reasons = []
    cands = _candidates(format, backend)
    if backend is None and shape is not None:
        pref = dispatch.preferred_backend(format, cfg, device, shape, batch)
        if pref is not None:  # stable sort: the table's choice first, the rest by priority
            cands = sorted(cands, key=lambda k: k.backend != pref or (layout is not None and k.layout is not None
                                                                      and k.layout.name != layout))
    for k in cands:
        why = k.reject(cfg, device, dtype, batch, shape)
        if why is None:
            if passed_over is not None:
                passed_over.extend(reasons)
            return k
        reasons.append(f"{k.backend}: {why}")
    raise ValueError(f"no kernel for format={format!r} bits={cfg.bits} group_size={cfg.group_size} on "
                     f"{device.type} {dtype} batch={batch}: " + "; ".join(reasons))


def why_not_runnable(format: str, cfg, device: torch.device, shape: tuple[int, int], backend: str) -> Optional[str]:
    """Why no kernel of ``backend`` can run a ``format`` layer of config ``cfg`` and ``shape`` = (N, K) on ``device``
    at any dtype and at its smallest batch, or None if one can."""
    ks = [k for k in _KERNELS if k.format == format and k.backend == backend]
    if not ks:
        return f"backend {backend!r} has no kernel for format {format!r}"
    reasons = [k.reject(cfg, device, None, k.min_batch, shape) for k in ks]
    return None if None in reasons else "; ".join(f"{k.backend}: {r}" for k, r in zip(ks, reasons))


def layout_for(format: str, cfg, device: torch.device, shape: tuple[int, int],
               backend: Optional[str] = None) -> Optional[Layout]:
    """The packed layout a ``format`` layer of ``shape`` = (N, K) should hold on ``device``: the one the
    device's measured dispatch table names for this shape if one of its kernels can run the layer, else that
    of the kernel :func:`select` picks for a single-row (decode) input of any dtype; None = canonical.

    Raises:
        ValueError: the requested backend does not exist.
    """
    backend = effective_backend(backend) or None
    cands = _candidates(format, backend)
    want = None if backend is not None else dispatch.preferred_layout(format, cfg, device, shape)
    if want is not None:  # the measured table's layout first
        cands = sorted(cands, key=lambda k: _layout_name(k) != want)
    for k in cands:
        if k.reject(cfg, device, None, 1, shape) is None:
            return k.layout
    return None


from . import dispatch  # noqa: E402
# each registers its kernels
from . import arm_neon, async_dequant, cuda_codebook, cuda_lut, cuda_uniform, quick, reference, x86  # noqa: E402,F401
