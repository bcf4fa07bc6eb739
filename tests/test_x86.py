"""x86 backend (AVX-512 VNNI + VBMI / AVX2 + AVX-VNNI / AVX2 / scalar): its layouts (uniform 4-bit nibbles, BCQ
bit-planes for the lookup tables, codebook codes), executable spec, every dispatch path of the native op on this
machine and, through the SIMDe build, the paths this CPU lacks; registry rules.  Modules on the backend are in
test_kernel_conformance.py.

Error bound versus the float64 reference: the int8 activations' (``conftest.int8_activation_bound``, as for the Arm
kernels).  Native op versus :func:`qlinear.backends.x86.spec` (float64 of the same integers): fp32 rounding of the
per-block scaling and the sums over blocks and groups, ``(H + 2G + 12)·2⁻²⁴·Σ_k |ŵ_k|·|x̂_k|`` (free α: per weight ``2Σ_i |α_i| + |c|`` for ``|ŵ_k|``) with x̂ the int8
activations times their scales.
"""

from __future__ import annotations

import itertools
import math
import platform

import pytest
import torch
from conftest import dense64, int8_activation_bound

import qlinear.backends as backends
from qlinear import BCQLinear, CodebookLinear, MixedPrecisionLinear, QLinearConfig
from qlinear.backends import x86
from qlinear.backends._cpu import quantize_activations, rotation_args
from qlinear.formats import bcq, codebook, mixed
from qlinear.formats.packing import unpack, unpack_planes

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")


@pytest.fixture(autouse=True, scope="module")
def _built():
    """The extension builds on every x86-64 machine with a C++ compiler (a failure here is a real failure)."""
    assert x86.available() is None, x86.available()


def _layer(N, K, group_size, offset=True, imported=False, seed=0, free=False, bits=4):
    """``(cfg, canonical buffers)``: round-to-nearest, (``imported``) random codes and zero points over their whole
    range as a GPTQ checkpoint may hold them, or (``free``) free-α BCQ from the BCQ fit."""
    g = torch.Generator().manual_seed(seed)
    if free:
        cfg = bcq.Config(bits=bits, group_size=group_size, offset=offset, iters=2)
        return cfg, bcq.quantize(torch.randn(N, K, generator=g), cfg)
    if imported:
        G = 1 if group_size == -1 else -(-K // group_size)
        top = 2 ** bits - 1
        zeros = torch.randint(0, top + 1, (N, G), generator=g)
        zeros[0, 0], zeros[-1, -1] = 0, top
        return bcq.from_uniform(torch.randint(0, top + 1, (N, K), generator=g),
                                (torch.rand(N, G, generator=g) * 0.02 + 1e-3).half(), zeros, bits, group_size)
    cfg = bcq.Config(bits=bits, group_size=group_size, offset=offset, init="uniform", iters=0)
    return cfg, bcq.quantize(torch.randn(N, K, generator=g), cfg)


CASES = {  # (N, K, group size, offset, imported, free α, bits); all but uniform 4-8 bit take the bit-plane layout
    "g128": (48, 256, 128, True, False, False, 4),
    "g64 ragged N tail": (40, 320, 64, True, True, False, 4),  # 40 rows: a half-filled last block
    "g128 ragged last group": (24, 576, 128, True, False, False, 4),  # SmolLM2's 576 inputs: 4 groups of 128, one of 64
    "g32 no offset": (16, 96, 32, False, False, False, 4),
    "whole row": (33, 128, -1, True, True, False, 4),
    "uniform 3-bit g64 imported": (40, 320, 64, True, True, False, 3),
    "uniform 2-bit g128 ragged last group": (24, 576, 128, True, False, False, 2),
    "uniform 1-bit no offset": (16, 96, 32, False, False, False, 1),
    "uniform 8-bit g64 imported": (40, 320, 64, True, True, False, 8),  # codes and zero points over 0..255
    "uniform 8-bit g128 ragged last group": (24, 576, 128, True, False, False, 8),
    "uniform 8-bit no offset whole row": (17, 128, -1, False, False, False, 8),
    "uniform 5-bit g64 imported": (40, 320, 64, True, True, False, 5),  # 5-7 bit codes take the 8-bit bytes
    "uniform 6-bit no offset g32": (17, 96, 32, False, False, False, 6),
    "uniform 7-bit g128 ragged last group": (24, 576, 128, True, False, False, 7),
    "free α g64 ragged N tail": (40, 320, 64, True, False, True, 4),
    "free α g128 ragged last group": (24, 576, 128, True, False, True, 4),
    "free α no offset whole row": (17, 128, -1, False, False, True, 4),
    "free α 3-bit g32": (33, 160, 32, True, False, True, 3),
    "free α 2-bit g64": (40, 320, 64, True, False, True, 2),
    "free α 1-bit g128 no offset": (16, 256, 128, False, False, True, 1),
}


CB_CASES = {  # codebooks: (N, K, group size, bits, books)
    "codebook 4-bit g32": (20, 128, 32, 4, 1),
    "codebook 4-bit g64 ragged N tail": (40, 320, 64, 4, 1),
    "codebook 2-bit 1 book": (8, 96, 32, 2, 1),
    "codebook 2-bit 2 books ragged N tail": (19, 128, 32, 2, 2),
    "codebook 2-bit 4 books g64": (33, 192, 64, 2, 4),
    "codebook 2-bit 4 books g128": (48, 256, 128, 2, 4),
}
ALL = [*CASES, *CB_CASES]


def _case(name):
    if name in CB_CASES:
        N, K, gs, bits, books = CB_CASES[name]
        torch.manual_seed(N + K)
        cfg = codebook.Config(bits=bits, group_size=gs, num_codebooks=books, iters=1)
        return cfg, codebook.quantize(torch.randn(N, K), cfg), N, K
    N, K, gs, offset, imported, free, bits = CASES[name]
    cfg, bufs = _layer(N, K, gs, offset, imported, seed=N + K, free=free, bits=bits)
    return cfg, bufs, N, K


def _repack(cfg, bufs, N, K):
    return (x86.repack_codebook if cfg.format == "codebook" else x86.repack)(bufs, cfg, N, K)


def _planes(cfg) -> bool:
    return not (bcq.is_uniform(cfg) and (cfg.bits >= 4 or (cfg.bits == 2 and cfg.offset)))


def _dense(cfg, bufs, N, K):
    from conftest import dense64

    return dense64(cfg.format, bufs, cfg, N, K)


def _op(x, packed, bias, N, cfg, path):
    """The native op on ``path``, or None where this CPU lacks it; ``simde-<path>`` runs the SIMDe build (every path,
    on any x86-64 CPU with AVX2, FMA and F16C)."""
    simde = path.startswith("simde-")
    if simde and x86.simde_available() is not None:
        return None
    fn = x86.linear_mixed if cfg.format == "mixed" else x86.linear
    try:
        return fn(x, packed, bias, cfg, N, x.shape[1], path=path.removeprefix("simde-"), simde=simde)
    except RuntimeError as e:
        if "cannot run path" in str(e):
            return None
        raise


@pytest.mark.parametrize("name", ALL)
def test_dequantize_from_the_layout_is_the_formats_bit_for_bit(name):
    """The layouts' ``dequantize`` (the backward pass's weight, no unrepack) gives the format's float32 values, and
    their float64 formula to fp32 rounding."""
    from qlinear.formats import get_format

    if x86.available() is not None:
        pytest.skip(x86.available())
    cfg, bufs, N, K = _case(name)
    w = x86.dequantize(_repack(cfg, bufs, N, K), cfg, N, K)
    assert w.dtype == torch.float32 and torch.equal(w, get_format(cfg.format).dequantize(bufs, cfg, N, K))
    assert torch.allclose(w.double(), _dense(cfg, bufs, N, K), rtol=2.0 ** -23, atol=0)


@pytest.mark.parametrize("name", ALL)
def test_bfloat16_dequantize_rounds_the_formats_values_once(name):
    """``dtype=torch.bfloat16`` (the batched path's tiles for bfloat16 activations): the format's float32 Ŵ rounded to
    bfloat16 by torch, bit for bit, in the native build and (every SIMD path emulated) the SIMDe one."""
    from qlinear.formats import get_format

    if x86.available() is not None:
        pytest.skip(x86.available())
    cfg, bufs, N, K = _case(name)
    held = _repack(cfg, bufs, N, K)
    want = get_format(cfg.format).dequantize(bufs, cfg, N, K).to(torch.bfloat16)
    got = x86.dequantize(held, cfg, N, K, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    if x86.simde_available() is None:
        qw, qs, qz, qb, gs, bits, fmt = x86._weights(held, cfg, K)
        for dtype in (torch.float32, torch.bfloat16):
            simde = torch.ops.qlinear_x86_simde.x86_dequantize(qw, qs, qz, qb, N, K, gs, bits, fmt, dtype)
            assert torch.equal(simde, x86.dequantize(held, cfg, N, K, dtype)), dtype
    with pytest.raises(RuntimeError, match="dtype must be torch.float32 or torch.bfloat16"):
        x86.dequantize(held, cfg, N, K, torch.float16)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("gemm", ["amx", "torch"])
def test_bfloat16_activations_take_a_bfloat16_gemm_from_the_threshold(name, gemm, monkeypatch):
    """On a CPU with AVX512-BF16, bfloat16 activations from ``batched_from`` rows multiply the layout's Ŵ rounded to
    bfloat16 in a bfloat16 GEMM (AMX tiles, 100 rows: a pass of 6 activation groups and a ragged one; or torch's
    GEMM over tiles of 3 blocks, the last ragged): within the roundings of Ŵ and y to bfloat16 of the float64
    reference; below the threshold the int8 GEMV runs (the batched path is not called)."""
    if x86.available() is not None:
        pytest.skip(x86.available())
    cfg, bufs, N, K = _case(name)
    x = torch.randn(100, K).bfloat16()
    if x86.batched_dtype(x) != torch.bfloat16:
        pytest.skip("no AVX512-BF16: bfloat16 activations take the float32 batched path")
    if gemm == "amx" and not x86.amx_available():
        pytest.skip("no AMX")
    if gemm == "torch":
        monkeypatch.setattr(x86, "amx_available", lambda: False)
    for table in ("BF16_BATCHED_FROM", "AMX_BATCHED_FROM"):
        monkeypatch.setattr(x86, table, {"planes": 3, "other": 4, "mixed": 4})
    monkeypatch.setattr(x86, "_TILE_BYTES_BF16", 2 * K * 16 * 3)
    calls = []
    batched = x86._batched
    monkeypatch.setattr(x86, "_batched", lambda *a, **k: calls.append(1) or batched(*a, **k))
    held, w64, b = _repack(cfg, bufs, N, K), _dense(cfg, bufs, N, K), torch.randn(N).bfloat16()
    y = x86.linear(x, held, b, cfg, N, K)
    assert calls == [1] and y.dtype == torch.bfloat16
    y64 = x.double() @ w64.T + b.double()
    bound = 2.0 ** -8 * (x.double().abs() @ w64.abs().T) + 2.0 ** -7 * (y64.abs() + b.double().abs()) + 1e-6
    assert ((y.double() - y64).abs() <= bound).all()
    x86.linear(x[:2], held, b, cfg, N, K)
    assert calls == [1]


@pytest.mark.parametrize("name", ["g128", "g64 ragged N tail"])
def test_amx_gemm_is_the_bfloat16_product_and_rejects_bad_input(name):
    """The AMX op equals x·Ŵ_bf16ᵀ + bias summed in float64, to float32 summation and one bfloat16 rounding (a wrong
    row order, a dropped 32-input chunk or a misplaced bias would be far outside; 37 rows: a ragged activation group),
    and refuses float32 x and a bias of the wrong length with a reason."""
    if x86.available() is not None or not x86.amx_available():
        pytest.skip("no AMX")
    cfg, bufs, N, K = _case(name)
    held = _repack(cfg, bufs, N, K)
    qw, qs, qz, qb, gs, bits, fmt = x86._weights(held, cfg, K)
    x, b = torch.randn(37, K).bfloat16(), torch.randn(N).bfloat16()
    wb = x86.dequantize(held, cfg, N, K, torch.bfloat16).double()
    for bias in (None, b):
        y = torch.ops.qlinear.x86_amx_gemm(x, qw, qs, qz, qb, bias, N, gs, bits, fmt)
        assert y.dtype == torch.bfloat16 and y.shape == (37, N)
        want = x.double() @ wb.T + (0 if bias is None else b.double())
        sums = 2 * K * 2.0 ** -24 * (x.double().abs() @ wb.abs().T + b.double().abs())
        assert ((y.double() - want).abs() <= sums + 2.0 ** -8 * (want.abs() + sums) + 1e-30).all()
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        torch.ops.qlinear.x86_amx_gemm(x.float(), qw, qs, qz, qb, None, N, gs, bits, fmt)
    with pytest.raises(RuntimeError, match="bias must be a CPU"):
        torch.ops.qlinear.x86_amx_gemm(x, qw, qs, qz, qb, b[:-1], N, gs, bits, fmt)


@pytest.mark.parametrize("name", list(CASES))
def test_layout_round_trip_is_exact(name):
    cfg, bufs, N, K = _case(name)
    packed = x86.repack(bufs, cfg, N, K)
    assert tuple(packed) == x86.LAYOUT.names(cfg)
    Nb, G, B = -(-N // 16), (bufs["scales"] if "scales" in bufs else bufs["alpha"][0]).shape[1], cfg.bits
    crumbs = bcq.is_uniform(cfg) and B == 2 and cfg.offset  # 2-bit codes 4 per byte, zero points as book words
    W = 8 if bcq.is_uniform(cfg) and B > 4 else B  # 5-7 bit codes a byte each
    assert [(t.dtype, tuple(t.shape)) for t in packed.values()] == [
        (torch.uint8, (Nb, K // 32, B, 64) if _planes(cfg) else (Nb, K * W // 32, 64)),
        *([(torch.float16, (Nb, G, 16)), (torch.int32, (Nb, G))] if crumbs else
          [(torch.float16, (Nb, G, 16)), (torch.int16 if W == 8 else torch.uint8, (Nb, G, 16))]
          if bcq.is_uniform(cfg) else
          [(torch.float16, (Nb, G, B, 16)), (torch.float16, (Nb, G, 16))])]
    back = x86.unrepack(packed, cfg, N, K)
    assert set(back) == set(bufs) and all(torch.equal(back[k], bufs[k]) and back[k].dtype == bufs[k].dtype
                                          for k in bufs)


def test_layout_puts_each_code_where_the_header_says():
    """Byte ``4r + j`` of chunk ``c`` of block ``b``: code ``[16b + r, 8c + j]`` low, ``[16b + r, 8c + 4 + j]`` high."""
    cfg, bufs, N, K = _case("g64 ragged N tail")
    codes, s, zeros = bcq.uniform_parts(bufs, cfg, N, K)
    packed = x86.repack(bufs, cfg, N, K)
    qw, qs, qz = packed["x86_qw"], packed["x86_qs"], packed["x86_qz"]
    for n, k in [(0, 0), (1, 5), (17, 300), (39, 319), (15, 12), (16, 7)]:
        b, r, c, j = n // 16, n % 16, k // 8, k % 4
        byte = int(qw[b, c, 4 * r + j])
        assert (byte & 15 if k % 8 < 4 else byte >> 4) == codes[n, k]
        g = k // 64
        assert qs[b, g, r] == s[n, g] and int(qz[b, g, r]) == 2 * int(zeros[n, g])
    assert not qw[2, :, 4 * 8:].any() and not qs[2, :, 8:].any()  # rows 40..47 pad with zeros


def test_8bit_layout_puts_each_code_where_the_header_says():
    """Byte ``4r + j`` of chunk ``c`` of block ``b``: code ``[16b + r, 4c + j]``; ``x86_qz`` int16 holds ``2·z``."""
    cfg, bufs, N, K = _case("uniform 8-bit g64 imported")
    codes, s, zeros = bcq.uniform_parts(bufs, cfg, N, K)
    assert codes.max() == 255 and zeros.max() == 255  # the whole range: 2·z does not fit uint8
    packed = x86.repack(bufs, cfg, N, K)
    qw, qs, qz = packed["x86_qw"], packed["x86_qs"], packed["x86_qz"]
    for n, k in [(0, 0), (1, 5), (17, 300), (39, 319), (15, 12), (16, 7)]:
        b, r, c, j = n // 16, n % 16, k // 4, k % 4
        assert int(qw[b, c, 4 * r + j]) == codes[n, k]
        g = k // 64
        assert qs[b, g, r] == s[n, g] and int(qz[b, g, r]) == 2 * int(zeros[n, g])
    assert not qw[2, :, 4 * 8:].any() and not qs[2, :, 8:].any()  # rows 40..47 pad with zeros


def test_uniform_2bit_layers_are_held_and_run_as_codebook_layers():
    """A uniform 2-bit layer with zero points takes the 2-bit codebook layout and kernel (kCB2): code ``[n, k]`` in bits
    ``2t..2t+1`` of byte ``4r + j`` of chunk ``k/16`` (``t, j = k%16/4, k%4``), its zero point of group g, the book,
    in bits ``2r..2r+1`` of ``x86_qb[b, g]`` (book z of ``UNIFORM2_BOOKS`` holds q − z), at every batch (no batched
    path); without zero points (symmetric levels) the layer keeps the bit-planes."""
    cfg, bufs, N, K = _case("uniform 2-bit g128 ragged last group")
    codes, s, zeros = bcq.uniform_parts(bufs, cfg, N, K)
    packed = x86.repack(bufs, cfg, N, K)
    assert tuple(packed) == ("x86_qw", "x86_qs", "x86_qb") and x86._weights(packed, cfg, K)[-1] == 4
    for n in (0, 5, 17, N - 1):
        b, r = divmod(n, 16)
        for gi in range(zeros.shape[1]):
            assert (int(packed["x86_qb"][b, gi]) >> (2 * r)) & 3 == zeros[n, gi]
            assert packed["x86_qs"][b, gi, r] == s[n, gi]
        for k in (0, 5, 130, K - 1):
            byte = int(packed["x86_qw"][b, k // 16, 4 * r + k % 4])
            assert (byte >> (2 * (k % 16 // 4))) & 3 == codes[n, k]
    assert all(int(x86.UNIFORM2_BOOKS[z, q]) == q - z for z in range(4) for q in range(4))
    x = torch.randn(x86.dequant_from(2, N, K), K)  # no batched path: the codebook kernel is faster at every batch
    assert torch.equal(_op(x, packed, None, N, cfg, "auto"), _op(x, packed, None, N, cfg, "scalar"))
    symmetric = bcq.Config(bits=2, group_size=64, offset=False, init="uniform", iters=0)
    assert bcq.is_uniform(symmetric) and x86.LAYOUT.names(symmetric)[0] == "x86_lp"


@pytest.mark.parametrize("name", ["free α 3-bit g32", "uniform 3-bit g64 imported"])
def test_bit_planes_sit_where_the_header_says(name):
    """Byte ``16q + r`` of block ``b``, 32 inputs ``h``, plane ``i``: bit ``t`` of its low nibble is bit ``i`` of code
    ``[16b + r, 32h + 4q + t]``, of its high nibble of code ``[16b + r, 32h + 16 + 4q + t]``."""
    cfg, bufs, N, K = _case(name)
    codes = (unpack_planes(bufs["planes"], K) if "planes" in bufs else bcq.uniform_parts(bufs, cfg, N, K)[0])
    lp = x86.repack(bufs, cfg, N, K)["x86_lp"]
    for n, k in [(0, 0), (1, 5), (17, 150), (N - 1, K - 1), (15, 20), (16, 37)]:
        b, r, h, q, t, high = n // 16, n % 16, k // 32, (k % 16) // 4, k % 4, (k % 32) >= 16
        for i in range(cfg.bits):
            byte = int(lp[b, h, i, 16 * q + r])
            assert (byte >> (4 * high + t)) & 1 == (int(codes[n, k]) >> i) & 1, (n, k, i)
    assert N % 16 and not lp[-1].view(*lp.shape[1:3], 4, 16)[..., N % 16:].any()  # padding rows are zero


@pytest.mark.parametrize("name", list(CB_CASES))
def test_codebook_layout_round_trip_is_exact(name):
    cfg, bufs, N, K = _case(name)
    packed = x86.repack_codebook(bufs, cfg, N, K)
    assert tuple(packed) == x86.CODEBOOK_LAYOUT.names(cfg)
    Nb, G = -(-N // 16), K // cfg.group_size
    assert [(t.dtype, tuple(t.shape)) for t in packed.values()] == [
        (torch.uint8, (Nb, K * cfg.bits // 32, 64)), (torch.float16, (Nb, G, 16)),
        *([(torch.int32, (Nb, G))] if cfg.books > 1 else []), (torch.int8, (cfg.books, 2 ** cfg.bits))]
    back = x86.unrepack_codebook(packed, cfg, N, K)
    assert set(back) == set(bufs) and all(torch.equal(back[k], bufs[k]) and back[k].dtype == bufs[k].dtype
                                          for k in bufs)


def test_codebook_codes_and_books_sit_where_the_header_says():
    """2 bits: byte ``4r + j`` of chunk ``c`` of block ``b`` holds code ``[16b + r, 16c + 4t + j]`` in bits
    ``2t..2t+1``; bits ``2r..2r+1`` of word ``[b, g]`` hold the book of row ``16b + r`` in group ``g``."""
    from qlinear.formats.packing import unpack

    cfg, bufs, N, K = _case("codebook 2-bit 4 books g64")
    codes, books = unpack(bufs["codes"], 2, K), unpack(bufs["book_idx"], 2, K // 64)
    packed = x86.repack_codebook(bufs, cfg, N, K)
    qw, qb = packed["x86_qw"], packed["x86_qb"]
    for n, k in [(0, 0), (1, 5), (17, 191), (32, 100), (15, 12), (16, 7)]:
        b, r, c, t, j = n // 16, n % 16, k // 16, (k % 16) // 4, k % 4
        assert (int(qw[b, c, 4 * r + j]) >> (2 * t)) & 3 == codes[n, k]
        assert (int(qb[b, k // 64]) >> (2 * r)) & 3 == books[n, k // 64]
    assert not qw[2, :, 4:].any() and not (qb[2] >> 2).any()  # rows 33..47 pad with zeros


@pytest.mark.parametrize("name", ALL)
def test_spec_matches_reference_within_activation_bound(name):
    cfg, bufs, N, K = _case(name)
    packed = _repack(cfg, bufs, N, K)
    w = _dense(cfg, bufs, N, K)
    bias = torch.randn(N)
    for M in (1, 3, 8):
        x = torch.randn(M, K)
        x[0, :32] *= 20  # one block with a large amax
        y = x86.spec(x, packed, bias, cfg, N, K)
        assert ((y - (x.double() @ w.T + bias.double())).abs() <= int8_activation_bound(w, x)).all()


def test_spec_catches_a_wrong_layout():
    for name, other in (("g128", "x86_qz"), ("uniform 8-bit g64 imported", "x86_qz"),
                        ("free α g64 ragged N tail", "x86_qa"), ("free α 2-bit g64", "x86_qc"),
                        ("uniform 2-bit g128 ragged last group", "x86_qb")):  # its zero points
        cfg, bufs, N, K = _case(name)
        packed = x86.repack(bufs, cfg, N, K)
        w = _dense(cfg, bufs, N, K)
        x = torch.randn(2, K)
        qn = x86.LAYOUT.names(cfg)[0]
        qw = packed[qn]
        swapped = ((qw & 15) << 4) | (qw >> 4)  # the two nibbles of each byte exchanged
        rows = (qw.view(*qw.shape[:-1], 4, 16).flip(-1) if _planes(cfg) else  # rows of a block reversed
                qw.view(*qw.shape[:2], 16, 4).flip(2)).reshape(qw.shape)
        for bad in ({**packed, qn: swapped}, {**packed, qn: rows},
                    {**packed, other: packed[other].flip(-1).contiguous()}):  # per-row values of other rows
            y = x86.spec(x, bad, None, cfg, N, K)
            assert not ((y - x.double() @ w.T).abs() <= int8_activation_bound(w, x)).all(), name


def test_codebook_spec_catches_a_wrong_layout():
    for name in ("codebook 4-bit g64 ragged N tail", "codebook 2-bit 4 books g64"):
        cfg, bufs, N, K = _case(name)
        packed = x86.repack_codebook(bufs, cfg, N, K)
        w = _dense(cfg, bufs, N, K)
        x = torch.randn(2, K)
        qw = packed["x86_qw"]
        rows = qw.view(*qw.shape[:2], 16, 4).flip(2).reshape(qw.shape)  # rows of a block reversed
        bad = [{**packed, "x86_qw": rows}, {**packed, "x86_qs": packed["x86_qs"].flip(-1).contiguous()}]
        if cfg.books > 1:
            bad.append({**packed, "x86_qb": packed["x86_qb"].flip(-1).contiguous()})  # other groups' books
        for b in bad:
            y = x86.spec(x, b, None, cfg, N, K)
            assert not ((y - x.double() @ w.T).abs() <= int8_activation_bound(w, x)).all(), name


def _native_bound(cfg, bufs, packed, N, K, x):
    """fp32 rounding of the kernels' scaling and sums (module docstring); free α: per plane, ``|α_i|`` in place of
    ``|ŵ|`` (the planes' partial sums are formed apart, then combined)."""
    xq, xs = quantize_activations(x)
    xhat = (xq.view(x.shape[0], K // 32, 32).double() * xs.double()[..., None]).view(x.shape[0], K).abs()
    G = -(-K // (K if cfg.group_size == -1 else cfg.group_size))
    mag = _dense(cfg, bufs, N, K).abs()
    if cfg.format == "bcq" and not bcq.is_uniform(cfg):
        # Σ_i |α_i| + |c| + Σ_i |α_i| per weight: what the planes and the offset term carry
        gs = K if cfg.group_size == -1 else cfg.group_size
        a = bufs["alpha"].double().abs().sum(0) * 2 + (bufs["offset"].double().abs() if cfg.offset else 0)
        mag = a.repeat_interleave(gs, 1)[:, :K]
    return (K // 32 + 2 * G + 12) * 2.0 ** -24 * (xhat @ mag.T) + 1e-30


PATHS = ("scalar", "avx2", "avx2_vnni", "avx512_vnni", "simde-avx2_vnni", "simde-avx512_vnni")


def _simde_expected() -> bool:
    """Whether the SIMDe build must work here: its headers are installed (a dependency on x86) and the CPU has the
    AVX2, FMA and F16C it runs on."""
    import importlib.util

    flags = set(open("/proc/cpuinfo").read().split())
    return importlib.util.find_spec("simde_py") is not None and {"avx2", "fma", "f16c"} <= flags


def test_the_simde_build_builds_where_expected():
    """A failed SIMDe build would leave the AVX-512 and AVX-VNNI paths untested on CPUs without them."""
    if not _simde_expected():
        pytest.skip("no SIMDe headers or no AVX2/FMA/F16C")
    assert x86.simde_available() is None, x86.simde_available()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bias", [True, False])
def test_every_path_matches_the_spec_and_the_others_bitwise(name, bias):
    cfg, bufs, N, K = _case(name)
    packed = _repack(cfg, bufs, N, K)
    b = torch.randn(N) if bias else None
    for M in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(M, K)
        x[-1, 32:64] = 0  # an all-zero block: scale 0
        ys = {path: y for path in PATHS if (y := _op(x, packed, b, N, cfg, path)) is not None}
        assert {p.removeprefix("simde-") for p in ys} == set(PATHS[:4]) or not _simde_expected()  # every path ran
        y64 = x86.spec(x, packed, b, cfg, N, K)
        bound = _native_bound(cfg, bufs, packed, N, K, x) + (0 if b is None else 2.0 ** -24 * y64.abs())
        for path, y in ys.items():
            assert y.shape == (M, N) and y.dtype == torch.float32
            assert ((y.double() - y64).abs() <= bound).all(), (path, M)
            assert torch.equal(y, ys["scalar"]), (path, M)  # the same integers and fp32 operations: the same bits
        assert torch.equal(_op(x, packed, b, N, cfg, "auto"), ys["scalar"])


@pytest.mark.parametrize("name", [n for n in CASES if _planes(_case(n)[0])])
@pytest.mark.parametrize("tile", ["one", "16 rows", "large layer"])
def test_large_batches_of_bit_plane_layers_take_the_float_gemm(name, tile, monkeypatch):
    """From ``dequant_from`` rows ("auto": DEQUANT_FROM by bits, twice that for a layer of LARGE_LAYER weights), Ŵ from
    the layout (a tile of rows at a time) times unquantized x: within float32 GEMM rounding of the float64 reference,
    far inside the int8-activation bound the lookups keep below it."""
    if x86.available() is not None:
        pytest.skip(x86.available())
    monkeypatch.setattr(x86, "_plane_codes", lambda: False)  # a CPU whose uniform layers keep the lookups
    cfg, bufs, N, K = _case(name)
    if tile == "16 rows":
        monkeypatch.setattr(x86, "_TILE_BYTES", 1)  # one 16-row block per tile, the last one ragged
    if tile == "large layer":
        monkeypatch.setattr(x86, "LARGE_LAYER", N * K)  # this layer counts as large: the threshold doubles
    first = x86.dequant_from(cfg.bits, N, K)
    assert first == x86.DEQUANT_FROM[cfg.bits] * (2 if tile == "large layer" else 1)
    packed, w64, b = x86.repack(bufs, cfg, N, K), _dense(cfg, bufs, N, K), torch.randn(N)
    for M in (first - 1, first):
        x = torch.randn(M, K)
        y = _op(x, packed, b, N, cfg, "auto").double()
        err = (y - (x.double() @ w64.T + b.double())).abs()
        gemm = 2 * K * 2.0 ** -24 * (x.double().abs() @ w64.abs().T + b.double().abs())
        assert (err <= gemm).all() == (M >= first), M


@pytest.mark.parametrize("K,block", [(576, 576), (192, 192), (256, 256), (96, 48)])  # Paley II, I, 2^a, scalar path
def test_rotate_op_is_the_dense_rotation_then_the_gather(K, block):
    """``x86_rotate`` (the batched path's input) is ``R·x`` of the float64 definition, then ``x[:, perm]``; bfloat16
    rows are rotated in float32 and rounded once."""
    from conftest import rotation64

    if x86.available() is not None:
        pytest.skip(x86.available())
    torch.manual_seed(K)
    x, perm = torch.randn(70, K), torch.randperm(K).int()  # three chunks of 32 rows
    args = rotation_args((11, block), K)
    want = x.double() @ rotation64(11, block, K).T
    for p, w in ((None, want), (perm, want[:, perm.long()])):
        y = torch.ops.qlinear.x86_rotate(x, *args, p)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert ((y.double() - w).abs() <= 1e-6 * w.abs().amax(1, keepdim=True)).all()
    assert torch.equal(torch.ops.qlinear.x86_rotate(x, None, None, 0, perm), x[:, perm.long()])
    xb = x.bfloat16()  # rotated in float32 from the bfloat16 values, rounded once
    yb = torch.ops.qlinear.x86_rotate(xb, *args, perm)
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, torch.ops.qlinear.x86_rotate(xb.float(), *args, perm).bfloat16())
    xb[1, 3] = float("nan")  # a NaN input spreads over its block as NaN (never rounded to inf)
    yb = torch.ops.qlinear.x86_rotate(xb, *args)
    assert yb[1, :block].isnan().all() and not yb.isinf().any() and not yb[0].isnan().any()
    with pytest.raises(RuntimeError, match="x86_rotate: x must be a contiguous float32 or bfloat16"):
        torch.ops.qlinear.x86_rotate(x.double(), *args)


def test_large_batches_of_rotated_act_order_layers_take_the_float_gemm(monkeypatch):
    """The batched path applies what the lookups fuse: the rotation of x, then act_order's gather."""
    from conftest import random_hessian, ref64

    if x86.available() is not None:
        pytest.skip(x86.available())
    monkeypatch.setattr(x86, "_plane_codes", lambda: False)  # GPTQ is uniform: as on a CPU without AVX-512 VBMI
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 40)
    layer = BCQLinear.from_linear(lin, dict(bits=3, group_size=64, method="gptq", act_order=True, rotation="hadamard",
                                            rotation_seed=5), random_hessian(192), backend="x86")
    x = torch.randn(x86.dequant_from(3, 40, 192), 192)
    assert layer.kernel(x).backend == "x86" and layer.layout == "x86"
    want = ref64(layer, x)
    assert ((layer(x).double() - want).abs() <= 1e-5 * (1 + want.abs())).all()



@pytest.mark.parametrize("name", ["uniform 3-bit g64 imported", "free α 3-bit g32"])
def test_uniform_bit_plane_layers_keep_the_gemv_where_planes_become_codes(name):
    """Where the AVX-512 path turns a uniform layer's planes into codes (``_plane_codes``), its int8 GEMV outruns the
    float32 batched path at every batch, as uniform 4-bit's does: a float32 batch far above ``dequant_from`` stays on
    the GEMV (its error is the int8 activations', above float32 GEMM rounding); free-α layers still switch."""
    if x86.available() is not None:
        pytest.skip(x86.available())
    if not x86._plane_codes():
        pytest.skip("no AVX-512 VBMI path: uniform bit-plane layers keep DEQUANT_FROM")
    cfg, bufs, N, K = _case(name)
    uniform = bcq.is_uniform(cfg)
    M = 4 * x86.dequant_from(cfg.bits, N, K)
    assert x86.batched_from(cfg, N, K, torch.zeros(1, K)) == (math.inf if uniform else x86.dequant_from(cfg.bits, N, K))
    packed, w64 = x86.repack(bufs, cfg, N, K), _dense(cfg, bufs, N, K)
    x = torch.randn(M, K)
    y = _op(x, packed, None, N, cfg, "auto")
    assert torch.equal(y, _op(x, packed, None, N, cfg, "avx512_vnni")) == uniform
    assert ((y.double() - x.double() @ w64.T).abs() <= int8_activation_bound(w64, x)).all()

def test_op_rejects_inconsistent_buffers():
    cfg, bufs, N, K = _case("g128")
    packed = x86.repack(bufs, cfg, N, K)
    qw, qs, qz = packed["x86_qw"], packed["x86_qs"], packed["x86_qz"]
    x = torch.randn(1, K)
    op = torch.ops.qlinear.x86_gemm
    with pytest.raises(RuntimeError, match="qw must be contiguous uint8"):
        op(x, qw[:1], qs, qz, None, N, 128, 4, 0, 0)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        op(x.double(), qw, qs, qz, None, N, 128, 4, 0, 0)
    with pytest.raises(RuntimeError, match="unknown path"):
        op(x, qw, qs, qz, None, N, 128, 4, 0, 9)
    perm = torch.arange(K, dtype=torch.int32).flip(0)
    with pytest.raises(RuntimeError, match=r"perm must lie in \[0, K\)"):  # never read out of bounds
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, perm=perm + 1)
    with pytest.raises(RuntimeError, match="perm must be contiguous int32"):
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, perm=perm.long())
    with pytest.raises(RuntimeError, match="rot_signs be contiguous float32"):
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, rot_signs=torch.ones(K - 1), rot_block=K)
    with pytest.raises(RuntimeError, match="must divide K"):
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, rot_signs=torch.ones(K), rot_block=K - 1)
    with pytest.raises(RuntimeError, match="Paley factor must be"):
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, rot_signs=torch.ones(K), rot_paley=torch.ones(12, 12), rot_block=K)
    with pytest.raises(RuntimeError, match="Paley factor must be"):  # an empty factor: no division by zero
        op(x, qw, qs, qz, None, N, 128, 4, 0, 0, rot_signs=torch.ones(K), rot_paley=torch.ones(0, 0), rot_block=K)
    cfg96, bufs96, N96, K96 = _case("g32 no offset")  # K = 96 = 4·24: a block the transform's loops cannot take
    p96 = x86.repack(bufs96, cfg96, N96, K96)
    with pytest.raises(RuntimeError, match="must be a power of two"):
        op(torch.randn(1, K96), p96["x86_qw"], p96["x86_qs"], p96["x86_qz"], None, N96, 32, 4, 0, 0,
           rot_signs=torch.ones(K96), rot_paley=torch.ones(4, 4), rot_block=K96)
    with pytest.raises(RuntimeError, match="unknown format"):
        op(x, qw, qs, qz, None, N, 128, 4, 5, 0)
    with pytest.raises(RuntimeError, match="bits 5 not in 1..4"):
        op(x, qw, qs, qz, None, N, 128, 5, 1, 0)
    with pytest.raises(RuntimeError, match=r"bits 8 not in 1..4 \(4 or 8 for format 0\)"):  # no 8-bit planes
        op(x, qw, qs, qz, None, N, 128, 8, 1, 0)
    with pytest.raises(RuntimeError, match=r"qw must be contiguous uint8 \[3, 64, 64\]"):  # nibbles as bytes
        op(x, qw, qs, qz, None, N, 128, 8, 0, 0)
    c8, b8, N8, K8 = _case("uniform 8-bit g64 imported")
    p8 = x86.repack(b8, c8, N8, K8)
    with pytest.raises(RuntimeError, match=r"qz must be contiguous int16 \[3, 5, 16\]"):  # 2·z of 8-bit codes
        op(torch.randn(1, K8), p8["x86_qw"], p8["x86_qs"], p8["x86_qz"].to(torch.uint8), None, N8, 64, 8, 0, 0)
    with pytest.raises(RuntimeError, match=r"qw must be contiguous uint8 \[3, 8, 2, 64\]"):  # nibbles as 2-bit planes
        op(x, qw, qs, qz, None, N, 128, 2, 1, 0)
    with pytest.raises(RuntimeError, match="x86_dequantize: qw must be contiguous uint8"):  # the same checks
        torch.ops.qlinear.x86_dequantize(qw[:1], qs, qz, None, N, K, 128, 4, 0)
    cfg, bufs, N, K = _case("free α 2-bit g64")
    packed = x86.repack(bufs, cfg, N, K)
    with pytest.raises(RuntimeError, match=r"qs must be contiguous fp16 \[3, 5, 1, 16\]"):  # 2-bit α, one plane
        op(torch.randn(1, K), packed["x86_lp"][:, :, :1].contiguous(), packed["x86_qa"], packed["x86_qc"], None, N, 64,
           1, 2, 0)


def test_op_rejects_inconsistent_codebook_buffers():
    cfg, bufs, N, K = _case("codebook 2-bit 4 books g64")
    p = x86.repack_codebook(bufs, cfg, N, K)
    x = torch.randn(1, K)

    def call(qw=p["x86_qw"], table=p["codebooks"], qb=p["x86_qb"], bits=2, fmt=4):
        return torch.ops.qlinear.x86_gemm(x, qw, p["x86_qs"], table, None, N, 64, bits, fmt, 0, qb=qb)

    assert call().shape == (1, N)
    with pytest.raises(RuntimeError, match="qb .book words. is needed exactly when"):
        call(qb=None)
    with pytest.raises(RuntimeError, match=r"qz \(the codebooks\) must be contiguous int8 \[C, 4\]"):
        call(table=torch.zeros(5, 4, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="format 4 takes bits=2"):
        call(bits=4)
    with pytest.raises(RuntimeError, match=r"qw must be contiguous uint8 \[3, 24, 64\]"):  # 2-bit codes as 4-bit
        call(bits=4, fmt=3)


def test_registry_reasons():
    k = next(k for k in backends.kernels("bcq") if k.backend == "x86")
    cpu = torch.device("cpu")
    for bits in (1, 2, 3, 4):  # uniform and free α
        assert k.reject(bcq.Config(bits=bits, group_size=128), cpu, torch.float32, 1, (64, 256)) is None
        assert k.reject(bcq.Config(bits=bits, init="uniform", iters=0), cpu, torch.float32, 1, (64, 256)) is None
    for bits in (5, 6, 7, 8):  # uniform only, as bytes
        assert k.reject(bcq.Config(bits=bits, init="uniform", iters=0), cpu, torch.float32, 1, (64, 256)) is None
        assert "1-4 planes" in k.reject(bcq.Config(bits=bits, group_size=128), cpu, torch.float32, 1, (64, 256))
    assert "fp32 offsets" in k.reject(bcq.Config(bits=4, fp32_offset=True), cpu, torch.float32, 1, (64, 256))
    cb = next(k for k in backends.kernels("codebook") if k.backend == "x86")
    assert cb.reject(codebook.Config(bits=2, group_size=64), cpu, torch.bfloat16, 1, (64, 256)) is None
    assert "bits=1" in cb.reject(codebook.Config(bits=1), cpu, torch.float32, 1, (64, 256))
    assert "multiple of 32" in cb.reject(codebook.Config(bits=2, group_size=48), cpu, torch.float32, 1, (64, 192))


@pytest.mark.parametrize("name", ["g128", "uniform 3-bit g64 imported", "uniform 2-bit g128 ragged last group",
                                  "uniform 8-bit g64 imported",
                                  "free α g64 ragged N tail", "free α 2-bit g64", "codebook 4-bit g32",
                                  "codebook 2-bit 1 book", "codebook 2-bit 2 books ragged N tail",
                                  "codebook 2-bit 4 books g64"])
def test_default_registry_selects_x86_for_every_format(name):
    """With no backend named, the registry picks x86 for a CPU layer of each format (above the reference and, off
    aarch64, the Arm kernels' SIMDe build) at decode and prefill batches, and the layer then holds x86's layout and
    computes what the x86 op computes (the mixed format: test_mixed_registry)."""
    cfg, bufs, N, K = _case(name)
    cls = CodebookLinear if cfg.format == "codebook" else BCQLinear
    mod = cls.from_packed(bufs, K, N, cfg, None)
    for batch in (1, 8, 512):
        assert mod.kernel(torch.randn(batch, K)).backend == "x86", (name, batch)
    assert mod.layout.startswith("x86")
    x = torch.randn(3, K)
    op = x86.linear(x, dict(zip(mod._packed_names, mod.packed())), None, cfg, N, K, path="scalar")
    assert torch.equal(mod(x), op)


@pytest.mark.parametrize("cls,opts", [(BCQLinear, dict(bits=4, group_size=64, init="uniform", iters=0)),
                                      (BCQLinear, dict(bits=3, group_size=32)),
                                      (BCQLinear, dict(bits=3, group_size=64, method="gptq", act_order=True)),
                                      (CodebookLinear, dict(bits=2))],
                         ids=["uniform 4-bit", "free α 3-bit", "GPTQ 3-bit act_order", "codebook 2-bit"])
# Paley I (12·16) and II (36·16) blocks and a power of two on rotation.h's vector path; 12·4 and 36·2 on its scalar one
@pytest.mark.parametrize("K,block", [(192, 0), (256, 0), (576, 0), (192, 48), (576, 72)],
                         ids=["192", "256", "576", "192 block 48", "576 block 72"])
def test_rotated_layers_transform_x_inside_the_op(cls, opts, K, block):
    from conftest import assert_fused_rotation

    assert_fused_rotation("x86", cls, opts, lambda x, m: x86.spec(
        x, dict(zip(m._packed_names, m.packed())), m.bias, m._call(x.device, x.dtype, 37).cfg, m.out_features, K,
        rotation=m._call(x.device, x.dtype, 37).rotation), K=K, block=block)


# --- the mixed 2/4/16 format (mixed.cpp): int8 activations per 16 inputs, layout x86_mixed ----------------------------
MIXED = {"default": mixed.Config(), "g32 sb8 sg7": mixed.Config(group_size=32, scale_bits=8, scale_group_size=7),
         "g48 sb2": mixed.Config(group_size=48, scale_bits=2, outlier_ratio=0.0),
         "no 4-bit": mixed.Config(ratio_4bit=0.0, outlier_ratio=0.005),
         "all 4-bit": mixed.Config(ratio_4bit=1.0, outlier_ratio=0.0)}
MIXED_PATHS = ("scalar", "avx2", "avx2_vnni", "avx512_vnni", "simde-avx2", "simde-avx2_vnni", "simde-avx512_vnni")


def _mixed(name, N=100, K=480):
    from qlinear.backends import async_dequant

    cfg = MIXED[name]
    return cfg, async_dequant.random_buffers(N, K, cfg, seed=N + K)


def _mixed_bound(canon, cfg, N, K, x):
    """Bound on the GEMV's distance to the float64 ``x·Ŵᵀ``: the activations' rounding per 16 inputs plus fp32."""
    return int8_activation_bound(dense64("mixed", canon, cfg, N, K), x, block=16)


def _mixed_spec_bound(canon, cfg, N, K, x):
    """Bound on the GEMV's distance to its own arithmetic in float64 (:func:`x86.spec_mixed`): per output at most
    K/16 + G + nnz + 1 fp32 roundings, each within 2⁻²⁴ of a partial sum bounded by ``Σ_k |ŵ_k|·amax_h(k) +
    Σ |o·x|``, well inside ``1e-5·Σ_k |w_k|·(|x_k| + amax_h(k)/127) + 1e-6``."""
    M = x.shape[0]
    amax = x.abs().view(M, K // 16, 16).amax(-1).repeat_interleave(16, 1)
    return 1e-5 * ((x.abs() + amax / 127).double() @ dense64("mixed", canon, cfg, N, K).abs().T) + 1e-6


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_layout_round_trip_is_exact(name):
    cfg, canon = _mixed(name)
    back = x86.unrepack_mixed(x86.repack_mixed(canon, cfg, 100, 480), cfg, 100, 480)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype
                                           for k in canon)


def test_mixed_layout_round_trip_of_a_fresh_module():
    """A freshly constructed layer's zero buffers (``idx4`` all zeros: not a set of groups) survive the layout too."""
    mod = MixedPrecisionLinear(320, 64, True, mixed.Config(), backend="reference")
    canon = mod.canonical()
    back = x86.unrepack_mixed(x86.repack_mixed(canon, mod.config, 64, 320), mod.config, 64, 320)
    assert all(torch.equal(back[k], canon[k]) for k in canon)


@pytest.mark.parametrize("name", list(MIXED))
def test_mixed_dequantize_from_the_layout_is_the_formats_bit_for_bit(name):
    """Ŵ from layout ``x86_mixed`` (batches above the GEMV's, the backward pass) equals the format's float32 Ŵ,
    outliers included, on the scalar, AVX2 and AVX-512 paths; in bfloat16, those values rounded once by torch."""
    cfg, canon = _mixed(name)
    held = x86.repack_mixed(canon, cfg, 100, 480)
    want = mixed.dequantize(canon, cfg, 100, 480)
    for path in ("scalar", "avx2", "avx512_vnni", "auto"):
        try:
            assert torch.equal(x86.dequantize_mixed(held, cfg, 100, 480, path), want), path
            got = x86.dequantize_mixed(held, cfg, 100, 480, path, torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), path
        except RuntimeError as e:  # a CPU without AVX2 or AVX-512 VBMI
            assert path in ("avx2", "avx512_vnni") and "cannot run path" in str(e), e


@pytest.mark.parametrize("name", ["g32 sb8 sg7", "g48 sb2", "default"])
def test_mixed_layout_puts_each_field_where_qgemm_h_says(name):
    """Bit positions read one field at a time from the held words, as ``qgemm.h`` describes them (the layout's Python
    inverse is not used): code ``[n, c]`` of the 2-bit groups' columns in word ``[n/16, c/16, n%16]``, byte ``c%4``,
    bits ``2·(c%16/4)``; 4-bit column ``c`` in word ``[n/16, c/8, n%16]``, byte ``c%4``, high nibble when ``c%8 ≥ 4``;
    the scale code of row n, layout group i at bit ``sb·(16i + n%16)`` of block ``n/16``; zero points of 2-bit group i
    at bit ``32i + 2·(n%16)``, of 4-bit group i at ``32·G2 + 64i + 4·(n%16)``; ``x86m_kinds`` bit i for the groups
    ``idx4`` lists."""
    N, K = 100, 480
    cfg, canon = _mixed(name, N, K)
    held = x86.repack_mixed(canon, cfg, N, K)
    G, g, sb = K // cfg.group_size, cfg.group_size, cfg.scale_bits
    is4 = torch.zeros(G, dtype=torch.bool)
    is4[canon["idx4"].long()] = True
    idx2, idx4 = torch.nonzero(~is4).flatten().tolist(), torch.nonzero(is4).flatten().tolist()
    assert torch.equal(unpack(held["x86m_kinds"], 1, G).bool(), is4)
    codes2 = unpack(canon["qweight2"], 2, len(idx2) * g)
    codes4 = unpack(canon["qweight4"], 4, len(idx4) * g)
    sc = unpack(canon["scale_codes"], sb, N)  # [G, N]
    z2, z4 = unpack(canon["zeros2"], 2, len(idx2)), unpack(canon["zeros4"], 4, len(idx4))

    def field(words, bit, bits):
        return (int(words[bit // 32]) & 0xFFFFFFFF) >> (bit % 32) & ((1 << bits) - 1)

    gen = torch.Generator().manual_seed(1)
    for n in torch.randint(0, N, (12,), generator=gen).tolist() + [N - 1]:
        b, r = divmod(n, 16)
        for c in range(0, codes2.shape[1], 7):
            word = held["x86m_q2"][b, c // 16, r : r + 1]
            assert field(word, 8 * (c % 4) + 2 * (c % 16 // 4), 2) == codes2[n, c]
        for c in range(0, codes4.shape[1], 5):
            word = held["x86m_q4"][b, c // 8, r : r + 1]
            assert field(word, 8 * (c % 4) + 4 * (c % 8 // 4), 4) == codes4[n, c]
        for i, grp in enumerate(idx2 + idx4):
            assert field(held["x86m_sc"][b], sb * (16 * i + r), sb) == sc[grp, n]
        for i in range(len(idx2)):
            assert field(held["x86m_z"][b], 32 * i + 2 * r, 2) == z2[n, i]
        for i in range(len(idx4)):
            assert field(held["x86m_z"][b], 32 * len(idx2) + 64 * i + 4 * r, 4) == z4[n, i]


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("bias", [True, False])
def test_mixed_kernel_paths_agree_bitwise_within_the_bound(name, bias):
    """Every path (scalar, AVX2, AVX2 + AVX-VNNI, AVX-512 VNNI; their SIMDe builds) gives the same bits at every M (the
    kernel takes 4 activation rows per pass), within fp32 rounding of the kernel's arithmetic in float64
    (its spec) and within the int8-activation bound of the float64 reference, with and without outliers and bias."""
    N, K = 100, 480
    cfg, canon = _mixed(name, N, K)
    held = x86.repack_mixed(canon, cfg, N, K)
    b = torch.randn(N) if bias else None
    w64 = dense64("mixed", canon, cfg, N, K)
    for M in (1, 3, 4, 5, 9):
        x = torch.randn(M, K)
        x[0, :16] *= 30  # one large block: its products dominate their lanes
        ys = {p: y for p in MIXED_PATHS if (y := _op(x, held, b, N, cfg, p)) is not None}
        y = ys["scalar"]
        ran = {p.removeprefix("simde-") for p in ys}
        assert ran == set(MIXED_PATHS[:4]) or not _simde_expected(), (M, list(ys))  # every path ran
        assert all(torch.equal(v, y) for v in ys.values()), (M, list(ys))
        y64 = x.double() @ w64.T + (0 if b is None else b.double())
        assert ((y.double() - y64).abs() <= _mixed_bound(canon, cfg, N, K, x)).all(), M
        spec = x86.spec_mixed(x, held, b, cfg, N, K)
        assert ((y.double() - spec).abs() <= _mixed_spec_bound(canon, cfg, N, K, x)).all(), M


def _nan_and_tiny_inputs(M, K):
    """``(x, nan_rows, x_flushed)``: a NaN at the start, middle or end of a block in some rows, and in row 0 a block
    whose largest |x| (1e-37) is below 127/FLT_MAX, which ``x_flushed`` holds as zeros."""
    x = torch.randn(M, K)
    spots = [(1 % M, 0), (2 % M, 47), (3 % M, K - 1)] if M > 1 else [(0, 47)]
    x[0, 64:96] = 1e-37 * torch.sign(torch.randn(32))
    flushed = x.clone()
    flushed[0, 64:96] = 0
    for r, k in spots:
        x[r, k] = flushed[r, k] = float("nan")
    return x, sorted({r for r, _ in spots}), flushed


@pytest.mark.parametrize("name", [*ALL, *(f"mixed {n}" for n in MIXED)])
def test_a_nan_input_gives_nan_outputs_and_tiny_blocks_count_as_zero_on_every_path(name):
    """A NaN anywhere in a row's 32 (mixed: 16) activations makes every output of that row NaN, as in float arithmetic
    and the reference, instead of finite values from saturated int8 codes; the other rows are untouched.  A block too
    small for 127/amax to be finite counts as zeros (backends/_shared/act_quant.h), in the spec too."""
    if name.startswith("mixed "):
        N, K = 100, 480
        cfg, canon = _mixed(name[6:], N, K)
        packed, paths, spec = x86.repack_mixed(canon, cfg, N, K), MIXED_PATHS, x86.spec_mixed
    else:
        cfg, bufs, N, K = _case(name)
        packed, paths, spec = _repack(cfg, bufs, N, K), PATHS, x86.spec
    for M in (1, 5):
        x, nan_rows, flushed = _nan_and_tiny_inputs(M, K)
        want = _op(flushed, packed, None, N, cfg, "scalar")
        for path in paths:
            y = _op(x, packed, None, N, cfg, path)
            if y is None:
                continue
            assert y[nan_rows].isnan().all(), (path, M)
            rest = [r for r in range(M) if r not in nan_rows]
            assert torch.equal(y[rest], want[rest]) and y[rest].isfinite().all(), (path, M)
        s = spec(x, packed, None, cfg, N, K)
        assert s[nan_rows].isnan().all() and s[rest].isfinite().all()


def test_layers_holding_a_cpu_kernel_layout_pickle(tmp_path):
    """torch.save(model) of layers repacked for the x86 or Arm kernels: a layout's functions (lambdas among them) are
    not pickled, the layout is found again by its name."""
    from qlinear.backends import arm_neon
    from qlinear.modules import module_class

    configs = [QLinearConfig("bcq", group_size=32, init="uniform", iters=0), QLinearConfig("bcq", bits=3),
               QLinearConfig("codebook", bits=2), QLinearConfig("mixed")]
    if arm_neon.available() is None:
        configs += [QLinearConfig("bcq", group_size=32, init="uniform", iters=0, backend="arm_neon"),
                    QLinearConfig("codebook", bits=4, backend="arm_neon")]
    lin, x = torch.nn.Linear(128, 48), torch.randn(3, 128)
    for cfg in configs:
        m = module_class(cfg.format).from_linear(lin, cfg)
        with torch.no_grad():
            y = m(x)
            assert m.layout is not None, cfg
            torch.save(torch.nn.Sequential(m), tmp_path / "m.pt")
            again = torch.load(tmp_path / "m.pt", weights_only=False)[0]
            assert again.layout == m.layout and torch.equal(again(x), y), cfg


def test_mixed_large_batches_take_the_float_gemm(monkeypatch):
    """Above MIXED_GEMV_ROWS rows (path "auto") the op multiplies by the format's Ŵ a tile of rows at a time, within
    the same bound; at or below it, and with a forced path, it runs the GEMV."""
    N, K = 100, 480
    cfg, canon = _mixed("default", N, K)
    held = x86.repack_mixed(canon, cfg, N, K)
    monkeypatch.setattr(x86, "MIXED_GEMV_ROWS", 4)
    monkeypatch.setattr(x86, "_TILE_BYTES", 4 * K * 16 * 3)  # tiles of 3 blocks: 48 + 48 + 4 rows
    calls = []
    batched = x86._batched
    monkeypatch.setattr(x86, "_batched", lambda *a, **k: calls.append(1) or batched(*a, **k))
    x, b = torch.randn(9, K), torch.randn(N)
    y = x86.linear_mixed(x, held, b, cfg, N, K)
    assert calls == [1]
    w64 = mixed.dequantize(canon, cfg, N, K).double()
    y64 = x.double() @ w64.T + b.double()
    assert ((y.double() - y64).abs() <= 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-6).all()  # float x: fp32 only
    x86.linear_mixed(x[:4], held, b, cfg, N, K)
    x86.linear_mixed(x, held, b, cfg, N, K, path="avx2")
    assert calls == [1]


@pytest.mark.parametrize("gemm", ["amx", "torch"])
def test_mixed_bfloat16_activations_take_a_bfloat16_gemm(gemm, monkeypatch):
    """Bfloat16 activations from ``batched_from`` rows: Ŵ (outliers included) rounded to bfloat16 times x, within the
    roundings of Ŵ and y to bfloat16 of the float64 reference, on AMX tiles or torch's GEMM."""
    N, K = 100, 480
    cfg, canon = _mixed("default", N, K)
    x = torch.randn(40, K).bfloat16()
    if x86.batched_dtype(x) != torch.bfloat16 or (gemm == "amx" and not x86.amx_available()):
        pytest.skip("no AVX512-BF16 or no AMX")
    if gemm == "torch":
        monkeypatch.setattr(x86, "amx_available", lambda: False)
    for table in ("BF16_BATCHED_FROM", "AMX_BATCHED_FROM"):
        monkeypatch.setattr(x86, table, {"planes": 3, "other": 4, "mixed": 4})
    held, b = x86.repack_mixed(canon, cfg, N, K), torch.randn(N).bfloat16()
    y = x86.linear_mixed(x, held, b, cfg, N, K)
    w64 = mixed.dequantize(canon, cfg, N, K).double()
    y64 = x.double() @ w64.T + b.double()
    bound = 2.0 ** -8 * (x.double().abs() @ w64.abs().T) + 2.0 ** -7 * (y64.abs() + b.double().abs()) + 1e-6
    assert y.dtype == torch.bfloat16 and ((y.double() - y64).abs() <= bound).all()


def test_mixed_kernel_catches_a_wrong_layout():
    """Each block given its neighbour's scale codes moves the output outside the spec's bound (the test can fail)."""
    N, K = 100, 480
    cfg, canon = _mixed("default", N, K)
    held = x86.repack_mixed(canon, cfg, N, K)
    bad = dict(held, x86m_sc=held["x86m_sc"].roll(1, 0))
    x = torch.randn(2, K)
    y = x86.linear_mixed(x, bad, None, cfg, N, K)
    spec = x86.spec_mixed(x, held, None, cfg, N, K)
    assert not ((y.double() - spec).abs() <= _mixed_spec_bound(canon, cfg, N, K, x)).all()


def test_mixed_op_rejects_inconsistent_buffers():
    N, K = 100, 480
    cfg, canon = _mixed("default", N, K)
    held = x86.repack_mixed(canon, cfg, N, K)
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match="kinds marks"):
        x86.linear_mixed(x, dict(held, x86m_kinds=torch.zeros_like(held["x86m_kinds"])), None, cfg, N, K)
    with pytest.raises(RuntimeError, match="ss and sz must be"):
        x86.linear_mixed(x, dict(held, x86m_ss=held["x86m_ss"][:-1]), None, cfg, N, K)
    with pytest.raises(RuntimeError, match="sc must be"):
        x86.linear_mixed(x, dict(held, x86m_sc=held["x86m_sc"][:-1]), None, cfg, N, K)
    with pytest.raises(RuntimeError, match="z must be"):
        x86.linear_mixed(x, dict(held, x86m_z=held["x86m_z"][:, :-1].contiguous()), None, cfg, N, K)
    with pytest.raises(RuntimeError, match="cannot run path"):
        torch.ops.qlinear.x86_mixed_gemm(x, *(held[k] for k in x86.MIXED_NAMES[:7]), None, None, None, None, N,
                                         cfg.group_size, cfg.scale_bits, cfg.scale_group_size, 7)
    # damaged outliers: never read or written out of bounds
    nnz = held["x86m_ov"].numel()
    assert nnz > 0
    for bad, why in ((dict(held, x86m_oc=torch.full_like(held["x86m_oc"], K)), "columns must lie"),
                     (dict(held, x86m_orp=held["x86m_orp"] * 1000), "row pointers must rise"),
                     (dict(held, x86m_orp=held["x86m_orp"].flip(0).contiguous()), "row pointers must rise")):
        for run in (lambda: x86.linear_mixed(x, bad, None, cfg, N, K), lambda: x86.dequantize_mixed(bad, cfg, N, K)):
            with pytest.raises(RuntimeError, match=why):
                run()


def test_mixed_scale_group_size_beyond_int32():
    """A second-order chunk larger than the layer (here 2^32 rows: one chunk) runs as one chunk of N rows."""
    N, K = 40, 160
    cfg = mixed.Config(scale_group_size=2 ** 32)
    canon = mixed.quantize(torch.randn(N, K), cfg)
    held = x86.repack_mixed(canon, cfg, N, K)
    x = torch.randn(3, K)
    y = x86.linear_mixed(x, held, None, cfg, N, K)
    assert ((y.double() - x86.spec_mixed(x, held, None, cfg, N, K)).abs() <= _mixed_spec_bound(canon, cfg, N, K, x)).all()
    assert torch.equal(x86.dequantize_mixed(held, cfg, N, K), mixed.dequantize(canon, cfg, N, K))


def test_mixed_registry():
    """On a CPU the mixed format runs on x86 at every batch and float dtype, with a reason for group sizes that are not
    multiples of 16."""
    k = next(k for k in backends.kernels("mixed") if k.backend == "x86")
    cpu = torch.device("cpu")
    for dtype, batch in itertools.product((torch.float32, torch.float16, torch.bfloat16), (1, 4096)):
        assert k.reject(mixed.Config(), cpu, dtype, batch, (64, 320)) is None
    assert "multiple of 16" in k.reject(mixed.Config(group_size=24), cpu, torch.float32, 1, (64, 336))
    mod = MixedPrecisionLinear.from_packed(_mixed("default", 64, 320)[1], 320, 64, mixed.Config(), None)
    assert mod.kernel(torch.randn(3, 320)).backend == "x86" and mod.layout == "x86_mixed"


@pytest.mark.parametrize("K,block", [(192, 0), (576, 0), (576, 72)], ids=["192", "576", "576 block 72"])
def test_rotated_mixed_layer_transforms_x_inside_the_op(monkeypatch, K, block):
    from conftest import assert_fused_rotation

    monkeypatch.setattr(x86, "MIXED_GEMV_ROWS", 64)  # its 37 rows through the GEMV, whose arithmetic spec_mixed is
    assert_fused_rotation("x86", MixedPrecisionLinear, {}, lambda x, m: x86.spec_mixed(
        x, dict(zip(m._packed_names, m.packed())), m.bias, m._call(x.device, x.dtype, 37).cfg, m.out_features, K,
        rotation=m._call(x.device, x.dtype, 37).rotation), K=K, block=block)


@pytest.mark.parametrize("fmt, opts", [("bcq", dict(bits=4, group_size=32, method="gptq", act_order=True)),
                                       ("codebook", dict(bits=2)), ("mixed", dict(outlier_ratio=0.005))])
def test_packed_buffers_given_as_strided_views_run_as_dense_ones(fmt, opts):
    """from_packed and load_state_dict(assign=True) with every packed tensor a strided view (the act_order perm, the
    codebooks and outlier columns reach the x86 kernels as they are): the same outputs as dense buffers."""
    from torch import nn

    from qlinear.modules import module_class

    torch.manual_seed(0)
    X = torch.randn(256, 128)
    mod = module_class(fmt).from_linear(nn.Linear(128, 40), QLinearConfig(fmt, **opts), X.T @ X)
    bufs = mod.canonical()

    def strided(t):
        if not t.dim():
            return t
        wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
        wide[..., ::2] = t
        return wide[..., ::2]

    views = {k: strided(v) for k, v in bufs.items()}
    assert any(not v.is_contiguous() for v in views.values())
    x = torch.randn(5, 128)
    want = mod(x)
    again = module_class(fmt).from_packed(views, 128, 40, mod.config, bias=mod.bias)
    assert torch.equal(again(x), want)
    loaded = module_class(fmt)(128, 40, True, mod.config)
    loaded.load_state_dict({**views, "bias": mod.bias.detach()}, assign=True)
    assert torch.equal(loaded(x), want)


def test_setting_the_backend_repacks_the_layer():
    """A layer held canonical for backend "reference" takes the x86 layout when its backend is set to automatic (as a
    move does), rather than converting its buffers on every call, and gives it back when set to "reference" again."""
    import warnings

    torch.manual_seed(0)
    cfg = QLinearConfig("bcq", bits=4, group_size=64, init="uniform", iters=0, backend="reference")
    m = BCQLinear.from_linear(torch.nn.Linear(256, 64), cfg)
    x = torch.randn(2, 256)
    want = m(x)
    assert m.layout == ""  # canonical
    m.backend = None
    assert m.layout == "x86"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "converted on every such call" warning
        assert m.kernel(x).backend == "x86"
        assert ((m(x).double() - x.double() @ m.dequantize().double().T - m.bias.double()).abs()
                <= int8_activation_bound(m.dequantize(), x)).all()
    m.backend = "reference"
    assert m.layout == "" and torch.equal(m(x), want)


@pytest.mark.parametrize("fmt, opts", [("bcq", dict(bits=4, group_size=64, init="uniform", iters=0)),
                                       ("codebook", dict(bits=2)), ("mixed", {})])
def test_state_dict_of_a_layer_moved_to_meta_has_the_canonical_specs(fmt, opts):
    """A layer held in the x86 layout, moved to meta: its state dict is empty meta tensors of the checkpoint's names,
    shapes and dtypes (the layout's conversion back reads values, which meta tensors do not have)."""
    from qlinear.modules import module_class

    m = module_class(fmt).from_linear(torch.nn.Linear(256, 64), QLinearConfig(fmt, **opts))
    assert m.layout.startswith("x86")
    sd = m.to("meta").state_dict()
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in sd.items() if k != "bias"} == \
        {k: (tuple(shape), dt, "meta") for k, (shape, dt) in m._specs.items()}
