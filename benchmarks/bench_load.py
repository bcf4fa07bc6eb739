"""What checkpoint integrity costs: ``from_pretrained`` of a saved qlinear SmolLM2-135M with and without the
CRC-32 pass of every tensor with a saved sum and the finiteness pass of the packed ones
(``QLinearHfQuantizer._verify_packed``), alternated in one run.

    python benchmarks/bench_load.py                      # BCQ 4-bit g64, 5 loads each
    python benchmarks/bench_load.py --format mixed --repeats 7

Prints the median load time of each, the verification's share, and the packed bytes it reads.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import qlinear
from qlinear import QLinearConfig
from qlinear.evaluation import smollm2_checkpoint
from qlinear.integrations.transformers.quantizer import QLinearHfQuantizer

FORMATS = {"bcq": dict(format="bcq", bits=4, group_size=64, init="uniform", iters=0), "mixed": dict(format="mixed"),
           "codebook": dict(format="codebook"), "bcq-free": dict(format="bcq", iters=0),
           "bcq3": dict(format="bcq", bits=3, group_size=64, init="uniform", iters=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=list(FORMATS), default="bcq")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    out = tempfile.mkdtemp(prefix="qlinear_load_")
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), quantization_config=QLinearConfig(
        **FORMATS[args.format]))
    model.save_pretrained(out)
    packed = sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, qlinear.QuantLinear)
                 for t in m.canonical().values())
    del model
    verify = QLinearHfQuantizer._verify_packed
    times = {"verified": [], "unverified": []}
    for _ in range(args.repeats):
        for kind in times:
            QLinearHfQuantizer._verify_packed = verify if kind == "verified" else (lambda self, model, sums: None)
            start = time.perf_counter()
            AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            times[kind].append(time.perf_counter() - start)
    QLinearHfQuantizer._verify_packed = verify
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.format}: {packed / 2 ** 20:.1f} MiB of packed tensors; from_pretrained median of {args.repeats}: "
          f"{med['verified']:.3f} s verified, {med['unverified']:.3f} s without the check "
          f"({100 * (med['verified'] / med['unverified'] - 1):+.1f} %)")


if __name__ == "__main__":
    main()
