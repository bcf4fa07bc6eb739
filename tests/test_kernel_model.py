"""The performance models of benchmarks/kernel_model.py (LUT GEMV, QUICK GEMM, mixed GEMV): their SASS reading, and
their fits kept honest.

The fit test reads the SASS of the kernel the committed H100 rows were measured with (its features for this nvcc from
benchmarks/results/lut-sass-30bf025.json, else compiled from git history), fits the machine constants on every other row and fails if the held-out rows are predicted worse than the issue's bounds
(median |error| <= 30 %, no row off by more than 2x).  Skipped where nvcc, cuobjdump, scipy or that commit is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_model as km  # noqa: E402

SASS = """
        Function : _Z4demo
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0020*/                   LDS R8, [R9] ;
        /*0030*/                   STS [R9], R8 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   LDS R8, [R9+0x400] ;
        /*0060*/                   FADD R8, R8, R4 ;
        /*0070*/                   LDG.E.64.CONSTANT R4, desc[UR4][R2.64] ;
        /*0080*/                   LDG.E R6, desc[UR4][R2.64] ;
        /*0090*/              @!P1 BRA 0x10 ;
        /*00a0*/                   EXIT ;
"""


def test_lookup_loop_reads_the_innermost_loop_with_global_and_shared_loads():
    instrs = km.parse_sass(SASS)["_Z4demo"]
    assert len(instrs) == 11 and instrs[1] == (0x10, "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]")
    # loop 0x20-0x40 has LDS but no LDG; loop 0x10-0x90 minus it: LDG 16 + 8 + 4 bytes, one issued after an LDS
    assert km.lookup_loop(instrs) == (28, True)
    no_prefetch = [(a, i) for a, i in instrs if a not in (0x70, 0x80)]
    assert km.lookup_loop(no_prefetch) == (16, False)
    assert km.lookup_loop([(a, i) for a, i in instrs if not i.startswith("LDS")]) == (0, False)


def test_residency_follows_the_h100_limits():
    assert km.residency(256, 128, 32 * 1024) == 2          # registers: 2 x 256 x 128 = 64 K
    assert km.residency(256, 64, 32 * 1024) == 4           # threads: 2048 / 256... smem allows 6, registers 4
    assert km.residency(32, 40, 64 * 1024) == 3            # shared memory: 3 x (64 + 1) KiB <= 228 KiB
    assert km.residency(32, 32, 0) == 32                   # the block limit
    assert km.residency(256, 129, 0) == 1                  # 129 registers round up to 136 per thread: one block


def test_predict_adds_launch_reduction_and_the_longer_of_chain_and_bandwidth():
    c = dict(t0=3.0, t_red=2.0, L=1.0, L_tab=0.5, c_tab=0.25, c_lds=0.01, BW=2.0)
    f = dict(W=4, tiles=2, tables_per_warp=2, splits=8, waves=1, warps_sm=16, tail_warps_sm=0, lookups=32,
             bytes=10**6, pipelined=False, iterations=8)
    step, tab = 16 * 32 * 0.01, 0.5 + 2 * 0.25
    assert km.predict(f, c) == pytest.approx(3 + 2 + 2 * tab + 8 * (1 + step))
    assert km.predict({**f, "pipelined": True}, c) == pytest.approx(3 + 2 + 1 + 2 * max(tab + 4 * step, 1))
    assert km.predict({**f, "bytes": 10**9, "splits": 1}, c) == pytest.approx(3 + 10**9 / 2e12 * 1e6)
    # a tail wave of 4 warps per SM: one more chain, its lookups queue behind 4 warps instead of 16
    tail = 2 * tab + 8 * (1 + 4 * 32 * 0.01)
    assert km.predict({**f, "tail_warps_sm": 4}, c) == pytest.approx(3 + 2 + 2 * tab + 8 * (1 + step) + tail)
    assert km.predict({**f, "waves": 0, "warps_sm": 0, "tail_warps_sm": 4}, c) == pytest.approx(3 + 2 + tail)


def test_features_split_the_grid_into_full_waves_and_a_tail():
    """280 blocks of 256 threads, two per SM on 132 SMs: one full wave of 264 and a tail of 16 (one block per SM)."""
    v = km.Version("t", plan=lambda M, N, K, sms, q: (64, 256, 13, 10), sass={(1, 4): km.Sass(128, 368, True)},
                   smem=lambda M, kt: 16 * 1024, words_per_iteration=lambda M, kt: 2)
    f = km.features(v, 1, 28672, 8192, 4, 128)
    assert (f["waves"], f["warps_sm"], f["tail_warps_sm"]) == (1, 16, 8)
    f = km.features(v, 1, 8192 * 3, 8192, 4, 128)  # 24 x 10 = 240 blocks: no full wave, 2 blocks on most SMs
    assert (f["waves"], f["tail_warps_sm"]) == (0, 16)


def _tools_or_skip():
    pytest.importorskip("scipy")
    if km.nvcc() is None or km.cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    r = subprocess.run(["git", "-C", str(km.ROOT), "cat-file", "-e", km.MEASURED_COMMIT], capture_output=True)
    if r.returncode:
        pytest.skip(f"commit {km.MEASURED_COMMIT} (the measured kernel) is not in this checkout's history")


@pytest.fixture(scope="module")
def versions(sm90a_cubin):
    """The measured kernel's SASS features (km.MEASURED_SASS, or compiled where this nvcc has no entry) and this
    checkout's, from the build test_native_build shares."""
    _tools_or_skip()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        measured = pool.submit(km.measured_version, Path(tmp))
        current = pool.submit(km.current_version, Path(tmp), sm90a_cubin)
        return measured.result(), current.result()


@pytest.mark.slow
def test_fit_predicts_held_out_h100_rows_within_bounds(versions):
    measured, _ = versions
    rows = km.read_rows()
    assert len(rows) >= 80 and all(t > 0 for *_, t in rows)
    res = km.check(measured, rows)
    assert len(res.held_out) == len(rows) // 2
    assert res.median_error <= 0.30 and res.worst_factor <= 2.0, (res.median_error, res.worst_factor)
    # the fitted constants stay physical: a launch of a few µs, a DRAM round trip under 2 µs, HBM-like bandwidth
    c = res.constants
    assert 0.5 < c["t0"] < 8 and 0.1 < c["L"] < 2 and 1.5 < c["BW"] < 3.5, c


@pytest.mark.slow
def test_current_kernel_keeps_a_tile_of_words_in_flight(versions):
    """The SASS of this checkout's kernel: the lookup loop loads the next tile (all W words of every plane) after its
    first lookup, for every batch and bit width; the 2026-11-23 kernel loaded one word per iteration, then waited."""
    measured, current = versions
    from qlinear.backends import cuda_lut

    for (M, Q), s in current.sass.items():
        assert s.pipelined and s.loop_bytes >= 16 * Q * cuda_lut.words(M, Q), (M, Q, s)
        assert s.regs <= 65536 // (256 * cuda_lut.resident(Q))  # two 256-thread blocks per SM (one past 4 planes)
    assert not any(s.pipelined for s in measured.sass.values())
    # one word per iteration: Q plane words (16 B), Q α (8 B), the offset (8 B fp16 or 16 B fp32 path)
    assert all(s.loop_bytes <= 24 * Q + 24 for (M, Q), s in measured.sass.items())


def test_quick_plan_of_the_measured_kernel():
    """quick.plan at 30bf025 on 132 SMs, as RESULTS.md describes it: 8192² at M = 1 five splits of 26 tiles, at M = 32
    two of 64, at M = 64 one of 128 (64 blocks: half the SMs idle)."""
    assert km.quick_plan_2026_11_23(1, 8192, 8192, 132) == (16, 26, 5)
    assert km.quick_plan_2026_11_23(32, 8192, 8192, 132) == (32, 64, 2)
    assert km.quick_plan_2026_11_23(64, 8192, 8192, 132) == (64, 128, 1)
    assert km.quick_plan_2026_11_23(256, 8192, 8192, 132) == (128, 128, 1)


def test_quick_predict_waits_per_tile_without_a_ring_and_overlaps_with_one():
    c = dict(t0=3.0, t_red=2.0, L=1.0, c_cvt=0.02, c_mma=0.01, BW=2.0)
    f = dict(tiles=10, mt=2, splits=4, waves=0, warps_sm=0, tail_warps_sm=8, bytes=10**6, depth=1)
    step = 8 * (0.02 + 2 * 0.01)
    assert km.quick_predict(f, c) == pytest.approx(3 + 2 + 10 * (1 + step))
    assert km.quick_predict({**f, "depth": 4}, c) == pytest.approx(3 + 2 + 1 + 10 * max(1 / 4, step))
    assert km.quick_predict({**f, "depth": 4, "tail_warps_sm": 1}, c) == pytest.approx(3 + 2 + 1 + 10 * 0.25)
    assert km.quick_predict({**f, "bytes": 10**9, "splits": 1}, c) == pytest.approx(3 + 10**9 / 2e12 * 1e6)


def test_quick_fit_predicts_held_out_h100_rows_within_bounds():
    """Fitted on the H100 dispatch table's 2-bit QUICK rows, the model predicts its 4-bit rows (same shapes and M)
    within the issue's bounds, with physical constants."""
    pytest.importorskip("scipy")
    rows = km.quick_rows()
    assert len(rows) >= 80 and {q for *_, q, g, t in rows} == {2, 4}
    res = km.quick_check(rows)
    assert len(res.held_out) == len(rows) // 2 and {r[3] for r in res.held_out} == {4}
    assert res.median_error <= 0.30 and res.worst_factor <= 2.0, (res.median_error, res.worst_factor)
    c = res.constants
    assert 0.5 < c["t0"] < 8 and 0.2 < c["L"] < 3 and 1.5 < c["BW"] < 3.5, c


def test_quick_predict_takes_issue_and_mma_bounds_from_the_sass_count():
    c = dict(t0=3.0, t_red=2.0, L=1.0, c_cvt=0.0, c_mma=0.0, BW=2.0)
    f = dict(tiles=10, mt=1, splits=1, waves=1, warps_sm=16, tail_warps_sm=0, bytes=0, depth=4, ins=400.0)
    issue = 16 * 10 * 400 / km.QUICK_ISSUE_PER_NS / 1e3
    assert km.quick_predict(f, c) == pytest.approx(3 + max(1 + 10 * 0.25, issue))
    mma = 16 * 10 * 4 * 16 / 4 * km.QUICK_HMMA_CYCLES / km.CLOCK_GHZ / 1e3
    assert km.quick_predict({**f, "mt": 4}, c) == pytest.approx(3 + max(issue, mma))
    assert km.quick_predict({**f, "ins": 0.0}, c) == pytest.approx(3 + 1 + 10 * 0.25)  # no SASS count: latency only
    assert km.quick_predict({**f, "splits": 4}, c) - km.quick_predict(f, c) == pytest.approx(2.0)  # t_red


def test_main_loop_instructions_count_the_mma_loop_without_its_nested_loops():
    instrs = km.parse_sass("""
        Function : _Z1k
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0020*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0030*/               @P0 BRA 0x20 ;
        /*0040*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0050*/              @!P1 BRA 0x10 ;
        /*0060*/                   FADD R8, R8, R9 ;
        /*0070*/              @!P2 BRA 0x60 ;
        /*0080*/                   EXIT ;
""")["_Z1k"]
    assert km.main_loop_instructions(instrs) == 3  # 0x10, 0x40, 0x50; the nested 0x20-0x30 and the MMA-free loop out


@pytest.mark.slow
def test_quick_model_predicts_the_register_ring_kernels_h200_rows():
    """The fitted constants with the SASS of the kernel the 2026-11-27 H200 rows ran (its instructions per tile and
    registers) predict those rows within the issue's bounds; the issue rate and the MMA rate come from one row each."""
    pytest.importorskip("scipy")
    if km.nvcc() is None or km.cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump")
    try:
        subprocess.run(["git", "-C", str(km.ROOT), "cat-file", "-e", km.QUICK_RING_COMMIT], check=True,
                       capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip(f"git history with {km.QUICK_RING_COMMIT} is not here")
    with tempfile.TemporaryDirectory() as tmp:
        src = km.checkout(km.QUICK_RING_COMMIT, Path(tmp), "backends/quick")
        sass = km.quick_sass(src, src)
    rows = km.quick_bench_rows()
    assert len(rows) == 12 and {M for _, _, M, *_ in rows} == {1, 16, 64, 256}
    res = km.quick_ring_check(km.quick_check().constants, sass, rows)
    assert res.median_error <= 0.30 and res.worst_factor <= 2.0, res.held_out


def test_mixed_words_and_plan_of_the_measured_kernels():
    """The format's defaults at K = 8192: 512 groups of 16, 128 of them 4-bit (two words each): 640 words, 40 % of them
    4-bit.  async_dequant.plan from 30bf025 to ac34c79 at 8192², M = 1: 256-thread blocks (16 along N) aiming at 768
    resident threads, ceil(132·768/256/16) = 25 splits of ceil(160/25) = 7 tiles, so 23 splits."""
    assert km.mixed_words(8192, 8192) == (640, 0.4)
    assert km.mixed_plan_2026_11_23(1, 8192, 8192, 640, 132) == (256, 7, 23)


def test_mixed_features_count_the_warp_tiles_of_the_busiest_sm():
    """368 blocks of 8 warps, 3 resident per SM (79 registers): no full wave of 396, at most 3 blocks on an SM, each
    warp walking 7 tiles; instructions per tile mixed 60/40 between 2- and 4-bit words; the split partials added."""
    f = km.mixed_features(1, 8192, 8192, 10**6, {(1, True): (79, 600, 500)})
    assert f == dict(splits=23, warp_tiles=3 * 8 * 7, ins=pytest.approx(0.6 * 600 + 0.4 * 500),
                     bytes=10**6 + 8 * 23 * 8192)


def test_mixed_features_refuse_batches_a_launch_does_not_run():
    with pytest.raises(ValueError, match="1..8"):
        km.mixed_features(9, 8192, 8192, 10**6, {(8, True): (145, 1370, 1018)})


def test_mixed_predict_is_launch_reduction_and_the_longer_of_issue_and_bandwidth():
    """``t0``, ``t_red`` where the launch is split, then the busiest SM's instructions at ``rate`` or the bytes at
    ``BW``, whichever takes longer."""
    c = dict(t0=3.0, t_red=2.0, rate=5.0, BW=2.0)
    f = dict(splits=4, warp_tiles=100, ins=500.0, bytes=10**6)
    assert km.mixed_predict(f, c) == pytest.approx(3 + 2 + 100 * 500 / 5.0 / 1e3)
    assert km.mixed_predict({**f, "bytes": 10**8, "splits": 1}, c) == pytest.approx(3 + 10**8 / 2e12 * 1e6)


def test_main_loop_counts_the_largest_loop_with_a_global_load_predicated_or_not():
    instrs = km.parse_sass("""
        Function : _Z1m
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P2 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0020*/                   HFMA2 R8, R4, R5, R8 ;
        /*0030*/                   LOP3.LUT R6, R6, 0x3, RZ, 0xc0, !PT ;
        /*0040*/              @!P1 BRA 0x10 ;
        /*0050*/                   LDGSTS.E.128 [R9], desc[UR4][R2.64] ;
        /*0060*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0070*/                   IADD3 R6, R6, 0x1, RZ ;
        /*0080*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0090*/                   IADD3 R8, R8, 0x1, RZ ;
        /*00a0*/               @P0 BRA 0x50 ;
        /*00b0*/                   EXIT ;
""")["_Z1m"]
    # the predicated LDG counts, the longer loop of only LDGSTS (a cp.async) does not
    assert km.main_loop(instrs, km._GLOBAL_LOAD.search) == 4
    assert km.main_loop(instrs, lambda i: "LDGSTS" in i) == 6


def test_mixed_sass_features_round_trip_through_their_json():
    sass = {(1, True): (79, 635, 516), (8, False): (145, 1370, 1018)}
    assert km.mixed_sass_from_json(json.loads(json.dumps(km.mixed_sass_json(sass)))) == sass


def test_mixed_sass_can_specialise_this_checkouts_kernel():
    """mixed_sass builds the kernel with entry_is4 fixed to false and to true: the definition it rewrites is there."""
    assert km._IS4.search((km.ROOT / km.MIXED_SOURCE).read_text())


@pytest.mark.slow
def test_mixed_model_predicts_held_out_h100_rows_and_later_kernels_h200_rows():
    """Fitted on half the H100 rows of the 2026-11-23 kernel (static SASS counts per tile, its plan), the model predicts
    the other half and, with nothing fitted on them, H200 rows (of the same source and of two later kernels) within
    the issue's bounds."""
    pytest.importorskip("scipy")
    if km.nvcc() is None or km.cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sass = {c: km.mixed_measured_sass(c, Path(tmp)) for c in (km.MIXED_H100[0], *(c for c, _ in km.MIXED_H200))}
        except subprocess.CalledProcessError:
            pytest.skip("this nvcc has no saved features and the measured commits are not in git history")
    rows = km.mixed_rows(km.MIXED_H100[1])
    assert len(rows) == 20 and {M for _, _, M, _, _ in rows} == {1, 2, 4, 8}
    res = km.mixed_check(sass[km.MIXED_H100[0]], rows)
    assert res.median_error <= 0.30 and res.worst_factor <= 2.0, res.held_out
    # and what it reaches (4 %, 1.12x on 2026-11-27): counting the M = 1 kernel's instructions at every M gives 25 %, 1.7x
    assert res.median_error <= 0.10 and res.worst_factor <= 1.25, res.held_out
    c = res.constants
    # physical: a launch of a few µs, under one instruction per scheduler and cycle (4 × 1.98 per ns)
    assert 0.5 < c["t0"] < 8 and 1.0 < c["rate"] < 4 * km.CLOCK_GHZ, c
    h200 = km.mixed_h200_check(c, sass)
    assert len(h200.held_out) == 6
    assert h200.median_error <= 0.30 and h200.worst_factor <= 2.0, h200.held_out


@pytest.mark.slow
def test_uniform_gemm_model_reads_every_instantiation_of_this_checkouts_kernel():
    """``--uniform8``: the 8-bit GEMM's registers and instructions per step for every tile size and both grids (fp16),
    and predictions on the QUICK constants that never undercut the bytes and grow with M once MMA-bound."""
    pytest.importorskip("scipy")
    if km.nvcc() is None or km.cuobjdump() is None:
        pytest.skip("needs nvcc and cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        sass = km.uniform_gemm_sass(km.ROOT, Path(tmp))
    assert set(sass) == {(t, sym) for t in (16, 32, 64, 128) for sym in (False, True)}
    assert all(0 < regs <= 255 and 100 < ins < 2000 for regs, ins in sass.values())
    c = km.quick_check().constants
    f = {M: km.uniform_gemm_features(M, 8192, 8192, 128, sass) for M in (16, 64, 128, 256)}
    t = {M: km.quick_predict(f[M], c) for M in f}
    assert all(t[M] >= f[M]["bytes"] / c["BW"] / 1e6 for M in f)
    assert t[16] < t[64] < t[128] < t[256]
    assert f[64]["depth"] == 2 and f[16]["depth"] == 3
