"""Every backend of the model's ops gives the reference logits within bf16
tolerance, through prefill and decode.

On CPU: reference, xla, mosaic (Mosaic GPU interpret mode) and triton (Pallas
Triton interpret mode) on the tiny config. On a GPU (marked ``gpu``): mosaic,
cudnn and triton against xla on a small bf16 model of realistic head shapes.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import config as config_lib, model as model_lib, tokenizer as tok_lib
from mosaic import testing


def _run(m, prompts, page_size, *, prefill, decode, chunked=True, cache_dtype=None):
  """Batched prefill of ``prompts`` in two chunks (the first fresh, the second
  on top of the cached first; one fresh chunk unless ``chunked``), then two
  decode steps (the second with Tq=2); returns every logit row, float32."""
  b = len(prompts)
  longest = max(len(p) for p in prompts) + 3
  per = -(-longest // page_size)
  table = 1 + np.arange(b * per).reshape(b, per)
  cache = m.init_cache(1 + b * per, page_size, dtype=cache_dtype)
  assert cache.k.dtype == jnp.dtype(cache_dtype or m.dtype)
  lens = np.array([len(p) for p in prompts])
  # A 1-token prompt is a padding row (length 0) in the second chunk.
  first = lens // 2 + 1 if chunked else lens
  rows = [[] for _ in prompts]
  chunks = [(np.zeros(b, int), first)] + ([(first, lens - first)] if chunked else [])
  for start, n in chunks:
    toks = np.zeros((b, max(n.max(), 1)), np.int32)
    for i, p in enumerate(prompts):
      toks[i, :n[i]] = p[start[i]:start[i] + n[i]]
    out, cache = m.prefill(cache, toks, start, n, table, all_logits=True, **prefill)
    for i in range(b):
      rows[i].append(np.asarray(out[i, :n[i]]))
  rows = [np.concatenate(r) for r in rows]
  # Fixed next tokens, not each run's argmax: a near-tie that bf16 rounding
  # flips would feed the runs different tokens and compare unrelated logits.
  nxt = np.array([p[0] for p in prompts])
  l2, cache = m.decode(cache, nxt, lens + 1, table, **decode)
  l3, cache = m.decode(cache, np.stack([nxt, nxt], 1), lens + 3, table, **decode)
  return np.concatenate(rows + [np.asarray(l2), np.asarray(l3).reshape(-1, l3.shape[-1])])


CPU_CASES = {
    "xla": (dict(attention="xla", matmul="xla", norm="xla"),
            dict(attention="xla", matmul="xla", norm="xla")),
    "mosaic": (dict(attention="mosaic", matmul="mosaic", norm="mosaic"),
               dict(attention="mosaic", matmul="mosaic", norm="mosaic")),
    "triton": (dict(attention="triton"), dict(attention="triton")),
}


@pytest.fixture(scope="module")
def tiny_bf16():
  return models.load("tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny_reference(tiny_bf16, prompts):
  ref = dict(attention="reference", matmul="reference", norm="reference")
  return _run(tiny_bf16, prompts, 16, prefill=ref, decode=ref)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng()
  return [rng.integers(3, 259, 13).tolist(), rng.integers(3, 259, 6).tolist()]


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_backend_matches_reference(case, tiny_bf16, tiny_reference, prompts):
  prefill, decode = CPU_CASES[case]
  out = _run(tiny_bf16, prompts, 16, prefill=prefill, decode=decode)
  testing.assert_close(out, tiny_reference, dtype=jnp.bfloat16, what=f"{case} logits")


def test_fp8_kv_cache(tiny_bf16, tiny_reference, prompts):
  # An fp8 cache: the mosaic attention kernels (interpreted) read the same
  # quantized pages as xla to bf16 tolerance, through chunked prefill (a
  # gathered, widened prefix) and decode (fp8 pages in the kernel). Against the
  # bf16 cache's reference the difference is fp8's rounding: visible, and
  # bounded. Only attention touches the cache: the mosaic matmul and norm
  # stay xla here (test_backend_matches_reference covers them).
  f8 = "float8_e4m3fn"
  xla = dict(attention="xla", matmul="xla", norm="xla")
  mos = dict(attention="mosaic", matmul="xla", norm="xla")
  out_xla = _run(tiny_bf16, prompts, 16, prefill=xla, decode=xla, cache_dtype=f8)
  out_mos = _run(tiny_bf16, prompts, 16, prefill=mos, decode=mos, cache_dtype=f8)
  testing.assert_close(out_mos, out_xla, dtype=jnp.bfloat16, what="mosaic vs xla, fp8 cache")
  err = testing.rel_error(out_xla, tiny_reference)
  assert 1e-3 < err < 0.1, err


def test_fp8_prefill_attention_by_name():
  # attention_prefill's "mosaic_fp8" backend (q/k/v quantized per head, the
  # fp8 FA3 kernel interpreted) in prefill, fresh and over a cached prefix;
  # xla elsewhere. Head dim 128, which the fp8 kernel needs. Against the bf16
  # run the difference is fp8's rounding: visible and bounded.
  cfg = config_lib.ModelConfig("hd128", vocab_size=320, hidden_size=256, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=128,
                               intermediate_size=256, rope_theta=10000.0)
  params = model_lib.random_params(cfg, seed=int(np.random.default_rng().integers(1 << 30)))
  m = models.Model(cfg, params, tok_lib.ByteTokenizer(), dtype="bfloat16")
  rng = np.random.default_rng()
  prompts = [rng.integers(3, 259, 13).tolist(), rng.integers(3, 259, 6).tolist()]
  xla = dict(attention="xla", matmul="xla", norm="xla")
  ref = _run(m, prompts, 16, prefill=xla, decode=xla)
  out = _run(m, prompts, 16, prefill=dict(xla, attention="mosaic_fp8"), decode=xla)
  err = testing.rel_error(out, ref)
  assert 1e-4 < err < 0.06, err


def test_fp8_cache_writes_saturate():
  from models import kv_cache

  x = jnp.array([1e6, -1e6, 3.0, 0.0], jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(kv_cache.to_cache_dtype(x, jnp.float8_e4m3fn), np.float32),
                                [448.0, -448.0, 3.0, 0.0])
  with pytest.raises(ValueError, match="KV cache dtype int8"):
    kv_cache.init_cache(config_lib.get("tiny"), 4, 16, dtype="int8")


# ---------------------------------------------------------------- GPU

GPU_CONFIG = config_lib.ModelConfig(
    "gpu-small", vocab_size=4096, hidden_size=1024, num_layers=2, num_heads=8,
    num_kv_heads=2, head_dim=128, intermediate_size=2816, rope_theta=500000.0)

GPU_CASES = {
    "mosaic": (dict(attention="mosaic", matmul="mosaic", norm="mosaic"),
               dict(attention="mosaic", norm="mosaic")),
    # cuDNN takes no positions/segment ids: only a fresh (unchunked) prefill.
    "cudnn": (dict(attention="cudnn"), dict()),
    "triton": (dict(attention="triton"), dict(attention="triton")),
}


@pytest.fixture(scope="module")
def gpu_model():
  params = model_lib.random_params(GPU_CONFIG, seed=int(np.random.default_rng().integers(1 << 30)))
  return models.Model(GPU_CONFIG, params, tok_lib.ByteTokenizer(), dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_backend_matches_xla(case, gpu_model):
  rng = np.random.default_rng()
  prompts = [rng.integers(3, 4096, n).tolist() for n in (200, 77, 1)]
  xla = dict(attention="xla", matmul="xla", norm="xla")
  ref = _run(gpu_model, prompts, 64, prefill=xla, decode=xla)
  prefill, decode = GPU_CASES[case]
  # cuDNN takes no positions/segment ids: one fresh prefill chunk.
  out = _run(gpu_model, prompts, 64, prefill=prefill, decode=decode, chunked=case != "cudnn")
  testing.assert_close(out, ref, dtype=jnp.bfloat16, what=f"{case} logits vs xla")


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_gpu_mosaic_attention_on_cached_pages(stage, gpu_model):
  """Chunked prefill on cached pages and decode, mosaic attention in one stage
  only (xla elsewhere): localizes a disagreement to one kernel."""
  rng = np.random.default_rng()
  prompts = [rng.integers(3, 4096, n).tolist() for n in (200, 77, 1)]
  xla = dict(attention="xla", matmul="xla", norm="xla")
  ref = _run(gpu_model, prompts, 64, prefill=xla, decode=xla)
  ours = dict(xla, attention="mosaic")
  prefill, decode = (ours, xla) if stage == "prefill" else (xla, ours)
  out = _run(gpu_model, prompts, 64, prefill=prefill, decode=decode)
  testing.assert_close(out, ref, dtype=jnp.bfloat16, what=f"mosaic {stage} logits vs xla")


@pytest.mark.gpu
def test_gpu_fp8_prefill_attention_by_name(gpu_model):
  # attention_prefill's mosaic_fp8 on the card, fresh and over cached pages;
  # xla elsewhere: fp8's rounding, bounded as on the CPU.
  rng = np.random.default_rng()
  prompts = [rng.integers(3, 4096, n).tolist() for n in (200, 77, 1)]
  xla = dict(attention="xla", matmul="xla", norm="xla")
  ref = _run(gpu_model, prompts, 64, prefill=xla, decode=xla)
  out = _run(gpu_model, prompts, 64, prefill=dict(xla, attention="mosaic_fp8"), decode=xla)
  err = testing.rel_error(out, ref)
  assert 1e-4 < err < 0.06, err
