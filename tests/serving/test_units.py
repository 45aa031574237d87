"""Engine parts on their own: page allocator, detokenization with stops, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from serving.engine import api, sampling
from serving.engine.pages import PageAllocator, block_hashes
from serving.engine.text import ByteTokenizer, IncrementalText


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("alrcx"), st.integers(0, 6)), max_size=60))
def test_allocator_invariants_under_random_use(ops):
  a = PageAllocator(12, 4)
  held: list[list[int]] = []
  hashes = block_hashes(list(range(40)), 4)
  for op, n in ops:
    if op == "a":
      pages = a.allocate(n)
      if pages is not None:
        assert 0 not in pages and len(pages) == n
        held.append(pages)
    elif op == "l":
      held.append(a.lookup(hashes[:n]))
    elif op == "r" and held:
      a.release(held.pop(n % len(held)))
    elif op == "c" and held and held[-1]:
      for i, p in enumerate(held[-1][:len(hashes)]):
        a.register(p, hashes[i])
    a.check()
    assert a.in_use == len({p for h in held for p in h})
  for h in held:
    a.release(h)
  a.check()
  assert a.in_use == 0


def test_prefix_cache_reuses_and_evicts():
  a = PageAllocator(4, 2)
  hs = block_hashes([1, 2, 3, 4, 5], 2)
  assert len(hs) == 2 and hs != block_hashes([1, 2, 3, 9, 5], 2)
  assert hs[0] == block_hashes([1, 2, 7, 7], 2)[0]
  p = a.allocate(2)
  a.register(p[0], hs[0])
  a.register(p[1], hs[1])
  a.release(p)
  assert a.in_use == 0 and a.cached == 2
  assert a.lookup(hs) == p
  a.release(p)
  assert a.allocate(3) is not None  # the idle cached pages are evicted for fresh ones
  assert a.cached == 0 and a.lookup(hs) == []
  with pytest.raises(ValueError, match="num_pages"):
    PageAllocator(1, 4)


def _run_text(tok, ids, stop=(), context=()):
  t = IncrementalText(tok, stop, context=context)
  out = "".join(t.push([i]) for i in ids)
  return out + t.flush(), t.stopped


def test_incremental_text_utf8_and_stops():
  tok = ByteTokenizer()
  s = "héllo wörld ✓ done"
  ids = tok.encode(s)
  assert _run_text(tok, ids) == (s, False)
  assert _run_text(tok, ids, stop=("wör",)) == ("héllo ", True)
  assert _run_text(tok, ids, stop=("zz", "✓")) == ("héllo wörld ", True)
  # A partial match that does not complete is released at the end.
  assert _run_text(tok, tok.encode("abc do"), stop=("done",)) == ("abc do", False)


def test_incremental_text_decodes_a_bounded_window_over_tokens_without_text():
  """Ids that render as nothing (a random-weight model's output, mostly) are
  final once a window's worth of them came: decoding does not grow with the
  run, and the text around it, a character split across pushes included, is
  intact."""

  class Counting(ByteTokenizer):
    longest = 0

    def decode(self, ids):
      Counting.longest = max(Counting.longest, len(ids))
      return super().decode(ids)

  tok = Counting()
  t = IncrementalText(tok, context=tok.encode("ab"))
  silent = [tok.vocab_size + 1000] * 7  # outside the byte range: no text
  ids = tok.encode("x") + silent * 40 + tok.encode("é")[:1]
  out = "".join(t.push(ids[k:k + 7]) for k in range(0, len(ids), 7))
  out += t.push(tok.encode("é")[1:] + tok.encode("!"))
  assert out + t.flush() == "xé!"
  assert Counting.longest <= 48, Counting.longest  # not the 283 tokens of the run


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=3), st.integers(1, 80)), max_size=20),
       st.lists(st.integers(1, 9), min_size=1, max_size=8))
# A real U+FFFD at the end looks like an unfinished character: the flush must
# still hand it out.
@example(parts=["\ufffd"], chunks=[1])
@example(parts=["a\ufffd", 2], chunks=[2])
def test_incremental_text_equals_the_whole_decode(parts, chunks):
  """Text and runs of ids without text, pushed in any chunking: the pieces
  add up to the decode of all of them."""
  tok = ByteTokenizer()
  ids = []
  for part in parts:  # a string's bytes, or a run of that many text-less ids
    ids += tok.encode(part) if isinstance(part, str) else [tok.vocab_size + 5] * part
  t = IncrementalText(tok, context=tok.encode("ctx"))
  out, k, i = [], 0, 0
  while k < len(ids):
    out.append(t.push(ids[k:k + chunks[i % len(chunks)]]))
    k, i = k + chunks[i % len(chunks)], i + 1
  assert "".join(out) + t.flush() == tok.decode(ids)


def test_incremental_text_holds_back_possible_stop_prefix():
  tok = ByteTokenizer()
  t = IncrementalText(tok, ("END",))
  got = [t.push([i]) for i in tok.encode("xxEN")]
  assert "".join(got) == "xx"  # "EN" could start "END"
  assert t.push(tok.encode("D")) == "" and t.stopped


def test_incremental_text_ignores_stops_ending_in_text_pushed_without_them():
  """min_tokens: a stop string inside the first tokens' text does not stop
  the request; one that ends later does, and no text of it was handed out."""
  tok = ByteTokenizer()
  t = IncrementalText(tok, ("ab",))
  out = [t.push([i], stops=False) for i in tok.encode("xab")]
  out += [t.push([i]) for i in tok.encode("cdab")]
  assert t.stopped and "".join(out) == "xabcd"
  t = IncrementalText(tok, ("ab",))
  out = [t.push([i], stops=False) for i in tok.encode("xa")]
  out.append(t.push(tok.encode("b")))  # the match ends past the floor: it stops
  assert t.stopped and "".join(out) == "x"


def _arrays(params, batch, slots=None):
  slots = slots or list(range(len(params)))
  return sampling.pack(params, [p.seed or 0 for p in params], [0] * len(params), slots, batch)


def test_greedy_and_topk1_pick_the_argmax():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 50)).astype(np.float32)
  counts = jnp.zeros((4, 50), jnp.int32)
  mask = sampling.slot_tokens(4, 50)
  params = [api.SamplingParams(), api.SamplingParams(temperature=1.0, top_k=1, seed=3),
            api.SamplingParams(temperature=0.5, min_p=1.0, seed=4)]
  tok, lp, top_ids, top_lp, counts, _ = sampling.sample(logits, _arrays(params, 4), counts, mask)
  np.testing.assert_array_equal(np.asarray(tok)[:3], logits[:3].argmax(-1))
  ref_lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(lp)[:3], ref_lp[np.arange(3), logits[:3].argmax(-1)],
                             rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(top_ids)[:, 0], logits.argmax(-1))
  # Counts gained one per live row; the padding row (slot -1) none.
  assert np.asarray(counts).sum() == 3
  g = sampling.greedy(logits, _arrays(params[:1], 4), jnp.zeros((4, 50), jnp.int32))
  assert int(g[0][0]) == logits[0].argmax()


@pytest.mark.parametrize("p", [
    api.SamplingParams(temperature=1.0, top_k=5, seed=1),
    api.SamplingParams(temperature=0.7, top_p=0.9, seed=2),
    api.SamplingParams(temperature=1.3, min_p=0.2, seed=3),
    api.SamplingParams(temperature=1.0, top_k=8, repetition_penalty=1.8, presence_penalty=1.0,
                       frequency_penalty=0.5, seed=4),
    api.SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.5, min_tokens=9, seed=5),
    api.SamplingParams(temperature=1.0, top_k=6, logit_bias=((3, 4.0), (7, -100.0), (11, 2.5)),
                       seed=6),
    # The likeliest is not allowed; the second (an end token) is.
    api.SamplingParams(temperature=1.0, allowed_token_ids=(22, 4, 1, 9, 16), seed=7),
])
def test_samples_stay_in_the_reference_allowed_set(p):
  v = 32
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(v,)).astype(np.float32) * 2
  counts = np.zeros((1, v), np.int32)
  counts[0, rng.integers(0, v, 6)] = rng.integers(1, 4, 6)
  prompt = rng.integers(0, v, 5)
  mask = np.zeros((1, v), bool)
  mask[0, prompt] = True
  ends = set(np.argsort(-logits)[:2].tolist())  # the two likeliest end the request
  tok = jax.tree.map(lambda a: jnp.asarray(a)[None], sampling.slot_row(
      v, prompt, ends, p.logit_bias, p.allowed_token_ids))
  batch = 16
  seen = set()
  for step in range(8):  # all below min_tokens where it is set
    allowed = sampling.reference(logits, p, counts[0], mask[0], ends, step)
    assert 2 <= allowed.sum() < v  # the cut matters and leaves a choice
    arrays = sampling.pack([p] * batch, [p.seed * 100 + i for i in range(batch)], [step] * batch,
                           [0] * batch, batch)
    out = sampling.sample(np.repeat(logits[None], batch, 0), arrays,
                          jnp.asarray(np.repeat(counts, 1, 0)), tok)
    seen |= set(np.asarray(out[0]).tolist())
    assert set(np.asarray(out[0]).tolist()) <= set(np.flatnonzero(allowed).tolist())
  assert len(seen) > 1  # it samples, not argmax
  assert bool(seen & ends) == (p.min_tokens == 0)


def test_min_tokens_bans_end_tokens_until_reached():
  """Below min_tokens a row never draws EOS or its stop token ids (greedy,
  sampled, and a multi-step call's later steps); from there on it may."""
  v, eos, stop = 40, 7, 3
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(v,)).astype(np.float32)
  logits[eos], logits[stop] = 9.0, 8.0  # the argmax, then the runner-up
  row = sampling.slot_row(v, [], {eos, stop})
  flags = jax.tree.map(lambda a: jnp.asarray(np.stack([a, a])), row)
  params = [api.SamplingParams(min_tokens=4),
            api.SamplingParams(temperature=1.0, top_k=3, min_tokens=4, seed=1)]
  x = np.repeat(logits[None], 2, 0)
  order = [int(t) for t in np.argsort(-logits)]
  for step in range(6):
    arrays = sampling.pack(params, [0, 1], [step] * 2, [0, 1], 2)
    tok = np.asarray(sampling.sample(x, arrays, jnp.zeros((2, v), jnp.int32), flags)[0])
    if step < 4:
      assert tok[0] == order[2] and tok[1] in order[2:5], step
    else:
      assert tok[0] == eos
    for i in range(3):  # step i of a multi-step call that starts at `step`
      out = sampling.step_jit(x, arrays, np.int32(i), jnp.zeros((2, v), jnp.int32), flags,
                              jnp.zeros((2,), jnp.int32), greedy_only=False)
      assert (int(out[0][0]) == eos) == (step + i >= 4)



def _cut_probs(logits, p, counts=None):
  """The distribution a row samples from (numpy): its penalized logits (with
  ``counts`` generated tokens) over its temperature, on the reference's
  allowed set."""
  v = len(logits)
  counts = np.zeros(v) if counts is None else counts
  args = (logits, p, counts, np.zeros(v, bool))
  x = np.where(sampling.reference(*args), sampling.reference_logits(*args) / p.temperature,
               -np.inf)
  e = np.exp(x - x.max())
  return e / e.sum()


@pytest.mark.parametrize("p", [api.SamplingParams(temperature=0.9),
                               api.SamplingParams(temperature=1.2, top_k=4),
                               api.SamplingParams(temperature=0.8, top_p=0.8),
                               api.SamplingParams(temperature=1.0, presence_penalty=1.0,
                                                  frequency_penalty=0.5)])
def test_speculative_sampling_keeps_each_positions_distribution(p):
  """sampling.verify over many rows of the same logits and drafts, each with
  a fresh seed: the first token (the kept draft, or the token drawn after its
  refusal) is distributed as position 0's cut distribution; the second, where
  the first draft was kept, as position 1's, whether it is a second draft or
  kept-or-redrawn (rows with two drafts) or the token drawn after the last
  draft (rows with one); a draft the cuts remove is never kept. With
  penalties, position 1's distribution is penalized for the first draft."""
  rng = np.random.default_rng(11)
  v, t, n = 8, 3, 24000
  logits = (rng.normal(size=(t, v)) * 1.5).astype(np.float32)
  probs = [_cut_probs(logits[0], p)]
  # Drafts: position 0's likeliest; then position 1's second likeliest (rows
  # i % 3 == 0), none (1), or its least likely, cut by top-k (2).
  d0 = int(np.argmax(probs[0]))
  logits[1, d0] = logits[1].max() + 0.5  # position 1's likeliest but for a penalty
  probs.append(_cut_probs(logits[1], p, np.eye(v)[d0]))
  d1, low = int(np.argsort(-probs[1])[1]), int(np.argmin(logits[1]))
  group = np.arange(n) % 3
  tokens = np.zeros((n, t), np.int32)
  tokens[:, 1] = d0
  tokens[:, 2] = np.where(group == 0, d1, low)
  lengths = np.where(group == 1, 2, 3).astype(np.int32)
  arrays = sampling.pack([p] * n, rng.integers(0, 2**62, n).tolist(), [5] * n, [0] * n, n)
  state = dict(counts=jnp.zeros((1, v), jnp.int32), tok=sampling.slot_tokens(1, v),
               penalized=True) if p.slot_state else {}
  kept, after = map(np.asarray, sampling.verify_jit(
      np.broadcast_to(logits, (n, t, v)), tokens, lengths, arrays, greedy_only=False, **state))
  assert kept.min() >= 0 and (kept <= lengths - 1).all()

  def tv(sample, ref):
    return 0.5 * np.abs(np.bincount(sample, minlength=v) / len(sample) - ref).sum()

  first = np.where(kept >= 1, d0, after)
  assert tv(first, probs[0]) < 0.02
  second = np.where(kept >= 2, tokens[:, 2], after)
  for g in range(3):
    assert tv(second[(kept >= 1) & (group == g)], probs[1]) < 0.05
  if probs[1][low] == 0:
    assert not (kept[group == 2] >= 2).any()


def test_verify_on_greedy_rows_keeps_drafts_equal_to_the_argmax():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(3, 4, 20)).astype(np.float32)
  best = logits.argmax(-1)
  # Row 0: both drafts agree; row 1: the second differs; row 2: no drafts.
  tokens = np.asarray([[1, best[0, 0], best[0, 1], 0], [1, best[1, 0], (best[1, 1] + 1) % 20, 0],
                       [1, 0, 0, 0]], np.int32)
  lengths = np.asarray([3, 3, 1], np.int32)
  greedy = api.SamplingParams()
  for greedy_only, params in ((True, [greedy] * 3),
                              (False, [greedy, greedy, api.SamplingParams(temperature=1.0)])):
    kept, after = map(np.asarray, sampling.verify_jit(
        logits, tokens, lengths, _arrays(params, 3), greedy_only=greedy_only))
    np.testing.assert_array_equal(kept[:2], [2, 1])
    np.testing.assert_array_equal(after[:2], [best[0, 2], best[1, 1]])
    if greedy_only:
      assert kept[2] == 0 and after[2] == best[2, 0]


def test_verify_applies_each_positions_penalties_bias_and_end_ban():
  """Greedy rows with slot state (repetition / presence / frequency
  penalties, a logit bias, allowed ids, min_tokens): verify keeps exactly
  the drafts that one-token-at-a-time sampling (sampling.sample, counts
  updated as it goes) would emit, and takes its token after them; each
  position counts the drafts before it. Without the slot state the argmax
  sequence differs, so the state is what decides."""
  v, t, eos = 12, 5, 11
  rng = np.random.default_rng(4)
  # Token 3 leads at every position, 5 close behind, eos first at position 0.
  logits = rng.normal(size=(t, v)).astype(np.float32) * 0.3
  logits[:, 3] += 3.0
  logits[:, 5] += 2.4
  logits[0, eos] += 5.0
  prompt = [3, 1]
  ps = [api.SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.5,
                           min_tokens=2, logit_bias=((7, 1.0),)),
        api.SamplingParams(frequency_penalty=0.9, allowed_token_ids=(3, 5, 7, 8, eos))]
  tok = jax.tree.map(lambda *r: jnp.asarray(np.stack(r)), *[
      sampling.slot_row(v, prompt, {eos}, p.logit_bias, p.allowed_token_ids) for p in ps])
  counts0 = np.zeros((2, v), np.int32)
  counts0[:, 8] = 1  # a token generated before this call
  # One token at a time, as decode steps emit them (step 1 onwards).
  seq, counts = [], jnp.asarray(counts0)
  for j in range(t):
    out = sampling.sample(np.ascontiguousarray(np.repeat(logits[j][None], 2, 0)),
                          sampling.pack(ps, [0, 0], [1 + j] * 2, [0, 1], 2), counts, tok)
    seq.append(np.asarray(out[0]))
    counts = out[4]
  seq = np.stack(seq, 1)  # [2, t]
  assert not np.array_equal(seq[0], logits.argmax(-1)) and seq[0, 0] != eos
  for wrong_at in (None, 2):  # every draft right; the third wrong
    tokens = np.zeros((2, t), np.int32)
    tokens[:, 0] = 8
    tokens[:, 1:] = seq[:, :t - 1]
    if wrong_at is not None:
      tokens[:, 1 + wrong_at] = (seq[:, wrong_at] + 1) % v
    kept, after = map(np.asarray, sampling.verify_jit(
        np.ascontiguousarray(np.broadcast_to(logits, (2, t, v))), tokens,
        np.full((2,), t, np.int32), sampling.pack(ps, [0, 0], [1, 1], [0, 1], 2),
        jnp.asarray(counts0), tok, greedy_only=True, penalized=True))
    a = t - 1 if wrong_at is None else wrong_at
    np.testing.assert_array_equal(kept, [a, a])
    np.testing.assert_array_equal(after, seq[:, a])


def test_verify_keeps_sampled_drafts_equal_to_each_steps_own_draw():
  """Sampled rows (seeded, with cuts): verify's tokens are the draws
  sampling.sample makes one step at a time with the same seed, so a seeded
  request gives the same tokens with drafts as without them."""
  v, t = 30, 5
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(t, v)).astype(np.float32) * 2.0
  ps = [api.SamplingParams(temperature=0.9, seed=5), api.SamplingParams(temperature=1.3, top_k=6,
                                                                         top_p=0.9, seed=77)]
  tok = sampling.slot_tokens(2, v)
  draws = np.stack([np.asarray(sampling.sample(
      np.ascontiguousarray(np.repeat(logits[j][None], 2, 0)),
      sampling.pack(ps, [p.seed for p in ps], [3 + j] * 2, [0, 1], 2),
      jnp.zeros((2, v), jnp.int32), tok)[0]) for j in range(t)], 1)  # [2, t]
  for wrong_at in (None, 0, 2):
    tokens = np.zeros((2, t), np.int32)
    tokens[:, 1:] = draws[:, :t - 1]
    if wrong_at is not None:
      tokens[:, 1 + wrong_at] = (draws[:, wrong_at] + 1) % v
    kept, after = map(np.asarray, sampling.verify_jit(
        np.ascontiguousarray(np.broadcast_to(logits, (2, t, v))), tokens,
        np.full((2,), t, np.int32), sampling.pack(ps, [p.seed for p in ps], [3, 3], [0, 1], 2),
        greedy_only=False))
    a = t - 1 if wrong_at is None else wrong_at
    np.testing.assert_array_equal(kept, [a, a])
    np.testing.assert_array_equal(after, draws[:, a])


def test_add_counts_counts_the_emitted_tokens_of_real_slots():
  counts = sampling.add_counts(jnp.zeros((3, 6), jnp.int32), np.asarray([2, 3, 0], np.int32),
                               np.asarray([[1, 1, 4], [2, 2, 2], [5, 0, 0]], np.int32),
                               np.asarray([3, 3, 1], np.int32))
  want = np.zeros((3, 6), np.int32)
  want[2, 1], want[2, 4], want[0, 5] = 2, 1, 1  # slot 3 is out of range: padding
  np.testing.assert_array_equal(np.asarray(counts), want)


def test_seeded_sampling_ignores_batch_neighbours():
  v = 64
  rng = np.random.default_rng(2)
  row = rng.normal(size=(v,)).astype(np.float32)
  p = api.SamplingParams(temperature=1.0, seed=1234)
  other = api.SamplingParams(temperature=1.0, seed=99)
  counts, mask = jnp.zeros((4, v), jnp.int32), sampling.slot_tokens(4, v)
  alone = sampling.sample(row[None].repeat(1, 0), sampling.pack([p], [p.seed], [5], [0], 1),
                          counts, mask)[0]
  logits = np.stack([rng.normal(size=v).astype(np.float32), row, row, row])
  mixed = sampling.sample(logits, sampling.pack([other, p, other, other], [99, 1234, 7, 8],
                                                [0, 5, 1, 2], [1, 0, 2, 3], 4),
                          jnp.zeros((4, v), jnp.int32), mask)[0]
  assert int(alone[0]) == int(mixed[1])


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(top_logprobs=21), "top_logprobs"), (dict(temperature=float("nan")), "temperature"),
    (dict(stop=("",)), "stop"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logit_bias=(5,)), "pairs"), (dict(logit_bias=((5, 1.0, 2.0),)), "pairs"),
    (dict(logit_bias={"a": 1.0}), "pairs"),
])
def test_sampling_params_refuse_bad_values(kw, match):
  with pytest.raises(api.InvalidRequest, match=match):
    api.SamplingParams(**kw)


def test_logit_bias_may_be_a_mapping():
  assert api.SamplingParams(logit_bias={5: 1.0, 9: -2.0}).logit_bias == ((5, 1.0), (9, -2.0))


def test_a_refusal_names_its_field_and_keeps_it_across_processes():
  # The HTTP API reports the body's field from it (param); an --engine-process
  # engine's refusals come through a pickle.
  import pickle

  from serving.engine import api

  for kw, field in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                    (dict(stop_token_ids=tuple(range(65))), "stop_token_ids"),
                    (dict(frequency_penalty=3), "frequency_penalty"),
                    (dict(top_k=1.5), "top_k")):
    with pytest.raises(api.InvalidRequest) as e:
      api.SamplingParams(**kw)
    assert e.value.field == field and str(e.value).startswith(field), (kw, str(e.value))
    again = pickle.loads(pickle.dumps(e.value))
    assert (type(again), again.field, str(again)) == (api.InvalidRequest, field, str(e.value))


@pytest.mark.parametrize("kw,match", [
    (dict(max_batch=0), "max_batch"), (dict(decode_steps=0), "decode_steps"),
    (dict(min_chunk=32, prefill_chunk=16), "min_chunk"),
    # a full decode batch would leave waiting prompts no tokens
    (dict(max_batch=8, token_budget=7), "token_budget"),
    (dict(decode_prefill_budget=0), "decode_prefill_budget"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    # the last token and the drafts are checked as one prompt chunk
    (dict(num_speculative_tokens=64, prefill_chunk=64), "num_speculative_tokens"),
    (dict(prompt_lookup_max=1, prompt_lookup_min=2), "prompt_lookup_max"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(speculative_max_batch=0), "speculative_max_batch"),
])
def test_engine_config_refuses_bad_values(kw, match):
  from serving.engine.engine import EngineConfig

  with pytest.raises(ValueError, match=match):
    EngineConfig(**kw)
  EngineConfig(max_batch=8, token_budget=8)  # the smallest budget that always progresses


def test_last_token_per_slot_feeds_the_next_decode():
  logits = np.full((4, 10), -1.0, np.float32)
  logits[np.arange(4), [3, 7, 1, 9]] = 1.0
  last = jnp.asarray([5, 5, 5, 5, 5, 5], jnp.int32)
  arrays = sampling.pack([api.SamplingParams()] * 3, [0] * 3, [0] * 3, [4, 0, 2], 4)
  out = sampling.greedy(logits, arrays, jnp.zeros((6, 10), jnp.int32), last, logprobs=False)
  np.testing.assert_array_equal(np.asarray(out[5]), [7, 5, 1, 5, 3, 5])  # row 3 is padding
  np.testing.assert_array_equal(np.asarray(sampling.take(out[5], np.array([4, 2, -1]))), [3, 1, 7])


def test_decode_inputs_travel_packed_and_unpack_exactly():
  """ModelRunner.decode_multi's one host array: every column comes back as
  it went in, the sampling floats bit for bit (seeds and slot -1 included)."""
  import jax

  from serving.engine import runners

  rng = np.random.default_rng(0)
  b, p = 5, 7
  slots = np.array([3, 0, 4, -1, -1], np.int32)
  lengths = rng.integers(0, 900, b).astype(np.int32)
  table = rng.integers(0, 1 << 20, (b, p)).astype(np.int32)
  params = [api.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                               presence_penalty=-1.5, min_tokens=3), api.SamplingParams(), None]
  arrays = sampling.pack(params, [2**63 + 12345, 7, 0], [3, 0, 0], [3, 0, -1], b)
  assert len(jax.tree_util.tree_leaves(arrays)) == 1  # a sampling call: one transfer
  host = runners.pack_decode_inputs(slots, lengths, table, arrays)
  # Every field but the last (the page table) starts on a 256-byte boundary:
  # a one-row step hands its slices to Mosaic GPU kernels as views.
  assert host.dtype == np.int32 and host.shape == (b, 3 * 64 + p)
  np.testing.assert_array_equal(host[:, 3 * 64:], table)
  assert np.asarray(arrays.min_tokens).tolist() == [3, 0, 0, 0, 0]
  got = jax.jit(runners._unpack_decode_inputs)(host)
  for want, x in zip((slots, lengths, table, arrays.i), got[:3] + (got[3].i,)):
    np.testing.assert_array_equal(np.asarray(x), want)
  assert np.asarray(got[3].f).dtype == np.float32
  np.testing.assert_array_equal(np.asarray(got[3].f).view(np.int32), arrays.f.view(np.int32))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=5), st.integers(1, 3),
       st.integers(1, 300))
def test_packed_host_fields_start_on_256_byte_boundaries(widths, b, n):
  """A one-row step hands slices of its packed host array to Mosaic GPU
  kernels as views, and those kernels refuse buffers that are not 256-byte
  aligned: every field of _side_by_side and every row of _stacked starts on
  such a boundary (the decode kernel got its page table at byte 8 before)."""
  import jax

  from serving.engine import runners

  rng = np.random.default_rng(len(widths) * 1000 + b * 10 + n)
  cols = [rng.integers(-5, 1 << 20, (b, w)).astype(np.int32) for w in widths]
  host = runners._side_by_side(*cols)
  at = 0
  for w, c in zip(widths[:-1], cols):
    assert (at * 4) % 256 == 0
    np.testing.assert_array_equal(host[:, at:at + w], c)
    at += -(-w // 64) * 64
  assert (at * 4) % 256 == 0 and host.shape[1] == at + widths[-1]
  got = jax.jit(lambda h: runners._fields(h, *widths[:-1]))(host)
  for w, c, x in zip(widths, cols, got):
    np.testing.assert_array_equal(np.asarray(x), c[:, 0] if w == 1 and x.ndim == 1 else c)
  rows = [rng.integers(0, 1000, n).astype(np.int32) for _ in range(3)]
  stacked = runners._stacked(*rows)
  assert stacked.dtype == np.int32 and (stacked.shape[1] * 4) % 256 == 0
  np.testing.assert_array_equal(stacked[:, :n], np.stack(rows))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=30), st.integers(1, 5),
       st.integers(1, 4), st.integers(1, 4))
@example([1, 2, 3, 1, 2], 3, 3, 1)  # "1 2" occurred: "3 1 2" follows it
def test_ngram_draft_matches_a_brute_force_lookup(tokens, k, lookup_max, lookup_min):
  from serving.engine.engine import ngram_draft

  want = []
  for n in range(lookup_max, lookup_min - 1, -1):
    if not 1 <= n < len(tokens):
      continue
    starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
    if starts:
      want = tokens[starts[-1] + n:starts[-1] + n + k]
      break
  assert ngram_draft(tokens, k, lookup_max, lookup_min) == want


def serving_imports() -> dict[str, set[str]]:
  """Each module of the serving package (serving/**/*.py, by dotted name) ->
  the serving modules it imports, at top level or inside a function (read
  with ``ast``, nothing imported). ``from serving.engine import api`` names the
  submodule serving.engine.api; ``from serving.engine import Engine``, the
  package serving.engine."""
  import ast
  import pathlib

  import serving

  root = pathlib.Path(serving.__file__).resolve().parent
  paths = {}
  for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root.parent).with_suffix("").parts
    paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

  def known(name: str) -> str | None:  # the serving module a dotted name lies in
    while name and name not in paths:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for name, path in paths.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets += [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from . / from .x
          up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
          base = ".".join(up + ([base] if base else []))
        targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                    for a in node.names]
    graph[name] = {t for t in map(known, targets) if t is not None and t != name}
  return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The cycles a depth-first walk of ``graph`` meets, each as its modules in
  import order, back to the first."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []
  cycles = []

  def visit(m):
    state[m] = 1
    path.append(m)
    for d in sorted(graph.get(m, ())):
      if state.get(d) == 1:
        cycles.append(path[path.index(d):] + [d])
      elif d not in state:
        visit(d)
    path.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  return cycles


def test_import_cycles_are_found():
  g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": set()}
  assert import_cycles(g) == [["a", "b", "c", "a"]]
  assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_serving_module_imports_one_that_imports_it_back():
  """Not even inside a function: such a pair only works as long as one of
  them imports the other late, and neither can be read without the other."""
  graph = serving_imports()
  assert {"serving.cli", "serving.service", "serving.engine.api"} <= set(graph)
  assert "serving.engine.api" in graph["serving.service"]
  assert "serving.profiler" in graph["serving.cli"]  # a function-level import counts
  cycles = import_cycles(graph)
  assert not cycles, "serving modules import each other in a circle:\n" + "\n".join(
      " -> ".join(c) for c in cycles)
