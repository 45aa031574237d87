"""How long the device idles before each kernel of a decode-sized chain.

A B=1 decode trace (bench/profile_gpu.py) shows ~1-1.7 us between the end of
a kernel and the start of the next Mosaic GPU kernel, and ~0 before an XLA
fusion. This times chains of 32 layer-indexed M=1 matmuls (4096 x 4096 and
4096 x 6144, Llama-3-8B's o and qkv) inside a fori_loop, as the model runs
them: wall time per call (20 calls back to back) against the sum of the
kernels' CUPTI times. (wall - CUPTI) / kernels is the mean idle time before
a kernel. Variants: Mosaic kernels alone, one XLA fusion after each, two
different Mosaic kernels in turn, the same one twice, and XLA's own dot.
Run it again under XLA_FLAGS=--xla_gpu_enable_command_buffer= to see what
command buffers change.

  PYTHONPATH=. python3 bench/studies/launch_gap_study.py [--out DIR] [--tag NAME]
"""
import argparse, json, os, statistics, time
import jax, jax.numpy as jnp, numpy as np
from kernels import matmul as mm
from mosaic import bench
from mosaic import target as target_lib

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
ap.add_argument("--tag", default=os.environ.get("TAG", "default"))
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--dim", type=int, default=4096, help="o is dim x dim, qkv dim x 1.5 dim")
args = ap.parse_args()
L, D = args.layers, args.dim
key = jax.random.key(0)
k1, k2, k3 = jax.random.split(key, 3)
wo = (jax.random.normal(k1, (L, D, D), jnp.float32) * 0.015).astype(jnp.bfloat16)
wq = (jax.random.normal(k2, (L, D, 3 * D // 2), jnp.float32) * 0.015).astype(jnp.bfloat16)
x0 = jax.random.normal(k3, (1, D), jnp.float32).astype(jnp.bfloat16)

def chain(step):
  def f(x, wo, wq):
    return jax.lax.fori_loop(0, L, lambda l, x: step(l, x, wo, wq), x)
  return jax.jit(f)

M = lambda x, w, l, **kw: mm.matmul_mosaic(x, w, layer=l, **kw)
variants = {
  "mosaic_o": lambda l, x, wo, wq: M(x, wo, l),
  "xla_o": lambda l, x, wo, wq: jnp.dot(x, jax.lax.dynamic_index_in_dim(wo, l, 0, False)).astype(x.dtype),
  "mosaic_o_plus_fusion": lambda l, x, wo, wq: (M(x, wo, l) * 1.001 + 0.5).astype(x.dtype),
  "mosaic_o_then_qkv": lambda l, x, wo, wq: M(M(x, wo, l), wq, l)[:, :D],
  "mosaic_o_then_o": lambda l, x, wo, wq: M(M(x, wo, l), wo, l),
}
res = {"xla_flags": os.environ.get("XLA_FLAGS", "")}
# Correctness before timing: the o chain against float32 products (rounded to
# bf16 after each of the 32 matmuls, as the kernels round their outputs).
ref = x0.astype(jnp.float32)
for l in range(L):
  ref = (ref @ wo[l].astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
ref = np.asarray(ref)
for name, step in variants.items():
  f = chain(step)
  out = np.asarray(jax.block_until_ready(f(x0, wo, wq)), np.float32)
  assert np.isfinite(out).all(), name
  if name in ("mosaic_o", "xla_o"):
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    res[f"rel_error_{name}"] = err
    assert err < 5e-2, (name, err)
  # wall: 20 calls back to back, per call
  walls = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(20):
      o = f(x0, wo, wq)
    jax.block_until_ready(o)
    walls.append((time.perf_counter() - t0) / 20)
  if not target_lib.on_gpu():  # a smoke run: no CUPTI
    print(name, "wall", statistics.median(walls) * 1e6, "us")
    continue
  kern = bench.cupti_kernels(f, (x0, wo, wq))
  names = {}
  for n, s in kern:
    names.setdefault(n[:40], []).append(s)
  cupti = sum(s for _, s in kern)
  wall = statistics.median(walls)
  r = {"wall_us": wall * 1e6, "cupti_sum_us": cupti * 1e6, "kernels": len(kern),
       "gap_per_kernel_us": (wall - cupti) * 1e6 / len(kern),
       "per_kernel": {n: (len(v), statistics.median(v) * 1e6) for n, v in names.items()}}
  res[name] = r
  print(name, json.dumps(r), flush=True)
res["env"] = bench.environment()
os.makedirs(args.out, exist_ok=True)
json.dump(res, open(f"{args.out}/launch_gaps_{args.tag}.json", "w"), indent=1)
