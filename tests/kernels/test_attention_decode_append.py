"""attention_decode_append: RoPE, the K/V write and decode attention in one op.

The reference is checked against numpy written from the interface's words
(rotate the halves, write the new token's k and v at position length - 1,
attend every key up to it). Each backend must then give the reference's
output within bf16 tolerance and the same caches. Lengths include 0 (no
write), 1 (the new token alone), page boundaries and a position past the
table (no write). The Mosaic kernel runs in interpret mode on CPU.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels import attention_decode as ad
from kernels import attention_decode_append as ada
from mosaic import testing

PAGE = 64


def _case(lengths, hkv=2, g=4, d=128, layers=2, pages_per_row=4, seed=None):
  """Random un-rotated qkv, a two-layer cache stack, pages in a random order."""
  rng = np.random.default_rng(int(jax.random.randint(testing.fresh_key(seed), (), 0, 2**30)))
  b = len(lengths)
  num_pages = b * pages_per_row + 2
  table = rng.permutation(np.arange(1, num_pages))[:b * pages_per_row].reshape(b, -1)
  qkv, kp, vp = testing.random_inputs(
      [(b, 1, hkv, g + 2, d), (layers, hkv, num_pages, PAGE, d),
       (layers, hkv, num_pages, PAGE, d)], jnp.bfloat16)
  ang = jnp.asarray(rng.uniform(0, 2 * np.pi, (b, d // 2)), jnp.float32)
  rope = ada.rope_table(jnp.cos(ang), jnp.sin(ang))
  return qkv, kp, vp, jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32), rope, ang


def _expected(qkv, kp, vp, lengths, table, ang, layer):
  """(rotated q [B,1,Hq,D], k stack, v stack) from the interface's words; the
  rotation in float32, rounded to bf16 as the model's is."""
  x = np.asarray(qkv, np.float32)
  b, _, hkv, gp2, d = x.shape
  c, s = np.cos(np.asarray(ang))[:, None, None, :], np.sin(np.asarray(ang))[:, None, None, :]

  def rot(y):  # y [B, 1, H, D]: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    y1, y2 = y[..., :d // 2], y[..., d // 2:]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], -1)

  q = jnp.asarray(rot(x[:, :, :, :-2].reshape(b, 1, -1, d))).astype(jnp.bfloat16)
  k = rot(x[:, :, :, -2]).astype(jnp.bfloat16)
  kp, vp = np.array(kp), np.array(vp)
  for i, n in enumerate(np.asarray(lengths)):
    pos = int(n) - 1
    if 0 <= pos < table.shape[1] * PAGE:
      page, slot = int(table[i, pos // PAGE]), pos % PAGE
      kp[layer, :, page, slot] = k[i, 0]
      vp[layer, :, page, slot] = np.asarray(qkv)[i, 0, :, -1]
  return q, jnp.asarray(kp), jnp.asarray(vp)


LENGTHS = {
    "mixed": [0, 1, 64, 65, 200],
    "past_table": [257, 130],  # 4 pages of 64 hold 256: the first writes nothing
}


@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_reference_rotates_writes_and_attends(lengths):
  qkv, kp, vp, lens, table, rope, ang = _case(LENGTHS[lengths])
  q, k_want, v_want = _expected(qkv, kp, vp, lens, table, ang, layer=1)
  o, k_out, v_out = ada.attention_decode_append_reference(qkv, kp, vp, lens, table, rope, layer=1)
  _check_caches(kp, k_out, v_out, (None, k_want, v_want))
  want = ad.attention_decode_reference(q, k_want, v_want, lens, table, layer=1)
  # Usually the same bits; but a rotated q or k element may round to bf16 one
  # ulp apart from _expected's (a fused multiply-add), which moved the output
  # by 2e-5 in one draw of many. A wrong rotation, slot or length moves it by
  # far more than 1e-3.
  testing.assert_close(o, want, jnp.float32, tol=1e-3, what="reference output")
  assert int(jnp.sum(k_out != kp)) > 0  # a write happened at all


CONFIGS = {
    "default": None,
    "swap_splits": ad.Config(pages_per_step=1, stages=2, splits=3, swap_ab=True),
    "no_swap": ad.Config(pages_per_step=2, stages=2, splits=1),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_mosaic_matches_reference(config, lengths):
  args = _case(LENGTHS[lengths])[:6]
  want = ada.attention_decode_append_reference(*args, layer=1)
  o, k_out, v_out = ada.attention_decode_append_mosaic(*args, layer=1, config=CONFIGS[config])
  testing.assert_close(o, want[0], jnp.bfloat16, what=f"mosaic {config} output")
  _check_caches(args[1], k_out, v_out, want)


def _check_caches(k_before, k_out, v_out, want):
  """v is copied as it is: the same bits. The rotated k may round apart from
  the reference's in its last bit (a fused multiply-add): close, written
  only where the reference wrote, and every other element untouched."""
  np.testing.assert_array_equal(np.asarray(v_out), np.asarray(want[2]))
  written = np.asarray(want[1] != k_before)
  assert written.any()
  testing.assert_close(np.asarray(k_out, np.float32)[written],
                       np.asarray(want[1], np.float32)[written], jnp.bfloat16,
                       what="written k rows")
  np.testing.assert_array_equal(np.asarray(k_out)[~written], np.asarray(k_before)[~written])


def test_xla_matches_reference_one_layer_cache():
  qkv, kp, vp, lens, table, rope, _ = _case(LENGTHS["mixed"])
  want = ada.attention_decode_append_reference(qkv, kp[0], vp[0], lens, table, rope)
  o, k_out, v_out = ada.attention_decode_append(qkv, kp[0], vp[0], lens, table, rope,
                                               backend="xla")
  testing.assert_close(o, want[0], jnp.bfloat16, what="xla output")
  np.testing.assert_array_equal(np.asarray(k_out), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(v_out), np.asarray(want[2]))


def test_new_token_alone_is_its_value():
  # Length 1: the only key is the new one, so every head's output is its v.
  qkv, kp, vp, lens, table, rope, _ = _case([1, 1], seed=3)
  o, _, _ = ada.attention_decode_append_mosaic(qkv, kp, vp, lens, table, rope, layer=0)
  v = jnp.repeat(qkv[:, :, :, -1], 4, axis=2)  # [B, 1, Hq, D]
  np.testing.assert_array_equal(np.asarray(o), np.asarray(v))


@pytest.mark.parametrize("bad, match", [
    (lambda a: (a[0][:, :, :, :2],) + a[1:], "G \\+ 2"),
    (lambda a: (a[0][..., :64],) + a[1:], "head dims differ"),
    (lambda a: a[:5] + (a[5][:, :1],), "rope must be"),
    (lambda a: a[:5] + (a[5].astype(jnp.bfloat16),), "rope must be"),
    (lambda a: (a[0][:, :, :1],) + a[1:], "kv heads"),
])
def test_bad_inputs_are_rejected(bad, match):
  args = bad(_case([5, 9])[:6])
  for backend in ("xla", "mosaic", "reference"):
    with pytest.raises(ValueError, match=match):
      ada.attention_decode_append(*args, layer=0, backend=backend)


def test_mosaic_says_why_not():
  qkv, kp, vp, lens, table, rope, _ = _case([5, 9], d=64)
  why = ada.append_op.get("mosaic").why_not(qkv, kp, vp, lens, table, rope, layer=0)
  assert "multiple of 128" in why
  args = _case([5, 9])[:6]
  big = ad.Config(pages_per_step=4, stages=4, swap_ab=True)  # 4 x 256-key K and V stages
  assert "SMEM" in ada.append_op.get("mosaic").why_not(*args, layer=0, config=big)
  fp8 = [ad.quantize_pages(x, 1.0) for x in args[1:3]]
  why = ada.append_op.get("mosaic").why_not(args[0], *fp8, *args[3:], layer=0)
  assert "fp8" in why
  # The xla backend takes fp8 pages: k and v are written at scale 1.
  o, k_out, _ = ada.attention_decode_append(args[0], *fp8, *args[3:], layer=0, backend="xla")
  assert k_out.dtype == jnp.float8_e4m3fn and bool(jnp.isfinite(o.astype(jnp.float32)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_full_size(batch):
  # Llama-3-8B's heads, 128-token pages (the engine's), a 32-layer stack.
  rng = np.random.default_rng(int(jax.random.randint(testing.fresh_key(), (), 0, 2**30)))
  lengths = rng.integers(1, 2000, batch)
  lengths[: min(batch, 3)] = [1, 128, 129][: min(batch, 3)]
  hkv, g, d, page, mp = 8, 4, 128, 128, 16
  table = rng.permutation(np.arange(1, batch * mp + 1)).reshape(batch, mp).astype(np.int32)
  qkv, kp, vp = testing.random_inputs(
      [(batch, 1, hkv, g + 2, d), (4, hkv, batch * mp + 1, page, d),
       (4, hkv, batch * mp + 1, page, d)], jnp.bfloat16)
  ang = jnp.asarray(rng.uniform(0, 2 * np.pi, (batch, d // 2)), jnp.float32)
  args = (qkv, kp, vp, jnp.asarray(lengths, jnp.int32), jnp.asarray(table),
          ada.rope_table(jnp.cos(ang), jnp.sin(ang)))
  want = ada.attention_decode_append_reference(*args, layer=2)
  o, k_out, v_out = ada.attention_decode_append(*args, layer=2, backend="mosaic")
  testing.assert_close(o, want[0], jnp.bfloat16, what="mosaic output")
  _check_caches(kp, k_out, v_out, want)
