"""Tokenizers behind one small interface.

Every tokenizer has ``encode(str) -> list[int]`` (no BOS added: the caller
decides, helped by ``add_bos`` and ``add_eos``), ``decode(list[int]) -> str``
(special tokens skipped), ``bos_id``, ``eos_ids``, ``add_bos``, ``add_eos`` and ``apply_chat_template(messages, add_generation_prompt=True)``
which renders the model's Jinja chat template (``None`` when it has none).

Sources: a byte-level tokenizer that needs no files (the "tiny" model), a
Hugging Face ``tokenizer.json`` (the ``tokenizers`` package), a sentencepiece
``tokenizer.model``, and the GPT-2 style BPE vocabulary embedded in a GGUF file.
``from_folder`` picks the right one for an HF folder.

A GGUF's tokenizer is what transformers builds from it: CONTROL tokens
(token_type 3) are special, USER_DEFINED ones (4) added tokens that are text
(decode keeps them), and tokenizer.ggml.add_bos_token / add_eos_token its
post-processor, so the tokenizer.json ``models.save`` writes keeps them.

What an HF folder's files mean follows transformers:

* eos ids (where generation stops): generation_config.json's
  ``eos_token_id`` (an int or a list), else config.json's (transformers'
  ``GenerationConfig.from_model_config``), else the tokenizer's
  ``eos_token`` (tokenizer_config.json; for sentencepiece, its own). A
  generation_config.json without the key falls through to config.json (where
  transformers' ``generate`` would have no eos at all). ``eos_ids[0]`` is the
  tokenizer's eos token when it is one of them (what a post-processor's
  "$A </s>" appends, see ``add_eos``).
* bos id (what ``add_bos`` prepends to a text prompt, as the tokenizer's own
  ``encode`` does in transformers): tokenizer_config.json's ``bos_token``,
  else generation_config.json's ``bos_token_id``, else config.json's (for
  sentencepiece, then its own).
* the chat template: chat_template.jinja (and additional_chat_templates/*.jinja,
  named templates) take priority over tokenizer_config.json's
  ``chat_template`` (a string, or named templates: a list of
  {"name", "template"} or a dict). Of named templates the one named "default"
  is used; without one, chat prompts are refused, naming the templates.
  chat_template.json (a processor's file, which transformers' AutoTokenizer
  does not read) is not used either: a folder whose only template is there
  refuses chat prompts with a message that says so.
* the template renders in transformers' Jinja environment
  (``chat_template_utils._compile_jinja_template``): a sandbox with
  trim_blocks, lstrip_blocks, ``{% break %}``/``{% continue %}``,
  ``{% generation %}`` blocks, a ``tojson`` that keeps non-ASCII text and
  key order, ``raise_exception``, ``strftime_now``; whatever a template
  raises while rendering is a ValueError (INVALID_ARGUMENT at the server).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import pathlib
from typing import Any, Sequence


class Tokenizer:
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  # Set where the folder's templates cannot be used (named templates without
  # a "default", only chat_template.json): apply_chat_template raises it.
  chat_template_error: str | None = None
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
    # (getattr: serving's test tokenizer renders through this method too.)
    error = getattr(self, "chat_template_error", None)
    if error:
      raise ValueError(error)
    if not self.chat_template:
      return None
    return render_chat_template(self.chat_template, messages,
                                add_generation_prompt=add_generation_prompt,
                                bos_token=getattr(self, "bos_token", ""),
                                eos_token=getattr(self, "eos_token", ""))


class _TemplateRaised(Exception):
  """A chat template's own raise_exception(message)."""


@functools.lru_cache(maxsize=1)
def _jinja_environment():
  """transformers' chat-template environment (chat_template_utils.
  _compile_jinja_template): the same sandbox, options, extensions, filters
  and globals. ``{% generation %}`` renders its body (transformers tracks
  where it lies for assistant masks, which nothing here asks for)."""
  import jinja2
  import jinja2.ext
  import jinja2.nodes
  import jinja2.utils
  from jinja2 import sandbox

  class GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body
                                    ).set_lineno(lineno)

    def _render_body(self, caller):
      return caller()

  def raise_exception(message):
    raise _TemplateRaised(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's own: that one sorts keys and escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format):
    return datetime.datetime.now().strftime(format)

  class TemplateDict:
    """dict(...) without the dict type's attributes."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  class TemplateNamespace(jinja2.utils.Namespace):
    """namespace(...) that refuses underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) works
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        TemplateNamespace._check_name(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      TemplateNamespace._check_name(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace, "
            f"but got {name!r}")

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  env.globals["dict"] = TemplateDict()
  env.globals["namespace"] = TemplateNamespace
  return env


@functools.lru_cache(maxsize=16)
def _compile_chat_template(source: str):
  import jinja2

  try:
    return _jinja_environment().from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template does not parse: {e}") from None
  except Exception as e:  # noqa: BLE001: any other failure is the template's too
    raise ValueError(f"chat template does not compile: {type(e).__name__}: {e}") from None


def render_chat_template(source: str, messages: list[dict[str, Any]], *,
                         add_generation_prompt: bool = True, bos_token: str = "",
                         eos_token: str = "") -> str:
  """``source`` rendered as transformers' ``apply_chat_template(tokenize=False)``
  does (tools and documents None). Whatever the template raises is a
  ValueError that says what."""
  tmpl = _compile_chat_template(source)
  try:
    return tmpl.render(messages=messages, tools=None, documents=None,
                       add_generation_prompt=add_generation_prompt,
                       bos_token=bos_token, eos_token=eos_token)
  except _TemplateRaised as e:
    raise ValueError(f"chat template: {e}") from None
  except Exception as e:  # noqa: BLE001: an undefined name, a sandbox refusal, a TypeError, ...
    raise ValueError(f"chat template: rendering failed: {type(e).__name__}: {e}") from None


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
  if isinstance(v, bool):
    return []
  return [v] if isinstance(v, int) else [int(i) for i in (v or [])
                                         if isinstance(i, int) and not isinstance(i, bool)]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  """A JSON object file's contents; {} where the file is absent."""
  if not path.is_file():
    return {}
  try:
    value = json.loads(path.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(value, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value


def generation_ids(folder: pathlib.Path, hf_config: dict[str, Any] | None = None
                   ) -> tuple[int | None, list[int]]:
  """(bos id, eos ids) as transformers' ``generate`` takes them: from
  generation_config.json, else from config.json (``hf_config``, or read from
  ``folder``) -- per key, so a generation_config.json without
  ``eos_token_id`` falls through to config.json."""
  folder = pathlib.Path(folder)
  gcfg = _read_json(folder / "generation_config.json")
  hf = hf_config if hf_config is not None else _read_json(folder / "config.json")
  if not isinstance(hf, dict):
    hf = {}
  bos = next((v for v in (gcfg.get("bos_token_id"), hf.get("bos_token_id"))
              if isinstance(v, int) and not isinstance(v, bool)), None)
  eos = _ids(gcfg.get("eos_token_id")) or _ids(hf.get("eos_token_id"))
  return bos, eos


def no_tokenizer(folder: pathlib.Path, hf_config: dict[str, Any] | None = None) -> NoTokenizer:
  """A NoTokenizer for ``folder`` with bos/eos ids from its generation_config.json
  (first) or config.json."""
  bos, eos = generation_ids(folder, hf_config if hf_config is not None else {})
  return NoTokenizer(str(folder), bos_id=bos, eos_ids=eos)


def has_tokenizer(folder) -> bool:
  folder = pathlib.Path(folder)
  return (folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()


class HFTokenizer(Tokenizer):
  """A ``tokenizers.Tokenizer`` (from tokenizer.json or built from GGUF)."""

  def __init__(self, tk, *, bos_id=None, eos_ids=(), chat_template=None, bos_token=None,
               eos_token=None):
    """``bos_token``/``eos_token``: the strings a chat template sees
    (tokenizer_config.json's, as in transformers); by default the tokens of
    ``bos_id`` and ``eos_ids[0]``."""
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
    if bos_token is None:
      bos_token = tk.id_to_token(bos_id) if bos_id is not None else None
    if eos_token is None:
      eos_token = tk.id_to_token(self.eos_ids[0]) if self.eos_ids else None
    self.bos_token, self.eos_token = bos_token or "", eos_token or ""

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

  def __init__(self, path: pathlib.Path, *, bos_id=None, eos_ids=None, chat_template=None,
               bos_token=None, eos_token=None):
    """``bos_id``/``eos_ids``: the generation config's (None/empty: none).
    ``bos_token``/``eos_token``: tokenizer_config.json's strings. bos is
    ``bos_token``'s piece, else ``bos_id``, else the model's BOS; eos ids
    are ``eos_ids``, else ``eos_token``'s piece, else the model's EOS."""
    import sentencepiece as spm

    self.sp = spm.SentencePieceProcessor(model_file=str(path))
    sp_bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
    sp_eos = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
    cfg_bos, cfg_eos = self._piece_id(bos_token), self._piece_id(eos_token)
    self.bos_id = next((i for i in (cfg_bos, bos_id, sp_bos) if i is not None), None)
    own_eos = cfg_eos if cfg_eos is not None else sp_eos
    eos = list(eos_ids) if eos_ids else ([own_eos] if own_eos is not None else [])
    if own_eos in eos:  # the tokenizer's own first
      eos.remove(own_eos)
      eos.insert(0, own_eos)
    self.eos_ids = tuple(eos)
    self.chat_template = chat_template
    self.add_bos = self.bos_id is not None
    self.bos_token = self.sp.id_to_piece(self.bos_id) if self.bos_id is not None else ""
    # (the template's eos_token is tokenizer_config's, as in transformers)
    self.eos_token = eos_token or (self.sp.id_to_piece(self.eos_ids[0]) if self.eos_ids else "")

  def _piece_id(self, piece) -> int | None:
    if not piece:
      return None
    i = self.sp.piece_to_id(piece)
    return i if 0 <= i < self.sp.get_piece_size() and self.sp.id_to_piece(i) == piece else None

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


def _token_str(value) -> str | None:
  """tokenizer_config's bos/eos entry (a string or an AddedToken dict) as a string."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _token_id(tk, value) -> int | None:
  """An id from tokenizer_config's bos/eos entry (a string or an AddedToken dict)."""
  value = _token_str(value)
  if value is None:
    return None
  return tk.token_to_id(value) if hasattr(tk, "token_to_id") else None


def _named_templates(value, where: str) -> dict[str, str]:
  """tokenizer_config's named templates: [{"name": ..., "template": ...}, ...] or
  {name: template}."""
  if isinstance(value, (list, tuple)):
    if not all(isinstance(t, dict) and isinstance(t.get("name"), str)
               and isinstance(t.get("template"), str) for t in value):
      raise ValueError(f"{where}: chat_template is a list, but not of "
                       '{"name": <str>, "template": <str>} entries')
    return {t["name"]: t["template"] for t in value}
  if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
    raise ValueError(f"{where}: chat_template is a dict, but not of name -> template strings")
  return dict(value)


def chat_template_of(folder: pathlib.Path, tcfg: dict[str, Any] | None = None
                     ) -> tuple[str | None, str | None]:
  """(template, error) for ``folder`` as transformers' AutoTokenizer reads it:
  chat_template.jinja ("default") and additional_chat_templates/<name>.jinja
  take priority over tokenizer_config.json's chat_template; of named
  templates, "default" (transformers uses "tool_use" only given tools). The
  error (template None) says why chat prompts cannot be rendered."""
  folder = pathlib.Path(folder)
  if tcfg is None:
    tcfg = _read_json(folder / "tokenizer_config.json")
  templates: dict[str, str] = {}
  jinja, extra = folder / "chat_template.jinja", folder / "additional_chat_templates"
  where = str(jinja)
  if jinja.is_file():
    templates["default"] = jinja.read_text(encoding="utf-8")
  if extra.is_dir():
    for f in sorted(extra.glob("*.jinja")):
      templates[f.name[:-len(".jinja")]] = f.read_text(encoding="utf-8")
    if templates.keys() - {"default"}:
      where = (f"{extra} (whose templates replace tokenizer_config.json's chat_template, "
               "as in transformers)")
  if not templates:
    where = str(folder / "tokenizer_config.json")
    value = tcfg.get("chat_template")
    if isinstance(value, str):
      templates["default"] = value
    elif isinstance(value, (list, tuple, dict)):
      templates = _named_templates(value, where)
    elif value is not None:
      raise ValueError(f"{where}: chat_template must be a string or named templates, got "
                       f"{type(value).__name__}")
  legacy = folder / "chat_template.json"
  if not templates:
    if legacy.is_file():
      return None, (f"{legacy}: a processor's chat template file, which transformers' "
                    "AutoTokenizer does not read, so the model's tokenizer has no chat "
                    "template; put the template in chat_template.jinja to use it, or send "
                    "the prompt as text")
    return None, None
  if "default" not in templates:
    return None, (f"{where}: named chat templates {sorted(templates)} and none named "
                  "'default' (the one transformers renders without tools); name one "
                  "'default', or send the prompt as text")
  template = templates["default"]
  if legacy.is_file():
    try:
      other = _read_json(legacy).get("chat_template")
    except ValueError:
      other = None
    if other != template:
      logging.getLogger(__name__).warning(
          "%s: not used, as transformers' AutoTokenizer does not read it (the chat template "
          "is the tokenizer's: %s)", legacy, where)
  return template, None


def from_folder(folder: pathlib.Path) -> Tokenizer:
  """tokenizer.json if present, else tokenizer.model; bos/eos ids, their
  strings and the chat template as the module docstring says (from
  tokenizer_config.json, generation_config.json, config.json,
  chat_template.jinja)."""
  folder = pathlib.Path(folder)
  tcfg = _read_json(folder / "tokenizer_config.json")
  template, template_error = chat_template_of(folder, tcfg)
  gen_bos, gen_eos = generation_ids(folder)
  bos_token, eos_token = _token_str(tcfg.get("bos_token")), _token_str(tcfg.get("eos_token"))

  if (folder / "tokenizer.json").exists():
    import tokenizers

    try:
      tk = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
      raise ValueError(f"{folder / 'tokenizer.json'}: cannot be read: {e}") from None
    bos = _token_id(tk, bos_token)
    if bos is None:
      bos = gen_bos
    own_eos = _token_id(tk, eos_token)
    eos = list(gen_eos) or ([own_eos] if own_eos is not None else [])
    if own_eos in eos:  # the tokenizer's own first: what add_eos appends
      eos.remove(own_eos)
      eos.insert(0, own_eos)
    # (the template's eos_token is tokenizer_config's, as in transformers,
    # whatever ids generation stops at)
    out: Tokenizer = HFTokenizer(tk, bos_id=bos, eos_ids=eos, chat_template=template,
                                 eos_token=eos_token)
  elif (folder / "tokenizer.model").exists():
    out = SentencePieceTokenizer(folder / "tokenizer.model", bos_id=gen_bos, eos_ids=gen_eos,
                                 chat_template=template, bos_token=bos_token,
                                 eos_token=eos_token)
  else:
    raise FileNotFoundError(
        f"{folder}: no tokenizer found: expected tokenizer.json (Hugging Face tokenizers) "
        "or tokenizer.model (sentencepiece)")
  out.chat_template_error = template_error
  return out


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
  # Both matched whole in the text, never split (llama.cpp, transformers):
  # 3 = CONTROL, a special token (decode skips it); 4 = USER_DEFINED (e.g.
  # <think>, <tool_call>), an added token that is text (decode keeps it).
  tk.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                         for i, t in enumerate(types[:len(tokens)]) if t == 3])
  tk.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                 for i, t in enumerate(types[:len(tokens)]) if t == 4])
  bos = fields.get("tokenizer.ggml.bos_token_id")
  eos = fields.get("tokenizer.ggml.eos_token_id")
  eos_ids = [int(eos)] if eos is not None else []
  eot = fields.get("tokenizer.ggml.eot_token_id")
  if eot is not None and int(eot) not in eos_ids:
    eos_ids.append(int(eot))
  # tokenizer.ggml.add_bos_token / add_eos_token as the tokenizer's own
  # post-processor (as in transformers' tokenizer for the GGUF), so that
  # tokenizer.json (models.save) keeps them: from_folder reads add_bos /
  # add_eos off it.
  add_bos = (bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
             and 0 <= int(bos) < len(tokens))
  add_eos = (bool(fields.get("tokenizer.ggml.add_eos_token", False)) and bool(eos_ids)
             and 0 <= eos_ids[0] < len(tokens))
  tk.post_processor = _bos_eos_template(tokens, int(bos) if add_bos else None,
                                        eos_ids[0] if add_eos else None)
  out = HFTokenizer(tk, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
                    chat_template=fields.get("tokenizer.chat_template"))
  out.add_bos, out.add_eos = add_bos, add_eos
  return out


def _bos_eos_template(tokens: Sequence[str], bos: int | None, eos: int | None):
  """transformers' post-processor for add_bos_token / add_eos_token
  (``update_post_processor``): "<bos> $A <eos>", for pairs "<bos> $A <eos>
  <bos>:1 $B:1 <eos>:1"; without either, "$A" / "$A $B:1"."""
  from tokenizers import processors

  def label(i, other):  # the token's text, as transformers names it, where the template can
    text = tokens[i]
    plain = ":" not in text and not text.startswith("$") and text != other
    return text if plain else f"<token {i}>"

  b = label(bos, None) if bos is not None else None
  e = label(eos, b if eos != bos else None) if eos is not None else None
  single = [f"{b}:0"] * (b is not None) + ["$A:0"] + [f"{e}:0"] * (e is not None)
  pair = single + [f"{b}:1"] * (b is not None) + ["$B:1"] + [f"{e}:1"] * (e is not None)
  special = {x: i for x, i in ((b, bos), (e, eos)) if x is not None}
  return processors.TemplateProcessing(
      single=single, pair=pair,
      special_tokens=[{"id": x, "ids": [i], "tokens": [tokens[i]]} for x, i in special.items()])
