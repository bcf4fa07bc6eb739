"""replace_linear and calibrate on a small random Llama."""

import pytest
import torch
from torch import nn

import qlinear
from qlinear import QLinearConfig, calibrate, replace_linear

from conftest import tiny_llama


def linear_names(model, cls=nn.Linear):
    return {n for n, m in model.named_modules() if type(m) is cls}


@pytest.mark.parametrize("config", [QLinearConfig("bcq", bits=4, group_size=32), QLinearConfig("mixed"),
                                    QLinearConfig("codebook", bits=2)])
def test_replace_all_formats(config):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 16))
    ref = model(ids).logits
    names = linear_names(model) - {"lm_head"}
    replace_linear(model, config, progress=False)
    assert all(isinstance(model.get_submodule(n), qlinear.QuantLinear) for n in names)
    assert type(model.lm_head) is nn.Linear
    out = model(ids).logits
    assert out.shape == ref.shape and torch.isfinite(out).all()
    # a random model's logits are tiny; the quantized ones must still be correlated with the originals
    assert torch.corrcoef(torch.stack([out.flatten(), ref.flatten()]))[0, 1] > 0.8


def test_patterns_and_per_module():
    model = tiny_llama()
    replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32), modules_to_not_convert=["lm_head", "o_proj"],
                   per_module={"*.mlp.*": QLinearConfig("codebook", bits=4), "layers.1.self_attn.q_proj": None},
                   progress=False)
    assert type(model.model.layers[0].self_attn.o_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.q_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, qlinear.CodebookLinear)
    assert isinstance(model.model.layers[0].self_attn.k_proj, qlinear.BCQLinear)


def test_failed_replace_leaves_model_untouched():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    before["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj.*NaN or Inf"):
        replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32), progress=False)
    assert not any(isinstance(m, qlinear.QuantLinear) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # a format constraint the shapes violate: also a clear error naming a layer, nothing swapped
    with pytest.raises(ValueError, match="layer '.*'.*divisible"):
        replace_linear(tiny_llama(), QLinearConfig("mixed", group_size=48), progress=False)
    with pytest.raises(TypeError):
        replace_linear(model, {"format": "bcq"})


def test_calibrate_shapes_and_sharing():
    model = tiny_llama()
    data = [torch.randint(0, 128, (1, 24)) for _ in range(3)]
    H = calibrate(model, data, progress=False)
    assert H["model.layers.0.self_attn.q_proj"].shape == (64, 64)
    assert H["model.layers.0.mlp.down_proj"].shape == (128, 128)
    assert H["model.layers.0.self_attn.q_proj"] is H["model.layers.0.self_attn.k_proj"]  # same input
    # equals XᵀX / n computed directly
    xs = []
    h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, 128)))
    with torch.no_grad():
        for d in data:
            model(d)
    h.remove()
    X = torch.cat(xs)
    assert torch.allclose(H["model.layers.0.mlp.down_proj"], X.T @ X / X.shape[0], rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="tokenizer"):
        calibrate(model, ["some text"])
    for max_length, error in ((0, ValueError), (-15, ValueError), (2.5, TypeError)):  # slices would take any of these
        with pytest.raises(error, match="max_length must be"):
            calibrate(model, data, max_length=max_length, progress=False)


def test_calibrated_replace_lowers_output_error():
    model = tiny_llama()
    data = [torch.randint(0, 128, (1, 32)) for _ in range(8)]
    H = calibrate(model, data, progress=False)
    name = "model.layers.0.mlp.down_proj"
    lin = model.get_submodule(name)
    cfg = QLinearConfig("mixed")
    plain = qlinear.MixedPrecisionLinear.from_linear(lin, cfg)
    calib = qlinear.MixedPrecisionLinear.from_linear(lin, cfg, hessian=H[name])

    def err(m):
        e = (lin.weight - m.dequantize()).double()
        return torch.trace(e @ H[name].double() @ e.T)

    assert err(calib) < err(plain)
    replace_linear(model, cfg, calibration_data=H, progress=False)
    assert torch.equal(model.get_submodule(name).canonical()["qweight2"], calib.canonical()["qweight2"])


def test_codebook_model_scope_shares_codebooks():
    model = tiny_llama()
    replace_linear(model, QLinearConfig("codebook", bits=2, codebook_scope="model"), progress=False)
    books = [m.codebooks for m in model.modules() if isinstance(m, qlinear.CodebookLinear)]
    assert len(books) == 14 and all(torch.equal(b, books[0]) for b in books)


def test_compiled_quantized_model_matches_eager():
    torch._dynamo.reset()
    model = tiny_llama()
    replace_linear(model, QLinearConfig("bcq", bits=4, group_size=32), progress=False)
    ids = torch.randint(0, 128, (1, 12))
    eager = model(ids).logits
    compiled = torch.compile(model, fullgraph=True)
    assert torch.allclose(compiled(ids).logits, eager, atol=1e-4)


def test_replace_then_save_pretrained_reloads(tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny_llama()
    cfg = QLinearConfig("bcq", bits=3, group_size=32)
    replace_linear(model, cfg, progress=False)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 128, (1, 10))
    assert isinstance(again.model.layers[0].mlp.up_proj, qlinear.BCQLinear)
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert cfg.modules_to_not_convert == ["lm_head"]  # the user's config object is not modified


def test_rotation_without_calibration_warns(caplog):
    """A rotated config without calibration_data logs why (rotation pays only with error feedback); with it, or
    unrotated, nothing is logged."""
    import logging

    data = [torch.randint(0, 128, (1, 16)) for _ in range(2)]
    runs = [(QLinearConfig("bcq", bits=4, group_size=32, rotation="hadamard"), None, True),
            (QLinearConfig("bcq", bits=4, group_size=32), None, False),
            (QLinearConfig("bcq", bits=4, group_size=32, method="gptq", rotation="hadamard"), data, False)]
    for cfg, calib, warns in runs:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qlinear"):
            replace_linear(tiny_llama(), cfg, calibration_data=calib, progress=False)
        assert any("without calibration_data" in r.message for r in caplog.records) == warns, cfg
