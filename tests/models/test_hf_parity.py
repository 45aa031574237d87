"""Our decoder against transformers (torch, CPU) on random-weight checkpoints.

The oracle saved each model as an HF folder (sharded safetensors) with its
logits over prompt + 32 greedy tokens. We load the folder in float32 and must
match: max |diff| <= 1e-4 * max |logit| on every position, and the same greedy
tokens, through every path that produces logits (one-shot prefill, chunked
prefill, token-by-token decode, multi-token decode).
"""

import numpy as np
import pytest

import models

ARCHS = ["llama", "mistral", "qwen2"]
PAGE = 8  # small pages so a sequence spans several, in scrambled order


def _close(ours, ref, what):
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs {ref.shape}"
  assert np.all(np.isfinite(ours)), f"{what}: non-finite logits"
  err = np.abs(ours - ref).max() / np.abs(ref).max()
  assert err <= 1e-4, f"{what}: max|diff|/max|ref| = {err:.2e} > 1e-4"


def _load(hf_oracle, arch):
  d = hf_oracle / arch
  return (models.load(d, dtype="float32"), np.load(d / "prompt.npy"), np.load(d / "greedy.npy"),
          np.load(d / "logits.npy"))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_decode_logits(hf_oracle, arch):
  model, prompt, greedy, ref = _load(hf_oracle, arch)
  expect = {"llama": (False, False, None), "mistral": (False, False, 16), "qwen2": (True, True, None)}
  cfg = model.config
  assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.sliding_window) == expect[arch]
  out, logits = models.generate(model, prompt.tolist(), len(greedy), page_size=PAGE,
                                stop_at_eos=False, return_logits=True)
  _close(logits, ref[len(prompt) - 1:], f"{arch} prefill+decode logits")
  assert out == greedy.tolist(), f"{arch}: greedy tokens differ"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_multi_token_decode(hf_oracle, arch):
  """All-position logits of a prefill split in two chunks of a batch with a
  padding row and scrambled pages, then a Tq=4 decode (speculative verify)."""
  model, prompt, greedy, ref = _load(hf_oracle, arch)
  seq = np.concatenate([prompt, greedy[:-1]])  # the tokens ref's rows were computed on
  n = len(seq)
  n_pages = -(-n // PAGE)
  rng = np.random.default_rng()
  pages = rng.permutation(np.arange(1, n_pages + 3))[:n_pages]  # never page 0
  table = np.stack([pages, np.zeros_like(pages)])  # row 1: a padding row
  cache = model.init_cache(n_pages + 3, PAGE)
  a = 13  # first chunk
  b = n - 4 - a  # second chunk; the last 4 tokens go through decode
  toks = np.zeros((2, a), np.int32)
  toks[0] = seq[:a]
  l1, cache = model.prefill(cache, toks, [0, 0], [a, 0], table, all_logits=True)
  toks = np.zeros((2, b), np.int32)
  toks[0] = seq[a:a + b]
  l2, cache = model.prefill(cache, toks, [a, 0], [b, 0], table, all_logits=True)
  l3, cache = model.decode(cache, np.stack([seq[a + b:], np.zeros(4, np.int32)]), [n, 0], table)
  ours = np.concatenate([np.asarray(l1[0]), np.asarray(l2[0]), np.asarray(l3[0])])
  _close(ours, ref, f"{arch} chunked prefill + Tq=4 decode")
  assert np.all(np.asarray(l3[1]) == np.asarray(l3[1])), "padding row produced NaN"


def test_tokenizer_and_chat_template_from_folder(hf_oracle):
  model = models.load(hf_oracle / "llama", dtype="float32")
  tok = model.tokenizer
  text = "the quick brown fox, the end"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.bos_id == 0 and 1 in tok.eos_ids
  rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert rendered == "<user>hi"
