"""The engine interface the service depends on, and the values it exchanges.

``Engine.submit(Request) -> RequestHandle`` queues a request (or raises
``InvalidRequest`` / ``QueueFull``); the handle's ``events`` queue then yields
``Delta`` events (new token ids, their text, logprobs) and one ``Final``
event. ``Engine.cancel(request_id)`` ends a request within one step; its
pages return to the allocator. ``Engine.drain()`` stops admission of new
requests and waits for the running ones.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
import numbers
import queue
import time
from collections.abc import Mapping, Sequence

import numpy as np

MAX_TOP_LOGPROBS = 20  # (vLLM's default max_logprobs; OpenAI chat's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_ALLOWED_TOKENS = 1 << 17  # allowed_token_ids per request (a vocabulary's worth)
MAX_GRAMMAR_CHARS = 1 << 16  # a structured output's schema, regex or grammar
MAX_CHOICES = 1024


class InvalidRequest(ValueError):
  """A request the engine cannot run as asked (bad parameter, prompt too long).
  ``field``: the SamplingParams field it names, where it names one."""

  def __init__(self, message: str, field: str | None = None):
    super().__init__(message)
    self.field = field

  def __reduce__(self):  # the field survives the pipe of an --engine-process engine
    return type(self), (str(self), self.field)


class QueueFull(RuntimeError):
  """The bounded waiting queue is full; retry later."""


class EngineFailed(RuntimeError):
  """The engine's scheduler stopped after an internal error."""


class Draining(RuntimeError):
  """The engine is shutting down and admits no new requests."""


class FinishReason(enum.IntEnum):
  # Values match serving/proto/generate.proto FinishReason.
  LENGTH = 1
  STOP = 2
  EOS = 3
  CANCELLED = 4
  DEADLINE = 5


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
  """What the output must match (vLLM's structured_outputs); exactly one is set.

  ``json``: a JSON schema (as JSON text); ``json_object``: any JSON object;
  ``regex``: a regular expression (Rust regex syntax); ``choice``: one of
  these strings; ``grammar``: a Lark grammar (llguidance's dialect).
  """

  json: str | None = None
  regex: str | None = None
  choice: tuple[str, ...] = ()
  grammar: str | None = None
  json_object: bool = False

  def __post_init__(self):
    kinds = [k for k in ("json", "regex", "grammar") if getattr(self, k) is not None]
    kinds += [k for k in ("choice", "json_object") if getattr(self, k)]
    if len(kinds) != 1:
      raise InvalidRequest("structured outputs: set exactly one of json, regex, choice, grammar, "
                           f"json_object (got {kinds or 'none'})")
    if getattr(self, kinds[0]) == "":
      raise InvalidRequest(f"structured {kinds[0]} must not be empty")
    for k in ("json", "regex", "grammar"):
      v = getattr(self, k)
      if v is not None and len(v) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"structured {k} has {len(v)} chars; at most {MAX_GRAMMAR_CHARS}")
    if len(self.choice) > MAX_CHOICES or sum(map(len, self.choice)) > MAX_GRAMMAR_CHARS:
      raise InvalidRequest(f"structured choice: at most {MAX_CHOICES} strings of "
                           f"{MAX_GRAMMAR_CHARS} chars in all")
    if any(not c for c in self.choice):
      raise InvalidRequest("structured choice: the strings must not be empty")

  @property
  def kind(self) -> str:
    return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, (), False))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request sampling; defaults give greedy decoding."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None
  max_tokens: int | None = None
  # Tokens generated before EOS or a stop token id may be sampled, or a stop
  # string may end the request (vLLM's min_tokens; SGLang's min_new_tokens).
  min_tokens: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  logprobs: bool = False
  top_logprobs: int = 0
  ignore_eos: bool = False
  # (token id, bias) pairs added to the logits before sampling (OpenAI's
  # logit_bias): -100 all but bans a token, +100 all but forces it. A
  # {token id: bias} mapping is taken as its pairs.
  logit_bias: tuple[tuple[int, float], ...] = ()
  # Only these token ids may be picked (vLLM's allowed_token_ids; empty: any).
  allowed_token_ids: tuple[int, ...] = ()
  # The prompt's own logprobs (vLLM's prompt_logprobs): None for none, k >= 0
  # for each prompt token's logprob given the tokens before it, with the k
  # likeliest tokens there. Needs EngineConfig.prompt_logprobs.
  prompt_logprobs: int | None = None
  # The stop string that ended the output stays at its end (vLLM's
  # include_stop_str_in_output); by default the text stops before it.
  include_stop_str_in_output: bool = False
  # Keep only the prompt's last k tokens (vLLM's truncate_prompt_tokens): a
  # prompt longer than the context is cut instead of refused.
  truncate_prompt_tokens: int | None = None
  # The output must match this (a JSON schema, a regex, ...): each step may
  # only take tokens the grammar admits; it ends when the grammar is complete.
  structured: StructuredOutputs | None = None

  def __post_init__(self):
    def integral(v) -> bool:
      return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    # Types first (a JSON front end hands over whatever came): the checks
    # below and the engine's thread assume them.
    if isinstance(self.logit_bias, Mapping):
      object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
    if not all(isinstance(e, Sequence) and len(e) == 2 and integral(e[0])
               for e in self.logit_bias):
      raise InvalidRequest("logit_bias must be (token id, bias) pairs or a {token id: bias} "
                           "mapping", field="logit_bias")
    for name in ("top_k", "min_tokens", "top_logprobs", "max_tokens", "seed",
                 "truncate_prompt_tokens", "prompt_logprobs"):
      v = getattr(self, name)
      if v is not None and not integral(v):
        raise InvalidRequest(f"{name}={v!r} must be an integer", field=name)
    if not all(isinstance(s, str) for s in self.stop):
      raise InvalidRequest("stop must be strings", field="stop")
    for name in ("stop_token_ids", "allowed_token_ids"):
      if not all(integral(t) for t in getattr(self, name)):
        raise InvalidRequest(f"{name} must be integers", field=name)
    if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
      raise InvalidRequest(f"structured={self.structured!r} must be StructuredOutputs",
                           field="structured")

    def finite(name):
      v = getattr(self, name)
      if not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequest(f"{name}={v!r} must be a finite number", field=name)
    for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty"):
      finite(f)
    if self.temperature < 0 or self.temperature > 100:
      raise InvalidRequest(f"temperature={self.temperature} must be in [0, 100] (0 = greedy)",
                           field="temperature")
    if self.top_k == -1:  # vLLM's spelling of no cut
      object.__setattr__(self, "top_k", 0)
    if self.top_k < 0:
      raise InvalidRequest(f"top_k={self.top_k} must be >= 0 (0 or -1 = no cut)", field="top_k")
    if not 0 < self.top_p <= 1:
      raise InvalidRequest(f"top_p={self.top_p} must be in (0, 1]", field="top_p")
    if not 0 <= self.min_p <= 1:
      raise InvalidRequest(f"min_p={self.min_p} must be in [0, 1]", field="min_p")
    if not 0 < self.repetition_penalty <= 100:
      raise InvalidRequest(
          f"repetition_penalty={self.repetition_penalty} must be in (0, 100] (1 = none)",
          field="repetition_penalty")
    for f in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(self, f) <= 2:
        raise InvalidRequest(f"{f}={getattr(self, f)} must be in [-2, 2]", field=f)
    if self.seed is not None and not -2**63 <= self.seed < 2**64:
      raise InvalidRequest(f"seed={self.seed} must be in [-2**63, 2**64)", field="seed")
    if self.seed is not None and self.seed < 0:  # (vLLM takes any int64) as its 64 bits
      object.__setattr__(self, "seed", self.seed % 2**64)
    if self.max_tokens is not None and self.max_tokens < 1:
      raise InvalidRequest(f"max_tokens={self.max_tokens} must be >= 1", field="max_tokens")
    if self.min_tokens < 0:
      raise InvalidRequest(f"min_tokens={self.min_tokens} must be >= 0", field="min_tokens")
    if self.max_tokens is not None and self.min_tokens > self.max_tokens:
      raise InvalidRequest(
          f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}",
          field="min_tokens")
    if self.structured is not None and self.min_tokens > 0:  # (it would end short of them)
      raise InvalidRequest(f"min_tokens={self.min_tokens} cannot go with structured outputs: "
                           "the grammar decides where the output ends", field="min_tokens")
    if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
      raise InvalidRequest(
          f"stop has {len(self.stop)} strings; at most 16 non-empty strings of <= 256 chars",
          field="stop")
    if len(self.stop_token_ids) > 64:
      raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most 64",
                           field="stop_token_ids")
    if len(self.logit_bias) > MAX_LOGIT_BIAS:
      raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most "
                           f"{MAX_LOGIT_BIAS}", field="logit_bias")
    for t, b in self.logit_bias:
      if not isinstance(b, (int, float)) or not -100 <= b <= 100:  # NaN fails too
        raise InvalidRequest(f"logit_bias[{t}]={b!r} must be in [-100, 100]", field="logit_bias")
    if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
      raise InvalidRequest("logit_bias names a token id twice", field="logit_bias")
    if len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS:
      raise InvalidRequest(f"allowed_token_ids has {len(self.allowed_token_ids)} ids; at most "
                           f"{MAX_ALLOWED_TOKENS}", field="allowed_token_ids")
    if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
      raise InvalidRequest(f"top_logprobs={self.top_logprobs} must be in "
                           f"[0, {MAX_TOP_LOGPROBS}]", field="top_logprobs")
    if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
      raise InvalidRequest(f"truncate_prompt_tokens={self.truncate_prompt_tokens} must be >= 1",
                           field="truncate_prompt_tokens")
    if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
      raise InvalidRequest(f"prompt_logprobs={self.prompt_logprobs} must be in "
                           f"[0, {MAX_TOP_LOGPROBS}] (or unset)", field="prompt_logprobs")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def penalized(self) -> bool:
    return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)

  @property
  def slot_state(self) -> bool:
    """Whether sampling needs the request's per-slot token state (counts,
    prompt and end-token flags, logit bias), set at admission."""
    return self.penalized or self.min_tokens > 0 or self.biased

  @property
  def biased(self) -> bool:
    """Whether its slot's per-token rows shape its logits (logit_bias,
    allowed_token_ids, a structured output's allow bitmask)."""
    return bool(self.logit_bias or self.allowed_token_ids or self.structured)


@dataclasses.dataclass
class Request:
  request_id: str
  prompt_ids: Sequence[int] | None = None
  prompt_text: str | None = None
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  # Chat messages as (role, content) pairs, rendered by the model's chat
  # template: the third form of the prompt.
  messages: Sequence[tuple[str, str]] | None = None
  add_generation_prompt: bool = True  # the template ends with the assistant's header
  deadline: float | None = None  # time.monotonic() by which the request must end
  # prompt_text's special tokens (vLLM's add_special_tokens): BOS first where
  # the model's tokenizer puts one (its add_bos), never on a model without.
  add_bos: bool = True
  priority: int = 0  # lower is more urgent; needs EngineConfig.scheduling = "priority"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class PromptLogprobs(Sequence):
  """A prompt's logprobs as arrays, read as a sequence of TokenLogprob: a
  2,048-token prompt's 2,047 entries are built, sent across the engine
  process and turned into protos without a Python object each."""

  token_ids: np.ndarray  # [n] int32: prompt token i + 1
  logprobs: np.ndarray  # [n] float32: its logprob given tokens 0..i
  top_ids: np.ndarray  # [n, k] int32: the k likeliest tokens there
  top_logprobs: np.ndarray  # [n, k] float32

  def __len__(self) -> int:
    return len(self.token_ids)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return tuple(self[j] for j in range(*i.indices(len(self))))
    return TokenLogprob(int(self.token_ids[i]), float(self.logprobs[i]),
                        tuple(zip(self.top_ids[i].tolist(), self.top_logprobs[i].tolist())))

  def __eq__(self, other) -> bool:
    return isinstance(other, Sequence) and tuple(self) == tuple(other)


@dataclasses.dataclass(frozen=True)
class Delta:
  token_ids: tuple[int, ...]
  text: str
  logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True)
class Final:
  reason: FinishReason
  prompt_tokens: int
  completion_tokens: int
  cached_prompt_tokens: int
  queue_s: float
  first_token_s: float
  total_s: float
  # With SamplingParams.prompt_logprobs: entry i is prompt token i + 1's
  # logprob given tokens 0..i (the first token has no context).
  prompt_logprobs: Sequence[TokenLogprob] = ()  # a PromptLogprobs when asked for
  # With reason STOP: the stop string (str) or stop token id (int) that ended
  # it (vLLM's stop_reason).
  stop_reason: str | int | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
  """The request ended in an error inside the engine, never a normal finish:
  an internal error (``invalid`` False: gRPC INTERNAL, HTTP 500), or one its
  own input caused that submit could not see (``invalid`` True: a grammar past
  the structured-output library's limits; INVALID_ARGUMENT, HTTP 400)."""

  message: str
  invalid: bool = False


@dataclasses.dataclass
class RequestHandle:
  request_id: str
  prompt_tokens: int
  events: "queue.SimpleQueue[Delta | Final | Failed]"
  submitted: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
  model_name: str
  vocab_size: int
  max_context: int
  eos_token_id: int
  bos_token_id: int
  max_batch: int
  page_size: int
  num_pages: int
  dtype: str
  backends: dict[str, str] = dataclasses.field(default_factory=dict)
  tensor_parallel_size: int = 1
  # Tokens (prompt + output) one request can hold: max_context, or fewer
  # where the whole KV cache holds fewer (vLLM's max_model_len is this).
  capacity: int | None = None


@dataclasses.dataclass(frozen=True)
class EngineStats:
  running: int
  waiting: int
  pages_in_use: int
  pages_cached: int
  pages_total: int  # usable pages (page 0 excluded)
  steps: int
  draining: bool
  preemptions: int = 0  # requests preempted (their pages freed) so far
  jump_forward_tokens: int = 0  # tokens structured outputs took without sampling
  spec_draft_tokens: int = 0  # speculative tokens drafted (EngineConfig.num_speculative_tokens)
  spec_accepted_tokens: int = 0  # and those the model agreed with


class Engine(abc.ABC):
  """What the service needs from an engine."""

  info: EngineInfo

  @abc.abstractmethod
  def start(self) -> None:
    """Compiles the bucketed shapes and starts the scheduler thread."""

  @abc.abstractmethod
  def submit(self, request: Request) -> RequestHandle:
    """Queues a request; raises InvalidRequest, QueueFull or Draining."""

  def submit_all(self, requests: Sequence[Request]) -> list[RequestHandle]:
    """Queues one call's requests (its n completions) as one admission
    decision: all of them or none (the error of the first refused)."""
    handles: list[RequestHandle] = []
    try:
      for r in requests:
        handles.append(self.submit(r))
    except BaseException:
      for h in handles:
        self.cancel(h.request_id)
      raise
    return handles

  @abc.abstractmethod
  def cancel(self, request_id: str) -> None:
    """Ends the request within one step (no-op if it already ended)."""

  @abc.abstractmethod
  def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
    ...

  @abc.abstractmethod
  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    ...

  def token_bytes(self, ids: Sequence[int]) -> list[list[int]]:
    """Each id's own bytes (OpenAI's logprob ``bytes``: a token that is part
    of a character holds that part, where its piece would be U+FFFD). The
    default spells each piece in UTF-8."""
    return [list(p.encode()) for p in self.token_pieces(ids)]

  @abc.abstractmethod
  def detokenize(self, ids: Sequence[int]) -> str:
    """The text of ``ids`` as a completion spells it; InvalidRequest for an id
    outside the vocabulary."""

  def render_chat(self, messages: Sequence[tuple[str, str]],
                  add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """A chat prompt's text (the model's chat template) and token ids, as
    ``Request.messages`` has them; InvalidRequest where it cannot."""
    raise InvalidRequest(f"{type(self).__name__} renders no chat prompts")

  @abc.abstractmethod
  def stats(self) -> EngineStats:
    ...

  @abc.abstractmethod
  def drain(self, timeout: float | None = None) -> bool:
    """Stops admitting; waits for running and waiting requests; True if all ended."""

  @abc.abstractmethod
  def stop(self) -> None:
    """Cancels everything and stops the scheduler thread."""

  def start_profile(self, log_dir: str) -> None:
    """Starts a trace of the engine's process, its device work included
    (vLLM's and SGLang's start_profile); RuntimeError if one is running."""
    raise NotImplementedError(f"{type(self).__name__} cannot profile")

  def stop_profile(self) -> None:
    """Ends the trace and writes it under start_profile's ``log_dir``
    (TensorBoard / Perfetto files); RuntimeError if none is running."""
    raise NotImplementedError(f"{type(self).__name__} cannot profile")
