"""Per-request sampling on the device, one row per sequence of the batch.

``sample(logits[B, V], SamplingArrays, counts, SlotTokens)`` applies, per
row: the request's logit bias, its allowed set (allowed_token_ids, and a
structured output's grammar as a bitmask the engine sets each step), repetition penalty (over prompt and generated
tokens), presence and frequency penalties (generated tokens), the ban on the
request's end tokens (EOS and stop token ids) while it has fewer than
min_tokens, temperature, top-k, top-p and min-p, then draws with a key derived
from (seed, number of tokens generated so far), so a seeded request samples
the same tokens whatever else shares its batch. Rows with
temperature 0 take the argmax. It returns the token, its logprob and the
``MAX_TOP_LOGPROBS`` best alternatives (from the penalized distribution at
temperature 1), the generated-token counts updated with the new tokens, and
``last`` (the last token of each batch slot, kept on the device so the next
decode step can start before the host has read this one's tokens).

``greedy`` is the fast path when no row of the step samples, penalizes,
biases or bans: argmax (and logprobs if asked), no sort over the vocabulary. ``step`` is one
of several decode steps run in one device call (EngineConfig.decode_steps).
``verify`` reads a speculative checking call's logits: which drafts each row
keeps (those equal to what a decode step would draw there) and its next token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.api import MAX_TOP_LOGPROBS, SamplingParams


F_COLS, I_COLS = 6, 6


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
  """Per-row parameters in one int32 array, so a call moves one buffer to the
  device (each host array is a transfer of its own: 0.3-0.6 ms of the
  dispatching thread on the H200, bench/results/decode_merge_pack_h200/)."""

  # [B, I_COLS + F_COLS]: ints top_k (0 = off), seed hi, seed lo (bits), step,
  # slot (-1 = pad), min_tokens; then the bits of the floats temperature,
  # top_p, min_p, repetition, presence, frequency.
  rows: jax.Array

  @property
  def i(self):
    return self.rows[:, :I_COLS]

  @property
  def f(self):
    bits = self.rows[:, I_COLS:]
    if isinstance(bits, np.ndarray):
      return bits.view(np.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)

  temperature = property(lambda self: self.f[:, 0])
  top_p = property(lambda self: self.f[:, 1])
  min_p = property(lambda self: self.f[:, 2])
  repetition = property(lambda self: self.f[:, 3])
  presence = property(lambda self: self.f[:, 4])
  frequency = property(lambda self: self.f[:, 5])
  top_k = property(lambda self: self.i[:, 0])
  seed = property(lambda self: self.i[:, 1:3])  # hi, lo
  step = property(lambda self: self.i[:, 3])
  slot = property(lambda self: self.i[:, 4])
  min_tokens = property(lambda self: self.i[:, 5])


def _arrays(f: np.ndarray, i: np.ndarray) -> SamplingArrays:
  # Seed halves keep their 32 bits through int32 (two's complement).
  return SamplingArrays(rows=np.concatenate(
      [i.astype(np.uint32).view(np.int32), np.asarray(f, np.float32).view(np.int32)], axis=1))


_PAD_F = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)
# Bits of SlotTokens.flags: the token is in the prompt (repetition penalty);
# the token ends the request (EOS unless ignored, a stop token id), so it is
# banned while step < min_tokens.
IN_PROMPT, ENDS = 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotTokens:
  """Per batch slot, over the vocabulary, set at a request's admission (only
  for requests that need it: penalties, min_tokens, logit_bias,
  allowed_token_ids, structured outputs)."""

  flags: jax.Array  # [slots, V] uint8: IN_PROMPT | ENDS
  # [slots, V] float32: the request's logit_bias, 0 elsewhere; -inf on the
  # ids outside its allowed_token_ids.
  bias: jax.Array
  # [slots, mask_words(V)] int32: bit t % 32 of word t // 32 is set where token
  # t may come next; a structured output's grammar clears the others each
  # step (16 KB a row for 128K tokens, against 512 KB as a float row).
  allow: jax.Array


def mask_words(vocab: int) -> int:
  return -(-vocab // 32)


def slot_tokens(slots: int, vocab: int) -> SlotTokens:
  return SlotTokens(flags=jnp.zeros((slots, vocab), jnp.uint8),
                    bias=jnp.zeros((slots, vocab), jnp.float32),
                    allow=jnp.full((slots, mask_words(vocab)), -1, jnp.int32))


def slot_row(vocab: int, prompt=(), ends=(), logit_bias=(), allowed=(),
             allow: np.ndarray | None = None) -> SlotTokens:
  """One slot's SlotTokens row (numpy [V] each; ``allow`` [mask_words(V)],
  every bit set when None)."""
  flags = np.zeros(vocab, np.uint8)
  flags[np.asarray(prompt, np.int64)] |= IN_PROMPT
  flags[np.asarray(sorted(ends), np.int64)] |= ENDS
  bias = np.zeros(vocab, np.float32)
  if len(allowed):
    bias[:] = -np.inf
    bias[np.asarray(allowed, np.int64)] = 0.0
  for t, b in logit_bias:
    bias[t] = b
  if allow is None:
    allow = np.full(mask_words(vocab), -1, np.int32)
  return SlotTokens(flags=flags, bias=bias, allow=allow)


def param_rows(p: SamplingParams, seed: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
  """One request's rows of ``SamplingArrays.f`` and ``.i`` (its step column 0)."""
  f = np.asarray((p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
                  p.frequency_penalty), np.float32)
  i = np.asarray((p.top_k, seed >> 32, seed & 0xFFFFFFFF, 0, slot, p.min_tokens), np.int64)
  return f, i


def gather(f_rows: np.ndarray, i_rows: np.ndarray, rows: np.ndarray, steps: np.ndarray,
           batch: int) -> SamplingArrays:
  """Arrays for ``batch`` rows: row ``rows[j]`` takes ``f_rows[j]``, ``i_rows[j]``;
  the others are padding."""
  f = np.tile(np.asarray(_PAD_F, np.float32), (batch, 1))
  i = np.zeros((batch, I_COLS), np.int64)
  i[:, 4] = -1
  f[rows] = f_rows
  i[rows] = i_rows
  i[rows, 3] = steps
  return _arrays(f, i)


def pack(params: list[SamplingParams | None], seeds: list[int], steps: list[int],
         slots: list[int], batch: int) -> SamplingArrays:
  """Host-side arrays for ``batch`` rows (rows past ``len(params)`` are padding)."""
  f = np.tile(np.asarray(_PAD_F, np.float32), (batch, 1))
  i = np.zeros((batch, I_COLS), np.int64)
  i[:, 4] = -1
  for r, p in enumerate(params):
    if p is not None:
      f[r] = (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty)
      i[r, 0], i[r, 5] = p.top_k, p.min_tokens
  n = len(params)
  s = np.asarray(seeds, np.uint64)
  i[:n, 1] = (s >> np.uint64(32)).astype(np.int64)
  i[:n, 2] = (s & np.uint64(0xFFFFFFFF)).astype(np.int64)
  i[:n, 3] = steps
  i[:n, 4] = slots
  return _arrays(f, i)


def _update(counts, last, slot, tokens):
  # Padding rows (slot -1) land out of bounds and are dropped.
  rows = jnp.where(slot < 0, counts.shape[0], slot)
  counts = counts.at[rows, tokens].add(1, mode="drop")
  if last is not None:
    last = last.at[rows].set(tokens, mode="drop")
  return counts, last


def _logprobs(logits, tokens):
  lp = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
  k = min(MAX_TOP_LOGPROBS, lp.shape[-1])  # (a vocabulary smaller than that: a test model's)
  top_lp, top_ids = jax.lax.top_k(lp, k)
  if k < MAX_TOP_LOGPROBS:  # one shape for the host; intake refuses asking past the vocabulary
    pad = ((0, 0), (0, MAX_TOP_LOGPROBS - k))
    top_lp, top_ids = jnp.pad(top_lp, pad, constant_values=-jnp.inf), jnp.pad(top_ids, pad)
  return chosen, top_ids, top_lp


def prompt_scores(logits, targets):
  """logits [B, T, V] at every prompt position, targets [B, T] (the next
  prompt token) -> (the targets' logprobs [B, T], the MAX_TOP_LOGPROBS
  likeliest ids [B, T, K] and their logprobs): the model's own distribution,
  no sampling parameters applied (vLLM's prompt_logprobs)."""
  b, t, v = logits.shape
  out = _logprobs(logits.reshape(b * t, v).astype(jnp.float32), targets.reshape(b * t))
  return tuple(x.reshape(b, t, *x.shape[1:]) for x in out)


def _greedy(logits, s: SamplingArrays, counts, last=None, *, logprobs: bool = True):
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not logprobs:  # nothing but the ids leaves the device
    return (tokens, None, None, None) + _update(counts, last, s.slot, tokens)
  chosen, top_ids, top_lp = _logprobs(logits.astype(jnp.float32), tokens)
  return (tokens, chosen, top_ids, top_lp) + _update(counts, last, s.slot, tokens)


def _allowed(words, vocab: int):
  """[B, W] int32 bitmask words -> [B, vocab] bool."""
  bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


def _penalize(logits, s, counts, tok: SlotTokens):
  return _penalize_rows(logits, s, counts[jnp.maximum(s.slot, 0)], tok)


def _penalize_rows(logits, s, c, tok: SlotTokens, allow=None):
  """_penalize with each row's generated-token counts ``c`` [B, V] given (and
  its allow words [B, W], else its slot's)."""
  rows = jnp.maximum(s.slot, 0)
  f = tok.flags[rows]  # [B, V]
  allow = tok.allow[rows] if allow is None else allow
  logits = jnp.where(_allowed(allow, logits.shape[-1]), logits + tok.bias[rows], -jnp.inf)
  seen = ((f & IN_PROMPT) != 0) | (c > 0)
  rep = s.repetition[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  logits = logits - s.presence[:, None] * (c > 0) - s.frequency[:, None] * c
  held = ((f & ENDS) != 0) & (s.step < s.min_tokens)[:, None]
  return jnp.where(held, -jnp.inf, logits)


def _cut(logits, s: SamplingArrays):
  """Penalized logits [B, V] -> (order [B, V], descending; the sorted logits
  over the temperature with the top-k / top-p / min-p cuts at -inf)."""
  vocab = logits.shape[-1]
  t = jnp.maximum(s.temperature, 1e-6)[:, None]
  order = jnp.argsort(-logits, axis=-1)
  sl = jnp.take_along_axis(logits, order, axis=-1) / t  # descending
  probs = jax.nn.softmax(sl, axis=-1)
  rank = jnp.arange(vocab)[None, :]
  drop = (s.top_k[:, None] > 0) & (rank >= s.top_k[:, None])
  drop |= (jnp.cumsum(probs, axis=-1) - probs) >= s.top_p[:, None]
  drop |= probs < s.min_p[:, None] * probs[:, :1]
  drop &= rank > 0  # the best token always survives
  return order, jnp.where(drop, -jnp.inf, sl)


def _key(seed, step):
  """The draw's key of a row: (seed hi, seed lo) int32 bits, its step."""
  seed = jax.lax.bitcast_convert_type(seed, jnp.uint32)
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)


def _draw(logits, s: SamplingArrays):
  """Penalized logits [B, V] -> each row's draw from its cut distribution,
  keyed by (seed, step): the same logits and step give the same token."""
  order, sl = _cut(logits, s)
  pick = jax.vmap(lambda seed, step, row: jax.random.categorical(_key(seed, step), row))(
      s.seed, s.step, sl)
  return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample(logits, s: SamplingArrays, counts, tok: SlotTokens, last=None):
  logits = _penalize(logits.astype(jnp.float32), s, counts, tok)
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  tokens = jnp.where(s.temperature > 0, _draw(logits, s), argmax)
  chosen, top_ids, top_lp = _logprobs(logits, tokens)
  return (tokens, chosen, top_ids, top_lp) + _update(counts, last, s.slot, tokens)


def verify(logits, tokens, lengths, s: SamplingArrays, counts=None, tok: SlotTokens | None = None,
           allow=None, *, greedy_only: bool, logprobs: bool = False, penalized: bool = False):
  """Which drafted tokens a checking call's rows keep.

  logits [B, T, V] after each of a row's tokens [B, T] = [its last token,
  drafts...], ``lengths`` [B] = 1 + its number of drafts, ``s`` its sampling
  rows -> (accepted [B]: how many leading drafts are kept, token [B]: the
  one that follows them), and with ``logprobs`` the logprob and
  MAX_TOP_LOGPROBS best alternatives of each position's token (the kept
  drafts', then that one's), each [B, T, ...], as a decode step reports them.

  With ``penalized`` each position's logits first take the row's slot state
  (``counts`` [slots, V], ``tok``) as a decode step there would: logit bias
  and allowed ids, penalties over the generated tokens counted with the
  drafts before that position, the end-token ban while its step is under
  min_tokens; and ``allow`` [B, T, W], if given, holds each position's allow
  words in place of the slot's (a grammar's allowed set changes with each
  draft before the position).

  Each position draws its token as a decode step at that step would: the
  same cut distribution, the same key (seed, step + j), the same draw. A
  row keeps its drafts while they equal those draws and takes the draw at
  the first that differs (or after the last). Its tokens are therefore the
  ones decoding without drafts draws, a seeded request's exactly; a draft
  is kept with probability p_j(draft), as speculative sampling (Leviathan
  et al. 2023) keeps a one-hot proposal, and a refused one's position
  yields p_j's draw given that it is not the draft, the residual. A greedy
  row keeps drafts equal to the argmax and takes the argmax after them.
  """
  b, t, v = logits.shape
  x = logits.astype(jnp.float32)
  drafts = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
  ndraft = jnp.maximum(lengths - 1, 0)
  col = jnp.arange(t)[None, :]
  # Every (row, position) as one row of sampling arrays: position j is step + j.
  rows = jnp.repeat(s.rows, t, axis=0)
  rows = SamplingArrays(rows=rows.at[:, 3].add(jnp.tile(jnp.arange(t, dtype=jnp.int32), b)))
  if penalized:
    onehot = jax.nn.one_hot(drafts, v, dtype=jnp.int32)  # [B, T, V]
    c = counts[jnp.maximum(s.slot, 0)][:, None] + jnp.cumsum(onehot, axis=1) - onehot
    words = None if allow is None else allow.reshape(b * t, -1)
    x = _penalize_rows(x.reshape(b * t, v), rows, c.reshape(b * t, v), tok,
                       words).reshape(b, t, v)
  best = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [B, T]

  def first_refused(keep):  # [B, T] -> [B]: leading kept drafts
    return jnp.argmin(jnp.where(col < ndraft[:, None], keep, False), axis=1).astype(jnp.int32)

  def out(a, after):
    if not logprobs:
      return a, after
    emitted = jnp.where(col < a[:, None], drafts, after[:, None])
    lp = _logprobs(x.reshape(b * t, v), emitted.reshape(b * t))
    return (a, after) + tuple(y.reshape(b, t, *y.shape[1:]) for y in lp)

  a_greedy = first_refused(drafts == best)
  tok_greedy = jnp.take_along_axis(best, a_greedy[:, None], axis=1)[:, 0]
  if greedy_only:
    return out(a_greedy, tok_greedy)
  drawn = _draw(x.reshape(b * t, v), rows).reshape(b, t)  # each position's decode-step draw
  a = first_refused(drafts == drawn)
  sampled = jnp.take_along_axis(drawn, a[:, None], axis=1)[:, 0]
  hot = s.temperature > 0
  return out(jnp.where(hot, a, a_greedy), jnp.where(hot, sampled, tok_greedy))


greedy = jax.jit(_greedy, donate_argnames=("counts", "last"), static_argnames=("logprobs",))
sample = jax.jit(_sample, donate_argnames=("counts", "last"))
verify_jit = jax.jit(verify, static_argnames=("greedy_only", "logprobs", "penalized"))


@functools.partial(jax.jit, donate_argnames=("counts",))
def add_counts(counts, slots, tokens, n):
  """Counts the first ``n`` [k] of ``tokens`` [k, T] for ``slots`` [k] (the
  tokens a checking call emitted; slots out of range are padding)."""
  k, t = tokens.shape
  rows = jnp.where((slots >= 0) & (slots < counts.shape[0]), slots, counts.shape[0])
  add = (jnp.arange(t)[None, :] < n[:, None]).astype(counts.dtype)
  return counts.at[jnp.repeat(rows, t), tokens.reshape(-1)].add(add.reshape(-1), mode="drop")


def step(logits, s: SamplingArrays, i, counts, tok: SlotTokens, last, *, greedy_only: bool,
         logprobs: bool = True):
  """Step ``i`` of a multi-step decode: ``greedy`` or ``sample`` with every
  row's step counter advanced by ``i`` (a seeded row draws what it would one
  step at a time). Traceable: the runner calls it inside its loop."""
  s = SamplingArrays(rows=s.rows.at[:, 3].add(i))
  if greedy_only:
    return _greedy(logits, s, counts, last, logprobs=logprobs)
  return _sample(logits, s, counts, tok, last)


step_jit = jax.jit(step, donate_argnames=("counts", "last"),
                   static_argnames=("greedy_only", "logprobs"))


@jax.jit
def take(last, slots):
  """The decode step's input tokens: the last token of each row's slot."""
  return last[jnp.maximum(slots, 0)]


@functools.partial(jax.jit, donate_argnames=("counts", "tok"))
def set_rows(counts, tok: SlotTokens, slot, count_row, row: SlotTokens):
  """Initializes one slot's penalty counts and SlotTokens (at admission or
  after preemption)."""
  return counts.at[slot].set(count_row), jax.tree.map(lambda a, r: a.at[slot].set(r), tok, row)


@functools.partial(jax.jit, donate_argnames=("last",))
def set_last(last, slots, tokens):
  """Sets the last token of ``slots`` [k] to ``tokens`` [k] (after tokens
  accepted on the host); slots out of range are padding."""
  return last.at[slots].set(tokens, mode="drop")


@functools.partial(jax.jit, donate_argnames=("tok",))
def set_allow(tok: SlotTokens, slots, words):
  """Sets the allow bitmask rows of ``slots`` [k] to ``words`` [k, W] (the
  grammars' sets for the next step); slots out of range are padding."""
  return dataclasses.replace(tok, allow=tok.allow.at[slots].set(words, mode="drop"))


def reference_logits(logits: np.ndarray, p: SamplingParams, counts: np.ndarray,
                     prompt_mask: np.ndarray, ends=(), step: int = 0) -> np.ndarray:
  """One row's logits after the logit bias, allowed ids, penalties and the
  end-token ban, in numpy float64 (tests)."""
  x = logits.astype(np.float64)
  for t, b in p.logit_bias:
    x[t] += b
  if p.allowed_token_ids:
    x[np.setdiff1d(np.arange(len(x)), p.allowed_token_ids)] = -np.inf
  seen = prompt_mask | (counts > 0)
  r = p.repetition_penalty
  x = np.where(seen, np.where(x > 0, x / r, x * r), x)
  x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
  if step < p.min_tokens:
    x[list(ends)] = -np.inf
  return x


def reference(logits: np.ndarray, p: SamplingParams, counts: np.ndarray,
              prompt_mask: np.ndarray, ends=(), step: int = 0) -> np.ndarray:
  """The allowed set after ``reference_logits`` and the cuts for one row, in
  numpy (tests)."""
  x = reference_logits(logits, p, counts, prompt_mask, ends, step)
  order = np.argsort(-x, kind="stable")
  xs = x[order] / max(p.temperature, 1e-6)
  e = np.exp(xs - xs.max())
  probs = e / e.sum()
  keep = np.ones_like(probs, bool)
  if p.top_k:
    keep[p.top_k:] = False
  keep &= (np.cumsum(probs) - probs) < p.top_p
  keep &= probs >= p.min_p * probs[0]
  keep[0] = True
  allowed = np.zeros(x.shape, bool)
  allowed[order[keep]] = True
  return allowed & (x > -np.inf)
