"""Arm NEON/SDOT/SMMLA backend: layouts, executable spec, the native op (SIMDe on x86, or native on Arm) on
every dispatch path, registry rules, and the standalone harness cross-compiled for aarch64 and run under qemu
(dotprod+i8mm and dotprod-only CPUs).  What every kernel must satisfy in a module (layout held, canonical saves,
compile, autograd) is in test_kernel_conformance.py.

Error bound versus the reference (int8 activations, see the backend docstring): per output
``|y − y_ref| ≤ Σ_h (amax_h / 254) · Σ_{k∈h} |ŵ_k| + 1e-5 · Σ_k |ŵ_k x_k|``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qlinear.backends as backends
from conftest import int8_activation_bound
from qlinear import BCQLinear, CodebookLinear
from qlinear.backends import arm_neon
from qlinear.formats import bcq, codebook

HERE = Path(arm_neon.__file__).parent


def _bcq_uniform(N, K, group_size, offset=True, fp32=False, seed=0, bits=4):
    torch.manual_seed(seed)
    if fp32:  # an imported GPTQ-style layer: exact fp32 offsets
        G = -(-K // group_size)
        codes = torch.randint(0, 2 ** bits, (N, K))
        scales = (torch.rand(N, G) * 0.02 + 0.001).half().float()
        zeros = torch.randint(0, 2 ** bits, (N, G))
        cfg, bufs = bcq.from_uniform(codes, scales, zeros, bits, group_size)
        return cfg, bufs
    cfg = bcq.Config(bits=bits, group_size=group_size, offset=offset, init="uniform", iters=0)
    return cfg, bcq.quantize(torch.randn(N, K), cfg)


def _bcq_outliers(N, K, group_size, bits):
    """Rows with one large weight (their groups far from the zero point) and a zero row: the offset term's Σ x must be
    over the int8 activations the codes multiply, or its error exceeds the int8 bound (a review helper's case)."""
    torch.manual_seed(1)
    w = torch.randn(N, K) * 0.02
    w[:, 5] = 50.0
    w[3] = 0.0
    cfg = bcq.Config(bits=bits, group_size=group_size, init="uniform", iters=0)
    return cfg, bcq.quantize(w, cfg)


def _codebook(N, K, bits, books, group_size=32, seed=0):
    torch.manual_seed(seed)
    cfg = codebook.Config(bits=bits, group_size=group_size, num_codebooks=books, iters=1)
    return cfg, codebook.quantize(torch.randn(N, K), cfg)


def _cases():
    yield "bcq g128", *_bcq_uniform(24, 256, 128)
    yield "bcq g64 fp32 offset ragged", *_bcq_uniform(13, 160, 64, fp32=True)
    yield "bcq no offset g32", *_bcq_uniform(16, 96, 32, offset=False)
    yield "bcq 8-bit g64", *_bcq_uniform(24, 256, 64, bits=8)
    yield "bcq 8-bit whole row ragged", *_bcq_uniform(13, 160, -1, bits=8)
    yield "bcq 8-bit g32 fp32 offset", *_bcq_uniform(16, 96, 32, fp32=True, bits=8)
    yield "bcq 8-bit no offset", *_bcq_uniform(8, 128, 64, offset=False, bits=8)
    yield "bcq 5-bit g32 fp32 offset", *_bcq_uniform(16, 96, 32, fp32=True, bits=5)
    yield "bcq 6-bit no offset", *_bcq_uniform(13, 128, 64, offset=False, bits=6)
    yield "bcq 4-bit g32 outliers", *_bcq_outliers(16, 128, 32, 4)
    yield "bcq 8-bit whole row outliers", *_bcq_outliers(16, 128, -1, 8)
    yield "codebook 4-bit", *_codebook(20, 128, 4, 1)
    yield "codebook 2-bit 1 book", *_codebook(8, 96, 2, 1)
    yield "codebook 2-bit 2 books", *_codebook(19, 128, 2, 2)
    yield "codebook 2-bit 4 books g64", *_codebook(32, 192, 2, 4, group_size=64)


CASES = list(_cases())
IDS = [c[0] for c in CASES]


def _layout(cfg):
    return arm_neon.BCQ_LAYOUT if cfg.format == "bcq" else arm_neon.CODEBOOK_LAYOUT


def _dense(cfg, bufs, N, K):
    from qlinear.formats import get_format

    return get_format(cfg.format).dequantize(bufs, cfg, N, K)


def _repack(cfg, bufs, N, K, layout):
    fn = arm_neon.repack_bcq if cfg.format == "bcq" else arm_neon.repack_codebook
    return fn(bufs, cfg, N, K, layout=layout)


LAYOUTS = ["mmla", "sdot"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,cfg,bufs", CASES, ids=IDS)
def test_layout_round_trip_is_exact(name, cfg, bufs, layout):
    (N, K) = _shape(cfg, bufs)
    packed = _repack(cfg, bufs, N, K, layout)
    assert tuple(packed) == _layout(cfg).names(cfg)
    canon_code_bytes = bufs["qweight" if cfg.format == "bcq" else "codes"].numel() * 4
    assert packed["arm_qw"].numel() <= canon_code_bytes + 8 * 4 * K  # same code bits (+ padding rows)
    unrepack = arm_neon.unrepack_bcq if cfg.format == "bcq" else arm_neon.unrepack_codebook
    back = unrepack(packed, cfg, N, K, layout=layout)
    assert set(back) == set(bufs)
    for k in bufs:
        assert back[k].dtype == bufs[k].dtype and torch.equal(back[k], bufs[k]), k


def test_the_two_layouts_differ_where_documented():
    """Row ``r``, input ``k`` of a block lands at byte ``i`` of ``V[c][p]`` as qgemm.h says, in each layout."""
    N, K = 8, 32
    codes = torch.arange(N * K).view(N, K)
    mmla = arm_neon._blocks(codes, N, K, "mmla")[0, 0]   # [c, p, i]
    sdot = arm_neon._blocks(codes, N, K, "sdot")[0, 0]
    for r in range(8):
        for k in range(32):
            assert mmla[k // 8, r // 2, (r % 2) * 8 + k % 8] == codes[r, k]
            assert sdot[k % 16 // 4, 2 * (r // 4) + k // 16, 4 * (r % 4) + k % 4] == codes[r, k]
    with pytest.raises(ValueError, match="layout 'laneq' is not one of"):
        arm_neon.repack_codebook(*_codebook(8, 32, 2, 1)[::-1], 8, 32, layout="laneq")


@pytest.mark.parametrize("N", [8, 13])
def test_sdot_layout_from_the_packed_words_is_the_codes_layout(monkeypatch, N):
    """Layout ``sdot`` of uniform 4-bit layers is built from ``qweight``'s bytes (little-endian hosts): the same bytes
    as the codes path (:func:`_blocks` + :func:`_pack_nibbles`), which other hosts take (simulated), and back."""
    K = 64
    cfg = BCQLinear(K, N, False, bcq.Config(bits=4, group_size=32, init="uniform", iters=0)).config
    codes = torch.randint(0, 16, (N, K))
    bufs = bcq.uniform_buffers(codes, torch.rand(N, 2).half() + 0.5, torch.randint(0, 16, (N, 2)), 4)
    want = arm_neon._pack_nibbles(arm_neon._blocks(codes ^ 8, N, K, "sdot"))
    got = arm_neon.repack_bcq(bufs, cfg, N, K, layout="sdot")
    assert torch.equal(got["arm_qw"], want)
    back = arm_neon.unrepack_bcq(got, cfg, N, K, layout="sdot")
    monkeypatch.setattr(sys, "byteorder", "big")
    assert torch.equal(arm_neon.repack_bcq(bufs, cfg, N, K, layout="sdot")["arm_qw"], want)
    assert all(torch.equal(back[k], bufs[k]) for k in bufs)
    assert torch.equal(arm_neon.unrepack_bcq(got, cfg, N, K, layout="sdot")["qweight"], bufs["qweight"])


@pytest.mark.parametrize("value,want", [(None, "sdot"), ("", "sdot"), ("sdot", "sdot"), ("mmla", "mmla"),
                                        (" MMLA ", "mmla")])
def test_default_layout_reads_qlinear_arm_layout(monkeypatch, value, want):
    """sdot unless QLINEAR_ARM_LAYOUT asks for mmla; another value is a ValueError that names the choices."""
    if value is None:
        monkeypatch.delenv("QLINEAR_ARM_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("QLINEAR_ARM_LAYOUT", value)
    assert arm_neon.default_layout() == want
    monkeypatch.setenv("QLINEAR_ARM_LAYOUT", "laneq")
    with pytest.raises(ValueError, match=r"QLINEAR_ARM_LAYOUT='laneq' is not one of \['mmla', 'sdot'\]"):
        arm_neon.default_layout()


def _shape(cfg, bufs):
    if cfg.format == "bcq":
        return bufs["qweight"].shape[0], bufs["qweight"].shape[1] * 32 // cfg.bits
    return bufs["scales"].shape[0], bufs["scales"].shape[1] * cfg.group_size


@pytest.mark.slow  # fresh interpreters
def test_qlinear_arm_layout_is_read_at_import():
    """mmla names its layouts *_mmla; a bad value leaves qlinear importable and this backend unavailable, with the
    error as its reason."""
    code = ("import qlinear; from qlinear.backends import arm_neon as a; "
            "print(a.LAYOUT, a.BCQ_LAYOUT.name, a.available() if a._LAYOUT_ERROR else None)")

    def run(value):
        env = dict(os.environ, QLINEAR_ARM_LAYOUT=value)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)

    r = run("mmla")
    assert r.returncode == 0 and r.stdout.split() == ["mmla", "arm_neon_bcq_mmla", "None"], r.stderr[-2000:]
    r = run("laneq")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("sdot arm_neon_bcq QLINEAR_ARM_LAYOUT='laneq' is not one of ['mmla', 'sdot']")


def test_non_uniform_bcq_is_rejected():
    cfg = bcq.Config(bits=4, group_size=64, iters=2)
    bufs = bcq.quantize(torch.randn(16, 128), cfg)
    k = next(k for k in backends.kernels("bcq") if k.backend == "arm_neon")
    assert "uniform" in k.reject(cfg, torch.device("cpu"), torch.float32, 1, (16, 128))
    with pytest.raises(ValueError, match="not uniform"):
        arm_neon.repack_bcq(bufs, cfg, 16, 128)


def test_registry_reasons():
    cpu = torch.device("cpu")
    cb = next(k for k in backends.kernels("codebook") if k.backend == "arm_neon")
    assert "bits=1" in cb.reject(codebook.Config(bits=1), cpu, torch.float32, 1, (8, 64))
    assert "multiple of 32" in cb.reject(codebook.Config(bits=2, group_size=16), cpu, torch.float32, 1, (8, 64))
    b = next(k for k in backends.kernels("bcq") if k.backend == "arm_neon")
    assert "bits=3" in b.reject(bcq.Config(bits=3, init="uniform", iters=0), cpu, torch.float32, 1, (8, 64))
    assert arm_neon.supports_bcq(bcq.Config(bits=7, init="uniform", iters=0), 8, 64) is None
    assert "uniform" in b.reject(bcq.Config(bits=8, iters=1), cpu, torch.float32, 1, (8, 64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,cfg,bufs", CASES, ids=IDS)
def test_spec_matches_reference_within_activation_bound(name, cfg, bufs, layout):
    N, K = _shape(cfg, bufs)
    packed = _repack(cfg, bufs, N, K, layout)
    w = _dense(cfg, bufs, N, K)
    for M in (1, 3, 8):
        x = torch.randn(M, K) * 2
        bias = torch.randn(N)
        y = arm_neon.spec(x, packed, bias, cfg, arm_neon._format(cfg), N, K, layout)
        ref = x.double() @ w.double().T + bias.double()
        assert ((y.double() - ref).abs() <= int8_activation_bound(w, x)).all()


def test_spec_catches_a_wrong_layout():
    cfg, bufs = _codebook(16, 128, 2, 4)
    w = _dense(cfg, bufs, 16, 128)
    x = torch.randn(2, 128)
    packed = arm_neon.repack_codebook(bufs, cfg, 16, 128, layout="mmla")
    flipped = dict(packed, arm_qw=packed["arm_qw"].flip(-1).contiguous())
    sdot = arm_neon.repack_codebook(bufs, cfg, 16, 128, layout="sdot")
    for bufs_, layout in ((flipped, "mmla"), (sdot, "mmla"), (packed, "sdot")):
        y = arm_neon.spec(x, bufs_, None, cfg, arm_neon._FMT_CB2, 16, 128, layout)
        assert not ((y.double() - x.double() @ w.double().T).abs() <= int8_activation_bound(w, x)).all()


# --- the native op ----------------------------------------------------------------------------------------------
native = pytest.mark.skipif(arm_neon.available() is not None, reason=f"arm_neon extension: {arm_neon.available()}")


@native
@pytest.mark.parametrize("name,cfg,bufs", CASES, ids=IDS)
@pytest.mark.parametrize("path,layout", [("neon", "mmla"), ("dotprod", "mmla"), ("i8mm", "mmla"), ("neon", "sdot"),
                                         ("dotprod", "sdot"), ("i8mm", "sdot")])
def test_native_op_matches_spec_and_reference(name, cfg, bufs, path, layout):
    N, K = _shape(cfg, bufs)
    packed = _repack(cfg, bufs, N, K, layout)
    w = _dense(cfg, bufs, N, K)
    for M in (1, 2, 3, 4, 5, 8, 17, 64):
        x = torch.randn(M, K)
        for bias in (None, torch.randn(N)):
            y = arm_neon.linear(x, packed, bias, cfg, N, K, path, layout)
            assert y.shape == (M, N) and y.dtype == torch.float32
            s = arm_neon.spec(x, packed, bias, cfg, arm_neon._format(cfg), N, K, layout)
            assert torch.allclose(y, s, rtol=1e-5, atol=1e-5 * float(s.abs().max()) + 1e-6)
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert ((y.double() - ref).abs() <= int8_activation_bound(w, x)).all()


@native
@pytest.mark.parametrize("cfg,bufs", [_codebook(40, 256, 2, 4), _bcq_uniform(40, 256, 64), _codebook(40, 256, 4, 1),
                                      _bcq_uniform(40, 256, 64, bits=8)], ids=["cb2", "bcq", "cb4", "bcq8"])
def test_all_paths_and_layouts_agree_bitwise(cfg, bufs):
    x = torch.randn(9, 256)
    outs = []
    for layout in LAYOUTS:
        packed = _repack(cfg, bufs, 40, 256, layout)
        for p in ("neon", "dotprod", "i8mm"):  # i8mm: SDOT for 1 row, SMMLA for 9
            outs += [arm_neon.linear(x[:m], packed, None, cfg, 40, 256, p, layout) for m in (1, 9)]
    for o in outs[2::2]:
        assert torch.equal(o, outs[0])
    for o in outs[3::2]:
        assert torch.equal(o, outs[1])


@native
@pytest.mark.parametrize("cfg,bufs", [_codebook(40, 256, 2, 4), _bcq_uniform(40, 256, 64), _codebook(40, 256, 4, 1)],
                         ids=["cb2", "bcq", "cb4"])
def test_a_nan_input_gives_nan_outputs_on_every_path(cfg, bufs):
    """A NaN anywhere in a row's 32-input block makes that row's outputs NaN (fmaxf alone would drop it and leave
    finite values from saturated codes); other rows are untouched."""
    for layout in LAYOUTS:
        packed = _repack(cfg, bufs, 40, 256, layout)
        for k in (0, 45, 255):
            x = torch.randn(9, 256)
            want = arm_neon.linear(x, packed, None, cfg, 40, 256, "neon", layout)
            x[4, k] = float("nan")
            for p in ("neon", "dotprod", "i8mm"):  # i8mm: SDOT for 1 row, SMMLA for 9
                assert arm_neon.linear(x[4:5], packed, None, cfg, 40, 256, p, layout).isnan().all(), (layout, k, p)
                y = arm_neon.linear(x, packed, None, cfg, 40, 256, p, layout)
                assert y[4].isnan().all() and torch.equal(y[:4], want[:4]) and torch.equal(y[5:], want[5:])


@native
def test_op_rejects_inconsistent_codebook_buffers():
    cfg, bufs = _codebook(16, 64, 2, 4)
    p = arm_neon.repack_codebook(bufs, cfg, 16, 64, layout="sdot")
    x = torch.randn(1, 64)

    def call(books=4, qb=p["arm_qb"], table=p["codebooks"], group=32, layout=1):  # 1: sdot
        return torch.ops.qlinear.arm_gemm(x, p["arm_qw"], p["arm_qs"], None, qb, table, None, arm_neon._FMT_CB2,
                                          books, 16, group, 0, layout)

    assert call().shape == (1, 16)
    with pytest.raises(RuntimeError, match="do not fit in 16 bytes"):
        call(books=5, table=torch.zeros(20, dtype=torch.int8))
    with pytest.raises(RuntimeError, match=r"codebooks must be contiguous int8 \[4, 4\]"):
        call(table=p["codebooks"].flatten()[:8].contiguous())
    with pytest.raises(RuntimeError, match="qb .codebook ids. is needed exactly when"):
        call(qb=None)
    with pytest.raises(RuntimeError, match="positive multiples of 32"):
        call(group=0)
    with pytest.raises(RuntimeError, match="unknown layout 2"):
        call(layout=2)


@native
@pytest.mark.parametrize("cls,opts", [(CodebookLinear, dict(bits=2)), (CodebookLinear, dict(bits=4)),
                                      (BCQLinear, dict(bits=4, group_size=64, init="uniform", iters=0)),
                                      (BCQLinear, dict(bits=4, group_size=64, method="gptq", act_order=True))],
                         ids=["cb2", "cb4", "bcq", "gptq act_order"])
@pytest.mark.parametrize("K,block", [(192, 0), (576, 0), (576, 72)], ids=["192", "576", "576 block 72"])
def test_rotated_layers_transform_x_inside_the_op(cls, opts, K, block):
    from conftest import assert_fused_rotation

    def spec(x, m):
        call = m._call(x.device, x.dtype, 37)
        return arm_neon.spec(x, dict(zip(m._packed_names, m.packed())), m.bias, call.cfg, arm_neon._format(call.cfg),
                             m.out_features, m.in_features, rotation=call.rotation)

    assert_fused_rotation("arm_neon", cls, opts, spec, K=K, block=block)


# --- the standalone harness on aarch64 under qemu ----------------------------------------------------------------
CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm") / "harness"
    srcs = [str(HERE / f) for f in ("harness.cpp", "kernels.cpp", "kernels_i8mm.cpp")]
    r = subprocess.run([CROSS, "-std=c++17", "-O3", "-static", "-march=armv8.2-a+dotprod", *srcs, "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.skipif(CROSS is None or QEMU is None, reason="needs g++-aarch64-linux-gnu and qemu-user")
@pytest.mark.parametrize("cpu,path", [("max", "i8mm"), ("neoverse-n1", "dotprod"), ("cortex-a53", "neon")])
def test_harness_under_qemu(harness, cpu, path):
    r = subprocess.run([QEMU, "-cpu", cpu, str(harness), "test"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"dispatch: {path}" in r.stdout and " 0 failures" in r.stdout


@pytest.mark.skipif(CROSS is None or QEMU is None, reason="needs g++-aarch64-linux-gnu and qemu-user")
@pytest.mark.parametrize("K,block,seed", [(576, 576, 0), (1536, 1536, 7), (96, 48, 5), (224, 224, 3),  # 36, 12, 12, 28
                                          (512, 256, 2 ** 31 - 1)])
def test_harness_rotation_matches_python(harness, tmp_path, K, block, seed):
    """The harness's rotate_rows (what bench_arm.py --rotation counts; D computed in C++, the Paley factor read from
    Python) is qlinear.formats.rotation.rotate within float32 rounding."""
    from qlinear.backends._cpu import paley_argument
    from qlinear.formats import rotation

    p = rotation._split(block)[0]
    args = [QEMU, "-cpu", "max", str(harness), "rotate", str(K), str(block), str(seed)]
    if p > 1:
        (tmp_path / "paley").write_bytes(paley_argument(p).numpy().tobytes())
        args.append(str(tmp_path / "paley"))
    x = torch.randn(3, K)
    r = subprocess.run(args, input=x.numpy().tobytes(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    y = torch.frombuffer(bytearray(r.stdout), dtype=torch.float32).reshape(3, K)
    want = rotation.rotate(x, seed, block)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
