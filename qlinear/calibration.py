"""Calibration: per-layer ``H = XᵀX / n`` of the inputs each ``nn.Linear`` sees.

Collected with forward hooks (as GPTQ does, Frantar et al. 2022 §4), in float32 on the layer's
device; memory is ``[K, K]`` per layer (plus the inputs of the batch in flight) whatever the amount
of data, and layers that see the same input tensor (q/k/v, gate/up) share one matrix.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["calibrate"]

Data = Union[Sequence[str], Sequence[torch.Tensor], torch.Tensor]


def _batches(data: Data, tokenizer, max_length: int) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        data = [data]
    out = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise TypeError("calibration texts need a tokenizer: calibrate(model, texts, tokenizer=...)")
            ids = tokenizer(item, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
        elif isinstance(item, torch.Tensor) and not item.is_floating_point():
            ids = item if item.dim() == 2 else item.reshape(1, -1)
            ids = ids[:, :max_length]
        else:
            raise TypeError(f"calibration data must be texts or integer token-id tensors, got {type(item).__name__}"
                            + (f" of {item.dtype}" if isinstance(item, torch.Tensor) else ""))
        if ids.numel():
            out.append(ids)
    if not out:
        raise ValueError("calibration data is empty")
    return out


@torch.no_grad()
def calibrate(model: nn.Module, data: Data, tokenizer=None, *, max_length: int = 512,
              modules: Optional[Iterable[str]] = None, progress: bool = True) -> dict[str, torch.Tensor]:
    """Run ``model`` on ``data`` and return ``{linear name: H [K, K] float32}``, ``H = XᵀX / n``
    over the ``n`` input rows each Linear saw.

    Args:
        data: texts (with ``tokenizer``), or int64 token ids ``[T]`` / ``[B, T]`` (a tensor or a list).
        max_length: tokens per sample (longer samples are truncated).
        modules: names of the Linear layers to collect (default: all).

    Raises:
        TypeError: texts without a tokenizer, or data of another type.  ValueError: empty data.
    """
    wanted = None if modules is None else set(modules)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and (wanted is None or n in wanted)}
    if wanted is not None and wanted - set(linears):
        raise ValueError(f"not Linear layers of the model: {sorted(wanted - set(linears))}")
    H: dict[str, torch.Tensor] = {}
    count: dict[str, int] = {}
    seen: dict[int, tuple[torch.Tensor, str]] = {}

    def hook(name):
        def fn(mod, args):
            x = args[0]
            key = id(x)
            if key in seen and seen[key][0] is x:  # same input as an earlier layer: share its matrix
                H[name] = H[seen[key][1]]
                count[name] = count[seen[key][1]]
                return
            x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            if name not in H:
                H[name] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
                count[name] = 0
            H[name].addmm_(x2.T, x2)
            count[name] += x2.shape[0]
            seen[key] = (x, name)
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    was_training = model.training
    model.eval()
    try:
        dev = next(model.parameters()).device
        for ids in tqdm(_batches(data, tokenizer, max_length), desc="calibrate", disable=not progress):
            seen.clear()
            # counts of shared matrices must advance once per batch: recompute after the batch
            model(ids.to(dev))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {}
    norm = {}
    for name, h in H.items():
        key = id(h)
        if key not in norm:
            norm[key] = h / max(count[name], 1)
        out[name] = norm[key]
    return out
