"""Issue 27 experiment: a QuaRot-style rotation of the whole residual stream, on top of (or instead of) the
per-layer input rotation that ``rotation="hadamard"`` gives.

    python benchmarks/residual_rotation.py [--rows rtn4,rtn3,codebook4-rot] [--max-tokens 4096]

QuaRot (Ashkboos et al. 2024, section 4) folds each RMSNorm's weight γ into the linear layers that read its output,
then turns the residual stream by an orthogonal R: the embedding becomes ``E·Rᵀ``, every layer that reads the stream
(q/k/v, gate/up, lm_head) ``W·diag(γ)·Rᵀ``, every layer that writes it (o_proj, down_proj) ``R·W``. The float
model computes the same function (the script prints the largest logit difference), but the weights that are
quantized change: an outlier row of a writer, such as the one that writes SmolLM2's massive activation, is
spread over all rows. R here is the randomized Hadamard of the hidden size that ``rotation="hadamard"`` would use
on a 576-input layer (``qlinear.formats.rotation.rotate``, seed 0).

Each row quantizes a fresh SmolLM2-135M twice, as it is and with the residual stream turned, and prints both
perplexities (the README's protocol: the first ``--max-tokens`` tokens of gensim's Wikipedia excerpt, 512-token
windows). Calibrated rows calibrate each model on its own inputs (128 Lee documents).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qlinear
from qlinear import QLinearConfig
from qlinear.evaluation import calibration_texts, perplexity, smollm2_checkpoint, wikipedia_text
from qlinear.formats import rotation

# name: (label, config, calibrated)
ROWS = {"rtn4": ("RTN 4-bit g128", QLinearConfig("bcq", bits=4, group_size=128, init="uniform", iters=0), False),
        "rtn3": ("RTN 3-bit g128", QLinearConfig("bcq", bits=3, group_size=128, init="uniform", iters=0), False),
        "codebook4-rot": ("Codebook 4-bit g96, error feedback, Hadamard-rotated layers",
                          QLinearConfig("codebook", bits=4, group_size=96, error_feedback=True, rotation="hadamard"),
                          True)}


@torch.no_grad()
def rotate_residual(model, seed: int = 0):
    """Turn a Llama-style transformers model's residual stream by the randomized Hadamard ``R`` of its hidden size,
    with every RMSNorm weight folded into the layers that read it (QuaRot, section 4); in place, float64 math.

    The tied ``lm_head`` is untied (``config.tie_word_embeddings = False``): it takes the final norm's weight.
    """
    m = model.model
    block = rotation.block_size(model.config.hidden_size)

    def turn(w):  # w·Rᵀ, [*, hidden]
        return rotation.rotate(w.double(), seed, block)

    def read(lin, norm):  # lin reads norm's output: W·diag(γ)·Rᵀ
        lin.weight.copy_(turn(lin.weight.double() * norm.weight.double()))

    if model.lm_head.weight is m.embed_tokens.weight:
        model.lm_head.weight = torch.nn.Parameter(m.embed_tokens.weight.detach().clone())
        model.config.tie_word_embeddings = False
    m.embed_tokens.weight.copy_(turn(m.embed_tokens.weight))
    for layer in m.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            read(lin, layer.input_layernorm)
        for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
            read(lin, layer.post_attention_layernorm)
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):  # writes the stream: R·W
            lin.weight.copy_(turn(lin.weight.double().T).T)
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    read(model.lm_head, m.norm)
    m.norm.weight.fill_(1.0)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--max-tokens", type=int, default=4096)
    args = ap.parse_args()
    torch.manual_seed(0)
    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = wikipedia_text()

    plain, turned = load(), rotate_residual(load())
    ids = tok(text[:4000], return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        diff = (plain(ids).logits - turned(ids).logits).abs().max().item()
    print(f"float model, residual stream turned: largest logit difference {diff:.2e}; perplexity "
          f"{perplexity(plain, tok, text, max_tokens=args.max_tokens):.2f} / "
          f"{perplexity(turned, tok, text, max_tokens=args.max_tokens):.2f}; layer 2's down_proj max |w| "
          f"{plain.model.layers[2].mlp.down_proj.weight.abs().max():.2f} / "
          f"{turned.model.layers[2].mlp.down_proj.weight.abs().max():.2f}", flush=True)
    print("| row | configuration | perplexity | with the residual stream turned |\n|---|---|---|---|")
    for name in args.rows.split(","):
        label, cfg, calibrated = ROWS[name]
        ppl = []
        for turn in (False, True):
            t = time.time()
            model = rotate_residual(load()) if turn else load()
            cal = (qlinear.calibrate(model, calibration_texts(128), tok, max_length=512, progress=False)
                   if calibrated else None)
            qlinear.replace_linear(model, cfg, calibration_data=cal, progress=False)
            ppl.append(perplexity(model, tok, text, max_tokens=args.max_tokens))
            print(f"  ({name}, turned={turn}: {ppl[-1]:.2f}, {time.time() - t:.0f} s)", flush=True)
        print(f"| {name} | {label} | {ppl[0]:.2f} | {ppl[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
