"""Host cost of structured outputs, per engine step, at a 128K vocabulary.

The engine pays it on its scheduler thread: after each step it fills the
allowed-token bitmask of every running structured request
(``Grammars.fill``, on llguidance's threads) and moves each grammar past its
new token (``Guide.accept``). This measures both for 1, 8 and 64 requests
with a JSON schema, over a byte-level BPE tokenizer trained here to the
vocabulary size asked for (Llama-3's 128,256 by default; the merges come from
this machine's Python sources, so its tokens are code-like, not English),
plus the one-time costs: llguidance's tokenizer (at warm-up) and a grammar
(at submission).

Correctness first: random walks through the allowed sets end in JSON that
parses and has the schema's keys; NaN or a walk that fails stops the run.

  PYTHONPATH=. python3 bench/structured_host.py --out $OUT [--vocab 128256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.engine import api, sampling, structured  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "tags", "role", "active"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
}


def train_tokenizer(vocab: int, corpus_mb: float):
  """A byte-level BPE tokenizer of ``vocab`` ids (<s>, </s>, then merges)."""
  import tokenizers
  from tokenizers import decoders, models as tk_models, pre_tokenizers, trainers

  from models import tokenizer as tok_lib

  files, size = [], 0
  for p in sorted(pathlib.Path(np.__file__).resolve().parents[1].rglob("*.py")):
    files.append(str(p))
    size += p.stat().st_size
    if size > corpus_mb * 2**20:
      break
  tk = tokenizers.Tokenizer(tk_models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tk.train(files, trainer)
  return tok_lib.HFTokenizer(tk, bos_id=0, eos_ids=(1,)), size


def walk(grammars, rng, eos) -> tuple[list[int], structured.Guide]:
  """One random walk through a fresh guide's allowed sets to the grammar's end."""
  g, ids = grammars.guide(api.StructuredOutputs(json=json.dumps(SCHEMA))), []
  while not g.stopped and len(ids) < 400:
    allowed = np.flatnonzero(g.allowed())
    choices = [t for t in allowed if t not in eos] or list(allowed)
    t = int(rng.choice(choices))
    if t in eos:
      break
    assert g.accept([t]), g.error
    ids.append(t)
  return ids, g


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", type=pathlib.Path, required=True)
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--corpus-mb", type=float, default=48)
  ap.add_argument("--steps", type=int, default=40, help="steps timed per batch size")
  a = ap.parse_args()
  a.out.mkdir(parents=True, exist_ok=True)

  t0 = time.perf_counter()
  tok, corpus = train_tokenizer(a.vocab, a.corpus_mb)
  vocab = a.vocab
  print(f"tokenizer: {tok.tk.get_vocab_size()} ids from {corpus / 2**20:.0f} MB in "
        f"{time.perf_counter() - t0:.0f} s", flush=True)
  grammars = structured.Grammars(tok, vocab)
  t = time.perf_counter()
  grammars.prepare()
  ll_s = time.perf_counter() - t
  rng = np.random.default_rng(0)
  eos = set(tok.eos_ids)

  # Correctness: finished walks decode to JSON with the schema's keys.
  for _ in range(5):
    ids, g = walk(grammars, rng, eos)
    out = json.loads(tok.decode(ids))
    assert set(out) == set(SCHEMA["required"]) and out["role"] in ("admin", "user", "guest")
  print("correctness: 5 walks give JSON with the schema's keys", flush=True)

  spec = api.StructuredOutputs(json=json.dumps(SCHEMA))
  t = time.perf_counter()
  for _ in range(20):
    grammars.guide(spec)
  guide_ms = (time.perf_counter() - t) / 20 * 1e3

  rows = []
  for k in (1, 8, 64):
    # k requests part-way through their output, each at its own place.
    guides, nexts = [], []
    for _ in range(k):
      g = grammars.guide(spec)
      for _ in range(int(rng.integers(0, 30))):
        allowed = [t for t in np.flatnonzero(g.allowed()) if t not in eos]
        if g.stopped or not allowed:
          break
        g.accept([int(rng.choice(allowed))])
      guides.append(g)
    words = np.full((k, sampling.mask_words(vocab)), -1, np.int32)
    fill, accept = [], []
    for _ in range(a.steps):
      live = [g for g in guides if not g.stopped]
      if not live:
        break
      t = time.perf_counter()
      grammars.fill(live, words[:len(live)])
      fill.append(time.perf_counter() - t)
      bits = np.unpackbits(words[:len(live)].view(np.uint8), axis=1, bitorder="little")
      picks = [int(rng.choice(np.flatnonzero(b[:vocab]))) for b in bits]
      t = time.perf_counter()
      for g, tid in zip(live, picks):
        if tid not in eos:
          g.accept([tid])
      accept.append(time.perf_counter() - t)
    rows.append({"requests": k, "fill_ms_p50": statistics.median(fill) * 1e3,
                 "accept_ms_p50": statistics.median(accept) * 1e3, "steps": len(fill)})
    print(rows[-1], flush=True)

  summary = {"vocab": vocab, "tokenizer_ids": tok.tk.get_vocab_size(),
             "corpus_mb": round(corpus / 2**20, 1), "cpu_count": os.cpu_count(),
             "llguidance_tokenizer_s": ll_s, "grammar_ms": guide_ms, "per_step": rows,
             "cpu": platform.processor() or platform.machine(),
             "date": datetime.date.today().isoformat(),
             "command": "PYTHONPATH=. python3 bench/structured_host.py " + " ".join(sys.argv[1:])}
  (a.out / "structured_host.json").write_text(json.dumps(summary, indent=1))
  lines = [f"# Structured outputs: host cost per step ({vocab:,}-token vocabulary)", "",
           f"{summary['date']}, {summary['cpu']} with {os.cpu_count()} cores (llguidance's "
           f"threads fill the bitmasks side by side); `{summary['command']}`", "",
           f"- llguidance tokenizer (warm-up): {ll_s:.2f} s; a JSON-schema grammar (submission): "
           f"{guide_ms:.2f} ms", "",
           "| structured requests | bitmask fill (ms) | accept (ms) |", "|---|---|---|"]
  lines += [f"| {r['requests']} | {r['fill_ms_p50']:.3f} | {r['accept_ms_p50']:.3f} |"
            for r in rows]
  (a.out / "structured_host.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
