"""transformers integration: ``from_pretrained(..., quantization_config=QLinearConfig(...))`` quantizes on
load exactly like ``replace_linear``; ``save_pretrained`` / ``from_pretrained`` round-trips bit-exactly;
checkpoints that do not match their config fail with a clear ValueError.

CPU only, tiny randomly initialised models saved to tmp dirs (no hub access).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import qlinear
from qlinear import QLinearConfig, QuantLinear, replace_linear
from qlinear.integrations.transformers.quantizer import QLinearHfQuantizer, QLinearQuantize, register
from qlinear.modules import module_class

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, FalconConfig, GPTNeoXConfig, LlamaConfig, OPTConfig  # noqa: E402
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

FORMATS = {
    "bcq": dict(format="bcq", bits=4, group_size=64),
    "mixed": dict(format="mixed"),
    "codebook": dict(format="codebook"),
    "mixed-rotated": dict(format="mixed", rotation="hadamard", rotation_seed=3),  # issue 27: saved, reloaded exactly
}
# loose bound on ||logits_q - logits_fp|| / ||logits_fp|| for random tiny models (4-bit bcq, ~2-bit others)
REL_ERR = {"bcq": 0.25, "mixed": 0.6, "codebook": 0.6, "mixed-rotated": 0.6}
TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def llama_config(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaConfig(**{**base, **kw})


def save_float(config, path, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    return model


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens).logits


def quant_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add OpenMP contention (5-10x slower on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_fp")
    return save_float(llama_config(), path), path


@pytest.fixture(scope="module", params=list(FORMATS))
def quantized_llama(request, float_llama, tmp_path_factory):
    """(format, quantized-on-load model, its save_pretrained dir)."""
    _, path = float_llama
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(**FORMATS[request.param]))
    saved = tmp_path_factory.mktemp(f"llama_{request.param}")
    model.save_pretrained(saved)
    return request.param, model, saved


# registration / quantizer flags ------------------------------------------------------------------


def test_registered_on_import():
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["qlinear"] is QLinearConfig
    assert AUTO_QUANTIZER_MAPPING["qlinear"] is QLinearHfQuantizer
    register()  # a second registration (re-import) must not raise
    register()
    assert AUTO_QUANTIZER_MAPPING["qlinear"] is QLinearHfQuantizer


def test_register_replaces_stale_or_foreign(monkeypatch):
    stale = type("QLinearHfQuantizer", (QLinearHfQuantizer,), {"__module__": QLinearHfQuantizer.__module__})
    stale.__qualname__ = QLinearHfQuantizer.__qualname__
    monkeypatch.setitem(AUTO_QUANTIZER_MAPPING, "qlinear", stale)  # as left by importlib.reload
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register()
    assert AUTO_QUANTIZER_MAPPING["qlinear"] is QLinearHfQuantizer
    foreign = type("Other", (QLinearHfQuantizer,), {"__module__": "someone_else"})
    monkeypatch.setitem(AUTO_QUANTIZER_MAPPING, "qlinear", foreign)
    with pytest.warns(UserWarning, match="someone_else"):
        register()
    assert AUTO_QUANTIZER_MAPPING["qlinear"] is QLinearHfQuantizer


def test_quantizer_flags():
    q = QLinearHfQuantizer(QLinearConfig(**FORMATS["bcq"]), pre_quantized=False)
    assert q.is_serializable() is True
    assert q.is_trainable is True  # LoRA adapters train (test_peft.py); packed weights stay frozen
    assert q.is_qat_trainable is False
    assert q.is_compileable is True
    assert QLinearHfQuantizer.requires_calibration is False


def test_config_round_trip():
    cfg = QLinearConfig(format="codebook", bits=2, num_codebooks=2, modules_to_not_convert=["lm_head", "*.mlp.*"])
    again = AUTO_QUANTIZATION_CONFIG_MAPPING["qlinear"].from_dict(json.loads(cfg.to_json_string()))
    assert again.to_dict() == cfg.to_dict()
    assert again.format_config() == cfg.format_config()


def test_per_module_configs_are_saved_and_rebuilt(float_llama, tmp_path):
    fp_model, path = float_llama
    per = {"*o_proj": QLinearConfig("codebook", bits=2), "*.0.mlp.down_proj": None,
           "*down_proj": QLinearConfig("bcq", bits=3, group_size=32, iters=0)}
    cfg = QLinearConfig("bcq", bits=4, group_size=64, per_module=per)
    again = QLinearConfig(**json.loads(cfg.to_json_string()))
    assert again.to_dict() == cfg.to_dict() and again.per_module["*.0.mlp.down_proj"] is None
    assert again.config_for("model.layers.1.mlp.down_proj").format_config().bits == 3
    model = replace_linear(copy.deepcopy(fp_model), QLinearConfig("bcq", bits=4, group_size=64), per_module=per,
                           progress=False)
    kinds = {n: (type(m).__name__, m.config.bits) for n, m in quant_layers(model).items()}
    assert kinds["model.layers.0.self_attn.o_proj"] == ("CodebookLinear", 2)
    assert kinds["model.layers.1.mlp.down_proj"] == ("BCQLinear", 3)
    assert kinds["model.layers.0.mlp.up_proj"] == ("BCQLinear", 4)
    assert "model.layers.0.mlp.down_proj" not in kinds
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert {n: (type(m).__name__, m.config.bits) for n, m in quant_layers(loaded).items()} == kinds
    assert_same_state(model, loaded)
    assert torch.equal(logits(model), logits(loaded))
    on_load = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)  # quantize on load, same layers
    assert_same_state(model, on_load)
    with pytest.raises(TypeError, match="per_module"):
        QLinearConfig("bcq", per_module={"*": 4})
    with pytest.raises(ValueError, match="nesting"):
        QLinearConfig("bcq", per_module={"*": cfg})
    with pytest.raises(ValueError, match="calibration data"):
        QLinearConfig("bcq", per_module={"*": QLinearConfig("bcq", dataset=[TOKENS])})


def test_per_module_order_survives_saving(float_llama, tmp_path):
    """The first matching pattern wins, and config.json is written with sorted keys: the order must be kept."""
    fp_model, _ = float_llama
    per = {"*down_proj": QLinearConfig("bcq", bits=3, group_size=32, iters=0), "*.0.mlp.down_proj": None}
    model = replace_linear(copy.deepcopy(fp_model), QLinearConfig("bcq", bits=4, group_size=64), per_module=per,
                           progress=False)
    assert "model.layers.0.mlp.down_proj" in quant_layers(model)  # "*down_proj" comes first
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert list(loaded.config.quantization_config.per_module) == list(per)
    assert_same_state(model, loaded)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"modules_to_not_convert": "lm_head"}, TypeError, r"got the string 'lm_head': write \['lm_head'\]"),
    ({"modules_to_not_convert": 5}, TypeError, "list of name patterns"),
    ({"backend": 3}, TypeError, "backend must be a backend name"),
    ({"dataset": 5}, TypeError, "dataset must be a list of texts or token-id tensors"),
    ({"dataset": ["a text"], "tokenizer": 5}, TypeError, "tokenizer must be a tokenizer or its name/path"),
])
def test_config_refuses_arguments_of_the_wrong_type(kwargs, error, message):
    with pytest.raises(error, match=message):
        QLinearConfig("bcq", **kwargs)


def test_replace_linear_refuses_bad_names_and_token_ids_leaving_the_model_untouched(float_llama):
    model = copy.deepcopy(float_llama[0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match="got the string 'lm_head'"):
        replace_linear(model, QLinearConfig("bcq"), modules_to_not_convert="lm_head", progress=False)
    H = qlinear.calibrate(model, [TOKENS], progress=False)
    with pytest.raises(ValueError, match="no module of the model, e.g. 'typo.q_proj'"):
        replace_linear(model, QLinearConfig("bcq"), calibration_data={**H, "typo.q_proj": H[Q]}, progress=False)
    for ids in (TOKENS + 128, TOKENS - 128):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
            replace_linear(model, QLinearConfig("bcq", method="gptq"), calibration_data=[ids], progress=False)
    assert not quant_layers(model) and getattr(model.config, "quantization_config", None) is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_bad_per_module_leaves_the_model_untouched(float_llama):
    fp_model, _ = float_llama
    model = copy.deepcopy(fp_model)
    nested = QLinearConfig("bcq", per_module={"*q_proj": None})
    with pytest.raises(ValueError, match="nesting"):
        replace_linear(model, QLinearConfig("bcq"), per_module={"*o_proj": nested}, progress=False)
    assert not quant_layers(model) and getattr(model.config, "quantization_config", None) is None


# quantize on load ---------------------------------------------------------------------------------


def test_quantize_on_load(quantized_llama, float_llama):
    fmt, model, _ = quantized_llama
    fp_model, _ = float_llama
    cls = module_class(FORMATS[fmt]["format"])
    linears = {n for n, m in fp_model.named_modules() if isinstance(m, nn.Linear)}
    layers = quant_layers(model)
    assert set(layers) == linears - {"lm_head"}
    assert all(type(m) is cls for m in layers.values())
    assert type(model.lm_head) is nn.Linear
    assert not any("weight" in m._parameters for m in layers.values())  # float placeholders dropped
    assert model.is_quantized and model.config.quantization_config.format == FORMATS[fmt]["format"]
    ref, out = logits(fp_model), logits(model)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < REL_ERR[fmt]


def test_quantize_on_load_matches_replace_linear(quantized_llama, float_llama):
    fmt, model, _ = quantized_llama
    fp_model, _ = float_llama
    ref = replace_linear(copy.deepcopy(fp_model), QLinearConfig(**FORMATS[fmt]), progress=False)
    assert_same_state(model, ref)
    assert torch.equal(logits(model), logits(ref))


# save / reload ------------------------------------------------------------------------------------


def test_saved_checkpoint_layout(quantized_llama):
    fmt, model, saved = quantized_llama
    qc = json.loads((saved / "config.json").read_text())["quantization_config"]
    assert qc == QLinearConfig(**FORMATS[fmt]).to_dict()
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    for name, layer in quant_layers(model).items():
        assert f"{name}.weight" not in stored
        for buf, (_, dtype) in layer.buffer_specs.items():  # the canonical buffers, whatever layout the layer holds
            assert stored[f"{name}.{buf}"] == {torch.int32: "I32", torch.float16: "F16", torch.int8: "I8",
                                                torch.int16: "I16"}[dtype]
    dtypes = set(stored.values())
    assert {"I32", "F16"} <= dtypes
    assert ("I8" in dtypes) == (fmt == "codebook")
    assert ("I16" in dtypes) == fmt.startswith("mixed")


def test_reload_bit_identical_without_requantizing(quantized_llama, monkeypatch):
    fmt, model, saved = quantized_llama

    def boom(*a, **k):
        raise AssertionError("a pre-quantized checkpoint must not be quantized again")

    monkeypatch.setattr(QLinearQuantize, "convert", boom)
    monkeypatch.setattr(QuantLinear, "from_linear", classmethod(boom))
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    assert isinstance(reloaded.hf_quantizer, QLinearHfQuantizer) and reloaded.hf_quantizer.pre_quantized
    assert {n: type(m) for n, m in quant_layers(reloaded).items()} == {n: type(m) for n, m in quant_layers(model).items()}
    assert_same_state(model, reloaded)
    assert torch.equal(logits(model), logits(reloaded))


def test_reload_bfloat16_keeps_packed_dtypes(quantized_llama):
    fmt, model, saved = quantized_llama
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, layer in quant_layers(model).items():
        other = reloaded.get_submodule(name)
        for buf in layer._packed_names:
            a, b = layer._buffers[buf], other._buffers[buf]
            assert b.dtype == a.dtype, f"{name}.{buf}: {b.dtype} != {a.dtype}"  # fp16 scales stay fp16
            assert torch.equal(a, b)
    assert torch.isfinite(logits(reloaded).float()).all()


def test_resave_reloaded_is_identical(quantized_llama, tmp_path):
    _, model, saved = quantized_llama
    AutoModelForCausalLM.from_pretrained(saved).save_pretrained(tmp_path)
    assert load_file(str(tmp_path / "model.safetensors")).keys() == load_file(str(saved / "model.safetensors")).keys()
    a, b = load_file(str(tmp_path / "model.safetensors")), load_file(str(saved / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# mismatched checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bcq_checkpoint(float_llama, tmp_path_factory):
    _, path = float_llama
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(**FORMATS["bcq"]))
    saved = tmp_path_factory.mktemp("llama_bcq_ref")
    model.save_pretrained(saved)
    return saved


def edited(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        j = json.loads((dst / "config.json").read_text())
        config(j["quantization_config"])
        (dst / "config.json").write_text(json.dumps(j))
    if tensors:
        with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
            metadata = f.metadata()
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata=metadata)  # checksums kept as saved
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("case, config, tensors, message", [
    ("bits", lambda c: c.update(bits=3), None, r"do not match the quantization_config.*\"bits\": 3"),
    ("group_size", lambda c: c.update(group_size=32), None, r"q_proj\.alpha: checkpoint has F16 \[4, 64, 1\].*expects F16 \[4, 64, 2\]"),
    ("truncated", None, lambda sd: sd.update({f"{Q}.planes": sd[f"{Q}.planes"][:, :40].contiguous()}),
     r"q_proj\.planes: checkpoint has I32 \[4, 40, 2\].*expects I32 \[4, 64, 2\]"),
    ("dtype", None, lambda sd: sd.update({f"{Q}.alpha": sd[f"{Q}.alpha"].float()}), r"q_proj\.alpha: checkpoint has F32"),
    ("missing", None, lambda sd: sd.pop(f"{Q}.planes"), r"missing packed tensors.*q_proj: planes$"),
    ("format", lambda c: c.update(format="codebook", bits=2, group_size=32), None, r"saved with another format"),
    ("kept_float", lambda c: c.update(modules_to_not_convert=["lm_head", "o_proj"]), None,
     r"stored quantized but the config keeps them in float.*o_proj"),
    # same tensor shapes, other weights: caught by the layer configs saved beside the checksums
    ("group_size_same_shapes", lambda c: c.update(group_size=96), None,
     r"q_proj: saved with another config than quantization_config gives it \(group_size 64 -> 96\)"),
    ("offset_dropped", lambda c: c.update(offset=False), None, r"q_proj: saved with another config.*offset True -> False"),
])
def test_mismatched_checkpoint_raises(bcq_checkpoint, tmp_path, case, config, tensors, message):
    path = edited(bcq_checkpoint, tmp_path / case, config, tensors)
    with pytest.raises(ValueError, match="(?s)" + message) as err:
        AutoModelForCausalLM.from_pretrained(path)
    assert "qlinear checkpoint does not match its quantization_config" in str(err.value)


def test_saved_checksums_are_the_crc32_of_every_tensor(bcq_checkpoint):
    import zlib

    with safe_open(str(bcq_checkpoint / "model.safetensors"), framework="pt") as f:
        sums = json.loads(f.metadata()["qlinear_crc32"])
        packed = [k for k in f.keys() if k.rpartition(".")[2] in ("planes", "alpha", "offset", "perm")]
        assert packed and "model.norm.weight" in f.keys() and set(f.keys()) <= set(sums)  # float tensors too
        dtypes = json.loads(f.metadata()["qlinear_dtypes"])
        for k in f.keys():
            t = f.get_tensor(k)
            assert int(sums[k], 16) == zlib.crc32(t.view(torch.uint8).numpy().tobytes()), k
            assert dtypes[k] == {torch.float32: "F32", torch.int32: "I32", torch.float16: "F16"}[t.dtype], k


def _pop_twin(sd: dict, name: str) -> None:
    """Remove ``name``, which another tensor of ``sd`` equals byte for byte."""
    t = sd.pop(name)
    assert any(torch.equal(t, u) for u in sd.values() if u.shape == t.shape and u.dtype == t.dtype)


@pytest.mark.parametrize("case, tensors, message", [
    ("nan_alpha", lambda sd: sd[f"{Q}.alpha"].view(-1)[5:7].fill_(float("nan")),
     r"q_proj\.alpha: CRC-32 [0-9a-f]{8} differs from the saved [0-9a-f]{8}"),
    ("flipped_code", lambda sd: sd[f"{Q}.planes"].view(-1)[3].bitwise_xor_(1 << 7), r"q_proj\.planes: CRC-32"),
    # the float tensors beside the packed ones (norms, embeddings) are summed too
    ("flipped_norm", lambda sd: sd["model.norm.weight"].view(torch.int32)[3].bitwise_xor_(1 << 30),
     r"model\.norm\.weight: CRC-32"),
    ("flipped_embedding", lambda sd: sd["model.embed_tokens.weight"].view(torch.int32)[7].bitwise_xor_(1),
     r"model\.embed_tokens\.weight: CRC-32"),
    # transformers would initialise a missing float tensor at random, and load a retyped one's bytes as other numbers
    ("missing_embedding", lambda sd: sd.pop("model.embed_tokens.weight"),
     r"model\.embed_tokens\.weight: missing from the checkpoint \(its CRC-32 was saved\)"),
    ("retyped_embedding", lambda sd: sd.update({"model.embed_tokens.weight": sd["model.embed_tokens.weight"].view(
        torch.int32)}), r"model\.embed_tokens\.weight: stored as I32, saved as F32"),
    # its bytes equal the other norms' (all ones): only a tie in the model, not an equal sum, makes a tensor held
    ("missing_norm_with_twins", lambda sd: _pop_twin(sd, "model.layers.0.input_layernorm.weight"),
     r"model\.layers\.0\.input_layernorm\.weight: missing from the checkpoint"),
])
def test_damaged_tensor_raises_naming_it(bcq_checkpoint, tmp_path, case, tensors, message):
    path = edited(bcq_checkpoint, tmp_path / case, tensors=tensors)
    with pytest.raises(ValueError, match=r"(?s)qlinear checkpoint is damaged.*" + message):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("tied", [True, False])
def test_sharded_checkpoint_reloads_exactly(tmp_path, tied):
    """Each shard's metadata lists every tensor's CRC-32 and dtype while the shard holds a few: none counts as missing
    (nor a tied output layer, which transformers saves once), and the logits are the saved model's."""
    model = save_float(llama_config(tie_word_embeddings=tied), tmp_path / "fp")
    replace_linear(model, QLinearConfig(**FORMATS["bcq"]), progress=False)
    model.save_pretrained(tmp_path / "q", max_shard_size="20KB")
    assert len(list((tmp_path / "q").glob("*.safetensors"))) > 2
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "q")), logits(model))


def test_checkpoint_without_layer_configs_still_refuses_tensors_its_config_does_not_hold(bcq_checkpoint, tmp_path):
    path = edited(bcq_checkpoint, tmp_path / "old", lambda c: c.update(offset=False))  # saved with offsets
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "qlinear_configs"}  # as saved before 2026-11-28
    save_file(load_file(str(path / "model.safetensors")), str(path / "model.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match=r"q_proj: the checkpoint also has offset, which a layer of this config"):
        AutoModelForCausalLM.from_pretrained(path)


def test_checkpoint_with_sums_but_no_layer_configs_loads_with_a_warning(bcq_checkpoint, tmp_path):
    """A file rewritten without qlinear_configs (its sums kept) still loads, but says that a config.json edit keeping
    the shapes would go unnoticed (a review helper's case: group_size 64 -> 96 loaded wrong weights silently)."""
    path = tmp_path / "stripped"
    shutil.copytree(bcq_checkpoint, path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != "qlinear_configs"}
    save_file(load_file(str(path / "model.safetensors")), str(path / "model.safetensors"), metadata=metadata)
    with pytest.warns(UserWarning, match="checksums but no saved layer configs"):
        model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(logits(model), logits(AutoModelForCausalLM.from_pretrained(bcq_checkpoint)))


def test_unreadable_file_or_metadata_raises_value_error(bcq_checkpoint, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(bcq_checkpoint, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="cannot be read .*truncated or damaged"):
        AutoModelForCausalLM.from_pretrained(cut)
    bad = tmp_path / "bad_metadata"
    shutil.copytree(bcq_checkpoint, bad)
    with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
        metadata = {**f.metadata(), "qlinear_crc32": "{not json"}
    save_file(load_file(str(bad / "model.safetensors")), str(bad / "model.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match="metadata cannot be read"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_damage_is_caught_when_loaded_as_the_base_model(bcq_checkpoint, tmp_path):
    from transformers import AutoModel

    path = edited(bcq_checkpoint, tmp_path / "flip", tensors=lambda sd: sd[f"{Q}.planes"].view(-1)[3].bitwise_xor_(1))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.planes: CRC-32"):
        AutoModel.from_pretrained(path)  # its layers are named without the saving model's "model." prefix


@pytest.mark.parametrize("case, tensors, message", [
    ("flipped", lambda sd: sd[f"{Q}.bias"].view(torch.int32)[3].bitwise_xor_(1 << 29), r"q_proj\.bias: CRC-32"),
    ("missing", lambda sd: sd.pop(f"{Q}.bias"), r"missing packed tensors.*q_proj: bias"),
    ("int", lambda sd: sd.update({f"{Q}.bias": sd[f"{Q}.bias"].to(torch.int32)}), r"q_proj\.bias.*floating point"),
])
def test_a_quantized_layers_bias_is_checked_like_its_packed_tensors(tmp_path, case, tensors, message):
    model = save_float(llama_config(attention_bias=True), tmp_path / "fp")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    replace_linear(model, QLinearConfig(**FORMATS["bcq"]), progress=False)
    model.save_pretrained(tmp_path / "q")
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "q")), logits(model))
    path = edited(tmp_path / "q", tmp_path / case, tensors=tensors)
    with pytest.raises(ValueError, match="(?s)" + message):
        AutoModelForCausalLM.from_pretrained(path)


def test_layers_of_two_replace_linear_calls_reload_with_their_own_configs(float_llama, tmp_path):
    model = copy.deepcopy(float_llama[0])
    replace_linear(model, QLinearConfig("bcq", bits=3, group_size=96), modules_to_not_convert=["lm_head", "q_proj"],
                   progress=False)
    replace_linear(model, QLinearConfig("bcq", bits=4, group_size=64), progress=False)  # the q_proj layers
    model.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert {n: m.config for n, m in quant_layers(again).items()} == {n: m.config for n, m in quant_layers(model).items()}
    assert {m.config.group_size for m in quant_layers(again).values()} == {64, 96}
    assert_same_state(again, model)


def test_checkpoint_without_checksums_loads_with_a_warning_and_nan_still_raises(bcq_checkpoint, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(bcq_checkpoint, plain)
    save_file(load_file(str(plain / "model.safetensors")), str(plain / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="has no checksums"):
        model = AutoModelForCausalLM.from_pretrained(plain)
    assert torch.equal(logits(model), logits(AutoModelForCausalLM.from_pretrained(bcq_checkpoint)))
    sd = load_file(str(plain / "model.safetensors"))
    sd[f"{Q}.alpha"].view(-1)[0] = float("inf")
    save_file(sd, str(plain / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.alpha: holds NaN or Inf"), pytest.warns(UserWarning):
        AutoModelForCausalLM.from_pretrained(plain)


def as_bin(path):
    """``path`` with its model.safetensors rewritten as a pytorch_model.bin (``torch.save``: no metadata)."""
    torch.save(load_file(str(path / "model.safetensors")), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    return path


def test_a_bin_checkpoint_is_checked_before_loading_like_a_safetensors_one(bcq_checkpoint, tmp_path):
    """A ``.bin`` checkpoint's keys, shapes and dtypes are read (onto the meta device) before the layers are built:
    an output layer it stores packed loads packed, not as the float layer transformers' default skips would build
    (random, or the tied embedding); a layer its config keeps float but the file stores packed raises."""
    fp = save_float(llama_config(), tmp_path / "fp")
    model = replace_linear(copy.deepcopy(fp), QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]), progress=False)
    model.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(as_bin(tmp_path / "q"))
    assert set(quant_layers(again)) == set(quant_layers(model)) and "lm_head" in quant_layers(again)
    assert_same_state(again, model)
    bad = as_bin(edited(bcq_checkpoint, tmp_path / "kept_float",
                        config=lambda c: c.update(modules_to_not_convert=["lm_head", "o_proj"])))
    with pytest.raises(ValueError, match=r"(?s)stored quantized but the config keeps them in float.*o_proj"):
        AutoModelForCausalLM.from_pretrained(bad)
    bad = as_bin(edited(bcq_checkpoint, tmp_path / "truncated",
                        tensors=lambda sd: sd.update({f"{Q}.planes": sd[f"{Q}.planes"][:, :40].contiguous()})))
    with pytest.raises(ValueError, match=r"q_proj\.planes: checkpoint has I32 \[4, 40, 2\].*expects I32 \[4, 64, 2\]"):
        AutoModelForCausalLM.from_pretrained(bad)
    nan = as_bin(edited(bcq_checkpoint, tmp_path / "nan", tensors=lambda sd: sd[f"{Q}.alpha"].view(-1)[:1].fill_(
        float("nan"))))  # no checksums in a .bin: the values are still checked, and the missing sums are said
    with pytest.warns(UserWarning, match="in .bin files, which carry no checksums"), \
            pytest.raises(ValueError, match=r"q_proj: packed tensor 'alpha' holds NaN or Inf"):
        AutoModelForCausalLM.from_pretrained(nan)
    data = (bad / "pytorch_model.bin").read_bytes()
    legacy = tmp_path / "legacy.bin"  # torch.save's pre-zip format
    torch.save({"x": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    for damaged in (data[:len(data) // 2], b"", b"hello world" * 10, legacy.read_bytes()[:300]):
        (bad / "pytorch_model.bin").write_bytes(damaged)
        with pytest.raises(ValueError, match="cannot be read .*truncated or damaged"):
            AutoModelForCausalLM.from_pretrained(bad)


def test_bad_weight_at_quantize_on_load_raises_qlinear_s_error(tmp_path):
    """Not transformers' generic RuntimeError about conversion: qlinear's ValueError, naming every bad layer."""
    model = save_float(llama_config(), tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
        model.model.layers[0].self_attn.k_proj.weight[0, 0] = float("inf")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"(?s)qlinear could not quantize layer 'model\.layers\.0\.self_attn\.k_proj' "
                                         r"\(32x64\): weight contains NaN or Inf.*1 more.*layers\.1\.mlp\.up_proj"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=QLinearConfig(**FORMATS["bcq"]))


_FRESH = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
assert "qlinear" in sys.modules  # imported by the checkpoint's quant_method, not by this script
print(type(model.model.layers[0].self_attn.q_proj).__name__)
torch.save(model(torch.tensor([int(t) for t in sys.argv[2:]]).view(2, -1)).logits.detach(), sys.argv[1] + "/logits.pt")
"""


@pytest.mark.slow
def test_checkpoint_loads_quantized_without_import_qlinear(bcq_checkpoint, tmp_path):
    """The installed ``qlinear-autoload.pth`` (qlinear._autoload) registers quant_method="qlinear" lazily: a fresh
    interpreter that never imports qlinear gets the quantized model, logits identical; a folder named qlinear shadowing
    the package raises ImportError instead of loading random weights."""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    shutil.copytree(bcq_checkpoint, ckpt)
    (tmp_path / "load.py").write_text(_FRESH)
    run = [sys.executable, str(tmp_path / "load.py"), str(ckpt), *map(str, TOKENS.flatten().tolist())]
    out = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["BCQLinear"], (
        out.stderr[-2000:] + "\n(is qlinear-autoload.pth installed? reinstall with pip install -e .)")
    assert torch.equal(torch.load(ckpt / "logits.pt"), logits(AutoModelForCausalLM.from_pretrained(ckpt)))
    (tmp_path / "qlinear").mkdir()
    (tmp_path / "qlinear" / "__init__.py").write_text("")
    out = subprocess.run(run, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode != 0 and "a folder named qlinear shadowing the package" in out.stderr, out.stderr[-2000:]


def test_accelerate_empty_skeleton_loads_like_from_pretrained(quantized_llama, float_llama):
    """accelerate's big-model recipe: init_empty_weights + from_config + qlinear.init_empty_quantized +
    load_checkpoint_and_dispatch gives from_pretrained's layers, layouts and logits."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig

    fmt, _, saved = quantized_llama
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved))
    qlinear.init_empty_quantized(model)
    model = load_checkpoint_and_dispatch(model, str(saved), device_map={"": "cpu"}).eval()
    ref = AutoModelForCausalLM.from_pretrained(saved)
    assert torch.equal(logits(model), logits(ref))
    assert {n: m.layout for n, m in quant_layers(model).items()} == {n: m.layout for n, m in quant_layers(ref).items()}
    assert_same_state(model, ref)
    with pytest.raises(ValueError, match="expects an empty model"):
        qlinear.init_empty_quantized(float_llama[0], QLinearConfig(**FORMATS[fmt]))
    with init_empty_weights():  # hidden size 40: no format stores it
        odd = AutoModelForCausalLM.from_config(llama_config(hidden_size=40, intermediate_size=80))
    names = [n for n, _ in odd.named_modules()]
    with pytest.raises(ValueError, match="cannot be stored in format"):
        qlinear.init_empty_quantized(odd, QLinearConfig(**FORMATS[fmt]))
    assert [n for n, _ in odd.named_modules()] == names and not getattr(odd, "is_quantized", False)
    odd.half()  # transformers refuses .half() on a model marked quantized


@pytest.mark.parametrize("tied", [False, True])
def test_accelerate_empty_skeleton_reads_the_checkpoint_for_a_quantized_output_layer(tmp_path, tied):
    """``init_empty_quantized(model, checkpoint=folder)`` reads the headers as from_pretrained does: an lm_head the
    checkpoint stores packed is built packed (not the float layer, or the tied embedding, of transformers' defaults),
    and a checkpoint that does not match raises there, leaving the skeleton as it was."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig

    fp = save_float(llama_config(tie_word_embeddings=tied), tmp_path / "fp")
    model = replace_linear(copy.deepcopy(fp), QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]), progress=False)
    model.save_pretrained(tmp_path / "q")

    def skeleton():
        with init_empty_weights():
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "q"))

    empty = qlinear.init_empty_quantized(skeleton(), checkpoint=tmp_path / "q")
    assert set(quant_layers(empty)) == set(quant_layers(model))
    loaded = load_checkpoint_and_dispatch(empty, str(tmp_path / "q"), device_map={"": "cpu"}).eval()
    assert torch.equal(logits(loaded), logits(model))
    bad = edited(tmp_path / "q", tmp_path / "bad",
                 tensors=lambda sd: sd.update({f"{Q}.planes": sd[f"{Q}.planes"][:, :40].contiguous()}))
    sk = skeleton()
    kinds = {n: type(m) for n, m in sk.named_modules()}
    with pytest.raises(ValueError, match=r"q_proj\.planes: checkpoint has I32 \[4, 40, 2\]"):
        qlinear.init_empty_quantized(sk, checkpoint=bad / "model.safetensors")
    assert {n: type(m) for n, m in sk.named_modules()} == kinds and not getattr(sk, "is_quantized", False)
    with pytest.raises(ValueError, match="no weights at checkpoint"):
        qlinear.init_empty_quantized(skeleton(), checkpoint=tmp_path / "elsewhere")
    # a folder's one *.index.json, whatever its name, as accelerate finds it
    shard = tmp_path / "sharded"
    shard.mkdir()
    shutil.copy(tmp_path / "q" / "model.safetensors", shard / "part-1.safetensors")
    (shard / "weights.index.json").write_text(json.dumps({"weight_map": {k: "part-1.safetensors" for k in
                                                                         load_file(str(shard / "part-1.safetensors"))}}))
    assert set(quant_layers(qlinear.init_empty_quantized(skeleton(), checkpoint=shard))) == set(quant_layers(model))


DISK_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
            "model.norm": "cpu", "lm_head": "cpu"}


@pytest.mark.parametrize("source", ["saved", "quantized on load"])
def test_disk_offload_takes_the_packed_tensors_without_offload_buffers(quantized_llama, float_llama, source, tmp_path):
    """device_map "disk" layers hold no packed tensor in RAM (meta), without offload_buffers=True: a saved
    checkpoint's are read from its own file (nothing copied), a quantized-on-load model's are written to the offload
    folder; logits equal the in-memory model's, with and without autograd, call after call."""
    fmt, ref, saved = quantized_llama
    kw = (dict(quantization_config=QLinearConfig(**FORMATS[fmt])) if source != "saved" else {})
    model = AutoModelForCausalLM.from_pretrained(saved if source == "saved" else float_llama[1], device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path / "offload"), **kw)
    layers = quant_layers(model)
    for name, mod in layers.items():
        devices = {b.device.type for _, b in mod.named_buffers() if _ != "bias"}
        assert devices == ({"meta"} if name.startswith("model.layers.1.") else {"cpu"}), name
        assert mod.offloaded() == name.startswith("model.layers.1.")
    written = {f.name for f in (tmp_path / "offload").iterdir()}
    packed = {f"{n}.{b}.dat" for n, m in layers.items() if m.offloaded() for b in m.held_specs()}
    assert packed <= written if source != "saved" else not packed & written
    assert torch.equal(model(TOKENS).logits, logits(ref))  # autograd on: through the op
    for length in (12, 9):  # eager: the layer's cached call, twice
        assert torch.equal(logits(model, TOKENS[:, :length]), logits(ref, TOKENS[:, :length]))
    assert all(b.device.type == "meta" for n, m in layers.items() if m.offloaded() for _, b in m.named_buffers())
    with pytest.raises(ValueError, match="offloaded or not loaded .first: model.layers.1"):
        qlinear.finetune(model, [TOKENS], steps=1, progress=False)
    model.save_pretrained(tmp_path / "again")  # the offloaded tensors are read back to be saved
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "again")), logits(ref))


def test_cpu_offloaded_layers_hand_their_packed_tensors_to_the_hook(quantized_llama):
    """The "cpu" offload (a layer on the CPU beside a GPU, which a CPU-only machine cannot reach through
    from_pretrained): accelerate's hook, as dispatch_model attaches it, gets the canonical tensors in its weights map
    and the layer holds meta ones; the logits do not change."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    from qlinear.integrations.transformers.quantizer import _offload_packed

    _, _, saved = quantized_llama
    model = AutoModelForCausalLM.from_pretrained(saved)
    want, name = logits(model), "model.layers.1.mlp.down_proj"
    layer, loader = model.get_submodule(name), OffloadedWeightsLoader(state_dict={})
    canon = layer.canonical()
    add_hook_to_module(layer, AlignDevicesHook("cpu", offload=True, weights_map=PrefixedDataset(loader, name + ".")))
    model.hf_device_map = {"": "cpu"}
    _offload_packed(model, {})
    assert layer.offloaded() and all(b.is_meta for _, b in layer.named_buffers())
    assert loader.state_dict.keys() == {f"{name}.{k}" for k in canon}
    assert all(torch.equal(loader.state_dict[f"{name}.{k}"], v) for k, v in canon.items())
    assert torch.equal(logits(model), want) and torch.equal(model(TOKENS).logits, want)


def test_disk_offload_of_a_layer_quantized_on_load_needs_an_offload_folder(float_llama):
    with pytest.raises(ValueError, match="offloaded to disk but its packed tensors .* pass offload_folder="):
        AutoModelForCausalLM.from_pretrained(float_llama[1], quantization_config=QLinearConfig(**FORMATS["bcq"]),
                                             device_map=DISK_MAP)


def test_float_layer_in_checkpoint_raises(float_llama, tmp_path):
    _, path = float_llama
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=["lm_head", "o_proj"]))
    model.save_pretrained(tmp_path / "q")
    bad = edited(tmp_path / "q", tmp_path / "bad", config=lambda c: c.update(modules_to_not_convert=["lm_head"]))
    with pytest.raises(ValueError, match=r"(?s)stored as float weights but the config quantizes them.*o_proj"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_missing_tensor_in_state_dict_raises(bcq_checkpoint):
    # from_pretrained(None, state_dict=...) gives the quantizer no files to check: caught after loading
    from transformers import AutoConfig, LlamaForCausalLM

    sd = load_file(str(bcq_checkpoint / "model.safetensors"))
    sd.pop(f"{Q}.planes")
    with pytest.raises(ValueError, match=r"q_proj\.planes: missing from the checkpoint"):
        LlamaForCausalLM.from_pretrained(None, config=AutoConfig.from_pretrained(bcq_checkpoint), state_dict=sd)


def test_invalid_config_raises(bcq_checkpoint, tmp_path):
    path = edited(bcq_checkpoint, tmp_path / "bad", config=lambda c: c.update(bits=12))
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        AutoModelForCausalLM.from_pretrained(path)


# module selection ---------------------------------------------------------------------------------


def test_modules_to_not_convert_glob_matches_replace_linear(float_llama):
    fp_model, path = float_llama
    cfg = QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=["lm_head", "*.mlp.*"])
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    assert quant_layers(model) and not any(".mlp." in n for n in quant_layers(model))
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    ref = replace_linear(copy.deepcopy(fp_model), cfg, progress=False)
    assert_same_state(model, ref)


def test_quantize_on_load_says_which_layers_the_default_skips_keep_against_the_config(float_llama):
    """transformers keeps output embeddings in float on load; a config whose modules_to_not_convert leaves lm_head
    out asked for it quantized, so the load says it was not (and how to get it), instead of a silent float head."""
    _, path = float_llama
    with pytest.warns(UserWarning, match=r"(?s)keeps 1 layer\(s\) in full precision.*\n  lm_head\n.*replace_linear"):
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]))
    assert type(model.lm_head) is nn.Linear and quant_layers(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*in full precision that modules_to_not_convert")
        AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(**FORMATS["bcq"]))
        AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(
            **FORMATS["bcq"], modules_to_not_convert=[], per_module=[["lm_head", None]]))


def test_unsupported_shape_names_layer(tmp_path):
    path = tmp_path / "fp"
    save_float(llama_config(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2), path)
    with pytest.raises(ValueError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj'.*modules_to_not_convert"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(**FORMATS["bcq"]))


def test_codebook_model_scope_matches_replace_linear(float_llama, tmp_path):
    """Shared codebooks need all layers: quantized after loading, still identical to replace_linear."""
    fp_model, path = float_llama
    cfg = QLinearConfig(format="codebook", codebook_scope="model")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    layers = quant_layers(model)
    assert len(layers) == 14
    books = [m.codebooks for m in layers.values()]
    assert all(torch.equal(b, books[0]) for b in books)
    ref = replace_linear(copy.deepcopy(fp_model), cfg, progress=False)
    assert_same_state(model, ref)
    model.save_pretrained(tmp_path)
    assert_same_state(model, AutoModelForCausalLM.from_pretrained(tmp_path))


def test_no_linear_layers_warns(tmp_path):
    from transformers import GPT2Config

    path = tmp_path / "gpt2"
    save_float(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=32), path)
    with pytest.warns(UserWarning, match="no nn.Linear layer to quantize"):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(**FORMATS["bcq"]))
    assert not quant_layers(model)


# layers transformers' default skips keep in float ----------------------------------------------------------


def _reloads_exactly(model, path):
    model.save_pretrained(path)
    again = type(model).from_pretrained(path)
    assert set(quant_layers(again)) == set(quant_layers(model))
    assert_same_state(again, model)
    return again


@pytest.mark.parametrize("tied", [False, True])
def test_a_quantized_output_layer_reloads(tmp_path, tied):
    """transformers keeps output embeddings (and tied weights) in float on load; a checkpoint that stores them packed
    (``modules_to_not_convert=[]``, GPTQModel's ``lm_head=True``) loads them packed, a tied model untied from them."""
    fp = save_float(llama_config(tie_word_embeddings=tied), tmp_path / "fp")
    model = replace_linear(copy.deepcopy(fp), QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]), progress=False)
    assert isinstance(model.lm_head, QuantLinear)
    again = _reloads_exactly(model, tmp_path / "q")
    assert isinstance(again.lm_head, QuantLinear) and not again.all_tied_weights_keys
    assert not again.config.tie_word_embeddings and not model.config.tie_word_embeddings
    assert torch.equal(again.model.embed_tokens.weight, fp.model.embed_tokens.weight)
    again.tie_weights()  # as Trainer does: nothing left to tie
    assert not hasattr(again.lm_head, "weight")
    assert torch.equal(logits(again), logits(model))
    # with the float lm_head of transformers' default skips the logits would differ
    assert not torch.equal(logits(model), logits(replace_linear(copy.deepcopy(fp), QLinearConfig(**FORMATS["bcq"]),
                                                                progress=False)))


def test_packed_tensors_of_an_output_layer_missing_from_the_checkpoint_raise(tmp_path):
    fp = save_float(llama_config(tie_word_embeddings=True), tmp_path / "fp")
    replace_linear(fp, QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]), progress=False).save_pretrained(
        tmp_path / "q")
    bad = edited(tmp_path / "q", tmp_path / "bad", tensors=lambda sd: [sd.pop(k) for k in list(sd) if "lm_head" in k])
    with pytest.raises(ValueError, match=r"(?s)missing packed tensors.*lm_head: planes, alpha"):
        AutoModelForCausalLM.from_pretrained(bad)  # not the tied float embedding in its place


def test_a_checkpoint_whose_config_quantizes_its_float_output_layer_loads_it_in_float(bcq_checkpoint, tmp_path):
    """Folders saved by quantize-on-load with ``modules_to_not_convert=[]`` store lm_head in float (transformers'
    default skips) while their config names no skip for it: the checkpoint decides."""
    want = AutoModelForCausalLM.from_pretrained(bcq_checkpoint)
    path = edited(bcq_checkpoint, tmp_path / "q", config=lambda c: c.update(
        modules_to_not_convert=[], per_module=[["lm_head", {**FORMATS["bcq"], "bits": 8}]]))
    again = AutoModelForCausalLM.from_pretrained(path)
    assert type(again.lm_head) is nn.Linear
    assert_same_state(again, want)


def test_a_quantized_last_module_reloads(tmp_path):
    """transformers also skips a model's last module (a classification head)."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(llama_config(num_labels=3, pad_token_id=0)).eval()
    replace_linear(model, QLinearConfig(**FORMATS["bcq"], modules_to_not_convert=[]), progress=False)
    assert isinstance(model.score, QuantLinear)
    again = _reloads_exactly(model, tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(again(TOKENS).logits, model(TOKENS).logits)


def test_a_second_call_s_skips_do_not_undo_the_first_call_s_layers(float_llama, tmp_path):
    model = copy.deepcopy(float_llama[0])
    replace_linear(model, QLinearConfig("bcq", bits=4, group_size=64), modules_to_not_convert=["lm_head", "self_attn"],
                   progress=False)
    replace_linear(model, QLinearConfig("bcq", bits=3, group_size=64), modules_to_not_convert=["lm_head", "mlp"],
                   progress=False)
    assert len(quant_layers(model)) == 14
    again = _reloads_exactly(model, tmp_path / "q")
    assert torch.equal(logits(again), logits(model))
    assert model.config.quantization_config.modules_to_not_convert == ["lm_head"]  # "mlp" matched no float layer
    assert len(model.config.quantization_config.per_module) == 6  # the mlp layers' exact names, "model." prefixed
    from transformers import AutoModel

    base = AutoModel.from_pretrained(tmp_path / "q")  # the base model: its names lack the prefix
    assert {n: m.config for n, m in quant_layers(base).items()} == {
        n.removeprefix("model."): m.config for n, m in quant_layers(model).items()}
    assert_same_state(base, model.model)


def test_t5_initializes_around_quantized_layers(tmp_path):
    """T5's ``_init_weights`` reads ``module.q.weight`` of every attention block transformers initializes, quantized
    or not; its ``_keep_in_fp32_modules`` (``wo``, whose ``.weight.dtype`` its forward reads) stay float on load and
    in replace_linear alike."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    torch.manual_seed(0)
    fp = AutoModelForSeq2SeqLM.from_config(T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=1,
                                                    num_heads=4, decoder_start_token_id=0)).eval()
    fp.save_pretrained(tmp_path / "fp")
    cfg = QLinearConfig(**FORMATS["bcq"])
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "fp", quantization_config=cfg)
    ref = replace_linear(copy.deepcopy(fp), cfg, progress=False)
    assert set(quant_layers(model)) == set(quant_layers(ref)) and len(quant_layers(model)) == 14
    assert not any(n.endswith(".wo") for n in quant_layers(model))
    assert_same_state(model, ref)
    again = _reloads_exactly(ref, tmp_path / "q")
    ids = TOKENS[:, :6]
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, decoder_input_ids=ids).logits, ref(input_ids=ids, decoder_input_ids=ids).logits)
    assert not hasattr(again.decoder.block[0].layer[0].SelfAttention.q, "weight")
    assert "initialize_weights" not in again.__dict__
    # a checkpoint with wo quantized (qlinear before 2026-11-28 did that) is refused: T5's forward reads wo.weight
    wo = copy.deepcopy(fp)
    wo._keep_in_fp32_modules = set()
    replace_linear(wo, cfg, progress=False).save_pretrained(tmp_path / "wo")
    with pytest.raises(ValueError, match=r"(?s)stored quantized but the config keeps them in float.*_keep_in_fp32.*\.wo"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "wo")


# other architectures ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch, config, fmt", [
    # fused query_key_value, biases everywhere, untied embed_out
    ("gpt_neox", GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=128, max_position_embeddings=64), "mixed"),
    # biases, project_in/out absent, lm_head tied to the embeddings (skipped by transformers' default skips)
    ("opt", OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                      word_embed_proj_dim=64, max_position_embeddings=64), "bcq"),
    # FalconLinear: an nn.Linear subclass with its own forward (the bias added after the matmul)
    ("falcon", FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, bias=True,
                            max_position_embeddings=64), "bcq"),
])
def test_other_architectures(tmp_path, arch, config, fmt):
    fp_model = save_float(config, tmp_path / "fp")
    cfg = QLinearConfig(**FORMATS[fmt])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=cfg)
    linears = {n for n, m in fp_model.named_modules() if isinstance(m, nn.Linear)}
    out_emb = {n for n, m in fp_model.named_modules() if m is fp_model.get_output_embeddings()}
    assert set(quant_layers(model)) == linears - out_emb
    assert any(m.bias is not None for m in quant_layers(model).values())
    ref = replace_linear(copy.deepcopy(fp_model), cfg, progress=False)
    assert_same_state(model, ref)
    assert torch.equal(logits(model), logits(ref))
    model.save_pretrained(tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert_same_state(model, reloaded)
    assert torch.equal(logits(model), logits(reloaded))


# compile ------------------------------------------------------------------------------------------


def test_generate_auto_compile(quantized_llama):
    from transformers import GenerationConfig
    from transformers.generation import CompileConfig

    fmt, model, _ = quantized_llama
    x = TOKENS[:1, :8]
    eager = model.generate(x, max_new_tokens=4, do_sample=False, cache_implementation="static", disable_compile=True)
    cc = CompileConfig(fullgraph=True)
    cc._compile_all_devices = True  # auto-compile is GPU-only by default
    torch._dynamo.reset()
    out = model.generate(x, generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                               cache_implementation="static", compile_config=cc))
    assert getattr(model, "_compiled_call", None) is not None  # generate really compiled the forward
    assert torch.equal(out, eager)


def test_a_saved_backend_that_cannot_run_here_falls_back_with_a_warning(float_llama, tmp_path, monkeypatch):
    """``backend`` in a saved quantization_config is a preference (issue 22, item 4): a checkpoint quantized for the
    GPU LUT kernel reloads on this CPU machine and runs on a CPU kernel, with one warning, instead of failing every
    forward."""
    from qlinear import modules

    monkeypatch.setattr(modules, "_WARNED_PREFERENCES", set())
    _, path = float_llama
    cfg = QLinearConfig(format="bcq", bits=4, group_size=32, backend="cuda_lut")
    with pytest.warns(UserWarning, match="configured backend 'cuda_lut' cannot run"):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["backend"] == "cuda_lut"
    monkeypatch.setattr(modules, "_WARNED_PREFERENCES", set())
    with pytest.warns(UserWarning, match="configured backend 'cuda_lut' cannot run") as record:
        again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum("configured backend" in str(w.message) for w in record) == 1  # once, not once per layer
    layers = quant_layers(again)
    cpu = {k.backend for k in qlinear.backends.kernels("bcq") if k.devices is None or "cpu" in k.devices}
    assert all(m.backend is None and m.kernel(torch.zeros(1, m.in_features)).backend in cpu for m in layers.values())
    assert torch.equal(logits(again), logits(model))


def test_loading_repacks_each_layer_once(float_llama, tmp_path, counting_layout):
    """Issue 22, item 2: quantize-on-load and a pre-quantized load each convert a layer into its kernel layout once,
    never back (the quantizer hands transformers canonical buffers; loading fills canonical buffers)."""
    counts = counting_layout
    _, path = float_llama
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QLinearConfig(
        format="bcq", bits=4, group_size=32, init="uniform", iters=0))
    n = len(quant_layers(model))
    assert n == 14 and all(m.layout == "counting" for m in quant_layers(model).values())
    assert counts == {"repack": n, "unrepack": 0}
    model.save_pretrained(tmp_path)
    counts.update(repack=0, unrepack=0)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert counts == {"repack": n, "unrepack": 0}
    assert torch.equal(logits(again), logits(model))


@pytest.mark.parametrize("fmt", ["bcq", "mixed-rotated"])
def test_model_dequantize_gives_float_layers_holding_the_quantized_weights(tmp_path, fmt):
    """transformers' ``model.dequantize()`` (bitsandbytes' and HQQ's quantizers have it): nn.Linear layers whose
    weights are the layers' Ŵ, so the float model computes what the quantized one did (to the x86 kernels'
    activation rounding), and it saves as a plain float checkpoint."""
    save_float(llama_config(), tmp_path / "fp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp", quantization_config=QLinearConfig(**FORMATS[fmt]))
    layers = {n: (m.dequantize(), None if m.bias is None else m.bias.clone()) for n, m in quant_layers(model).items()}
    want = logits(model)
    plain = model.dequantize()
    assert not quant_layers(plain) and not plain.is_quantized and not hasattr(plain.config, "quantization_config")
    for name, (w, _) in layers.items():
        dense = plain.get_submodule(name)
        assert type(dense) is nn.Linear and torch.equal(dense.weight, w) and not dense.weight.requires_grad
    got = logits(plain)
    assert (got - want).norm() <= 0.02 * want.norm()
    plain.save_pretrained(tmp_path / "plain")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert not quant_layers(again) and torch.equal(logits(again), got)


def test_a_failed_load_state_dict_leaves_the_whole_model_as_it_was(tmp_path):
    """torch loads module by module: a state dict whose last quantized layer is wrong used to leave the layers before
    it loaded.  Models from replace_linear and from_pretrained check every quantized layer's entries first."""
    save_float(llama_config(), tmp_path / "fp")
    a = replace_linear(AutoModelForCausalLM.from_pretrained(tmp_path / "fp"), QLinearConfig(**FORMATS["bcq"]),
                       progress=False)
    a.save_pretrained(tmp_path / "q")
    other = replace_linear(save_float(llama_config(), tmp_path / "fp2", seed=1), QLinearConfig(**FORMATS["bcq"]),
                           progress=False).state_dict()
    last = "model.layers.1.mlp.down_proj"
    for model in (a, AutoModelForCausalLM.from_pretrained(tmp_path / "q")):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for key, value, message in ((f"{last}.alpha", other[f"{last}.alpha"][..., :1].clone(), "expects"),
                                    (f"{last}.offset", torch.full_like(other[f"{last}.offset"], float("nan")),
                                     "'offset' holds NaN")):
            with pytest.raises(ValueError, match=message):
                model.load_state_dict({**other, key: value})
            assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        model.load_state_dict(other)  # a good one still loads
        assert torch.equal(model.state_dict()[f"{Q}.alpha"], other[f"{Q}.alpha"])
