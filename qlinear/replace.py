"""``replace_linear``: swap a model's ``nn.Linear`` layers for QuantLinear modules, all or nothing."""

from __future__ import annotations

import copy
import fnmatch
import logging
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .formats import codebook
from .formats.base import quantize_device
from .modules import QuantLinear, format_config, module_class, watch_loads

logger = logging.getLogger("qlinear")

__all__ = ["replace_linear", "matches", "is_quantizable_linear"]


# nn.Linear subclasses whose forward computes nn.Linear's product by other ops (Falcon's adds the bias after the matmul,
# rounding once more): a quantized layer replaces them like nn.Linear, as bitsandbytes and GPTQModel do
_LINEAR_ALIKES = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


def is_quantizable_linear(mod: nn.Module) -> bool:
    """The layers qlinear replaces: ``nn.Linear``, a subclass that keeps ``nn.Linear.forward``, or one of the known
    subclasses whose forward is the same product (transformers' ``FalconLinear``)."""
    t = type(mod)
    return t is nn.Linear or (isinstance(mod, nn.Linear) and (
        t.forward is nn.Linear.forward or f"{t.__module__}.{t.__qualname__}" in _LINEAR_ALIKES))


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches ``pattern``: a glob (``"*.mlp.*"``) or a run of whole dotted
    components (``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``, ``"mlp"`` matches
    ``"layers.0.mlp.up_proj"``)."""
    return fnmatch.fnmatchcase(name, pattern) or f".{pattern}." in f".{name}."


def _targets(model, config, modules_to_not_convert, per_module):
    out = []
    for name, mod in model.named_modules():
        if not is_quantizable_linear(mod):
            continue
        if any(matches(name, p) for p in modules_to_not_convert):
            continue
        cfg = config
        for pat, c in per_module.items():
            if matches(name, pat):
                cfg = c
                break
        if cfg is not None:
            out.append((name, mod, cfg))
    return out


def _shared_codebooks(targets, hessians):
    """Model-scope codebooks: one clustering over the groups of every layer sharing a config."""
    books = {}
    by_cfg: dict[str, list] = {}
    for name, mod, cfg in targets:
        fc, _ = format_config(cfg.format, cfg)
        if fc.format == "codebook" and fc.codebook_scope == "model":
            by_cfg.setdefault(fc.to_json(), []).append((name, mod, fc))
    for key, items in by_cfg.items():
        gs, ds = [], []
        dev = quantize_device(items[0][1].weight)  # the clustering runs where the (first) weights are
        for name, mod, fc in items:
            h = hessians.get(name)
            g, d = codebook.layer_groups(mod.weight.detach().to(dev), fc, None if h is None else h.to(dev))
            step = max(1, g.shape[0] // 65536)  # bounded memory: at most 64k groups per layer
            gs.append(g[::step])
            ds.append(d[::step])
        shared = codebook.fit_codebooks(torch.cat(gs), torch.cat(ds), items[0][2])
        for name, _, _ in items:
            books[name] = shared
    return books


def replace_linear(model: nn.Module, config: Any, *, modules_to_not_convert: Optional[Sequence[str]] = None,
                   per_module: Optional[Mapping[str, Any]] = None, calibration_data: Any = None,
                   tokenizer=None, progress: bool = True) -> nn.Module:
    """Quantize the ``nn.Linear`` layers of ``model`` in place and return it.

    Every target is quantized first and the modules are swapped only when all succeeded, so an
    error leaves the model exactly as it was.

    Args:
        config: a :class:`qlinear.QLinearConfig` (format, bits, group size, options, backend).
        modules_to_not_convert: name patterns (see :func:`matches`) to keep in full precision;
            default ``config.modules_to_not_convert`` (``["lm_head"]``).  A transformers model's
            ``_keep_in_fp32_modules`` (e.g. T5's ``wo``) are kept too, as by transformers' quantizers.
        per_module: ``{pattern: QLinearConfig or None}``; the first matching pattern overrides
            ``config`` for that module (None keeps it unquantized).  Default ``config.per_module``; it is
            saved with the model either way.
        calibration_data: ``{name: H}`` from :func:`qlinear.calibrate`, or data for it (token-id
            tensors, or texts with ``tokenizer``).  Enables Hessian-aware quantization.  With data, the
            decoder is calibrated and quantized block by block (:func:`qlinear.calibration.sequential`:
            one block's Hessians in memory, each block calibrated on the quantized blocks before it, as
            GPTQ does); with ``{name: H}`` every layer uses the given matrix.  A rotated config
            (``rotation="hadamard"``) without it logs a warning: rotation pays only with error feedback.
        progress: show a tqdm bar.

    Raises:
        ValueError: a layer that cannot be quantized (NaN/Inf weights, shape the format cannot
            store); the message names the layer.  Hessians in ``calibration_data`` named for no module of the
            model; token ids outside the model's vocabulary.  TypeError: wrong argument types (e.g.
            ``modules_to_not_convert`` a string instead of a list).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not hasattr(config, "format_config"):
        raise TypeError(f"config must be a qlinear.QLinearConfig, got {type(config).__name__}")
    from qlinear.integrations.transformers.config import check_patterns, per_module_configs

    skip = modules_to_not_convert if modules_to_not_convert is not None \
        else getattr(config, "modules_to_not_convert", ["lm_head"])
    check_patterns(skip)
    # as transformers' quantizers (and qlinear's, on load) do: layers a model must keep in full precision (T5's wo,
    # whose forward reads wo.weight.dtype) stay float
    skip = list(skip) + [p for p in getattr(model, "_keep_in_fp32_modules", None) or () if p not in skip]
    per_module = per_module_configs(per_module if per_module is not None else getattr(config, "per_module", None))
    targets = _targets(model, config, skip, per_module)
    def quantize(name, mod, cfg, hessian, **kwargs):
        try:
            return module_class(cfg.format).from_linear(mod, cfg, hessian, **kwargs)
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer {name!r} ({mod.out_features}x{mod.in_features}): {e}") from e

    formats = [format_config(c.format, c)[0] for _, _, c in targets]
    if calibration_data is None and any(f.rotation != "none" for f in formats):
        logger.warning("rotation='hadamard' without calibration_data: on SmolLM2-135M a rotation lost quality at "
                       "every width without error feedback (RTN 3-bit g128: 5.1x -> 59x the unquantized perplexity) "
                       "and won with it (README, 'Rotation (issue 27)'); pass calibration_data")
    model_scope = any(f.format == "codebook" and f.codebook_scope == "model" for f in formats)
    hessians: Mapping[str, torch.Tensor] = {}
    if calibration_data is not None:
        if isinstance(calibration_data, Mapping):
            hessians = calibration_data
            unknown = sorted(set(hessians) - {n for n, _ in model.named_modules()})
            if unknown:
                raise ValueError(f"calibration_data has Hessians for {len(unknown)} name(s) that are no module of the "
                                 f"model, e.g. {unknown[0]!r}: use the names qlinear.calibrate(model, ...) returns")
        elif not model_scope:  # block by block, one block's Hessians at a time, quantized inputs downstream
            from .calibration import sequential

            new = sequential(model, calibration_data, tokenizer, targets, quantize, progress=progress)
            for name, q in new.items():
                parent_name, _, child = name.rpartition(".")
                q.train((model.get_submodule(parent_name) if parent_name else model).training)
            remember_config(model, config, skip, per_module, new)
            return model
        else:
            from .calibration import calibrate
            hessians = calibrate(model, calibration_data, tokenizer, modules=[n for n, _, _ in targets],
                                 progress=progress)
    books = _shared_codebooks(targets, hessians)
    new = {}
    for name, mod, cfg in tqdm(targets, desc="quantize", disable=not progress):
        new[name] = quantize(name, mod, cfg, hessians.get(name), **({"codebooks": books[name]} if name in books else {}))
    for name, q in new.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        q.train(parent.training)
        setattr(parent, child, q)
    remember_config(model, config, skip, per_module, new)
    return model


def remember_config(model, config, skip, per_module, new) -> None:
    """Put ``config`` (with ``skip`` and ``per_module``) on ``model.config.quantization_config`` after the layers
    ``new`` (name -> QuantLinear) were swapped in, so that ``save_pretrained`` writes a qlinear checkpoint (and,
    through the quantizer, the tensors' checksums) from which ``from_pretrained`` rebuilds the same modules, each
    with its own config; and make the model's ``load_state_dict`` check every quantized layer first
    (:func:`qlinear.modules.watch_loads`)."""
    if new:
        watch_loads(model)
    if hasattr(getattr(model, "config", None), "to_dict") and new:
        saved = copy.copy(config)  # calibration data and tokenizer are not part of the saved config
        saved.format_options, saved.modules_to_not_convert = dict(config.format_options), _float_only(model, skip)
        saved.per_module = dict(per_module)
        if hasattr(saved, "dataset"):
            saved.dataset = saved.tokenizer = None
        # exact names, ahead of the patterns, for a layer whose config the patterns do not give (an earlier call's,
        # an imported layer's)
        exact = {}
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                c = saved.config_for(name)
                if c is None or c.format_config().to_json() != m.config.to_json():
                    exact[name] = type(config)(**m.config.to_dict(), backend=m.backend or None)
        saved.per_module = {**exact, **saved.per_module}
        model.config.quantization_config = saved
        if hasattr(model, "save_pretrained"):
            from qlinear.integrations.transformers import QLinearHfQuantizer

            if QLinearHfQuantizer is not None:
                from qlinear.integrations.transformers.quantizer import untie_quantized

                untie_quantized(model)
                if getattr(model, "hf_quantizer", None) is None:
                    model.hf_quantizer = QLinearHfQuantizer(saved, pre_quantized=True)


def _float_only(model, skip) -> list[str]:
    """``skip`` (``modules_to_not_convert``) as saved: a pattern that also matches a quantized layer (quantized by an
    earlier call) is replaced by the names of the float layers it matches, so that loading keeps exactly those in
    float."""
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    out = []
    for p in skip:
        if not any(matches(n, p) for n in quantized):
            out.append(p)
            continue
        out += [n for n, m in model.named_modules() if is_quantizable_linear(m) and matches(n, p) and n not in out]
    return out
