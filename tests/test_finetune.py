"""qlinear.finetune: gradients of each format's tunable buffers, the distillation it runs, and its errors; and
qlinear.generate_data, the float model's own samples it can distil on."""

import copy

import pytest
import torch

import qlinear
from qlinear import QLinearConfig, QuantLinear
from qlinear.finetune import finetune
from qlinear.formats import get_format

from conftest import tiny_llama

CONFIGS = [QLinearConfig("bcq", bits=4, group_size=32, method="gptq"),  # uniform storage: scales
           QLinearConfig("bcq", bits=3, group_size=32),  # non-uniform: alpha and offset
           QLinearConfig("codebook", bits=2, group_size=32),
           QLinearConfig("codebook", bits=4, group_size=32, rotation="hadamard"),
           QLinearConfig("mixed", group_size=16, outlier_ratio=0.005)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.format}{c.bits}")
def test_autograd_gradient_of_tunable_buffers_matches_finite_difference(config):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False)
    layer = qlinear.modules.module_class(config.format).from_linear(lin, config)
    fmt, bufs = get_format(layer.format), layer.canonical()
    names = [n for n in fmt.TUNABLE if n in bufs and bufs[n].numel()]
    assert names, "every format has at least one tunable buffer"
    base = {n: bufs[n].to(torch.float32).requires_grad_(True) for n in names}
    probe = torch.randn(48, 64, dtype=torch.float64)
    w0 = fmt.dequantize({**bufs, **base}, layer.config, 48, 64)
    (probe.float() * w0).sum().backward()
    for n in names:
        step = torch.randn_like(base[n]) * base[n].detach().abs().mean() * 1e-2
        w1 = fmt.dequantize({**bufs, **{k: v.detach() for k, v in base.items()}, n: base[n].detach() + step},
                            layer.config, 48, 64)
        finite = (probe * (w1.double() - w0.detach().double())).sum()  # exact for a weight linear in the buffer
        analytic = (base[n].grad.double() * step.double()).sum()
        assert torch.allclose(finite, analytic, rtol=1e-3, atol=1e-6 * probe.abs().sum()), (n, finite, analytic)


def _kl(student, teacher, ids):
    with torch.no_grad():
        s, t = student(ids).logits.log_softmax(-1), teacher(ids).logits.log_softmax(-1)
    return (t.exp() * (t - s)).sum(-1).mean().item()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.format}{c.bits}")
def test_finetune_lowers_the_distillation_loss_and_changes_only_tunable_buffers(config):
    teacher = tiny_llama()
    model = copy.deepcopy(teacher)
    data = [torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    H = qlinear.calibrate(model, data, progress=False)
    qlinear.replace_linear(model, config, calibration_data=H, progress=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    before = {n: {k: v.clone() for k, v in m.canonical().items()} for n, m in layers.items()}
    bits = {n: m.bits_per_weight for n, m in layers.items()}
    kl0 = sum(_kl(model, teacher, ids) for ids in data)
    losses = finetune(model, data, teacher=teacher, steps=25, batch_size=2, lr=1e-2, progress=False)
    kl1 = sum(_kl(model, teacher, ids) for ids in data)
    assert len(losses) == 25 and kl1 < 0.8 * kl0, (kl0, kl1)
    changed = 0
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear):
            assert m is layers[n] and m.bits_per_weight == bits[n]
            fmt = get_format(m.format)
            for k, v in m.canonical().items():
                assert v.dtype == before[n][k].dtype and v.shape == before[n][k].shape
                if k not in fmt.TUNABLE:
                    assert torch.equal(v, before[n][k]), (n, k)
                else:
                    changed += not torch.equal(v, before[n][k])
    assert changed > 0
    assert all(p.requires_grad for p in teacher.parameters())  # the teacher was not touched
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_finetune_without_teacher_lowers_next_token_loss():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    qlinear.replace_linear(model, QLinearConfig("codebook", bits=2, group_size=32), progress=False)

    def nll():
        with torch.no_grad():
            logits = model(ids).logits
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()

    start = nll()
    losses = finetune(model, [ids], steps=40, batch_size=1, lr=5e-2, progress=False)
    assert abs(losses[0] - start) < 1e-3 * start  # step 0 reports the loss of the untouched model
    assert nll() < 0.97 * start


def test_finetune_errors_leave_the_model_as_it_was():
    model = tiny_llama()
    with pytest.raises(ValueError, match="no QuantLinear"):
        finetune(model, [torch.randint(0, 128, (1, 8))], progress=False)
    qlinear.replace_linear(model, QLinearConfig("codebook", bits=2, group_size=32), progress=False)
    ids = torch.randint(0, 128, (1, 16))
    ref = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for kw in ({"steps": 0}, {"batch_size": 0}, {"lr": float("nan")}, {"lr": -1.0}):
        with pytest.raises(ValueError, match="must be positive"):
            finetune(model, [ids], progress=False, **kw)
    from transformers import LlamaConfig, LlamaForCausalLM
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    for data in ([ids % 64], [ids]):  # ids past the teacher's 64 once failed inside its embedding (IndexError)
        with pytest.raises(ValueError, match="teacher has a vocabulary of 64 tokens, the model 128"):
            finetune(model, data, teacher=other, steps=2, progress=False)
    with pytest.raises(ValueError, match="separate float model"):
        finetune(model, [ids], teacher=model, progress=False)
    with pytest.raises(ValueError, match="non-finite"):
        finetune(model, [ids], steps=3, lr=1e30, progress=False)
    with pytest.raises(TypeError, match="tokenizer"):
        finetune(model, ["a text"], progress=False)
    with pytest.raises(TypeError, match="must be ints"):
        finetune(model, [ids], steps="2", progress=False)
    with pytest.raises(TypeError, match="seed must be ints"):
        finetune(model, [ids], seed="a", progress=False)
    for max_length, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_length must be"):
            finetune(model, [ids], max_length=max_length, progress=False)
    with pytest.raises(TypeError, match="teacher must be the float model"):
        finetune(model, [ids], teacher="float model", progress=False)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 128\)"):
        finetune(model, [ids + 128], progress=False)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        finetune(model, [ids[:, :1]], progress=False)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert torch.equal(model(ids).logits, ref)


def test_data_and_evaluation_inputs_are_checked():
    """Inputs a review helper found accepted or failing deep inside torch/transformers: bool or uint8 token ids, a 3-D
    id tensor (once flattened into one sequence), generate_data's non-int arguments, perplexity's max_tokens below
    one window (once sliced as a negative index), an empty greedy prompt, and calibration of a model on the meta
    device (once meta Hessians, or transformers' error from inside the forward)."""
    from qlinear.evaluation import greedy_continuation, perplexity

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 8))
    for bad in (ids.bool(), ids.to(torch.uint8), ids.float()):
        with pytest.raises(TypeError, match="int64/int32 token-id tensors"):
            qlinear.calibrate(model, [bad], progress=False)
    with pytest.raises(ValueError, match=r"must be \[T\] or \[batch, T\], got \[2, 2, 3\]"):
        qlinear.calibrate(model, [torch.zeros(2, 2, 3, dtype=torch.long)], progress=False)
    assert len(qlinear.calibrate(model, [ids.int()], progress=False)) > 0
    for kw in ({"seed": None}, {"length": 6.0}, {"num_samples": 1.5}, {"batch_size": True}):
        with pytest.raises(TypeError, match="must be ints"):
            qlinear.generate_data(model, **{"num_samples": 2, "length": 6, **kw}, progress=False)
    with pytest.raises(ValueError, match="max_tokens >= window"):
        perplexity(model, None, "text", max_tokens=-1, window=8)
    with torch.device("meta"):
        meta = tiny_llama()
    with pytest.raises(ValueError, match="on the meta device"):
        qlinear.calibrate(meta, [ids], progress=False)
    with pytest.raises(ValueError, match="on the meta device"):
        qlinear.replace_linear(meta, QLinearConfig("bcq", bits=4, group_size=32, method="gptq"), calibration_data=[ids],
                               progress=False)
    assert not any(isinstance(m, QuantLinear) for m in meta.modules())  # nothing replaced
    empty = lambda text, **kw: {"input_ids": torch.zeros(1, 0, dtype=torch.long)}
    with pytest.raises(ValueError, match="has no tokens"):
        greedy_continuation(model, empty, "")


def test_generate_data_starts_random_then_greedy_and_keeps_the_callers_state():
    model = tiny_llama().train()
    rng = torch.get_rng_state()
    data = qlinear.generate_data(model, 6, 10, greedy_tokens=3, batch_size=4, seed=5, progress=False)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert len(data) == 6 and all(d.shape == (1, 10) and d.dtype == torch.int64 for d in data)
    ids = torch.cat(data)
    assert 0 <= ids.min() and ids.max() < 128 and ids[:, 0].unique().numel() > 1
    with torch.no_grad():
        for t in (1, 2, 3):  # greedy under the float model, EOS (id 2) suppressed until the end
            logits = model.eval()(ids[:, :t]).logits[:, -1]
            logits[:, 2] = -float("inf")
            assert torch.equal(ids[:, t], logits.argmax(-1)), t
    assert torch.equal(torch.cat(qlinear.generate_data(model, 6, 10, batch_size=4, seed=5, progress=False)), ids)
    assert not torch.equal(torch.cat(qlinear.generate_data(model, 6, 10, seed=6, progress=False)), ids)


def test_generate_data_ignores_the_checkpoints_decoding_settings():
    model = tiny_llama()
    want = torch.cat(qlinear.generate_data(model, 4, 12, progress=False))
    config = model.generation_config
    for k, v in {"repetition_penalty": 5.0, "top_k": 5, "top_p": 0.5, "temperature": 0.3, "do_sample": True,
                 "no_repeat_ngram_size": 2, "num_return_sequences": 2}.items():
        setattr(config, k, v)
    assert torch.equal(torch.cat(qlinear.generate_data(model, 4, 12, progress=False)), want)
    assert model.generation_config is config and config.top_k == 5


def test_generate_data_samples_from_the_models_distribution():
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # a peaked next-token distribution, far from uniform and from greedy
    ids = torch.cat(qlinear.generate_data(model, 1500, 2, greedy_tokens=0, batch_size=500, progress=False))
    with torch.no_grad():
        logits = model(ids[:, :1]).logits[:, -1].double()
    logits[:, 2] = -float("inf")
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0)).sum(-1)
    picked = logp.gather(1, ids[:, 1:]).squeeze(1)
    # E[log p(X)] = -H for X ~ p; greedy or uniform sampling would sit far above or below
    gap = (picked + entropy).mean()
    assert gap.abs() < 4 * (picked + entropy).std() / len(ids) ** 0.5, gap
    assert entropy.mean() > 0.3 and (logp.exp().max(-1).values.mean() < 0.95)  # sampled, not a forced choice


def test_generate_data_errors():
    model = tiny_llama()
    with pytest.raises(TypeError, match="transformers causal LM"):
        qlinear.generate_data(torch.nn.Linear(4, 4))
    for kw, msg in (({"num_samples": 0}, "num_samples and batch_size"), ({"batch_size": 0}, "num_samples and batch"),
                    ({"length": 4, "greedy_tokens": 3}, "at least greedy_tokens . 2 = 5"),
                    ({"length": 1, "greedy_tokens": 0}, "= 2"), ({"greedy_tokens": -1}, "length must be"),
                    ({"length": model.config.max_position_embeddings + 1}, "longer than the model takes")):
        with pytest.raises(ValueError, match=msg):
            qlinear.generate_data(model, **{"num_samples": 4, "length": 8, **kw}, progress=False)


def test_distillation_on_the_models_own_samples_needs_no_data():
    teacher = tiny_llama()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10)  # next-token distributions far from uniform: a KL worth lowering
    model = copy.deepcopy(teacher)
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=3, group_size=32), progress=False)
    held_out = qlinear.generate_data(teacher, 4, 24, seed=99, progress=False)
    kl0 = sum(_kl(model, teacher, ids) for ids in held_out)
    finetune(model, qlinear.generate_data(teacher, 16, 24, progress=False), teacher=teacher, steps=40, batch_size=2,
             lr=3e-2, progress=False)
    assert sum(_kl(model, teacher, ids) for ids in held_out) < 0.85 * kl0  # on samples it was not tuned on


def test_finetune_runs_equal_length_sequences_as_one_batch_without_mixing_them():
    teacher = tiny_llama()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10)  # a KL far above float32 rounding
    model = copy.deepcopy(teacher)
    # the reference backend: Ŵ as finetune computes it, so only the batching can move the loss
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=3, group_size=32, backend="reference"), progress=False)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 128, shape, generator=g) for shape in ((1, 24), (1, 16), (2, 24), (1, 24))]
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids in data:  # KL summed sequence by sequence, in float64
            for row in ids:
                s = model(row[None]).logits.double().log_softmax(-1)
                t = teacher(row[None]).logits.double().log_softmax(-1)
                total += (t.exp() * (t - s)).sum().item()
                tokens += row.numel()
    losses = finetune(model, data, teacher=teacher, steps=1, batch_size=len(data), progress=False)
    # step 0 sees every sequence with the untouched weights; lengths 24 ran as one [4, 24] batch
    assert losses[0] == pytest.approx(total / tokens, rel=1e-4)


@pytest.mark.parametrize("call", ["calibrate", "generate_data", "finetune", "perplexity", "replace_linear"])
def test_helpers_run_in_eval_mode_and_keep_each_modules_own_flag(call):
    model = tiny_llama().train()
    model.model.layers[0].eval()  # a mixed model: one frozen block in eval mode
    flags = {n: m.training for n, m in model.named_modules()}
    ids = [torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    seen = []
    model.model.layers[1].register_forward_pre_hook(lambda m, a: seen.append(any(x.training for x in model.modules())))
    if call == "finetune":
        teacher = tiny_llama()
        qlinear.replace_linear(model, QLinearConfig("bcq", bits=3, group_size=32), progress=False)
        flags = {n: m.training for n, m in model.named_modules()}
        teacher.model.layers[1].train()
        teacher_flags = {n: m.training for n, m in teacher.named_modules()}
        finetune(model, ids, teacher=teacher, steps=1, progress=False)
        assert {n: m.training for n, m in teacher.named_modules()} == teacher_flags
    elif call == "calibrate":
        qlinear.calibrate(model, ids, progress=False)
    elif call == "generate_data":
        qlinear.generate_data(model, 2, 6, progress=False)
    elif call == "perplexity":
        from qlinear.evaluation import perplexity

        perplexity(model, lambda text, add_special_tokens: {"input_ids": list(range(40))}, "text", window=8)
    else:  # block by block calibration, then each new layer takes its parent's flag
        qlinear.replace_linear(model, QLinearConfig("bcq", bits=3, group_size=32, method="gptq"),
                               calibration_data=ids, progress=False)
        for n, m in model.named_modules():
            if isinstance(m, QuantLinear):
                flags[n] = flags[n.rpartition(".")[0]]
    assert seen and not any(seen)
    assert {n: m.training for n, m in model.named_modules()} == flags
