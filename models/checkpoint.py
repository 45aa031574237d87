"""Checkpoints: Hugging Face folders, GGUF files, our own orbax directories.

Every reader produces ``(ModelConfig, pure params dict, Tokenizer)``; the pure
dict has the nesting of ``nnx.state(Llama)`` (``embed``, ``layers.attn.wqkv.w``,
..., stacked layer weights [num_layers, ...], matrices [in, out]), with host
numpy arrays that ``models.model`` turns into device arrays of the chosen dtype.
q/k/v and gate/up are stored fused (``fuse_qkv``, ``fuse_gate_up``; the
``split_*`` functions undo it): readers combine the source's separate tensors.

- HF: config.json + model.safetensors or sharded model-0000x-of-0000y.safetensors
  (+ model.safetensors.index.json). torch Linear weights are [out, in]: they
  are transposed. safetensors are read with our own header parser into numpy
  memory maps (bf16 through ml_dtypes), one tensor at a time. An fp8
  checkpoint in the ``compressed-tensors`` layout (``quantization_config``:
  float8 weights with a scale per output channel, activations quantized
  dynamically per token; vLLM's "FP8-dynamic") is dequantized here
  (w * weight_scale) and loads as ``quantization="fp8"`` (``hf_quantization``)
  with its scales as the params' ``w_scale`` (float32), which quantizes it
  back with them: the fp8 values as written (the dequantized value's
  rounding in --dtype is far under half an fp8 step).
  The ``fbgemm_fp8`` layout (transformers' FbgemmFp8Config: the same
  weights and scales, activations per token with their amax bounded by
  ``activation_scale_ub``) loads the same way, the bound kept; so does
  compressed-tensors' static scheme (weights per tensor, each linear's
  activations at its static ``input_scale``: the params' ``in_scale``).
- GGUF: the ``gguf`` package reads and dequantizes; llama.cpp stores the Q and
  K rows of "llama" models permuted for interleaved RoPE, which is undone here
  since our RoPE rotates the two halves of a head.
- orbax: ``save(dir, model)`` writes params (orbax StandardCheckpointer),
  model.json (our config + tokenizer kind) and the tokenizer files.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Callable, NamedTuple

import ml_dtypes
import numpy as np

from kernels import matmul as mm
from models import tokenizer as tok_lib
from models.config import ModelConfig, RopeScaling

_ST_DTYPES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


def _progress(iterable, total, desc):
  try:
    from tqdm import tqdm
  except ImportError:  # progress is a nicety
    return iterable
  return tqdm(iterable, total=total, desc=desc, unit="tensor", disable=None, leave=False)


# ---------------------------------------------------------------- params tree


def fuse_qkv(q, k, v, cfg: ModelConfig):
  """q [..., Hq*hd], k/v [..., Hkv*hd] -> [..., Hkv*(G+2)*hd] in the model's
  wqkv column order: per kv head, its G query heads, then k, then v."""
  hd, hkv = cfg.head_dim, cfg.num_kv_heads
  lead = q.shape[:-1]
  parts = [q.reshape(*lead, hkv, cfg.q_per_kv, hd), k.reshape(*lead, hkv, 1, hd),
           v.reshape(*lead, hkv, 1, hd)]
  return np.concatenate(parts, axis=-2).reshape(*lead, -1)


def split_qkv(wqkv, cfg: ModelConfig):
  """Inverse of ``fuse_qkv``: (q, k, v)."""
  hd, hkv, g = cfg.head_dim, cfg.num_kv_heads, cfg.q_per_kv
  lead = wqkv.shape[:-1]
  y = np.asarray(wqkv).reshape(*lead, hkv, g + 2, hd)
  return (y[..., :g, :].reshape(*lead, -1), y[..., g, :].reshape(*lead, -1),
          y[..., g + 1, :].reshape(*lead, -1))


# Column order of the fused gate/up matrix, recorded in model.json. "pairs"
# (gate and up side by side per feature) is what directories written before
# the matmul fused the SwiGLU hold; they are converted when read.
GATE_UP_LAYOUT = f"swiglu{mm.SWIGLU_BLOCK}"


def fuse_gate_up(gate, up):
  """gate/up [..., F] -> [..., 2F] in the order the matmul's fused SwiGLU
  reads: blocks of SWIGLU_BLOCK gate columns, each followed by its up columns."""
  return mm.swiglu_columns(np.asarray(gate), np.asarray(up))


def split_gate_up(w):
  """Inverse of ``fuse_gate_up``: (gate, up)."""
  return mm.swiglu_split(np.asarray(w))


def _gate_up_from_pairs(w):
  """A fused gate/up matrix in the older "pairs" order, in today's order."""
  y = np.asarray(w).reshape(*w.shape[:-1], -1, 2)
  return fuse_gate_up(y[..., 0], y[..., 1])


def unfused_layers(params: dict, cfg: ModelConfig) -> dict[str, Any]:
  """The stacked layer matrices as separate wq/wk/wv [n, D, out], w_gate/w_up
  [n, D, F] and w_down [n, F, D] (F = intermediate_size, without the zero
  padding of ``ModelConfig.ffn_size``; and the qkv biases bq/bk/bv when
  present), for writing other formats."""
  attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
  f = cfg.intermediate_size
  out = dict(zip(("wq", "wk", "wv"), split_qkv(attn["wqkv"]["w"], cfg)))
  if "b" in attn["wqkv"]:
    out.update(zip(("bq", "bk", "bv"), split_qkv(attn["wqkv"]["b"], cfg)))
  out.update(zip(("w_gate", "w_up"), (w[..., :f] for w in split_gate_up(mlp["w_gate_up"]["w"]))))
  out["w_down"] = np.asarray(mlp["w_down"]["w"])[..., :f, :]
  return out


def _pad_ffn(a, axis: int, cfg: ModelConfig):
  """``a`` with its FFN axis zero-padded from intermediate_size to ffn_size
  (exact: a padded feature is act(0 + 0) * 0 = 0 and meets a zero row of w_down)."""
  a = np.asarray(a)
  extra = cfg.ffn_size - a.shape[axis]
  if extra <= 0:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, extra)
  return np.pad(a, widths)


# Names of quantization tensors (scales, zero points, bounds, group indices):
# a checkpoint holding one that its scheme does not read is refused.
_QUANT_SUFFIXES = ("_scale", "_zero_point", "_scale_ub", "g_idx", "_global_scale")

# Leaves of an fp8 checkpoint's scales, kept float32 whatever --dtype is.
FP8_SCALES = ("w_scale", "in_scale")

# Fused leaves: (source leaves, combine(arrays, cfg)).
_FUSED = {
    "layers.attn.wqkv.w": (("wq.w", "wk.w", "wv.w"), lambda a, cfg: fuse_qkv(*a, cfg)),
    "layers.attn.wqkv.b": (("wq.b", "wk.b", "wv.b"), lambda a, cfg: fuse_qkv(*a, cfg)),
    "layers.mlp.w_gate_up.w": (("w_gate.w", "w_up.w"),
                               lambda a, cfg: fuse_gate_up(*(_pad_ffn(x, -1, cfg) for x in a))),
    "layers.mlp.w_gate_up.b": (("w_gate.b", "w_up.b"),
                               lambda a, cfg: fuse_gate_up(*(_pad_ffn(x, -1, cfg) for x in a))),
    # An fp8 checkpoint's weight scales, per output feature: fused as biases
    # are (padded FFN features get 0, which quantize_params reads as 1).
    "layers.attn.wqkv.w_scale": (("wq.w_scale", "wk.w_scale", "wv.w_scale"),
                                 lambda a, cfg: fuse_qkv(*a, cfg)),
    "layers.mlp.w_gate_up.w_scale": (("w_gate.w_scale", "w_up.w_scale"),
                                     lambda a, cfg: fuse_gate_up(
                                         *(_pad_ffn(x, -1, cfg) for x in a))),
    # Static fp8 input scales: the fused matmul quantizes its one input once,
    # with the largest of its parts' scales (as vLLM does).
    "layers.attn.wqkv.in_scale": (("wq.in_scale", "wk.in_scale", "wv.in_scale"),
                                  lambda a, cfg: np.max(a)),
    "layers.mlp.w_gate_up.in_scale": (("w_gate.in_scale", "w_up.in_scale"),
                                      lambda a, cfg: np.max(a)),
}
# Leaves whose FFN axis is padded to ffn_size as they are read: (leaf, axis).
_FFN_ROWS = {"layers.mlp.w_down.w": 0}


def _fused_parts(key: str) -> list[str]:
  """The unfused leaf paths a fused leaf is made of ("layers.attn.wq.w", ...)."""
  base = key.rsplit(".", 2)[0]
  return [f"{base}.{p}" for p in _FUSED[key][0]]


def _target(cfg: ModelConfig, fused: bool = True, w_scales: bool = False,
            in_scales: bool = False) -> dict[str, Any]:
  """Shapes of our params tree, nested like nnx.state(Llama); ``fused=False``:
  the layout before q/k/v and gate/up were fused (older orbax directories);
  ``w_scales``: an fp8 checkpoint's weight scales per output feature of the
  layer linears; ``in_scales``: their static input scales (one a layer)."""
  d, hd, f, n = cfg.hidden_size, cfg.head_dim, cfg.ffn_size, cfg.num_layers
  lin = lambda i, o, bias=False: {"w": (n, i, o), **({"b": (n, o)} if bias else {}),
                                  **({"w_scale": (n, o)} if w_scales else {}),
                                  **({"in_scale": (n,)} if in_scales else {})}
  if fused:
    attn = {"wqkv": lin(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.qkv_bias)}
    if cfg.qk_norm:
      attn.update(q_norm=(n, hd), k_norm=(n, hd))
    mlp = {"w_gate_up": lin(d, 2 * f, cfg.mlp_bias)}
  else:
    attn = {"wq": lin(d, cfg.num_heads * hd, cfg.qkv_bias),
            "wk": lin(d, cfg.num_kv_heads * hd, cfg.qkv_bias),
            "wv": lin(d, cfg.num_kv_heads * hd, cfg.qkv_bias)}
    mlp = {"w_gate": lin(d, f), "w_up": lin(d, f)}
  tree = {
      "embed": (cfg.vocab_size, d),
      "layers": {
          "attn_norm": {"w": (n, d)},
          "attn": {**attn, "wo": lin(cfg.num_heads * hd, d, cfg.o_bias)},
          "mlp_norm": {"w": (n, d)},
          "mlp": {**mlp, "w_down": lin(f, d, cfg.mlp_bias)},
      },
      "final_norm": {"w": (d,)},
  }
  if not cfg.tie_embeddings:
    tree["lm_head"] = {"w": (d, cfg.vocab_size)}
  return tree


def _fill(cfg: ModelConfig, get: Callable[[str, int | None], np.ndarray], names: dict,
          dtype, source: str, desc: str, w_scales: bool = False,
          in_scales: bool = False) -> dict[str, Any]:
  """Builds the params tree; ``names`` maps our leaf path to a source name
  (with "{i}" for the layer), ``get(name, layer)`` returns the tensor already
  in our orientation. A fused leaf reads its parts (``_FUSED``) and combines them."""
  target = _target(cfg, w_scales=w_scales, in_scales=in_scales)
  out: dict[str, Any] = {}
  leaves = []

  def walk(t, prefix):
    for k, v in t.items():
      if isinstance(v, dict):
        walk(v, prefix + (k,))
      else:
        leaves.append((prefix + (k,), v))

  walk(target, ())
  per_layer = [p for p in leaves if p[0][0] == "layers"]
  total = len(leaves) - len(per_layer) + len(per_layer) * cfg.num_layers
  bar = _progress(range(total), total, desc)
  it = iter(bar)
  for path, shape in leaves:
    key = ".".join(path)
    name = names.get(key) or " + ".join(names[k] for k in _fused_parts(key))
    if path[0] == "layers":
      # (fp8 scales stay float32: they are the fp8 matmul's.)
      arr = np.empty(shape, np.float32 if path[-1] in FP8_SCALES else dtype)
      for i in range(cfg.num_layers):
        if key in _FUSED:
          part = [get(names[k].format(i=i), i) for k in _fused_parts(key)]
          _check_parts(key, part, [names[k].format(i=i) for k in _fused_parts(key)], cfg,
                       source)
          layer = _FUSED[key][1](part, cfg)
        else:
          layer = get(name.format(i=i), i)
          if key in _FFN_ROWS and layer.shape[_FFN_ROWS[key]] == cfg.intermediate_size:
            layer = _pad_ffn(layer, _FFN_ROWS[key], cfg)
        arr[i] = _checked(layer, shape[1:], name.format(i=i), source)
        next(it, None)
    else:
      arr = _checked(get(name, None), shape, name, source).astype(dtype)
      next(it, None)
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = arr
  if hasattr(bar, "close"):
    bar.close()
  return out


def _check_parts(key: str, arrays, names: list[str], cfg: ModelConfig, source: str) -> None:
  """A fused leaf's parts (one layer's q/k/v or gate/up), each checked against
  the config before they are combined: a wrong width would otherwise be
  reshaped into the wrong heads, or zero-padded up to the MLP's width."""
  d, hd = cfg.hidden_size, cfg.head_dim
  if key.endswith(".in_scale"):
    return  # scalars (checked as they are read; w_scale: as a bias)
  if key.startswith("layers.attn.wqkv"):
    widths = [(cfg.num_heads * hd,), (cfg.num_kv_heads * hd,), (cfg.num_kv_heads * hd,)]
  else:  # gate, up: the checkpoint's intermediate_size (or already padded to ffn_size)
    widths = [(cfg.intermediate_size, cfg.ffn_size)] * 2
  for a, name, ws in zip(arrays, names, widths):
    shapes = [((d, w) if key.endswith(".w") else (w,)) for w in ws]
    if tuple(np.shape(a)) not in shapes:
      raise ValueError(f"{source}: tensor {name!r} has shape {tuple(np.shape(a))}, the "
                       f"config implies {shapes[0]}")


def _checked(arr, shape, name, source):
  if tuple(arr.shape) != tuple(shape):
    raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                     f"the config implies {tuple(shape)}")
  return arr


# ---------------------------------------------------------------- Hugging Face


class _SafetensorsFile:
  """Header + memory map of one .safetensors file."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    try:
      with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n < (1 << 30):
          raise ValueError(f"header length {n}")
        header = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    self.header = header
    self.offset = 8 + n
    self._mm = None
    size = path.stat().st_size - self.offset
    for name, info in header.items():  # (a cut or edited file: named here, not in a reshape)
      try:
        a, b = info["data_offsets"]
        count = math.prod(info["shape"])
        width = np.dtype(_ST_DTYPES[info["dtype"]]).itemsize if info["dtype"] in _ST_DTYPES \
            else None
      except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name!r} has no readable dtype, shape and "
                         "data_offsets in the header") from None
      if not 0 <= a <= b <= size or (width is not None and b - a != count * width):
        raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}) needs "
                         f"bytes {a}..{b} of {size} after the header; the file is cut short "
                         "or its header is wrong")

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}; "
                       f"supported: {', '.join(_ST_DTYPES)}")
    if self._mm is None:
      self._mm = np.memmap(self.path, np.uint8, mode="r")
    a, b = info["data_offsets"]
    raw = self._mm[self.offset + a:self.offset + b]
    return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _hf_names(cfg: ModelConfig) -> dict[str, str]:
  p = "model.layers.{i}."
  names = {
      "embed": "model.embed_tokens.weight",
      "layers.attn_norm.w": p + "input_layernorm.weight",
      "layers.mlp_norm.w": p + "post_attention_layernorm.weight",
      "final_norm.w": "model.norm.weight",
      "lm_head.w": "lm_head.weight",
  }
  for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
    names[f"layers.attn.{ours}.w"] = p + f"self_attn.{theirs}.weight"
    names[f"layers.attn.{ours}.b"] = p + f"self_attn.{theirs}.bias"
  for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
    names[f"layers.mlp.{ours}.w"] = p + f"mlp.{theirs}.weight"
    names[f"layers.mlp.{ours}.b"] = p + f"mlp.{theirs}.bias"
  for ours, theirs in (("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"),
                       ("attn.wv", "self_attn.v_proj"), ("attn.wo", "self_attn.o_proj"),
                       ("mlp.w_gate", "mlp.gate_proj"), ("mlp.w_up", "mlp.up_proj"),
                       ("mlp.w_down", "mlp.down_proj")):
    names[f"layers.{ours}.in_scale"] = p + f"{theirs}.input_scale"  # static fp8
    names[f"layers.{ours}.w_scale"] = p + f"{theirs}.weight_scale"  # fp8
  names["layers.attn.q_norm"] = p + "self_attn.q_norm.weight"  # Qwen3
  names["layers.attn.k_norm"] = p + "self_attn.k_norm.weight"
  return names


_FP8_FORMAT = {"num_bits": 8, "type": "float", "symmetric": True}
# compressed-tensors keys that are read (or bookkeeping: status, ratios, the
# version), and a scheme's keys; any other is refused unless null.
_CT_KEYS = {"quant_method", "format", "ignore", "kv_cache_scheme", "config_groups",
            "quantization_status", "global_compression_ratio", "version", "sparsity_config",
            "transform_config"}
_CT_SCHEME_KEYS = {"num_bits", "type", "symmetric", "strategy", "dynamic", "group_size",
                   "block_structure", "observer", "observer_kwargs"}


class HFQuantization(NamedTuple):
  """What an HF checkpoint's ``quantization_config`` computes, in our terms."""
  method: str  # a models.llama.QUANTIZATIONS value
  # Activation scales: static per-tensor (each linear's input_scale), or
  # dynamic per token with fbgemm_fp8's bound on a row's amax (or none).
  static_activations: bool = False
  activation_scale_ub: float | None = None


# transformers' FbgemmFp8Config default, which it applies when the key is absent.
FBGEMM_DEFAULT_UB = 1200.0


def _fp8_scheme(qc: dict, source: str) -> HFQuantization:
  """The quantization of a ``quantization_config`` we compute as written
  (compressed-tensors: fp8 weights per output channel or per tensor, fp8
  activations dynamic per token or static per tensor, only lm_head left out,
  no KV-cache scheme; fbgemm_fp8: weights per channel, activations per token
  with a bound on their amax), else a ValueError naming the field that
  differs."""
  bad = lambda why: ValueError(
      f"{source}: config field quantization_config={qc!r} is not supported; supported: "
      "compressed-tensors FP8 (fp8 weights with a scale per output channel or per tensor, "
      "activations dynamic per token or static per tensor) or fbgemm_fp8; here " + why)
  if isinstance(qc, dict) and qc.get("quant_method") == "fbgemm_fp8":
    return _fbgemm_scheme(qc, bad)
  if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
    raise bad(f"quant_method={qc.get('quant_method') if isinstance(qc, dict) else qc!r}")
  # Every key is computed, or is bookkeeping that does not change the math;
  # any other (transforms, sparsity, a key of a newer version) is refused.
  for k in set(qc) - _CT_KEYS:
    raise bad(f"{k}={qc[k]!r} (not read here)")
  for k in ("sparsity_config", "transform_config"):
    if qc.get(k):
      raise bad(f"{k}={qc[k]!r}")
  if "lm_head" not in (qc.get("ignore") or []):
    raise bad(f"ignore={qc.get('ignore')!r} (lm_head must be left out: it runs in --dtype)")
  if qc.get("format") not in (None, "float-quantized", "naive-quantized"):
    raise bad(f"format={qc.get('format')!r}")
  if qc.get("kv_cache_scheme") is not None:
    raise bad(f"kv_cache_scheme={qc['kv_cache_scheme']!r} (use --kv-cache-dtype)")
  if set(qc.get("ignore") or []) - {"lm_head"}:
    raise bad(f"ignore={qc['ignore']!r} (only lm_head may stay unquantized)")
  groups = qc.get("config_groups") or {}
  if not isinstance(groups, dict) or len(groups) != 1:
    raise bad(f"config_groups={groups!r} (one group, a mapping, is supported)")
  (group,) = groups.values()
  if not isinstance(group, dict):
    raise bad(f"config_groups' group is {group!r} (a mapping of its schemes)")
  for k in set(group) - {"targets", "weights", "input_activations", "output_activations",
                         "format"}:
    raise bad(f"config_groups.{k}={group[k]!r} (not read here)")
  if group.get("format") not in (None, "float-quantized", "naive-quantized"):
    raise bad(f"config_groups.format={group.get('format')!r}")
  w, x = group.get("weights") or {}, group.get("input_activations") or {}
  for what, d in (("weights", w), ("input_activations", x)):
    if not isinstance(d, dict):
      raise bad(f"{what}={d!r} (a mapping)")
    for k in set(d) - _CT_SCHEME_KEYS:
      if d[k] not in (None, False):
        raise bad(f"{what}.{k}={d[k]!r} (not read here)")
  if set(group.get("targets") or []) != {"Linear"}:
    raise bad(f"targets={group.get('targets')!r} (every Linear is)")
  # Static activations are per tensor, dynamic ones per token.
  static = x.get("dynamic") is False
  for what, d, want in (
      ("weights", w, dict(_FP8_FORMAT, strategy=("channel", "tensor"), dynamic=False)),
      ("input_activations", x, dict(_FP8_FORMAT, strategy="tensor" if static else "token",
                                    dynamic=not static))):
    for k, v in want.items():
      if d.get(k) not in (v if isinstance(v, tuple) else (v,)):
        raise bad(f"{what}.{k}={d.get(k)!r} (supported: {v!r})")
    if d.get("group_size") is not None or d.get("block_structure") is not None:
      raise bad(f"{what} are grouped or blocked")
  if group.get("output_activations") is not None:
    raise bad("output_activations are quantized")
  return HFQuantization("fp8", static_activations=static)


def _fbgemm_scheme(qc: dict, bad) -> HFQuantization:
  for k in set(qc) - {"quant_method", "activation_scale_ub", "modules_to_not_convert"}:
    raise bad(f"{k}={qc[k]!r} (not read here)")
  names = qc.get("modules_to_not_convert") or []
  if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
    raise bad(f"modules_to_not_convert={names!r} (a list of module names)")
  # lm_head is never converted (transformers adds it, vLLM's head is not a
  # Linear); a layer's projection left in 16 bits is not supported: every
  # layer's four projections are fp8 here.
  skipped = set(names) - {"lm_head"}
  if skipped:
    raise bad(f"modules_to_not_convert={sorted(skipped)!r} (only lm_head may stay "
              "unquantized)")
  ub = qc.get("activation_scale_ub", FBGEMM_DEFAULT_UB)
  if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not 0 < ub < float("inf"):
    raise bad(f"activation_scale_ub={ub!r} (a positive finite number)")
  return HFQuantization("fp8", activation_scale_ub=float(ub))


def hf_quantization(folder) -> HFQuantization | None:
  """The weight quantization an HF folder's config.json declares, None for
  unquantized weights; a scheme not computed here is a ValueError."""
  path = pathlib.Path(folder) / "config.json"
  try:
    qc = json.loads(path.read_text()).get("quantization_config")
  except (OSError, json.JSONDecodeError, AttributeError):
    return None  # read_hf says what is wrong with the folder
  return None if qc is None else _fp8_scheme(qc, str(path))


def read_hf(folder, dtype=np.float32, tokenizer: bool = True
            ) -> tuple[ModelConfig, dict, tok_lib.Tokenizer]:
  """``tokenizer``: read the folder's tokenizer (a NoTokenizer, token ids
  only, where it has none); False: a NoTokenizer regardless."""
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"{folder}: not a directory")
  cfg_path = folder / "config.json"
  if not cfg_path.exists():
    raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
  try:
    hf = json.loads(cfg_path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
  fp8 = isinstance(hf, dict) and hf.get("quantization_config") is not None
  if fp8:  # what it declares is computed here (or refused by name)
    scheme = _fp8_scheme(hf["quantization_config"], str(cfg_path))
    hf = {k: v for k, v in hf.items() if k != "quantization_config"}
  try:
    cfg = ModelConfig.from_hf(hf, name=folder.name)
  except ValueError as e:
    raise ValueError(f"{cfg_path}: {e}") from None
  if tokenizer and tok_lib.has_tokenizer(folder):
    tok = tok_lib.from_folder(folder)
  else:
    if tokenizer:
      import logging

      logging.getLogger(__name__).warning(
          "%s: no tokenizer (tokenizer.json / tokenizer.model): loaded for token-id prompts only",
          folder)
    tok = tok_lib.no_tokenizer(folder, hf)

  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{folder}: no *.safetensors weights (only safetensors are read)")
  index: dict[str, _SafetensorsFile] = {}
  for f in files:
    st = _SafetensorsFile(f)
    for name in st.header:
      index[name] = st
  if cfg.tie_embeddings is False and "lm_head.weight" not in index:
    # (Tying the head to the embedding here would be a different model than
    # the config names: refused, as vLLM refuses weights it cannot load.)
    raise ValueError(f"{folder}: config.json says tie_word_embeddings false, but no "
                     f"lm_head.weight is in {', '.join(f.name for f in files)}; if the output "
                     "head is the embedding, set tie_word_embeddings true")

  if cfg.tie_embeddings and "lm_head.weight" in index and "model.embed_tokens.weight" in index:
    head, embed = (index[k].get(k) for k in ("lm_head.weight", "model.embed_tokens.weight"))
    if head.shape != embed.shape or not np.array_equal(head, embed):
      # (transformers 5 keeps such a head, older versions overwrite it with
      # the embedding: which model was meant is not ours to guess.)
      raise ValueError(f"{folder}: config.json says tie_word_embeddings true, but "
                       "lm_head.weight differs from model.embed_tokens.weight; set "
                       "tie_word_embeddings false to use lm_head.weight")

  read = set()

  def get(name, layer):
    del layer
    if name not in index:
      raise ValueError(f"{folder}: tensor {name!r} missing from {', '.join(f.name for f in files)}")
    read.add(name)
    a = index[name].get(name)
    if name.endswith(".weight_scale"):  # per output feature (one per tensor: broadcast)
      weight = name.removesuffix("_scale")
      out = index[weight].header[weight]["shape"][0] if weight in index else -1
      s = np.asarray(a, np.float32)
      if s.size not in (1, out):
        raise ValueError(f"{folder}: {name!r} has shape {s.shape}; a scale per output "
                         f"channel of {weight!r} is [{out}, 1], one per tensor [1]")
      return np.broadcast_to(_positive(s, name).reshape(-1), (out,))
    if name.endswith(".input_scale"):
      return _positive(np.asarray(a, np.float32), name, "a static input scale is one value"
                       ).reshape(())
    if a.dtype == ml_dtypes.float8_e4m3fn:
      a = _dequantized(a, name)
      _check_input_scale_ub(name)
    elif fp8 and ".layers." in name and name.endswith("_proj.weight"):
      raise ValueError(f"{folder}: tensor {name!r} is {a.dtype}, but config.json's "
                       "quantization_config makes every layer linear fp8 (a projection left "
                       "in 16 bits is not supported)")
    if a.ndim == 2 and not name.endswith("embed_tokens.weight"):
      a = a.T  # torch Linear [out, in] -> ours [in, out]
    return a

  def _check_input_scale_ub(name):
    # fbgemm_fp8 stores the config's bound beside each weight too; one that
    # differs would be a bound this model does not apply.
    ub_name = name.removesuffix("weight") + "input_scale_ub"
    if ub_name not in index:
      return
    read.add(ub_name)
    ub = np.asarray(index[ub_name].get(ub_name), np.float32).ravel()
    want = scheme.activation_scale_ub
    if want is None or ub.size != 1 or not np.isclose(ub[0], want, rtol=1e-6):
      raise ValueError(f"{folder}: {ub_name!r} is {ub.tolist()}, but config.json's "
                       f"quantization_config has activation_scale_ub={want!r}; the bound is "
                       "one value for every layer here")

  def _dequantized(a, name):
    scale_name = name + "_scale"
    if not fp8 or scale_name not in index:
      raise ValueError(f"{folder}: tensor {name!r} is float8_e4m3fn without "
                       f"{'a quantization_config' if not fp8 else repr(scale_name)}")
    s = np.asarray(index[scale_name].get(scale_name), np.float32)
    if s.size not in (1, a.shape[0]) or a.ndim != 2:
      raise ValueError(f"{folder}: {scale_name!r} has shape {s.shape}; a scale per output "
                       f"channel of {name!r} {a.shape} is [{a.shape[0]}, 1], one per tensor [1]")
    s = _positive(s, scale_name)
    read.add(scale_name)
    out = a.astype(np.float32) * s.reshape(-1, 1)
    if not np.isfinite(out).all():
      raise ValueError(f"{folder}: {name!r} holds NaN (fp8 has no inf)")
    return out

  def _positive(s, name, one=None):
    if one is not None and s.size != 1:
      raise ValueError(f"{folder}: {name!r} has shape {s.shape}; {one}")
    if not (np.isfinite(s).all() and (s > 0).all()):
      raise ValueError(f"{folder}: {name!r} holds values that are not finite and "
                       f"positive (e.g. {s[~(np.isfinite(s) & (s > 0))].ravel()[0]})")
    return s

  params = _fill(cfg, get, _hf_names(cfg), dtype, str(folder), "loading safetensors",
                 w_scales=fp8, in_scales=fp8 and scheme.static_activations)
  # A quantization tensor nothing read (a KV-cache scale, a zero point, a
  # dynamic checkpoint's input_scale) would be part of the math ignored.
  unread = sorted(n for n in index if n not in read and n.endswith(_QUANT_SUFFIXES))
  if unread:
    raise ValueError(f"{folder}: quantization tensors not read here: {', '.join(unread[:4])}"
                     f"{' ...' if len(unread) > 4 else ''} (its quantization_config computes "
                     "without them; see models.checkpoint.hf_quantization)")
  return cfg, params, tok


# ---------------------------------------------------------------- GGUF


def _gguf_value(field) -> Any:
  import gguf

  if hasattr(field, "contents"):
    return field.contents()
  # Older gguf: decode by hand (scalars and string arrays cover our keys).
  if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
    return [bytes(field.parts[i]).decode() if field.types[-1] == gguf.GGUFValueType.STRING
            else field.parts[i].tolist()[0] for i in field.data]
  v = field.parts[field.data[0]]
  return bytes(v).decode() if field.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's convert permute on a [out, in] Q/K weight (or [out] bias)."""
  out = w.shape[0]
  rest = w.shape[1:]
  return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
# The "<arch>." metadata keys read_gguf computes (or checks); any other is refused.
_GGUF_KEYS = frozenset({
    "attention.head_count", "attention.head_count_kv", "embedding_length", "vocab_size",
    "block_count", "attention.key_length", "attention.value_length", "rope.dimension_count",
    "feed_forward_length", "rope.freq_base", "attention.layer_norm_rms_epsilon",
    "context_length", "attention.sliding_window", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",  # (how the model was trained: no effect on its logits)
    "expert_count", "expert_used_count",  # (0 in some dense conversions; else refused)
})


def read_gguf(path, dtype=np.float32) -> tuple[ModelConfig, dict, tok_lib.Tokenizer]:
  import gguf

  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such GGUF file")
  try:
    reader = gguf.GGUFReader(str(path))
  except Exception as e:
    raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
  fields = {k: _gguf_value(f) for k, f in reader.fields.items()}
  arch = fields.get("general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise ValueError(f"{path}: unsupported architecture {arch!r}; supported: "
                     f"{', '.join(GGUF_ARCHITECTURES)}")
  tensors = {t.name: t for t in reader.tensors}
  factors = None
  if "rope_freqs.weight" in tensors:  # Llama-3 scaling, precomputed per frequency
    t = tensors["rope_freqs.weight"]
    factors = tuple(float(x) for x in
                    np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(-1))

  unknown = sorted(k for k in fields if k.startswith(f"{arch}.")
                   and k.removeprefix(f"{arch}.") not in _GGUF_KEYS)
  if unknown:  # (what llama.cpp would compute from them, this loader does not)
    k = unknown[0]
    raise ValueError(f"{path}: GGUF metadata {k}={fields[k]!r} is not computed here; refused "
                     "rather than ignored")

  for key in ("expert_count", "expert_used_count"):
    if fields.get(f"{arch}.{key}", 0) != 0:
      raise ValueError(f"{path}: GGUF metadata {arch}.{key}={fields[f'{arch}.{key}']!r} is not "
                       "supported; supported: 0 (a dense model)")

  def meta(key, default=None, required=True, kind=int):
    v = fields.get(f"{arch}.{key}", default)
    if v is None and required:
      raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
    if isinstance(v, list) and v and all(x == v[0] for x in v):
      v = v[0]  # (a per-layer value, the same in every layer)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float) if kind is float
                                                                 else int)):
      raise ValueError(f"{path}: GGUF metadata {arch}.{key}={v!r} is not supported; "
                       f"supported: {'a number' if kind is float else 'an integer'} "
                       "(the same in every layer)")
    return v

  heads = meta("attention.head_count")
  d = meta("embedding_length")
  tokens = fields.get("tokenizer.ggml.tokens")
  vocab = meta("vocab_size", None, required=False) or (len(tokens) if tokens else 0)
  if not vocab:
    vocab = int(tensors["token_embd.weight"].shape[-1])
  head_dim = (meta("attention.key_length", None, required=False)
              or meta("rope.dimension_count", None, required=False) or d // heads)
  for key in ("attention.value_length", "rope.dimension_count"):
    v = meta(key, None, required=False)
    if v is not None and v != head_dim:  # (values of another width; RoPE on part of a head)
      raise ValueError(f"{path}: GGUF metadata {arch}.{key}={v} is not supported; supported: "
                       f"the head dim, {head_dim}")
  window = meta("attention.sliding_window", None, required=False)
  if window is not None and arch != "mistral":
    # (llama.cpp's llama and qwen2 graphs attend over the whole context)
    raise ValueError(f"{path}: GGUF metadata {arch}.attention.sliding_window={window} is not "
                     "supported for this architecture; supported: mistral")
  kind = fields.get(f"{arch}.rope.scaling.type", "none")
  orig = meta("rope.scaling.original_context_length", None, required=False)
  max_pos = meta("context_length", 8192)
  if kind == "none":
    scaling = None
  elif kind == "linear":
    scaling = RopeScaling(float(meta("rope.scaling.factor", kind=float)),
                          original_max_position_embeddings=orig or max_pos, rope_type="linear")
  else:
    raise ValueError(f"{path}: GGUF metadata {arch}.rope.scaling.type={kind!r} is not "
                     "supported; supported: none, linear (Llama-3's scaling as rope_freqs.weight)")
  cfg = ModelConfig(
      name=path.stem,
      vocab_size=vocab,
      hidden_size=d,
      num_layers=meta("block_count"),
      num_heads=heads,
      num_kv_heads=meta("attention.head_count_kv", heads),
      head_dim=head_dim,
      intermediate_size=meta("feed_forward_length"),
      # GGUF keeps float32: 1e-5 comes back as 9.99999975e-06; print it as written.
      rope_theta=float(f'{meta("rope.freq_base", 10000.0, kind=float):.7g}'),
      rope_scaling=scaling,
      rms_norm_eps=float(f'{meta("attention.layer_norm_rms_epsilon", 1e-5, kind=float):.7g}'),
      tie_embeddings="output.weight" not in tensors,
      qkv_bias="blk.0.attn_q.bias" in tensors,
      o_bias="blk.0.attn_output.bias" in tensors,
      mlp_bias="blk.0.ffn_down.bias" in tensors,
      sliding_window=window,
      max_position_embeddings=max_pos,
      rope_freq_factors=factors,
  )
  tokenizer = tok_lib.from_gguf_fields(fields, str(path))
  permuted = arch in ("llama", "mistral")

  names = {
      "embed": "token_embd.weight",
      "layers.attn_norm.w": "blk.{i}.attn_norm.weight",
      "layers.mlp_norm.w": "blk.{i}.ffn_norm.weight",
      "final_norm.w": "output_norm.weight",
      "lm_head.w": "output.weight",
  }
  for ours, theirs in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output")):
    names[f"layers.attn.{ours}.w"] = f"blk.{{i}}.{theirs}.weight"
    names[f"layers.attn.{ours}.b"] = f"blk.{{i}}.{theirs}.bias"
  for ours, theirs in (("w_gate", "ffn_gate"), ("w_up", "ffn_up"), ("w_down", "ffn_down")):
    names[f"layers.mlp.{ours}.w"] = f"blk.{{i}}.{theirs}.weight"
    names[f"layers.mlp.{ours}.b"] = f"blk.{{i}}.{theirs}.bias"
  read = {"rope_freqs.weight"}

  def get(name, layer):
    del layer
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} missing")
    read.add(name)
    t = tensors[name]
    try:
      a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise ValueError(f"{path}: tensor {name!r} has type {t.tensor_type.name}, which is not "
                       "read here") from None
    a = np.asarray(a).reshape(tuple(int(x) for x in reversed(t.shape)))  # numpy order: [out, in]
    if permuted and (".attn_q." in name or ".attn_k." in name):
      a = _unpermute(a, cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads)
    if a.ndim == 2 and name != "token_embd.weight":
      a = a.T  # [out, in] -> [in, out]
    return a

  params = _fill(cfg, get, names, dtype, str(path), "loading gguf")
  unread = sorted(set(tensors) - read)
  if unread:  # (a tensor llama.cpp would use, or a layer past block_count)
    raise ValueError(f"{path}: tensor {unread[0]!r} is not read by this model "
                     f"({len(unread)} unread tensors); refused rather than dropped")
  return cfg, params, tokenizer


# ---------------------------------------------------------------- orbax


def save(directory, model) -> pathlib.Path:
  """Writes params (orbax), model.json and the tokenizer into ``directory``."""
  import orbax.checkpoint as ocp
  from flax import nnx

  if getattr(model, "quantization", None) is not None:
    # The directory holds our unquantized layout; quantization applies at load.
    raise ValueError(f"cannot save a model with {model.quantization} linears: save the "
                     "unquantized model and load it with quantization="
                     f"{model.quantization!r}")
  directory = pathlib.Path(directory).absolute()
  directory.mkdir(parents=True, exist_ok=True)
  pure = nnx.to_pure_dict(model.params)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(directory / "params", pure, force=True)
  tok = model.tokenizer
  meta: dict[str, Any] = {"config": model.config.to_dict(), "dtype": str(model.dtype),
                          "gate_up_layout": GATE_UP_LAYOUT}
  if isinstance(tok, tok_lib.ByteTokenizer):
    meta["tokenizer"] = "byte"
  elif isinstance(tok, tok_lib.NoTokenizer):
    meta["tokenizer"] = "none"
    meta["token_ids"] = {"bos_token_id": tok.bos_id, "eos_token_id": list(tok.eos_ids)}
  elif isinstance(tok, tok_lib.HFTokenizer):
    meta["tokenizer"] = "tokenizer.json"
    tok.tk.save(str(directory / "tokenizer.json"))
  elif isinstance(tok, tok_lib.SentencePieceTokenizer):
    meta["tokenizer"] = "tokenizer.model"
    (directory / "tokenizer.model").write_bytes(tok.sp.serialized_model_proto())
  else:
    raise ValueError(f"cannot save tokenizer of type {type(tok).__name__}")
  if not isinstance(tok, (tok_lib.ByteTokenizer, tok_lib.NoTokenizer)):
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token or None, "eos_token": tok.eos_token or None,
        "chat_template": tok.chat_template}))
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_id, "eos_token_id": list(tok.eos_ids)}))
  (directory / "model.json").write_text(json.dumps(meta, indent=1))
  return directory


def is_orbax_dir(path) -> bool:
  path = pathlib.Path(path)
  return (path / "model.json").exists() and (path / "params").is_dir()


def read_orbax(directory, dtype) -> tuple[ModelConfig, dict, tok_lib.Tokenizer]:
  """Restores what ``save`` wrote, as arrays of ``dtype``."""
  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp

  directory = pathlib.Path(directory).absolute()
  meta_path = directory / "model.json"
  if not meta_path.exists():
    raise FileNotFoundError(f"{meta_path}: missing (not a directory written by models.save)")
  try:
    meta = json.loads(meta_path.read_text())
    cfg = ModelConfig.from_dict(meta["config"])
  except json.JSONDecodeError as e:
    raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
  except (KeyError, TypeError, ValueError) as e:  # (no config, a field of another version)
    raise ValueError(f"{meta_path}: not a model config this version reads "
                     f"({type(e).__name__}: {e})") from None
  if meta.get("tokenizer") == "byte":
    tokenizer: tok_lib.Tokenizer = tok_lib.ByteTokenizer()
  elif meta.get("tokenizer") == "none":
    tokenizer = tok_lib.no_tokenizer(directory, meta.get("token_ids"))
  else:
    tokenizer = tok_lib.from_folder(directory)
  saved = jnp.dtype(meta.get("dtype", "float32"))
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, saved), _target(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))
  try:
    params = _restore(ocp, directory, meta_path, meta, cfg, saved, target)
  except ValueError:
    raise
  except Exception as e:  # (orbax / TensorStore on a damaged or incomplete params folder)
    first = (str(e).strip().splitlines() or [""])[0][:200]
    raise ValueError(f"{directory / 'params'}: cannot be restored ({type(e).__name__}: "
                     f"{first})") from None
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
  return cfg, params, tokenizer


def _restore(ocp, directory, meta_path, meta, cfg, saved, target) -> dict:
  import jax

  with ocp.StandardCheckpointer() as ckptr:
    stored = ckptr.metadata(directory / "params")
    tree = getattr(stored, "item_metadata", stored)
    attn = tree["layers"]["attn"] if "layers" in tree else {}
    if "wq" in attn:  # written before q/k/v and gate/up were fused
      old = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, saved), _target(cfg, fused=False),
                         is_leaf=lambda x: isinstance(x, tuple))
      params = ckptr.restore(directory / "params", old)
      params = _fuse_tree(jax.tree.map(np.asarray, params), cfg)
    else:
      params = ckptr.restore(directory / "params", target)
      layout = meta.get("gate_up_layout", "pairs")
      if layout == "pairs":
        mlp = params["layers"]["mlp"]["w_gate_up"]
        mlp["w"] = _gate_up_from_pairs(np.asarray(mlp["w"]))
      elif layout != GATE_UP_LAYOUT:
        raise ValueError(f"{meta_path}: unknown gate_up_layout {layout!r} "
                         f"(this version reads 'pairs' and {GATE_UP_LAYOUT!r})")
  return params


def _fuse_tree(params: dict, cfg: ModelConfig) -> dict:
  """An unfused params tree (wq/wk/wv, w_gate/w_up) in the fused layout."""
  from flax import traverse_util

  flat = traverse_util.flatten_dict(params, sep=".")
  for key, (_, combine) in _FUSED.items():
    parts = _fused_parts(key)
    if all(p in flat for p in parts):  # a bias only where the model has one
      flat[key] = combine([flat.pop(p) for p in parts], cfg)
  return traverse_util.unflatten_dict(flat, sep=".")
