"""Issue 27: how close to the unquantized model can an uncalibrated 4-bit g64 quantizer get on SmolLM2-135M?

    python benchmarks/uncalibrated_bound.py            # four rows, about 10 min on 2 cores

Without calibration data a quantizer can only fit the weights themselves.  This script compares, per group of 64
inputs of every decoder Linear (README's quality setup: perplexity on the first 4096 tokens of gensim's Wikipedia
excerpt, 512-token windows, no calibration):

* ``bcq``: the BCQ 4-bit g64 fit the library stores (``qlinear.formats.bcq.fit``: 16 levels ``Σ ±α_i + c`` from 5
  fp16 numbers per group, alternating least squares);
* ``lloyd``: 16 *free* levels per group, Lloyd's algorithm (k-means in one dimension) started from the BCQ levels, so
  never a worse fit of the weights.  It needs 16 fp16 levels per group (8 bits/weight in all): not a format, an
  estimate of what fitting 16 levels per group of 64 to the weights can buy (Lloyd's optimum is local, and a lower
  weight error does not always give a lower perplexity);
* each also in the rotated basis (``--rotation``): the groups of ``W·Rᵀ`` (the library's randomized Hadamard,
  seed 0), turned back with ``R`` before evaluation.

Each row puts ``Ŵ`` into the float model (the reference backend's math, without kernels) and prints the relative
weight error ``‖W − Ŵ‖/‖W‖`` over all layers and the perplexity, also as a ratio to the unquantized model's
(measured first, in the same run).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qlinear.evaluation import perplexity, smollm2_checkpoint, wikipedia_text
from qlinear.formats import bcq, rotation

GROUP = 64


def bcq_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels ``[G, 16]``, codes ``[G, 64]``) of the library's BCQ 4-bit fit of groups ``w`` ``[G, 64]``."""
    alpha, offset, codes = bcq.fit(w, torch.ones_like(w), bcq.Config(bits=4, group_size=GROUP))
    return bcq.levels(alpha, offset), codes


def lloyd_groups(w: torch.Tensor, rounds: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's algorithm on each group's 16 levels, started from the BCQ fit (a level that loses every weight stays)."""
    lv, codes = bcq_groups(w)
    ones = torch.ones_like(w)
    for _ in range(rounds):
        total = torch.zeros_like(lv).scatter_add_(1, codes, w)
        count = torch.zeros_like(lv).scatter_add_(1, codes, ones)
        lv = torch.where(count > 0, total / count.clamp(min=1), lv)
        new = bcq.nearest(lv, w)
        if torch.equal(new, codes):
            break
        codes = new
    return lv, codes


FITS = {"bcq": bcq_groups, "lloyd": lloyd_groups}


def quantized(weight: torch.Tensor, fit, rotated: bool) -> torch.Tensor:
    """``Ŵ`` of ``weight`` ``[N, K]`` fitted group by group, in the layer's own input basis."""
    w = weight.detach().float()
    seed_block = rotation.params(bcq.Config(rotation="hadamard"), w.shape[1]) if rotated else None
    if seed_block:
        w = rotation.rotate(w, *seed_block)
    lv, codes = fit(w.reshape(-1, GROUP))
    w_hat = lv.gather(1, codes).reshape(w.shape)
    return rotation.rotate(w_hat, *seed_block, inverse=True) if seed_block else w_hat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fits", default="bcq,lloyd", help="comma list of: " + ", ".join(FITS))
    ap.add_argument("--rotation", default="none,hadamard", help="comma list of: none, hadamard")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    text = wikipedia_text()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    original = {n: m.weight.detach().clone() for n, m in layers}
    unquantized = perplexity(model, tokenizer, text, max_tokens=args.max_tokens, batch_size=4)
    print(f"unquantized: perplexity {unquantized:.2f}\n")
    print("| fit | rotation | ‖W − Ŵ‖/‖W‖ | perplexity | vs unquantized | seconds |\n|---|---|---|---|---|---|")
    for fit in args.fits.split(","):
        for rot in args.rotation.split(","):
            t = time.time()
            err = norm = 0.0
            for name, mod in layers:
                w_hat = quantized(original[name], FITS[fit], rot == "hadamard")
                err += float((original[name].float() - w_hat).square().sum())
                norm += float(original[name].float().square().sum())
                mod.weight.data.copy_(w_hat)
            ppl = perplexity(model, tokenizer, text, max_tokens=args.max_tokens, batch_size=4)
            print(f"| {fit} | {rot} | {(err / norm) ** 0.5:.4f} | {ppl:.2f} | {ppl / unquantized:.3f}x | "
                  f"{time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
