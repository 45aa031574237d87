"""A/B: mask vectors by TMA into SMEM (HEAD) against GMEM -> registers (tree)."""
import json, os, sys
import jax, jax.numpy as jnp
from kernels import attention_prefill as new
from bench import _old_prefill as old
from mosaic import bench, cost, testing

def inputs(B, S, Hq, Hkv, D):
  return [testing.random_inputs([(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)], jnp.bfloat16) for _ in range(2)]

lengths = [4096, 256, 3072, 512, 2048, 1024, 3584, 1792]
seg, pos = [], []
for i, n in enumerate(lengths):
  seg += [i + 1] * n; pos += list(range(n))
seg = jnp.array([seg], jnp.int32); pos = jnp.array([pos], jnp.int32)
cases = {
  "causal_S4096": (inputs(1, 4096, 32, 32, 128), dict(causal=True), cost.attention(1, 32, 32, 4096, 4096, 128, causal=True).flops),
  "packed8": (inputs(1, 16384, 32, 8, 128), dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos),
              sum(cost.attention(1, 32, 32, n, n, 128, causal=True).flops for n in lengths)),
  "dense_B4": (inputs(4, 4096, 32, 8, 128), dict(causal=True), cost.attention(4, 32, 32, 4096, 4096, 128, causal=True).flops),
}
C = new.Config
cfgs = {"2pp": dict(block_kv=128, stages=2), "2ov_nopp": dict(block_kv=128, stages=2, overlap=True, pingpong=False),
        "2ov": dict(block_kv=128, stages=2, overlap=True)}
rows = []
for rep in range(2):
  for cname, ckw in cfgs.items():
    for case, (sets, kw, fl) in cases.items():
      q, k, v = sets[0]
      f32 = lambda x: x.astype(jnp.float32)
      ref = new.attention_prefill_xla(f32(q), f32(k), f32(v), **kw)
      for name, mod in (("smem", old), ("gmem", new)):
        cfg = mod.Config(**ckw)
        f = jax.jit(lambda q, k, v, mod=mod, cfg=cfg: mod.attention_prefill_mosaic(q, k, v, config=cfg, **kw))
        err = testing.assert_close(f(q, k, v), ref, jnp.bfloat16)
        t = bench.time_jax(f, sets, iters=10, warmup=1)
        tf = fl / t.median_s / 1e12
        rows.append(dict(rep=rep, cfg=cname, case=case, impl=name, err=err, us=t.median_s * 1e6, tflops=tf))
        print(f"{rep} {cname:9s} {case:13s} {name} err={err:.2e} {t.median_s*1e6:8.1f} us {tf:6.1f} TFLOP/s", flush=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(f"{out}/ab_prefill.json", "w"), indent=1)
