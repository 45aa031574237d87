"""Config variants against transformers, and the config fields that are refused.

The oracle (hf_variants.py) wrote tiny random checkpoints (no tokenizer: they
load for token ids) of: gelu (tanh) with MLP and attention biases and an MLP
width of 160 (padded to 192 at load), exact gelu with YaRN RoPE, dynamic NTK
RoPE, Qwen2 with a window from max_window_layers on, Qwen3 (q/k norms,
head_dim independent of the hidden size, alternating window layers). Each must
match transformers in float32: logits within 1e-4 x max|logit| and the same 24
greedy tokens through models.generate, through a chunked prefill + multi-token
decode, and through the serving engine.

Every config.json field of the supported architectures is computed, inert (no
effect on the logits) or refused at load with its name.
"""

import dataclasses
import json
import math

import numpy as np
import pytest

import models
from models import config as config_lib
from models import tokenizer as tok_lib
from tests.models.test_hf_parity import _close  # the parity tests' 1e-4 x max|ref| check

PAGE = 8
VARIANTS = {  # name: what the config must say
    "llama_gelu_bias": dict(hidden_act="gelu_pytorch_tanh", mlp_bias=True, o_bias=True,
                            qkv_bias=True, intermediate_size=160, rope="linear"),
    "llama_yarn": dict(hidden_act="gelu", intermediate_size=96, rope="yarn"),
    "llama_dynamic": dict(rope="dynamic", max_position_embeddings=64),
    "qwen2_window": dict(sliding_window=8, sliding_layers=(False, True, True), qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim=32, tie_embeddings=True, sliding_window=8,
                  sliding_layers=(True, False, True), qkv_bias=False),
}


def _load(hf_variants, name):
  d = hf_variants / name
  m = models.load(d)  # the CPU default: float32
  assert m.dtype.name == "float32" and isinstance(m.tokenizer, tok_lib.NoTokenizer)
  for k, v in VARIANTS[name].items():
    got = m.config.rope_scaling.rope_type if k == "rope" else getattr(m.config, k)
    assert got == v, f"{name}: config {k}={got!r}, expected {v!r}"
  return m, np.load(d / "prompt.npy"), np.load(d / "greedy.npy"), np.load(d / "logits.npy")


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_generate_and_chunked(hf_variants, name):
  model, prompt, greedy, ref = _load(hf_variants, name)
  out, logits = models.generate(model, prompt.tolist(), len(greedy), page_size=PAGE,
                                stop_at_eos=False, return_logits=True)
  _close(logits, ref[len(prompt) - 1:], f"{name} prefill+decode logits")
  assert out == greedy.tolist(), f"{name}: greedy tokens differ"
  # All positions: a prefill in two chunks (the second over cached pages, in
  # scrambled order), then a Tq=4 decode.
  seq = np.concatenate([prompt, greedy[:-1]])
  n = len(seq)
  n_pages = -(-n // PAGE)
  pages = np.random.default_rng().permutation(np.arange(1, n_pages + 3))[:n_pages][None]
  cache = model.init_cache(n_pages + 3, PAGE)
  a, b = 13, n - 4 - 13
  l1, cache = model.prefill(cache, seq[None, :a], [0], [a], pages, all_logits=True)
  l2, cache = model.prefill(cache, seq[None, a:a + b], [a], [b], pages, all_logits=True)
  l3, cache = model.decode(cache, seq[None, a + b:], [n], pages)
  _close(np.concatenate([l1[0], l2[0], l3[0]]), ref, f"{name} chunked prefill + Tq=4 decode")


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_through_the_engine(hf_variants, name):
  from serving import engine as E
  from serving.engine import api

  model, prompt, greedy, _ = _load(hf_variants, name)
  engine = E.BatchingEngine(E.ModelRunner(model, num_pages=32, page_size=PAGE), E.EngineConfig(
      max_batch=2, batch_buckets=(2,), prefill_rows=1, min_chunk=16, prefill_chunk=16,
      max_seq_len=64, warmup=False))
  h = engine.submit(api.Request("r", prompt_ids=prompt.tolist(), add_bos=False,
                                sampling=api.SamplingParams(max_tokens=len(greedy),
                                                            ignore_eos=True)))
  while engine.step():
    pass
  ids, final = [], None
  while not h.events.empty():
    ev = h.events.get_nowait()
    assert not isinstance(ev, api.Failed), ev
    if isinstance(ev, api.Delta):
      ids.extend(ev.token_ids)
    elif isinstance(ev, api.Final):
      final = ev
  assert final is not None and ids == greedy.tolist(), f"{name}: engine greedy tokens differ"
  for kw in (dict(prompt_text="hi"), dict(messages=[("user", "hi")])):
    with pytest.raises(api.InvalidRequest, match="loaded without a tokenizer"):
      engine.submit(api.Request("t", **kw))
  if model.config.sliding_window is not None:  # no mixed step: refused, not ignored
    with pytest.raises(ValueError, match="mixed_steps: runner .* has no mixed step"):
      E.BatchingEngine(E.ModelRunner(model, num_pages=32, page_size=PAGE),
                       E.EngineConfig(max_seq_len=64, warmup=False, mixed_steps=True))


def test_activations_match_transformers(hf_variants):
  import jax.numpy as jnp

  from models import llama

  ref = json.loads((hf_variants / "acts.json").read_text())
  x = np.asarray(ref["x"], np.float32)
  assert set(ref["acts"]) == set(config_lib.ACTIVATIONS) == set(llama.ACTIVATIONS)
  for name, want in ref["acts"].items():
    got = np.asarray(llama.ACTIVATIONS[name](jnp.asarray(x)), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5, err_msg=name)


def test_dynamic_rope_is_capped_at_max_position_embeddings(hf_variants):
  model, prompt, _, _ = _load(hf_variants, "llama_dynamic")
  with pytest.raises(ValueError, match="dynamic RoPE .* max_position_embeddings=64"):
    models.generate(model, prompt.tolist(), 64 - len(prompt) + 1)


# ---------------------------------------------------------------- config fields

# config.json fields seen in the supported families' configs (transformers 4.x
# and 5.x writers, PretrainedConfig's own); hf_variants' fields.json adds the
# installed transformers' dataclass fields.
HF_FIELDS = """
_name_or_path architectures attention_bias attention_dropout bos_token_id chunk_size_feed_forward
dtype eos_token_id head_dim hidden_act hidden_size id2label initializer_range intermediate_size
is_encoder_decoder label2id layer_types max_position_embeddings max_window_layers mlp_bias
model_type num_attention_heads num_hidden_layers num_key_value_heads output_attentions
output_hidden_states pad_token_id pretraining_tp problem_type return_dict rms_norm_eps
rope_parameters rope_scaling rope_theta sliding_window tie_word_embeddings torch_dtype
transformers_version use_cache use_sliding_window vocab_size
""".split()

ARCH_OF = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
           "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


def _known(arch):
  return set(config_lib.hf_fields(arch))


def test_every_listed_field_is_computed_inert_or_refused():
  for arch in config_lib.ARCHITECTURES:
    known = _known(arch)
    assert not (config_lib.INERT_FIELDS & set(config_lib.REFUSED_FIELDS))
    assert not (config_lib.ARCH_FIELDS[arch] & set(config_lib.REFUSED_FIELDS))
    for f in HF_FIELDS:
      if f.startswith("_"):
        continue
      # A family's own fields are computed; another family's are refused (below).
      assert f in known or any(f in config_lib.ARCH_FIELDS[a] for a in config_lib.ARCHITECTURES), f


def test_transformers_config_fields_are_all_known(hf_variants):
  """Every field of the installed transformers' config classes: a field added
  there fails here until it is computed or refused."""
  fields = json.loads((hf_variants / "fields.json").read_text())
  assert set(fields) == set(ARCH_OF)
  for cls, names in fields.items():
    unknown = [f for f in names if not f.startswith("_") and f not in _known(ARCH_OF[cls])]
    assert not unknown, f"{cls} fields neither computed nor refused: {unknown}"


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 100, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 256, "rope_theta": 10000.0}

# A value of each refused field that the loader does not compute.
REFUSED_VALUES = {
    "quantization_config": {"quant_method": "gptq", "bits": 4},
    "partial_rotary_factor": 0.5,
    "pruned_heads": {"0": [1]},
    "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"},
    "rope_interleave": True,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "use_mrope": True,
    "rope_local_base_freq": 10000.0,
    "original_max_position_embeddings": 4096,
    "num_experts": 8,
    "num_local_experts": 8,
    "attention_chunk_size": 8192,
    "query_pre_attn_scalar": 256,
}


def _load_config(tmp_path, **fields):
  d = tmp_path / "cfg"
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(json.dumps({**BASE, **fields}))
  return models.load(d)


@pytest.mark.parametrize("field", sorted(config_lib.REFUSED_FIELDS))
def test_refused_field_fails_the_load_naming_it(tmp_path, field):
  value = REFUSED_VALUES[field]
  with pytest.raises(ValueError, match=f"config field {field}=.* is not supported; supported: "):
    _load_config(tmp_path, **{field: value})
  # At its neutral value the field computes the same as without it: no refusal
  # (the load then stops at the missing weights).
  with pytest.raises(FileNotFoundError, match="no \\*\\.safetensors"):
    _load_config(tmp_path, **{field: config_lib.REFUSED_FIELDS[field][0]})


def test_refused_values(tmp_path):
  assert set(REFUSED_VALUES) == set(config_lib.REFUSED_FIELDS)
  cases = [
      (dict(hidden_act="gelu_10"), r"hidden_act='gelu_10' is not supported; supported: silu"),
      (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
       r"rope_scaling.rope_type='longrope' is not supported; supported: default, linear"),
      (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0,
                             "rope_theta": 1e4}),
       r"rope_parameters.low_freq_factor=1.0 is not supported"),
      (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.25}),
       r"rope_parameters.partial_rotary_factor=0.25 is not supported"),
      (dict(mlp_bias="yes"), r"mlp_bias='yes' is not supported; supported: true or false"),
      (dict(some_new_field=3), r"config field some_new_field=3 is not one that LlamaForCausalLM"),
      (dict(architectures=["MistralForCausalLM"], mlp_bias=True),
       r"config field mlp_bias=True is not one that MistralForCausalLM computes"),
      (dict(architectures=["Qwen2ForCausalLM"], layer_types=["full_attention", "chunked"]),
       r"config field layer_types=.* is not supported; supported: 2 entries"),
      (dict(architectures=["LlamaForCausalLM", "MistralForCausalLM"]),
       r"unsupported architecture"),
  ]
  for fields, msg in cases:
    with pytest.raises(ValueError, match=msg):
      _load_config(tmp_path, **fields)


@pytest.mark.parametrize("fields, msg", [
    # a missing or null value is refused by name, never a TypeError / KeyError
    (dict(rope_scaling={"rope_type": "linear"}), r"rope_scaling of rope_type 'linear' needs factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     r"rope_type 'llama3' needs low_freq_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}),
     r"rope_scaling.factor='2' is not supported; supported: a number"),
    (dict(rope_scaling="linear"), r"rope_scaling='linear' is not supported; supported: an object"),
    (dict(rms_norm_eps=None), r"rms_norm_eps=None is not supported; supported: a number"),
    (dict(max_position_embeddings=None), r"max_position_embeddings=None is not supported"),
    (dict(num_attention_heads=4.0), r"num_attention_heads=4.0 is not supported"),
    (dict(architectures=["Qwen2ForCausalLM"], max_window_layers=None),
     r"max_window_layers=None is not supported"),
    # 0 is no default: it was replaced by the head count / hidden_size // heads
    (dict(num_key_value_heads=0), r"num_kv_heads must be a positive int, got 0"),
    (dict(head_dim=0), r"head_dim must be a positive int, got 0"),
    # transformers builds the model from model_type, vLLM from architectures
    (dict(architectures=["MistralForCausalLM"], model_type="llama"),
     r"architectures \['MistralForCausalLM'\] is model_type 'mistral', but model_type says "
     r"'llama'"),
    (dict(architectures="LlamaForCausalLM"), r"architectures='LlamaForCausalLM' is not "
     r"supported; supported: a list of one of"),
    (dict(architectures=None, model_type="gpt2"), r"unsupported model_type 'gpt2'"),
])
def test_malformed_values_are_refused_by_name(fields, msg):
  with pytest.raises(ValueError, match=msg):
    config_lib.ModelConfig.from_hf({**BASE, **fields})


def test_model_type_alone_names_the_architecture():
  """No architectures: model_type says which (as AutoModelForCausalLM reads it)."""
  base = {k: v for k, v in BASE.items() if k != "architectures"}
  for model_type, arch_window in (("llama", None), ("mistral", 4096), ("qwen3", None)):
    m = config_lib.ModelConfig.from_hf({**base, "model_type": model_type})
    assert m.sliding_window == arch_window and m.qk_norm == (model_type == "qwen3")
  assert config_lib.ModelConfig.from_hf({**BASE, "model_type": "llama"}).sliding_window is None


def test_rope_theta_in_two_places_must_agree():
  """rope_theta beside rope_parameters.rope_theta: transformers 5 reads the
  dict's, older versions the top-level one; two values are refused, one is
  read wherever it is."""
  f = lambda **kw: config_lib.ModelConfig.from_hf({**BASE, **kw})  # noqa: E731
  default = {"rope_type": "default"}
  assert f(rope_theta=100.0, rope_parameters=default).rope_theta == 100.0
  assert f(rope_theta=None, rope_parameters={**default, "rope_theta": 500.0}).rope_theta == 500.0
  assert f(rope_theta=500.0, rope_parameters={**default, "rope_theta": 500.0}).rope_theta == 500.0
  with pytest.raises(ValueError, match=r"rope_theta=100.0 and rope_parameters.rope_theta=10000"):
    f(rope_theta=100.0, rope_parameters={**default, "rope_theta": 10000.0})


def test_config_defaults_and_padding():
  f = lambda **kw: config_lib.ModelConfig.from_hf({**BASE, **kw})
  assert f().intermediate_size == 100 and f().ffn_size == 128
  # transformers' defaults for fields left out: Mistral's window, Qwen3's head_dim
  base = {k: v for k, v in BASE.items() if k not in ("head_dim", "max_position_embeddings")}
  m = config_lib.ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"]})
  assert m.sliding_window == 4096 and m.sliding_layers is None and m.head_dim == 16
  assert m.max_position_embeddings == 131072
  m = config_lib.ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"],
                                      "sliding_window": None})
  assert m.sliding_window is None
  q = config_lib.ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"]})
  assert q.head_dim == 128 and q.qk_norm and q.sliding_window is None
  # Qwen2: the window only from max_window_layers on; none when that is past the last layer
  q2 = dict(base, architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=32)
  assert config_lib.ModelConfig.from_hf({**q2, "max_window_layers": 1}).layer_windows() == (
      None, 32)
  assert config_lib.ModelConfig.from_hf({**q2, "max_window_layers": 0}).sliding_layers is None
  assert config_lib.ModelConfig.from_hf(q2).sliding_window is None  # default 28 >= 2 layers
  # yarn's attention factor, as transformers infers it
  y = f(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 64}).rope_scaling
  assert math.isclose(y.attention_factor, 0.1 * math.log(4.0) + 1.0)
  # a saved config (orbax model.json) comes back equal
  c = f(mlp_bias=True, rope_scaling={"rope_type": "yarn", "factor": 2.0})
  assert config_lib.ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
  assert dataclasses.replace(c, sliding_window=8, sliding_layers=(True, False)).layer_runs() == [
      (0, 1, 8), (1, 2, None)]
