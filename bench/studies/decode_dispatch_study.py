"""What the host pays to launch a multi-step decode call, by how its inputs travel.

The engine's c=64 host share is about 10% of an 8-step call, ~2.9 ms of it the
launch. This times ``ModelRunner.decode_multi`` (B rows, 8 steps, greedy)
pipelined as the engine runs it (call n + 1 is dispatched before call n's
tokens are read):

  packed    as the engine calls it now: slots, lengths, page table and
            sampling rows in one host array (one transfer), the input tokens
            gathered inside the call
  separate  as it did before: a token gather of its own (``sampling.take``,
            a call with its own transfer), then lengths, page table and the
            two sampling arrays each transferred on its own (the call itself
            then reads a packed copy already on the device, so only the
            transfers and the gather differ)
  staged    an earlier question: the inputs copied each call into one
            persistent device set (a donated update, so the set keeps its
            addresses), which the call reads

Run once per XLA_FLAGS setting (the flags are read at start-up):

    PYTHONPATH=. python3 bench/studies/decode_dispatch_study.py --out DIR --tag default
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL PYTHONPATH=. \\
        python3 bench/studies/decode_dispatch_study.py --out DIR --tag while
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/
from serving_gpu import random_model  # noqa: E402


@functools.partial(jax.jit, donate_argnums=(0,))
def _stage(state, host):
  """Writes a call's packed inputs into ``state`` (donated: the same buffer out)."""
  del state
  return host


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--tag", default="default")
  ap.add_argument("--config", default="llama3.1-8b")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--calls", type=int, default=30)
  ap.add_argument("--num-pages", type=int, default=1400)
  ap.add_argument("--backend", default="mosaic", help="attention and matmul (xla: a CPU smoke run)")
  a = ap.parse_args(argv)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  from serving import engine as E
  from serving.engine import runners as R
  from serving.engine import sampling

  model = random_model(a.config, "bfloat16")
  page = E.default_page_size()
  runner = E.ModelRunner(model, num_pages=a.num_pages, page_size=page, attention=a.backend,
                         matmul=a.backend)
  b, v = a.batch, runner.vocab_size
  max_pages = -(-4096 // page)
  per_row = -(-600 // page)
  table = np.zeros((b, max_pages), np.int32)
  table[:, :per_row] = 1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
  slots = np.arange(b, dtype=np.int32)
  arrays = sampling.pack([None] * b, [0] * b, [0] * b, list(range(b)), b)
  counts = jnp.zeros((b, v), jnp.int32)
  prompt_mask = sampling.slot_tokens(b, v)  # the engine's per-slot token state
  last = jnp.asarray(np.random.default_rng(0).integers(0, 1000, b), jnp.int32)

  def host_inputs(call):
    return (np.full((b,), 600 + call, np.int32), table)

  res = {"tag": a.tag, "xla_flags": os.environ.get("XLA_FLAGS", ""), "batch": b,
         "steps": a.steps}
  run = runner._fast[2]  # the jitted call, to hand it device inputs (separate, staged)
  state = None
  for variant in ("packed", "separate", "staged", "packed", "separate", "staged"):
    dispatch, tokens_seen = [], []
    pending = None
    t_start = time.perf_counter()
    for call in range(a.calls):
      lengths, tab = host_inputs(call)
      kw = dict(steps=a.steps, greedy_only=True, logprobs=False)
      t0 = time.perf_counter()
      if variant == "packed":
        o = runner.decode_multi(slots, lengths, tab, arrays, counts, prompt_mask, last, **kw)
      else:
        host = R.pack_decode_inputs(slots, lengths, tab, arrays)
        if variant == "separate":
          _ = [sampling.take(last, slots)] + [jax.device_put(x) for x in
                                               (lengths, tab, arrays.f, arrays.i)]
          dev = jax.device_put(host) if call == 0 else dev
        else:
          if state is None:
            state = jnp.array(host)
          state = dev = _stage(state, host)
        o, runner.cache = run(runner.model.params, runner.cache, dev, counts, prompt_mask, last,
                              **kw)
      counts, last = o[4], o[5]
      dispatch.append(time.perf_counter() - t0)
      if pending is not None:  # the engine reads call n's tokens after dispatching n + 1
        tokens_seen.append(np.asarray(pending[0])[:, 0].tolist())
      pending = o
    tokens_seen.append(np.asarray(pending[0])[:, 0].tolist())
    jax.block_until_ready(o)
    total = time.perf_counter() - t_start
    # The first calls compile and warm the traces; the second pass is the figure.
    res[variant] = {"dispatch_ms_p50": statistics.median(dispatch[5:]) * 1e3,
                    "call_ms": total / a.calls * 1e3,
                    "first_tokens": tokens_seen[-1][:4]}
    print(variant, res[variant], flush=True)
  (out / f"decode_dispatch_{a.tag}.json").write_text(json.dumps(res, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
