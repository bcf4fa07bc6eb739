"""Weight formats: pack/unpack, reference dequantization and quantizers, pure PyTorch.

``FORMATS`` maps a format name to its module (see :mod:`qlinear.formats.base` for the interface).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import bcq, codebook, mixed, uniform
from .base import FormatConfig, spec_bits

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (bcq, mixed, codebook)}

__all__ = ["FORMATS", "FormatConfig", "get_format", "config_from_dict", "bits_per_weight", "bcq", "mixed", "codebook",
           "uniform"]


def get_format(name: str) -> ModuleType:
    """The format module for ``name`` ("bcq", "mixed", "codebook").

    Raises:
        ValueError: unknown format name.
    """
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
