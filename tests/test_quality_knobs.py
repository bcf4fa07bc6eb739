"""The mixed format's ablation switches (issue 9): random 4-bit group selection, outliers in any group."""

import pytest
import torch

from conftest import random_hessian
from qlinear import gptq
from qlinear.formats import config_from_dict, mixed

N, K, g = 64, 256, 16
G = K // g


def layer_with_sensitive_groups(big=(1, 6, 11, 13)):
    """Small weights, except a few groups 10x larger: eq. 9 (H = I) must pick exactly those as 4-bit."""
    w = torch.randn(N, K) * 0.02
    for gi in big:
        w[:, gi * g:(gi + 1) * g] *= 10
    return w


def buffers_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sq_err(w, buffers, cfg):
    return float(((mixed.dequantize(buffers, cfg, N, K).double() - w.double()) ** 2).sum())


@pytest.mark.parametrize("calibrated", [False, True])
def test_defaults_are_the_explicit_defaults_and_the_paper_rule(calibrated):
    w = layer_with_sensitive_groups()
    H = random_hessian(K) if calibrated else None
    default = mixed.quantize(w, mixed.Config(), H)
    explicit = mixed.quantize(w, mixed.Config(group_selection="sensitivity", selection_seed=0,
                                              outlier_placement="2bit"), H)
    assert buffers_equal(default, explicit)
    # the default still is eq. 9 top-G4 and exclusive 2-bit outliers
    cfg = mixed.Config()
    _, G4, nnz = cfg.counts(N, K)
    hinv = None if H is None else torch.diagonal(gptq.damped_inverse_hessian(H, K, cfg.damp)).float()
    S = mixed.sensitivity(w, g, hinv)
    assert default["idx4"].tolist() == sorted(torch.argsort(S, descending=True, stable=True)[:G4].tolist())
    assert default["outlier_values"].numel() == nnz > 0
    assert not torch.isin(default["outlier_cols"].long() // g, default["idx4"].long()).any()


def test_old_configs_load_with_the_default_knobs():
    cfg = config_from_dict({"format": "mixed", "bits": 2, "group_size": 16, "ratio_4bit": 0.25,
                            "scale_bits": 4, "scale_group_size": 16, "outlier_ratio": 0.002, "damp": 0.01})
    assert (cfg.group_selection, cfg.selection_seed, cfg.outlier_placement) == ("sensitivity", 0, "2bit")
    new = mixed.Config(group_selection="random", selection_seed=3, outlier_placement="any")
    assert config_from_dict(new.to_dict()) == new


def test_random_selection_same_count_other_groups_deterministic():
    w = layer_with_sensitive_groups()
    cfg_s, cfg_r = mixed.Config(), mixed.Config(group_selection="random")
    _, G4, _ = cfg_s.counts(N, K)
    sens = mixed.quantize(w, cfg_s)
    rand = mixed.quantize(w, cfg_r)
    assert sens["idx4"].tolist() == [1, 6, 11, 13]
    assert rand["idx4"].numel() == G4 == 4 and rand["idx4"].tolist() != sens["idx4"].tolist()
    assert rand["idx4"].tolist() == sorted(rand["idx4"].tolist()) and len(set(rand["idx4"].tolist())) == G4
    # deterministic: same seed, same buffers (whatever the global RNG state); another seed, another choice
    torch.manual_seed(123)
    assert buffers_equal(rand, mixed.quantize(w, cfg_r))
    seeds = {tuple(mixed.quantize(w, mixed.Config(group_selection="random", selection_seed=s))["idx4"].tolist())
             for s in range(4)}
    assert len(seeds) > 1
    # the selection ignores the weights: the same groups for another layer of the same shape
    assert torch.equal(mixed.select_4bit_groups(torch.randn(N, K), cfg_r, None), torch.isin(torch.arange(G), rand["idx4"]))
    # and on this layer sensitivity is what helps: its error is far lower than random's
    assert sq_err(w, sens, cfg_s) < 0.5 * sq_err(w, rand, cfg_r)


@pytest.mark.parametrize("ratio", [0.0, 0.1, 1.0])
def test_random_selection_counts_at_edges(ratio):
    cfg = mixed.Config(ratio_4bit=ratio, group_selection="random")
    b = mixed.quantize(torch.randn(N, K), cfg)
    assert b["idx4"].numel() == cfg.counts(N, K)[1] == round(ratio * G)


def layer_with_4bit_errors():
    """Groups 2 and 9 carry one large spike per row: they are the sensitive (4-bit) groups, and the spike
    stretches their range so that their other weights get the layer's largest rounding errors."""
    w = torch.randn(N, K) * 0.02
    for gi in (2, 9):
        w[torch.arange(N), gi * g + torch.randint(0, g, (N,))] = 5.0
    return w


def test_outliers_anywhere_land_in_4bit_groups_and_never_raise_the_error():
    w = layer_with_4bit_errors()
    cfg2 = mixed.Config(ratio_4bit=0.125, outlier_ratio=0.005)
    cfga = mixed.Config(ratio_4bit=0.125, outlier_ratio=0.005, outlier_placement="any")
    b2, ba = mixed.quantize(w, cfg2), mixed.quantize(w, cfga)
    assert b2["idx4"].tolist() == ba["idx4"].tolist() == [2, 9]
    nnz = round(0.005 * N * K)
    assert b2["outlier_values"].numel() == ba["outlier_values"].numel() == nnz  # same count
    in4 = lambda b: torch.isin(b["outlier_cols"].long() // g, b["idx4"].long())
    assert not in4(b2).any() and in4(ba).sum() > nnz // 2
    # CSR well formed and shapes as buffer_specs says
    rp = ba["outlier_row_ptr"].long()
    assert rp[0] == 0 and rp[-1] == nnz and (rp.diff() >= 0).all()
    assert {k: (tuple(v.shape), v.dtype) for k, v in ba.items()} == \
        {k: (tuple(s), d) for k, (s, d) in mixed.buffer_specs(N, K, cfga).items()}
    # Without calibration both placements share codes and scales (the fit ignores outliers), and each keeps the
    # nnz largest errors of its candidate set: "any" takes them from a superset, so its float64 error can only
    # be lower (up to the fp16 rounding of the corrections), and here it is clearly lower.
    assert torch.equal(b2["qweight4"], ba["qweight4"]) and torch.equal(b2["qweight2"], ba["qweight2"])
    e2, ea = sq_err(w, b2, cfg2), sq_err(w, ba, cfga)
    assert ea < 0.9 * e2


@pytest.mark.parametrize("seed", range(3))
def test_outliers_anywhere_error_bound_on_random_layers(seed):
    torch.manual_seed(seed)
    w = torch.randn(N, K) * (torch.rand(1, K) * 2 + 0.1)
    cfg2 = mixed.Config(outlier_ratio=0.005)
    cfga = mixed.Config(outlier_ratio=0.005, outlier_placement="any")
    e2, ea = sq_err(w, mixed.quantize(w, cfg2), cfg2), sq_err(w, mixed.quantize(w, cfga), cfga)
    assert ea <= e2 * (1 + 1e-6)


def test_outliers_anywhere_count_can_exceed_the_2bit_weights():
    # all groups 4-bit: "2bit" has no room for outliers, "any" keeps the full count
    w = torch.randn(N, K)
    assert mixed.quantize(w, mixed.Config(ratio_4bit=1.0))["outlier_values"].numel() == 0
    b = mixed.quantize(w, mixed.Config(ratio_4bit=1.0, outlier_placement="any"))
    assert b["outlier_values"].numel() == round(0.002 * N * K)


@pytest.mark.parametrize("kw, msg", [
    ({"group_selection": "best"}, "group_selection"),
    ({"group_selection": "Random"}, "group_selection"),
    ({"outlier_placement": "4bit"}, "outlier_placement"),
    ({"outlier_placement": None}, "outlier_placement"),
    ({"selection_seed": -1}, "selection_seed"),
])
def test_bad_knob_values_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mixed.Config(**kw)
