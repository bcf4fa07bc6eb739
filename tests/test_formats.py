"""Format-level properties: quantizer quality bounds, exactness of imports, exact bit counts."""

import dataclasses
import math

import pytest
import torch

from conftest import dense64, random_hessian
from qlinear.formats import bcq, bits_per_weight, codebook, config_from_dict, get_format, mixed, uniform
from qlinear.formats.packing import pack, pack_planes, unpack, unpack_planes

N, K = 96, 256


def weight(n=N, k=K):
    return torch.randn(n, k) * 0.02


def rel_err(w, w_hat):
    return float((w - w_hat).norm() / w.norm())


def out_err(w, w_hat, H):
    e = (w - w_hat).double()
    return float(torch.trace(e @ H.double() @ e.T))


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("cfg", [bcq.Config(bits=3, group_size=128, iters=2), mixed.Config(ratio_4bit=0.5),
                                 codebook.Config(bits=4)])
def test_config_json_roundtrip(cfg):
    import json
    assert config_from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("make", [
    lambda: bcq.Config(bits=9), lambda: bcq.Config(bits=0), lambda: bcq.Config(group_size=48),
    lambda: bcq.Config(init="zeros"), lambda: mixed.Config(bits=3), lambda: mixed.Config(outlier_ratio=0.01),
    lambda: mixed.Config(ratio_4bit=1.5), lambda: codebook.Config(bits=3),
    lambda: codebook.Config(bits=2, num_codebooks=8), lambda: codebook.Config(num_codebooks=3),
    lambda: codebook.Config(codebook_scope="global")])
def test_config_rejects_bad_values(make):
    with pytest.raises(ValueError):
        make()


def test_config_rejects_bad_types():
    with pytest.raises(TypeError):
        bcq.Config(bits=4.0)
    with pytest.raises(TypeError):
        bcq.Config(offset="yes")
    with pytest.raises(ValueError, match="unknown options"):
        bcq.Config.from_dict({"format": "bcq", "bitz": 4})


# ---------------------------------------------------------------- BCQ
@pytest.mark.parametrize("bits,bound", [(2, 0.45), (3, 0.22), (4, 0.11)])
def test_bcq_error_bound(bits, bound):
    w = weight()
    cfg = bcq.Config(bits=bits, group_size=64)
    w_hat = bcq.dequantize(bcq.quantize(w, cfg), cfg, N, K)
    assert rel_err(w, w_hat) < bound


def test_bcq_dequant_matches_float64_formula():
    w = weight()
    cfg = bcq.Config(bits=3, group_size=64)
    b = bcq.quantize(w, cfg)
    codes = unpack_planes(b["planes"], K)
    signs = torch.stack([((codes >> i) & 1).double() * 2 - 1 for i in range(3)])  # [q, N, K]
    alpha = b["alpha"].double().repeat_interleave(64, 2)
    ref = (alpha * signs).sum(0) + b["offset"].double().repeat_interleave(64, 1)
    assert torch.allclose(bcq.dequantize(b, cfg, N, K).double(), ref, atol=1e-7, rtol=0)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("group_size,K", [(32, 96), (64, 160), (128, 256), (-1, 128)])
@pytest.mark.parametrize("offset", [False, True])
def test_bcq_dequant_is_the_float32_plane_sum_bit_for_bit(bits, group_size, K, offset):
    """Both dequantization paths (levels looked up when 2^q <= group_size, planes added per weight otherwise) give
    the bits of the plain float32 formula ``Σ_i α_i·(±1)`` (a sum from +0 over planes) ``+ c``, signed zeros of
    all-zero α groups, ragged last groups and non-contiguous α included."""
    N, cfg = 24, bcq.Config(bits=bits, group_size=group_size, offset=offset)
    g = cfg.group(K)
    G = -(-K // g)
    codes = torch.randint(0, 1 << bits, (N, K))
    alpha = (torch.randn(bits, G, N) * 0.1).half().transpose(1, 2)
    alpha[:, 0, 0], alpha[:, 1, 0] = 0.0, -0.0
    b = {"planes": pack_planes(codes, bits), "alpha": alpha}
    if offset:
        b["offset"] = (torch.randn(N, G) * 0.1).half()
    signs = torch.stack([((codes >> i) & 1) * 2.0 - 1 for i in range(bits)])  # [q, N, K]
    ref = (alpha.float().repeat_interleave(g, 2)[:, :, :K] * signs).sum(0)
    if offset:
        ref = ref + b["offset"].float().repeat_interleave(g, 1)[:, :K]
    out = bcq.dequantize(b, cfg, N, K)
    assert out.dtype == torch.float32 and out.shape == (N, K)
    assert torch.equal(out.contiguous().view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_bcq_refinement_never_worse_than_either_init(bits, weighted):
    w = weight(64, 128).reshape(-1, 64)
    d = torch.rand(64) + 0.1 if weighted else torch.ones(64)

    def err(init, iters):
        cfg = bcq.Config(bits=bits, init=init, iters=iters)
        alpha, c, _ = bcq.fit(w, d, cfg)
        lv = bcq.levels(alpha, c)
        return (d * (w - lv.gather(1, bcq.nearest(lv, w))) ** 2).sum(1)

    refined = err("best", 6)
    assert (refined <= err("greedy", 0) + 1e-12).all()
    assert (refined <= err("uniform", 0) + 1e-12).all()
    assert refined.sum() < err("uniform", 0).sum()  # and it does improve on the whole


def test_bcq_uniform_init_zero_iters_equals_round_to_nearest():
    """Round-to-nearest BCQ is stored as GPTQ stores it (codes, fp16 scale, packed zero point) and dequantizes to
    s·(q − z) exactly (float64 reference: the product of an fp16 scale and a 5-bit integer is exact in float32)."""
    w = weight()
    cfg = bcq.Config(bits=4, group_size=64, init="uniform", iters=0)
    b = bcq.quantize(w, cfg)
    assert set(b) == {"qweight", "scales", "qzeros"}
    codes, scales, zeros = uniform.rtn(w, 4, 64)
    assert torch.equal(unpack(b["qweight"], 4, K), codes) and torch.equal(unpack(b["qzeros"], 4, N).T, zeros)
    assert b["scales"].dtype == torch.float16 and torch.equal(b["scales"].float(), scales)
    rtn = scales.double().repeat_interleave(64, 1) * (codes - zeros.repeat_interleave(64, 1)).double()
    assert torch.equal(bcq.dequantize(b, cfg, N, K).double(), rtn)
    assert bits_per_weight(cfg, N, K) == 4 + (16 + 4) / 64


@pytest.mark.parametrize("bits", [3, 6, 8])
def test_round_to_nearest_with_fp32_offsets_stores_the_same_layer(bits):
    """fp32_offset=True only changes where BCQ keeps its offset: a round-to-nearest layer stores the same codes, scales
    and zero points (its fitted offsets are fp16 values, matched as such, not refused as non-uniform)."""
    w = torch.randn(N, K)
    cfg = bcq.Config(bits=bits, group_size=64, init="uniform", iters=0)
    want = bcq.quantize(w, cfg)
    got = bcq.quantize(w, dataclasses.replace(cfg, fp32_offset=True))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bcq_from_uniform_is_exact(bits):
    G = K // 64
    codes = torch.randint(0, 1 << bits, (N, K))
    zeros = torch.randint(0, 1 << bits, (N, G))
    scales = (torch.rand(N, G) * 0.01 + 1e-3).half().float()
    cfg, b = bcq.from_uniform(codes, scales, zeros, bits, 64)
    ref = (scales.double().repeat_interleave(64, 1) * (codes - zeros.repeat_interleave(64, 1)).double())
    assert torch.equal(bcq.dequantize(b, cfg, N, K).double(), ref)  # bit-exact, even against float64
    assert torch.equal(unpack(b["qweight"], bits, K), codes) and torch.equal(unpack(b["qzeros"], bits, N).T, zeros)
    view = bcq.as_bcq(b, cfg, N, K)  # BCQ's α and offset, derived exactly: the same weights
    assert torch.equal(bcq.dequantize(view, dataclasses.replace(cfg, init="best", iters=1, fp32_offset=True), N, K)
                       .double(), ref)
    back = bcq.as_uniform(view, cfg, N, K)
    assert all(torch.equal(back[k], b[k]) for k in b)


def test_bcq_from_uniform_with_g_idx():
    G = K // 64
    codes = torch.randint(0, 16, (N, K))
    zeros = torch.randint(0, 16, (N, G))
    scales = torch.rand(N, G).half().float()
    g_idx = torch.randperm(K) % G
    cfg, b = bcq.from_uniform(codes, scales, zeros, 4, 64, g_idx)
    ref = scales[:, g_idx] * (codes - zeros[:, g_idx])
    assert torch.equal(bcq.dequantize(b, cfg, N, K), ref)
    with pytest.raises(ValueError):
        bcq.from_uniform(codes, scales[:, :2], zeros, 4, 64)


def test_bcq_ragged_last_group():
    w = weight(32, 96)
    cfg = bcq.Config(bits=4, group_size=64)
    b = bcq.quantize(w, cfg)
    assert b["alpha"].shape == (4, 32, 2)
    assert rel_err(w, bcq.dequantize(b, cfg, 32, 96)) < 0.11


# ---------------------------------------------------------------- mixed
def test_mixed_structure_and_dequant():
    w = weight()
    w[:, 16:32] *= 8  # one obviously sensitive group
    cfg = mixed.Config()
    b = mixed.quantize(w, cfg)
    G, G4, nnz = cfg.counts(N, K)
    assert b["idx4"].numel() == G4 and 1 in b["idx4"].tolist()
    assert b["outlier_values"].numel() == nnz == round(0.002 * N * K)
    # outliers only in 2-bit groups, CSR well formed
    cols = b["outlier_cols"].long()
    assert not torch.isin(cols // 16, b["idx4"].long()).any()
    rp = b["outlier_row_ptr"].long()
    assert rp[0] == 0 and rp[-1] == nnz and (rp.diff() >= 0).all()
    w_hat = mixed.dequantize(b, cfg, N, K)
    assert rel_err(w, w_hat) < 0.45
    # 4-bit groups are much more accurate than 2-bit groups
    g4 = b["idx4"].long()
    e = ((w - w_hat) ** 2).reshape(N, -1, 16).sum((0, 2)) / (w ** 2).reshape(N, -1, 16).sum((0, 2))
    mask = torch.zeros(G, dtype=torch.bool)
    mask[g4] = True
    assert e[mask].mean() < e[~mask].mean() / 4


def test_mixed_dequant_matches_float64_formula():
    w = weight()
    cfg = mixed.Config(outlier_ratio=0.0, ratio_4bit=0.0)
    b = mixed.quantize(w, cfg)
    sc = unpack(b["scale_codes"], 4, N).double()  # [G, N]
    ss = b["scale_scale"].double().repeat_interleave(16, 1)[:, :N]
    zz = b["scale_zero"].double().repeat_interleave(16, 1)[:, :N]
    s = (zz + ss * sc).T.repeat_interleave(16, 1)
    z = unpack(b["zeros2"], 2, K // 16).double().repeat_interleave(16, 1)
    q = unpack(b["qweight2"], 2, K).double()
    assert torch.allclose(mixed.dequantize(b, cfg, N, K).double(), s * (q - z), atol=1e-7, rtol=1e-6)


def test_mixed_bits_per_weight_exact_and_paper_formula():
    cfg = mixed.Config()
    Nb, Kb = 4096, 4096
    G, G4, nnz = cfg.counts(Nb, Kb)
    G2 = G - G4
    expect = (Nb * G2 * 16 * 2 + Nb * G4 * 16 * 4 + Nb * G2 * 2 + Nb * G4 * 4 + G * Nb * 4  # codes, zeros, scale codes
              + G * (Nb // 16) * 32 + nnz * 32 + (Nb + 1) * 32 + G4 * 32)  # 2nd order, outliers, row_ptr, idx4
    assert bits_per_weight(cfg, Nb, Kb) == expect / (Nb * Kb)
    assert 2.9 < mixed.paper_bits_per_weight(cfg) < 2.92  # the paper's 2.91 at its defaults
    assert 3.0 < bits_per_weight(cfg, Nb, Kb) < 3.15


# ---------------------------------------------------------------- codebook
def test_codebook_structure_and_error():
    w = weight()
    cfg = codebook.Config(bits=2)
    b = codebook.quantize(w, cfg)
    assert b["codebooks"].shape == (4, 4) and b["codebooks"].dtype == torch.int8
    assert b["codebooks"].numel() <= 16  # one 128-bit register
    w_hat = codebook.dequantize(b, cfg, N, K)
    assert rel_err(w, w_hat) < 0.40
    cfg4 = codebook.Config(bits=4)
    assert rel_err(w, codebook.dequantize(codebook.quantize(w, cfg4), cfg4, N, K)) < 0.11


def test_codebook_dequant_matches_float64_formula():
    w = weight()
    cfg = codebook.Config(bits=2)
    b = codebook.quantize(w, cfg)
    idx = unpack(b["codes"], 2, K)
    book = unpack(b["book_idx"], 2, K // 32).repeat_interleave(32, 1)
    ref = b["scales"].double().repeat_interleave(32, 1) * b["codebooks"].double()[book, idx]
    assert torch.allclose(codebook.dequantize(b, cfg, N, K).double(), ref, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("bits,books", [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("group_size", [32, 64])
def test_codebook_dequant_is_the_float32_formula_bit_for_bit(bits, books, group_size):
    """The per-(row, group) level lookup gives the bits of ``float32(scale) · float32(codebook[book][idx])``,
    signed zeros of zero scales included."""
    N, K = 24, 192
    G = K // group_size
    cfg = codebook.Config(bits=bits, group_size=group_size, num_codebooks=books)
    codes, book = torch.randint(0, 1 << bits, (N, K)), torch.randint(0, books, (N, G))
    b = {"codes": pack(codes, bits), "scales": (torch.rand(N, G) - 0.5).half(),
         "codebooks": torch.randint(-128, 128, (books, 1 << bits), dtype=torch.int8)}
    b["scales"][0, 0], b["scales"][1, 0] = 0.0, -0.0
    if books > 1:
        b["book_idx"] = pack(book, int(math.log2(books)))
    else:
        book.zero_()
    ref = b["scales"].float().repeat_interleave(group_size, 1) * b["codebooks"].float()[
        book.repeat_interleave(group_size, 1), codes]
    out = codebook.dequantize(b, cfg, N, K)
    assert out.dtype == torch.float32 and out.shape == (N, K)
    assert torch.equal(out.contiguous().view(torch.int32), ref.view(torch.int32))


def test_codebook_beats_single_codebook_and_uniform():
    w = torch.cat([torch.randn(N, K // 2), torch.distributions.Laplace(0, 1).sample((N, K // 2))], 1) * 0.02
    errs = {}
    for c in (1, 4):
        cfg = codebook.Config(bits=2, num_codebooks=c)
        errs[c] = rel_err(w, codebook.dequantize(codebook.quantize(w, cfg), cfg, N, K))
    codes, s, z = uniform.rtn(w, 2, 32)
    rtn = s.repeat_interleave(32, 1) * (codes - z.repeat_interleave(32, 1))
    assert errs[4] <= errs[1] < rel_err(w, rtn)


# ---------------------------------------------------------------- bits per weight, error feedback
@pytest.mark.parametrize("fmt,cfg,expect", [
    (bcq, bcq.Config(bits=4, group_size=64), 4 + (4 * 16 + 16) / 64),
    (bcq, bcq.Config(bits=3, group_size=128, offset=False), 3 + 3 * 16 / 128),
    (codebook, codebook.Config(bits=2), 2 + 16 / 32 + 2 / 32 + 16 * 8 / (N * 2 * K)),
    (codebook, codebook.Config(bits=4), 4 + 16 / 32 + 16 * 8 / (N * 2 * K)),
])
def test_bits_per_weight_exact(fmt, cfg, expect):
    from qlinear.formats.base import spec_bits
    k = 2 * K  # 16 groups of 32: the 2-bit codebook choices fill whole int32 words
    assert math.isclose(spec_bits(fmt.buffer_specs(N, k, cfg)) / (N * k), expect, rel_tol=1e-12)
    # and the specs are what the quantizer produces
    b = fmt.quantize(weight(N, k), cfg)
    assert {n: (tuple(v.shape), v.dtype) for n, v in b.items()} == dict(fmt.buffer_specs(N, k, cfg))


@pytest.mark.parametrize("fmt,cfg,rtn_cfg", [
    (bcq, bcq.Config(bits=3, group_size=64, error_feedback=True), bcq.Config(bits=3, group_size=64, init="uniform", iters=0)),
    (mixed, mixed.Config(), None),
    (codebook, codebook.Config(bits=2, error_feedback=True), None),
])
def test_error_feedback_lowers_output_error(fmt, cfg, rtn_cfg):
    w = weight(64, 128)
    H = random_hessian(128)
    with_h = fmt.dequantize(fmt.quantize(w, cfg, H), cfg, 64, 128)
    base_cfg = rtn_cfg or cfg
    without = fmt.dequantize(fmt.quantize(w, base_cfg), base_cfg, 64, 128)
    codes, s, z = uniform.rtn(w, cfg.bits, cfg.group_size)
    rtn = s.repeat_interleave(cfg.group_size, 1) * (codes - z.repeat_interleave(cfg.group_size, 1))
    assert out_err(w, with_h, H) < out_err(w, without, H)
    assert out_err(w, with_h, H) < out_err(w, rtn, H)


def test_bad_hessian_rejected():
    with pytest.raises(ValueError, match="hessian"):
        bcq.quantize(weight(), bcq.Config(error_feedback=True), torch.eye(K + 1))
    H = torch.eye(K)
    H[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        mixed.quantize(weight(), mixed.Config(), H)


def test_bcq_error_decreases_with_bits_1_to_8():
    w = weight(32, 128)
    errs = []
    for bits in range(1, 9):
        cfg = bcq.Config(bits=bits, group_size=64, iters=2)
        errs.append(rel_err(w, bcq.dequantize(bcq.quantize(w, cfg), cfg, 32, 128)))
    assert all(a > b for a, b in zip(errs, errs[1:])) and errs[-1] < 0.01


@pytest.mark.parametrize("fmt,cfg", [(bcq, bcq.Config(bits=3, group_size=32)), (bcq, bcq.Config(bits=2, offset=False)),
                                     (mixed, mixed.Config()), (codebook, codebook.Config(bits=2))])
@pytest.mark.parametrize("hessian", [False, True])
def test_zero_rows_and_groups(fmt, cfg, hessian):
    w = weight(32, 128)
    w[:4] = 0  # zero rows
    w[8:, :32] = 0  # a zero group in most rows
    H = random_hessian(128) if hessian else None
    if H is not None and fmt is not bcq:
        cfg = dataclasses.replace(cfg, **({"error_feedback": True} if fmt is codebook else {}))
    w_hat = fmt.dequantize(fmt.quantize(w, cfg, H), cfg, 32, 128)
    assert torch.isfinite(w_hat).all()
    assert w_hat[:4].abs().max() < 1e-6 and rel_err(w[4:], w_hat[4:]) < 0.6


def test_mixed_ignores_dead_input_columns():
    w = weight(64, 128)
    H = random_hessian(128)
    H[:16, :] = 0
    H[:, :16] = 0  # input group 0 never seen in calibration
    cfg = mixed.Config(ratio_4bit=0.25, outlier_ratio=0.005)
    b = mixed.quantize(w, cfg, H)
    assert 0 not in b["idx4"].tolist()
    assert (b["outlier_cols"].long() >= 16).all()


def test_mixed_dequant_with_4bit_groups_and_outliers_matches_float64():
    w = weight()
    cfg = mixed.Config()
    b = mixed.quantize(w, cfg)
    assert len(b["idx4"]) and len(b["outlier_values"])
    assert torch.allclose(mixed.dequantize(b, cfg, N, K).double(), dense64("mixed", b, cfg, N, K), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("fmt,cfg", [("bcq", bcq.Config(bits=3, group_size=64, iters=2)),
                                     ("bcq", bcq.Config(bits=4, group_size=64, init="uniform", iters=0)),
                                     ("bcq", bcq.Config(bits=3, group_size=32, init="uniform", iters=0, offset=False)),
                                     ("codebook", codebook.Config(bits=2, num_codebooks=4, iters=1)),
                                     ("codebook", codebook.Config(bits=4, num_codebooks=1, iters=1))])
def test_dequantize_matches_the_float64_formulas(fmt, cfg):
    """Every format's dequantization equals the tests' independent float64 formulas (conftest.dense64), which the
    kernel tests use as ground truth."""
    b = get_format(fmt).quantize(weight(), cfg)
    assert torch.allclose(get_format(fmt).dequantize(b, cfg, N, K).double(), dense64(fmt, b, cfg, N, K),
                          atol=1e-7, rtol=1e-6)


def test_from_uniform_rejects_bad_scales_and_zeros_and_the_bcq_view_scales_alpha_cannot_hold():
    codes = torch.randint(0, 256, (8, 64))
    zeros = torch.zeros(8, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="fp16 values"):
        bcq.from_uniform(codes, torch.full((8, 1), 0.1), zeros, 8, 64)
    with pytest.raises(ValueError, match=r"zero points must lie in \[0, 256\)"):
        bcq.from_uniform(codes, torch.full((8, 1), 0.5), zeros + 256, 8, 64)
    cfg, b = bcq.from_uniform(codes, torch.full((8, 1), 2048.0), zeros, 8, 64)  # the storage holds any fp16 scale
    assert torch.equal(bcq.dequantize(b, cfg, 8, 64), 2048.0 * codes.float())
    with pytest.raises(ValueError, match="α cannot represent"):  # 2048·2^6 is beyond fp16
        bcq.as_bcq(b, cfg, 8, 64)


def test_codebook_rejects_unpackable_codebook_count_and_sorts_given_books():
    with pytest.raises(ValueError, match="1, 2 or 4"):
        codebook.Config(bits=1, num_codebooks=8)
    cfg = codebook.Config(bits=2, num_codebooks=1)
    w = weight(16, 64)
    books = torch.tensor([[90, -90, 30, -30]], dtype=torch.int8)
    b = codebook.quantize(w, cfg, codebooks=books)
    assert b["codebooks"].tolist() == [[-90, -30, 30, 90]]
    assert rel_err(w, codebook.dequantize(b, cfg, 16, 64)) < 0.5


def _dense_fit_reference(w, d, bits, iters):
    """BCQ's alternating refinement as written in the module docstring, in float64 with explicit design matrices and
    every round run on every row (no shortcuts): best of greedy/uniform init, then ``iters`` rounds of weighted least
    squares for (α, c) and nearest levels, keeping each row's best iterate.  Returns the per-row weighted error."""
    cfg = bcq.Config(bits=bits, iters=0)
    d = d / d.mean(1, keepdim=True)
    alpha, c, codes = bcq.fit(w, d, cfg)  # the inits are shared code; the rounds below are not
    S = torch.tensor([[2.0 * ((l >> i) & 1) - 1 for i in range(bits)] + [1.0] for l in range(2 ** bits)],
                     dtype=torch.float64)
    lv = (alpha.double() @ S[:, :bits].T + c.double()[:, None])
    best = (d.double() * (w.double() - lv.gather(1, codes)) ** 2).sum(1)
    for _ in range(iters):
        A = S[codes]                                                    # [M, g, q + 1]
        AtD = A.transpose(1, 2) * d.double()[:, None, :]
        lhs = AtD @ A
        lhs = lhs + torch.eye(bits + 1, dtype=torch.float64) * (1e-9 * lhs.diagonal(dim1=1, dim2=2).mean(1))[:, None, None]
        sol = torch.linalg.solve(lhs, AtD @ w.double()[:, :, None])[:, :, 0]
        sol = sol.float().half().double()                               # α and c are stored as fp16
        lv = sol[:, :bits] @ S[:, :bits].T + sol[:, bits:]
        codes = (w.double()[:, :, None] - lv[:, None, :]).abs().argmin(-1)
        best = torch.minimum(best, (d.double() * (w.double() - lv.gather(1, codes)) ** 2).sum(1))
    return best


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bcq_fit_matches_a_dense_float64_reference(bits):
    """The fitted rows' errors match the plain algorithm's: the per-code histograms of the normal equations, the
    midpoint search for the nearest level and rows leaving the loop at a fixed point change no result beyond float
    rounding (individual rows may differ where fp16 rounding of α ties, the total may not move)."""
    torch.manual_seed(bits)
    w = weight(128, 256).reshape(-1, 64)
    d = torch.rand(w.shape) + 0.1
    alpha, c, codes = bcq.fit(w, d, bcq.Config(bits=bits, iters=8))
    lv = bcq.levels(alpha, c).double()
    dn = (d / d.mean(1, keepdim=True)).double()
    ours = (dn * (w.double() - lv.gather(1, codes)) ** 2).sum(1)
    ref = _dense_fit_reference(w, d, bits, 8)
    assert abs(ours.sum() / ref.sum() - 1) < 1e-4
    assert ((ours - ref).abs() <= 1e-6 * ref + 1e-12).float().mean() > 0.99
