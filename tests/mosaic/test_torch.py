"""mosaic.torch on CUDA tensors (GPU machine only): shared buffers, values of
the custom ops against float32 references, ordering on torch's current
stream without a host wait, and the transformers backend.

The CPU side (fakes, torch.compile, transformers on CPU) is
tests/mosaic/torch_cases.py, run by test_torch_interop.py.
"""

import itertools
import time

import pytest

torch = pytest.importorskip("torch")

from mosaic import testing  # noqa: E402
from mosaic import torch as mtorch  # noqa: E402

pytestmark = pytest.mark.gpu
_seeds = itertools.count(testing._BASE_SEED)


def _gen():
  return torch.Generator(device="cuda").manual_seed(next(_seeds))


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
  return (torch.randn(*shape, device="cuda", generator=_gen()) * scale).to(dtype)


def assert_close(out, ref, dtype, what="output"):
  f64 = lambda t: t.detach().double().cpu().numpy()
  return testing.assert_close(f64(out), f64(ref), str(dtype).split(".")[-1], what=what)


def ref_attention(q, k, v, causal, scale=None):
  """[B, Sq, Hq, D] / [B, Skv, Hkv, D], float32, queries the last Sq positions."""
  q, k, v = (t.float() for t in (q, k, v))
  Sq, Hq, D = q.shape[1:]
  Skv, Hkv = k.shape[1:3]
  k, v = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
  s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (D ** -0.5 if scale is None else scale)
  if causal:
    qpos = torch.arange(Sq, device=q.device)[:, None] + (Skv - Sq)
    s = s.masked_fill(torch.arange(Skv, device=q.device)[None] > qpos, float("-inf"))
  return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def ref_rms(x, w, eps):
  xf = x.float()
  return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def test_rms_norm_on_torch_tensors_without_copies():
  x = randn(512, 1024)
  w = randn(1024)
  assert mtorch.to_jax(x).unsafe_buffer_pointer() == x.data_ptr()  # shared, not copied
  out = mtorch.torch_op("rms_norm", backend="mosaic")(x, w, eps=1e-6)
  assert isinstance(out, torch.Tensor) and out.is_cuda and out.shape == x.shape
  assert_close(out, ref_rms(x, w, 1e-6), torch.bfloat16)
  out = torch.ops.mosaic.rms_norm(x, w, 1e-6, "mosaic")
  assert_close(out, ref_rms(x, w, 1e-6), torch.bfloat16)


@pytest.mark.parametrize("causal,sq,skv,layout", [(True, 1000, 1000, "bshd"),
                                                  (False, 1000, 1000, "bshd"),
                                                  (True, 300, 1000, "bhsd"),
                                                  (False, 1, 777, "bhsd")])
def test_attention_prefill_mosaic_on_cuda(causal, sq, skv, layout):
  q, k, v = randn(2, sq, 8, 128), randn(2, skv, 2, 128), randn(2, skv, 2, 128)
  ref = ref_attention(q, k, v, causal)
  if layout == "bhsd":
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
  out = torch.ops.mosaic.attention_prefill(q, k, v, causal, None, None, layout, "mosaic")
  assert_close(out.transpose(1, 2) if layout == "bhsd" else out, ref, torch.bfloat16)


def test_matmul_and_decode_mosaic_on_cuda():
  a, b, bias = randn(256, 1024), randn(1024, 2048, scale=0.03), randn(2048)
  out = torch.ops.mosaic.matmul(a, b, bias, out_dtype=torch.float32, backend="mosaic")
  assert out.dtype == torch.float32
  assert_close(out, a.float() @ b.float() + bias.float(), torch.bfloat16)
  B, Hq, Hkv, D, page, S = 4, 8, 2, 128, 128, 700
  n = -(-S // page)
  k, v = randn(B, n * page, Hkv, D), randn(B, n * page, Hkv, D)
  table = (torch.randperm(B * n, device="cuda") + 1).reshape(B, n).to(torch.int32)
  pages = lambda x: torch.zeros(Hkv, B * n + 1, page, D, dtype=x.dtype, device="cuda").index_copy(
      1, table.reshape(-1).long(), x.reshape(B * n, page, Hkv, D).permute(2, 0, 1, 3))
  lengths = torch.tensor([700, 1, 129, 512], dtype=torch.int32, device="cuda")
  q = randn(B, 1, Hq, D)
  out = torch.ops.mosaic.attention_decode(q, pages(k), pages(v), lengths, table, None, "mosaic")
  for i in range(B):
    L = int(lengths[i])
    assert_close(out[i:i + 1], ref_attention(q[i:i + 1], k[i:i + 1, :L], v[i:i + 1, :L], True),
                 torch.bfloat16, what=f"row {i}")


@pytest.mark.parametrize("side_stream", [False, True])
def test_ordered_on_current_stream_without_host_wait(side_stream):
  """A call queued behind ~0.2 s of GPU work returns at once, reads inputs
  written behind that work, and torch work queued after it reads its output."""
  x0, x1, w = randn(4096, 4096), randn(4096, 4096), randn(4096)
  op = lambda x: torch.ops.mosaic.rms_norm(x, w, 1e-6, "mosaic")
  op(x0)  # compiled before timing
  torch.cuda.synchronize()
  stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
  with torch.cuda.stream(stream):
    x = x0.clone()
    torch.cuda._sleep(400_000_000)  # ~0.2 s at 2 GHz
    x.copy_(x1)  # the op must see this write
    t0 = time.perf_counter()
    out = op(x)
    host_s = time.perf_counter() - t0
    y = out.float() * 2  # must see the finished output
    done = torch.cuda.Event()
    done.record()
  pending = not done.query()
  stream.synchronize()
  assert pending, "the GPU had finished before the checks: the sleep was too short"
  assert host_s < 0.05, f"the call held the host {host_s:.3f} s (a host wait?)"
  assert_close(out, ref_rms(x1, w, 1e-6), torch.bfloat16)
  assert_close(y, 2 * ref_rms(x1, w, 1e-6), torch.bfloat16, what="torch after the op")


def test_transformers_backend_on_cuda():
  """bf16 logits as close to the float32 model's as sdpa's are, and greedy
  tokens equal to sdpa's (or differing first at a bf16 near-tie of sdpa's
  own logits: random weights give flat logits)."""
  from transformers import LlamaConfig, LlamaForCausalLM

  mtorch.register_transformers_attention()
  cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                    max_position_embeddings=1024)
  torch.manual_seed(next(_seeds))
  with torch.device("cuda"):
    m = LlamaForCausalLM(cfg).eval()
  set_impl = lambda impl: setattr(m.config, "_attn_implementation", impl)
  ids = torch.randint(3, 512, (2, 300), device="cuda", generator=_gen())
  f64 = lambda t: t.detach().double().cpu().numpy()
  with torch.no_grad():
    set_impl("sdpa")
    ref = m(ids).logits
    m.to(torch.bfloat16)
    err = {}
    for impl in ("sdpa", "mosaic"):
      set_impl(impl)
      err[impl] = testing.rel_error(f64(m(ids).logits), f64(ref))
    assert err["mosaic"] <= 1.5 * err["sdpa"] + 1e-3, err
    gen = {}
    for impl in ("sdpa", "mosaic"):
      set_impl(impl)
      gen[impl] = m.generate(ids[:1], max_new_tokens=16, min_new_tokens=16, do_sample=False)
    diff = (gen["mosaic"] != gen["sdpa"]).nonzero()
    if len(diff):
      t = int(diff[0, 1])
      at = {}
      for impl in ("sdpa", "mosaic"):
        set_impl(impl)
        at[impl] = m(gen["sdpa"][:, :t]).logits[0, -1].float()
      top2 = at["sdpa"].topk(2).values
      noise = float((at["mosaic"] - at["sdpa"]).abs().max())
      assert float(top2[0] - top2[1]) <= 2 * noise, f"tokens differ at {t}, not at a near-tie"
