"""Request intake: a request's checks, before it is queued.

``prepare`` turns an ``api.Request`` into what its ``Seq`` is made of: the
prompt's token ids (from text, ids or chat messages rendered by the model's
chat template), its token limit, seed and grammar state. Whatever cannot run
(a prompt past the context or the KV cache, token ids outside the
vocabulary, options the server was not started with) is refused here with
``api.InvalidRequest``, on the caller's thread, before the engine holds it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from serving.engine import api
from serving.engine.config import EngineConfig


class Intake:

  def __init__(self, tok, *, vocab_size: int, model_name: str, max_seq_len: int, capacity: int,
               config: EngineConfig, eos_ids: frozenset[int], grammars):
    self.tok = tok
    self.vocab_size = vocab_size
    self.model_name = model_name
    self.max_seq_len = max_seq_len
    self.capacity = capacity  # tokens the KV cache holds for one request
    self.config = config
    self.eos_ids = eos_ids
    self.grammars = grammars  # structured.Grammars
    self._bytes: list[bytes | None] | None = None  # token_bytes' table, built on first use

  def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
    """``add_bos``: the model's special tokens (vLLM's ``add_special_tokens``):
    BOS goes first only where the tokenizer puts one before a plain prompt
    (its ``add_bos``, e.g. a GGUF's tokenizer.ggml.add_bos_token), and EOS
    last only where it appends one (its ``add_eos``); a model trained
    without them is not given them."""
    try:
      ids = list(self.tok.encode(text))
    except ValueError as e:  # a model loaded without a tokenizer: token ids only
      raise api.InvalidRequest(str(e)) from None
    if not add_bos:
      return ids
    bos, eos = getattr(self.tok, "bos_id", None), tuple(getattr(self.tok, "eos_ids", ()))
    if bos is not None and getattr(self.tok, "add_bos", False):
      ids = [bos] + ids
    if eos and getattr(self.tok, "add_eos", False):
      ids = ids + [eos[0]]
    return ids

  def token_pieces(self, ids: Sequence[int]) -> list[str]:
    return [self.tok.decode([i]) for i in ids]

  def token_bytes(self, ids: Sequence[int]) -> list[list[int]]:
    """Each id's bytes in the text; a special token's (no bytes in the
    text), and a tokenizer's that cannot say, are its piece's UTF-8."""
    if self._bytes is None:
      try:
        self._bytes = self.tok.token_bytes()
      except (AttributeError, NotImplementedError, ValueError):  # (NoTokenizer: ValueError)
        self._bytes = []
    table = self._bytes
    return [list(table[i]) if 0 <= i < len(table) and table[i] is not None
            else list(self.tok.decode([i]).encode()) for i in ids]

  def detokenize(self, ids: Sequence[int]) -> str:
    self.check_vocab("token ids", ids)
    return self.tok.decode(list(ids))

  def check_vocab(self, what: str, ids, field: str | None = None) -> None:
    """InvalidRequest naming the first ids outside [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < self.vocab_size]
    if bad:
      raise api.InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary "
                               f"[0, {self.vocab_size})", field=field)

  def prepare(self, request: api.Request, make_events):
    """A request's checks and what its Seq is made of: (handle, prompt ids,
    max_tokens, seed, grammar state); InvalidRequest where it cannot run."""
    prompt = self.prompt_ids(request)
    p = request.sampling
    if p.truncate_prompt_tokens is not None:
      prompt = prompt[-p.truncate_prompt_tokens:]
    room = self.max_seq_len - len(prompt)
    if room < 1:
      raise api.InvalidRequest(
          f"the prompt has {len(prompt)} tokens; at most {self.max_seq_len - 1} fit the "
          f"context of {self.max_seq_len}")
    # Without max_tokens a request gets the default, or min_tokens if more.
    max_tokens = min(p.max_tokens or max(self.config.default_max_tokens, p.min_tokens), room)
    for name in ("max_tokens", "min_tokens"):
      if (getattr(p, name) or 0) > room:
        raise api.InvalidRequest(
            f"prompt ({len(prompt)} tokens) + {name} ({getattr(p, name)}) exceeds the "
            f"context of {self.max_seq_len}", field=name)
    if len(prompt) >= self.capacity:
      raise api.InvalidRequest(
          f"the prompt has {len(prompt)} tokens; the KV cache holds {self.capacity}")
    # A KV cache smaller than the context ends a request there (LENGTH), as
    # the context would; only min_tokens past it cannot be met.
    if len(prompt) + p.min_tokens > self.capacity:
      raise api.InvalidRequest(
          f"prompt ({len(prompt)} tokens) + min_tokens ({p.min_tokens}) exceeds the "
          f"{self.capacity} tokens the KV cache holds", field="min_tokens")
    for name in ("top_logprobs", "prompt_logprobs"):
      if (getattr(p, name) or 0) > self.vocab_size:
        raise api.InvalidRequest(f"{name}={getattr(p, name)} is more than the vocabulary's "
                                 f"{self.vocab_size} tokens", field=name)
    for name, ids in (("stop_token_ids", p.stop_token_ids),
                      ("logit_bias", [t for t, _ in p.logit_bias]),
                      ("allowed_token_ids", p.allowed_token_ids)):
      self.check_vocab(name, ids, field=name)
    if p.min_tokens and p.allowed_token_ids and not (
        set(p.allowed_token_ids) - set(p.stop_token_ids)
        - (set() if p.ignore_eos else self.eos_ids)):
      raise api.InvalidRequest("every allowed token id ends the request: min_tokens="
                               f"{p.min_tokens} cannot be met", field="min_tokens")
    if p.prompt_logprobs is not None and not self.config.prompt_logprobs:
      raise api.InvalidRequest("prompt_logprobs needs a server started with "
                               "--enable-prompt-logprobs", field="prompt_logprobs")
    if request.priority and self.config.scheduling != "priority":
      raise api.InvalidRequest(f"priority={request.priority} needs priority scheduling "
                               "(serve --scheduling-policy priority)")
    guide = self.grammars.guide(p.structured) if p.structured is not None else None
    first = guide.allowed() if guide is not None else None  # (one mask for both checks)
    if guide is not None and (not first.any() or guide.stopped and guide.error):
      # (the first mask finds a grammar that nothing matches: llguidance stops it)
      raise api.InvalidRequest(f"structured {p.structured.kind}: no output can match it")
    if guide is not None and p.allowed_token_ids and not first[list(p.allowed_token_ids)].any():
      # Else the request would end (STOP) at its first step with no output.
      raise api.InvalidRequest("allowed_token_ids and the structured output admit no common "
                               "first token", field="allowed_token_ids")
    seed = p.seed if p.seed is not None else random.getrandbits(64)
    handle = api.RequestHandle(request.request_id, len(prompt),
                               make_events(request.request_id))
    return handle, prompt, max_tokens, seed, guide

  def prompt_ids(self, request: api.Request) -> list[int]:
    forms = (request.prompt_ids, request.prompt_text, request.messages)
    if sum(x is not None for x in forms) != 1:
      raise api.InvalidRequest("give the prompt as text, token ids or chat messages "
                               "(exactly one)")
    if request.messages is not None:
      ids = self.render_chat(request.messages, request.add_generation_prompt)[1]
    elif request.prompt_text is not None:
      ids = self.tokenize(request.prompt_text, add_bos=request.add_bos)
    else:
      ids = [int(t) for t in request.prompt_ids]
      self.check_vocab("prompt token ids", ids)
    if not ids:
      raise api.InvalidRequest("the prompt is empty")
    return ids

  def render_chat(self, messages: Sequence[tuple[str, str]],
                  add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """Chat messages rendered by the model's chat template, then tokenized
    without adding BOS (vLLM's way: the template writes it where the model
    wants it; a BOS written as text becomes the BOS id)."""
    if not messages:
      raise api.InvalidRequest("the chat has no messages")
    render = getattr(self.tok, "apply_chat_template", None)
    messages = [{"role": role, "content": content} for role, content in messages]
    import jinja2

    try:
      text = None if render is None else render(
          messages, add_generation_prompt=add_generation_prompt)
    except (ValueError, TypeError, jinja2.TemplateError) as e:  # raise_exception, a bad role
      raise api.InvalidRequest(f"chat template: {e}") from None
    if text is None:
      raise api.InvalidRequest(f"the model {self.model_name} has no chat template: send the "
                               "prompt as text")
    bos, bos_id = getattr(self.tok, "bos_token", ""), getattr(self.tok, "bos_id", None)
    if bos and bos_id is not None and text.startswith(bos):
      return text, [bos_id] + list(self.tok.encode(text[len(bos):]))
    return text, list(self.tok.encode(text))
