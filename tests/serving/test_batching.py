"""Continuous batching on a real (toy) decoder behind the real gRPC server.

The toy model (serving.engine.toy_model) has the models serving API and
random weights; its greedy continuations are checked against a reference
that recomputes the whole sequence in a fresh cache at every token, so the
paged cache, chunked prefill, prefix cache and preemption must not change a
single token.
"""

import concurrent.futures
import functools
import itertools
import random

import numpy as np
import pytest

from serving import engine as E
from serving.engine.toy_model import ToyModel

from tests.serving.conftest import running, wait_for

_SMALL = dict(batch_buckets=(1, 8, 64), prefill_rows=4, min_chunk=16, prefill_chunk=64,
              max_seq_len=256, warmup=False)


@functools.lru_cache(maxsize=1)
def _reference_model():
  return ToyModel(seed=0)


def reference_greedy(prompt: list[int], n: int) -> list[int]:
  model = _reference_model()
  width, ps = 256, 8
  toks = list(prompt)
  table = np.arange(1, width // ps + 1, dtype=np.int32)[None]
  for _ in range(n):
    cache = model.init_cache(width // ps + 1, ps)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(toks)] = toks
    logits, _ = model.prefill(cache, tokens, np.zeros(1, np.int32),
                              np.array([len(toks)], np.int32), table)
    toks.append(int(np.argmax(np.asarray(logits)[0])))
  return toks[len(prompt):]


def _prompts(n, seed=0):
  rng = random.Random(seed)
  shared = [rng.randrange(256) for _ in range(24)]  # page-aligned shared prefixes
  out = []
  for i in range(n):
    tail = [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
    out.append((shared if i % 3 == 0 else []) + tail)
  return out


@pytest.fixture(scope="module")
def toy():
  engine = E.toy_engine(max_batch=64, num_pages=400, page_size=8, **_SMALL)
  with running(engine) as sc:
    yield sc


def _ids(c, prompt, **kw):
  r = c.generate(prompt, max_tokens=kw.pop("max_tokens", 12), ignore_eos=True, **kw)
  return list(r.token_ids)


def test_64_concurrent_streams_equal_64_sequential(toy):
  server, c = toy
  prompts = _prompts(64)
  sequential = [_ids(c, p) for p in prompts]

  def streamed(p):
    return [i for ch in c.stream(p, max_tokens=12, ignore_eos=True) for i in ch.token_ids]

  with concurrent.futures.ThreadPoolExecutor(64) as pool:
    concurrent_ = list(pool.map(streamed, prompts))
  assert concurrent_ == sequential
  assert server.engine.stats().pages_in_use == 0
  for p, got in list(zip(prompts, sequential))[:3]:
    assert got == reference_greedy(p, 12)


def test_chunked_prefill_and_prefix_cache_keep_outputs(toy):
  server, c = toy
  rng = random.Random(5)
  prompt = [rng.randrange(256) for _ in range(150)]  # 3 chunks of at most 64
  want = reference_greedy(prompt, 6)
  r1 = c.generate(prompt, max_tokens=6, ignore_eos=True)
  r2 = c.generate(prompt, max_tokens=6, ignore_eos=True)
  assert list(r1.token_ids) == want and list(r2.token_ids) == want
  assert r2.usage.cached_prompt_tokens == 144  # 18 full pages; the last token is recomputed
  assert server.engine.stats().pages_in_use == 0


def test_prompts_just_past_a_chunk_bucket_are_cut_to_the_bucket_below():
  """Chunk buckets 4, 16, 64: a 30-token prompt alone would run padded to 64;
  it runs as 16 + 14 (two calls of 16); at 40 tokens the two calls (16 + 24
  in 64) would not save half, so it runs whole. A call of several prompts
  (rows padded to 4) cuts only when each fits twice the bucket below.
  Packed calls pad only their total and keep whole chunks. Outputs are
  greedy decoding's."""
  from serving.engine import api

  rng = random.Random(3)
  cfg = dict(max_batch=4, batch_buckets=(1, 2, 4), prefill_chunk=64, min_chunk=4,
             prefill_rows=4, warmup=False)
  for prompts, want_calls in (([30], [(1, 16), (1, 16)]), ([40], [(1, 64)]),
                              ([20, 30], [(4, 16), (4, 16)]), ([20, 40], [(4, 64)])):
    prompts = [[rng.randrange(256) for _ in range(n)] for n in prompts]
    engine = E.toy_engine(num_pages=64, page_size=8, packed_prefill=False, **cfg)
    prefill, calls = engine.runner.prefill, []
    engine.runner.prefill = lambda t, *a: calls.append(np.shape(t)) or prefill(t, *a)
    got = _drain_all(engine, [engine.submit(api.Request(f"r{i}", prompt_ids=p, add_bos=False,
                                                        sampling=api.SamplingParams(
                                                            max_tokens=4, ignore_eos=True)))
                              for i, p in enumerate(prompts)])
    assert got == [reference_greedy(p, 4) for p in prompts]
    assert calls == want_calls, (len(prompts[0]), calls)
  engine = E.tiny_engine(packed_prefill=True, **cfg)
  assert engine.scheduler.fit_buckets([(None, 30)]) == [(None, 30)]


def test_seeded_sampling_is_reproducible_in_any_batch(toy):
  _, c = toy
  kw = dict(temperature=1.0, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True,
            repetition_penalty=1.2, frequency_penalty=0.3)
  alone = c.generate([1, 2, 3], **kw).token_ids
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    futs = [pool.submit(c.generate, [9, 8, 7, i], temperature=1.0, seed=i, max_tokens=10)
            for i in range(6)]
    mixed = c.generate([1, 2, 3], **kw).token_ids
    [f.result() for f in futs]
  assert list(alone) == list(mixed)
  other = c.generate([1, 2, 3], **{**kw, "seed": 8}).token_ids
  assert list(other) != list(alone)


@pytest.mark.parametrize("prefill_first", [False, True])
def test_preemption_when_pages_run_out_keeps_outputs(prefill_first):
  # 10 usable pages of 8 tokens; 4 requests of ~20 + 24 tokens need 6 pages each.
  engine = E.toy_engine(max_batch=8, num_pages=11, page_size=8,
                        **{**_SMALL, "batch_buckets": (8,), "prefill_first": prefill_first})
  prompts = _prompts(4, seed=3)
  prompts = [p[:20] + [5] * max(0, 20 - len(p)) for p in prompts]
  with running(engine) as (server, c):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      got = list(pool.map(lambda p: _ids(c, p, max_tokens=24), prompts))
    assert engine.preemptions > 0
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")
    engine.alloc.check()
  assert got[:2] == [reference_greedy(p, 24) for p in prompts[:2]]


def test_prefill_first_runs_prompt_chunks_alone_and_keeps_outputs():
  """prefill_first: a step with prompt chunks dispatches no decodes (the
  requests decoding wait); by default the same arrivals share steps. The
  tokens are the same either way, and every page comes back."""
  from serving.engine import api

  prompts = _prompts(9, seed=6)
  outs, shared = {}, {}
  for first in (False, True):
    engine = E.toy_engine(max_batch=8, num_pages=200, page_size=8,
                          **{**_SMALL, "batch_buckets": (1, 8), "prefill_rows": 2,
                             "prefill_first": first})
    sub = lambda i: engine.submit(api.Request(  # noqa: E731
        f"r{i}", prompt_ids=prompts[i], add_bos=False,
        sampling=api.SamplingParams(max_tokens=8, ignore_eos=True)))
    handles = [sub(i) for i in range(2)]
    for _ in range(3):  # the first two decode when the others arrive
      engine.step()
    handles += [sub(i) for i in range(2, len(prompts))]
    while engine.step():
      pass
    outs[first] = [_drain(h) for h in handles]
    shared[first] = sum(1 for r in engine.step_times if r.prefill_tokens and r.decodes)
    assert engine.stats().pages_in_use == 0
    engine.alloc.check()
  assert shared[False] > 0 and shared[True] == 0
  assert outs[True] == outs[False]
  assert outs[True][:2] == [reference_greedy(p, 8) for p in prompts[:2]]
  with pytest.raises(ValueError, match="prefill_first"):
    E.EngineConfig(prefill_first=True, mixed_steps=True)
  with pytest.raises(ValueError, match="prefill_first"):
    E.EngineConfig(prefill_first=True, decode_prefill_budget=16)


def test_warmup_compiles_every_shape_steady_state_does_not():
  model = ToyModel(seed=0)
  runner = E.ModelRunner(model, num_pages=64, page_size=8)
  engine = E.BatchingEngine(runner, E.EngineConfig(
      max_batch=4, batch_buckets=(1, 4), prefill_rows=2, min_chunk=16, prefill_chunk=32,
      max_seq_len=128, warmup=True))
  with running(engine) as (server, c):
    compiled = model._fwd._cache_size()
    # decode buckets + prefill rows x chunk buckets x page-table widths (the toy
    # model compiles a fresh chunk's full table as the widest continued one's)
    assert engine.table_buckets == (1, 4, 16)
    assert compiled == 2 + 2 * 2 * 3
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      list(pool.map(lambda p: _ids(c, p, max_tokens=5), _prompts(6, seed=9)))
    # Penalties and min_tokens set the slot's state at admission (set_rows).
    c.generate([5, 6, 7], max_tokens=5, temperature=0.7, seed=1, repetition_penalty=1.2,
               min_tokens=2, logprobs=True)
    # Structured outputs set the slots' allow rows each step (set_allow); their
    # tokenizer for grammars was built at warm-up.
    assert engine._grammars._ll is not None
    r = c.generate([5, 6, 7], max_tokens=8, structured_outputs={"regex": "[a-c]{3}"})
    assert len(r.token_ids) == 3 and r.text.strip("abc") == ""
    assert model._fwd._cache_size() == compiled
    assert engine.counters()["compiles_after_start"] == 0, engine.counters()


def test_multi_step_decode_keeps_outputs_stops_and_pages(toy):
  """decode_steps=4: several tokens per dispatch give the tokens of one step at
  a time (greedy, and seeded sampling with penalties and logprobs), end exactly
  at max_tokens and stop tokens, and free every page."""
  _, c1 = toy  # decode_steps=1
  engine = E.toy_engine(max_batch=8, num_pages=200, page_size=8,
                        **{**_SMALL, "batch_buckets": (1, 8), "decode_steps": 4})
  calls = []
  multi = engine._run_decode_steps
  engine._run_decode_steps = lambda *a: calls.append(a[-1]) or multi(*a)
  prompts = _prompts(8, seed=11)
  lengths = [1, 3, 4, 5, 9, 12, 13, 7]  # not multiples of 4, and shorter than a block
  kw = dict(temperature=0.8, top_k=20, seed=5, max_tokens=11, repetition_penalty=1.3,
            logprobs=True, top_logprobs=2, ignore_eos=True)
  with running(engine) as (server, c):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      got = list(pool.map(lambda a: _ids(c, a[0], max_tokens=a[1]), zip(prompts, lengths)))
    assert calls and set(calls) == {4}
    want = [reference_greedy(p, n) for p, n in zip(prompts, lengths)]
    assert got == want
    stop = want[4][5]
    r = c.generate(prompts[4], max_tokens=9, ignore_eos=True, stop_token_ids=[stop])
    assert list(r.token_ids) == want[4][:want[4].index(stop)]  # the stop token is not sent
    assert r.usage.completion_tokens == len(r.token_ids) + 1  # but counted, as an EOS
    assert r.finish_reason == E.FinishReason.STOP
    calls.clear()
    sampled = c.generate(prompts[1], **kw)
    assert calls
    one_step = c1.generate(prompts[1], **kw)
    assert list(sampled.token_ids) == list(one_step.token_ids)
    assert len(sampled.logprobs) == 11
    for a, b in zip(sampled.logprobs, one_step.logprobs):
      assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
      assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")
    engine.alloc.check()


def test_a_stop_string_inside_a_multi_step_call_ends_the_output_and_its_count():
  """decode_steps=4: a stop string completed by the 3rd token of a call ends
  the output there; the call's later tokens are neither sent nor counted."""
  engine = E.toy_engine(max_batch=8, num_pages=200, page_size=8,
                        **{**_SMALL, "batch_buckets": (1, 8), "decode_steps": 4})
  with running(engine) as (server, c):
    for seed in range(40):
      prompt = _prompts(1, seed=100 + seed)[0]
      ids = list(c.generate(prompt, max_tokens=12, ignore_eos=True).token_ids)
      # Token 2 (the first token comes from the prefill, then calls of 4:
      # token 2 is mid-call) as a printable byte not seen before it.
      if 32 < ids[2] < 127 and chr(ids[2]) not in bytes(i for i in ids[:2] if i < 256).decode(
          "latin-1"):
        break
    else:
      pytest.skip("no prompt gave a printable, new third token")
    r = c.generate(prompt, max_tokens=12, ignore_eos=True, stop=[chr(ids[2])])
    assert r.finish_reason == E.FinishReason.STOP and r.stop_string == chr(ids[2])
    assert list(r.token_ids) == ids[:3]
    assert r.usage.completion_tokens == 3


def test_multi_step_decode_ends_requests_in_one_step_calls():
  """A multi-step call computes all its steps for every row: when no request
  has more than half of them left, the engine dispatches one step at a time
  instead, and the tokens are the same."""
  engine = E.toy_engine(max_batch=8, num_pages=200, page_size=8,
                        **{**_SMALL, "batch_buckets": (1, 8), "decode_steps": 4})
  prompt = _prompts(1, seed=21)[0]
  with running(engine) as (server, c):
    for max_tokens, want_steps in ((11, [4, 4, 1, 1]), (12, [4, 4, 4]), (3, [1, 1])):
      engine.step_times.clear()
      got = _ids(c, prompt, max_tokens=max_tokens)
      assert got == reference_greedy(prompt, max_tokens)
      # The first token comes from prefill. 11 tokens: 10 left, so 4, 4, then
      # 2 left (at most half of 4) in one-step calls; 12: after 4, 4 the 3
      # left are over half, so a (partly unused) 4-step call; 3: 2 left.
      assert [t.steps for t in engine.step_times if t.decodes] == want_steps, max_tokens
    wait_for(lambda: engine.stats().pages_in_use == 0, what="pages freed")


def test_multi_step_decode_under_preemption_and_cancel():
  engine = E.toy_engine(max_batch=8, num_pages=11, page_size=8,
                        **{**_SMALL, "batch_buckets": (8,), "decode_steps": 4})
  prompts = [p[:20] + [5] * max(0, 20 - len(p)) for p in _prompts(4, seed=3)]
  with running(engine) as (server, c):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      got = list(pool.map(lambda p: _ids(c, p, max_tokens=24), prompts))
    assert got[:2] == [reference_greedy(p, 24) for p in prompts[:2]]
    s = c.stream(prompts[0], max_tokens=40, ignore_eos=True)
    next(iter(s))
    s.cancel()
    wait_for(lambda: engine.stats().pages_in_use == 0 and engine.stats().running == 0,
             what="pages freed after cancel")
    engine.alloc.check()


def _drain(handle) -> list[int]:
  from serving.engine import api

  ids = []
  while not handle.events.empty():
    ev = handle.events.get_nowait()
    if isinstance(ev, api.Delta):
      ids.extend(ev.token_ids)
    assert not isinstance(ev, api.Failed), ev
  return ids


def _llama_engine(model, **config):
  """(runner, engine) of the tiny Llama on 120 pages of 8, batch 8, chunks 16..64."""
  runner = E.ModelRunner(model, num_pages=120, page_size=8)
  return runner, E.BatchingEngine(runner, E.EngineConfig(
      max_batch=8, batch_buckets=(1, 8), min_chunk=16, prefill_chunk=64, max_seq_len=128,
      **config))


def _compiled(runner):
  """Shapes compiled so far by the runner's jitted steps and greedy sampling."""
  from serving.engine import sampling

  return [f._cache_size() for f in runner._fast] + [sampling.greedy._cache_size()]


def test_packed_prefill_keeps_outputs_on_the_llama_decoder():
  """packed_prefill: prompts of ragged lengths go to the device packed in one
  row, fresh ones and prefix-cache hits (over their gathered pages) alike; the
  greedy tokens are those of the row layout, steady state compiles nothing
  after warm-up, and pages come back. A runner that cannot pack is refused."""
  import models
  from serving.engine import api

  model = models.load("tiny", dtype="float32")
  prompts = _prompts(10, seed=11)  # 1..53 tokens; 0, 3, 6, 9 share a 3-page prefix
  waves = [[0, 1, 2, 3], [4, 5, 7, 8], [6, 9]]  # fresh (3 shares 0's prefix), fresh, hits
  outs, packed_calls = {}, []
  for packed in (False, True):
    runner, engine = _llama_engine(model, prefill_rows=4, token_budget=256, warmup=packed,
                                   warmup_continued=packed, packed_prefill=packed)
    if packed:
      assert engine.packed_buckets == (16, 32, 64, 128, 256)
      engine.warmup()
      compiled = _compiled(runner)
      run_packed = runner.prefill_packed

      def spy(tokens, tpos, seg, last, table, fresh=True):
        live = int((seg > 0).sum())
        packed_calls.append((live, fresh))
        assert len(tokens) == min(b for b in engine.packed_buckets if b >= live)
        return run_packed(tokens, tpos, seg, last, table, fresh=fresh)

      runner.prefill_packed = spy
    outs[packed] = {}
    for wave in waves:
      handles = {i: engine.submit(api.Request(
          f"r{i}", prompt_ids=prompts[i], add_bos=False,
          sampling=api.SamplingParams(max_tokens=5, ignore_eos=True))) for i in wave}
      while engine.step():
        pass
      outs[packed].update({i: _drain(h) for i, h in handles.items()})
    if packed:
      assert _compiled(runner) == compiled
    assert engine.stats().pages_in_use == 0
    engine.alloc.check()
  # Wave one: 3 shares 0's prefix, so it waits for 0's prefill and then
  # computes its rest over the cached pages; wave two packs all four fresh;
  # wave three's prefix-cache hits compute their rests.
  assert packed_calls[:3] == [(sum(len(prompts[i]) for i in (0, 1, 2)), True),
                              (len(prompts[3]) - 24, False),
                              (sum(len(prompts[i]) for i in waves[1]), True)]
  (hits, fresh), = packed_calls[3:]
  assert not fresh and 0 < hits <= sum(len(prompts[i]) for i in waves[2]) - 2 * 24, packed_calls
  assert outs[True] == outs[False]
  assert all(len(o) == 5 for o in outs[True].values())
  with pytest.raises(ValueError, match="packed_prefill: .*no packed prefill"):
    E.toy_engine(packed_prefill=True)


def test_prefill_is_packed_by_default_where_the_runner_can():
  # The counting runner packs; the toy model has no packed step, so by
  # default it runs rows (asking for packed is an error, above); False
  # forces rows anywhere.
  assert E.tiny_engine().packed and not E.tiny_engine(packed_prefill=False).packed
  assert not E.toy_engine().packed
  assert [E.tiny_engine().counters()["packed_prefill"],  # what benchmarks record
          E.toy_engine().counters()["packed_prefill"]] == [True, False]
  engine = E.tiny_engine(packed_prefill=False, prefill_rows=4, min_chunk=4, prefill_chunk=64)
  assert engine.scheduler.fit_buckets([(None, 30)]) == [(None, 16)]  # rows: cut at the bucket below


def test_packed_prefill_continues_a_split_prompt_packed():
  """A prompt split by the step's budget continues in the next step's packed
  row (over its gathered pages), never in the row layout, whose rows would
  each be padded to their chunk's bucket; the greedy tokens are the row
  layout's."""
  import models
  from serving.engine import api

  model = models.load("tiny", dtype="float32")
  rng = np.random.default_rng(5)
  prompts = [rng.integers(3, 200, n).tolist() for n in (40, 30, 20, 10)]
  outs, calls = {}, []
  for packed in (False, True):
    runner, engine = _llama_engine(model, prefill_rows=4, token_budget=64, packed_prefill=packed)
    if packed:
      run_packed = runner.prefill_packed

      def spy(tokens, tpos, seg, last, table, fresh=True):
        calls.append(([int((seg == r + 1).sum()) for r in range(int(seg.max()))], fresh,
                      table.shape[1]))
        return run_packed(tokens, tpos, seg, last, table, fresh=fresh)

      def row_prefill(*args):
        raise AssertionError("a row-layout prefill ran")

      runner.prefill_packed, runner.prefill = spy, row_prefill
    handles = [engine.submit(api.Request(
        f"r{i}", prompt_ids=p, add_bos=False,
        sampling=api.SamplingParams(max_tokens=3, ignore_eos=True))) for i, p in enumerate(prompts)]
    while engine.step():
      pass
    outs[packed] = [_drain(h) for h in handles]
    assert engine.stats().pages_in_use == 0
  # 64 tokens: 40 and the first 24 of 30. Then 63 (one decode row): the
  # other 6 of them (a cached prefix of 24: 30 tokens, 4 pages of 8, in the
  # table width bucket of 4) with 20 and 10.
  assert calls == [([40, 24], True, engine.max_pages), ([6, 20, 10], False, 4)], calls
  assert outs[True] == outs[False]
  assert all(len(o) == 3 for o in outs[True])


@pytest.mark.parametrize("packed", [True, False])
def test_mixed_steps_keep_outputs_on_the_llama_decoder(packed):
  """mixed_steps: prompts arriving while others decode share their steps (one
  call for both, its chunks packed in one row or padded rows); greedy tokens
  must not change, and pages come back."""
  import models
  from serving.engine import api

  model = models.load("tiny", dtype="float32")
  prompts = _prompts(9, seed=4)
  outs, calls = {}, {}
  # The mixed engine first: the reference's prefill and decode shapes are
  # among those its warm-up compiled, so they come from the compilation cache.
  for mixed in (True, False):
    runner, engine = _llama_engine(model, prefill_rows=2, decode_prefill_budget=16,
                                   warmup=mixed, mixed_steps=mixed, packed_prefill=packed)
    if mixed:
      engine.warmup()  # the mixed shapes too: steady state must not compile
      compiled = _compiled(runner)
      widths, name = [], "mixed_packed_slots" if packed else "mixed_slots"
      run_mixed = getattr(runner, name)

      def spy(*args, **kw):  # last, slots, decode lengths and table, then the chunks'
        if packed:
          _, tpos, seg, _, table = args[4:]
          kv_end = int(np.where(seg > 0, tpos + 1, 0).max())
          continued = not kw["fresh"]
        else:
          positions, lengths, table = args[5:]
          kv_end, continued = int((positions + lengths).max()), positions.any()
        # A continued chunk gets the bucketed width its rows need, not the
        # whole context's (its attention gathers that many pages per row).
        if continued:
          widths.append(table.shape[1])
          need = -(-kv_end // engine.page_size)
          assert table.shape[1] in engine.table_buckets and table.shape[1] >= need
        return run_mixed(*args, **kw)

      setattr(runner, name, spy)
    sub = lambda i: engine.submit(api.Request(  # noqa: E731
        f"r{i}", prompt_ids=prompts[i], add_bos=False,
        sampling=api.SamplingParams(max_tokens=6, ignore_eos=True)))
    handles = [sub(i) for i in range(3)]
    for _ in range(4):  # the first prompts decode while the next ones arrive
      engine.step()
    handles += [sub(i) for i in range(3, len(prompts))]
    while engine.step():
      pass
    outs[mixed] = [_drain(h) for h in handles]
    if mixed:
      assert _compiled(runner) == compiled
    calls[mixed] = engine.mixed_steps_run
    assert engine.stats().pages_in_use == 0
  assert min(widths) < engine.max_pages, widths
  assert calls[False] == 0 and calls[True] > 0
  assert outs[True] == outs[False]
  assert all(len(o) == 6 for o in outs[True])


def test_min_tokens_in_a_fused_multi_step_call_on_the_llama_decoder():
  """decode_steps=4 on models.Model (one device call per 4 steps, sampling
  inside it): a stop token id below min_tokens is banned at every step of the
  call; from min_tokens on it ends the request as without the ban."""
  import models
  from serving.engine import api

  model = models.load("tiny", dtype="float32")
  runner, engine = _llama_engine(model, decode_steps=4, warmup=False)
  assert runner.supports_multi_step
  prompt = _prompts(1, seed=8)[0]
  multi, calls = runner.decode_multi, []
  runner.decode_multi = lambda *a, **kw: calls.append(kw) or multi(*a, **kw)

  def run(**kw):
    h = engine.submit(api.Request("r", prompt_ids=prompt, add_bos=False,
                                  sampling=api.SamplingParams(ignore_eos=True, **kw)))
    while engine.step():
      pass
    return _drain(h)
  free = run(max_tokens=16)
  stop = free[6]
  first = free.index(stop)
  calls.clear()
  held = run(max_tokens=16, stop_token_ids=[stop], min_tokens=first + 4)
  # The ban needs the sampling path, then the greedy one is back.
  assert [c["greedy_only"] for c in calls][0] is False and calls[-1]["greedy_only"]
  assert held[:first] == free[:first] and stop not in held[:first + 4]
  assert held[first] != free[first]  # the runner-up where the stop token was
  ended = run(max_tokens=16, stop_token_ids=[stop], min_tokens=first)
  assert ended == free[:first]  # at min_tokens the stop token may end it
  assert engine.stats().pages_in_use == 0


def test_a_prompt_prefilled_by_another_request_waits_for_its_pages():
  """Requests with one long prompt arriving together prefill it once: the
  others wait (in the step that admits the first, and in the steps after,
  while its chunks run) for its pages to reach the prefix cache, then compute
  only their last partial page. A request behind them with another prompt is
  not held up. Outputs are the reference's."""
  from serving.engine import api

  engine = E.toy_engine(max_batch=8, num_pages=200, page_size=8, **{**_SMALL,
                                                                    "batch_buckets": (1, 8)})
  rng = random.Random(5)
  shared = [rng.randrange(256) for _ in range(150)]  # 18 full pages and 6 tokens: 3 chunks
  other = [rng.randrange(256) for _ in range(20)]
  prompts = [shared] * 4 + [other]
  handles = [engine.submit(api.Request(f"r{i}", prompt_ids=p, add_bos=False,
                                       sampling=api.SamplingParams(max_tokens=4)))
             for i, p in enumerate(prompts)]
  engine.step()
  # The first copy's chunk, and the other prompt in what the budget leaves.
  assert engine.step_times[-1].prefill_tokens == engine.config.budget == 64 + 8
  while engine.step():
    pass
  prefilled = sum(t.prefill_tokens for t in engine.step_times)
  assert prefilled == 150 + 20 + 3 * (150 - 144)  # the copies: their last 6 tokens
  cached = []
  for h, p in zip(handles, prompts):
    events = []
    while not h.events.empty():
      events.append(h.events.get_nowait())
    assert [t for e in events if isinstance(e, api.Delta) for t in e.token_ids] == \
        reference_greedy(p, 4)
    cached += [e.cached_prompt_tokens for e in events if isinstance(e, api.Final)]
  assert cached == [0, 144, 144, 144, 0]
  assert engine.stats().pages_in_use == 0
  engine.alloc.check()


def test_n_completions_sample_apart_and_prefill_the_prompt_once(toy):
  """n = 4 seeded completions: completion i draws what a lone request with
  completion_seed(seed, i) draws; they differ; only completion 0 computes
  the prompt's full pages, the others read them from the prefix cache."""
  from serving.calls import completion_seed

  _, c = toy
  rng = random.Random(31)
  prompt = [rng.randrange(256) for _ in range(45)]  # 5 full pages of 8, and 5 tokens
  kw = dict(temperature=1.0, top_k=50, max_tokens=8, ignore_eos=True)
  r = c.generate(prompt, n=4, seed=7, **kw)
  outs = [list(x.token_ids) for x in r.completions]
  assert [x.usage.cached_prompt_tokens for x in r.completions] == [0, 40, 40, 40]
  assert len({tuple(o) for o in outs}) > 1
  for i, out in enumerate(outs):
    assert list(c.generate(prompt, seed=completion_seed(7, i), **kw).token_ids) == out, i
  assert list(r.token_ids) == outs[0]


def test_model_runner_steps_take_their_host_ints_in_few_arrays():
  """Each host array a jitted call gets is a transfer of its own (0.3-0.6 ms
  of the dispatching thread on the H200): the runner's steps take their ints
  side by side, one array per leading dim (decode's input tokens stay on the
  device), and compute what the separate arrays gave."""
  import jax

  import models

  model = models.load("tiny", dtype="float32")
  runner = E.ModelRunner(model, num_pages=16, page_size=8)
  host_arrays = []
  fast = runner._fast
  runner._fast = tuple(
      (lambda f: lambda *a, **k: host_arrays.append(
          sum(isinstance(x, np.ndarray) for x in jax.tree.leaves(a[2:]))) or f(*a, **k))(f)
      for f in fast)
  tokens = np.arange(3, 35, dtype=np.int32).reshape(2, 16)
  table = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
  want, _ = model.prefill(model.init_cache(16, page_size=8), tokens, np.zeros(2, np.int32),
                          np.array([16, 9], np.int32), table)
  got = runner.prefill(tokens, np.zeros(2, np.int32), np.array([16, 9], np.int32), table)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  direct = runner.decode(jax.numpy.asarray([5, 6], jax.numpy.int32), np.array([17, 10], np.int32),
                         table)
  z = np.zeros(16, np.int32)
  runner.prefill_packed(z, z, z, np.zeros(2, np.int32), np.zeros((2, 4), np.int32))
  runner.mixed(jax.numpy.asarray([5, 6], jax.numpy.int32), np.array([18, 11], np.int32), table,
               np.zeros((2, 16), np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32),
               np.zeros((2, 4), np.int32))
  # prefill, decode (its input tokens given on the device), packed prefill,
  # mixed, then decode_slots (the slots' last tokens, on the device)
  last = jax.numpy.asarray([9, 5, 6], jax.numpy.int32)
  # The same rows and tokens (slots 1 and 2 of ``last``) after the same prefill:
  # the direct decode's logits.
  runner.prefill(tokens, np.zeros(2, np.int32), np.array([16, 9], np.int32), table)
  logits = runner.decode_slots(last, np.array([1, 2], np.int32), np.array([17, 10], np.int32),
                               table)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(direct), rtol=1e-5, atol=1e-5)
  assert host_arrays == [1, 1, 2, 2, 1, 1]


def _finish_order(engine, handles):
  from serving.engine import api

  while engine.step():
    pass
  finals = {}
  for rid, h in handles.items():
    while not h.events.empty():
      ev = h.events.get_nowait()
      if isinstance(ev, api.Final):
        finals[rid] = ev
  return sorted(finals, key=lambda r: handles[r].submitted + finals[r].total_s), finals


def test_priority_scheduling_admits_by_priority_and_preempts_the_least_urgent():
  """scheduling="priority": waiting requests are admitted by (priority,
  arrival); when pages run out, the least urgent running request is
  preempted, not the latest admitted. Under "fcfs" a priority is refused."""
  from serving.engine import api

  def sub(engine, rid, priority, max_tokens=3):
    return engine.submit(api.Request(rid, prompt_ids=[ord("a")], add_bos=False,
                                     priority=priority,
                                     sampling=api.SamplingParams(max_tokens=max_tokens,
                                                                 ignore_eos=True)))

  engine = E.tiny_engine(max_batch=1, scheduling="priority")
  handles = {rid: sub(engine, rid, p) for rid, p in
             (("first", 0), ("low", 5), ("urgent", -1), ("second", 0))}
  order, _ = _finish_order(engine, handles)
  assert order == ["urgent", "first", "second", "low"]

  for scheduling, survivor in (("priority", "urgent"), ("fcfs", "early")):
    # 12 pages of 4 tokens: two requests of 1 + 30 tokens do not both fit.
    engine = E.tiny_engine(max_batch=2, num_pages=13, scheduling=scheduling)
    handles = {"early": sub(engine, "early", 5 if scheduling == "priority" else 0, 30)}
    engine.step()  # admitted first
    handles["urgent"] = sub(engine, "urgent", 0, 30)
    order, finals = _finish_order(engine, handles)
    assert engine.preemptions > 0 and order[0] == survivor, (scheduling, order)
    assert all(f.completion_tokens == 30 for f in finals.values())
    assert engine.stats().pages_in_use == 0

  with pytest.raises(api.InvalidRequest, match="priority=3 needs priority scheduling"):
    sub(E.tiny_engine(), "r", 3)
  with pytest.raises(ValueError, match="scheduling"):
    E.EngineConfig(scheduling="lifo")


def _reference_logprobs(model, prompt):
  """log_softmax of a float32 forward over the whole prompt: [len(prompt), V]."""
  cache = model.init_cache(16, page_size=8)
  table = np.arange(1, 16, dtype=np.int32)[None]
  logits, _ = model.prefill(cache, np.asarray([prompt], np.int32), np.zeros(1, np.int32),
                            np.array([len(prompt)], np.int32), table, all_logits=True)
  x = np.asarray(logits[0], np.float64)
  return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(
      -1, keepdims=True)


@pytest.mark.parametrize("layout", [{"packed_prefill": False}, {}, {"mixed_steps": True},
                                    {"mixed_steps": True, "packed_prefill": False}],
                         ids=["rows", "packed", "mixed_packed", "mixed_rows"])
def test_prompt_logprobs_on_the_llama_decoder(layout):
  """prompt_logprobs=3: entry i is prompt token i + 1's logprob given tokens
  0..i, with the 3 likeliest tokens there, as a float32 forward over the whole
  prompt says. A 100-token prompt is scored in two chunks (64, then 36 over
  the cache) beside a plain request with the same prompt, which gets no
  scores; a third request's prompt arrives while the second chunk is due and
  keeps its call layout (rows, packed, or mixed with the decodes, packed or
  in rows). Every
  completion equals a lone request's. The scored request reads nothing from
  the prefix cache."""
  import models
  from serving.engine import api

  model = models.load("tiny", dtype="float32")
  runner, engine = _llama_engine(model, warmup=False, prompt_logprobs=True, **layout)
  rng = np.random.default_rng(3)
  prompt, other = (rng.integers(0, model.config.vocab_size, n).tolist() for n in (100, 20))
  scored, calls = runner.prefill_scores, []
  runner.prefill_scores = lambda *a: calls.append(a[0].shape) or scored(*a)

  def submit(rid, p=prompt, **kw):
    return engine.submit(api.Request(rid, prompt_ids=p, add_bos=False,
                                     sampling=api.SamplingParams(max_tokens=6, **kw)))

  plain, alone_other = _drain_all(engine, [submit("alone"), submit("alone-other", other)])
  handles = [submit("scored", prompt_logprobs=3), submit("plain")]
  engine.step()  # the first chunks; the plain request has its prompt
  handles.append(submit("other", other))
  (ids, final), (ids2, final2), (ids3, _) = _drain_all(engine, handles, finals=True)
  assert ids == ids2 == plain and len(plain) == 6 and ids3 == alone_other
  assert calls == [(1, 64), (1, 64)]  # 36 tokens go to the 64 bucket
  assert final.cached_prompt_tokens == 0 and final2.cached_prompt_tokens == 96
  # With mixed steps, the other prompt rode with the plain request's decode.
  assert engine.mixed_steps_run == (1 if layout.get("mixed_steps") else 0)
  assert final2.prompt_logprobs == ()
  lps = final.prompt_logprobs
  assert [x.token_id for x in lps] == prompt[1:]
  ref = _reference_logprobs(model, prompt)
  got = np.array([x.logprob for x in lps])
  want = ref[np.arange(99), prompt[1:]]
  np.testing.assert_allclose(got, want, atol=2e-4)
  for i, x in enumerate(lps):
    assert len(x.top) == 3
    np.testing.assert_allclose([v for _, v in x.top], np.sort(ref[i])[::-1][:3], atol=2e-4)
    assert ref[i][[t for t, _ in x.top]].argmax() == 0  # the likeliest first
  assert engine.stats().pages_in_use == 0


def _drain_all(engine, handles, finals=False, logprobs=False):
  """Steps the engine until every handle's Final: (ids, Final) or ids each;
  with ``logprobs``, (ids, Final, the deltas' TokenLogprobs)."""
  from serving.engine import api

  out = []
  while engine.step():
    pass
  for h in handles:
    ids, final, lps = [], None, []
    while not h.events.empty():
      ev = h.events.get_nowait()
      assert not isinstance(ev, api.Failed), ev
      if isinstance(ev, api.Delta):
        ids.extend(ev.token_ids)
        lps.extend(ev.logprobs)
      elif isinstance(ev, api.Final):
        final = ev
    assert final is not None
    out.append((ids, final, lps) if logprobs else (ids, final))
  return out if finals or logprobs else [ids for ids, _ in out]


def test_prompt_logprobs_survive_preemption_once_each():
  """A scored request preempted after its prompt was scored computes the
  prompt again: its scores come back once per position, in order."""
  from serving.engine import api

  # 8 usable pages of 4 tokens: the first request grows to 7 pages, so the
  # scored one (admitted second, 3 pages of prompt) is preempted.
  engine = E.tiny_engine(num_pages=9, page_size=4, max_batch=2, prompt_logprobs=True)
  scores, calls = engine.runner.prefill_scores, []
  engine.runner.prefill_scores = lambda *a: calls.append(int(a[2][0])) or scores(*a)
  first = engine.submit(api.Request("a", prompt_ids=list(range(97, 105)), add_bos=False,
                                    sampling=api.SamplingParams(max_tokens=20,
                                                                ignore_eos=True)))
  prompt = [97, 98, 99, 101, 102, 103, 104, 106, 107, 108, 109, 110]
  scored = engine.submit(api.Request("b", prompt_ids=prompt, add_bos=False,
                                     sampling=api.SamplingParams(max_tokens=6, ignore_eos=True,
                                                                 prompt_logprobs=0)))
  (_, fa), (ids, fb) = _drain_all(engine, [first, scored], finals=True)
  # The prompt scored twice: whole, then again with its tokens since (in chunks).
  assert engine.preemptions > 0 and calls[0] == len(prompt) and sum(calls[1:]) > len(prompt)
  assert len(engine._by_id) == 0 and engine.stats().pages_in_use == 0
  assert [x.token_id for x in fb.prompt_logprobs] == prompt[1:]
  follows = [b == a + 1 for a, b in zip(prompt, prompt[1:])]
  assert [x.logprob > -1 for x in fb.prompt_logprobs] == follows
  assert ids == list(range(111, 117))


def _spec_run(engine, requests, logprobs=False):
  """Submits (prompt, SamplingParams kwargs) pairs, steps the engine dry:
  each request's token ids and Final (and its tokens' logprobs)."""
  from serving.engine import api

  handles = [engine.submit(api.Request(f"r{i}", prompt_ids=p, add_bos=False,
                                       sampling=api.SamplingParams(**kw)))
             for i, (p, kw) in enumerate(requests)]
  return _drain_all(engine, handles, finals=True, logprobs=logprobs)


def test_ngram_speculation_takes_the_drafts_the_model_agrees_with():
  """num_speculative_tokens=4 on the counting model (after byte b comes
  b + 1): a prompt that repeats its start drafts what followed there, which
  the model agrees with, so 20 tokens take 5 calls; a draft running past a
  stop token or past max_tokens ends exactly where plain decoding ends; the
  outputs are plain decoding's, and pages come back."""
  text = lambda t: [ord(c) for c in t]  # noqa: E731
  requests = [(text("abcdefghijklmnopqrstuvwxyz0123abc"), dict(max_tokens=20)),
              (text("uvwxyz{|}~uvw"), dict(max_tokens=30)),  # "~" is followed by EOS
              (text("klmnopqrstklm"), dict(max_tokens=9, stop_token_ids=[ord("q")])),
              (text("0123456789012"), dict(max_tokens=6))]
  outs = {}
  for k in (0, 4):
    engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=k)
    outs[k] = [(ids, f.reason, f.completion_tokens) for ids, f in _spec_run(engine, requests)]
    if k:
      assert engine.spec_accepted_tokens > 0
      assert engine.spec_draft_tokens >= engine.spec_accepted_tokens
      assert engine.stats().spec_accepted_tokens == engine.spec_accepted_tokens
    assert engine.stats().pages_in_use == 0
  assert outs[4] == outs[0]
  (ids, reason, _), (_, eos, _), (stopped, stop, _), (six, length, _) = outs[4]
  assert ids == list(range(ord("d"), ord("d") + 20)) and reason == api_reason("LENGTH")
  assert eos == api_reason("EOS") and stop == api_reason("STOP") and stopped == text("nop")
  assert len(six) == 6 and length == api_reason("LENGTH")
  # Alone, the first request takes its 20 tokens in 5 calls, not 20.
  engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=4)
  _spec_run(engine, requests[:1])
  assert engine.steps == 1 + 4  # the prompt's call (its first token), then 4 + 5 x 3 + 4
  # With a seeded sampled request and a greedy one with logprobs beside it:
  # every output, logprobs included, is what it is without speculation.
  mixed = requests[:1] + [(text("xyz"), dict(temperature=0.8, seed=7, max_tokens=25,
                                             ignore_eos=True)),
                          (text("abcdefghabc"), dict(max_tokens=8, logprobs=True, top_logprobs=2))]
  got, lps = {}, {}
  for k in (0, 4):
    engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=k)
    run = _spec_run(engine, mixed, logprobs=True)
    got[k] = [(ids, f.completion_tokens) for ids, f, _ in run]
    lps[k] = run[2][2]
    assert engine.stats().pages_in_use == 0
  assert got[4] == got[0] and got[4][0][0] == outs[0][0][0]
  assert engine.spec_accepted_tokens > 0
  assert [x.token_id for x in lps[4]] == got[4][2][0] and len(lps[4]) == 8
  for a, b in zip(lps[4], lps[0]):
    assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert [t for t, _ in a.top] == [t for t, _ in b.top]
  # A seeded sampled request drafts too: its tokens are its draws with its
  # steps' keys, whether they came as checked drafts or from decode steps.
  seeded = [(text("abcdefghabc"), dict(temperature=0.8, seed=7, max_tokens=12))]
  runs = []
  for k in (0, 4):
    engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=k)
    runs.append(_spec_run(engine, seeded)[0][0])
  assert runs[1] == runs[0] and engine.spec_accepted_tokens > 0
  # An unseeded one drafts, and keeps the drafts its distribution keeps: on
  # this model (its next byte at 20 logits above the rest) all of them.
  engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=4)
  ((ids, final),) = _spec_run(engine, [(text("abcdefghijklmnopqrstuvwxyz0123abc"),
                                        dict(temperature=0.8, max_tokens=20))])
  assert ids == list(range(ord("d"), ord("d") + 20))
  assert engine.spec_accepted_tokens == engine.spec_draft_tokens > 0
  assert engine.steps == 1 + 4 and engine.stats().pages_in_use == 0


def test_ngram_speculation_with_penalties_bias_and_min_tokens():
  """Requests with per-slot sampling state draft too, and their outputs are
  plain decoding's: a logit bias that makes the counting model repeat "x",
  against a frequency penalty that grows with each "x" (each draft position
  counts the drafts before it, and kept drafts count for later calls); a
  min_tokens that bans the EOS after "~"; allowed ids."""
  text = lambda t: [ord(c) for c in t]  # noqa: E731
  x = ord("x")
  requests = [(text("wxxxxxxx"), dict(max_tokens=24, logit_bias={x: 25.0},
                                       frequency_penalty=1.5)),
              (text("uvwxyz{|}~uvw"), dict(max_tokens=16, min_tokens=12)),
              (text("abcabcabcab"), dict(max_tokens=10, allowed_token_ids=text("abcz"),
                                         presence_penalty=0.5))]
  outs = {}
  for k in (0, 4):
    engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=k,
                           speculative_patience=0)
    outs[k] = [(ids, f.reason) for ids, f in _spec_run(engine, requests)]
    assert engine.stats().pages_in_use == 0
  assert outs[4] == outs[0]
  assert engine.spec_draft_tokens > 0 and engine.spec_accepted_tokens > 0
  (xs, _), (tilde, _), (abc, _) = outs[4]
  # "x" (15 with the bias) until its penalty (1.5 an "x") takes it under the
  # model's own next byte (10): the fifth is refused, from drafts of "x".
  assert xs == text("xxxxyz{|}~")
  assert len(tilde) >= 12 and tilde[:7] == text("xyz{|}~")
  assert set(abc) <= set(text("abcz"))
  # Without the state the same prompts give other tokens: it is what decides.
  plain = [(p, {"max_tokens": kw["max_tokens"]}) for p, kw in requests]
  engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4))
  assert [ids for ids, _ in _spec_run(engine, plain)] != [ids for ids, _ in outs[0]]


def test_ngram_speculation_pauses_a_request_whose_drafts_miss():
  """Every draft of this prompt is refused (after byte b it drafts "z", the
  counting model says b + 1): with speculative_patience = 2 the request
  stops drafting after two misses for 8 tokens, then 16, and its decode runs
  as 4-step calls meanwhile; with 0 it checks a draft every call. The tokens
  are the same; a request whose drafts are kept never pauses (5 calls for 20
  tokens, as in the test above)."""
  text = lambda t: [ord(c) for c in t]  # noqa: E731
  prompt = text("".join(c + "z" for c in "bcdefghijklmnopqrstuvw") + "a")
  runs = {}
  for patience in (0, 2):
    engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=4,
                           decode_steps=4, speculative_patience=patience)
    ((ids, _),) = _spec_run(engine, [(prompt, dict(max_tokens=24))])
    assert engine.spec_accepted_tokens == 0 and engine.stats().pages_in_use == 0
    runs[patience] = (ids, engine.spec_draft_tokens, engine.steps)
  assert runs[0][0] == runs[2][0] == list(range(ord("b"), ord("b") + 24))
  assert runs[0][1] >= 4 * 20  # a refused draft of 4 at (nearly) every token
  assert runs[2][1] <= 4 * 6 and runs[2][2] < runs[0][2] / 2, runs
  engine = E.tiny_engine(max_batch=4, batch_buckets=(1, 2, 4), num_speculative_tokens=4,
                         speculative_patience=1)
  _spec_run(engine, [(text("abcdefghijklmnopqrstuvwxyz0123abc"), dict(max_tokens=20))])
  assert engine.steps == 1 + 4


def api_reason(name):
  from serving.engine import api

  return getattr(api.FinishReason, name)


def test_ngram_speculation_on_the_llama_decoder():
  """The tiny Llama, greedy (one request with repetition and frequency
  penalties) and sampled with a seed, with speculation: the same tokens
  (and logprobs) as plain decoding, drafts kept and refused, no compile
  after warm-up, pages back. The drafts are plain decoding's own next tokens,
  the last one wrong every other call (the n-gram drafter is tested apart:
  on a random model its drafts are rarely right). With
  k = 3 every checking call is a decode step of 4 query tokens a row (decode
  attention over the pages in place, short rows padded); with k = 8, past the
  decode kernels' 8 queries, the continued-prefill form over gathered pages."""
  import models

  model = models.load("tiny", dtype="float32")
  rng = np.random.default_rng(5)
  base = rng.integers(0, model.config.vocab_size, 12).tolist()
  # Repeats in the prompts, so that drafts are found from the first step.
  requests = [(base + base[:4], dict(max_tokens=16)),
              (base[3:] * 2, dict(max_tokens=12, logprobs=True, top_logprobs=3)),
              (rng.integers(0, model.config.vocab_size, 7).tolist() * 3,
               dict(max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.4, logprobs=True,
                    top_logprobs=2)),
              (base[5:] * 3, dict(max_tokens=12, temperature=0.7, top_k=8, seed=11))]
  outs, lps = {}, {}
  for k in (0, 3, 8):
    # patience 0: drafting never pauses (this checks the checking calls, not
    # when to make them).
    runner, engine = _llama_engine(model, warmup=bool(k), num_speculative_tokens=k,
                                   speculative_patience=0)
    calls = {"check_decode": 0, "check_prefill": 0}
    for name in calls:
      def counted(*a, _f=getattr(runner, name), _n=name, **kw):
        calls[_n] += 1
        return _f(*a, **kw)
      setattr(runner, name, counted)
    if k:
      engine.warmup()
      compiled = _compiled(runner)
      calls = dict.fromkeys(calls, 0)  # the warm-up's calls aside
      want = {f"r{i}": list(p) + outs[0][i] for i, (p, _) in enumerate(requests)}
      made = itertools.count()

      def draft(seq, _k=k, want=want, made=made):
        d = want[seq.req.request_id][len(seq.tokens):len(seq.tokens) + _k]
        if d and next(made) % 2:
          d[-1] = (d[-1] + 1) % model.config.vocab_size
        return d
      engine.speculator.draft = draft
    run = _spec_run(engine, requests, logprobs=True)
    outs[k], lps[k] = [ids for ids, _, _ in run], (run[1][2], run[2][2])
    if k:
      assert _compiled(runner) == compiled
      assert engine.spec_accepted_tokens > engine.spec_draft_tokens / 2
      assert engine.spec_accepted_tokens < engine.spec_draft_tokens
      paged = "check_decode" if k == 3 else "check_prefill"
      assert calls[paged] > 0 and sum(calls.values()) == calls[paged], calls
    assert engine.stats().pages_in_use == 0
  assert outs[3] == outs[0] and outs[8] == outs[0]
  assert [len(o) for o in outs[3]] == [16, 12, 14, 12]
  # The logprobs requests', kept drafts' included, are plain decoding's (the
  # penalized one's from its penalized distribution, as a decode step's).
  for k, r in itertools.product((3, 8), (0, 1)):
    got, want = lps[k][r], lps[0][r]
    assert [x.token_id for x in got] == outs[0][1 + r]
    np.testing.assert_allclose([x.logprob for x in got], [x.logprob for x in want], atol=1e-4)
    np.testing.assert_allclose([[v for _, v in x.top] for x in got],
                               [[v for _, v in x.top] for x in want], atol=1e-4)
    assert [[t for t, _ in x.top] for x in got] == [[t for t, _ in x.top] for x in want]
