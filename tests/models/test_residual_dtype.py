"""The float32 residual stream under bfloat16 weights (``residual_dtype``).

The reference is the float32 model on the same bf16-rounded weights: what
is left between it and a bf16 model is activation rounding. A float32
residual stream removes the rounding of every layer's sums, so its logits
must sit clearly closer to the reference than the all-bf16 model's, on every
backend (mosaic runs in interpret mode here). A residual dtype that was
accepted and not honoured would give the bf16 model's logits exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import config as config_lib, llama, model as model_lib, tokenizer as tok_lib
from mosaic import testing

PAGE = 8


@pytest.fixture(scope="module")
def setup():
  cfg = config_lib.get("tiny")
  params = model_lib.random_params(cfg, seed=3)
  rounded = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), params)
  ids = [int(i) for i in np.random.default_rng(0).integers(3, cfg.vocab_size, 13)]
  ref = model_lib.Model(cfg, rounded, tok_lib.ByteTokenizer(), dtype="float32")
  return cfg, params, ids, _logits(ref, ids, matmul="xla", norm="xla")


def _logits(m, ids, **backends):
  n = -(-len(ids) // PAGE)
  cache = m.init_cache(n + 1, PAGE)
  table = np.arange(1, n + 1, dtype=np.int32)[None]
  out, _ = m.prefill(cache, [ids], [0], [len(ids)], table, all_logits=True, **backends)
  return np.asarray(out, np.float32)


def _model(cfg, params, residual_dtype):
  return model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="bfloat16",
                         residual_dtype=residual_dtype)


def test_float32_residual_is_closer_to_float32(setup):
  """On the xla ops and on the mosaic kernels (whose matmul adds the f32
  residual in its epilogue and whose norm reads the f32 stream)."""
  cfg, params, ids, ref = setup
  bf16 = _model(cfg, params, None)
  f32res = _model(cfg, params, "float32")
  assert (bf16.fold_norms, f32res.fold_norms) == (True, False)  # folding needs the weights' dtype
  base = testing.rel_error(_logits(bf16, ids, matmul="xla", norm="xla"), ref)
  assert np.isfinite(base) and base < 2e-2, base
  for backend in ("xla", "mosaic"):
    err = testing.rel_error(_logits(f32res, ids, matmul=backend, norm=backend), ref)
    assert err < 0.85 * base, (backend, err, base)


def test_decode_carries_a_float32_stream(setup):
  """The one-token decode step (unrolled layers, decode-append attention)
  honours it too: its logits match prefill's at the same position."""
  cfg, params, ids, _ = setup
  m = model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="bfloat16",
                      residual_dtype="float32")
  n = -(-(len(ids) + 1) // PAGE)
  table = np.arange(1, n + 1, dtype=np.int32)[None]
  cache = m.init_cache(n + 1, PAGE)
  _, cache = m.prefill(cache, [ids[:-1]], [0], [len(ids) - 1], table)
  dec, _ = m.decode(cache, [[ids[-1]]], [len(ids)], table)
  full = _logits(m, ids)[0, -1]
  assert testing.rel_error(np.asarray(dec, np.float32).reshape(-1), full) < 1e-2


def test_refusals():
  cfg = config_lib.get("tiny")
  params = model_lib.random_params(cfg, seed=3)
  with pytest.raises(ValueError, match="norms_folded"):
    llama.Llama(cfg, dtype="bfloat16", rngs=model_lib.nnx.Rngs(0), norms_folded=True,
                residual_dtype="float32")
  with pytest.raises(ValueError, match="residual_dtype=int8"):
    model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="bfloat16",
                    residual_dtype="int8")


def test_serve_flag_reaches_the_model():
  from serving import cli

  a = cli.parser().parse_args(["serve", "--model", "tiny", "--dtype", "bfloat16",
                               "--residual-dtype", "float32", "--no-warmup",
                               "--num-pages", "16", "--page-size", "8"])
  model = cli.build_engine(a).runner.model
  assert (model.dtype.name, model.residual_dtype.name, model.fold_norms) == (
      "bfloat16", "float32", False)
  a = cli.parser().parse_args(["serve", "--model", "toy", "--residual-dtype", "float32"])
  with pytest.raises(ValueError, match="residual dtype"):
    cli.build_engine(a)
