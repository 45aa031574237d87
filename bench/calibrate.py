"""Measures the card's two ceilings and writes mosaic/calibration/<device>.json.

HBM: a large device-to-device copy (bytes read + written); also a read-only
figure (a sum over the same 2 GiB), the ceiling of kernels that stream
weights and write almost nothing. Tensor cores: an 8192^3 bf16 matmul
through XLA (cuBLAS) on random data. All medians of device-timed runs.

  PYTHONPATH=. python3 bench/calibrate.py --out DIR
"""

import argparse
import json

import jax
import jax.numpy as jnp

from mosaic import bench, target, testing


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  t = target.current()
  n = 1 << 30  # 2 GiB of bf16: far beyond L2
  xs = [testing.random_inputs([(n,)], jnp.bfloat16)[0] for _ in range(2)]
  copy = bench.time_jax(lambda x: x * jnp.bfloat16(2), [(x,) for x in xs], iters=20)
  hbm = 2 * n * 2 / copy.median_s / 1e9
  total = bench.time_jax(lambda x: jnp.sum(x, dtype=jnp.float32), [(x,) for x in xs], iters=20)
  read = n * 2 / total.median_s / 1e9
  del xs
  hbm_torch = None
  try:  # torch's copy kernel is the better-tuned memory-bound reference
    import torch

    src = [torch.randn(n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dst = torch.empty_like(src[0])
    tc = bench.time_torch(lambda s: dst.copy_(s), [(s,) for s in src], iters=20)
    hbm_torch = 2 * n * 2 / tc.median_s / 1e9
    ts = bench.time_torch(lambda s: s.sum(dtype=torch.float32), [(s,) for s in src], iters=20)
    read = max(read, n * 2 / ts.median_s / 1e9)
    del src, dst
  except Exception as e:  # noqa: BLE001 -- torch is optional here
    print(f"torch copy not measured: {e}")
  a, b = testing.random_inputs([(8192, 8192), (8192, 8192)], jnp.bfloat16)
  mm = bench.time_jax(lambda a, b: a @ b, [(a, b), (b, a)], iters=20)
  tflops = 2 * 8192**3 / mm.median_s / 1e12
  data = {"device": t.name, "bf16_tflops": round(tflops, 1), "hbm_gbps": round(max(hbm, hbm_torch or 0), 1),
          "hbm_gbps_xla_elementwise": round(hbm, 1),
          "hbm_gbps_torch_copy": hbm_torch and round(hbm_torch, 1),
          "hbm_read_gbps": round(read, 1),
          "sms": t.ceilings.sms, "smem_per_block": t.ceilings.smem_per_block,
          "method": "median device time: the faster of a 2 GiB bf16 x*2 (XLA) and copy_ (torch); read: the faster of a 2 GiB sum in XLA and torch; 8192^3 bf16 matmul via XLA",
          "jax": jax.__version__}
  path = target.CALIBRATION_DIR / f"{t.key}.json"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1) + "\n")
  print(json.dumps(data))
  bench.write(args.out, "calibration", [data], ["device", "bf16_tflops", "hbm_gbps", "hbm_read_gbps"],
              "PYTHONPATH=. python3 bench/calibrate.py --out DIR")


if __name__ == "__main__":
  main()
