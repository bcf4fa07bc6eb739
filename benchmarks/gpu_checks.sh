#!/bin/bash
# Every GPU check the CUDA backends (cuda_lut, quick, async_dequant) still need, for the device tool
# (each device call is limited to 10 minutes, so the work is split into stages; run them in order):
#   bash benchmarks/gpu_checks.sh build      # JIT-build the three extensions (cached in .qlinear-cache: carry it)
#   bash benchmarks/gpu_checks.sh test       # GPU tests of every backend
#   bash benchmarks/gpu_checks.sh sanitize   # compute-sanitizer memcheck + racecheck over one run of each kernel
#   bash benchmarks/gpu_checks.sh bench      # bench_gemv.py (LUT + mixed rows) and bench_gemm.py
#   bash benchmarks/gpu_checks.sh tune       # tune_dispatch.py: writes backends/dispatch/<gpu>.json
#   bash benchmarks/gpu_checks.sh e2e        # bench_e2e.py
#   bash benchmarks/gpu_checks.sh tp         # bench_tp.py --single cuda: act_order reordered vs the g_idx path
#   bash benchmarks/gpu_checks.sh quick      # build + tests + the --quick benchmarks, one short call
# Outputs land in $OUT (or ./gpu-out) for benchmarks/RESULTS.md.  GemLite is installed from wheels/ if present
# (there is no internet on the GPU machine: build it here with
#  `pip wheel --no-deps --no-build-isolation gemlite==0.6.0.post2 -w wheels/` and carry wheels/ and .qlinear-cache).
set -u
STAGE=${1:-quick}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export QLINEAR_CACHE=${QLINEAR_CACHE:-$PWD/.qlinear-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
ls wheels/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps wheels/*.whl
BACKENDS="cuda_lut quick async_dequant"
TESTS="tests/test_cuda_lut.py tests/test_quick.py tests/test_async_dequant.py tests/test_dispatch.py tests/test_modules.py"

build() {
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
  for b in $BACKENDS; do
    python3 -c "from qlinear.backends import $b; print('$b build:', $b.available() or 'ok')" 2>&1 | tee -a "$OUT/build.txt"
  done
}
tests() { python3 -m pytest -q $TESTS 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"; }
sanitize() {
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_lut.py \
      -k "kernel_matches and 576 and 128 and float16 and 4" 2>&1 | tail -4 | tee -a "$OUT/sanitizer.txt"
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x tests/test_quick.py \
      -k "kernel_matches and 576 and 4 and 128 and float16" 2>&1 | tail -4 | tee -a "$OUT/sanitizer.txt"
    compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest -q -x tests/test_async_dequant.py \
      -k "kernel_matches and 576-576 or without_4bit and 576-576 or separate and 576-576" 2>&1 | tail -4 \
      | tee -a "$OUT/sanitizer.txt"
  done
  # SASS of the mixed GEMV (sync mode must issue its code loads after the scale math) and of the QUICK GEMM
  for b in async_dequant quick; do
    cuobjdump -sass "$(find "$QLINEAR_CACHE" -name "qlinear_$b*.so" | head -1)" 2>&1 | gzip > "$OUT/$b.sass.gz"
  done
}

case "$STAGE" in
  build) build ;;
  test) tests ;;
  sanitize) sanitize ;;
  bench)
    python3 benchmarks/bench_gemv.py --markdown "$OUT/bench_gemv.md" 2>&1 | tail -5
    python3 benchmarks/bench_gemm.py --markdown "$OUT/bench_gemm.md" 2>&1 | tail -5 ;;
  tune) python3 benchmarks/tune_dispatch.py 2>&1 | tail -5; cp backends/dispatch/*.json "$OUT/" ;;
  e2e) python3 benchmarks/bench_e2e.py --markdown "$OUT/bench_e2e.md" 2>&1 | tail -15 ;;
  tp) python3 benchmarks/bench_tp.py --single cuda 2>&1 | tee "$OUT/bench_tp_single.md" | tail -25 ;;
  quick)
    build; tests
    python3 benchmarks/bench_gemv.py --quick --markdown "$OUT/bench_gemv.md" 2>&1 | tail -12
    python3 benchmarks/bench_gemm.py --quick --markdown "$OUT/bench_gemm.md" 2>&1 | tail -12 ;;
  *) echo "unknown stage $STAGE (build|test|sanitize|bench|tune|e2e|tp|quick)"; exit 2 ;;
esac
