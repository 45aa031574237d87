"""Run in a process with 2 host devices: TP=2 must give TP=1's logits.

usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python tp_check.py SEED
Prints "ok <rel error>" or raises.
"""

import sys

import jax
import numpy as np

import models
from models import model as model_lib, tokenizer as tok_lib
from mosaic import testing


def main():
  seed = int(sys.argv[1])
  assert len(jax.devices()) >= 2, jax.devices()
  cfg = models.config.get("tiny")
  params = model_lib.random_params(cfg, seed=seed)
  one = models.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="float32")
  two = models.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="float32",
                     mesh=model_lib.make_mesh(2))
  wqkv = two.params["layers"]["attn"]["wqkv"]["w"][...]
  assert len(wqkv.sharding.device_set) == 2 and wqkv.sharding.spec[-1] == "tp", wqkv.sharding
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 259, n).tolist() for n in (9, 4)]
  outs = []
  for m in (one, two):
    cache = m.init_cache(9, 4)
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    toks = np.zeros((2, 9), np.int32)
    toks[0], toks[1, :4] = prompts[0], prompts[1]
    pre, cache = m.prefill(cache, toks, [0, 0], [9, 4], table, all_logits=True)
    if m is two:
      assert len(cache.k.sharding.device_set) == 2, cache.k.sharding
    dec, cache = m.decode(cache, [[7, 8], [9, 10]], [11, 6], table)
    outs.append(np.concatenate([np.asarray(pre).reshape(-1), np.asarray(dec).reshape(-1)]))
  err = testing.assert_close(outs[1], outs[0], tol=1e-5, what="tp=2 vs tp=1")
  # The step ran per shard (shard_map) with all-reduces, not as a replicated program.
  from models import llama
  import jax.numpy as jnp
  hlo = llama.decode_step.lower(
      two.graphdef, two.params, two.init_cache(9, 4), jnp.zeros((2, 1), jnp.int32),
      jnp.full((2,), 5, jnp.int32), jnp.ones((2, 4), jnp.int32),
      backends=llama.backends(), mesh=two.mesh).as_text()
  assert "all_reduce" in hlo or "all-reduce" in hlo, "no all-reduce in the TP decode step"
  print("ok", err)


if __name__ == "__main__":
  main()
