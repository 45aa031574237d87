"""Builds the engine as `python -m serving serve` does and runs its warm-up
steps one by one, checking every jax array in and out for 256-byte alignment
(Mosaic GPU kernels refuse others) and, with MEM=1, the memory_analysis of
each compiled step; REDUCE=1 keeps one shape per bucket list. Serve flags per
variant in VARIANTS, separated by ";":

  MEM=1 REDUCE=1 VARIANTS="--model llama3.1-8b --attention-backend mosaic --num-pages 1400" \
      PYTHONPATH=. python3 bench/studies/serve_path_study.py
"""
import functools, os, sys, time, traceback
import numpy as np
import jax, jax.numpy as jnp

T0 = time.time()
def say(*a):
  print(f"[{time.time()-T0:7.1f}s]", *a, flush=True)

def ptr(x):
  try:
    return x.unsafe_buffer_pointer()
  except Exception:
    try:
      return x.addressable_shards[0].data.unsafe_buffer_pointer()
    except Exception:
      return None

def misaligned(tree):
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, jax.Array):
      p = ptr(x)
      if p is not None and p % 256:
        bad.append((jax.tree_util.keystr(path), tuple(x.shape), str(x.dtype), hex(p)))
  return bad

def probe_puts(tag):
  res = {}
  for n in (1, 2, 4, 7, 8, 64, 100, 1000, 4096, 100000):
    for dt in (np.int32, np.float32, np.int64):
      a = jax.device_put(np.zeros((n,), dt))
      p = ptr(a)
      if p % 256:
        res[(n, np.dtype(dt).name)] = hex(p)
  b = jnp.asarray(np.arange(64, dtype=np.int32))
  say(f"probe[{tag}] misaligned device_puts: {res or 'none'}; jnp.asarray ptr%256={ptr(b) % 256}")

def wrap(mod, name, tag):
  f = getattr(mod, name)
  @functools.wraps(f)
  def g(*args, **kw):
    bad = misaligned((args, kw))
    if bad:
      say(f"MISALIGNED INPUT to {tag}.{name}: {bad[:6]}")
    try:
      out = f(*args, **kw)
      jax.block_until_ready(out)
    except Exception as e:
      say(f"FAIL in {tag}.{name}: {type(e).__name__}: {str(e)[:300]}")
      for i, a in enumerate(jax.tree.leaves((args, kw))):
        if isinstance(a, jax.Array):
          say(f"   arg leaf {i}: jax {a.shape} {a.dtype} ptr%256={ptr(a) % 256} sharding={a.sharding}")
        elif isinstance(a, np.ndarray):
          say(f"   arg leaf {i}: numpy {a.shape} {a.dtype} flags c={a.flags.c_contiguous} "
              f"own={a.flags.owndata} host%64={a.ctypes.data % 64}")
      raise
    bad = misaligned(out)
    if bad:
      say(f"MISALIGNED OUTPUT of {tag}.{name}: {bad[:6]}")
    return out
  setattr(mod, name, g)

def main():
  flags = sys.argv[1:]
  say("jax", jax.__version__, jax.devices(), "flags:", flags)
  probe_puts("start")
  from serving import cli
  import models
  from models import model as model_lib
  from serving.engine import sampling
  loaded = {}
  orig_load = model_lib.load
  def load(spec, **kw):
    key = (spec, tuple(sorted(kw.items())))
    if key not in loaded:
      loaded[key] = orig_load(spec, **kw)
      say("model loaded; params misaligned:", misaligned(loaded[key].params)[:5])
      say("memory:", {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                      if k in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use")})
    return loaded[key]
  models.load = load
  model_lib.load = load
  for name in ("greedy", "sample", "take", "set_rows", "set_allow", "set_last", "verify_jit"):
    if hasattr(sampling, name):
      wrap(sampling, name, "sampling")
  for variant in flags and [flags] or []:
    pass
  variants = [v.split() for v in os.environ["VARIANTS"].split(";")]
  for v in variants:
    say("=== variant", v)
    a = cli.parser().parse_args(["serve"] + v + ["--no-warmup"])
    try:
      eng = cli.build_engine(a)
    except Exception:
      traceback.print_exc(); continue
    r = eng.runner
    if os.environ.get("REDUCE") == "1":
      eng.batch_buckets = (1, eng.batch_buckets[-1])
      eng.packed_buckets = (eng.packed_buckets[-1],)
      eng.table_buckets = (eng.table_buckets[-1],)
      eng.chunk_buckets = (eng.chunk_buckets[-1],)
      eng.row_buckets = (eng.row_buckets[-1],)
      say("reduced buckets", eng.batch_buckets, eng.packed_buckets, eng.table_buckets)
    say("engine built: max_pages", eng.max_pages, "num_pages", r.num_pages,
        "batch_buckets", eng.batch_buckets, "cache misaligned", misaligned(r.cache)[:4],
        "state misaligned", misaligned((eng._counts, eng._slot_tokens, eng._last_tok))[:4])
    probe_puts("after build")
    if os.environ.get("MEM") == "1":
      import concurrent.futures
      t = time.time()
      rows = []
      labels = []
      class Named:
        def __init__(self, f, name): self.f, self.name = f, name
        def lower(self, *args, **kw):
          shp = [getattr(x, "shape", None) for x in jax.tree.leaves(args[2:])]
          labels.append(f"{self.name}{shp}{kw}")
          return self.f.lower(*args, **kw)
      nm = ("prefill", "decode", "decode_multi", "mixed", "prefill_packed", "prefill_scores",
            "check_prefill", "check_decode", "mixed_packed")
      orig_fast = r._fast
      r._fast = tuple(Named(f, n) for f, n in zip(orig_fast, nm))
      with concurrent.futures.ThreadPoolExecutor(8) as pool:
        with r.compiling_in(pool) as compiles:
          eng._warm_calls()
        r._fast = orig_fast
        for f, lab in zip(compiles, labels):
          try:
            c = f.result()
          except Exception as e:
            say("compile failed:", type(e).__name__, str(e)[:300]); continue
          m = c.memory_analysis()
          head = c.as_text()[:2000]
          name = lab
          import re
          ent = re.search(r"ENTRY[^\n]*", head)
          rows.append((m.temp_size_in_bytes, m.argument_size_in_bytes, m.alias_size_in_bytes, m.output_size_in_bytes, name, ent.group(0)[:400] if ent else ""))
      say(f"compile-only pass: {len(rows)} executables in {time.time()-t:.1f}s")
      for row in sorted(rows, reverse=True)[:25]:
        say(f"temp {row[0]/2**30:8.2f} GiB arg {row[1]/2**30:7.2f} alias {row[2]/2**30:7.2f} out {row[3]/2**30:7.2f} {row[4]} | {row[5]}")
    fast = r._fast
    names = ("prefill", "decode", "decode_multi", "mixed", "prefill_packed", "prefill_scores",
             "check_prefill", "check_decode", "mixed_packed")
    class NS: pass
    ns = NS()
    for n, f in zip(names, fast):
      setattr(ns, n, f)
      wrap(ns, n, "step")
    r._fast = tuple(getattr(ns, n) for n in names)
    try:
      t = time.time()
      shapes = eng._warm_calls()
      say("warm calls ok", shapes, f"{time.time()-t:.1f}s")
    except Exception:
      traceback.print_exc()
    probe_puts("after warm")
    say("memory:", {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                    if k in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use")})
    del eng, r, fast, ns
    import gc; gc.collect()

main()
