"""models.tokenizer: what a token stands for in bytes, and the special tokens
a tokenizer's post-processor adds."""

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
