"""The per-layer profiler on a Llama-3-8B-shaped model (random bf16 weights),
checked against the measured step time and the kernels' own timings.

One process, in this order (CUPTI must not follow a jax.profiler trace):

1. the model: llama3.1-8b's shapes cut to ``--layers`` layers (default 4, to
   fit the time budget; every layer has the same shapes, so per-layer figures
   are those of the full model);
2. the kernels on their own, at the model's shapes, with device timers
   (mosaic.bench.time_jax, CUPTI): each matmul of a layer (qkv, o + residual,
   gate_up, down + residual, lm_head) at M = B*S (prefill) and M = B
   (decode), and each attention backend at the model's call;
3. serving.profiler.profile, one call for both phases (and the mixed step
   with ``--mixed-chunk T``; it has no own-kernel comparison): every configuration
   compiled, its logits checked against the xla-attention configuration, its
   step timed (CUPTI kernel sum and back-to-back wall time); only then each
   is traced and attributed to layers and ops;
4. the checks: per-layer sum (all ops, layers and head) within 10% of the
   CUPTI step time; per-op TFLOP/s of matmuls and attention against the
   kernels' own figures from 2;
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
import sys
import time

import jax
import jax.numpy as jnp

T0 = time.monotonic()


def log(msg):
  print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def isolated(model, phase, batch, length, attn_names, page_size):
  """Device time (CUPTI median) of each op's kernels on their own, at the
  model's shapes: {(op, backend-or-None): (seconds, flops)}."""
  from kernels import attention_decode as ad
  from models import llama
  from mosaic import bench, registry

  ops = llama.ops()
  cfg, dt = model.config, model.dtype
  d, hd, f, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  m = batch * length if phase == "prefill" else batch
  keys = iter(jax.random.split(jax.random.key(1), 1024))
  rnd = lambda *s, dtype=dt: jax.random.normal(next(keys), s, jnp.float32).astype(dtype)
  out = {}
  # The model's matmuls: q/k/v fused, gate/up fused (models.llama).
  mm = [(("qkv",), d, (hq + 2 * hkv) * hd, False), (("o",), hq * hd, d, True),
        (("gate_up",), d, 2 * f, False), (("down",), f, d, True)]
  for names, k, n, res in mm:
    # As in the model, the weight is not in L2 when the op runs (rotate past it).
    n_sets = bench.cold_sets(2 * (m * k + k * n + (m * n if res else 0)))
    sets = [(rnd(m, k), rnd(k, n)) + ((rnd(m, n),) if res else ()) for _ in range(n_sets)]
    # gate_up runs with its SwiGLU gate fused, as in the model.
    act = "swiglu" if names == ("gate_up",) else None
    fn = (lambda a, b, r: ops["matmul"](a, b, residual=r)) if res else (
        lambda a, b, act=act: ops["matmul"](a, b, activation=act))
    t = bench.time_jax(jax.jit(fn), sets, iters=10, warmup=1)
    for name in names:
      out[("mm_" + name, None)] = (t.median_s, 2.0 * m * n * k)
  mo = batch if phase == "prefill" else m
  sets = [(rnd(mo, d), rnd(d, v)) for _ in range(bench.cold_sets(2 * (mo * d + d * v)))]
  t = bench.time_jax(jax.jit(lambda a, b: ops["matmul"](a, b, out_dtype=jnp.float32)), sets,
                     iters=10, warmup=1)
  out[("mm_lm_head", None)] = (t.median_s, 2.0 * mo * v * d)
  from mosaic import cost

  for name in attn_names:
    try:
      if phase == "prefill":
        s = length
        q, kk, vv = rnd(batch, s, hq, hd), rnd(batch, s, hkv, hd), rnd(batch, s, hkv, hd)
        # The model's call for a fresh prompt (no cached prefix, see models.llama).
        fn = jax.jit(lambda q, k, v: ops["attention_prefill"](q, k, v, causal=True, backend=name))
        c = cost.attention(batch, hq, hkv, s, s, hd, causal=True)
        t = bench.time_jax(fn, [(q, kk, vv)], iters=10, warmup=1)
      else:
        ps = page_size or llama.DEFAULT_PAGE_SIZE
        per = -(-length // ps)
        pages = batch * per + 1
        lengths = jnp.full((batch,), length, jnp.int32)
        pt = (1 + jnp.arange(batch * per, dtype=jnp.int32)).reshape(batch, per)
        fn = jax.jit(lambda q, k, v: ops["attention_decode"](q, k, v, lengths, pt, backend=name))
        c = cost.attention(batch, hq, hkv, 1, length, hd, causal=True)
        # As in the model (and as the matmuls above), the layer's K/V pages are
        # not in L2 when it runs: rotate past them (a small cache would stay hot).
        n_sets = bench.cold_sets(2 * hkv * pages * ps * hd * jnp.dtype(dt).itemsize)
        sets = [(rnd(batch, 1, hq, hd), rnd(hkv, pages, ps, hd), rnd(hkv, pages, ps, hd))
                for _ in range(n_sets)]
        t = bench.time_jax(fn, sets, iters=10, warmup=1)
      out[("attention", name)] = (t.median_s, c.flops)
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
        log(f"isolated {ph}: " + ", ".join(f"{k[0]}{'/' + k[1] if k[1] else ''} "
                                           f"{v[0] * 1e6:.1f}us" for k, v in iso[ph].items()))
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
  op_of = {"qkv": ["mm_qkv"], "o_proj": ["mm_o"], "gate_up": ["mm_gate_up"],
           "down": ["mm_down"], "lm_head": ["mm_lm_head"]}
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
    by_op = {o["op"]: o for o in pr.ops}
    attn_name = pr.backends.get("attention_prefill", pr.backends.get("attention_decode"))
    for op, o in by_op.items():
      r = base | {k: o.get(k) for k in ("op", "time_us", "tflops", "gbps", "tc_pct", "hbm_pct",
                                        "bound", "share_pct")}
      ref = None
      kernels = iso.get(pr.phase, {})
      if op in op_of and all((k, None) in kernels for k in op_of[op]):
        t = sum(kernels[(k, None)][0] for k in op_of[op])
        fl = sum(kernels[(k, None)][1] for k in op_of[op])
        ref = fl / t / 1e12
      elif op == "attention" and ("attention", attn_name) in kernels:
        t, fl = kernels[("attention", attn_name)]
        ref = fl / t / 1e12
      if ref is not None and o.get("tflops"):
        r["own_tflops"] = ref
        r["ratio"] = o["tflops"] / ref
      rows.append(r)
  cols = ["config", "op", "time_us", "share_pct", "tflops", "gbps", "tc_pct", "hbm_pct", "bound",
          "own_tflops", "ratio", "measured_us", "wall_us", "check"]
  cmd = "PYTHONPATH=. python3 bench/profile_gpu.py " + " ".join(sys.argv[1:])
  bench.write(a.out, "profile_gpu", rows, cols, cmd)
  paths = rep.write_all(a.out, stem="profile_llama8b")
  log("wrote " + ", ".join(str(x) for x in paths.values()))
  print(bench.table(rows, cols))
  log("per-layer sum within 10% of the measured step: " + ("yes" if ok else "NO"))
  off = [f"{r['config']} {r['op']} {r['ratio']:.2f}" for r in rows
         if r.get("op") != "step" and r.get("ratio") is not None and abs(r["ratio"] - 1) > 0.10]
  log("op utilization within 10% of the kernels' own: " + ("yes" if not off else
                                                          "NO: " + "; ".join(off)))
  if tgt.is_gpu:
    try:
      P.kernel_timeline(model, a.out, prefill_len=a.prefill_len, log=log)
    except Exception as e:  # noqa: BLE001 - the profile above stands without it
      log(f"kernel timeline failed: {type(e).__name__}: {str(e)[:300]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
