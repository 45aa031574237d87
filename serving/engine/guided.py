"""Structured outputs in the engine: the grammar state of running requests.

A request with structured outputs (``SamplingParams.structured``) decodes one
step a call, and the step after one of its tokens reads that token back
before dispatching: its grammar (serving.engine.structured) follows the
token (``follow``), and its allowed set for the next token goes into its
slot's allow bitmask first (``write_allow_rows``). It ends (STOP) when the
grammar is complete.

With ``EngineConfig.jump_forward``, the tokens the grammar forces next are
taken without sampling (``jump_forward``) and computed as a prompt chunk.
Under speculation a structured request drafts only what its grammar admits
(``guided_drafts``), and each position is checked under the grammar's
allowed set after the drafts before it.
"""

from __future__ import annotations

import numpy as np

from serving.engine import api, sampling, structured
from serving.engine.scheduler import bucket
from serving.engine.sequence import Seq, State


class RequestError(Exception):
  """One request cannot go on (its grammar failed): it ends with api.Failed."""

  def __init__(self, message: str, invalid: bool = False):
    super().__init__(message)
    self.invalid = invalid


def grammar_error(seq: Seq, guide) -> RequestError:
  """The error that ends a structured request whose grammar refused a token
  its own allowed set admitted: a limit of llguidance's (a lexer too complex
  for the grammar, INVALID_ARGUMENT: the client's grammar), else our bug."""
  first = (guide.error.strip().splitlines() or ["the grammar refused a token"])[0]
  limit = any(w in first.lower() for w in ("lexer error", "too many", "too complex", "limit"))
  return RequestError(f"structured output failed after {len(seq.generated)} tokens: {first}",
                      invalid=limit)


def guided_drafts(seq: Seq, d: list[int]) -> tuple[list[int], np.ndarray]:
  """A structured request's drafts cut at the first its grammar refuses or
  that would complete the output (that one is sampled, as a decode step
  would), and the grammar's allow words at each position [kept + 1, W]:
  now, then after each kept draft. The grammar is left where it was."""
  g = seq.guide
  words, taken = [g.words()], 0
  for t in d:
    # Offered only where the mask admits it: a refused token would leave
    # the matcher in its error state (which no rollback leaves).
    if not (words[-1][t >> 5] >> (t & 31)) & 1:
      break
    if not g.accept([t]):
      raise grammar_error(seq, g)
    taken += 1
    if g.stopped:
      break
    words.append(g.words())
  g.rollback(taken)
  return d[:len(words) - 1], np.stack(words)


def _admits_a_token(words: np.ndarray, allowed_ids) -> bool:
  """Whether an allow row (``Guide.words``) admits a token, of ``allowed_ids`` if any."""
  if not allowed_ids:
    return bool(words.any())
  ids = np.asarray(allowed_ids)
  return bool(((words[ids >> 5] >> (ids & 31)) & 1).any())


class Guided:
  """The engine's grammars and the structured requests whose allow rows are
  due. It holds the engine for its KV pages and its slots' device state."""

  def __init__(self, engine):
    self.engine = engine
    self.grammars = structured.Grammars(engine.runner.tokenizer, engine.runner.vocab_size)
    self.due: list[Seq] = []  # structured requests whose allow rows are due
    self.jump_forward_tokens = 0  # tokens structured outputs took without sampling

  def follow(self, seq: Seq, ids: list[int], reason):
    """Moves a structured request's grammar past its new tokens: it ends
    (STOP) where the grammar is complete, else its slot's allow row is due
    (``write_allow_rows``). Returns the finish reason."""
    g = seq.guide
    if not g.accept(ids):  # cannot happen while the allow row holds: a limit, or a bug
      raise grammar_error(seq, g)
    if g.stopped:
      return reason or api.FinishReason.STOP
    if reason is None:
      self.due.append(seq)
    return reason

  def jump_forward(self, seq: Seq, n_new: int) -> list[int]:
    """The tokens the grammar forces after the request's ``n_new`` new ones:
    accepted without sampling, the request back in PREFILL so that its next
    call computes them as a chunk (and samples the token after them). Not for
    requests whose sampling state follows each sampled token (penalties'
    counts, logprobs) or that score their prompt."""
    p = seq.params
    if (p.penalized or p.logprobs or p.top_logprobs or seq.scored
        or seq.state != State.DECODE):
      return []
    total = seq.num_tokens + n_new
    # Room for the forced tokens and the sampled one after them.
    room = min(seq.max_tokens - len(seq.generated) - n_new, self.engine.capacity - total) - 1
    forced = seq.guide.forced()[:max(room, 0)]
    if not forced or not self.engine.kv.reserve(seq, total + len(forced)):
      return []
    if not seq.guide.accept(forced):  # (the matcher is in its error state now)
      raise grammar_error(seq, seq.guide)
    if not seq.guide.stopped:
      seq.state = State.PREFILL
    self.jump_forward_tokens += len(forced)
    return forced

  def write_allow_rows(self) -> None:
    """Writes the allowed sets of the structured requests that took tokens
    into their slots' allow rows: one bitmask fill, one transfer and one
    device update for all (rows padded to a batch bucket)."""
    e = self.engine
    # (a request that jumped forward is in PREFILL, its slot still held)
    seqs = [s for s in self.due if s.state in (State.DECODE, State.PREFILL)]
    self.due = []
    if not seqs:
      return
    b = bucket(len(seqs), e.batch_buckets)
    words = np.full((b, sampling.mask_words(e.runner.vocab_size)), -1, np.int32)
    self.grammars.fill([s.guide for s in seqs], words)
    slots = np.full((b,), e.config.max_batch, np.int32)  # out of range: dropped
    for i, s in enumerate(seqs):
      if _admits_a_token(words[i], s.params.allowed_token_ids):
        slots[i] = s.slot
      else:  # (the client's constraints contradict: INVALID_ARGUMENT, not our error)
        e.outputs.fail(s, f"structured output: after {len(s.generated)} tokens the grammar "
                       + ("and allowed_token_ids admit" if s.params.allowed_token_ids
                          else "admits") + " no next token", invalid=True)
    e._slot_tokens = sampling.set_allow(e._slot_tokens, slots, words)
