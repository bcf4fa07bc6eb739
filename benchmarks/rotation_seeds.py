"""Issue 27: does choosing each layer's rotation seed by its calibration error lower the perplexity?

    python benchmarks/rotation_seeds.py --seeds 0,1,2,3 --hessians /tmp/h.pt     # codebook 4-bit g96, ~15 min

Quantizes SmolLM2-135M once per seed (README's quality setup: 128 Lee documents of calibration, perplexity on the first
4096 tokens of gensim's Wikipedia excerpt), measures every layer's activation-weighted error
``tr(E·H·Eᵀ) / tr(W·H·Wᵀ)`` (``E = W − Ŵ``, ``H`` the calibration Hessian, Ŵ in the layer's input coordinates), then
evaluates two assembled models: each layer with its own lowest-error seed, and one seed per group of layers that read
the same input (q/k/v, gate/up: the transform of x stays shared).  With ``--unrotated`` it compares rotated against
unrotated the same way instead of seeds.
"""

from __future__ import annotations

import argparse
import collections
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qlinear
from qlinear import QLinearConfig
from qlinear.evaluation import calibration_texts, perplexity, quantize_fresh, smollm2_checkpoint, wikipedia_text


def layer_errors(model, reference: dict, hessians: dict) -> dict[str, float]:
    """``{name: tr(E·H·Eᵀ) / tr(W·H·Wᵀ)}`` of every QuantLinear of ``model`` in float64."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, qlinear.QuantLinear):
            w, h = reference[name].weight.detach().double(), hessians[name].double()
            e = w - mod.dequantize(torch.float64)
            out[name] = float(torch.einsum("ij,jk,ik->", e, h, e) / torch.einsum("ij,jk,ik->", w, h, w))
    return out


def input_group(name: str) -> str:
    """Layers that read the same input share a group: a decoder block's q/k/v, and its gate/up."""
    for members, tag in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
        parent, _, leaf = name.rpartition(".")
        if leaf in members:
            return f"{parent}.{tag}"
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="codebook")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=96)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--unrotated", action="store_true", help="candidates: unrotated and seed 0, not seeds")
    ap.add_argument("--hessians", help="cache file for the calibration Hessians (loaded if present, else written)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.hessians and os.path.exists(args.hessians):
        hessians = torch.load(args.hessians)
    else:
        hessians = qlinear.calibrate(load(), calibration_texts(128), tok, max_length=512)
        if args.hessians:
            torch.save(hessians, args.hessians)
    text = wikipedia_text()
    ppl = lambda m: perplexity(m, tok, text, max_tokens=4096, window=512, batch_size=8)
    reference = dict(load().named_modules())

    opts = {"error_feedback": True} if args.format != "bcq" else {"method": "gptq", "act_order": True}
    candidates = ({"unrotated": {}, "seed 0": {"rotation": "hadamard"}} if args.unrotated else
                  {f"seed {s}": {"rotation": "hadamard", "rotation_seed": int(s)} for s in args.seeds.split(",")})
    models, errors = {}, {}
    for label, rot in candidates.items():
        cfg = QLinearConfig(args.format, bits=args.bits, group_size=args.group_size, **opts, **rot)
        models[label] = quantize_fresh(load, cfg, calibration_data=hessians).model
        errors[label] = layer_errors(models[label], reference, hessians)
        print(f"{label}: perplexity {ppl(models[label]):.2f}", flush=True)

    names = sorted(errors[next(iter(errors))])
    modules = {label: dict(m.named_modules()) for label, m in models.items()}
    first = next(iter(candidates))
    best = {n: min(candidates, key=lambda c: errors[c][n]) for n in names}
    print("layers whose error is lowest with each candidate:", dict(collections.Counter(best.values())))
    mean = sum(errors[best[n]][n] / errors[first][n] for n in names) / len(names)
    print(f"mean error of each layer's best candidate relative to {first}: {mean:.4f}")
    block0 = [n for n in names if n.startswith("model.layers.0.")]
    print("first decoder block's errors: " + "; ".join(
        f"{n.rsplit('.', 1)[1]} " + " / ".join(f"{errors[c][n]:.5f}" for c in candidates) for n in block0)
        + f" ({' / '.join(candidates)})")
    groups = collections.defaultdict(list)
    for n in names:
        groups[input_group(n)].append(n)
    by_group = {n: min(candidates, key=lambda c: sum(errors[c][m] for m in ms)) for ms in groups.values() for n in ms}
    for label, choice in (("each layer's best", best), ("each input group's best", by_group)):
        model = models[first]
        for n in names:
            parent, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent), leaf, modules[choice[n]][n])
        print(f"{label}: perplexity {ppl(model):.2f}", flush=True)


if __name__ == "__main__":
    main()
