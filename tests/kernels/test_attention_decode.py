"""attention_decode: every backend against the float32 reference.

The reference itself is checked against a per-query numpy loop written from
the interface's words. Pages are handed out in random order, lengths are
random and include 0, 1, non-multiples of the page size and lengths shorter
than Tq. The Mosaic kernel runs in interpret mode on CPU (race detection on).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels import attention_decode as ad
from mosaic import dsl, registry, testing, tuning


def _seed() -> int:
  return int(jax.random.randint(testing.fresh_key(), (), 0, 2**31 - 1))


def _case(b, tq, hq, hkv, d, page, lengths=None, max_len=None, dtype=jnp.bfloat16,
          extra_pages=3):
  """Random q, pages in a random order, a page table with junk past each sequence."""
  rng = np.random.default_rng(_seed())
  if lengths is None:
    lengths = rng.integers(1, max_len + 1, size=b)
  lengths = np.asarray(lengths, np.int32)
  mp = max(1, int(-(-lengths.max() // page))) + 1  # one spare column: junk entries
  num_pages = b * mp + extra_pages
  perm = rng.permutation(np.arange(1, num_pages))
  table = perm[:b * mp].reshape(b, mp).astype(np.int32)
  for i, n in enumerate(lengths):
    used = -(-int(n) // page)
    table[i, used:] = rng.integers(0, num_pages, size=mp - used)  # arbitrary valid pages
  q, kp, vp = testing.random_inputs(
      [(b, tq, hq, d), (hkv, num_pages, page, d), (hkv, num_pages, page, d)], dtype)
  return q, kp, vp, jnp.asarray(lengths), jnp.asarray(table)


def _naive(q, kp, vp, lengths, table, sm_scale=None):
  q, kp, vp = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, kp, vp))
  lengths, table = np.asarray(lengths), np.asarray(table)
  b, tq, hq, d = q.shape
  hkv, _, page, _ = kp.shape
  scale = d ** -0.5 if sm_scale is None else sm_scale
  out = np.zeros(q.shape)
  for i in range(b):
    for t in range(tq):
      pos = int(lengths[i]) - tq + t
      for h in range(hq):
        kh = h // (hq // hkv)
        keys = [kp[kh, table[i, j // page], j % page] for j in range(pos + 1)]
        vals = [vp[kh, table[i, j // page], j % page] for j in range(pos + 1)]
        if not keys:
          continue
        s = np.stack(keys) @ q[i, t, h] * scale
        w = np.exp(s - s.max())
        out[i, t, h] = (w / w.sum()) @ np.stack(vals)
  return out


@pytest.mark.parametrize("tq", [1, 3])
def test_reference_matches_naive_loop(tq):
  args = _case(3, tq, 4, 2, 16, 8, lengths=[1, 13, 24], dtype=jnp.float32)
  ref = ad.attention_decode_reference(*args, sm_scale=0.3)
  assert ref.dtype == jnp.float32
  testing.assert_close(ref, _naive(*args, sm_scale=0.3), tol=1e-5)


def test_reference_short_and_empty_rows_are_zero():
  # length 0: nothing to see; length 1 with Tq=3: queries 0 and 1 sit before
  # the sequence start and see nothing either.
  q, kp, vp, lengths, table = _case(2, 3, 4, 2, 16, 8, lengths=[0, 1])
  out = np.asarray(ad.attention_decode_reference(q, kp, vp, lengths, table))
  assert np.all(out[0] == 0) and np.all(out[1, :2] == 0)
  v0 = np.asarray(vp[:, table[1, 0], 0], np.float32)  # the single visible value
  np.testing.assert_allclose(out[1, 2], np.repeat(v0, 2, axis=0), rtol=1e-6)


CASES = {
    # name: (b, tq, hq, hkv, d, page, lengths)
    "tq1_gqa4": (4, 1, 8, 2, 64, 16, [1, 37, 64, 5]),
    # 3 packed rows: Q and the output stay unpadded in HBM (TMA fills/drops the rest)
    "tq1_gqa3": (2, 1, 6, 2, 64, 16, [5, 40]),
    "tq4_short": (3, 4, 8, 4, 64, 16, [2, 0, 50]),
    "tq8_mha": (2, 8, 2, 2, 64, 32, [8, 77]),
}


@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_reference(backend, case):
  b, tq, hq, hkv, d, page, lengths = CASES[case]
  args = _case(b, tq, hq, hkv, d, page, lengths=lengths)
  out = ad.attention_decode(*args, backend=backend)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)
  # Rows that see no key are exactly 0 (length 0, or a query before the start).
  out = np.asarray(out, np.float32)
  for i, n in enumerate(lengths):
    for t in range(tq):
      if n - tq + t < 0:
        assert np.all(out[i, t] == 0), (i, t)


@pytest.mark.parametrize("config", [
    ad.Config(pages_per_step=2, stages=2, splits=3),  # split-K + combine, 2 pages a step
    ad.Config(pages_per_step=1, stages=3, splits=1),  # ring wraps several times
])
def test_mosaic_configs(config):
  args = _case(3, 2, 8, 2, 64, 16, max_len=150)
  out = ad.attention_decode_mosaic(*args, config=config)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)


@pytest.mark.parametrize("config", [
    ad.Config(steps_per_page=2, stages=2, splits=3),  # split ranges start mid-page
    ad.Config(steps_per_page=4, stages=3, splits=1),  # ring wraps inside pages
    ad.Config(steps_per_page=2, stages=2, splits=2, blocks_per_sm=1),  # persistent
])
def test_mosaic_parts_of_a_page_per_step(config, monkeypatch):
  # 64-token pages copied 32 or 16 rows a step; lengths end inside a part,
  # on a part boundary (32, 96) and at 1.
  monkeypatch.setattr(ad, "_num_sms", lambda: 2)
  args = _case(5, 2, 8, 2, 64, 64, lengths=[1, 32, 96, 150, 57])
  out = ad.attention_decode_mosaic(*args, config=config)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)
  if dsl.interpreting():
    assert not dsl.races_found()


@pytest.mark.parametrize("splits", [1, 3, 70])  # 70: past the unrolled form's limit
def test_split_merge_is_the_softmax_over_all_keys(splits):
  # Partials of disjoint key ranges merge into the softmax over their union;
  # a row no split saw (lse -inf everywhere) is 0, and an empty split weighs 0.
  rng = np.random.default_rng(_seed())
  rows, d, keys = 6, 8, 5
  scores = rng.normal(size=(splits, rows, keys)) * 3
  vals = rng.normal(size=(splits, keys, d))
  scores[:, 0] = -np.inf
  scores[0, 1] = -np.inf
  with np.errstate(invalid="ignore", divide="ignore"):
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp2(scores - m)
    o_parts = np.nan_to_num(e @ vals / e.sum(-1, keepdims=True))
    lse = np.where(np.isfinite(m[..., 0]), np.log2(e.sum(-1)) + m[..., 0], -np.inf)
    flat_s = scores.transpose(1, 0, 2).reshape(rows, -1)
    flat_v = vals.reshape(-1, d)
    w = np.exp2(flat_s - flat_s.max(-1, keepdims=True))  # row 0: all -inf, NaN -> 0 below
    want = np.nan_to_num((w @ flat_v) / w.sum(-1, keepdims=True))
  got = jax.jit(ad._combine)(jnp.asarray(o_parts, jnp.float32), jnp.asarray(lse, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(got)[0] == 0)


SWAP_CASES = {
    # name: (b, tq, hq, hkv, d, page, lengths, config): S^T = K Q^T, O^T = V^T P^T
    "rows4_split": (3, 1, 8, 2, 64, 16, [1, 70, 150],
                    ad.Config(pages_per_step=4, stages=2, splits=3, swap_ab=True)),
    "rows12_ring_wraps": (2, 3, 8, 2, 64, 32, [2, 200],
                          ad.Config(pages_per_step=2, stages=3, splits=1, swap_ab=True)),
    "rows128_two_tiles": (1, 8, 16, 1, 128, 64, [100],
                          ad.Config(pages_per_step=1, stages=2, splits=2, swap_ab=True)),
    "half_pages": (2, 1, 8, 2, 64, 128, [1, 300],
                   ad.Config(steps_per_page=2, stages=3, splits=2, swap_ab=True)),
}


@pytest.mark.parametrize("case", list(SWAP_CASES))
def test_mosaic_swap_ab(case):
  # Packed rows below 8 (TMA zero-fills Q, exactly 4 rows leave), not a
  # multiple of 8, and two 64-row tiles; split partials and bf16 output, both
  # stored transposed from O^T.
  b, tq, hq, hkv, d, page, lengths, cfg = SWAP_CASES[case]
  args = _case(b, tq, hq, hkv, d, page, lengths=lengths)
  out = ad.attention_decode_mosaic(*args, config=cfg)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)
  if dsl.interpreting():
    assert not dsl.races_found()


@pytest.mark.parametrize("persistent", [0, 1])
def test_short_sequences_in_a_wide_table(persistent, monkeypatch):
  # The engine's table is as wide as the longest context it allows: splits
  # share out each sequence's own pages (here 1 to 3 of them over 4 splits),
  # and the junk columns past them are never read.
  monkeypatch.setattr(ad, "_num_sms", lambda: 2)
  q, kp, vp, lengths, table = _case(3, 1, 8, 2, 64, 16, lengths=[3, 17, 40])
  rng = np.random.default_rng(_seed())
  junk = rng.integers(0, kp.shape[1], size=(3, 13)).astype(np.int32)
  table = jnp.concatenate([table, jnp.asarray(junk)], axis=1)  # 16 columns
  args = (q, kp, vp, lengths, table)
  cfg = ad.Config(pages_per_step=1, stages=2, splits=4, blocks_per_sm=persistent)
  out = ad.attention_decode_mosaic(*args, config=cfg)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)
  if dsl.interpreting():
    assert not dsl.races_found()


@pytest.mark.parametrize("config", [
    ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2),  # bf16 output via the Q buffers
    ad.Config(pages_per_step=2, stages=3, splits=2, blocks_per_sm=1),  # f32 partials
    ad.Config(pages_per_step=4, stages=2, blocks_per_sm=2, swap_ab=True),  # via a staging buffer
])
def test_mosaic_persistent(config, monkeypatch):
  # One SM: each block loops over several work items, some with no keys, and
  # the copy ring crosses item boundaries.
  monkeypatch.setattr(ad, "_num_sms", lambda: 1)
  args = _case(4, 2, 8, 2, 64, 16, lengths=[0, 1, 77, 130])
  out = ad.attention_decode_mosaic(*args, config=config)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)
  assert np.all(np.asarray(out[0], np.float32) == 0)


def test_mosaic_two_row_tiles_fp16_d128():
  # 16 query heads on one kv head x 8 tokens = 128 packed rows: two tiles.
  args = _case(1, 8, 16, 1, 128, 64, lengths=[100], dtype=jnp.float16)
  out = ad.attention_decode_mosaic(*args, sm_scale=0.05,
                                   config=ad.Config(pages_per_step=1, stages=2, splits=2))
  testing.assert_close(out, ad.attention_decode_reference(*args, sm_scale=0.05), jnp.float16)


def test_triton_splits():
  args = _case(2, 2, 8, 2, 64, 16, max_len=200)
  out = ad.attention_decode_triton(*args, splits=4, pages_per_block=2)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)


@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic"])
def test_layer_of_a_cache_stack(backend):
  # layer= reads one layer of a [layers, Hkv, pages, page, D] stack; the
  # layer index may be traced (a model looping over layers under jit).
  q, kp, vp, lengths, table = _case(2, 2, 8, 2, 64, 16, lengths=[1, 40])
  other_k, other_v = testing.random_inputs([kp.shape, kp.shape], kp.dtype)
  k_stack, v_stack = jnp.stack([other_k, kp, other_k]), jnp.stack([other_v, vp, other_v])
  want = ad.attention_decode_reference(q, kp, vp, lengths, table)
  f = jax.jit(lambda lyr, *a: ad.attention_decode(*a, layer=lyr, backend=backend))
  out = f(jnp.int32(1), q, k_stack, v_stack, lengths, table)
  testing.assert_close(out, want, jnp.bfloat16)
  ref = ad.attention_decode_reference(q, k_stack, v_stack, lengths, table, layer=1)
  testing.assert_close(ref, want, tol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_clamps_at_the_edges(backend):
  # A traced layer past the stack reads the last layer; a length past the
  # table's capacity is clamped to it; with 2 pages a step and an odd table
  # width the last step reaches past the table (those keys are masked).
  q, kp, vp, lengths, table = _case(2, 1, 8, 2, 64, 16, lengths=[90, 33])
  table = table[:, :5]  # capacity 80 tokens: row 0 is cut to 80
  over = jnp.asarray([500, 33], jnp.int32)
  want = ad.attention_decode_reference(q, kp, vp, jnp.asarray([80, 33], jnp.int32), table)
  other = testing.random_inputs([kp.shape], kp.dtype)[0]
  k_stack, v_stack = jnp.stack([other, kp]), jnp.stack([other, vp])
  if backend == "mosaic":
    cfg = ad.Config(pages_per_step=2, stages=2, splits=2)
    f = jax.jit(lambda lyr, *a: ad.attention_decode_mosaic(*a, layer=lyr, config=cfg))
  else:
    f = jax.jit(lambda lyr, *a: ad.attention_decode(*a, layer=lyr, backend=backend))
  out = f(jnp.int32(7), q, k_stack, v_stack, over, table)
  testing.assert_close(out, want, jnp.bfloat16)


def test_contiguous_to_paged_round_trip():
  b, s, hkv, d = 2, 40, 2, 16
  k, v, q = testing.random_inputs([(b, s, hkv, d), (b, s, hkv, d), (b, 1, 4, d)], jnp.float32)
  kp, table = ad.contiguous_to_paged(k, page_size=16, seed=_seed())
  vp, table2 = ad.contiguous_to_paged(v, page_size=16, seed=0)
  vp = vp.at[:, table.reshape(-1)].set(vp[:, table2.reshape(-1)])
  assert int(table.min()) >= 1  # page 0 stays the null page
  lengths = jnp.array([s, s], jnp.int32)
  out = ad.attention_decode_reference(q, kp, vp, lengths, table)
  want = jax.nn.dot_product_attention(q, k, v)  # GQA, every key visible
  testing.assert_close(out, want, tol=1e-5)


def test_default_backend_on_cpu_is_xla():
  args = _case(1, 1, 4, 2, 64, 16, lengths=[5])
  assert registry.get_op("attention_decode").select(*args).name == "xla"
  # The default page is one the H200 table was tuned for (bf16, D=128).
  prefix = tuning.shape_key(page=ad.DEFAULT_PAGE_SIZE, head_dim=128, dtype="bfloat16")
  assert any(k.startswith(prefix + ",") for k in tuning.entries("attention_decode", "nvidia_h200"))


@pytest.mark.parametrize("bad, match", [
    (dict(lengths=jnp.array([3], jnp.int64 if jax.config.jax_enable_x64 else jnp.float32)),
     "lengths must be int32"),
    (dict(q=jnp.ones((1, 9, 4, 64), jnp.bfloat16)), "tq=9"),
    (dict(q=jnp.ones((1, 1, 3, 64), jnp.bfloat16)), "multiple of kv heads"),
    (dict(q=jnp.ones((1, 1, 4, 32), jnp.bfloat16)), "head dims differ"),
    (dict(page_table=jnp.zeros((2, 3), jnp.int32)), "page_table must be int32"),
    (dict(v_pages=jnp.ones((2, 5, 16, 64), jnp.float16)), "share a dtype"),
    (dict(layer=0), "with layer=, k_pages must be"),
])
def test_bad_inputs_are_rejected(bad, match):
  q, kp, vp, lengths, table = _case(1, 1, 4, 2, 64, 16, lengths=[5])
  args = dict(q=q, k_pages=kp, v_pages=vp, lengths=lengths, page_table=table)
  args.update(bad)
  layer = args.pop("layer", None)
  for backend in ("xla", "reference"):
    with pytest.raises(ValueError, match=match):
      ad.attention_decode(*args.values(), layer=layer, backend=backend)


def test_out_of_range_pages_and_negative_lengths_are_refused_where_known():
  # Eager calls (values known): a page index outside the pages gave each
  # backend a different wrong answer (NaN, another page's keys), a negative
  # length read as 0. Under jit the values are not known (the model checks).
  # (Host arrays: a GPU array's values are not read, which would wait for it.)
  q, kp, vp, lengths, table = _case(1, 1, 4, 2, 64, 16, lengths=[5])
  n = kp.shape[-3]
  for bad_table, bad_lengths, match in (
      (table.at[0, 0].set(n), lengths, rf"page_table entries must be in \[0, {n}\)"),
      (table.at[0, 0].set(-1), lengths, "page_table entries must be in"),
      (table, lengths.at[0].set(-2), r"lengths must be >= 0; got \[-2\]")):
    bad_table, bad_lengths = np.asarray(bad_table), np.asarray(bad_lengths)
    for backend in ("xla", "reference", "mosaic"):
      with pytest.raises(ValueError, match=match):
        ad.attention_decode(q, kp, vp, bad_lengths, bad_table, backend=backend)
  jitted = jax.jit(lambda t: ad.attention_decode(q, kp, vp, lengths, t, backend="xla"))
  testing.assert_close(jitted(table), ad.attention_decode_reference(q, kp, vp, lengths, table),
                       jnp.bfloat16)


def test_mosaic_says_why_not():
  q, kp, vp, lengths, table = _case(1, 1, 4, 2, 64, 16, lengths=[5], dtype=jnp.float32)
  with pytest.raises(registry.BackendError, match="dtype float32 is not supported"):
    ad.attention_decode(q, kp, vp, lengths, table, backend="mosaic")
  with pytest.raises(ValueError, match="pages_per_step"):
    ad.Config(pages_per_step=3)
  with pytest.raises(ValueError, match="blocks_per_sm"):
    ad.Config(blocks_per_sm=5)
  stack = jnp.stack([kp, kp])
  with pytest.raises(ValueError, match="layer=3 is out of range"):
    ad.attention_decode(q, stack, stack, lengths, table, layer=3, backend="xla")
  args = _case(1, 1, 4, 2, 64, 8, lengths=[5])
  with pytest.raises(ValueError, match="multiple of 16 tokens"):
    ad.attention_decode_mosaic(*args, config=ad.Config(pages_per_step=1))
  with pytest.raises(ValueError, match="swap_ab.*multiple of 64"):
    ad.attention_decode_mosaic(*args, config=ad.Config(pages_per_step=4, swap_ab=True))
  with pytest.raises(ValueError, match="swap_ab"):
    ad.Config(swap_ab=1)
  with pytest.raises(ValueError, match="steps_per_page"):
    ad.Config(steps_per_page=3)
  with pytest.raises(ValueError, match="needs pages_per_step=1"):
    ad.Config(pages_per_step=2, steps_per_page=2)
  args = _case(1, 1, 4, 2, 64, 32, lengths=[5])
  with pytest.raises(ValueError, match="multiple of 16 tokens"):  # 32 / 4 = 8 keys
    ad.attention_decode_mosaic(*args, config=ad.Config(steps_per_page=4))
  with pytest.raises(ValueError, match="swap_ab.*multiple of 64"):
    ad.attention_decode_mosaic(*args, config=ad.Config(steps_per_page=2, swap_ab=True))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic", "triton", "xla"])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("batch", [8, 256])  # 256: the table's half-page steps at 128
def test_gpu_full_size(backend, page, batch):
  args = _case(batch, 1, 32, 8, 128, page, max_len=4096 if batch == 8 else 600)
  out = ad.attention_decode(*args, backend=backend)
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_speculative_edges():
  args = _case(5, 8, 32, 8, 128, 64, lengths=[0, 1, 7, 64, 3001])
  for backend in ("mosaic", "triton"):
    out = ad.attention_decode(*args, backend=backend)
    testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_layer_stack_and_persistent():
  q, kp, vp, lengths, table = _case(6, 2, 32, 8, 128, 64, lengths=[0, 1, 65, 700, 64, 2000])
  k_stack, v_stack = jnp.stack([vp, kp]), jnp.stack([kp, vp])
  want = ad.attention_decode_reference(q, kp, vp, lengths, table)
  for cfg in (None, ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2),
              ad.Config(pages_per_step=2, stages=2, splits=3, blocks_per_sm=1),
              ad.Config(pages_per_step=1, stages=3, swap_ab=True),
              ad.Config(pages_per_step=2, stages=2, splits=3, swap_ab=True),
              ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2, swap_ab=True)):
    out = ad.attention_decode_mosaic(q, k_stack, v_stack, lengths, table, layer=1, config=cfg)
    testing.assert_close(out, want, jnp.bfloat16, what=f"mosaic {cfg}")


def test_heuristic_swaps_where_a_steps_keys_allow():
  # No table entry for these keys (D 64): the heuristic. 64 keys a step swap,
  # with a third stage unless split; 2 x 24 = 48 keys cannot (the M of K Q^T).
  pick = lambda batch, page: ad._pick_config(batch, 2, 1, 40, page, 64, jnp.bfloat16, rows=4)
  assert pick(64, 16) == ad.Config(pages_per_step=4, stages=3, swap_ab=True)
  assert pick(1, 16) == ad.Config(pages_per_step=8, stages=2, swap_ab=True)  # split-K
  assert not pick(64, 24).swap_ab
  # 128-token pages: half a page a step where 64 keys are wanted, whole pages
  # under split-K.
  assert pick(64, 128) == ad.Config(steps_per_page=2, stages=3, swap_ab=True)
  assert pick(1, 128) == ad.Config(pages_per_step=1, stages=2, swap_ab=True)


def test_exact_output_rows_only_where_the_staging_buffer_fits():
  """4 packed rows leave exactly through an untiled buffer, unless the config
  fills SMEM without it (then the output stays padded, as before)."""
  stage = lambda cfg, rows=4, split=False: ad._stage_out(cfg, rows, split, 64, 128, jnp.bfloat16)
  assert stage(ad.Config(pages_per_step=1, stages=2))
  assert not stage(ad.Config(pages_per_step=2, stages=3))  # 224 KB before the buffer
  assert not stage(ad.Config(pages_per_step=1, stages=2), rows=8)  # tiled Q buffer serves
  assert not stage(ad.Config(pages_per_step=1, stages=2), split=True)  # float32 buffer exists
  assert not stage(ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2))  # persistent
  # swap_ab: O^T is stored transposed into it, whatever the rows (its own SMEM is small)
  assert stage(ad.Config(pages_per_step=2, stages=3, blocks_per_sm=2, swap_ab=True), rows=32)
  assert not stage(ad.Config(pages_per_step=1, stages=2, swap_ab=True), split=True)


@pytest.mark.parametrize("limit", [None, 0])
def test_padded_output_fallback_is_correct(limit, monkeypatch):
  """4 packed rows, one split: exact rows from the staging buffer, or (SMEM
  too small for it) the padded output through the Q buffer, then a slice."""
  if limit is not None:
    monkeypatch.setattr(ad, "SMEM_LIMIT", limit)
  args = _case(3, 1, 8, 2, 64, 16, lengths=[1, 30, 47])
  out = ad.attention_decode_mosaic(*args, config=ad.Config(pages_per_step=1, stages=2, splits=1))
  testing.assert_close(out, ad.attention_decode_reference(*args), jnp.bfloat16)


# --------------------------------------------------------------------------
# fp8 pages: the cache holds K / k_scale and V / v_scale (float8_e4m3fn)


F8 = jnp.float8_e4m3fn


def _fp8_case(*shape_args, **kw):
  """_case with its pages quantized at per-tensor scales: (args, kv_scales, f32 pages)."""
  q, kp, vp, lengths, table = _case(*shape_args, **kw)
  scales = jnp.stack([ad.fp8_scale(kp), ad.fp8_scale(vp)])
  k8, v8 = ad.quantize_pages(kp, scales[0]), ad.quantize_pages(vp, scales[1])
  deq = (k8.astype(jnp.float32) * scales[0], v8.astype(jnp.float32) * scales[1])
  return (q, k8, v8, lengths, table), scales, deq


def test_fp8_reference_means_the_scaled_values():
  (q, k8, v8, lengths, table), scales, (kd, vd) = _fp8_case(3, 2, 8, 2, 64, 16,
                                                           lengths=[1, 40, 0])
  out = ad.attention_decode_reference(q, k8, v8, lengths, table, kv_scales=scales)
  want = ad.attention_decode_reference(q.astype(jnp.float32), kd, vd, lengths, table)
  testing.assert_close(out, want, tol=1e-6)
  # Without scales the pages are read at scale 1.
  one = ad.attention_decode_reference(q, k8, v8, lengths, table)
  want1 = ad.attention_decode_reference(q.astype(jnp.float32), k8.astype(jnp.float32),
                                        v8.astype(jnp.float32), lengths, table)
  testing.assert_close(one, want1, tol=1e-6)


def test_quantize_pages_round_trip_and_saturation():
  x = testing.random_inputs([(4, 64, 16)], jnp.float32, scale=3.0)[0]
  s = ad.fp8_scale(x)
  x8 = ad.quantize_pages(x, s)
  assert x8.dtype == F8
  assert float(jnp.max(jnp.abs(x8.astype(jnp.float32)))) == ad.FP8_MAX  # max|x| maps to the top
  # e4m3 keeps 3 mantissa bits: each value within 2^-4 relative, plus the
  # subnormal step near 0.
  back = x8.astype(jnp.float32) * s
  assert float(jnp.max(jnp.abs(back - x) - (2.0**-4 * jnp.abs(x) + 2.0**-9 * s))) <= 0
  big = ad.quantize_pages(jnp.array([1e6, -1e6, 3.0]), 1.0)
  np.testing.assert_array_equal(np.asarray(big.astype(jnp.float32)), [448.0, -448.0, 3.0])
  assert float(ad.fp8_scale(jnp.zeros((3,)))) == 1.0
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    ad.quantize_pages(x, s, dtype=jnp.int8)


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
@pytest.mark.parametrize("case", ["tq1_gqa4", "tq4_short"])
def test_fp8_pages_match_reference(backend, case):
  b, tq, hq, hkv, d, page, lengths = CASES[case]
  args, scales, _ = _fp8_case(b, tq, hq, hkv, d, page, lengths=lengths)
  out = ad.attention_decode(*args, kv_scales=scales, backend=backend)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  testing.assert_close(out, ad.attention_decode_reference(*args, kv_scales=scales),
                       jnp.bfloat16)


@pytest.mark.parametrize("config", [
    ad.Config(pages_per_step=2, stages=2, splits=3),  # f32 partials: v_scale before the merge
    ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2),  # persistent, f16 output
    ad.Config(pages_per_step=4, stages=2, splits=2, swap_ab=True),
])
def test_fp8_mosaic_configs(config):
  args, scales, _ = _fp8_case(3, 2, 8, 2, 64, 16, max_len=150)
  out = ad.attention_decode_mosaic(*args, kv_scales=scales, config=config)
  testing.assert_close(out, ad.attention_decode_reference(*args, kv_scales=scales),
                       jnp.bfloat16)
  if dsl.interpreting():
    assert not dsl.races_found()


@pytest.mark.parametrize("backend", ["xla", "mosaic"])
def test_fp8_layer_stack_with_per_layer_scales(backend):
  # Each layer of the stack has its own (k_scale, v_scale); a traced layer
  # reads its row.
  args, scales, _ = _fp8_case(2, 1, 8, 2, 64, 16, lengths=[3, 45])
  q, k8, v8, lengths, table = args
  other = ad.quantize_pages(testing.random_inputs([k8.shape], jnp.float32)[0], 0.01)
  k_stack, v_stack = jnp.stack([other, k8]), jnp.stack([other, v8])
  per_layer = jnp.stack([jnp.array([5.0, 7.0], jnp.float32), scales])
  want = ad.attention_decode_reference(*args, kv_scales=scales)
  f = jax.jit(lambda lyr, *a: ad.attention_decode(*a, layer=lyr, kv_scales=per_layer,
                                                  backend=backend))
  out = f(jnp.int32(1), q, k_stack, v_stack, lengths, table)
  testing.assert_close(out, want, jnp.bfloat16)


@pytest.mark.parametrize("bad, match", [
    (dict(kv_scales=jnp.ones((3,), jnp.float32)), "kv_scales must be float32"),
    (dict(kv_scales=jnp.ones((2,), jnp.bfloat16)), "kv_scales must be float32"),
    (dict(kv_scales=jnp.ones((2,), jnp.float32), fp8=False), "fp8 pages"),
    (dict(v_bf16=True), "share a dtype"),
])
def test_fp8_bad_inputs_are_rejected(bad, match):
  args, scales, _ = _fp8_case(1, 1, 4, 2, 64, 16, lengths=[5])
  q, k8, v8, lengths, table = args
  if not bad.pop("fp8", True):
    k8, v8 = (x.astype(jnp.bfloat16) for x in (k8, v8))
  if bad.pop("v_bf16", False):
    v8 = v8.astype(jnp.bfloat16)
  for backend in ("xla", "reference", "mosaic"):
    with pytest.raises(ValueError, match=match):
      ad.attention_decode(q, k8, v8, lengths, table, backend=backend, **bad)


def test_fp8_triton_says_why_not():
  args, scales, _ = _fp8_case(1, 1, 4, 2, 64, 16, lengths=[5])
  with pytest.raises(registry.BackendError, match="fp8 pages"):
    ad.attention_decode(*args, kv_scales=scales, backend="triton")


@pytest.mark.gpu
def test_gpu_fp8_full_size():
  args, scales, _ = _fp8_case(8, 1, 32, 8, 128, 64, lengths=[1, 63, 64, 65, 700, 2000, 4096, 0])
  want = ad.attention_decode_reference(*args, kv_scales=scales)
  for cfg in (None, ad.Config(pages_per_step=2, stages=2, splits=4),
              ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2),
              ad.Config(pages_per_step=2, stages=2, splits=4, swap_ab=True)):
    out = ad.attention_decode_mosaic(*args, kv_scales=scales, config=cfg)
    testing.assert_close(out, want, jnp.bfloat16, what=f"mosaic fp8 {cfg}")
