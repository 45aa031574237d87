"""What a request's tokens become: text, stop strings and events.

The loop hands each request the tokens it read back (``accept``): they end
it at EOS, a stop token, its length, or where its grammar is complete
(serving.engine.guided), and the tokens past that end are dropped. The text
of the tokens accepted in one step is decoded and checked for stop strings
in the next (``flush_deferred``), while the device runs that step; a
request's events leave as ``api.Delta`` (every ``stream_interval`` tokens
after its first) and one ``api.Final`` or ``api.Failed``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from serving.engine import api
from serving.engine.guided import RequestError
from serving.engine.sequence import Seq, State

log = logging.getLogger("serving.engine")


def prompt_logprobs(seq: Seq) -> api.PromptLogprobs:
  """The scored chunks' logprobs in prompt order; a prompt computed again
  after preemption keeps its first scores."""
  k = seq.params.prompt_logprobs
  # (to numpy first: indexing a device array compiles)
  chunks = [(c, n, [np.asarray(x)[0][:n] for x in scores]) for c, n, scores in seq.scores]
  pos = np.concatenate([np.arange(c, c + n) for c, n, _ in chunks] + [np.zeros(0, int)])
  pos, first = np.unique(pos, return_index=True)  # each position's first score
  lp, ids, lps = (np.concatenate([s[i] for _, _, s in chunks] + [np.zeros(shape)])[first]
                  for i, shape in ((0, (0,)), (1, (0, api.MAX_TOP_LOGPROBS)),
                                   (2, (0, api.MAX_TOP_LOGPROBS))))
  return api.PromptLogprobs(token_ids=np.asarray(seq.prompt, np.int32)[pos + 1],
                            logprobs=lp.astype(np.float32), top_ids=ids[:, :k].astype(np.int32),
                            top_logprobs=lps[:, :k].astype(np.float32))


class Outputs:
  """Accepted tokens on their way to the clients. It holds the engine for
  its requests by id (which a final event removes), its observer and the
  schedule that ended requests leave."""

  def __init__(self, engine):
    self.engine = engine
    # (seq, tokens, logprobs, silent, finish reason, first index): accepted
    # last step, not yet sent.
    self.deferred: list = []

  def accept(self, seq: Seq, tokens: list[int], lps: list | None) -> None:
    """Records a request's tokens read back from one call (several with
    decode_steps > 1); ends it at EOS, a stop token or its length, dropping
    the tokens after that end."""
    e = self.engine
    if seq.first_token_at is None:
      seq.first_token_at = time.monotonic()
    p = seq.params
    # It reaches its length (max_tokens, or the cache's capacity) at token `room`.
    room = min(seq.max_tokens - len(seq.generated), e.capacity - seq.num_tokens)
    n = min(len(tokens), room)
    reason = api.FinishReason.LENGTH if n == room else None
    silent = False  # the last token ended it and has no text
    if seq.ends and not seq.ends.isdisjoint(tokens[:n]):
      n = next(k for k in range(n) if tokens[k] in seq.ends) + 1
      is_eos = tokens[n - 1] in e.eos_ids and not p.ignore_eos
      reason = api.FinishReason.EOS if is_eos else api.FinishReason.STOP
      # A stop token's text is kept with include_stop_str_in_output (vLLM's
      # way; EOS, a special token, has none either way).
      silent = is_eos or not p.include_stop_str_in_output
      if not is_eos:
        seq.stop_token = tokens[n - 1]
    ids = tokens[:n]
    if seq.guide is not None:
      try:
        reason = e.guided.follow(seq, ids, reason)
        if reason is None and e.config.jump_forward:
          forced = e.guided.jump_forward(seq, len(ids))
          ids = ids + forced
          if forced and seq.guide.stopped:  # they complete the output
            reason = api.FinishReason.STOP
      except RequestError as err:
        self.fail(seq, str(err), err.invalid)
        return
    self.deferred.append((seq, ids, None if lps is None else lps[:n], silent, reason,
                          len(seq.generated)))
    seq.generated.extend(ids)
    if reason is not None:
      e.scheduler.release(seq)

  def flush_deferred(self) -> bool:
    """Text, stop strings and events of the tokens accepted last step: each
    request's tokens of a call leave in one Delta."""
    items, self.deferred = self.deferred, []
    for item in items:
      if not item[0].final_sent:
        self._flush_seq(*item)
    return bool(items)

  def _flush_seq(self, seq: Seq, ids: list[int], lps, silent: bool, reason,
                 first: int) -> None:
    """One request's tokens accepted from one call (``accept``'s record);
    ``first`` is the index of ids[0] in the request's output."""
    e = self.engine
    p = seq.params
    n = len(ids) - silent  # the tokens with text
    # A stop string ends the request at the token that completes it: with stop
    # strings the text is pushed token by token, else in one go.
    cuts = range(1, n + 1) if p.stop and n else (n,)
    done = 0
    for cut in cuts:
      # No stop string ends the output before its min_tokens-th token.
      text = seq.text.push(ids[done:cut], skip=cut == done, stops=first + cut >= p.min_tokens)
      done = cut
      if text:
        seq.out_text.append(text)
      if seq.text.stopped:
        # A token of this request may be in flight already: it is dropped on return.
        reason = api.FinishReason.STOP
        e.scheduler.release(seq)
        # Tokens after the one that completed the stop string (the rest of a
        # multi-step or speculative call) are not output: nor are they counted.
        del seq.generated[first + cut:]
        break
    seq.out_ids.extend(ids[:done])
    if lps is not None and (p.logprobs or p.top_logprobs):
      for token, (chosen, top_ids, top_lp) in zip(ids[:done], lps):
        top = tuple((int(top_ids[k]), float(top_lp[k])) for k in range(p.top_logprobs))
        seq.out_lps.append(api.TokenLogprob(token, float(chosen), top))
    if reason is not None:
      tail = seq.text.flush()  # the text held back for stop strings ('' after one)
      if tail:
        seq.out_text.append(tail)
      if seq.text.stopped:  # (a stop string in text the flush decoded)
        reason = api.FinishReason.STOP
      self._send_final(seq, reason)  # sends what is buffered first
    elif seq.events_sent == 0 or len(seq.out_ids) >= e.config.stream_interval:
      self._send_delta(seq)

  def _send_delta(self, seq: Seq) -> None:
    """Hands the buffered tokens, text and logprobs to the client as one Delta."""
    if seq.out_ids or seq.out_text:
      seq.handle.events.put(api.Delta(tuple(seq.out_ids), "".join(seq.out_text),
                                      tuple(seq.out_lps)))
      seq.events_sent += 1
      seq.out_ids, seq.out_text, seq.out_lps = [], [], []

  def fail(self, seq: Seq, message: str, invalid: bool = False) -> None:
    """Ends one request with an error (``api.Failed``), never a normal finish:
    its tokens not sent yet are dropped, its pages freed; the others run on."""
    e = self.engine
    if seq.final_sent:
      return
    log.warning("request %s failed: %s", seq.req.request_id, message)
    e.scheduler.release(seq)
    seq.final_sent = True
    failed = api.Failed(message, invalid=invalid)
    with e._lock:
      e._by_id.pop(seq.req.request_id, None)
    # Counted before the client hears of it: its next /metrics read sees it.
    on_failed = getattr(e.observer, "on_failed", None)
    if on_failed is not None:
      on_failed(failed)
    seq.handle.events.put(failed)

  def finish(self, seq: Seq, reason: api.FinishReason) -> None:
    """Ends a request now (cancel, deadline): its pending tokens are not sent."""
    if seq.state == State.DONE:
      return
    self.engine.scheduler.release(seq)
    self._send_final(seq, reason)

  def _send_final(self, seq: Seq, reason: api.FinishReason) -> None:
    e = self.engine
    self._send_delta(seq)  # nothing accepted is lost, whatever the interval
    seq.final_sent = True
    now = time.monotonic()
    t0 = seq.handle.submitted
    final = api.Final(
        reason=reason, prompt_tokens=len(seq.prompt), completion_tokens=len(seq.generated),
        cached_prompt_tokens=seq.cached_tokens,
        queue_s=(seq.scheduled_at or now) - t0,
        first_token_s=(seq.first_token_at - t0) if seq.first_token_at else 0.0,
        total_s=now - t0, prompt_logprobs=prompt_logprobs(seq) if seq.scored else (),
        stop_reason=((seq.text.stop_string or seq.stop_token)
                     if reason == api.FinishReason.STOP else None))
    with e._lock:
      e._by_id.pop(seq.req.request_id, None)
    if e.observer is not None:  # (counted before the client hears of it, as above)
      e.observer.on_final(final)
    seq.handle.events.put(final)
