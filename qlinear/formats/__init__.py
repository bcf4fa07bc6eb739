"""Weight formats: pack/unpack, reference dequantization and quantizers, pure PyTorch.

``FORMATS`` maps a format name to its module (see :mod:`qlinear.formats.base` for the interface).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from . import bcq, codebook, mixed, rotation, uniform
from .base import FormatConfig, spec_bits

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (bcq, mixed, codebook)}

__all__ = ["FORMATS", "FormatConfig", "get_format", "config_from_dict", "bits_per_weight", "check_buffers", "bcq",
           "mixed", "codebook", "uniform"]


def get_format(name: str) -> ModuleType:
    """The format module for ``name`` ("bcq", "mixed", "codebook").

    Raises:
        ValueError: unknown format name.
        TypeError: a name that is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"format must be a string, one of {sorted(FORMATS)}; got {type(name).__name__}")
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; choose one of {sorted(FORMATS)}") from None


def config_from_dict(d: dict[str, Any]) -> FormatConfig:
    """Rebuild a format config from :meth:`FormatConfig.to_dict` output."""
    if "format" not in d:
        raise ValueError(f"format config dict needs a 'format' key, got keys {sorted(d)}")
    return get_format(d["format"]).Config.from_dict(d)


def bits_per_weight(cfg: FormatConfig, out_features: int, in_features: int) -> float:
    """Exact stored bits per weight of an ``out_features x in_features`` layer in format config ``cfg``:
    every packed buffer counted (codes, scales, zeros, indices, codebooks, outliers).

    Raises:
        ValueError: a shape the format cannot store.
    """
    return spec_bits(get_format(cfg.format).buffer_specs(out_features, in_features, cfg)) / (out_features * in_features)


def check_buffers(buffers: dict[str, Any], cfg: FormatConfig, out_features: int, in_features: int) -> None:
    """Check the values of a layer's canonical packed ``buffers`` (any subset of its ``buffer_specs``, shapes and
    dtypes already checked) before a layer takes them from a checkpoint: values a damaged file holds where no
    quantizer writes them.  Packed codes are valid whatever their bits, so only these are checked: every float tensor
    finite, ``perm`` (act_order) a permutation of the inputs, ``rotation`` the config's record, and the format's own
    ``check_indices`` (mixed: the 4-bit group list and the outliers' CSR).

    Raises:
        ValueError: naming the tensor.
    """
    buffers = {n: t for n, t in buffers.items() if t.device.type != "meta"}  # shapes only (an empty model)
    for name, t in buffers.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"packed tensor {name!r} holds NaN or Inf: the checkpoint is damaged")
    perm = buffers.get("perm")
    if perm is not None and not torch.equal(perm.sort().values, torch.arange(in_features, dtype=perm.dtype,
                                                                              device=perm.device)):
        raise ValueError(f"perm must be a permutation of the {in_features} inputs: the checkpoint is damaged")
    if "rotation" in buffers:
        rotation.check_record(buffers["rotation"], cfg, in_features)
    check = getattr(get_format(cfg.format), "check_indices", None)
    if check is not None:
        check(buffers, cfg, out_features, in_features)
