"""Our ops from PyTorch: torch custom ops and a transformers attention backend.

Importing this module (it needs torch; nothing else in the project does)
defines four torch custom ops in the namespace ``mosaic``:

  torch.ops.mosaic.attention_prefill(q, k, v, causal, scale, sliding_window, layout, backend)
  torch.ops.mosaic.attention_decode(q, k_pages, v_pages, lengths, page_table, scale, backend)
  torch.ops.mosaic.matmul(a, b, bias, residual, out_dtype, activation, rms_eps, backend)
  torch.ops.mosaic.rms_norm(x, weight, eps, backend)

Each mirrors the jax op of the same name (kernels/<op>.py, through
mosaic.registry): the same shapes, dtypes and meaning. Each has a fake (meta)
implementation giving the exact output shape and dtype, so torch.compile
(fullgraph=True) traces a module that calls them. ``register_transformers_
attention()`` adds ``attn_implementation="mosaic"`` to transformers.

How a call flows. The torch tensors are handed to jax through DLPack (the
buffer is shared, not copied; a strided tensor is made contiguous first, one
copy). One jitted function per op and static arguments (``_jitted``) runs
the registry's op, so a call is one jax dispatch whose shapes jax's own
cache keys. Its outputs come back through DLPack, again without a copy. The
backend is resolved as the registry resolves it (``backend=``, then
``registry.use``, ``MOSAIC_BACKEND_<OP>``, the target's default order);
``reference`` is refused, since it returns float32 where the op promises its
input dtype. The ops are for inference: they have no autograd formula, and
torch refuses a backward through them.

Ordering on CUDA, without a host wait. A call is ordered as if its kernels
ran on torch's current stream S (the one current at the call):

1. Inputs: ``jax.dlpack.from_dlpack(t)`` calls ``t.__dlpack__(stream=J)``,
   J being the stream jax's GPU client names for external buffers
   (``Device.get_stream_for_external_ready_events()``). torch records an
   event on S and makes J wait for it (``cudaStreamWaitEvent``); jax records
   the imported buffer's definition event on J, and a jax computation waits
   for its inputs' definition events before it starts. So jax's kernels run
   after everything queued on S before the call.
2. Outputs: ``torch.utils.dlpack.from_dlpack(out)`` calls
   ``out.__dlpack__(stream=S)``; jax makes S wait for the output's ready
   event (PJRT's ``WaitUntilBufferReadyOnStream``; without a stream jax
   would block the host in ``AwaitBuffersReady`` instead, which is why the
   handshake passes one). So every op queued on S after the call sees the
   finished output.
3. Memory reuse follows from 1 and 2. An input torch frees after the call is
   reused by torch's allocator on S, after the wait of (2), so after jax's
   kernels have read it. An output buffer torch frees goes back to jax's
   allocator, and only a later jax computation can reuse it; through these
   ops that computation starts after all of S's work queued before it (1),
   the output's last readers included.

The guarantee is per stream, as for any torch kernel: a tensor made or used
on another stream needs the usual ``wait_stream`` / ``record_stream``. It
also assumes that jax's GPU work in the process comes through these ops (a
jax computation with no torch input is not ordered after S). Where jax's
client cannot name its stream (``get_stream_for_external_ready_events``
unimplemented) there is no event to wait on, and the inputs are handed over
after ``torch.cuda.current_stream().synchronize()`` instead: a host wait,
taken only on such a client and noted once in the log.

Why not ``plgpu.as_torch_kernel``: jax 0.11.2 has it
(jax._src.pallas.mosaic_gpu.torch). It lowers a function whose module must be
exactly one Mosaic GPU custom call plus int32 scalar constants, scalar
broadcasts and buffer allocations, compiles it with ``MosaicGpuCompile`` and
launches it with the torch tensors' pointers on
``torch.cuda.default_stream(device)``. Our ops wrap their kernels in XLA
work that it refuses ("Unsupported operation found in the kernel module"):
attention_prefill pads Q/K/V to its blocks and builds its plan (block ranges,
position vectors) in jnp, attention_decode packs the Q rows and merges the
split-K partials, matmul reduces split-K partials and rms_norm reshapes its
weight into a stack of one. And it launches on the default stream, not the
current one, so it is ordered only for code that never leaves the default
stream. The DLPack handshake above serves every op and any current stream.

On CPU tensors (a machine where jax has no GPU) the same path runs the jax
op on jax's CPU device: the registry's default there (``xla``), or
``backend="mosaic"`` for the kernels in Mosaic GPU interpret mode. CPU
tensors on a machine whose jax sees a GPU are refused (the kernels are
chosen for the GPU), as are tensors on other devices.

The transformers backend (``transformers_attention``) serves what
``sdpa`` serves without a mask: causal prefill (the mask function
registered beside it is transformers' own ``sdpa_mask``, which leaves the
mask out exactly when it is plain causal) and a decode step over a KV cache
(one query, every key visible: non-causal attention_prefill, whose queries
are the last Sq positions of the keys, so Sq != Skv is allowed). Anything
else raises a ValueError that says why (a padding mask, dropout, soft-capping,
attention sinks, a position bias, attention weights requested). Q/K/V come
in transformers' [B, H, S, D]; the op's ``layout="bhsd"`` reads them where
they lie (see ``_prefill_body``), so a decode step does not copy the cache.

Our ops' modules (kernels/) are loaded on first use (``_load_ops``), not
imported by this module: kernels sit above mosaic in the project's layering.
The top-level name ``kernels`` is also Hugging Face's ``kernels`` package,
which transformers 5 requires. Where that distribution is installed it keeps
the name (transformers imports from it), and our ops' modules are loaded
from this checkout under the name only while they register.
"""

import functools
import math
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any, Optional

# jax takes 75% of the card at its first GPU use unless told not to; torch
# shares the card here. (No effect where jax's GPU client already exists.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import torch

from mosaic import registry
from mosaic import target as target_lib

log = logging.getLogger("mosaic.torch")

Tensor = torch.Tensor

_KERNELS_DIR = pathlib.Path(__file__).resolve().parents[1] / "kernels"
_OPS = ("attention_prefill", "attention_decode", "matmul", "rms_norm")

# torch dtypes that cross DLPack to jax and back, by jnp name.
_FLOAT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
LAYOUTS = ("bshd", "bhsd")


# --------------------------------------------------------------------------
# Loading our op modules beside Hugging Face's ``kernels``


def _is_ours(module) -> bool:
  f = getattr(module, "__file__", None)
  return f is not None and pathlib.Path(f).resolve().parent == _KERNELS_DIR


def _foreign_kernels_installed() -> bool:
  """Whether a distribution named ``kernels`` is installed (ours is
  ``mosaic-serve``, so such a one is another project's: Hugging Face's)."""
  try:
    importlib.metadata.distribution("kernels")
  except importlib.metadata.PackageNotFoundError:
    return False
  return True


def _kernels_entries() -> dict[str, Any]:
  return {k: m for k, m in sys.modules.items() if k == "kernels" or k.startswith("kernels.")}


def _load_ops() -> None:
  """Imports our op modules, which registers the ops (see module docstring).
  Called on first use, not at import: kernels sit above mosaic in the
  project's layering, so this module imports none of them statically."""
  if all(name in registry.ops() for name in _OPS):
    return
  held = sys.modules.get("kernels")
  if (held is not None and _is_ours(held)) or (held is None and not _foreign_kernels_installed()):
    for name in _OPS:
      importlib.import_module(f"kernels.{name}")
    return
  if held is None:
    # Import theirs first, with this checkout hidden from sys.path, so that
    # the name is theirs for transformers whatever the import order.
    root = _KERNELS_DIR.parent
    path = sys.path[:]
    sys.path[:] = [p for p in path if pathlib.Path(p or ".").resolve() != root]
    try:
      importlib.import_module("kernels")
    finally:
      sys.path[:] = path
    if _is_ours(sys.modules["kernels"]):  # an installer's finder maps the name to ours
      for name in _OPS:
        importlib.import_module(f"kernels.{name}")
      return
  theirs = _kernels_entries()
  for k in theirs:
    del sys.modules[k]
  try:
    spec = importlib.util.spec_from_file_location(
        "kernels", _KERNELS_DIR / "__init__.py", submodule_search_locations=[str(_KERNELS_DIR)])
    ours = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = ours
    spec.loader.exec_module(ours)
    for name in _OPS:
      importlib.import_module(f"kernels.{name}")
  finally:
    for k in _kernels_entries():
      del sys.modules[k]
    sys.modules.update(theirs)


# --------------------------------------------------------------------------
# torch <-> jax


@functools.cache
def _jax_stream(device_index: int) -> int | None:
  """The stream jax's client on this CUDA device names for external buffers,
  or None where it names none (then inputs cross after a host wait)."""
  try:
    return _jax_device(device_index).get_stream_for_external_ready_events()
  except Exception as e:  # jax's JaxRuntimeError: UNIMPLEMENTED on some clients
    log.warning("jax's client on cuda:%d names no stream for external buffers (%s): torch "
                "inputs are handed over after a host wait on torch's current stream",
                device_index, e)
    return None


def _jax_device(device_index: int):
  for d in jax.devices():
    if d.platform == "gpu" and d.local_hardware_id == device_index:
      return d
  raise ValueError(f"jax sees no GPU with local hardware id {device_index}")


def to_jax(t: Tensor) -> jax.Array:
  """``t`` as a jax array on the same device, sharing its buffer (a strided
  ``t`` is made contiguous first: one copy). On CUDA, jax's work on it is
  ordered after the work queued on torch's current stream (module docstring)."""
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
  t = t.detach()
  if not t.is_contiguous():
    t = t.contiguous()
  if t.device.type == "cuda":
    with torch.cuda.device(t.device):
      if _jax_stream(t.device.index) is None:
        torch.cuda.current_stream().synchronize()
      return jax.dlpack.from_dlpack(t)
  return jax.dlpack.from_dlpack(t)


def to_torch(x: jax.Array) -> Tensor:
  """``x`` as a torch tensor sharing its buffer; on CUDA, torch's current
  stream waits for ``x`` (no host wait)."""
  return torch.utils.dlpack.from_dlpack(x)


def torch_op(op_name: str, backend: str | None = None) -> Callable[..., Any]:
  """The registered op ``op_name`` as a torch-in, torch-out function: tensor
  arguments cross by DLPack, keyword arguments go to the op as they are.
  (The custom ops below are the compiled-graph-friendly form of the same.)"""
  _load_ops()
  op = registry.get_op(op_name)

  def call(*args, **kwargs):
    args = [to_jax(t) if isinstance(t, torch.Tensor) else t for t in args]
    kwargs = {k: to_jax(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return jax.tree.map(to_torch, op(*args, backend=backend, **kwargs))

  call.__name__ = f"torch_{op_name}"
  return call


# --------------------------------------------------------------------------
# The jax side of each custom op: one jitted function per (op, backend,
# static arguments); its arrays arrive positionally, named by ``names``.


def _prefill_body(q, k, v, *, layout, backend, causal, sm_scale, sliding_window):
  """``layout="bhsd"`` (torch SDPA's and transformers' [B, H, S, D]) is served
  without a transpose, by reshapes that are free in memory: k/v
  [B, Hkv, Skv, D] are [B * Hkv, Skv, 1, D], and q [B, Hq, Sq, D], whose
  heads kv * G .. kv * G + G - 1 share kv head kv (G = Hq / Hkv), is
  [B * Hkv, G * Sq, 1, D]: the G heads' queries one after the other in one
  sequence. With a mask, the folded queries' positions (the last Sq of the
  keys, repeated G times) say which keys each one sees."""
  op = registry.get_op("attention_prefill")
  kw = dict(causal=causal, sm_scale=sm_scale, sliding_window=sliding_window)
  if layout == "bshd":
    return op(q, k, v, backend=backend, **kw)
  B, Hq, Sq, D = q.shape
  _, Hkv, Skv, _ = k.shape
  G = Hq // Hkv
  qf = q.reshape(B * Hkv, G * Sq, 1, D)
  kf = k.reshape(B * Hkv, Skv, 1, D)
  vf = v.reshape(B * Hkv, Skv, 1, D)
  if causal or sliding_window is not None:
    pos = jnp.tile(jnp.arange(Sq, dtype=jnp.int32) + (Skv - Sq), G)
    kw["q_positions"] = jnp.broadcast_to(pos, (B * Hkv, G * Sq))
  return op(qf, kf, vf, backend=backend, **kw).reshape(B, Hq, Sq, D)


def _decode_body(q, k_pages, v_pages, lengths, page_table, *, backend, sm_scale):
  return registry.get_op("attention_decode")(q, k_pages, v_pages, lengths, page_table,
                                             sm_scale=sm_scale, backend=backend)


def _matmul_body(*arrays, names, backend, out_dtype, activation, rms_eps):
  args = dict(zip(names, arrays))
  return registry.get_op("matmul")(args.pop("a"), args.pop("b"), backend=backend,
                                   out_dtype=out_dtype, activation=activation,
                                   rms_eps=rms_eps, **args)


def _rms_norm_body(x, weight, *, backend, eps):
  return registry.get_op("rms_norm")(x, weight, eps=eps, backend=backend)


_BODIES = {"attention_prefill": _prefill_body, "attention_decode": _decode_body,
           "matmul": _matmul_body, "rms_norm": _rms_norm_body}


@functools.cache
def _jitted(op_name: str, backend: str | None, static: tuple) -> Callable[..., Any]:
  return jax.jit(functools.partial(_BODIES[op_name], backend=backend, **dict(static)))


def _device_of(op_name: str, tensors: dict[str, Tensor]) -> torch.device:
  devices = {t.device for t in tensors.values()}
  if len(devices) != 1:
    raise ValueError(f"mosaic.{op_name}: all tensors must be on one device, got "
                     + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))
  (dev,) = devices
  if dev.type not in ("cuda", "cpu"):
    raise ValueError(f"mosaic.{op_name}: tensors on {dev} are not supported (cuda or cpu)")
  return dev


def _run(op_name: str, tensors: dict[str, Tensor], backend: str | None, static: dict,
         expect: tuple[tuple, torch.dtype]) -> Tensor:
  """Runs the jax side of ``op_name`` on ``tensors`` (in the body's order)."""
  _load_ops()
  dev = _device_of(op_name, tensors)
  on_gpu = target_lib.on_gpu()
  if dev.type == "cuda" and not on_gpu:
    raise ValueError(f"mosaic.{op_name}: the tensors are on {dev} but jax sees no GPU "
                     f"(jax devices: {jax.devices()}); install jax with CUDA")
  if dev.type == "cpu" and on_gpu:
    raise ValueError(f"mosaic.{op_name}: the tensors are on the CPU but jax's kernels are "
                     f"chosen for {target_lib.current().name}; move them to CUDA")
  if math.prod(expect[0]) == 0:  # (what the fake promised: nothing to compute)
    return torch.empty(expect[0], dtype=expect[1], device=dev)
  impl = registry.get_op(op_name).explicit_choice(backend)
  if ((impl or "").startswith("mosaic") and dev.type == "cpu" and op_name != "rms_norm"
      and tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)):
    raise ValueError(f"mosaic.{op_name}: backend='mosaic' on CPU tensors runs the kernel in "
                     f"Pallas' interpreter, which needs jax >= 0.11 (this is {jax.__version__}); "
                     "use backend='xla' or CUDA tensors")
  if impl == "reference":
    raise ValueError(f"mosaic.{op_name}: backend 'reference' returns float32 (the op's meaning, "
                     f"for tests); the torch op promises {expect[1]}: pick another backend")
  fn = _jitted(op_name, impl, tuple(sorted(static.items())))
  out = to_torch(fn(*(to_jax(t) for t in tensors.values())))
  if tuple(out.shape) != tuple(expect[0]) or out.dtype != expect[1]:
    raise ValueError(f"mosaic.{op_name}: backend {impl!r} returned {out.dtype} "
                     f"{tuple(out.shape)}; the op promises {expect[1]} {tuple(expect[0])}")
  return out


def _backend_arg(op_name: str, backend: Optional[str]) -> None:
  if backend is not None:
    _load_ops()
    registry.get_op(op_name).get(backend)  # an unknown name fails here, listing the valid ones


def _one_device(op_name: str, **tensors: Tensor | None) -> None:
  """The fakes' check too: a meta tensor beside a CPU one makes torch run the
  fake, whose output (empty memory) would be the result."""
  given = {n: t for n, t in tensors.items() if t is not None}
  if len({t.device for t in given.values()}) > 1:
    raise ValueError(f"mosaic.{op_name}: all tensors must be on one device, got "
                     + ", ".join(f"{n} on {t.device}" for n, t in given.items()))


def _float_dtype(op_name: str, what: str, t: Tensor) -> None:
  if t.dtype not in _FLOAT_DTYPES:
    raise ValueError(f"mosaic.{op_name}: {what}.dtype={t.dtype} is not supported "
                     f"(bfloat16, float16, float32)")


def _int32(op_name: str, what: str, t: Tensor) -> None:
  if t.dtype != torch.int32:
    raise ValueError(f"mosaic.{op_name}: {what} must be int32, got {t.dtype}")


# --------------------------------------------------------------------------
# attention_prefill


def _prefill_meta(q, k, v, causal, scale, sliding_window, layout, backend):
  """Checks a call (shapes, dtypes, arguments) and returns its output (shape, dtype)."""
  op = "attention_prefill"
  _backend_arg(op, backend)
  _one_device(op, q=q, k=k, v=v)
  if layout not in LAYOUTS:
    raise ValueError(f"mosaic.{op}: layout={layout!r} must be one of {LAYOUTS} "
                     "(bshd: [B, S, H, D], the jax op's; bhsd: [B, H, S, D], torch SDPA's)")
  for name, t in (("q", q), ("k", k), ("v", v)):
    if t.dim() != 4:
      raise ValueError(f"mosaic.{op}: {name} must be 4D ({layout}), got {tuple(t.shape)}")
  if tuple(k.shape) != tuple(v.shape):
    raise ValueError(f"mosaic.{op}: k and v must have one shape, got {tuple(k.shape)} and "
                     f"{tuple(v.shape)}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"mosaic.{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                     f"{v.dtype}")
  _float_dtype(op, "q", q)
  if layout == "bshd":
    (B, Sq, Hq, D), (Bk, Skv, Hkv, Dk) = q.shape, k.shape
  else:
    (B, Hq, Sq, D), (Bk, Hkv, Skv, Dk) = q.shape, k.shape
  if Bk != B or Dk != D:
    raise ValueError(f"mosaic.{op}: k's batch and head dim must match q's: q {tuple(q.shape)}, "
                     f"k {tuple(k.shape)} ({layout})")
  if Hq % Hkv:
    raise ValueError(f"mosaic.{op}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
  if causal and Sq > Skv:
    # (the queries are the last Sq positions of the keys: the first Sq - Skv
    # would see none; SDPA's is_causal aligns the first query with the first key)
    raise ValueError(f"mosaic.{op}: causal with more queries ({Sq}) than keys ({Skv}): the "
                     "queries are the last Sq positions of the keys")
  if scale is not None and not scale > 0:
    raise ValueError(f"mosaic.{op}: scale={scale} must be positive (None: head_dim ** -0.5)")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"mosaic.{op}: sliding_window={sliding_window} must be >= 1 or None")
  return tuple(q.shape), q.dtype


@torch.library.custom_op("mosaic::attention_prefill", mutates_args=())
def attention_prefill(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                      scale: Optional[float] = None, sliding_window: Optional[int] = None,
                      layout: str = "bshd", backend: Optional[str] = None) -> Tensor:
  """softmax(q k^T * scale + mask) v with GQA (query head h reads kv head
  h // (Hq // Hkv)); the queries are the last Sq positions of the Skv keys
  (a cached prefix plus themselves). ``layout``: "bshd" (q [B, Sq, Hq, D],
  k/v [B, Skv, Hkv, D]) or "bhsd" ([B, H, S, D]); the output has q's
  shape, layout and dtype. ``scale``: None is head_dim ** -0.5.
  ``sliding_window``: query i sees key j only if pos_i - pos_j < window."""
  expect = _prefill_meta(q, k, v, causal, scale, sliding_window, layout, backend)
  static = dict(layout=layout, causal=bool(causal),
                sm_scale=None if scale is None else float(scale),
                sliding_window=None if sliding_window is None else int(sliding_window))
  return _run("attention_prefill", dict(q=q, k=k, v=v), backend, static, expect)


@attention_prefill.register_fake
def _(q, k, v, causal=True, scale=None, sliding_window=None, layout="bshd", backend=None):
  shape, dtype = _prefill_meta(q, k, v, causal, scale, sliding_window, layout, backend)
  return q.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------
# attention_decode


def _decode_meta(q, k_pages, v_pages, lengths, page_table, scale, backend):
  op = "attention_decode"
  _backend_arg(op, backend)
  _one_device(op, q=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths, page_table=page_table)
  if q.dim() != 4:
    raise ValueError(f"mosaic.{op}: q must be [B, Tq, Hq, D], got {tuple(q.shape)}")
  if k_pages.dim() != 4:
    raise ValueError(f"mosaic.{op}: k_pages must be [Hkv, num_pages, page_size, D], got "
                     f"{tuple(k_pages.shape)} (the layer stack of the jax op is not served here)")
  if tuple(v_pages.shape) != tuple(k_pages.shape):
    raise ValueError(f"mosaic.{op}: v_pages {tuple(v_pages.shape)} must have k_pages' shape "
                     f"{tuple(k_pages.shape)}")
  if not (q.dtype == k_pages.dtype == v_pages.dtype):
    raise ValueError(f"mosaic.{op}: q, k_pages, v_pages must share a dtype, got {q.dtype}, "
                     f"{k_pages.dtype}, {v_pages.dtype} (fp8 pages do not cross DLPack)")
  _float_dtype(op, "q", q)
  B, Tq, Hq, D = q.shape
  Hkv, _, _, Dk = k_pages.shape
  if Dk != D:
    raise ValueError(f"mosaic.{op}: head dims differ: q {tuple(q.shape)}, k_pages "
                     f"{tuple(k_pages.shape)}")
  if Hq % Hkv:
    raise ValueError(f"mosaic.{op}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
  _int32(op, "lengths", lengths)
  _int32(op, "page_table", page_table)
  if tuple(lengths.shape) != (B,):
    raise ValueError(f"mosaic.{op}: lengths must be [{B}], got {tuple(lengths.shape)}")
  if page_table.dim() != 2 or page_table.shape[0] != B:
    raise ValueError(f"mosaic.{op}: page_table must be [{B}, max_pages], got "
                     f"{tuple(page_table.shape)}")
  if scale is not None and not scale > 0:
    raise ValueError(f"mosaic.{op}: scale={scale} must be positive (None: head_dim ** -0.5)")
  return tuple(q.shape), q.dtype


@torch.library.custom_op("mosaic::attention_decode", mutates_args=())
def attention_decode(q: Tensor, k_pages: Tensor, v_pages: Tensor, lengths: Tensor,
                     page_table: Tensor, scale: Optional[float] = None,
                     backend: Optional[str] = None) -> Tensor:
  """Decode attention over a paged KV cache: q [B, Tq, Hq, D] (Tq <= 8),
  k_pages/v_pages [Hkv, num_pages, page_size, D], lengths int32 [B] (tokens
  cached, the Tq new ones included), page_table int32 [B, max_pages]. Query
  t of sequence b sits at position lengths[b] - Tq + t and sees every cached
  token at or before it. Returns [B, Tq, Hq, D] in q's dtype."""
  expect = _decode_meta(q, k_pages, v_pages, lengths, page_table, scale, backend)
  if lengths.device.type == "cpu" and lengths.numel():  # (on CUDA, reading them is a sync)
    pages = k_pages.shape[1]
    if int(lengths.min()) < 0:
      raise ValueError(f"mosaic.attention_decode: lengths must be >= 0, got {lengths.tolist()}")
    if page_table.numel() and not (0 <= int(page_table.min()) and
                                   int(page_table.max()) < pages):
      raise ValueError(f"mosaic.attention_decode: page_table entries must be in [0, {pages}), "
                       f"got [{int(page_table.min())}, {int(page_table.max())}]")
  static = dict(sm_scale=None if scale is None else float(scale))
  return _run("attention_decode", dict(q=q, k_pages=k_pages, v_pages=v_pages, lengths=lengths,
                                       page_table=page_table), backend, static, expect)


@attention_decode.register_fake
def _(q, k_pages, v_pages, lengths, page_table, scale=None, backend=None):
  shape, dtype = _decode_meta(q, k_pages, v_pages, lengths, page_table, scale, backend)
  return q.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------
# matmul


ACTIVATIONS = (None, "swiglu")


def _matmul_meta(a, b, bias, residual, out_dtype, activation, rms_eps, backend):
  op = "matmul"
  _backend_arg(op, backend)
  _one_device(op, a=a, b=b, bias=bias, residual=residual)
  if a.dim() != 2 or b.dim() != 2:
    raise ValueError(f"mosaic.{op}: a must be [M, K] and b [K, N], got {tuple(a.shape)} and "
                     f"{tuple(b.shape)} (the layer stack of the jax op is not served here)")
  M, K = a.shape
  K2, N = b.shape
  if K != K2:
    raise ValueError(f"mosaic.{op}: contracting dims differ: a {tuple(a.shape)}, b "
                     f"{tuple(b.shape)}")
  _float_dtype(op, "a", a)
  _float_dtype(op, "b", b)
  if activation not in ACTIVATIONS:
    raise ValueError(f"mosaic.{op}: activation={activation!r} must be one of {ACTIVATIONS}")
  out_n = N // 2 if activation == "swiglu" else N
  if bias is not None:
    _float_dtype(op, "bias", bias)
    if tuple(bias.shape) != (N,):
      raise ValueError(f"mosaic.{op}: bias must be [N]=[{N}], got {tuple(bias.shape)}")
  out = a.dtype if out_dtype is None else out_dtype
  if out not in _FLOAT_DTYPES:
    raise ValueError(f"mosaic.{op}: out_dtype={out} is not supported (bfloat16, float16, "
                     "float32)")
  if residual is not None:
    if tuple(residual.shape) != (M, out_n):
      raise ValueError(f"mosaic.{op}: residual must be [{M}, {out_n}], got "
                       f"{tuple(residual.shape)}")
    if residual.dtype != out:
      raise ValueError(f"mosaic.{op}: residual.dtype={residual.dtype} must be the output dtype "
                       f"{out}")
  if rms_eps is not None and not rms_eps >= 0:
    raise ValueError(f"mosaic.{op}: rms_eps={rms_eps} must be >= 0 or None")
  return (M, out_n), out


@torch.library.custom_op("mosaic::matmul", mutates_args=())
def matmul(a: Tensor, b: Tensor, bias: Optional[Tensor] = None,
           residual: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
           activation: Optional[str] = None, rms_eps: Optional[float] = None,
           backend: Optional[str] = None) -> Tensor:
  """act(a @ b (+ bias)) (+ residual), float32 accumulation. a [M, K], b
  [K, N] (weights stored [in, out]); out_dtype defaults to a's.
  ``activation="swiglu"``: b's columns are [gate | up] blocks
  (kernels.matmul.swiglu_columns) and the output is [M, N / 2].
  ``rms_eps``: a's rows are RMS-normalized first (the norm's weight folded
  into b's rows)."""
  expect = _matmul_meta(a, b, bias, residual, out_dtype, activation, rms_eps, backend)
  tensors = {n: t for n, t in (("a", a), ("b", b), ("bias", bias), ("residual", residual))
             if t is not None}
  static = dict(names=tuple(tensors), out_dtype=_FLOAT_DTYPES[expect[1]], activation=activation,
                rms_eps=None if rms_eps is None else float(rms_eps))
  return _run("matmul", tensors, backend, static, expect)


@matmul.register_fake
def _(a, b, bias=None, residual=None, out_dtype=None, activation=None, rms_eps=None,
      backend=None):
  shape, dtype = _matmul_meta(a, b, bias, residual, out_dtype, activation, rms_eps, backend)
  return a.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------
# rms_norm


def _rms_norm_meta(x, weight, eps, backend):
  op = "rms_norm"
  _backend_arg(op, backend)
  _one_device(op, x=x, weight=weight)
  if x.dim() < 1:
    raise ValueError(f"mosaic.{op}: x needs a feature axis, got shape {tuple(x.shape)}")
  if tuple(weight.shape) != (x.shape[-1],):
    raise ValueError(f"mosaic.{op}: weight must be [{x.shape[-1]}] to match x "
                     f"{tuple(x.shape)}, got {tuple(weight.shape)}")
  _float_dtype(op, "x", x)
  _float_dtype(op, "weight", weight)
  if not eps >= 0:
    raise ValueError(f"mosaic.{op}: eps={eps} must be >= 0")
  return tuple(x.shape), x.dtype


@torch.library.custom_op("mosaic::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6,
             backend: Optional[str] = None) -> Tensor:
  """x * rsqrt(mean(x^2, -1) + eps) * weight, float32 math; x's shape and dtype."""
  expect = _rms_norm_meta(x, weight, eps, backend)
  return _run("rms_norm", dict(x=x, weight=weight), backend, dict(eps=float(eps)), expect)


@rms_norm.register_fake
def _(x, weight, eps=1e-6, backend=None):
  shape, dtype = _rms_norm_meta(x, weight, eps, backend)
  return x.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------
# transformers: attn_implementation="mosaic"

NAME = "mosaic"


def _why_not_served(module, query, key, value, attention_mask, dropout, kwargs) -> str | None:
  if attention_mask is not None:
    return ("the call has an attention mask (padding in the batch, packed sequences, a sliding "
            "window shorter than the keys, a chunked prefill or a custom mask); mosaic serves "
            "causal attention with no mask and decode steps over an unpadded cache")
  if dropout:
    return f"dropout={dropout} (training) is not supported"
  if kwargs.get("softcap") is not None:
    return f"logit soft-capping (softcap={kwargs['softcap']}) is not supported"
  if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
    return "attention sinks are not supported"
  if kwargs.get("position_bias") is not None:
    return "an additive position bias is not supported"
  if kwargs.get("output_attentions"):
    return "output_attentions=True: the kernel never forms the attention weights"
  if key.shape[-1] != value.shape[-1]:
    return f"key and value head dims differ ({key.shape[-1]} and {value.shape[-1]})"
  groups = getattr(module, "num_key_value_groups", None)
  if groups is not None and query.shape[1] != key.shape[1] * groups:
    return (f"query heads ({query.shape[1]}) != kv heads ({key.shape[1]}) x "
            f"num_key_value_groups ({groups})")
  return None


def _copied(ts, layout_of) -> int:
  return sum(t.numel() for t in ts if not layout_of(t).is_contiguous())


def transformers_attention(module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Optional[Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           **kwargs) -> tuple[Tensor, None]:
  """transformers' attention function signature: query [B, Hq, Sq, D],
  key/value [B, Hkv, Skv, D] (GQA without repeat_kv); returns
  ([B, Sq, Hq, D], None) as sdpa_attention_forward does."""
  why = _why_not_served(module, query, key, value, attention_mask, dropout, kwargs)
  if why is not None:
    raise ValueError(f"attn_implementation='mosaic' cannot serve this call: {why}. Load the "
                     "model with attn_implementation='sdpa' for it.")
  # A ``sliding_window`` kwarg needs nothing here: with a window,
  # transformers leaves the mask out only while the keys are fewer than the
  # window, where it hides nothing.
  is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
  sq, skv = query.shape[2], key.shape[2]
  causal = bool(is_causal) and sq > 1
  if causal and skv > sq:
    # transformers leaves the mask out here only for a prefill into an empty
    # static cache, whose keys past Sq are unwritten slots (sdpa crops them too).
    key, value = key[:, :, :sq], value[:, :, :sq]
  # Read Q/K/V where they lie: [B, H, S, D] as is, or [B, S, H, D] through a
  # transposed view; whichever copies fewer elements to make them contiguous.
  qkv = (query, key, value)
  bhsd = _copied(qkv, lambda t: t) <= _copied(qkv, lambda t: t.transpose(1, 2))
  if bhsd:
    out = torch.ops.mosaic.attention_prefill(query, key, value, causal, scaling, None, "bhsd")
    return out.transpose(1, 2), None
  q, k, v = (t.transpose(1, 2) for t in qkv)
  return torch.ops.mosaic.attention_prefill(q, k, v, causal, scaling, None, "bshd"), None


def register_transformers_attention() -> None:
  """Registers ``attn_implementation="mosaic"`` in transformers: this
  module's ``transformers_attention``, with transformers' ``sdpa_mask`` as its
  mask function (the mask is left out exactly when it is plain causal)."""
  _load_ops()  # (first: transformers' import of HF's `kernels` must not find ours)
  from transformers import AttentionInterface
  from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

  AttentionInterface.register(NAME, transformers_attention)
  AttentionMaskInterface.register(NAME, sdpa_mask)
