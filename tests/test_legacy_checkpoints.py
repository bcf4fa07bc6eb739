"""Checkpoints saved before the uniform storage (uniform BCQ layers as planes + fp16 α + offset) still load, converted
exactly to codes + fp16 scale + packed zero point.

The fixture ``fixtures/legacy_uniform_v1`` was written by the code of that time (``make.py`` there says how): a
2-layer Llama with round-to-nearest 4-bit layers (fp16 offsets), a round-to-nearest 3-bit layer without offset,
GPTQ act_order layers (fp32 offsets and a permutation) and free-α BCQ layers, plus the dequantized weights and the
logits that code computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import qlinear  # noqa: E402
from qlinear import QLinearConfig, QuantLinear  # noqa: E402
from qlinear.formats import bcq  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "legacy_uniform_v1"
REF = load_file(FIXTURE / "reference.safetensors")


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    """The fixture's logits came from the reference backend: compare like with like (a CPU kernel with int8
    activations would move them by more than the conversion's tolerance)."""
    monkeypatch.setenv("QLINEAR_BACKEND", "reference")
OLD_NAMES = {"planes", "alpha", "offset", "perm"}


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _check_weights(model):
    """Every layer equals the weights the old code dequantized: bit for bit, except round-to-nearest layers with an
    offset, whose fp16-rounded offset is now the exact s·((2^q−1)/2 − z) (within one fp16 rounding of it)."""
    kinds = set()
    for name, m in _layers(model).items():
        w, ref = m.dequantize(), REF[f"{name}.weight"]
        uniform = bcq.is_uniform(m.config)
        assert set(m.buffer_specs) == ({"qweight", "scales"} | ({"qzeros"} if m.config.offset else set())
                                       | ({"perm"} if m.config.act_order else set()) if uniform
                                       else {"planes", "alpha", "offset"})
        if uniform and m.config.offset and m.config.method == "bcq":
            _, s, z = bcq.uniform_parts(m.canonical(), m.config, m.out_features, m.in_features)
            c = bcq.uniform_offset(s, z, m.config.bits).double().abs().repeat_interleave(32, 1)
            assert ((w.double() - ref.double()).abs() <= c * 2.0 ** -11).all(), name
            kinds.add("rtn")
        else:
            assert torch.equal(w, ref), name
            kinds.add("gptq" if m.config.method == "gptq" else "rtn-sym" if uniform else "free")
    assert kinds == {"rtn", "rtn-sym", "gptq", "free"}


def _logits(model):
    with torch.no_grad():
        return model(torch.arange(16)[None]).logits[0]


def test_the_fixture_holds_the_old_storage():
    from safetensors import safe_open

    with safe_open(FIXTURE / "model" / "model.safetensors", framework="pt") as f:
        names = {k.rpartition(".")[2] for k in f.keys() if ".layers." in k and "norm" not in k}
    assert names == OLD_NAMES


def test_from_pretrained_converts_an_old_checkpoint(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE / "model")
    assert len(_layers(model)) == 14
    _check_weights(model)
    assert torch.allclose(_logits(model), REF["logits"], atol=1e-3, rtol=1e-3)
    # saved again in the new storage (smaller), it reloads to the same weights bit for bit
    model.save_pretrained(tmp_path)
    names = {k.rpartition(".")[2] for k in load_file(tmp_path / "model.safetensors") if ".layers." in k and "norm" not in k}
    assert {"qweight", "scales", "qzeros", "perm"} <= names and "alpha" in names  # free-α layers keep α
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (n, a), b in zip(_layers(model).items(), _layers(again).values()):
        assert torch.equal(a.dequantize(), b.dequantize()), n
    assert (tmp_path / "model.safetensors").stat().st_size < (FIXTURE / "model" / "model.safetensors").stat().st_size


def test_load_state_dict_converts_an_old_state_dict():
    cfg = json.loads((FIXTURE / "model" / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "dtype")}))
    qcfg = QLinearConfig.from_dict(quant)
    qlinear.replace_linear(model, qcfg, progress=False)
    model.load_state_dict(load_file(FIXTURE / "model" / "model.safetensors"), strict=True)
    _check_weights(model)
    assert torch.allclose(_logits(model.eval()), REF["logits"], atol=1e-3, rtol=1e-3)


def test_a_damaged_old_checkpoint_is_refused(tmp_path):
    """Old buffers that are not uniform for a uniform config (α of another layer kind) raise instead of loading as
    other weights; a tensor of the wrong shape names itself."""
    sd = load_file(FIXTURE / "model" / "model.safetensors")
    m = qlinear.BCQLinear(64, 64, False, QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0))
    old = {k.rpartition(".")[2]: v for k, v in sd.items() if k.startswith("model.layers.0.self_attn.q_proj.")}
    assert set(old) == {"planes", "alpha", "offset"}
    before = {k: v.clone() for k, v in m.state_dict().items()}
    bad = dict(old, alpha=old["alpha"] * torch.tensor([1.0, 1.0, 1.5, 1.0], dtype=torch.float16)[:, None, None])
    with pytest.raises(ValueError, match="not uniform"):
        m.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"checkpoint tensor offset .* saved as bcq_legacy"):
        m.load_state_dict(dict(old, offset=old["offset"][:, :1].contiguous()))
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    m.load_state_dict(old)
    assert set(m.state_dict()) == {"qweight", "scales", "qzeros"}
    ref = REF["model.layers.0.self_attn.q_proj.weight"].double()
    assert ((m.dequantize().double() - ref).abs() <= ref.abs().max() * 2.0 ** -10).all()


def test_a_layer_pickled_in_the_old_storage_unpickles_converted():
    import pickle

    sd = load_file(FIXTURE / "model" / "model.safetensors")
    old = {k.rpartition(".")[2]: v for k, v in sd.items() if k.startswith("model.layers.1.mlp.down_proj.")}
    m = qlinear.BCQLinear(128, 64, False, QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True))
    state = m.__getstate__()  # what pickle stored for such a layer before the uniform storage
    specs = bcq.LEGACY.saved_specs(64, 128, m.config)
    state["_buffers"] = {**{k: v for k, v in state["_buffers"].items() if k not in m.buffer_specs}, **old}
    state["_specs"], state["_packed_names"] = {**specs, "perm": m.buffer_specs["perm"]}, tuple(old)
    clone = object.__new__(qlinear.BCQLinear)
    clone.__setstate__(state)
    assert set(clone.state_dict()) == set(m.buffer_specs)
    assert torch.equal(clone.dequantize(), REF["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(pickle.loads(pickle.dumps(clone)).dequantize(), clone.dequantize())
