"""The ``qlinear`` command line (also ``python -m qlinear`` and ``optimum-cli qlinear``).

    qlinear quantize SRC OUT [--format bcq --bits 4 --group-size 64 --option method=gptq ...] [--calibration FILE]
                             [--finetune-steps 80]
    qlinear convert SRC OUT
    qlinear eval MODEL --text FILE [--max-tokens 4096 --window 512]
    qlinear info MODEL [--batch 1 --dtype float32]

``quantize`` reads a transformers checkpoint folder and writes a qlinear one (safetensors + config.json with
``quant_method="qlinear"``, plus the tokenizer); ``convert`` writes a GPTQ or AWQ checkpoint folder as a qlinear one
with the same weights (:func:`qlinear.load_gptq`, :func:`qlinear.load_awq`), which ``from_pretrained`` then loads;
``eval`` prints perplexity over non-overlapping windows of a text file (:func:`qlinear.evaluation.perplexity`);
``info`` prints per layer the format, stored bits and bytes, and the kernel and layout this machine would use, with
why the kernels ranked before it cannot.  ``eval`` and ``info`` also read GPTQ and AWQ folders directly.

Exit status: 0 on success, 2 for a command-line error (argparse's convention), 1 when the work fails for a reason
the message gives (a missing or damaged checkpoint, a config the format rejects): ``qlinear: error: ...`` on stderr,
no traceback.  Options follow transformers' and optimum's CLIs (``--dtype``, ``--trust-remote-code``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

DTYPES = ("float32", "float16", "bfloat16")


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value): VALUE parsed as JSON (numbers, true/false, lists) or else kept a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key = key.replace("-", "_")
    own = {"bits": "--bits", "group_size": "--group-size", "format": "--format", "modules_to_not_convert": "--skip"}
    if key in own:
        raise argparse.ArgumentTypeError(f"{key} has its own option: use {own[key]}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _folder(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a transformers checkpoint folder (no config.json)")
    return path


def _text_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such text file: {text!r}")
    return path


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def parser() -> argparse.ArgumentParser:
    """The argument parser of every command (also what ``--help`` prints)."""
    p = argparse.ArgumentParser(prog="qlinear", description="Quantize transformers checkpoints with qlinear, score "
                                "them, and show what each layer stores and which kernel runs it.",
                                epilog="'qlinear COMMAND --help' documents each command's options.  Also runs as "
                                       "'python -m qlinear' and 'optimum-cli qlinear'.")
    sub = p.add_subparsers(dest="command", required=True, metavar="{quantize,convert,eval,info}")

    q = sub.add_parser("quantize", help="quantize a transformers checkpoint folder into a qlinear one",
                       description="Quantize every nn.Linear of SRC (except --skip patterns and lm_head) and save "
                                   "the qlinear checkpoint and the tokenizer to OUT.")
    q.add_argument("src", type=_folder, help="transformers checkpoint folder (float weights)")
    q.add_argument("out", type=Path, help="output folder (created; existing files are overwritten)")
    q.add_argument("--format", default="bcq", choices=("bcq", "mixed", "codebook"), help="format (default bcq)")
    q.add_argument("--bits", type=_positive, help="bits per weight code (default: the format's, bcq 4)")
    q.add_argument("--group-size", type=int, help="inputs per group, -1 for one group per row (default: the format's)")
    q.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="another format option, repeatable, e.g. --option method=gptq --option act_order=true "
                        "(see qlinear.formats.<format>.Config)")
    q.add_argument("--skip", action="append", default=None, metavar="PATTERN",
                   help="module-name pattern kept in full precision, repeatable (lm_head is always kept unless "
                        "--lm-head-bits)")
    q.add_argument("--lm-head-bits", type=int, choices=(8,), metavar="8",
                   help="quantize lm_head too (a tied one gets its own copy), round-to-nearest per row: 8 bits cost "
                        "SmolLM2-135M 0.1%% perplexity and save its float32 output layer's ~10 ms per CPU decode step "
                        "(4 bits per group cost 6-17%%; default: lm_head kept in full precision)")
    q.add_argument("--calibration", type=_text_file, metavar="FILE",
                   help="calibration text, documents separated by blank lines (GPTQ, activation-aware fits)")
    q.add_argument("--calibration-samples", type=_positive, default=128,
                   help="documents of FILE used, or sequences generated without FILE (default 128)")
    q.add_argument("--calibration-length", type=_positive,
                   help="tokens per document (default 512), or per generated sequence (default 256)")
    q.add_argument("--finetune-steps", type=_positive, metavar="N",
                   help="after quantizing, distil the stored scales from the float model for N steps "
                        "(qlinear.finetune; 80 in the README's table) on the calibration text, or without "
                        "--calibration on sequences the float model samples itself (qlinear.generate_data)")
    q.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the float weights loaded "
                                                                      "(default float32)")
    q.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")

    c = sub.add_parser("convert", help="write a GPTQ or AWQ checkpoint folder as a qlinear one (same weights)",
                       description="Load SRC (quant_method 'gptq' or 'awq' in its config.json) into exact qlinear "
                                   "layers and save the qlinear checkpoint and the tokenizer, if SRC has one, to OUT.")
    c.add_argument("src", type=_folder, help="GPTQ (AutoGPTQ/GPTQModel) or AWQ (AutoAWQ) checkpoint folder")
    c.add_argument("out", type=Path, help="output folder (created; existing files are overwritten)")
    c.add_argument("--dtype", choices=DTYPES, default="float16", help="dtype of the float weights (default float16)")

    e = sub.add_parser("eval", help="perplexity of a (qlinear or float) checkpoint on a text file",
                       description="Perplexity over non-overlapping windows of the first --max-tokens tokens of "
                                   "--text, each window scored without earlier context.")
    e.add_argument("model", type=_folder, help="checkpoint folder (qlinear, GPTQ, AWQ or float)")
    e.add_argument("--text", type=_text_file, required=True, help="UTF-8 text file")
    e.add_argument("--max-tokens", type=_positive, default=4096, help="tokens scored (default 4096)")
    e.add_argument("--window", type=_positive, default=512, help="tokens per window (default 512)")
    e.add_argument("--batch-size", type=_positive, default=1, help="windows per forward pass (default 1)")
    e.add_argument("--dtype", choices=DTYPES, help="dtype of the float parts (default: the checkpoint's; GPTQ and "
                                                   "AWQ: float32)")
    e.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")

    i = sub.add_parser("info", help="per layer: format, bits, stored size, kernel and layout on this machine",
                       description="Load MODEL on the CPU and print one row per quantized layer, then totals.")
    i.add_argument("model", type=_folder, help="qlinear, GPTQ or AWQ checkpoint folder")
    i.add_argument("--batch", type=_positive, default=1, help="rows per call the kernel is chosen for (default 1)")
    i.add_argument("--dtype", choices=DTYPES, default="float32", help="activation dtype (default float32)")
    i.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    return p


def _imported(path: Path) -> Optional[str]:
    """The checkpoint's quant_method when it is "gptq" or "awq" (read by qlinear's own loaders), else None."""
    try:
        method = json.loads((path / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    except (OSError, ValueError, AttributeError):
        return None  # from_pretrained reports it
    return method if method in ("gptq", "awq") else None


def _load(path: Path, dtype: Optional[str], trust: bool, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    import qlinear  # noqa: F401  (the quant_method="qlinear" quantizer)

    method = _imported(path)
    if method:
        return getattr(qlinear, f"load_{method}")(path, dtype=getattr(torch, dtype or "float32"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", trust_remote_code=trust, **kw)


def _quantized(model):
    from qlinear import QuantLinear

    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def _totals(model) -> str:
    layers = _quantized(model)
    if not layers:
        return "no quantized layers"
    weights = sum(m.in_features * m.out_features for m in layers)
    bits = sum(m.bits_per_weight * m.in_features * m.out_features for m in layers) / weights
    return (f"{len(layers)} quantized layers, {weights:,} weights, {bits:.4f} stored bits per weight, "
            f"{bits * weights / 8 / 2 ** 20:.2f} MiB of packed weights (fp16: {weights * 2 / 2 ** 20:.2f} MiB)")


def _quantize(args) -> None:
    import torch
    from transformers import AutoTokenizer

    import qlinear
    from qlinear import QLinearConfig
    from qlinear.integrations.transformers.config import per_module_configs

    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    opts, skip = dict(args.option), ["lm_head", *(args.skip or [])]  # --skip adds to lm_head, never replaces it
    if args.lm_head_bits:
        skip = [p for p in skip if p != "lm_head"]
        head = QLinearConfig("bcq", bits=args.lm_head_bits, group_size=-1, init="uniform", iters=0)
        opts["per_module"] = {"lm_head": head, **per_module_configs(opts.get("per_module"))}  # the first match wins
    config = QLinearConfig(args.format, bits=args.bits, group_size=args.group_size, **opts,
                           modules_to_not_convert=skip)
    try:
        tok = AutoTokenizer.from_pretrained(args.src, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:
        if args.calibration:
            raise ValueError(f"--calibration texts need the tokenizer of {args.src}, which cannot be loaded: {e}") \
                from None
        tok = None  # nothing else needs it: generated fine-tuning data is token ids
    model = _load(args.src, args.dtype, args.trust_remote_code)
    start = time.perf_counter()
    hessians = None
    length = args.calibration_length or (512 if args.calibration else 256)
    if args.calibration:
        docs = [d.strip() for d in args.calibration.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        docs = docs[:args.calibration_samples]
        hessians = qlinear.calibrate(model, docs, tok, max_length=length, progress=not args.no_progress)
    with torch.no_grad():
        qlinear.replace_linear(model, config, calibration_data=hessians, progress=not args.no_progress)
    if args.finetune_steps:
        teacher = _load(args.src, args.dtype, args.trust_remote_code)
        if not args.calibration:
            docs = qlinear.generate_data(teacher, args.calibration_samples, length, progress=not args.no_progress)
        qlinear.finetune(model, docs, tok, teacher=teacher, steps=args.finetune_steps, max_length=length,
                         progress=not args.no_progress)
        del teacher
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    if tok is not None:
        tok.save_pretrained(args.out)
    print(f"quantized {args.src} -> {args.out} in {seconds:.1f} s ({config.format_config().to_json()})"
          + ("" if tok else " (no tokenizer)"))
    print(_totals(model))


def _convert(args) -> None:
    from transformers import AutoTokenizer

    method = _imported(args.src)
    if not method:  # before loading: a float folder would load and convert nothing
        raise ValueError(f"{args.src} is not a GPTQ or AWQ checkpoint (its config.json has no quantization_config "
                         "with quant_method 'gptq' or 'awq'); 'qlinear quantize' quantizes float checkpoints")
    model = _load(args.src, args.dtype, False)
    try:
        tok = AutoTokenizer.from_pretrained(args.src)
    except (OSError, ValueError):
        tok = None
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    if tok is not None:
        tok.save_pretrained(args.out)
    print(f"converted {args.src} ({method.upper()}) -> {args.out}" + ("" if tok else " (no tokenizer)"))
    print(_totals(model))


def _eval(args) -> None:
    from transformers import AutoTokenizer

    from qlinear.evaluation import perplexity

    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model = _load(args.model, args.dtype, args.trust_remote_code)
    text = args.text.read_text(encoding="utf-8")
    start = time.perf_counter()
    ppl = perplexity(model, tok, text, max_tokens=args.max_tokens, window=args.window, batch_size=args.batch_size)
    n = min(len(tok(text, add_special_tokens=False)["input_ids"]), args.max_tokens) // args.window
    print(f"perplexity {ppl:.4f} over {n} windows of {args.window} tokens ({n * (args.window - 1)} predicted "
          f"tokens) in {time.perf_counter() - start:.1f} s")


def _info(args) -> None:
    import torch

    import qlinear

    model = _load(args.model, None, args.trust_remote_code, device_map="cpu")
    if not _quantized(model):
        raise ValueError(f"{args.model} has no qlinear layers (not a qlinear checkpoint?)")
    print(qlinear.describe(model, batch=args.batch, dtype=getattr(torch, args.dtype)))
    print()
    print(_totals(model))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a command; returns the exit status (see the module docstring)."""
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "finetune_steps", None) and not args.calibration and (args.calibration_length or 5) < 5:
        p.error("--calibration-length must be at least 5 for generated sequences (a random, 3 greedy and sampled "
                "tokens)")
    from safetensors import SafetensorError  # a truncated or damaged checkpoint file

    try:
        {"quantize": _quantize, "convert": _convert, "eval": _eval, "info": _info}[args.command](args)
    except (ValueError, TypeError, OSError, ImportError, SafetensorError) as e:
        print(f"qlinear: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
