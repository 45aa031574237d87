#!/usr/bin/env bash
# The GPU machine's one script: gpu tests, calibration, benchmarks, from the
# tree (no installs but the wheels of .whl/, see bench/gpu_deps.sh). Everything
# lands in $OUT/results.tgz (plus the logs).
#
#   bench/gpu.sh                      # tests + calibration + every benchmark (bench/*.py)
#   BENCHES="rms_norm matmul" TESTS=0 bench/gpu.sh
#   BENCHES=studies/l2_rotation_study TESTS=0 bench/gpu.sh   # a study of bench/studies/
#   BENCH_ARGS="--tune" bench/gpu.sh  # also autotune where a bench supports it
#   # one bench under several flag sets (name:flags, ';' between), one after
#   # another in this call (sharing its compilation cache), each in its own folder:
#   VARIANTS="fixed:;mixed:--mixed-steps --decode-prefill-budget 128" BENCHES=serving_gpu \
#     BENCH_ARGS="--engine-process --decode-steps 8 --compilation-cache /tmp/jcc" TESTS=0 bench/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
source bench/gpu_deps.sh  # .whl/'s wheels on PYTHONPATH; stops if a needed package is missing
OUT=${OUT:-/tmp/gpu_out}
R=$OUT/results
mkdir -p "$R"
status=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$R/nvidia_smi.txt"
if [ "${CALIBRATE:-1}" = 1 ]; then
  python3 bench/calibrate.py --out "$R" 2>&1 | tee "$R/calibrate.log" || status=1
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-900}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} 2>&1 | tee "$R/gpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
pack() { tar czf "$OUT/results.tgz" -C "$OUT" results; }  # after each run: a timeout keeps the rest
# (tensor_parallel needs two GPUs: BENCHES=tensor_parallel on the two-GPU kind)
for b in ${BENCHES:-$(cd bench && ls *.py | grep -v -e calibrate -e __init__ -e gpu_smoke -e tensor_parallel | sed 's/\.py$//')}; do
  IFS=';' read -ra variants <<< "${VARIANTS:-:}"
  for v in "${variants[@]}"; do
    name=${v%%:*}; flags=${v#*:}
    out=$R; log=$R/${b##*/}.log  # studies/x logs as x
    [ -n "$name" ] && { out=$R/${b##*/}_$name; log=$out.log; }
    echo "== bench $b $name $flags"
    timeout "${BENCH_TIMEOUT:-400}" python3 "bench/$b.py" --out "$out" ${BENCH_ARGS:-} $flags 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    pack
  done
done
mkdir -p "$R/tables"
cp -r mosaic/calibration "$R/tables/" 2>/dev/null
cp -r kernels/tuning "$R/tables/" 2>/dev/null
pack
echo "gpu.sh: status $status"
exit $status
