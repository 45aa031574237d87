"""Model hyper-parameters: one frozen dataclass and the named configs.

``ModelConfig`` holds everything the decoder needs to build its parameters and
run; ``from_hf(config_json_dict)`` reads a Hugging Face config.json (Llama,
Mistral, Qwen2 architectures); ``get(name)`` returns a named config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency scaling (rope_type "llama3")."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.factor <= 0:
      raise ValueError(f"rope scaling {self.factor=} must be positive")
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          f"rope scaling needs {self.high_freq_factor=} > {self.low_freq_factor=}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2
  sliding_window: int | None = None  # Mistral: a query sees this many latest keys
  max_position_embeddings: int = 8192
  # Per-frequency divisors of the RoPE inverse frequencies, as GGUF files store
  # Llama-3 scaling (rope_freqs.weight); exclusive with rope_scaling.
  rope_freq_factors: tuple[float, ...] | None = None

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size", "max_position_embeddings"):
      v = getattr(self, f)
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads must be a multiple of num_kv_heads (GQA): {self.num_heads=}, "
          f"{self.num_kv_heads=}")
    if self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim: {self.head_dim=}")
    if self.intermediate_size % 64:
      # The fused gate/up matmul pairs them in blocks of 64 features
      # (kernels.matmul.SWIGLU_BLOCK); every Llama-family release fits.
      raise ValueError(f"intermediate_size={self.intermediate_size} must be a multiple of 64")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"{self.sliding_window=} must be positive or None")
    if self.rope_freq_factors is not None:
      if self.rope_scaling is not None:
        raise ValueError("give rope_scaling or rope_freq_factors, not both")
      if len(self.rope_freq_factors) != self.head_dim // 2:
        raise ValueError(f"rope_freq_factors needs head_dim/2 = {self.head_dim // 2} entries, "
                         f"got {len(self.rope_freq_factors)}")
    if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
      raise ValueError(f"{self.rope_theta=} and {self.rms_norm_eps=} must be positive")

  @property
  def q_per_kv(self) -> int:
    return self.num_heads // self.num_kv_heads

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("rope_freq_factors") is not None:
      d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
    return cls(**d)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, hd, f = self.hidden_size, self.head_dim, self.intermediate_size
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += hd * (self.num_heads + 2 * self.num_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + emb + d

  @classmethod
  def from_hf(cls, hf: dict[str, Any], name: str = "hf") -> "ModelConfig":
    """From a Hugging Face config.json dict; unknown architectures are refused."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else hf.get("model_type", "?")
    if arch not in ARCHITECTURES:
      raise ValueError(
          f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in hf]
    if missing:
      raise ValueError(f"config.json lacks {missing}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    scaling = None
    rs = hf.get("rope_scaling") or None
    rope_theta = hf.get("rope_theta")
    if rs is None and isinstance(hf.get("rope_parameters"), dict):
      rs = hf["rope_parameters"]  # newer transformers spell it this way
      rope_theta = rope_theta or rs.get("rope_theta")
    if rs:
      kind = rs.get("rope_type", rs.get("type", "default"))
      if kind == "llama3":
        scaling = RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
      elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, default")
    window = None
    if arch == "MistralForCausalLM":
      window = hf.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
      window = hf.get("sliding_window")
    return cls(
        name=name,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=hf["intermediate_size"],
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        sliding_window=window,
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
    )


_L3 = RopeScaling(32.0, 1.0, 4.0, 8192)

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in [
    ModelConfig("llama3.2-1b", 128256, 2048, 16, 32, 8, 64, 8192, 500000.0,
                _L3, 1e-5, tie_embeddings=True, max_position_embeddings=131072),
    ModelConfig("llama3.2-3b", 128256, 3072, 28, 24, 8, 128, 8192, 500000.0,
                _L3, 1e-5, tie_embeddings=True, max_position_embeddings=131072),
    ModelConfig("llama3.1-8b", 128256, 4096, 32, 32, 8, 128, 14336, 500000.0,
                RopeScaling(8.0, 1.0, 4.0, 8192), 1e-5, max_position_embeddings=131072),
    ModelConfig("mistral-7b", 32000, 4096, 32, 32, 8, 128, 14336, 10000.0, None, 1e-5,
                sliding_window=4096, max_position_embeddings=32768),
    ModelConfig("qwen2.5-0.5b", 151936, 896, 24, 14, 2, 64, 4864, 1000000.0, None, 1e-6,
                tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768),
    ModelConfig("qwen2.5-1.5b", 151936, 1536, 28, 12, 2, 128, 8960, 1000000.0, None, 1e-6,
                tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768),
    ModelConfig("qwen2.5-3b", 151936, 2048, 36, 16, 2, 128, 11008, 1000000.0, None, 1e-6,
                tie_embeddings=True, qkv_bias=True, max_position_embeddings=32768),
    ModelConfig("qwen2.5-7b", 152064, 3584, 28, 28, 4, 128, 18944, 1000000.0, None, 1e-6,
                qkv_bias=True, max_position_embeddings=32768),
    ModelConfig("smollm2-135m", 49152, 576, 30, 9, 3, 64, 1536, 100000.0, None, 1e-5,
                tie_embeddings=True, max_position_embeddings=8192),
    # Small enough for interpret-mode kernels on CPU, with GQA (2 q heads per kv);
    # 320 tokens = the byte-level tokenizer's 259 rounded up.
    ModelConfig("tiny", 320, 128, 2, 4, 2, 64, 256, 10000.0, None, 1e-5,
                tie_embeddings=False, max_position_embeddings=2048),
]}


def get(name: str) -> ModelConfig:
  try:
    return CONFIGS[name]
  except KeyError:
    raise ValueError(f"unknown model config {name!r}; known: {', '.join(CONFIGS)}") from None
