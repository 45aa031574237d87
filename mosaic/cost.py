"""FLOPs and bytes of each op call, and utilization against target ceilings.

Bytes are the fewest a kernel must move: each input read once and each output
written once. ``utilization(cost, seconds)`` turns a time into achieved
TFLOP/s and GB/s, their fraction of the target's ceilings, and which bound
(compute or memory) the roofline says applies. FLOPs on fp8 operands
(``Cost.fp8_flops``, part of ``flops``) run at FP8_SPEEDUP times the dense
bf16 peak (Hopper's and Blackwell's fp8 tensor cores), so the compute floor
of a cost is ``compute_seconds``, not its FLOPs over the bf16 peak.
"""

from __future__ import annotations

import dataclasses
import math

from mosaic import target as target_lib


# fp8 tensor-core throughput over bf16's (dense), on Hopper and Blackwell.
FP8_SPEEDUP = 2.0


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes: float
  fp8_flops: float = 0.0  # the part of ``flops`` with fp8 operands

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.bytes + other.bytes,
                self.fp8_flops + other.fp8_flops)

  @property
  def intensity(self) -> float:
    return self.flops / self.bytes if self.bytes else math.inf

  def compute_seconds(self, ceilings) -> float:
    """The least time of the FLOPs at the target's dense peaks (fp8 FLOPs at
    FP8_SPEEDUP x the bf16 peak)."""
    bf16 = ceilings.bf16_tflops * 1e12
    return (self.flops - self.fp8_flops) / bf16 + self.fp8_flops / (FP8_SPEEDUP * bf16)


def _isz(dtype) -> int:
  import numpy as np

  return np.dtype(dtype).itemsize


def matmul(m: int, n: int, k: int, in_dtype="bfloat16", out_dtype="bfloat16",
           weight_dtype=None) -> Cost:
  """A [m, k] @ [k, n] product; 1-byte (fp8) operands on both sides run on
  the fp8 tensor cores (``fp8_flops``)."""
  w = weight_dtype or in_dtype
  flops = 2.0 * m * n * k
  fp8 = _isz(in_dtype) == 1 and _isz(w) == 1
  return Cost(flops, m * k * _isz(in_dtype) + k * n * _isz(w) + m * n * _isz(out_dtype),
              flops if fp8 else 0.0)


def attention(batch: int, heads_q: int, heads_kv: int, q_len: int, kv_len: int, head_dim: int,
              causal: bool = False, dtype="bfloat16", kv_dtype=None) -> Cost:
  """Prefill/decode attention: QK^T and PV (4*B*H*Sq*Skv*D), halved if causal.
  Bytes: Q read and O written in ``dtype``, K and V read once in ``kv_dtype``
  (default ``dtype``; an fp8 cache halves them).

  For causal with q_len == kv_len the visible fraction is (S+1)/(2S); with a
  cached prefix (q_len < kv_len) queries see prefix + their own causal part.
  """
  if causal:
    prefix = kv_len - q_len
    visible = q_len * prefix + q_len * (q_len + 1) / 2
  else:
    visible = q_len * kv_len
  flops = 4.0 * batch * heads_q * visible * head_dim
  b, kvb = _isz(dtype), _isz(kv_dtype or dtype)
  io = batch * head_dim * (b * 2 * heads_q * q_len + kvb * 2 * heads_kv * kv_len)
  return Cost(flops, io)


def rms_norm(rows: int, cols: int, dtype="bfloat16", weight_dtype=None) -> Cost:
  b = _isz(dtype)
  return Cost(4.0 * rows * cols, 2 * rows * cols * b + cols * _isz(weight_dtype or dtype))


@dataclasses.dataclass(frozen=True)
class Utilization:
  seconds: float
  tflops: float
  gbps: float
  tc_fraction: float  # of the dense peak for its operands (fp8's FP8_SPEEDUP x bf16's)
  hbm_fraction: float  # of the target's HBM bandwidth
  bound: str  # "compute" or "memory", by the roofline
  ceilings_source: str

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def utilization(cost: Cost, seconds: float, target: target_lib.Target | None = None) -> Utilization:
  if seconds <= 0:
    raise ValueError(f"{seconds=} must be positive")
  t = target or target_lib.current()
  c = t.ceilings
  tflops = cost.flops / seconds / 1e12
  gbps = cost.bytes / seconds / 1e9
  compute = cost.compute_seconds(c)
  # The roofline's bound: whichever floor, FLOPs at the peak or bytes at the
  # bandwidth, is longer (the ridge point, for bf16 FLOPs alone).
  bound = "compute" if compute > 0 and compute >= cost.bytes / (c.hbm_gbps * 1e9) else "memory"
  src = c.source if t.is_gpu else f"{c.source} (CPU: not a tensor-core figure)"
  return Utilization(seconds, tflops, gbps, compute / seconds, gbps / c.hbm_gbps, bound, src)


def serving_step(*, weight_bytes: float, matmul_params: float, kv_bytes_per_token: float,
                 attn_flops_per_pair: float, concurrency: int, input_len: int,
                 output_len: int, fp8_params: float = 0.0) -> Cost:
  """One steady-state step of a server under stall-free batching: each of
  ``concurrency`` running requests decodes one token, and the prompt tokens
  that must enter to keep it full (``input_len / output_len`` per request a
  step, since each request decodes ``output_len`` steps) share the same pass
  over the weights. Decodes read their context's KV (``input_len +
  output_len / 2`` tokens on average); a prompt token attends to half its
  prompt on average. ``attn_flops_per_pair``: attention FLOPs of one (query,
  key) pair over all layers (4 * layers * heads * head_dim).

  The weights are read once a step, so the step is memory-bound until the
  tokens per step pass the ridge point; ``roofline_seconds`` is the step's
  floor on a target, and ``concurrency / roofline_seconds`` the output
  tokens/s no schedule can beat. ``fp8_params``: those of ``matmul_params``
  whose products run on fp8 operands (W8A8 linears)."""
  for name, v in (("concurrency", concurrency), ("input_len", input_len),
                  ("output_len", output_len)):
    if v < 1:
      raise ValueError(f"{name}={v} must be >= 1")
  prompt = concurrency * input_len / output_len  # prompt tokens a step
  context = input_len + output_len / 2  # a decode's mean KV tokens
  flops = (2.0 * matmul_params * (concurrency + prompt)
           + attn_flops_per_pair * (concurrency * context + prompt * input_len / 2))
  kv = kv_bytes_per_token * (concurrency * context + prompt)  # read by decodes, written by prompts
  return Cost(flops, weight_bytes + kv, 2.0 * fp8_params * (concurrency + prompt))


def roofline_seconds(cost: Cost, target: target_lib.Target | None = None) -> float:
  """The least time ``cost`` can take on ``target``: its FLOPs at the dense
  peaks (``Cost.compute_seconds``) or its bytes at the HBM bandwidth,
  whichever is longer."""
  c = (target or target_lib.current()).ceilings
  return max(cost.compute_seconds(c), cost.bytes / (c.hbm_gbps * 1e9))
