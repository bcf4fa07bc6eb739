"""GPTQ on uniform int codes (act_order, static_groups, sym), the reordered act_order storage, and GPTQ
checkpoint import/export."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import ref64, tiny_llama

import qlinear
from qlinear import BCQLinear, QLinearConfig
from qlinear.formats import bcq, uniform
from qlinear.gptq import quantize_uniform


def _layer(N=48, K=256, seed=0):
    torch.manual_seed(seed)
    # correlated inputs (low rank + noise, as activations are) with unequal scales: GPTQ and act_order matter
    X = (torch.randn(512, 32) @ torch.randn(32, K) + 0.3 * torch.randn(512, K)) * torch.linspace(0.2, 3.0, K)
    X[:, 7] = 0  # a dead input
    lin = torch.nn.Linear(K, N)
    return lin, X.T @ X / X.shape[0]


def _err(w, w_hat, H):
    d = (w - w_hat).double()
    return float(torch.einsum("nk,kl,nl->", d, H.double(), d))


def _dense(codes, scales, zeros, g_idx, group_size):
    g = torch.arange(codes.shape[1]) // group_size if g_idx is None else g_idx.long()
    return scales[:, g] * (codes - zeros[:, g])


def test_without_hessian_gptq_is_round_to_nearest():
    lin, _ = _layer()
    codes, scales, zeros, g_idx = quantize_uniform(lin.weight, 4, 64)
    c2, s2, z2 = uniform.rtn(lin.weight, 4, 64)
    assert g_idx is None and torch.equal(codes, c2) and torch.equal(scales, s2) and torch.equal(zeros, z2)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, False), (True, True)])
def test_gptq_beats_rtn_on_the_hessian_weighted_error(bits, act_order, static):
    lin, H = _layer()
    w = lin.weight.detach()
    rtn = _dense(*uniform.rtn(w, bits, 64), None, 64)
    codes, scales, zeros, g_idx = quantize_uniform(w, bits, 64, H, act_order=act_order, static_groups=static)
    w_hat = _dense(codes, scales, zeros, g_idx, 64)
    assert _err(w, w_hat, H) < 0.8 * _err(w, rtn, H)
    assert int(codes.min()) >= 0 and int(codes.max()) < 1 << bits
    if act_order and not static:
        assert g_idx is not None and not torch.equal(g_idx.long(), torch.arange(256) // 64)
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((4,), 64))
        diag = torch.diagonal(H)
        first = torch.argsort(diag, descending=True, stable=True)[:64]
        assert (g_idx[first] == 0).all()  # the group of the largest-Hessian columns is formed first
    else:
        assert g_idx is None


def test_symmetric_grid():
    lin, H = _layer()
    _, scales, zeros, _ = quantize_uniform(lin.weight, 4, 64, H, sym=True)
    assert (zeros == 8).all() and (scales > 0).all()


def test_mse_range_search_never_loses_to_min_max_per_group():
    """Without a Hessian each group is rounded alone: the searched range (shrink factors 1.00 ... 0.80, 1.00
    included) has at most the min/max grid's squared error in every (row, group), and less where a heavy tail
    makes clipping pay; with a Hessian GPTQ still beats RTN."""
    lin, H = _layer()
    w = lin.weight.detach().clone()
    w[:, ::37] *= 6  # heavy tails in some groups
    errs = {}
    for mse in (False, True):
        codes, scales, zeros, _ = quantize_uniform(w, 3, 64, mse=mse)
        errs[mse] = ((w - _dense(codes, scales, zeros, None, 64)) ** 2).reshape(48, 4, 64).sum(-1)
    assert (errs[True] <= errs[False] * (1 + 1e-6)).all() and (errs[True] < 0.95 * errs[False]).any()
    codes, scales, zeros, _ = quantize_uniform(w, 3, 64, H, mse=True)
    assert _err(w, _dense(codes, scales, zeros, None, 64), H) < _err(w, _dense(*uniform.rtn(w, 3, 64), None, 64), H)
    for bad in (dict(mse=True), dict(method="gptq", mse=True, sym=True)):
        with pytest.raises(ValueError, match="mse"):
            QLinearConfig("bcq", **bad)


@pytest.mark.parametrize("act_order", [False, True])
def test_bcq_gptq_layer_round_trips_through_gptq_checkpoints(act_order):
    lin, H = _layer()
    cfg = QLinearConfig("bcq", bits=4, group_size=64, method="gptq", act_order=act_order)
    m = BCQLinear.from_linear(lin, cfg, H, backend="reference")  # the storage's exact math, not a kernel's
    assert ("perm" in m.buffer_specs) == act_order
    w = m.dequantize()
    x = torch.randn(5, 256)
    assert torch.allclose(m(x), x @ w.T + lin.bias, atol=1e-5)
    # 4-bit codes, an fp16 scale and a 4-bit zero point per group of 64, an int32 perm entry per input (48 rows)
    assert m.bits_per_weight == 4 + (16 + 4) / 64 + (32 / 48 if act_order else 0)
    for fmt in ("gptq", "gptq_v2"):
        t = m.to_gptq(fmt)
        assert t["qweight"].shape == (256 * 4 // 32, 48) and t["qzeros"].shape == (4, 48 * 4 // 32)
        again = BCQLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], bits=4, group_size=64, g_idx=t["g_idx"],
                                    bias=t["bias"].float(), checkpoint_format=fmt)
        assert torch.equal(again.dequantize(), w)
        if not act_order:  # with act_order the order inside a group may differ; the weights may not
            assert all(torch.equal(again.canonical()[k], v) for k, v in m.canonical().items())


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_checkpoint_tensors_round_trip_bit_exactly(bits, fmt):
    torch.manual_seed(bits)
    N, K, g = 64, 256, 64
    codes = torch.randint(0, 1 << bits, (N, K))
    scales = (torch.rand(N, K // g) * 0.02 + 0.001).half().float()
    zeros = torch.randint(1 if fmt == "gptq" else 0, 1 << bits, (N, K // g))  # v1 cannot hold a zero point of 0
    g_idx = (torch.randperm(K) % (K // g)).to(torch.int32)
    qweight, qzeros = uniform.pack_gptq(codes, zeros, bits, fmt)
    c2, z2 = uniform.unpack_gptq(qweight, qzeros, bits, K, fmt)
    assert torch.equal(c2, codes) and torch.equal(z2, zeros)
    m = BCQLinear.from_gptq(qweight, qzeros, scales.T.half(), bits=bits, group_size=g, g_idx=g_idx,
                            checkpoint_format=fmt)
    assert torch.equal(m.dequantize(), _dense(codes, scales, zeros, g_idx, g))
    t = m.to_gptq(fmt)
    assert torch.equal(t["qweight"], qweight) and torch.equal(t["qzeros"], qzeros)
    assert torch.equal(t["g_idx"], g_idx) and torch.equal(t["scales"], scales.T.half())


def test_gptq_three_bit_words_straddle_as_in_autogptq():
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, 10] = 0b101  # code 10 spans bits 30..32 of the stream
    qweight, _ = uniform.pack_gptq(codes, torch.zeros(1, 1, dtype=torch.int64), 3, "gptq_v2")
    assert qweight.shape == (3, 1)
    assert (int(qweight[0, 0]) >> 30) & 3 == 0b01 and int(qweight[1, 0]) & 1 == 1


def test_ordered_g_idx_needs_no_reordering_and_bad_g_idx_is_rejected():
    codes = torch.randint(0, 16, (8, 128))
    s, z = torch.full((8, 2), 2.0 ** -7), torch.full((8, 2), 8)
    cfg, bufs = bcq.from_uniform(codes, s, z, 4, 64, torch.arange(128) // 64)
    assert not cfg.act_order and "perm" not in bufs
    bad = torch.zeros(128, dtype=torch.int64)
    bad[:10] = 1
    with pytest.raises(ValueError, match="group_size=64 inputs in each group"):
        bcq.from_uniform(codes, s, z, 4, 64, bad)


def test_bcq_act_order_with_error_feedback():
    lin, H = _layer()
    cfg = bcq.Config(bits=3, group_size=64, error_feedback=True, act_order=True, iters=2)
    m = BCQLinear.from_linear(lin, cfg, H, backend="reference")  # the storage's exact math
    assert "perm" in m._packed_names and sorted(m.perm.tolist()) == list(range(256))
    x = torch.randn(4, 256)
    assert torch.allclose(m(x).double(), ref64(m, x), atol=1e-5)  # Ŵ by the independent float64 formula
    with pytest.raises(ValueError, match="act_order needs a Hessian"):
        BCQLinear.from_linear(lin, cfg)


def test_replace_linear_with_gptq_act_order_on_a_small_llama():
    model = tiny_llama()
    ids = torch.randint(0, 128, (4, 32))
    H = qlinear.calibrate(model, [ids[i:i + 1] for i in range(4)], progress=False)
    ref = model(ids).logits
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True),
                           calibration_data=H, progress=False)
    layers = [m for m in model.modules() if isinstance(m, BCQLinear)]
    assert len(layers) == 14 and all("perm" in m._packed_names for m in layers)
    out = model(ids).logits
    assert (out - ref).abs().mean() < 0.1 * ref.abs().mean()


# group size 128 over layers of 64 inputs (q/k/v/o, gate/up) and 128 (down_proj): GPTQ's g_idx = k // 128 makes the
# smaller ones one group per row, as the layers hold them
@pytest.mark.parametrize("bits,act_order,fmt,group_size", [(4, True, "gptq", 32), (3, False, "gptq_v2", 32),
                                                           (2, True, "gptq_v2", 32), (8, False, "gptq", 32),
                                                           (4, False, "gptq", 128)])
def test_save_and_load_gptq_checkpoints(tmp_path, bits, act_order, fmt, group_size):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    H = qlinear.calibrate(model, [ids[i:i + 1] for i in range(2)], progress=False)
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=bits, group_size=group_size, method="gptq",
                                                act_order=act_order), calibration_data=H, progress=False)
    ref = model(ids).logits
    qlinear.save_gptq(model, tmp_path, checkpoint_format=fmt)
    cfg = __import__("json").loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": False,
                   "checkpoint_format": fmt}
    again = qlinear.load_gptq(tmp_path, dtype=torch.float32)
    for name, mod in model.named_modules():
        if isinstance(mod, BCQLinear):
            assert torch.equal(again.get_submodule(name).dequantize(), mod.dequantize()), name
    assert torch.allclose(again(ids).logits, ref, atol=1e-4)


def test_load_gptq_rejects_other_checkpoints(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a GPTQ checkpoint"):
        qlinear.load_gptq(tmp_path)
    with pytest.raises(ValueError, match="GPTQ checkpoints hold uniform int codes"):
        qlinear.save_gptq(qlinear.replace_linear(tiny_llama(), QLinearConfig("codebook", bits=2, iters=0),
                                                 progress=False), tmp_path / "cb")
    import json

    from safetensors.torch import load_file, save_file

    good = tmp_path / "gptq"
    qlinear.save_gptq(qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, init="uniform",
                                                                         iters=0), progress=False), good)
    config = json.loads((good / "config.json").read_text())
    del config["quantization_config"]["bits"]
    (good / "config.json").write_text(json.dumps(config))
    for bits, group_size in ((None, 32), (4.5, 32), (0, 32), (4, 32.9), (4, 0)):  # never truncated or divided by
        config["quantization_config"].update(bits=bits, group_size=group_size)
        (good / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=r"needs integer bits >= 1 and group_size \(-1 or positive\), got "
                                             rf"bits={bits}, group_size={group_size}"):
            qlinear.load_gptq(good)
    config["quantization_config"].update(bits=4, group_size=32, desc_act=True)  # act_order without its g_idx
    (good / "config.json").write_text(json.dumps(config))
    sd = load_file(str(good / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.endswith("g_idx")}, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match="desc_act is true but the checkpoint has no g_idx"):
        qlinear.load_gptq(good)
    config["quantization_config"]["desc_act"] = False
    (good / "config.json").write_text(json.dumps(config))
    sd = load_file(str(good / "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:, :32].contiguous()
    save_file(sd, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match="(?s)does not fit the model its config.json describes.*embed_tokens"):
        qlinear.load_gptq(good)


def test_load_gptq_reads_every_config_spelling_and_refuses_damaged_tensors(tmp_path):
    """A review helper's findings: AutoGPTQ 0.8's ``"format"`` key is read (as v2: the zero points as stored) and a
    conflict with ``checkpoint_format`` raises; settings only in ``quantize_config.json`` (older AutoGPTQ) load; a
    missing group_size means one group per row; a qzeros wider than ceil(N·bits/32) words, int scales and a float g_idx
    raise instead of loading wrong weights; and export refuses a bias fp16 cannot hold."""
    import json

    from safetensors.torch import load_file, save_file

    model = qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0),
                                   progress=False)
    ids = torch.randint(0, 128, (1, 8))
    want = model(ids).logits
    good = tmp_path / "v2"
    qlinear.save_gptq(model, good, checkpoint_format="gptq_v2")
    config = json.loads((good / "config.json").read_text())
    q = config["quantization_config"]

    def write(qc, sd=None, where="config.json"):
        c = {**config, "quantization_config": qc} if where == "config.json" else \
            {k: v for k, v in config.items() if k != "quantization_config"}
        (good / "config.json").write_text(json.dumps(c))
        if where != "config.json":
            (good / where).write_text(json.dumps(qc))
        if sd is not None:
            save_file(sd, str(good / "model.safetensors"), metadata={"format": "pt"})

    write({k: v for k, v in q.items() if k != "checkpoint_format"} | {"format": "gptq_v2"})
    assert torch.equal(qlinear.load_gptq(good, dtype=torch.float32)(ids).logits, want)
    write(q | {"format": "gptq"})
    with pytest.raises(ValueError, match="two formats, checkpoint_format='gptq_v2' and format='gptq'"):
        qlinear.load_gptq(good)
    write({k: v for k, v in q.items() if k != "quant_method"}, where="quantize_config.json")
    assert torch.equal(qlinear.load_gptq(good, dtype=torch.float32)(ids).logits, want)
    (good / "quantize_config.json").unlink()

    whole = tmp_path / "whole"  # one group per row: a config without group_size
    row = qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=-1, init="uniform", iters=0),
                                 progress=False)
    qlinear.save_gptq(row, whole)
    wc = json.loads((whole / "config.json").read_text())
    del wc["quantization_config"]["group_size"]
    (whole / "config.json").write_text(json.dumps(wc))
    assert torch.equal(qlinear.load_gptq(whole, dtype=torch.float32)(ids).logits, row(ids).logits)

    sd = load_file(str(good / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj"
    for key, bad, match, error in (
            ("qzeros", torch.cat([sd[f"{name}.qzeros"], sd[f"{name}.qzeros"][:, :1]], 1), "do not fit", ValueError),
            ("scales", sd[f"{name}.scales"].to(torch.int32), "floating-point", TypeError),
            ("g_idx", sd[f"{name}.g_idx"].float(), "integer tensor", TypeError)):
        write(q, {**sd, f"{name}.{key}": bad})
        with pytest.raises(error, match=match):
            qlinear.load_gptq(good)

    lin = qlinear.replace_linear(torch.nn.Sequential(torch.nn.Linear(64, 32)), QLinearConfig(
        "bcq", bits=4, group_size=32, init="uniform", iters=0), progress=False)[0]
    with torch.no_grad():
        lin.bias[0] = 1e5
    with pytest.raises(ValueError, match="bias in fp16, which cannot hold"):
        lin.to_gptq()
    with pytest.raises(ValueError, match="bias in fp16, which cannot hold"):
        lin.to_awq()


def test_load_gptq_refuses_a_quantized_layer_without_the_bias_its_model_has(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()  # q/k/v with biases
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0), progress=False)
    qlinear.save_gptq(model, tmp_path)
    ids = torch.randint(0, 128, (1, 8))
    assert torch.equal(qlinear.load_gptq(tmp_path, dtype=torch.float32)(ids).logits, model(ids).logits)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.0.self_attn.q_proj.bias"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has model.layers.0.self_attn.q_proj.qweight but no "
                                         "model.layers.0.self_attn.q_proj.bias, which this model's layer has"):
        qlinear.load_gptq(tmp_path)
    # the other way round: a bias the model's layer does not have (o_proj) is refused unless all zeros (packers that
    # always save one)
    o = "model.layers.0.self_attn.o_proj"
    for bias, loads in ((torch.zeros(64, dtype=torch.float16), True), (torch.full((64,), 0.5, dtype=torch.float16), False)):
        save_file({**load_file(str(tmp_path / "model.safetensors")), "model.layers.0.self_attn.q_proj.bias":
                   model.model.layers[0].self_attn.q_proj.bias.detach().half(), f"{o}.bias": bias},
                  str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        if loads:
            again = qlinear.load_gptq(tmp_path, dtype=torch.float32)
            assert again.get_submodule(o).bias is None
        else:
            with pytest.raises(ValueError, match=f"nonzero {o}.bias, which this model's layer does not have"):
                qlinear.load_gptq(tmp_path)


def test_edge_cases_found_in_review(tmp_path):
    """Dead inputs and all-zero groups, act_order without a Hessian, round-to-nearest export, the v1 zero point."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    with torch.no_grad():
        lin.weight[3, :32] = 0
    H = torch.eye(64)
    H[:32, :32] = 0
    for bits in (4, 8):
        m = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=bits, group_size=32, method="gptq"), H)
        assert torch.isfinite(m.dequantize()).all()
    m = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True))
    assert torch.equal(m.perm, torch.arange(64, dtype=torch.int32))
    rtn = torch.nn.Linear(256, 32)
    with torch.no_grad():
        rtn.weight.normal_(0, 0.02)
    r = BCQLinear.from_linear(rtn, QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0))
    t = r.to_gptq("gptq_v2")
    back = BCQLinear.from_gptq(t["qweight"], t["qzeros"], t["scales"], bits=4, group_size=64, checkpoint_format="gptq_v2")
    assert torch.allclose(back.dequantize(), r.dequantize(), atol=1e-3)  # fp16 offsets -> exact int zero points
    with pytest.raises(ValueError, match="cannot hold a zero point of 0"):
        uniform.pack_gptq(torch.zeros(1, 32, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), 4, "gptq")
    with pytest.raises(ValueError, match="static_groups only changes act_order"):
        bcq.Config(bits=4, method="gptq", static_groups=True)


def test_quantize_on_load_with_calibration_data(tmp_path):
    """from_pretrained(quantization_config=QLinearConfig(..., dataset=...)) calibrates and runs GPTQ after loading,
    like transformers' GPTQConfig(dataset=...); the saved model reloads without the data."""
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    model.save_pretrained(tmp_path / "fp")
    ids = torch.randint(0, 128, (4, 24))
    cfg = QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True,
                        dataset=[ids[i:i + 1] for i in range(4)])
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg, dtype=torch.float32).eval()
    layers = [m for m in q.modules() if isinstance(m, BCQLinear)]
    assert len(layers) == 14 and all("perm" in m._packed_names for m in layers)
    out = q(ids).logits
    q.save_pretrained(tmp_path / "q")
    assert "dataset" not in (tmp_path / "q" / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    assert torch.equal(again(ids).logits, out)
    # the same, then the scales distilled from the float model on the dataset: codes kept, scales moved
    cfg = QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True,
                        dataset=[ids[i:i + 1] for i in range(4)], finetune_steps=3)
    ft = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg, dtype=torch.float32).eval()
    a, b = layers[0].canonical(), next(m for m in ft.modules() if isinstance(m, BCQLinear)).canonical()
    assert all(torch.equal(a[k], b[k]) for k in a if k != "scales") and not torch.equal(a["scales"], b["scales"])
    ft.save_pretrained(tmp_path / "ft")
    assert "finetune" not in (tmp_path / "ft" / "config.json").read_text()
    with pytest.raises(ValueError, match=">= 0"):
        QLinearConfig("bcq", finetune_steps=-1, dataset=[ids])
    # no dataset: quantized without calibration, then distilled on sequences the float model samples itself
    plain, own = (AutoModelForCausalLM.from_pretrained(tmp_path / "fp", dtype=torch.float32, quantization_config=
                                                       QLinearConfig("bcq", bits=3, group_size=32, **kw)).eval()
                  for kw in ({}, {"finetune_steps": 3}))
    a, b = (next(m for m in x.modules() if isinstance(m, BCQLinear)).canonical() for x in (plain, own))
    assert torch.equal(a["planes"], b["planes"]) and not torch.equal(a["alpha"], b["alpha"])
    # precomputed Hessians: GPTQ on them, then distilled on the float model's own samples (Hessians hold no text)
    H = qlinear.calibrate(tiny_llama(), [ids[i:i + 1] for i in range(4)], progress=False)
    gptq, tuned = (AutoModelForCausalLM.from_pretrained(tmp_path / "fp", dtype=torch.float32, quantization_config=
                                                        QLinearConfig("bcq", bits=4, group_size=32, method="gptq",
                                                                      dataset=H, **kw)).eval()
                   for kw in ({}, {"finetune_steps": 3}))
    direct = qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, method="gptq"),
                                    calibration_data=H, progress=False)
    for w, x, y in zip(*((m for m in q.modules() if isinstance(m, BCQLinear)) for q in (direct, gptq, tuned))):
        a, b = x.canonical(), y.canonical()
        assert all(torch.equal(v, a[k]) for k, v in w.canonical().items())  # the Hessians were used
        assert all(torch.equal(a[k], b[k]) for k in a if k != "scales") and not torch.equal(a["scales"], b["scales"])


def test_sequences_longer_than_the_models_positions_are_cut_to_them():
    """A model with learned positions (OPT) fails with an IndexError past ``max_position_embeddings``: calibration cuts
    longer samples to it (the Hessians of the first 16 tokens exactly), and a perplexity window longer than it raises."""
    from transformers import OPTConfig, OPTForCausalLM

    from qlinear.evaluation import perplexity

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=32)).eval()
    ids = torch.randint(4, 64, (1, 40))
    H = qlinear.calibrate(model, [ids], progress=False)
    H16 = qlinear.calibrate(model, [ids[:, :16]], progress=False)
    assert H.keys() == H16.keys() and all(torch.equal(H[k], H16[k]) for k in H)

    class Tok:  # a word per token id
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [4 + int(w) % 60 for w in text.split()]}

    with pytest.raises(ValueError, match="a window of 32 tokens is longer than the model takes \\(16 positions\\)"):
        perplexity(model, Tok(), " ".join(map(str, range(100))), window=32)
    assert perplexity(model, Tok(), " ".join(map(str, range(100))), window=16) > 1


def test_sequential_calibration_block_by_block():
    """Raw calibration data quantizes the decoder block by block (quantized inputs downstream, one block's
    Hessians at a time); an error part-way puts every swapped layer back."""
    from qlinear.calibration import decoder_blocks

    model = tiny_llama()
    ids = torch.randint(0, 128, (4, 24))
    data = [ids[i:i + 1] for i in range(4)]
    ref = model(ids).logits
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    prefix, blocks = decoder_blocks(model, names)
    assert prefix == "model.layers" and blocks is model.model.layers
    cfg = QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True)
    seq = qlinear.replace_linear(tiny_llama(), cfg, calibration_data=data, progress=False)
    H = qlinear.calibrate(tiny_llama(), data, progress=False)
    allh = qlinear.replace_linear(tiny_llama(), cfg, calibration_data=H, progress=False)
    a = seq.model.layers[1].mlp.down_proj.dequantize()
    b = allh.model.layers[1].mlp.down_proj.dequantize()
    assert not torch.equal(a, b)  # block 1 was calibrated on block 0's quantized outputs
    assert torch.equal(seq.model.layers[0].self_attn.q_proj.dequantize(), allh.model.layers[0].self_attn.q_proj.dequantize())
    assert (seq(ids).logits - ref).abs().mean() < 0.1 * ref.abs().mean()

    model = tiny_llama()
    before = {n: m for n, m in model.named_modules()}
    bad = {"model.layers.1.mlp.down_proj": QLinearConfig("codebook", bits=2, group_size=96), "*": cfg}
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj"):
        qlinear.replace_linear(model, cfg, per_module=bad, calibration_data=data, progress=False)
    assert all(model.get_submodule(n) is m for n, m in before.items() if n)


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                    reason="gptqmodel is not installable here: 7.7.0 needs torch>=2.14.1 (this environment has 2.13), "
                           "and auto-gptq 0.7.1 imports transformers 4 internals that transformers 5 removed")
def test_loads_what_gptqmodel_writes(tmp_path):
    """GPTQModel's own act_order output, loaded by qlinear, runs like GPTQModel's CPU forward of it."""
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "float")
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
    calib = [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]
    model = GPTQModel.load(str(tmp_path / "float"), QuantizeConfig(bits=4, group_size=32, desc_act=True),
                           device="cpu")
    model.quantize(calib)
    model.save(str(tmp_path / "gptq"))
    theirs = GPTQModel.load(str(tmp_path / "gptq"), device="cpu")
    ours = qlinear.load_gptq(tmp_path / "gptq", dtype=torch.float32)
    assert any(isinstance(m, BCQLinear) and "perm" in m.canonical() for m in ours.modules())
    with torch.no_grad():
        want = theirs.model(ids[:2]).logits.float()
        got = ours(ids[:2]).logits.float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
