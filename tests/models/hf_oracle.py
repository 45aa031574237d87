"""Reference oracle, run with the torch + transformers interpreter (.venv-oracle).

usage: python hf_oracle.py OUT_DIR SEED

For each of a Llama (Llama-3 RoPE scaling, untied), a Mistral (sliding window
shorter than the sequence) and a Qwen2 (qkv bias, tied embeddings) config with
random weights, writes OUT_DIR/<name>/: the HF checkpoint (config.json, sharded
safetensors + index), a byte-level BPE tokenizer.json, and
  prompt.npy  [P] int64      the prompt ids
  greedy.npy  [N] int64      transformers' greedy continuation (N = 32)
  logits.npy  [P + N - 1, V] float32 logits of the model over prompt + greedy[:-1]
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers

N_NEW = 32
VOCAB = 300


def tokenizer_json(path: pathlib.Path) -> None:
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {"<s>": 0, "</s>": 1}
  for ch in sorted(alphabet):
    vocab[ch] = len(vocab)
  merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tk.add_special_tokens(["<s>", "</s>"])
  assert len(vocab) <= VOCAB
  tk.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<s>", "eos_token": "</s>",
      "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"}))


def configs():
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, initializer_range=0.1, bos_token_id=0,
                eos_token_id=1, rms_norm_eps=1e-5)
  return {
      "llama": transformers.LlamaConfig(
          **common, rope_theta=10000.0, tie_word_embeddings=False,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
      "mistral": transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=16,
                                            tie_word_embeddings=False),
      "qwen2": transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True),
  }


def main():
  out, seed = pathlib.Path(sys.argv[1]), int(sys.argv[2])
  torch.manual_seed(seed)
  rng = np.random.default_rng(seed)
  classes = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}
  for name, cfg in configs().items():
    cfg._attn_implementation = "eager"
    model = classes[name](cfg).eval()
    if name == "qwen2":  # random, not zero, biases so that the bias path is checked
      for layer in model.model.layers:
        for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
          torch.nn.init.normal_(p.bias, std=0.5)
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True, max_shard_size="60KB")
    tokenizer_json(d)
    prompt = torch.tensor(rng.integers(2, VOCAB, size=12), dtype=torch.long)
    with torch.no_grad():
      ids = prompt[None]
      for _ in range(N_NEW):  # greedy by hand: no eos stop, no generation-config surprises
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
      logits = model(ids[:, :-1]).logits[0].float().numpy()
    np.save(d / "prompt.npy", prompt.numpy())
    np.save(d / "greedy.npy", ids[0, len(prompt):].numpy())
    np.save(d / "logits.npy", logits)


if __name__ == "__main__":
  main()
