# Sourced (from the repository root) by bench/gpu.sh and bench/gpu_smoke.sh.
# The GPU machine has no network and lacks some of the server's packages:
# bench/fetch_wheels.sh puts their wheels in .whl/, which travels with the
# tree; they are installed here into /tmp/site, put first on PYTHONPATH.
# Then every package the server needs must import, or this stops, naming it.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || {
    echo "gpu_deps: installing the wheels of .whl/ into /tmp/site failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 - <<'PY' || exit 1
import importlib, sys
# module -> the package that provides it
needed = {"grpc": "grpcio", "google.protobuf": "protobuf",
          "grpc_health.v1.health": "grpcio-health-checking",
          "grpc_reflection.v1alpha.reflection": "grpcio-reflection",
          "prometheus_client": "prometheus-client", "fastapi": "fastapi",
          "starlette": "starlette", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
          "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
          "uvicorn": "uvicorn"}
missing = []
for module, package in needed.items():
  try:
    importlib.import_module(module)
  except Exception as e:  # not installed, or built against what is not here
    missing.append(f"  {package} (import {module}: {type(e).__name__}: {e})")
if missing:
  sys.exit("gpu_deps: the server cannot run here; these packages do not import:\n"
           + "\n".join(missing) + "\nrun bench/fetch_wheels.sh where there is network and "
           "bring .whl/ with the tree (the README's 'On a GPU machine').")
PY
