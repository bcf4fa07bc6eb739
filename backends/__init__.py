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

__all__ = ["Kernel", "register", "kernels", "select", "ENV_VAR"]

ENV_VAR = "QLINEAR_BACKEND"
_KERNELS: list["Kernel"] = []


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel and what it supports (``None`` = anything).

    ``fn(x, buffers, bias, cfg, out_features, in_features) -> y`` computes ``y = x Wᵀ + b`` for
    ``x`` ``[..., K]`` with the packed ``buffers`` (dict of the format's buffer names).
    """

    backend: str
    format: str
    fn: Callable
    priority: int = 0
    devices: Optional[frozenset] = None
    dtypes: Optional[frozenset] = None
    bits: Optional[frozenset] = None
    group_sizes: Optional[frozenset] = None
    min_capability: Optional[tuple] = None
    min_batch: int = 1
    max_batch: Optional[int] = None
    available: Optional[Callable[[], bool]] = None

    def reject(self, cfg, device: torch.device, dtype: torch.dtype, batch: int) -> Optional[str]:
        """Why this kernel cannot run the call, or None if it can."""
        if self.devices is not None and device.type not in self.devices:
            return f"device {device.type} not in {sorted(self.devices)}"
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype} not supported"
        if self.bits is not None and cfg.bits not in self.bits:
            return f"bits={cfg.bits} not in {sorted(self.bits)}"
        if self.group_sizes is not None and cfg.group_size not in self.group_sizes:
            return f"group_size={cfg.group_size} not in {sorted(self.group_sizes)}"
        if batch < self.min_batch or (self.max_batch is not None and batch > self.max_batch):
            return f"batch {batch} outside [{self.min_batch}, {self.max_batch}]"
        if self.min_capability is not None and device.type == "cuda":
            if torch.cuda.get_device_capability(device) < self.min_capability:
                return f"compute capability below {self.min_capability}"
        if self.available is not None and not self.available():
            return "not available (native extension not built)"
        return None


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (replacing one with the same backend and format)."""
    _KERNELS[:] = [k for k in _KERNELS if (k.backend, k.format) != (kernel.backend, kernel.format)]
    _KERNELS.append(kernel)
    _KERNELS.sort(key=lambda k: -k.priority)
    return kernel


def kernels(format: Optional[str] = None) -> list[Kernel]:
    """Registered kernels, highest priority first, optionally of one format."""
    return [k for k in _KERNELS if format is None or k.format == format]


def select(format: str, cfg, device: torch.device, dtype: torch.dtype, batch: int,
           backend: Optional[str] = None) -> Kernel:
    """The kernel to run a ``format`` layer with config ``cfg`` on ``batch`` rows of ``dtype`` on ``device``.

    Raises:
        ValueError: the requested backend does not exist or cannot run this call (the message says why),
            or no kernel supports the call.
    """
    backend = backend or os.environ.get(ENV_VAR) or None
    cands = kernels(format)
    if backend is not None:
        named = [k for k in cands if k.backend == backend]
        if not named:
            known = sorted({k.backend for k in _KERNELS})
            raise ValueError(f"backend {backend!r} has no kernel for format {format!r}; known backends: {known}")
        cands = named
    reasons = []
    for k in cands:
        why = k.reject(cfg, device, dtype, batch)
        if why is None:
            return k
        reasons.append(f"{k.backend}: {why}")
    raise ValueError(f"no kernel for format={format!r} bits={cfg.bits} group_size={cfg.group_size} on "
                     f"{device.type} {dtype} batch={batch}: " + "; ".join(reasons))


from . import reference  # noqa: E402,F401  (registers the reference kernels)
