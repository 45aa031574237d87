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


def _compare(cfg, seed, quantization=None, tol=1e-5):
  params = model_lib.random_params(cfg, seed=seed)
  one = models.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="float32",
                     quantization=quantization)
  two = models.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="float32",
                     mesh=model_lib.make_mesh(2), quantization=quantization)
  if quantization is None:
    wqkv = two.params["layers"]["attn"]["wqkv"]["w"][...]
    assert len(wqkv.sharding.device_set) == 2 and wqkv.sharding.spec[-1] == "tp", wqkv.sharding
  else:  # fp8 weights are [out, in]: column-parallel splits their first axis
    wqkv = two.params["layers"]["attn"]["wqkv"]["w_q"][...]
    assert wqkv.sharding.spec[-2] == "tp" and wqkv.sharding.spec[-1] is None, wqkv.sharding
    down = two.params["layers"]["mlp"]["w_down"]["w_q"][...]
    assert down.sharding.spec[-1] == "tp", down.sharding
    assert two.params["layers"]["attn"]["wqkv"]["w_scale"][...].sharding.spec[-1] == "tp"
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
  err = testing.assert_close(outs[1], outs[0], tol=tol,
                             what=f"{cfg.name} {quantization or ''} tp=2 vs tp=1")
  return one, two, err


def main():
  seed = int(sys.argv[1])
  assert len(jax.devices()) >= 2, jax.devices()
  # The tiny model, and one with every bias, gelu, q/k norms, a padded MLP
  # width (100 -> 128: 64 features a device) and a window on one layer.
  variant = models.config.get("tiny").replace(
      qkv_bias=True, o_bias=True, mlp_bias=True, hidden_act="gelu", qk_norm=True,
      intermediate_size=100, sliding_window=3, sliding_layers=(False, True))
  # fp8: a row-parallel shard quantizes its own half of each row (its own
  # per-token scale), so TP=2 rounds differently: equal up to fp8 rounding.
  _compare(models.config.get("tiny"), seed, quantization="fp8", tol=5e-2)
  for cfg in (models.config.get("tiny"), variant):
    one, two, err = _compare(cfg, seed)
  # The step ran per shard (shard_map) with all-reduces, not as a replicated program.
  from models import jitted
  import jax.numpy as jnp
  hlo = jitted.decode_step.lower(
      two.graphdef, two.params, two.init_cache(9, 4), jnp.zeros((2, 1), jnp.int32),
      jnp.full((2,), 5, jnp.int32), jnp.ones((2, 4), jnp.int32),
      backends=jitted.backends(), mesh=two.mesh).as_text()
  assert "all_reduce" in hlo or "all-reduce" in hlo, "no all-reduce in the TP decode step"
  _random_params_are_drawn_split(seed)
  _llama_8b_tp2_lowers_for_h200()
  print("ok", err)


def _random_params_are_drawn_split(seed):
  """A named config's random weights at TP=2 are drawn on both devices as
  TP places them (70B fits only so), with the values of the one-device draw."""
  cfg = models.config.get("tiny")
  one = model_lib.random_device_params(cfg, "float32", seed)
  two = model_lib.random_device_params(cfg, "float32", seed, mesh=model_lib.make_mesh(2))
  w = two["layers"]["attn"]["wqkv"]["w"]
  assert len(w.sharding.device_set) == 2 and w.sharding.spec[-1] == "tp", w.sharding
  down = two["layers"]["mlp"]["w_down"]["w"]
  assert down.sharding.spec[-2] == "tp", down.sharding
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _llama_8b_tp2_lowers_for_h200():
  """Llama-3-8B's decode (B=64) and prefill (2048 tokens) steps at TP=2 lower
  for the H200 with our kernels on each device's shard: half the heads and
  MLP features per kernel, the all-reduces between them."""
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding

  from kernels import attention_decode as ad
  from models import jitted, kv_cache, llama, sharding

  S, BF16, I32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  cfg = models.config.get("llama3.1-8b")
  mesh = model_lib.make_mesh(2)
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=BF16, rngs=nnx.Rngs(0),
                                                norms_folded=True))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  params = jax.tree.map(lambda x, spec: S(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
                        pure, sharding.param_specs(pure))
  cache = jax.tree.map(lambda x: S(x.shape, x.dtype, sharding=sharding.cache_sharding(mesh)),
                       jax.eval_shape(lambda: kv_cache.init_cache(cfg, 64, ad.DEFAULT_PAGE_SIZE)))
  names = jitted.backends(attention_prefill="mosaic", attention_decode="mosaic", matmul="mosaic",
                         rms_norm="mosaic")
  decode = lambda p, c, tok, n, tab: jitted.decode_step(graphdef, p, c, tok, n, tab,
                                                        backends=names, mesh=mesh)
  prefill = lambda p, c, tok, pos, n, tab: jitted.prefill_step(graphdef, p, c, tok, pos, n, tab,
                                                              backends=names, mesh=mesh)
  for fn, args, rows in ((decode, (S((64, 1), I32), S((64,), I32), S((64, 32), I32)), 64),
                         (prefill, (S((1, 2048), I32), S((1,), I32), S((1,), I32),
                                    S((1, 32), I32)), 2048)):
    low = testing.lower_for_gpu(fn, params, cache, *args)
    assert "all_reduce" in low.text or "all-reduce" in low.text, "no all-reduce at TP=2"
    outs = " ".join(low.kernel_results)
    # Per shard: qkv's (32 + 2 x 8 heads) x 128 / 2 columns and half the
    # vocabulary; no kernel sees a whole qkv, gate_up or lm_head.
    assert low.mosaic_kernels >= 7 and f"{rows}x3072x" in outs and "x64128x" in outs, outs
    assert not any(w in outs for w in ("x6144x", "x28672x", "x128256x")), outs


if __name__ == "__main__":
  main()
