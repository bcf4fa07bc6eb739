"""End-to-end distillation of a quantized model's continuous quantization parameters, codes fixed.

Source: EfficientQAT (Chen et al. 2024, §3.3 "E2E-QP": only the quantization parameters are trained end to end,
the integer weights frozen); the loss is the token-level KL divergence to the float model, as in AQLM's and
PV-tuning's global fine-tuning (Egiazarian et al. 2024, §3.4).  GPTQ's error feedback fits each layer to its own
inputs; this pass fits all layers together to the model's output, which is what perplexity measures.

What is trained is, per format, the floating-point buffers its dequantization is linear in (the format module's
``TUNABLE``: group scales, BCQ's α and offsets, the mixed format's second-order scales and outlier values).
Codes, zero points, codebooks, permutations and the rotation are not touched, so the stored format, its bits per
weight and every kernel layout stay as they were.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from .calibration import Data, _batches, eval_mode
from .formats import get_format
from .modules import QuantLinear

__all__ = ["finetune"]


class _Tuning(nn.Module):
    """Stands in for a :class:`QuantLinear` while it is tuned: ``Ŵ`` from the format's reference ``dequantize``
    with each tunable buffer as ``b0 + θ·|b0|`` (θ trained, starting at 0: Adam then moves every value by about
    ``lr`` of its own size per step, whatever its scale).  Entries that are 0 move relative to their row's mean
    magnitude instead."""

    def __init__(self, layer: QuantLinear):
        super().__init__()
        self.layer = layer
        self.fmt = get_format(layer.format)
        self.fixed = layer.canonical()
        names = [n for n in self.fmt.TUNABLE if n in self.fixed and self.fixed[n].numel()]
        self.start = {n: self.fixed[n].to(torch.float32) for n in names}
        self.unit = {}
        for n, b in self.start.items():
            row = b.abs().mean(-1, keepdim=True) if b.dim() else b.abs()
            self.unit[n] = torch.where(b != 0, b.abs(), row.clamp(min=torch.finfo(torch.float16).tiny))
        self.theta = nn.ParameterDict({n: nn.Parameter(torch.zeros_like(b)) for n, b in self.start.items()})

    def values(self) -> dict[str, torch.Tensor]:
        return {n: self.start[n] + self.theta[n] * self.unit[n] for n in self.start}

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fmt.dequantize({**self.fixed, **self.values()}, self.layer.config, self.layer.out_features,
                                self.layer.in_features)
        return nn.functional.linear(x, w.to(x.dtype), self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Ŵ dequantized again in the backward pass instead of kept: memory holds one layer's dense weight at a time
        return checkpoint(self._linear, x, use_reentrant=False)

    @torch.no_grad()
    def stored(self) -> dict[str, torch.Tensor]:
        """The tuned buffers rounded to their stored dtypes.  Raises ValueError on a non-finite value."""
        out = {}
        for n, v in self.values().items():
            v = v.to(self.fixed[n].dtype)
            if not torch.isfinite(v).all():
                raise ValueError(f"{self.layer.format} buffer {n!r} became non-finite during finetune; lower lr")
            out[n] = v
        return out


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _logits(out) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out).float()


def _loss(model: nn.Module, teacher: Optional[nn.Module], ids: torch.Tensor, teacher_device) -> torch.Tensor:
    """Summed over the tokens of ``ids`` ``[n, T]``: KL(teacher ‖ model), or without a teacher the next-token
    cross-entropy."""
    logits = _logits(model(ids))
    if teacher is None:
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    with torch.no_grad():
        target = _logits(teacher(ids.to(teacher_device))).to(logits.device)
    if target.shape != logits.shape:
        raise ValueError(f"teacher logits {list(target.shape)} do not match the model's {list(logits.shape)}: use "
                         f"the float model of the same checkpoint")
    return nn.functional.kl_div(logits.log_softmax(-1), target.log_softmax(-1), log_target=True, reduction="sum")


def finetune(model: nn.Module, data: Data, tokenizer=None, *, teacher: Optional[nn.Module] = None, steps: int = 80,
             batch_size: int = 2, lr: float = 2e-3, max_length: int = 512, seed: int = 0,
             progress: bool = True) -> list[float]:
    """Tune the continuous quantization parameters of every :class:`QuantLinear` in ``model`` (module docstring) by
    Adam with a cosine schedule, the codes fixed, then write them back into the layers' packed buffers.

    Args:
        model: a quantized causal LM (after :func:`qlinear.replace_linear`) whose forward takes token ids
            ``[1, T]`` int64 and returns logits ``[1, T, V]`` (or an output with ``.logits``).
        data: texts (with ``tokenizer``) or int64 token ids, as :func:`qlinear.calibrate` takes them; use text
            disjoint from what you evaluate on.
        teacher: the float model to distil from (same vocabulary), e.g. a second copy loaded from the same
            checkpoint; loss = KL(teacher ‖ model) per token.  None: next-token cross-entropy on ``data``.
        steps: optimizer steps; each sees ``batch_size`` sequences (cycling through ``data`` in an order drawn
            from ``seed``).
        lr: Adam's learning rate, as a fraction of each parameter's initial size (defaults measured on
            SmolLM2-135M, README).

    Returns:
        The mean loss per token of each step (nats), ``[steps]``.

    Memory and time: a step's sequences of equal length run as one batch ``[n, T]`` (self-generated data always
    do): a teacher forward and a forward and backward of the model, each quantized layer's float32 ``Ŵ``
    dequantized in both passes and held only while that layer runs.  Activation memory is that of full
    fine-tuning at that batch; weight memory that of one dense layer.

    Raises:
        ValueError: no QuantLinear in ``model``, ``steps``/``batch_size``/``lr`` not positive, token ids outside
            the vocabulary, a one-token sequence without ``teacher``, a layer offloaded by accelerate (disk/cpu
            offload) or still empty, ``teacher`` that is ``model`` itself or has another vocabulary size, or a
            tuned value that is not finite.  On any error (and on an interrupt) the model is left as it was.
        TypeError: bad ``data`` or ``max_length`` (see :func:`qlinear.calibrate`), ``steps``/``batch_size``/``seed``
            not ints, ``lr`` not a number, ``teacher`` not a module.
    """
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (steps, batch_size, seed)) \
            or isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"steps, batch_size and seed must be ints and lr a float, got {steps!r}, {batch_size!r}, "
                        f"{seed!r}, {lr!r}")
    if teacher is not None and not isinstance(teacher, nn.Module):
        raise TypeError(f"teacher must be the float model (an nn.Module) or None, got {type(teacher).__name__}")
    if steps < 1 or batch_size < 1 or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"steps, batch_size and lr must be positive, got {steps}, {batch_size}, {lr}")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not layers:
        raise ValueError("finetune needs a quantized model: no QuantLinear found (run qlinear.replace_linear first)")
    away = [n for n, m in layers if any(t.is_meta for t in m.packed()) or (m.bias is not None and m.bias.is_meta)]
    if away:
        raise ValueError(f"finetune needs every quantized layer's tensors in memory, but {len(away)} are offloaded "
                         f"or not loaded (first: {away[0]}): load the model onto one device without offload")
    if teacher is model:
        raise ValueError("teacher must be a separate float model (e.g. loaded again from the same checkpoint)")
    if teacher is not None:  # a smaller teacher vocabulary would fail inside its embedding, before the logits check
        vocab = [getattr(m.get_input_embeddings(), "num_embeddings", None) if hasattr(m, "get_input_embeddings")
                 else None for m in (model, teacher)]
        if None not in vocab and vocab[0] != vocab[1]:
            raise ValueError(f"teacher has a vocabulary of {vocab[1]} tokens, the model {vocab[0]}: distil from the "
                             "float model of the same checkpoint")
    batches = _batches(data, tokenizer, max_length, model)
    if teacher is None and min(ids.shape[1] for ids in batches) < 2:
        raise ValueError("without a teacher each sequence needs at least 2 tokens (the loss predicts the next one)")
    device = layers[0][1].packed()[0].device
    tuning = [(n, _Tuning(m)) for n, m in layers]
    params = [p for _, t in tuning for p in t.theta.values()]
    if not params:
        raise ValueError("the quantized layers have no tunable buffers")
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    teacher_device = next(teacher.parameters()).device if teacher is not None else None
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed))
    losses = []
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        for n, t in tuning:
            _swap(model, n, t)
        # no dropout: the teacher's and the student's forward must match where the weights do
        with eval_mode(model, teacher):
            opt = torch.optim.Adam(params, lr=lr)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
            for step in tqdm(range(steps), desc="finetune", disable=not progress):
                opt.zero_grad(set_to_none=True)
                total = 0.0
                picked = [batches[order[(step * batch_size + j) % len(batches)]] for j in range(batch_size)]
                count = sum(ids.shape[0] * (ids.shape[1] - (teacher is None)) for ids in picked)
                same_length = {}
                for ids in picked:
                    same_length.setdefault(ids.shape[1], []).append(ids)
                for group in same_length.values():
                    loss = _loss(model, teacher, torch.cat(group).to(device), teacher_device)
                    (loss / count).backward()
                    total += loss.item()
                if not math.isfinite(total):
                    raise ValueError(f"finetune loss became non-finite at step {step}; lower lr")
                opt.step()
                sched.step()
                losses.append(total / count)
        new = {n: t.stored() for n, t in tuning}  # every value checked before any layer changes
    finally:
        for n, t in tuning:
            _swap(model, n, t.layer)
        for p, flag in frozen:
            p.requires_grad_(flag)
    for n, t in tuning:
        t.layer.load_packed({**t.fixed, **new[n]})
    return losses
