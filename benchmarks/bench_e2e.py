"""End-to-end decode benchmark: a Llama-2-7B-shaped model (random weights, no download), fp16 vs BCQ 4/3-bit.

    python benchmarks/bench_e2e.py [--variants fp16,bcq4,bcq3] [--batches 1,16,64] [--prompt 128] [--new 128]
                                   [--layers 32] [--markdown out.md]

Per variant and batch: prefill time of the prompt, decode throughput (tokens/s over all sequences, from
``generate`` with 128 and with 1 new tokens: ``batch·(new − 1) / (t_new − t_1)``) and peak GPU memory, with a
static KV cache and ``torch.compile(mode="reduce-overhead")`` on the forward (CUDA graphs).  BCQ layers hold
round-to-nearest int codes (group 128) with random values: timing does not depend on them, and quantizing
7B parameters would take longer than the benchmark.  Greedy text equality of compiled and eager decoding
is checked by tests/test_quick.py and tests/test_cuda_lut.py on a SmolLM2-shaped model.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import report, table, uniform_bcq_sets  # noqa: E402

from qlinear import BCQLinear  # noqa: E402


def quantize_randomly(model: torch.nn.Module, bits: int, group_size: int = 128, device: str = "cuda") -> None:
    """Replace every decoder ``nn.Linear`` (not lm_head) by a BCQLinear holding random uniform codes."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and child_name != "lm_head":
                N, K = child.out_features, child.in_features
                cfg, (packed,) = uniform_bcq_sets(N, K, bits, group_size, "", 1, device=device)
                names = list(BCQLinear(K, N, False, cfg, device="meta").buffer_specs)
                setattr(mod, child_name, BCQLinear.from_packed(dict(zip(names, packed)), K, N, cfg, child.bias))
                del child
    torch.cuda.empty_cache()


def run(model, batch: int, prompt: int, new: int) -> tuple[float, float]:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(2):  # compile and capture the graphs of both phases
        timed(1), timed(4)
    t1, tn = timed(1), timed(new)
    return t1, batch * (new - 1) / (tn - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="fp16,bcq4,bcq3")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-2-7B)")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=args.layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.date.today()}; Llama-2-7B shape, "
            f"{args.layers} layers, prompt {args.prompt}, {args.new} new tokens, static cache, reduce-overhead")
    print(head, flush=True)
    rows, base = [], {}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.float16).eval()
        if variant.startswith("bcq"):
            quantize_randomly(model, int(variant[3:]))
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        for batch in map(int, args.batches.split(",")):
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                prefill, tps = run(model, batch, args.prompt, args.new)
            if variant == "fp16":
                base[batch] = tps
            rows.append([variant, batch, prefill * 1e3, tps, tps / base[batch] if batch in base else float("nan"),
                         torch.cuda.max_memory_allocated() / 2 ** 30])
            print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    text = head + "\n\n" + table(["model", "batch", "prefill (ms)", "decode tokens/s", "x fp16", "peak GiB"], rows)
    report(text, args.markdown)


if __name__ == "__main__":
    main()
