"""Issue 27: where an uncalibrated rotation loses on SmolLM2 -- per-layer output errors, unrotated against rotated.

    python benchmarks/rotation_layer_errors.py --hessians H.pt      # the calibration Hessians quality.py caches

For each layer, ``‖(Ŵ − W)·x‖`` on the first token of the first ``--tokens`` Wikipedia tokens (the one that carries the
model's massive activation) and the median over the others, for RTN 3-bit g128 (no calibration) and, with
``--hessians``, GPTQ 3-bit g128 act_order (error feedback on the rotated Hessian), each with ``rotation="none"`` and
``"hadamard"``; reference backend, float64 errors.  README, "Rotation (issue 27)", quotes the 2026-11-27 run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

from qlinear import QLinearConfig  # noqa: E402
from qlinear.evaluation import smollm2_checkpoint, wikipedia_text  # noqa: E402
from qlinear.modules import module_class  # noqa: E402

LAYERS = ["model.layers.2.mlp.down_proj", "model.layers.3.self_attn.v_proj", "model.layers.10.self_attn.v_proj",
          "model.layers.20.self_attn.v_proj", "model.layers.3.self_attn.o_proj", "model.layers.3.self_attn.q_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hessians", help="quality.py's cached calibration Hessians (adds the GPTQ columns)")
    args = ap.parse_args()
    path = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(wikipedia_text()[:20000], return_tensors="pt").input_ids[:, :args.tokens]
    modules, inputs = dict(model.named_modules()), {}
    hooks = [modules[n].register_forward_pre_hook(lambda mod, a, n=n: inputs.__setitem__(n, a[0][0].double()))
             for n in LAYERS]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    hessians = torch.load(args.hessians) if args.hessians else None
    methods = {"RTN": dict(init="uniform", iters=0)}
    if hessians is not None:
        methods["GPTQ"] = dict(method="gptq", act_order=True)
    rows = []
    for name in LAYERS:
        lin, x = modules[name], inputs[name]
        row = [name.removeprefix("model."), f"{x[0].norm():.1f} / {x[1:].norm(dim=1).median():.2f}"]
        for method, opts in methods.items():
            for rot in ("none", "hadamard"):
                cfg = QLinearConfig("bcq", bits=3, group_size=128, rotation=rot, **opts)
                h = hessians[name] if method == "GPTQ" else None
                w = module_class("bcq").from_linear(lin, cfg, h, backend="reference").dequantize(torch.float64)
                e = x @ (w - lin.weight.double()).T
                row.append(f"{e[0].norm():.3f} / {e[1:].norm(dim=1).median():.3f}")
        rows.append(row)
    cols = [f"{m} {r} error (first / median)" for m in methods for r in ("unrotated", "rotated")]
    print(table(["layer", "‖x‖ (first / median)", *cols], rows))


if __name__ == "__main__":
    main()
