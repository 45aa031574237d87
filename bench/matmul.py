"""matmul: our Mosaic GPU kernel against cuBLAS (through XLA and through torch).

Shapes: 8192^3 and the Llama-3-8B layer shapes (qkv 4096->6144, o 4096->4096,
gate_up 4096->28672, down 14336->4096, lm_head 4096->128256) at M in
{1, 16, 64, 192, 256, 2048, 8192} (192: the mixed step's 64 decode rows
plus a 128-token prompt chunk), bf16 in, bf16 out. For every shape each
backend's output is first checked against the float32 reference (relative
Frobenius error), then timed on two rotating input sets (so weights do not
sit hot in L2) with device timers; the table gives microseconds, TFLOP/s
and GB/s (each operand read once, the output written once) and two ratios:
``vs_cublas`` against the faster cuBLAS (XLA with its Triton GEMMs turned
off, ``xla_cublas``, and torch) and ``vs_xla`` against XLA's default ``a @ b``,
which at decode shapes is often XLA's own Triton GEMM rather than cuBLAS.

``--tune`` then tries a few configs per shape within ``--budget-s`` seconds
and writes the measured winners, merged into the table already in the tree,
as ``matmul_tuning.json`` next to the results (copy it to
kernels/tuning/matmul/<device_key>.json); a wrong config is never timed.
``--smollm2`` runs the SmolLM2-135M layer shapes instead of Llama-3-8B's.
``gate_up_swiglu`` is gate_up with the model's fused SwiGLU gate (output
[M, N / 2]); its anchors are cuBLAS followed by XLA's (or torch's) silu * up.
``qkv_rms`` and ``gate_up_swiglu_rms`` also normalize a's rows first (the
model's folded norms, ``rms_eps``); their anchors run the norm, then cuBLAS.

  PYTHONPATH=. python3 bench/matmul.py --out /tmp/mm [--tune] [--small]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from kernels import matmul as mm
from mosaic import bench, cost, dsl, target as target_lib, tuning

LAYERS = {  # Llama-3-8B, name: (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
    "gate_up_swiglu": (4096, 28672),
    "qkv_rms": (4096, 6144),
    "gate_up_swiglu_rms": (4096, 28672),
}
# Shapes run with a fused activation / the fused RMSNorm (rms_eps).
ACTIVATION = {"gate_up_swiglu": "swiglu", "gate_up_swiglu_rms": "swiglu"}
RMS_EPS = 1e-5
RMS = {"qkv_rms", "gate_up_swiglu_rms"}
# The model adds the residual stream in these matmuls' epilogues: their
# configs are fitted to SMEM with the residual tile (timed without it).
RESIDUAL = {"o", "down", "smol_o", "smol_down"}
SMOLLM2_LAYERS = {  # SmolLM2-135M (hidden 576, 9 q / 3 kv heads of 64, FFN 1536)
    "smol_qkv": (576, 960),
    "smol_o": (576, 576),
    "smol_gate_up": (576, 3072),
    "smol_down": (1536, 576),
    "smol_lm_head": (576, 49152),
}
MS = (1, 16, 64, 192, 256, 2048, 8192)  # 192: the mixed step's 64 + 128 rows
COLUMNS = ["shape", "M", "N", "K", "config", "mosaic_us", "mosaic_norm_then_matmul_us", "xla_us",
           "xla_cublas_us", "torch_us",
           "mosaic_tflops", "mosaic_GBps", "xla_tflops", "torch_tflops", "vs_cublas", "vs_xla",
           "err_mosaic"]
# XLA's a @ b as cuBLAS runs it: without this option XLA may time its own
# Triton GEMM against cuBLAS and keep the faster (it does at most decode shapes).
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}


def shapes(small: bool, smollm2: bool = False):
  if small:
    return [("square", 256, 256, 256), ("qkv", 1, 384, 256), ("o", 64, 256, 512)]
  out = [("square", 8192, 8192, 8192)]
  for name, (k, n) in (SMOLLM2_LAYERS if smollm2 else LAYERS).items():
    out += [(name, m, n, k) for m in MS]
  return out


def _input_sets(key, m, n, k, count=None):
  """Fresh bf16 (a [m, k], b [k, n]) pairs; by default enough of them to rotate
  past the L2 (small decode weights fit in it on their own)."""
  count = count or bench.cold_sets(2 * (m * k + k * n))
  rnd = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape,
                                           jnp.float32).astype(jnp.bfloat16)
  return [(rnd(2 * i, (m, k)), rnd(2 * i + 1, (k, n))) for i in range(count)]


@jax.jit
def _rel_err(out, ref):
  d = out.astype(jnp.float32) - ref
  return jnp.sqrt(jnp.sum(d * d) / jnp.sum(ref * ref))


@functools.partial(jax.jit, static_argnames=("activation", "rms_eps"))
def _ref(a, b, activation=None, rms_eps=None):
  return mm.matmul_reference(a, b, activation=activation, rms_eps=rms_eps)


def candidates(m: int, n: int, k: int, sms: int, activation=None,
               rms: bool = False, residual: bool = False) -> list[mm.Config]:
  """A handful of configs around the heuristic's choice (with a fused SwiGLU,
  those whose tiles hold whole [gate | up] pairs; with the fused norm, the
  swapped-operand ones that fit its 64-row a blocks)."""
  h = mm.heuristic(m, n, k, sms)
  C, rep = mm.Config, dataclasses.replace
  swiglu = activation == "swiglu"
  if m <= 64:
    # Weight streaming: vary the bytes in flight (stages x tile) and how the
    # K loop is split so that the grid fills the SMs once.
    cs = [h]
    # tile_n 256 reads each weight row in 1 KB pieces (cta_n = 512).
    for tile_n, tile_k in ((128, 64), (64, 64), (64, 128), (128, 128), (256, 64)):
      base = C(tile_m=64, tile_n=tile_n, tile_k=tile_k, wg_dim="n")
      tiles = -(-n // base.cta_n)
      one_wave = max(1, min(-(-k // tile_k) // 2, sms // tiles))
      # Twice one wave's splits, one CTA each with a short ring: two CTAs per
      # SM, as XLA's Triton GEMMs run these shapes (4-warp CTAs, 2-3 per SM).
      two_waves = min(-(-k // tile_k) // 2, 2 * one_wave)
      for split in sorted({one_wave, max(1, one_wave // 2), max(1, two_waves)}):
        fits = [st for st in range(2, 9)
                if rep(base, split_k=split, stages=st).smem_bytes() <= mm.SMEM_LIMIT]
        if fits:  # the deepest ring that fits: the most weight bytes in flight
          cs.append(rep(base, split_k=split, stages=fits[-1]))
          # One CTA per (tile, split): the hardware balances the stream.
          cs.append(rep(base, split_k=split, stages=fits[-1], persistent=False))
          cs.append(rep(base, split_k=split, stages=2, persistent=False))  # two CTAs per SM
    # Swapped operands, 64 weight columns a CTA: N / 64 CTAs (qkv 96, o and
    # down 64) with no split and no partial sums, or twice that with two,
    # summed by XLA or in the cluster's SMEM (cluster "k").
    # Wide N (gate_up, lm_head) has CTAs enough: 64 or 128 columns, no split.
    tile_m = next(t for t in (8, 16, 32, 64) if t >= m)
    if n // 64 <= 2 * sms:
      shapes_ = [(64, tile_k, split, None) for tile_k, split in
                 ((64, 1), (128, 1), (256, 1), (128, 2), (256, 2))]
      shapes_ += [(64, tile_k, split, "k") for tile_k, split in
                  ((128, 2), (256, 2), (64, 2), (128, 4))]
      # Pairs of weight tiles sharing each activation block (multicast): at
      # 64 rows the block is as large as the weight block it meets.
      shapes_ += [(64, tile_k, 1, "n") for tile_k in (128, 256)]
    else:
      shapes_ = [(tile_n, tile_k, 1, None) for tile_n in (64, 128) for tile_k in (128, 256)]
      shapes_ += [(tile_n, 128, 1, "n") for tile_n in (64, 128)]
    for tile_n, tile_k, split, cluster in shapes_:
      base = C(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, split_k=split, swap_ab=True,
               cluster=cluster)
      fits = [st for st in range(2, 16)
              if rep(base, stages=st).smem_bytes(rms=rms, swiglu=swiglu) <= mm.SMEM_LIMIT]
      if fits:
        cs += [rep(base, stages=st) for st in {fits[-1], max(2, fits[-1] // 2)}]
  elif m <= 256:
    cs = [h, rep(h, split_k=max(1, h.split_k * 2))]
    # A CTA as tall as M reads each weight block once: 192 rows cover the
    # mixed step's 64 decode rows plus a 128-token prompt chunk.
    tiles_ = [(64, 128, "m"), (128, 128, "n"), (64, 64, "m")]
    if 128 < m <= 192:
      tiles_ += [(192, 64, "n"), (192, 128, "n")]
    for tile_m, tile_n, wg in tiles_:
      base = C(tile_m=tile_m, tile_n=tile_n, tile_k=64, wg_dim=wg)
      tiles = -(-m // base.cta_m) * -(-n // base.cta_n)
      one_wave = max(1, min(-(-k // 64) // 4, sms // tiles))
      for split in sorted({1, one_wave}):
        fits = [st for st in range(2, 9)
                if rep(base, split_k=split, stages=st).smem_bytes() <= mm.SMEM_LIMIT]
        if fits:
          cs.append(rep(base, split_k=split, stages=fits[-1]))
          if split == 1:
            cs.append(rep(base, stages=fits[-1], persistent=False))
            # Narrow column tiles read the whole activation block once per
            # tile: a pair along N reads it from L2 once (multicast), as a
            # pair along M does each weight block when M has two row tiles.
            for dim, count in (("n", -(-n // base.cta_n)), ("m", -(-m // base.cta_m))):
              if count >= 2:
                cs.append(rep(base, stages=fits[-1], cluster=dim))
    # Swapped operands with every row in one tile: each weight block is read
    # once, by N / 64 CTAs (o and down: 64), or twice that with the K split
    # in a cluster (summed in SMEM) or by XLA. Every CTA reads the whole
    # activation block from L2, tile_m / tile_n times its weight bytes: 128
    # weight columns halve that (and hold 128 x tile_m accumulators).
    tile_m = next(t for t in mm.SWAP_TILE_M if t >= m)
    # Pairs of neighbouring weight tiles ("n") read the activation block from
    # L2 once for both (multicast), as cuBLAS's 2-CTA clusters do here (never
    # faster on the H100: results/matmul_h100_run3_cluster_n_rms192/; kept as
    # candidates for the H200's faster HBM against the same L2).
    shapes_ = [(tile_n, tile_k, split, cluster) for tile_n, tile_k, split, cluster in
               ((64, 64, 1, None), (64, 128, 1, None), (64, 64, 2, None), (64, 64, 2, "k"),
                (128, 64, 1, None), (64, 64, 1, "n"), (64, 64, 2, "n"))]
    if n // 64 > 2 * sms:  # wide N: CTAs enough without a split
      shapes_ = [(tile_n, 64, 1, cluster) for tile_n in (64, 128) for cluster in (None, "n")]
    for tile_n, tile_k, split, cluster in shapes_:
      base = C(tile_m=tile_m, tile_n=tile_n, tile_k=tile_k, split_k=split, swap_ab=True,
               cluster=cluster)
      # (over 64 rows the norm runs in XLA first: no Gram rows in SMEM)
      fits = [st for st in range(2, 9)
              if rep(base, stages=st).smem_bytes(swiglu=swiglu) <= mm.SMEM_LIMIT]
      if fits:
        cs += [rep(base, stages=st) for st in {fits[-1], max(2, fits[-1] - 1)}]
  elif m <= 1024:
    cs = [h] + _wave_filling(m, n, sms)
  else:
    cs = [h, rep(h, wg_dim="m"), rep(h, grid_width=16), rep(h, grid_width=4),
          rep(h, grid_minor="m"), C(tile_m=64, tile_n=256, stages=4, wg_dim="m", epi_n=64)]
    # 2-CTA clusters: the pair's shared block is read from L2 once, multicast.
    cs += [rep(h, cluster="m"), rep(h, cluster="n"), rep(h, cluster="m", grid_minor="m")]
    if n % 192 == 0 and n % 128:
      # SmolLM2's N = 576: 128- and 256-column tiles leave 10-25% of the last
      # column of tiles empty; 192-column ones (split by M) none.
      for tile_m in (64, 128):
        base = C(tile_m=tile_m, tile_n=192, tile_k=64, wg_dim="m", epi_n=64)
        fits = [st for st in range(2, 9) if rep(base, stages=st).smem_bytes() <= mm.SMEM_LIMIT]
        if fits:
          cs.append(rep(base, stages=fits[-1]))
  if activation == "swiglu":
    cs = [c for c in cs if mm._swiglu_tile_error(c, k) is None]
  seen, out = set(), []
  for c in cs:  # with the norm, a config that cannot fuse it normalizes in XLA first
    fused = rms and mm.fuses_rms(c, k)
    c = mm.fit_smem(c, rms=fused, swiglu=swiglu, residual=residual)
    if c not in seen and c.smem_bytes(rms=fused, swiglu=swiglu,
                                      residual=residual) <= mm.SMEM_LIMIT:
      seen.add(c)
      out.append(c)
  return out


def _wave_filling(m: int, n: int, sms: int, keep: int = 10) -> list[mm.Config]:
  """The mixed step's rows (64 decodes + a 256- or 512-token chunk): CTA
  shapes whose grid, with a K split of 1 or 2, fills most of a whole number
  of waves with little row padding (at M = 320, N = 6,144 the 128 x 256 CTAs
  of prefill are 72 on 132 SMs). Ranked by the fraction of the SMs' time that
  does useful rows, then by the CTA's area (its reuse of each block read);
  the best ``keep``, each with the deepest ring that fits."""
  C, rep = mm.Config, dataclasses.replace
  scored = []
  for tile_m, tile_n, wg in itertools.product((64, 128, 192), (64, 128, 256), "mn"):
    base = C(tile_m=tile_m, tile_n=tile_n, tile_k=64, wg_dim=wg)
    rows = -(-m // base.cta_m)
    tiles = rows * -(-n // base.cta_n)
    for split in (1, 2):
      units = tiles * split
      useful = (m / (rows * base.cta_m)) * (units / (-(-units // sms) * sms))
      fits = [st for st in range(2, 9)
              if rep(base, split_k=split, stages=st).smem_bytes() <= mm.SMEM_LIMIT]
      if fits:
        scored.append((useful, base.cta_m * base.cta_n, rep(base, split_k=split, stages=fits[-1])))
  scored.sort(key=lambda t: (-t[0], -t[1]))
  return [c for _, _, c in scored[:keep]]


def cfg_str(c: mm.Config) -> str:
  if c.swap_ab:
    return (f"{c.tile_m}x{c.tile_n}x{c.tile_k} swap s{c.stages}"
            + (f" sk{c.split_k}" if c.split_k > 1 else "")
            + {"k": " ck", "n": " cn"}.get(c.cluster, ""))
  return (f"{c.tile_m}x{c.tile_n}x{c.tile_k}/{c.wg_dim} s{c.stages} w{c.grid_width}"
          f"{c.grid_minor}" + (f" sk{c.split_k}" if c.split_k > 1 else "")
          + ("" if c.persistent else " np") + (f" c2{c.cluster}" if c.cluster else ""))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
  p.add_argument("--tune", action="store_true")
  p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M layer shapes instead")
  p.add_argument("--budget-s", type=float, default=320.0,
                 help="seconds from start after which --tune stops (the table alone takes ~180)")
  p.add_argument("--only", default="", help="shapes to run, e.g. qkv,o:256 (name or name:M)")
  p.add_argument("--tune-only", default="",
                 help="shapes to tune, in this order (default: those run, in --only's order)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--match", default="",
                 help="--tune tries only the table's config and the candidates whose name "
                      "contains one of these comma-separated strings (e.g. 'np,sk4')")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--sets", type=int, default=0,
                 help="rotating input sets per shape (default: enough to pass twice the L2)")
  args = p.parse_args(argv)
  t_start = time.time()
  tgt = target_lib.current()
  sms = jax.devices()[0].core_count if tgt.is_gpu else 132
  tol = 1.6e-2
  torch = None
  if tgt.is_gpu and not args.no_torch:
    try:
      import torch
    except ImportError:
      torch = None
  command = "python3 bench/matmul.py " + " ".join(argv if argv is not None else sys.argv[1:])
  rows, tune_log, winners = [], [], {}
  todo = every = shapes(args.small, args.smollm2)
  def pick(spec):
    """Shapes by name ("qkv": every M of MS) or name:M, for any M (e.g. lm_head:72)."""
    out = []
    for item in dict.fromkeys(spec.split(",")):  # once each, in order
      name, _, m = item.partition(":")
      # From every shape, not from --only's: --tune-only may name shapes not run.
      layer = [s for s in every if s[0] == name]
      if layer and m:
        layer = [(name, int(m)) + layer[0][2:]]  # (name, M, N, K)
      if not layer:
        raise SystemExit(f"unknown shape {name!r}; known: {sorted({s[0] for s in every})}")
      out += layer
    return out

  if args.only:
    todo = pick(args.only)
  # Shapes named on the command line are tuned in the order named (the budget
  # may run out before the last); the full sweep goes small M first: that is
  # where the heuristic is furthest from cuBLAS.
  if args.tune_only:
    tune_todo = pick(args.tune_only)
  elif args.only:
    tune_todo = todo
  else:
    tune_todo = sorted(todo, key=lambda s: s[1])

  def timed(f, sets):
    return bench.time_jax(f, sets, iters=args.iters).median_s

  for name, m, n, k in todo:
    key = jax.random.key(m * 7 + n * 3 + k)
    sets = _input_sets(key, m, n, k, 1 if args.small else (args.sets or None))
    act = ACTIVATION.get(name)
    rms = name in RMS
    eps = RMS_EPS if rms else None
    ref = _ref(*sets[0], activation=act, rms_eps=eps)
    c = cost.matmul(m, n, k)
    if act:  # the output is [M, N / 2]
      c = cost.Cost(c.flops, c.bytes - m * n)
    row = {"shape": name, "M": m, "N": n, "K": k}
    cfg = mm.fit_smem(mm.pick_config(m, n, k, jnp.bfloat16, act, rms), rms=rms,
                      swiglu=act == "swiglu", residual=name in RESIDUAL)
    row["config"] = cfg_str(cfg)
    fns = {
        "mosaic": jax.jit(lambda a, b, cfg=cfg: mm.matmul_mosaic(a, b, config=cfg,
                                                                activation=act, rms_eps=eps)),
        "xla": jax.jit(lambda a, b: mm.matmul_xla(a, b, activation=act, rms_eps=eps)),
        "xla_cublas": jax.jit(lambda a, b: mm.matmul_xla(a, b, activation=act, rms_eps=eps),
                              compiler_options=CUBLAS_ONLY if tgt.is_gpu else None),
    }
    if rms:  # ours as the model ran it before folding: the rms_norm kernel, then the matmul
      from kernels import rms_norm as rn

      plain = mm.fit_smem(mm.pick_config(m, n, k, jnp.bfloat16, act), swiglu=act == "swiglu")
      ones = jnp.ones((k,), jnp.bfloat16)
      fns["mosaic_norm_then_matmul"] = jax.jit(lambda a, b, cfg=plain: mm.matmul_mosaic(
          rn.rms_norm_mosaic(a, ones, eps=RMS_EPS), b, config=cfg, activation=act))
    for backend, f in fns.items():
      try:
        err = float(_rel_err(f(*sets[0]), ref))
        row[f"err_{backend}"] = err
        if not err <= tol:
          row[f"{backend}_us"] = f"WRONG {err:.2e}"
          continue
        s = timed(f, sets)
        row[f"{backend}_us"] = s * 1e6
        u = cost.utilization(c, s)
        row[f"{backend}_tflops"] = u.tflops
        row[f"{backend}_GBps"] = u.gbps
      except Exception as e:  # noqa: BLE001 -- a failure is a row, not a crash
        row[f"{backend}_us"] = f"FAIL {type(e).__name__}"
        row[f"{backend}_error"] = str(e)[:400]
        print(f"{name} M={m} {backend}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if torch is not None:
      ta, tb = (torch.from_dlpack(sets[0][0]), torch.from_dlpack(sets[0][1]))
      tsets = [(torch.from_dlpack(a), torch.from_dlpack(b)) for a, b in sets]
      def tfn(a, b):
        if rms:
          x = a.float()
          a = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(a.dtype)
        if not act:
          return torch.matmul(a, b)
        y = torch.matmul(a, b).float().unflatten(-1, (-1, 2, mm.SWIGLU_BLOCK))
        return (torch.nn.functional.silu(y[..., 0, :]) * y[..., 1, :]).flatten(-2).to(a.dtype)
      terr = float(_rel_err(jnp.from_dlpack(tfn(ta, tb)), ref))
      row["err_torch"] = terr
      if terr <= tol:
        s = bench.time_torch(tfn, tsets, iters=args.iters).median_s
        row["torch_us"] = s * 1e6
        row["torch_tflops"] = c.flops / s / 1e12
    cublas = min([row[x] for x in ("xla_cublas_us", "torch_us") if isinstance(row.get(x), float)],
                 default=None)
    if isinstance(row.get("mosaic_us"), float):
      if cublas:
        row["vs_cublas"] = cublas / row["mosaic_us"]
      if isinstance(row.get("xla_us"), float):
        row["vs_xla"] = row["xla_us"] / row["mosaic_us"]
    rows.append(row)
    print(" ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}"
                   for k_, v in row.items() if not k_.endswith("_error")), flush=True)
    bench.write(args.out, "matmul", rows, COLUMNS, command)  # kept if a later shape hangs

  def save_tuning():  # after every shape, so a timeout keeps what was measured
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul_tune_log.json").write_text(json.dumps(tune_log, indent=1) + "\n")
    if winners:
      # Start from the table in the tree so the file that comes back is complete.
      dst = out / "matmul_tuning.json"
      src = tuning.table_path("matmul")
      if not dst.exists() and src.is_file():
        dst.write_text(src.read_text())
      tuning.save("matmul", winners, path=dst,
                  extra={"source": command, "date": bench.environment()["date"]})

  if args.tune:
    for name, m, n, k in tune_todo:
      act = ACTIVATION.get(name)  # a fused activation is tuned into entries of its own
      rms = name in RMS  # and so is the fused norm
      eps = RMS_EPS if rms else None
      if time.time() - t_start > args.budget_s:
        tune_log.append({"shape": name, "M": m, "skipped": "budget"})
        continue
      tsets = _input_sets(jax.random.key(m + n + k), m, n, k, 1 if args.small else None)
      a, b = tsets[0]
      ref = _ref(a, b, activation=act, rms_eps=eps)

      def check(out):
        err = float(_rel_err(out, ref))
        if not err <= tol:
          raise AssertionError(f"relative error {err:.3e}")

      res = name in RESIDUAL
      cands = candidates(m, n, k, sms, act, rms, res)
      if args.match:
        keep = args.match.split(",")
        cands = [mm.fit_smem(mm.pick_config(m, n, k, jnp.bfloat16, act, rms), rms=rms,
                             swiglu=act == "swiglu", residual=res)] + [
            c for c in cands if any(s_ in cfg_str(c) for s_ in keep)]
      try:
        best, results = tuning.autotune(
            cands,
            lambda cfg: mm.matmul_mosaic(a, b, config=cfg, activation=act, rms_eps=eps),
            check,
            lambda cfg: bench.time_jax(
                jax.jit(lambda a, b, cfg=cfg: mm.matmul_mosaic(a, b, config=cfg,
                                                              activation=act, rms_eps=eps)),
                tsets, iters=10, warmup=1).median_s,
        )
      except RuntimeError as e:
        tune_log.append({"shape": name, "M": m, "error": str(e)[:500]})
        continue
      winners[mm.tuning_key(m, n, k, jnp.bfloat16, act, rms)] = best
      for r in results:
        tune_log.append({"shape": name, "M": m, "N": n, "K": k, "config": cfg_str(r.config),
                         "us": None if r.seconds is None else r.seconds * 1e6,
                         "error": r.error})
      save_tuning()
      print(f"tune {name} M={m}: " + ", ".join(
          f"{cfg_str(r.config)}={'x' if r.seconds is None else f'{r.seconds * 1e6:.1f}'}"
          for r in results), flush=True)
    save_tuning()

  print()
  print(bench.table(rows, COLUMNS))
  print(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
  main()
