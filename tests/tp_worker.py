"""One rank of the tensor-parallel tests (run by tests/test_tensor_parallel.py in a subprocess per rank).

usage: python tests/tp_worker.py RANK WORLD PORT OUT_JSON [CHECKPOINT IDS_PT]
Builds the same small Llama in every rank (9 query / 3 key-value heads, like SmolLM2), quantizes it several
ways, runs it unsharded, shards it with qlinear.tensor_parallel.parallelize and compares logits, greedy text
and the number of all-gathers per forward.  Then (world > 1) rank 0 saves quantized checkpoints and every rank
loads them with transformers' own tensor-parallel loading (``distributed_config=DistributedConfig(tp_size=W)``)
and compares with the same checkpoint loaded in one process.  With CHECKPOINT and IDS_PT (a saved token-id
tensor) only that comparison runs, on that checkpoint (the real SmolLM2 test)."""

import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import qlinear
from qlinear import QLinearConfig
from qlinear.integrations import tensor_parallel as tp

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
torch.set_num_threads(1)


def build(quant, heads=None, group_size=32):
    torch.manual_seed(0)
    heads = heads or ((9, 3) if world % 3 == 0 else (8, 4))  # SmolLM2's 9/3 heads at world size 3
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32 * heads[0], intermediate_size=768,
                                         num_hidden_layers=2, num_attention_heads=heads[0], num_key_value_heads=heads[1],
                                         head_dim=32, mlp_bias=quant.endswith("mlp-bias"))).eval()
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(1))
    if quant == "bcq":
        qlinear.replace_linear(model, QLinearConfig("bcq", bits=4, group_size=group_size, iters=1), progress=False)
    elif quant == "codebook":
        qlinear.replace_linear(model, QLinearConfig("codebook", bits=2, group_size=group_size), progress=False)
    elif quant.startswith("gptq"):
        H = qlinear.calibrate(model, [ids[i:i + 1] for i in range(4)], progress=False)
        cfg = QLinearConfig("bcq", bits=4, group_size=group_size, method="gptq", act_order=True)
        per = {"*o_proj": QLinearConfig("bcq", bits=4, group_size=group_size, method="gptq", act_order=True,
                                        static_groups=True)} if quant == "gptq-static-o" else None
        qlinear.replace_linear(model, cfg, per_module=per, calibration_data=H, progress=False)
    return model, ids


results = []
kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
checkpoint_mode = len(sys.argv) > 5
cases = [("none", "tp_aware"), ("bcq", "tp_aware"), ("gptq-static-o", "naive"), ("gptq-static-o", "tp_aware"),
         ("gptq", "tp_aware")]


def parallelize_cases():
    """qlinear.tensor_parallel.parallelize on models in memory: logits, greedy text, all-gathers, bad input."""
    for quant, mode in cases:
        model, ids = build(quant)
        ref = model(ids).logits
        ref_gen = model.generate(ids[:1], **kw)
        tp.parallelize(model, mode=mode)
        before = dict(tp.STATS)
        logits = model(ids).logits
        gathers = tp.STATS["all_gather"] - before["all_gather"]
        gen = model.generate(ids[:1], **kw)
        results.append({"quant": quant, "mode": mode, "max_diff": float((logits - ref).abs().max()),
                        "scale": float(ref.abs().max()), "same_text": bool(torch.equal(gen, ref_gen)),
                        "all_gather_per_forward": gathers})
    try:
        model, _ = build("none")
        tp.parallelize(model, mode="sideways")
    except ValueError as e:
        results.append({"error": str(e)})
    if world == 2:
        model, _ = build("none", heads=(9, 3))
        q_before = model.model.layers[0].self_attn.q_proj
        try:
            tp.parallelize(model)
        except ValueError as e:
            results.append({"error_heads": str(e), "untouched": model.model.layers[0].self_attn.q_proj is q_before})


def gradient_cases():
    """Gradients through a parallelized model (LoRA-style training of its float parameters) against one process: the
    embedding's and the first norm's, which reach every column-parallel input and (naive) the all-gather."""
    for quant, mode in (("bcq", "tp_aware"), ("gptq-static-o", "naive")):
        model, ids = build(quant)
        grads = []
        for sharded in (False, True):
            if sharded:
                tp.parallelize(model, mode=mode)
            model.zero_grad()
            model(ids).logits.float().pow(2).mean().backward()
            grads.append([p.grad.clone() for p in (model.model.embed_tokens.weight,
                                                   model.model.layers[0].input_layernorm.weight)])
        results.append({"grad_quant": quant, "mode": mode,
                        "max_diff": max(float((a - b).abs().max()) for a, b in zip(*grads)),
                        "scale": min(float(a.abs().max()) for a in grads[0])})


if not checkpoint_mode:
    with torch.no_grad():
        parallelize_cases()
    gradient_cases()


def hf_compare(path, ids, label, tp_config, base=False):
    """Load ``path`` in one process and tensor-parallel; logits (``base``: the decoder's hidden states, for a
    checkpoint saved from the base model, whose lm_head is then random), greedy text, all-gathers, packed bytes
    and unexpected checkpoint keys."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(path)
    out = (lambda m: m.model(ids).last_hidden_state) if base else (lambda m: m(ids).logits)
    ref = out(ref_model)
    ref_gen = None if base else ref_model.generate(ids[:1], **kw)
    model, info = AutoModelForCausalLM.from_pretrained(path, distributed_config=tp_config, output_loading_info=True)
    q = model.model.layers[0].self_attn.q_proj
    before = dict(tp.STATS)
    logits = out(model)
    gathers = tp.STATS["all_gather"] - before["all_gather"]
    packed = lambda m: sum(x.memory_footprint() for x in m.modules() if isinstance(x, qlinear.QuantLinear))
    same = True if base else bool(torch.equal(model.generate(ids[:1], **kw), ref_gen))
    return model, {"hf_quant": label, "max_diff": float((logits - ref).abs().max()), "scale": float(ref.abs().max()),
                   "all_gather_per_forward": gathers, "same_text": same, "unexpected": sorted(info["unexpected_keys"]),
                   "local_q_rows": q.out_features, "q_class": type(q).__name__, "packed_bytes": packed(model),
                   "ref_packed_bytes": packed(ref_model), "read_shards": model.hf_quantizer._tp_specs is not None}


if world > 1:  # transformers' tensor-parallel loading of saved qlinear checkpoints
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    tp_config = DistributedConfig(tp_size=world)
    warnings.filterwarnings("ignore")
    root = Path(out).parent / "ckpt"
    hf_cases = [] if checkpoint_mode else ["bcq", "codebook", "gptq", "gptq-static-o", "gptq-mlp-bias"]
    if rank == 0:
        for quant in hf_cases:
            build(quant)[0].save_pretrained(root / quant)
        if hf_cases:
            build("gptq")[0].model.save_pretrained(root / "gptq-base")  # keys without the "model." prefix
            build("bcq", group_size=128)[0].save_pretrained(root / "g128")
            build("none")[0].save_pretrained(root / "float")
    dist.barrier()
    with torch.no_grad():
        if checkpoint_mode:
            results.append(hf_compare(sys.argv[5], torch.load(sys.argv[6]), "checkpoint", tp_config)[1])
        for quant in hf_cases:
            model, r = hf_compare(root / quant, build("none")[1], quant, tp_config)
            results.append(r)
        if hf_cases:  # the fallback for checkpoints qlinear cannot index (not safetensors): load whole, then slice
            from qlinear.integrations.transformers.quantizer import QLinearHfQuantizer

            read = QLinearHfQuantizer._read_checkpoint
            QLinearHfQuantizer._read_checkpoint = lambda self, model, files: None
            try:
                results.append(hf_compare(root / "gptq", build("none")[1], "gptq-full-load", tp_config)[1])
            finally:
                QLinearHfQuantizer._read_checkpoint = read
            results.append(hf_compare(root / "gptq-base", build("none")[1], "gptq-base", tp_config, base=True)[1])
        if hf_cases:
            try:
                model.save_pretrained(root / f"resave{rank}")
                results.append({"hf_error_save": ""})
            except ValueError as e:
                results.append({"hf_error_save": str(e)})
            rep = DistributedConfig(tp_size=world, tp_plan={"model.layers.*.self_attn.o_proj": "rowwise_rep"})
            for name, src, kwargs in (("hf_error_split", "g128", {"distributed_config": tp_config}),
                                      ("hf_error_quantize_on_load", "float",
                                       {"distributed_config": tp_config, "quantization_config": QLinearConfig("bcq")}),
                                      ("hf_error_override", "bcq", {"distributed_config": rep})):
                try:
                    AutoModelForCausalLM.from_pretrained(root / src, **kwargs)
                    results.append({name: ""})
                except ValueError as e:
                    results.append({name: str(e)})
    dist.barrier()
dist.destroy_process_group()
if rank == 0:
    with open(out, "w") as f:
        json.dump(results, f)
