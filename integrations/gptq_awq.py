"""GPTQ and AWQ checkpoints as the ecosystem writes them: load into :class:`qlinear.BCQLinear` layers, and export.

Both are transformers model folders whose ``config.json`` has a ``quantization_config`` and whose safetensors hold,
per quantized ``nn.Linear`` ``name``, packed int32 ``name.qweight`` and ``name.qzeros``, fp16 ``name.scales`` and
optionally ``name.bias``; the weights are ``scales·(codes − zeros)`` per group of inputs.

- **GPTQ** (AutoGPTQ / GPTQModel, also read by transformers, vLLM, TGI and ExLlama): ``{"quant_method": "gptq",
  "bits", "group_size", "desc_act", "sym", "checkpoint_format": "gptq" | "gptq_v2"}`` (AutoGPTQ 0.8 names it
  ``"format"``; older AutoGPTQ folders keep these settings in ``quantize_config.json``); ``qweight`` ``[K·bits/32,
  N]`` (codes packed along K), ``qzeros`` ``[G, N·bits/32]`` (stored minus one in the v1 "gptq" format),
  ``scales`` ``[G, N]``, ``g_idx`` int32 ``[K]``.  Bits 2, 3, 4, 8 (3-bit codes straddle words as one
  little-endian bit stream).  See :func:`qlinear.formats.uniform.pack_gptq`.
- **AWQ** (AutoAWQ, Lin et al. 2023; also read by transformers, vLLM and TGI): ``{"quant_method": "awq", "bits": 4,
  "group_size", "zero_point": true, "version": "gemm" | "gemv"}``; 4-bit codes in AutoAWQ's ``WQLinear_GEMM``
  layout (``qweight`` ``[K, N/8]``, output columns interleaved in each word) or ``WQLinear_GEMV`` layout
  (``qweight`` ``[N, K/8]``, padded ``qzeros``/``scales``).  See :func:`qlinear.formats.uniform.pack_awq`.

Why functions instead of ``from_pretrained``: transformers 5 binds ``quant_method="gptq"`` and ``"awq"`` to its own
quantizers, which need the ``gptqmodel`` package and its kernels; registering qlinear under the same names would
replace them for every user of the process.  The loaders build the model with transformers (``from_config`` with
parameters on the meta device), swap the quantized layers for exact ``BCQLinear`` layers (act_order layers stored
reordered, see :mod:`qlinear.formats.bcq`) and load the other tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["load_gptq", "save_gptq", "load_awq", "save_awq"]


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():  # sharded: exactly the files the index names
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "model.safetensors"] if (path / "model.safetensors").exists() else sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error type for a truncated or damaged file
            raise ValueError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    return out


def _read_config(path: Path, method: str):
    """``(transformers config, its quantization_config as a dict with int bits and group_size)``; ValueError unless
    the checkpoint's quant_method is ``method`` with integer bits and group_size."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    q = getattr(config, "quantization_config", None)
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q or {})
    legacy = path / "quantize_config.json"  # older AutoGPTQ folders keep the settings there, not in config.json
    if not q and method == "gptq" and legacy.is_file():
        try:
            q = {"quant_method": "gptq", **json.loads(legacy.read_text())}
        except (ValueError, TypeError) as e:
            raise ValueError(f"{legacy} is not a JSON object: {e}") from None
        config.quantization_config = q
    if q.get("quant_method") != method:
        article = "an" if method[0] in "aeiou" else "a"
        raise ValueError(f"{path} is not {article} {method.upper()} checkpoint (quantization_config.quant_method = "
                         f"{q.get('quant_method')!r})")
    bits, group_size = q.get("bits"), q.get("group_size", -1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (bits, group_size)) or bits < 1 or not (
            group_size == -1 or group_size > 0):
        raise ValueError(f"{path}: quantization_config needs integer bits >= 1 and group_size (-1 or positive), got "
                         f"bits={bits!r}, group_size={group_size!r}")
    q["group_size"] = group_size
    return config, q


def _load(path: Path, config, method: str, dtype: torch.dtype,
          make_layer: Callable[[str, nn.Linear, dict, Optional[torch.Tensor]], nn.Module]) -> nn.Module:
    """Build ``config``'s causal LM on the meta device, swap each Linear whose ``qweight`` the checkpoint holds for
    ``make_layer(name, linear, its tensors, bias)`` and load every other tensor; ValueError on any mismatch."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from qlinear import BCQLinear

    engine = method.upper()
    tensors = _read_tensors(path)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):  # parameters on meta, computed buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or f"{name}.qweight" not in tensors:
            continue
        t = {k: tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{k}" in tensors}
        bias = tensors.pop(f"{name}.bias", None)
        if bias is None and mod.bias is not None:  # the model's layer has one: dropping it would change the outputs
            raise ValueError(f"layer {name!r}: the checkpoint has {name}.qweight but no {name}.bias, which this "
                             f"model's layer has; the checkpoint is damaged or is of another model")
        if bias is not None and mod.bias is None:  # some packers save zeros for layers without one: harmless
            if bias.count_nonzero():
                raise ValueError(f"layer {name!r}: the checkpoint has a nonzero {name}.bias, which this model's layer "
                                 f"does not have; the checkpoint is of another model (or its config.json is)")
            bias = None
        try:
            layer = make_layer(name, mod, t, None if bias is None else bias.to(dtype))
        except KeyError as e:
            raise ValueError(f"layer {name!r}: the checkpoint has {name}.qweight but no {name}.{e.args[0]}") from None
        except ValueError as e:
            raise ValueError(f"layer {name!r}: {e}") from e
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    try:
        missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                     for k, v in tensors.items()}, strict=False, assign=True)
    except RuntimeError as e:  # torch's size mismatches of the float tensors
        raise ValueError(f"{engine} checkpoint {path} does not fit the model its config.json describes: {e}") from None
    quantized = [name + "." for name, m in model.named_modules() if isinstance(m, BCQLinear)]
    output = model.get_output_embeddings()
    tie = getattr(config, "tie_word_embeddings", False) and not isinstance(output, BCQLinear)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if tie else set()
    missing = [k for k in missing if k not in tied and not any(k.startswith(q) for q in quantized)]
    if unexpected or missing:
        raise ValueError(f"{engine} checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    if tie:
        model.tie_weights()
    elif getattr(config, "tie_word_embeddings", False):  # a quantized lm_head (GPTQModel's lm_head=True) has its own
        model.config.tie_word_embeddings = False
    if (path / "generation_config.json").exists():  # from_config gave the defaults (end-of-sequence tokens...)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BCQLinear)}
    if layers:  # save_pretrained then writes a qlinear checkpoint that from_pretrained loads
        from qlinear import QLinearConfig
        from qlinear.replace import is_quantizable_linear, remember_config

        first = next(iter(layers.values()))
        floats = [name for name, m in model.named_modules() if is_quantizable_linear(m)]
        remember_config(model, QLinearConfig(**first.config.to_dict(), backend=first.backend or None), floats, {},
                        layers)
    return model.eval()


def _save(model: nn.Module, path, method: str, layer_tensors: Callable[[nn.Module], dict[str, torch.Tensor]],
          quantization_config: Callable[[list], dict]) -> None:
    """Write ``model`` as ``config.json`` + one ``model.safetensors``: each quantized layer's ``layer_tensors(layer)``,
    every other tensor as it is (a tied tensor once), and ``quantization_config(layers)``."""
    from safetensors.torch import save_file

    from qlinear import BCQLinear, QuantLinear

    layers = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, QuantLinear)]
    if not layers:
        raise ValueError("the model has no quantized layers")
    tensors = {}
    for name, mod in layers:
        if not isinstance(mod, BCQLinear):
            raise ValueError(f"layer {name!r} is a {type(mod).__name__}: {method.upper()} checkpoints hold uniform "
                             "int codes")
        try:
            tensors.update({f"{name}.{k}": v for k, v in layer_tensors(mod).items()})
        except ValueError as e:
            raise ValueError(f"layer {name!r}: {e}") from e
    qconfig = quantization_config([mod for _, mod in layers])
    prefixes = [name + "." for name, _ in layers]
    for key, v in model.state_dict().items():
        if not any(key.startswith(p) for p in prefixes):
            tensors[key] = v.detach().cpu().contiguous()
    seen = {}
    for k, v in list(tensors.items()):  # tied weights: keep the first name of a shared tensor
        if v.data_ptr() in seen and v.numel():
            del tensors[k]
        else:
            seen[v.data_ptr()] = k
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    index = path / "model.safetensors.index.json"
    if index.exists():  # an earlier sharded checkpoint: the loaders would read its index, not the new file
        for shard in set(json.loads(index.read_text()).get("weight_map", {}).values()):
            (path / shard).unlink(missing_ok=True)
        index.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))


def _one_grid(layers: list, method: str) -> tuple[int, int]:
    """The ``(bits, group_size)`` every layer shares (group_size -1 for one group per row); ValueError otherwise.

    A layer's groups are what the checkpoint's one ``group_size`` g gives it: input k is in group k // g (GPTQ's
    ``g_idx``), so a layer with fewer inputs than g is one group under it (a hidden size of 64 beside g128; AWQ's
    export then refuses it, as its loaders need g to divide every layer's inputs)."""
    bits = {m.config.bits for m in layers}
    for g in sorted({m.config.group_size for m in layers}, key=lambda g: (g == -1, g)):
        if len(bits) == 1 and all(m.config.group(m.in_features) == (m.in_features if g == -1 else min(g, m.in_features))
                                  for m in layers):
            return next(iter(bits)), g
    grids = sorted({(m.config.bits, m.config.group_size, m.in_features) for m in layers})
    raise ValueError(f"{method.upper()} checkpoints have one bits/group_size for every layer; the layers' (bits, "
                     f"group_size, in_features) are {grids}: quantize them with one config")


def _gptq_format(q: dict) -> str:
    """The checkpoint format a GPTQ quantization_config names: ``checkpoint_format`` (GPTQModel, transformers) or
    ``format`` (AutoGPTQ 0.8 writes only that key), "gptq" when neither; ValueError if they disagree."""
    named = {q[k] for k in ("checkpoint_format", "format") if q.get(k) is not None}
    if len(named) > 1:
        raise ValueError(f"quantization_config names two formats, checkpoint_format={q['checkpoint_format']!r} and "
                         f"format={q['format']!r}; fix config.json so that they agree")
    return named.pop() if named else "gptq"


def load_gptq(path, *, dtype: torch.dtype = torch.float16, backend: Optional[str] = None) -> nn.Module:
    """Load a GPTQ checkpoint folder (see the module docstring) as a transformers causal LM whose quantized
    layers are exact :class:`qlinear.BCQLinear` modules (same dequantized weights as the checkpoint's
    ``scales·(codes − zeros)``), on the CPU.

    Args:
        path: folder with ``config.json`` and ``*.safetensors``.
        dtype: of the float weights (embeddings, norms, lm_head, biases).
        backend: kernel backend for the quantized layers (None: automatic).

    Raises:
        ValueError: not a GPTQ checkpoint, unsupported bits or format, a tensor missing or of the wrong shape.
    """
    from qlinear import BCQLinear

    path = Path(path)
    config, q = _read_config(path, "gptq")
    bits, fmt = q["bits"], _gptq_format(q)

    def make_layer(name, mod, t, bias):
        if q.get("desc_act") and "g_idx" not in t:  # act_order: the inputs' groups are not k // group_size
            raise ValueError("desc_act is true but the checkpoint has no g_idx for this layer")
        if t["qweight"].shape[0] * 32 // bits != mod.in_features or t["qweight"].shape[1] != mod.out_features:
            raise ValueError(f"qweight is {list(t['qweight'].shape)}; the model's layer is "
                             f"{mod.out_features}x{mod.in_features} at {bits} bits")
        return BCQLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], bits=bits, group_size=q["group_size"],
                                   g_idx=t.get("g_idx"), bias=bias, checkpoint_format=fmt, backend=backend)

    return _load(path, config, "gptq", dtype, make_layer)


def save_gptq(model: nn.Module, path, *, checkpoint_format: str = "gptq") -> None:
    """Write ``model`` (whose quantized layers are uniform :class:`qlinear.BCQLinear`: GPTQ, round-to-nearest or
    imported) as a GPTQ checkpoint folder that :func:`load_gptq` and other GPTQ engines read.

    Args:
        model: a transformers model (its ``config`` is written with a GPTQ ``quantization_config``).
        path: folder; ``config.json`` and ``model.safetensors`` in it are overwritten (one file, no shards).
        checkpoint_format: "gptq" (v1 zero points, the most widely read) or "gptq_v2".

    Raises:
        ValueError: a layer that has no int codes (non-uniform α), layers with different bits/group sizes, or a
            zero point of 0 in the v1 format.
    """
    def qconfig(layers):
        bits, group_size = _one_grid(layers, "gptq")
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": any(m.config.act_order for m in layers), "sym": False,
                "checkpoint_format": checkpoint_format}

    _save(model, path, "gptq", lambda m: m.to_gptq(checkpoint_format), qconfig)


def load_awq(path, *, dtype: torch.dtype = torch.float16, backend: Optional[str] = None) -> nn.Module:
    """Load an AutoAWQ checkpoint folder (see the module docstring; versions "gemm" and "gemv") as a transformers
    causal LM whose quantized layers are exact 4-bit :class:`qlinear.BCQLinear` modules (same dequantized weights
    as the checkpoint's ``scales·(codes − zeros)``), on the CPU.  Layers the checkpoint keeps in floating point
    (its ``modules_to_not_convert``) stay ``nn.Linear``.

    Args:
        path: folder with ``config.json`` and ``*.safetensors``.
        dtype: of the float weights (embeddings, norms, lm_head, biases).
        backend: kernel backend for the quantized layers (None: automatic).

    Raises:
        ValueError: not an AWQ checkpoint, bits other than 4, ``zero_point: false``, a version other than "gemm" or
            "gemv", a tensor missing or of the wrong shape.
    """
    from qlinear import BCQLinear
    from qlinear.formats.uniform import awq_version

    path = Path(path)
    config, q = _read_config(path, "awq")
    if q["bits"] != 4:
        raise ValueError(f"{path}: AWQ checkpoints hold 4-bit codes, quantization_config.bits = {q['bits']}")
    if q.get("zero_point", True) is not True:
        raise ValueError(f"{path}: quantization_config.zero_point = {q.get('zero_point')!r}; only AWQ's default "
                         "zero-point (asymmetric) checkpoints are read")
    version = awq_version(q.get("version", q.get("format", "gemm")))

    def make_layer(name, mod, t, bias):
        return BCQLinear.from_awq(t["qweight"], t["qzeros"], t["scales"], in_features=mod.in_features,
                                  out_features=mod.out_features, group_size=q["group_size"], version=version,
                                  bias=bias, backend=backend)

    return _load(path, config, "awq", dtype, make_layer)


def _awq_not_convert(model: nn.Module) -> list[str]:
    """``modules_to_not_convert`` as AWQ loaders read it: a float ``nn.Linear`` inside the decoder blocks by its name
    within a block (AutoAWQ tests each block's layers against the list, by substring), one outside by its full name
    (transformers tests full names).  ValueError where an entry would also match a quantized layer (a layer float in
    some blocks only)."""
    from qlinear import QuantLinear
    from qlinear.calibration import decoder_blocks
    from qlinear.replace import is_quantizable_linear

    linears = [(n, m) for n, m in model.named_modules() if is_quantizable_linear(m) or isinstance(m, QuantLinear)]
    prefix, blocks = decoder_blocks(model, [n for n, _ in linears])

    def key(name):
        return name[len(prefix) + 1:].partition(".")[2] if blocks is not None and name.startswith(prefix + ".") else name

    floats = {key(n): n for n, m in linears if is_quantizable_linear(m)}
    for name, m in linears:
        clash = [f for f in floats if f in key(name)] if isinstance(m, QuantLinear) else []
        if clash:
            raise ValueError(f"layer {floats[clash[0]]!r} is kept in float, {name!r} is quantized: AWQ's "
                             f"modules_to_not_convert names a layer for every decoder block ({clash[0]!r}), so it "
                             "cannot keep one block's layer in float only; quantize or skip it in every block")
    return sorted(floats)


def save_awq(model: nn.Module, path, *, version: str = "gemm") -> None:
    """Write ``model`` (whose quantized layers are 4-bit uniform :class:`qlinear.BCQLinear` without act_order or
    rotation: round-to-nearest, GPTQ, or imported) as an AutoAWQ checkpoint folder for :func:`load_awq` and the
    engines that read AWQ (tests compare the packing bit for bit with AutoAWQ's own).  Float ``nn.Linear`` layers are
    listed in ``modules_to_not_convert``, those of the decoder blocks by their name within a block, as AutoAWQ reads
    them.

    Args:
        model: a transformers model (its ``config`` is written with an AWQ ``quantization_config``).
        path: folder; ``config.json`` and ``model.safetensors`` in it are overwritten (one file, no shards).
        version: "gemm" (the common layout) or "gemv".

    Raises:
        ValueError: a layer that is not 4-bit uniform, act_order or rotated, layers with different group sizes, a
            shape the layout cannot pack (out_features for "gemm", in_features for "gemv", not multiples of 8), a
            layer kept in float in some decoder blocks but not all.
    """
    from qlinear.formats.uniform import awq_version

    version = awq_version(version)
    floats = _awq_not_convert(model)

    def qconfig(layers):
        bits, group_size = _one_grid(layers, "awq")
        return {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True,
                "version": version, "modules_to_not_convert": floats or None}

    _save(model, path, "awq", lambda m: m.to_awq(version), qconfig)
