#!/usr/bin/env bash
# Downloads into .whl/ (repository root, ignored by git) the wheels the GPU
# machine lacks, for its Python 3.12 (cp312, manylinux x86_64), pinned to the
# versions in .venv. That machine has no network: the folder travels with the
# tree, and bench/gpu.sh / bench/gpu_smoke.sh install it (bench/gpu_deps.sh).
# It already has prometheus-client, grpcio, protobuf 7, anyio, h11, httpx,
# click, typing-extensions and uvloop. fastapi imports annotated-doc and
# opentelemetry-api when it loads, so they come too.
#
#   bench/fetch_wheels.sh            # PYTHON=... picks the pip that downloads
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The two grpc ones: their stubs refuse a grpcio older than the one that
# generated them, and 1.84 is what serving/proto's stubs (which run there) need.
WHEELS=(
  grpcio-health-checking==1.84.0
  grpcio-reflection==1.84.0
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  uvicorn==0.55.0
  annotated-doc==0.0.7
  opentelemetry-api==1.45.3
  gguf==0.19.0  # bench/torch_interop.py --gguf: transformers reads the embedded model with it
)
# A pin that no longer matches .venv is named (the tests ran on .venv's).
if [ -x .venv/bin/python ]; then
  frozen=$(.venv/bin/python -m pip freeze 2>/dev/null | tr '[:upper:]_' '[:lower:]-')
  for w in "${WHEELS[@]}"; do
    name=${w%%==*}
    have=$(grep -m1 "^$name==" <<<"$frozen" || true)
    [ "$have" = "$w" ] || echo "fetch_wheels: pinned $w, .venv has ${have:-none}" >&2
  done
fi
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
