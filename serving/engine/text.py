"""Tokenizers the engine can use, and incremental detokenization with stops.

``IncrementalText.push(token_ids)`` returns the text that became final with
those tokens. It decodes a short window of recent tokens rather than the
whole output (a token's text can depend on its neighbours: byte fallback,
leading spaces) and holds back an incomplete UTF-8 character. With stop
strings it also holds back a tail that could be the start of a stop string,
and reports the stop once the text contains one (text cut before it, or
after it with ``include_stop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Tokenizer(Protocol):
  bos_id: int | None
  eos_ids: tuple[int, ...]
  add_bos: bool  # BOS goes before a plain text prompt (models.tokenizer.Tokenizer)

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, then BOS and EOS; needs no files."""

  def __init__(self, vocab_size: int = 258):
    if vocab_size < 258:
      raise ValueError(f"{vocab_size=} must be >= 258 (256 bytes + BOS + EOS)")
    self.vocab_size = vocab_size
    self.bos_id = 256
    self.eos_ids = (257,)
    self.add_bos = True  # the test models see BOS first, as a Llama does

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

  bos_token = eos_token = ""  # the chat template's names for them: unused
  # "role: content" lines, then "assistant: " for the model's turn.
  chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                   "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
    from models.tokenizer import Tokenizer  # jinja2 in a sandbox, as every model renders

    return Tokenizer.apply_chat_template(self, messages,
                                         add_generation_prompt=add_generation_prompt)

  def token_bytes(self) -> list[bytes | None]:
    """Each id's bytes; None for BOS, EOS and the ids past them."""
    return [bytes([b]) for b in range(256)] + [None] * (self.vocab_size - 256)


_WINDOW = 6  # prompt tokens of left context for the first new token
# Tokens a window may hold before a run of them that adds no text (special
# tokens, ids the tokenizer cannot render: most ids of a random-weight model)
# is taken as final; else every push would decode the whole run again.
_MAX_WINDOW = 32


class IncrementalText:

  def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
               context: Sequence[int] = (), include_stop: bool = False):
    self._tok = tokenizer
    # The prompt's last tokens give the first new token its left context.
    self._ids: list[int] = list(context[-_WINDOW:])
    self._prefix = 0  # window start
    self._read = len(self._ids)  # tokens whose text is already in self._text
    self._text = ""  # everything decoded as final so far
    self._emitted = 0  # chars of self._text handed out
    self._stop = tuple(stop)
    self._include_stop = include_stop  # the text ends after the stop string, not before
    self._hold = max((len(s) for s in self._stop), default=1) - 1
    # A stop string must end past this many chars: the text pushed with
    # stops=False (a request's first min_tokens - 1 tokens) cannot stop it.
    self._floor = 0
    self.stopped = False
    self.stop_string: str | None = None  # the one that stopped it

  @property
  def text(self) -> str:
    return self._text[:self._emitted]

  def push(self, ids: Sequence[int], *, skip: bool = False, stops: bool = True) -> str:
    """Adds tokens; returns newly final text. ``skip``: tokens add no text
    (EOS). ``stops=False``: no stop string ends in the text so far."""
    if self.stopped:
      return ""
    if not skip:
      self._ids.extend(ids)
      prev = self._tok.decode(self._ids[self._prefix:self._read])
      cur = self._tok.decode(self._ids[self._prefix:])
      if len(cur) > len(prev) and not cur.endswith("\ufffd"):
        self._text += cur[len(prev):]
        self._prefix, self._read = self._read, len(self._ids)
      elif (cur == prev and not cur.endswith("\ufffd")
            and len(self._ids) - self._prefix > _MAX_WINDOW):
        self._read = len(self._ids)
        self._prefix = self._read - _WINDOW
    if not stops:
      self._floor = len(self._text)
    else:
      self._find_stop()
    end = len(self._text) if self.stopped else max(self._emitted, len(self._text) - self._hold)
    out = self._text[self._emitted:end]
    self._emitted = end
    return out

  def _find_stop(self) -> None:
    for s in self._stop:
      # A match ends in text no earlier search saw: it starts at or after
      # self._emitted, as the held-back tail is at least len(s) - 1 chars.
      i = self._text.find(s, max(0, self._emitted - len(s) + 1, self._floor - len(s) + 1))
      if i >= 0:
        self.stopped, self.stop_string = True, s
        self._text = self._text[:i + len(s) if self._include_stop else i]
        return

  def flush(self) -> str:
    """The rest, at the end of a request that did not stop on a string: the
    held-back tail, and the tokens held back as an unfinished character,
    which decode as the whole output's decode has them (U+FFFD; also a
    real U+FFFD, which looks unfinished until a character follows it)."""
    if self.stopped:
      return ""
    prev = self._tok.decode(self._ids[self._prefix:self._read])
    cur = self._tok.decode(self._ids[self._prefix:])
    if len(cur) > len(prev):
      self._text += cur[len(prev):]
      self._prefix, self._read = self._read, len(self._ids)
      self._find_stop()
    out = self._text[self._emitted:]
    self._emitted = len(self._text)
    return out
