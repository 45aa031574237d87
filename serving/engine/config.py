"""The engine's settings (``EngineConfig``): batch and chunk sizes, the token
budget, scheduling policy and the optional step kinds (mixed, packed,
multi-step, speculative, jump-forward). Every field is checked where the
config is made, so a bad value fails with its name before a model loads."""

from __future__ import annotations

import dataclasses
import os


SCHEDULING = ("fcfs", "priority")


def auto_compile_threads() -> int:
  """The entry points' default for EngineConfig.compile_threads: one per core
  up to 8. With 8 on the H200 host the 8B warm-up took 68-111 s against
  91-241 s on one thread, and no step compiled after it
  (bench/results/serving_h200/threads_rounds_mixed_prefix/)."""
  return max(1, min(8, os.cpu_count() or 1))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_batch: int = 64  # requests decoding together
  # Bounded queue: the engine holds at most max_batch + max_waiting requests
  # (running or waiting); a call that would take it past that is refused
  # (QueueFull), one that never fits (n completions over it) is InvalidRequest.
  max_waiting: int = 256
  max_seq_len: int | None = None  # default: the model's context
  prefill_chunk: int = 512  # largest prompt chunk per request and step
  min_chunk: int = 16
  prefill_rows: int = 4  # prompts prefilled together in one call
  token_budget: int | None = None  # tokens per step; default max_batch + prefill_chunk
  default_max_tokens: int = 256
  prefix_caching: bool = True
  warmup: bool = True
  batch_buckets: tuple[int, ...] | None = None  # default: powers of 2 up to max_batch
  # Warm-up also compiles prefill of continued chunks (a prefix in the cache);
  # without them the first continued chunk or prefix-cache hit compiles then.
  warmup_continued: bool = True
  # Decode steps per dispatch while no prompt is waiting: the device samples
  # each step's token and feeds it to the next; the host dispatches and reads
  # once per ``decode_steps`` tokens. Tokens past a request's end (EOS, stop,
  # max_tokens) are dropped. Seeded sampling draws what it would step by step.
  decode_steps: int = 1
  # Tokens per streamed event after a request's first (which goes out at
  # once); the last event carries whatever is left. Larger values mean fewer,
  # larger messages: less Python per token when many streams share the
  # interpreter (the --stream-interval of vLLM and SGLang). The tokens a step
  # reads back for a request (decode_steps of them) go out in one event.
  stream_interval: int = 1
  # A step with both decodes and prefill chunks runs them as one device call
  # (the runner's ``mixed``): the chunk's tokens share the decode batch's pass
  # over the weights. Its decode rows are padded to max_batch (a few more rows
  # cost little next to the chunk) so that warm-up compiles one mixed shape
  # per chunk shape, not per batch bucket too.
  mixed_steps: bool = False
  # Prompt tokens per step while requests decode (default: what token_budget
  # leaves). A small value prefills prompts a little each step, so decoding
  # requests are not held up by long prefills (a steadier inter-token
  # latency). It is not free: on the H200 a Llama-3-8B mixed step of 64
  # decode rows and a 128-token chunk takes 8.0 ms, against 6.3 ms for the
  # decode step alone. At c=64 this ties separate calls in throughput, with a
  # lower median TTFT and tail ITL but a higher median ITL and tail TTFT
  # (bench/results/serving_h200/mixed_trimmed_tables/).
  decode_prefill_budget: int | None = None
  # A step that has prompt chunks to prefill runs them alone; the requests
  # already decoding wait (their pages stay reserved), as SGLang's scheduler
  # does by default. A burst of prompts then starts decoding together after
  # the shortest prefill phase, instead of every prefill call also carrying a
  # one-step decode: more tokens/s when prompts arrive together, at the cost
  # of inter-token gaps as long as the prefill phase for requests already
  # decoding (a long prompt's chunks hold them all up).
  prefill_first: bool = False
  # A step's prompt chunks go to the device packed in one row, each causal
  # within itself (the runner's ``prefill_packed``), instead of one row each
  # padded to the longest one's chunk bucket: ragged prompts cost their own
  # tokens (3 prompts of 700 tokens: 2,112 tokens, not 4 x 2,048, nor
  # 2 x 4 x 512 when the rows cut them at the bucket below). A step
  # that continues a prompt (a cached prefix, or the rest of a prompt split
  # by the budget) also gathers its rows' pages for attention; a mixed step's
  # chunks are packed too where the runner has a packed mixed step. None:
  # packed wherever the runner can (its prefill attention takes segment
  # ids); True: packed or an error; False: rows.
  # Measured on an H100, 8B shapes, c=64: the same tokens/s on 512-token
  # prompts, 10.8% more on 256-768-token ones
  # (bench/results/serving_h100/prefill_layouts/).
  packed_prefill: bool | None = None
  # Threads that compile the warm-up's shapes side by side (1: each shape
  # compiles as it first runs). 8 took the 8B ragged packed warm-up from 241 s
  # to 111 s on the H200 host (bench/results/serving_h200/transfers_and_threads/);
  # the entry points default to auto_compile_threads().
  compile_threads: int = 1
  # "fcfs": requests are admitted in arrival order and the latest admitted is
  # preempted first. "priority": by Request.priority (lower first), then
  # arrival, both ways (vLLM's --scheduling-policy); a running request is not
  # preempted to admit a more urgent one.
  scheduling: str = "fcfs"
  # Requests may ask for their prompt's logprobs (SamplingParams.prompt_logprobs).
  # Their prompt chunks run as calls of their own that keep every position's
  # logits (a [T, vocab] float32 block a chunk: 1 GB for a 2,048-token chunk
  # of a 128K vocabulary), never from the prefix cache; warm-up compiles
  # those calls' shapes too, so it is off unless asked for.
  prompt_logprobs: bool = False
  # Structured outputs take the tokens their grammar forces (a JSON schema's
  # keys and punctuation) without sampling them: appended at once, they are
  # computed as a prompt chunk whose last position samples the next token
  # (SGLang's jump-forward). Fewer steps; the forced bytes' tokens are the
  # tokenizer's, where the model might have spelled them otherwise.
  jump_forward: bool = False
  # N-gram (prompt lookup) speculative decoding, vLLM's "ngram" method. With
  # num_speculative_tokens = k > 0, an iteration whose running requests (at
  # most speculative_max_batch, nothing waiting) all decode
  # drafts up to k tokens for each one: what followed the latest earlier
  # occurrence of its last n tokens (n from prompt_lookup_max down to
  # prompt_lookup_min), in its prompt or output. One call over [last token,
  # drafts] checks them (sampling.verify), a decode step of k + 1 query
  # tokens a row where k + 1 <= 8 (attention reads the pages in place), else a
  # continued prefill over gathered pages: a request takes the drafts the
  # model keeps and one token of its own, up to k + 1 tokens a call. Its
  # output is what decoding without drafts gives: greedy, the argmax's;
  # sampled, each position's draw with the key and the penalties, bias and
  # min_tokens a decode step there would use (and a structured request's
  # grammar: its drafts stop at the first it refuses, or at one that would
  # complete the output, which is sampled). The other requests take one
  # token from the same call, sampled as usual. Those iterations read their
  # tokens back before the next is dispatched (the next drafts need them);
  # warm-up compiles the checking call's shapes too.
  num_speculative_tokens: int = 0
  prompt_lookup_max: int = 3
  prompt_lookup_min: int = 1
  speculative_max_batch: int = 4
  # A request that gains nothing from this many checks in a row (no draft
  # found, or none kept) stops drafting for 8 of its tokens, then 16, ... up
  # to 256; a kept draft resets it. Its iterations then pipeline again (open
  # writing keeps few drafts, and a checking call costs about a decode step
  # plus the lost overlap). 0: it never stops.
  speculative_patience: int = 4

  def __post_init__(self):
    v = lambda f: f"EngineConfig.{f}={getattr(self, f)}"  # errors name the field and value
    for f in ("max_batch", "max_waiting", "prefill_chunk", "min_chunk", "prefill_rows",
              "default_max_tokens", "decode_steps", "stream_interval", "compile_threads",
              "prompt_lookup_min", "speculative_max_batch"):
      if getattr(self, f) < 1:
        raise ValueError(f"{v(f)} must be >= 1")
    if self.speculative_patience < 0:
      raise ValueError(f"{v('speculative_patience')} must be >= 0 (0: never pause drafting)")
    if self.num_speculative_tokens < 0:
      raise ValueError(f"{v('num_speculative_tokens')} must be >= 0 (0: no speculation)")
    if self.num_speculative_tokens >= self.prefill_chunk:
      raise ValueError(f"{v('num_speculative_tokens')} must be < {v('prefill_chunk')} "
                       "(the last token and the drafts are checked as one chunk)")
    if self.prompt_lookup_max < self.prompt_lookup_min:
      raise ValueError(f"{v('prompt_lookup_max')} must be >= {v('prompt_lookup_min')}")
    if self.max_seq_len is not None and self.max_seq_len < 1:
      raise ValueError(f"{v('max_seq_len')} must be >= 1 (None: the model's context)")
    if self.min_chunk > self.prefill_chunk:
      raise ValueError(f"{v('min_chunk')} must be <= {v('prefill_chunk')}")
    if self.token_budget is not None and self.token_budget < self.max_batch:
      # A full decode batch takes one token of the budget per row: below
      # max_batch, waiting prompts would get no tokens while it runs (vLLM
      # refuses max_num_batched_tokens < max_num_seqs for the same reason).
      raise ValueError(f"{v('token_budget')} must be >= {v('max_batch')}")
    if self.decode_prefill_budget is not None and self.decode_prefill_budget < 1:
      raise ValueError(f"{v('decode_prefill_budget')} must be >= 1")
    if self.scheduling not in SCHEDULING:
      raise ValueError(f"{v('scheduling')} must be one of {SCHEDULING}")
    if self.prefill_first and (self.mixed_steps or self.decode_prefill_budget is not None):
      raise ValueError(f"{v('prefill_first')} runs no decodes beside prompt chunks: it cannot "
                       "be combined with EngineConfig.mixed_steps or "
                       "EngineConfig.decode_prefill_budget")

  @property
  def budget(self) -> int:
    return self.token_budget or self.max_batch + self.prefill_chunk
