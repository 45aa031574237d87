#!/usr/bin/env bash
# Regenerates the committed stubs of generate.proto. Needs grpcio-tools whose
# protoc matches the protobuf runtime major (grpcio-tools 1.85 + protobuf 7
# here); run from the repository root: serving/proto/gen.sh [python]
# (grpc.health.v1 and server reflection come from grpcio-health-checking and
# grpcio-reflection, stubs included.)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-python3}
"$PY" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \
  serving/proto/generate.proto
