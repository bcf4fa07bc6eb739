"""GPTQ checkpoints as the ecosystem writes them: load into :class:`qlinear.BCQLinear` layers, and export.

Format (AutoGPTQ / GPTQModel, also read by transformers, vLLM, TGI and ExLlama): a transformers model
folder whose ``config.json`` has ``quantization_config = {"quant_method": "gptq", "bits", "group_size",
"desc_act", "sym", "checkpoint_format": "gptq" | "gptq_v2"}`` and whose safetensors hold, per quantized
``nn.Linear`` ``name``: ``name.qweight`` int32 ``[K·bits/32, N]`` (codes packed along K), ``name.qzeros``
int32 ``[G, N·bits/32]`` (zero points packed along N, stored minus one in the v1 "gptq" format),
``name.scales`` fp16 ``[G, N]``, ``name.g_idx`` int32 ``[K]`` and optionally ``name.bias``.  Bits 2, 3, 4, 8
(3-bit codes straddle words as one little-endian bit stream).

Why functions instead of ``from_pretrained``: transformers 5 binds ``quant_method="gptq"`` to its own
``GptqHfQuantizer``, which needs the ``gptqmodel`` package and its kernels; registering qlinear under the same
name would replace that quantizer for every user of the process.  :func:`load_gptq` builds the model with
transformers (``from_config`` with parameters on the meta device), swaps the quantized layers for exact ``BCQLinear``
layers (act_order layers stored reordered, see :mod:`qlinear.formats.bcq`) and loads the other tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

__all__ = ["load_gptq", "save_gptq"]


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
        out.update(load_file(str(f)))
    return out


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
    from transformers import AutoConfig, AutoModelForCausalLM

    from qlinear import BCQLinear

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    q = getattr(config, "quantization_config", None)
    q = q.to_dict() if hasattr(q, "to_dict") else dict(q or {})
    if q.get("quant_method") != "gptq":
        raise ValueError(f"{path} is not a GPTQ checkpoint (quantization_config.quant_method = {q.get('quant_method')!r})")
    try:
        bits, group_size = int(q["bits"]), int(q.get("group_size", -1))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: quantization_config needs integer bits and group_size, got bits="
                         f"{q.get('bits')!r}, group_size={q.get('group_size')!r} ({type(e).__name__})") from None
    fmt = q.get("checkpoint_format", "gptq")
    tensors = _read_tensors(path)
    del config.quantization_config
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta, computed buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or f"{name}.qweight" not in tensors:
            continue
        t = {k: tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx") if f"{name}.{k}" in tensors}
        bias = tensors.pop(f"{name}.bias", None)
        if t["qweight"].shape[0] * 32 // bits != mod.in_features or t["qweight"].shape[1] != mod.out_features:
            raise ValueError(f"{name}.qweight is {list(t['qweight'].shape)}; the model's layer is "
                             f"{mod.out_features}x{mod.in_features} at {bits} bits")
        try:
            layer = BCQLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], bits=bits, group_size=group_size,
                                        g_idx=t.get("g_idx"), bias=None if bias is None else bias.to(dtype),
                                        checkpoint_format=fmt, backend=backend)
        except (KeyError, ValueError) as e:
            raise ValueError(f"layer {name!r}: {e}") from e
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    try:
        missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                     for k, v in tensors.items()}, strict=False, assign=True)
    except RuntimeError as e:  # torch's size mismatches of the float tensors
        raise ValueError(f"GPTQ checkpoint {path} does not fit the model its config.json describes: {e}") from None
    quantized = [name + "." for name, m in model.named_modules() if isinstance(m, BCQLinear)]
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")
               and not any(k.startswith(q) for q in quantized)]
    if unexpected or missing:
        raise ValueError(f"GPTQ checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


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
    from safetensors.torch import save_file

    from qlinear import BCQLinear, QuantLinear

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, shapes = {}, set()
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            if not isinstance(mod, BCQLinear):
                raise ValueError(f"layer {name!r} is a {type(mod).__name__}: GPTQ checkpoints hold uniform int codes")
            shapes.add((mod.config.bits, mod.config.group(mod.in_features) if mod.config.group_size != -1 else -1,
                        mod.config.act_order))
            for k, v in mod.to_gptq(checkpoint_format).items():
                tensors[f"{name}.{k}"] = v
    if len({s[:2] for s in shapes}) > 1:
        raise ValueError(f"GPTQ checkpoints have one bits/group_size for every layer; got {sorted(shapes)}")
    if not shapes:
        raise ValueError("the model has no quantized layers")
    bits, group_size = next(iter(shapes))[:2]
    quantized = [name + "." for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    for key, v in model.state_dict().items():
        if not any(key.startswith(q) for q in quantized):
            tensors[key] = v.detach().cpu().contiguous()
    seen = {}
    for k, v in list(tensors.items()):  # tied weights: keep the first name of a shared tensor
        if v.data_ptr() in seen and v.numel():
            del tensors[k]
        else:
            seen[v.data_ptr()] = k
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                     "desc_act": any(s[2] for s in shapes), "sym": False,
                                     "checkpoint_format": checkpoint_format}
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
