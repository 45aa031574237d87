"""What a float32 residual stream buys and costs under bfloat16 weights.

Two measurements, each a mode of this script:

``--kl`` (any device; the CPU is enough): the embedded model (SmolLM2-135M-
Instruct, real weights) answers 16 real chat prompts greedily in float32; the
answer is the reference trajectory. Along it (teacher-forced: one prefill of
prompt + answer, all logits), each variant's next-token distribution is
compared with float32's: KL(p_f32 || p_variant) averaged over the answer's
positions, and the top-1 agreement. The variants free-run too, and the count
of answers that differ from float32's within --tokens is reported.

  bf16          weights and residual stream bfloat16 (folded norms, the default)
  bf16+f32res   weights bfloat16, residual stream float32 (--residual-dtype float32)

``--decode`` (a GPU): one-token decode steps of a named config (random bf16
weights, default llama3.1-8b) on the mosaic kernels, for both variants, at
batch 1, 16 and 64 with 512 tokens of context: median wall time per step
(bench/model.py's timer). Before timing, each variant's logits are compared
with the xla backends' logits of the same variant (relative Frobenius error).

  PYTHONPATH=. python3 bench/residual_dtype.py --kl --out DIR
  PYTHONPATH=. python3 bench/residual_dtype.py --decode --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

PROMPTS = [
    "What is the capital of France?",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Summarize the plot of Cinderella in one sentence.",
    "Why do cats purr?",
    "Name the planets of the solar system in order.",
    "What should I pack for a weekend hiking trip?",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bakery.",
    "What is photosynthesis?",
]
VARIANTS = {"bf16": dict(dtype="bfloat16"),
            "bf16+f32res": dict(dtype="bfloat16", residual_dtype="float32")}


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl_rows(tokens: int):
  import models
  from models import model as model_lib

  ref = models.load("default", dtype="float32")
  tok = ref.tokenizer
  variants = {name: models.load("default", **kw) for name, kw in VARIANTS.items()}
  rows = []
  for i, text in enumerate(PROMPTS):
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    answer, ref_logits = model_lib.generate(ref, prompt, tokens, return_logits=True)
    ref_logits = np.asarray(ref_logits, np.float32)
    if not np.isfinite(ref_logits).all():
      raise SystemExit(f"prompt {i}: float32 logits are not finite")
    row = {"prompt": i, "answer_tokens": len(answer), "answer": tok.decode(answer)[:80]}
    for name, m in variants.items():
      # Teacher-forced along float32's answer: the logits that chose each of its tokens.
      _, lg = _forced_logits(m, prompt, answer)
      lp_ref, lp = _log_softmax(ref_logits), _log_softmax(lg)
      kl = float(np.mean(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)))
      if not np.isfinite(kl):
        raise SystemExit(f"prompt {i}, {name}: KL is not finite")
      own = model_lib.generate(m, prompt, tokens)
      row[f"kl_{name}"] = kl
      row[f"top1_{name}"] = float(np.mean(lg.argmax(-1) == ref_logits.argmax(-1)))
      row[f"same_answer_{name}"] = own == answer
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def _forced_logits(model, prompt, answer):
  """Logits [len(answer), vocab] predicting each answer token from the prompt
  and the answer's tokens before it (one prefill, all positions)."""
  from models import kv_cache

  seq = list(prompt) + list(answer)
  ps = kv_cache.DEFAULT_PAGE_SIZE
  n_pages = -(-len(seq) // ps)
  cache = model.init_cache(n_pages + 1, ps)
  table = np.arange(1, n_pages + 1, dtype=np.int32)[None]
  logits, _ = model.prefill(cache, [seq], [0], [len(seq)], table, all_logits=True)
  logits = np.asarray(logits, np.float32)[0]
  return seq, logits[len(prompt) - 1:len(seq) - 1]


def decode_rows(config: str, iters: int, tol: float, batches=(1, 16, 64), context: int = 512):
  import jax

  from bench.model import _steps
  from models import config as config_lib, kv_cache, model as model_lib, tokenizer as tok_lib
  from mosaic import testing

  cfg = config_lib.get(config)
  params = model_lib.random_device_params(cfg, "bfloat16", seed=0)
  ps = kv_cache.DEFAULT_PAGE_SIZE
  backends = {"xla": dict(attention="xla", matmul="xla", norm="xla"),
              "mosaic": dict(attention="mosaic", matmul="mosaic", norm="mosaic")}
  rows = []
  for name, kw in VARIANTS.items():
    model = model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), **kw)
    for batch in batches:
      _, ref = _steps(model, "decode", batch, context, backends["xla"], ps, 1)
      times, logits = _steps(model, "decode", batch, context, backends["mosaic"], ps, iters)
      err = testing.rel_error(logits, ref)
      row = {"variant": name, "batch": batch, "context": context, "fold_norms": model.fold_norms,
             "rel_err_vs_xla": err, "ms": statistics.median(times) * 1e3,
             "min_ms": min(times) * 1e3, "timer": "wall"}
      if not err <= tol:
        row["error"] = f"logits differ from xla: {err:.3e} > {tol}"
      rows.append(row)
      print(json.dumps(row), flush=True)
    del model
    jax.clear_caches()
  base = {r["batch"]: r["ms"] for r in rows if r["variant"] == "bf16"}
  for r in rows:
    r["vs_bf16"] = r["ms"] / base[r["batch"]]
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, type=pathlib.Path)
  ap.add_argument("--kl", action="store_true")
  ap.add_argument("--decode", action="store_true")
  ap.add_argument("--tokens", type=int, default=48, help="answer tokens per prompt (--kl)")
  ap.add_argument("--config", default="llama3.1-8b", help="named config (--decode)")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--batches", default="1,16,64", help="decode batches (--decode)")
  ap.add_argument("--context", type=int, default=512, help="context tokens (--decode)")
  ap.add_argument("--tol", type=float, default=5e-2)
  a = ap.parse_args()
  if not (a.kl or a.decode):
    ap.error("give --kl, --decode or both")
  import jax

  from mosaic import bench

  a.out.mkdir(parents=True, exist_ok=True)
  failed = False
  if a.kl:
    t0 = time.perf_counter()
    rows = kl_rows(a.tokens)
    summary = {"prompts": len(rows), "tokens": a.tokens, "device": jax.devices()[0].device_kind,
               "seconds": round(time.perf_counter() - t0, 1)}
    for name in VARIANTS:
      summary[f"mean_kl_{name}"] = statistics.mean(r[f"kl_{name}"] for r in rows)
      summary[f"top1_{name}"] = statistics.mean(r[f"top1_{name}"] for r in rows)
      summary[f"answers_changed_{name}"] = sum(not r[f"same_answer_{name}"] for r in rows)
    print(json.dumps(summary), flush=True)
    cols = ["prompt", "answer_tokens"] + [f"{k}_{n}" for n in VARIANTS
                                          for k in ("kl", "top1", "same_answer")]
    bench.write(a.out, "residual_dtype_kl", rows + [summary], cols, " ".join(sys.argv))
  if a.decode:
    rows = decode_rows(a.config, a.iters, a.tol, [int(b) for b in a.batches.split(",")], a.context)
    failed = any("error" in r for r in rows)
    cols = ["variant", "batch", "context", "fold_norms", "ms", "min_ms", "vs_bf16",
            "rel_err_vs_xla", "timer", "error"]
    bench.write(a.out, f"residual_dtype_decode_{a.config}", rows, cols, " ".join(sys.argv))
    print(bench.table(rows, cols))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
