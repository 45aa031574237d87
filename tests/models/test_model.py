"""The decoder's serving entry points on the tiny config (random weights).

Checks that batching, padding, page placement and chunking do not change the
numbers: a ragged batch must give what each sequence gives alone; the plain
jnp forward below is the float32 meaning of the model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import checkpoint, jitted, kv_cache, llama, model as model_lib, rope, sharding
from mosaic import testing


@pytest.fixture(scope="module")
def tiny():
  return models.load("tiny", dtype="float32")


def _dense_forward(m, ids):
  """Causal forward over one sequence in plain jnp, float32: logits [T, V]."""
  cfg, p = m.config, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                                  model_lib.nnx.to_pure_dict(m.params))
  t = len(ids)
  pos = jnp.arange(t)[None]
  inv = jnp.asarray(rope.rope_inv_freq(cfg))
  norm = lambda x, w: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w
  x = p["embed"][jnp.asarray(ids)][None]
  u = checkpoint.unfused_layers(jax.tree.map(np.asarray, p), cfg)
  for i in range(cfg.num_layers):
    L = jax.tree.map(lambda a: a[i], p["layers"])
    h = norm(x, L["attn_norm"]["w"])
    q = (h @ u["wq"][i]).reshape(1, t, cfg.num_heads, cfg.head_dim)
    k = (h @ u["wk"][i]).reshape(1, t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ u["wv"][i]).reshape(1, t, cfg.num_kv_heads, cfg.head_dim)
    q, k = rope.apply_rope(q, pos, inv), rope.apply_rope(k, pos, inv)
    k = jnp.repeat(k, cfg.q_per_kv, axis=2)
    v = jnp.repeat(v, cfg.q_per_kv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * cfg.head_dim**-0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(1, t, -1)
    x = x + o @ L["attn"]["wo"]["w"]
    h = norm(x, L["mlp_norm"]["w"])
    x = x + (jax.nn.silu(h @ u["w_gate"][i]) * (h @ u["w_up"][i])) @ L["mlp"]["w_down"]["w"]
  x = norm(x, p["final_norm"]["w"])
  return (x @ p["lm_head"]["w"])[0]


def test_prefill_matches_dense_forward(tiny):
  ids = np.random.default_rng().integers(3, 259, 21).tolist()
  cache = tiny.init_cache(8, 4)
  logits, _ = tiny.prefill(cache, [ids], [0], [len(ids)], np.arange(1, 7)[None], all_logits=True)
  testing.assert_close(logits[0], _dense_forward(tiny, ids), dtype=jnp.float32, what="prefill")


def test_folded_norms_compute_the_unfolded_model(tiny):
  """Norm weights far from 1 (random ones are all 1): the model with them
  folded into wqkv / w_gate_up gives the logits of the model that applies
  them in its norms, at prefill and at decode; the folded params' norms are 1
  and folding them again changes nothing."""
  rng = np.random.default_rng()
  p = jax.tree.map(np.asarray, model_lib.nnx.to_pure_dict(tiny.params))
  for norm in ("attn_norm", "mlp_norm"):
    p["layers"][norm]["w"] = rng.uniform(0.5, 2.0, p["layers"][norm]["w"].shape).astype(np.float32)
  plain = model_lib.Model(tiny.config, p, tiny.tokenizer, dtype="float32", fold_norms=False)
  folded = model_lib.Model(tiny.config, p, tiny.tokenizer, dtype="float32")
  fp = model_lib.nnx.to_pure_dict(folded.params)
  assert (np.asarray(fp["layers"]["attn_norm"]["w"]) == 1).all()
  again = llama.fold_norm_weights(fp)
  assert (np.asarray(again["layers"]["mlp"]["w_gate_up"]["w"])
          == np.asarray(fp["layers"]["mlp"]["w_gate_up"]["w"])).all()
  ids = rng.integers(3, 259, 9).tolist()
  table = np.arange(1, 5)[None]
  outs = []
  for m in (plain, folded):
    cache = m.init_cache(6, 4)
    pre, cache = m.prefill(cache, [ids], [0], [len(ids)], table, all_logits=True)
    dec, _ = m.decode(cache, [7], [len(ids) + 1], table)
    outs.append((pre[0], dec[0]))
  testing.assert_close(outs[1][0], outs[0][0], dtype=jnp.float32, what="prefill")
  testing.assert_close(outs[1][1], outs[0][1], dtype=jnp.float32, what="decode")
  # The folded graph ignores the norms' weights: unfolded params there would
  # be another function (so the check above can fail).
  wrong = model_lib.Model(tiny.config, p, tiny.tokenizer, dtype="float32")
  wrong.params = plain.params
  bad, _ = wrong.prefill(wrong.init_cache(6, 4), [ids], [0], [len(ids)], table, all_logits=True)
  assert not np.allclose(np.asarray(bad[0]), np.asarray(outs[0][0]), rtol=1e-2, atol=1e-2)


def test_ragged_batch_equals_single_sequences(tiny):
  """Three prompts of different lengths, pages interleaved, one padding row;
  then three batched decode steps (one row finishing early)."""
  rng = np.random.default_rng()
  lens = [5, 17, 1]
  prompts = [rng.integers(3, 259, n).tolist() for n in lens]
  ps, per_seq = 4, 6
  pages = rng.permutation(np.arange(1, 1 + per_seq * 3)).reshape(3, per_seq)
  table = np.concatenate([pages, np.zeros((1, per_seq), int)])
  cache = tiny.init_cache(1 + per_seq * 3, ps)
  toks = np.zeros((4, max(lens)), np.int32)
  for i, p in enumerate(prompts):
    toks[i, :len(p)] = p
  logits, cache = tiny.prefill(cache, toks, [0] * 4, lens + [0], table)
  steps = [np.asarray(logits[:3])]
  cur = list(lens)
  nxt = [int(np.argmax(steps[-1][i])) for i in range(3)]
  seqs = [p + [t] for p, t in zip(prompts, nxt)]
  for step in range(3):
    cur = [c + 1 for c in cur]
    lengths = cur + [0]
    if step == 2:
      lengths[1] = 0  # row 1 is done: a padding row from now on
    logits, cache = tiny.decode(cache, nxt + [0], lengths, table)
    logits = np.asarray(logits)
    steps.append(logits[:3])
    nxt = [int(np.argmax(logits[i])) for i in range(3)]
    for i in range(3):
      seqs[i].append(nxt[i])
  for i in range(3):
    dense = np.asarray(_dense_forward(tiny, seqs[i][:-1]))
    got = np.stack([s[i] for s in steps[:4 if i != 1 else 3]])
    want = dense[lens[i] - 1:lens[i] - 1 + len(got)]
    testing.assert_close(got, want, dtype=jnp.float32, what=f"row {i}")


def test_single_row_decode_matches_dense_forward(tiny):
  """Batch 1, one token a step (the model writes K/V by a dynamic update
  slice there): the steps cross a page boundary in a shuffled table."""
  rng = np.random.default_rng()
  ids = rng.integers(3, 259, 6).tolist()
  table = rng.permutation(np.arange(1, 5))[None]  # 4 pages of 4 tokens
  cache = tiny.init_cache(5, 4)
  logits, cache = tiny.prefill(cache, [ids], [0], [len(ids)], table)
  steps = []
  for _ in range(4):  # positions 6..9: slots 2, 3 of one page, then 0, 1 of the next
    ids.append(int(np.argmax(np.asarray(logits)[-1])))
    logits, cache = tiny.decode(cache, [ids[-1]], [len(ids)], table)
    steps.append(np.asarray(logits)[0])
  want = np.asarray(_dense_forward(tiny, ids))[-4:]
  testing.assert_close(np.stack(steps), want, dtype=jnp.float32, what="decode")


def test_buckets_do_not_recompile(tiny):
  table = np.arange(1, 7)[None]
  tiny.prefill(tiny.init_cache(8, 4), [[5, 6, 7]], [0], [3], table)
  before = jitted.prefill_step._cache_size()
  for n in (2, 9, 16):
    cache = tiny.init_cache(8, 4)
    _, cache = tiny.prefill(cache, [list(range(3, 3 + n))], [0], [n], table)
  assert jitted.prefill_step._cache_size() == before, "a length within one bucket recompiled"


@pytest.mark.parametrize("bad, match", [
    (dict(lengths=[5]), r"lengths must be in \[0, T=3\]"),
    (dict(page_table=np.array([[1]])), "page_table has 1 pages per row"),
    (dict(page_table=np.array([[1, 99]])), r"page_table entries must be in \[0, 8\)"),
    (dict(positions=[-1]), "positions must be"),
    # An id outside the vocabulary gave NaN logits (past it) or another token
    # (negative), with no error.
    (dict(tokens=[[5, 400, 7]]), r"token ids \[400\] are outside the vocabulary \[0, 320\)"),
    (dict(tokens=[[5, -3, 7]]), r"token ids \[-3\] are outside the vocabulary"),
    (dict(tokens=[[5.7, 6.2, 7.0]]), "tokens must be integer ids; got dtype float64"),
])
def test_prefill_rejects_bad_input(tiny, bad, match):
  args = dict(tokens=[[5, 6, 7]], positions=[0], lengths=[3], page_table=np.array([[1, 2]]))
  args.update(bad)
  cache = tiny.init_cache(8, 2)
  with pytest.raises(ValueError, match=match):
    tiny.prefill(cache, **args)


def test_decode_rejects_bad_input(tiny):
  cache = tiny.init_cache(8, 2)
  with pytest.raises(ValueError, match="1 <= Tq <= 8"):
    tiny.decode(cache, np.zeros((1, 9), int), [9], np.array([[1, 2, 3, 4, 5]]))
  with pytest.raises(ValueError, match="include the 2 new tokens"):
    tiny.decode(cache, [[3, 4]], [1], np.array([[1]]))
  with pytest.raises(ValueError, match="unknown attention_decode backend 'nope'"):
    tiny.decode(cache, [3], [1], np.array([[1]]), attention="nope")
  with pytest.raises(ValueError, match=r"token ids \[1000\] are outside the vocabulary"):
    tiny.decode(cache, [1000], [1], np.array([[1]]))


def test_generate_tiny_is_deterministic_and_decodes(tiny):
  ids = [tiny.tokenizer.bos_id] + tiny.tokenizer.encode("hello")
  a = models.generate(tiny, ids, 6, page_size=4, stop_at_eos=False)
  b = models.generate(models.load("tiny", dtype="float32"), ids, 6, page_size=4, stop_at_eos=False)
  assert a == b and len(a) == 6
  assert isinstance(tiny.tokenizer.decode(a), str)
  with pytest.raises(ValueError, match="prompt_ids is empty"):
    models.generate(tiny, [], 3)
  # A backend keyword it does not know (the op's name, a typo) is refused, not dropped.
  for kw in ("attention_decode", "attn"):
    with pytest.raises(TypeError, match=f"unknown backend keywords \\['{kw}'\\]"):
      models.generate(tiny, ids, 2, **{kw: "xla"})


def test_rope_llama3_scaling_bands():
  cfg = models.config.get("llama3.1-8b")
  scaled = rope.rope_inv_freq(cfg)
  plain = rope.rope_inv_freq(cfg.replace(rope_scaling=None))
  wavelen = 2 * np.pi / plain
  s = cfg.rope_scaling
  hi = wavelen < s.original_max_position_embeddings / s.high_freq_factor
  lo = wavelen > s.original_max_position_embeddings / s.low_freq_factor
  np.testing.assert_allclose(scaled[hi], plain[hi], rtol=1e-6)
  np.testing.assert_allclose(scaled[lo], plain[lo] / s.factor, rtol=1e-6)
  mid = ~hi & ~lo
  assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / s.factor)


def test_config_validation():
  cfg = models.config.get("tiny")
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    cfg.replace(num_kv_heads=3)
  with pytest.raises(ValueError, match="unknown model config 'gpt5'"):
    models.config.get("gpt5")
  with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
    models.ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
  for name, c in models.config.CONFIGS.items():
    assert models.ModelConfig.from_dict(c.to_dict()) == c, name


def test_the_70b_config_is_hugging_faces_and_splits_over_two_devices():
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
  cfg = models.config.get("llama3.1-70b")
  assert models.ModelConfig.from_hf(hf, name=cfg.name) == cfg
  assert 70.0e9 < cfg.num_params() < 71.0e9
  sharding.check_tp(cfg, 2)  # heads, kv heads, FFN blocks and vocabulary divide by 2


@pytest.mark.parametrize("fresh, pad_rows", [(True, 1), (False, 1), (False, 6)])
def test_mixed_step_equals_decode_then_prefill(tiny, fresh, pad_rows):
  """One mixed call (decode rows + prefill chunks sharing the matmuls) gives the
  logits and the cache that a decode call and a prefill call give. With 6
  padding decode rows there are 10 logits rows, which the lm_head rounds up
  to 16 and drops again."""
  rng = np.random.default_rng()
  ps, per_seq = 4, 6
  pages = rng.permutation(np.arange(1, 1 + per_seq * 4)).reshape(4, per_seq).astype(np.int32)
  cache = tiny.init_cache(1 + per_seq * 4, ps)
  prompts = [rng.integers(3, 259, n).tolist() for n in (6, 9)]  # rows 0, 1: decoding
  cached = 0 if fresh else 4  # row 3's prefix already in the cache
  chunk_rows = [rng.integers(3, 259, 7).tolist(), rng.integers(3, 259, 10).tolist()]
  toks = np.zeros((3, 9), np.int32)
  toks[0, :6], toks[1, :9], toks[2, :cached] = prompts[0], prompts[1], chunk_rows[1][:cached]
  _, cache = tiny.prefill(cache, toks, [0, 0, 0], [6, 9, cached], pages[[0, 1, 3]])
  dec_tokens = np.asarray([11, 12] + [0] * pad_rows, np.int32)  # then padding rows
  dec_lengths = np.asarray([7, 10] + [0] * pad_rows, np.int32)
  dec_table = np.stack([pages[0], pages[1]] + [np.zeros(per_seq, np.int32)] * pad_rows)
  ch_tokens = np.zeros((2, 8), np.int32)
  ch_tokens[0, :7] = chunk_rows[0]
  if not fresh:  # row 3 continues after its cached prefix; in a fresh batch it is padding
    ch_tokens[1, :6] = chunk_rows[1][cached:]
  ch_lengths = np.asarray([7, 0 if fresh else 6], np.int32)
  ch_pos = np.asarray([0, cached], np.int32)
  ch_table = pages[[2, 3]]

  ref_cache = jax.tree.map(jnp.copy, cache)
  dec_ref, ref_cache = jitted.decode_step(tiny.graphdef, tiny.params, ref_cache,
                                         jnp.asarray(dec_tokens)[:, None], dec_lengths, dec_table)
  pre_ref, ref_cache = jitted.prefill_step(tiny.graphdef, tiny.params, ref_cache, ch_tokens,
                                          ch_pos, ch_lengths, ch_table, fresh=fresh)
  got, cache = jitted.mixed_step(tiny.graphdef, tiny.params, cache, dec_tokens, dec_lengths,
                                dec_table, ch_tokens, ch_pos, ch_lengths, ch_table, fresh=fresh)
  bd = 2 + pad_rows
  assert got.shape == (bd + 2, tiny.config.vocab_size)
  want = np.concatenate([np.asarray(dec_ref[:, 0]), np.asarray(pre_ref)])
  live = [0, 1, bd] + ([] if fresh else [bd + 1])
  testing.assert_close(np.asarray(got)[live], want[live], dtype=jnp.float32, what="mixed logits")
  for name in ("k", "v"):
    a, b = np.array(getattr(cache, name)), np.array(getattr(ref_cache, name))
    assert not a[:, :, 0].any() and not b[:, :, 0].any(), "padding wrote to page 0"
    testing.assert_close(a, b, dtype=jnp.float32, what=f"mixed cache {name}")


@pytest.mark.parametrize("step", ["prefill", "continued", "decode", "mixed", "packed"])
def test_padding_tokens_write_nothing(tiny, step):
  """Padding rows, a short chunk's tail and padding decode rows leave every
  page but the live tokens' slots as it was, scratch page 0 included. They
  used to all land in page 0, slot 0: on the GPU XLA ran those colliding
  updates one after another (a 2-prompt prefill padded to 4 rows: ~300 ms
  against ~40; bench/results/serving_h200/padding_writes/)."""
  rng = np.random.default_rng()
  ps, per_seq, n_pages = 4, 4, 14
  pages = rng.permutation(np.arange(1, n_pages)).astype(np.int32)[:3 * per_seq].reshape(3, per_seq)
  empty = tiny.init_cache(n_pages, ps)
  rand = lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)
  cache = kv_cache.KVCache(rand(empty.k), rand(empty.v))
  before = jax.tree.map(np.array, cache)
  live = set()  # (page, slot) the step may write

  def toks(rows, t):
    return rng.integers(3, 259, (rows, t)).astype(np.int32)  # padding holds tokens too

  table = np.concatenate([pages, np.zeros((1, per_seq), np.int32)])  # row 3: padding
  if step in ("prefill", "continued"):
    pos = np.asarray([0, 0, 0, 0] if step == "prefill" else [0, 5, 2, 0], np.int32)
    lens = np.asarray([7, 3, 9, 0], np.int32)  # rows 0 and 1 end before the chunk's 9 tokens
    _, cache = jitted.prefill_step(tiny.graphdef, tiny.params, cache, toks(4, 9), pos, lens,
                                  table, fresh=step == "prefill")
    for r in range(3):
      live |= {(pages[r, p // ps], p % ps) for p in range(pos[r], pos[r] + lens[r])}
  elif step == "packed":  # 6 and 3 tokens in a row of 16; rows 1 and 3: padding
    _, cache = jitted.prefill_packed_step(tiny.graphdef, tiny.params, cache,
                                         *_packed([toks(1, 6)[0], [], toks(1, 3)[0]], 16), table)
    live = {(pages[0, p // ps], p % ps) for p in range(6)} | {(pages[2, 0], p) for p in range(3)}
  elif step == "decode":
    lens = np.asarray([6, 1, 0, 0], np.int32)  # rows 2 and 3: padding
    _, cache = jitted.decode_step(tiny.graphdef, tiny.params, cache, toks(4, 1), lens, table)
    live = {(pages[0, 5 // ps], 5 % ps), (pages[1, 0], 0)}
  else:
    dec_lens = np.asarray([3, 0, 0], np.int32)
    _, cache = jitted.mixed_step(tiny.graphdef, tiny.params, cache, toks(1, 3)[0], dec_lens,
                                table[[0, 3, 3]], toks(2, 8), np.asarray([0, 4], np.int32),
                                np.asarray([5, 2], np.int32), table[[1, 2]])
    live = {(pages[0, 0], 2)} | {(pages[1, p // ps], p % ps) for p in range(5)} | {
        (pages[2, 1], 0), (pages[2, 1], 1)}
  for name in ("k", "v"):
    got, old = np.asarray(getattr(cache, name)), getattr(before, name)
    changed = {(int(p), int(s)) for p, s in zip(*np.nonzero((got != old).any(axis=(0, 1, 4))))}
    assert changed == live, f"{step}: {name} written at {changed - live}, not at {live - changed}"


def _packed(prompts, n, starts=None):
  """Chunks packed in one row of n tokens: (tokens, tpos, seg, last [len(prompts) + 1]);
  chunk i starts at position starts[i] (default 0); an empty chunk is a
  padding row, and so is the last row."""
  rng = np.random.default_rng()
  tokens = rng.integers(3, 259, n).astype(np.int32)  # padding holds tokens too
  tpos, seg = np.zeros(n, np.int32), np.zeros(n, np.int32)
  last, o = np.zeros(len(prompts) + 1, np.int32), 0
  for i, p in enumerate(prompts):
    if len(p):
      c = 0 if starts is None else starts[i]
      tokens[o:o + len(p)], tpos[o:o + len(p)], seg[o:o + len(p)] = p, c + np.arange(len(p)), i + 1
      last[i] = o + len(p) - 1
      o += len(p)
  return tokens, tpos, seg, last


def test_packed_prefill_equals_row_prefill(tiny):
  """Prompts of 5, 17 and 1 tokens packed into one row of 32 (9 padding
  tokens, one padding row) give the logits and the cache that the row layout
  gives ([4, 17]: 45 padding tokens)."""
  rng = np.random.default_rng()
  lens = [5, 17, 1]
  ps, per_seq = 4, 6
  pages = rng.permutation(np.arange(1, 1 + per_seq * 3)).reshape(3, per_seq).astype(np.int32)
  table = np.concatenate([pages, np.zeros((1, per_seq), np.int32)])
  prompts = [rng.integers(3, 259, n).astype(np.int32) for n in lens]
  rows = np.zeros((4, 17), np.int32)
  for i, p in enumerate(prompts):
    rows[i, :len(p)] = p
  want, want_cache = jitted.prefill_step(
      tiny.graphdef, tiny.params, tiny.init_cache(1 + per_seq * 3, ps), rows,
      np.zeros(4, np.int32), np.asarray(lens + [0], np.int32), table, fresh=True)
  got, cache = jitted.prefill_packed_step(tiny.graphdef, tiny.params,
                                         tiny.init_cache(1 + per_seq * 3, ps),
                                         *_packed(prompts, 32), table)
  assert got.shape == (4, tiny.config.vocab_size)
  testing.assert_close(np.asarray(got)[:3], np.asarray(want)[:3], dtype=jnp.float32,
                       what="packed logits")
  for name in ("k", "v"):
    testing.assert_close(np.asarray(getattr(cache, name)), np.asarray(getattr(want_cache, name)),
                         dtype=jnp.float32, what=f"packed cache {name}")


def test_packed_continued_chunks_equal_row_prefill(tiny):
  """Chunks that continue prompts already in the cache (prefixes of 4, 8 and 0
  tokens; the empty one starts its prompt in the same call), packed into one
  row over the rows' gathered pages, give the logits and the cache that the
  row layout's continued chunks give."""
  rng = np.random.default_rng()
  ps, per_seq = 4, 6
  pre, rest = [4, 8, 0], [9, 5, 7]
  pages = rng.permutation(np.arange(1, 1 + per_seq * 3)).reshape(3, per_seq).astype(np.int32)
  table = np.concatenate([pages, np.zeros((1, per_seq), np.int32)])
  prompts = [rng.integers(3, 259, a + b).astype(np.int32) for a, b in zip(pre, rest)]

  def rows_of(parts, t):
    rows = np.zeros((4, t), np.int32)
    for i, p in enumerate(parts):
      rows[i, :len(p)] = p
    return rows

  cache = tiny.init_cache(1 + per_seq * 3, ps)
  _, cache = jitted.prefill_step(tiny.graphdef, tiny.params, cache,
                                rows_of([p[:a] for p, a in zip(prompts, pre)], 8),
                                np.zeros(4, np.int32), np.asarray(pre + [0], np.int32), table)
  # The row layout reads the cache it is given (donated): each run gets a copy.
  copy = lambda c: jax.tree.map(jnp.array, c)
  chunks = [p[a:] for p, a in zip(prompts, pre)]
  want, want_cache = jitted.prefill_step(
      tiny.graphdef, tiny.params, copy(cache), rows_of(chunks, 16), np.asarray(pre + [0], np.int32),
      np.asarray(rest + [0], np.int32), table)
  got, got_cache = jitted.prefill_packed_step(tiny.graphdef, tiny.params, copy(cache),
                                             *_packed(chunks, 24, pre), table, fresh=False)
  testing.assert_close(np.asarray(got)[:3], np.asarray(want)[:3], dtype=jnp.float32,
                       what="packed continued logits")
  for name in ("k", "v"):
    testing.assert_close(np.asarray(getattr(got_cache, name)),
                         np.asarray(getattr(want_cache, name)), dtype=jnp.float32,
                         what=f"packed continued cache {name}")


@pytest.mark.parametrize("fresh, pad_rows", [(True, 1), (False, 6)])
def test_mixed_packed_step_equals_decode_then_packed_prefill(tiny, fresh, pad_rows):
  """Decode rows and packed prompt chunks in one call give the logits and the
  cache of a decode call, then a packed prefill call. Not fresh: the second
  chunk continues a prompt whose first 4 tokens are in the cache."""
  rng = np.random.default_rng()
  ps, per_seq = 4, 6
  pages = rng.permutation(np.arange(1, 1 + per_seq * 4)).reshape(4, per_seq).astype(np.int32)
  cache = tiny.init_cache(1 + per_seq * 4, ps)
  cached = 0 if fresh else 4
  prompts = [rng.integers(3, 259, n).astype(np.int32) for n in (6, 9)]  # rows 0, 1: decoding
  chunks = [rng.integers(3, 259, 7).astype(np.int32), rng.integers(3, 259, 10).astype(np.int32)]
  toks = np.zeros((3, 9), np.int32)
  toks[0, :6], toks[1, :9], toks[2, :cached] = prompts[0], prompts[1], chunks[1][:cached]
  _, cache = tiny.prefill(cache, toks, [0, 0, 0], [6, 9, cached], pages[[0, 1, 3]])
  dec_tokens = np.asarray([11, 12] + [0] * pad_rows, np.int32)
  dec_lengths = np.asarray([7, 10] + [0] * pad_rows, np.int32)
  dec_table = np.stack([pages[0], pages[1]] + [np.zeros(per_seq, np.int32)] * pad_rows)
  packed = _packed([chunks[0], chunks[1][cached:]], 24, [0, cached])
  table = np.concatenate([pages[[2, 3]], np.zeros((1, per_seq), np.int32)])

  ref_cache = jax.tree.map(jnp.copy, cache)
  dec_ref, ref_cache = jitted.decode_step(tiny.graphdef, tiny.params, ref_cache,
                                         jnp.asarray(dec_tokens)[:, None], dec_lengths, dec_table)
  pre_ref, ref_cache = jitted.prefill_packed_step(tiny.graphdef, tiny.params, ref_cache, *packed,
                                                 table, fresh=fresh)
  got, cache = jitted.mixed_packed_step(tiny.graphdef, tiny.params, cache, dec_tokens,
                                       dec_lengths, dec_table, *packed, table, fresh=fresh)
  bd = 2 + pad_rows
  assert got.shape == (bd + 3, tiny.config.vocab_size)
  want = np.concatenate([np.asarray(dec_ref[:, 0]), np.asarray(pre_ref)])
  live = [0, 1, bd, bd + 1]
  testing.assert_close(np.asarray(got)[live], want[live], dtype=jnp.float32,
                       what="mixed packed logits")
  for name in ("k", "v"):
    testing.assert_close(np.asarray(getattr(cache, name)), np.asarray(getattr(ref_cache, name)),
                         dtype=jnp.float32, what=f"mixed packed cache {name}")


@pytest.mark.parametrize("folded", [True, False])
def test_layers_read_their_weight_stacks_in_place(tiny, monkeypatch, folded):
  """Inside the layer scan every matmul and rms_norm gets the whole [layers, ...]
  stack and the layer index, never a per-layer slice: a slice moves every
  layer, and XLA then records each iteration's command buffer again
  (bench/results/serving_h200/layer_stack_dispatch/). With folded norms the
  layer runs no rms_norm: qkv and gate/up normalize their input (rms_eps)."""
  import dataclasses

  from flax import nnx
  from mosaic import registry

  calls = []
  for name in ("matmul", "rms_norm"):
    op = llama.ops()[name]  # imports the op modules
    impl = op.impls["xla"]

    def spy(x, w, *args, _fn=impl.fn, _name=name, **kw):
      calls.append((_name, w.ndim, kw.get("layer") is not None, kw.get("rms_eps")))
      return _fn(x, w, *args, **kw)

    monkeypatch.setitem(op.impls, "xla", dataclasses.replace(impl, fn=spy))
  model = tiny if folded else model_lib.Model(tiny.config, tiny.params, tiny.tokenizer,
                                              dtype="float32", fold_norms=False)
  m = nnx.merge(model.graphdef, model.params)
  assert m.norms_folded == folded
  with registry.use(matmul="xla", rms_norm="xla"):
    logits, _ = m.decode(tiny.init_cache(8, 4), jnp.asarray([[5]]), jnp.asarray([1]),
                         jnp.asarray([[1, 2]]))
  assert np.isfinite(np.asarray(logits)).all()
  in_scan = [c[:3] + (c[3] is not None,) for c in calls if c[2]]
  if folded:  # Traced once: qkv (normalizing), o_proj, gate_up (normalizing), down.
    assert in_scan == [("matmul", 3, True, True), ("matmul", 3, True, False),
                       ("matmul", 3, True, True), ("matmul", 3, True, False)], calls
  else:  # Traced once: attn_norm, qkv, o_proj, mlp_norm, gate_up, down.
    assert in_scan == [("rms_norm", 2, True, False), ("matmul", 3, True, False),
                       ("matmul", 3, True, False), ("rms_norm", 2, True, False),
                       ("matmul", 3, True, False), ("matmul", 3, True, False)], calls
  # After the scan: the final norm and the lm_head, plain weights.
  calls = [c[:3] for c in calls]
  assert [c for c in calls if not c[2]] == [("rms_norm", 1, False), ("matmul", 2, False)], calls


def test_decode_step_unrolls_its_layer_loop(tiny):
  """A one-token decode step runs its layers with no loop by default (each
  loop iteration costs the GPU ~4 us, bench/results/decode_unroll_h200/),
  with the same numbers as the loop; prefill keeps its loop."""
  from flax import nnx

  rng = np.random.default_rng()
  ids = rng.integers(3, 259, 5).tolist()
  table = rng.permutation(np.arange(1, 5))[None]
  whiles, out = {}, {}
  for unroll in (None, 1):
    m = model_lib.Model(tiny.config, tiny.params, tiny.tokenizer, dtype="float32",
                        decode_unroll=unroll)
    cache = m.init_cache(5, 4)
    _, cache = m.prefill(cache, [ids[:-1]], [0], [len(ids) - 1], table)
    logits, cache = m.decode(cache, [ids[-1]], [len(ids)], table)
    out[unroll] = (np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v))
    mod = nnx.merge(m.graphdef, m.params)
    lower = lambda f, *a: nnx.jit(f).lower(mod, m.init_cache(5, 4), *a).as_text()
    whiles[unroll] = (
        lower(lambda mod, c, t, n, tab: mod.decode(c, t, n, tab), jnp.asarray([[5]]),
              jnp.asarray([1]), jnp.asarray(table)).count("stablehlo.while"),
        lower(lambda mod, c, t, p, n, tab: mod.prefill(c, t, p, n, tab), jnp.asarray([ids]),
              jnp.asarray([0]), jnp.asarray([len(ids)]), jnp.asarray(table)).count("stablehlo.while"))
  assert whiles == {None: (0, 1), 1: (1, 1)}, whiles
  for got, want, what in zip(out[None], out[1], ("logits", "k cache", "v cache")):
    testing.assert_close(got, want, dtype=jnp.float32, what=what)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_decode_unroll_is_validated(tiny, bad):
  with pytest.raises(ValueError, match="decode_unroll"):
    model_lib.Model(tiny.config, tiny.params, tiny.tokenizer, dtype="float32", decode_unroll=bad)
