"""Does the kernel before it slow the decode o_proj down? (the profiler's one gap)

In a decode step the o_proj matmul (M = B, 4096 x 4096 + residual) runs right
after paged attention; the profiler reads it 0.72x its stand-alone time at
B=16, L=2048. This times, with CUPTI (kernel time, no launch gaps):

  o        o_proj alone (L2-cold weight sets, as the profiler's own figure)
  attn     paged decode attention alone (random page order, as the server)
  chain    attention, then o_proj on its output: chain - attn is o_proj
           in the model's order
  stream   a contiguous read of as many bytes as the attention reads, then
           o_proj: is it any large read before, or the paged one?

    PYTHONPATH=. python3 bench/studies/o_proj_context.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels import matmul as mm_k
from mosaic import bench, registry


def main(argv=None) -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--pages", type=int, default=1400, help="pages in the cache (the server's)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--backend", default="mosaic", help="for both ops (xla: a CPU smoke run)")
  p.add_argument("--stack", type=int, default=0,
                 help="read o_proj's weight from a [STACK, 4096, 4096] layer stack with layer=, "
                      "as the model's scan does (each input set another layer)")
  p.add_argument("--sweep", action="store_true",
                 help="also time each o_proj tuning candidate alone and after the read")
  a = p.parse_args(argv)
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  kernels.load_all()
  attn, mm = registry.get_op("attention_decode"), registry.get_op("matmul")
  B, L, hq, hkv, d, ps, dm = a.batch, a.context, 32, 8, 128, 64, 4096
  keys = iter(jax.random.split(jax.random.key(0), 64))
  rnd = lambda *s: jax.random.normal(next(keys), s, jnp.float32).astype(jnp.bfloat16)
  per_seq = L // ps
  rng = np.random.default_rng(0)

  def attn_set():
    table = rng.permutation(a.pages)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
    return (rnd(B, 1, hq, d), rnd(hkv, a.pages, ps, d), rnd(hkv, a.pages, ps, d),
            jnp.full((B,), L, jnp.int32), jnp.asarray(table))

  kv_bytes = 2 * B * L * hkv * d * 2
  n_o = bench.cold_sets(2 * dm * dm)
  if a.stack:  # one stack, each set a different layer of it (L2-cold all the same)
    w_stack = rnd(a.stack, dm, dm)
    o_sets = [(rnd(B, dm), w_stack, rnd(B, dm), jnp.int32(i % a.stack)) for i in range(n_o)]
  else:
    o_sets = [(rnd(B, dm), rnd(dm, dm), rnd(B, dm)) for _ in range(n_o)]
  a_sets = [attn_set() for _ in range(2)]
  s_sets = [(rnd(kv_bytes // 2),) for _ in range(2)]

  def o_proj(x, w, r, layer=None, config=None):
    if config is not None:  # a tuning candidate (--sweep)
      return mm_k.matmul_mosaic(x, w, residual=r, config=config, layer=layer)
    return mm(x, w, residual=r, backend=a.backend, layer=layer)

  def attention(q, kc, vc, n, t):
    return attn(q, kc, vc, n, t, backend=a.backend)

  def chain(q, kc, vc, n, t, w, r, layer=None):
    return o_proj(attention(q, kc, vc, n, t).reshape(B, hq * d), w, r, layer)

  def stream(big, x, w, r, layer=None, config=None):
    # The sum feeds o_proj's input so the read cannot be reordered after it.
    return o_proj(x + jnp.sum(big).astype(x.dtype) * 0, w, r, layer, config)

  def read(big):
    return jnp.sum(big)

  t = {}
  t["o"] = bench.time_jax(jax.jit(o_proj), o_sets, iters=a.iters).median_s
  t["attn"] = bench.time_jax(jax.jit(attention), a_sets, iters=a.iters).median_s
  chain_sets = [s + o[1:] for s, o in zip(a_sets * len(o_sets), o_sets)]
  t["chain"] = bench.time_jax(jax.jit(chain), chain_sets, iters=a.iters).median_s
  t["read"] = bench.time_jax(jax.jit(read), s_sets, iters=a.iters).median_s
  stream_sets = [s + o for s, o in zip(s_sets * len(o_sets), o_sets)]
  t["stream"] = bench.time_jax(jax.jit(stream), stream_sets, iters=a.iters).median_s
  us = {k: v * 1e6 for k, v in t.items()}
  res = {
      "card": jax.devices()[0].device_kind, "jax": jax.__version__,
      "command": ("PYTHONPATH=. python3 bench/studies/o_proj_context.py "
                  + " ".join(argv or sys.argv[1:])),
      "batch": B, "context": L, "stack": a.stack, "kv_bytes": kv_bytes, "us": us,
      "o_alone_us": us["o"], "o_after_attention_us": us["chain"] - us["attn"],
      "o_after_contiguous_read_us": us["stream"] - us["read"],
  }
  res["ratio_after_attention"] = res["o_alone_us"] / res["o_after_attention_us"]
  res["ratio_after_contiguous_read"] = res["o_alone_us"] / res["o_after_contiguous_read_us"]
  if a.sweep:
    from bench.matmul import candidates, cfg_str

    res["sweep"] = []
    for c in candidates(B, dm, dm, 132 if a.backend != "mosaic" else mm_k._num_sms()):
      f = jax.jit(functools.partial(o_proj, config=c))
      g = jax.jit(functools.partial(stream, config=c))
      try:
        alone = bench.time_jax(f, o_sets, iters=a.iters).median_s * 1e6
        after = bench.time_jax(g, stream_sets, iters=a.iters).median_s * 1e6 - us["read"]
      except Exception as e:  # a candidate that does not compile is reported, not fatal
        res["sweep"].append({"config": cfg_str(c), "error": repr(e)[:200]})
        continue
      res["sweep"].append({"config": cfg_str(c), "alone_us": alone, "after_read_us": after})
      print(res["sweep"][-1], flush=True)
  (out / "o_proj_context.json").write_text(json.dumps(res, indent=1))
  print(json.dumps(res, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
