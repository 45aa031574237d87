#!/usr/bin/env bash
# The README's commands on the GPU machine, as a user types them (serve with
# and without --engine-process, generate, generate --chat, loadgen c=8, curl
# on the OpenAI route, SIGTERM). Writes $OUT/smoke/gpu_smoke.json and each
# process's log; exits 1 on any failed step. Commit the JSON under
# bench/results/gpu_smoke/<commit>.json before resolving an issue that touches
# serving/, models/, kernels/ or mosaic/.
#
#   bench/gpu_smoke.sh                         # the 8B config, both servers
#   SMOKE_ARGS="--c64" bench/gpu_smoke.sh      # also the c=64 load (512/256)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
source bench/gpu_deps.sh  # .whl/'s wheels on PYTHONPATH; stops if a needed package is missing
OUT=${OUT:-/tmp/gpu_out}
python3 bench/gpu_smoke.py --out "$OUT/smoke" ${SMOKE_ARGS:-}
