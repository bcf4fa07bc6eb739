"""QuantLinear modules: forward == x·Ŵᵀ + b, dtype/device moves, registry, torch.compile, bad input."""

import pytest
import torch
from torch import nn

import qlinear
from qlinear import BCQLinear, CodebookLinear, MixedPrecisionLinear, QLinearConfig, backends
from qlinear.backends import ANY, Kernel
from qlinear.modules import module_class

from conftest import cpu_kernel, dense64, ref64

CONFIGS = {
    "bcq": QLinearConfig("bcq", bits=3, group_size=64, iters=2),
    "mixed": QLinearConfig("mixed"),
    "codebook": QLinearConfig("codebook", bits=2),
    # incoherence processing (issue 27): every module mechanic holds for rotated layers too
    "bcq-rot": QLinearConfig("bcq", bits=3, group_size=64, iters=2, rotation="hadamard", rotation_seed=7),
    "mixed-rot": QLinearConfig("mixed", rotation="hadamard"),
    "codebook-rot": QLinearConfig("codebook", bits=2, rotation="hadamard", rotation_block=32),
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True, scope="module")
def _reference(reference_on_cpu):
    """The mechanics on the reference kernel's exact math (set up before the module's layers)."""


@pytest.fixture(scope="module")
def layers():
    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    with torch.no_grad():
        lin.weight.mul_(0.5)
    return lin, {f: module_class(c.format).from_linear(lin, c) for f, c in CONFIGS.items()}


@pytest.mark.parametrize("fmt", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (2, 1, 3)])
def test_forward_equals_dequantized_matmul(layers, fmt, dtype, lead):
    lin, mods = layers
    m = mods[fmt]
    x = torch.randn(*lead, 128).to(dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == (*lead, 48)
    ref = ref64(m, x.reshape(-1, 128)).reshape(*lead, 48)
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype]


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_no_bias_and_class(layers, fmt):
    lin = nn.Linear(128, 32, bias=False)
    m = module_class(CONFIGS[fmt].format).from_linear(lin, CONFIGS[fmt])
    assert m.bias is None and isinstance(m, qlinear.QuantLinear)
    x = torch.randn(4, 128)
    assert torch.allclose(m(x).double(), ref64(m, x), atol=1e-5)  # Ŵ by an independent float64 formula, no bias


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_dtype_moves_keep_packed_buffers(layers, fmt):
    _, mods = layers
    m = mods[fmt]
    before = {k: v.clone() for k, v in m.state_dict().items() if k != "bias"}
    m2 = module_class(CONFIGS[fmt].format)(128, 48, True, CONFIGS[fmt])
    m2.load_state_dict(m.state_dict())
    m2.to(torch.bfloat16)
    for k, v in before.items():
        got = m2.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    assert m2.bias.dtype == torch.bfloat16
    m2.half().float()
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_state_dict_roundtrip_bit_exact(layers, fmt, tmp_path):
    from safetensors.torch import load_file, save_file
    _, mods = layers
    m = mods[fmt]
    save_file(m.state_dict(), tmp_path / "m.safetensors")
    m2 = module_class(CONFIGS[fmt].format)(128, 48, True, CONFIGS[fmt])
    m2.load_state_dict(load_file(tmp_path / "m.safetensors"))
    x = torch.randn(3, 128)
    assert torch.equal(m(x), m2(x))


def test_bits_memory_and_repr(layers):
    _, mods = layers
    m = mods["bcq"]
    assert m.bits_per_weight == pytest.approx(3 + (3 * 16 + 16) / 64)
    # 3-bit planes (48 rows x 4 words x 3), 3 fp16 α and an fp16 offset per group of 64, fp32 bias: counted by hand
    assert m.memory_footprint() == 3 * 48 * 4 * 4 + (3 + 1) * 48 * 2 * 2 + 48 * 4
    r = repr(m)
    for s in ("format=bcq", "bits=3", "group_size=64", "backend=auto"):
        assert s in r
    for f, mm in mods.items():
        assert mm.memory_footprint() < 128 * 48 * 4 / 5  # well below fp32


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_compile_fullgraph_matches_eager(layers, fmt):
    torch._dynamo.reset()
    _, mods = layers
    model = nn.Sequential(mods[fmt], nn.GELU(), nn.Linear(48, 8))
    x = torch.randn(2, 7, 128)
    compiled = torch.compile(model, fullgraph=True)
    assert torch.allclose(compiled(x), model(x), atol=1e-5)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0


# ---------------------------------------------------------------- registry
def test_registry_reference_and_priority(layers, monkeypatch):
    _, mods = layers
    m = mods["bcq"]
    x = torch.randn(2, 128)
    assert m.kernel(x).backend == "reference"
    calls = []

    def fake(x, bufs, bias, cfg, n, k):
        calls.append(cfg.bits)
        return backends.reference.linear(x, bufs, bias, cfg, n, k) * 0 + 1

    kern = cpu_kernel("fake", "bcq", fake, priority=10, bits=frozenset({3}), max_batch=4)
    backends.register(kern)
    try:
        assert m.kernel(x).backend == "fake"
        assert torch.equal(m(x), torch.ones(2, 48))
        assert calls == [3]
        assert m.kernel(torch.randn(5, 128)).backend == "reference"  # batch outside range
        monkeypatch.setenv(backends.ENV_VAR, "reference")  # read when a (device, dtype, batch) is first resolved
        assert m.kernel(torch.randn(3, 128)).backend == "reference"
        assert m.kernel(x).backend == "fake"  # resolved before: kept
        monkeypatch.delenv(backends.ENV_VAR)
        m.backend = "reference"
        assert m.kernel(x).backend == "reference"
        m.backend = "fake"
        with pytest.raises(ValueError, match="batch 5"):
            m(torch.randn(5, 128))
    finally:
        m.backend = None
        backends._KERNELS.remove(kern)
    with pytest.raises(ValueError, match="no kernel"):
        backends.select("bcq", m.config, torch.device("cpu"), torch.float32, 1, "nonexistent")


def test_config_backend_override():
    lin = nn.Linear(64, 32)
    m = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=2, group_size=32, backend="reference"))
    assert m.backend == "reference" and "backend=reference" in repr(m)


# ---------------------------------------------------------------- bad input
def test_bad_inputs():
    lin = nn.Linear(100, 32)
    with pytest.raises(ValueError, match="divisible by 32"):
        BCQLinear.from_linear(lin, QLinearConfig("bcq"))
    with pytest.raises(ValueError, match="divisible by group_size"):
        MixedPrecisionLinear.from_linear(nn.Linear(72, 8), QLinearConfig("mixed", group_size=16))
    with pytest.raises(ValueError, match="divisible by group_size"):
        CodebookLinear.from_linear(nn.Linear(80, 8), QLinearConfig("codebook"))
    with pytest.raises(ValueError, match="bits"):
        QLinearConfig("bcq", bits=12)
    with pytest.raises(ValueError, match="group_size"):
        QLinearConfig("bcq", group_size=40)
    with pytest.raises(ValueError, match="unknown format"):
        QLinearConfig("nf4")
    with pytest.raises(ValueError, match="unknown options"):
        QLinearConfig("bcq", ratio_4bit=0.5)
    with pytest.raises(TypeError):
        BCQLinear.from_linear(nn.Conv1d(64, 64, 1), None)
    bad = nn.Linear(64, 32)
    with torch.no_grad():
        bad.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        BCQLinear.from_linear(bad, None)
    m = BCQLinear.from_linear(nn.Linear(64, 32), QLinearConfig("bcq", group_size=32))
    for call in (m, m.kernel):  # kernel() names the kernel only for inputs forward takes
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            call(torch.ones(2, 64, dtype=torch.int64))
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            call(torch.ones(2, 64, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
            call(torch.ones(2, 65))
        with pytest.raises(ValueError, match=r"\[\.\.\., 64\], got \[3, 0\]"):
            call(torch.ones(3, 0))
        with pytest.raises(ValueError, match=r"\[\.\.\., 64\], got \[\]"):
            call(torch.tensor(1.0))
    assert m.kernel(torch.ones(0, 64)) is m.kernel(torch.ones(1, 64))
    with pytest.raises(ValueError, match="expects"):
        m.load_state_dict({**m.state_dict(), "alpha": torch.zeros(4, 32, 3, dtype=torch.float16)})


def test_autograd_through_frozen_weights(layers):
    _, mods = layers
    m = mods["bcq"]
    x = torch.randn(3, 128, requires_grad=True)
    m(x).square().sum().backward()
    # d(Σ y²)/dx = 2·y·Ŵ, with y and Ŵ by the independent float64 formula
    w64 = dense64("bcq", m.canonical(), m.config, 48, 128)
    assert torch.allclose(x.grad.double(), 2 * ref64(m, x.detach()) @ w64, atol=1e-4)


@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_empty_batch_like_nn_linear(layers, fmt):
    _, mods = layers
    y = mods[fmt](torch.randn(0, 3, 128))
    assert y.shape == (0, 3, 48)


def test_bias_gradient(layers):
    lin, mods = layers
    m = module_class("bcq")(128, 48, True, CONFIGS["bcq"])
    m.load_state_dict(mods["bcq"].state_dict())
    m.bias.requires_grad_(True)
    x = torch.randn(5, 128)
    m(x).sum().backward()
    assert torch.allclose(m.bias.grad, torch.full((48,), 5.0))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_backend_on_cuda(layers, fmt, dtype):
    lin, mods = layers
    m = module_class(CONFIGS[fmt].format)(128, 48, True, CONFIGS[fmt])
    m.load_state_dict(mods[fmt].state_dict())
    m.cuda().to(dtype)
    # on the GPU the buffers are held in a kernel's layout: compare what it maps back to, bit for bit
    want = mods[fmt].canonical()
    assert all(torch.equal(t.cpu(), want[n]) for n, t in m.canonical().items()) and m.canonical().keys() == want.keys()
    x = torch.randn(4, 128)
    ref = x.double() @ mods[fmt].dequantize(torch.float64).T + lin.bias.double()
    y = m(x.cuda().to(dtype)).double().cpu()
    assert ((y - ref).abs().max() / ref.abs().max()) < TOL[dtype]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("fmt_name", ["gptq", "gptq_v2"])
def test_from_gptq_checkpoint_tensors_exact(bits, fmt_name):
    from qlinear.formats.packing import pack
    N, K, g = 64, 128, 32
    codes = torch.randint(0, 1 << bits, (N, K))
    zeros = torch.randint(0, 1 << bits, (N, K // g))
    scales = (torch.rand(N, K // g) * 0.01 + 0.001).half()
    stored = (zeros - 1) % (1 << bits) if fmt_name == "gptq" else zeros
    qweight = pack(codes, bits).T.contiguous()  # [K*bits/32, N], packed along K
    qzeros = pack(stored.T.contiguous(), bits)  # [G, N*bits/32], packed along N
    m = BCQLinear.from_gptq(qweight, qzeros, scales.T.contiguous(), bits=bits, group_size=g,
                            checkpoint_format=fmt_name)
    ref = scales.float().repeat_interleave(g, 1) * (codes - zeros.repeat_interleave(g, 1))
    assert torch.equal(m.dequantize(), ref)
    with pytest.raises(ValueError):
        BCQLinear.from_gptq(qweight, qzeros, scales.T.contiguous(), bits=3, group_size=g)


def test_bad_hessian_in_from_linear():
    lin = nn.Linear(64, 16)
    for cfg in CONFIGS.values():
        with pytest.raises(ValueError, match=r"\[64, 64\]"):
            module_class(cfg.format).from_linear(lin, cfg, hessian=torch.eye(65))
        with pytest.raises(TypeError):
            module_class(cfg.format).from_linear(lin, cfg, hessian=torch.eye(64, dtype=torch.int64))


def test_adopt_takes_over_shape_and_packed_data_in_place(layers):
    lin, mods = layers
    mod = BCQLinear.from_linear(lin, CONFIGS["bcq"])
    calls = []
    mod.register_forward_pre_hook(lambda m, args: calls.append(1))
    bias = mod.bias
    other = BCQLinear.from_linear(nn.Linear(64, 16), QLinearConfig("bcq", bits=2, group_size=32, iters=0))
    mod.adopt(other)
    assert (mod.in_features, mod.out_features, mod.config) == (64, 16, other.config) and mod.bias is bias
    assert all(torch.equal(a, b) for a, b in zip(mod.canonical().values(), other.canonical().values()))
    mod.bias = None  # the kept bias is the caller's business (TP: transformers' replicated/sharded one)
    x = torch.randn(3, 64)
    ref = x.double() @ other.dequantize(torch.float64).T
    torch.testing.assert_close(mod(x).double(), ref, atol=1e-5, rtol=1e-5)
    assert calls  # the hook on the object survived
    sd = mod.state_dict()
    assert set(sd) == set(other.state_dict()) - {"bias"}
    with pytest.raises(TypeError, match="cannot adopt"):
        mod.adopt(mods["codebook"])


# --- one kernel resolution per layer (issue 22) ----------------------------------------------------------------------
def _counting_select(monkeypatch):
    """Count registry walks: every resolution goes through backends.select."""
    from qlinear import ops

    calls = []
    real = backends.select

    def select(*args, **kwargs):
        calls.append(args[4])  # batch
        return real(*args, **kwargs)

    monkeypatch.setattr(backends, "select", select)
    ops.resolve.cache_clear()
    return calls


def test_forward_resolves_once_per_device_dtype_batch(layers, monkeypatch):
    lin, mods = layers
    m = BCQLinear.from_linear(lin, CONFIGS["bcq"])
    walks = _counting_select(monkeypatch)
    x = torch.randn(2, 128)
    with torch.no_grad():
        ys = [m(x) for _ in range(20)]
    assert walks == [2] and all(torch.equal(y, ys[0]) for y in ys)
    y3 = m(torch.randn(3, 1, 128))
    assert walks == [2, 3] and y3.shape == (3, 1, 48)
    m.backend = "reference"  # a backend change resolves anew
    m(x)
    assert walks == [2, 3, 2]

    seen = []

    def fn(x, bufs, bias, cfg, N, K):
        seen.append(x.shape[0])
        return backends.reference.linear(x, bufs, bias, cfg, N, K)

    m.backend = None
    k = backends.register(cpu_kernel("seen", "bcq", fn, priority=50))
    try:
        assert torch.equal(m(x), ys[0]) and seen == [2]  # a registered kernel is picked up at once
    finally:
        backends._KERNELS.remove(k)
    m(x)
    assert seen == [2] and len(walks) == 5  # and dropped again once removed
    # the op path (autograd, compile) resolves through the same cached function and gives the same result
    xg = x.clone().requires_grad_(True)
    assert torch.equal(m(xg), ys[0]) and len(walks) == 5
    # state-dict loads and moves keep serving the new weights
    other = BCQLinear.from_linear(nn.Linear(128, 48), CONFIGS["bcq"])
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(m(x), other(x))


def test_a_per_call_conversion_warns_once_and_names_the_reason(monkeypatch):
    """A layer held in a kernel layout whose kernel cannot take the call (here: batch above its range) runs a
    fallback on converted buffers, and says so once."""
    from qlinear.backends import cuda_lut

    def fn(x, bufs, bias, cfg, N, K):
        y = cuda_lut.spec(x.reshape(-1, K), bufs, bias, cfg, N, K, cuda_lut.plan(x.numel() // K, N, K, 4, cfg.bits))
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    k = backends.register(cpu_kernel("lut_cpu", "bcq", fn, priority=100, max_batch=2, layout=cuda_lut.LAYOUT))
    try:
        m = BCQLinear.from_linear(nn.Linear(64, 32), QLinearConfig("bcq", bits=2, group_size=32, iters=0))
        assert m.layout == "cuda_lut"
        with torch.no_grad():
            m(torch.randn(1, 64))  # the layout's own kernel: no warning
            msg = r"kernel reference serves cpu torch.float32 batch 5: .*lut_cpu: batch 5 outside \[1, 2\]"
            with pytest.warns(UserWarning, match=msg):
                y = m(torch.randn(5, 64))
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                m(torch.randn(5, 64))
                m(torch.randn(7, 64))
        assert y.shape == (5, 32)
    finally:
        backends._KERNELS.remove(k)


def test_kernel_choice_is_logged_once_and_described(layers, caplog):
    lin, _ = layers
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 48))
    qlinear.replace_linear(model, QLinearConfig("bcq", bits=3, group_size=32, iters=0), progress=False)
    with caplog.at_level("INFO", logger="qlinear"), torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 128))
    picks = [r.getMessage() for r in caplog.records if "-> kernel" in r.getMessage()]
    assert len(picks) == 2 and all("batch 2 -> kernel reference, layout canonical" in p for p in picks), picks
    text = qlinear.describe(model).splitlines()
    assert text[0].startswith("| layer |") and len(text) == 4
    assert text[2].startswith("| 0 | BCQLinear | 128 -> 64 | bcq 3-bit |")
    assert f"| canonical ({model[0].bits_per_weight:.3f}) | reference | " in text[2]
    assert text[2].endswith("|") and "quick: device cpu not in ['cuda']" in text[2].split("| reference |")[1]
    model[2].backend = "nonexistent"
    assert "none: backend 'nonexistent' has no kernel" in qlinear.describe(model).splitlines()[3]


def test_resolved_layers_pickle_and_deepcopy(layers, tmp_path):
    import copy

    lin, _ = layers
    m = BCQLinear.from_linear(lin, CONFIGS["bcq"])
    x = torch.randn(2, 128)
    with torch.no_grad():
        y = m(x)
        torch.save(m, tmp_path / "m.pt")
        again = torch.load(tmp_path / "m.pt", weights_only=False)
        assert torch.equal(again(x), y) and torch.equal(copy.deepcopy(m)(x), y)


def test_old_pickles_and_the_environment_resolve_per_layer(layers, monkeypatch):
    """A layer pickled before ``backend`` became a property still loads and runs; ``QLINEAR_BACKEND`` set after one
    layer resolved still applies to a new layer of the same config (the shared resolution cache keys on it)."""
    lin, _ = layers
    m = BCQLinear.from_linear(lin, CONFIGS["bcq"])
    x = torch.randn(2, 128)
    with torch.no_grad():
        y = m(x)
        state = dict(m.__getstate__())
        state["backend"] = state.pop("_backend")
        del state["_calls"]
        old = BCQLinear.__new__(BCQLinear)
        old.__setstate__(state)
        assert old.backend is None and torch.equal(old(x), y)

    seen = []

    def fn(x, bufs, bias, cfg, N, K):
        seen.append(1)
        return backends.reference.linear(x, bufs, bias, cfg, N, K)

    k = backends.register(cpu_kernel("seen", "bcq", fn, priority=50))
    try:
        with torch.no_grad():
            m(x)
            assert seen == [1]
            monkeypatch.setenv(backends.ENV_VAR, "reference")
            fresh = BCQLinear.from_linear(lin, CONFIGS["bcq"])
            assert fresh.kernel(x).backend == "reference" and m.kernel(x).backend == "seen"
    finally:
        backends._KERNELS.remove(k)


def test_a_configured_backend_is_a_preference_and_an_explicit_one_a_requirement(monkeypatch):
    """The backend of a config runs where it can and falls back (one warning) where it cannot; the ``backend``
    argument or attribute must run, else ValueError."""
    from qlinear import modules

    monkeypatch.setattr(modules, "_WARNED_PREFERENCES", set())
    calls = []

    def fn(x, bufs, bias, cfg, N, K):
        calls.append(x.shape)
        return x.new_zeros(*x.shape[:-1], N)

    k = backends.register(cpu_kernel("cpu_pref", "bcq", fn))
    try:
        lin = torch.nn.Linear(64, 32)
        x = torch.randn(3, 64)
        m = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32, backend="cpu_pref"))
        assert m.backend == "cpu_pref" and m.kernel(x).backend == "cpu_pref" and torch.equal(m(x), torch.zeros(3, 32))
        with pytest.warns(UserWarning, match=r"configured backend 'cuda_lut' cannot run .* on cpu"):
            p = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32, backend="cuda_lut"))
        assert p.backend is None and p.kernel(x).backend != "cuda_lut"
        ref = x.double() @ p.dequantize(torch.float64).T + lin.bias.double()
        assert torch.allclose(p(x).double(), ref, atol=1e-4)
        strict = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32), backend="cuda_lut")
        with pytest.raises(ValueError, match="cuda_lut: device cpu not in"):
            strict(x)
        p.backend = "cuda_lut"  # set by hand: a requirement
        with pytest.raises(ValueError, match="cuda_lut: device cpu not in"):
            p(x)
    finally:
        backends._KERNELS.remove(k)


def test_each_load_path_repacks_once_for_the_final_device(counting_layout):
    """Issue 22, item 2: from_linear, from_packed(...).to(device), load_state_dict and repeated moves convert each
    layer into its kernel layout exactly once and never back (unrepacks happen only to save)."""
    counts = counting_layout
    lin = nn.Linear(64, 32)
    cfg = QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0)
    m = BCQLinear.from_linear(lin, cfg)
    assert m.layout == "counting" and counts == {"repack": 1, "unrepack": 0}
    sd = m.state_dict()
    assert counts["unrepack"] == 1 and set(sd) == {"qweight", "scales", "qzeros", "bias"}
    counts.update(repack=0, unrepack=0)
    m.load_state_dict(sd)
    assert counts == {"repack": 1, "unrepack": 0}
    counts.update(repack=0)
    again = BCQLinear.from_packed({k: v for k, v in sd.items() if k != "bias"}, 64, 32, m.config, sd["bias"],
                                  device="cpu")
    assert counts == {"repack": 1, "unrepack": 0}
    again.to("cpu").float()
    assert counts == {"repack": 1, "unrepack": 0}
    x = torch.randn(3, 64)
    assert again.kernel(x).backend == "counting" and torch.equal(again(x), m(x))


def test_a_kernel_must_declare_its_capabilities():
    """No capability is claimed by leaving a field out (GPTQModel's SUPPORTS_* discipline): devices, dtypes, bits,
    group sizes, the batch range and the CUDA capability are each written out, as a value of the right type or ANY."""
    full = dict(devices=frozenset({"cpu"}), dtypes=ANY, bits=frozenset({4}), group_sizes=ANY, max_batch=8,
                min_capability=ANY)

    def make(**fields):
        return Kernel(backend="k", format="bcq", fn=lambda *a: None, **fields)

    with pytest.raises(TypeError, match="must declare dtypes, group_sizes, min_capability: a frozenset"):
        make(devices=frozenset({"cpu"}), bits=frozenset({4}), max_batch=8)
    for field, bad in [("bits", {4}), ("devices", "cpu"),
                       ("max_batch", 0), ("max_batch", 2.5), ("min_capability", 8), ("min_capability", (8, "0"))]:
        with pytest.raises(TypeError, match=field):
            make(**full | {field: bad})
    with pytest.raises(TypeError, match="min_batch must be"):
        make(**full, min_batch=0)
    with pytest.raises(TypeError, match="max_batch must be an int >= min_batch=9"):
        make(**full, min_batch=9)
    k = make(**{c: ANY for c in backends.CAPABILITIES})
    assert k.reject(QLinearConfig("bcq", bits=7).format_config(), torch.device("meta"), torch.float64, 10**6) is None
    for real in backends.kernels():
        assert all(getattr(real, c) is ANY or isinstance(getattr(real, c), (frozenset, int, tuple))
                   for c in backends.CAPABILITIES)
        if real.devices is ANY or "cuda" in real.devices:  # a CUDA kernel names the architectures it was built for
            assert real.backend == "reference" or isinstance(real.min_capability, tuple), real.backend


def test_loading_refuses_values_no_quantizer_writes():
    """A checkpoint's packed tensors with the right shapes and dtypes but values a damaged file holds (NaN, a perm
    that is not a permutation, the mixed format's group list and outlier CSR out of range) raise a ValueError naming
    the tensor, from load_state_dict and from_packed, and the layer keeps its weights."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    gptq = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32, method="gptq", act_order=True))
    mix = MixedPrecisionLinear.from_linear(lin, QLinearConfig("mixed", group_size=16, ratio_4bit=0.25,
                                                              outlier_ratio=0.005))
    free = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=3, group_size=64, iters=1))
    nan = free.state_dict()["alpha"].clone()
    nan[0, 0, 0] = float("nan")
    idx4 = mix.state_dict()["idx4"].clone()
    cols, ptr = mix.state_dict()["outlier_cols"].clone(), mix.state_dict()["outlier_row_ptr"].clone()
    assert idx4.numel() >= 2 and cols.numel() >= 1
    cases = [(free, "alpha", nan, "'alpha' holds NaN or Inf"),
             (gptq, "perm", torch.zeros(128, dtype=torch.int32), "perm must be a permutation of the 128 inputs"),
             (gptq, "perm", gptq.state_dict()["perm"] + 1, "perm must be a permutation"),
             (mix, "idx4", torch.full_like(idx4, int(idx4[0])), r"idx4 must list distinct groups in \[0, 8\)"),
             (mix, "idx4", idx4 + 8, r"idx4 must list distinct groups"),
             (mix, "outlier_cols", cols.fill_(128), r"outlier_cols must lie in \[0, 128\)"),
             (mix, "outlier_row_ptr", ptr.flip(0).contiguous(), "outlier_row_ptr must rise from 0")]
    x = torch.randn(2, 128)
    for mod, name, value, message in cases:
        before = {k: v.clone() for k, v in mod.state_dict().items()}
        y = mod(x)
        with pytest.raises(ValueError, match=message):
            mod.load_state_dict({**before, name: value})
        assert all(torch.equal(mod.state_dict()[k], v) for k, v in before.items()) and torch.equal(mod(x), y)
        with pytest.raises(ValueError, match=message):
            type(mod).from_packed({**mod.canonical(), name: value}, 128, 48, mod.config)


def test_imports_and_calls_refuse_bad_arguments_with_a_clear_error():
    """Found by an error-path review: each of these used to fail deep inside (ZeroDivisionError, StopIteration,
    AttributeError), to load silently (a wrong bias, Inf scales) or to misread its input (a text as characters)."""
    lin = nn.Linear(128, 64)
    q = BCQLinear.from_linear(lin, QLinearConfig("bcq", bits=4, group_size=32, init="uniform", iters=0))
    for bias, err, message in ((torch.full((1,), 5.0), ValueError, r"bias must be \[64\] \(out_features\)"),
                               (torch.zeros(1, 64), ValueError, r"bias must be \[64\]"),
                               (torch.full((64,), float("nan")), ValueError, "bias has 64 non-finite values"),
                               (torch.zeros(64, dtype=torch.int32), TypeError, "bias must be a floating point")):
        with pytest.raises(err, match=message):
            BCQLinear.from_packed(q.canonical(), 128, 64, q.config, bias)
    with pytest.raises(ValueError, match="no packed buffers given"):
        BCQLinear.from_packed({}, 128, 64, q.config)
    for dtype in ("float", torch.int32):
        with pytest.raises(TypeError, match="dtype must be a floating point torch.dtype"):
            q.dequantize(dtype)
    g = q.to_gptq()
    with pytest.raises(ValueError, match="2, 3, 4 or 8-bit codes, got bits=0"):
        BCQLinear.from_gptq(g["qweight"], g["qzeros"], g["scales"], bits=0, group_size=32)
    with pytest.raises(ValueError, match="group_size must be -1 or a positive integer, got 0"):
        BCQLinear.from_gptq(g["qweight"], g["qzeros"], g["scales"], bits=4, group_size=0)
    with pytest.raises(TypeError, match="qweight must be a 2-D int32 tensor"):
        BCQLinear.from_gptq(g["qweight"].flatten(), g["qzeros"], g["scales"], bits=4, group_size=32)
    with pytest.raises(ValueError, match="'scales' holds NaN or Inf"):
        BCQLinear.from_gptq(g["qweight"], g["qzeros"], torch.full_like(g["scales"], float("inf")), bits=4,
                            group_size=32)
    with pytest.raises(TypeError, match="in_features and out_features must be positive ints"):
        BCQLinear("64", 64)
    big = nn.Linear(64, 16)
    with torch.no_grad():
        big.weight[3, 5] = 1e6  # finite, but no fp16 scale holds it: it came back as 327520
    for fmt, opts in (("bcq", {}), ("mixed", dict(group_size=16)), ("codebook", dict(bits=2))):
        with pytest.raises(ValueError, match=r"weight magnitudes up to 1e\+06 exceed fp16's range"):
            module_class(fmt).from_linear(big, QLinearConfig(fmt, **opts))
    with pytest.raises(TypeError, match="format must be a string"):
        QLinearConfig(format=["bcq"])
    with pytest.raises(TypeError, match="per_module must be a dict or a list"):
        QLinearConfig("bcq", per_module=5)
    for data in ("The capital of France", 5):
        with pytest.raises(TypeError, match="calibration data must be a list of texts or of token-id tensors"):
            qlinear.calibrate(nn.Sequential(nn.Linear(8, 8)), data, tokenizer=lambda *a, **k: None)


@pytest.mark.parametrize("fmt", ["bcq", "mixed", "codebook"])
def test_output_is_not_a_view_under_autograd(layers, fmt):
    """As nn.Linear's: a model may add into a layer's output in place with autograd on (Falcon's
    ``mlp_output += attention_output``); a view returned by the op would make autograd refuse."""
    lin, mods = layers
    x = torch.randn(2, 3, 128, requires_grad=True)
    y = mods[fmt](x)
    assert y._base is None
    y += 1.0
    y.sum().backward()
    assert torch.allclose(x.grad, mods[fmt].dequantize().sum(0).expand(2, 3, 128), atol=1e-4)

