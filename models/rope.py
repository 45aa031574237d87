"""Rotary position embeddings of the Llama family: plain, Llama-3, linear,
dynamic (NTK) and YaRN scaling (models.config.RopeScaling).

positions [B, T] -> ``rope_angles`` -> (cos, sin), each [B, T, 1, hd/2],
computed once a step, outside the layer loop; ``rotate`` turns q and k
[B, T, H, hd] by them (the two halves of hd: HF's layout).
``rope_inv_freq`` is where a config's scaling is read.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """[hd/2] inverse frequencies, with the configured scaling (models.config.RopeScaling)."""
  hd = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  if cfg.rope_freq_factors is not None:
    return (inv / np.asarray(cfg.rope_freq_factors, np.float64)).astype(np.float32)
  s = cfg.rope_scaling
  if s is None or s.rope_type == "dynamic":
    # dynamic (NTK): transformers scales only past max_position_embeddings,
    # where the context is capped; below it, the plain frequencies.
    return inv.astype(np.float32)
  if s.rope_type == "linear":
    return (inv / s.factor).astype(np.float32)
  if s.rope_type == "yarn":
    return _yarn_inv_freq(inv, s, cfg.rope_theta, hd)
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  # Long wavelengths are slowed down by `factor`, short ones kept, and the
  # band in between interpolated smoothly.
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv, s, base, dim) -> np.ndarray:
  """YaRN's blend of interpolated and extrapolated frequencies, as
  transformers' _compute_yarn_parameters computes it."""
  def correction_dim(rotations):
    return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
  inv = inv.astype(np.float32)
  return ((inv / s.factor) * (1 - extrapolation) + inv * extrapolation).astype(np.float32)


def rope_scale(cfg: ModelConfig) -> float:
  """The factor on cos and sin (YaRN's attention_factor; 1 otherwise)."""
  s = cfg.rope_scaling
  return s.attention_factor if s is not None and s.rope_type == "yarn" else 1.0


def rope_angles(positions, inv_freq, scale: float = 1.0):
  """positions [B, T] -> (cos, sin), each [B, T, 1, hd/2] float32, times
  ``scale`` (rope_scale).

  A step computes them once, outside the layer loop: inside it XLA would
  evaluate them again in every layer (one more kernel per layer)."""
  ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  return cos, sin


def model_rope(cfg: ModelConfig, positions):
  """rope_angles of ``cfg``'s RoPE at positions [B, T]."""
  return rope_angles(positions, jnp.asarray(rope_inv_freq(cfg)), rope_scale(cfg))


def rotate(x, cos, sin):
  """x [B, T, H, hd]: rotates the two halves of hd (HF layout) by the angles."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def apply_rope(x, positions, inv_freq):
  """x [B, T, H, hd], positions [B, T]: RoPE at those positions."""
  return rotate(x, *rope_angles(positions, inv_freq))
