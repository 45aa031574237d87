"""How much do the gRPC stream threads slow the engine's own steps? (CPU only)

The counting model (serving.engine.runners.CountingRunner: numpy, no device)
makes an engine step pure host work. Full-batch steps are timed twice:
``--concurrency`` requests driven by ``engine.step()`` in this thread alone,
then the same load through the gRPC server on loopback with the load
generator in another process, so that the server's stream threads (one per
streaming call, woken for every message) share this process's interpreter
with the engine thread. The difference is what the server costs the engine;
``--engine-process`` moves the engine out of the server's process
(serving.engine.process) to take that cost away.

  PYTHONPATH=. python3 bench/serving_contention.py --out DIR [--stream-interval 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys

from mosaic import bench
from serving import engine as E
from serving.engine import api


def _engine_kw(a) -> dict:
  return dict(max_batch=a.concurrency, num_pages=a.concurrency * 110, page_size=4,
              max_context=1024, prefill_chunk=512, min_chunk=64, max_waiting=512,
              batch_buckets=tuple(sorted({1, 8, a.concurrency})), stream_interval=a.stream_interval)


def _full_steps(engine, concurrency):
  steps = [t for t in engine.step_times if t.decodes >= concurrency * 3 // 4 and t.launched]
  if not steps:
    raise RuntimeError("no full-batch step was recorded")
  return {"steps": len(steps),
          "step_ms_p50": statistics.median(t.wall for t in steps) * 1e3,
          "launch_ms_p50": statistics.median(t.launch for t in steps) * 1e3,
          "tokens_ms_p50": statistics.median(t.tokens for t in steps) * 1e3}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--concurrency", type=int, default=64)
  p.add_argument("--input-len", type=int, default=64)
  p.add_argument("--output-len", type=int, default=200)
  p.add_argument("--stream-interval", type=int, default=1)
  p.add_argument("--engine-process", action="store_true",
                 help="behind gRPC, the engine runs in a process of its own")
  a = p.parse_args(argv)
  pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)

  engine = E.tiny_engine(**_engine_kw(a))
  rng = random.Random(0)
  params = api.SamplingParams(max_tokens=a.output_len, ignore_eos=True)
  for i in range(a.concurrency):
    prompt = [rng.randrange(256) for _ in range(a.input_len)]
    engine.submit(api.Request(f"r{i}", prompt_ids=prompt, add_bos=False, sampling=params))
  while engine.step():
    pass
  alone = _full_steps(engine, a.concurrency)

  from serving.service import Server

  if a.engine_process:
    from serving.engine.process import ProcessEngine

    engine = ProcessEngine(E.tiny_engine, **_engine_kw(a))
  else:
    engine = E.tiny_engine(**_engine_kw(a))
  server = Server(engine, port=0).start()
  try:
    r = subprocess.run(
        [sys.executable, "-m", "serving", "loadgen", "--target", server.address, "--concurrency",
         str(a.concurrency), "--num-requests", str(2 * a.concurrency), "--input-len",
         str(a.input_len), "--output-len", str(a.output_len), "--byte-prompts", "--json",
         str(pathlib.Path(a.out) / "loadgen.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if r.returncode:
      raise RuntimeError(f"loadgen failed: {r.stderr[-1000:]}")
  finally:
    server.stop(grace=1.0)
  served = _full_steps(engine, a.concurrency)
  served["output_tok_s"] = json.loads((pathlib.Path(a.out) / "loadgen.json").read_text())[
      "output_tok_s"]

  where = "engine in its own process" if a.engine_process else "same process"
  rows = [{"case": "engine alone", **alone},
          {"case": f"behind gRPC, streams in flight ({where})", **served}]
  cols = ["case", "steps", "step_ms_p50", "launch_ms_p50", "tokens_ms_p50", "output_tok_s"]
  bench.write(a.out, "serving_contention", rows, cols,
              "PYTHONPATH=. python3 bench/serving_contention.py " + " ".join(argv or sys.argv[1:]))
  print(bench.table(rows, cols))
  return 0


if __name__ == "__main__":
  sys.exit(main())
