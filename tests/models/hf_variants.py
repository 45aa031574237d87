"""Reference oracle for the config variants, run with the torch + transformers
interpreter (.venv-oracle).

usage: python hf_variants.py OUT_DIR SEED

For each variant of ``variants()`` (a tiny random checkpoint exercising config
fields beyond the base architectures: activations, MLP and output biases,
intermediate sizes that are not a multiple of 64, RoPE scaling types,
per-layer sliding windows, Qwen3), writes OUT_DIR/<name>/: config.json and
model.safetensors, and no tokenizer (the models load them token-ids-only), plus
  prompt.npy  [P] int64      the prompt ids
  greedy.npy  [N] int64      transformers' greedy continuation (N = 24)
  logits.npy  [P + N - 1, V] float32 logits of the model over prompt + greedy[:-1]
Also OUT_DIR/fields.json: every field of each supported architecture's config
class (so that a field transformers adds is caught), and OUT_DIR/acts.json:
each activation's values on a grid (transformers' ACT2FN).
"""

import dataclasses
import json
import pathlib
import sys

import numpy as np
import torch
import transformers

N_NEW = 24
VOCAB = 300


def variants():
  common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, initializer_range=0.1, bos_token_id=0, eos_token_id=1,
                rms_norm_eps=1e-5, tie_word_embeddings=False, num_hidden_layers=2)
  L, Q2, Q3 = transformers.LlamaConfig, transformers.Qwen2Config, transformers.Qwen3Config
  return {
      # gelu (tanh), biases everywhere, an MLP width that is not a multiple of 64, linear RoPE
      "llama_gelu_bias": L(**common, intermediate_size=160, hidden_act="gelu_pytorch_tanh",
                           mlp_bias=True, attention_bias=True, max_position_embeddings=256,
                           rope_parameters={"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}),
      # exact gelu, YaRN past its original context
      "llama_yarn": L(**common, intermediate_size=96, hidden_act="gelu",
                      max_position_embeddings=256,
                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 16}),
      # dynamic NTK, within max_position_embeddings
      "llama_dynamic": L(**common, intermediate_size=128, max_position_embeddings=64,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0}),
      # sliding window from max_window_layers on (layer 0 full, 1 and 2 windowed)
      "qwen2_window": Q2(**{**common, "num_hidden_layers": 3}, intermediate_size=128,
                         use_sliding_window=True, sliding_window=8, max_window_layers=1,
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
      # q/k norms, head_dim * heads != hidden, tied, alternating window layers
      "qwen3": Q3(**{**common, "num_hidden_layers": 3, "head_dim": 32,
                     "tie_word_embeddings": True}, intermediate_size=128,
                  use_sliding_window=True, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
  }


CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}
ACTS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu",
        "relu")


def main():
  out, seed = pathlib.Path(sys.argv[1]), int(sys.argv[2])
  torch.manual_seed(seed)
  rng = np.random.default_rng(seed)
  out.mkdir(parents=True, exist_ok=True)
  for name, cfg in variants().items():
    cfg._attn_implementation = "eager"
    model = CLASSES[name.split("_")[0]](cfg).eval()
    with torch.no_grad():  # random (not zero / one) biases and norm weights: checked paths
      for pname, p in model.named_parameters():
        if pname.endswith(".bias") or "q_norm" in pname or "k_norm" in pname:
          p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in pname else 0.0))
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
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
  fields = {}
  for cls in (transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config,
              transformers.Qwen3Config):
    names = {f.name for f in dataclasses.fields(cls)} | set(cls().to_dict())
    fields[cls.__name__] = sorted(names)
  (out / "fields.json").write_text(json.dumps(fields))
  from transformers.activations import ACT2FN

  x = torch.linspace(-6, 6, 241, dtype=torch.float64)
  acts = {a: ACT2FN[a](x).tolist() for a in ACTS}
  (out / "acts.json").write_text(json.dumps({"x": x.tolist(), "acts": acts}))


if __name__ == "__main__":
  main()
