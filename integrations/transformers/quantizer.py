"""The ``quant_method="qlinear"`` transformers quantizer (transformers 5.x ``HfQuantizer`` API).

Registered, together with :class:`QLinearConfig`, when qlinear is imported.

* Quantize on load: ``from_pretrained(path, quantization_config=QLinearConfig(...))`` of a float
  checkpoint.  ``_process_model_before_weight_loading`` swaps every plain ``nn.Linear`` of the meta
  model (except ``modules_to_not_convert``, transformers' default skips such as a tied or output
  ``lm_head``, and ``_keep_in_fp32_modules``) for the empty :class:`qlinear.QuantLinear` of the
  format, plus a meta ``weight`` placeholder so the checkpoint's float weight is routed to
  :class:`QLinearQuantize`.  That op quantizes it with ``QuantLinear.quantize_weight`` (the code path of
  :func:`qlinear.replace_linear`, so both give bit-identical layers), drops the placeholder and
  returns the canonical packed buffers, which transformers then copies into the module (repacked for a kernel
  layout once, after loading).
  ``codebook_scope="model"`` needs every layer at once, so for it the float model is loaded and
  :func:`qlinear.replace_linear` runs after loading (higher peak memory).
* Pre-quantized load: a checkpoint whose ``config.json`` has ``quant_method="qlinear"``.  The
  same empty modules are built (no placeholder), plus those of the layers transformers' default skips would keep
  in float but the checkpoint stores packed (its headers and saved layer list decide: an output layer quantized by
  ``replace_linear(modules_to_not_convert=[])`` or GPTQModel's ``lm_head=True``; a tied one is dropped from the
  model's tied weights), and transformers copies the checkpoint tensors
  into their persistent buffers with their own dtypes (int32 codes, fp16 scales, int8 codebooks,
  int16 indices), whatever ``dtype=`` asks for the rest of the model.  Every packed tensor's
  presence, shape and dtype is checked against the config from the safetensors headers (a ``.bin`` file's
  ``torch.load`` onto the meta device) before any weight is read, so a checkpoint that does not match its config
  raises a ``ValueError`` naming the tensor instead of transformers' generic size-mismatch ``RuntimeError``.
* Integrity: ``save_pretrained`` writes the CRC-32 of every tensor of the state dict (packed tensors and the float
  ones: embeddings, norms, layers kept in float) into the safetensors metadata (``qlinear_crc32``: a JSON map from
  state-dict key to 8 hex digits), their dtypes (``qlinear_dtypes``, since 2026-11-29) and each layer's format config
  (``qlinear_configs``).  A pre-quantized load reads every tensor of the files that has a sum once before transformers
  does (those transformers renamed or merged on saving have none), and raises a ``ValueError`` naming it when its CRC
  or dtype differs, when no file holds it (transformers would initialise it at random; a tied weight, saved once,
  counts as held where a file holds any name the model ties it to) or when a packed float tensor (scales, α, codebooks, outliers) holds
  NaN/Inf: damaged bytes never load as wrong weights.  After loading, every layer's
  packed values are checked too (:func:`qlinear.formats.check_buffers`: NaN/Inf, act_order's permutation, the
  mixed format's indices), which is all a ``.bin`` checkpoint (no metadata) gets, with a warning.  A layer whose config from ``config.json`` differs from the
  saved one, or whose checkpoint holds tensors that config does not (an edited ``act_order``, ``rotation`` or
  ``offset``), raises too: equal shapes do not mean equal weights.  Checkpoints
  saved before checksums existed load with a one-line warning (finiteness still checked).  CRC-32 (zlib, ~1.3 GB/s
  here) rather than a cryptographic hash: it guards against damage, not tampering.
"""

from __future__ import annotations

import copy
import json
import mmap
import warnings
import zlib
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from safetensors import SafetensorError
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                         register_quantization_config, register_quantizer)
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module

from qlinear.formats import check_buffers
from qlinear.modules import QuantLinear, module_class, watch_loads
from qlinear.replace import is_quantizable_linear, matches

from .config import QUANT_METHOD, QLinearConfig

__all__ = ["QLinearHfQuantizer", "QLinearQuantize", "init_empty_quantized", "register", "untie_quantized"]

_ST_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
              torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
              torch.bool: "BOOL"}
# safetensors float dtype -> (unsigned integer of its width, exponent mask)
_ST_EXPONENTS = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000),
                 "F64": (np.uint64, 0x7FF0000000000000)}
_MAX_LISTED = 8
CHECKSUM_KEY = "qlinear_crc32"  # safetensors metadata entries written by save_pretrained
CONFIGS_KEY = "qlinear_configs"
DTYPES_KEY = "qlinear_dtypes"  # each summed tensor's safetensors dtype, since 2026-11-29


def crc32(t: torch.Tensor) -> str:
    """CRC-32 (zlib) of a tensor's bytes in row-major order, as 8 hex digits."""
    return f"{zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()):08x}"


def _with_bias(mod: QuantLinear, names) -> list[str]:
    """``names`` and, if the layer has one, ``"bias"``: the tensors of a quantized layer the checksums cover."""
    return [*names, "bias"] if mod.bias is not None else list(names)


def _has_placeholder(mod: nn.Module) -> bool:
    return isinstance(mod, QuantLinear) and mod._parameters.get("weight") is not None


def _listing(items: list[str]) -> str:
    shown = "\n  ".join(items[:_MAX_LISTED])
    more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"\n  {shown}{more}"


class _ModuleKeys:
    """The model's state-dict names as ``rename_source_key`` looks them up (``.get``) to add or strip the base-model
    prefix, before the layers are swapped: a Linear layer's packed tensors count as its own names."""

    def __init__(self, model: nn.Module):
        self.state = model.state_dict()
        self.linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}

    def get(self, key: str, default=None):
        if key in self.state:
            return self.state[key]
        return True if key.rpartition(".")[0] in self.linears else default


def untie_quantized(model: nn.Module) -> None:
    """Drop from transformers' tied-weight maps (``all_tied_weights_keys``: ``{target: source}`` parameter names, on
    each ``PreTrainedModel`` of ``model``) every pair with a side in a quantized layer, e.g. ``lm_head.weight`` of a
    tied model whose ``lm_head`` is quantized: that layer has no ``weight`` to tie, and transformers' loading (which
    ties from this map) would fail on it.  A model left with no tied pair gets ``config.tie_word_embeddings = False``,
    so that ``tie_weights()`` and the saved config agree (a model with other tied pairs, e.g. T5's embeddings, keeps
    its flag)."""
    for _, sub in model.named_modules():
        tied = getattr(sub, "all_tied_weights_keys", None)
        if not isinstance(tied, dict) or not tied:
            continue
        for target, source in list(tied.items()):
            for param in (target, source):
                try:
                    owner = sub.get_submodule(param.rpartition(".")[0])
                except AttributeError:
                    continue
                if isinstance(owner, QuantLinear):
                    del tied[target]
                    break
        if not tied and getattr(sub.config, "tie_word_embeddings", False):
            sub.config.tie_word_embeddings = False


def _guard_init(model: nn.Module) -> None:
    """Let transformers initialize the weights a checkpoint lacks around quantized layers.  Its ``initialize_weights``
    calls the model's ``_init_weights`` on every module not fully loaded, and some (T5, Mamba, ...) reach into a child
    Linear's ``.weight``, which a :class:`QuantLinear` does not have: during that call each one shows a meta ``weight``
    flagged as initialized, which transformers' init functions skip.  Undone by :func:`_unguard_init`."""
    original = model.initialize_weights

    def initialize_weights():
        shown = [m for m in model.modules() if isinstance(m, QuantLinear) and "weight" not in m._parameters]
        for m in shown:
            m.__dict__["weight"] = w = torch.empty(m.out_features, m.in_features, device="meta")
            w._is_hf_initialized = True
        try:
            return original()
        finally:
            for m in shown:
                m.__dict__.pop("weight", None)

    initialize_weights._qlinear_guard = True
    model.initialize_weights = initialize_weights


def _unguard_init(model: nn.Module) -> None:
    if getattr(model.__dict__.get("initialize_weights"), "_qlinear_guard", False):
        del model.__dict__["initialize_weights"]


class QLinearQuantize(ConversionOps):
    """Quantize-on-load op: ``{"<layer>.weight": float weight}`` -> the layer's packed buffers.

    Entries that are not the weight of a :class:`QuantLinear` waiting for one (placeholder) pass
    through unchanged.
    """

    def __init__(self, hf_quantizer: "QLinearHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model: Optional[nn.Module] = None,
                full_layer_name: Optional[str] = None, missing_keys: Optional[set] = None,
                **kwargs) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in input_dict.items():
            module_name, _, tensor_name = key.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            if tensor_name != "weight" or not _has_placeholder(module):
                out[key] = value
                continue
            weight = value[0] if isinstance(value, (list, tuple)) else value
            expected = (module.out_features, module.in_features)
            try:  # canonical buffers straight from the quantizer: the layer repacks them once, after loading
                if tuple(weight.shape) != expected:
                    raise ValueError(f"checkpoint weight {key} is {list(weight.shape)}, expected {list(expected)}")
                config = self.hf_quantizer.quantization_config.config_for(module_name, *self.hf_quantizer._aliases(module_name))
                packed = type(module).quantize_weight(weight, config)
            except (ValueError, TypeError) as e:
                # transformers would turn it into a generic RuntimeError after loading; the quantizer raises it
                # as it is once loading ends (_process_model_after_weight_loading)
                self.hf_quantizer.load_errors.append(
                    type(e)(f"layer {module_name!r} ({module.out_features}x{module.in_features}): {e}"))
                continue
            del module._parameters["weight"]
            if missing_keys is not None:
                missing_keys.discard(key)
            for name, t in packed.items():
                out[f"{module_name}.{name}"] = t.to(weight.device)
        return out


class QLinearHfQuantizer(HfQuantizer):
    """transformers quantizer of ``quant_method="qlinear"`` (see the module docstring)."""

    requires_calibration = False
    quantization_config: QLinearConfig

    def __init__(self, quantization_config: QLinearConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.modules_to_not_convert: list[str] = []
        self._quantize_after_loading = False
        self._tp_sharded = False
        self._checkpoint_index: dict[str, dict[str, tuple[str, str]]] = {}  # module -> tensor -> (file, key)
        self._checkpoint: Optional[tuple] = None  # checkpoint headers: (tensors, checksums, layer configs)
        self._saved_dtypes: dict[str, str] = {}  # key as saved -> its safetensors dtype (checkpoints since 2026-11-29)
        self._safetensors = True  # whether every checkpoint file is safetensors (else .bin: no offsets, no metadata)
        self._keep_fp32: list[str] = []  # the model's _keep_in_fp32_modules
        self._prefix = ""  # the base_model_prefix when a base model loads
        self._saved_layers: set[str] = set()  # the layers the checkpoint's metadata lists as quantized
        self._tp_specs: Optional[dict] = None  # layers load_shards sliced before loading
        self.load_errors: list[Exception] = []  # ValueError/TypeError of quantize-on-load, raised after loading

    # capabilities ---------------------------------------------------------------------------------
    def is_serializable(self, *args, **kwargs) -> bool:
        if self._tp_sharded:  # each rank holds plain local slices, which transformers' save would not gather
            warnings.warn("qlinear cannot save a model loaded tensor-parallel: each rank holds only its slice of the "
                          "packed tensors; save from a single-process load instead", stacklevel=2)
            return False
        return True

    def get_state_dict_and_metadata(self, model):
        """The state dict ``save_pretrained`` writes and, in the safetensors metadata, the :func:`crc32` of each of
        its tensors (those of offloaded layers, still on the meta device here, go without), their dtypes
        (``qlinear_dtypes``: a retyped tensor keeps its bytes, hence its CRC) and each layer's format config
        (``qlinear_configs``: a JSON list of ``[config, [layer names]]``)."""
        state_dict = model.state_dict()
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
        sums, seen, dtypes = {}, {}, {}
        for k, t in state_dict.items():
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                same = (t.data_ptr(), t.shape, t.stride(), t.dtype)  # a tied weight: summed once
                sums[k] = seen[same] = seen[same] if same in seen else crc32(t)
                dtypes[k] = _ST_DTYPES.get(t.dtype, str(t.dtype))
        configs: dict[str, list[str]] = {}
        for n, m in layers:
            configs.setdefault(m.config.to_json(), []).append(n)
        return state_dict, {CHECKSUM_KEY: json.dumps(sums, sort_keys=True),
                            DTYPES_KEY: json.dumps(dtypes, sort_keys=True),
                            CONFIGS_KEY: json.dumps([[json.loads(c), names] for c, names in configs.items()])}

    def _dequantize(self, model, dtype=None):
        """transformers' ``model.dequantize(dtype)`` (as for bitsandbytes and HQQ): every :class:`QuantLinear` back to
        an ``nn.Linear`` holding its ``Ŵ`` (``QuantLinear.dequantize``, the weights the layer computes with, in the
        input basis for rotated or act_order layers) in ``dtype`` (default: the layer's bias dtype, else float32), on
        the layer's device; its bias and train/eval mode kept.  Lossy only as the quantization was."""
        for name, mod in list(model.named_modules()):
            if isinstance(mod, QuantLinear):
                dt = dtype or (mod.bias.dtype if mod.bias is not None else torch.float32)
                dense = nn.Linear(mod.in_features, mod.out_features, mod.bias is not None, device="meta")
                dense.weight = nn.Parameter(mod.dequantize(torch.float32).to(dt), requires_grad=False)
                if mod.bias is not None:
                    dense.bias = nn.Parameter(mod.bias.detach().to(dt), requires_grad=False)
                dense.train(mod.training)
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, dense)
        return model

    @property
    def is_trainable(self) -> bool:
        # adapters train (qlinear.integrations.peft); the packed weights are buffers and stay frozen
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # forward is one torch.library custom op per layer with a fake implementation: no graph break
        return True

    def validate_environment(self, *args, **kwargs):
        if not isinstance(self.quantization_config, QLinearConfig):
            raise TypeError(f"quant_method='qlinear' needs a qlinear.QLinearConfig, got "
                            f"{type(self.quantization_config).__name__}")
        self.quantization_config.format_config()  # raises on an invalid (e.g. hand-edited) config

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        try:
            module, tensor_name = get_module_from_name(model, param_name)
        except AttributeError:
            return False
        return tensor_name == "weight" and _has_placeholder(module)

    def param_element_size(self, model, param_name: str, param: torch.Tensor) -> float:
        # the float placeholder is dropped on quantization; the packed buffers are counted on their own
        if self.param_needs_quantization(model, param_name):
            return 0.0
        return super().param_element_size(model, param_name, param)

    def get_quantize_ops(self) -> QLinearQuantize:
        return QLinearQuantize(self)

    # module selection ----------------------------------------------------------------------------
    def _aliases(self, name: str) -> tuple[str, ...]:
        """Module ``name`` as the full model names it, when a base model loads (a checkpoint's exact names, written by
        ``remember_config``, carry the ``base_model_prefix``)."""
        return (f"{self._prefix}.{name}",) if self._prefix else ()

    def _skipped_by_config(self, name: str) -> bool:
        return any(matches(n, p) for p in self.quantization_config.modules_to_not_convert
                   for n in (name, *self._aliases(name)))

    def _skip(self, name: str) -> bool:
        if self._skipped_by_config(name):
            return True
        if not should_convert_module(name, self._keep_fp32):  # the model's forward may read their .weight (T5's wo)
            return True
        # transformers' other default skips hold for float checkpoints; a saved one that stores the layer packed (an
        # output layer quantized by replace_linear(modules_to_not_convert=[]) or GPTQModel's lm_head=True) decides
        return not should_convert_module(name, self.modules_to_not_convert) and not self._stored_packed(name)

    def _stored_packed(self, name: str) -> bool:
        """Whether the (pre-quantized, safetensors) checkpoint stores layer ``name`` quantized: packed tensors and no
        float weight, or named among its quantized layers by the saved metadata (then missing tensors raise)."""
        tensors = set(self._checkpoint_index.get(name, ()))
        return "weight" not in tensors and (bool(tensors - {"bias"}) or name in self._saved_layers)

    def _targets(self, model) -> list[tuple[str, nn.Linear, QLinearConfig]]:
        """``(name, float layer, its config)`` of every layer to quantize (``per_module`` applied)."""
        found = [(name, mod, self.quantization_config.config_for(name, *self._aliases(name)))
                 for name, mod in model.named_modules()
                 if name and is_quantizable_linear(mod) and not self._skip(name)]
        return [t for t in found if t[2] is not None]

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self._keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or ())
        base = getattr(model, "base_model_prefix", "")
        self._prefix = base if base and getattr(model, "base_model", None) is model else ""
        # transformers' defaults (tied weights, output embeddings, last module) + keep_in_fp32; the
        # config's own patterns use qlinear's glob/dotted-name matching (see _skip)
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, [], self._keep_fp32 or None, add_default_skips=True)
        if self.pre_quantized and checkpoint_files:
            self._read_checkpoint(model, checkpoint_files)
        targets = self._targets(model)
        model_scope = any(c.format_config().format == "codebook" and c.format_config().codebook_scope == "model"
                          for _, _, c in targets)
        qc = self.quantization_config
        self._quantize_after_loading = not self.pre_quantized and (
            model_scope or qc.dataset is not None or qc.finetune_steps > 0)
        kept = [] if self.pre_quantized or qc.modules_to_not_convert == ["lm_head"] else [
            name for name, mod in model.named_modules() if name and is_quantizable_linear(mod) and self._skip(name)
            and not self._skipped_by_config(name) and should_convert_module(name, self._keep_fp32)
            and qc.config_for(name, *self._aliases(name)) is not None]
        if kept:  # the user changed the skips: say which layers transformers' defaults still keep
            warnings.warn(f"qlinear keeps {len(kept)} layer(s) in full precision that modules_to_not_convert does not "
                          f"name: quantize-on-load applies transformers' default skips (output embeddings, tied "
                          f"weights, the last module):{_listing(kept)}\nTo quantize them, load the float model and call "
                          f"qlinear.replace_linear(model, config) with the same modules_to_not_convert", stacklevel=2)
        if not targets:
            warnings.warn(f"qlinear found no nn.Linear layer to quantize in {type(model).__name__} (layers such as "
                          f"GPT-2's Conv1D are not nn.Linear, and modules_to_not_convert / tied or output "
                          f"embeddings are skipped): the model stays in full precision", stacklevel=2)
        if self._quantize_after_loading:
            return model  # codebooks shared, calibration, distillation: every layer first, replace_linear after
        new = {}
        for name, mod, cfg in targets:  # every layer built before any is swapped: an error changes nothing
            try:
                q = module_class(cfg.format)(mod.in_features, mod.out_features, mod.bias is not None, cfg,
                                             device="meta", dtype=mod.weight.dtype if mod.bias is None else mod.bias.dtype)
            except ValueError as e:
                raise ValueError(f"layer {name!r} ({mod.out_features}x{mod.in_features}) cannot be stored in "
                                 f"format {cfg.format!r}: {e}; add it to modules_to_not_convert") from e
            if not self.pre_quantized:
                q.weight = nn.Parameter(torch.empty_like(mod.weight, device="meta"), requires_grad=False)
            q.train(mod.training)
            q._hf_quantized_needs_local_tp = True  # transformers' TP styles then hand it local tensors
            new[name] = q
        swapped = []
        for name, q in new.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swapped.append((parent, child, getattr(parent, child)))
            setattr(parent, child, q)
        if self._checkpoint is not None:
            try:
                self._check_checkpoint(model)
            except BaseException:  # the model as it was (init_empty_quantized hands it back to the user)
                for parent, child, old in swapped:
                    setattr(parent, child, old)
                raise
        untie_quantized(model)
        if new:
            _guard_init(model)
        return model

    def update_parallel_plan(self, model, plan: dict[str, str]):
        """Tensor-parallel loading (``distributed_config=DistributedConfig(tp_size=W)``, or ``tp_plan="auto"``):
        the plan keeps transformers' own "colwise"/"rowwise" styles, which run each quantized layer on local
        tensors (``_hf_quantized_needs_local_tp``).  Checked here, before any weight is read, against the model's
        plan with the ``DistributedConfig``'s ``tp_plan`` override applied.  From a safetensors checkpoint each
        rank then reads only its slices, one layer at a time (:func:`qlinear.tensor_parallel.load_shards`), and
        transformers is told to skip the full packed tensors; otherwise the full tensors load and are sliced
        afterwards (:func:`qlinear.tensor_parallel.shard_loaded`).  A model loaded this way cannot be saved
        (``is_serializable`` is False).

        Raises:
            ValueError: quantize-on-load under tensor parallelism (quantize and save first), or a quantized layer
                the plan cannot split (:func:`qlinear.tensor_parallel.check_tp_plan`).
        """
        super().update_parallel_plan(model, plan)
        dc = getattr(model.config, "distributed_config", None)
        world = getattr(dc, "tp_size", 1) or 1
        if world <= 1 or plan is not model.tp_plan:
            return
        if not self.pre_quantized:
            raise ValueError("qlinear cannot quantize on load under tensor parallelism: quantize and save_pretrained "
                             "the model in one process first, then load that checkpoint with the distributed_config")
        from qlinear.integrations.tensor_parallel import check_tp_plan

        override = getattr(dc, "tp_plan", None)  # merged into the plan by transformers after this hook
        if isinstance(override, dict):
            plan = {**plan, **override} if override else {}
        check_tp_plan(model, plan, world)
        layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        if layers and self._safetensors and all(set(m.buffer_specs) <= set(self._checkpoint_index.get(n, ()))
                                                for n, m in layers.items()):
            # safetensors: read only this rank's slices
            import re

            import torch.distributed as dist
            from qlinear.integrations.tensor_parallel import load_shards

            bufs = {n: "|".join(m.buffer_specs) for n, m in layers.items()}  # each layer's own tensors, before slicing
            with torch.device("cpu"):  # this hook runs under transformers' meta-device init context
                self._tp_specs = load_shards(model, plan, world, dist.get_rank() % world, self._read_layer)
            if self._tp_specs:  # transformers must not load the full tensors over the slices
                # without the base model's prefix: a base-model checkpoint's keys keep theirs unprefixed
                base = f"{model.base_model_prefix}."
                by_bufs: dict[str, list[str]] = {}
                for n in self._tp_specs:
                    by_bufs.setdefault(bufs[n], []).append(re.escape(n.removeprefix(base)))
                model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
                    rf"(^|\.)({'|'.join(names)})\.({b})$" for b, names in by_bufs.items()}

    def _read_layer(self, name: str, buffers: list[str]) -> dict[str, torch.Tensor]:
        """Packed tensors ``buffers`` of quantized layer ``name``, read from the safetensors checkpoint."""
        from safetensors import safe_open

        by_file: dict[str, dict[str, str]] = {}
        for buf in buffers:
            path, key = self._checkpoint_index[name][buf]
            by_file.setdefault(path, {})[buf] = key
        out = {}
        for path, keys in by_file.items():  # one open per file, not per tensor
            with safe_open(path, framework="pt") as f:
                out.update({buf: f.get_tensor(key) for buf, key in keys.items()})
        return out

    def _read_checkpoint(self, model, checkpoint_files) -> None:
        """Read the headers and metadata of the checkpoint files (no tensor data): which tensors each module has
        (``_checkpoint_index``), their shapes and dtypes, the saved checksums and layer configs.  ``.bin`` files
        (``torch.load`` onto the meta device) have no metadata: no checksums, no saved layer configs."""
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.modeling_utils import load_state_dict

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        known = _ModuleKeys(model)

        def model_name(key: str) -> str:  # a key of the files as this model names it
            name, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, known)
            return key if known.get(name) is None and known.get(key) is not None else name

        self._model_name = model_name
        found: dict[str, tuple[tuple[int, ...], str, str]] = {}
        sums: Optional[dict[str, str]] = None
        self._saved_dtypes = {}
        saved_configs: dict[str, str] = {}  # layer name as saved -> its format config's JSON
        files = [str(f) for f in checkpoint_files]
        self._safetensors = all(f.endswith(".safetensors") for f in files)
        for path in files:
            try:
                if not path.endswith(".safetensors"):
                    try:  # a damaged pickle fails in many ways (EOFError, KeyError, ...): all mean unreadable
                        state = load_state_dict(path, map_location="meta")
                    except Exception as e:
                        raise OSError(e) from None
                    if not isinstance(state, dict):
                        raise OSError(f"it holds a {type(state).__name__}, not a state dict")
                    entries = [(k, tuple(t.shape), _ST_DTYPES.get(t.dtype, str(t.dtype)))
                               for k, t in state.items() if isinstance(t, torch.Tensor)]
                else:
                    with safe_open(path, framework="pt") as f:
                        meta = f.metadata() or {}
                        try:
                            if CHECKSUM_KEY in meta:
                                sums = {**(sums or {}), **json.loads(meta[CHECKSUM_KEY])}
                            self._saved_dtypes.update(json.loads(meta.get(DTYPES_KEY, "{}")))
                            for cfg, names in json.loads(meta.get(CONFIGS_KEY, "[]")):
                                saved_configs.update(dict.fromkeys(names, json.dumps(cfg, sort_keys=True)))
                        except (ValueError, TypeError) as e:
                            raise ValueError(f"qlinear checkpoint {path} is damaged: its safetensors metadata "
                                             f"cannot be read ({e}); restore the file from the source") from None
                        entries = []
                        for k in f.keys():
                            sl = f.get_slice(k)
                            entries.append((k, tuple(sl.get_shape()), sl.get_dtype()))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"qlinear checkpoint {path} cannot be read ({e}): the file is truncated or "
                                 f"damaged; restore it from the source") from None
            for key, shape, dtype in entries:
                name = self._model_name(key)
                found[name] = (shape, dtype, key)
                module_name, _, tensor_name = name.rpartition(".")
                self._checkpoint_index.setdefault(module_name, {})[tensor_name] = (path, key)
        self._checkpoint = (found, sums, saved_configs)
        self._saved_layers = {rename_source_key(f"{n}.weight", renamings, converters, model.base_model_prefix,
                                                known)[0].rpartition(".")[0] for n in saved_configs}

    def _check_checkpoint(self, model) -> None:
        """Compare the packed tensors of the checkpoint (:meth:`_read_checkpoint`) with the empty modules."""
        found, sums, saved_configs = self._checkpoint
        by_module: dict[str, set[str]] = {}
        for key in found:
            module_name, _, tensor_name = key.rpartition(".")
            by_module.setdefault(module_name, set()).add(tensor_name)
        problems, missing, stored_float, stored_packed = [], [], [], []
        for name, mod in model.named_modules():
            if isinstance(mod, QuantLinear):
                saved = mod.saved_layout(by_module.get(name, ()))
                if saved is not None:  # an older qlinear storage: loaded as it is, converted after loading
                    mod.hold_saved_layout(saved)
                absent = []
                for buf, (shape, dtype) in mod.held_specs().items():
                    got = found.get(f"{name}.{buf}")
                    if got is None:
                        absent.append(buf)
                        continue
                    want = (tuple(shape), _ST_DTYPES.get(dtype, str(dtype)))
                    if got[:2] != want:
                        problems.append(f"{got[2]}: checkpoint has {got[1]} {list(got[0])}, {type(mod).__name__} "
                                        f"{mod.out_features}x{mod.in_features} expects {want[1]} {list(want[0])}")
                bias = found.get(f"{name}.bias")
                if mod.bias is not None and bias is not None and bias[1] not in _ST_EXPONENTS:
                    problems.append(f"{bias[2]}: checkpoint has {bias[1]}, a bias must be floating point")
                others = sorted(by_module.get(name, set()) - set(mod.held_specs()) - {"bias"})
                if absent and f"{name}.weight" in found:
                    stored_float.append(name)
                elif absent or (mod.bias is not None and bias is None):
                    absent += ["bias"] if mod.bias is not None and bias is None else []
                    hint = f" (the checkpoint has {', '.join(others)}: saved with another format?)" if others else ""
                    missing.append(f"{name}: {', '.join(absent)}{hint}")
                elif others:  # e.g. perm or rotation of a layer whose config, edited, no longer has act_order/rotation
                    problems.append(f"{name}: the checkpoint also has {', '.join(others)}, which a layer of this "
                                    f"config does not hold")
                key = next(iter(self._checkpoint_index.get(name, {}).values()), (None, ""))[1]
                saved = saved_configs.get(key.rpartition(".")[0])
                if saved is not None and saved != mod.config.to_json():
                    was, now = json.loads(saved), json.loads(mod.config.to_json())
                    diff = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(was) | set(now))
                                     if was.get(k) != now.get(k))
                    problems.append(f"{name}: saved with another config than quantization_config gives it ({diff})")
            elif is_quantizable_linear(mod) and by_module.get(name, set()) - {"bias"} and "weight" not in by_module[name]:
                stored_packed.append(name)
        msgs = []
        cfg = self.quantization_config.format_config().to_json()
        if problems:
            msgs.append(f"{len(problems)} packed tensor(s) do not match the quantization_config ({cfg}): the "
                        f"checkpoint was saved with another config (e.g. an edited bits/group_size) or a tensor is "
                        f"truncated or corrupt:{_listing(problems)}")
        if missing:
            msgs.append(f"{len(missing)} quantized layer(s) are missing packed tensors in the checkpoint:"
                        f"{_listing(missing)}")
        if stored_float:
            msgs.append(f"{len(stored_float)} layer(s) are stored as float weights but the config quantizes them "
                        f"(modules_to_not_convert differs from the one they were saved with?):"
                        f"{_listing(stored_float)}")
        if stored_packed:
            msgs.append(f"{len(stored_packed)} layer(s) are stored quantized but the config keeps them in float "
                        f"(modules_to_not_convert differs from the one they were saved with? or the model's "
                        f"_keep_in_fp32_modules, which its forward needs in float, e.g. T5's wo):"
                        f"{_listing(stored_packed)}")
        if msgs:
            raise ValueError("qlinear checkpoint does not match its quantization_config:\n" + "\n".join(msgs))
        if self._safetensors:
            self._verify_packed(model, sums)
        else:
            warnings.warn("this qlinear checkpoint is in .bin files, which carry no checksums: its packed tensors are "
                          "checked for NaN/Inf and invalid indices only; save it again (safetensors) to add them",
                          stacklevel=2)

    def _verify_packed(self, model, sums: Optional[dict[str, str]]) -> None:
        """Read every tensor of the checkpoint that has a saved sum, and every packed tensor, once, straight from the
        memory-mapped files (no tensor copies): its CRC must equal the saved one and a packed float tensor must be
        finite, else ValueError naming it (see the module docstring)."""
        if sums is None:
            warnings.warn("this qlinear checkpoint has no checksums (saved before 2026-11-25, or rewritten by a tool "
                          "that drops safetensors metadata): its packed tensors are checked for NaN/Inf only; save it "
                          "again to add them", stacklevel=2)
        elif not self._checkpoint[2]:
            warnings.warn("this qlinear checkpoint has checksums but no saved layer configs (qlinear_configs, since "
                          "2026-11-25): an edit of config.json that keeps the tensor shapes cannot be detected; save "
                          "it again to add them", stacklevel=2)
        sums = sums or {}
        packed = {f"{n}.{b}" if n else b for n, m in model.named_modules() if isinstance(m, QuantLinear)
                  for b in _with_bias(m, m.held_specs())}
        by_file: dict[str, list[tuple[str, str]]] = {}  # file -> [(state-dict name, key in the file)]
        for module, tensors in self._checkpoint_index.items():
            for t, (path, key) in tensors.items():
                name = f"{module}.{t}" if module else t
                if name in packed or key in sums or name in sums:
                    by_file.setdefault(path, []).append((name, key))
        found = self._checkpoint[0]  # as this model names the files' tensors (renamed on save, e.g. GPT-NeoX)
        present = {key for tensors in self._checkpoint_index.values() for _, key in tensors.values()} | set(found)
        # the model's ties (transformers' map, shared parameters and buffers) as groups of names: one tensor each
        pairs = list((getattr(model, "all_tied_weights_keys", None) or {}).items())
        shared: dict[int, list[str]] = {}
        for n, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            shared.setdefault(id(t), []).append(n)
        pairs += [(names[0], n) for names in shared.values() for n in names[1:]]
        root: dict[str, str] = {}

        def find(n: str) -> str:
            while root.get(n, n) != n:
                n = root[n]
            return n

        for a, b in pairs:
            root[find(a)] = find(b)
        held_groups = {find(n) for n in found}

        def held(key: str) -> bool:  # a tied weight, which transformers saves once, is held by any of its names
            name = self._model_name(key)
            return key in present or name in found or find(name) in held_groups

        # a summed tensor no file holds would be initialised at random by transformers
        bad = [f"{key}: missing from the checkpoint (its CRC-32 was saved)" for key in sorted(sums) if not held(key)]
        for path, entries in by_file.items():
            with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                size = int.from_bytes(mm[:8], "little")
                header, view = json.loads(mm[8:8 + size]), memoryview(mm)
                for name, key in entries:
                    lo, hi = header[key]["data_offsets"]
                    data = view[8 + size + lo:8 + size + hi]
                    # the saved name is the file's key; a model loaded without the saving model's prefix names the
                    # tensor differently
                    got, want = f"{zlib.crc32(data):08x}", sums.get(key, sums.get(name))
                    exponent = _ST_EXPONENTS.get(header[key]["dtype"])  # a float: NaN/Inf have every exponent bit set
                    saved_dtype = self._saved_dtypes.get(key)
                    if saved_dtype is not None and header[key]["dtype"] != saved_dtype:
                        bad.append(f"{name}: stored as {header[key]['dtype']}, saved as {saved_dtype} (damaged file)")
                    elif want is not None and got != want:
                        bad.append(f"{name}: CRC-32 {got} differs from the saved {want} (damaged file)")
                    elif name in packed and exponent is not None and (
                            np.frombuffer(data, exponent[0]) & exponent[1] == exponent[1]).any():
                        bad.append(f"{name}: holds NaN or Inf")
                    data.release()
                view.release()
        if bad:
            raise ValueError(f"qlinear checkpoint is damaged: {len(bad)} tensor(s) are not what was saved; "
                             f"restore the files from the source:{_listing(bad)}")

    def _process_model_after_weight_loading(self, model, **kwargs):
        _unguard_init(model)
        if self.load_errors:
            first = self.load_errors[0]
            more = f" (and {len(self.load_errors) - 1} more layer(s):{_listing([str(e) for e in self.load_errors[1:]])})"
            raise type(first)(f"qlinear could not quantize {first}" + (more if len(self.load_errors) > 1 else "")) \
                from first
        if self._quantize_after_loading:
            from qlinear.replace import replace_linear

            keep = [name for name, mod in model.named_modules() if name and is_quantizable_linear(mod) and self._skip(name)]
            cfg = self.quantization_config
            tok = cfg.tokenizer
            if isinstance(tok, str):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tok)
            teacher = copy.deepcopy(model) if cfg.finetune_steps else None
            replace_linear(model, cfg, modules_to_not_convert=keep, calibration_data=cfg.dataset, tokenizer=tok,
                           progress=False)
            if teacher is not None:
                from qlinear.calibration import generate_data
                from qlinear.finetune import finetune

                own = cfg.dataset is None or isinstance(cfg.dataset, dict)  # no data, or Hessians only
                data = generate_data(teacher, progress=False) if own else cfg.dataset
                finetune(model, data, tok, teacher=teacher, steps=cfg.finetune_steps, progress=False)
            return model
        leftover = [name for name, mod in model.named_modules() if _has_placeholder(mod)]
        if leftover:
            raise ValueError(f"{len(leftover)} layer(s) were not quantized because the checkpoint has no weight "
                             f"for them:{_listing(leftover)}")
        # Safety net for what _check_checkpoint cannot see (a state_dict= argument): transformers
        # flags every tensor it loads with `_is_hf_initialized`; a packed buffer without it was missing from
        # the checkpoint and only holds torch.empty memory.  Skipped for multi-device / offloaded models,
        # whose tensors accelerate may have moved since.
        device_map = getattr(model, "hf_device_map", None) or {}
        check_loaded = len(set(device_map.values())) <= 1 and "disk" not in device_map.values()
        bad = []
        for name, mod in model.named_modules():
            if not isinstance(mod, QuantLinear) or name in (self._tp_specs or {}):  # those were read by load_shards,
                continue  # already sliced and repacked for their device
            found = len(bad)
            for buf, (shape, dt) in mod.held_specs().items():  # as loaded: an older storage is converted below
                t = getattr(mod, buf)
                if tuple(t.shape) != tuple(shape) or t.dtype != dt:
                    bad.append(f"{name}.{buf}: loaded {t.dtype} {list(t.shape)}, expected {dt} {list(shape)}")
                elif check_loaded and (t.device.type == "meta" or not getattr(t, "_is_hf_initialized", False)):
                    bad.append(f"{name}.{buf}: missing from the checkpoint")
            b = mod.bias
            if check_loaded and b is not None and (b.device.type == "meta" or not getattr(b, "_is_hf_initialized", False)):
                bad.append(f"{name}.bias: missing from the checkpoint")
            if len(bad) == found and mod.held_specs().keys() == mod.buffer_specs.keys():  # not an older storage
                try:  # NaN/Inf, perm, indices: what a .bin or a checksum-less file cannot prove otherwise
                    check_buffers({n: getattr(mod, n) for n in mod.buffer_specs}, mod.config, mod.out_features,
                                  mod.in_features)
                except ValueError as e:
                    bad.append(f"{name}: {e}")
        if bad:
            raise ValueError(f"qlinear checkpoint does not match its quantization_config "
                             f"({self.quantization_config.format_config().to_json()}):{_listing(bad)}")
        if (getattr(model, "tp_size", None) or 1) > 1:
            from qlinear.integrations import tensor_parallel as tp

            mesh = model._mesh_manager.get_mesh("tp")
            if self._tp_specs is None:
                tp.shard_loaded(model, model.tp_plan, mesh.get_group())
            else:
                if mesh.get_local_rank() != torch.distributed.get_rank() % mesh.size():
                    raise RuntimeError("qlinear sliced the layers for another tensor-parallel rank than transformers' "
                                       "mesh gives this process; load with tp as the innermost mesh dimension")
                tp.finish_load_shards(model, self._tp_specs, next(model.parameters()).device)
                tp.add_gather_hooks(model, self._tp_specs, mesh.get_group())
            self._tp_sharded = True
        _offload_packed(model, self._checkpoint_index if self._safetensors else {})
        for mod in model.modules():  # tensors were assigned in place: derive each kernel's layout once now
            if isinstance(mod, QuantLinear):
                mod.repack_for_device()
        return watch_loads(model)


def _offload_packed(model: nn.Module, checkpoint_index: dict[str, dict[str, tuple[str, str]]]) -> None:
    """Send the packed tensors of the layers ``device_map`` offloads ("cpu" beside a GPU, or "disk") to the offload
    too.  transformers offloads only parameters unless ``from_pretrained`` gets ``offload_buffers=True`` (it passes
    that flag to accelerate itself; a quantizer cannot set it), and packed tensors are buffers, so without this they
    would stay in RAM (or on the GPU).  Each such layer's hook gets its tensors: on "disk" an entry pointing at the
    checkpoint's safetensors file (no copy) or, for tensors the checkpoint does not hold as they are (quantized on
    load, an older storage), a file written to the offload folder; on "cpu" the tensor itself.  Then the hook loads
    buffers too (``offload_buffers``) and the layer holds meta tensors.  Uses accelerate's ``AlignDevicesHook``
    (``offload``, ``offload_buffers``, ``weights_map``) and ``OffloadedWeightsLoader`` (``state_dict``, ``index``,
    ``save_folder``, ``all_keys``), accelerate 1.x.

    Raises:
        ValueError: a disk-offloaded layer whose tensors must be written, without an offload folder.
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    if not {"cpu", "disk"} & set(device_map.values()):
        return
    from accelerate.hooks import AlignDevicesHook
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset, offload_weight

    for name, mod in model.named_modules():
        hook = getattr(mod, "_hf_hook", None)
        if not isinstance(mod, QuantLinear) or not isinstance(hook, AlignDevicesHook) or not hook.offload \
                or hook.offload_buffers or not isinstance(hook.weights_map, PrefixedDataset) \
                or not isinstance(hook.weights_map.dataset, OffloadedWeightsLoader):
            continue
        loader, prefix = hook.weights_map.dataset, hook.weights_map.prefix
        disk = _mapped_device(device_map, name) == "disk"
        files = checkpoint_index.get(name, {})
        for buf, t in mod.release_packed().items():
            key = prefix + buf
            if not disk:
                loader.state_dict[key] = t.cpu()
            elif buf in files:
                loader.index[key] = {"safetensors_file": files[buf][0], "weight_name": files[buf][1],
                                     "dtype": str(t.dtype).removeprefix("torch.")}
            elif loader.save_folder is None:
                raise ValueError(f"{name} is offloaded to disk but its packed tensors are not in a safetensors "
                                 f"checkpoint: pass offload_folder= to from_pretrained")
            else:
                offload_weight(t, key, loader.save_folder, index=loader.index)
            if key not in loader.all_keys:
                loader.all_keys.append(key)
        hook.offload_buffers = True


def _mapped_device(device_map: dict, name: str):
    """The ``device_map`` entry that places module ``name`` (its own or its closest ancestor's)."""
    while name not in device_map and name:
        name = name.rpartition(".")[0]
    return device_map.get(name)


def init_empty_quantized(model: nn.Module, config: Any = None, checkpoint: Any = None) -> nn.Module:
    """Turn an empty transformers model (built on the meta device, e.g. ``from_config`` under accelerate's
    ``init_empty_weights()``) into the empty qlinear model a checkpoint saved with ``config`` holds, so that
    accelerate's ``load_checkpoint_and_dispatch(model, folder, device_map=...)`` fills it: accelerate's big-model
    recipe.  The layers are those ``from_pretrained`` builds (the same quantizer does it); each takes its device's
    kernel layout on its first call.

    Args:
        model: a ``PreTrainedModel`` whose Linear weights are on the meta device.
        config: a :class:`QLinearConfig` or its dict; default ``model.config.quantization_config`` (what
            ``AutoConfig.from_pretrained`` reads from a qlinear checkpoint).
        checkpoint: the folder (or weights file, or ``*.index.json``) that will be loaded, as
            ``load_checkpoint_and_dispatch`` takes it.  Its headers are then read first, as ``from_pretrained`` does:
            layers transformers keeps in float by default (an output ``lm_head``) are built quantized where the
            checkpoint stores them packed, and tensors that do not match the config raise here.  Without it
            those layers stay float, so a checkpoint with a quantized output layer needs it.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: no qlinear config; Linear layers that hold weights (use :func:`qlinear.replace_linear` to
            quantize real weights); a layer shape the format cannot store; no weights file at ``checkpoint``, or
            one that does not match the config (the model is then left unchanged).
    """
    config = getattr(model.config, "quantization_config", None) if config is None else config
    if isinstance(config, dict) and config.get("quant_method") == QUANT_METHOD:
        config = QLinearConfig.from_dict(config)
    if not isinstance(config, QLinearConfig):
        raise ValueError(f"init_empty_quantized needs a QLinearConfig (or a model config whose quantization_config is "
                         f"one), got {type(config).__name__}")
    loaded = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.device.type != "meta"]
    if loaded:
        raise ValueError(f"init_empty_quantized expects an empty model (under accelerate's init_empty_weights), but "
                         f"{len(loaded)} Linear layer(s) hold weights, e.g. {loaded[0]!r}; quantize a loaded model "
                         f"with qlinear.replace_linear")
    files = None if checkpoint is None else _weight_files(checkpoint)
    quantizer = QLinearHfQuantizer(config, pre_quantized=True)
    flags = ("is_quantized", "quantization_method")  # set by transformers before qlinear's checks run
    before = {k: model.__dict__[k] for k in flags if k in model.__dict__}
    try:
        quantizer.preprocess_model(model, checkpoint_files=files)
    except BaseException:
        for k in flags:
            model.__dict__.pop(k, None)
        model.__dict__.update(before)
        raise
    _unguard_init(model)  # accelerate's loading initializes nothing
    model.hf_quantizer, model.config.quantization_config = quantizer, config
    return watch_loads(model)


def _weight_files(checkpoint: Any) -> list[str]:
    """The weight files of ``checkpoint`` as accelerate's ``load_checkpoint_in_model`` (1.x) picks them: a file, or
    the shards a ``.json`` index names; in a folder ``pytorch_model.bin``, else ``model.safetensors``, else its one
    ``*.index.json``.  Raises ValueError when there is none, or the index cannot be read."""
    import os

    from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    path = str(checkpoint)
    if os.path.isdir(path):
        single = [f for f in (os.path.join(path, WEIGHTS_NAME), os.path.join(path, SAFE_WEIGHTS_NAME))
                  if os.path.isfile(f)]
        indexes = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".index.json")]
        path = single[0] if single else indexes[0] if len(indexes) == 1 else path
    if not os.path.isfile(path):
        raise ValueError(f"init_empty_quantized: no weights at checkpoint={str(checkpoint)!r} (a weights file, a .json "
                         f"index, or a folder with one of them): pass what load_checkpoint_and_dispatch gets")
    if not path.endswith(".json"):
        return [path]
    try:
        with open(path) as f:
            index = json.load(f)
        shards = index.get("weight_map", index).values()
        return [os.path.join(os.path.dirname(path), f) for f in sorted(set(shards))]
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"init_empty_quantized: {path} is not a weights index ({e})") from None


def register() -> None:
    """Register ``QLinearConfig`` and ``QLinearHfQuantizer`` under ``quant_method="qlinear"``.

    Idempotent: transformers' ``register_*`` raise ValueError for a name registered twice, so a
    second call (re-import, ``importlib.reload``) replaces qlinear's own earlier registration in
    place, as are the stand-ins of :mod:`qlinear._autoload`; a foreign class registered under the same name is
    replaced with a warning.
    """
    for mapping, cls, decorator in (
            (AUTO_QUANTIZATION_CONFIG_MAPPING, QLinearConfig, register_quantization_config),
            (AUTO_QUANTIZER_MAPPING, QLinearHfQuantizer, register_quantizer)):
        old = mapping.get(QUANT_METHOD)
        if old is None:
            decorator(QUANT_METHOD)(cls)
            continue
        if old is cls:
            continue
        foreign = (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__)
        if foreign and not getattr(old, "_qlinear_stand_in", False):
            warnings.warn(f"quant_method {QUANT_METHOD!r} was registered by {old.__module__}.{old.__qualname__}; "
                          f"qlinear replaces it with {cls.__module__}.{cls.__qualname__}", stacklevel=2)
        mapping[QUANT_METHOD] = cls
