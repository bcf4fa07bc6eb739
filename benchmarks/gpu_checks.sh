#!/bin/bash
# Every GPU check the CUDA backends still need, in one device call (see the device tool's README):
#   bash benchmarks/gpu_checks.sh [--quick]
# builds the extensions, runs the GPU tests, compute-sanitizer memcheck over the LUT GEMV tests, and the
# GEMV benchmark; everything lands in $OUT (or ./gpu-out) for benchmarks/RESULTS.md.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export QLINEAR_CACHE=${QLINEAR_CACHE:-$PWD/.qlinear-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "from qlinear.backends import cuda_lut; print('cuda_lut build:', cuda_lut.available() or 'ok')" 2>&1 | tee "$OUT/build.txt"
python3 -m pytest -q tests/test_cuda_lut.py tests/test_modules.py 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x tests/test_cuda_lut.py \
  -k "kernel_matches and 576 and 128" 2>&1 | tail -8 | tee "$OUT/memcheck.txt"
if [ "${1:-}" = "--quick" ]; then
  python3 benchmarks/bench_gemv.py --quick --markdown "$OUT/bench_gemv.md" 2>&1 | tail -12
else
  python3 benchmarks/bench_gemv.py --markdown "$OUT/bench_gemv.md" 2>&1 | tail -5
fi
