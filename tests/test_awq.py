"""AutoAWQ checkpoints ("gemm" and "gemv" layouts): exact layers, load/save, and the errors on what they cannot hold.

The reference packer below is written from AutoAWQ's layout description (``WQLinear_GEMM``: qweight ``[K, N/8]``,
nibble i of word c holding output column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; ``WQLinear_GEMV``: qweight ``[N, K/8]``
with inputs in order, qzeros/scales padded to a width that depends on the group size), one nibble at a time.
Where AutoAWQ 0.2.9 is installed (``pip install --no-deps autoawq==0.2.9``, as README's install command does), its own
``WQLinear_GEMM`` / ``WQLinear_GEMV`` packing and ``dequantize_gemm`` are the reference too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

import qlinear
from qlinear import BCQLinear, QLinearConfig

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _word(nibbles) -> int:
    v = 0
    for i, n in enumerate(nibbles):
        v |= int(n) << (4 * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def naive_awq(codes, zeros, scales, group_size, version):
    """(qweight, qzeros, scales) of 4-bit ``codes [N, K]``, ``zeros [N, G]``, ``scales [N, G]``, nibble by nibble."""
    N, K = codes.shape
    G = zeros.shape[1]
    if version == "gemm":
        qweight = [[_word(codes[8 * c + o, k] for o in ORDER) for c in range(N // 8)] for k in range(K)]
        qzeros = [[_word(zeros[8 * c + o, g] for o in ORDER) for c in range(N // 8)] for g in range(G)]
        return (torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32),
                scales.T.contiguous().half())
    g = K if group_size == -1 else group_size
    multiple = 1 if g >= 128 else {64: 2, 32: 4}[g]
    words = -(-G // 8)
    width = -(-words // multiple) * multiple
    z = torch.zeros(N, 8 * width, dtype=torch.int64)
    z[:, :G] = zeros
    s = torch.zeros(N, 8 * width, dtype=torch.float16)
    s[:, :G] = scales
    qweight = [[_word(codes[n, 8 * c:8 * c + 8]) for c in range(K // 8)] for n in range(N)]
    qzeros = [[_word(z[n, 8 * c:8 * c + 8]) for c in range(width)] for n in range(N)]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32), s


def _uniform(N, K, G, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g)
    zeros = torch.randint(0, 16, (N, G), generator=g)
    scales = (torch.rand(N, G, generator=g) * 0.05 + 1e-3).half().float()
    return codes, zeros, scales


@pytest.mark.parametrize("version", ["gemm", "gemv"])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq_layer_is_exact_and_exports_bit_for_bit(version, group_size):
    N, K = 24, 256
    G = 1 if group_size == -1 else K // group_size
    codes, zeros, scales = _uniform(N, K, G)
    tensors = naive_awq(codes, zeros, scales, group_size, version)
    bias = torch.randn(N)
    layer = BCQLinear.from_awq(*tensors, in_features=K, out_features=N, group_size=group_size, version=version,
                               bias=bias, backend="reference")
    cols = torch.arange(K) // (K // G)
    want = scales.double()[:, cols] * (codes - zeros[:, cols]).double()
    assert torch.equal(layer.dequantize().double(), want)
    x = torch.randn(3, K)
    assert torch.allclose(layer(x).double(), x.double() @ want.T + bias.double(), atol=1e-4)
    out = layer.to_awq(version)
    for name, t in zip(("qweight", "qzeros", "scales"), tensors):
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert torch.equal(out["bias"], bias.half())


def _autoawq(monkeypatch):
    """AutoAWQ's ``(gemm, gemv, packing_utils)`` modules, loaded from their files: the package's ``__init__`` imports
    transformers 4 internals that transformers 5 removed."""
    spec = importlib.util.find_spec("awq")
    if spec is None:
        pytest.skip("AutoAWQ is not installed (pip install --no-deps autoawq==0.2.9)")
    root = Path(spec.submodule_search_locations[0])
    for name in ("awq", "awq.utils"):
        stub = types.ModuleType(name)
        stub.__path__ = [str(root / name.partition(".")[2])]
        monkeypatch.setitem(sys.modules, name, stub)
    out = []
    for name, file in (("awq.utils.packing_utils", "utils/packing_utils.py"), ("_awq_gemm", "modules/linear/gemm.py"),
                       ("_awq_gemv", "modules/linear/gemv.py")):
        module_spec = importlib.util.spec_from_file_location(name, root / file)
        module = importlib.util.module_from_spec(module_spec)
        monkeypatch.setitem(sys.modules, name, module)
        module_spec.loader.exec_module(module)
        out.append(module)
    packing, gemm, gemv = out
    return gemm, gemv, packing


@pytest.mark.parametrize("version", ["gemm", "gemv"])
def test_reads_and_writes_what_autoawq_packs(monkeypatch, version):
    gemm, gemv, packing = _autoawq(monkeypatch)
    N, K, g = 64, 256, 64  # AutoAWQ's from_linear packs N // 32 · 4 words: N a multiple of 32
    codes, zeros, scales = _uniform(N, K, K // g, seed=3)
    cols = torch.arange(K) // g
    w = scales[:, cols] * (codes - zeros[:, cols])  # exact in float32
    lin = torch.nn.Linear(K, N)
    lin.weight.data = w
    if version == "gemm":
        theirs = gemm.WQLinear_GEMM.from_linear(lin, 4, g, scales=scales.T.contiguous(), zeros=zeros.T.contiguous())
    else:
        theirs = gemv.WQLinear_GEMV.from_linear(lin, 4, g, scales=scales, zeros=zeros)
    ours = BCQLinear.from_awq(theirs.qweight, theirs.qzeros, theirs.scales, in_features=K, out_features=N,
                              group_size=g, version=version, bias=theirs.bias, backend="reference")
    assert torch.equal(ours.dequantize(), w)
    if version == "gemm":
        assert torch.equal(packing.dequantize_gemm(theirs.qweight, theirs.qzeros, theirs.scales, 4, g), w.T.half())
    exported = ours.to_awq(version)
    for name in ("qweight", "qzeros", "scales", "bias"):
        assert torch.equal(exported[name], getattr(theirs, name)), name


def _rtn4(model=None, **kw):
    return qlinear.replace_linear(model or tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, init="uniform",
                                                                        iters=0, **kw), progress=False)


@pytest.mark.parametrize("version", ["gemm", "gemv"])
def test_save_and_load_awq_checkpoints(tmp_path, version):
    model = _rtn4(modules_to_not_convert=["lm_head", "*mlp.down_proj"])
    ids = torch.randint(0, 128, (2, 16))
    ref = model(ids).logits
    qlinear.save_awq(model, tmp_path, version=version)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    # a decoder block's float layer by its name within the block: AutoAWQ matches each block's layers so
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": version,
                   "modules_to_not_convert": ["lm_head", "mlp.down_proj"]}
    again = qlinear.load_awq(tmp_path, dtype=torch.float32)
    for block in (0, 1):
        down = again.model.layers[block].mlp.down_proj
        assert type(down) is torch.nn.Linear and torch.equal(down.weight, model.model.layers[block].mlp.down_proj.weight)
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, BCQLinear):
            assert torch.equal(again.get_submodule(name).dequantize(), mod.dequantize()), name
            n += 1
    assert n == 12
    assert torch.allclose(again(ids).logits, ref, atol=1e-4)
    with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj' is kept in float, "
                                         "'model.layers.0.mlp.down_proj' is quantized"):
        qlinear.save_awq(_rtn4(modules_to_not_convert=["lm_head", "*.1.mlp.down_proj"]), tmp_path / "one-block")
    assert not (tmp_path / "one-block").exists()


def test_loads_a_checkpoint_packed_from_the_spec(tmp_path):
    """A folder as AutoAWQ writes it (version "GEMM" in capitals, fp16 tensors, lm_head in float) loads as the float
    model with each quantized weight replaced by scales·(codes − zeros)."""
    from safetensors.torch import save_file

    model = tiny_llama().half()
    want = tiny_llama().double()
    tensors = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            N, K = mod.weight.shape
            codes, zeros, scales = _uniform(N, K, K // 64, seed=N + K)
            for k, t in zip(("qweight", "qzeros", "scales"), naive_awq(codes, zeros, scales, 64, "gemm")):
                tensors[f"{name}.{k}"] = t
            cols = torch.arange(K) // 64
            want.get_submodule(name).weight.data = scales.double()[:, cols] * (codes - zeros[:, cols]).double()
    for k, v in model.state_dict().items():
        if not k.endswith("proj.weight"):
            tensors[k] = v.contiguous()
    for k, v in want.state_dict().items():
        if not k.endswith("proj.weight"):
            v.copy_(tensors[k].double())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                     "version": "GEMM", "modules_to_not_convert": None}
    (tmp_path / "config.json").write_text(json.dumps(config, default=str))
    ours = qlinear.load_awq(tmp_path, dtype=torch.float32, backend="reference")
    assert sum(isinstance(m, BCQLinear) for m in ours.modules()) == 14
    ids = torch.randint(0, 128, (2, 12))
    got, ref = ours(ids).logits.double(), want(ids).logits
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_awq_errors(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="not an AWQ checkpoint"):
        qlinear.load_awq(tmp_path / "float")

    good = tmp_path / "awq"
    qlinear.save_awq(_rtn4(), good)
    config = json.loads((good / "config.json").read_text())
    for field, value, message in [("bits", 3, "4-bit codes"), ("zero_point", False, "zero_point = False"),
                                  ("version", "gemv_fast", "'gemv_fast' and 'marlin'")]:
        bad = json.loads(json.dumps(config))
        bad["quantization_config"][field] = value
        (good / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            qlinear.load_awq(good)
    (good / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(good / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.qweight"] = sd["model.layers.0.mlp.up_proj.qweight"][:, :-1].contiguous()
    save_file(sd, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.mlp.up_proj': AWQ 'gemm' qweight is \[64, 15\], "
                                         r"expected \[64, 16\]"):
        qlinear.load_awq(good)
    qlinear.save_awq(_rtn4(), good)
    sd = load_file(str(good / "model.safetensors"))
    save_file({**sd, "model.layers.0.mlp.up_proj.scales": sd["model.layers.0.mlp.up_proj.scales"].to(torch.int32)},
              str(good / "model.safetensors"))
    with pytest.raises(TypeError, match="AWQ scales must be fp16, got torch.int32"):
        qlinear.load_awq(good)

    out = tmp_path / "refused"
    for bad_model, message in [
        (qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=3, group_size=32, init="uniform", iters=0),
                                progress=False), "4-bit codes, this layer has 3"),
        (_rtn4(rotation="hadamard"), "rotated layer"),
        (qlinear.replace_linear(tiny_llama(), QLinearConfig("codebook", bits=2, iters=0), progress=False),
         "uniform int codes"),
        (qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0),
                                per_module={"*down_proj": QLinearConfig("bcq", bits=4, group_size=64, init="uniform",
                                                                        iters=0)}, progress=False),
         "one bits/group_size"),
        (qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=128, init="uniform", iters=0),
                                progress=False), "AWQ groups must divide in_features=64"),  # K = 64 < 128: fine for GPTQ, not AWQ
    ]:
        with pytest.raises(ValueError, match=message):
            qlinear.save_awq(bad_model, out)
        assert not out.exists()
    H = qlinear.calibrate(tiny_llama(), [torch.randint(0, 128, (1, 16))], progress=False)
    act_order = qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=32, method="gptq",
                                                                   act_order=True), calibration_data=H, progress=False)
    with pytest.raises(ValueError, match="act_order layer"):
        qlinear.save_awq(act_order, out)
    with pytest.raises(ValueError, match="AWQ groups must divide in_features=64, got group_size=96"):
        qlinear.save_awq(qlinear.replace_linear(tiny_llama(), QLinearConfig("bcq", bits=4, group_size=96,
                                                                            init="uniform", iters=0), progress=False),
                         out)
    with pytest.raises(ValueError, match="version.*one of"):
        qlinear.save_awq(_rtn4(), out, version="marlin")
    assert not out.exists()
    cfg = QLinearConfig("bcq", bits=4, group_size=96, init="uniform", iters=0)
    lin = qlinear.replace_linear(torch.nn.Sequential(torch.nn.Linear(192, 12)), cfg, progress=False)[0]
    with pytest.raises(ValueError, match="out_features=12 is not a multiple of 8"):
        lin.to_awq("gemm")
    with pytest.raises(ValueError, match="group sizes 32, 64 or >= 128"):
        lin.to_awq("gemv")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_imported_checkpoint_saves_as_a_qlinear_one(tmp_path, method):
    """load_awq / load_gptq, then save_pretrained: from_pretrained rebuilds the same layers (it used to build random
    nn.Linear layers and skip the packed tensors), float layers stay float, layers keep their own configs (GPTQ: a
    layer whose g_idx is in order loads without act_order), and the generation config is the checkpoint's."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if method == "awq":
        src = _rtn4(modules_to_not_convert=["lm_head", "*self_attn.o_proj"])
        qlinear.save_awq(src, tmp_path / "src")
        model = qlinear.load_awq(tmp_path / "src", dtype=torch.float32)
    else:
        H = qlinear.calibrate(tiny_llama(), [torch.randint(0, 128, (1, 16))], progress=False)
        cfg = QLinearConfig("bcq", bits=3, group_size=32, method="gptq", act_order=True,
                            modules_to_not_convert=["lm_head", "*.0.self_attn.o_proj"],
                            per_module={"*down_proj": QLinearConfig("bcq", bits=3, group_size=32, method="gptq")})
        src = qlinear.replace_linear(tiny_llama(), cfg, calibration_data=H, progress=False)
        qlinear.save_gptq(src, tmp_path / "src")
        model = qlinear.load_gptq(tmp_path / "src", dtype=torch.float32)
        assert {model.get_submodule(f"model.layers.{i}.mlp.down_proj").config.act_order for i in (0, 1)} == {False}
        assert model.model.layers[0].mlp.up_proj.config.act_order
    GenerationConfig(eos_token_id=[1, 7], max_new_tokens=5).save_pretrained(tmp_path / "src")
    model = getattr(qlinear, f"load_{method}")(tmp_path / "src", dtype=torch.float32)
    assert model.generation_config.eos_token_id == [1, 7]
    model.save_pretrained(tmp_path / "ql")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ql", dtype=torch.float32)
    names = {n for n, m in model.named_modules() if isinstance(m, BCQLinear)}
    assert len(names) == (12 if method == "awq" else 13)
    assert names == {n for n, m in again.named_modules() if isinstance(m, BCQLinear)}
    for name in names:
        a, b = model.get_submodule(name), again.get_submodule(name)
        assert a.config.to_json() == b.config.to_json() and torch.equal(a.dequantize(), b.dequantize()), name
    o_proj = again.model.layers[0].self_attn.o_proj
    assert type(o_proj) is torch.nn.Linear and torch.equal(o_proj.weight, model.model.layers[0].self_attn.o_proj.weight)
    ids = torch.randint(0, 128, (2, 12))
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert again.generation_config.eos_token_id == [1, 7]


def test_loader_refuses_what_it_cannot_read_and_overwrites_shards(tmp_path):
    from safetensors.torch import load_file, save_file

    good = tmp_path / "awq"
    qlinear.save_awq(_rtn4(), good)
    sd = load_file(str(good / "model.safetensors"))
    # an untied model needs its lm_head: it used to load with lm_head on the meta device
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit the model: missing \['lm_head.weight'\]"):
        qlinear.load_awq(good)
    save_file({k: v for k, v in sd.items() if k != "model.layers.0.mlp.up_proj.qzeros"}, str(good / "model.safetensors"))
    with pytest.raises(ValueError, match="has model.layers.0.mlp.up_proj.qweight but no model.layers.0.mlp.up_proj.qzeros"):
        qlinear.load_awq(good)
    (good / "model.safetensors").write_bytes((tmp_path / "awq" / "config.json").read_bytes()[:64])
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        qlinear.load_awq(good)

    # saving into a folder that held a sharded checkpoint: the index and its shards go, the new file is what loads
    old = tmp_path / "sharded"
    tiny_llama(seed=1).save_pretrained(old, max_shard_size="100KB")
    assert (old / "model.safetensors.index.json").exists()
    model = _rtn4()
    qlinear.save_awq(model, old)
    assert sorted(p.name for p in old.glob("*.safetensors*")) == ["model.safetensors"]
    again = qlinear.load_awq(old, dtype=torch.float32)
    assert torch.equal(again.model.layers[1].mlp.up_proj.dequantize(), model.model.layers[1].mlp.up_proj.dequantize())
