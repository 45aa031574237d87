"""Per-request sampling on the device, one row per sequence of the batch.

``sample(logits[B, V], SamplingArrays, counts, prompt_mask)`` applies, per row:
repetition penalty (over prompt and generated tokens), presence and frequency
penalties (generated tokens), temperature, top-k, top-p and min-p, then draws
with a key derived from (seed, number of tokens generated so far), so a seeded
request samples the same tokens whatever else shares its batch. Rows with
temperature 0 take the argmax. It returns the token, its logprob and the
``MAX_TOP_LOGPROBS`` best alternatives (from the penalized distribution at
temperature 1), and the generated-token counts updated with the new tokens.

``greedy`` is the fast path when no row of the step samples or penalizes:
argmax and logprobs only, no sort over the vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.api import MAX_TOP_LOGPROBS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
  temperature: jax.Array  # [B] f32
  top_k: jax.Array  # [B] i32, 0 = off
  top_p: jax.Array  # [B] f32
  min_p: jax.Array  # [B] f32
  repetition: jax.Array  # [B] f32
  presence: jax.Array  # [B] f32
  frequency: jax.Array  # [B] f32
  seed: jax.Array  # [B, 2] u32 (hi, lo)
  step: jax.Array  # [B] i32, tokens generated so far
  slot: jax.Array  # [B] i32, row of counts / prompt_mask; -1 = padding row


def pack(params: list[SamplingParams | None], seeds: list[int], steps: list[int],
         slots: list[int], batch: int) -> SamplingArrays:
  """Host-side arrays for ``batch`` rows (rows past ``len(params)`` are padding)."""
  n = len(params)
  def col(f, default, dtype):
    a = np.full((batch,), default, dtype)
    a[:n] = [f(p) if p is not None else default for p in params]
    return a
  seed = np.zeros((batch, 2), np.uint32)
  s = np.asarray(seeds, np.uint64)
  seed[:n, 0] = (s >> np.uint64(32)).astype(np.uint32)
  seed[:n, 1] = (s & np.uint64(0xFFFFFFFF)).astype(np.uint32)
  slot = np.full((batch,), -1, np.int32)
  slot[:n] = slots
  step = np.zeros((batch,), np.int32)
  step[:n] = steps
  return SamplingArrays(
      temperature=col(lambda p: p.temperature, 0.0, np.float32),
      top_k=col(lambda p: p.top_k, 0, np.int32),
      top_p=col(lambda p: p.top_p, 1.0, np.float32),
      min_p=col(lambda p: p.min_p, 0.0, np.float32),
      repetition=col(lambda p: p.repetition_penalty, 1.0, np.float32),
      presence=col(lambda p: p.presence_penalty, 0.0, np.float32),
      frequency=col(lambda p: p.frequency_penalty, 0.0, np.float32),
      seed=seed, step=step, slot=slot)


def _update_counts(counts, slot, tokens):
  # Padding rows (slot -1) land out of bounds and are dropped.
  rows = jnp.where(slot < 0, counts.shape[0], slot)
  return counts.at[rows, tokens].add(1, mode="drop")


def _logprobs(logits, tokens):
  lp = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(lp, MAX_TOP_LOGPROBS)
  return chosen, top_ids, top_lp


@functools.partial(jax.jit, donate_argnames=("counts",))
def greedy(logits, s: SamplingArrays, counts):
  logits = logits.astype(jnp.float32)
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  chosen, top_ids, top_lp = _logprobs(logits, tokens)
  return tokens, chosen, top_ids, top_lp, _update_counts(counts, s.slot, tokens)


def _penalize(logits, s, counts, prompt_mask):
  rows = jnp.maximum(s.slot, 0)
  c = counts[rows]  # [B, V]
  seen = prompt_mask[rows] | (c > 0)
  rep = s.repetition[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  return logits - s.presence[:, None] * (c > 0) - s.frequency[:, None] * c


@functools.partial(jax.jit, donate_argnames=("counts",))
def sample(logits, s: SamplingArrays, counts, prompt_mask):
  logits = _penalize(logits.astype(jnp.float32), s, counts, prompt_mask)
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
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
  sl = jnp.where(drop, -jnp.inf, sl)

  def draw(seed, step, row):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)
    return jax.random.categorical(key, row)

  pick = jax.vmap(draw)(s.seed, s.step, sl)
  sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
  tokens = jnp.where(s.temperature > 0, sampled, argmax)
  chosen, top_ids, top_lp = _logprobs(logits, tokens)
  return tokens, chosen, top_ids, top_lp, _update_counts(counts, s.slot, tokens)


@functools.partial(jax.jit, donate_argnames=("counts", "prompt_mask"))
def set_rows(counts, prompt_mask, slot, count_row, mask_row):
  """Initializes one slot's penalty state (at admission or after preemption)."""
  return counts.at[slot].set(count_row), prompt_mask.at[slot].set(mask_row)


def reference(logits: np.ndarray, p: SamplingParams, counts: np.ndarray,
              prompt_mask: np.ndarray) -> np.ndarray:
  """The allowed set after penalties and cuts for one row, in numpy (tests)."""
  x = logits.astype(np.float64)
  seen = prompt_mask | (counts > 0)
  r = p.repetition_penalty
  x = np.where(seen, np.where(x > 0, x / r, x * r), x)
  x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
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
  return allowed
