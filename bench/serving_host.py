"""Where the serving engine's step time goes, without the gRPC server.

1. The model's decode step alone (the runner's jitted call): the time until
   the call returns (host dispatch: what the engine's thread pays) on an idle
   device and back to back, and until its result is ready (device), at batch 1
   and the engine's max batch; with the lengths and page table from numpy (as
   the engine sends them) and kept on the device (the same addresses every
   call). ``--decode-only`` stops here.
2. The engine alone: ``--requests`` greedy requests of ``--input-len`` in /
   ``--output-len`` out submitted at once and driven by ``engine.step()`` in
   this thread under cProfile: step wall time, host time (wall minus the time
   blocked on the device's results) and the host functions that cost most.

Run it under different ``XLA_FLAGS`` to compare settings (command buffers):
the logits' fingerprint shows whether a setting changed the results.

  PYTHONPATH=. python3 bench/serving_host.py --out $OUT [--tag NAME] [--decode-only]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pathlib
import pstats
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serving_gpu import apply_model_flags, flags_model, flags_num_pages, host_share, model_flags  # noqa: E402


def _timed_calls(f, n):
  """(median s until the call returns, median s until its output is ready)."""
  ret, done = [], []
  for _ in range(n):
    t0 = time.perf_counter()
    out = f()
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    ret.append(t1 - t0)
    done.append(t2 - t0)
  return statistics.median(ret), statistics.median(done)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_host"))
  ap.add_argument("--tag", default="default")
  model_flags(ap)
  ap.add_argument("--max-batch", type=int, default=64)
  ap.add_argument("--requests", type=int, default=64)
  ap.add_argument("--input-len", type=int, default=512)
  ap.add_argument("--output-len", type=int, default=64)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--decode-only", action="store_true",
                  help="time the decode step alone; skip the engine")
  ap.add_argument("--page-size", type=int, default=0,
                  help="tokens per KV page (default: the kernel's)")
  a = ap.parse_args()
  apply_model_flags(a)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  from serving import engine as E
  from serving.engine import api

  res = {"tag": a.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), "config": a.config,
         "attention": a.attention, "matmul": a.matmul, "fold_norms": a.fold_norms,
         "decode_append": a.decode_append, "decode_unroll": a.decode_unroll}
  model = flags_model(a)
  page = a.page_size or E.default_page_size()
  res["page_size"] = page
  num_pages = flags_num_pages(a, model, page)
  runner = E.ModelRunner(model, num_pages=num_pages, page_size=page, attention=a.attention,
                         matmul=a.matmul, kv_cache_dtype=a.kv_cache_dtype)
  max_pages = -(-4096 // page)
  if a.max_batch * -(-600 // page) >= num_pages:
    raise SystemExit(f"--num-pages {num_pages} is too few for {a.max_batch} rows of 600 tokens")
  for b in sorted({1, a.max_batch}):
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, min(1000, runner.vocab_size), b), jax.numpy.int32)
    lengths = np.full((b,), 600, np.int32)
    # Each row its own pages: rows sharing a slot would serialize the KV writes.
    per_row = -(-600 // page)
    table = np.zeros((b, max_pages), np.int32)
    table[:, :per_row] = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
    # "host": lengths and page table from numpy, as the engine sends them (new
    # device buffers each call); "device": the same arrays put on the device
    # once, so every call sees the same input addresses (what XLA's command
    # buffers and their traces of our kernels key on); "rotating": on the
    # device, but four copies taken in turn (no transfer, new addresses).
    # The step takes slot, length and page table side by side in one array.
    from serving.engine import runners as R
    joined = R._side_by_side(np.arange(b, dtype=np.int32), lengths, table)
    dev_joined = jax.device_put(joined)
    copies = [jax.device_put(joined.copy()) for _ in range(4)]
    turn = itertools.count()

    def joined_call(length_table):  # the runner's jitted step, given its device input
      logits, runner.cache = runner._fast[1](runner.model.params, runner.cache, tokens,
                                             length_table)
      return logits

    variants = {"host": lambda: runner.decode(tokens, lengths, table),
                "device": lambda: joined_call(dev_joined),
                "rotating": lambda: joined_call(copies[next(turn) % len(copies)])}
    for name, f in variants.items():
      logits = np.asarray(jax.block_until_ready(f()), np.float32)  # compile
      # The same on every run whatever XLA_FLAGS say (seeded weights, same inputs):
      # a setting that changes them is not a scheduling change.
      fingerprint = {"argmax": logits.argmax(-1)[:8].tolist(),
                     "sum": float(np.sum(logits, dtype=np.float64)),
                     "finite": bool(np.isfinite(logits).all())}
      r, d = _timed_calls(f, a.iters)
      # Back to back without waiting: the steady state of a pipelined engine.
      rets, t0 = [], time.perf_counter()
      for _ in range(a.iters):
        t1 = time.perf_counter()
        o = f()
        rets.append(time.perf_counter() - t1)
      jax.block_until_ready(o)
      key = f"decode_b{b}" + ("" if name == "host" else f"_{name}")
      res[key] = {"dispatch_ms": r * 1e3, "call_to_ready_ms": d * 1e3,
                  "back_to_back_ms": (time.perf_counter() - t0) / a.iters * 1e3,
                  "back_to_back_dispatch_ms": statistics.median(rets) * 1e3,
                  "logits": fingerprint}
      print(f"decode B={b} {name} inputs: {res[key]}", flush=True)
  if a.decode_only:
    (out / f"serving_host_{a.tag}.json").write_text(json.dumps(res, indent=1))
    return

  cfg = E.EngineConfig(max_batch=a.max_batch, max_waiting=4 * a.requests, max_seq_len=4096,
                       prefill_chunk=2048, min_chunk=a.input_len, prefill_rows=4,
                       batch_buckets=tuple(sorted({1, min(8, a.max_batch), a.max_batch})),
                       token_budget=a.max_batch + 2048, default_max_tokens=a.output_len,
                       warmup_continued=False, decode_steps=a.decode_steps,
                       stream_interval=a.stream_interval, mixed_steps=a.mixed_steps,
                       decode_prefill_budget=a.decode_prefill_budget,
                       prefill_first=a.prefill_first, compile_threads=a.compile_threads)
  engine = E.BatchingEngine(runner, cfg)
  t0 = time.perf_counter()
  engine.warmup()
  res["warmup_s"] = time.perf_counter() - t0
  rng = np.random.default_rng(1)
  handles = [engine.submit(api.Request(
      f"r{i}", prompt_ids=rng.integers(0, min(1000, runner.vocab_size), a.input_len).tolist(),
      sampling=api.SamplingParams(max_tokens=a.output_len, ignore_eos=True), add_bos=False))
      for i in range(a.requests)]
  engine.step_times.clear()
  prof = cProfile.Profile()
  t0 = time.perf_counter()
  prof.enable()
  while engine.step():
    pass
  prof.disable()
  wall = time.perf_counter() - t0
  done = 0
  for h in handles:
    while not h.events.empty():
      done += isinstance(h.events.get_nowait(), api.Final)
  res["engine"] = {"wall_s": wall, "requests_done": done,
                   "output_tok_s": a.requests * a.output_len / wall,
                   "full_batch": host_share(engine, max(1, a.max_batch * 3 // 4)),
                   "all_steps": host_share(engine, 0)}
  s = io.StringIO()
  pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
  (out / f"serving_host_{a.tag}_profile.txt").write_text(s.getvalue())
  (out / f"serving_host_{a.tag}.json").write_text(json.dumps(res, indent=1))
  print(json.dumps(res, indent=1))
  print("\n".join(s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
  main()
