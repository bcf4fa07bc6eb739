"""Calibration: per-layer ``H = XᵀX / n`` of the inputs each ``nn.Linear`` sees.

Collected with forward hooks (as GPTQ does, Frantar et al. 2022 §4), in float32 on the layer's
device; memory is ``[K, K]`` per layer (plus the inputs of the batch in flight) whatever the amount
of data, and layers that see the same input tensor (q/k/v, gate/up) share one matrix.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["calibrate", "generate_data"]

Data = Union[Sequence[str], Sequence[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def eval_mode(*models: Optional[nn.Module]) -> Iterator[None]:
    """Every module of ``models`` (None skipped) in eval mode inside the block, each submodule's own ``training`` flag
    restored after it, even on an error: ``model.train(was)`` would leave a model whose submodules differ (a frozen
    part in eval mode, say) uniform."""
    flags = [(m, m.training) for model in models if model is not None for m in model.modules()]
    try:
        for model in models:
            if model is not None:
                model.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def max_positions(model: Optional[nn.Module]) -> Optional[int]:
    """The longest sequence ``model`` takes (its config's ``max_position_embeddings``, or ``n_positions`` as GPT-2 names
    it), or None where it does not say: past it a model with learned positions fails with an ``IndexError``."""
    config = getattr(model, "config", None)
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return n if isinstance(n, int) and n > 0 else None


def check_length(model: Optional[nn.Module], length: int, what: str, option: str) -> None:
    """ValueError if ``length`` tokens (``what``, set by the command line's ``option``) exceed :func:`max_positions`."""
    n = max_positions(model)
    if n is not None and length > n:
        raise ValueError(f"{what} of {length} tokens is longer than the model takes ({n} positions): use at most {n} "
                         f"({option} on the command line)")


def _check_loaded(model: nn.Module) -> None:
    """ValueError if a parameter of ``model`` is on the meta device: its forward cannot collect activations."""
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"calibration runs the model, but {meta} is on the meta device (not loaded, or offloaded to "
                         "disk): load the weights first")


def _batches(data: Data, tokenizer, max_length: int, model: Optional[nn.Module] = None) -> list[torch.Tensor]:
    """``data`` as int64 token-id tensors ``[B, T]``, checked against ``model.config.vocab_size`` where it has one, and
    cut to ``max_length`` tokens, or to the model's :func:`max_positions` where that is less."""
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"max_length must be an int, got {max_length!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1 token, got {max_length}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    max_length = min(max_length, max_positions(model) or max_length)
    if isinstance(data, torch.Tensor):
        data = [data]
    if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(f"calibration data must be a list of texts or of token-id tensors, got a "
                        f"{type(data).__name__}" + (" (wrap one text in a list)" if isinstance(data, str) else ""))
    out = []
    for item in data:
        if isinstance(item, str):
            if tokenizer is None:
                raise TypeError("calibration texts need a tokenizer: calibrate(model, texts, tokenizer=...)")
            ids = tokenizer(item, return_tensors="pt", truncation=True, max_length=max_length)["input_ids"]
        elif isinstance(item, torch.Tensor) and item.dtype in (torch.int32, torch.int64):  # what embeddings take
            if item.dim() not in (1, 2):
                raise ValueError(f"a token-id tensor must be [T] or [batch, T], got {list(item.shape)}")
            ids = (item if item.dim() == 2 else item.reshape(1, -1))[:, :max_length]
        else:
            raise TypeError(f"calibration data must be texts or int64/int32 token-id tensors, got {type(item).__name__}"
                            + (f" of {item.dtype}" if isinstance(item, torch.Tensor) else ""))
        if ids.numel():
            if isinstance(vocab, int) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
                raise ValueError(f"token ids must lie in [0, {vocab}) (the model's vocab_size), got "
                                 f"{int(ids.min())}..{int(ids.max())}: made by another model's tokenizer?")
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
        max_length: tokens per sample (longer samples are truncated, and so are those longer than the model's
            ``max_position_embeddings``).
        modules: names of the Linear layers to collect (default: all).

    Raises:
        TypeError: texts without a tokenizer, data of another type (token ids must be int64/int32), or
        ``max_length`` not an int.  ValueError: empty data, a token-id tensor that is not ``[T]`` or ``[batch, T]``,
        ``max_length`` < 1, token ids outside ``[0, model.config.vocab_size)``, or a parameter on the meta device.
    """
    wanted = None if modules is None else set(modules)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and (wanted is None or n in wanted)}
    if wanted is not None and wanted - set(linears):
        raise ValueError(f"not Linear layers of the model: {sorted(wanted - set(linears))}")
    _check_loaded(model)
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
    try:
        with eval_mode(model):
            dev = next(model.parameters()).device
            for ids in tqdm(_batches(data, tokenizer, max_length, model), desc="calibrate", disable=not progress):
                seen.clear()
                # counts of shared matrices must advance once per batch: recompute after the batch
                model(ids.to(dev))
    finally:
        for h in handles:
            h.remove()
    out = {}
    norm = {}
    for name, h in H.items():
        key = id(h)
        if key not in norm:
            norm[key] = h / max(count[name], 1)
        out[name] = norm[key]
    return out


@torch.no_grad()
def generate_data(model: nn.Module, num_samples: int = 128, length: int = 256, *, greedy_tokens: int = 3,
                  batch_size: int = 16, seed: int = 0, progress: bool = True) -> list[torch.Tensor]:
    """Sample ``num_samples`` token sequences from ``model`` itself, for calibration or distillation without any
    user data (LLM-QAT, Liu et al. 2023, §2.1 "data-free distillation": the first token drawn uniformly from the
    vocabulary, the next ``greedy_tokens`` chosen greedily so that a sequence settles on a topic, the rest sampled
    from the model's distribution at temperature 1).  Decoding settings of the checkpoint's ``generation_config``
    (repetition penalty, top-k/top-p, ...) are ignored while sampling; only its token ids are kept.

    Args:
        model: a float transformers causal LM (it needs ``generate`` and ``config.vocab_size``) with its weights in
            memory; the model the quantized one is distilled from, so the samples cover what it knows.
        num_samples: sequences to return.  length: tokens per sequence, the random first token included.
        greedy_tokens: greedy tokens after the first one.  batch_size: sequences generated together.
        seed: draws the first tokens and, with ``batch_size``, the device and the dtype, the samples; the caller's
            random state (CPU and every CUDA device) is left as it was.

    Returns:
        ``num_samples`` int64 tensors ``[1, length]`` on the CPU, usable as ``data`` of :func:`qlinear.finetune`
        and :func:`calibrate`.  End-of-sequence tokens are suppressed until ``length`` (``min_new_tokens``).

    Cost: ``ceil(num_samples / batch_size) x length`` batched decoding steps of ``model`` with its KV cache
    (SmolLM2-135M, 128 x 256 tokens: 304 s on 2 CPU cores, README).

    Raises:
        TypeError: ``model`` without ``generate``/``config.vocab_size`` (not a transformers causal LM), or
            ``num_samples``, ``length``, ``greedy_tokens``, ``batch_size`` or ``seed`` that is not an int.
        ValueError: ``num_samples`` or ``batch_size`` < 1, ``greedy_tokens`` < 0, ``length`` < ``greedy_tokens + 2``
        (no sampled token) or above the model's ``max_position_embeddings``, or embeddings offloaded to the meta
        device.
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not callable(getattr(model, "generate", None)) or not isinstance(vocab, int):
        raise TypeError(f"generate_data needs a transformers causal LM with generate() and config.vocab_size, "
                        f"got {type(model).__name__}")
    ints = {"num_samples": num_samples, "length": length, "greedy_tokens": greedy_tokens, "batch_size": batch_size,
            "seed": seed}
    wrong = [f"{k}={v!r}" for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        raise TypeError(f"generate_data: {', '.join(wrong)} must be ints")
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"generate_data: num_samples and batch_size must be >= 1, got {num_samples}, {batch_size}")
    if greedy_tokens < 0 or length < greedy_tokens + 2:
        raise ValueError(f"generate_data: length must be at least greedy_tokens + 2 = {greedy_tokens + 2} (a random, "
                         f"{greedy_tokens} greedy and at least one sampled token), got length {length}, "
                         f"greedy_tokens {greedy_tokens}")
    check_length(model, length, "generate_data: a length", "--calibration-length")
    from transformers import GenerationConfig

    device = model.get_input_embeddings().weight.device
    if device.type == "meta":
        raise ValueError("generate_data needs the model's weights in memory: load it without disk offload")
    given = model.generation_config
    ids_of = {k: getattr(given, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    pad = next((v for v in (ids_of["pad_token_id"], getattr(model.config, "pad_token_id", None)) if v is not None), 0)
    first = torch.randint(0, vocab, (num_samples, 1), generator=torch.Generator().manual_seed(seed))
    model.generation_config = GenerationConfig(**{**ids_of, "pad_token_id": pad})  # only the token ids kept
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    out = []
    try:
        with eval_mode(model), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            for b in tqdm(range(0, num_samples, batch_size), desc="generate_data", disable=not progress):
                ids = first[b:b + batch_size].to(device)
                if greedy_tokens:
                    ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens)
                ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=length - ids.shape[1],
                                     min_new_tokens=length - ids.shape[1])
                out += [row.reshape(1, -1).cpu() for row in ids]
    finally:
        model.generation_config = given
    return out


class _Captured(Exception):
    pass


def decoder_blocks(model: nn.Module, names: Iterable[str]) -> tuple[str, Optional[nn.ModuleList]]:
    """``(prefix, blocks)``: the ``nn.ModuleList`` of the model holding the most of the Linear layers ``names``
    (a transformers decoder's layer list), or ``("", None)`` if none does."""
    names = list(names)
    best, best_n = ("", None), 0
    for prefix, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1:
            n = sum(1 for x in names if x.startswith(prefix + "."))
            if n > best_n:
                best, best_n = (prefix, mod), n
    return best


@torch.no_grad()
def sequential(model: nn.Module, data: Data, tokenizer, targets: list, quantize, *, max_length: int = 512,
               progress: bool = True) -> dict[str, nn.Module]:
    """GPTQ's sequential calibration with bounded memory: decoder block after block, collect ``H = XᵀX / n`` of
    that block's target Linears only, quantize them with ``quantize(name, module, cfg, H)``, swap them in, and feed
    the quantized block's outputs to the next block.  Memory: one block's Hessians plus the block inputs of the
    calibration batches (``n · T · hidden`` floats).

    Args:
        targets: ``[(name, nn.Linear, cfg)]``.  Layers outside the decoder blocks get Hessians from one pass
            of :func:`calibrate` over the unquantized model.

    Returns:
        ``{name: quantized module}``, already swapped into ``model``.  On an error every swapped module is
        put back, so the model is as it was, and the error is raised.

    Raises:
        Whatever ``quantize`` raises; TypeError/ValueError for bad data (see :func:`calibrate`).
    """
    _check_loaded(model)
    names = [n for n, _, _ in targets]
    prefix, blocks = decoder_blocks(model, names)
    inside = {n for n in names if blocks is not None and n.startswith(prefix + ".")}
    by_name = {n: (m, c) for n, m, c in targets}
    done: dict[str, nn.Module] = {}

    def swap(name, new):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)

    with eval_mode(model):
        try:
            outside = [n for n in names if n not in inside]
            if outside:
                H = calibrate(model, data, tokenizer, max_length=max_length, modules=outside, progress=False)
                for n in outside:
                    done[n] = quantize(n, *by_name[n], H.get(n))
            if blocks is not None:
                inputs = []

                def grab(mod, args, kwargs):
                    inputs.append((args, kwargs))
                    raise _Captured

                handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
                try:
                    dev = next(model.parameters()).device
                    for ids in _batches(data, tokenizer, max_length, model):
                        try:
                            try:
                                model(ids.to(dev), use_cache=False)  # no KV cache: each block runs twice
                            except TypeError:  # not a transformers model
                                model(ids.to(dev))
                        except _Captured:
                            pass
                finally:
                    handle.remove()
                for i, block in enumerate(tqdm(blocks, desc="quantize", disable=not progress)):
                    here = [n for n in names if n.startswith(f"{prefix}.{i}.")]
                    sub = {n: model.get_submodule(n) for n in here}
                    H: dict[str, torch.Tensor] = {}
                    count: dict[str, int] = {}

                    def hook(name):
                        def fn(mod, args):
                            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
                            if name not in H:
                                H[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
                                count[name] = 0
                            H[name].addmm_(x.T, x)
                            count[name] += x.shape[0]
                        return fn

                    handles = [m.register_forward_pre_hook(hook(n)) for n, m in sub.items()]
                    try:
                        for args, kwargs in inputs:
                            block(*args, **kwargs)
                    finally:
                        for h in handles:
                            h.remove()
                    for n in here:
                        new = quantize(n, *by_name[n], H[n] / max(count[n], 1) if n in H else None)
                        swap(n, new.eval())  # eval like the rest of the model meanwhile
                        done[n] = new
                    del H
                    outs = []
                    for args, kwargs in inputs:
                        out = block(*args, **kwargs)
                        out = out[0] if isinstance(out, tuple) else out
                        outs.append(((out,) + tuple(args[1:]), kwargs))
                    inputs = outs
            for n in outside:
                swap(n, done[n])
        except BaseException:
            for n in done:
                swap(n, by_name[n][0])
            raise
    return done
