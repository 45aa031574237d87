"""mosaic.torch on CPU: the custom ops, their fakes, torch.compile, transformers.

Runs in an interpreter that has both torch and jax (test_torch_interop.py
starts it: .venv-oracle's torch + transformers with jax beside them); the
file name keeps the main suite, which has no torch, from collecting it.
Values are checked against float32 references written here in torch (not
the jax references: those share code with what is tested), with the
relative Frobenius error of mosaic.testing; inputs are fresh every run.
"""

import itertools
import math
import sys

import numpy as np
import pytest
import torch

from mosaic import registry, testing
from mosaic import torch as mt

_counter = itertools.count()


def _gen() -> torch.Generator:
  return torch.Generator().manual_seed(testing._BASE_SEED + next(_counter))


def randn(*shape, dtype=torch.float32, scale=1.0, gen=None):
  x = torch.randn(*shape, generator=gen or _gen(), dtype=torch.float32) * scale
  return x.to(dtype)


def assert_close(out, ref, dtype, tol=None, what="output"):
  """mosaic.testing's check: ||out - ref|| / ||ref|| <= tol, NaN never passes."""
  assert isinstance(out, torch.Tensor)
  f64 = lambda t: t.detach().to(torch.float64).numpy()
  testing.assert_close(f64(out), f64(ref), str(dtype).split(".")[-1], tol=tol, what=what)


# --------------------------------------------------------------------------
# float32 references


def ref_attention(q, k, v, causal, scale=None, window=None):
  """q [B, Sq, Hq, D], k/v [B, Skv, Hkv, D], the queries the last Sq positions."""
  q, k, v = (t.double() for t in (q, k, v))
  B, Sq, Hq, D = q.shape
  Skv, Hkv = k.shape[1], k.shape[2]
  k = k.repeat_interleave(Hq // Hkv, dim=2)
  v = v.repeat_interleave(Hq // Hkv, dim=2)
  s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (D ** -0.5 if scale is None else scale)
  qpos = torch.arange(Sq)[:, None] + (Skv - Sq)
  kpos = torch.arange(Skv)[None, :]
  vis = torch.ones(Sq, Skv, dtype=torch.bool)
  if causal:
    vis &= kpos <= qpos
  if window is not None:
    vis &= (qpos - kpos) < window
  s = s.masked_fill(~vis, -math.inf)
  return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def ref_decode(q, k_pages, v_pages, lengths, table, scale=None):
  q = q.double()
  B, Tq, Hq, D = q.shape
  Hkv, _, page, _ = k_pages.shape
  out = torch.zeros_like(q)
  for b in range(B):
    n = int(lengths[b])
    pages = table[b, : -(-n // page)].long()
    k = k_pages[:, pages].reshape(Hkv, -1, D)[:, :n].double()
    v = v_pages[:, pages].reshape(Hkv, -1, D)[:, :n].double()
    out[b] = ref_attention(q[b:b + 1], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                           True, scale)[0]
  return out


def ref_rms(x, w, eps):
  x = x.double()
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def paged(k, page, seed):
  """[B, S, Hkv, D] -> pages [Hkv, P, page, D] in a shuffled order, table [B, S / page]."""
  B, S, Hkv, D = k.shape
  n = -(-S // page)
  perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed)) + 1
  table = perm.reshape(B, n).to(torch.int32)
  x = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, n * page - S))
  pages = torch.zeros(Hkv, B * n + 1, page, D, dtype=k.dtype)
  pages[:, table.reshape(-1).long()] = x.reshape(B * n, page, Hkv, D).permute(2, 0, 1, 3)
  return pages, table


# --------------------------------------------------------------------------
# registration and fakes


def test_ops_registered_in_namespace_mosaic():
  for name in ("attention_prefill", "attention_decode", "matmul", "rms_norm"):
    op = getattr(torch.ops.mosaic, name)
    assert str(op.default._schema).startswith(f"mosaic::{name}(")
  schema = str(torch.ops.mosaic.matmul.default._schema)
  for arg in ("Tensor? bias", "Tensor? residual", "ScalarType? out_dtype", "str? activation",
              "float? rms_eps"):
    assert arg in schema, schema
  mt._load_ops()  # on first use, else
  assert set(registry.ops()) >= {"attention_prefill", "attention_decode", "matmul", "rms_norm"}
  if mt._foreign_kernels_installed():  # Hugging Face's kernels kept its name
    assert not mt._is_ours(sys.modules["kernels"])
    import transformers.integrations.hub_kernels  # noqa: F401  (imports from theirs)


def _fake_cases():
  f = torch.empty
  bf, f32 = torch.bfloat16, torch.float32
  return [
      ("attention_prefill", (f(2, 33, 8, 64, dtype=bf), f(2, 40, 2, 64, dtype=bf),
                             f(2, 40, 2, 64, dtype=bf)), {}, (2, 33, 8, 64), bf),
      ("attention_prefill", (f(1, 8, 5, 128, dtype=bf), f(1, 4, 9, 128, dtype=bf),
                             f(1, 4, 9, 128, dtype=bf)), dict(layout="bhsd"), (1, 8, 5, 128), bf),
      ("attention_decode", (f(3, 2, 4, 64, dtype=bf), f(2, 9, 16, 64, dtype=bf),
                            f(2, 9, 16, 64, dtype=bf), f(3, dtype=torch.int32),
                            f(3, 4, dtype=torch.int32)), {}, (3, 2, 4, 64), bf),
      ("matmul", (f(5, 64, dtype=bf), f(64, 256, dtype=bf)), {}, (5, 256), bf),
      ("matmul", (f(5, 64, dtype=bf), f(64, 256, dtype=bf)),
       dict(activation="swiglu", out_dtype=f32, residual=f(5, 128, dtype=f32)), (5, 128), f32),
      ("rms_norm", (f(2, 3, 128, dtype=torch.float16), f(128, dtype=torch.float16)), {},
       (2, 3, 128), torch.float16),
  ]


@pytest.mark.parametrize("case", range(len(_fake_cases())))
def test_fake_gives_exact_shape_and_dtype(case):
  from torch._subclasses.fake_tensor import FakeTensorMode

  name, args, kwargs, shape, dtype = _fake_cases()[case]
  with FakeTensorMode() as mode:
    fargs = [mode.from_tensor(a) for a in args]
    fkw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    out = getattr(torch.ops.mosaic, name)(*fargs, **fkw)
  assert tuple(out.shape) == shape and out.dtype == dtype


def test_opcheck():
  """torch's own checks: schema (no aliasing, no mutation), fake tensor,
  and AOT dispatch with dynamic shapes against the real op."""
  bf = torch.bfloat16
  cases = [
      (torch.ops.mosaic.attention_prefill, (randn(1, 20, 4, 64, dtype=bf),
                                            randn(1, 20, 2, 64, dtype=bf),
                                            randn(1, 20, 2, 64, dtype=bf)), {}),
      (torch.ops.mosaic.rms_norm, (randn(6, 128), randn(128)), dict(eps=1e-5)),
      (torch.ops.mosaic.matmul, (randn(6, 64, dtype=bf), randn(64, 128, dtype=bf)),
       dict(bias=randn(128, dtype=bf))),
  ]
  k, table = paged(randn(2, 20, 2, 64, dtype=bf), 16, 0)
  cases.append((torch.ops.mosaic.attention_decode,
                (randn(2, 1, 4, 64, dtype=bf), k, k.clone(),
                 torch.tensor([20, 7], dtype=torch.int32), table), {}))
  for op, args, kwargs in cases:
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor",
                                                        "test_aot_dispatch_dynamic"))


# --------------------------------------------------------------------------
# values on CPU (the registry's CPU default, xla)


@pytest.mark.parametrize("causal,sq,skv,hq,hkv,layout,dtype", [
    (True, 70, 70, 4, 2, "bshd", torch.float32),   # GQA, a tail block
    (False, 70, 70, 4, 4, "bshd", torch.bfloat16),
    (True, 5, 70, 4, 2, "bshd", torch.float32),    # a cached prefix
    (True, 70, 70, 4, 2, "bhsd", torch.float32),   # heads folded into the sequence
    (False, 1, 37, 6, 2, "bhsd", torch.float16),   # a decode step
    (True, 5, 70, 8, 2, "bhsd", torch.bfloat16),
])
def test_attention_prefill_values(causal, sq, skv, hq, hkv, layout, dtype):
  B, D = 2, 64
  q, k, v = randn(B, sq, hq, D, dtype=dtype), randn(B, skv, hkv, D, dtype=dtype), randn(
      B, skv, hkv, D, dtype=dtype)
  ref = ref_attention(q, k, v, causal)
  if layout == "bhsd":
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
  out = torch.ops.mosaic.attention_prefill(q, k, v, causal=causal, layout=layout)
  assert out.dtype == dtype and out.shape == q.shape
  if layout == "bhsd":
    out = out.transpose(1, 2)
  assert_close(out, ref, dtype)


def test_attention_prefill_scale_and_window():
  q, k, v = randn(1, 50, 4, 64), randn(1, 50, 2, 64), randn(1, 50, 2, 64)
  out = torch.ops.mosaic.attention_prefill(q, k, v, True, 0.07, 17)
  assert_close(out, ref_attention(q, k, v, True, 0.07, 17), torch.float32)
  # Folded heads keep each query's own window.
  bhsd = lambda t: t.transpose(1, 2).contiguous()
  out = torch.ops.mosaic.attention_prefill(bhsd(q), bhsd(k), bhsd(v), True, 0.07, 17, "bhsd")
  assert_close(out.transpose(1, 2), ref_attention(q, k, v, True, 0.07, 17), torch.float32)


def test_attention_decode_values():
  B, Tq, Hq, Hkv, D, page = 3, 2, 4, 2, 64, 16
  lengths = torch.tensor([40, 2, 17], dtype=torch.int32)
  k_pages, table = paged(randn(B, 40, Hkv, D), page, 1)
  v_pages, _ = paged(randn(B, 40, Hkv, D), page, 1)
  q = randn(B, Tq, Hq, D)
  out = torch.ops.mosaic.attention_decode(q, k_pages, v_pages, lengths, table, 0.1)
  assert_close(out, ref_decode(q, k_pages, v_pages, lengths, table, 0.1), torch.float32)


def test_matmul_values():
  bf, f32 = torch.bfloat16, torch.float32
  a, b, bias = randn(9, 64, dtype=bf), randn(64, 256, dtype=bf, scale=0.1), randn(256, dtype=bf)
  ref = a.double() @ b.double() + bias.double()
  assert_close(torch.ops.mosaic.matmul(a, b, bias), ref, bf)
  res = randn(9, 256)
  out = torch.ops.mosaic.matmul(a, b, residual=res, out_dtype=f32)
  assert out.dtype == f32
  assert_close(out, a.double() @ b.double() + res.double(), bf)  # bf16 inputs


def test_matmul_rms_and_swiglu():
  """Fused RMSNorm of a's rows, then SwiGLU over one [gate | up] column block pair."""
  bf = torch.bfloat16
  blk = registry.get_op("matmul").get("xla").fn.__globals__["SWIGLU_BLOCK"]
  a, gate, up = randn(4, 64, dtype=bf), randn(64, blk, dtype=bf, scale=0.1), randn(
      64, blk, dtype=bf, scale=0.1)
  b = torch.stack([gate, up], 1).reshape(64, 2 * blk)  # one [gate | up] block pair
  out = torch.ops.mosaic.matmul(a, b, activation="swiglu", rms_eps=1e-5)
  an = ref_rms(a, torch.ones(64), 1e-5)
  ref = torch.nn.functional.silu(an @ gate.double()) * (an @ up.double())
  assert out.shape == (4, blk)
  assert_close(out, ref, bf)


@pytest.mark.parametrize("backend", [None, "mosaic"])
def test_rms_norm_values(backend):
  """backend="mosaic": the Mosaic GPU kernel itself, in interpret mode. (Under
  this interpreter's jax, 0.10.2, the attention and matmul kernels do not
  interpret; the main suite interprets them under 0.11.2.)"""
  x, w = randn(3, 5, 256, dtype=torch.bfloat16), randn(256, dtype=torch.bfloat16)
  out = torch.ops.mosaic.rms_norm(x, w, 1e-5, backend)
  assert out.shape == x.shape and out.dtype == x.dtype
  assert_close(out, ref_rms(x, w, 1e-5), torch.bfloat16)


def test_strided_inputs_are_made_contiguous():
  q, k, v = randn(2, 4, 30, 64), randn(2, 2, 30, 64), randn(2, 2, 30, 64)
  out = torch.ops.mosaic.attention_prefill(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
  assert_close(out, ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True),
               torch.float32)


# --------------------------------------------------------------------------
# refusals name the argument


@pytest.mark.parametrize("call,match", [
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 3, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64)), "multiple of kv heads"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64), randn(1, 8, 2, 32),
                                                randn(1, 8, 2, 32)), "head dim"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64), layout="sbhd"), "layout"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64).half()), "share a dtype"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64), backend="reference"),
     "reference"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64), backend="nope"), "nope"),
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64).bfloat16(),
                                                randn(1, 8, 2, 64).bfloat16(),
                                                randn(1, 8, 2, 64).bfloat16(), scale=-1.0),
     "scale"),
    (lambda: torch.ops.mosaic.attention_decode(randn(1, 1, 2, 64), randn(2, 3, 16, 64),
                                               randn(2, 3, 16, 64), torch.tensor([5]),
                                               torch.ones(1, 3, dtype=torch.int32)), "lengths"),
    (lambda: torch.ops.mosaic.matmul(randn(4, 64), randn(32, 64)), "contracting"),
    (lambda: torch.ops.mosaic.matmul(randn(4, 64), randn(64, 64), activation="gelu"),
     "activation"),
    (lambda: torch.ops.mosaic.matmul(randn(4, 64), randn(64, 64), residual=randn(4, 64).half()),
     "residual"),
    (lambda: torch.ops.mosaic.matmul(torch.ones(4, 64, dtype=torch.int32),
                                     torch.ones(64, 64, dtype=torch.int32)), "a.dtype"),
    (lambda: torch.ops.mosaic.rms_norm(randn(4, 64), randn(32)), "weight"),
    # values the jax op checks only outside jit: read here on the CPU (a page
    # past the cache gave NaN rows, a negative length zeros, with no error)
    (lambda: torch.ops.mosaic.attention_decode(
        randn(1, 1, 2, 64), randn(2, 3, 16, 64), randn(2, 3, 16, 64),
        torch.tensor([5], dtype=torch.int32), torch.tensor([[99, 0, 1]], dtype=torch.int32)),
     r"page_table entries must be in \[0, 3\)"),
    (lambda: torch.ops.mosaic.attention_decode(
        randn(1, 1, 2, 64), randn(2, 3, 16, 64), randn(2, 3, 16, 64),
        torch.tensor([-5], dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32)),
     "lengths must be >= 0"),
    # causal with more queries than keys: rows that see no key came back zeros
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 24, 2, 64), randn(1, 8, 2, 64),
                                                randn(1, 8, 2, 64)),
     r"causal with more queries \(24\) than keys \(8\)"),
    # a meta tensor beside a CPU one ran the fake: its empty memory was the result
    (lambda: torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 64),
                                                torch.empty(1, 8, 2, 64, device="meta"),
                                                torch.empty(1, 8, 2, 64, device="meta")),
     "all tensors must be on one device"),
    (lambda: torch.ops.mosaic.rms_norm(randn(4, 64), torch.empty(64, device="meta")),
     "all tensors must be on one device"),
])
def test_refusals_name_the_argument(call, match):
  with pytest.raises((ValueError, registry.BackendError), match=match):
    call()


def test_mosaic_backend_refuses_what_the_kernel_cannot_run():
  """An explicit backend that cannot run the call says why: under jax < 0.11
  the kernels do not interpret on the CPU (matmul hung in the interpreter),
  else the registry's reason."""
  import jax

  old_jax = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
  with pytest.raises((ValueError, registry.BackendError),
                     match="needs jax >= 0.11" if old_jax else "head dim 32"):
    torch.ops.mosaic.attention_prefill(randn(1, 8, 2, 32).bfloat16(), randn(1, 8, 2, 32).bfloat16(),
                                       randn(1, 8, 2, 32).bfloat16(), backend="mosaic")
  if old_jax:
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
      torch.ops.mosaic.matmul(randn(8, 64).half(), randn(64, 64).half(), backend="mosaic")


def test_empty_inputs_give_what_the_fakes_promise():
  """A zero-size output is returned as the fake shapes it (B=0 raised a
  ZeroDivisionError, M=0 'empty matmul is not supported')."""
  o = torch.ops.mosaic.attention_prefill(randn(0, 8, 2, 64), randn(0, 8, 2, 64),
                                         randn(0, 8, 2, 64))
  assert o.shape == (0, 8, 2, 64) and o.dtype == torch.float32
  y = torch.ops.mosaic.matmul(randn(0, 64), randn(64, 32), out_dtype=torch.bfloat16)
  assert y.shape == (0, 32) and y.dtype == torch.bfloat16


def test_transformers_registration_in_a_fresh_interpreter():
  """The README's order (import, register, then transformers) in a fresh
  interpreter: registering imported transformers, whose import of Hugging
  Face's `kernels` found ours (ImportError) until the ops had been loaded."""
  import subprocess

  code = ("import mosaic.torch as mt\n"
          "mt.register_transformers_attention()\n"
          "from transformers import AttentionInterface\n"
          "assert 'mosaic' in AttentionInterface._global_mapping, 'not registered'\n"
          "print('ok')\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# --------------------------------------------------------------------------
# torch.compile traces every op without a graph break


class _Block(torch.nn.Module):
  def forward(self, x, w_norm, w_qkv, k_pages, v_pages, lengths, table):
    h = torch.ops.mosaic.rms_norm(x, w_norm, 1e-5)
    qkv = torch.ops.mosaic.matmul(h, w_qkv, out_dtype=torch.float32)
    B, S = x.shape[0], 1
    q = qkv[:, :256].reshape(B, S, 4, 64)
    k = qkv[:, 256:384].reshape(B, S, 2, 64)
    v = qkv[:, 384:].reshape(B, S, 2, 64)
    o1 = torch.ops.mosaic.attention_prefill(q, k, v, causal=False)
    o2 = torch.ops.mosaic.attention_decode(q, k_pages, v_pages, lengths, table)
    return (o1 + o2).reshape(B, 256) * 2


def test_compile_fullgraph_without_graph_breaks():
  B = 3
  k_pages, table = paged(randn(B, 30, 2, 64), 16, 2)
  v_pages, _ = paged(randn(B, 30, 2, 64), 16, 2)
  lengths = torch.tensor([30, 11, 1], dtype=torch.int32)
  args = (randn(B, 128), randn(128), randn(128, 512, scale=0.1), k_pages, v_pages, lengths, table)
  graphs = []

  def backend(gm, example_inputs):
    graphs.append(gm)
    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

  m = _Block()
  compiled = torch.compile(m, backend=backend, fullgraph=True)
  with torch.no_grad():
    out = compiled(*args)
    ref = m(*args)
  assert len(graphs) == 1
  targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
  for name in ("rms_norm", "matmul", "attention_prefill", "attention_decode"):
    assert any(f"mosaic.{name}" in t for t in targets), targets
  assert_close(out, ref, torch.float32)


# --------------------------------------------------------------------------
# transformers: attn_implementation="mosaic"


class _Attn(torch.nn.Module):
  num_key_value_groups = 2
  is_causal = True


@pytest.mark.parametrize("sq,skv,stored", [(40, 40, "bhsd"), (40, 40, "bshd"), (1, 41, "bhsd"),
                                           (1, 41, "bshd")])
def test_transformers_attention_function(sq, skv, stored):
  """Both memory layouts transformers hands over, prefill and decode step."""
  B, Hq, Hkv, D = 2, 4, 2, 64
  mk = lambda h, s: (randn(B, h, s, D) if stored == "bhsd"
                     else randn(B, s, h, D).transpose(1, 2))
  q, k, v = mk(Hq, sq), mk(Hkv, skv), mk(Hkv, skv)
  out, weights = mt.transformers_attention(_Attn(), q, k, v, None, scaling=0.125)
  assert weights is None and out.shape == (B, sq, Hq, D)
  ref = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), sq > 1, 0.125)
  assert_close(out, ref, torch.float32)


def test_transformers_attention_static_cache_prefill_crops_unwritten_keys():
  q, k, v = randn(1, 4, 10, 64), randn(1, 2, 32, 64), randn(1, 2, 32, 64)
  k[:, :, 10:] = float("nan")  # unwritten cache slots must not be read
  out, _ = mt.transformers_attention(_Attn(), q, k, v, None)
  ref = ref_attention(*(t.transpose(1, 2) for t in (q, k[:, :, :10], v[:, :, :10])), True)
  assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)), "attention mask"),
    (dict(dropout=0.1), "dropout"),
    (dict(softcap=30.0), "soft-capping"),
    (dict(s_aux=torch.zeros(4)), "sinks"),
    (dict(output_attentions=True), "output_attentions"),
])
def test_transformers_attention_refusals(kwargs, match):
  q, k, v = randn(1, 4, 8, 64), randn(1, 2, 8, 64), randn(1, 2, 8, 64)
  kwargs.setdefault("attention_mask", None)
  with pytest.raises(ValueError, match=match):
    mt.transformers_attention(_Attn(), q, k, v, **kwargs)


def _tiny_llama(seed):
  from transformers import LlamaConfig, LlamaForCausalLM

  cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
  torch.manual_seed(seed)
  return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama_models():
  mt.register_transformers_attention()
  seed = testing._BASE_SEED + next(_counter)
  models = {}
  for impl in ("mosaic", "eager", "sdpa"):
    m = _tiny_llama(seed)
    m.config._attn_implementation = impl
    models[impl] = m
  sd = models["eager"].state_dict()
  for m in models.values():
    m.load_state_dict(sd)
  return models


def test_llama_logits_and_greedy_generation_match(llama_models, monkeypatch):
  calls = []
  run = mt._run
  monkeypatch.setattr(mt, "_run", lambda name, *a, **k: (calls.append(name), run(name, *a, **k))[1])
  ids = torch.randint(3, 256, (2, 19), generator=_gen())
  with torch.no_grad():
    logits = {impl: m(ids).logits for impl, m in llama_models.items()}
    assert calls.count("attention_prefill") == 2  # one per layer
    for impl in ("eager", "sdpa"):
      assert_close(logits["mosaic"], logits[impl], torch.float32, tol=1e-5, what=impl)
    gen = {impl: llama_models[impl].generate(ids[:1], max_new_tokens=8, do_sample=False,
                                             min_new_tokens=8)
           for impl in ("mosaic", "sdpa")}
  assert gen["mosaic"].shape == (1, 19 + 8)
  assert torch.equal(gen["mosaic"], gen["sdpa"])
  assert calls.count("attention_prefill") == 2 + 2 * 8  # prefill + 7 decode steps, 2 layers


def test_llama_padding_mask_is_refused_by_name(llama_models):
  ids = torch.randint(3, 256, (2, 6), generator=_gen())
  mask = torch.ones_like(ids)
  mask[1, :2] = 0  # left padding in the batch
  with torch.no_grad(), pytest.raises(ValueError, match="attention mask"):
    llama_models["mosaic"](ids, attention_mask=mask)
