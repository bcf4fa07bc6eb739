#!/bin/bash
# Every GPU check the CUDA backends (cuda_lut, quick, async_dequant) still need, for the device tool
# (each device call is limited to 10 minutes, so the work is split into stages; run them in order):
#   bash benchmarks/gpu_checks.sh build      # JIT-build the three extensions (cached in .qlinear-cache on that machine)
#   bash benchmarks/gpu_checks.sh test [kernels|rest]  # GPU tests of every backend (all, or in two halves)
#   bash benchmarks/gpu_checks.sh sanitize [memcheck|racecheck]  # compute-sanitizer over one run of each kernel
#   bash benchmarks/gpu_checks.sh bench      # bench_gemv.py (LUT + mixed rows), bench_gemm.py, bench_dequant.py
#   bash benchmarks/gpu_checks.sh tune       # tune_dispatch.py: writes backends/dispatch/<gpu>.json
#   bash benchmarks/gpu_checks.sh e2e [fp16|bcq4|bcq3]  # bench_e2e.py, all variants or one per call (compiles are slow)
#   bash benchmarks/gpu_checks.sh tp         # bench_tp.py --single cuda: act_order reordered vs the g_idx path
#   bash benchmarks/gpu_checks.sh sweep      # sweep_plans.py: every launch around plan() of the LUT GEMV and QUICK
#   bash benchmarks/gpu_checks.sh ncu [NxK] [bits] [M] [cuda_lut|quick|lut_dequant]  # ncu --set full, one call (profile_one.py)
#   bash benchmarks/gpu_checks.sh quick      # build + tests + the --quick benchmarks, one short call
#   bash benchmarks/gpu_checks.sh session    # one ~9-minute call for a 15-minute lease: build; every gpu-marked test
#                                            # with memcheck + racecheck of the LUT GEMV beside it; bench_gemv's issue-23
#                                            # rows; bench_gemm --quick (GemLite too); ncu of the LUT GEMV, 8192² q4 M1
#   bash benchmarks/gpu_checks.sh lease      # one ~8-minute call: build; gpu tests + memcheck of quick/mixed/codebook
#                                            # (+ $EXTRA); bench_gemm --quick, bench_gemv's 8192²/28672x8192/576² rows, bench_dequant
#                                            # (+ bench_rotation on each backend of $ROTATION and cuda_rotate's slice sweep; the plan sweeps with
#                                            # SWEEP=1; $WORKERS, $TEST_SLOT, $SAN_TIMEOUT
#                                            # and $MEMCHECK, "file:-k expression;..." of tests/test_<file>.py, size the first part)
#   bash benchmarks/gpu_checks.sh test compile  # the torch.compile tests alone (cuda_lut's two failed on 2026-11-26)
#   bash benchmarks/gpu_checks.sh rotation   # build; rotation GPU tests; bench_rotation.py on the three fusing kernels
#                                            # (fused R·x against the op's transform, issue 27; never run on a GPU yet)
# Outputs land in $OUT (or ./gpu-out) for benchmarks/RESULTS.md.  GemLite is installed from wheels/ if present
# (there is no internet on the GPU machine: build it here with
#  `pip wheel --no-deps --no-build-isolation gemlite==0.6.0.post2 -w wheels/` and carry wheels/).
# Seen on the H100 (2026-11-23): the build takes ~50 s (carrying a .qlinear-cache from another machine does not
# save it); `test` needs more than one 10-minute call (88 % done after 400 s with -n 4; the two
# test_compile_fullgraph_matches_eager cases take 67 s each), so run it as `test kernels` then `test rest`.
# Seen on an H200 (2026-11-26): the build takes ~60 s; `test gpu` (the 288 gpu-marked tests) 98 % done after 185 s
# with -n 12; `session` took 389 s of a 418 s lease call; GemLite's first calls at 8192² take over 40 s (autotuning).
# H200 (2026-11-27, second run): `lease` with ROTATION="cuda_lut quick async_dequant" took 394 s (the 361 gpu tests
# at -n 15: 354 done in a 205 s slot); a fresh machine's `build` then two benchmarks in 45 s slots printed nothing
# (output was block-buffered, now unbuffered; give a benchmark after a fresh build at least 90 s).
# H200 (2026-11-27): `lease` took 307 s (316 gpu tests: 313 done in its 210 s slot); a second call of 265 s (build,
# 33 tests, bench_gemm --quick, ncu of one QUICK call) left 234 s of the 900: too little to start a third machine.
set -u
STAGE=${1:-quick}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export QLINEAR_CACHE=${QLINEAR_CACHE:-$PWD/.qlinear-cache}
export PYTHONUNBUFFERED=1  # a run cut at its time limit still leaves what it printed
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
ls wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps wheels/*.whl
BACKENDS="cuda_lut quick async_dequant cuda_codebook cuda_uniform"
TESTS="tests/test_cuda_lut.py tests/test_quick.py tests/test_async_dequant.py tests/test_cuda_codebook.py tests/test_cuda_uniform.py tests/test_dispatch.py tests/test_modules.py"

build() {
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
  for b in $BACKENDS; do  # concurrently: each build is mostly one long nvcc process
    python3 -c "from qlinear.backends import $b; print('$b build:', $b.available() or 'ok')" >"$OUT/build_$b.txt" 2>&1 &
  done
  python3 -c "from qlinear.backends import _gpu; print('cuda_rotate build:', _gpu._rotate_library() or 'ok')" \
    >"$OUT/build_cuda_rotate.txt" 2>&1 &
  wait; cat "$OUT"/build_*.txt
  for f in "$OUT"/build_*.txt; do grep -q "build: ok" "$f" || return 1; done
}
# the full log goes to $OUT (a run stopped at its time limit still returns it); -n 4 when pytest-xdist is there
tests() {
  case "${1:-all}" in
    kernels) files="tests/test_cuda_lut.py tests/test_quick.py tests/test_async_dequant.py" ;;
    rest) files="tests/test_dispatch.py tests/test_modules.py" ;;
    gpu) files="$TESTS tests/test_kernel_conformance.py tests/test_quantize_device.py tests/test_rotation.py -m gpu" ;;
    compile) files="tests/test_kernel_conformance.py -m gpu -k compile" ;;  # the slow ones (~60 s each)
    *) files=$TESTS ;;
  esac
  python3 -c "import xdist" 2>/dev/null && XDIST="-n ${WORKERS:-4}" || XDIST=""
  # -v names every result as it comes and --timeout ends a hung test, so a run cut at its limit still says what failed
  python3 -c "import pytest_timeout" 2>/dev/null && TMO="--timeout=${TEST_TIMEOUT:-150}" || TMO=""
  python3 -m pytest -v -rfEs --tb=short --durations=15 -p no:cacheprovider $TMO $XDIST $files \
    >"$OUT/pytest_gpu_${1:-all}.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu_${1:-all}.txt" | tail -20
}
sanitize() {
  for tool in ${1:-memcheck racecheck}; do  # one tool per call fits the 10-minute limit better
    for b in ${2:-$BACKENDS}; do
      timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x \
        -p no:cacheprovider tests/test_$b.py -k "${SAN_K:-kernel_matches and 576-576 and dtype0}" >"$OUT/${tool}_$b.txt" 2>&1
      echo "$tool $b: rc $? $(grep -E 'passed|ERROR SUMMARY' "$OUT/${tool}_$b.txt" | tr '\n' ' ')"
    done
  done
  # SASS of the mixed GEMV (sync mode must issue its code loads after the scale math) and of the QUICK GEMM
  for b in async_dequant quick; do
    cuobjdump -sass "$(find "$QLINEAR_CACHE" -name "qlinear_$b*.so" | head -1)" 2>&1 | gzip > "$OUT/$b.sass.gz"
  done
}

case "$STAGE" in
  build) build ;;
  test) tests "${2:-all}" ;;
  sanitize) sanitize "${2:-}" ;;
  bench)
    python3 benchmarks/bench_gemv.py --markdown "$OUT/bench_gemv.md" 2>&1 | tail -5
    python3 benchmarks/bench_gemm.py --markdown "$OUT/bench_gemm.md" 2>&1 | tail -5
    python3 benchmarks/bench_dequant.py --markdown "$OUT/bench_dequant.md" 2>&1 | tail -5 ;;
  tune) python3 benchmarks/tune_dispatch.py 2>&1 | tail -5; cp backends/dispatch/*.json "$OUT/" ;;
  e2e) python3 benchmarks/bench_e2e.py --variants "${2:-fp16,bcq4,bcq3}" --markdown "$OUT/bench_e2e_${2:-all}.md" 2>&1 | tail -15 ;;
  tp) python3 benchmarks/bench_tp.py --single cuda 2>&1 | tee "$OUT/bench_tp_single.md" | tail -25 ;;
  ncu)  # ncu [NxK] [bits] [M] [cuda_lut|quick|lut_dequant]
    KER=${5:-cuda_lut}
    case "$KER" in quick) RX=quick_gemm_kernel ;; lut_dequant) RX=lut_dequantize_kernel ;; *) RX=lut_gemv_kernel ;; esac
    F="$OUT/ncu_${KER}_${2:-8192x8192}_q${3:-4}_m${4:-1}.txt"
    ncu --set full --clock-control none -k regex:$RX --launch-skip 5 --launch-count 1 python3 benchmarks/profile_one.py \
      --shape "${2:-8192x8192}" --bits "${3:-4}" --M "${4:-1}" --kernel "$KER" >"$F" 2>&1
    tail -60 "$F" ;;
  rotation)
    build
    python3 -m pytest -q -x tests/test_rotation.py -k "stage_the_rotated or cuda_rotate" 2>&1 | tail -3
    for B in cuda_lut quick async_dequant; do
      timeout 120 python3 benchmarks/bench_rotation.py --device cuda --backend $B --batches 1,4,8 --rounds 3 \
        --shapes 576x576,1536x576,4096x4096,8192x8192 2>&1 | tee "$OUT/bench_rotation_$B.md" | tail -14
    done ;;
  sweep) timeout 560 python3 benchmarks/sweep_plans.py --markdown "$OUT/sweep_plans.md" 2>&1 | tail -60 ;;
  quick)
    build; tests
    python3 benchmarks/bench_gemv.py --quick --markdown "$OUT/bench_gemv.md" 2>&1 | tail -12
    python3 benchmarks/bench_gemm.py --quick --markdown "$OUT/bench_gemm.md" 2>&1 | tail -12 ;;
  session)  # at most 8 files come back from the device: the logs travel as one archive, refreshed after each stage
    FINAL=$OUT; export OUT=/tmp/gpu-session; mkdir -p "$OUT"
    snap() { tar czf "$FINAL/session.tgz" -C "$OUT" .; }
    build || { snap; exit 1; }
    (WORKERS=12 timeout 240 bash "$0" test gpu >/dev/null 2>&1) &
    export SAN_TIMEOUT=100 SAN_K="kernel_matches and dtype0-128 and (576-576 or 1024-8192)"
    (sanitize memcheck cuda_lut; sanitize racecheck cuda_lut) >"$OUT/sanitize.txt" 2>&1 &
    wait; snap; tail -25 "$OUT/pytest_gpu_gpu.txt"; cat "$OUT/sanitize.txt"
    timeout 120 python3 benchmarks/bench_gemv.py --shapes 8192x8192,12288x12288,28672x8192,576x576,1536x576 \
      --batches 1,8 --groups 128 --mixed-shapes 8192x8192 --outliers 0,0.002 --mixed-large-batches "" \
      --gemlite-bits "" --markdown "$OUT/bench_gemv.md" >"$OUT/bench_gemv.log" 2>&1
    snap  # GemLite's rows come from bench_gemm (8192², M = 1/16/64/256)
    timeout 100 python3 benchmarks/bench_gemm.py --quick --markdown "$OUT/bench_gemm.md" >"$OUT/bench_gemm.log" 2>&1
    timeout 40 python3 benchmarks/bench_dequant.py --shapes 8192x8192 --markdown "$OUT/bench_dequant.md" \
      >"$OUT/bench_dequant.log" 2>&1
    timeout 60 bash "$0" ncu 8192x8192 4 1 >/dev/null 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Shared Memory Configuration Size" \
      "$OUT"/ncu_*.txt | head -8
    snap
    cat "$OUT/bench_gemv.md" "$OUT/bench_gemm.md" "$OUT/bench_dequant.md" 2>/dev/null | grep -v "^|---" | cut -c1-110
    tail -3 "$OUT/bench_gemv.log" "$OUT/bench_gemm.log" ;;
  lease)  # one ~8-minute call: build; gpu tests beside memcheck of the kernels not yet sanitized on a GPU (and $EXTRA,
           # a script of the session's own); then the issue-23/24 benchmarks alone on the GPU
    FINAL=$OUT; export OUT=/tmp/gpu-lease; mkdir -p "$OUT"
    snap() { tar czf "$FINAL/lease.tgz" -C "$OUT" .; }
    build || { snap; exit 1; }
    (WORKERS=${WORKERS:-12} TEST_TIMEOUT=120 timeout ${TEST_SLOT:-210} bash "$0" test gpu >/dev/null 2>&1) &
    MC=${MEMCHECK:-"quick:kernel_matches and dtype0-128-4-576-576 or free_alpha and 1536-576-64-dtype0;\
cuda_lut:kernel_matches and dtype0-128 and (576-576 or 1024-8192);async_dequant:kernel_matches and dtype0-0.005-576-576 or canonical_dequantize_op and 8-;\
cuda_codebook:dequantize_op;cuda_uniform:ops_and_forward and 256-128"}
    (IFS=';'; for k in $MC; do
       timeout ${SAN_TIMEOUT:-100} compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x -p no:cacheprovider \
         "tests/test_${k%%:*}.py" -k "${k#*:}" >"$OUT/memcheck_${k%%:*}.txt" 2>&1
       echo "memcheck ${k%%:*}: rc $? $(grep -E 'passed|failed|ERROR SUMMARY' "$OUT/memcheck_${k%%:*}.txt" | tr '\n' ' ')"
     done) >"$OUT/sanitize.txt" 2>&1 &
    [ -n "${EXTRA:-}" ] && (timeout 150 python3 "$EXTRA" >"$OUT/extra.txt" 2>&1) &
    wait; snap; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu_gpu.txt" | tail -15; cat "$OUT/sanitize.txt"
    [ -n "${EXTRA:-}" ] && cat "$OUT/extra.txt"
    timeout 110 python3 benchmarks/bench_gemm.py --quick --markdown "$OUT/bench_gemm.md" >"$OUT/bench_gemm.log" 2>&1
    snap
    timeout 40 python3 benchmarks/bench_gemm.py --quick --bits 8 --markdown "$OUT/bench_gemm8.md" >"$OUT/bench_gemm8.log" 2>&1
    snap
    timeout 90 python3 benchmarks/bench_gemv.py --shapes 8192x8192,28672x8192,576x576,1536x576 --batches 1,8 --groups 128 \
      --mixed-shapes 8192x8192,576x576 --outliers 0,0.002 --mixed-large-batches "" --gemlite-bits "" \
      --codebook-shapes 8192x8192 --uniform8 128 --uniform8-shapes 8192x8192 \
      --markdown "$OUT/bench_gemv.md" >"$OUT/bench_gemv.log" 2>&1
    snap
    timeout 30 python3 benchmarks/bench_dequant.py --shapes 8192x8192 --markdown "$OUT/bench_dequant.md" \
      >"$OUT/bench_dequant.log" 2>&1
    snap
    for B in ${ROTATION:-}; do  # issue 27: the fused R·x against the op's transform, on the decode kernels
      timeout 40 python3 benchmarks/bench_rotation.py --device cuda --backend $B --batches 1,8 --rounds 3 \
        --shapes 576x576,1536x576,4096x4096 >"$OUT/bench_rotation_$B.md" 2>&1
      snap
    done
    if [ -n "${ROTATION:-}" ]; then  # qlinear::cuda_rotate's launch plans, and the PyTorch transform it replaces
      timeout 40 python3 benchmarks/bench_rotation.py --device cuda --slice-sweep --batches 1,8,64,512 \
        >"$OUT/bench_rotate_slices.md" 2>&1
      snap
    fi
    if [ -n "${SWEEP:-}" ]; then  # the plan sweeps of the split launches (issue 23/24: the split-K reduction's cost)
      timeout 120 python3 benchmarks/sweep_plans.py --kernels async_dequant,cuda_lut,quick \
        --shapes 576x576,4096x4096,8192x8192 --lut-batches 1,8 --quick-batches 1,16,64 --mixed-batches 1,8 \
        --markdown "$OUT/sweep_plans.md" >"$OUT/sweep_plans.log" 2>&1
      snap
    fi
    cat "$OUT/bench_gemm.md" "$OUT/bench_gemm8.md" "$OUT/bench_gemv.md" "$OUT/bench_dequant.md" 2>/dev/null | grep -v "^|---" | cut -c1-100
    [ -n "${SWEEP:-}" ] && grep -A24 "heuristic / best" "$OUT/sweep_plans.md" | cut -c1-110
    for B in ${ROTATION:-}; do grep -v "^|---" "$OUT/bench_rotation_$B.md" | cut -c1-110 | tail -8; done
    [ -n "${ROTATION:-}" ] && grep "plan" "$OUT/bench_rotate_slices.md" | cut -c1-110
    tail -n 2 "$OUT/bench_gemm.log" "$OUT/bench_gemv.log" "$OUT/bench_dequant.log" ;;
  *) echo "unknown stage $STAGE (build|test|sanitize|bench|tune|e2e|tp|sweep|ncu|quick|session)"; exit 2 ;;
esac
