"""The scheduler and the KV cache manager without a model: requests are
``Seq`` records whose steps the tests play by hand (a prefill chunk computes
its tokens, a decode step one token), and each test checks the decisions."""

import os
import pathlib
import queue
import subprocess
import sys
import textwrap

import pytest

from serving.engine import api
from serving.engine.config import EngineConfig
from serving.engine.kv_cache import KVCacheManager
from serving.engine.scheduler import Schedule, Scheduler
from serving.engine.sequence import Seq, State
from serving.engine.text import ByteTokenizer

_TOK = ByteTokenizer()


def _scheduler(num_pages=64, page_size=4, max_pages=32, prefix_caching=True, packed=True,
               **config):
  config = EngineConfig(**{"max_batch": 4, "prefill_chunk": 16, "min_chunk": 4,
                           "warmup": False, **config})
  kv = KVCacheManager(num_pages, page_size, slots=config.max_batch, max_pages=max_pages,
                      prefix_caching=prefix_caching)
  admitted = []
  sched = Scheduler(config, kv, capacity=min(max_pages, num_pages - 1) * page_size,
                    packed=packed, on_admit=admitted.append)
  sched.admitted = admitted  # what on_admit heard, in order
  return sched


_order = iter(range(1, 1 << 30))


def _seq(sched, rid, prompt, *, max_tokens=32, priority=0):
  req = api.Request(rid, prompt_ids=list(prompt), priority=priority,
                    sampling=api.SamplingParams(max_tokens=max_tokens))
  handle = api.RequestHandle(rid, len(prompt), queue.SimpleQueue())
  return Seq(req, handle, list(prompt), max_tokens, 0, _TOK, next(_order), frozenset(),
             sched.config.scheduling == "priority")


def _prompt(n, start=0):
  return [(start + i) % 200 for i in range(n)]


def _play(sched, schedule: Schedule):
  """The device side of a schedule: each chunk's tokens are computed (their
  full pages registered) and a prompt's last chunk samples its first token;
  each decode computes its input token and samples one more."""
  for seq, n in schedule.prefills:
    seq.computed += n
    sched.kv.register_blocks(seq)
    if seq.computed == seq.num_tokens:
      seq.state = State.DECODE
      seq.generated.append(1)
  for seq in schedule.decodes:
    seq.computed += schedule.steps
    seq.generated.extend([1] * schedule.steps)


def _decoding(sched, *prompts, **kw):
  """Requests admitted and prefilled to their first token, in this order."""
  seqs = [_seq(sched, f"d{i}", p, **kw) for i, p in enumerate(prompts)]
  sched.add(seqs)
  while any(s.state != State.DECODE for s in seqs):
    _play(sched, sched.schedule())
  return seqs


def test_decodes_take_one_token_each_and_the_rest_goes_to_a_prompt_chunk():
  sched = _scheduler(token_budget=10)
  a, b = _decoding(sched, _prompt(5), _prompt(6, 50))
  p = _seq(sched, "p", _prompt(40, 100))
  sched.add([p])
  s = sched.schedule()
  assert s.decodes == [a, b] and s.steps == 1
  assert s.prefills == [(p, 8)]  # 10 tokens less the two decodes
  assert p.state == State.PREFILL and sched.running == [a, b, p] and not sched.waiting


def test_decode_prefill_budget_caps_the_chunk_beside_decodes():
  sched = _scheduler(decode_prefill_budget=3)
  (a,) = _decoding(sched, _prompt(5))
  p = _seq(sched, "p", _prompt(40, 100))
  sched.add([p])
  assert sched.schedule() == Schedule([a], [(p, 3)], 1)


def test_a_long_prompt_is_split_over_steps_at_most_prefill_chunk_each():
  sched = _scheduler(prefill_chunk=16)
  p = _seq(sched, "p", _prompt(40))
  sched.add([p])
  chunks = []
  while p.state != State.DECODE:
    s = sched.schedule()
    assert not s.decodes
    chunks += [n for seq, n in s.prefills if seq is p]
    _play(sched, s)
  assert chunks == [16, 16, 8]


def test_prefill_first_holds_decodes_back_while_prompts_prefill():
  sched = _scheduler(prefill_first=True)
  (a,) = _decoding(sched, _prompt(8))
  p = _seq(sched, "p", _prompt(6, 100))
  sched.add([p])
  s = sched.schedule()
  assert s == Schedule([], [(p, 6)], 1)
  assert len(a.pages) == 3  # the page of its next token stays reserved
  _play(sched, s)
  assert sched.schedule() == Schedule([a, p], [], 1)


def test_rows_cut_chunks_to_the_bucket_below_packed_calls_keep_them():
  rows = _scheduler(packed=False, prefill_chunk=64, min_chunk=4)
  assert rows.chunk_buckets == (4, 16, 64)
  assert rows.fit_buckets([(None, 30), (None, 9)]) == [(None, 16), (None, 9)]
  assert rows.fit_buckets([(None, 40)]) == [(None, 40)]  # over twice 16: one call of 64
  packed = _scheduler(packed=True, prefill_chunk=64, min_chunk=4)
  assert packed.fit_buckets([(None, 30)]) == [(None, 30)]


def _full_cache(scheduling, priorities):
  """Two decoding requests, a admitted before b, holding all 8 pages: 4
  each, their next tokens past them."""
  sched = _scheduler(num_pages=9, page_size=4, max_pages=8, scheduling=scheduling)
  a = _seq(sched, "a", _prompt(14), priority=priorities[0])
  b = _seq(sched, "b", _prompt(15, 40), priority=priorities[1])
  sched.add([a])
  _play(sched, sched.schedule())
  sched.add([b])
  _play(sched, sched.schedule())
  _play(sched, sched.schedule())
  assert sched.kv.alloc.available == 0 and a.computed == b.computed == 16
  assert len(a.pages) == len(b.pages) == 4 and sched.running == [a, b]
  return sched, (a, b)


def test_fcfs_preempts_the_latest_admitted_when_pages_run_out():
  sched, (a, b) = _full_cache("fcfs", (0, 0))
  s = sched.schedule()
  assert s.decodes == [a] and s.prefills == []  # b's tokens no longer fit beside a
  assert sched.preemptions == 1
  assert b.state == State.WAITING and list(sched.waiting) == [b] and sched.running == [a]
  assert b.pages == [] and b.computed == 0 and b.slot == -1
  assert len(a.pages) == 5 and sched.kv.alloc.available == 3
  sched.kv.alloc.check()


def test_priority_preempts_the_least_urgent_not_the_latest():
  sched, (a, b) = _full_cache("priority", (1, 0))  # a came first, b is more urgent
  s = sched.schedule()
  assert s.decodes == [b] and sched.preemptions == 1
  assert a.state == State.WAITING and list(sched.waiting) == [a] and sched.running == [b]
  assert len(b.pages) == 5


def test_the_latest_request_short_of_a_page_preempts_itself():
  sched = _scheduler(num_pages=9, page_size=4, max_pages=8, prefill_chunk=32, token_budget=64)
  a, b = _decoding(sched, _prompt(5), _prompt(23, 60))  # 2 + 6 pages
  _play(sched, sched.schedule())
  assert sched.kv.alloc.available == 0 and b.computed == 24
  s = sched.schedule()  # a's next token fits its pages; b's needs a 7th
  assert s.decodes == [a] and b.state == State.WAITING and sched.running == [a]
  assert sched.preemptions == 1 and len(a.pages) == 2


def test_priority_admits_the_most_urgent_first_then_by_arrival():
  sched = _scheduler(scheduling="priority", prefill_rows=2)
  seqs = [_seq(sched, f"r{i}", _prompt(5, 10 * i), priority=p)
          for i, p in enumerate((2, 0, 1, 0))]
  sched.add(seqs)
  assert list(sched.waiting) == [seqs[1], seqs[3], seqs[2], seqs[0]]
  s = sched.schedule()
  assert [seq for seq, _ in s.prefills] == [seqs[1], seqs[3]]  # two rows a step
  assert sched.admitted == [seqs[1], seqs[3]]
  assert list(sched.waiting) == [seqs[2], seqs[0]]


def test_fcfs_admits_in_arrival_order_whatever_the_priority_field():
  sched = _scheduler(prefill_rows=2)
  seqs = [_seq(sched, f"r{i}", _prompt(5, 10 * i), priority=p)
          for i, p in enumerate((2, 0, 1))]
  sched.add(seqs)
  assert [seq for seq, _ in sched.schedule().prefills] == seqs[:2]


def test_a_prefix_cache_hit_starts_the_chunk_at_the_cached_length():
  sched = _scheduler(page_size=4)
  (a,) = _decoding(sched, _prompt(13))  # 3 full pages registered
  assert a.registered == 12 and sched.kv.alloc.cached == 3
  b = _seq(sched, "b", _prompt(12) + [199, 198])
  sched.add([b])
  s = sched.schedule()
  assert (b, 2) in s.prefills
  assert b.computed == 12 and b.cached_tokens == 12 and b.pages[:3] == a.pages[:3]
  # The whole prompt cached: its last token is still computed, for its logits.
  c = _seq(sched, "c", _prompt(12))
  sched.add([c])
  assert (c, 4) in sched.schedule().prefills and c.cached_tokens == 8


def test_no_prefix_caching_computes_every_token():
  sched = _scheduler(page_size=4, prefix_caching=False)
  _decoding(sched, _prompt(13))
  b = _seq(sched, "b", _prompt(14))
  sched.add([b])
  assert (b, 14) in sched.schedule().prefills and b.cached_tokens == 0


def test_a_prompt_whose_next_block_is_in_flight_waits_for_it():
  sched = _scheduler(page_size=4, prefill_chunk=8, token_budget=64)
  a = _seq(sched, "a", _prompt(40))
  sched.add([a])
  _play(sched, sched.schedule())  # a: 8 of 40 tokens, 2 pages registered
  b = _seq(sched, "b", _prompt(40))  # the same prompt: its 3rd block is a's next
  c = _seq(sched, "c", _prompt(20, 100))  # another prompt, behind it
  sched.add([b, c])
  s = sched.schedule()
  assert s.prefills == [(a, 8), (c, 8)]  # c need not wait behind b
  assert list(sched.waiting) == [b] and b.state == State.WAITING
  while a.state != State.DECODE:
    _play(sched, s)
    s = sched.schedule()
  # a's prompt is in the prefix cache now: b starts after it.
  assert (b, 4) in s.prefills and b.cached_tokens == 36


def test_waiting_requests_are_not_admitted_while_stopping():
  sched = _scheduler()
  p = _seq(sched, "p", _prompt(5))
  sched.add([p])
  assert sched.schedule(admit=False) == Schedule([], [], 1)
  assert list(sched.waiting) == [p]


def test_admission_waits_for_a_free_slot():
  sched = _scheduler(max_batch=2, token_budget=64)
  _decoding(sched, _prompt(5), _prompt(5, 30))
  p = _seq(sched, "p", _prompt(5, 60))
  sched.add([p])
  assert sched.schedule().prefills == [] and list(sched.waiting) == [p]


def test_release_frees_pages_and_slot():
  sched = _scheduler(max_batch=2)
  a, b = _decoding(sched, _prompt(9), _prompt(9, 50))
  free = sched.kv.alloc.available
  sched.release(a)
  assert a.state == State.DONE and a.pages == [] and sched.running == [b]
  assert sched.kv.alloc.available == free + 3 and a.slot in sched.free_slots
  w = _seq(sched, "w", _prompt(5))
  sched.add([w])
  sched.release(w)  # a waiting request leaves the queue
  assert not sched.waiting and w.state == State.DONE
  sched.kv.alloc.check()


def test_multi_step_decodes_only_with_nothing_waiting_and_enough_left():
  sched = _scheduler(decode_steps=4)
  (a,) = _decoding(sched, _prompt(5), max_tokens=12)
  assert sched.decode_steps() == 4
  a.generated.extend([1] * 9)  # 10 of 12: no request has more than 4 // 2 left
  assert sched.decode_steps() == 1
  del a.generated[1:]
  b = _seq(sched, "b", _prompt(5, 50))
  sched.add([b])
  assert sched.decode_steps() == 1  # a prompt waits
  s = sched.schedule()
  assert s.steps == 1 and b.state == State.PREFILL and sched.decode_steps() == 1
  _play(sched, s)
  s = sched.schedule()
  assert s.steps == 4 and s.decodes == [a, b]
  assert len(a.pages) == 3  # 6 computed + 4 steps: a third page


def test_kv_reserve_writes_the_slot_table_and_stops_at_an_empty_allocator():
  kv = KVCacheManager(4, 4, slots=2, max_pages=8)
  sched = _scheduler()
  seq = _seq(sched, "s", _prompt(5))
  seq.slot = 1
  assert kv.reserve(seq, 9) and seq.pages == [1, 2, 3]
  assert kv.slot_table[1, :4].tolist() == [1, 2, 3, 0]
  assert kv.reserve(seq, 12)  # within its pages: nothing taken
  assert not kv.reserve(seq, 13) and seq.pages == [1, 2, 3]
  kv.free(seq)
  assert seq.pages == [] and kv.alloc.available == 3


def test_scheduler_and_kv_cache_import_without_jax():
  """The scheduler's modules import without jax, as a user imports them (the
  package's engine and runners load only when named)."""
  root = pathlib.Path(__file__).resolve().parents[2]
  code = textwrap.dedent("""
      import sys
      import serving.engine.kv_cache, serving.engine.scheduler
      from serving.engine import EngineConfig
      print(sorted(m for m in sys.modules if m.split(".")[0] == "jax"))
  """)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
  out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == "[]"


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
