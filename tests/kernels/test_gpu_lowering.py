"""Every kernel's GPU path lowers for the H200 (and matmul's for the B200), on CPU.

Interpret mode checks a kernel's logic but never builds its Mosaic GPU
program. These tests lower each kernel for CUDA as it would run on the GPU:
compiled, with the device's tuning table, at the shapes the model and the
benchmarks run (decode and prefill, split-K and 192-row tiles, fused SwiGLU,
layer stacks, FA3's overlap and ping-pong schedules, paged decode with splits
and the persistent grid), and the whole Llama-3-8B decode and prefill steps.
A layout, transform, barrier or MMA-shape error in any of them fails here.
No test runs a kernel; ptxas is not reached (it needs the GPU toolchain).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import attention_decode as ad
from kernels import attention_prefill as ap
from kernels import matmul as mm
from kernels import rms_norm as rn
from mosaic import dsl, target as target_lib, testing, tuning
from mosaic.dsl import plgpu

S = jax.ShapeDtypeStruct
BF16, F16, F32, I32 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32


def _lower(fn, *args, device="h200", kernels=1, **kwargs):
  lowered = testing.lower_for_gpu(fn, *args, device=device, **kwargs)
  assert lowered.host_callbacks == 0, "a kernel was interpreted, not compiled"
  assert lowered.mosaic_kernels == kernels, lowered.mosaic_kernels
  return lowered


def test_override_is_scoped_and_restores_the_machine(monkeypatch):
  before = (dsl.interpreting(), target_lib.current())
  h200 = target_lib.make("gpu", "NVIDIA H200", "9.0", 132)
  monkeypatch.setenv("MOSAIC_INTERPRET", "1")  # tracing for the H200 compiles anyway
  with target_lib.override(h200):
    assert target_lib.current() is h200 and not dsl.interpreting()
    # The H200 table's entry, not the heuristic's config.
    tabled = mm.Config.from_dict(_table("matmul")[mm.tuning_key(16, 4096, 4096, BF16)])
    assert mm.pick_config(16, 4096, 4096, BF16) == tabled != mm.heuristic(16, 4096, 4096)
  monkeypatch.delenv("MOSAIC_INTERPRET")
  assert (dsl.interpreting(), target_lib.current()) == before
  with pytest.raises(TypeError, match="Target"):
    with target_lib.override("NVIDIA H200"):
      pass
  with pytest.raises(ValueError, match="known"):
    testing.lower_for_gpu(lambda x: x, S((1,), F32), device="h300")


def _fp8_tile_to(dtype):
  """A kernel that TMA-copies an fp8 [128, 128] tile to SMEM and converts it."""
  f8 = jnp.float8_e4m3fn

  def body(x_gmem, o_gmem, x8, x16, bar):
    plgpu.copy_gmem_to_smem(x_gmem, x8, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    x16[...] = x8[...].astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x16, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  return dsl.kernel(body, out_type=S((128, 128), dtype), grid=(1,), grid_names=("g",),
                    scratch_types=[
                        plgpu.SMEM((128, 128), f8, transforms=dsl.smem_transforms((128, 128), f8)),
                        plgpu.SMEM((128, 128), dtype,
                                   transforms=dsl.smem_transforms((128, 128), dtype)),
                        plgpu.Barrier(num_barriers=1)])


def test_what_interpret_mode_runs_but_the_gpu_cannot():
  # Hopper converts fp8 to f16 only: the interpreter converts to bf16 exactly,
  # the lowering refuses (why fp8 decode attention runs its MMAs in f16).
  x = (jax.random.normal(jax.random.key(0), (128, 128)) * 8).astype(jnp.float8_e4m3fn)
  for dtype in (BF16, F16):
    np.testing.assert_array_equal(np.asarray(_fp8_tile_to(dtype)(x), np.float32),
                                  np.asarray(x, np.float32))
  _lower(lambda x: _fp8_tile_to(F16)(x), S((128, 128), jnp.float8_e4m3fn))
  with pytest.raises(Exception, match="converting from f8E4M3FN to bf16"):
    testing.lower_for_gpu(lambda x: _fp8_tile_to(BF16)(x), S((128, 128), jnp.float8_e4m3fn))
  # Likewise matmul tiles narrower than 128-byte rows, or 64-byte K blocks: the
  # interpreter ran them, the lowering does not, so Config refuses them.
  from kernels import matmul_blackwell as bw

  for cls, bad in ((mm.Config, dict(tile_n=32)), (mm.Config, dict(tile_k=32)),
                   (bw.Config, dict(tile_n=128, tile_k=32))):
    with pytest.raises(ValueError, match="not lower"):
      cls(**bad)
  with pytest.raises(ValueError, match="on Hopper config must be a matmul.Config"):
    testing.lower_for_gpu(lambda a, b: mm.matmul_mosaic(a, b, config=bw.Config()),
                          S((128, 512), BF16), S((512, 512), BF16))


def _table(op):
  return tuning.entries(op, "nvidia_h200")


# The Hopper cards with a matmul table (both sm_90a: lowered for the H200).
HOPPER_TABLES = ("nvidia_h200", "nvidia_h100_80gb_hbm3")


def _key(key):
  return {k: v for k, v in (kv.split("=") for kv in key.split(","))}


@pytest.mark.parametrize("device,key", [(device, key) for device in HOPPER_TABLES
                                        for key in tuning.entries("matmul", device)])
def test_every_hopper_matmul_table_entry_lowers(device, key):
  d = _key(key)
  m, n, k, dt = int(d["m"]), int(d["n"]), int(d["k"]), jnp.dtype(d["dtype"])
  cfg = mm.Config.from_dict(tuning.entries("matmul", device)[key])
  act = d.get("act")  # an entry of a fused activation (or norm) lowers with it
  rms = dict(rms_eps=1e-5) if d.get("norm") == "rms" else {}
  _lower(lambda a, b: mm.matmul_mosaic(a, b, config=cfg, activation=act, **rms), S((m, k), dt),
         S((k, n), dt))


@pytest.mark.parametrize("key", list(_table("attention_prefill")))
def test_every_h200_attention_prefill_table_entry_lowers(key):
  d = _key(key)
  dh, dt, causal = int(d["head_dim"]), jnp.dtype(d["dtype"]), d["causal"] == "1"
  cfg = ap.Config.from_dict(_table("attention_prefill")[key])
  _lower(lambda q, k, v: ap.attention_prefill_mosaic(q, k, v, causal=causal, config=cfg),
         S((1, 2048, 32, dh), dt), S((1, 2048, 8, dh), dt), S((1, 2048, 8, dh), dt))


@pytest.mark.parametrize("key", list(_table("attention_decode")))
def test_every_h200_attention_decode_table_entry_lowers(key):
  d = _key(key)
  page, dh, dt, b = int(d["page"]), int(d["head_dim"]), jnp.dtype(d["dtype"]), int(d["batch"])
  width = int(d["pages"])  # pages per sequence
  cfg = ad.Config.from_dict(_table("attention_decode")[key])
  cache = S((8, b * width + 1, page, dh), dt)
  fp8 = d["dtype"] in ad.FP8_DTYPES  # fp8 pages: bf16 queries, (k_scale, v_scale)
  scales = (S((2,), F32),) if fp8 else ()
  _lower(lambda q, k, v, n, t, *s: ad.attention_decode_mosaic(
      q, k, v, n, t, config=cfg, kv_scales=s[0] if s else None),
         S((b, 1, 32, dh), BF16 if fp8 else dt), cache, cache, S((b,), I32), S((b, width), I32),
         *scales)


@pytest.mark.parametrize("key", list(_table("rms_norm")))
def test_every_h200_rms_norm_table_entry_lowers(key):
  d = _key(key)
  cols, dt = int(d["cols"]), jnp.dtype(d["dtype"])
  cfg = rn.Config.from_dict(_table("rms_norm")[key])
  _lower(lambda x, w: rn.rms_norm_mosaic(x, w, config=cfg), S((4096, cols), dt), S((cols,), dt))


MATMULS = {
    # name: (M, N, K, kwargs)
    "decode_split_k_residual": (16, 4096, 4096, dict(residual=True)),
    "decode_m1_qkv": (1, 6144, 4096, {}),
    "decode_swiglu": (1, 28672, 4096, dict(activation="swiglu")),
    "mixed_192_rows": (192, 4096, 4096, dict(residual=True)),
    "mixed_lm_head_72": (72, 128256, 4096, dict(out_dtype=F32)),
    "prefill_bias_residual": (2048, 4096, 4096, dict(bias=True, residual=True)),
    "prefill_swiglu": (2048, 28672, 4096, dict(activation="swiglu")),
    # Partial tiles in M, N and K (M a multiple of 8, N and K of 64, as TMA needs).
    "ragged": (104, 960, 320, dict(bias=True)),
    "fp16_in_fp32_out": (256, 512, 512, dict(dtype=F16, out_dtype=F32)),
}


@pytest.mark.parametrize("name", MATMULS)
def test_matmul_lowers_for_h200(name):
  m, n, k, kw = MATMULS[name]
  kw = dict(kw)
  dt = kw.pop("dtype", BF16)
  args = [S((m, k), dt), S((k, n), dt)]
  names = []
  for opt, shape in (("bias", (n,)), ("residual", (m, n))):
    if kw.pop(opt, False):
      args.append(S(shape, dt))
      names.append(opt)

  def f(a, b, *rest):
    return mm.matmul_mosaic(a, b, **dict(zip(names, rest)), **kw)

  _lower(f, *args)


# The edges of what Config accepts (each found to lower by a sweep of the whole
# space on CPU); what it refuses is in test_what_interpret_mode_runs_but_the_gpu_cannot.
HOPPER_EDGES = [
    dict(tile_m=64, tile_n=64, epi_n=16), dict(tile_m=256, tile_n=64, tile_k=128, stages=2),
    dict(tile_m=192, tile_n=192, stages=2), dict(tile_n=256, stages=2, wg_dim="m"),
    dict(tile_m=64, tile_n=128, tile_k=128, stages=2, split_k=2, persistent=False),
    # 2-CTA clusters: the shared block multicast (B along M, A along N).
    dict(stages=4, cluster="m"), dict(tile_n=256, stages=3, wg_dim="m", cluster="n"),
    dict(tile_m=192, tile_n=64, stages=4, cluster="n"),  # the mixed step's 192-row tile
]


# swap_ab (small M): every token tile and K block, both column tiles, deep
# rings, the split partials, and the epilogue's bias, residual and SwiGLU gate.
SWAP_EDGES = [
    (1, dict(tile_m=8, tile_k=256, stages=5), ("bias", "residual")),
    (16, dict(tile_m=16, tile_k=128, stages=10), ("residual",)),
    (40, dict(tile_m=32, tile_k=64, stages=6, split_k=2), ("bias", "residual")),
    (64, dict(tile_m=64, tile_k=128, stages=6), ()),
    (16, dict(tile_m=16, tile_n=128, tile_k=128, stages=5), ("bias", "residual")),
    (1, dict(tile_m=8, tile_n=128, tile_k=128, stages=6), ("swiglu", "bias", "residual")),
    (64, dict(tile_m=64, tile_n=128, tile_k=64, stages=6), ("swiglu",)),
    # The fused RMSNorm: 64-row a blocks, the Gram accumulator, every token tile.
    (1, dict(tile_m=8, tile_k=256, stages=3), ("rms", "bias")),
    (16, dict(tile_m=16, tile_k=128, stages=5), ("rms",)),
    (64, dict(tile_m=64, tile_k=256, stages=3), ("rms",)),
    (1, dict(tile_m=8, tile_n=128, tile_k=128, stages=3), ("swiglu", "rms")),
    (32, dict(tile_m=32, tile_n=128, tile_k=128, stages=2), ("swiglu", "rms")),
    # Splits summed in a cluster's SMEM (cluster="k"): the partial (and Gram)
    # stored into the first split's SMEM, 2 and 4 splits, every epilogue.
    (1, dict(tile_m=8, tile_k=256, stages=3, split_k=2, cluster="k"), ()),
    (16, dict(tile_m=16, tile_k=128, stages=4, split_k=4, cluster="k"), ("bias", "residual")),
    (64, dict(tile_m=64, tile_k=128, stages=3, split_k=2, cluster="k"), ("rms", "residual")),
    (1, dict(tile_m=8, tile_n=128, tile_k=128, stages=3, split_k=2, cluster="k"),
     ("swiglu", "rms")),
    # Tall tiles (the mixed step's rows): a slot refilled one step late;
    # plain, split and clustered (the norm runs in XLA: see fuses_rms).
    (72, dict(tile_m=128, tile_k=64, stages=4), ("bias", "residual")),
    (192, dict(tile_m=192, tile_k=64, stages=3, split_k=2, cluster="k"), ("residual",)),
    (136, dict(tile_m=192, tile_k=64, stages=3, split_k=2), ()),
    (256, dict(tile_m=256, tile_k=64, stages=2), ("bias",)),
    (160, dict(tile_m=192, tile_n=128, tile_k=64, stages=2), ("swiglu",)),
    # Rings that fit only because the epilogue's staging tile reuses their
    # SMEM (the ring alone is 192-224 KB).
    (192, dict(tile_m=192, tile_k=64, stages=6, split_k=2), ()),
    (192, dict(tile_m=192, tile_k=64, stages=6), ("bias", "residual")),
    (64, dict(tile_m=64, tile_k=128, stages=7), ("bias",)),
    # Pairs of weight tiles sharing each activation block (multicast).
    (64, dict(tile_m=64, tile_k=128, stages=6, cluster="n"), ("residual",)),
    (192, dict(tile_m=192, tile_k=64, stages=6, cluster="n"), ("bias", "residual")),
    (192, dict(tile_m=192, tile_k=64, stages=6, split_k=2, cluster="n"), ()),
    (16, dict(tile_m=16, tile_k=256, stages=3, cluster="n"), ("rms",)),
    (1, dict(tile_m=8, tile_k=256, stages=3, cluster="n"), ()),
    (64, dict(tile_m=64, tile_n=128, tile_k=64, stages=4, cluster="n"), ("swiglu", "rms")),
]


@pytest.mark.parametrize("edge", range(len(SWAP_EDGES)))
def test_matmul_swap_ab_lowers_for_h200(edge):
  m, kw, extras = SWAP_EDGES[edge]
  cfg = mm.Config(**{"tile_n": 64, **kw}, swap_ab=True)
  swiglu, rms = "swiglu" in extras, "rms" in extras
  extras = tuple(e for e in extras if e not in ("swiglu", "rms"))
  n, k = (28672, 4096) if swiglu else (4096, 14336)
  out_n = n // 2 if swiglu else n
  args = [S((m, k), BF16), S((k, n), BF16)] + [S((n,) if e == "bias" else (m, out_n), BF16)
                                               for e in extras]
  act = dict(activation="swiglu") if swiglu else {}
  if rms:
    act["rms_eps"] = 1e-5

  def fn(a, b, *rest):
    assert not rms or mm.fuses_rms(cfg, k)  # as the GPU sees it (a cluster's splits fuse)
    return mm.matmul_mosaic(a, b, config=cfg, **act, **dict(zip(extras, rest)))

  lowered = _lower(fn, *args)
  # Partials leave the kernel only from a split without a cluster.
  split_out = cfg.split_k > 1 and cfg.cluster != "k"
  want = f"tensor<{cfg.split_k}x{m}x{n}xf32>" if split_out else f"tensor<{m}x{out_n}xbf16>"
  assert lowered.kernel_results == (want,), lowered.kernel_results


@pytest.mark.parametrize("edge", range(len(HOPPER_EDGES)))
def test_matmul_config_edges_lower_for_h200(edge):
  cfg = mm.Config(**HOPPER_EDGES[edge])
  _lower(lambda a, b: mm.matmul_mosaic(a, b, config=cfg), S((512, 1024), BF16),
         S((1024, 1536), BF16))


@pytest.mark.parametrize("edge", [dict(tile_n=16, tile_k=32, epi_n=16), dict(tile_n=256, epi_n=16),
                                  dict(tile_n=128, tile_k=128, stages=2)])
def test_blackwell_config_edges_lower_for_b200(edge):
  from kernels import matmul_blackwell as bw

  cfg = bw.Config(**edge)
  _lower(lambda a, b: mm.matmul_mosaic(a, b, config=cfg), S((256, 1024), BF16),
         S((1024, 1536), BF16), device="b200")


def test_matmul_layer_stack_lowers_for_h200():
  _lower(lambda a, b, layer: mm.matmul_mosaic(a, b, layer=layer),
         S((64, 4096), BF16), S((4, 4096, 6144), BF16), S((), I32))


@pytest.mark.parametrize("m", [16, 256])
def test_matmul_lowers_for_b200_through_the_tcgen05_kernel(m, monkeypatch):
  from kernels import matmul_blackwell as bw

  calls = []
  real = bw.run
  monkeypatch.setattr(bw, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
  _lower(lambda a, b, r: mm.matmul_mosaic(a, b, residual=r),
         S((m, 4096), BF16), S((4096, 4096), BF16), S((m, 4096), BF16), device="b200")
  assert calls, "the Blackwell target did not take the tcgen05 kernel"
  # The fused norm's request: normalized by XLA first, then the same kernel.
  _lower(lambda a, b: mm.matmul_mosaic(a, b, rms_eps=1e-5), S((m, 4096), BF16),
         S((4096, 4096), BF16), device="b200")
  assert len(calls) == 2


PREFILLS = {
    # name: (B, Sq, Skv, Hq, Hkv, D, kwargs)
    "d128_noncausal_overlap": (1, 1024, 1024, 32, 32, 128, dict(causal=False)),
    "d128_causal_pingpong": (1, 1024, 1024, 32, 8, 128, dict(causal=True)),
    "d64_causal": (1, 1024, 1024, 32, 32, 64, dict(causal=True)),
    "gqa_64_8_lse": (2, 512, 512, 64, 8, 128, dict(causal=True, return_lse=True)),
    "cached_prefix": (1, 300, 1000, 32, 8, 128, dict(causal=True)),
    "d256_gqa_noncausal_lse": (1, 1024, 1024, 16, 8, 256, dict(causal=False, return_lse=True)),
    "d256_causal": (1, 1024, 1024, 16, 8, 256, dict(causal=True)),
    "sliding_window_fp16": (1, 1024, 1024, 32, 8, 128, dict(causal=True, sliding_window=256,
                                                           dtype=F16)),
}


@pytest.mark.parametrize("name", PREFILLS)
def test_attention_prefill_lowers_for_h200(name):
  b, sq, skv, hq, hkv, d, kw = PREFILLS[name]
  kw = dict(kw)
  dt = kw.pop("dtype", BF16)
  _lower(lambda q, k, v: ap.attention_prefill_mosaic(q, k, v, **kw),
         S((b, sq, hq, d), dt), S((b, skv, hkv, d), dt), S((b, skv, hkv, d), dt))


@pytest.mark.parametrize("schedule", ["pingpong", "overlap", "overlap_nopp", "p_smem"])
def test_attention_prefill_schedules_lower_for_h200(schedule):
  cfg = {"pingpong": ap.Config(pingpong=True, overlap=False),
         "overlap": ap.Config(pingpong=True, overlap=True),
         "overlap_nopp": ap.Config(pingpong=False, overlap=True),
         "p_smem": ap.Config(p_smem=True, acc_in_place=False)}[schedule]
  _lower(lambda q, k, v, s: ap.attention_prefill_mosaic(
      q, k, v, causal=True, q_segment_ids=s, kv_segment_ids=s, config=cfg),
      S((1, 2048, 32, 128), BF16), S((1, 2048, 8, 128), BF16), S((1, 2048, 8, 128), BF16),
      S((1, 2048), I32))


# (config, no mask, lse): ap.smem_bytes says whether each fits. Those it says
# fit must lower (the lowering checks the real SMEM); the others must be
# refused with a clear error before Mosaic GPU is reached. The first two sit
# either side of the limit (the lse adds 512 bytes).
SMEM_EDGES = [
    (dict(block_kv=128, stages=3, overlap=True, pingpong=False), True, False),
    (dict(block_kv=128, stages=3, overlap=True, pingpong=False), True, True),
    (dict(block_kv=192, stages=2), True, False),
    (dict(block_kv=192, stages=2), False, False),
    (dict(block_kv=128, stages=2, overlap=True), False, True),
    (dict(block_kv=128, stages=2, p_smem=True, acc_in_place=False), True, True),
]


@pytest.mark.parametrize("edge", range(len(SMEM_EDGES)))
def test_attention_prefill_smem_estimate_agrees_with_the_lowering(edge):
  kw, dense, lse = SMEM_EDGES[edge]
  cfg = ap.Config(**kw)
  h200 = target_lib.make("gpu", "NVIDIA H200", "9.0", 132)
  fits = ap.smem_bytes(cfg, 128, dense=dense, has_lse=lse) <= h200.ceilings.smem_per_block
  assert fits == (edge in (0, 2, 4, 5))  # the edges are what they say
  call = lambda q, k, v: ap.attention_prefill_mosaic(q, k, v, causal=not dense, return_lse=lse,
                                                     config=cfg)
  args = [S((1, 4096, 32, 128), BF16)] * 3
  if fits:
    _lower(call, *args)
  else:
    with pytest.raises(ValueError, match="bytes of SMEM"):
      _lower(call, *args)


def test_attention_prefill_tabled_config_falls_back_when_the_lse_does_not_fit(monkeypatch):
  # A dense 3-stage entry fits without the lse only: asked for the lse, the
  # call takes the heuristic's blocks instead of failing to compile.
  monkeypatch.setattr(ap, "_pick_config", lambda *a: ap.Config(
      block_kv=128, stages=3, overlap=True, pingpong=False))
  _lower(lambda q, k, v: ap.attention_prefill_mosaic(q, k, v, causal=False, return_lse=True),
         *[S((1, 4096, 32, 128), BF16)] * 3)


DECODES = {
    # name: (B, Tq, L, pages, config[, page]): one kernel, plus the split merge in XLA
    "b1_long_splits": (1, 1, 131072, 2100, None),
    "b64_no_split": (64, 1, 4096, 4200, None),
    "speculative_tq4": (8, 4, 2048, 300, None),
    "persistent": (256, 1, 512, 2100, ad.Config(pages_per_step=1, stages=2, blocks_per_sm=2)),
    # swap_ab: keys as the wgmmas' M, the packed rows (4, 16, 64) as their N
    "swap_b1_splits": (1, 1, 131072, 2100, ad.Config(pages_per_step=2, stages=3, swap_ab=True)),
    "swap_b64": (64, 1, 4096, 4200, ad.Config(pages_per_step=1, stages=4, swap_ab=True)),
    "swap_tq4": (8, 4, 2048, 300, ad.Config(pages_per_step=2, stages=2, swap_ab=True)),
    "swap_tq8": (4, 8, 1024, 300, ad.Config(pages_per_step=1, stages=2, swap_ab=True)),
    "swap_persistent": (256, 1, 512, 2100,
                        ad.Config(pages_per_step=1, stages=3, blocks_per_sm=2, swap_ab=True)),
    "swap_persistent_split": (2, 1, 8192, 300, ad.Config(pages_per_step=1, stages=2, splits=4,
                                                         blocks_per_sm=1, swap_ab=True)),
    # 128-token pages copied half a page a step (64-row TMA boxes inside a page)
    "half_pages": (256, 1, 512, 1100, ad.Config(steps_per_page=2, stages=3, swap_ab=True), 128),
    "half_pages_persistent": (16, 1, 2048, 300, ad.Config(steps_per_page=2, stages=2, splits=2,
                                                          blocks_per_sm=1, swap_ab=True), 128),
}


def _decode_page(cfg, page):
  """The entry's page size: the default with the table's config, else 64
  tokens (what the explicit configs above were sized for)."""
  return page[0] if page else ad.DEFAULT_PAGE_SIZE if cfg is None else 64


@pytest.mark.parametrize("name", DECODES)
def test_attention_decode_lowers_for_h200(name):
  b, tq, length, pages, cfg, *page = DECODES[name]
  page = _decode_page(cfg, page)
  kw = {} if cfg is None else {"config": cfg}
  _lower(lambda q, k, v, n, t: ad.attention_decode_mosaic(q, k, v, n, t, **kw),
         S((b, tq, 32, 128), BF16), S((8, pages, page, 128), BF16),
         S((8, pages, page, 128), BF16), S((b,), I32), S((b, -(-length // page)), I32))


@pytest.mark.parametrize("name", DECODES)
def test_attention_decode_fp8_pages_lower_for_h200(name):
  # fp8 pages: converted to f16 in SMEM a step at a time (Hopper converts fp8
  # to f16 only), scales read in the kernel.
  b, tq, length, pages, cfg, *page = DECODES[name]
  page = _decode_page(cfg, page)
  kw = {} if cfg is None else {"config": cfg}
  f8 = S((8, pages, page, 128), jnp.float8_e4m3fn)
  _lower(lambda q, k, v, n, t, sc: ad.attention_decode_mosaic(q, k, v, n, t, kv_scales=sc, **kw),
         S((b, tq, 32, 128), BF16), f8, f8, S((b,), I32), S((b, -(-length // page)), I32),
         S((2,), F32))


def test_attention_decode_layer_stack_lowers_for_h200():
  page = ad.DEFAULT_PAGE_SIZE
  _lower(lambda q, k, v, n, t, layer: ad.attention_decode_mosaic(q, k, v, n, t, layer=layer),
         S((16, 1, 32, 128), BF16), S((4, 8, 600, page, 128), BF16),
         S((4, 8, 600, page, 128), BF16), S((16,), I32), S((16, 64), I32), S((), I32))


@pytest.mark.parametrize("rows", [1, 64, 8192])
def test_rms_norm_lowers_for_h200(rows):
  _lower(lambda x, w: rn.rms_norm_mosaic(x, w), S((rows, 4096), BF16), S((4096,), BF16))
  _lower(lambda x, w, layer: rn.rms_norm_mosaic(x, w, layer=layer),
         S((rows, 4096), BF16), S((32, 4096), BF16), S((), I32))


def _llama_8b(cache_dtype="bfloat16", folded=False, decode_append=True):
  from flax import nnx

  from models import config as config_lib
  from models import jitted, kv_cache, llama

  cfg = config_lib.get("llama3.1-8b")
  abstract = nnx.eval_shape(lambda: llama.Llama(cfg, dtype=BF16, rngs=nnx.Rngs(0),
                                                norms_folded=folded,
                                                decode_append=decode_append))
  graphdef, params = nnx.split(abstract)
  params = jax.tree.map(lambda x: S(x.shape, x.dtype), params)
  cache = jax.eval_shape(lambda: kv_cache.init_cache(cfg, 1400, ad.DEFAULT_PAGE_SIZE,
                                                  dtype=cache_dtype))
  return jitted, graphdef, params, cache


@pytest.mark.parametrize("step, cache_dtype, folded, b", [
    ("decode", "bfloat16", False, 64), ("prefill", "bfloat16", False, 1),
    ("decode", "float8_e4m3fn", False, 64), ("decode", "bfloat16", True, 1),
    ("decode", "bfloat16", True, 64), ("prefill", "bfloat16", True, 1),
    ("prefill_packed", "bfloat16", True, 4), ("prefill_packed_continued", "bfloat16", True, 4),
    ("mixed_packed", "bfloat16", True, 4)])
def test_llama_8b_steps_lower_for_h200_on_mosaic_kernels(step, cache_dtype, folded, b):
  jitted, graphdef, params, cache = _llama_8b(cache_dtype, folded)
  names = jitted.backends(attention_prefill="mosaic", attention_decode="mosaic",
                         matmul="mosaic", rms_norm="mosaic")
  # Packed: b prompts' 2048 tokens in one row (attention by segment ids);
  # continued, over their 16 pages each laid end to end.
  t, width = (1, 64) if step == "decode" else (2048 // b, 32)
  logit_rows = b
  if step == "mixed_packed":  # 64 decode rows and 4 continued chunks of 32 tokens, packed
    t, logit_rows = 32, 72  # 64 + 4 rows, padded to 8 for lm_head
    fn = lambda p, c, dt, dl, dtab, tok, tpos, seg, last, tab: jitted.mixed_packed_step(
        graphdef, p, c, dt, dl, dtab, tok, tpos, seg, last, tab, backends=names, fresh=False)
    args = ((S((64,), I32), S((64,), I32), S((64, 64), I32)) + (S((b * t,), I32),) * 3
            + (S((b,), I32), S((b, 16), I32)))
  elif step == "decode":
    fn = lambda p, c, tok, n, tab: jitted.decode_step(graphdef, p, c, tok, n, tab, backends=names)
    args = (S((b, 1), I32), S((b,), I32), S((b, width), I32))
  elif step.startswith("prefill_packed"):
    fresh = step == "prefill_packed"
    width = width if fresh else 16
    fn = lambda p, c, tok, tpos, seg, last, tab: jitted.prefill_packed_step(
        graphdef, p, c, tok, tpos, seg, last, tab, backends=names, fresh=fresh)
    args = (S((b * t,), I32),) * 3 + (S((b,), I32), S((b, width), I32))
  else:
    fn = lambda p, c, tok, pos, n, tab: jitted.prefill_step(graphdef, p, c, tok, pos, n, tab,
                                                          backends=names)
    args = (S((b, t), I32), S((b,), I32), S((b,), I32), S((b, width), I32))
  # In the layer scan: the norm (both norms call one kernel), qkv, attention,
  # o, gate_up with the SwiGLU gate, down; after it the final norm and lm_head.
  # Folded norms: no norm kernel in the layer (qkv and gate_up normalize).
  # A mixed step runs decode attention too.
  lowered = _lower(fn, params, cache, *args,
                   kernels=(7 if folded else 8) + (step == "mixed_packed"))
  rows = b * t + (64 if step == "mixed_packed" else 0)
  outs = " ".join(lowered.kernel_results)
  # (qkv's split-K partials at 192 rows: 2x192x6144xf32)
  for want in (f"{rows}x6144x", f"{rows}x14336xbf16", f"{logit_rows}x128256xf32"):
    assert want in outs, (want, lowered.kernel_results)


@pytest.mark.parametrize("b", [1, 64])
def test_llama_8b_decode_writes_the_cache_in_the_attention_kernel(b):
  # With decode_append the attention kernel rotates q and k and writes k and v
  # itself: the step has no scatter or update-slice of the cache left, and the
  # kernel's call aliases the cache (written in place, not copied).
  texts = {}
  for append in (True, False):
    jitted, graphdef, params, cache = _llama_8b("bfloat16", True, decode_append=append)
    names = jitted.backends(attention_decode="mosaic", matmul="mosaic", rms_norm="mosaic")
    fn = lambda p, c, tok, n, tab: jitted.decode_step(graphdef, p, c, tok, n, tab, backends=names)
    texts[append] = _lower(fn, params, cache, S((b, 1), I32), S((b,), I32), S((b, 64), I32),
                           kernels=7).text
  writes = lambda text: text.count("stablehlo.scatter") + text.count("dynamic_update_slice")
  assert writes(texts[False]) >= 2 and writes(texts[True]) == 0
  assert "output_operand_aliases" in texts[True] and "output_operand_aliases" not in texts[False]


KERNEL_CALLS = ("mpmd_map", "pallas_call")  # how a Mosaic GPU kernel shows in a jaxpr


def _eqns(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it, but not inside kernels."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name in KERNEL_CALLS:
      continue
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _primitives(jaxpr) -> list[str]:
  return [e.primitive.name for e in _eqns(jaxpr)]


@pytest.mark.parametrize("step", ["prefill_continued", "mixed", "prefill_packed",
                                  "prefill_packed_continued", "mixed_packed"])
def test_fa3_block_ranges_are_planned_once_per_step_not_per_layer(step):
  # The FA3 kernel's kv block ranges depend on positions only. Built inside
  # the layer scan, XLA's GPU pipeline left them there (5 small kernels a
  # layer, profile run 11); the model plans them once, outside it.
  jitted, graphdef, params, cache = _llama_8b()
  names = jitted.backends(attention_prefill="mosaic", attention_decode="mosaic",
                         matmul="mosaic", rms_norm="mosaic")
  if step == "mixed":
    fn = lambda p, c, dt, dl, dtab, tok, pos, n, tab: jitted.mixed_step(
        graphdef, p, c, dt, dl, dtab, tok, pos, n, tab, backends=names)
    args = (S((64,), I32), S((64,), I32), S((64, 64), I32), S((1, 128), I32), S((1,), I32),
            S((1,), I32), S((1, 16), I32))
  elif step == "mixed_packed":  # 64 decode rows and 128 continued prompt tokens
    fn = lambda p, c, dt, dl, dtab, tok, tpos, seg, last, tab: jitted.mixed_packed_step(
        graphdef, p, c, dt, dl, dtab, tok, tpos, seg, last, tab, backends=names)
    args = ((S((64,), I32), S((64,), I32), S((64, 64), I32)) + (S((128,), I32),) * 3
            + (S((4,), I32), S((4, 16), I32)))
  elif step.startswith("prefill_packed"):  # 2048 prompt tokens in one row, segment ids
    fresh = step == "prefill_packed"
    fn = lambda p, c, tok, tpos, seg, last, tab: jitted.prefill_packed_step(
        graphdef, p, c, tok, tpos, seg, last, tab, backends=names, fresh=fresh)
    args = (S((2048,), I32), S((2048,), I32), S((2048,), I32), S((4,), I32),
            S((4, 32 if fresh else 16), I32))
  else:
    fn = lambda p, c, tok, pos, n, tab: jitted.prefill_step(graphdef, p, c, tok, pos, n, tab,
                                                          backends=names)
    args = (S((1, 512), I32), S((1,), I32), S((1,), I32), S((1, 32), I32))
  h200 = target_lib.make("gpu", "NVIDIA H200", "9.0", 132)
  with target_lib.override(h200):
    closed = jax.make_jaxpr(fn)(params, cache, *args)
  outer = _primitives(closed.jaxpr)
  scans = [e for e in _eqns(closed.jaxpr) if e.primitive.name == "scan"]
  assert len(scans) == 1, [e.primitive.name for e in scans]  # the layer scan
  inner = _primitives(scans[0].params["jaxpr"].jaxpr)
  assert "reduce_min" in outer and "reduce_min" not in inner  # _block_ranges' mins
  assert sum(inner.count(k) for k in KERNEL_CALLS) >= 7  # the layer's kernels are in it


# fp8 (W8A8): the Llama-3-8B layer shapes at the decode, mixed-step and
# prefill row counts, through the public wrapper (the configs it picks for the
# H200), with the epilogues the model uses; and the schedules one by one.
F8 = jnp.float8_e4m3fn


def _lower_fp8(m, n, k, layers=None, activation=None, bias=False, residual=False, config=None):
  from kernels import matmul_fp8 as mf

  w = S((n, k), F8) if layers is None else S((layers, n, k), F8)
  per_n = S((n,), F32) if layers is None else S((layers, n), F32)
  out_n = n // 2 if activation else n
  extra = ([S(per_n.shape, BF16)] if bias else []) + ([S((m, out_n), BF16)] if residual else [])

  def f(a, w, a_scale, w_scale, *rest):
    rest = list(rest)
    b = rest.pop(0) if bias else None
    r = rest.pop(0) if residual else None
    return mf.matmul_fp8_mosaic(a, w, a_scale=a_scale, w_scale=w_scale, bias=b, residual=r,
                                activation=activation, config=config,
                                layer=None if layers is None else jnp.int32(1))

  _lower(f, S((m, k), F8), w, S((m,), F32), per_n, *extra)


@pytest.mark.parametrize("m", [1, 16, 64, 192, 320, 2048])
def test_fp8_matmul_llama_shapes_lower(m):
  _lower_fp8(m, 6144, 4096, layers=32)                                # qkv
  _lower_fp8(m, 4096, 4096, layers=32, residual=True)                 # wo (+ residual)
  _lower_fp8(m, 28672, 4096, layers=32, activation="swiglu")          # gate/up, fused gate
  _lower_fp8(m, 4096, 14336, layers=32, residual=True)                # down (+ residual)


@pytest.mark.parametrize("m,n,k,cfg", [
    (8192, 8192, 8192, mm.Config(tile_m=128, tile_n=128, tile_k=128, stages=3)),
    (8192, 8192, 8192, mm.Config(tile_m=128, tile_n=256, tile_k=128, stages=2, cluster="m")),
    (304, 4096, 4096, mm.Config(tile_m=64, tile_n=128, tile_k=128, stages=4, wg_dim="m")),
    (64, 4096, 14336, mm.Config(tile_m=64, tile_n=128, tile_k=128, stages=3, split_k=4)),
    (16, 6144, 4096, mm.Config(tile_m=16, tile_n=128, tile_k=256, stages=6, swap_ab=True)),
    (16, 4096, 4096, mm.Config(tile_m=16, tile_n=64, tile_k=256, stages=6, swap_ab=True,
                               split_k=4, cluster="k")),
    (192, 6144, 4096, mm.Config(tile_m=192, tile_n=128, tile_k=128, stages=4, swap_ab=True)),
    (64, 6144, 4096, mm.Config(tile_m=64, tile_n=128, tile_k=128, stages=4, swap_ab=True,
                               cluster="n")),
])
def test_fp8_matmul_schedules_lower(m, n, k, cfg):
  _lower_fp8(m, n, k, config=cfg, bias=True, residual=not cfg.split_k > 1)


# fp8 prefill attention: the Llama-3-8B heads (GQA 32:8, D = 128) through the
# public wrapper, each schedule, with and without a mask, the lse and packed
# segments; SMEM estimate either side of the limit (256-key blocks fit two
# stages with the bf16 output tiles, not three).
FP8_PREFILL = {
    "heuristic_causal": (None, dict(causal=True)),
    "heuristic_dense_lse": (None, dict(causal=False, return_lse=True)),
    "overlap_segments": (ap.Config(p_smem=True, overlap=True), dict(causal=True, segments=True)),
    "overlap_nopp_window": (ap.Config(p_smem=True, overlap=True, pingpong=False, stages=3),
                            dict(causal=True, sliding_window=512)),
    "acc_add": (ap.Config(p_smem=True, acc_in_place=False), dict(causal=True)),
    "kv256_lse": (ap.Config(p_smem=True, block_kv=256), dict(causal=False, return_lse=True)),
    "kv256_3_stages": (ap.Config(p_smem=True, block_kv=256, stages=3), dict(causal=True)),
}


@pytest.mark.parametrize("name", FP8_PREFILL)
def test_fp8_attention_prefill_lowers_for_h200(name):
  from kernels import attention_prefill_fp8 as af

  cfg, kw = FP8_PREFILL[name]
  kw = dict(kw)
  segments = kw.pop("segments", False)

  def f(q, k, v, qs, ks, vs, seg):
    masks = dict(q_segment_ids=seg, kv_segment_ids=seg) if segments else {}
    return af.attention_prefill_fp8_mosaic(q, k, v, q_scale=qs, k_scale=ks, v_scale=vs,
                                           config=cfg, **masks, **kw)

  args = (S((1, 2048, 32, 128), F8), S((1, 2048, 8, 128), F8), S((1, 2048, 8, 128), F8),
          S((32,), F32), S((8,), F32), S((), F32), S((1, 2048), I32))
  need = ap.smem_bytes(cfg or af._pick_config(128, True), 128, 1, dense=not kw["causal"],
                       has_lse=kw.get("return_lse", False), out_itemsize=2)
  fits = need <= target_lib.make("gpu", "NVIDIA H200", "9.0", 132).ceilings.smem_per_block
  assert fits == (name != "kv256_3_stages")  # the edge is what it says
  if fits:
    _lower(f, *args)
  else:
    with pytest.raises(ValueError, match="bytes of SMEM"):
      _lower(f, *args)


def test_mosaic_fp8_backend_of_attention_prefill_lowers_for_h200():
  # bf16 q/k/v quantized per head, then the fp8 kernel: the model's packed
  # prefill (segments, positions) through the registry with a plan.
  from kernels import attention_prefill_fp8  # noqa: F401 (registers the backend)

  def f(q, k, v, seg, pos):
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
              kv_positions=pos)
    plan = ap.op.plan(q, k, v, backend="mosaic_fp8", **kw)
    return ap.op(q, k, v, backend="mosaic_fp8", plan=plan, **kw)

  _lower(f, S((1, 2048, 32, 128), BF16), S((1, 2048, 8, 128), BF16), S((1, 2048, 8, 128), BF16),
         S((1, 2048), I32), S((1, 2048), I32))
