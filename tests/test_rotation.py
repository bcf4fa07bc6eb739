"""Incoherence processing (issue 27): the randomized Hadamard rotation against its dense float64 definition, every
format rotated (quantize, dequantize, forward, Hessians, checkpoints), the shared online transform, and its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from conftest import lowbias32_sign, ref64, rotation64, random_hessian
from qlinear import BCQLinear, CodebookLinear, MixedPrecisionLinear, QLinearConfig
from qlinear.formats import bits_per_weight, rotation
from qlinear.modules import module_class

pytestmark = pytest.mark.usefixtures("reference_on_cpu")


@pytest.mark.parametrize("p", [4, 8, 12, 20, 24, 28, 36, 44, 60, 108, 196])
def test_paley_matrices_are_hadamard(p):
    h = rotation._paley(p)
    assert h.shape == (p, p) and bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, p * torch.eye(p, dtype=torch.int64))


@pytest.mark.parametrize("p", [12, 20, 28, 36, 44, 60, 76, 108, 196])
def test_conference_matrices_behind_the_paley_factors(p):
    """Paley's C: zero diagonal, ±1 elsewhere, C·Cᵀ = (q)·I, skew for Paley I (H = I + C, p = q + 1) and symmetric
    for Paley II (p = 2(q + 1)); the CPU kernels take C itself for Paley II (``paley_argument``)."""
    from qlinear.backends._cpu import paley_argument

    c, kind = rotation._conference(p)
    n = c.shape[0]
    assert n == (p if kind == 1 else p // 2) and bool((c.diagonal() == 0).all())
    assert bool((c.abs() + torch.eye(n, dtype=torch.int64) == 1).all())
    assert torch.equal(c @ c.T, (n - 1) * torch.eye(n, dtype=torch.int64))
    assert torch.equal(c.T, -c if kind == 1 else c)
    assert torch.equal(paley_argument(p), (c if kind == 2 else rotation._paley(p)).float())


_WIDTHS_DRIVER = r"""
#include "rotation.h"
#include <cstdio>
#include <vector>
using namespace qlinear_rotation;
int main(int argc, char** argv) {  // W M K BLOCK F APART < d [K], factor [F, F], x [M, K] > rotated x
  const int w = atoi(argv[1]), apart = atoi(argv[6]);
  const long M = atol(argv[2]), K = atol(argv[3]), block = atol(argv[4]), f = atol(argv[5]);
  std::vector<float> d(K), factor(f > 1 ? f * f : 0), x(M * K), y(M * K, 1e30f);
  if (fread(d.data(), 4, K, stdin) != (size_t)K || fread(factor.data(), 4, factor.size(), stdin) != factor.size() ||
      fread(x.data(), 4, x.size(), stdin) != x.size()) return 2;
  const float* pf = f > 1 ? factor.data() : nullptr;
  float* out = apart ? y.data() : x.data();  // APART: from x into junk-filled y, else in place
  const float* src = x.data();
#ifdef QLINEAR_ROTATION_X86
  if (w == 16) rotate_rows_avx512(out, M, K, d.data(), block, pf, f, src);
  if (w == 8) rotate_rows_avx2(out, M, K, d.data(), block, pf, f, src);
#endif
  if (w == 4) rotate_rows_w<4>(out, M, K, d.data(), block, pf, f, src);
  if (w == 0 && apart) rotate_rows(out, M, K, d.data(), block, pf, f, src);
  if (w == 0 && !apart) rotate_rows(out, M, K, d.data(), block, pf, f);
  fwrite(out, 4, x.size(), stdout);
}
"""


def test_native_transform_gives_the_same_bits_at_every_vector_width(tmp_path):
    """backends/_shared/rotation.h on this machine's vector widths (AVX-512 16, AVX2 8, 4; the dispatcher's choice),
    in place and from a source row into a separate (junk-filled) output: the same bits for each, within float32
    rounding of the float64 definition, on Paley I and II, power-of-two and scalar-path (n <= 8) blocks, M across the
    32-row chunks (test_arm_neon runs the aarch64 build).  Paley orders 12, 28 and 36 take the residue sums (with
    their row stride known at compile time at n = 16, and not at larger n), 20, 44 and 76 the dense multiply-adds."""
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    from qlinear.backends._cpu import rotation_args

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    header = Path(rotation.__file__).parents[2] / "backends" / "_shared"
    (tmp_path / "driver.cpp").write_text(_WIDTHS_DRIVER)
    exe = tmp_path / "driver"
    subprocess.run([cxx, "-O2", "-std=c++17", f"-I{header}", str(tmp_path / "driver.cpp"), "-o", str(exe)], check=True)
    flags = set(open("/proc/cpuinfo").read().split()) if Path("/proc/cpuinfo").exists() else set()
    widths = [0, 4] + ([8] if platform.machine() == "x86_64" and {"avx2", "fma"} <= flags else []) + (
        [16] if platform.machine() == "x86_64" and "avx512f" in flags else [])
    for K, block, M in [(576, 576, 1), (576, 576, 33), (1536, 1536, 3), (448, 448, 2), (256, 256, 5), (96, 48, 37),
                        (288, 72, 70), (224, 224, 33), (320, 320, 2), (704, 704, 3), (4096, 4096, 2), (896, 896, 2),
                        (4608, 4608, 1), (1216, 1216, 2), (2560, 2560, 1)]:
        # Paley II / I, 2^a, n <= 8 (I and II), dense Paley I (20·16, 44·16), 2^12 (stages past the registers),
        # Paley II 28·32 (row stride not known at compile time) and 36·128 (a stage past the registers), dense
        # Paley II 76·16, dense Paley I 20·128 with a stage past the registers
        signs, factor, _ = rotation_args((3, block), K)
        f = 1 if factor is None else factor.shape[0]
        x = torch.randn(M, K)
        data = signs.numpy().tobytes() + (b"" if factor is None else factor.numpy().tobytes()) + x.numpy().tobytes()
        outs = [torch.frombuffer(bytearray(subprocess.run([str(exe), str(w), str(M), str(K), str(block), str(f),
                                                            str(apart)], input=data, capture_output=True,
                                                           check=True).stdout), dtype=torch.float32).reshape(M, K)
                for w in widths for apart in (0, 1)]
        for y in outs[1:]:
            assert torch.equal(y, outs[0]), (K, block, M)
        want = x.double() @ rotation64(3, block, K).T
        assert ((outs[0].double() - want).abs() <= 1e-6 * want.abs().amax(1, keepdim=True)).all(), (K, block, M)


def test_orders_without_a_paley_construction():
    assert rotation._paley(172) is None and rotation._paley(16) is None  # 171, 85 and 15, 7 are not such primes


@pytest.mark.parametrize("K, block", [(576, 576), (1536, 1536), (4096, 4096), (11008, 256), (14336, 14336),
                                      (768, 768), (5120, 5120), (96, 96), (100, 20)])
def test_auto_block_is_the_largest_constructible_divisor(K, block):
    """SmolLM2 (576 = 36·16, 1536 = 12·128) and Llama (4096; 11008 = 43·256, where 172 has no construction here, so
    the largest order dividing it is 256) shapes."""
    assert rotation.block_size(K) == block
    assert all(K % b or rotation._split(b) is None for b in range(block + 1, K + 1))


@pytest.mark.parametrize("K, requested, match", [(576, 128, "does not fit"), (576, 9, "does not fit"),
                                                 (7, 0, "no Hadamard block"),
                                                 (96, 4, "rotation_block=4 is below the smallest block, 8")])
def test_blocks_that_do_not_fit_raise(K, requested, match):
    with pytest.raises(ValueError, match=match):
        rotation.block_size(K, requested)


def test_signs_are_lowbias32_of_seed_and_index():
    for seed in (0, 1, 12345, 2 ** 31 - 1):
        want = torch.tensor([lowbias32_sign(seed, k) for k in range(300)], dtype=torch.float32)
        assert torch.equal(rotation.signs(seed, 300, "cpu"), want)
    assert not torch.equal(rotation.signs(0, 300, "cpu"), rotation.signs(1, 300, "cpu"))


@pytest.mark.parametrize("K, block", [(192, 192), (192, 64), (576, 576), (96, 12), (512, 512)])
def test_rotate_matches_the_dense_orthogonal_matrix(K, block):
    torch.manual_seed(0)
    R = rotation64(5, block, K)
    assert torch.allclose(R @ R.T, torch.eye(K, dtype=torch.float64), atol=1e-12)
    x = torch.randn(3, 2, K, dtype=torch.float64)
    assert torch.allclose(rotation.rotate(x, 5, block), x @ R.T, atol=1e-12)
    assert torch.allclose(rotation.rotate(x, 5, block, inverse=True), x @ R, atol=1e-12)
    x32 = x.float()
    assert rotation.rotate(x32, 5, block).dtype == torch.float32
    assert torch.allclose(rotation.rotate(x32.half(), 5, block).double(), x @ R.T, atol=1e-2)
    h = random_hessian(K)
    assert torch.allclose(rotation.rotate_hessian(h, 5, block), R @ h.double() @ R.T, atol=1e-9)


CONFIGS = {
    "bcq": dict(format="bcq", bits=3, group_size=64),
    "rtn": dict(format="bcq", bits=3, group_size=64, init="uniform", iters=0),
    "gptq-act_order": dict(format="bcq", bits=3, group_size=64, method="gptq", act_order=True),
    "mixed": dict(format="mixed"),
    "codebook": dict(format="codebook", bits=2, error_feedback=True),
}


def _layer(name, rot="hadamard", hessian=None, K=192, N=40, **kw):
    torch.manual_seed(0)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight[:, 3] *= 25  # an outlier input channel, what rotation spreads out
    opts = dict(CONFIGS[name])
    fmt = opts.pop("format")
    cfg = QLinearConfig(fmt, **opts, rotation=rot, **kw)
    return lin, module_class(fmt).from_linear(lin, cfg, hessian)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rotated_layer_stores_w_r_transposed_and_runs_exactly(name):
    """Ŵ = (the stored weight, by each format's formula)·R, the forward is x·Ŵᵀ + b, and the stored weight is what
    the format's own quantizer makes of W·Rᵀ with R·H·Rᵀ: the rotation is the only difference."""
    K = 192
    h = random_hessian(K, seed=1)
    lin, m = _layer(name, hessian=h)
    assert m.config.rotation == "hadamard" and m.canonical()["rotation"].tolist() == [0, 192]
    x = torch.randn(5, K)
    assert torch.allclose(m(x).double(), ref64(m, x), atol=1e-4 * float(ref64(m, x).abs().max()))
    R = rotation64(0, 192, K)
    plain = rotation.unrotated(m.config)
    direct = type(m).quantize_weight((lin.weight.detach().double() @ R.T).float(), plain, (R @ h.double() @ R.T).float())
    stored = {k: v for k, v in m.canonical().items() if k != "rotation"}
    same = [torch.equal(direct[k], stored[k]) for k in stored]
    assert sorted(direct) == sorted(stored) and sum(same) >= len(same) - 1  # float rounding may move a code
    assert torch.allclose(m.dequantize(torch.float64), type(m).from_packed(direct, K, 40, plain).dequantize(
        torch.float64) @ R, atol=0.05 * float(lin.weight.abs().max()))


@pytest.mark.parametrize("name", ["rtn", "bcq"])
def test_rotation_spreads_an_outlier_channel(name):
    """With one input channel 25x the others, the rotated layer's weight error ‖W − Ŵ‖ is smaller: the outlier no
    longer sets its groups' scales alone (QuIP §4).  (Not so for the mixed format, whose fp16 outliers already take
    such a channel: rotation spreads it over every weight of the block instead.)"""
    errs = {}
    for rot in ("none", "hadamard"):
        lin, m = _layer(name, rot)
        errs[rot] = (m.dequantize(torch.float64) - lin.weight.double()).norm()
    assert errs["hadamard"] < 0.8 * errs["none"]


def test_calibrated_rotation_uses_the_rotated_hessian():
    """Error feedback with the rotated Hessian beats the rotated layer quantized without calibration on the output
    error ‖(W − Ŵ)Xᵀ‖ for anisotropic inputs (it would not if the Hessian were left in the unrotated basis)."""
    K = 192
    g = torch.Generator().manual_seed(3)
    X = torch.randn(4096, K, generator=g) * torch.linspace(0.05, 4, K)
    h = X.T @ X
    errs = {}
    for label, hess in (("uncalibrated", None), ("calibrated", h)):
        lin, m = _layer("gptq-act_order" if hess is not None else "rtn", hessian=hess)
        errs[label] = ((m.dequantize(torch.float64) - lin.weight.double()) @ X.double().T).norm()
    lin, m = _layer("gptq-act_order", hessian=h)
    wrong = type(m).quantize_weight(lin.weight.detach() @ rotation64(0, 192, K).float().T, rotation.unrotated(m.config),
                                    h)  # the unrotated Hessian with rotated weights
    w_wrong = type(m).from_packed(wrong, K, 40, rotation.unrotated(m.config)).dequantize(torch.float64) @ \
        rotation64(0, 192, K)
    err_wrong = ((w_wrong - lin.weight.double()) @ X.double().T).norm()
    assert errs["calibrated"] < 0.85 * min(errs["uncalibrated"], err_wrong)


def test_bits_count_the_rotation_record():
    plain = QLinearConfig("bcq", bits=4, group_size=64).format_config()
    rot = QLinearConfig("bcq", bits=4, group_size=64, rotation="hadamard").format_config()
    assert bits_per_weight(rot, 40, 192) * 40 * 192 == bits_per_weight(plain, 40, 192) * 40 * 192 + 64


def test_checkpoint_round_trip_is_exact_and_mismatched_rotations_refuse(tmp_path):
    from safetensors.torch import load_file, save_file

    lin, m = _layer("bcq", rotation_seed=11, rotation_block=64)
    save_file(m.state_dict(), tmp_path / "m.safetensors")
    sd = load_file(tmp_path / "m.safetensors")
    assert sd["rotation"].tolist() == [11, 64]
    fresh = BCQLinear(192, 40, True, m.config)
    fresh.load_state_dict(sd)
    x = torch.randn(3, 192)
    assert torch.equal(fresh(x), m(x))
    for cfg in (dataclasses.replace(m.config, rotation_seed=12), dataclasses.replace(m.config, rotation_block=192)):
        other = BCQLinear(192, 40, True, cfg)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(ValueError, match="rotation"):
            other.load_state_dict(sd)
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())  # nothing loaded
    damaged = dict(sd, rotation=torch.tensor([11, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="differs"):
        BCQLinear(192, 40, True, m.config).load_state_dict(damaged)
    with pytest.raises(ValueError, match="differs"):  # buffers set from outside are checked when placed
        other = BCQLinear(192, 40, True, m.config, device="meta")
        other.rotation = damaged["rotation"]
        for k, v in damaged.items():
            if k != "rotation" and k != "bias":
                setattr(other, k, v)
        other.repack_for_device()


@pytest.mark.parametrize("fmt", ["bcq", "mixed", "codebook"])
def test_layers_built_under_a_meta_device_context_cache_nothing_on_meta(fmt):
    """transformers builds a model under ``torch.device("meta")``: the empty rotated layers built there must leave no
    meta tensor in the transform's caches, or every later layer of that Paley order fails or (through a CPU op that
    got a meta argument and ran its fake implementation) computes garbage.  K = 96: blocks of 96 = 12·8, a Paley
    factor of order 12."""
    from qlinear.backends import _cpu, quick
    from qlinear.formats import packing

    for cached in (rotation._conference, rotation._paley, rotation._factor, packing._byte_table, quick._lane_slots,
                   _cpu.rotation_args):
        cached.cache_clear()
    cfg = QLinearConfig(fmt, rotation="hadamard", **({"group_size": 32} if fmt != "mixed" else {}))
    with torch.device("meta"):
        empty = module_class(fmt)(96, 8, config=cfg)
        empty(torch.empty(2, 96))
    assert rotation._paley(12).device.type == "cpu"
    torch.manual_seed(0)
    m = module_class(fmt).from_linear(nn.Linear(96, 8), cfg)
    x = torch.randn(3, 96)
    w = m.dequantize().double()
    assert torch.allclose(m(x).double(), x.double() @ w.T + m.bias.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["bcq", "codebook"])
def test_a_rotated_layer_built_on_meta_takes_to_empty_then_its_state_dict(fmt):
    """``to_empty`` fills buffers with uninitialised memory: the rotation record, which the config determines, is
    written instead (its check would refuse the garbage), and load_state_dict then gives the original layer."""
    _, ref = _layer(fmt)
    with torch.device("meta"):
        m = module_class(fmt)(ref.in_features, ref.out_features, True, ref.config)
    m.to_empty(device="cpu")
    assert m.rotation.tolist() == list(rotation.params(ref.config, ref.in_features))
    m.load_state_dict(ref.state_dict())
    x = torch.randn(3, ref.in_features)
    assert torch.equal(m(x), ref(x))


def test_layers_reading_one_input_share_its_transform(monkeypatch):
    """q/k/v-like layers on the same tensor: one transform; an in-place change of the input, or another rotation,
    transforms again; every output stays exact."""
    layers = [_layer("rtn")[1] for _ in range(3)]
    other = _layer("rtn", rotation_seed=1)[1]
    calls = []
    real = rotation.rotate
    monkeypatch.setattr(rotation, "rotate", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, 192)
    ys = [m(x) for m in layers]
    assert len(calls) == 1
    assert all(torch.allclose(y.double(), ref64(m, x), atol=1e-3) for y, m in zip(ys, layers))
    x.mul_(2)
    y = layers[0](x)
    assert len(calls) == 2 and torch.allclose(y.double(), ref64(layers[0], x), atol=2e-3)
    assert torch.allclose(other(x).double(), ref64(other, x), atol=2e-3) and len(calls) == 3
    for write in (lambda: x.data.mul_(3), lambda: x.numpy().__setitem__(slice(None), 1.5)):  # the counter stays
        version = x._version
        write()
        assert x._version == version
        assert torch.allclose(other(x).double(), ref64(other, x), atol=1e-2)
    assert len(calls) == 5
    with torch.inference_mode():
        xi = torch.randn(2, 192)
        layers[0](xi), layers[1](xi)
    assert len(calls) == 7  # inference tensors have no version counter: not shared


def test_rotated_layer_options_and_exports_raise():
    with pytest.raises(ValueError, match="rotation must be"):
        QLinearConfig("bcq", rotation="walsh")
    with pytest.raises(ValueError, match="options of rotation='hadamard'"):
        QLinearConfig("mixed", rotation_seed=3)
    with pytest.raises(ValueError, match="rotation_seed"):
        QLinearConfig("codebook", rotation="hadamard", rotation_seed=-1)
    with pytest.raises(ValueError, match="rotation_block=128 does not fit"):
        CodebookLinear(192, 8, config=dict(rotation="hadamard", rotation_block=128))
    _, m = _layer("rtn")
    with pytest.raises(ValueError, match="GPTQ checkpoint"):
        m.to_gptq()
    from qlinear.integrations.tensor_parallel import shard_inputs, shard_rows

    with pytest.raises(ValueError, match="cannot be split along its inputs"):
        shard_inputs(m, 0, 64)
    rows = torch.tensor([5, 0, 17])
    part = shard_rows(m, rows)
    x = torch.randn(2, 192)
    assert torch.allclose(part(x), m(x)[:, rows], atol=1e-5)


def test_mixed_selects_groups_on_the_rotated_weights():
    """The mixed format's sensitivity (eq. 9) and outlier choice see W·Rᵀ: its 4-bit groups and outlier columns are
    those of quantizing W·Rᵀ directly."""
    K = 192
    h = random_hessian(K, seed=2)
    lin, m = _layer("mixed", hessian=h)
    R = rotation64(0, 192, K)
    direct = MixedPrecisionLinear.quantize_weight((lin.weight.detach().double() @ R.T).float(), rotation.unrotated(m.config),
                                                  (R @ h.double() @ R.T).float())
    assert torch.equal(direct["idx4"], m.canonical()["idx4"])
    assert torch.equal(direct["outlier_cols"], m.canonical()["outlier_cols"])


@pytest.mark.gpu
@pytest.mark.parametrize("name,backend", [("rtn", "quick"), ("rtn2", "quick"), ("rtn", "cuda_lut"), ("bcq", "cuda_lut"),
                                          ("bcq", "quick_free"), ("mixed", "async_dequant")])
@pytest.mark.parametrize("K", [576, 1536, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_decode_kernels_stage_the_rotated_input(monkeypatch, name, backend, K, dtype):
    """On a GPU the decode kernels of a rotated layer apply ``R`` to x themselves (backends/_cuda/rotation.cuh; at
    batch 1 always (QUICK: but for free α at 2 bits, not among these), above it where a kernel's shared-memory budget still holds ``R·x``, else
    the op's PyTorch transform runs first): every output is the float64 product with the exact ``R·x`` within twice x's rounding (the
    kernel rounds ``R·x`` to x's dtype once, as the op's transform does), for every decode batch, and the fused and
    PyTorch-rotated calls agree within that rounding."""
    import sys

    from qlinear.backends._gpu import NO_ROTATION

    opts = dict(CONFIGS[name]) if name in CONFIGS else dict(CONFIGS["rtn"], bits=2)  # rtn2: QUICK's 2-bit staging
    fmt = opts.pop("format")
    torch.manual_seed(K)
    N = 256
    mod = module_class(fmt).from_linear(nn.Linear(K, N), QLinearConfig(fmt, **opts, rotation="hadamard"),
                                        backend=backend).to("cuda", dtype)
    calls = []
    real = rotation.rotate_input
    monkeypatch.setattr(rotation, "rotate_input", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    rot = rotation.params(mod.config, K)
    w = mod.dequantize(torch.float64).cpu()  # Ŵ'·R: the weight in the layer's input basis
    wq = rotation.rotate(w, *rot).abs()  # |Ŵ'|, the stored weight's magnitudes

    half = 8 * 2.0 ** -11 if backend == "async_dequant" else 0.0  # its per-word half2 sums (test_async_dequant)

    def bound(x, y64):  # Σ_k |(R·x)_k|·|Ŵ'_nk| times 2·eps, plus the output's rounding
        return (2 * eps + half) * (rotation.rotate(x.double().cpu(), *rot).abs() @ wq.T) + eps * y64.abs() + 1e-3

    for M in range(1, 9):
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == backend and mod.kernel(x).fuses_rotation
        y = mod(x).double().cpu()
        y64 = x.double().cpu() @ w.T + mod.bias.double().cpu()
        assert ((y - y64).abs() <= bound(x, y64)).all(), (M, calls, (y - y64).abs().max().item())
        assert M > 1 or not calls, "batch 1 must rotate inside the kernel"
    # the transform forced into PyTorch (what a kernel over its budget does): the same outputs within that rounding
    x = torch.randn(1, K, device="cuda").to(dtype)
    fused = mod(x).double().cpu()
    kernel_module = sys.modules[mod.kernel(x).fn.__module__]
    monkeypatch.setattr(kernel_module, "staged_rotation",
                        lambda x, r, smem, budget: (rotation.rotate_input(x, *r), NO_ROTATION))
    n = len(calls)
    separate = mod(x).double().cpu()
    assert len(calls) == n + 1
    assert ((fused - separate).abs() <= bound(x, separate)).all()


def test_device_transform_is_tried_first_and_shared(monkeypatch):
    """A registered native transform (backends/_gpu.py registers ``qlinear::cuda_rotate`` for "cuda") serves
    rotate_input on its device and its result is shared like the PyTorch one; where it declines (None) rotate runs."""
    seen = []

    def native(x, seed, block):
        seen.append((x.shape, seed, block))
        return None if x.dtype == torch.float64 else torch.full_like(x, 7.0)

    monkeypatch.setitem(rotation._device_transforms, "cpu", native)
    monkeypatch.setattr(rotation, "_last", ())
    x = torch.randn(3, 48)
    assert torch.equal(rotation.rotate_input(x, 5, 48), torch.full_like(x, 7.0))
    assert rotation.rotate_input(x, 5, 48) is rotation.rotate_input(x, 5, 48) and len(seen) == 1
    x64 = x.double()
    assert torch.equal(rotation.rotate_input(x64, 5, 48), rotation.rotate(x64, 5, 48)) and len(seen) == 2


_ROTATE_DRIVER = r'''
// Driver: reads one call (header M, K, bf16, grid rows, slice (0: rotate_plan's), sign words, block, p; x; sign bits;
// Paley factor), writes y.
int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 8);
  const int M = h[0], K = h[1], bf16 = h[2], grid_rows = h[3];
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  auto sign_bits = emu_read<unsigned>(f, h[5]);
  auto paley = emu_read<signed char>(f, h[7] > 1 ? h[7] * h[7] : 0);
  fclose(f);
  const Rotation r{h[6], h[7], sign_bits.data(), paley.data()};
  RotatePlan plan = rotate_plan(r, M, K);
  if (h[4]) plan.slice = h[4];
  std::vector<uint16_t> y((size_t)M * K, 0x7E00);  // NaN-poisoned output
  auto run = [&](auto zero) {
    using T = decltype(zero);
    run_grid(dim3(K / plan.slice, grid_rows, 1), plan.threads,
             [&] { rotate_kernel<T>(reinterpret_cast<const T*>(x.data()), reinterpret_cast<T*>(y.data()), M, K, r,
                                    plan.slice); }, rotate_smem_bytes(r));
  };
  if (bf16) run(__nv_bfloat16{}); else run(__half{});
  emu_write(argv[2], y, bf16);
  return 0;
}
'''


@pytest.mark.emulation
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_rotate_kernel_source_matches_float64(tmp_path, dtype):
    """backends/_cuda/rotate.cu (the one-launch transform the CUDA backends fall back to when their kernel does not
    stage ``R·x``) under the host emulation: each output within one rounding to x's dtype, plus float32 summation
    error, of the float64 ``R·x``, for Paley I and II blocks, power-of-two blocks sliced across CUDA blocks (4096: 8
    slices of 512), slices of one Paley row and of whole blocks (and two: 96 = 2·48), blocks of one and two inputs
    per Paley row, rows not 16-byte aligned (K = 44), and more rows than the grid has (its rows loop)."""
    import cuda_emulation
    from cuda_emulation import rotated_reference, rotation_header, run

    exe = cuda_emulation.build(
        tmp_path, "_cuda/rotate.cu",
        ("extern __shared__ __align__(16) float rotate_work[];",
         "float* rotate_work = reinterpret_cast<float*>(::g_smem4);"), "", _ROTATE_DRIVER)
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    torch.manual_seed(0)
    # (M, K, block, grid rows, slice: 0 rotate_plan's, one Paley row or 512 inputs at these M; else a whole block, as
    # rotate_plan gives from 256 blocks in a call on, two, or any divisor of K as bench_rotation.py sweeps: half a
    # Paley row, slices that cross Paley rows, a quarter of a power-of-two block)
    for M, K, block, grid_rows, slice_ in ((3, 576, 576, 3, 0), (2, 576, 576, 1, 576), (2, 1536, 1536, 2, 0),
                                           (1, 1536, 1536, 1, 1536), (1, 4096, 4096, 1, 0), (1, 4096, 4096, 1, 4096),
                                           (5, 2048, 256, 2, 0), (3, 96, 48, 3, 0), (3, 96, 48, 3, 96),
                                           (3, 44, 44, 2, 0), (2, 72, 24, 1, 0), (2, 72, 24, 1, 24),
                                           (1, 576, 576, 1, 8), (1, 576, 576, 1, 96), (1, 1536, 1536, 1, 96),
                                           (1, 4096, 4096, 1, 1024)):
        x = torch.randn(M, K).to(dtype)
        x[0, 3] = 40.0  # an outlier to spread
        rot, tensors = rotation_header((11, block), K)
        y = run(exe, [M, K, int(dtype == torch.bfloat16), grid_rows, slice_, *rot], [x, *tensors], (M, K)).double()
        x64, _ = rotated_reference(x, (11, block))
        # one rounding to dtype, plus float32 sums of terms |x_k|/√b (mass: their total) at most 64 additions deep
        mass = x.double().abs().view(M, K // block, block).sum(-1, keepdim=True) / block ** 0.5
        bound = eps * x64.abs() + 64 * 2.0 ** -24 * mass.repeat_interleave(block, -1).view(M, K) + 1e-30
        assert ((y - x64).abs() <= bound).all(), (K, block, (y - x64).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_rotate_op_serves_rotate_input_on_a_gpu(monkeypatch, dtype):
    """On a GPU, rotate_input of an fp16/bf16 input is one ``qlinear::cuda_rotate`` launch, within one rounding of the
    float64 ``R·x`` for K = 576 / 1536 / 4096 / 11008 (blocks 576, 1536, 4096, 256) at M = 1 and 512, 3-d inputs
    included; float32 inputs and inputs that need their gradient take the PyTorch transform."""
    from qlinear.backends import _gpu

    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    calls = []
    real = torch.ops.qlinear.cuda_rotate
    monkeypatch.setattr(_gpu.torch.ops.qlinear, "cuda_rotate", lambda *a: calls.append(1) or real(*a), raising=False)
    for K in (576, 1536, 4096, 11008):
        block = rotation.block_size(K)
        for shape in ((1, K), (512, K), (2, 3, K)):
            monkeypatch.setattr(rotation, "_last", ())
            x = torch.randn(*shape, device="cuda").to(dtype)
            n = len(calls)
            y = rotation.rotate_input(x, 3, block)
            assert len(calls) == n + 1 and y.shape == x.shape and y.dtype == dtype
            x64 = rotation.rotate(x.double(), 3, block)
            mass = x.double().abs().reshape(-1, K // block, block).sum(-1, keepdim=True) / block ** 0.5
            bound = eps * x64.abs() + 64 * 2.0 ** -24 * mass.expand(-1, -1, block).reshape(x.shape)
            assert ((y.double() - x64).abs() <= bound).all(), (K, shape)
    monkeypatch.setattr(rotation, "_last", ())
    n = len(calls)
    rotation.rotate_input(torch.randn(2, 576, device="cuda"), 3, 576)
    rotation.rotate_input(torch.randn(2, 576, device="cuda", dtype=dtype, requires_grad=True), 3, 576)
    assert len(calls) == n


def test_cuda_transform_declines_what_its_kernel_does_not_take(monkeypatch):
    """backends/_gpu.py's cuda_transform hands rotate_input back to PyTorch (None) for float32 inputs, inputs that need
    their gradient and blocks whose work area exceeds the device's shared memory per block, before building
    anything."""
    from qlinear.backends import _gpu

    monkeypatch.setattr(_gpu, "_rotate_library", lambda: pytest.fail("built for an input it declines"))
    monkeypatch.setattr(_gpu, "_smem_optin", lambda device: 99 * 1024)  # a consumer GPU's
    assert _gpu.cuda_transform(torch.randn(2, 576), 0, 576) is None
    assert _gpu.cuda_transform(torch.randn(2, 576, dtype=torch.float16, requires_grad=True), 0, 576) is None
    assert _gpu.cuda_transform(torch.randn(1, 28672, dtype=torch.float16), 0, 28672) is None
    built = []  # 14336 = 28·512: 56 KiB, past every check to the build, which declines here
    monkeypatch.setattr(_gpu, "_rotate_library", lambda: built.append(1) or "no library here")
    assert _gpu.cuda_transform(torch.randn(1, 28672, dtype=torch.float16), 0, 14336) is None and built == [1]
