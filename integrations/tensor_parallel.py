"""Megatron-style tensor parallelism for transformers decoders whose linear layers may be quantized, with the
act_order handling of "TP-Aware Dequantization" (Alg. 2 "naive" and Alg. 3 "tp_aware").

:func:`parallelize` shards every decoder layer of a Llama-style model over a ``torch.distributed`` group:
q/k/v and gate/up are column-parallel (output features split; whole attention heads per rank, GQA
key/value heads split the same way), o_proj and down are row-parallel (input features split) followed by
one all-reduce; embeddings, norms and lm_head stay replicated.  Quantized layers are sliced in their
packed form (codes, scales, codebooks), never dequantized; an input split must fall on a group boundary.

act_order layers are stored reordered (contiguous groups plus ``perm``, :mod:`qlinear.formats.bcq`).  For
a column-parallel layer that is free (every rank gathers its full input by ``perm``).  For the row-parallel
down projection with permutation P2 the rank owns stored positions ``[r·I/W, (r+1)·I/W)``:

* ``naive`` (Alg. 2): gate/up keep their natural output split, so down's input shard must be gathered:
  all-gather Y1, index it by P2's shard, then the local matmul and the all-reduce.
* ``tp_aware`` (Alg. 3): gate and up (SwiGLU: both the same) take as their output rows exactly P2's shard,
  so each rank's Y1 already is down's input shard: no all-gather.

Attention: o_proj's input is the concatenation of heads, and a global act_order permutation mixes
channels of different heads, so no offline permutation of q/k/v can put a rank's heads in o_proj's stored
order.  The scheme used here needs no all-gather for layers quantized by qlinear: quantize o_proj with
``static_groups=True`` (GPTQ still processes columns in act_order, but groups stay in input order, so the
row split is the natural one; ``per_module={"*o_proj": ...}``).  Its cost, measured on SmolLM2-135M at
4-bit g128: perplexity 27.62 against 27.77 with act_order everywhere (README).  An imported o_proj with a
global permutation falls back to gathering the attention output (counted in :data:`STATS`).

transformers' own tensor-parallel loading (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=W))``)
of a saved qlinear checkpoint goes through :func:`check_tp_plan` and :func:`load_shards` (before any weight is
read: each rank reads only its slices) or, for checkpoints qlinear cannot index, :func:`shard_loaded` (after a
full load), called by the qlinear quantizer; :func:`plan_shards` decides the slices for both, and they are cut
with the same helpers as :func:`parallelize`.

Source: Megatron-LM (Shoeybi et al. 2019) for the layer split; "TP-Aware Dequantization" (Hoque et al. 2024)
for the act_order algorithms.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from qlinear.formats import get_format
from qlinear.formats.base import check_input_split

__all__ = ["parallelize", "shard_rows", "shard_inputs", "RowParallel", "STATS", "check_tp_plan", "plan_shards",
           "load_shards", "finish_load_shards", "shard_loaded", "add_gather_hooks"]

STATS = {"all_gather": 0, "all_reduce": 0, "bytes": 0}  # collectives issued by this process since import


def _quant():
    from qlinear import BCQLinear, CodebookLinear, QuantLinear

    return QuantLinear, BCQLinear, CodebookLinear


def _sliceable(layer):
    """The format module of a QuantLinear ``layer`` that can be sliced; ValueError if its format cannot."""
    fmt = get_format(layer.format)
    if not hasattr(fmt, "slice_rows"):
        raise ValueError(f"{type(layer).__name__} cannot be sharded (its scales are packed across rows)")
    return fmt


def _rows_packed(layer, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical packed tensors of a QuantLinear restricted to output features ``rows``."""
    return _sliceable(layer).slice_rows(layer.canonical(), layer.config, rows)


def shard_rows(layer: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The layer restricted to output features ``rows`` (int64 ``[n]``, any order): a new layer of the same
    class with ``out_features = n``, packed data sliced without dequantizing.

    Raises:
        ValueError: a layer type that cannot be sliced (MixedPrecisionLinear).
    """
    QuantLinear = _quant()[0]
    bias = None if layer.bias is None else layer.bias[rows]
    if not isinstance(layer, QuantLinear):
        out = nn.Linear(layer.in_features, len(rows), bias=bias is not None, device="meta", dtype=layer.weight.dtype)
        out.weight = nn.Parameter(layer.weight.detach()[rows].clone(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return out
    return type(layer).from_packed(_rows_packed(layer, rows), layer.in_features, len(rows), layer.config, bias,
                                   backend=layer.backend)


def _inputs_packed(layer, start: int, end: int):
    """``(canonical packed tensors, config)`` of a QuantLinear restricted to stored input positions
    ``[start, end)``; ValueError if a bound splits a quantization group."""
    return _sliceable(layer).slice_inputs(layer.canonical(), layer.config, layer.out_features, layer.in_features,
                                          start, end)


def shard_inputs(layer: nn.Module, start: int, end: int) -> nn.Module:
    """The layer restricted to stored input positions ``[start, end)`` (for an act_order layer the stored order
    is ``perm``'s; the result has no ``perm``: its input is ``x[..., perm[start:end]]``), bias dropped (a
    row-parallel layer adds it once after the all-reduce).

    Raises:
        ValueError: ``start``/``end`` not on a quantization group boundary, or an unsliceable layer type.
    """
    QuantLinear = _quant()[0]
    if not isinstance(layer, QuantLinear):
        out = nn.Linear(end - start, layer.out_features, bias=False, device="meta", dtype=layer.weight.dtype)
        out.weight = nn.Parameter(layer.weight.detach()[:, start:end].clone(), requires_grad=False)
        return out
    packed, cfg = _inputs_packed(layer, start, end)
    return type(layer).from_packed(packed, end - start, layer.out_features, cfg, backend=layer.backend)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:  # torch's differentiable one: its backward sums the ranks' parts
        from torch.distributed.nn.functional import all_gather

        parts = list(all_gather(x.contiguous(), group=group))
    else:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
    STATS["all_gather"] += 1
    STATS["bytes"] += x.numel() * x.element_size() * (len(parts) - 1)
    return torch.cat(parts, -1)


class _CopyToParallel(torch.autograd.Function):
    """Megatron's ``f`` before a column-parallel layer: the identity forward; backward, the input's gradient summed over
    the ranks (each rank's shard of the layer gives only its part of it).  The row-parallel all-reduce needs no such
    operator: its output feeds the same loss on every rank, so its input's gradient is the output's, as autograd
    already computes."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        STATS["all_reduce"] += 1
        STATS["bytes"] += grad.numel() * grad.element_size()
        return grad, None


def _column_input_hook(group):
    """A forward pre-hook (``with_kwargs``) putting :class:`_CopyToParallel` on a module's input (its first argument, or
    ``hidden_states`` given by name, as transformers calls attention): once per input that column shards share."""
    def hook(module, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not (isinstance(x, torch.Tensor) and torch.is_grad_enabled() and x.requires_grad):
            return None  # inference (and frozen inputs) skip the autograd node
        x = _CopyToParallel.apply(x, group)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
    return hook


class RowParallel(nn.Module):
    """Row-parallel linear: ``y = all_reduce(local(x_local)) + bias``; with ``gather`` (naive act_order, or an
    imported act_order o_proj) the rank's input is first all-gathered and indexed by ``gather``."""

    def __init__(self, local: nn.Module, bias: Optional[torch.Tensor], group, gather: Optional[torch.Tensor] = None):
        super().__init__()
        self.local, self.group = local, group
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer("gather", gather, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather is not None:
            x = _all_gather(x, self.group).index_select(-1, self.gather)
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        STATS["all_reduce"] += 1
        STATS["bytes"] += y.numel() * y.element_size()
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _perm(layer) -> Optional[torch.Tensor]:
    QuantLinear = _quant()[0]
    if isinstance(layer, QuantLinear) and "perm" in layer.buffer_specs:
        return layer.canonical()["perm"].long()
    return None


def parallelize(model: nn.Module, group=None, mode: str = "tp_aware") -> nn.Module:
    """Shard ``model`` (a transformers Llama-style causal LM: ``model.model.layers[i].self_attn.{q,k,v,o}_proj``
    and ``.mlp.{gate,up,down}_proj``) over ``group`` (default: the world) in place and return it.  Gradients of the
    float parameters (adapters, norms, embeddings) are those of the unsharded model: the attention's and the MLP's
    inputs all-reduce their gradient in backward (Megatron's ``f``) and all-gathers are differentiable.

    Args:
        mode: "tp_aware" (no all-gather for act_order down projections) or "naive" (Alg. 2).

    Raises:
        ValueError: an unknown mode, a world size that does not divide the attention heads, key/value heads or
            the MLP width, or a shard boundary inside a quantization group (checked for every layer before
            any module is replaced, so a failure leaves the model as it was).
        RuntimeError: torch.distributed is not initialised.
    """
    if mode not in ("tp_aware", "naive"):
        raise ValueError(f"mode must be 'tp_aware' or 'naive', got {mode!r}")
    if not dist.is_initialized():
        raise RuntimeError("parallelize needs torch.distributed initialised (init_process_group)")
    W, r = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    I = cfg.intermediate_size
    for what, n in (("num_attention_heads", H), ("num_key_value_heads", Hkv), ("intermediate_size", I)):
        if n % W:
            raise ValueError(f"world size {W} does not divide {what}={n}")
    q_rows = torch.arange(r * H // W * hd, (r + 1) * H // W * hd)
    kv_rows = torch.arange(r * Hkv // W * hd, (r + 1) * Hkv // W * hd)
    i0, i1 = r * I // W, (r + 1) * I // W
    plan = []  # (parent, name, new module): built for every layer first, assigned only if all succeed
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plan += [(attn, "q_proj", shard_rows(attn.q_proj, q_rows)), (attn, "k_proj", shard_rows(attn.k_proj, kv_rows)),
                 (attn, "v_proj", shard_rows(attn.v_proj, kv_rows))]
        o_perm = _perm(attn.o_proj)
        if o_perm is None:
            o = RowParallel(shard_inputs(attn.o_proj, q_rows[0].item(), q_rows[-1].item() + 1), attn.o_proj.bias, group)
        else:  # imported global act_order: gather the heads' outputs (see the module docstring)
            n = H * hd // W
            o = RowParallel(shard_inputs(attn.o_proj, r * n, (r + 1) * n), attn.o_proj.bias, group,
                            gather=o_perm[r * n:(r + 1) * n])
        plan.append((attn, "o_proj", o))
        p2 = _perm(mlp.down_proj)
        if p2 is not None and mode == "tp_aware":
            rows, gather = p2[i0:i1], None
        else:
            rows, gather = torch.arange(i0, i1), (None if p2 is None else p2[i0:i1])
        plan += [(mlp, "gate_proj", shard_rows(mlp.gate_proj, rows)), (mlp, "up_proj", shard_rows(mlp.up_proj, rows)),
                 (mlp, "down_proj", RowParallel(shard_inputs(mlp.down_proj, i0, i1), mlp.down_proj.bias, group, gather))]
    for parent, name, new in plan:
        setattr(parent, name, new)
    for layer in model.model.layers:  # the column shards' shared inputs: q/k/v's and gate/up's
        for region in (layer.self_attn, layer.mlp):
            region.register_forward_pre_hook(_column_input_hook(group), with_kwargs=True)
    return model


# transformers' own tensor-parallel loading -------------------------------------------------------------------------
TP_STYLES = ("colwise", "rowwise")  # the transformers plan styles a quantized layer can take


def _plan_style(name: str, plan: dict[str, str]) -> Optional[str]:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return plan.get(replace_layer_number_by_wildcard(name))


def check_tp_plan(model: nn.Module, plan: dict[str, str], world: int) -> None:
    """Check, before any weight is read, that every quantized layer a transformers ``tp_plan`` names can be split
    ``world`` ways (the meta model's shapes suffice).

    Raises:
        ValueError: a quantized layer under a style other than "colwise"/"rowwise", a format that cannot be
            sliced (MixedPrecisionLinear), a world size that does not divide its output (colwise) or input
            (rowwise) features, or an input shard that splits a quantization group.
    """
    QuantLinear = _quant()[0]
    problems = []
    for name, mod in model.named_modules():
        style = _plan_style(name, plan) if isinstance(mod, QuantLinear) else None
        if style is None:
            continue
        size = mod.out_features if style == "colwise" else mod.in_features
        try:
            if style not in TP_STYLES:
                output = mod is model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else False
                raise ValueError(f"style {style!r}: quantized layers take 'colwise' or 'rowwise' only" + (
                    "; a quantized output layer cannot load tensor-parallel through transformers: load the checkpoint "
                    "in one process and split it with qlinear.tensor_parallel.parallelize (which keeps the output "
                    "layer whole on every rank), or quantize it again with a float lm_head" if output else ""))
            if size % world:
                raise ValueError(f"world size {world} does not divide its {size} "
                                 f"{'output' if style == 'colwise' else 'input'} features")
            _sliceable(mod)
            if style == "rowwise":
                check_input_split(mod.out_features, mod.in_features, mod.config, 0, size // world)
        except ValueError as e:
            problems.append(f"{name}: {e}")
    if problems:
        raise ValueError("cannot shard these quantized layers for tensor parallelism (keep them in float with "
                         "modules_to_not_convert, or choose another tp_size):\n  " + "\n  ".join(problems))


def _gather_hook(index: torch.Tensor, group):
    def hook(module, args):
        x = _all_gather(args[0], group)
        return (x.index_select(-1, index.to(x.device)),) + tuple(args[1:])
    return hook


def plan_shards(model: nn.Module, plan: dict[str, str], world: int, rank: int, perm_of) -> dict[str, tuple]:
    """What rank ``rank`` of ``world`` keeps of every quantized layer a transformers ``tp_plan`` names:
    ``{name: ("rows", rows)}`` for "colwise" layers and ``{name: ("inputs", start, end, gather)}`` for "rowwise"
    ones, ``gather`` being the ``perm`` block to index the all-gathered input by, or None.

    "colwise" takes a contiguous block of output features and "rowwise" one of stored inputs.  act_order, as in
    :func:`parallelize` "tp_aware": where a "rowwise" ``down_proj`` holds a permutation P2 and its sibling
    ``gate_proj``/``up_proj`` are quantized, "colwise" and bias-free, they take P2's block as their rows and
    down needs no gather.  Any other row-parallel act_order layer (an imported o_proj, a down_proj next to float
    or biased gate/up, whose bias transformers shards in natural order) gathers (Alg. 2).

    Args:
        perm_of: ``perm_of(name)`` -> the layer's act_order permutation (int64 ``[K]``) or None.

    Raises:
        ValueError: as :func:`check_tp_plan`.
    """
    QuantLinear = _quant()[0]
    check_tp_plan(model, plan, world)
    mods = dict(model.named_modules())
    styles = {n: s for n, m in mods.items() if isinstance(m, QuantLinear) and (s := _plan_style(n, plan))}
    perms = {n: perm_of(n) for n, s in styles.items() if s == "rowwise"}
    rows_of, aware = {}, set()
    for name, style in styles.items():
        parent, _, leaf = name.rpartition(".")
        p2 = perms[name] if (style, leaf) == ("rowwise", "down_proj") else None
        sibs = [f"{parent}.gate_proj", f"{parent}.up_proj"]
        if p2 is not None and all(styles.get(s) == "colwise" and mods[s].bias is None for s in sibs):
            n = mods[name].in_features // world
            rows_of.update(dict.fromkeys(sibs, p2[rank * n:(rank + 1) * n]))
            aware.add(name)
    specs = {}
    for name, style in styles.items():
        mod = mods[name]
        if style == "colwise":
            n = mod.out_features // world
            specs[name] = ("rows", rows_of.get(name, torch.arange(rank * n, (rank + 1) * n)))
        else:
            n = mod.in_features // world
            perm = perms[name]
            gather = None if perm is None or name in aware else perm[rank * n:(rank + 1) * n]
            specs[name] = ("inputs", rank * n, (rank + 1) * n, gather)
    return specs


def _local_layer(layer, spec: tuple, backend: Optional[str]):
    """The slice ``spec`` (of :func:`plan_shards`) of QuantLinear ``layer``, without bias."""
    if spec[0] == "rows":
        return type(layer).from_packed(_rows_packed(layer, spec[1]), layer.in_features, len(spec[1]), layer.config,
                                       backend=backend)
    packed, cfg = _inputs_packed(layer, spec[1], spec[2])
    return type(layer).from_packed(packed, spec[2] - spec[1], layer.out_features, cfg, backend=backend)


def add_gather_hooks(model: nn.Module, specs: dict[str, tuple], group) -> None:
    """Register the Alg. 2 input all-gather on the row-parallel layers of ``specs`` that need one."""
    for name, spec in specs.items():
        if spec[0] == "inputs" and spec[3] is not None:
            model.get_submodule(name).register_forward_pre_hook(_gather_hook(spec[3], group))


def shard_loaded(model: nn.Module, plan: dict[str, str], group) -> dict[str, tuple]:
    """Shard, in place, the quantized layers of a model transformers loaded with a tensor-parallel plan while
    every rank holds the full packed tensors (the qlinear quantizer's fallback when it could not read the shards
    from safetensors files itself, :func:`load_shards`).  Each QuantLinear keeps its module object
    (transformers' "colwise"/"rowwise" forward wrappers sit on it and do the communication through its
    ``_hf_quantized_needs_local_tp`` local path) and takes over its slice (:func:`plan_shards`), cut by the same
    helpers as :func:`parallelize`.  Returns the specs.

    Raises:
        ValueError: as :func:`check_tp_plan`.
    """
    mods = dict(model.named_modules())
    specs = plan_shards(model, plan, dist.get_world_size(group), dist.get_rank(group), lambda n: _perm(mods[n]))
    for name, spec in specs.items():
        mods[name].adopt(_local_layer(mods[name], spec, mods[name].backend))
    add_gather_hooks(model, specs, group)
    return specs


def load_shards(model: nn.Module, plan: dict[str, str], world: int, rank: int, read) -> dict[str, tuple]:
    """Before transformers loads the weights: give each quantized layer a tensor-parallel plan names only its
    slice (:func:`plan_shards`), read from the checkpoint one layer at a time, so a rank never holds more than its
    shards plus one full layer.  The sliced buffers are left out of the layers' state dicts for the duration of
    the load, so transformers skips the checkpoint's full tensors (the caller ignores them as unexpected keys and
    calls :func:`finish_load_shards` afterwards).  Returns the specs, for :func:`add_gather_hooks`.

    Args:
        read: ``read(name, buffers)`` -> the full canonical packed tensors ``buffers`` of layer ``name``, by name.

    Raises:
        ValueError: as :func:`check_tp_plan`.
    """
    mods = dict(model.named_modules())

    def perm_of(name):
        return read(name, ["perm"])["perm"].long() if "perm" in mods[name].buffer_specs else None

    specs = plan_shards(model, plan, world, rank, perm_of)
    for name, spec in specs.items():
        meta = mods[name]
        full = type(meta).from_packed(read(name, list(meta.buffer_specs)), meta.in_features, meta.out_features, meta.config, backend="reference")
        meta.adopt(_local_layer(full, spec, meta.backend))
        meta.packed_in_state_dict = False
    return specs


def finish_load_shards(model: nn.Module, specs: dict[str, tuple], device) -> None:
    """After loading: the layers :func:`load_shards` sliced move to ``device`` and show their packed buffers in
    their state dicts again."""
    for name in specs:
        mod = model.get_submodule(name)
        mod.packed_in_state_dict = True
        mod.to(device)
