"""QLoRA-style fine-tuning of a qlinear model with PEFT: SmolLM2-135M quantized on load, LoRA adapters trained with
transformers' Trainer on gensim's Lee news corpus, perplexity on the Wikipedia excerpt before and after.

    python examples/finetune_lora.py                      # BCQ 4-bit g64, 100 steps of 4x64 tokens
    python examples/finetune_lora.py --format mixed --steps 50 --merge

The packed weights stay frozen (only ``lora_A``/``lora_B`` train); the adapter is saved, reloaded onto a freshly
loaded copy of the quantized checkpoint, and checked to give the same logits.  ``--merge`` also merges it into the
quantized layers (dequantize, add, quantize again: a fresh rounding error, see ``qlinear.integrations.peft``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import qlinear  # noqa: F401  (registers the quantizer and the PEFT support)
from qlinear import QLinearConfig
from qlinear.evaluation import calibration_texts, perplexity, smollm2_checkpoint, wikipedia_text

FORMATS = {"bcq": dict(format="bcq", bits=4, group_size=64), "rtn": dict(format="bcq", bits=4, group_size=64,
                                                                           init="uniform", iters=0),
           "mixed": dict(format="mixed"), "codebook": dict(format="codebook")}


def _blocks(tokenizer, texts: list[str], length: int) -> list[dict[str, torch.Tensor]]:
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    n = len(ids) // length
    t = torch.tensor(ids[: n * length]).view(n, length)
    return [{"input_ids": row, "labels": row} for row in t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=list(FORMATS), default="bcq", help="quantization (default: BCQ 4-bit g64)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8; lora_alpha = 2r)")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    ap.add_argument("--seq-len", type=int, default=64, help="training block length in tokens (default 64)")
    ap.add_argument("--batch", type=int, default=4, help="blocks per step (default 4)")
    ap.add_argument("--eval-tokens", type=int, default=2048, help="Wikipedia tokens for perplexity (default 2048)")
    ap.add_argument("--merge", action="store_true", help="also merge the adapter into the quantized layers")
    ap.add_argument("--out", help="folder for the quantized checkpoint and the adapter (default: a temp folder)")
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="qlinear_lora_"))
    src = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QLinearConfig(**FORMATS[args.format]))
    model.save_pretrained(out / "quantized")
    text = wikipedia_text()
    ppl0 = perplexity(model, tok, text, max_tokens=args.eval_tokens, batch_size=4)

    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(target_modules="all-linear", r=args.rank, lora_alpha=2 * args.rank,
                                             lora_dropout=0.05, task_type="CAUSAL_LM"))
    model.print_trainable_parameters()
    data = _blocks(tok, calibration_texts(300, min_chars=1), args.seq_len)
    targs = TrainingArguments(str(out / "run"), max_steps=args.steps, per_device_train_batch_size=args.batch,
                              learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=10, report_to=[],
                              save_strategy="no", use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    t = time.time()
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()
    seconds = time.time() - t
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    model.eval()
    ppl1 = perplexity(model, tok, text, max_tokens=args.eval_tokens, batch_size=4)

    model.save_pretrained(out / "adapter")
    fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "quantized"), out / "adapter")
    probe = torch.tensor([data[0]["input_ids"][:32].tolist()])
    with torch.no_grad():
        same = torch.equal(fresh(probe).logits, model(probe).logits)
    print(f"format {args.format}: {args.steps} steps in {seconds:.0f} s, training loss {losses[0]:.3f} (first 10 "
          f"steps) -> {losses[-1]:.3f} (last 10)")
    print(f"Wikipedia perplexity ({args.eval_tokens} tokens): {ppl0:.2f} before, {ppl1:.2f} with the adapter")
    print(f"adapter saved to {out / 'adapter'}; reloaded onto a fresh load of {out / 'quantized'}: "
          f"{'identical' if same else 'DIFFERENT'} logits")
    if args.merge:
        merged = model.merge_and_unload()
        ppl2 = perplexity(merged, tok, text, max_tokens=args.eval_tokens, batch_size=4)
        print(f"merged and re-quantized: perplexity {ppl2:.2f}")


if __name__ == "__main__":
    main()
