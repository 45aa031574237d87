"""Warm-up: every shape the engine's steps run, compiled before it serves.

The shape set follows from the scheduler's buckets (serving.engine.scheduler):
decode batches, prefill rows x chunk lengths (or packed token counts) at
each page-table width a continued chunk may gather, the mixed steps' chunk
shapes, prompt-scoring calls and the speculative checking call, each with
the sampling variants steady state uses. Every call writes only to the null
page (zero tokens, zero lengths), so warming up leaves the cache as it was.
``warm_calls`` returns how many decode, prefill and mixed shapes it ran.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time

import jax
import numpy as np

from serving.engine import sampling

log = logging.getLogger("serving.engine")


def warmup(e) -> None:
  """Compiles every bucketed shape once, writing only to the null page.

  Where the runner can compile a step without running it, a first pass over
  the same calls lowers each step on this thread and compiles it on
  ``compile_threads`` threads: XLA compiles without holding the interpreter,
  so the compiles run side by side and beside the next step's lowering.
  The second pass then runs each shape once from the compiled executables.
  """
  t0 = time.perf_counter()
  threads = e.config.compile_threads
  if threads > 1 and getattr(e.runner, "compiles_ahead", False):
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
      with e.runner.compiling_in(pool) as compiles:
        e._warm_calls()
      for f in compiles:
        f.result()  # a failed compile raises here
    log.info("warm-up: %d steps compiled on %d threads in %.1f s", len(compiles), threads,
             time.perf_counter() - t0)
  shapes = e._warm_calls()
  log.info("warm-up compiled %d decode, %d prefill and %d mixed shapes in %.1f s", *shapes,
           time.perf_counter() - t0)
  why_not = e.guided.grammars.prepare()  # (else the first structured request would build it)
  if why_not:
    log.info("structured outputs are off: %s", why_not)


def warm_calls(e) -> tuple[int, int, int]:
  """Runs every bucketed shape once: (decode, prefill, mixed) shapes."""
  table_w = e.max_pages
  # A slot's penalty and end-token state, as a penalized or min_tokens request
  # sets it at admission (slot 0 is free: anything goes there until then).
  v = e.runner.vocab_size
  e._counts, e._slot_tokens = sampling.set_rows(
      e._counts, e._slot_tokens, np.int32(0), np.zeros(v, np.int32),
      sampling.slot_row(v))
  # Structured requests' allow rows, as each step sets them (padding rows only).
  for b in e.batch_buckets:
    e._slot_tokens = sampling.set_allow(
        e._slot_tokens, np.full((b,), e.config.max_batch, np.int32),
        np.full((b, sampling.mask_words(v)), -1, np.int32))
  for b in e.batch_buckets:
    logits = e._decode_call(np.zeros((b,), np.int32), np.zeros((b,), np.int32),
                               np.zeros((b, table_w), np.int32))
    _warm_sampling(e, logits, b)
    if e.config.decode_steps > 1 and getattr(e.runner, "supports_multi_step", False):
      arrays = sampling.pack([], [], [], [], b)
      for greedy_only, lp in ((True, False), (True, True), (False, True)):
        out = e.runner.decode_multi(
            np.zeros((b,), np.int32), np.zeros((b,), np.int32),
            np.zeros((b, table_w), np.int32), arrays, e._counts, e._slot_tokens,
            e._last_tok, steps=e.config.decode_steps, greedy_only=greedy_only,
            logprobs=lp)
        e._counts, e._last_tok = out[4], out[5]
  # (position, page-table width) of each chunk shape: position 0 is a fresh
  # chunk with the full table, position 1 a continued one at each width
  # bucket (a model may compile the two apart).
  chunk_tables = ((0, table_w),) + tuple((1, w) for w in e.table_buckets)
  prefill_tables = chunk_tables if e.config.warmup_continued else chunk_tables[:1]
  packed_tables = ()
  if e.packed:  # every prefill call is packed: no row-layout shapes
    packed_tables, prefill_tables = prefill_tables, ()
    rows = e.config.prefill_rows
    for n in e.packed_buckets:  # segment 0 everywhere: nothing is written
      z = np.zeros((n,), np.int32)
      for pos, w in packed_tables:
        logits = e.runner.prefill_packed(z, z, z, np.zeros((rows,), np.int32),
                                            np.zeros((rows, w), np.int32), fresh=pos == 0)
    _warm_sampling(e, logits, rows)
  for rows in e.row_buckets:
    for t in e.chunk_buckets:
      # Rows of length 0 write nothing.
      for pos, w in prefill_tables:
        logits = e.runner.prefill(np.zeros((rows, t), np.int32),
                                     np.full((rows,), pos, np.int32),
                                     np.zeros((rows,), np.int32), np.zeros((rows, w), np.int32))
      if prefill_tables:
        _warm_sampling(e, logits, rows)
      if e.mixed and not e._mixed_packed and t in e._mixed_chunks:
        b = e.batch_buckets[-1]
        # Mixed steps split prompts across steps: continued chunks are the rule.
        for pos, w in chunk_tables:
          logits = e._mixed_call(
              np.zeros((b,), np.int32), np.zeros((b,), np.int32),
              np.zeros((b, table_w), np.int32),
              np.zeros((rows, t), np.int32), np.full((rows,), pos, np.int32),
              np.zeros((rows,), np.int32), np.zeros((rows, w), np.int32))
        _warm_sampling(e, logits, b + rows)
  if e._mixed_packed:  # continued chunks are the rule here too
    b, rows = e.batch_buckets[-1], e.config.prefill_rows
    for n in e._mixed_packed_ns:
      z = np.zeros((n,), np.int32)
      for pos, w in chunk_tables:
        logits = e._mixed_packed_call(
            np.zeros((b,), np.int32), np.zeros((b,), np.int32),
            np.zeros((b, table_w), np.int32), z, z, z, np.zeros((rows,), np.int32),
            np.zeros((rows, w), np.int32), fresh=pos == 0)
    _warm_sampling(e, logits, b + rows)
  if e.config.prompt_logprobs:  # a scored chunk is a call of one row
    rows = e.row_buckets[0]
    for t in e.chunk_buckets:
      z = np.zeros((rows, t), np.int32)
      for pos, w in chunk_tables:
        logits, _ = e.runner.prefill_scores(z, np.full((rows,), pos, np.int32),
                                               np.zeros((rows,), np.int32),
                                               np.zeros((rows, w), np.int32), z)
    _warm_sampling(e, logits, rows)
  if e.config.num_speculative_tokens:  # checking calls continue a sequence
    t = e.speculator.chunk
    k1 = e.config.num_speculative_tokens + 1
    for rows in e.speculator.rows:
      z, zr = np.zeros((rows, t), np.int32), np.zeros((rows,), np.int32)
      if e.speculator.check_paged:  # and the prefill form, for rows short of pages
        logits = e.runner.check_decode(z[:, :k1], zr,
                                          np.zeros((rows, e.max_pages), np.int32))
      for w in e.table_buckets:
        logits = e.runner.check_prefill(z, zr, zr, np.zeros((rows, w), np.int32), width=k1)
      arrays = sampling.pack([], [], [], [], rows)
      allow = np.full((rows, k1, sampling.mask_words(e.runner.vocab_size)), -1, np.int32)
      for greedy_only, lp, penalized, guided in itertools.product((True, False), repeat=4):
        if guided and not penalized:  # (a structured request's slot state: penalized)
          continue
        sampling.verify_jit(logits, z[:, :k1], zr, arrays, e._counts, e._slot_tokens,
                            allow if guided else None, greedy_only=greedy_only, logprobs=lp,
                            penalized=penalized)
      e._counts = sampling.add_counts(
          e._counts, np.full((rows,), e.config.max_batch, np.int32), z[:, :k1], zr)
      _warm_sampling(e, logits[:, 0], rows)  # the rows without drafts
      e._last_tok = sampling.set_last(
          e._last_tok, np.full((rows,), e.config.max_batch, np.int32), z[:, 0])
  jax.block_until_ready(e._counts)
  return (len(e.batch_buckets),
          len(e.row_buckets) * len(e.chunk_buckets) * len(prefill_tables)
          + len(e.packed_buckets) * len(packed_tables)
          + len(e.chunk_buckets) * len(chunk_tables) * e.config.prompt_logprobs
          + len(e.speculator.rows) * (len(e.table_buckets) + e.speculator.check_paged) * bool(
              e.config.num_speculative_tokens),
          (len(e._mixed_packed_ns) if e._mixed_packed else
           len(e.row_buckets) * len(e._mixed_chunks)) * len(chunk_tables) * e.mixed)


def _warm_sampling(e, logits, b):
  arrays = sampling.pack([], [], [], [], b)
  for lp in (False, True):
    out = sampling.greedy(logits, arrays, e._counts, e._last_tok, logprobs=lp)
    e._counts, e._last_tok = out[4], out[5]
  out = sampling.sample(logits, arrays, e._counts, e._slot_tokens, e._last_tok)
  e._counts, e._last_tok = out[4], out[5]
  jax.block_until_ready(sampling.take(e._last_tok, np.zeros((b,), np.int32)))
