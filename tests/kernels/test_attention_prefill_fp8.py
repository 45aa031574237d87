"""attention_prefill_fp8: each backend against the float32 reference of the
dequantized operands; the Mosaic kernel's fp8 paths (GQA, cached prefix,
padding, no mask, causal, window, packed segments, 256-key blocks, overlap,
lse, per-tensor scales) in interpret mode on CPU, and attention_prefill's
"mosaic_fp8" backend (16-bit q/k/v quantized per head into the same kernel);
its H200 lowering in test_gpu_lowering.py and its full-size runs on the GPU
(marked gpu)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import attention_prefill as ap
from kernels import attention_prefill_fp8 as af
from mosaic import dsl, registry, testing

# The kernel's P is fp8 (3 mantissa bits); random scores measure about 0.022
# against the reference, which P in 16 bits would meet to 0.004.
P_FP8_TOL = 0.035


def _quantized(B, Sq, Skv, Hq, Hkv, D=128, per_tensor=False):
  """Fresh normal q, k, v quantized per head (or per tensor) and their scales."""
  q, k, v = testing.random_inputs([(B, Sq, Hq, D), (B, Skv, Hkv, D), (B, Skv, Hkv, D)],
                                  jnp.float32)
  out = []
  for x in (q, k, v):
    x8, s = af.quantize_heads(x)
    if per_tensor:
      s = s.max()
      x8 = (x / s).astype(af.FP8)
    out.append((x8, s))
  (q8, qs), (k8, ks), (v8, vs) = out
  return (q8, k8, v8), dict(q_scale=qs, k_scale=ks, v_scale=vs)


def _case(name):
  """(shape, mask kwargs, config, per-tensor scales)."""
  seg, pos = testing.packed_segments([90, 100, 40], 256)
  base = ap.Config(p_smem=True)
  return {
      # GQA 4:1 over a cached prefix; padding queries and a partial kv block.
      "prefix_gqa_pad": (dict(B=2, Sq=100, Skv=200, Hq=4, Hkv=1), dict(causal=True), base, False),
      # No mask: padding keys masked by index, no position vectors.
      "noncausal_ragged": (dict(B=1, Sq=100, Skv=150, Hq=2, Hkv=2), dict(causal=False), base,
                           False),
      # 256-key blocks (P V contracts 256 fp8 bytes), per-tensor scales.
      "kv256_per_tensor": (dict(B=1, Sq=64, Skv=300, Hq=2, Hkv=1), dict(causal=True),
                           dataclasses.replace(base, block_kv=256), True),
      "window": (dict(B=1, Sq=256, Skv=256, Hq=2, Hkv=1), dict(causal=True, sliding_window=70),
                 base, False),
      "packed": (dict(B=1, Sq=256, Skv=256, Hq=2, Hkv=1),
                 dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                      kv_positions=pos), base, False),
  }[name]


CASES = ["prefix_gqa_pad", "noncausal_ragged", "kv256_per_tensor", "window", "packed"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_mosaic_matches_reference(name, overlap):
  shape, kw, cfg, per_tensor = _case(name)
  (q, k, v), scales = _quantized(**shape, per_tensor=per_tensor)
  ref, lse_ref = af.attention_prefill_fp8_reference(q, k, v, return_lse=True, **scales, **kw)
  out, lse = af.attention_prefill_fp8_mosaic(q, k, v, return_lse=True, **scales, **kw,
                                             config=dataclasses.replace(cfg, overlap=overlap))
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  testing.assert_close(out, ref, tol=P_FP8_TOL)
  finite = np.isfinite(np.asarray(lse_ref))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  testing.assert_close(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0), tol=1e-5,
                       what="lse")
  if "q_segment_ids" in kw:  # padding queries output exactly 0
    pad = np.asarray(kw["q_segment_ids"])[0] == 0
    assert np.all(np.asarray(out, np.float32)[0, pad] == 0)
  assert not dsl.races_found()


def test_with_integer_log2_scores_p_is_exact_and_the_kernel_meets_bf16_rounding():
  # q and k sparse in {-1, 0, 1} with unit scales and sm_scale = ln 2: every
  # score's exp2 argument is a small integer, so fp8 P (a power of two) is
  # exact and only the bf16 output rounds. This pins the scale folding, the
  # P shift and the V^T operand beyond what P's rounding would hide.
  key = testing.fresh_key()
  kq, kk, kv = jax.random.split(key, 3)
  sparse = lambda k, s: (jax.random.randint(k, s, -1, 2) * (jax.random.uniform(
      jax.random.fold_in(k, 1), s) < 0.05)).astype(af.FP8)
  q, k = sparse(kq, (1, 130, 4, 128)), sparse(kk, (1, 260, 2, 128))
  v, v_scale = af.quantize_heads(jax.random.normal(kv, (1, 260, 2, 128)))
  one = jnp.ones((), jnp.float32)
  kw = dict(q_scale=one, k_scale=one, v_scale=v_scale, causal=True, sm_scale=float(np.log(2)))
  ref = af.attention_prefill_fp8_reference(q, k, v, **kw)
  for overlap in (False, True):
    out = af.attention_prefill_fp8_mosaic(q, k, v, **kw,
                                          config=ap.Config(p_smem=True, overlap=overlap))
    testing.assert_close(out, ref, jnp.bfloat16, what=f"overlap={overlap}")


def test_xla_backend_matches_reference():
  shape, kw, _, _ = _case("packed")
  (q, k, v), scales = _quantized(**shape)
  ref = af.attention_prefill_fp8_reference(q, k, v, **scales, **kw)
  out, lse = af.attention_prefill_fp8_xla(q, k, v, return_lse=True, **scales, **kw)
  assert out.dtype == jnp.bfloat16 and lse.shape == (1, 2, 256)
  testing.assert_close(out, ref, jnp.bfloat16)
  out32 = af.attention_prefill_fp8(q, k, v, backend="xla", out_dtype=jnp.float32, **scales, **kw)
  assert out32.dtype == jnp.float32
  testing.assert_close(out32, ref, jnp.float32, tol=1e-5)


def test_xla_backend_computes_in_float32_whatever_the_output_dtype():
  # Dequantized operands in 16 bits would round again (and K past 65504
  # overflows float16); the backend's math is float32, only its output rounds.
  (q, k, v), s = _quantized(1, 64, 64, 2, 1)
  s = dict(s, q_scale=jnp.full((2,), 1e-4, jnp.float32), k_scale=jnp.full((1,), 300.0,
                                                                             jnp.float32))
  ref, lse_ref = af.attention_prefill_fp8_reference(q, k, v, return_lse=True, **s)
  for dt in (jnp.float16, jnp.bfloat16):
    out, lse = af.attention_prefill_fp8_xla(q, k, v, out_dtype=dt, return_lse=True, **s)
    assert out.dtype == dt
    testing.assert_close(out, ref, dt)
    testing.assert_close(lse, lse_ref, tol=1e-5, what="lse")


def test_quantize_heads_is_per_head_and_round_trips():
  x = testing.random_inputs([(2, 33, 3, 128)], jnp.float32)[0]
  x = x * jnp.array([1.0, 100.0, 1e-3])[None, None, :, None]  # heads of very different ranges
  x = x.at[:, :, 2].set(0.0).at[0, 0, 2, 0].set(1e-3)  # one nearly empty head
  xq, s = af.quantize_heads(x)
  assert xq.dtype == af.FP8 and s.shape == (3,) and s.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(s), np.abs(np.asarray(x)).max(axis=(0, 1, 3)) / 448,
                             rtol=1e-6)
  back = xq.astype(jnp.float32) * s[:, None]
  for h in range(3):
    testing.assert_close(back[:, :, h], x[:, :, h], tol=0.05, what=f"head {h}")
  zq, zs = af.quantize_heads(jnp.zeros((1, 4, 2, 128)))
  assert np.all(np.asarray(zs) == af.MIN_SCALE) and np.all(np.isfinite(np.asarray(zq, np.float32)))
  with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
    af.quantize_heads(jnp.ones((4, 128)))


def test_bad_inputs_are_refused_by_name():
  (q, k, v), s = _quantized(1, 64, 64, 2, 1)
  call = lambda backend, **kw: af.attention_prefill_fp8(
      kw.pop("q", q), kw.pop("k", k), v, backend=backend, **{**s, **kw})
  for backend in ("mosaic", "xla", "reference"):
    with pytest.raises(ValueError, match="float8_e4m3fn"):
      call(backend, q=q.astype(jnp.bfloat16), k=k.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="k_scale= is required"):
      call(backend, k_scale=None)
    with pytest.raises(ValueError, match=r"q_scale must be float32 of shape \(\) or \(2,\)"):
      call(backend, q_scale=jnp.ones((1,), jnp.float32))
    with pytest.raises(ValueError, match="v_scale must be float32"):
      call(backend, v_scale=jnp.ones((1,), jnp.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
      call(backend, out_dtype=jnp.int8)
    for bad in (-s["q_scale"], jnp.zeros_like(s["q_scale"]), s["q_scale"].at[0].set(jnp.nan)):
      with pytest.raises(ValueError, match="q_scale must be finite and > 0"):
        call(backend, q_scale=bad)
  with pytest.raises(ValueError, match="config= applies to the mosaic backend only"):
    call("xla", config=ap.Config(p_smem=True))
  with pytest.raises(TypeError, match="window"):
    af.attention_prefill_fp8_xla(q, k, v, **s, window=3)


def test_mosaic_says_what_it_cannot_run():
  (q, k, v), s = _quantized(1, 64, 64, 2, 1, D=64)
  why = af._mosaic_why_not(q, k, v, **s)
  assert "head dim 64 is not supported" in why
  with pytest.raises(ValueError, match="head dim 64"):
    af.attention_prefill_fp8_mosaic(q, k, v, **s)
  (q, k, v), s = _quantized(1, 64, 64, 2, 1)
  assert af._mosaic_why_not(q, k, v, **s) is None
  assert "block_kv=192" in af._mosaic_why_not(q, k, v, **s, config=ap.Config(block_kv=192))
  with pytest.raises(ValueError, match="p_smem=True"):
    af.attention_prefill_fp8_mosaic(q, k, v, **s, config=ap.Config(p_smem=False))
  # The kernel scales scores after their row max: only a positive sm_scale.
  for sm in (0.0, -0.1):
    assert "must be > 0" in af._mosaic_why_not(q, k, v, **s, sm_scale=sm)
    out = af.attention_prefill_fp8(q, k, v, **s, sm_scale=sm)  # (the default order: xla)
    testing.assert_close(out, af.attention_prefill_fp8_reference(q, k, v, **s, sm_scale=sm))
  # The registry names the mosaic backend's reason and falls back on CPU.
  op = registry.get_op(af.OP)
  assert op.select(q, k, v, **s).name == "xla"


# attention_prefill's "mosaic_fp8" backend quantizes 16-bit q, k, v per head:
# the inputs' e4m3 rounding adds to fp8 P's (random scores: about 0.05).
QUANTIZED_TOL = 0.08


def test_mosaic_fp8_backend_of_the_bf16_op_is_the_fp8_kernel_on_quantized_heads():
  q, k, v = testing.random_inputs([(2, 100, 4, 128), (2, 200, 1, 128), (2, 200, 1, 128)],
                                  jnp.bfloat16)
  kw = dict(causal=True)  # 100 queries at the end of 200 keys: a cached prefix, GQA 4:1
  out = ap.attention_prefill(q, k, v, backend="mosaic_fp8", **kw)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  (q8, qs), (k8, ks), (v8, vs) = (af.quantize_heads(x) for x in (q, k, v))
  direct = af.attention_prefill_fp8_mosaic(q8, k8, v8, q_scale=qs, k_scale=ks, v_scale=vs, **kw)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(direct, np.float32))
  testing.assert_close(out, ap.attention_prefill_reference(q, k, v, **kw), tol=QUANTIZED_TOL)
  # A plan (the block ranges, once per step in the model) gives the same output.
  plan = ap.op.plan(q, k, v, backend="mosaic_fp8", **kw)
  planned = ap.op(q, k, v, backend="mosaic_fp8", plan=plan, **kw)
  np.testing.assert_array_equal(np.asarray(planned, np.float32), np.asarray(out, np.float32))
  with pytest.raises(registry.BackendError, match="made for backend 'mosaic_fp8'"):
    ap.op(q, k, v, backend="mosaic", plan=plan, **kw)
  with pytest.raises(ValueError, match="other shapes"):
    af.attention_prefill_quantized(q[:1], k[:1], v[:1], plan=plan.data, **kw)


def test_mosaic_fp8_backend_runs_by_name_only_and_says_what_it_cannot_run():
  # fp8 rounding changes the output: no default order picks it.
  for kind in ("hopper", "blackwell", "cuda", "cpu"):
    assert "mosaic_fp8" not in ap.op.default_order(kind)
  q, k, v = testing.random_inputs([(1, 64, 2, 128)] * 3, jnp.bfloat16)
  impl = ap.op.get("mosaic_fp8")
  assert impl.why_not(q, k, v) is None
  assert "head dim 64" in impl.why_not(q[..., :64], k[..., :64], v[..., :64])
  assert "float32" in impl.why_not(*(x.astype(jnp.float32) for x in (q, k, v)))
  assert "must be > 0" in impl.why_not(q, k, v, sm_scale=0.0)
  with pytest.raises(registry.BackendError, match="head dim 64"):
    ap.attention_prefill(q[..., :64], k[..., :64], v[..., :64], backend="mosaic_fp8")
  with pytest.raises(TypeError, match="window"):
    af.attention_prefill_quantized(q, k, v, window=3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (32, 32)])
def test_mosaic_full_size_on_gpu(causal, hq, hkv):
  (q, k, v), s = _quantized(1, 4096, 4096, hq, hkv)
  ref = af.attention_prefill_fp8_xla(q, k, v, out_dtype=jnp.float32, causal=causal, **s)
  for cfg in (None, ap.Config(p_smem=True, overlap=True), ap.Config(p_smem=True, block_kv=256)):
    out = af.attention_prefill_fp8_mosaic(q, k, v, causal=causal, config=cfg, **s)
    testing.assert_close(out, ref, tol=P_FP8_TOL, what=f"{cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_mosaic_fp8_backend_full_size_on_gpu(causal):
  q, k, v = testing.random_inputs([(1, 4096, 32, 128), (1, 4096, 8, 128), (1, 4096, 8, 128)],
                                  jnp.bfloat16)
  ref = ap.attention_prefill_xla(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
  out = ap.attention_prefill(q, k, v, backend="mosaic_fp8", causal=causal)
  assert out.dtype == jnp.bfloat16
  testing.assert_close(out, ref, tol=QUANTIZED_TOL)
