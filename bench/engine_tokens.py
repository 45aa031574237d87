"""The engine's host time on the tokens it reads back, per token (CPU only).

A step of ``--batch`` requests decoding ``--decode-steps`` tokens a call reads
back batch x steps tokens; the engine accepts them, checks their ends,
detokenizes each request's new tokens and hands one event per request on
(``StepRecord.tokens``). In an engine process those events are then
pickled once a step (``serving.engine.process._Outbox``): timed here on the
events the requests received. Two kinds of token ids:

- ``text``: the counting model's bytes, every token adds a character;
- ``random``: ids drawn over a Llama-3-sized vocabulary, as a random-weight
  model samples them: almost none renders as text under the byte tokenizer
  (what ``bench/serving_gpu.py``'s model streams).

  PYTHONPATH=. python3 bench/engine_tokens.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import sys
import time
from multiprocessing import reduction

import numpy as np

from mosaic import bench
from serving.engine import BatchingEngine, CountingRunner, EngineConfig, api


class _RandomIds(CountingRunner):
  """The counting model's shape, with each next token drawn at random from
  ``vocab_size`` (the ids past the byte range carry no text)."""

  def __init__(self, vocab_size: int, seed: int, **kw):
    super().__init__(vocab_size=vocab_size, **kw)
    self._rng = np.random.default_rng(seed)

  def _logits(self, last):
    out = np.zeros((len(last), self.vocab_size), np.float32)
    out[np.arange(len(last)), self._rng.integers(300, self.vocab_size, len(last))] = 10.0
    return out


def run(kind: str, a) -> dict:
  kw = dict(num_pages=a.batch * 110, page_size=4, max_context=1024)
  runner = (CountingRunner(**kw) if kind == "text" else
            _RandomIds(a.vocab_size, seed=random.randrange(1 << 30), **kw))
  engine = BatchingEngine(runner, EngineConfig(
      max_batch=a.batch, batch_buckets=tuple(sorted({1, 8, a.batch})), prefill_chunk=512,
      min_chunk=64, decode_steps=a.decode_steps, warmup=False))
  rng = random.Random(0)
  handles = [engine.submit(api.Request(
      f"r{i}", prompt_ids=[rng.randrange(32, 127) for _ in range(64)], add_bos=False,
      sampling=api.SamplingParams(max_tokens=a.output_len, ignore_eos=True)))
      for i in range(a.batch)]
  while engine.step():
    pass
  steps = [t for t in engine.step_times if t.decodes == a.batch and t.launched]
  tokens = statistics.median(t.tokens for t in steps)
  # One step's events as the engine process pickles them: a Delta per request.
  events = []
  for h in handles:
    try:
      e = h.events.get_nowait()
      while not isinstance(e, api.Delta) or len(e.token_ids) < a.decode_steps:
        e = h.events.get_nowait()
    except queue.Empty:
      continue
    events.append(("event", h.request_id, e))
  t0 = time.perf_counter()
  for _ in range(50):
    reduction.ForkingPickler.dumps(("batch", events))
  pickled = (time.perf_counter() - t0) / 50
  per_step = a.batch * a.decode_steps
  return {"tokens": kind, "steps": len(steps), "tokens_ms_p50": tokens * 1e3,
          "us_per_token": tokens / per_step * 1e6, "events_pickled": len(events),
          "pickle_ms": pickled * 1e3}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/engine_tokens"))
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--decode-steps", type=int, default=8)
  p.add_argument("--output-len", type=int, default=256)
  p.add_argument("--vocab-size", type=int, default=128256)
  a = p.parse_args(argv)
  rows = [run(kind, a) for kind in ("text", "random")]
  cols = ["tokens", "steps", "tokens_ms_p50", "us_per_token", "events_pickled", "pickle_ms"]
  bench.write(a.out, "engine_tokens", rows, cols,
              "PYTHONPATH=. python3 bench/engine_tokens.py " + " ".join(argv or sys.argv[1:]))
  print(bench.table(rows, cols))
  return 0


if __name__ == "__main__":
  sys.exit(main())
