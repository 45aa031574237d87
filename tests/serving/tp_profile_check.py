"""Run in a process with 2 host devices: the profiler over the tiny model at
TP=2 books each collective (o_proj's and down's all-reduce in every layer,
lm_head's all-gather once) as a row of its own, with time, and reads one
device's kernels: each layer's matmuls and attention have as many kernels as
at TP=1.

usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python tp_profile_check.py SEED
Prints "ok" or raises.
"""

import sys

from models import config as config_lib
from serving import profiler as P

COLLECTIVES = {"o_proj_all_reduce", "down_all_reduce", "lm_head_all_gather"}


def rows(tp: int, seed: int):
  model = P.load_model("tiny", dtype="float32", seed=seed, tp=tp)
  rep = P.profile(model, batch=2, decode_context=40, phases=("decode",), attention="xla",
                  matmul="xla", page_size=16, steps=2, iters=2, log=lambda msg: None)
  (prof,) = rep.profiles
  assert prof.error is None, prof.error
  assert ("tensor parallel" in rep.note) == (tp > 1), rep.note
  return {(r["layer"], r["op"]): r for r in prof.rows}


def main(seed: int) -> None:
  one, two = rows(1, seed), rows(2, seed)
  layers = config_lib.get("tiny").num_layers
  assert not {op for _, op in one} & COLLECTIVES, sorted(one)
  want = {(layer, op) for layer in range(layers) for op in ("o_proj_all_reduce", "down_all_reduce")}
  want.add((None, "lm_head_all_gather"))
  assert want <= set(two), sorted(set(two))
  assert all(two[k]["time_us"] > 0 for k in want), {k: two[k]["time_us"] for k in want}
  for key, r in one.items():
    # (the layers' ops: at the top, XLA lays the sharded logits out its own way)
    if key[0] is not None and key[1] in ("qkv", "attention", "o_proj", "gate_up", "down"):
      assert two[key]["kernels"] == r["kernels"], (key, two[key]["kernels"], r["kernels"])
  print("ok")


if __name__ == "__main__":
  main(int(sys.argv[1]))
