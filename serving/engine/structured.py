"""Structured outputs: the tokens a request may take next, by grammar.

A request's ``SamplingParams.structured`` (a JSON schema, any JSON object, a
regex, a choice of strings, or a Lark grammar) becomes an llguidance grammar
when it is submitted; ``Grammars.guide`` checks it against the model's
vocabulary and refuses a bad one there (``InvalidRequest``). The request's
``Guide`` then follows its accepted tokens: before each step the engine
computes the structured requests' allowed sets as bitmasks
(``Grammars.fill``, on llguidance's threads) into their slots'
``SlotTokens.allow`` rows, and a request ends (STOP) when its grammar admits
nothing more.

llguidance works on token bytes: a Hugging Face ``tokenizer.json`` is handed
over whole; other tokenizers say what bytes each id stands for
(``token_bytes()``: None for special ids).
"""

from __future__ import annotations

import json
import threading

import numpy as np

from serving.engine import api

_MISSING = ("structured outputs need the llguidance package (pip install llguidance); "
            "this server has none")


# Compact JSON (no whitespace between items) rather than any whitespace
# anywhere: a weak model could otherwise emit whitespace until max_tokens.
# A schema's own "x-guidance" options override it.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _rust_regex_escape(s: str) -> str:
  """A literal in llguidance's regex syntax (Rust's regex_syntax::escape)."""
  return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in s)


def grammar(spec: api.StructuredOutputs) -> str:
  """The llguidance grammar text of a request's structured output spec."""
  from llguidance import LLMatcher

  if spec.json is not None:
    try:
      schema = json.loads(spec.json)
    except json.JSONDecodeError as e:
      raise api.InvalidRequest(f"structured json: the schema is not JSON: {e}") from None
    if not isinstance(schema, dict):  # (true / false, JSON Schema's "anything" / "nothing")
      raise api.InvalidRequest("structured json: the schema must be a JSON object")
    try:
      return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except ValueError as e:  # (llguidance refusing the schema: the client's)
      raise api.InvalidRequest(f"structured json: {e}") from None
  if spec.json_object:
    return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
  if spec.regex is not None:
    return LLMatcher.grammar_from_regex(spec.regex)
  if spec.choice:
    return LLMatcher.grammar_from_regex("|".join(f"({_rust_regex_escape(c)})"
                                                 for c in spec.choice))
  return LLMatcher.grammar_from_lark(spec.grammar)


class _Vocabulary:
  """llguidance's view of a tokenizer without a tokenizer.json."""

  def __init__(self, tok, pieces: list[bytes | None], vocab: int):
    eos = list(getattr(tok, "eos_ids", ()) or ())
    pieces = (pieces + [None] * vocab)[:vocab]
    self.special_token_ids = [i for i, p in enumerate(pieces) if p is None]
    # Special ids need a name; ids past the tokenizer's (a padded embedding) too.
    self.tokens = [p if p is not None else f"<|special_{i}|>".encode()
                   for i, p in enumerate(pieces)]
    self.eos_token_id = eos[0] if eos else vocab - 1
    self.bos_token_id = getattr(tok, "bos_id", None)
    # bytes -> id; where two ids spell the same bytes (a sentencepiece piece and
    # its byte-fallback twin), the later one: the piece.
    self._ids = {p: i for i, p in enumerate(pieces) if p}
    self._longest = max(map(len, self._ids), default=1)

  def __call__(self, s: bytes | str) -> list[int]:
    """Greedy longest-match tokens of ``s`` (llguidance tokenizes the bytes a
    grammar forces with it). Not the tokenizer's own encode: sentencepiece's
    adds a leading "▁", a space the grammar never allowed."""
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    out, i = [], 0
    while i < len(b):
      for n in range(min(self._longest, len(b) - i), 0, -1):
        t = self._ids.get(b[i:i + n])
        if t is not None:
          out.append(t)
          i += n
          break
      else:
        i += 1  # a byte no token spells cannot be generated anyway
    return out


def ll_tokenizer(tok, vocab: int):
  """An llguidance tokenizer for the model's tokenizer and ``vocab`` logits."""
  import llguidance

  eos = list(getattr(tok, "eos_ids", ()) or ())
  if hasattr(tok, "tk"):  # models.tokenizer.HFTokenizer: tokenizers' own JSON
    return llguidance.LLTokenizer(tok.tk.to_str(), n_vocab=vocab, eos_token=eos or None)
  if not hasattr(tok, "token_bytes"):
    raise api.InvalidRequest(f"structured outputs: the tokenizer {type(tok).__name__} does "
                             "not say what bytes its tokens stand for")
  wrapper = llguidance.TokenizerWrapper(_Vocabulary(tok, tok.token_bytes(), vocab))
  return llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos or None)


class Guide:
  """One request's grammar state: what it may take next, and what it took."""

  def __init__(self, matcher, vocab: int):
    self._m = matcher
    self._vocab = vocab

  def words(self) -> np.ndarray:
    """[ceil(vocab / 32)] int32: bit t % 32 of word t // 32 set where token t may come next."""
    # (compute_bitmask has a spare word when 32 divides the vocabulary)
    return np.frombuffer(self._m.compute_bitmask(), np.int32)[:-(-self._vocab // 32)].copy()

  def allowed(self) -> np.ndarray:
    """[vocab] bool: the tokens the grammar admits next."""
    bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
    return np.unpackbits(bits, bitorder="little")[:self._vocab].astype(bool)

  def forced(self) -> list[int]:
    """The tokens that must come next whatever is sampled (may be none)."""
    return self._m.compute_ff_tokens()

  def accept(self, ids: list[int]) -> bool:
    """Follows the tokens; False if the grammar refused one (the matcher's error)."""
    return self._m.consume_tokens(ids)

  def rollback(self, n: int) -> None:
    """Takes back the last ``n`` accepted tokens (checked drafts)."""
    if n and not self._m.rollback(n):
      raise RuntimeError(f"grammar rollback of {n} tokens failed: {self._m.get_error()}")

  @property
  def stopped(self) -> bool:
    """Nothing more can follow: the output is complete."""
    return self._m.is_stopped()

  @property
  def error(self) -> str:
    return self._m.get_error() if self._m.is_error() else ""


class Grammars:
  """Builds each structured request's Guide; the llguidance tokenizer (about
  a second for a 128K vocabulary) is built at the first such request."""

  def __init__(self, tok, vocab: int):
    self._tok, self._vocab = tok, vocab
    self._ll = None
    self._executor = None
    self._lock = threading.Lock()

  def _tokenizer(self):
    with self._lock:
      if self._ll is None:
        self._ll = ll_tokenizer(self._tok, self._vocab)
      return self._ll

  def prepare(self) -> str | None:
    """Builds the llguidance tokenizer now (at warm-up: half a second even for
    a small vocabulary); None if built, else why structured outputs are off
    (structured requests then get that as their error)."""
    try:
      import llguidance  # noqa: F401
    except ImportError:
      return "no llguidance package"
    try:
      self._tokenizer()
    except api.InvalidRequest as e:  # a tokenizer without token bytes: plain text still serves
      return str(e)
    return None

  def fill(self, guides: list[Guide], words: np.ndarray) -> None:
    """Row i of ``words`` [>= len(guides), W] int32 <- guides[i]'s bitmask,
    computed side by side on llguidance's threads (without the GIL)."""
    from llguidance.numpy import fill_next_token_bitmask_par

    if words.shape[1] != -(-self._vocab // 32):  # llguidance's row stride
      raise ValueError(f"{words.shape=}: rows of {-(-self._vocab // 32)} words expected")
    if self._executor is None:
      import llguidance

      self._executor = llguidance.LLExecutor()
    fill_next_token_bitmask_par(self._executor, [(g._m, i) for i, g in enumerate(guides)],
                                words)

  def guide(self, spec: api.StructuredOutputs) -> Guide:
    """A fresh Guide for ``spec``; InvalidRequest if the spec does not compile."""
    try:
      import llguidance
    except ImportError:
      raise api.InvalidRequest(_MISSING) from None
    # The matcher compiles the grammar and keeps any error (it never raises):
    # one compile, where validate_grammar first would be two.
    m = llguidance.LLMatcher(self._tokenizer(), grammar(spec), log_level=0)
    if m.is_error():
      raise api.InvalidRequest(f"structured {spec.kind}: {m.get_error().strip()}")
    return Guide(m, self._vocab)
