"""Per-layer, per-op device time and tensor-core / HBM utilization of a model step.

Data flow, for each configuration (phase x attention backend x matmul backend):

1. ``_Step`` builds the inputs of one step (prefill: B x S fresh tokens;
   decode: B sequences with L tokens in a paged KV cache; mixed: that decode
   batch and one fresh prompt chunk of T tokens in one call, as the engine's
   ``--mixed-steps`` runs them) and compiles the model's jitted step
   (``models.jitted.prefill_step`` / ``decode_step`` / ``mixed_step``) once.
   The compiled HLO text maps every HLO instruction to its ``op_name``
   metadata, which carries the ``jax.named_scope`` path the model emits
   (``.../while/body/.../qkv/...``, or ``.../layers/qkv/...`` with no loop;
   ``.../lm_head/...``).
2. The step time is measured first, with the device's own timers where there
   are some: CUPTI (Mosaic GPU's profiler: the sum of the step's kernel
   durations) and, beside it, the wall time of many back-to-back steps. This
   happens for every configuration before any tracing, because CUPTI aborts
   when used after ``jax.profiler.trace`` in the same process.
3. ``jax.profiler.trace(create_perfetto_trace=True)`` records a few steps,
   each inside a host ``TraceAnnotation`` window. ``parse_trace`` reads
   perfetto_trace.json.gz: the kernels of the GPU's streams (or, on CPU, the
   XLA CPU thunks, which are host events) carry ``hlo_op``; a kernel without
   it is matched by name to the sanitized HLO instruction names.
4. ``attribute`` turns each step's kernels into (layer, op) times: the op
   from the innermost named scope of the instruction, the layer from the
   kernel's occurrence index inside the layer loop (the loop body's
   instructions run once per layer, in order). A fusion is one kernel with
   one scope: where XLA fuses work of two ops (the sum of qkv's split-K
   partials goes into the rope and cache-write fusions), its time counts
   for the one op its metadata names (there, rope and kv_write).
5. ``op_costs`` gives each op's FLOPs and minimum bytes (mosaic.cost);
   ``mosaic.cost.utilization`` turns (cost, time) into TFLOP/s, GB/s, the
   fractions of the target's ceilings (mosaic.target) and the roofline bound.

Outputs: ``Report.table()`` (terminal), ``write_json``, ``write_png``
(matplotlib, Agg), ``write_trace`` (Chrome/Perfetto JSON: one process per
configuration, the step's kernels named by layer and op). On CPU the figures
are against nominal CPU ceilings, not tensor cores, and the report says so.

In-kernel timeline (GPU): ``kernel_timeline`` runs the FA3 prefill kernel
once under ``mosaic.dsl.kernel_timeline``; Mosaic GPU's on-device profiler
stamps each named region of the kernel body (wait_k, qk, softmax, wait_v, pv;
the producer's wait_free, load_kv) per warpgroup, and ``label_timeline`` names
the tracks (SM, CTA, consumer/producer) for Perfetto.

CLI: ``python -m serving.profiler --model tiny --batch 2 --prefill-len 64
--decode-context 128 --attention-backend xla,reference --out /tmp/prof``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import gzip
import inspect
import itertools
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

from mosaic import cost as cost_lib
from serving.options import KV_CACHE_DTYPES

# Scopes the model emits (models/llama.py), in execution order within a layer.
LAYER_OPS = ("attn_norm", "qkv", "rope", "kv_write", "attention", "o_proj", "o_proj_all_reduce",
             "mlp_norm", "gate_up", "down", "down_all_reduce")
TOP_OPS = ("embed", "final_norm", "lm_head", "lm_head_all_gather")
# Under tensor parallelism the model scopes its collectives inside the op they
# end ("o_proj/all_reduce"): each is a row of its own, named "<op>_<collective>".
COLLECTIVES = ("all_reduce", "all_gather")
OPS = TOP_OPS + LAYER_OPS
PHASES = ("prefill", "decode", "mixed")
PNG_SIZE = (1200, 800)  # pixels of the chart: 12 x 8 inches at 100 dpi
_PNG_DPI = 100


# ---------------------------------------------------------------- costs


def op_costs(cfg, phase: str, batch: int, length: int, *, dtype="bfloat16",
             decode_tokens: int = 1, chunk: int = 0, kv_dtype=None,
             folded_norms: bool = False, decode_append: bool = False, tp: int = 1,
             quantization: str | None = None,
             fp8_prefill_attention: bool = False) -> dict[str, cost_lib.Cost]:
  """FLOPs and minimum bytes of each op of ONE layer (LAYER_OPS) and of the
  ops outside the layers (TOP_OPS), for a step of ``phase``.

  prefill: ``batch`` x ``length`` new tokens, no cached prefix, logits at the
  last token of each row. decode: ``batch`` sequences of ``length`` kv tokens
  (including the ``decode_tokens`` new ones), logits at every new token.
  mixed: that decode step (one token a row) and a fresh prompt chunk of
  ``chunk`` tokens in one pass: batch + chunk rows through the matmuls, logits
  for the decode rows and the chunk's last token.
  Elementwise ops (rope, kv_write, embed) count bytes only. gate_up includes the
  SwiGLU gate fused into it: it writes F features per row, not 2F. ``kv_dtype``:
  the KV cache's (default ``dtype``), for the bytes decode attention reads and
  the cache write writes. ``folded_norms``: the layers' norms run inside qkv
  and gate_up (models.Model(fold_norms=True)), so their FLOPs are those ops'
  and there is no attn_norm / mlp_norm op (the row would always read 0).
  ``decode_append``: a one-token decode step rotates q and k and writes the
  cache inside its attention op (attention_decode_append), so rope's and
  kv_write's bytes are attention's and those ops are gone from the layer.
  ``tp``: tensor parallelism; the costs are one device's: its share of the
  heads, FFN features and (untied) vocabulary; norms and the embedding are
  replicated. The collectives have no cost model (their link is not in
  mosaic.target's ceilings): their rows carry time and share only.
  ``quantization="fp8"``: the layers' four projections read fp8 weights and
  fp8 rows (on the fp8 tensor cores, ``Cost.fp8_flops``), and each also
  quantizes its input rows (read in ``dtype``, written in fp8: the XLA fusion
  the model scopes inside the projection); embed and lm_head stay ``dtype``.
  ``fp8_prefill_attention``: prompt attention runs attention_prefill's
  ``mosaic_fp8`` backend: its products on the fp8 tensor cores, and q, k, v
  quantized per head on the way in (an amax pass and a quantizing pass each
  read them in ``dtype``, which writes them in fp8 for the kernel to read).
  """
  if phase not in PHASES:
    raise ValueError(f"{phase=} is not one of {PHASES}")
  if batch <= 0 or length <= 0:
    raise ValueError(f"{batch=} and {length=} must be positive")
  if phase == "decode" and not 1 <= decode_tokens <= length:
    raise ValueError(f"{decode_tokens=} must be in [1, {length=}]")
  if phase == "mixed" and chunk < 1:
    raise ValueError(f"a mixed step needs a prompt chunk: {chunk=} must be >= 1")
  if quantization not in (None, "fp8"):
    raise ValueError(f"{quantization=} has no cost model (None or 'fp8')")
  import numpy as np

  isz = np.dtype(dtype).itemsize
  kv_isz = np.dtype(kv_dtype or dtype).itemsize
  if tp < 1:
    raise ValueError(f"{tp=} must be >= 1")
  d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  # Megatron layout (models.sharding.param_spec): one device's heads and features.
  hq, hkv, f = hq // tp, hkv // tp, f // tp
  if not cfg.tie_embeddings:
    v //= tp
  fp8 = quantization == "fp8"

  def mm(rows, n, k, out_n=None):
    """A projection [rows, k] @ [k, n] writing [rows, out_n] (default n)."""
    if not fp8:
      c = cost_lib.matmul(rows, n, k, dtype, dtype)
      return c if out_n is None else cost_lib.Cost(c.flops, c.bytes + rows * (out_n - n) * isz)
    c = cost_lib.matmul(rows, n, k, "float8_e4m3fn", dtype)
    quantize = cost_lib.Cost(0.0, rows * k * (isz + 1) + rows * 4)  # rows in, fp8 + scale out
    out = 0 if out_n is None else rows * (out_n - n) * isz
    return cost_lib.Cost(c.flops, c.bytes + out, c.fp8_flops) + quantize

  attention = lambda b, tq, tkv, kv=None: cost_lib.attention(b, hq, hkv, tq, tkv, hd,
                                                             causal=True, dtype=dtype, kv_dtype=kv)

  def prompt_attention(b, t):
    """A fresh chunk's attention over its own K/V (bf16, or through the fp8 kernel)."""
    c = attention(b, t, t)
    if not fp8_prefill_attention:
      return c
    qkv = b * t * (hq + 2 * hkv) * hd  # elements of q, k, v
    out = b * t * hq * hd * isz
    return cost_lib.Cost(c.flops, out + qkv * (2 * isz + 1) + qkv, c.flops)

  cache = kv_dtype or dtype
  if phase == "prefill":  # fresh prompts attend their own K/V, not the cache
    m, m_out = batch * length, batch  # rows through the matmuls / final norm and lm_head
    attn = prompt_attention(batch, length)
  elif phase == "decode":
    m = m_out = batch * decode_tokens
    attn = attention(batch, decode_tokens, length, cache)
  else:
    m, m_out = batch + chunk, batch + 1
    attn = attention(batch, 1, length, cache) + prompt_attention(1, chunk)
  bytes_only = lambda n: cost_lib.Cost(0.0, float(n))
  costs = {
      "embed": bytes_only(2 * m * d * isz),
      "attn_norm": cost_lib.rms_norm(m, d, dtype),
      # (unquantized: counted as three products, each reading the rows)
      "qkv": (mm(m, (hq + 2 * hkv) * hd, d) if fp8
              else mm(m, hq * hd, d) + mm(m, hkv * hd, d) + mm(m, hkv * hd, d)),
      "rope": bytes_only(2 * m * (hq + hkv) * hd * isz),
      "kv_write": bytes_only(2 * m * hkv * hd * (isz + kv_isz)),  # read k, v; write them
      "attention": attn,
      "o_proj": mm(m, d, hq * hd) + bytes_only(m * d * isz),  # + residual read
      "mlp_norm": cost_lib.rms_norm(m, d, dtype),
      "gate_up": mm(m, 2 * f, d, out_n=f),  # the fused gate writes F features, not 2F
      "down": mm(m, d, f) + bytes_only(m * d * isz),
      "final_norm": cost_lib.rms_norm(m_out, d, dtype),
      "lm_head": cost_lib.matmul(m_out, v, d, dtype, "float32", weight_dtype=dtype),
  }
  if folded_norms:  # the norm reads the rows its matmul reads anyway: FLOPs only
    for norm, op in (("attn_norm", "qkv"), ("mlp_norm", "gate_up")):
      costs[op] = costs[op] + cost_lib.Cost(costs.pop(norm).flops, 0.0)
  if decode_append and phase == "decode" and decode_tokens == 1:
    costs["attention"] = costs["attention"] + costs.pop("rope") + costs.pop("kv_write")
  return costs


# ---------------------------------------------------------------- HLO and trace parsing

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S")
_OP_NAME = re.compile(r"metadata=\{[^}]*?op_name=\"([^\"]*)\"")
_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)", re.M)


def sanitize(name: str) -> str:
  """XLA's kernel name for an HLO instruction name (non-alphanumerics -> '_')."""
  return re.sub(r"[^A-Za-z0-9_]", "_", name)


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> op_name metadata ('' if none), over every computation."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m and not line.lstrip().startswith(("HloModule", "//")):
      n = _OP_NAME.search(line)
      if n or m.group(1) not in out:
        out[m.group(1)] = n.group(1) if n else ""
  return out


def hlo_module_name(hlo_text: str) -> str | None:
  m = _MODULE.search(hlo_text)
  return m.group(1) if m else None


def classify(op_name: str) -> tuple[str, bool]:
  """(op, inside the layer loop) of an op_name path: the innermost scope that
  is one of OPS; 'loop' for the layer loop's own control, else 'other'. An op
  is in a layer inside the loop's body or, with the loop unrolled, inside the
  model's "layers" scope (models.llama); a layer op outside both (the RoPE
  table a decode step builds once) is not."""
  parts = op_name.split("/")
  in_layer = ("while" in parts and "body" in parts) or "layers" in parts
  for i in range(len(parts) - 1, -1, -1):
    p = parts[i]
    if p in COLLECTIVES:
      owner = next((q for q in reversed(parts[:i]) if q in OPS), None)
      p = f"{owner}_{p}"
    if p in OPS:
      return p, p in LAYER_OPS and in_layer
  if "while" in parts and "cond" in parts:
    return "loop", False
  if in_layer and "jit(dynamic_index_in_dim)" in parts:
    return "params", True  # a per-layer slice of a stacked array inside the loop
  return "other", in_layer


@dataclasses.dataclass(frozen=True)
class Kernel:
  ts: float  # microseconds, trace clock
  dur: float  # microseconds
  name: str
  hlo_op: str | None
  tid: Any = None
  host_names: tuple[str, ...] = ()  # host events around the kernel's launch, innermost first


@dataclasses.dataclass
class Trace:
  kernels: list[Kernel]
  windows: dict[str, tuple[float, float]]  # annotation name -> (start, end) us
  device: str  # "gpu" or "cpu"
  path: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the trace held


def find_trace_file(trace_dir: str | os.PathLike) -> pathlib.Path:
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  return pathlib.Path(files[-1])


def parse_trace(path: str | os.PathLike, window_prefix: str = "mosaic_profile_step") -> Trace:
  """Kernels (device events with their HLO op) and step windows of a
  perfetto_trace.json.gz written by jax.profiler.trace."""
  with gzip.open(path, "rt") as fh:
    data = json.load(fh)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  gpu_pids = {p for p, n in procs.items() if n.startswith("/device:GPU")}
  # A tensor-parallel step runs the same program on every device: the first
  # device's kernels are the step's (both devices' would count each op twice).
  ordinals = {p: int(m.group(1)) for p in gpu_pids
              if (m := re.match(r"/device:GPU:(\d+)", procs[p]))}
  if len(ordinals) > 1:
    gpu_pids = {min(ordinals, key=ordinals.get)}
  windows = {}
  for e in events:
    if e.get("ph") == "X" and str(e.get("name", "")).startswith(window_prefix):
      windows[e["name"]] = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
  kernels = []
  if gpu_pids:
    # Stream lines hold the kernels; derived lines (XLA Ops/Modules, Steps)
    # repeat them, so when stream lines exist only they are read.
    stream_tids = {k for k, n in threads.items() if k[0] in gpu_pids and n.startswith("Stream")}
    derived = {k for k, n in threads.items() if k[0] in gpu_pids and any(
        w in n for w in ("XLA", "Steps", "Framework", "Source", "Launch", "TensorFlow"))}
    launches = _host_launches(events, gpu_pids)
    for e in events:
      if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
        continue
      key = (e["pid"], e.get("tid"))
      if (stream_tids and key not in stream_tids) or (not stream_tids and key in derived):
        continue
      args = e.get("args") or {}
      corr = args.get("correlation_id")
      kernels.append(Kernel(float(e["ts"]), float(e.get("dur", 0)), str(e.get("name", "")),
                            args.get("hlo_op"), e.get("tid"),
                            launches.get(str(corr), ()) if corr is not None else ()))
    device = "gpu"
  else:
    for e in events:
      args = e.get("args") or {}
      # (host devices: XLA CPU thunks say which device they ran for)
      if e.get("ph") == "X" and "hlo_op" in args and str(args.get("device_ordinal", "0")) == "0":
        kernels.append(Kernel(float(e["ts"]), float(e.get("dur", 0)), str(e.get("name", "")),
                              args["hlo_op"], e.get("tid")))
    kernels = _leaves(kernels)
    device = "cpu"
  kernels.sort(key=lambda k: k.ts)
  info = {"device_threads": sorted({n for (pid, _), n in threads.items() if pid in gpu_pids}),
          "gpus_in_trace": max(1, len(ordinals)) if gpu_pids else 0,
          "kernels": len(kernels),
          "with_hlo_op": sum(k.hlo_op is not None for k in kernels),
          "with_host_names": sum(bool(k.host_names) for k in kernels)}
  return Trace(kernels, windows, device, str(path), info)


def _host_launches(events, gpu_pids) -> dict[str, tuple[str, ...]]:
  """correlation_id -> names (and hlo_op args) of the host events enclosing
  the launch with that id, innermost first: XLA's per-thunk annotations there
  name the HLO op of a kernel whose own event does not (library kernels)."""
  launches, by_thread = [], {}
  for e in events:
    if e.get("ph") != "X" or e.get("pid") in gpu_pids:
      continue
    args = e.get("args") or {}
    key = (e.get("pid"), e.get("tid"))
    if "correlation_id" in args:
      launches.append((key, float(e["ts"]), str(args["correlation_id"])))
    elif not str(e.get("name", "")).startswith("$"):  # '$...' are Python frames
      by_thread.setdefault(key, []).append(e)
  out = {}
  for key, ts, corr in launches:
    around = [e for e in by_thread.get(key, ())
              if float(e["ts"]) <= ts <= float(e["ts"]) + float(e.get("dur", 0))]
    around.sort(key=lambda e: float(e.get("dur", 0)))
    names = []
    for e in around:
      a = e.get("args") or {}
      if a.get("hlo_op"):
        names.append(str(a["hlo_op"]))
      names.append(str(e.get("name", "")))
    out[corr] = tuple(names)
  return out


def _leaves(kernels: list[Kernel]) -> list[Kernel]:
  """Drops host events that enclose other op events on the same thread (a CPU
  while loop's thunk encloses its body's), so that no time counts twice."""
  out = []
  by_tid: dict[Any, list[Kernel]] = {}
  for k in kernels:
    by_tid.setdefault(k.tid, []).append(k)
  for ks in by_tid.values():
    ks.sort(key=lambda k: (k.ts, -k.dur))
    for i, k in enumerate(ks):
      nxt = ks[i + 1] if i + 1 < len(ks) else None
      if nxt is not None and nxt.ts < k.ts + k.dur and nxt.ts + nxt.dur <= k.ts + k.dur + 1e-3:
        continue  # k encloses the next event
      out.append(k)
  return out


# ---------------------------------------------------------------- attribution


@dataclasses.dataclass
class StepTimes:
  """One step's kernels grouped: times[(layer or None, op)] = seconds."""
  times: dict[tuple[int | None, str], float]
  counts: dict[tuple[int | None, str], int]
  events: list[tuple[Kernel, int | None, str, str]]  # kernel, layer, op, op_name
  unattributed: dict[str, float]  # kernel name -> seconds, kernels with no HLO op found
  span_s: float  # first kernel start to last kernel end


def attribute(kernels: Sequence[Kernel], op_names: dict[str, str], num_layers: int) -> StepTimes:
  """Groups one step's kernels by (layer, op). See the module docstring."""
  by_sanitized = {sanitize(n): n for n in op_names}
  resolved = []
  for k in kernels:
    hlo = k.hlo_op if k.hlo_op in op_names else by_sanitized.get(sanitize(k.name))
    if hlo is None and k.hlo_op:
      hlo = by_sanitized.get(sanitize(k.hlo_op))
    for n in k.host_names if hlo is None else ():
      hlo = n if n in op_names else by_sanitized.get(sanitize(n))
      if hlo is not None:
        break
    resolved.append((k, hlo))
  # Loop-body instructions run once per layer (or a fixed number of times):
  # the n-th run of an instruction that runs L*r times is layer n // r. When
  # the loop was unrolled (each instruction once: XLA's choice, or the model's
  # one-token decode step, models.llama), layers are counted instead: a new
  # layer starts where the op order returns to attn_norm/qkv after o_proj or
  # later.
  occurrences: dict[str, int] = {}
  for _, hlo in resolved:
    if hlo is not None:
      occurrences[hlo] = occurrences.get(hlo, 0) + 1
  in_layer_occ = [occurrences[h] for _, h in resolved
                  if h is not None and classify(op_names[h])[1]]
  looped = sum(o % num_layers == 0 for o in in_layer_occ) * 2 >= len(in_layer_occ)
  seen: dict[str, int] = {}
  cur, max_idx = -1, -1
  times, counts, events, unattributed = {}, {}, [], {}
  for k, hlo in resolved:
    sec = k.dur * 1e-6
    if hlo is None:
      unattributed[k.name] = unattributed.get(k.name, 0.0) + sec
      key, op_name = (None, "unattributed"), ""
    else:
      op_name = op_names[hlo]
      op, in_layer = classify(op_name)
      layer = None
      if in_layer and not looped and "jit(dynamic_index_in_dim)" in op_name.split("/"):
        # A layer's weight slice (xla backends): with the loop unrolled, XLA
        # may run it apart from its layer (on CPU: all of them first, side by
        # side), so its place says nothing about where a layer starts.
        op, in_layer = "params", False
      if in_layer:
        idx = LAYER_OPS.index(op) if op in LAYER_OPS else None
        if cur < 0:
          cur = 0
        elif idx is not None and idx <= 1 and max_idx >= 5:
          cur, max_idx = cur + 1, -1
        if idx is not None:
          max_idx = max(max_idx, idx)
        n = seen.get(hlo, 0)
        seen[hlo] = n + 1
        occ = occurrences[hlo]
        if not looped:
          layer = min(max(cur, 0), num_layers - 1)
        elif occ % num_layers == 0:
          layer = min(n // (occ // num_layers), num_layers - 1)
        # else: hoisted out of the loop by XLA (runs once per step): no layer
      key = (layer, op)
    events.append((k, key[0], key[1], op_name))
  # XLA drops the metadata of some instructions it creates (reductions split
  # out of a fusion, copies): such a kernel between two kernels of the same
  # (layer, op) belongs to that op.
  for i in range(1, len(events) - 1):
    k, layer, op, op_name = events[i]
    if op == "other" and not op_name:
      prev, nxt = events[i - 1][1:3], events[i + 1][1:3]
      j = i + 1
      while nxt == (None, "other") and j + 1 < len(events) and not events[j][3]:
        j += 1
        nxt = events[j][1:3]
      if prev == nxt and prev[1] not in ("other", "unattributed"):
        events[i] = (k, prev[0], prev[1], op_name)
  for k, layer, op, _ in events:
    key, sec = (layer, op), k.dur * 1e-6
    times[key] = times.get(key, 0.0) + sec
    counts[key] = counts.get(key, 0) + 1
  span = 0.0
  if kernels:
    span = (max(k.ts + k.dur for k in kernels) - min(k.ts for k in kernels)) * 1e-6
  return StepTimes(times, counts, events, unattributed, span)


# ---------------------------------------------------------------- running a step


def _pages(n_tokens: int, page_size: int) -> int:
  return max(1, -(-n_tokens // page_size))


class _Step:
  """Inputs and the compiled step of one (phase, backends) configuration."""

  def __init__(self, model, phase: str, batch: int, length: int, backends: dict[str, str | None],
               *, page_size: int | None = None, seed: int = 0, chunk: int = 0,
               kv_dtype=None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from models import jitted, kv_cache, sharding

    if phase not in PHASES:
      raise ValueError(f"{phase=} is not one of {PHASES}")
    if batch <= 0 or length <= 0:
      raise ValueError(f"{batch=} and {length=} must be positive")
    if phase == "mixed" and chunk < 1:
      raise ValueError(f"a mixed step needs a prompt chunk: {chunk=} must be >= 1")
    cfg = model.config
    self.model, self.phase, self.batch, self.length = model, phase, batch, length
    ps = page_size or kv_cache.DEFAULT_PAGE_SIZE
    per_row = _pages(length, ps)
    chunk_pages = _pages(chunk, ps) if phase == "mixed" else 0
    num_pages = batch * per_row + chunk_pages + 1  # page 0 is the scratch page
    rng = np.random.default_rng(seed)
    page_table = (1 + np.arange(batch * per_row, dtype=np.int32)).reshape(batch, per_row)
    key = jax.random.key(seed)
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, ps, cfg.head_dim)
    kk, kv = jax.random.split(key)
    # Random cache contents so that decode attention reads real numbers.
    mk = jax.jit(lambda k: kv_cache.to_cache_dtype(jax.random.normal(k, shape, jnp.float32),
                                           jnp.dtype(kv_dtype or model.dtype)))
    self.cache = kv_cache.KVCache(mk(kk), mk(kv))
    mesh = getattr(model, "mesh", None)  # tensor parallelism: kv heads split over 'tp'
    self.devices = model.tensor_parallel_size
    if mesh is not None:
      self.cache = jax.device_put(self.cache, sharding.cache_sharding(mesh))
    self.backends = jitted.backends(**backends)
    if phase == "prefill":
      tokens = rng.integers(0, cfg.vocab_size, (batch, length), dtype=np.int32)
      self.rest = (jnp.asarray(tokens), jnp.zeros((batch,), jnp.int32),
                   jnp.full((batch,), length, jnp.int32), jnp.asarray(page_table))
      fn, kw = jitted.prefill_step, dict(backends=self.backends, all_logits=False)
      if "fresh" in inspect.signature(fn).parameters:
        kw["fresh"] = True  # as Model.prefill says for prompts with no cached prefix
    else:
      tokens = rng.integers(0, cfg.vocab_size, (batch, 1), dtype=np.int32)
      self.rest = (jnp.asarray(tokens), jnp.full((batch,), length, jnp.int32),
                   jnp.asarray(page_table))
      fn, kw = jitted.decode_step, dict(backends=self.backends)
    if phase == "mixed":  # the decode batch above, then one fresh chunk on its own pages
      chunk_tokens = rng.integers(0, cfg.vocab_size, (1, chunk), dtype=np.int32)
      chunk_table = (1 + batch * per_row + np.arange(chunk_pages, dtype=np.int32))[None]
      self.rest += (jnp.asarray(chunk_tokens), jnp.zeros((1,), jnp.int32),
                    jnp.full((1,), chunk, jnp.int32), jnp.asarray(chunk_table))
      fn, kw = jitted.mixed_step, dict(backends=self.backends, fresh=True)
    lowered = fn.lower(model.graphdef, model.params, self.cache, *self.rest, mesh=mesh, **kw)
    self.compiled = lowered.compile()
    self.hlo_text = self.compiled.as_text()
    self.op_names = hlo_op_names(self.hlo_text)
    self.module = hlo_module_name(self.hlo_text)

  def __call__(self):
    logits, self.cache = self.compiled(self.model.params, self.cache, *self.rest)
    return logits

  def _cupti(self, iters: int) -> float:
    """Median over steps of the sum of the step's kernel durations (CUPTI; one
    device's share under tensor parallelism), with the cache threaded from
    step to step (a step donates its cache, so it cannot be called twice on
    the same inputs)."""
    from mosaic import bench

    # CUPTI sees every device's kernels: under tensor parallelism their sum
    # over the devices, which run the same program, is divided among them.
    samples = [sum(s for _, s in bench.cupti_kernels(self, ())) / self.devices
               for _ in range(iters)]
    return statistics.median(samples)

  def measure(self, iters: int) -> dict[str, Any]:
    """Median step time: CUPTI kernel sum on GPU, and wall time of back-to-back steps."""
    import jax

    from mosaic import target as target_lib

    import numpy as np

    self.first_logits = np.asarray(jax.device_get(self()), np.float32)
    jax.block_until_ready(self())
    out: dict[str, Any] = {}
    if target_lib.on_gpu():
      try:
        out["cupti_s"] = self._cupti(iters)
      except Exception as e:  # keep the wall time; say why CUPTI is missing
        out["cupti_error"] = f"{type(e).__name__}: {e}"[:300]
    reps = []
    for _ in range(3):
      t0 = time.perf_counter()
      for _ in range(iters):
        logits = self()
      jax.block_until_ready(logits)
      reps.append((time.perf_counter() - t0) / iters)
    out["wall_s"] = min(reps)
    return out


# ---------------------------------------------------------------- report


@dataclasses.dataclass
class Profile:
  """One configuration's result."""
  phase: str
  batch: int
  length: int
  backends: dict[str, str]
  step: dict[str, Any] = dataclasses.field(default_factory=dict)
  rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  layers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  ops: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  unattributed: dict[str, float] = dataclasses.field(default_factory=dict)
  error: str | None = None
  chunk: int = 0  # mixed: the prompt chunk's tokens

  @property
  def label(self) -> str:
    b = ",".join(f"{k.replace('attention_', 'attn_')}={v}" for k, v in self.backends.items())
    shape = f"{'S' if self.phase == 'prefill' else 'L'}={self.length}" + (
        f" T={self.chunk}" if self.phase == "mixed" else "")
    return f"{self.phase} B={self.batch} {shape}" + (f" [{b}]" if b else "")

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"label": self.label}


def _util_row(c: cost_lib.Cost, seconds: float, target) -> dict[str, Any]:
  row = {"time_us": seconds * 1e6, "flops": c.flops, "bytes": c.bytes}
  if c.flops == 0 and c.bytes == 0:
    row["bound"] = "-"  # no cost model for this row (loop control, unattributed)
  elif seconds > 0:
    u = cost_lib.utilization(c, seconds, target)
    row |= {"tflops": u.tflops, "gbps": u.gbps, "tc_pct": 100 * u.tc_fraction,
            "hbm_pct": 100 * u.hbm_fraction, "bound": u.bound}
  return row


def summarize(prof: Profile, steps: list[StepTimes], costs: dict[str, cost_lib.Cost],
              num_layers: int, target) -> None:
  """Fills prof.rows/layers/ops/step from the traced steps (medians over steps)."""
  keys = sorted({k for s in steps for k in s.times},
                key=lambda k: (-1 if k[0] is None else k[0], OPS.index(k[1]) if k[1] in OPS else 99))
  med = {k: statistics.median([s.times.get(k, 0.0) for s in steps]) for k in keys}
  rows = []
  for (layer, op) in keys:
    c = costs.get(op, cost_lib.Cost(0.0, 0.0))
    if layer is None and op in LAYER_OPS:  # hoisted out of the loop: a fraction of the op
      c = cost_lib.Cost(0.0, 0.0)
    rows.append({"layer": layer, "op": op, "kernels": steps[0].counts.get((layer, op), 0)}
                | _util_row(c, med[(layer, op)], target))
  prof.rows = rows
  layer_cost = sum((costs[o] for o in LAYER_OPS if o in costs), cost_lib.Cost(0.0, 0.0))
  prof.layers = []
  for layer in range(num_layers):
    t = sum(v for (l, _), v in med.items() if l == layer)
    prof.layers.append({"layer": layer} | _util_row(layer_cost, t, target))
  # Per op over the whole step: layer ops summed over layers.
  ops = []
  for op in OPS + ("params", "loop", "other", "unattributed"):
    t = sum(v for (l, o), v in med.items() if o == op)
    if t == 0 and op not in costs:
      continue
    c = costs.get(op, cost_lib.Cost(0.0, 0.0))
    n = num_layers if op in LAYER_OPS else 1
    c_all = cost_lib.Cost(c.flops * n, c.bytes * n)
    ops.append({"op": op} | _util_row(c_all, t, target) | {"share_pct": 0.0})
  total = sum(med.values())
  for r in ops:
    r["share_pct"] = 100 * r["time_us"] * 1e-6 / total if total else 0.0
  prof.ops = ops
  top_cost = sum((costs[o] for o in TOP_OPS if o in costs), cost_lib.Cost(0.0, 0.0))
  all_cost = cost_lib.Cost(top_cost.flops + layer_cost.flops * num_layers,
                           top_cost.bytes + layer_cost.bytes * num_layers)
  prof.step["sum_s"] = total
  prof.step["layers_sum_s"] = sum(r["time_us"] for r in prof.layers) * 1e-6
  prof.step["span_s"] = statistics.median([s.span_s for s in steps])
  prof.step["traced_steps"] = len(steps)
  if prof.step.get("wall_s"):
    prof.step["sum_over_wall"] = total / prof.step["wall_s"]
  ref = prof.step.get("cupti_s") or prof.step.get("wall_s")
  if ref:
    prof.step["sum_over_measured"] = total / ref
    prof.step["measured_by"] = "cupti" if prof.step.get("cupti_s") else "wall"
  if total > 0:
    prof.step |= {f"step_{k}": v for k, v in _util_row(all_cost, total, target).items()
                  if k in ("tflops", "gbps", "tc_pct", "hbm_pct", "bound", "flops", "bytes")}
  unatt: dict[str, float] = {}
  for s in steps:
    for n, v in s.unattributed.items():
      unatt[n] = unatt.get(n, 0.0) + v / len(steps)
  prof.unattributed = dict(sorted(unatt.items(), key=lambda kv: -kv[1])[:20])
  s0 = steps[0]
  t0 = min((k.ts for k, *_ in s0.events), default=0.0)
  prof.events = [{"ts": k.ts - t0, "dur": k.dur, "name": k.name, "hlo_op": k.hlo_op,
                  "layer": layer, "op": op, "op_name": op_name}
                 for k, layer, op, op_name in s0.events]


@dataclasses.dataclass
class Report:
  env: dict[str, Any]
  model: dict[str, Any]
  note: str
  profiles: list[Profile]

  def as_dict(self) -> dict[str, Any]:
    return {"env": self.env, "model": self.model, "note": self.note,
            "profiles": [p.as_dict() for p in self.profiles]}

  def table(self, per_layer: bool = False) -> str:
    from mosaic import bench

    out = [self.note]
    cols = ["op", "time_us", "share_pct", "tflops", "gbps", "tc_pct", "hbm_pct", "bound"]
    for p in self.profiles:
      out.append(f"\n## {p.label}")
      if p.error:
        out.append(f"failed: {p.error}")
        continue
      s = p.step
      meas = ", ".join(f"{k[:-2]} {v * 1e6:.1f} us" for k, v in s.items()
                       if k in ("cupti_s", "wall_s"))
      out.append(f"step: measured {meas}; sum of ops {s['sum_s'] * 1e6:.1f} us"
                 + (f" ({100 * s['sum_over_measured']:.1f}% of {s['measured_by']}"
                    + (f", {100 * s['sum_over_wall']:.1f}% of wall" if s.get("cupti_s") else "")
                    + ")" if "sum_over_measured" in s else "")
                 + (f"; whole step {s['step_tflops']:.3g} TFLOP/s, {s['step_gbps']:.4g} GB/s"
                    if "step_tflops" in s else ""))
      out.append(bench.table(p.ops, cols))
      out.append("per layer (us): " + " ".join(f"L{r['layer']}={r['time_us']:.1f}"
                                               for r in p.layers))
      if per_layer:
        out.append(bench.table(p.rows, ["layer"] + cols[:1] + ["kernels"] + cols[1:]))
      if p.unattributed:
        top = ", ".join(f"{n} {v * 1e6:.1f} us" for n, v in list(p.unattributed.items())[:5])
        out.append(f"kernels with no HLO op found: {top}")
    return "\n".join(out)

  def write_json(self, path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(self.as_dict(), indent=1, default=str) + "\n")
    return path

  def write_png(self, path) -> pathlib.Path:
    """Per op, % of tensor-core peak and % of HBM bandwidth, one bar per
    configuration; one row of panels per phase."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    phases = [ph for ph in PHASES if any(p.phase == ph and not p.error for p in self.profiles)]
    nrows = max(1, len(phases))
    fig, axes = plt.subplots(nrows, 2, squeeze=False,
                             figsize=(PNG_SIZE[0] / _PNG_DPI, PNG_SIZE[1] / _PNG_DPI), dpi=_PNG_DPI)
    ops = ["embed", *LAYER_OPS, "final_norm", "lm_head"]  # step order
    for r, ph in enumerate(phases or ["(no profile)"]):
      profs = [p for p in self.profiles if p.phase == ph and not p.error]
      width = 0.8 / max(1, len(profs))
      for c, (metric, title) in enumerate((("tc_pct", "% of tensor-core peak"),
                                           ("hbm_pct", "% of HBM bandwidth"))):
        ax = axes[r][c]
        for i, p in enumerate(profs):
          by_op = {o["op"]: o for o in p.ops}
          vals = [by_op.get(o, {}).get(metric, 0.0) for o in ops]
          ax.bar([j + i * width for j in range(len(ops))], vals, width,
                 label=p.label.split("[")[-1].rstrip("]") if "[" in p.label else "default")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ops))])
        ax.set_xticklabels(ops, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{ph}: {title}", fontsize=9)
        ax.set_ylim(bottom=0)
        if profs and c == 0:
          ax.legend(fontsize=6)
    fig.suptitle(f"{self.model.get('name')} on {self.env.get('device')}"
                 + ("" if self.env.get("kind") != "cpu" else " (CPU: nominal ceilings)"),
                 fontsize=10)
    fig.tight_layout()
    # No bbox_inches="tight": the image keeps exactly PNG_SIZE pixels.
    fig.savefig(path, dpi=_PNG_DPI)
    plt.close(fig)
    return path

  def write_trace(self, path) -> pathlib.Path:
    """Chrome trace JSON (opens in Perfetto): one process per configuration,
    one thread of kernels named 'L<layer> <op>' and one of layer spans."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ev: list[dict[str, Any]] = []
    for pid, p in enumerate(self.profiles, start=1):
      ev.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": p.label}})
      ev.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name",
                 "args": {"name": "kernels"}})
      ev.append({"ph": "M", "pid": pid, "tid": 2, "name": "thread_name",
                 "args": {"name": "layers"}})
      spans: dict[Any, list[float]] = {}
      for e in p.events:
        who = "top" if e["layer"] is None else f"L{e['layer']}"
        ev.append({"ph": "X", "pid": pid, "tid": 1, "ts": e["ts"], "dur": e["dur"],
                   "name": f"{who} {e['op']}", "cat": e["op"],
                   "args": {"kernel": e["name"], "hlo_op": e["hlo_op"], "op_name": e["op_name"]}})
        if e["layer"] is not None:
          s = spans.setdefault(e["layer"], [e["ts"], e["ts"] + e["dur"]])
          s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
      for layer, (a, b) in sorted(spans.items()):
        ev.append({"ph": "X", "pid": pid, "tid": 2, "ts": a, "dur": b - a, "name": f"layer {layer}",
                   "cat": "layer"})
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ns",
                                "metadata": {"note": self.note}}) + "\n")
    return path

  def write_all(self, out_dir, stem: str = "profile") -> dict[str, pathlib.Path]:
    out = pathlib.Path(out_dir)
    return {"json": self.write_json(out / f"{stem}.json"),
            "png": self.write_png(out / f"{stem}.png"),
            "trace": self.write_trace(out / f"{stem}_trace.json")}


# ---------------------------------------------------------------- entry points


def _names(spec: str | Sequence[str] | None) -> list[str | None]:
  if spec is None:
    return [None]
  items = spec.split(",") if isinstance(spec, str) else list(spec)
  out = [None if s.strip() in ("", "default") else s.strip() for s in items]
  return out or [None]


def configurations(phases: Sequence[str], attention: Sequence[str | None],
                   decode_attention: Sequence[str | None] | None,
                   matmul: Sequence[str | None]) -> list[tuple[str, dict[str, str | None]]]:
  """(phase, backends) pairs: every attention x matmul backend, per phase."""
  from mosaic import registry

  out = []
  for ph in phases:
    if ph not in PHASES:
      raise ValueError(f"phase {ph!r} is not one of {PHASES}")
    if ph == "mixed":  # both attentions run: every prefill x decode x matmul backend
      for (_, pre), (_, dec) in itertools.product(
          configurations(["prefill"], attention, decode_attention, [None]),
          configurations(["decode"], attention, decode_attention, [None])):
        for m in matmul:
          out.append((ph, {"attention_prefill": pre["attention_prefill"],
                           "attention_decode": dec["attention_decode"], "matmul": m}))
      continue
    op = "attention_prefill" if ph == "prefill" else "attention_decode"
    names = attention if ph == "prefill" else (decode_attention if decode_attention is not None
                                                else attention)
    # A name the decode op lacks (cudnn) is skipped there, not an error.
    valid = registry.get_op(op).names
    if ph == "decode" and decode_attention is None:
      names = [n for n in names if n is None or n in valid] or [None]
    for a, m in itertools.product(names, matmul):
      if a is not None and a not in valid:
        raise ValueError(f"{op} backend {a!r} is unknown; valid: {', '.join(valid)}")
      out.append((ph, {op: a, "matmul": m}))
  return out


def profile(model, *, batch: int = 1, prefill_len: int = 128, decode_context: int = 512,
            decode_batch: int | None = None,
            phases: Sequence[str] = PHASES, attention: str | Sequence[str] | None = None,
            decode_attention: str | Sequence[str] | None = None,
            matmul: str | Sequence[str] | None = None, steps: int = 3, iters: int = 10,
            page_size: int | None = None, trace_dir: str | os.PathLike | None = None,
            log=None, measure_deadline: float | None = None,
            deadline: float | None = None, mixed_chunk: int = 128,
            kv_cache_dtype: str | None = None) -> Report:
  """Profiles ``model``'s prefill (batch x prefill_len), decode (batch at
  context decode_context; decode_batch rows if given) and, among ``phases``,
  mixed (that decode batch plus a fresh chunk of mixed_chunk prompt tokens)
  for every backend configuration. See the module
  docstring; backends are registry names ('default' = the op's default).
  ``measure_deadline`` / ``deadline`` (time.monotonic() values) stop starting
  new configurations in the measuring / tracing pass; skipped ones say so.
  ``kv_cache_dtype``: the KV cache's dtype (default the model's, or fp8)."""
  import jax

  from models import llama
  from mosaic import bench
  from mosaic import target as target_lib

  if steps < 1 or iters < 1:
    raise ValueError(f"{steps=} and {iters=} must be >= 1")
  for what, n in (("batch", batch), ("prefill_len", prefill_len),
                  ("decode_context", decode_context), ("decode_batch", decode_batch or 1),
                  ("mixed_chunk", mixed_chunk)):
    if n < 1:
      raise ValueError(f"{what}={n} must be >= 1")
  log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
  llama.ops()  # registers the ops' backends
  cfg = model.config
  tgt = target_lib.current()
  tp = model.tensor_parallel_size
  confs = configurations(phases, _names(attention),
                         None if decode_attention is None else _names(decode_attention),
                         _names(matmul))
  built: list[tuple[Profile, _Step | None]] = []
  # Pass 1: compile and measure everything (CUPTI must not follow a trace).
  for ph, backends in confs:
    length = prefill_len if ph == "prefill" else decode_context
    rows = batch if ph == "prefill" or decode_batch is None else decode_batch
    chosen = {k: v for k, v in backends.items() if v is not None}
    chunk = mixed_chunk if ph == "mixed" else 0
    prof = Profile(ph, rows, length, chosen, chunk=chunk)
    if measure_deadline is not None and time.monotonic() > measure_deadline:
      prof.error = "skipped: out of time budget before compiling"
      built.append((prof, None))
      continue
    try:
      step = _Step(model, ph, rows, length, backends, page_size=page_size, chunk=chunk,
                   kv_dtype=kv_cache_dtype)
      prof.step.update(step.measure(iters))
      log(f"measured {prof.label}: " + ", ".join(f"{k} {v * 1e6:.1f} us"
                                                 for k, v in prof.step.items()))
      built.append((prof, step))
    except Exception as e:  # one backend failing must not hide the others
      prof.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
      log(f"failed {prof.label}: {prof.error}")
      built.append((prof, None))
  _check_logits(built)
  # A first trace session runs kernels slower (seen on the H200: +20% on every
  # kernel of the first configuration traced): trace one throwaway step first.
  first = next((s for _, s in built if s is not None), None)
  if first is not None:
    with tempfile.TemporaryDirectory(prefix="mosaic_profile_warmup_") as d:
      with jax.profiler.trace(d, profiler_options=_options()):
        jax.block_until_ready(first())
  # Pass 2: trace each configuration's steps and attribute its kernels.
  for i, (prof, step) in enumerate(built):
    if step is None:
      continue
    if deadline is not None and time.monotonic() > deadline:
      prof.error = "skipped: out of time budget before tracing"
      continue
    try:
      ctx = (contextlib.nullcontext(trace_dir) if trace_dir is not None
             else tempfile.TemporaryDirectory(prefix="mosaic_profile_"))
      with ctx as base:
        d = os.path.join(base, f"{i:02d}_{prof.phase}")
        with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=_options()):
          for s in range(steps):
            with jax.profiler.TraceAnnotation(f"mosaic_profile_step{s}"):
              jax.block_until_ready(step())
        tr = parse_trace(find_trace_file(d))
      groups = _split_steps(tr, steps)
      per_step = [attribute(ks, step.op_names, cfg.num_layers) for ks in groups]
      if not any(s.times for s in per_step):
        raise RuntimeError(f"the trace ({tr.path}) holds no kernel of the step")
      # The decode step wrote the cache inside attention (no kv_write kernel
      # in any layer): attention_decode_append, where its backend has it.
      appended = prof.phase == "decode" and not any(
          op == "kv_write" and layer is not None for s in per_step for layer, op in s.times)
      costs = op_costs(cfg, prof.phase, prof.batch, prof.length, dtype=model.dtype,
                       chunk=prof.chunk, kv_dtype=kv_cache_dtype,
                       folded_norms=getattr(model, "fold_norms", False),
                       decode_append=appended, tp=tp,
                       quantization=getattr(model, "quantization", None),
                       fp8_prefill_attention=prof.phase != "decode" and prof.backends.get(
                           "attention_prefill") == "mosaic_fp8")
      summarize(prof, per_step, costs, cfg.num_layers, tgt)
      prof.step["trace_device"] = tr.device
      prof.step["trace_info"] = tr.info
    except Exception as e:
      prof.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
      log(f"trace failed {prof.label}: {prof.error}")
  if tgt.is_gpu:
    note = (f"{tgt.name}: utilization against {tgt.ceilings.bf16_tflops:g} TFLOP/s dense bf16 "
            f"(fp8 products: {cost_lib.FP8_SPEEDUP:g}x that) and "
            f"{tgt.ceilings.hbm_gbps:g} GB/s HBM ({tgt.ceilings.source}); device times from "
            "the GPU's own timers (jax.profiler trace, CUPTI)")
  else:
    note = (f"CPU ({tgt.name}): no tensor cores; % figures are against nominal CPU ceilings "
            f"({tgt.ceilings.bf16_tflops:g} TFLOP/s, {tgt.ceilings.hbm_gbps:g} GB/s) and mean "
            "little; op times are XLA CPU thunk times from the host trace")
  if tp > 1:
    note += (f"; tensor parallel over {tp} devices: the rows are device 0's kernels and "
             "costs (every device runs the same program), the collectives' rows time only")
  model_info = dict(cfg.to_dict()) | {"dtype": str(model.dtype), "tensor_parallel_size": tp}
  return Report(bench.environment(), model_info, note, [p for p, _ in built])


def _options():
  """Host annotations on (step windows, XLA's per-op annotations), Python frames off."""
  import jax

  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0
  return opts


def _check_logits(built) -> None:
  """Each configuration's first logits against those of the same phase's
  xla (else reference) attention configuration, as a relative Frobenius error."""
  import numpy as np

  for ph in PHASES:
    done = [(p, s) for p, s in built if p.phase == ph and s is not None]
    refs = [(p, s) for p, s in done
            if p.backends.get("attention_prefill" if ph == "prefill" else "attention_decode")
            in ("xla", "reference")
            and (ph != "mixed" or p.backends.get("attention_prefill") in ("xla", "reference"))]
    if not refs:
      continue
    rp, rs = refs[0]
    ref = rs.first_logits
    for p, s in done:
      err = float(np.linalg.norm(s.first_logits - ref) / max(np.linalg.norm(ref), 1e-30))
      p.step["logits_rel_err"] = err if np.isfinite(err) else float("nan")
      p.step["logits_ref"] = rp.label


def _split_steps(tr: Trace, steps: int) -> list[list[Kernel]]:
  """The kernels of each traced step: those inside its host annotation window;
  if the windows catch none (device and host clocks apart), the kernels split
  at the steps - 1 widest gaps (the host waits for each step to finish)."""
  groups = []
  for s in range(steps):
    w = tr.windows.get(f"mosaic_profile_step{s}")
    if w is None:
      break
    groups.append([k for k in tr.kernels if w[0] <= k.ts <= w[1]])
  if len(groups) == steps and all(groups):
    return groups
  ks = sorted(tr.kernels, key=lambda k: k.ts)
  if steps == 1 or len(ks) < steps:
    return [ks]
  gaps = sorted(range(1, len(ks)), key=lambda i: ks[i].ts - (ks[i - 1].ts + ks[i - 1].dur))
  cuts = sorted(gaps[-(steps - 1):])
  return [ks[a:b] for a, b in zip([0] + cuts, cuts + [len(ks)])]


def load_model(spec: str, *, layers: int | None = None, dtype: str = "bfloat16", seed: int = 0,
               tp: int = 1, quantization: str | None = None):
  """A model to profile: 'tiny', a named config (random weights, e.g.
  'llama3.1-8b'), or anything models.load takes. ``layers`` cuts the layer
  count of a random-weight model; ``tp`` splits it over that many devices
  (tensor parallelism, as ``serve --tensor-parallel-size``)."""
  import models
  from models import config as config_lib
  from models import model as model_lib
  from models import tokenizer as tok_lib

  if spec in config_lib.CONFIGS:
    cfg = config_lib.get(spec)
    if layers is not None:
      cfg = cfg.replace(num_layers=layers, name=f"{cfg.name}-{layers}l")
    params = model_lib.random_params(cfg, seed, dtype=dtype)
    return model_lib.Model(cfg, params, tok_lib.ByteTokenizer(), dtype=dtype,
                           mesh=model_lib.tp_mesh(cfg, tp), quantization=quantization)
  if layers is not None:
    raise ValueError(f"--layers applies to named configs ({', '.join(config_lib.CONFIGS)}); "
                     f"{spec!r} is a checkpoint")
  return models.load(spec, dtype=dtype, tp=tp, quantization=quantization)


# Warpgroup roles of the FA3 prefill kernel (kernels/attention_prefill.py).
FA3_ROLES = ("consumer 0", "consumer 1", "producer")


def label_timeline(trace: dict, roles: Sequence[str] = FA3_ROLES, max_sms: int | None = 4) -> dict:
  """Mosaic GPU's in-kernel trace (one process per SM, one thread per CTA
  warpgroup) with named tracks, cut to the first ``max_sms`` SMs (a full grid
  is hundreds of MB of events), rebased to start at 0 us."""
  events = [e for e in trace.get("traceEvents", []) if e.get("ph") in ("B", "E")]
  if max_sms is not None:
    keep = sorted({e["pid"] for e in events})[:max_sms]
    events = [e for e in events if e["pid"] in keep]
  if not events:
    raise ValueError("the kernel trace has no events (did the kernel record any named region?)")
  t0 = min(e["ts"] for e in events)
  out = [dict(e, ts=e["ts"] - t0) for e in events]
  meta = []
  n = len(roles)
  for pid in sorted({e["pid"] for e in out}):
    meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                 "args": {"name": f"SM {pid - 1}"}})
  for pid, tid in sorted({(e["pid"], e["tid"]) for e in out}):
    cta, wg = divmod(tid - 1, n)
    meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                 "args": {"name": f"CTA {cta} {roles[wg]}"}})
  return {"displayTimeUnit": "ns", "traceEvents": meta + out}


def kernel_timeline(model, out_dir: str | os.PathLike, *, prefill_len: int = 4096,
                    max_sms: int | None = 4, log=print) -> pathlib.Path:
  """The FA3 prefill kernel's in-kernel timeline at one layer of ``model``'s
  prefill (B=1, ``prefill_len`` tokens, causal): per warpgroup, when it waits
  for K, runs QK^T, the softmax, waits for V and runs PV, and when the
  producer loads K/V. Written as Perfetto JSON to
  ``out_dir/fa3_timeline.json``. Needs a GPU (Mosaic GPU's on-device profiler)."""
  import jax
  import jax.numpy as jnp

  from kernels import attention_prefill as ap
  from mosaic import dsl, testing
  from mosaic import target as target_lib

  if not target_lib.current().is_gpu:
    raise RuntimeError("the in-kernel timeline needs a GPU: Mosaic GPU's profiler stamps "
                       "the SM clock on the device; interpreted kernels record nothing")
  cfg = model.config
  dt = jnp.dtype(model.dtype)
  if dt.name not in ap.DTYPES:
    dt = jnp.dtype(jnp.bfloat16)
  q, k, v = testing.random_inputs([(1, prefill_len, cfg.num_heads, cfg.head_dim),
                                   (1, prefill_len, cfg.num_kv_heads, cfg.head_dim),
                                   (1, prefill_len, cfg.num_kv_heads, cfg.head_dim)], dt)
  out_dir = pathlib.Path(out_dir)
  with tempfile.TemporaryDirectory() as raw:
    with dsl.kernel_timeline(raw):
      jax.block_until_ready(ap.attention_prefill_mosaic(q, k, v, causal=True))
      jax.effects_barrier()  # the trace is written by a host callback
    files = sorted(pathlib.Path(raw).glob("*-trace.json"))
    if not files:
      raise RuntimeError("the kernel wrote no trace")
    trace = json.loads(files[-1].read_text())
  out = label_timeline(trace, max_sms=max_sms)
  out_dir.mkdir(parents=True, exist_ok=True)
  path = out_dir / "fa3_timeline.json"
  path.write_text(json.dumps(out))
  log(f"in-kernel timeline: {len(out['traceEvents'])} events -> {path}")
  return path


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default="tiny",
                 help="tiny, a named config with random weights (llama3.1-8b, ...), or a checkpoint")
  p.add_argument("--layers", type=int, help="cut a named config to this many layers")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                 help="weights and activations")
  p.add_argument("--batch", type=int, default=1, help="B: rows in prefill (and decode)")
  p.add_argument("--decode-batch", type=int, help="rows in decode (default: --batch)")
  p.add_argument("--prefill-len", type=int, default=128, help="S: tokens per row in prefill")
  p.add_argument("--decode-context", type=int, default=512, help="L: kv tokens per row in decode")
  p.add_argument("--phases", default="prefill,decode",
                 help="comma list of prefill, decode, mixed (decode rows + a prompt chunk)")
  p.add_argument("--mixed-chunk", type=int,
                 help="T: prompt tokens of the mixed step's chunk (default 128; needs the "
                      "mixed phase)")
  p.add_argument("--attention-backend", default="default",
                 help="comma list, e.g. mosaic,cudnn,xla (prefill; decode too where it exists)")
  p.add_argument("--decode-attention-backend", help="comma list for decode (default: as above)")
  p.add_argument("--matmul-backend", default="default", help="comma list, e.g. mosaic,xla")
  p.add_argument("--steps", type=int, default=3, help="steps traced per configuration")
  p.add_argument("--iters", type=int, default=10, help="steps timed per configuration")
  p.add_argument("--page-size", type=int, help="tokens per KV page (default: the kernel's)")
  p.add_argument("--quantization", default=None, choices=("fp8",),
                 help="as serve's: fp8 makes the layers' linears W8A8 (their rows are counted "
                 "against the fp8 peak, twice bf16's)")
  p.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES),
                 help="KV cache dtype: auto = the model's; fp8 = float8_e4m3fn")
  p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                 help="devices the model is split over (as serve's flag); the rows are device "
                      "0's, with a row per collective (o_proj_all_reduce, down_all_reduce, "
                      "lm_head_all_gather)")
  p.add_argument("--per-layer", action="store_true", help="print every (layer, op) row")
  p.add_argument("--out", type=pathlib.Path, help="write profile.json, .png, _trace.json here")
  p.add_argument("--keep-trace", action="store_true",
                 help="keep the raw jax.profiler traces under --out/raw")
  p.add_argument("--kernel-timeline", action="store_true",
                 help="also write the FA3 kernel's per-warpgroup timeline (GPU) to "
                      "--out/fa3_timeline.json")


def run_cli(a) -> int:
  """``python -m serving profile`` and ``python -m serving.profiler``: bad
  flags or model are a message and exit status 2, not a traceback."""
  try:
    return _run_cli(a)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _run_cli(a) -> int:
  phases = [s.strip() for s in a.phases.split(",") if s.strip()]
  if not phases:
    raise ValueError(f"--phases {a.phases!r} names no phase (of {', '.join(PHASES)})")
  for flag, value in (("--decode-batch", a.decode_batch),
                      ("--decode-attention-backend", a.decode_attention_backend)):
    if value is not None and not {"decode", "mixed"} & set(phases):
      raise ValueError(f"{flag} {value}: --phases {a.phases!r} has no decode or mixed step")
  if a.mixed_chunk is not None and "mixed" not in phases:
    raise ValueError(f"--mixed-chunk {a.mixed_chunk}: --phases {a.phases!r} has no mixed step")
  for flag in ("keep_trace", "kernel_timeline"):  # (before the profile's minutes, not after)
    if getattr(a, flag) and a.out is None:
      raise ValueError(f"--{flag.replace('_', '-')} needs --out")
  if a.tensor_parallel_size < 1:
    raise ValueError(f"--tensor-parallel-size {a.tensor_parallel_size} must be >= 1")
  model = load_model(a.model, layers=a.layers, dtype=a.dtype, tp=a.tensor_parallel_size,
                     quantization=a.quantization)
  trace_dir = None
  if a.keep_trace:
    trace_dir = a.out / "raw"
  rep = profile(model, batch=a.batch, prefill_len=a.prefill_len, decode_context=a.decode_context,
                decode_batch=a.decode_batch, phases=phases,
                attention=a.attention_backend, decode_attention=a.decode_attention_backend,
                matmul=a.matmul_backend, steps=a.steps, iters=a.iters, page_size=a.page_size,
                trace_dir=trace_dir,
                mixed_chunk=128 if a.mixed_chunk is None else a.mixed_chunk,
                kv_cache_dtype=KV_CACHE_DTYPES[a.kv_cache_dtype])
  print(rep.table(per_layer=a.per_layer))
  if a.out is not None:
    paths = rep.write_all(a.out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
  if a.kernel_timeline:
    try:
      kernel_timeline(model, a.out, prefill_len=a.prefill_len)
    except RuntimeError as e:  # no GPU: the per-layer profile still stands
      print(f"kernel timeline skipped: {e}", file=sys.stderr)
  return 0 if all(p.error is None for p in rep.profiles) else 1


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m serving.profiler", description=__doc__.split("\n")[0])
  add_arguments(p)
  return run_cli(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
