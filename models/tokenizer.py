"""Tokenizers behind one small interface.

Every tokenizer has ``encode(str) -> list[int]`` (no BOS added: the caller
decides, helped by ``add_bos`` and ``add_eos``), ``decode(list[int]) -> str``
(special tokens skipped), ``bos_id``, ``eos_ids``, ``add_bos``, ``add_eos`` and ``apply_chat_template(messages, add_generation_prompt=True)``
which renders the model's Jinja chat template (``None`` when it has none).

Sources: a byte-level tokenizer that needs no files (the "tiny" model), a
Hugging Face ``tokenizer.json`` (the ``tokenizers`` package), a sentencepiece
``tokenizer.model``, and the GPT-2 style BPE vocabulary embedded in a GGUF file.
``from_folder`` picks the right one for an HF folder.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence


class Tokenizer:
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  bos_token: str = ""
  eos_token: str = ""
  add_bos: bool = False  # whether the model expects BOS before a plain prompt
  add_eos: bool = False  # and EOS (eos_ids[0]) after it (a post-processor's "$A </s>")

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError

  def token_bytes(self) -> list[bytes | None]:
    """Each id's bytes in the text (None: a special or control token): what
    grammar-constrained decoding matches (serving.engine.structured)."""
    raise NotImplementedError

  def apply_chat_template(self, messages: list[dict[str, str]], *,
                          add_generation_prompt: bool = True) -> str | None:
    if not self.chat_template:
      return None
    import jinja2
    from jinja2 import sandbox

    def raise_exception(msg):
      raise ValueError(f"chat template: {msg}")

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
      tmpl = env.from_string(self.chat_template)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"chat template does not parse: {e}") from None
    return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes shifted by 3; 0 = pad, 1 = BOS, 2 = EOS. Needs vocab >= 259."""

  OFFSET = 3

  def __init__(self):
    self.bos_id, self.eos_ids, self.add_bos = 1, (2,), True
    self.bos_token, self.eos_token = "<s>", "</s>"
    self.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

  def encode(self, text: str) -> list[int]:
    return [b + self.OFFSET for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i - self.OFFSET for i in ids
                 if self.OFFSET <= i < 256 + self.OFFSET).decode("utf-8", "replace")

  def token_bytes(self) -> list[bytes | None]:
    return [None] * self.OFFSET + [bytes([b]) for b in range(256)]


class NoTokenizer(Tokenizer):
  """A checkpoint loaded without a tokenizer: prompts are token ids, outputs
  are token ids. ``encode`` (text prompts), chat templates and grammars
  raise a ValueError that says so; ``decode`` gives "" (there is no text).
  bos/eos ids come from the checkpoint's config.json / generation_config.json."""

  def __init__(self, source: str, *, bos_id=None, eos_ids=()):
    self.source = source
    self.bos_id = bos_id
    self.eos_ids = tuple(eos_ids)
    self.add_bos = False  # token-id prompts are taken as given

  def _refuse(self, what):
    return ValueError(f"{self.source}: the model was loaded without a tokenizer, so {what} is "
                      "not possible; give prompts as token ids, or load it with "
                      "tokenizer=<folder with tokenizer.json or tokenizer.model>")

  def encode(self, text: str) -> list[int]:
    raise self._refuse("encoding text")

  def decode(self, ids: Sequence[int]) -> str:
    return ""

  def token_bytes(self) -> list[bytes | None]:
    raise self._refuse("matching token bytes")

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True):
    raise self._refuse("rendering chat messages")


def _ids(v) -> list[int]:
  return [v] if isinstance(v, int) else [int(i) for i in (v or []) if isinstance(i, int)]


def no_tokenizer(folder: pathlib.Path, hf_config: dict[str, Any] | None = None) -> NoTokenizer:
  """A NoTokenizer for ``folder`` with bos/eos ids from its generation_config.json
  (first) or config.json."""
  folder = pathlib.Path(folder)
  gcfg: dict[str, Any] = {}
  if (folder / "generation_config.json").exists():
    gcfg = json.loads((folder / "generation_config.json").read_text())
  hf = hf_config or {}
  bos = gcfg.get("bos_token_id", hf.get("bos_token_id"))
  eos = _ids(gcfg.get("eos_token_id")) or _ids(hf.get("eos_token_id"))
  return NoTokenizer(str(folder), bos_id=bos if isinstance(bos, int) else None, eos_ids=eos)


def has_tokenizer(folder) -> bool:
  folder = pathlib.Path(folder)
  return (folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()


class HFTokenizer(Tokenizer):
  """A ``tokenizers.Tokenizer`` (from tokenizer.json or built from GGUF)."""

  def __init__(self, tk, *, bos_id=None, eos_ids=(), chat_template=None):
    self.tk = tk
    self.bos_id = bos_id
    self.eos_ids = tuple(eos_ids)
    self.chat_template = chat_template
    # The tokenizer's own post-processor says whether it would prepend BOS
    # or append EOS (tokenizer.json's TemplateProcessing "<s> $A </s>").
    plain, special = (tk.encode("a", add_special_tokens=b).ids for b in (False, True))
    extra, n = len(special) - len(plain), len(plain)  # special = [BOS] + plain + [EOS]
    self.add_bos = (bos_id is not None and extra > 0 and special[0] == bos_id
                    and special[1:1 + n] == plain)
    self.add_eos = (bool(self.eos_ids) and extra > self.add_bos
                    and special[-1] == self.eos_ids[0] and special[-1 - n:-1] == plain)
    self.bos_token = tk.id_to_token(bos_id) if bos_id is not None else ""
    self.eos_token = tk.id_to_token(self.eos_ids[0]) if self.eos_ids else ""

  def encode(self, text: str) -> list[int]:
    return self.tk.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self.tk.decode(list(ids), skip_special_tokens=True)

  def token_bytes(self) -> list[bytes | None]:
    """From the vocabulary's pieces as the decoder reads them: byte-level BPE
    (GPT-2, Llama 3, Qwen: each char stands for one byte), or
    sentencepiece-style pieces ("\u2581" is a space; "<0x0A>" one byte where
    the decoder falls back to bytes). A piece inside a multi-byte character
    is its bytes alone, which decode([id]) cannot give."""
    spec = json.loads(self.tk.to_str())
    dec = spec.get("decoder") or {}
    kinds = {d.get("type") for d in [dec, *dec.get("decoders", [])]}
    specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    char_byte = {c: b for b, c in _byte_chars().items()}
    out: list[bytes | None] = [None] * self.tk.get_vocab_size(with_added_tokens=True)
    for piece, i in self.tk.get_vocab(with_added_tokens=True).items():
      if i in specials or i >= len(out):
        continue
      if "ByteLevel" in kinds and all(c in char_byte for c in piece):
        out[i] = bytes(char_byte[c] for c in piece)
      elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and (
          piece.endswith(">")):
        out[i] = bytes([int(piece[3:5], 16)])
      else:  # an added token (plain text), or a sentencepiece-style piece
        out[i] = (piece if "ByteLevel" in kinds else piece.replace("\u2581", " ")).encode()
    return out


def _byte_chars() -> dict[int, str]:
  """GPT-2's byte-level alphabet: each byte's printable stand-in char."""
  keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  extra = iter(range(256, 512))
  return {b: chr(b if b in keep else next(extra)) for b in range(256)}


class SentencePieceTokenizer(Tokenizer):

  def __init__(self, path: pathlib.Path, *, bos_id=None, eos_ids=None, chat_template=None):
    import sentencepiece as spm

    self.sp = spm.SentencePieceProcessor(model_file=str(path))
    self.bos_id = bos_id if bos_id is not None else (self.sp.bos_id() if self.sp.bos_id() >= 0 else None)
    self.eos_ids = tuple(eos_ids) if eos_ids else ((self.sp.eos_id(),) if self.sp.eos_id() >= 0 else ())
    self.chat_template = chat_template
    self.add_bos = self.bos_id is not None
    self.bos_token = self.sp.id_to_piece(self.bos_id) if self.bos_id is not None else ""
    self.eos_token = self.sp.id_to_piece(self.eos_ids[0]) if self.eos_ids else ""

  def encode(self, text: str) -> list[int]:
    return self.sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    return self.sp.decode([int(i) for i in ids])

  def token_bytes(self) -> list[bytes | None]:
    out: list[bytes | None] = []
    for i in range(self.sp.get_piece_size()):
      piece = self.sp.id_to_piece(i)
      if self.sp.is_byte(i):  # <0xNN>: byte fallback
        out.append(bytes([int(piece[3:5], 16)]))
      elif self.sp.is_control(i) or self.sp.is_unknown(i):
        out.append(None)
      else:
        out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


def _token_id(tk, value) -> int | None:
  """An id from tokenizer_config's bos/eos entry (a string or an AddedToken dict)."""
  if value is None:
    return None
  if isinstance(value, dict):
    value = value.get("content")
  return tk.token_to_id(value) if hasattr(tk, "token_to_id") else None


def from_folder(folder: pathlib.Path) -> Tokenizer:
  """tokenizer.json if present, else tokenizer.model; bos/eos and the chat
  template from tokenizer_config.json / generation_config.json."""
  folder = pathlib.Path(folder)
  tcfg: dict[str, Any] = {}
  if (folder / "tokenizer_config.json").exists():
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
  gcfg: dict[str, Any] = {}
  if (folder / "generation_config.json").exists():
    gcfg = json.loads((folder / "generation_config.json").read_text())
  template = tcfg.get("chat_template")
  if template is None and (folder / "chat_template.jinja").exists():
    template = (folder / "chat_template.jinja").read_text()
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"),
                    template[0]["template"] if template else None)
  gen_eos = gcfg.get("eos_token_id")
  gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])

  if (folder / "tokenizer.json").exists():
    import tokenizers

    try:
      tk = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
      raise ValueError(f"{folder / 'tokenizer.json'}: cannot be read: {e}") from None
    bos = _token_id(tk, tcfg.get("bos_token"))
    if bos is None:
      bos = gcfg.get("bos_token_id")
    eos = gen_eos or [i for i in [_token_id(tk, tcfg.get("eos_token"))] if i is not None]
    return HFTokenizer(tk, bos_id=bos, eos_ids=eos, chat_template=template)
  if (folder / "tokenizer.model").exists():
    return SentencePieceTokenizer(folder / "tokenizer.model", bos_id=gcfg.get("bos_token_id"),
                                  eos_ids=gen_eos, chat_template=template)
  raise FileNotFoundError(
      f"{folder}: no tokenizer found: expected tokenizer.json (Hugging Face tokenizers) "
      "or tokenizer.model (sentencepiece)")


# llama.cpp's pre-tokenizer names -> the split regex of the original tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
                r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def from_gguf_fields(fields: dict[str, Any], path: str = "<gguf>") -> Tokenizer:
  """Builds the tokenizer embedded in a GGUF file (``fields``: key -> value)."""
  kind = fields.get("tokenizer.ggml.model")
  if kind is None:
    raise ValueError(f"{path}: the GGUF file has no embedded tokenizer (tokenizer.ggml.model)")
  if kind != "gpt2":
    raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported; supported: "
                     "'gpt2' (byte-level BPE). Use an HF folder with tokenizer.json instead")
  import tokenizers
  from tokenizers import decoders, models as tk_models, pre_tokenizers

  tokens = list(fields["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
  vocab = {t: i for i, t in enumerate(tokens)}
  tk = tokenizers.Tokenizer(tk_models.BPE(vocab=vocab, merges=merges))
  pre = fields.get("tokenizer.ggml.pre", "default")
  if pre == "smollm":
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  elif pre in ("llama-bpe", "llama3", "qwen2"):
    pattern = _LLAMA3_SPLIT if pre != "qwen2" else _QWEN2_SPLIT
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  types = list(fields.get("tokenizer.ggml.token_type", []))
  # 3 = CONTROL, 4 = USER_DEFINED: matched whole in the text, never split.
  special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
             for i, t in enumerate(types) if t in (3, 4)]
  tk.add_special_tokens(special)
  bos = fields.get("tokenizer.ggml.bos_token_id")
  eos = fields.get("tokenizer.ggml.eos_token_id")
  eos_ids = [int(eos)] if eos is not None else []
  eot = fields.get("tokenizer.ggml.eot_token_id")
  if eot is not None and int(eot) not in eos_ids:
    eos_ids.append(int(eot))
  out = HFTokenizer(tk, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
                    chat_template=fields.get("tokenizer.chat_template"))
  out.add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
  out.add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False)) and bool(eos_ids)
  return out
