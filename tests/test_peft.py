"""LoRA with PEFT on qlinear models (issue 26, item 1): PEFT's public API alone wraps every targeted QuantLinear; a
zero-initialised adapter leaves the logits bit-identical; training moves the adapters and never the packed weights;
adapters save and reload onto a freshly loaded model with identical logits; merging re-quantizes; unsupported LoRA
variants raise.  Tiny random Llama models on the CPU (no hub)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qlinear
from qlinear import QLinearConfig, QuantLinear
from conftest import dense64

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

FORMATS = {
    "bcq_rtn": dict(format="bcq", bits=4, group_size=32, init="uniform", iters=0),
    "bcq_free": dict(format="bcq", bits=3, group_size=32),
    "mixed": dict(format="mixed", group_size=32),
    "codebook": dict(format="codebook", group_size=32),
    "bcq_rtn_rotated": dict(format="bcq", bits=4, group_size=32, init="uniform", iters=0, rotation="hadamard"),
}
VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
pytestmark = pytest.mark.usefixtures("reference_on_cpu")


def _float_model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _quantized(fmt, seed=0):
    model = _float_model(seed)
    qlinear.replace_linear(model, QLinearConfig(**FORMATS[fmt]), progress=False)
    return model


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).logits


def _packed(model):
    return [t.clone() for m in model.modules() if isinstance(m, QuantLinear) for t in m.packed()]


def _train(model, steps=25, lr=3e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(TOKENS, labels=TOKENS).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_lora_trains_saves_reloads_and_merges(fmt, tmp_path):
    model = _quantized(fmt)
    before, packed = _logits(model), _packed(model)
    pm = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"], r=4, lora_alpha=8))
    wrapped = [n for n, m in pm.named_modules() if type(m).__name__ == "LoraQuantLinear"]
    assert len(wrapped) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in wrapped)
    assert torch.equal(_logits(pm), before)  # lora_B starts at zero: the quantized layer's output, bit for bit
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    losses = _train(pm)
    assert losses[-1] < losses[0] - 0.25, losses  # a random tiny model: ~0.5 nats lower after 25 steps
    after = _packed(pm)
    assert len(after) == len(packed) and all(torch.equal(a, b) for a, b in zip(after, packed))

    trained = _logits(pm)
    pm.save_pretrained(tmp_path / "adapter")
    again = PeftModel.from_pretrained(_quantized(fmt), tmp_path / "adapter")
    assert torch.equal(_logits(again), trained)

    # merging: Ŵ of the merged layer is the re-quantized W + B·A·scaling (closer to it than the unmerged Ŵ is)
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.get_base_layer()
    w0 = dense64(base.format, base.canonical(), base.config, base.out_features, base.in_features)
    target = w0 + layer.get_delta_weight("default").double()
    merged = pm.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj
    assert type(q) is type(base) and not any(type(m).__name__ == "LoraQuantLinear" for m in merged.modules())
    w1 = dense64(q.format, q.canonical(), q.config, q.out_features, q.in_features)
    assert (w1 - target).norm() < 0.8 * (w0 - target).norm()


def test_all_linear_targets_every_quantized_layer():
    model = _quantized("bcq_rtn")
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    pm = get_peft_model(model, LoraConfig(target_modules="all-linear", r=2))
    wrapped = [m for m in pm.modules() if type(m).__name__ == "LoraQuantLinear"]
    assert n_quant == 14 and len(wrapped) == n_quant
    assert all(isinstance(m.get_base_layer(), QuantLinear) for m in wrapped)
    # a quantized output layer stays out, as PEFT leaves a float one out
    model = _float_model()
    qlinear.replace_linear(model, QLinearConfig(**FORMATS["bcq_rtn"]), modules_to_not_convert=[], progress=False)
    assert isinstance(model.lm_head, QuantLinear)
    pm = get_peft_model(model, LoraConfig(target_modules="all-linear", r=2))
    assert type(pm.base_model.model.lm_head) is type(model.lm_head)
    assert sum(type(m).__name__ == "LoraQuantLinear" for m in pm.modules()) == 14


def test_bias_free_layers_and_float_layers_mix():
    """A model where some Linear layers stay float: PEFT wraps those with its own LoRA Linear, ours with ours."""
    model = _float_model()
    qlinear.replace_linear(model, QLinearConfig(**FORMATS["bcq_rtn"]), modules_to_not_convert=["down_proj"],
                           progress=False)
    pm = get_peft_model(model, LoraConfig(target_modules=["q_proj", "down_proj"], r=2))
    kinds = {type(m).__name__ for n, m in pm.named_modules() if n.endswith(("q_proj", "down_proj"))}
    assert kinds == {"LoraQuantLinear", "Linear"}
    _train(pm, steps=2)


@pytest.mark.parametrize("kw,match", [(dict(use_dora=True), "DoraLinearVariant"),
                                      (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'")])
def test_lora_variants_that_need_the_dense_weight_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        get_peft_model(_quantized("bcq_rtn"), LoraConfig(target_modules=["q_proj"], r=2, **kw))


def test_safe_merge_of_a_broken_adapter_raises():
    pm = get_peft_model(_quantized("bcq_rtn"), LoraConfig(target_modules=["q_proj"], r=2, init_lora_weights=False))
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaNs detected"):
        pm.merge_and_unload(safe_merge=True)


@pytest.mark.slow
def test_trainer_with_gradient_checkpointing_on_a_loaded_checkpoint(tmp_path):
    """transformers' Trainer accepts the quantized model (the quantizer is trainable) with gradient checkpointing;
    the adapter saved from it reloads onto a model freshly loaded from the qlinear checkpoint, logits identical."""
    _float_model().save_pretrained(tmp_path / "fp")
    qcfg = QLinearConfig(**FORMATS["bcq_rtn"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=qcfg)
    model.save_pretrained(tmp_path / "q")
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    pm = get_peft_model(model, LoraConfig(target_modules="all-linear", r=4, lora_alpha=8))
    data = [{"input_ids": t, "labels": t} for t in TOKENS]
    args = TrainingArguments(tmp_path / "run", max_steps=30, per_device_train_batch_size=4, learning_rate=3e-2,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=pm, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.25, losses
    pm.eval()
    pm.save_pretrained(tmp_path / "adapter")
    fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "q"), tmp_path / "adapter")
    assert torch.equal(_logits(fresh), _logits(pm))


def test_qlinear_never_imports_peft_and_hooks_it_in_either_order():
    code = ("import sys, qlinear; assert 'peft' not in sys.modules; import peft; "
            "from qlinear.integrations import peft as p; assert p._INSTALLED")
    subprocess.run([sys.executable, "-c", code], check=True)
    code = ("import peft, qlinear; from qlinear.integrations import peft as p; assert p._INSTALLED")
    subprocess.run([sys.executable, "-c", code], check=True)
