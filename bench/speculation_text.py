"""N-gram speculation on real text: how many tokens a checking call yields.

The engine over the embedded SmolLM2-135M-Instruct (real weights), one
request at a time, each chat prompt run without speculation and with
``--k`` drafts: greedy (its tokens must equal plain decoding's: checked
first) and sampled (temperature 0.7, unseeded). Reported per prompt: drafted
and kept tokens, the acceptance rate, and output tokens per device call of
the speculating run (plain one-step decoding: 1). These depend on the model
and the text, not on the machine; wall times on a CPU would not say what a
GPU does (what a checking call costs there is bench/speculation.py's job).
With ``--time`` (for a GPU: warmed-up engines, so nothing compiles while
timed) each request also runs ``--repeats`` more times per engine and the
median wall time per output token of both is reported, with their ratio:
what a user at concurrency 1 would see, host dispatch included.

  PYTHONPATH=. python3 bench/speculation_text.py --out DIR [--k 4] [--max-tokens 160] [--patience 4]
  PYTHONPATH=. python3 bench/speculation_text.py --out DIR --dtype bfloat16 --time
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

from mosaic import bench

PROMPTS = {
    # Rewriting text it was given: what prompt lookup is for.
    "edit_code": "Rename the function `area` to `rect_area` in this code and return the whole "
                 "code:\n\n```python\ndef area(w, h):\n    \"\"\"Area of a w x h rectangle.\"\"\"\n"
                 "    return w * h\n\n\ndef total(rects):\n    return sum(area(w, h) for w, h in "
                 "rects)\n\n\nprint(total([(1, 2), (3, 4), (5, 6)]))\n```",
    "fix_typos": "Fix the spelling mistakes and return the corrected text only:\n\nThe quik brown "
                 "fox jumpd over the lazy dog. Every mornign the fox runs though the forrest, "
                 "and the dog sleeps under the old oak tree untill noon.",
    # Open-ended writing: drafts come only from the model's own repeats.
    "open": "Write a short story about a lighthouse keeper.",
}


def run(engine, prompt: str, max_tokens: int, **sampling):
  """(token ids, engine steps) for one chat request run alone."""
  from serving.engine import api

  steps0 = engine.steps
  h = engine.submit(api.Request("r", messages=[("user", prompt)], sampling=api.SamplingParams(
      max_tokens=max_tokens, **sampling)))
  while engine.step():
    pass
  ids = []
  while not h.events.empty():
    ev = h.events.get_nowait()
    if isinstance(ev, api.Failed):
      raise RuntimeError(ev.message)
    ids.extend(getattr(ev, "token_ids", ()))
  return ids, engine.steps - steps0


def timed(engine, prompt: str, max_tokens: int, **sampling) -> float:
  """Wall ms per output token of one request run alone (its prefill included)."""
  t0 = time.perf_counter()
  ids, _ = run(engine, prompt, max_tokens, **sampling)
  return (time.perf_counter() - t0) * 1e3 / len(ids)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/speculation_text"))
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--max-tokens", type=int, default=160)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--patience", type=int, default=4, help="EngineConfig.speculative_patience")
  ap.add_argument("--time", action="store_true", help="also time both engines (warmed up)")
  ap.add_argument("--repeats", type=int, default=3, help="timed runs per request and engine")
  a = ap.parse_args()
  from serving import engine as E

  # Untimed, the CPU-friendly small pages and no warm-up; timed, the default
  # page size (the decode kernel's) and every shape compiled before the clock.
  kw = dict(dtype=a.dtype, num_pages=256, page_size=None if a.time else 16, max_batch=4,
            batch_buckets=(1, 4), max_seq_len=1024, warmup=a.time)
  plain = E.model_engine(None, **kw)
  spec = E.model_engine(None, num_speculative_tokens=a.k, speculative_patience=a.patience, **kw)
  rows = []
  for name, prompt in PROMPTS.items():
    for mode, sampling in (("greedy", {}), ("sampled", {"temperature": 0.7})):
      drafted0, kept0 = spec.spec_draft_tokens, spec.spec_accepted_tokens
      ids0, _ = run(plain, prompt, a.max_tokens, **sampling)
      ids1, steps = run(spec, prompt, a.max_tokens, **sampling)
      if mode == "greedy" and ids1 != ids0:
        raise SystemExit(f"{name}: speculation changed greedy output")
      drafted = spec.spec_draft_tokens - drafted0
      kept = spec.spec_accepted_tokens - kept0
      # Steps after the prompt's (one prefill call, which gives the first token).
      rows.append({"prompt": name, "mode": mode, "tokens": len(ids1), "drafted": drafted,
                   "kept": kept, "acceptance": kept / drafted if drafted else 0.0,
                   "tokens_per_call": (len(ids1) - 1) / max(steps - 1, 1)})
      if a.time:
        for key, eng in (("plain_ms_per_token", plain), ("spec_ms_per_token", spec)):
          rows[-1][key] = statistics.median(timed(eng, prompt, a.max_tokens, **sampling)
                                            for _ in range(a.repeats))
        rows[-1]["speedup"] = rows[-1]["plain_ms_per_token"] / rows[-1]["spec_ms_per_token"]
      print(rows[-1], flush=True)
  cols = ["prompt", "mode", "tokens", "drafted", "kept", "acceptance", "tokens_per_call"]
  if a.time:
    cols += ["plain_ms_per_token", "spec_ms_per_token", "speedup"]
  bench.write(pathlib.Path(a.out), "speculation_text", rows, cols,
              "PYTHONPATH=. python3 bench/speculation_text.py " + " ".join(sys.argv[1:]))
  print("\n" + bench.table(rows, cols))


if __name__ == "__main__":
  main()
