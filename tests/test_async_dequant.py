"""Mixed 2/4/16 GEMV with asynchronous dequantization: its layout and executable spec on CPU, registry rules,
and the kernel on a GPU.

Error bound used throughout: per word the kernel forms Σ_i (q_i − z)·x'_i over ≤ 16 inputs as two half2 lanes of
≤ 8 fp16 fused multiply-adds each (q − z exact, x' = x·2^s exact), so each lane errs by at most 8·u₁₆ of its
Σ|(q − z)·x'| (``u₁₆ = 2⁻¹¹``), plus fp16 subnormal roundings (``≤ 2⁻²⁵`` each in units of x', which are at most
max|x|/512); it scales the lanes' fp32 sum by ŝ = fma(scale_scale, code, scale_zero) (one rounding, the reference
rounds twice and once more for ŝ·(q − z)), accumulates the W words of a split and the row's outliers in fp32, then
sums the splits, so ``|y − y₆₄| ≤ ((W + 64 + nnz_row)·u₃₂ + 8·u₁₆) · Σ_k (|ŵ_k| + |o_k|)·|x_k| + W·2⁻²⁵·max|x|·max ŝ``
with ``u₃₂ = 2⁻²⁴``, ``ŵ`` the codes' part of the weight and ``o`` the outliers, plus one rounding of the output
(``u_out·|y|``) for fp16/bf16 outputs.  Where every half2 sum is exact (x of few significant bits: :func:`_dyadic`)
the fp16 terms drop out, which makes a single wrong code visible at any K.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from conftest import poison_cuda_allocator, ref64

import qlinear.backends as backends
from qlinear import MixedPrecisionLinear
from qlinear.backends import async_dequant as ad
from qlinear.formats import mixed

U32 = 2.0 ** -24
U16 = 2.0 ** -11
DEFAULT = mixed.Config()


def _mag(bufs: dict, cfg, N: int, K: int, x: torch.Tensor) -> torch.Tensor:
    """``Σ_k (|ŵ_k| + |o_k|)·|x_k|`` ``[M, N]`` float64 from canonical buffers."""
    no_out = dict(bufs, outlier_values=torch.zeros_like(bufs["outlier_values"]))
    w = mixed.dequantize(no_out, cfg, N, K).double().abs()
    vals = bufs["outlier_values"]
    if vals.numel():
        rows = torch.repeat_interleave(torch.arange(N, device=vals.device), bufs["outlier_row_ptr"].long().diff())
        w.index_put_((rows, bufs["outlier_cols"].long()), vals.double().abs(), accumulate=True)
    return x.double().abs().to(w.device) @ w.T


def _bound(bufs, cfg, N, K, x, out_eps=0.0, y64=None, half_sums=True):
    """The module docstring's bound ``[M, N]`` float64 from canonical buffers; ``half_sums=False`` where every half2
    sum is exact (:func:`_dyadic` inputs)."""
    W = ad._tables(mixed.group_kinds(bufs["idx4"], K // cfg.group_size), cfg.group_size, cfg.scale_bits)["src"].numel()
    nnz_row = int(bufs["outlier_row_ptr"].long().diff().max()) if N else 0
    bound = ((W + 64 + nnz_row) * U32 + 8 * U16 * half_sums) * _mag(bufs, cfg, N, K, x)
    if half_sums:
        s_max = (bufs["scale_scale"].double().abs() * ((1 << cfg.scale_bits) - 1) + bufs["scale_zero"].double().abs()).max()
        amax = x.double().abs().amax(1, keepdim=True).to(bound.device)
        bound = bound + W * 2.0 ** -25 * amax * float(s_max)
    if out_eps:
        bound = bound + out_eps * y64.abs().to(bound.device)
    return bound


def _dyadic(M: int, K: int, dtype=torch.float16) -> torch.Tensor:
    """x ``[M, K]`` of multiples of 1/8 in [−0.5, 0.5]: scaled to fp16 by the kernel, every product and half2 sum of a
    word is exact (at most 8 bits), so the kernel's error is that of fp32 accumulation alone."""
    return (torch.randint(-4, 5, (M, K)) / 8).to(dtype)


def _ref(bufs, cfg, N, K, x, bias=None):
    y = x.double() @ mixed.dequantize(bufs, cfg, N, K).double().to(x.device).T
    return y if bias is None else y + bias.double()


def _W(bufs, cfg) -> int:
    return ad.num_words(bufs, cfg)


CONFIGS = {
    "default": DEFAULT,
    "g32": mixed.Config(group_size=32),
    "g48_sb8_sg7": mixed.Config(group_size=48, scale_bits=8, scale_group_size=7),
    "sb2_no_outliers": mixed.Config(scale_bits=2, outlier_ratio=0.0),
    "outliers_0.005": mixed.Config(outlier_ratio=0.005),
    "no_4bit": mixed.Config(ratio_4bit=0.0, outlier_ratio=0.005),
    "all_4bit": mixed.Config(ratio_4bit=1.0, outlier_ratio=0.0),
    "g64": mixed.Config(group_size=64, ratio_4bit=0.4),  # one pair per tile (P = 1)
}
SHAPES = [(64, 64), (128, 320), (576, 576), (1536, 576), (96, 2048), (100, 112)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("N,K", SHAPES)
def test_spec_matches_reference_in_float64(name, N, K):
    cfg = CONFIGS[name]
    if K % cfg.group_size:
        pytest.skip("shape not divisible by the group size")
    canon = ad.random_buffers(N, K, cfg, seed=N + K)
    bufs = ad.repack(canon, cfg, N, K)
    bias = torch.randn(N)
    for M in (1, 3, 8):
        x = torch.randn(M, K).half()
        y64 = _ref(canon, cfg, N, K, x, bias)
        bound = _bound(canon, cfg, N, K, x)
        T = math.ceil(_W(bufs, cfg) / 4)
        launches = {ad.plan(M, N, K, _W(bufs, cfg), sms) for sms in (1, 132)} | {(32, 1, T), (64, T, 1)}
        for launch in launches:
            y = ad.spec(x, bufs, bias, cfg, N, K, launch)
            err = (y.double() - y64).abs()
            assert (err <= bound).all(), (launch, err.max().item())


def test_spec_matches_a_quantized_layer():
    """A layer from the real quantizer (calibrated: sensitivity-selected groups, GPTQ, saliency outliers)."""
    from conftest import random_hessian

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96)
    cfg = mixed.Config(outlier_ratio=0.005)
    mod = MixedPrecisionLinear.from_linear(lin, cfg, random_hessian(256), backend="reference")
    canon = mod.canonical()
    bufs = ad.repack(canon, cfg, 96, 256)
    x = torch.randn(5, 256).half()
    y = ad.spec(x, bufs, mod.bias, cfg, 96, 256, ad.plan(5, 96, 256, _W(bufs, cfg), 132))
    assert ((y.double() - ref64(mod, x)).abs() <= _bound(canon, cfg, 96, 256, x)).all()


def test_spec_handles_outliers_in_4bit_groups():
    """``outlier_placement="any"`` may put outliers in 4-bit groups: the fused path adds every column of a split."""
    cfg = mixed.Config(outlier_ratio=0.005, outlier_placement="any")
    N, K = 64, 256
    canon = ad.random_buffers(N, K, cfg, seed=3)
    G = K // cfg.group_size
    is4 = mixed.group_kinds(canon["idx4"], G)
    cols4 = (torch.nonzero(is4).flatten()[:, None] * 16 + torch.arange(16)).flatten()
    rp = canon["outlier_row_ptr"].long()
    r = int(rp.diff().argmax())                            # move the busiest row's outliers into 4-bit groups
    cols = canon["outlier_cols"].clone()
    cols[rp[r]:rp[r + 1]] = cols4[: int(rp[r + 1] - rp[r])].to(cols.dtype)
    canon["outlier_cols"] = cols
    bufs = ad.repack(canon, cfg, N, K)
    x = torch.randn(2, K).half()
    for launch in ((32, 1, math.ceil(_W(bufs, cfg) / 4)), ad.plan(2, N, K, _W(bufs, cfg), 132)):
        y = ad.spec(x, bufs, None, cfg, N, K, launch)
        assert ((y.double() - _ref(canon, cfg, N, K, x)).abs() <= _bound(canon, cfg, N, K, x)).all()


def test_spec_catches_a_wrong_layout():
    """The spec reads the repacked buffers, so codes in canonical (row-major) order or a wrong record offset
    must fail the bound."""
    cfg, N, K = DEFAULT, 128, 256
    canon = ad.random_buffers(N, K, cfg, seed=1)
    bufs = ad.repack(canon, cfg, N, K)
    x = torch.randn(1, K).half()
    launch = ad.plan(1, N, K, _W(bufs, cfg), 4)
    bound = _bound(canon, cfg, N, K, x)
    y64 = _ref(canon, cfg, N, K, x)
    W = _W(bufs, cfg)
    row_major = bufs["ad_codes"][: 4 * (W // 4) * N].reshape(W // 4, N, 4).transpose(0, 1).reshape(-1)
    for key, bad in (("ad_codes", torch.cat([row_major, bufs["ad_codes"][4 * (W // 4) * N:]])),
                     ("ad_tab", torch.cat([bufs["ad_tab"][:K // 16], bufs["ad_tab"][K // 16:K // 16 + W] + (2 << 20),
                                          bufs["ad_tab"][K // 16 + W:]])),  # every record read 2 bits off
                     ("ad_sqt", bufs["ad_sqt"].flip(0).contiguous())):
        y = ad.spec(x, dict(bufs, **{key: bad}), None, cfg, N, K, launch)
        assert not ((y.double() - y64).abs() <= bound).all(), key


@pytest.mark.parametrize("name", list(CONFIGS) + ["default-K32", "all_4bit-K32"])
def test_layout_round_trip_is_bit_exact(name):
    """Bit for bit, and no canonical buffer a view into a larger storage (a state dict of it would save that whole
    storage; e.g. an empty ``qweight4`` sliced from the merged code words), also at K = 32."""
    cfg = CONFIGS[name.removesuffix("-K32")]
    N, K = 80, 32 if name.endswith("-K32") else {32: 512, 64: 640}.get(cfg.group_size, 480)
    canon = ad.random_buffers(N, K, cfg, seed=7)
    packed = ad.repack(canon, cfg, N, K)
    assert tuple(packed) == ad.LAYOUT.names(cfg)
    assert all(t.dtype == torch.int32 for k, t in packed.items() if not k.startswith("ad_outlier"))
    back = ad.unrepack(packed, cfg, N, K)
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype
                                           for k in canon)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in back.values()), name


def test_round_trip_of_a_fresh_module_s_zero_buffers():
    """A module constructed without data holds zero buffers (``idx4`` all zeros, not a set of groups): the layout
    keeps that ``idx4`` verbatim so the round trip stays exact."""
    cfg, N, K = DEFAULT, 32, 256
    canon = {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in mixed.buffer_specs(N, K, cfg).items()}
    packed = ad.repack(canon, cfg, N, K)
    assert packed["ad_idx4"].numel() == canon["idx4"].numel() > 1
    back = ad.unrepack(packed, cfg, N, K)
    assert all(torch.equal(back[k], canon[k]) and back[k].dtype == canon[k].dtype for k in canon)
    valid = ad.repack(ad.random_buffers(N, K, cfg), cfg, N, K)
    assert valid["ad_idx4"].numel() == 0  # a real layer: idx4 is read back from the group table


def test_round_trip_with_int32_outlier_columns():
    cfg = mixed.Config(outlier_ratio=0.005)
    N, K = 8, 32784  # K > 32767: outlier columns are int32
    canon = ad.random_buffers(N, K, cfg, seed=2)
    assert canon["outlier_cols"].dtype == torch.int32
    back = ad.unrepack(ad.repack(canon, cfg, N, K), cfg, N, K)
    assert all(torch.equal(back[k], canon[k]) for k in canon)


def test_word_table_walks_K_in_order():
    cfg = DEFAULT
    G = 40
    is4 = torch.rand(G, generator=torch.Generator().manual_seed(0)) < 0.3
    tab = ad._tables(is4, cfg.group_size, cfg.scale_bits)
    k = 0
    for grp, e in zip(tab["grp"].tolist(), tab["wtab"].tolist()):
        k0, _, w4, cnt = ad._entry(e)
        assert k0 == k and bool(is4[grp]) == w4 and grp == k0 // cfg.group_size
        k += cnt
    assert k == G * cfg.group_size and tab["wtab"].numel() == int((~is4).sum()) + 2 * int(is4.sum())


@pytest.mark.parametrize("name", ["default", "g32", "g48_sb8_sg7", "no_4bit", "all_4bit", "sb2_no_outliers"])
def test_tile_windows_hold_every_word_s_record(name):
    """A tile's meta window (words ``ttab[t]`` .. +2) shifted by a word's record bit gives that word's group record
    (zero, scale code) as the canonical buffers hold it, for every row and word; the record bit fits the window the
    kernel loads (two words, three with 8-bit scale codes)."""
    cfg = CONFIGS[name]
    N, K = 24, 48 * 16 * 4
    G = K // cfg.group_size
    canon = ad.random_buffers(N, K, cfg, seed=9)
    bufs = ad.repack(canon, cfg, N, K)
    W = ad.num_words(bufs, cfg)
    T = math.ceil(W / 4)
    tab = [int(v) & 0xFFFFFFFF for v in bufs["ad_tab"]]
    assert len(tab) == G + W + T
    wtab, ttab = tab[G:G + W], tab[G + W:]
    meta = [[int(v) & 0xFFFFFFFF for v in row] for row in bufs["ad_meta"].T]
    is4 = mixed.group_kinds(canon["idx4"], G)
    idx2, idx4 = torch.nonzero(~is4).flatten().tolist(), torch.nonzero(is4).flatten().tolist()
    from qlinear.formats.packing import unpack
    z2, z4 = unpack(canon["zeros2"], 2, len(idx2)), unpack(canon["zeros4"], 4, len(idx4))
    sc = unpack(canon["scale_codes"], cfg.scale_bits, N).T
    window_words = 3 if cfg.scale_bits > 4 else 2
    for w in range(W):
        k0, rb, w4, _ = ad._entry(wtab[w])
        grp = k0 // cfg.group_size
        width = (4 if w4 else 2) + cfg.scale_bits
        assert rb + width <= 32 * window_words
        for n in range(N):
            win = sum((meta[n][ttab[w // 4] + i] if ttab[w // 4] + i < len(meta[n]) else 0) << (32 * i) for i in range(3))
            rec = (win >> rb) & ((1 << width) - 1)
            z = int(z4[n, idx4.index(grp)]) if w4 else int(z2[n, idx2.index(grp)])
            assert rec == z | int(sc[n, grp]) << (4 if w4 else 2), (w, n)


@pytest.mark.parametrize("N,K", [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (8192, 8192), (11008, 4096),
                                 (4096, 11008), (28672, 8192)])
@pytest.mark.parametrize("name", ["default", "g32", "no_4bit", "all_4bit", "outliers_0.005", "sb2_no_outliers"])
def test_repacked_bits_stay_within_005_of_canonical(N, K, name):
    cfg = CONFIGS[name]
    canon_bits, rep_bits = ad.layout_bits(cfg, N, K)
    assert rep_bits - canon_bits <= 0.05, (canon_bits, rep_bits)


def test_layout_bits_counts_the_repacked_tensors():
    for name in ("default", "g48_sb8_sg7", "no_4bit", "all_4bit"):
        cfg = CONFIGS[name]
        N, K = 64, 480
        canon = ad.random_buffers(N, K, cfg)
        packed = ad.repack(canon, cfg, N, K)
        stored = lambda bufs: sum(t.numel() * t.element_size() * 8 for t in bufs.values()) / (N * K)
        assert ad.layout_bits(cfg, N, K) == (pytest.approx(stored(canon)), pytest.approx(stored(packed))), name


def test_plan_covers_every_tile_once_within_limits():
    """Every batch of the GEMV's range (and beyond), real and odd shapes, 0-100 % 4-bit groups, several GPU sizes:
    whole warps, every word tile in exactly one split, the grid and shared memory within CUDA's limits."""
    shapes = [(576, 576), (1536, 576), (4096, 4096), (8192, 8192), (28672, 8192), (4096, 11008), (11008, 4096),
              (64, 64), (100, 112)]
    for (N, K), sms, ratio, M in itertools.product(shapes, (1, 78, 132), (0.0, 0.25, 1.0), [*range(1, 17), 32, 64]):
        G = K // 16
        W = (G - round(ratio * G)) + 2 * round(ratio * G)
        threads, per, splits = ad.plan(M, N, K, W, sms)
        tiles, case = math.ceil(W / 4), (M, N, K, sms, ratio)
        assert threads % 32 == 0 and 32 <= threads <= 256, case
        assert (splits - 1) * per < tiles <= splits * per and splits <= 65535, case
        assert 6 * min(M, 8) * min(K, 64 * per) + 20 * per + 32 <= 48 * 1024, case  # shared memory


def test_plan_splits_no_further_than_one_wave_of_resident_blocks():
    """Split-K adds blocks only while all of them fit on the GPU at once (resident threads per SM × SMs): one split
    more leaves a tail wave that costs a whole block's time.  The exception: a split the shared memory forces (one
    split fewer would not fit a block's slice)."""
    shapes = [(576, 576), (1536, 576), (4096, 4096), (8192, 8192), (28672, 8192), (4096, 11008), (11008, 4096),
              (14336, 4096)]
    for (N, K), sms, M in itertools.product(shapes, (78, 132), range(1, 9)):
        W = K // 16 + K // 64
        threads, per, splits = ad.plan(M, N, K, W, sms)
        blocks, places = math.ceil(N / (2 * threads)) * splits, sms * ad._resident(M) // threads
        fewer = splits > 1 and math.ceil(math.ceil(W / 4) / (splits - 1))
        assert blocks <= places or splits == 1 or ad._smem(M, K, fewer) > ad._block_smem_cap(M, threads), (N, K, sms, M)
    # 8192², M = 8 (384 places for 128-thread blocks): 12 splits of 14 tiles, 384 blocks; 13 would make 416
    assert ad.plan(8, 8192, 8192, 640, 132) == (128, 14, 12)


def test_fake_op_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg, N, K = DEFAULT, 64, 128
    bufs = ad.repack(ad.random_buffers(N, K, cfg), cfg, N, K)
    with FakeTensorMode() as mode:
        x = torch.empty(3, K, dtype=torch.float16)
        fb = {k: mode.from_tensor(v) for k, v in bufs.items()}
        y = torch.ops.qlinear.mixed_gemv(x, fb["ad_codes"], fb["ad_meta"], fb["ad_sqt"], fb["ad_tab"],
                                         None, None, None, None, N, 16, 4, 16, 32, 1, 1, True)
    assert y.shape == (3, N) and y.dtype == torch.float16


def test_registry_rejects_unsupported_configs():
    """(The reasons every GPU kernel gives are checked in test_kernel_conformance.py.)"""
    k = next(k for k in backends.kernels("mixed") if k.backend == "async_dequant")
    assert "multiple of 16" in k.reject(mixed.Config(group_size=8), torch.device("cuda"), torch.float16, 1, (64, 64))


# --- the kernel's own source, run on the CPU under the host emulation (tests/cuda_emulation.py) -------------
# It runs the kernel's real index arithmetic (tiles, tail, table decoding, meta window, outlier search, split
# partials and their reduction) without a GPU.
_EMU_DRIVER = r'''// Driver: reads one call from argv[1], runs the source's own mixed_gemv (template dispatch, launch
// sizes, split-K reduction) and writes y (fp32 [M, N]) to argv[2].
int main(int argc, char** argv) {
  using namespace qlinear;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 23);
  const int M = h[0], N = h[1], K = h[2], W = h[3], G = h[4], MW = h[5], S2 = h[16], nnz = h[15], T = (W + 3) / 4;
  auto x = emu_read<uint16_t>(f, (size_t)M * K);
  auto codes = emu_read<unsigned>(f, (size_t)N * W);
  auto meta = emu_read<unsigned>(f, (size_t)MW * N);
  auto sq = emu_read<unsigned>(f, (size_t)T * S2 * h[22]);
  auto tab = emu_read<int>(f, G + W + T);
  std::vector<uint16_t> vals; std::vector<char> cols; std::vector<int> rp; std::vector<char> bias;
  if (h[13]) { vals = emu_read<uint16_t>(f, nnz); cols = emu_read<char>(f, (size_t)nnz * (h[14] ? 4 : 2)); rp = emu_read<int>(f, N + 1); }
  if (h[18]) bias = emu_read<char>(f, (size_t)N * (h[18] == 2 ? 4 : 2));
  std::vector<unsigned> sign_bits = emu_read<unsigned>(f, h[19]);
  std::vector<signed char> paley = emu_read<signed char>(f, h[21] > 1 ? h[21] * h[21] : 0);
  fclose(f);
  const Rotation rot{h[20], h[21], sign_bits.data(), paley.data()};
  qlinear::mixed::MixedGemvArgs a{};
  a.x = x.data(); a.codes = codes.data(); a.meta = meta.data(); a.sq = sq.data(); a.tab = tab.data();
  if (h[13]) { a.outlier_values = vals.data(); a.outlier_cols = cols.data(); a.outlier_row_ptr = rp.data(); a.cols_int32 = h[14]; }
  a.bias = h[18] ? bias.data() : nullptr;
  a.bias_dtype = h[18] == 2 ? qlinear::DType::kFloat : h[17] ? qlinear::DType::kBFloat16 : qlinear::DType::kHalf;
  std::vector<uint16_t> y((size_t)M * N, 0x7E00);  // NaN-poisoned output
  std::vector<float> partial((size_t)h[11] * M * N, NAN);
  a.y = y.data(); a.partial = partial.data();
  a.M = M; a.N = N; a.K = K; a.W = W; a.G = G; a.MW = MW; a.S2 = S2; a.P = h[22];
  a.group_size = h[6]; a.scale_bits = h[7]; a.scale_group_size = h[8];
  a.threads = h[9]; a.tiles_per_split = h[10]; a.splits = h[11]; a.async_dequant = h[12];
  a.x_dtype = h[17] ? qlinear::DType::kBFloat16 : qlinear::DType::kHalf;
  emu_check(mixed::mixed_gemv(a, rot, nullptr));
  emu_write(argv[2], y, h[17]);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(
        tmp_path_factory.mktemp("emu"), "async_dequant/mixed_gemv.cu",
        ("extern __shared__ float4 smem4[];", "float4* smem4 = ::g_smem4;"), cuda_emulation.WARP_PTX, _EMU_DRIVER,
        launches=True)


def _emulate(exe, x, bufs, bias, cfg, N, K, launch, async_dequant=True, rotation=None):
    from cuda_emulation import dtype_kind, rotation_header, run

    threads, per, splits = launch
    rot, rot_tensors = rotation_header(rotation, K)
    has_out = bufs["ad_outlier_values"].numel() > 0
    hdr = [x.shape[0], N, K, _W(bufs, cfg), K // cfg.group_size, bufs["ad_meta"].shape[0], cfg.group_size,
           cfg.scale_bits, cfg.scale_group_size, threads, per, splits, int(async_dequant), int(has_out),
           int(bufs["ad_outlier_cols"].dtype == torch.int32), bufs["ad_outlier_values"].numel(), bufs["ad_sqt"].shape[1],
           int(x.dtype == torch.bfloat16), dtype_kind(bias), *rot, bufs["ad_sqt"].shape[2]]
    outliers = [bufs[k] for k in ("ad_outlier_values", "ad_outlier_cols", "ad_outlier_row_ptr")] if has_out else []
    tensors = [x, *(bufs[k] for k in ("ad_codes", "ad_meta", "ad_sqt", "ad_tab")), *outliers,
               bias, *rot_tensors]
    return run(exe, hdr, tensors, (x.shape[0], N))


@pytest.mark.parametrize("name,N,K", [("default", 100, 112), ("default", 576, 576), ("g32", 130, 256),
                                      ("g48_sb8_sg7", 96, 480), ("no_4bit", 64, 320), ("all_4bit", 64, 320),
                                      ("outliers_0.005", 200, 400), ("sb2_no_outliers", 70, 144), ("g64", 72, 640)])
def test_kernel_source_under_host_emulation(emulator, name, N, K):
    cfg = CONFIGS[name]
    canon = ad.random_buffers(N, K, cfg, seed=N * K)
    bufs = ad.repack(canon, cfg, N, K)
    bias = torch.randn(N)
    T = math.ceil(_W(bufs, cfg) / 4)
    for M, dtype in ((1, torch.float16), (5, torch.bfloat16), (8, torch.float16)):
        eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        x = torch.randn(M, K).to(dtype)
        y64 = _ref(canon, cfg, N, K, x, bias)
        bound = _bound(canon, cfg, N, K, x, eps, y64)
        xd = _dyadic(M, K, dtype)
        yd64 = _ref(canon, cfg, N, K, xd, bias)
        bound_d = _bound(canon, cfg, N, K, xd, eps, yd64, half_sums=False)
        for launch in {ad.plan(M, N, K, _W(bufs, cfg), 132), ad.plan(M, N, K, _W(bufs, cfg), 1), (32, 1, T)}:
            y = _emulate(emulator, x, bufs, bias, cfg, N, K, launch)
            err = (y.double() - y64).abs()
            assert (err <= bound).all(), (launch, err.max().item())
            assert torch.equal(_emulate(emulator, x, bufs, bias, cfg, N, K, launch, async_dequant=False), y)
            err = (_emulate(emulator, xd, bufs, bias, cfg, N, K, launch).double() - yd64).abs()
            assert (err <= bound_d).all(), (launch, "dyadic", err.max().item())
            if M == 5:  # a bias in x's dtype is read as it is: the same sums as that bias widened to fp32, in the
                b = bias.to(dtype)  # split launch's reduction and in the kernel's own epilogue (one split)
                for lc in (launch, (launch[0], T, 1)):
                    assert torch.equal(_emulate(emulator, x, bufs, b, cfg, N, K, lc),
                                       _emulate(emulator, x, bufs, b.float(), cfg, N, K, lc)), lc


def test_kernel_source_with_more_than_48kb_of_shared_memory(emulator):
    """One split over K = 1536 at M = 8 stages 72 KB of x: the launcher must raise the kernel's dynamic shared memory
    limit first (the emulation refuses the launch otherwise, as a GPU would), and the result stays within the bound."""
    cfg, N, K, M = CONFIGS["default"], 32, 1536, 8
    canon = ad.random_buffers(N, K, cfg, seed=7)
    bufs = ad.repack(canon, cfg, N, K)
    T = math.ceil(_W(bufs, cfg) / 4)
    assert ad.staged_smem_bytes(M, K, T, 0) > 48 * 1024
    x = torch.randn(M, K).half()
    y64 = _ref(canon, cfg, N, K, x, None)
    y = _emulate(emulator, x, bufs, None, cfg, N, K, (32, T, 1))
    assert ((y.double() - y64).abs() <= _bound(canon, cfg, N, K, x, 2.0 ** -11, y64)).all()


def test_kernel_source_stages_a_rotated_input(emulator):
    """A rotated layer: each block of mixed_gemv.cu stages ``R·x`` of its span itself (rotation.cuh, widened to fp32 from
    x's dtype) under the host emulation: the float64 product with the exact ``R·x`` within the emulation test's bound
    plus one rounding of ``R·x`` to x's dtype, for Paley and power-of-two blocks and spans that cut through blocks."""
    from cuda_emulation import rotated_reference

    cfg = CONFIGS["outliers_0.005"]
    N, K = 200, 400
    canon = ad.random_buffers(N, K, cfg, seed=5)
    bufs = ad.repack(canon, cfg, N, K)
    bias = torch.randn(N)
    T = math.ceil(_W(bufs, cfg) / 4)
    for block, M, dtype, launch in ((400, 1, torch.float16, (256, T, 1)), (16, 5, torch.bfloat16, (32, 3, -(-T // 3))),
                                    (80, 6, torch.float16, (64, 2, -(-T // 2))), (200, 3, torch.bfloat16, (32, 1, T)),
                                    (400, 7, torch.float16, (128, 2, -(-T // 2))), (16, 8, torch.float16, (128, 4, -(-T // 4)))):
        eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
        x = torch.randn(M, K).to(dtype)
        x64, _ = rotated_reference(x, (9, block))
        y64 = _ref(canon, cfg, N, K, x64, bias)
        bound = _bound(canon, cfg, N, K, x64, eps, y64) + 2 * eps * _mag(canon, cfg, N, K, x64)
        y = _emulate(emulator, x, bufs, bias, cfg, N, K, launch, rotation=(9, block))
        assert ((y.double() - y64).abs() <= bound).all(), (block, M, launch)


def test_kernel_source_under_host_emulation_int32_columns(emulator):
    cfg = mixed.Config(outlier_ratio=0.005)
    N, K = 8, 32784
    canon = ad.random_buffers(N, K, cfg, seed=4)
    bufs = ad.repack(canon, cfg, N, K)
    assert bufs["ad_outlier_cols"].dtype == torch.int32
    x = torch.randn(2, K).half()
    y64 = _ref(canon, cfg, N, K, x)
    y = _emulate(emulator, x, bufs, None, cfg, N, K, ad.plan(2, N, K, _W(bufs, cfg), 132))
    assert ((y.double() - y64).abs() <= _bound(canon, cfg, N, K, x, 2.0 ** -11, y64)).all()


# --- on a GPU ---------------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
pytestmark = pytest.mark.usefixtures("without_dispatch_table")
GPU_SHAPES = [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096), (4096, 11008), (8192, 8192),
              (28672, 8192)]
GPU_M = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 31, 33, 64)


@functools.lru_cache(maxsize=4)
def _gpu_layer(N, K, ratio_4bit, outlier_ratio, bias):
    """Random-but-valid buffers (quantizing large layers is slow) as a module on the GPU, with the float64 weight
    ``Ŵ`` and the magnitudes ``|ŵ| + |o|`` of the error bound (computed once per layer)."""
    cfg = mixed.Config(ratio_4bit=ratio_4bit, outlier_ratio=outlier_ratio)
    canon = ad.random_buffers(N, K, cfg, seed=N + K, device="cuda")
    b = torch.randn(N, device="cuda") if bias else None
    mod = MixedPrecisionLinear.from_packed(canon, K, N, cfg, b)
    w64 = mixed.dequantize(canon, cfg, N, K).double()
    wabs = mixed.dequantize(dict(canon, outlier_values=torch.zeros_like(canon["outlier_values"])), cfg, N, K).double()
    wabs = wabs.abs_() + (w64 - wabs).abs()  # outliers are the only difference (distinct positions)
    W = ad._tables(mixed.group_kinds(canon["idx4"], K // cfg.group_size), cfg.group_size, cfg.scale_bits)["src"].numel()
    nnz_row = int(canon["outlier_row_ptr"].long().diff().max())
    s_max = float((canon["scale_scale"].double().abs() * ((1 << cfg.scale_bits) - 1) + canon["scale_zero"].double().abs()).max())
    return mod, cfg, w64, wabs, (W + 64 + nnz_row) * U32 + 8 * U16, W * 2.0 ** -25 * s_max


def _check(layer, x, dtype, **kw):
    mod, cfg, w64, wabs, rel, sub = layer  # the module docstring's bound: rel·mag + sub·max|x|
    N, K = mod.out_features, mod.in_features
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    y64 = x.double() @ w64.T + (0 if mod.bias is None else mod.bias.double())
    mag = x.double().abs() @ wabs.T
    bufs = {n: b for n, b in zip(mod._packed_names, mod.packed())}
    poison_cuda_allocator()
    y = ad.linear(x, bufs, mod.bias, cfg, N, K, **kw)
    assert y.dtype == dtype and y.shape == (x.shape[0], N)
    bound = rel * mag + sub * x.double().abs().amax(1, keepdim=True) + eps * y64.abs()
    if kw.get("outliers") == "separate":  # the kernel's output is rounded before the SpMV is added
        bound = bound + 2 * eps * mag
    err = (y.double() - y64).abs()
    assert (err <= bound).all(), err.max().item()
    poison_cuda_allocator()
    assert torch.equal(ad.linear(x, bufs, mod.bias, cfg, N, K, **kw), y)  # bitwise reproducible
    return y


@gpu
@pytest.mark.parametrize("N,K", GPU_SHAPES)
@pytest.mark.parametrize("outlier_ratio", [0.0, 0.005])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference_and_is_deterministic(dtype, outlier_ratio, N, K):
    assert ad.available() is None, ad.available()
    layer = _gpu_layer(N, K, 0.25, outlier_ratio, True)
    mod, cfg = layer[:2]
    assert mod.layout == "async_dequant"
    for M in GPU_M:
        x = torch.randn(M, K, device="cuda").to(dtype)
        assert mod.kernel(x).backend == "async_dequant"
        y = _check(layer, x, dtype)
        assert torch.equal(mod(x), y)
        sync = ad.linear(x, {n: b for n, b in zip(mod._packed_names, mod.packed())}, mod.bias, cfg, N, K,
                         async_dequant=False)
        assert torch.equal(sync, y)  # same arithmetic in the same order
    # beyond the GEMV's batches: the dequantize kernel + cuBLAS, within the bound plus Ŵ's rounding to dtype
    x = torch.randn(65, K, device="cuda", dtype=dtype)
    assert mod.kernel(x).backend == "mixed_dequant"
    eps = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    mag = x.double().abs() @ layer[3].T
    y64 = x.double() @ layer[2].T + mod.bias.double()
    assert ((mod(x).double() - y64).abs() <= layer[4] * mag + eps * (mag + y64.abs())).all()


@gpu
@pytest.mark.parametrize("ratio_4bit", [0.0, 1.0])
@pytest.mark.parametrize("N,K", [(576, 576), (1536, 576), (4096, 4096)])
def test_kernel_without_4bit_groups_and_all_4bit(ratio_4bit, N, K):
    layer = _gpu_layer(N, K, ratio_4bit, 0.005 if ratio_4bit == 0 else 0.0, False)
    for dtype in (torch.float16, torch.bfloat16):
        for M in (1, 8, 33):
            _check(layer, torch.randn(M, K, device="cuda").to(dtype), dtype)


@gpu
@pytest.mark.parametrize("N,K", [(576, 576), (4096, 4096)])
def test_separate_outlier_path_matches(N, K):
    layer = _gpu_layer(N, K, 0.25, 0.005, True)
    for M in (1, 8):
        _check(layer, torch.randn(M, K, device="cuda").half(), torch.float16, outliers="separate")



@gpu
@pytest.mark.parametrize("outlier_ratio", [0.0, 0.005])
def test_dequantize_op_is_the_format_bit_for_bit(outlier_ratio):
    """``mixed_dequantize`` on the GPU: the format's float32 Ŵ exactly (outliers included), and its one rounding to
    fp16/bf16; also the layout's dequantize (the backward pass)."""
    mod, cfg, w64 = _gpu_layer(1536, 576, 0.25, outlier_ratio, True)[:3]
    held = {n: b for n, b in zip(mod._packed_names, mod.packed())}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_cuda_allocator()
        assert torch.equal(ad.dequantize(held, cfg, 1536, 576, dtype), w64.float().to(dtype)), dtype
    assert torch.equal(mod.dequantize(), w64.float())


# --- the dequantize kernel (mixed_dequant.cu: Ŵ for cuBLAS above the GEMV's batches, and the backward pass) -------
_DEQUANT_DRIVER = r'''// Driver: reads one call from argv[1] (header, codes, meta, sq, tab, outliers), runs the source's own
// mixed_dequantize (kernel choice, grid, shared memory) and writes Ŵ (fp32 [N, K]) to argv[2].
int main(int argc, char** argv) {
  using namespace qlinear;
  using namespace qlinear::mixed;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 13);
  const int N = h[0], K = h[1], W = h[2], G = h[3], MW = h[4], S2 = h[8], nnz = h[9], T = (W + 3) / 4;
  auto codes = emu_read<unsigned>(f, (size_t)N * W);
  auto meta = emu_read<unsigned>(f, (size_t)MW * N);
  auto sq = emu_read<unsigned>(f, (size_t)T * S2 * h[12]);
  auto tab = emu_read<int>(f, G + W + T);
  auto values = emu_read<uint16_t>(f, nnz);
  auto cols = emu_read<char>(f, (size_t)nnz * (h[10] ? 4 : 2));
  auto row_ptr = emu_read<int>(f, nnz ? N + 1 : 0);
  fclose(f);
  MixedGemvArgs a{};
  a.codes = codes.data(); a.meta = meta.data(); a.sq = sq.data(); a.tab = tab.data();
  if (nnz) { a.outlier_values = values.data(); a.outlier_cols = cols.data(); a.outlier_row_ptr = row_ptr.data(); }
  a.cols_int32 = h[10];
  a.N = N; a.K = K; a.W = W; a.G = G; a.MW = MW; a.S2 = S2; a.P = h[12];
  a.group_size = h[5]; a.scale_bits = h[6]; a.scale_group_size = h[7];
  if (h[11] == 0) {  // fp32 Ŵ
    std::vector<float> w((size_t)N * K, NAN);
    a.y = w.data();
    emu_check(mixed_dequantize(a, DType::kFloat, nullptr));
    FILE* o = fopen(argv[2], "wb"); fwrite(w.data(), 4, w.size(), o); fclose(o);
    return 0;
  }
  std::vector<uint16_t> w((size_t)N * K, 0x7E00);  // fp16 (h[11] = 1) or bf16 (2) Ŵ, written as fp32
  a.y = w.data();
  emu_check(mixed_dequantize(a, h[11] == 1 ? DType::kHalf : DType::kBFloat16, nullptr));
  emu_write(argv[2], w, h[11] == 2);
  return 0;
}
'''


@pytest.fixture(scope="module")
def dequant_emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(tmp_path_factory.mktemp("dequant_emu"), "async_dequant/mixed_dequant.cu",
                                ("extern __shared__ __align__(16) unsigned char smem_raw[];",
                                 "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(::g_smem4);"), "",
                                _DEQUANT_DRIVER, launches=True)


@pytest.mark.parametrize("name,N,K", [("default", 100, 112), ("g32", 130, 256), ("g48_sb8_sg7", 96, 480),
                                      ("no_4bit", 64, 320), ("all_4bit", 64, 320), ("outliers_0.005", 200, 400),
                                      ("sb2_no_outliers", 70, 144), ("g64", 72, 640)])
def test_dequantize_kernel_source_is_the_format_bit_for_bit(dequant_emulator, name, N, K):
    """mixed_dequant.cu under the host emulation: the format's float32 Ŵ (second-order scales, both group kinds,
    outliers) exactly, and its one rounding to fp16 and bf16, bit for bit (group sizes that 64 divides and not; N not
    a multiple of the block's 128 rows)."""
    from cuda_emulation import run

    cfg = CONFIGS[name]
    canon = ad.random_buffers(N, K, cfg, seed=N * K + 1)
    bufs = ad.repack(canon, cfg, N, K)
    nnz = bufs["ad_outlier_values"].numel()
    hdr = [N, K, _W(bufs, cfg), K // cfg.group_size, bufs["ad_meta"].shape[0], cfg.group_size, cfg.scale_bits,
           cfg.scale_group_size, bufs["ad_sqt"].shape[1], nnz, int(bufs["ad_outlier_cols"].dtype == torch.int32)]
    outliers = [bufs[k] for k in ("ad_outlier_values", "ad_outlier_cols", "ad_outlier_row_ptr")] if nnz else []
    want = mixed.dequantize(canon, cfg, N, K)
    for code, dtype, bits in ((0, torch.float32, torch.int32), (1, torch.float16, torch.int16),
                              (2, torch.bfloat16, torch.int16)):
        w = run(dequant_emulator, hdr + [code, bufs["ad_sqt"].shape[2]],
                [*(bufs[k] for k in ("ad_codes", "ad_meta", "ad_sqt", "ad_tab")), *outliers], (N, K))
        assert torch.equal(w.to(dtype).view(bits), want.to(dtype).view(bits)), dtype


_CANONICAL_DRIVER = r'''// Driver: reads one call from argv[1] (header, then the canonical buffers idx4, qweight2, qweight4, zeros2, zeros4,
// scale_codes, scale_scale, scale_zero, outliers), runs the source's own mixed_dequantize_canonical and writes Ŵ (as fp32
// [N, K]) to argv[2].  Header: N, K, group size, G4, scale bits, scale group size, S2, words per row of q2, q4, z2, z4
// and scale_codes, nnz, int32 columns, output (0/1/2: fp32/fp16/bf16).
int main(int argc, char** argv) {
  using namespace qlinear;
  using namespace qlinear::mixed;
  FILE* f = fopen(argv[1], "rb");
  auto h = emu_read<int>(f, 15);
  const int N = h[0], K = h[1], G = K / h[2], G4 = h[3], S2 = h[6], nnz = h[12];
  auto idx4 = emu_read<int>(f, G4);
  auto q2 = emu_read<unsigned>(f, (size_t)N * h[7]);
  auto q4 = emu_read<unsigned>(f, (size_t)N * h[8]);
  auto z2 = emu_read<unsigned>(f, (size_t)N * h[9]);
  auto z4 = emu_read<unsigned>(f, (size_t)N * h[10]);
  auto sc = emu_read<unsigned>(f, (size_t)G * h[11]);
  auto ss = emu_read<uint16_t>(f, (size_t)G * S2);
  auto sz = emu_read<uint16_t>(f, (size_t)G * S2);
  auto values = emu_read<uint16_t>(f, nnz);
  auto cols = emu_read<char>(f, (size_t)nnz * (h[13] ? 4 : 2));
  auto row_ptr = emu_read<int>(f, nnz ? N + 1 : 0);
  fclose(f);
  MixedCanonicalArgs a{idx4.data(), q2.data(), q4.data(), z2.data(), z4.data(), sc.data(), ss.data(), sz.data(),
                       nnz ? values.data() : nullptr, cols.data(), row_ptr.data(), nullptr,
                       N, K, h[2], G4, h[4], h[5], S2, h[7], h[8], h[9], h[10], h[11], h[13]};
  if (h[14] == 0) {  // fp32 Ŵ
    std::vector<float> w((size_t)N * K, NAN);
    a.w = w.data();
    emu_check(mixed_dequantize_canonical(a, DType::kFloat, nullptr));
    FILE* o = fopen(argv[2], "wb"); fwrite(w.data(), 4, w.size(), o); fclose(o);
    return 0;
  }
  std::vector<uint16_t> w((size_t)N * K, 0x7E00);  // fp16 (h[14] = 1) or bf16 (2) Ŵ, written as fp32
  a.w = w.data();
  emu_check(mixed_dequantize_canonical(a, h[14] == 1 ? DType::kHalf : DType::kBFloat16, nullptr));
  emu_write(argv[2], w, h[14] == 2);
  return 0;
}
'''


@pytest.fixture(scope="module")
def canonical_emulator(tmp_path_factory):
    import cuda_emulation

    return cuda_emulation.build(tmp_path_factory.mktemp("canonical_emu"), "async_dequant/mixed_dequant.cu",
                                ("extern __shared__ __align__(16) unsigned char smem_raw[];",
                                 "unsigned char* smem_raw = reinterpret_cast<unsigned char*>(::g_smem4);"), "",
                                _CANONICAL_DRIVER, launches=True, sanitize=True)


CANONICAL = {  # config, N, K: group sizes the layout cannot hold, a last run cut short
    "g8": (mixed.Config(group_size=8), 37, 200),
    "g4_tiny": (mixed.Config(group_size=4, ratio_4bit=0.5), 3, 12),
    "g24_sb2_sg7_outliers_anywhere": (mixed.Config(group_size=24, scale_bits=2, scale_group_size=7,
                                                   outlier_ratio=0.005, outlier_placement="any"), 45, 96),
    "g12_no_4bit": (mixed.Config(group_size=12, ratio_4bit=0.0, outlier_ratio=0.005), 70, 36),
    "g40_all_4bit": (mixed.Config(group_size=40, ratio_4bit=1.0, outlier_ratio=0.0), 9, 120),
    "g16_default": (DEFAULT, 100, 112),
    "g8_int32_columns": (mixed.Config(group_size=8, outlier_ratio=0.005), 2, 32776),
}


@pytest.mark.parametrize("name", CANONICAL)
def test_canonical_dequantize_kernel_source_is_the_format_bit_for_bit(canonical_emulator, name):
    """mixed_dequant.cu's kernel over the canonical buffers, under the host emulation (AddressSanitizer on): the
    format's float32 Ŵ exactly (both group kinds, second-order scales, outliers anywhere, int16 and int32 columns), and
    its one rounding to fp16 and bf16, bit for bit."""
    from cuda_emulation import run

    cfg, N, K = CANONICAL[name]
    bufs = ad.random_buffers(N, K, cfg, seed=N + K)
    nnz = bufs["outlier_values"].numel()
    assert (bufs["outlier_cols"].dtype == torch.int32) == (K > 32767)
    names = ("idx4", "qweight2", "qweight4", "zeros2", "zeros4", "scale_codes")
    hdr = [N, K, cfg.group_size, bufs["idx4"].numel(), cfg.scale_bits, cfg.scale_group_size,
           bufs["scale_scale"].shape[1], *(bufs[k].shape[1] for k in names[1:]), nnz,
           int(bufs["outlier_cols"].dtype == torch.int32)]
    outliers = [bufs[k] for k in ("outlier_values", "outlier_cols", "outlier_row_ptr")] if nnz else []
    want = mixed.dequantize(bufs, cfg, N, K)
    for code, dtype, bits in ((0, torch.float32, torch.int32), (1, torch.float16, torch.int16),
                              (2, torch.bfloat16, torch.int16)):
        w = run(canonical_emulator, hdr + [code], [*(bufs[k] for k in names), bufs["scale_scale"], bufs["scale_zero"],
                                                   *outliers], (N, K))
        assert torch.equal(w.to(dtype).view(bits), want.to(dtype).view(bits)), dtype


def test_canonical_entry_points_on_the_emulated_op(canonical_emulator, monkeypatch):
    """The registry's kernel for a mixed layer the layout cannot hold (group size 8), its entry point on
    ``torch.ops.qlinear.mixed_dequantize_canonical`` served by the source under the host emulation: the buffers reach
    the op in the schema's order (Ŵ exactly the format's), and ``linear_canonical`` gives ``[..., N]`` within fp16
    rounding of the float64 product, bias added."""
    from cuda_emulation import run

    def op(idx4, q2, q4, z2, z4, sc, ss, sz, values, cols, row_ptr, N, K, group_size, scale_bits, scale_group_size,
           dtype):
        nnz = 0 if values is None else values.numel()
        hdr = [N, K, group_size, idx4.numel(), scale_bits, scale_group_size, ss.shape[1], q2.shape[1], q4.shape[1],
               z2.shape[1], z4.shape[1], sc.shape[1], nnz, int(nnz > 0 and cols.dtype == torch.int32),
               {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]]
        return run(canonical_emulator, hdr, [idx4, q2, q4, z2, z4, sc, ss, sz, *((values, cols, row_ptr) if nnz else ())],
                   (N, K)).to(dtype)

    monkeypatch.setattr(torch.ops.qlinear, "mixed_dequantize_canonical", op)
    N, K = 48, 200
    torch.manual_seed(3)
    mod = MixedPrecisionLinear.from_linear(torch.nn.Linear(K, N), mixed.Config(group_size=8, outlier_ratio=0.005),
                                           backend="reference")
    bufs, cfg = mod.canonical(), mod.config
    assert bufs["outlier_values"].numel() > 0
    assert "multiple of 16" in ad.supports(cfg, N, K)  # the layout cannot hold it
    w = mixed.dequantize(bufs, cfg, N, K)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(ad.dequantize_canonical(bufs, cfg, N, K, dtype), w.to(dtype)), dtype
    x = torch.randn(2, 5, K).half()
    y = ad.linear_canonical(x, bufs, mod.bias, cfg, N, K)
    y64 = x.double() @ w.double().T + mod.bias.double()
    assert y.shape == (2, 5, N) and y.dtype == torch.float16
    assert ((y.double() - y64).abs() <= 2.0 ** -9 * (x.double().abs() @ w.double().abs().T) + 1e-3).all()


@pytest.mark.gpu
@pytest.mark.parametrize("group_size,N,K", [(8, 1536, 576), (24, 100, 1536), (16, 300, 576)])
def test_canonical_dequantize_op_and_forward_on_the_gpu(group_size, N, K):
    """``mixed_dequantize_canonical`` on the GPU: the format's float32 Ŵ exactly, and its one rounding to fp16/bf16; a
    layer of a group size the layout cannot hold is served by it at every batch (g16: the op alone, which reads any
    group size), within fp16 GEMM rounding of the float64 product."""
    assert ad.available() is None, ad.available()
    cfg = mixed.Config(group_size=group_size, outlier_ratio=0.005)
    bufs = {k: v.cuda() for k, v in ad.random_buffers(N, K, cfg, seed=group_size).items()}
    want = mixed.dequantize(bufs, cfg, N, K)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_cuda_allocator()
        assert torch.equal(ad.dequantize_canonical(bufs, cfg, N, K, dtype), want.to(dtype)), dtype
    if group_size % 16 == 0:
        return
    mod = MixedPrecisionLinear.from_linear(torch.nn.Linear(K, N), cfg, backend="reference")
    w = mixed.dequantize(mod.canonical(), mod.config, N, K).double()
    mod.backend = None
    mod.cuda()
    for dtype in (torch.float16, torch.bfloat16):
        for M in (1, 8, 300):
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            assert mod.kernel(x).backend == "mixed_canonical"
            y64 = x.double().cpu() @ w.T + mod.bias.detach().double().cpu()
            err = (mod(x).double().cpu() - y64).abs()
            assert (err <= 2.0 ** -7 * (x.double().abs().cpu() @ w.abs().T) + 1e-3).all(), (dtype, M, err.max().item())


def test_plan_keeps_the_8_row_kernels_launch_bounds():
    """At 8 rows of x (and so for every chunk of a larger batch) a block may have at most mixed_gemv.h's
    kMaxThreadsM8 threads (the kernel's ``__launch_bounds__``: a larger block fails to launch); plan keeps to it on
    every shape (a batch above 8 is planned as 8 rows), while smaller batches may still take 256-thread blocks."""
    import re
    from pathlib import Path

    header = (Path(ad.__file__).parent / "mixed_gemv.h").read_text()
    assert int(re.search(r"constexpr int kMaxThreadsM8 = (\d+);", header).group(1)) == ad.MAX_THREADS_M8
    shapes = [(576, 576), (1536, 576), (576, 1536), (8192, 8192), (28672, 8192), (96, 256)]
    for N, K in shapes:
        W = K // 16 + K // 64  # a quarter of the groups 4-bit at group size 16
        for sms in (1, 132):
            assert ad.plan(8, N, K, W, sms)[0] <= ad.MAX_THREADS_M8
    assert max(ad.plan(1, N, K, K // 16 + K // 64, 132)[0] for N, K in shapes) == 256
