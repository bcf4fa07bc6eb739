"""The GPU benchmarks' weight builders and call helpers, run on CPU with the reference kernel (not timed: this
only checks that what the GPU benchmarks time is a valid layer in each layout)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_e2e import quantize_randomly  # noqa: E402
from common import op_calls, uniform_bcq_sets  # noqa: E402

import qlinear  # noqa: E402


def test_weight_sets_are_the_same_layer_in_every_layout():
    x = torch.randn(3, 128)
    ys = []
    for layout in ("", "quick", "cuda_lut"):
        torch.manual_seed(0)
        cfg, sets = uniform_bcq_sets(64, 128, 3, 64, layout, 2, device="cpu")
        assert len(sets) == 2 and qlinear.formats.bcq.is_uniform(cfg)
        ys.append([call() for call in op_calls(x, cfg, sets, 64, 128, "reference", layout)])
    assert all(torch.equal(a, b) for y in ys[1:] for a, b in zip(ys[0], y))
    assert not torch.equal(ys[0][0], ys[0][1])  # two different weight sets


def test_random_quantization_of_a_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    model = LlamaForCausalLM(cfg).eval()
    quantize_randomly(model, 4, 32, device="cpu")
    q = [m for m in model.modules() if isinstance(m, qlinear.BCQLinear)]
    assert len(q) == 14 and isinstance(model.lm_head, torch.nn.Linear)
    out = model.generate(torch.randint(0, 100, (2, 5)), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert out.shape == (2, 8)


def test_single_device_act_order_table_runs_on_cpu():
    from bench_tp import SINGLE_HEADER, single_device_rows

    rows = single_device_rows({"tiny": (256, 384, 128)}, [1, 3], "cpu", reps=1)
    assert len(rows) == 4 and all(len(r) == len(SINGLE_HEADER) for r in rows)
    assert all(isinstance(v, float) and v > 0 for r in rows for v in r[5:])


def test_sweep_launch_grids_are_valid_launches():
    """Every launch benchmarks/sweep_plans.py times is one the kernels accept: LUT launches give the heuristic's
    result under the kernel's executable spec, QUICK launches cover K's tiles exactly once (the binding's check)."""
    import sweep_plans
    from qlinear.backends import cuda_lut, quick
    from qlinear.ops import to_layout

    N, K = 256, 576
    cfg, (canon,) = uniform_bcq_sets(N, K, 4, 64, "", 1, device="cpu")
    bufs = to_layout(dict(zip(qlinear.ops._names("bcq", cfg.to_json(), N, K), canon)), cfg,
                     qlinear.backends.get_layout("cuda_lut"), N, K)
    for M in (1, 4, 8):
        x = torch.randn(M, K)
        launches = sweep_plans.lut_launches(M, N, K, 132, 4)
        assert launches[0] == cuda_lut.plan(M, N, K, 132, 4) and len(set(launches)) == len(launches) > 5
        want = cuda_lut.spec(x, bufs, None, cfg, N, K, launches[0])
        for launch in launches:
            kt, threads, per, splits = launch
            assert kt == 32 * cuda_lut.words(M, 4) and (splits - 1) * per < -(-K // kt) <= splits * per, launch
            assert threads % 32 == 0 and 32 <= threads <= 256 and 4 * threads <= 128 * -(-N // 128), launch  # no idle warps
            got = cuda_lut.spec(x, bufs, None, cfg, N, K, launch)
            assert ((got - want).abs().max() / want.abs().max()) < 1e-5, launch
    for M in (1, 16, 64, 256):
        launches = sweep_plans.quick_launches(M, 8192, 8192, 132)
        assert launches[0] == quick.plan(M, 8192, 8192, 132) and len(set(launches)) == len(launches) > 10
        for tile_m, per, splits in launches:
            assert tile_m in (16, 32, 64, 128) and (splits - 1) * per < 8192 // quick.TILE_K <= splits * per


def test_mixed_sweep_launches_cover_the_layer_and_agree_under_the_spec():
    """benchmarks/sweep_plans.py's mixed GEMV launches: the heuristic's first, every K tile in exactly one split, 8-row
    blocks within the kernel's launch bounds, at 8192², M = 8 both the one-wave plan and the one more split that
    rounding up gave; on a small layer every launch gives the heuristic's result under the kernel's executable spec."""
    import sweep_plans
    from qlinear.backends import async_dequant as ad
    from qlinear.formats import mixed

    for M in (1, 8):
        launches = sweep_plans.mixed_launches(M, 8192, 8192, 132, 640)
        assert launches[0] == ad.plan(M, 8192, 8192, 640, 132) and len(set(launches)) == len(launches) > 10
        for threads, per, splits in launches:
            assert threads in (32, 64, 128, 256) and (splits - 1) * per < 160 <= splits * per
            assert M < 8 or threads <= ad.MAX_THREADS_M8
    assert {(128, 14, 12), (128, 13, 13)} <= set(sweep_plans.mixed_launches(8, 8192, 8192, 132, 640))
    cfg, N, K = mixed.Config(outlier_ratio=0.0), 96, 256
    bufs = ad.repack(ad.random_buffers(N, K, cfg, seed=0), cfg, N, K)
    W = ad.num_words(bufs, cfg)
    x = torch.randn(3, K)
    launches = sweep_plans.mixed_launches(3, N, K, 132, W)
    want = ad.spec(x, bufs, None, cfg, N, K, launches[0])
    for launch in launches:
        got = ad.spec(x, bufs, None, cfg, N, K, launch)
        assert ((got - want).abs().max() / want.abs().max()) < 1e-3, launch


def test_uncalibrated_bound_fits():
    """benchmarks/uncalibrated_bound.py: the free-level fit never errs more than the BCQ fit it starts from and keeps
    16 levels per group; the rotated fit comes back in the layer's own basis, close to the weight."""
    from uncalibrated_bound import bcq_groups, lloyd_groups, quantized

    torch.manual_seed(0)
    w = torch.randn(40, 64, dtype=torch.float64).float()
    err = [(w - lv.gather(1, c)).square().sum(1) for lv, c in (bcq_groups(w), lloyd_groups(w))]
    assert (err[1] <= err[0] * (1 + 1e-6)).all() and err[1].sum() < 0.9 * err[0].sum()
    weight = torch.randn(8, 576)
    plain, turned = quantized(weight, lloyd_groups, False), quantized(weight, lloyd_groups, True)
    assert max(len(g.unique()) for g in plain.reshape(-1, 64)) <= 16
    rel = [float((weight - x).norm() / weight.norm()) for x in (plain, turned)]
    assert all(0 < r < 0.15 for r in rel) and not torch.allclose(plain, turned)


def test_dispatch_tuner_paths_match_the_registry():
    """Every path tune_dispatch.py times names a registered kernel reading the layout the tuner files it under, with
    the batch cap the kernel declares; each BCQ layer is timed on exactly the kernels that take its bits."""
    import tune_dispatch

    from qlinear import backends

    for fmt, paths in (("bcq", tune_dispatch.PATHS[True]), ("bcq", tune_dispatch.PATHS[False]),
                       ("codebook", tune_dispatch.CODEBOOK_PATHS)):
        for backend, (layout, max_m) in paths.items():
            k = next(k for k in backends.kernels(fmt) if k.backend == backend)
            assert (k.layout.name if k.layout else "") == layout and k.max_batch == max_m, backend
    uniform = lambda bits: {b for b in tune_dispatch.PATHS[True] if tune_dispatch.takes("bcq", b, bits)}
    assert uniform(8) == {"cuda_lut", "cuda_lut_dequant", "cuda_uniform_gemv", "cuda_uniform_gemm", "cuda_uniform"}
    assert uniform(4) == {"cuda_lut", "cuda_lut_dequant", "quick", "quick_dequant"}
    assert uniform(6) == {"cuda_lut", "cuda_lut_dequant"}
