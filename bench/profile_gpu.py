"""The per-layer profiler on a Llama-3-8B-shaped model (random bf16 weights),
checked against the measured step time and the kernels' own timings.

One process, in this order (CUPTI must not follow a jax.profiler trace):

1. the model: llama3.1-8b's shapes cut to ``--layers`` layers (default 4, to
   fit the time budget; every layer has the same shapes, so per-layer figures
   are those of the full model);
2. the kernels on their own, at the model's shapes, with device timers
   (mosaic.bench.time_jax, CUPTI): each matmul of a layer (qkv, o + residual,
   gate_up, down + residual, lm_head) at M = B*S (prefill) and M = B
   (decode), and each attention backend at the model's call; each alone and
   in the model's order (right after the kernel before it, see isolated);
3. serving.profiler.profile, one call for both phases (and the mixed step
   with ``--mixed-chunk T``; it has no own-kernel comparison): every configuration
   compiled, its logits checked against the xla-attention configuration, its
   step timed (CUPTI kernel sum and back-to-back wall time); only then each
   is traced and attributed to layers and ops;
4. the checks: per-layer sum (all ops, layers and head) within 10% of the
   CUPTI step time; per-op TFLOP/s of matmuls and attention against the
   kernels' own figures from 2, alone and L2-cold as the kernels' own
   benchmarks time them (``ratio``, the check; the ratio to the op in the
   model's order, ``ratio_in_order``, is reported beside it), both over the
   kinds of kernel (ours, XLA's) that the model's op ran;
5. the FA3 kernel's in-kernel timeline per warpgroup (fa3_timeline.json).

XLA command buffers are turned off (``--xla_gpu_enable_command_buffer=``) so
that every kernel in the trace carries its HLO op.

  PYTHONPATH=. python3 bench/profile_gpu.py --out /tmp/prof [--layers 4]
"""

from __future__ import annotations

import os
import sys

if "--keep-command-buffers" not in sys.argv:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_gpu_enable_command_buffer=").strip()

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

T0 = time.monotonic()


def log(msg):
  print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


KINDS = ("mosaic", "xla")


def kernel_kind(name: str) -> str:
  """"mosaic" for our Mosaic GPU kernels, "xla" for the rest (XLA's fusions)."""
  return "mosaic" if "mosaic_gpu_kernel" in name else "xla"


def own_seconds(own: dict, model_kernels) -> float:
  """An op's own time over the kinds of kernel the model's op ran (all kinds
  when the model's kernels are not known)."""
  kinds = {kernel_kind(n) for n in model_kernels} or set(KINDS)
  return sum(own[c] for c in kinds)


def isolated(model, phase, batch, length, attn_names, page_size):
  """Device time (CUPTI median) of each op's kernels on their own, at the
  model's shapes, measured two ways:

    alone     the op by itself, on L2-cold input sets
    in order  the op right after the kernel that precedes it in the model
              (qkv and gate_up after their norm, attention after qkv, o after
              the attention, down after gate_up, lm_head after the final norm):
              the pair's time minus the first kernel's: what the kernel
              before leaves in L2 and in flight, which "alone" cannot show.

  Each time is split by kind of kernel ({"mosaic": s, "xla": s}, see
  ``kernel_kind``): a split-K matmul is our kernel plus XLA's sum of its
  partials, and in the model XLA may fuse that sum into the next op's kernel
  (qkv's goes into the rope and cache-write fusions), so the check compares
  the kinds of kernels the model's op has.

  -> {(op, backend-or-None): {"alone": t, "in_order": t, "flops": f}}; the
  o row is keyed by the attention backend that precedes it."""
  from mosaic import bench, cost
  from models import kv_cache, llama

  ops = llama.ops()
  cfg, dt = model.config, model.dtype
  d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  eps = cfg.rms_norm_eps
  m = batch * length if phase == "prefill" else batch
  mo = batch if phase == "prefill" else m  # lm_head rows: the last token of each prompt
  keys = iter(jax.random.split(jax.random.key(1), 4096))
  rnd = lambda *s, dtype=dt: jax.random.normal(next(keys), s, jnp.float32).astype(dtype)

  def sets(*shapes):
    """As in the model, inputs not in L2 when the op runs: rotate past them."""
    size = sum(int(np.prod(s)) for s in shapes) * jnp.dtype(dt).itemsize
    return [tuple(rnd(*s) for s in shapes) for _ in range(bench.cold_sets(size))]

  def median(fn, input_sets):
    """{kernel kind: seconds} of one call (medians per kernel, CUPTI)."""
    t = dict.fromkeys(KINDS, 0.0)
    for name, sec in bench.time_jax_kernels(jax.jit(fn), input_sets, iters=10, warmup=1):
      t[kernel_kind(name)] += sec
    return t

  first_s = {}  # (first kernel, its sets) -> times: the norm comes before two ops

  def after(first, first_sets, then, then_sets):
    """then(first(*a), *b) minus first(*a): ``then`` in the model's order."""
    k = len(first_sets[0])
    n = max(len(first_sets), len(then_sets))
    pairs = [first_sets[i % len(first_sets)] + then_sets[i % len(then_sets)] for i in range(n)]
    key = (first, id(first_sets))
    if key not in first_s:
      first_s[key] = median(first, first_sets)
    pair = median(lambda *a: then(first(*a[:k]), *a[k:]), pairs)
    return {c: max(0.0, pair[c] - first_s[key][c]) for c in KINDS}

  norm = lambda x, g: ops["rms_norm"](x, g, eps=eps)
  qkv = lambda h, w: ops["matmul"](h, w)
  o = lambda a, w, r: ops["matmul"](a, w, residual=r)
  gate_up = lambda h, w: ops["matmul"](h, w, activation="swiglu")  # fused gate, as in the model
  down = lambda a, w, r: ops["matmul"](a, w, residual=r)
  lm_head = lambda h, w: ops["matmul"](h, w, out_dtype=jnp.float32)
  n_qkv = (hq + 2 * hkv) * hd
  norm_sets, head_norm_sets = sets((m, d), (d,)), sets((mo, d), (d,))
  w_qkv, w_o, w_gu = sets((d, n_qkv)), sets((hq * hd, d), (m, d)), sets((d, 2 * f))
  w_down, w_head = sets((f, d), (m, d)), sets((d, v))
  qkv_in, gu_in = sets((m, d), (d, n_qkv)), sets((m, d), (d, 2 * f))
  # q's slice of the qkv output is a copy: in the model it is qkv's and rope's
  # work, so in the attention's pair it goes with the first kernel.
  q_len = length if phase == "prefill" else 1
  qkv_q = lambda h, w: qkv(h, w)[:, :hq * hd].reshape(batch, q_len, hq, hd)
  out = {}

  def put(key, alone_fn, alone_sets, in_order_s, flops):
    out[key] = {"alone": median(alone_fn, alone_sets), "in_order": in_order_s, "flops": flops}

  mm_flops = lambda rows, n, k: 2.0 * rows * n * k
  put(("mm_qkv", None), qkv, qkv_in, after(norm, norm_sets, qkv, w_qkv), mm_flops(m, n_qkv, d))
  put(("mm_gate_up", None), gate_up, gu_in, after(norm, norm_sets, gate_up, w_gu),
      mm_flops(m, 2 * f, d))
  put(("mm_down", None), down, sets((m, f), (f, d), (m, d)),
      after(gate_up, gu_in, down, w_down), mm_flops(m, d, f))
  put(("mm_lm_head", None), lm_head, sets((mo, d), (d, v)),
      after(norm, head_norm_sets, lm_head, w_head), mm_flops(mo, v, d))
  o_alone = median(o, sets((m, hq * hd), (hq * hd, d), (m, d)))

  for name in attn_names:
    try:
      if phase == "prefill":
        s = length
        # The model's call for a fresh prompt, its plan built once per step
        # outside the layers (models.llama._prefill_attention), so not timed.
        op = ops["attention_prefill"]
        qa = jax.ShapeDtypeStruct((batch, s, hq, hd), dt)
        ka = jax.ShapeDtypeStruct((batch, s, hkv, hd), dt)
        plan = jax.jit(lambda: op.plan(qa, ka, ka, causal=True, backend=name))()
        attn = lambda q, k, v: op(q, k, v, causal=True, backend=name, plan=plan)
        kv = sets((batch, s, hkv, hd), (batch, s, hkv, hd))
        alone_sets = [(rnd(batch, s, hq, hd),) + kvs for kvs in kv]
        c = cost.attention(batch, hq, hkv, s, s, hd, causal=True)
      else:
        ps = page_size or kv_cache.DEFAULT_PAGE_SIZE
        per = -(-length // ps)
        pages = batch * per + 1
        lengths = jnp.full((batch,), length, jnp.int32)
        pt = (1 + jnp.arange(batch * per, dtype=jnp.int32)).reshape(batch, per)
        attn = lambda q, k, v: ops["attention_decode"](q, k, v, lengths, pt, backend=name)
        kv = sets((hkv, pages, ps, hd), (hkv, pages, ps, hd))
        alone_sets = [(rnd(batch, 1, hq, hd),) + kvs for kvs in kv]
        c = cost.attention(batch, hq, hkv, 1, length, hd, causal=True)
      put(("attention", name), attn, alone_sets, after(qkv_q, qkv_in, attn, kv), c.flops)
      flat = lambda q, k, v: attn(q, k, v).reshape(m, hq * hd)
      out[("mm_o", name)] = {"alone": o_alone, "flops": mm_flops(m, d, hq * hd),
                             "in_order": after(flat, alone_sets, o, w_o)}
    except Exception as e:  # a backend that cannot run this shape is reported, not fatal
      log(f"isolated {phase} attention {name}: {type(e).__name__}: {str(e)[:200]}")
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", type=pathlib.Path, required=True)
  p.add_argument("--model", default="llama3.1-8b")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--batch", type=int, default=1, help="prefill rows")
  p.add_argument("--prefill-len", type=int, default=4096)
  p.add_argument("--decode-batch", type=int, default=16)
  p.add_argument("--decode-context", type=int, default=2048)
  p.add_argument("--attention-backend", default="mosaic,cudnn,xla")
  p.add_argument("--decode-attention-backend", default="mosaic,xla")
  p.add_argument("--mixed-chunk", type=int, default=0,
                 help="also profile a mixed step: the decode batch plus a prompt chunk of "
                      "this many tokens in one call (0: off)")
  p.add_argument("--budget-s", type=float, default=120.0,
                 help="stop starting new work after this many seconds")
  p.add_argument("--keep-command-buffers", action="store_true")
  a, _ = p.parse_known_args(argv)  # bench/gpu.sh passes flags meant for other benches

  from mosaic import bench, target as target_lib
  from serving import profiler as P

  tgt = target_lib.current()
  log(f"device {tgt.name} ({tgt.kind}); XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
  model = P.load_model(a.model, layers=a.layers, dtype="bfloat16")
  log(f"model {model.config.name}: {model.config.num_params() / 1e9:.2f}B params")
  attn = [n for n in a.attention_backend.split(",") if n]
  dattn = [n for n in a.decode_attention_backend.split(",") if n]
  iso = {}
  if tgt.is_gpu:
    for ph, bsz, length, names in (("prefill", a.batch, a.prefill_len, attn),
                                   ("decode", a.decode_batch, a.decode_context, dattn)):
      try:
        iso[ph] = isolated(model, ph, bsz, length, names, None)
        us = lambda t: " + ".join(f"{t[c] * 1e6:.1f}" for c in KINDS)
        log(f"isolated {ph} (us, ours + XLA's kernels): " + ", ".join(
            f"{k[0]}{'/' + k[1] if k[1] else ''} {us(v['alone'])} alone, "
            f"{us(v['in_order'])} in order" for k, v in iso[ph].items()))
      except Exception as e:
        log(f"isolated {ph} failed: {type(e).__name__}: {str(e)[:300]}")
  # One profile() call for both phases: it measures every configuration (CUPTI)
  # before it traces any (CUPTI aborts after a jax.profiler trace).
  left = T0 + a.budget_s - time.monotonic()
  phases = P.PHASES if a.mixed_chunk > 0 else ("prefill", "decode")
  rep = P.profile(model, batch=a.batch, prefill_len=a.prefill_len, decode_batch=a.decode_batch,
                  decode_context=a.decode_context, attention=attn, decode_attention=dattn,
                  phases=phases, mixed_chunk=max(1, a.mixed_chunk),
                  steps=3, iters=10, measure_deadline=time.monotonic() + left * 0.6,
                  deadline=time.monotonic() + left, log=log)
  print(rep.table(), flush=True)
  rep.write_json(a.out / "profile_llama8b.json")  # kept if a later step dies
  # Checks and the flat result table.
  rows = []
  op_of = {"qkv": "mm_qkv", "o_proj": "mm_o", "gate_up": "mm_gate_up", "down": "mm_down",
           "lm_head": "mm_lm_head"}
  ok = True
  for pr in rep.profiles:
    base = {"config": pr.label}
    if pr.error:
      rows.append(base | {"op": "step", "check": f"error: {pr.error}"})
      continue
    s = pr.step
    within = s.get("sum_over_measured")
    good = within is not None and abs(within - 1) <= 0.10 and s.get("measured_by") == "cupti"
    ok &= good
    rows.append(base | {"op": "step", "time_us": s["sum_s"] * 1e6,
                        "measured_us": s.get("cupti_s", s.get("wall_s", 0)) * 1e6,
                        "wall_us": s.get("wall_s", 0) * 1e6,
                        "ratio": within, "tflops": s.get("step_tflops"),
                        "gbps": s.get("step_gbps"), "tc_pct": s.get("step_tc_pct"),
                        "hbm_pct": s.get("step_hbm_pct"),
                        "check": ("sum within 10% of cupti step" if good else "sum OFF by >10%")
                        + (f"; logits err {s['logits_rel_err']:.2g}" if "logits_rel_err" in s else "")})
    attn_name = pr.backends.get("attention_prefill", pr.backends.get("attention_decode"))
    kernels = iso.get(pr.phase, {})
    for o in pr.ops:
      op = o["op"]
      r = base | {k: o.get(k) for k in ("op", "time_us", "tflops", "gbps", "tc_pct", "hbm_pct",
                                        "bound", "share_pct")}
      key = ("attention", attn_name) if op == "attention" else (
          (op_of[op], attn_name if op == "o_proj" else None) if op in op_of else None)
      own = kernels.get(key)
      if own is not None and o.get("tflops"):
        # ratio: against the op alone (the check); ratio_in_order: against it
        # after the kernel that precedes it in the model (see isolated). Both
        # over the kinds of kernel the model's op ran.
        names = [e["name"] for e in pr.events if e.get("op") == op]
        for col, t in (("", own["alone"]), ("_in_order", own["in_order"])):
          t = own_seconds(t, names)
          ref = own["flops"] / t / 1e12 if t > 0 else None
          r["own_tflops" + col] = ref
          r["ratio" + col] = o["tflops"] / ref if ref else None
      rows.append(r)
  cols = ["config", "op", "time_us", "share_pct", "tflops", "gbps", "tc_pct", "hbm_pct", "bound",
          "own_tflops", "ratio", "own_tflops_in_order", "ratio_in_order", "measured_us",
          "wall_us", "check"]
  cmd = "PYTHONPATH=. python3 bench/profile_gpu.py " + " ".join(sys.argv[1:])
  bench.write(a.out, "profile_gpu", rows, cols, cmd)
  paths = rep.write_all(a.out, stem="profile_llama8b")
  log("wrote " + ", ".join(str(x) for x in paths.values()))
  print(bench.table(rows, cols))
  log("per-layer sum within 10% of the measured step: " + ("yes" if ok else "NO"))
  for col, what in (("ratio", "run alone, as their own benchmarks run them (the check)"),
                    ("ratio_in_order", "run in the model's order")):
    off = [f"{r['config']} {r['op']} {r[col]:.2f}" for r in rows
           if r.get("op") != "step" and r.get(col) is not None and abs(r[col] - 1) > 0.10]
    log(f"op utilization within 10% of the kernels' own, {what}: "
        + ("yes" if not off else "NO: " + "; ".join(off)))
  if tgt.is_gpu:
    try:
      P.kernel_timeline(model, a.out, prefill_len=a.prefill_len, log=log)
    except Exception as e:  # noqa: BLE001 - the profile above stands without it
      log(f"kernel timeline failed: {type(e).__name__}: {str(e)[:300]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
