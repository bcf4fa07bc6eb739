"""LoRA with PEFT on qlinear layers: QLoRA-style fine-tuning with the packed weights frozen (Dettmers et al., 2023,
"QLoRA", §3; PEFT's LoRA for bitsandbytes, HQQ and GPTQModel layers is the model followed here).

After ``import qlinear``, ``get_peft_model(model, LoraConfig(target_modules=[...] or "all-linear"))`` wraps every
targeted :class:`qlinear.QuantLinear` in a :class:`LoraQuantLinear`: ``y = layer(x) + B(A(dropout(x)))·scaling``.

Why a dispatcher added to PEFT: PEFT chooses the LoRA class of a target module from a fixed list of dispatchers in
``LoraModel._create_new_module`` (its own bitsandbytes, GPTQ, HQQ, torchao ones) and has no public registry for
other libraries; ``LoraConfig._register_custom_module`` is experimental and per config, so every user would have to
call it.  So once PEFT is imported (:func:`install`, run by the post-import hook that ``import qlinear`` sets up
with :func:`qlinear._autoload.after_import`, so qlinear never imports PEFT itself), qlinear wraps three of PEFT's
functions: the dispatch (qlinear layers first), the adapter placement (a bias-free QuantLinear has no parameter to
read the device from; its packed tensors are buffers) and ``"all-linear"`` (which only looks for ``nn.Linear``).
The packed tensors stay buffers rather than frozen parameters: optimizers, ``model.half()`` and accelerate's
parameter hooks must never see integer codes.
Tested with PEFT 0.21.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import nn

from qlinear.modules import QuantLinear

_PEFT_MODULE = "peft.tuners.lora.model"  # imported by ``import peft``; the last of the modules patched here to load
_INSTALLED = False


def __getattr__(name):
    if name == "LoraQuantLinear":
        return _lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _lora_class():
    """:class:`LoraQuantLinear`, defined on first use (it subclasses PEFT's ``lora.Linear``)."""
    from peft.tuners.lora.layer import Linear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class LoraQuantLinear(Linear):
        """PEFT's LoRA ``Linear`` around a :class:`qlinear.QuantLinear` ``base_layer`` (frozen): forward, mixed-adapter
        batches, dropout, rsLoRA and ``lora_bias`` as PEFT's; adapters in float32 on the layer's device.

        ``merge()`` (and ``merge_and_unload()``) dequantizes the layer, adds ``B·A·scaling`` and quantizes the sum
        again with the layer's config, without calibration data (as PEFT does for bitsandbytes and HQQ layers), so the
        merged layer carries a fresh rounding error; ``unmerge()`` subtracts and quantizes again, so it does not
        restore the original codes bit for bit: reload the base model for that.

        Raises:
            ValueError: a LoRA variant (DoRA, aLoRA, ...) or an ``init_lora_weights`` that reads the dense base weight
                (PiSSA, OLoRA, LoftQ, CorDA, ...): a quantized layer has none to read; plain LoRA with
                ``init_lora_weights`` True, False or "gaussian" works.  ``merge(safe_merge=True)`` with non-finite
                merged weights.
        """

        def __init__(self, base_layer, adapter_name, config, **kwargs):
            init = config.init_lora_weights
            if not (isinstance(init, bool) or init == "gaussian"):
                raise ValueError(f"init_lora_weights={init!r} reads the dense base weight, which a qlinear layer does "
                                 "not hold; use init_lora_weights=True (default), False or 'gaussian'")
            if config.fan_in_fan_out:
                warnings.warn("fan_in_fan_out=True does not apply to qlinear layers; using False", stacklevel=2)
                config.fan_in_fan_out = False
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

        def resolve_lora_variant(self, *, config, **kwargs):
            variant = super().resolve_lora_variant(config=config, **kwargs)
            if variant is not None:
                raise ValueError(f"{type(variant).__name__} is not supported on qlinear layers (it needs the dense "
                                 "base weight); use plain LoRA")
            return None

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer):
            return base_layer.packed()[0].device, None  # adapters keep their own float dtype

        def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
            names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
            if names:
                self._requantize(names, 1.0, safe_merge)
                self.merged_adapters.extend(names)

        def unmerge(self) -> None:
            if not self.merged:
                warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
                return
            self._requantize([a for a in self.merged_adapters if a in self.lora_A], -1.0, False)
            self.merged_adapters.clear()

        def _requantize(self, names: list[str], sign: float, safe: bool) -> None:
            base = self.get_base_layer()
            w = base.dequantize(torch.float32)
            bias = None if base.bias is None else base.bias.detach().float()
            for a in names:
                w = w + sign * self.get_delta_weight(a).to(w.device, torch.float32)
                if self.lora_bias[a]:
                    extra = sign * self.lora_B[a].bias.detach().to(w.device, torch.float32) * self.scaling[a]
                    bias = extra if bias is None else bias + extra
            if safe and not (torch.isfinite(w).all() and (bias is None or torch.isfinite(bias).all())):
                raise ValueError(f"NaNs detected in the merged weights. The adapters {names} seem to be broken")
            dense = nn.Linear(base.in_features, base.out_features, bias is not None, device="meta")
            dense.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                dense.bias = nn.Parameter(bias.to(base.bias.dtype if base.bias is not None else torch.float32),
                                          requires_grad=False)
            self.base_layer = type(base).from_linear(dense, base.config, backend=base.backend)

    LoraQuantLinear.__module__ = __name__
    return LoraQuantLinear


def dispatch(target: nn.Module, adapter_name: str, config, **kwargs) -> Optional[nn.Module]:
    """PEFT dispatcher: a :class:`LoraQuantLinear` for a target whose base layer is a QuantLinear, else None (PEFT's
    own dispatchers decide)."""
    base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
    if not isinstance(base, QuantLinear):
        return None
    return _lora_class()(target, adapter_name, config=config, **kwargs)


def install(module=None) -> None:
    """Add qlinear's LoRA dispatch to PEFT (idempotent; PEFT must be importable).  Called by the post-import hook
    (with the module just imported, unused), or by hand after an import of PEFT that the hook could not see."""
    global _INSTALLED
    if _INSTALLED:
        return
    from peft.tuners import tuners_utils
    from peft.tuners.lora import model as lora_model

    LoraModel = lora_model.LoraModel
    missing = [n for n in ("_create_new_module", "_replace_module") if not hasattr(LoraModel, n)]
    if missing or not hasattr(tuners_utils, "_maybe_include_all_linear_layers"):
        import peft

        warnings.warn(f"qlinear's LoRA support does not know PEFT {peft.__version__} (tested with 0.21): "
                      "get_peft_model will not wrap qlinear layers", stacklevel=2)
        return
    create, replace = LoraModel._create_new_module, LoraModel._replace_module
    all_linear = tuners_utils._maybe_include_all_linear_layers

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        custom = tuple(getattr(lora_config, "_custom_modules", None) or ())
        base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
        new = None if custom and isinstance(base, custom) else dispatch(target, adapter_name, lora_config, **kwargs)
        return new if new is not None else create(lora_config, adapter_name, target, **kwargs)

    def _replace_module(self, parent, child_name, new_module, child):
        if isinstance(new_module, _lora_class()):  # adapters already sit on the layer's device
            setattr(parent, child_name, new_module)
            return
        replace(self, parent, child_name, new_module, child)

    def _maybe_include_all_linear_layers(peft_config, model):
        wanted = getattr(peft_config, "target_modules", None)
        everything = isinstance(wanted, str) and wanted.lower() == "all-linear"
        if everything:
            wrapped = {f"{p}.{s}" for p, m in model.named_modules() if isinstance(m, tuners_utils.BaseTunerLayer)
                       for s, _ in m.named_modules() if s}
            heads = _heads(peft_config, model)  # what PEFT leaves out of all-linear: the output layer
            quant = {n for n, m in model.named_modules()
                     if isinstance(m, QuantLinear) and n not in wrapped and not any(m is h for h in heads)}
        peft_config = all_linear(peft_config, model)
        if everything:
            peft_config.target_modules = set(peft_config.target_modules) | quant
        return peft_config

    def _heads(peft_config, model) -> list:
        """The modules PEFT's all-linear leaves out (its convention): a generative model's output layer, else a
        sequence classifier's head."""
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel):
            return []
        out = model.get_output_embeddings()
        if out is not None:
            return [out]
        if getattr(peft_config, "task_type", None) == "SEQ_CLS":  # a str enum in PEFT
            return [h for name in getattr(tuners_utils, "SEQ_CLS_HEAD_NAMES", ("score", "classifier"))
                    if (h := getattr(model, name, None)) is not None][:1]
        return []

    LoraModel._create_new_module = staticmethod(_create_new_module)
    LoraModel._replace_module = _replace_module
    tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers
    _INSTALLED = True


def install_when_imported() -> None:
    """Install the PEFT support now if PEFT is imported, else right after it is."""
    from qlinear._autoload import after_import

    after_import(_PEFT_MODULE, install)
