"""models.tokenizer: what a token stands for in bytes, and the special tokens
a tokenizer's post-processor adds."""

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

from models import tokenizer as tok_lib  # noqa: E402

TEXT = "héllo wörld ✓ 你好\n"


def _byte_level():
  """A GGUF-style byte-level BPE vocabulary: every byte, plus a few merges,
  and two special tokens."""
  chars = tok_lib._byte_chars()
  tokens = ["<s>", "</s>"] + [chars[b] for b in range(256)] + ["ll", "llo"]
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["l l", "ll o"],
            "tokenizer.ggml.token_type": [3, 3] + [1] * 258,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}
  return tok_lib.from_gguf_fields(fields)


def _sentencepiece_style():
  """A tokenizer.json of Llama 2's kind: "\u2581" pieces, <0xNN> byte fallback."""
  from tokenizers import decoders, models, normalizers

  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
  for piece in ("\u2581", "h", "l", "o", "w", "r", "d", "ll", "\u2581w", "llo", "é", "ö"):
    vocab.setdefault(piece, len(vocab))
  tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("l", "l"), ("ll", "o"),
                                                           ("\u2581", "w")],
                                       byte_fallback=True, unk_token="<unk>"))
  tk.normalizer = normalizers.Replace(" ", "\u2581")
  tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                  decoders.Fuse()])
  tk.add_special_tokens(["<unk>", "<s>", "</s>"])
  return tok_lib.HFTokenizer(tk, bos_id=1, eos_ids=(2,))


@pytest.mark.parametrize("make", [_byte_level, _sentencepiece_style],
                         ids=["byte-level", "sentencepiece-style"])
def test_token_bytes_spell_the_text_byte_for_byte(make):
  # A character split over tokens (the CJK ones, '✓') has no text of its own
  # (decode([id]) gives U+FFFD); its tokens' bytes joined give it back.
  tok = make()
  table = tok.token_bytes()
  ids = tok.encode(TEXT)
  assert any("\ufffd" in tok.decode([i]) for i in ids), "the text must split a character"
  assert b"".join(table[i] for i in ids) == TEXT.encode()
  assert all(table[i] is None for i in [tok.bos_id, *tok.eos_ids])  # special: no bytes
  # A token whose piece is whole text is its text's bytes.
  for i in ids:
    if "\ufffd" not in tok.decode([i]) and not tok.decode([i]).startswith(" "):
      assert table[i] == tok.decode([i]).encode(), i


def _gguf_fields(pre="smollm", add_bos=None, add_eos=None):
  """A GGUF's tokenizer metadata as llama.cpp writes it for a byte-level BPE
  vocabulary: three control tokens (type 3), every byte, ten merges, and
  user-defined tokens <extra_i> (type 4) up to 320 ids. The expected values
  in the tests below are transformers' (5.x, AutoTokenizer with gguf_file=)
  for the same file."""
  chars = tok_lib._byte_chars()
  merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "r e", "a t"]
  tokens = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chars[b] for b in range(256)]
            + [m.replace(" ", "") for m in merges])
  tokens += [f"<extra_{i}>" for i in range(320 - len(tokens))]
  types = [3] * 3 + [1] * 266 + [4] * (320 - 269)
  fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
  if add_bos is not None:
    fields["tokenizer.ggml.add_bos_token"] = add_bos
  if add_eos is not None:
    fields["tokenizer.ggml.add_eos_token"] = add_eos
  return fields


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "default"])
def test_gguf_user_defined_tokens_are_text(pre):
  """token_type 4 (USER_DEFINED, e.g. <think>, <tool_call>) is an added token
  that is not special: matched whole, and kept by decode (which skips the
  special, CONTROL ones), as in llama.cpp and transformers. It was built as
  a special token, so decode dropped it: 'a<extra_0>b' -> 'ab'."""
  tok = tok_lib.from_gguf_fields(_gguf_fields(pre))
  for text, ids, back in [
      ("a<extra_0>b", [100, 269, 101], "a<extra_0>b"),
      ("a <extra_0> b.", [100, 35, 269, 35, 101, 49], "a <extra_0> b."),
      ("  <extra_5>  ", [35, 35, 274, 35, 35], "  <extra_5>  "),
      ("<extra_0", [63, 104, 123, 119, 117, 100, 98, 51], "<extra_0"),
      ("<|im_start|>user\nhi<|im_end|>\n", [1, 120, 118, 264, 13, 107, 108, 2, 13],
       "user\nhi\n"),
      ("hello <|endoftext|> the", [260, 111, 111, 114, 35, 0, 261], "hello  the")]:
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == back, text
  assert tok.decode([1, 269, 2, 270]) == "<extra_0><extra_1>"
  assert tok.decode([119, 269, 260, 0, 35]) == "t<extra_0>he "
  assert tok.decode([269]) == "<extra_0>"
  table = tok.token_bytes()
  assert table[269] == b"<extra_0>" and table[:3] == [None] * 3


def _template(bos, eos, *, pair):
  """transformers' TemplateProcessing for add_bos_token / add_eos_token."""
  def special(name, t):
    return {"SpecialToken": {"id": name, "type_id": t}}

  def seq(name, t):
    return {"Sequence": {"id": name, "type_id": t}}

  out = []
  for name, t in ([("A", 0), ("B", 1)] if pair else [("A", 0)]):
    out += ([special(bos, t)] if bos else []) + [seq(name, t)] + ([special(eos, t)] if eos else [])
  return out


@pytest.mark.parametrize("add_bos, add_eos", [(True, True), (True, False), (False, True),
                                              (False, False), (None, None)])
def test_gguf_add_bos_add_eos_are_the_tokenizers_post_processor(tmp_path, add_bos, add_eos):
  """tokenizer.ggml.add_bos_token / add_eos_token become the tokenizer's
  post-processor, the one transformers builds for the GGUF, so that its
  tokenizer.json (what models.save writes) says the same: read back from a
  folder, add_bos / add_eos were False."""
  tok = tok_lib.from_gguf_fields(_gguf_fields(add_bos=add_bos, add_eos=add_eos))
  bos, eos = bool(add_bos), bool(add_eos)
  assert (tok.add_bos, tok.add_eos, tok.bos_id, tok.eos_ids) == (bos, eos, 1, (2,))
  plain = [119, 260, 35, 102, 268]
  assert tok.encode("the cat") == plain
  assert tok.tk.encode("the cat").ids == [1] * bos + plain + [2] * eos
  assert tok.tk.encode("the", "cat").ids == ([1] * bos + [119, 260] + [2] * eos
                                             + [1] * bos + [102, 268] + [2] * eos)
  spec = json.loads(tok.tk.to_str())["post_processor"]
  b, e = "<|im_start|>" if bos else None, "<|im_end|>" if eos else None
  assert spec == {
      "type": "TemplateProcessing", "single": _template(b, e, pair=False),
      "pair": _template(b, e, pair=True),
      "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]}
                         for name, i in ((b, 1), (e, 2)) if name}}
  # A folder with this tokenizer.json (as models.save writes it) reads the same.
  tok.tk.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": tok.bos_token, "eos_token": tok.eos_token}))
  back = tok_lib.from_folder(tmp_path)
  assert (back.add_bos, back.add_eos, back.bos_id, back.eos_ids) == (bos, eos, 1, (2,))
  assert back.encode("a<extra_0>b the cat") == tok.encode("a<extra_0>b the cat")
  assert back.decode([1, 100, 269, 2]) == "a<extra_0>"


def test_gguf_bos_eos_template_with_tokens_a_template_cannot_name():
  """A BOS/EOS token with ':' (the template's type-id separator), or the
  same token for both, still makes the post-processor."""
  fields = _gguf_fields(add_bos=True, add_eos=True)
  fields["tokenizer.ggml.tokens"][1] = "<s:x>"
  tok = tok_lib.from_gguf_fields(fields)
  assert tok.tk.encode("the").ids == [1, 119, 260, 2] and tok.add_bos and tok.add_eos
  fields = _gguf_fields(add_bos=True, add_eos=True)
  fields["tokenizer.ggml.eos_token_id"] = 1
  tok = tok_lib.from_gguf_fields(fields)
  assert tok.tk.encode("the").ids == [1, 119, 260, 1] and tok.add_bos and tok.add_eos
