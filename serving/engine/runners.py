"""Model runners: what the batching engine calls to run one step.

A runner owns the KV cache and exposes ``prefill(tokens[B, T], positions[B],
lengths[B], page_table[B, P]) -> logits[B, V]`` and ``decode(tokens[B],
lengths[B], page_table[B, P]) -> logits[B, V]`` on host (numpy) inputs,
returning device logits. ``ModelRunner`` over a models.Model also has
``decode_multi``: several decode steps in one device call, each sampling on
the device (serving.engine.sampling.step) and feeding its token to the next
(step i at lengths + i), so that the host dispatches once for several tokens,
and ``mixed``: a decode batch and prefill chunks in one call (one pass over
the weights). ``ModelRunner`` wraps anything with the ``models``
API (models.Model, or the toy model); ``CountingRunner`` is a model whose
next token is the previous token + 1, so the service's output is known.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import sampling


def _has_backend(op: str, name: str) -> bool:
  try:
    import kernels
    from mosaic import registry

    kernels.load_all()
    return name in registry.get_op(op).names
  except Exception:  # noqa: BLE001 - unknown: let the model decide and report
    return True


# Mosaic GPU kernels take only 256-byte-aligned buffers, and where a step
# slices its packed host array contiguously (one row, or one row of a stack),
# XLA hands the slice to a kernel as a view into that array: each field of a
# packed host array therefore starts on a 256-byte boundary. (Fields packed
# back to back gave the decode kernel its page table at byte offset 8 for a
# one-row step: "Input buffer 1 is not 256-byte aligned".)
_ALIGN = 64  # int32 columns in 256 bytes


def _aligned(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


def _side_by_side(*cols) -> np.ndarray:
  """Host int arrays with one leading dim as one int32 array [B, ...]: one
  transfer instead of one each (back to back with a running step each one
  cost the dispatching thread 0.3-0.6 ms on the H200,
  bench/results/decode_merge_pack_h200/). Every field but the last is padded
  to a multiple of _ALIGN columns; ``_fields`` splits them again in a step."""
  b = len(cols[0])
  parts = [np.asarray(c, np.int32).reshape(b, -1) for c in cols]
  parts = [np.pad(x, ((0, 0), (0, _aligned(x.shape[1]) - x.shape[1]))) for x in parts[:-1]]
  return np.concatenate(parts + [np.asarray(cols[-1], np.int32).reshape(b, -1)], axis=1)


def _fields(host, *widths):
  """``_side_by_side`` inverted in a step: the fields of ``widths`` columns
  (width 1: a vector [B]), then the last field (the rest)."""
  out, at = [], 0
  for w in widths:
    out.append(host[:, at] if w == 1 else host[:, at:at + w])
    at += _aligned(w)
  return out + [host[:, at:]]


def _stacked(*rows) -> np.ndarray:
  """Equal-length host int vectors as one int32 array [k, aligned length]
  whose rows start on 256-byte boundaries; a step takes ``[:, :n]``."""
  n = len(rows[0])
  return np.stack([np.pad(np.asarray(r, np.int32), (0, _aligned(n) - n)) for r in rows])


# A packed decode row: slot, length, the row of SamplingArrays.rows, then the
# page table row (P columns).
_ROW_COLS = sampling.I_COLS + sampling.F_COLS


def pack_decode_inputs(slots, lengths, page_table, arrays: sampling.SamplingArrays) -> np.ndarray:
  """A decode call's host inputs side by side in one int32 array."""
  return _side_by_side(slots, lengths, arrays.rows, page_table)


def _unpack_decode_inputs(host):
  """pack_decode_inputs, inverted on the device: (slots, lengths, page table, arrays)."""
  slots, lengths, rows, table = _fields(host, 1, 1, _ROW_COLS)
  return slots, lengths, table, sampling.SamplingArrays(rows=rows)


class ModelRunner:

  def __init__(self, model, *, num_pages: int, page_size: int, attention: str | None = None,
               decode_attention: str | None = None, matmul: str | None = None,
               kv_cache_dtype: str | None = None):
    """``kv_cache_dtype``: the KV cache's dtype (default the model's;
    "float8_e4m3fn" halves its bytes, models.Model only)."""
    self.model = model
    cfg = model.config
    self.name = getattr(cfg, "name", type(model).__name__)
    self.vocab_size = int(cfg.vocab_size)
    self.max_context = int(cfg.max_position_embeddings)
    self.tokenizer = model.tokenizer
    self.page_size = page_size
    self.num_pages = num_pages
    kw = {} if kv_cache_dtype is None else {"dtype": kv_cache_dtype}
    if kw and "dtype" not in inspect.signature(model.init_cache).parameters:
      raise ValueError(f"{type(model).__name__} has no KV cache dtype option "
                       f"(asked for {kv_cache_dtype})")
    try:
      self.cache = model.init_cache(num_pages, page_size=page_size, **kw)
    except jax.errors.JaxRuntimeError as e:  # (a traceback naming no flag)
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      shapes = jax.eval_shape(lambda: model.init_cache(num_pages, page_size=page_size, **kw))
      size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
      raise ValueError(f"num_pages={num_pages}: a KV cache of {size / 2**30:.1f} GiB does not "
                       "fit in the device's memory; give fewer pages") from None
    self.kv_cache_dtype = str(self.cache.k.dtype)
    self.dtype = str(jnp.dtype(getattr(model, "dtype", self.cache.k.dtype)))  # the weights'

    # Backend names of models.Model: prefill's ``attention`` is attention_prefill,
    # decode's is attention_decode. A prefill-only name (cudnn) leaves decode on
    # its default order unless decode_attention says otherwise.
    if decode_attention is None and attention is not None:
      decode_attention = attention if _has_backend("attention_decode", attention) else None
    self._pkw = {k: v for k, v in (("attention", attention), ("matmul", matmul)) if v}
    self._dkw = {k: v for k, v in (("attention", decode_attention), ("matmul", matmul)) if v}
    self.backends = {k: v for k, v in (("attention_prefill", attention),
                                       ("attention_decode", decode_attention),
                                       ("matmul", matmul)) if v}

    self._fast = self._direct_steps(attention, decode_attention, matmul)
    # Where the engine keeps its sampling state: replicated over a
    # tensor-parallel model's mesh (where the steps' logits are), else anywhere.
    mesh = getattr(model, "mesh", None)
    self.state_sharding = None if mesh is None else jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())
    self.tensor_parallel_size = getattr(model, "tensor_parallel_size", 1)

  def _direct_steps(self, attention, decode_attention, matmul):
    """The jitted steps of models.llama with the graph definition closed over.

    models.Model.prefill/decode re-validate, re-pad and hash the static graph
    definition on every call, which costs host time each step; the engine's
    shapes are already bucketed and checked, so a models.Model is driven through
    its jitted steps directly. Anything else goes through the documented API.
    """
    try:
      from models import jitted
      from models.model import Model
    except ImportError:
      return None
    if not isinstance(self.model, Model):
      return None
    graphdef = self.model.graphdef
    mesh = self.model.mesh  # tensor parallelism: each step runs per shard (shard_map)
    pb = jitted.backends(attention_prefill=attention, matmul=matmul)
    db = jitted.backends(attention_decode=decode_attention, matmul=matmul)
    has_fresh = "fresh" in inspect.signature(jitted.prefill_step).parameters

    # Each step's host ints come side by side in as few arrays as their
    # leading dims allow (_side_by_side), split again here: a chunk row is
    # [tokens (chunk) | position | length | page table].
    def chunk_rows(host, chunk):
      return _fields(host, chunk, 1, 1)

    @functools.partial(jax.jit, static_argnames=("chunk", "fresh"), donate_argnums=(1,))
    def prefill(params, cache, host, chunk, fresh=False):
      kw = {"fresh": fresh} if has_fresh else {}
      return jitted.prefill_step(graphdef, params, cache, *chunk_rows(host, chunk), backends=pb,
                                mesh=mesh, **kw)

    @functools.partial(jax.jit, static_argnames=("n", "fresh"), donate_argnums=(1,))
    def prefill_packed(params, cache, tokens_pos_seg, last_table, n, fresh=True):
      tokens, tpos, seg = tokens_pos_seg[:, :n]
      return jitted.prefill_packed_step(graphdef, params, cache, tokens, tpos, seg,
                                       *_fields(last_table, 1), backends=pb, fresh=fresh,
                                       mesh=mesh)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def decode(params, cache, last, host):
      # host: [slot | length | page table]; row r's input is its slot's last token.
      slots, lengths, table = _fields(host, 1, 1)
      tokens = sampling.take(last, slots)
      logits, cache = jitted.decode_step(graphdef, params, cache, tokens[:, None], lengths,
                                        table, backends=db, mesh=mesh)
      return logits[:, 0], cache

    @functools.partial(jax.jit, donate_argnums=(1, 3, 5),
                       static_argnames=("steps", "greedy_only", "logprobs"))
    def decode_multi(params, cache, host, counts, slot_tokens, last, steps, greedy_only,
                     logprobs):
      slots, lengths, page_table, arrays = _unpack_decode_inputs(host)
      tokens = sampling.take(last, slots)  # each row's input: its slot's last token

      def one(carry, i):
        cache, tok, counts, last = carry
        # Padding rows (length 0) stay at 0: they write nothing.
        logits, cache = jitted.decode_step(graphdef, params, cache, tok[:, None],
                                          jnp.where(lengths > 0, lengths + i, 0), page_table,
                                          backends=db, mesh=mesh)
        out = sampling.step(logits[:, 0], arrays, i, counts, slot_tokens, last,
                            greedy_only=greedy_only, logprobs=logprobs)
        return (cache, out[0], out[4], out[5]), out[:4]

      (cache, _, counts, last), outs = jax.lax.scan(
          one, (cache, tokens, counts, last), jnp.arange(steps, dtype=jnp.int32))
      return outs + (counts, last), cache

    mb = jitted.backends(attention_prefill=attention, attention_decode=decode_attention,
                        matmul=matmul)

    @functools.partial(jax.jit, static_argnames=("chunk", "fresh"), donate_argnums=(1,))
    def mixed(params, cache, last, dec_host, host, chunk, fresh=False):
      slots, dec_lengths, dec_table = _fields(dec_host, 1, 1)
      return jitted.mixed_step(graphdef, params, cache, sampling.take(last, slots), dec_lengths,
                              dec_table, *chunk_rows(host, chunk), backends=mb, fresh=fresh,
                              mesh=mesh)

    @functools.partial(jax.jit, static_argnames=("n", "fresh"), donate_argnums=(1,))
    def mixed_packed(params, cache, last, dec_host, tokens_pos_seg, last_table, n, fresh=False):
      tokens, tpos, seg = tokens_pos_seg[:, :n]
      slots, dec_lengths, dec_table = _fields(dec_host, 1, 1)
      return jitted.mixed_packed_step(graphdef, params, cache, sampling.take(last, slots),
                                     dec_lengths, dec_table, tokens, tpos, seg,
                                     *_fields(last_table, 1), backends=mb, fresh=fresh,
                                     mesh=mesh)

    @functools.partial(jax.jit, static_argnames=("chunk", "fresh"), donate_argnums=(1,))
    def prefill_scores(params, cache, host, targets, chunk, fresh=False):
      kw = {"fresh": fresh} if has_fresh else {}
      tokens, positions, lengths, table = chunk_rows(host, chunk)
      logits, cache = jitted.prefill_step(graphdef, params, cache, tokens, positions, lengths,
                                         table, backends=pb, mesh=mesh, all_logits=True, **kw)
      last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
      return (last[:, 0],) + sampling.prompt_scores(logits, targets), cache

    # A speculative checking call: every position's logits of each row's
    # [last token, drafts]; the engine's sampling.verify reads them.
    @functools.partial(jax.jit, static_argnames=("chunk", "width"), donate_argnums=(1,))
    def check_prefill(params, cache, host, chunk, width):
      logits, cache = jitted.prefill_step(graphdef, params, cache, *chunk_rows(host, chunk),
                                         backends=pb, mesh=mesh, all_logits=True)
      return logits[:, :width], cache  # the chunk bucket's padding is never a row's

    @functools.partial(jax.jit, static_argnames=("tq",), donate_argnums=(1,))
    def check_decode(params, cache, host, tq):
      # host: [tokens (tq) | length | page table]; the tokens sit at positions
      # length - tq ... length - 1.
      return jitted.decode_step(graphdef, params, cache, *_fields(host, tq, 1), backends=db,
                               mesh=mesh)

    return (prefill, decode, decode_multi, mixed, prefill_packed, prefill_scores, check_prefill,
            check_decode, mixed_packed)

  def prefill(self, tokens, positions, lengths, page_table):
    if self._fast is not None:
      # A fresh batch (every row starts at position 0) attends within the chunk only.
      logits, self.cache = self._fast[0](
          self.model.params, self.cache, _side_by_side(tokens, positions, lengths, page_table),
          chunk=tokens.shape[1], fresh=not np.any(positions))
      return logits
    logits, self.cache = self.model.prefill(self.cache, tokens, positions, lengths, page_table,
                                            **self._pkw)
    return logits

  def decode(self, tokens, lengths, page_table):
    if self._fast is not None:
      return self.decode_slots(tokens, np.arange(len(lengths), dtype=np.int32), lengths,
                               page_table)
    logits, self.cache = self.model.decode(self.cache, tokens, lengths, page_table, **self._dkw)
    return logits

  def decode_slots(self, last, slots, lengths, page_table):
    """``decode`` with row r's input token ``last[slots[r]]`` (slot -1: a
    padding row): the engine's last sampled tokens stay on the device, and
    the gather runs in the step's own call."""
    if self._fast is None:
      return self.decode(sampling.take(last, slots), lengths, page_table)
    logits, self.cache = self._fast[1](self.model.params, self.cache, last,
                                       _side_by_side(slots, lengths, page_table))
    return logits

  @property
  def supports_multi_step(self) -> bool:
    return self._fast is not None

  @property
  def compiles_ahead(self) -> bool:
    """Whether ``compiling_in`` can compile the steps without running them."""
    return self._fast is not None

  @contextlib.contextmanager
  def compiling_in(self, pool):
    """Inside, a step runs nothing: it is lowered on the calling thread and
    compiled on ``pool``, and returns zeros of its outputs' shapes and the
    cache it was given. Yields the compiles' futures. A later call with the
    same shapes finds the executable in jax's caches and compiles nothing."""
    fast, futures = self._fast, []

    def compile_only(step):
      def call(params, cache, *args, **kwargs):
        lowered = step.lower(params, cache, *args, **kwargs)
        futures.append(pool.submit(lowered.compile))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding),
                             lowered.out_info[0])
        return zeros, cache  # every step returns (outputs, cache)
      return call

    self._fast = tuple(map(compile_only, fast))
    try:
      yield futures
    finally:
      self._fast = fast

  def compiled_shapes(self) -> dict[str, int] | None:
    """Shapes compiled so far per jitted step (None off the direct path): after
    warm-up these must not grow, or steady state is paying for compiles."""
    if self._fast is None:
      return None
    names = ("prefill", "decode", "decode_multi_step", "mixed", "prefill_packed",
             "prefill_scores", "check_prefill", "check_decode", "mixed_packed")
    return {name: f._cache_size() for name, f in zip(names, self._fast)}

  @functools.cached_property
  def backends_why_not(self) -> str | None:
    """None if each backend chosen by name can run every call the engine
    makes, else why not, naming the first that cannot. A backend chosen by
    name never falls back (mosaic.registry), so without this check a backend
    that cannot run here, or cannot run a prompt chunk over cached tokens
    (cuDNN's), would fail the first request that needs it, not the start."""
    if not self.backends or self._fast is None:
      return None  # off the direct path the model's own API checks its calls
    from models import jitted, llama
    from mosaic import registry

    llama.ops()
    cfg = self.model.config
    dt = jnp.dtype(self.dtype)
    sds = jax.ShapeDtypeStruct
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    window = getattr(cfg, "sliding_window", None)
    vec = lambda n: sds((1, n), jnp.int32)  # noqa: E731
    pages = lambda x: sds(x.shape, x.dtype)  # noqa: E731
    q = sds((1, 64, hq, hd), dt)
    kv = sds((1, 64, hkv, hd), dt)
    long_kv = sds((1, 128, hkv, hd), dt)
    calls = {
        "attention_prefill": (
            ("a fresh prompt chunk", (q, kv, kv), dict(causal=True, sliding_window=window)),
            # Prompts longer than a chunk, prefix-cache hits and speculative checks.
            ("a prompt chunk over cached tokens", (q, long_kv, long_kv),
             dict(causal=True, sliding_window=window, q_positions=vec(64),
                  kv_positions=vec(128), q_segment_ids=vec(64), kv_segment_ids=vec(128)))),
        "attention_decode": (
            ("a decode step", (sds((1, 1, hq, hd), dt), pages(self.cache.k), pages(self.cache.v),
                               sds((1,), jnp.int32), sds((1, 1), jnp.int32)), dict(layer=0)),),
    }
    # The layers' four projections at one device's shard (K and N as each
    # kernel sees them under tensor parallelism), and the lm_head.
    tp = self.tensor_parallel_size
    d, f = cfg.hidden_size, cfg.ffn_size // tp
    projections = (("qkv", (hq + 2 * hkv) * hd // tp, d, {}), ("o_proj", d, hq * hd // tp, {}),
                   ("gate_up", 2 * f, d, dict(activation="swiglu")), ("down", d, f, {}))
    fp8 = getattr(self.model, "quantization", None) == "fp8"
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    layer_op = "matmul_fp8" if fp8 else "matmul"
    calls[layer_op] = tuple(
        (f"the {name} projection ({k} -> {n})",
         (sds((16, k), f8), sds((n, k), f8)) if fp8 else (sds((16, k), dt), sds((k, n), dt)),
         dict(kw, a_scale=sds((16,), f32), w_scale=sds((n,), f32)) if fp8 else kw)
        for name, n, k, kw in projections)
    vocab = cfg.vocab_size if cfg.tie_embeddings else cfg.vocab_size // tp
    calls["matmul"] = calls.get("matmul", ()) + (  # the lm_head (fp8 models: the only one)
        ("the lm_head", (sds((16, d), dt), sds((d, vocab), dt)), dict(out_dtype=f32)),)
    # --matmul-backend names the fp8 projections' backend too (jitted.backends).
    chosen = dict(jitted.backends(**self.backends))
    for op, name in chosen.items():
      for what, args, kw in calls.get(op, ()):
        why = registry.get_op(op).get(name).why_not(*args, **kw)
        if why is not None:
          return f"{op} backend {name!r} cannot run {what}: {why}"
    return None

  @property
  def packed_why_not(self) -> str | None:
    """None if ``prefill_packed`` can run, else why not: it needs the direct
    path and a prefill attention that takes positions and segment ids, which
    a backend chosen by name must take anyway (``backends_why_not``: a chunk
    over cached tokens); the default order picks one that does."""
    if self._fast is None:
      return f"{type(self.model).__name__} has no packed prefill step"
    return self.backends_why_not

  def prefill_packed(self, tokens, tpos, seg, last, page_table, fresh=True):
    """Prompt chunks packed in one row (models.Model only; llama.prefill_packed):
    logits [R, V] at each row's ``last`` token. ``fresh``: no chunk has a
    cached prefix (no page gather)."""
    logits, self.cache = self._fast[4](
        self.model.params, self.cache, _stacked(tokens, tpos, seg),
        _side_by_side(last, page_table), n=len(tokens), fresh=fresh)
    return logits

  @property
  def supports_prompt_logprobs(self) -> bool:
    return self._fast is not None

  def prefill_scores(self, tokens, positions, lengths, page_table, targets):
    """``prefill`` with every position's logits kept (models.Model only):
    (last logits [B, V], and sampling.prompt_scores of ``targets`` [B, T])."""
    (last, *scores), self.cache = self._fast[5](
        self.model.params, self.cache, _side_by_side(tokens, positions, lengths, page_table),
        np.asarray(targets, np.int32), chunk=tokens.shape[1], fresh=not np.any(positions))
    return last, tuple(scores)

  def check_prefill(self, tokens, positions, lengths, page_table, *, width):
    """A speculative checking call as a continued prefill (models.Model only):
    logits [B, width, V] at each row's first ``width`` chunk positions."""
    logits, self.cache = self._fast[6](
        self.model.params, self.cache, _side_by_side(tokens, positions, lengths, page_table),
        chunk=tokens.shape[1], width=width)
    return logits

  @property
  def check_decode_tokens(self) -> int:
    """The most tokens a row ``check_decode`` takes (0: it cannot): the
    decode attention kernels take up to attention_decode.MAX_TQ queries."""
    if self._fast is None:
      return 0
    from kernels.attention_decode import MAX_TQ

    return MAX_TQ

  def check_decode(self, tokens, lengths, page_table):
    """A speculative checking call as a decode step (models.Model only): row
    r's tokens [Tq] at positions lengths[r] - Tq ..., decode attention over
    the pages in place -> logits [B, Tq, V]."""
    logits, self.cache = self._fast[7](
        self.model.params, self.cache, _side_by_side(tokens, lengths, page_table),
        tq=tokens.shape[1])
    return logits

  @property
  def supports_mixed(self) -> bool:
    return self._fast is not None and self.model.config.sliding_window is None

  def mixed(self, dec_tokens, dec_lengths, dec_table, tokens, positions, lengths, page_table):
    """A decode batch and prefill chunks in one call (models.Model only):
    logits [Bd + B, V], the decode rows' then each chunk's last token's."""
    return self.mixed_slots(dec_tokens, np.arange(len(dec_lengths), dtype=np.int32), dec_lengths,
                            dec_table, tokens, positions, lengths, page_table)

  def mixed_slots(self, last, slots, dec_lengths, dec_table, tokens, positions, lengths,
                  page_table):
    """``mixed`` with decode row r's input token ``last[slots[r]]`` (as decode_slots)."""
    logits, self.cache = self._fast[3](
        self.model.params, self.cache, last, _side_by_side(slots, dec_lengths, dec_table),
        _side_by_side(tokens, positions, lengths, page_table), chunk=tokens.shape[1],
        fresh=not np.any(positions))
    return logits

  def mixed_packed_slots(self, last, slots, dec_lengths, dec_table, tokens, tpos, seg,
                         last_idx, page_table, fresh=False):
    """``mixed_slots`` with the prompt chunks packed in one row, as
    ``prefill_packed`` takes them: logits [Bd + R, V]."""
    logits, self.cache = self._fast[8](
        self.model.params, self.cache, last, _side_by_side(slots, dec_lengths, dec_table),
        _stacked(tokens, tpos, seg), _side_by_side(last_idx, page_table), n=len(tokens),
        fresh=fresh)
    return logits

  def decode_multi(self, slots, lengths, page_table, arrays, counts, slot_tokens, last, *,
                   steps: int, greedy_only: bool, logprobs: bool):
    """``steps`` decode steps with on-device sampling in one call (models.Model only),
    row r's first input token being ``last[slots[r]]`` (slot -1: a padding row):
    ((tokens, logprob, top ids, top logprobs) each [steps, B, ...], counts, last).
    The host inputs (slots, lengths, page table, sampling rows) travel as one array."""
    host = pack_decode_inputs(slots, lengths, page_table, arrays)
    out, self.cache = self._fast[2](self.model.params, self.cache, host, counts, slot_tokens,
                                    last, steps=steps, greedy_only=greedy_only,
                                    logprobs=logprobs)
    return out


class CountingRunner:
  """Byte-level 'model': after byte b comes byte (b + 1) % 256, after "~" EOS."""

  def __init__(self, *, num_pages: int = 64, page_size: int = 4, vocab_size: int = 258,
               max_context: int = 1024, step_delay: float = 0.0):
    from serving.engine.text import ByteTokenizer

    self.name = "counting"
    self.vocab_size = vocab_size
    self.max_context = max_context
    self.tokenizer = ByteTokenizer(vocab_size)
    self.page_size = page_size
    self.num_pages = num_pages
    self.dtype = "float32"
    self.backends = {}
    self.step_delay = step_delay  # seconds per call: makes timing tests deterministic

  def _logits(self, last):
    out = np.full((len(last), self.vocab_size), -10.0, np.float32)
    last = np.asarray(last)
    nxt = np.where(last == ord("~"), self.tokenizer.eos_ids[0], (last + 1) % 256)
    out[np.arange(len(last)), nxt] = 10.0
    return out

  @staticmethod
  def _chunk_last(tokens, lengths):
    lengths = np.asarray(lengths)
    return np.asarray(tokens)[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]

  def prefill(self, tokens, positions, lengths, page_table):
    del positions, page_table
    time.sleep(self.step_delay)
    return self._logits(self._chunk_last(tokens, lengths))

  def decode(self, tokens, lengths, page_table):
    del lengths, page_table
    time.sleep(self.step_delay)
    return self._logits(np.asarray(tokens))

  supports_mixed = True
  packed_why_not = None  # it can
  supports_prompt_logprobs = True

  def _every(self, tokens):
    """Logits [B, T, V] after every one of ``tokens`` [B, T]."""
    tokens = np.asarray(tokens)
    return self._logits(tokens.reshape(-1)).reshape(*tokens.shape, -1)

  def prefill_scores(self, tokens, positions, lengths, page_table, targets):
    del positions, page_table
    time.sleep(self.step_delay)
    return (self._logits(self._chunk_last(tokens, lengths)),
            sampling.prompt_scores(self._every(tokens), np.asarray(targets, np.int32)))

  def check_prefill(self, tokens, positions, lengths, page_table, *, width):
    del positions, lengths, page_table
    time.sleep(self.step_delay)
    return self._every(np.asarray(tokens)[:, :width])

  check_decode_tokens = 8

  def check_decode(self, tokens, lengths, page_table):
    del lengths, page_table
    time.sleep(self.step_delay)
    return self._every(tokens)

  def prefill_packed(self, tokens, tpos, seg, last, page_table, fresh=True):
    del tpos, seg, page_table, fresh
    time.sleep(self.step_delay)
    return self._logits(np.asarray(tokens)[np.asarray(last)])

  def mixed(self, dec_tokens, dec_lengths, dec_table, tokens, positions, lengths, page_table):
    del dec_lengths, dec_table, positions, page_table
    time.sleep(self.step_delay)  # one call, one delay
    return self._logits(np.concatenate([np.asarray(dec_tokens), self._chunk_last(tokens, lengths)]))

  def mixed_packed(self, dec_tokens, dec_lengths, dec_table, tokens, tpos, seg, last, page_table,
                   fresh=False):
    del dec_lengths, dec_table, tpos, seg, page_table, fresh
    time.sleep(self.step_delay)
    return self._logits(np.concatenate([np.asarray(dec_tokens),
                                        np.asarray(tokens)[np.asarray(last)]]))
