import dataclasses
import json

import pytest

from mosaic import cost, target, tuning


@dataclasses.dataclass(frozen=True)
class Cfg(tuning.KernelConfig):
  block: int = 64
  stages: int = 2

  def __post_init__(self):
    if self.block % 64:
      raise ValueError(f"{self.block=} must be a multiple of 64")


def test_search_space_drops_invalid():
  space = tuning.search_space(Cfg, block=[32, 64, 128], stages=[2, 3])
  assert {c.block for c in space} == {64, 128} and len(space) == 4


def test_from_dict_rejects_unknown():
  assert Cfg.from_dict({"block": 128}) == Cfg(128, 2)
  with pytest.raises(ValueError, match="unknown fields"):
    Cfg.from_dict({"blk": 1})


def test_table_roundtrip_and_heuristic(tmp_path, monkeypatch):
  monkeypatch.setattr(tuning, "TABLE_DIR", tmp_path)
  key = tuning.shape_key(m=tuning.bucket(100), n=4096)
  assert key == "m=256,n=4096"
  assert tuning.lookup("toy", key, Cfg, lambda: Cfg(64, 3), device_key="dev") == Cfg(64, 3)
  path = tuning.save("toy", {key: Cfg(128, 4)}, device_name="Dev")
  assert json.loads(path.read_text())["entries"][key] == {"block": 128, "stages": 4}
  assert tuning.lookup("toy", key, Cfg, lambda: Cfg(), device_key="dev") == Cfg(128, 4)
  # A later save merges its entries and keeps the table's note.
  data = json.loads(path.read_text())
  path.write_text(json.dumps({**data, "note": "measured on Dev"}))
  tuning.save("toy", {"m=1,n=4096": Cfg(64, 2)}, device_name="Dev")
  data = json.loads(path.read_text())
  assert data["note"] == "measured on Dev" and set(data["entries"]) == {key, "m=1,n=4096"}


def test_autotune_checks_before_timing():
  timed = []

  def run(c):
    return c.block

  def check(out):
    if out == 64:  # the fastest candidate is wrong: it must never win
      raise AssertionError("wrong")

  def time_fn(cfg):
    timed.append(cfg.block)
    return {64: 0.1, 128: 0.5, 192: 0.3}[cfg.block]

  best, results = tuning.autotune([Cfg(64), Cfg(128), Cfg(192)], run, check, time_fn)
  assert best == Cfg(192) and 64 not in timed
  assert results[0].seconds is None and "wrong" in results[0].error
  with pytest.raises(RuntimeError, match="no candidate"):
    tuning.autotune([Cfg(64)], run, check, time_fn)


def test_costs_and_utilization():
  c = cost.matmul(8192, 8192, 8192)
  assert c.flops == 2 * 8192**3 and c.bytes == 3 * 8192 * 8192 * 2
  h200 = target.Target("hopper", "NVIDIA H200", "9.0", target.Ceilings(989.0, 4800.0, 132, 1))
  u = cost.utilization(c, 2 * 8192**3 / 700e12, h200)
  assert abs(u.tflops - 700) < 1e-6 and u.bound == "compute"
  assert abs(u.tc_fraction - 700 / 989) < 1e-9
  r = cost.rms_norm(8192, 8192)
  assert cost.utilization(r, r.bytes / 4e12, h200).bound == "memory"
  full = cost.attention(1, 32, 32, 4096, 4096, 128, causal=False)
  causal = cost.attention(1, 32, 32, 4096, 4096, 128, causal=True)
  assert full.flops == 4 * 32 * 4096 * 4096 * 128
  assert abs(causal.flops / full.flops - 4097 / 8192) < 1e-12
  with pytest.raises(ValueError):
    cost.utilization(c, 0.0, h200)


def test_serving_step_roofline_matches_the_hand_arithmetic():
  """Llama-3-8B (7.5 B matmul weights, bf16; 128 KiB of KV a token) at c=64,
  512 in / 256 out, on a card of 700 TFLOP/s and 4.8 TB/s: the step reads
  15 GB of weights plus 64 x 640 x 128 KiB = 5.4 GB of KV (~4.3 ms) and
  computes 64 decode + 128 prompt tokens x 15 GFLOP (~4.1 ms): memory-bound,
  ~15,000 output tok/s at best."""
  layers, heads, kv_heads, hd, d, vocab = 32, 32, 8, 128, 4096, 128256
  matmul_params = 8.03e9 - vocab * d  # the embedding is gathered, not multiplied
  step = cost.serving_step(weight_bytes=2 * matmul_params, matmul_params=matmul_params,
                           kv_bytes_per_token=2 * layers * kv_heads * hd * 2,
                           attn_flops_per_pair=4 * layers * heads * hd,
                           concurrency=64, input_len=512, output_len=256)
  card = target.Target("hopper", "card", "9.0", target.Ceilings(700.0, 4800.0, 132, 1))
  assert 20.0e9 < step.bytes < 21.0e9
  assert 2.9e12 < step.flops < 3.0e12  # matmuls 2.88e12, attention ~0.03e12
  s = cost.roofline_seconds(step, card)
  assert s == pytest.approx(step.bytes / 4.8e12)  # memory-bound
  assert 14_500 < 64 / s < 15_500
  # Short outputs push prompt tokens into every step: compute-bound.
  prefill_heavy = cost.serving_step(weight_bytes=2 * matmul_params, matmul_params=matmul_params,
                                    kv_bytes_per_token=2 * layers * kv_heads * hd * 2,
                                    attn_flops_per_pair=4 * layers * heads * hd,
                                    concurrency=64, input_len=2048, output_len=64)
  assert cost.roofline_seconds(prefill_heavy, card) == pytest.approx(
      prefill_heavy.flops / 700e12)
  with pytest.raises(ValueError, match="output_len=0"):
    cost.serving_step(weight_bytes=1, matmul_params=1, kv_bytes_per_token=1,
                      attn_flops_per_pair=1, concurrency=1, input_len=1, output_len=0)
  # W8A8 linears (all but the 0.5 B lm_head): a byte a weight and the fp8
  # peak; the same load's floor is then the 8 GB of weights + 5.4 GB of KV.
  head = vocab * d
  fp8 = cost.serving_step(weight_bytes=2 * head + (matmul_params - head),
                          matmul_params=matmul_params, fp8_params=matmul_params - head,
                          kv_bytes_per_token=2 * layers * kv_heads * hd * 2,
                          attn_flops_per_pair=4 * layers * heads * hd,
                          concurrency=64, input_len=512, output_len=256)
  assert fp8.flops == step.flops and fp8.fp8_flops == pytest.approx(
      2 * (matmul_params - head) * (64 + 128))
  assert 12.9e9 < fp8.bytes < 13.9e9
  assert cost.roofline_seconds(fp8, card) == pytest.approx(fp8.bytes / 4.8e12)
  assert 21_000 < 64 / cost.roofline_seconds(fp8, card) < 24_000


def test_fp8_products_count_against_the_fp8_peak():
  # fp8 operands on both sides: the FLOPs run at FP8_SPEEDUP x the bf16 peak,
  # so the same time is half the utilization, and the bound moves.
  h200 = target.Target("hopper", "NVIDIA H200", "9.0", target.Ceilings(989.0, 4800.0, 132, 1))
  bf, f8 = cost.matmul(8192, 8192, 8192), cost.matmul(8192, 8192, 8192, "float8_e4m3fn")
  assert f8.flops == bf.flops == f8.fp8_flops and bf.fp8_flops == 0
  assert f8.bytes == 8192 * 8192 * (1 + 1 + 2)  # fp8 a and w, bf16 out
  secs = bf.flops / 700e12
  assert abs(cost.utilization(bf, secs, h200).tc_fraction - 700 / 989) < 1e-9
  assert abs(cost.utilization(f8, secs, h200).tc_fraction - 700 / (2 * 989)) < 1e-9
  # Mixed: one bf16 and one fp8 product's floors add up.
  both = bf + f8
  assert both.fp8_flops == f8.flops
  assert abs(both.compute_seconds(h200.ceilings) - bf.flops / 989e12 * 1.5) < 1e-12
  assert abs(cost.roofline_seconds(both, h200) - bf.flops / 989e12 * 1.5) < 1e-12
  # A decode-sized fp8 product stays memory-bound; one with a bf16 weight is not fp8.
  assert cost.utilization(cost.matmul(16, 4096, 4096, "float8_e4m3fn"), 1e-5, h200).bound \
      == "memory"
  assert cost.matmul(16, 4096, 4096, "float8_e4m3fn", weight_dtype="bfloat16").fp8_flops == 0
