"""The measured dispatch table: plan construction from timings, table lookup, and how select/layout_for use it
(driven on CPU by spec kernels standing in for the GPU kernels, with a fake device name)."""

from __future__ import annotations

import json

import pytest
import torch

import qlinear.backends as backends
from qlinear import BCQLinear, QLinearConfig
from qlinear.backends import cuda_lut, dispatch, quick

from conftest import cpu_kernel

LAYOUTS = {"cuda_lut": "cuda_lut", "ref_from_lut": "cuda_lut", "quick": "quick", "quick_dequant": "quick"}


def test_plan_picks_the_layout_with_the_smallest_worst_slowdown():
    t = {"cuda_lut": {1: 10.0, 8: 20.0}, "ref_from_lut": {16: 200.0, 64: 300.0},
         "quick": {1: 12.0, 8: 14.0, 16: 15.0, 64: 50.0}, "quick_dequant": {1: 90.0, 8: 90.0, 16: 90.0, 64: 45.0}}
    layout, plan, worst = dispatch.plan_from_timings(t, LAYOUTS)
    assert layout == "quick" and plan == [[16, "quick"], [None, "quick_dequant"]] and worst == pytest.approx(1.2)
    t["ref_from_lut"] = {16: 15.0, 64: 45.0}  # now the LUT layout is never slower than the best
    t["cuda_lut"][8] = 13.0
    layout, plan, worst = dispatch.plan_from_timings(t, LAYOUTS)
    assert layout == "cuda_lut" and plan == [[8, "cuda_lut"], [None, "ref_from_lut"]] and worst == 1.0
    with pytest.raises(ValueError, match="every measured batch"):
        dispatch.plan_from_timings({"cuda_lut": {1: 1.0}, "quick": {8: 1.0}}, LAYOUTS)


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A dispatch table for a fake device name that the CPU reports, plus spec kernels of both layouts."""

    def write(entries):
        (tmp_path / "fake-gpu-x1.json").write_text(json.dumps({"device": "Fake GPU x1", "entries": entries}))
        dispatch.entries.cache_clear()
        dispatch._lookup.cache_clear()

    monkeypatch.setattr(dispatch, "_HERE", tmp_path)
    monkeypatch.setattr(dispatch, "_device_name", lambda device: "Fake GPU x1")

    def lut_fn(x, bufs, bias, cfg, N, K):
        y = cuda_lut.spec(x.reshape(-1, K), bufs, bias, cfg, N, K, cuda_lut.plan(x.numel() // K, N, K, 4, cfg.bits))
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    def quick_fn(x, bufs, bias, cfg, N, K):
        return quick.spec(x.reshape(-1, K), bufs, bias, cfg, N, K).to(x.dtype).reshape(*x.shape[:-1], N)

    ks = [backends.register(cpu_kernel("lut_spec", "bcq", lut_fn, priority=90, max_batch=8, layout=cuda_lut.LAYOUT)),
          backends.register(cpu_kernel("quick_spec", "bcq", quick_fn, priority=100, max_batch=512,
                                       supports=quick.supports, layout=quick.LAYOUT))]
    yield write
    for k in ks:
        backends._KERNELS.remove(k)
    dispatch.entries.cache_clear()
    dispatch._lookup.cache_clear()


def _uniform_module():
    cfg = QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0)
    ref = BCQLinear.from_linear(torch.nn.Linear(128, 64), cfg, backend="reference")
    mod = BCQLinear(128, 64, True, ref.config)
    return ref, mod


def test_without_an_entry_priorities_decide(fake_gpu):
    fake_gpu([])
    ref, mod = _uniform_module()
    mod.load_state_dict(ref.state_dict())
    assert mod.layout == "quick" and mod.kernel(torch.randn(1, 128)).backend == "quick_spec"


def test_the_table_chooses_layout_and_kernel_per_batch(fake_gpu):
    fake_gpu([{"format": "bcq", "bits": 4, "group_size": 64, "N": 80, "K": 128, "layout": "cuda_lut",
               "plan": [[4, "lut_spec"], [None, "reference"]]}])
    ref, mod = _uniform_module()
    mod.load_state_dict(ref.state_dict())
    assert mod.layout == "cuda_lut"  # nearest entry (N within a factor of 2)
    assert mod.kernel(torch.randn(2, 128)).backend == "lut_spec"
    # above batch 4 the table names the reference kernel (canonical layout, converted per call): it overrides
    # quick_spec's higher priority
    assert mod.kernel(torch.randn(16, 128)).backend == "reference"
    x = torch.randn(3, 128)
    assert torch.allclose(mod(x), ref(x), atol=1e-4)
    other = BCQLinear(256, 512, True, ref.config)  # no entry within a factor of 2: priorities
    assert other.layout == "quick"


def test_free_alpha_layers_follow_only_entries_measured_on_free_alpha(fake_gpu):
    """An entry measured on uniform layers (no "uniform" key) does not move a free-α layer; one marked
    ``"uniform": false`` does, and names its kernel per batch (here a CPU stand-in for quick_free, ranked low as it)."""
    free = backends.register(cpu_kernel("quick_free_spec", "bcq", lambda x, b, bias, cfg, N, K: quick.spec(
        x.reshape(-1, K), b, bias, cfg, N, K).to(x.dtype).reshape(*x.shape[:-1], N), priority=3, max_batch=512,
        supports=quick.supports_free, layout=quick.LAYOUT))
    try:
        entry = {"format": "bcq", "bits": 4, "group_size": 64, "N": 64, "K": 128, "layout": "quick",
                 "plan": [[None, "quick_free_spec"]]}
        ref = BCQLinear.from_linear(torch.nn.Linear(128, 64), QLinearConfig("bcq", bits=4, group_size=64, iters=1),
                                    backend="reference")
        x = torch.randn(2, 128)
        for table, layout, kernel in (([entry], "cuda_lut", "lut_spec"),
                                      ([{**entry, "uniform": False}], "quick", "quick_free_spec")):
            fake_gpu(table)
            mod = BCQLinear(128, 64, True, ref.config)
            mod.load_state_dict(ref.state_dict())
            assert mod.layout == layout and mod.kernel(x).backend == kernel
            assert torch.allclose(mod(x), ref(x), atol=1e-3)
    finally:
        backends._KERNELS.remove(free)


def test_malformed_table_is_a_clear_error(fake_gpu):
    fake_gpu([{"format": "bcq", "bits": 4}])
    with pytest.raises(ValueError, match="malformed.*tune_dispatch"):
        dispatch.entries("Fake GPU x1")


def test_default_table_is_valid_and_used_for_unknown_gpus():
    assert dispatch.table_path("Some Future GPU").name == "default.json"
    assert dispatch.entries("Some Future GPU") == ()


@pytest.mark.parametrize("path", sorted(dispatch._HERE.glob("*.json")), ids=lambda p: p.name)
def test_committed_tables_name_registered_kernels_of_their_layout(path):
    """Every measured table in the repository parses, was written for the GPU its file name says, and each plan
    names kernels that are registered for the entry's format and read the layout the entry holds."""
    data = json.loads(path.read_text())
    if data["device"] != "default":
        assert dispatch.device_table_path(data["device"]) == path
    for e in dispatch.entries(data["device"]) if data["device"] != "default" else ():
        by_name = {k.backend: k for k in backends.kernels(e["format"])}
        assert e["plan"] and e["plan"][-1][0] is None, f"{path.name}: plan of {e} must end with a catch-all"
        for max_batch, name in e["plan"]:
            assert name in by_name, f"{path.name}: {name} is not a registered {e['format']} kernel"
            assert (by_name[name].layout.name if by_name[name].layout else "") == e["layout"], (path.name, name)
            cap = by_name[name].max_batch
            assert cap is None or (max_batch is not None and max_batch <= cap), f"{path.name}: {name} beyond M={cap}"


BATCHES = sorted({*range(1, 17), 31, 32, 33, 63, 64, 100, 128, 129, 256, 511, 512, 513, 1000, 1024, 2048, 4095, 4096})
NO_REFERENCE = {  # name -> (format, kernel config, N, K)
    "bcq free α 1-bit g64": ("bcq", dict(bits=1, group_size=64), 256, 512),
    "bcq free α 3-bit g128 act_order": ("bcq", dict(bits=3, group_size=128, act_order=True), 256, 512),
    "bcq free α 4-bit whole row": ("bcq", dict(bits=4, group_size=-1), 96, 320),
    "bcq uniform 2-bit g64": ("bcq", dict(bits=2, group_size=64, init="uniform", iters=0), 256, 512),
    "bcq uniform 4-bit g128": ("bcq", dict(bits=4, group_size=128, init="uniform", iters=0), 4096, 4096),
    "bcq free α 5-bit g32": ("bcq", dict(bits=5, group_size=32), 256, 512),
    "bcq uniform 6-bit g64": ("bcq", dict(bits=6, group_size=64, init="uniform", iters=0), 256, 512),
    "gptq 8-bit g128": ("bcq", dict(bits=8, group_size=128, method="gptq"), 4096, 4096),
    "bcq uniform 8-bit whole row (an output layer)": ("bcq", dict(bits=8, group_size=-1, init="uniform", iters=0),
                                                      49152, 576),
    "gptq 4-bit g128, GPT-2's 50257 output rows": ("bcq", dict(bits=4, group_size=128, method="gptq"), 50257, 768),
    "bcq free α 3-bit g64, 32001 output rows": ("bcq", dict(bits=3, group_size=64), 32001, 4096),
    "codebook 2-bit 4 books": ("codebook", dict(bits=2), 256, 512),
    "codebook 4-bit g64": ("codebook", dict(bits=4, group_size=64), 96, 320),
    "codebook 1-bit g8, K = 200": ("codebook", dict(bits=1, group_size=8), 96, 200),
    "mixed defaults": ("mixed", dict(), 256, 512),
    "mixed g32 outliers anywhere": ("mixed", dict(group_size=32, outlier_placement="any"), 96, 320),
    "mixed g8 (the layout holds multiples of 16)": ("mixed", dict(group_size=8), 96, 200),
    "mixed g12, no 4-bit groups": ("mixed", dict(group_size=12, ratio_4bit=0.0), 30, 36),
}


@pytest.mark.parametrize("case", NO_REFERENCE)
def test_no_call_on_a_gpu_falls_back_to_the_reference(posing_gpu, case):
    """Issue 24: on a CUDA device every BCQ (free α or uniform), codebook and mixed layer finds a GPU kernel at every
    batch 1..4096 and both dtypes, and it reads the layout the layer holds there (no conversion on every call)."""
    from qlinear.modules import format_config
    from qlinear.ops import kernel_view

    fmt, opts, N, K = NO_REFERENCE[case]
    cfg = kernel_view(format_config(fmt, QLinearConfig(fmt, **opts))[0])[0]
    device = torch.device("cuda")
    held = backends.layout_for(fmt, cfg, device, (N, K))
    for dtype in (torch.float16, torch.bfloat16):
        for M in BATCHES:
            k = backends.select(fmt, cfg, device, dtype, M, shape=(N, K), layout=held and held.name)
            assert k.backend != "reference", (dtype, M)
            assert k.layout is held, (dtype, M, k.backend)
