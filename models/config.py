"""Model hyper-parameters: one frozen dataclass and the named configs.

``ModelConfig`` holds everything the decoder needs to build its parameters and
run; ``from_hf(config_json_dict)`` reads a Hugging Face config.json (Llama,
Mistral, Qwen2 architectures); ``get(name)`` returns a named config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# The fused gate/up matmul pairs gate and up features in blocks of this many
# (kernels.matmul.SWIGLU_BLOCK; models.llama checks they agree). A checkpoint
# whose intermediate_size is not a multiple is zero-padded at load (exact:
# the padded features are act(0) * 0 = 0 and meet zero rows of w_down).
FFN_BLOCK = 64

# hidden_act values computed (transformers' ACT2FN names); the MLP applies
# act(gate) * up. "silu" runs fused in the gate/up matmul's epilogue.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast",
               "quick_gelu", "relu")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (HF ``rope_scaling`` / ``rope_parameters``).

  rope_type "llama3": Llama-3 band-wise scaling (factor, low/high_freq_factor,
  original_max_position_embeddings). "linear": every frequency divided by
  ``factor`` (position interpolation). "dynamic": NTK scaling, which
  transformers applies only once a sequence passes max_position_embeddings:
  below it the frequencies are the plain ones, which is what is computed here,
  and the context is capped there (beyond it transformers' own result depends
  on when each key was cached). "yarn": YaRN (factor,
  original_max_position_embeddings, beta_fast, beta_slow, truncate) with cos and
  sin multiplied by ``attention_factor``.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: str = "llama3"
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES[1:]:
      raise ValueError(f"rope scaling {self.rope_type=} is not one of {ROPE_TYPES[1:]}")
    if self.factor <= 0:
      raise ValueError(f"rope scaling {self.factor=} must be positive")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
          f"rope scaling needs {self.high_freq_factor=} > {self.low_freq_factor=}")
    if self.original_max_position_embeddings <= 0 or self.attention_factor <= 0:
      raise ValueError(f"rope scaling {self.original_max_position_embeddings=} and "
                       f"{self.attention_factor=} must be positive")


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
  qkv_bias: bool = False  # Qwen2; Llama/Qwen3 attention_bias
  # Mistral/Qwen2: a query sees this many latest keys, in the layers of
  # ``sliding_layers`` (None: every layer). None: no window anywhere.
  sliding_window: int | None = None
  max_position_embeddings: int = 8192
  # Per-frequency divisors of the RoPE inverse frequencies, as GGUF files store
  # Llama-3 scaling (rope_freqs.weight); exclusive with rope_scaling.
  rope_freq_factors: tuple[float, ...] | None = None
  hidden_act: str = "silu"  # the MLP's act(gate) * up; one of ACTIVATIONS
  mlp_bias: bool = False  # Llama mlp_bias: gate, up and down projections
  o_bias: bool = False  # Llama/Qwen3 attention_bias: the output projection too
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
  # Which layers the window applies to (num_layers flags; Qwen2/3
  # max_window_layers, layer_types). None: all of them.
  sliding_layers: tuple[bool, ...] | None = None

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
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"{self.sliding_window=} must be positive or None")
    if self.sliding_layers is not None:
      if self.sliding_window is None:
        raise ValueError("sliding_layers needs a sliding_window")
      if len(self.sliding_layers) != self.num_layers or not any(self.sliding_layers):
        raise ValueError(f"sliding_layers needs {self.num_layers} flags, at least one set; "
                         f"got {self.sliding_layers}")
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: "
                       f"{', '.join(ACTIVATIONS)}")
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

  @property
  def ffn_size(self) -> int:
    """The MLP width the weights are stored with: intermediate_size rounded up
    to whole fused gate/up blocks (the extra features are zeros)."""
    return -(-self.intermediate_size // FFN_BLOCK) * FFN_BLOCK

  def layer_windows(self) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full causal attention)."""
    if self.sliding_layers is None:
      return (self.sliding_window,) * self.num_layers
    return tuple(self.sliding_window if s else None for s in self.sliding_layers)

  def layer_runs(self) -> list[tuple[int, int, int | None]]:
    """(first, end, window) of each run of consecutive layers sharing a window."""
    runs: list[tuple[int, int, int | None]] = []
    for i, w in enumerate(self.layer_windows()):
      if runs and runs[-1][2] == w:
        runs[-1] = (runs[-1][0], i + 1, w)
      else:
        runs.append((i, i + 1, w))
    return runs

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    for k in ("rope_freq_factors", "sliding_layers"):
      if d.get(k) is not None:
        d[k] = tuple(d[k])
    return cls(**d)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, hd, f = self.hidden_size, self.head_dim, self.intermediate_size
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += hd * (self.num_heads + 2 * self.num_kv_heads)
    if self.o_bias:
      attn += d
    if self.qk_norm:
      attn += 2 * hd
    per_layer = attn + 3 * d * f + 2 * d + (2 * f + d if self.mlp_bias else 0)
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + emb + d

  @classmethod
  def from_hf(cls, hf: dict[str, Any], name: str = "hf") -> "ModelConfig":
    """From a Hugging Face config.json dict. Every field is either computed or
    refused with one line naming it (``hf_fields``); unknown architectures are
    refused."""
    return _from_hf(cls, hf, name)


# ---------------------------------------------------------------- Hugging Face config.json

# Fields every supported architecture computes.
_COMMON_FIELDS = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
    "rope_theta", "rope_scaling", "rope_parameters",
    # Token ids: the tokenizer's (or, without one, models.tokenizer.NoTokenizer's).
    "bos_token_id", "eos_token_id", "pad_token_id",
})

# Fields each architecture computes on top of the common ones. A field of
# another family (say mlp_bias in a Mistral config) is refused: transformers
# would ignore it, and whoever wrote it meant something.
ARCH_FIELDS: dict[str, frozenset[str]] = {
    "LlamaForCausalLM": _COMMON_FIELDS | {"attention_bias", "mlp_bias"},
    "MistralForCausalLM": _COMMON_FIELDS | {"sliding_window"},
    "Qwen2ForCausalLM": _COMMON_FIELDS | {"use_sliding_window", "sliding_window",
                                          "max_window_layers", "layer_types"},
    "Qwen3ForCausalLM": _COMMON_FIELDS | {"attention_bias", "use_sliding_window",
                                          "sliding_window", "max_window_layers", "layer_types"},
}

# Fields with no effect on a causal LM's logits in inference: training
# settings, generation defaults (requests carry their own), bookkeeping.
INERT_FIELDS = frozenset({
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "dropout",
    "pretraining_tp",  # transformers no longer splits the matmuls: same function
    "dtype", "torch_dtype", "transformers_version", "id2label", "label2id", "num_labels",
    "problem_type", "return_dict", "output_hidden_states", "output_attentions",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "finetuning_task", "tokenizer_class", "prefix", "task_specific_params",
    "sep_token_id", "decoder_start_token_id", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "output_router_logits",
})

# Fields known to change the computation in ways not computed here, with the
# values that compute the same as their absence (and say what is supported).
REFUSED_FIELDS: dict[str, tuple[Any, str]] = {
    # compressed-tensors FP8 and fbgemm_fp8 are read by models.checkpoint.read_hf.
    "quantization_config": (None, "unquantized weights, compressed-tensors FP8 (dynamic or "
                                  "static) or fbgemm_fp8"),
    "partial_rotary_factor": (1.0, "1.0 (RoPE over the whole head)"),
    "pruned_heads": ({}, "no pruned heads"),
    "auto_map": (None, "no custom modeling code"),
    "rope_interleave": (False, "half-split RoPE (false)"),
    "attn_logit_softcapping": (None, "no softcapping"),
    "final_logit_softcapping": (None, "no softcapping"),
    "use_mrope": (False, "1-D positions (false)"),
    "rope_local_base_freq": (None, "one RoPE base"),
    "original_max_position_embeddings": (None, "it inside rope_scaling"),
    "num_experts": (None, "dense MLPs"),
    "num_local_experts": (None, "dense MLPs"),
    "attention_chunk_size": (None, "no chunked attention"),
    "query_pre_attn_scalar": (None, "1/sqrt(head_dim) attention scale"),
}

# Keys inside rope_scaling / rope_parameters each rope_type computes.
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
}

# transformers' defaults of the fields a config.json may leave out, per architecture.
_DEFAULTS = {
    "LlamaForCausalLM": dict(max_position_embeddings=2048, head_dim=None),
    "MistralForCausalLM": dict(max_position_embeddings=131072, head_dim=None,
                               sliding_window=4096),
    "Qwen2ForCausalLM": dict(max_position_embeddings=32768, head_dim=None, sliding_window=4096,
                             max_window_layers=28),
    "Qwen3ForCausalLM": dict(max_position_embeddings=32768, head_dim=128, sliding_window=4096,
                             max_window_layers=28),
}


def hf_fields(arch: str) -> dict[str, str]:
  """Every config.json field this loader knows for ``arch``, and what it does
  with it: "computed", "inert" (no effect on the logits) or "refused unless
  <supported>". Anything else is refused as unknown."""
  out = {k: "inert" for k in INERT_FIELDS}
  out.update({k: f"refused unless {why}" for k, (_, why) in REFUSED_FIELDS.items()})
  out.update({k: "computed" for k in ARCH_FIELDS[arch]})
  return out


def _refuse(field, value, supported) -> ValueError:
  return ValueError(f"config field {field}={value!r} is not supported; supported: {supported}")


def _typed(field: str, v, kind: str = "int"):
  """``v`` if it is a JSON integer (kind "int") or finite number ("number");
  else the refusal naming the field (null included: no default is guessed)."""
  if isinstance(v, bool) or not isinstance(v, int if kind == "int" else (int, float)) or (
      kind == "number" and not math.isfinite(v)):
    raise _refuse(field, v, "an integer" if kind == "int" else "a number")
  return v


def _rope(hf: dict[str, Any], max_pos: int) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from rope_scaling / rope_parameters."""
  rs = hf.get("rope_scaling")
  field = "rope_scaling"
  rope_theta = hf.get("rope_theta")
  params = hf.get("rope_parameters")
  if rs is None and params is not None:
    if not isinstance(params, dict):
      raise _refuse("rope_parameters", params, "one dict for every layer")
    rs, field = dict(params), "rope_parameters"
    if rope_theta is None:
      rope_theta = rs.get("rope_theta")
  if rs is not None and not isinstance(rs, dict):
    raise _refuse(field, rs, "an object such as {\"rope_type\": \"linear\", \"factor\": 2.0}")
  rs = dict(rs or {})
  inner = rs.pop("rope_theta", None)
  if inner is not None and rope_theta is not None and float(inner) != float(rope_theta):
    # (transformers 5 reads the dict's, older versions the top-level one)
    raise ValueError(f"config.json: rope_theta={rope_theta} and {field}.rope_theta={inner} "
                     "disagree; give one value")
  if rope_theta is None:
    rope_theta = inner
  kind = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
  rs.pop("type", None)
  if kind not in _ROPE_KEYS:
    raise _refuse(f"{field}.rope_type", kind, ", ".join(ROPE_TYPES))
  prf = rs.pop("partial_rotary_factor", 1.0)
  if prf != 1.0:
    raise _refuse(f"{field}.partial_rotary_factor", prf, "1.0 (RoPE over the whole head)")
  for k in rs:
    if k not in _ROPE_KEYS[kind]:
      raise _refuse(f"{field}.{k}", rs[k], f"rope_type {kind!r} with keys "
                    f"{sorted(_ROPE_KEYS[kind]) or 'none'}")
  theta = float(_typed("rope_theta", rope_theta, "number") if rope_theta is not None
                else 10000.0)
  if kind == "default":
    return theta, None
  need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"),
          "linear": ("factor",), "dynamic": ("factor",)}.get(kind, ())
  for k in need:
    if rs.get(k) is None:
      raise ValueError(f"config field {field} of rope_type {kind!r} needs {k}")
  for k, v in rs.items():
    if k not in ("truncate",) and v is not None:
      _typed(f"{field}.{k}", v, "number")
  factor = rs.get("factor")
  orig = int(rs.get("original_max_position_embeddings") or max_pos)
  if kind == "llama3":
    return theta, RopeScaling(float(factor), float(rs["low_freq_factor"]),
                              float(rs["high_freq_factor"]), orig, rope_type="llama3")
  if kind in ("linear", "dynamic"):
    # dynamic: transformers scales from config.max_position_embeddings on,
    # whatever original_max_position_embeddings says.
    return theta, RopeScaling(float(factor), original_max_position_embeddings=max_pos
                              if kind == "dynamic" else orig, rope_type=kind)
  # yarn, as transformers' _compute_yarn_parameters
  if factor is None:
    factor = max_pos / orig
  factor = float(factor)
  att = rs.get("attention_factor")
  if att is None:
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
  return theta, RopeScaling(factor, original_max_position_embeddings=orig, rope_type="yarn",
                            beta_fast=float(rs.get("beta_fast") or 32),
                            beta_slow=float(rs.get("beta_slow") or 1),
                            attention_factor=float(att), truncate=bool(rs.get("truncate", True)))


# transformers builds the model from model_type, vLLM from architectures:
# where both are given they must name the same one.
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _architecture(hf: dict[str, Any]) -> str:
  archs, model_type = hf.get("architectures"), hf.get("model_type")
  supported = ", ".join(ARCHITECTURES)
  if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str)
                                                                for a in archs)):
    raise _refuse("architectures", archs, f"a list of one of {supported}")
  if archs:
    if len(archs) > 1 or archs[0] not in ARCHITECTURES:
      named = archs[0] if len(archs) == 1 else archs
      raise ValueError(f"unsupported architecture {named!r}; supported: {supported}")
    arch = archs[0]
    if model_type is not None and model_type != MODEL_TYPES[arch]:
      raise ValueError(f"architectures {archs} is model_type "
                       f"{MODEL_TYPES[arch]!r}, but model_type says {model_type!r}; "
                       "transformers would build the latter: give one model")
    return arch
  by_type = {t: a for a, t in MODEL_TYPES.items()}
  if model_type not in by_type:
    raise ValueError(f"unsupported model_type {model_type!r} (and no architectures); "
                     f"supported: {', '.join(by_type)} ({supported})")
  return by_type[model_type]


def _from_hf(cls, hf: dict[str, Any], name: str) -> ModelConfig:
  arch = _architecture(hf)
  known = ARCH_FIELDS[arch]
  for k, v in hf.items():
    if k in known or k in INERT_FIELDS or k.startswith("_"):
      continue
    if k in REFUSED_FIELDS:
      if v == REFUSED_FIELDS[k][0] or v is None:
        continue
      raise _refuse(k, v, REFUSED_FIELDS[k][1])
    raise ValueError(f"config field {k}={v!r} is not one that {arch} computes here; refused "
                     "rather than ignored")
  missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                         "num_attention_heads", "intermediate_size") if k not in hf]
  if missing:
    raise ValueError(f"config.json lacks {missing}")
  get = lambda k, default=None: hf[k] if k in hf else _DEFAULTS[arch].get(k, default)
  act = hf.get("hidden_act", "silu")
  if act not in ACTIVATIONS:
    raise _refuse("hidden_act", act, ", ".join(ACTIVATIONS))
  for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings"):
    _typed(k, get(k, 8192))
  for k in ("num_key_value_heads", "head_dim", "sliding_window"):  # (null: the default)
    if get(k) is not None:
      _typed(k, get(k))
  heads = hf["num_attention_heads"]
  layers = hf["num_hidden_layers"]
  # null means hidden_size // heads (transformers' rule); a 0 is refused below.
  head_dim = get("head_dim") if get("head_dim") is not None else hf["hidden_size"] // heads
  max_pos = get("max_position_embeddings", 8192)
  eps = _typed("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), "number")
  rope_theta, scaling = _rope(hf, max_pos)
  window, sliding = None, None
  if arch == "MistralForCausalLM":
    window = get("sliding_window")
  elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and hf.get("use_sliding_window"):
    window = get("sliding_window")
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    types = hf.get("layer_types")
    if types is None:  # transformers: sliding from max_window_layers on
      n = _typed("max_window_layers", get("max_window_layers"))
      types = ["sliding_attention" if i >= n else "full_attention" for i in range(layers)]
    bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
    if bad or len(types) != layers:
      raise _refuse("layer_types", types, f"{layers} entries of full_attention / "
                    "sliding_attention")
    flags = tuple(t == "sliding_attention" for t in types)
    if window is not None and not any(flags):
      window = None
    elif window is not None and not all(flags):
      sliding = flags
  for k in ("attention_bias", "mlp_bias"):
    if not isinstance(hf.get(k, False), bool):
      raise _refuse(k, hf[k], "true or false")
  attention_bias = bool(hf.get("attention_bias", False))
  return cls(
      name=name,
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      num_layers=layers,
      num_heads=heads,
      num_kv_heads=heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
      head_dim=head_dim,
      intermediate_size=hf["intermediate_size"],
      rope_theta=rope_theta,
      rope_scaling=scaling,
      rms_norm_eps=float(eps),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
      o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and attention_bias,
      mlp_bias=bool(hf.get("mlp_bias", False)),
      qk_norm=arch == "Qwen3ForCausalLM",
      hidden_act=act,
      sliding_window=window,
      sliding_layers=sliding,
      max_position_embeddings=max_pos,
  )


_L3 = RopeScaling(32.0, 1.0, 4.0, 8192)

CONFIGS: dict[str, ModelConfig] = {c.name: c for c in [
    ModelConfig("llama3.2-1b", 128256, 2048, 16, 32, 8, 64, 8192, 500000.0,
                _L3, 1e-5, tie_embeddings=True, max_position_embeddings=131072),
    ModelConfig("llama3.2-3b", 128256, 3072, 28, 24, 8, 128, 8192, 500000.0,
                _L3, 1e-5, tie_embeddings=True, max_position_embeddings=131072),
    ModelConfig("llama3.1-8b", 128256, 4096, 32, 32, 8, 128, 14336, 500000.0,
                RopeScaling(8.0, 1.0, 4.0, 8192), 1e-5, max_position_embeddings=131072),
    # Random weights at this shape are the tensor-parallel case: 141 GB of
    # bf16 weights, half on each of two cards.
    ModelConfig("llama3.1-70b", 128256, 8192, 80, 64, 8, 128, 28672, 500000.0,
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
