"""attention_prefill: every backend against the float32 reference, the
reference against a naive per-row loop, and the Mosaic kernel's code paths
(causal skipping, unmasked blocks, consumer skip steps, GQA, cached prefix,
packed segments, sliding window, lse, padding) in interpret mode on CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import attention_prefill as ap
from mosaic import dsl, registry, target as target_lib, testing


def _qkv(B, Sq, Skv, Hq, Hkv, D, dtype=jnp.bfloat16):
  return testing.random_inputs([(B, Sq, Hq, D), (B, Skv, Hkv, D), (B, Skv, Hkv, D)], dtype)


def _naive(q, k, v, causal, scale, qp, qs, kp, ks, window):
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  B, Sq, Hq, D = q.shape
  G = Hq // k.shape[2]
  o = np.zeros_like(q)
  for b in range(B):
    for h in range(Hq):
      for i in range(Sq):
        ok = [(qs[b, i] == ks[b, j] and qs[b, i] != 0 and (not causal or kp[b, j] <= qp[b, i])
               and (window is None or qp[b, i] - kp[b, j] < window)) for j in range(k.shape[1])]
        ok = np.array(ok)
        if not ok.any():
          continue
        s = (k[b, :, h // G] @ q[b, i, h]) * scale
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max())
        o[b, i, h] = (p / p.sum()) @ v[b, :, h // G]
  return o


@pytest.mark.parametrize("causal,window,packed", [(True, None, False), (False, None, False),
                                                  (True, 5, False), (True, None, True)])
def test_reference_matches_naive_loop(causal, window, packed):
  B, Sq, Skv = (1, 24, 24) if packed else (2, 7, 19)
  q, k, v = _qkv(B, Sq, Skv, 4, 2, 16, jnp.float32)
  if packed:
    qs, qp = testing.packed_segments([9, 4, 8], Sq)
    ks, kp = qs, qp
    kw = dict(q_segment_ids=qs, kv_segment_ids=ks, q_positions=qp, kv_positions=kp)
  else:
    qp = np.broadcast_to(np.arange(Sq) + Skv - Sq, (B, Sq))
    kp = np.broadcast_to(np.arange(Skv), (B, Skv))
    qs, ks = np.ones((B, Sq), int), np.ones((B, Skv), int)
    kw = {}
  out = ap.attention_prefill_reference(q, k, v, causal=causal, sliding_window=window,
                                       sm_scale=0.3, **kw)
  want = _naive(q, k, v, causal, 0.3, np.asarray(qp), np.asarray(qs), np.asarray(kp),
                np.asarray(ks), window)
  testing.assert_close(out, want, jnp.float32)
  if packed:  # padding queries output exactly 0
    assert np.all(np.asarray(out)[0, 21:] == 0)


def _exact_ranges(qp, qs, kp, ks, block_q, block_kv, causal, window):
  """[lo, hi) of the kv blocks holding a visible key, per query block, from
  the element mask (0, 0 where none), and whether any block holds three or
  more sequences."""
  vis = (qs[:, None] == ks[None, :]) & (qs[:, None] != 0)
  if causal:
    vis &= kp[None, :] <= qp[:, None]
  if window is not None:
    vis &= qp[:, None] - kp[None, :] < window
  nq, nk = len(qp) // block_q, len(kp) // block_kv
  blocks = vis.reshape(nq, block_q, nk, block_kv).any((1, 3))
  lo = np.where(blocks.any(1), blocks.argmax(1), 0)
  hi = np.where(blocks.any(1), nk - blocks[:, ::-1].argmax(1), 0)
  crowded = any(len(set(x[i:i + n]) - {0}) > 2 for x, n in ((qs, block_q), (ks, block_kv))
                for i in range(0, len(x), n))
  return lo, hi, crowded


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.booleans(),
       st.sampled_from([None, 40, 130]), st.sampled_from([64, 128]), st.booleans())
def test_block_ranges_hold_every_visible_block_and_only_those_of_its_sequences(
    lengths, causal, window, block_kv, shuffled):
  # Packed sequences (positions restarting at each, segment ids in packing
  # order or shuffled), padding after them. The ranges must hold every block
  # with a visible key; and where no block holds three sequences, they are
  # exactly the visible blocks' span (a sequence's positions never widen
  # another's range in a block they share).
  S = 1536
  lengths = lengths[:next((i for i in range(len(lengths)) if sum(lengths[:i + 1]) > S),
                          len(lengths))]
  ids = np.random.default_rng(len(lengths)).permutation(len(lengths)) + 1 if shuffled else \
      np.arange(1, len(lengths) + 1)
  seg = np.concatenate([np.full(n, i) for i, n in zip(ids, lengths)] + [np.zeros(S, int)])[:S]
  pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(S, int)])[:S]
  got = np.asarray(ap._block_ranges(*(jnp.asarray(x[None], jnp.int32) for x in (pos, seg) * 2),
                                    64, block_kv, causal, window))[0]
  lo, hi, crowded = _exact_ranges(pos, seg, pos, seg, 64, block_kv, causal, window)
  some = hi > lo
  assert np.all(got[some, 0] <= lo[some]) and np.all(got[some, 1] >= hi[some])
  if not crowded:
    np.testing.assert_array_equal(got[some, :2], np.stack([lo, hi], 1)[some])


def _case(name):
  """(shape kwargs, op kwargs, mosaic config) for the named case."""
  seg, pos = testing.packed_segments([40, 100, 70, 30], 256)
  # Rows 0..63 (the first consumer) and 114.. (the whole second CTA) are padding.
  s2, p2 = testing.packed_segments([30, 20], 192)
  seg2 = jnp.concatenate([jnp.zeros((1, 64), jnp.int32), s2], 1)
  pos2 = jnp.concatenate([jnp.zeros((1, 64), jnp.int32), p2], 1)
  # The model's chunk on cached pages: rows start at 101, 39 and 1 (the last
  # row has no query: length 0), kv is 4 pages of 64 read back whole.
  start, n, skv = np.array([101, 39, 1]), np.array([99, 38, 0]), 256
  tpos = start[:, None] + np.arange(100)
  chunk = dict(q_positions=jnp.asarray(tpos, jnp.int32),
               q_segment_ids=jnp.asarray(np.arange(100)[None] < n[:, None], jnp.int32),
               kv_positions=jnp.broadcast_to(jnp.arange(skv, dtype=jnp.int32), (3, skv)),
               kv_segment_ids=jnp.asarray(np.arange(skv)[None] < (start + n)[:, None], jnp.int32))
  cases = {
      "noncausal": (dict(B=1, Sq=128, Skv=128, Hq=2, Hkv=2, D=64), dict(causal=False), None),
      # No mask at all: no position vectors; the padding keys of the last of
      # three blocks (and the padding query rows) are masked by index.
      "noncausal_ragged": (dict(B=2, Sq=100, Skv=150, Hq=4, Hkv=2, D=64), dict(causal=False),
                           ap.Config(block_kv=64, stages=2)),
      "noncausal_d128_192": (dict(B=1, Sq=64, Skv=200, Hq=2, Hkv=1, D=128), dict(causal=False),
                             ap.Config(block_kv=192, stages=2)),
      # block_kv=64: one consumer needs fewer kv blocks than the other (skip
      # steps), some blocks are fully visible (the unmasked loop).
      "causal_skip": (dict(B=1, Sq=256, Skv=256, Hq=2, Hkv=1, D=64), dict(causal=True),
                      ap.Config(block_kv=64, stages=3)),
      "prefix_gqa_pad": (dict(B=2, Sq=100, Skv=200, Hq=4, Hkv=1, D=64), dict(causal=True), None),
      "d128_window": (dict(B=1, Sq=128, Skv=256, Hq=2, Hkv=2, D=128),
                      dict(causal=True, sliding_window=70), ap.Config(block_kv=64)),
      "packed": (dict(B=1, Sq=256, Skv=256, Hq=2, Hkv=1, D=64),
                 dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                      kv_positions=pos), ap.Config(block_kv=64, stages=2)),
      "packed_empty_tiles": (dict(B=1, Sq=256, Skv=256, Hq=2, Hkv=2, D=64),
                             dict(causal=False, q_segment_ids=seg2, kv_segment_ids=seg2,
                                  q_positions=pos2, kv_positions=pos2), ap.Config(block_kv=64)),
      "model_chunk": (dict(B=3, Sq=100, Skv=skv, Hq=4, Hkv=1, D=128), dict(causal=True, **chunk),
                      None),
      # Head dim 256 (the heuristic's 64-key blocks): GQA over a cached prefix,
      # a partial last kv block.
      "d256_prefix_gqa": (dict(B=1, Sq=70, Skv=150, Hq=2, Hkv=1, D=256), dict(causal=True), None),
  }
  return cases[name]


CASES = ["noncausal", "noncausal_ragged", "noncausal_d128_192", "causal_skip", "prefix_gqa_pad",
         "d128_window", "packed", "packed_empty_tiles", "model_chunk", "d256_prefix_gqa"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_mosaic_matches_reference(name, overlap):
  shape, kw, cfg = _case(name)
  cfg = dataclasses.replace(cfg or ap._pick_config(shape["D"], jnp.bfloat16, kw["causal"]),
                            overlap=overlap)
  dtype = jnp.float16 if name == "d128_window" else jnp.bfloat16
  q, k, v = _qkv(**shape, dtype=dtype)
  ref, lse_ref = ap.attention_prefill_reference(q, k, v, return_lse=True, **kw)
  out, lse = ap.attention_prefill_mosaic(q, k, v, return_lse=True, config=cfg, **kw)
  assert out.dtype == q.dtype and lse.shape == lse_ref.shape
  testing.assert_close(out, ref, dtype)
  finite = np.isfinite(np.asarray(lse_ref))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  testing.assert_close(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0), jnp.float32,
                       tol=1e-5, what="lse")
  if "q_segment_ids" in kw:  # padding queries output exactly 0
    pad = np.asarray(kw["q_segment_ids"])[0] == 0
    assert np.all(np.asarray(out, np.float32)[0, pad] == 0)
  assert not dsl.races_found()


def test_a_plan_gives_the_same_output_and_must_fit_the_call():
  # op.plan computes the mosaic kernel's block ranges from shapes and positions
  # alone; a call with it is the call without it, exactly.
  shape, kw, cfg = _case("model_chunk")
  q, k, v = _qkv(**shape, dtype=jnp.bfloat16)
  op = registry.get_op("attention_prefill")
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
  plan = op.plan(*shapes, backend="mosaic", **kw)
  assert plan.backend == "mosaic" and isinstance(plan.data, ap.MosaicPlan)
  want = ap.attention_prefill_mosaic(q, k, v, **kw)
  got = jax.jit(lambda q, k, v, plan: op(q, k, v, backend="mosaic", plan=plan, **kw))(
      q, k, v, plan)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # A backend without a planner ignores its (empty) plan; another's is refused.
  xla_plan = op.plan(*shapes, backend="xla", **kw)
  assert xla_plan.data is None
  testing.assert_close(op(q, k, v, backend="xla", plan=xla_plan, **kw),
                       ap.attention_prefill_reference(q, k, v, **kw), jnp.bfloat16)
  with pytest.raises(registry.BackendError, match="made for backend 'xla'"):
    op(q, k, v, backend="mosaic", plan=xla_plan, **kw)
  # A plan for other shapes (here, a shorter key sequence) is refused.
  short = op.plan(shapes[0], *[jax.ShapeDtypeStruct((3, 64, 1, 128), jnp.bfloat16)] * 2,
                  backend="mosaic", causal=True)
  with pytest.raises(ValueError, match="other shapes or another config"):
    ap.attention_prefill_mosaic(q, k, v, plan=short.data, **kw)


def test_the_plan_launches_each_rows_longest_tiles_first():
  # Config.heavy_first: each row's launch slots hold its query tiles sorted by
  # kv block count, most first; the ranges travel with their tile.
  def plan(B, S, cfg, **kw):
    shapes = [jax.ShapeDtypeStruct((B, S, 2, 64), jnp.bfloat16)] * 3
    return np.asarray(ap.attention_prefill_mosaic_plan(*shapes, config=cfg, **kw).meta)

  seg, pos = testing.packed_segments([300, 900, 120, 700], 2048)
  packed = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                kv_positions=pos)
  cfg = ap.Config(block_kv=64)
  in_order = plan(1, 2048, dataclasses.replace(cfg, heavy_first=False), **packed)[0]
  nt = len(in_order)
  np.testing.assert_array_equal(in_order[:, 2, 2], np.arange(nt))
  launched = plan(1, 2048, cfg, **packed)[0]
  tiles = launched[:, 2, 2]
  np.testing.assert_array_equal(np.sort(tiles), np.arange(nt))
  np.testing.assert_array_equal(launched, in_order[tiles])
  work = launched[:, 2, 1] - launched[:, 2, 0]
  assert np.all(np.diff(work) <= 0) and work[0] > work[-1]
  # Packed, that is not the last tile first: the 900-token sequence's tail
  # leads, and the short sequences' tiles sit with the light ones.
  assert not np.array_equal(tiles, np.arange(nt)[::-1])
  # A causal batch runs each row last tile first; an unmasked one in order.
  causal = plan(2, 512, cfg, causal=True)
  np.testing.assert_array_equal(causal[:, :, 2, 2], np.tile(np.arange(4)[::-1], (2, 1)))
  np.testing.assert_array_equal(plan(2, 512, cfg, causal=False)[:, :, 2, 2],
                                np.tile(np.arange(4), (2, 1)))
  # The kernel runs the same tiles either way: the outputs are equal exactly.
  shape, kw, cfg = _case("packed")
  q, k, v = _qkv(**shape)
  outs = [ap.attention_prefill_mosaic(q, k, v, config=dataclasses.replace(cfg, heavy_first=h),
                                      **kw) for h in (False, True)]
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
  testing.assert_close(outs[1], ap.attention_prefill_reference(q, k, v, **kw), jnp.bfloat16)


@pytest.mark.parametrize("backend", ["xla", "triton"])
@pytest.mark.parametrize("name", ["prefix_gqa_pad", "packed", "d128_window"])
def test_portable_backends_match_reference(backend, name):
  shape, kw, _ = _case(name)
  q, k, v = _qkv(**shape)
  ref, lse_ref = ap.attention_prefill_reference(q, k, v, return_lse=True, **kw)
  out, lse = registry.get_op("attention_prefill")(q, k, v, backend=backend, return_lse=True, **kw)
  testing.assert_close(out, ref, jnp.bfloat16)
  finite = np.isfinite(np.asarray(lse_ref))
  testing.assert_close(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0), jnp.float32,
                       tol=1e-5, what="lse")


def test_xla_chunked_path_matches_reference(monkeypatch):
  q, k, v = _qkv(1, 80, 80, 2, 1, 16, jnp.float32)
  ref = ap.attention_prefill_reference(q, k, v, causal=True)
  out = ap._attention_xla(q, k, v, *ap._vectors(1, 80, 80, None, None, None, None),
                          causal=True, scale=0.25, window=None, has_lse=False, chunk=32)
  testing.assert_close(out, ref, jnp.float32)


def test_default_backend_on_cpu_is_not_interpreted():
  q, k, v = _qkv(1, 16, 16, 2, 2, 64)
  impl = registry.get_op("attention_prefill").select(q, k, v)
  assert impl.name in ("xla", "reference")


@pytest.mark.parametrize("bad,match", [
    (dict(q=(1, 16, 3, 64), k=(1, 16, 2, 64)), "multiple of kv heads"),
    (dict(q=(1, 16, 2, 64), k=(1, 16, 2, 32)), "head dim"),
    (dict(q=(16, 2, 64), k=(1, 16, 2, 64)), "4D"),
])
def test_bad_shapes_are_rejected(bad, match):
  q = jnp.ones(bad["q"], jnp.bfloat16)
  k = jnp.ones(bad["k"], jnp.bfloat16)
  for backend in ("reference", "xla"):
    with pytest.raises(ValueError, match=match):
      registry.get_op("attention_prefill")(q, k, k, backend=backend)


def test_a_bool_window_is_refused():
  # sliding_window=True was a window of 1 (bool is an int).
  q, k, v = _qkv(1, 16, 16, 2, 2, 64)
  for backend in ("reference", "xla"):
    with pytest.raises(ValueError, match="sliding_window=True must be a positive int"):
      registry.get_op("attention_prefill")(q, k, v, sliding_window=True, backend=backend)


def test_mosaic_rejects_what_it_cannot_run():
  q = jnp.ones((1, 16, 2, 64), jnp.float32)
  with pytest.raises(registry.BackendError, match="dtype float32"):
    registry.get_op("attention_prefill")(q, q, q, backend="mosaic")
  q = jnp.ones((1, 16, 2, 96), jnp.bfloat16)
  with pytest.raises(registry.BackendError, match="head dim 96 .*64, 128, 256"):
    registry.get_op("attention_prefill")(q, q, q, backend="mosaic")
  seg = jnp.ones((1, 17), jnp.int32)
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="q_segment_ids must have shape"):
    ap.attention_prefill_mosaic(q, q, q, q_segment_ids=seg, kv_segment_ids=seg)
  with pytest.raises(ValueError, match="block_q"):
    ap.Config(block_q=128)
  # The kernel takes the row max before scaling: a scale <= 0 is refused
  # (it gave NaN), and the default order takes another backend.
  for sm in (0.0, -0.5):
    with pytest.raises(registry.BackendError, match="must be > 0"):
      registry.get_op("attention_prefill")(q, q, q, backend="mosaic", sm_scale=sm)
    with pytest.raises(ValueError, match="must be > 0"):
      ap.attention_prefill_mosaic(q, q, q, sm_scale=sm)


def test_cudnn_says_why_not():
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  why = ap._cudnn_why_not(q, q, q)
  if not jax.devices()[0].platform == "gpu":
    assert "CUDA GPU" in why
  seg = jnp.ones((1, 16), jnp.int32)
  with pytest.raises(registry.BackendError):
    registry.get_op("attention_prefill")(q, q, q, backend="cudnn", q_segment_ids=seg,
                                          kv_segment_ids=seg)


GPU_VARIANTS = {  # the GPU-only code paths, each alone
    "default": {}, "p_smem": dict(p_smem=True), "acc_add": dict(acc_in_place=False),
    "p_smem_acc_add": dict(p_smem=True, acc_in_place=False), "no_pingpong": dict(pingpong=False),
    "overlap": dict(overlap=True), "overlap_no_pingpong": dict(overlap=True, pingpong=False),
    "overlap_p_smem_acc_add": dict(overlap=True, p_smem=True, acc_in_place=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
@pytest.mark.parametrize("name", CASES)
def test_mosaic_cases_on_gpu(name, variant):
  """The interpret-mode cases at the same shapes, compiled, for each GPU-only path."""
  shape, kw, cfg = _case(name)
  cfg = dataclasses.replace(cfg or ap._pick_config(shape["D"], jnp.bfloat16, kw["causal"]),
                            **GPU_VARIANTS[variant])
  dense = ap.unmasked(kw["causal"], kw.get("sliding_window"), kw.get("q_segment_ids"))
  if ap.smem_bytes(cfg, shape["D"], dense=dense) > target_lib.current().ceilings.smem_per_block:
    pytest.skip("does not fit in SMEM (refused before compiling: test_gpu_lowering)")
  q, k, v = _qkv(**shape)
  ref = ap.attention_prefill_reference(q, k, v, **kw)
  out = ap.attention_prefill_mosaic(q, k, v, config=cfg, **kw)
  testing.assert_close(out, ref, jnp.bfloat16, what=f"{name} {variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv,d", [(32, 32, 128), (32, 8, 128), (16, 16, 64), (16, 8, 256)])
def test_mosaic_full_size_on_gpu(causal, hq, hkv, d):
  q, k, v = _qkv(1, 4096, 4096, hq, hkv, d)
  ref = ap.attention_prefill_xla(q.astype(jnp.float32), k.astype(jnp.float32),
                                 v.astype(jnp.float32), causal=causal)
  out = ap.attention_prefill_mosaic(q, k, v, causal=causal)
  testing.assert_close(out, ref, jnp.bfloat16)
