"""Decode attention over a paged KV cache.

``attention_decode(q[B,Tq,Hq,D], k_pages[Hkv,P,page,D], v_pages, lengths[B],
page_table[B,max_pages])``: query t of sequence b sits at position
``lengths[b] - Tq + t`` and attends every cached token at a position <= its
own. Token j of sequence b lives in page ``page_table[b, j // page]`` at slot
``j % page``. Query head h reads kv head ``h // (Hq // Hkv)`` (GQA).
Lengths above the table's capacity (max_pages * page) are clamped to it; a
row that sees no key (length 0, or a query before the sequence start)
outputs 0.

Data flow of the Mosaic GPU kernel (``_mosaic_kernel``): the G = Hq // Hkv
query heads sharing one kv head, times the Tq new tokens, are packed as the
rows of one 64-row tile, so one KV page read from HBM serves all of them
through one wgmma (decode is bound by HBM bytes, and this makes every K/V byte
count G * Tq times). The grid is (batch, kv head, split, row tile): the pages
a sequence fills (by its length at run time, not the table's width) are
divided into ``splits`` contiguous ranges, enough that batch x kv heads x
splits fills the SMs when the batch is small (split-K).
Each block reads its page indices from the page table, TMA-copies
``pages_per_step`` pages of K and of V per step (or one part of a page,
``steps_per_page``) into a ring of ``stages`` SMEM buffers (the copies of the
next steps are in flight while this step computes; a hand-written ring rather
than ``dsl.pipeline`` because the source of each copy is a page index read
from the table at run time), computes S = Q K^T with wgmma into registers,
masks positions past each row's own, runs the online softmax in float32,
writes P to SMEM and accumulates P V with a second wgmma. A single split writes the normalized
output directly; several splits write float32 partial outputs and their
log-sum-exp, merged by a small jnp combine step. Only the packed rows of Q
and of the output travel through HBM (rounded up to 8 rows; fewer than 8
rows as they are, so that a decode step needs no padding copy of Q).

The kernel has an append mode (``_mosaic_kernel`` with ``rope``), the
Mosaic backend of the op ``attention_decode_append``
(kernels/attention_decode_append.py): Q is rotated in its SMEM tile, and the
block that holds the new token's position stores its k and v rows and
patches them into the page it streams.

fp8 pages (``float8_e4m3fn``, ``kv_scales`` = (k_scale, v_scale), one pair
or one per layer): the ring holds the fp8 pages, half the HBM bytes; each
step converts its K and V tiles into two f16 SMEM tiles for the wgmmas
(Hopper converts fp8 to f16 only, so Q and P run in f16 too); k_scale folds
into the score scale and v_scale into the output's normalization, both exact.
``quantize_pages`` and ``fp8_scale`` make such pages. On the H200 fp8 pages
decode in 0.85-0.87x the bf16 time with several blocks per SM and in the
same time with one: the conversion runs in the warpgroup that does the
softmax (bench/results/attention_decode_h200_swap_ab/).

``Config.blocks_per_sm > 0`` selects ``_persistent_kernel`` instead: a grid of
k blocks per SM, each looping over work items with its copy ring running
across item boundaries (short sequences keep HBM busy between items).

``Config.swap_ab`` (the default where a step's keys are a multiple of 64)
transposes both products, S^T = K Q^T and O^T += V^T P^T, so the block's
keys are the wgmmas' 64-row M and the packed query rows (rounded up to 8)
their N: with GQA 4 at Tq = 1 the tensor cores and the softmax do 8 rows'
work a step instead of 64. The softmax then reduces over axis 0 (across the
warps, through SMEM), and P and the output are stored transposed.

Pages are 128 tokens by default (``DEFAULT_PAGE_SIZE``): a 32 KB TMA box
per page streams 1-3% faster than two 16 KB ones, and where a short sequence
wants short steps the table copies half a page a step (``steps_per_page``),
so 128-token pages were as fast as 64-token ones or faster at every shape
measured (bench/results/attention_decode_h200_page128_default/). On H200 the
kernel reads K/V at 4.2-4.5 TB/s, 1.00x cuDNN on a contiguous cache at long
contexts: within 0.3% of a copy-only stream of the same pages
(bench/studies/kv_layout_study.py, bench/results/attention_decode_h200_page128_stream/).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from mosaic import dsl, registry, tuning
from mosaic import target as target_lib
from mosaic.dsl import jax, jnp, lax, pl, plgpu

DEFAULT_PAGE_SIZE = 128
MAX_TQ = 8  # speculative verification checks at most 8 tokens per step
DTYPES = ("bfloat16", "float16", "float32")
KERNEL_DTYPES = ("bfloat16", "float16")
# fp8 pages: the cache holds K / k_scale and V / v_scale (``quantize_pages``).
FP8_DTYPES = ("float8_e4m3fn",)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# Hopper converts fp8 to f16 only (not bf16), so with fp8 pages the tensor
# cores run Q, K, P and V in f16; the dequantized values are exact in f16.
FP8_COMPUTE = jnp.float16
ROWS = 64  # wgmma M: one warpgroup's tile of packed (token, head) rows
_LOG2E = math.log2(math.e)
# Running max before any visible key: finite so that exp2(m_old - m_new) is 1,
# not NaN, for a row that has seen nothing yet (its sums stay exactly 0).
_M_INIT = -1e30


# --------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class Config(tuning.KernelConfig):
  """Mosaic kernel config.

  pages_per_step: pages whose K and V one loop step copies and multiplies;
    the step's key block is pages_per_step * page_size tokens.
  steps_per_page: > 1 splits each page over that many steps instead (with
    pages_per_step = 1): a step copies page_size / steps_per_page rows of one
    page. Large pages then keep a short step where a short one wins (a short
    sequence streams few steps; a smaller ring lets more blocks share an SM).
  stages: SMEM ring depth; stages - 1 steps of copies are in flight while one
    step computes.
  splits: contiguous page ranges per sequence (split-K); 0 = chosen from the
    batch, kv heads and SM count at call time.
  blocks_per_sm: 0 = one block per work item (sequence, kv head, split, row
    tile); k > 0 = a persistent grid of k blocks per SM, each looping over
    work items with its copy ring running across item boundaries.
  swap_ab: the wgmmas take the block's keys as their 64-row M side and the
    packed query rows (rounded up to 8) as N: S^T = K Q^T, O^T += V^T P^T.
    With few packed rows (GQA 4 at Tq = 1 packs 4) the tensor cores and the
    softmax then do 8 rows' work a step instead of 64 rows'. The step's
    keys (``step_keys``) must be a multiple of 64.
  """

  pages_per_step: int = 1
  steps_per_page: int = 1
  stages: int = 2
  splits: int = 0
  blocks_per_sm: int = 0
  swap_ab: bool = False

  def __post_init__(self):
    if self.pages_per_step not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.pages_per_step=} must be one of 1, 2, 4, 8, 16")
    if self.steps_per_page not in (1, 2, 4):
      raise ValueError(f"{self.steps_per_page=} must be one of 1, 2, 4")
    if self.steps_per_page > 1 and self.pages_per_step != 1:
      raise ValueError(f"{self.steps_per_page=} needs pages_per_step=1, got "
                       f"{self.pages_per_step=}")
    if not 1 <= self.stages <= 8:
      raise ValueError(f"{self.stages=} must be in [1, 8]")
    if self.splits < 0:
      raise ValueError(f"{self.splits=} must be >= 0 (0 = automatic)")
    if not 0 <= self.blocks_per_sm <= 4:
      raise ValueError(f"{self.blocks_per_sm=} must be in [0, 4] (0 = not persistent)")
    if not isinstance(self.swap_ab, bool):
      raise ValueError(f"{self.swap_ab=} must be a bool")

  def step_keys(self, page: int) -> int:
    """Keys one loop step copies and multiplies, with pages of ``page`` tokens."""
    return self.pages_per_step * page // self.steps_per_page


# --------------------------------------------------------------------------
# Mosaic GPU kernel


def _mosaic_kernel(lengths_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, tq: int,
                   group: int,
                   page: int, pages_per_step: int, steps_per_page: int, stages: int,
                   splits: int, scale: float, split_out: bool, io_rows: int, store_rows: int,
                   stage_out: bool, fp8: bool, swap: bool, append: bool = False,
                   tile_rows: int = 0):
  """One block: (sequence b, kv head h, split s, row tile r).

  Only the first ``io_rows`` rows of the tile (the packed rows rounded up to
  8) are loaded; when HBM holds fewer than 8, TMA zero-fills the others.
  ``store_rows`` rows are stored (exactly the packed rows when there are
  fewer than 8, from an untiled buffer). The rest of the SMEM tile is never
  loaded and never stored. Its rows compute garbage that stays in those rows
  (softmax and both matmuls are row-wise) and is dropped.

  With ``fp8``, a scales input follows v_ref and two f16 buffers the K and V
  of one step are converted into come before the barriers.

  With ``append`` (one new token a sequence, see ``attention_decode_append``)
  q_ref is the token's un-rotated q, k and v rows of each kv head [B, Hkv,
  G + 2, D], a RoPE table [B, 2, D] follows v_ref, and k_ref / v_ref are
  written: the block rotates Q in SMEM (``_rope_tile``); the block whose
  split holds the token's position rotates the new key (``_rope_kv``),
  stores its K and V rows into their page slot, and puts them into its last
  step's ring slot itself (``_patch_row``), since its copy of that page may
  have been read before the store landed. Q's buffer then has 64 rows (the
  layout the rotation's registers take) of which the wgmmas read
  ``tile_rows``; the table's SMEM copy [2, D] and two untiled [2, D] buffers
  (the k and v rows as loaded, and rotated) come before the barriers.
  """
  refs, scale, v_scale, cvt = _fp8_refs(refs, layer_ref, scale, fp8)
  if append:
    rope_ref, *refs = refs
    *refs, (rope_smem, kv_raw, kv_rows), bars = refs
    refs = (*refs, bars)
  if split_out:
    o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, bars = refs
  elif stage_out:
    o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, bars = refs
    lse_ref = lse_smem = None
  else:
    o_ref, q_smem, k_smem, v_smem, p_smem, bars = refs
    o_smem = q_smem  # Q is dead after the loop: its buffer stages the output
    lse_ref = lse_smem = None
  q_bar, k_bars, v_bars = bars
  b = lax.axis_index("b")
  h = lax.axis_index("h")
  kvh = _kv_head0(layer_ref, k_ref, q_ref.shape[1]) + h
  s = lax.axis_index("s")
  r = lax.axis_index("r")
  head_dim = q_smem.shape[-1]

  length = _length(lengths_ref, b, table_ref, page)
  block_kv = pages_per_step * page // steps_per_page
  first_step, n_steps = _split_range(length, block_kv, s, splits)

  def issue(step, slot):
    """Starts the copies of step ``step``'s pages into ring slot ``slot``."""
    _issue_step(table_ref, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, b, kvh,
                first_step + step, slot, page, pages_per_step, steps_per_page)

  io = pl.ds(r * ROWS, io_rows)
  plgpu.copy_gmem_to_smem(q_ref.at[b, h, io], q_smem.at[pl.ds(0, io_rows)], q_bar.at[0])
  if append:
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(group, 2)], kv_raw, q_bar.at[0])
    plgpu.copy_gmem_to_smem(rope_ref.at[b], rope_smem, q_bar.at[0])
  for i in range(stages):
    @pl.when(i < n_steps)
    def _():
      issue(i, i)

  plgpu.barrier_wait(q_bar.at[0])
  patch_row = None
  if append:
    _rope_tile(q_smem, rope_smem)
    # The new token sits at position length - 1, in the last step of the
    # last split that has steps (none when the row is empty or past the table).
    pos = lengths_ref[b] - 1
    owner = ((pos >= 0) & (pos < table_ref.shape[1] * page) & (n_steps > 0)
             & (lax.div(jnp.maximum(pos, 0), jnp.int32(block_kv)) == first_step + n_steps - 1))

    @pl.when(owner)
    def _():
      _rope_kv(kv_raw, rope_smem, kv_rows)
      pg = table_ref[b, lax.div(pos, jnp.int32(page))]
      slot = pl.ds(lax.rem(pos, jnp.int32(page)), 1)
      plgpu.copy_smem_to_gmem(kv_rows.at[pl.ds(0, 1)], k_ref.at[kvh, pg, slot])
      plgpu.copy_smem_to_gmem(kv_rows.at[pl.ds(1, 1)], v_ref.at[kvh, pg, slot])

    patch_row = lambda i: jnp.where(owner & (i == n_steps - 1),
                                    pos - (first_step + i) * block_kv, -1)
    q_smem = q_smem.at[pl.ds(0, tile_rows)]

  n = q_smem.shape[0]  # the Q tile's rows
  acc, m_i, l_i = _init_state(head_dim, n, swap)
  ids = _ids(block_kv, r, n, swap)

  def body(i, carry):
    slot = lax.rem(i, jnp.int32(stages))
    patch = None if patch_row is None else (patch_row(i), kv_rows.at[0], kv_rows.at[1])
    carry = _attend_step(carry, ids, slot, (first_step + i) * block_kv, length, q_smem, k_smem,
                         v_smem, p_smem, k_bars, v_bars, tq=tq, group=group, scale=scale,
                         cvt=cvt, swap=swap, patch=patch)

    # Both wgmmas of this step are complete (their results were read), so
    # the slot is free for the step `stages` ahead.
    @pl.when(i + stages < n_steps)
    def _():
      issue(i + stages, slot)

    return carry

  acc, m_i, l_i = lax.fori_loop(0, n_steps, body, (acc, m_i, l_i))
  _store_output(acc, m_i, l_i, o_smem, lse_smem, v_scale, swap)
  # store_rows < 8: exactly the packed rows leave, from an untiled buffer; a
  # wider box would spill into the next head's rows in HBM.
  out = pl.ds(r * ROWS, store_rows)
  if split_out:
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, store_rows)], o_ref.at[s, b, h, out])
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, store_rows)], lse_ref.at[s, b, h, out])
  else:
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, store_rows)], o_ref.at[b, h, out])
  plgpu.wait_smem_to_gmem(0)


def _fp8_refs(refs, layer_ref, scale, fp8: bool):
  """(refs without the fp8 ones, the Q K^T scale, v_scale, (k16, v16) or None).

  fp8 pages hold K / k_scale and V / v_scale: k_scale folds into the score
  scale and v_scale into the output's normalization, both exact (the scores
  and the output are linear in K and V)."""
  if not fp8:
    return refs, scale, None, None
  scales_ref, *refs = refs
  *refs, cvt, bars = refs
  li = dsl.layer_index(layer_ref, scales_ref.shape[0])
  return (*refs, bars), scale * scales_ref[li, 0], scales_ref[li, 1], cvt


# The clamps below run on scalars inside the kernel: as XLA ops in front of it
# they were three more kernel launches per layer of a decode step.


def _issue_step(table_ref, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, b, kvh, step, slot,
                page: int, pages_per_step: int, steps_per_page: int):
  """Starts the TMA copies of sequence b's step ``step`` (counted from its
  first key) into ring slot ``slot``: ``pages_per_step`` whole pages, or one
  part of a page when ``steps_per_page`` > 1."""
  if steps_per_page == 1:
    for j in range(pages_per_step):
      pg = _page(table_ref, b, step * pages_per_step + j)
      rows = pl.ds(j * page, page)
      plgpu.copy_gmem_to_smem(k_ref.at[kvh, pg], k_smem.at[slot, rows], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[kvh, pg], v_smem.at[slot, rows], v_bars.at[slot])
    return
  n = page // steps_per_page
  pg = _page(table_ref, b, lax.div(step, jnp.int32(steps_per_page)))
  rows = pl.ds(lax.rem(step, jnp.int32(steps_per_page)) * n, n)
  plgpu.copy_gmem_to_smem(k_ref.at[kvh, pg, rows], k_smem.at[slot], k_bars.at[slot])
  plgpu.copy_gmem_to_smem(v_ref.at[kvh, pg, rows], v_smem.at[slot], v_bars.at[slot])


def _split_range(length, block_kv: int, s, splits: int):
  """(first step, number of steps) of split ``s`` of a sequence of ``length``
  keys: its steps are shared out by the sequence's own length, not by the
  table's width, so a short sequence in a wide table still spreads over every
  split instead of leaving them all to the first."""
  # Scalar arithmetic stays in div/min/max: lengths are >= 0.
  total = lax.div(length + (block_kv - 1), jnp.int32(block_kv))
  per = lax.div(total + (splits - 1), jnp.int32(splits))
  first = s * per
  return first, jnp.minimum(jnp.maximum(total - first, 0), per)


def _kv_head0(layer_ref, k_ref, hkv):
  """First kv head of the layer: k_ref is [layers * Hkv, pages, page, D]."""
  n_layers = k_ref.shape[0] // hkv
  return dsl.layer_index(layer_ref, n_layers) * hkv


def _length(lengths_ref, b, table_ref, page):
  """Sequence b's length, at most what its table row holds."""
  return jnp.minimum(lengths_ref[b], table_ref.shape[1] * page)


def _page(table_ref, b, idx):
  """Page index idx of row b; a step's pages past the row's end (a partly
  used last step) read its last entry, a valid page whose keys are masked."""
  return table_ref[b, jnp.minimum(idx, table_ref.shape[1] - 1)]


def _init_state(head_dim, n, swap: bool):
  """(acc, running max, running sum) of ``n`` packed query rows: acc is
  [n, D], or [D, n] with ``swap`` (O^T); the row statistics are laid out as
  a reduction of S (S^T) over its keys."""
  layout = plgpu.Layout.WGMMA
  keys = 0 if swap else 1
  m_i = plgpu.layout_cast(jnp.full((n,), _M_INIT, jnp.float32), layout.reduce(keys))
  l_i = plgpu.layout_cast(jnp.full((n,), 0.0, jnp.float32), layout.reduce(keys))
  shape = (head_dim, n) if swap else (n, head_dim)
  acc = plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), layout)
  return acc, m_i, l_i


def _ids(block_kv, r, n, swap: bool):
  """(packed row, key in block) of each element of S [n, block_kv] (S^T with ``swap``)."""
  layout = plgpu.Layout.WGMMA
  shape, rows = ((block_kv, n), 1) if swap else ((n, block_kv), 0)
  row_ids = plgpu.broadcasted_iota(jnp.int32, shape, rows, layout=layout) + r * ROWS
  key_ids = plgpu.broadcasted_iota(jnp.int32, shape, 1 - rows, layout=layout)
  return row_ids, key_ids


def _attend_step(carry, ids, slot, start, length, q_smem, k_smem, v_smem, p_smem, k_bars,
                 v_bars, *, tq, group, scale, cvt=None, swap=False, patch=None):
  """One key block (ring slot ``slot``, first key position ``start``).

  ``cvt``: (k16, v16) SMEM buffers; the slot's fp8 K and V are converted into
  them for the tensor cores (the previous step's wgmmas, which read them,
  have completed: their results were read).
  ``swap``: S^T = K Q^T [block_kv, n] and O^T += V^T P^T [D, n], so the
  softmax reduces over axis 0 (across the warps, through SMEM) and P^T is
  stored transposed, as P [n, block_kv], the K-major B of the P V wgmma.
  ``patch``: (row, k, v): when row >= 0, the slot's K and V row ``row`` are
  replaced by the untiled SMEM rows k and v before the wgmmas read them."""
  acc, m_i, l_i = carry
  row_ids, key_ids = ids
  keys = 0 if swap else 1  # the axis of S that runs over the block's keys
  plgpu.barrier_wait(k_bars.at[slot])
  k_tile = k_smem.at[slot]
  if patch is not None:
    _patch_row(k_tile, patch[0], patch[1])
    plgpu.commit_smem()  # read by the tensor cores next
  if cvt is not None:
    cvt[0][...] = k_tile[...].astype(cvt[0].dtype)
    plgpu.commit_smem()  # read by the tensor cores next
    k_tile = cvt[0]

  if swap:
    qk = _mma(row_ids.shape, k_tile, dsl.transpose(q_smem))
  else:
    qk = _mma(row_ids.shape, q_smem, dsl.transpose(k_tile))
  # Row i holds token t = i // group; it sees key j iff j <= length - tq + t,
  # i.e. iff (j - length + tq) * group <= i (no vector division needed).
  visible = (key_ids + (start - length + tq)) * group <= row_ids
  qk = jnp.where(visible, qk * (scale * _LOG2E), -jnp.inf)
  per_row = lambda x: lax.broadcast_in_dim(x, qk.shape, [1 - keys])
  m_new = jnp.maximum(m_i, qk.max(axis=keys))
  alpha = jnp.exp2(m_i - m_new)
  p = jnp.exp2(qk - per_row(m_new))
  l_i = l_i * alpha + p.sum(axis=keys)
  p = p.astype(p_smem.dtype)
  if swap:
    dsl.transpose(p_smem)[...] = plgpu.layout_cast(p, plgpu.Layout.WGMMA_TRANSPOSED)
  else:
    p_smem[...] = p
  if cvt is None:
    plgpu.commit_smem()  # P is read by the tensor cores next
  plgpu.barrier_wait(v_bars.at[slot])
  v_tile = v_smem.at[slot]
  if patch is not None:
    _patch_row(v_tile, patch[0], patch[2])
    plgpu.commit_smem()  # read by the tensor cores next
  if cvt is not None:
    cvt[1][...] = v_tile[...].astype(cvt[1].dtype)
    plgpu.commit_smem()  # P and V are read by the tensor cores next
    v_tile = cvt[1]

  if swap:
    pv = _mma(acc.shape, dsl.transpose(v_tile), dsl.transpose(p_smem))
  else:
    pv = _mma(acc.shape, p_smem, v_tile)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1 - keys]) + pv
  return acc, m_new, l_i


def _rope_tile(q_smem, rope_smem):
  """Rotates every row of the Q tile [64, D] in place by the RoPE table
  [2, D] (cos | cos, -sin | sin), in float32 as ``models.rope.rotate``. Rows
  past the q heads (k, v, the zero fill) are rotated too, and never stored."""
  layout = plgpu.Layout.WGMMA
  half = q_smem.shape[-1] // 2
  cols = lambda j: q_smem.at[:, pl.ds(j * half, half)]
  lo, hi = (plgpu.load(cols(j), (), layout=layout).astype(jnp.float32) for j in (0, 1))

  def table(i, j):
    x = plgpu.load(rope_smem.at[i, pl.ds(j * half, half)], (), layout=layout.reduce(0))
    return lax.broadcast_in_dim(x, lo.shape, [1])

  out = (lo * table(0, 0) + hi * table(1, 0), hi * table(0, 1) + lo * table(1, 1))
  for j, x in enumerate(out):
    cols(j)[...] = x.astype(q_smem.dtype)
  plgpu.commit_smem()  # read by the tensor cores next


def _rope_kv(kv_raw, rope_smem, kv_rows):
  """The new token's k (row 0 of ``kv_raw`` [2, D]) rotated and its v (row
  1) as they are, into ``kv_rows`` [2, D], whence the TMA unit stores them."""
  # One layout for every vector here (the patches read kv_rows in it too):
  # left to inference, the vectors' layouts make a search that does not end.
  layout = plgpu.Layout.WGMMA.reduce(0)
  half = kv_raw.shape[-1] // 2
  part = lambda ref, i, j: ref.at[i, pl.ds(j * half, half)]
  load = lambda ref, i, j: plgpu.load(part(ref, i, j), (), layout=layout).astype(jnp.float32)
  lo, hi = load(kv_raw, 0, 0), load(kv_raw, 0, 1)
  c = [load(rope_smem, 0, j) for j in (0, 1)]
  s = [load(rope_smem, 1, j) for j in (0, 1)]
  part(kv_rows, 0, 0)[...] = (lo * c[0] + hi * s[0]).astype(kv_rows.dtype)
  part(kv_rows, 0, 1)[...] = (hi * c[1] + lo * s[1]).astype(kv_rows.dtype)
  for j in (0, 1):
    part(kv_rows, 1, j)[...] = plgpu.load(part(kv_raw, 1, j), (), layout=layout)
  plgpu.commit_smem()  # read by the TMA unit and the patches next


def _patch_row(tile, row, src):
  """Row ``row`` (dynamic; none when < 0) of the SMEM tile [block_kv, D]
  becomes the untiled SMEM row ``src`` [D]. The 64-row chunk that holds it
  goes through registers (the tile's swizzled layout takes no single-row
  store)."""
  layout = plgpu.Layout.WGMMA
  n, d = tile.shape
  for c in range(n // ROWS):
    @pl.when((row >= c * ROWS) & (row < (c + 1) * ROWS))
    def _():
      for j in range(d // 64):
        ref = tile.at[pl.ds(c * ROWS, ROWS), pl.ds(j * 64, 64)]
        x = plgpu.load(ref, (), layout=layout)
        new = plgpu.load(src.at[pl.ds(j * 64, 64)], (), layout=layout.reduce(0))
        rows = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=layout) + c * ROWS
        ref[...] = jnp.where(rows == row, lax.broadcast_in_dim(new, x.shape, [1]), x)


def _mma(shape, a, b):
  """a @ b on the tensor cores into a fresh float32 accumulator of ``shape``."""
  def scope(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def _store_output(acc, m_i, l_i, o_smem, lse_smem, v_scale=None, swap=False):
  """Normalized output (0 for rows that saw no key; times ``v_scale`` for fp8
  pages) and log2-sum-exp into SMEM. With ``swap`` acc is O^T [D, n]: it is
  stored transposed into the untiled [n, D] staging buffer."""
  seen = l_i > 0.0
  inv = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
  if v_scale is not None:
    inv = inv * v_scale
  o = (acc * lax.broadcast_in_dim(inv, acc.shape, [1 if swap else 0])).astype(o_smem.dtype)
  if swap:
    dsl.transpose(o_smem)[...] = plgpu.layout_cast(o, plgpu.Layout.WGMMA_TRANSPOSED)
  else:
    o_smem[...] = o
  if lse_smem is not None:
    lse_smem[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
  plgpu.commit_smem()  # the TMA store reads what registers just wrote


def _persistent_kernel(lengths_ref, table_ref, layer_ref, q_ref, k_ref, v_ref, *refs, tq: int,
                       group: int,
                       page: int, pages_per_step: int, steps_per_page: int, stages: int,
                       scale: float, split_out: bool, io_rows: int, store_rows: int,
                       dims: tuple[int, ...], grid_size: int, fp8: bool, swap: bool):
  """A persistent block: work items c, c + grid, c + 2 grid, ... of (b, h, s, r).

  The K/V ring runs across item boundaries: while the last steps of one
  item compute, the first pages of the next are already in flight (an issue
  cursor runs ``stages`` steps ahead of the compute cursor, skipping items
  with no keys). Q is double-buffered and prefetched one item ahead; each
  item's output leaves through the Q buffer it came in (bf16 output), or
  through a staging buffer (split partials; with ``swap`` every output),
  while the next item computes.
  """
  refs, scale, v_scale, cvt = _fp8_refs(refs, layer_ref, scale, fp8)
  if split_out:
    o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, bars = refs
  elif swap:
    o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, bars = refs
    lse_ref = lse_smem = None
  else:
    o_ref, q_smem, k_smem, v_smem, p_smem, bars = refs
    lse_ref = o_smem = lse_smem = None
  q_bars, k_bars, v_bars = bars
  c = lax.axis_index("c")
  n_b, n_h, n_s, n_r = dims
  n_items = n_b * n_h * n_s * n_r
  block_kv = pages_per_step * page // steps_per_page
  head_dim = q_smem.shape[-1]
  n_local = lax.div(n_items - c + (grid_size - 1), jnp.int32(grid_size))
  layer_off = _kv_head0(layer_ref, k_ref, n_h)

  def item_info(j):
    """Local item j -> (b, h, s, first step of split s, r, length, number of steps)."""
    item = c + j * grid_size
    r = lax.rem(item, jnp.int32(n_r))
    x = lax.div(item, jnp.int32(n_r))
    s = lax.rem(x, jnp.int32(n_s))
    x = lax.div(x, jnp.int32(n_s))
    h = lax.rem(x, jnp.int32(n_h))
    b = lax.div(x, jnp.int32(n_h))
    length = _length(lengths_ref, b, table_ref, page)
    first, n = _split_range(length, block_kv, s, n_s)
    return b, h, s, first, r, length, n

  def skip_empty(j):
    """The first local item >= j that has steps (n_local if none)."""
    def cond(j):
      return jnp.logical_and(j < n_local, item_info(jnp.minimum(j, n_local - 1))[-1] == 0)
    return lax.while_loop(cond, lambda j: j + 1, j)

  def issue(cursor, slot):
    j, i = cursor
    b, h, _, first, _, _, _ = item_info(j)
    _issue_step(table_ref, k_ref, v_ref, k_smem, v_smem, k_bars, v_bars, b, layer_off + h,
                first + i, slot, page, pages_per_step, steps_per_page)

  def advance(cursor):
    j, i = cursor
    n = item_info(jnp.minimum(j, n_local - 1))[-1]
    last = i + 1 >= n
    j2 = skip_empty(j + 1)
    return jnp.where(last, j2, j), jnp.where(last, 0, i + 1)

  def load_q(j, buf):
    b, h, _, _, r, _, _ = item_info(j)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(r * ROWS, io_rows)],
                            q_smem.at[buf, pl.ds(0, io_rows)], q_bars.at[buf])

  load_q(0, 0)  # grid_size <= n_items: every block has an item
  cursor = (skip_empty(jnp.int32(0)), jnp.int32(0))
  for k in range(stages):
    valid = cursor[0] < n_local

    @pl.when(valid)
    def _():
      issue(cursor, k)

    cursor = _select(valid, advance(cursor), cursor)

  def item_body(j, carry):
    cursor, gstep = carry
    buf = lax.rem(j, jnp.int32(2))
    b, h, s, first, r, length, n = item_info(j)

    @pl.when(j + 1 < n_local)
    def _():
      # The other Q buffer last sent item j-1's output: let that store finish
      # reading it first.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load_q(j + 1, 1 - buf)

    plgpu.barrier_wait(q_bars.at[buf])
    qb = q_smem.at[buf]
    n_rows = q_smem.shape[1]
    ids = _ids(block_kv, r, n_rows, swap)

    def step(i, carry):
      state, cursor, gstep = carry
      slot = lax.rem(gstep, jnp.int32(stages))
      state = _attend_step(state, ids, slot, (first + i) * block_kv, length, qb,
                           k_smem, v_smem, p_smem, k_bars, v_bars, tq=tq, group=group,
                           scale=scale, cvt=cvt, swap=swap)
      valid = cursor[0] < n_local

      @pl.when(valid)
      def _():
        issue(cursor, slot)

      cursor = _select(valid, advance(cursor), cursor)
      return state, cursor, gstep + 1

    state, cursor, gstep = lax.fori_loop(
        0, n, step, (_init_state(head_dim, n_rows, swap), cursor, gstep))
    io = pl.ds(r * ROWS, io_rows)
    out = pl.ds(r * ROWS, store_rows)  # untiled staging: exact rows
    if o_smem is not None:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # item j-1's output has left
      _store_output(*state, o_smem, lse_smem, v_scale, swap)
    if split_out:
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, store_rows)], o_ref.at[s, b, h, out])
      plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, store_rows)], lse_ref.at[s, b, h, out])
    elif o_smem is not None:
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, store_rows)], o_ref.at[b, h, out])
    else:
      _store_output(*state, qb, None, v_scale)
      plgpu.copy_smem_to_gmem(qb.at[pl.ds(0, io_rows)], o_ref.at[b, h, io])
    return cursor, gstep

  lax.fori_loop(0, n_local, item_body, (cursor, jnp.int32(0)))
  plgpu.wait_smem_to_gmem(0)


def _select(pred, new, old):
  return tuple(jnp.where(pred, x, y) for x, y in zip(new, old))


def _num_sms() -> int:
  return target_lib.current().ceilings.sms if target_lib.on_gpu() else 132


def _smem_bytes(cfg: Config, page: int, head_dim: int, dtype, split: bool,
                kv_dtype=None, rows: int = ROWS) -> int:
  """``dtype``: the tensor cores' (Q, P, output); ``kv_dtype``: the pages' (if
  other: fp8, converted a step at a time into two buffers of ``dtype``);
  ``rows``: the packed query rows (the Q tile's with ``swap_ab``, else 64)."""
  isz = jnp.dtype(dtype).itemsize
  block_kv = cfg.step_keys(page)
  n = _tile_rows(cfg, rows)
  kv_isz = isz if kv_dtype is None else jnp.dtype(kv_dtype).itemsize
  b = 2 * cfg.stages * block_kv * head_dim * kv_isz  # K and V rings
  if kv_isz != isz:
    b += 2 * block_kv * head_dim * isz  # the step's converted K and V
  b += n * head_dim * isz + n * block_kv * isz  # Q (and bf16 output), P
  if split:
    b += n * head_dim * 4 + n * 4  # float32 partial output and lse
  else:
    b += n * head_dim * isz  # untiled output staging
  return b


def _tile_rows(cfg: Config, rows: int) -> int:
  """Rows of a block's Q, P and output tiles: the packed rows rounded up to 8
  with ``swap_ab`` (they are the wgmmas' N), else the 64 of the wgmmas' M."""
  return _io_rows(rows) if cfg.swap_ab else ROWS


SMEM_BUDGET = 220 * 1024  # what the heuristic plans for
SMEM_LIMIT = 226 * 1024  # what a block may use on Hopper (227 KB), less barriers


def _pick_config(batch, hkv, tiles, max_pages, page, head_dim, dtype, kv_dtype=None,
                 rows: int = ROWS) -> Config:
  """``dtype``: the tensor cores'; ``kv_dtype``: the pages' if other (fp8),
  which keys the table (fp8 pages have entries of their own); ``rows``: the
  packed query rows."""
  kv_dtype = dtype if kv_dtype is None else kv_dtype
  key = tuning.shape_key(page=page, head_dim=head_dim, dtype=jnp.dtype(kv_dtype).name,
                         batch=tuning.bucket(batch), pages=tuning.bucket(max_pages))
  smem = lambda cfg, split: _smem_bytes(cfg, page, head_dim, dtype, split, kv_dtype, rows)

  def heuristic():
    # Measured on H200 (bench/results/attention_decode.md): two stages win
    # when the grid fills the SMs (two blocks fit per SM and overlap each
    # other's latency); with split-K a longer step (128 tokens) wins.
    split = batch * hkv * tiles < _num_sms() // 2
    tokens = 128 if split else 64
    cfg = _step_config(tokens, page)

    def shorter(cfg):  # the next shorter step, or None
      if cfg.pages_per_step > 1 and (cfg.pages_per_step // 2 * page) % 16 == 0:
        return dataclasses.replace(cfg, pages_per_step=cfg.pages_per_step // 2)
      spp = 2 * cfg.steps_per_page
      if spp <= 4 and page % spp == 0 and (page // spp) % 16 == 0:
        return dataclasses.replace(cfg, steps_per_page=spp)
      return None

    while smem(cfg, True) > SMEM_BUDGET and shorter(cfg) is not None:
      cfg = shorter(cfg)
    if smem(cfg, True) > SMEM_BUDGET:
      cfg = dataclasses.replace(cfg, stages=1)  # D=256 with 64-token pages: no room for 2
    # swap_ab won at every shape measured (bench/results/attention_decode_h200_swap_ab/),
    # with a third stage when the grid fills the SMs: its Q, P and output
    # tiles are small, so two such blocks still fit per SM.
    if cfg.step_keys(page) % ROWS == 0:
      for stages in ((2,) if split else (3, 2)):
        swapped = dataclasses.replace(cfg, stages=stages, swap_ab=True)
        if smem(swapped, True) <= SMEM_BUDGET:
          return swapped
    return cfg

  return tuning.lookup("attention_decode", key, Config, heuristic)


def _step_config(tokens: int, page: int) -> Config:
  """Two stages of steps of about ``tokens`` keys: whole pages, or parts of
  one page when pages are longer. A step's keys are a multiple of 16 (the K
  of the P V wgmma): pages of 8 tokens go two to a step at least."""
  if tokens >= page or page % 32:
    pps = max(1, min(16, tokens // page))
    while pps & (pps - 1):
      pps -= 1
    if (pps * page) % 16:
      pps = min(16, 2 * pps)
    return Config(pages_per_step=pps, stages=2, splits=0)
  spp = 4 if page >= 4 * tokens and (page // 4) % 16 == 0 else 2
  return Config(pages_per_step=1, steps_per_page=spp, stages=2, splits=0)


def _auto_splits(batch, hkv, tiles, n_steps) -> int:
  # One wave of blocks: split a sequence only while batch x kv heads leaves
  # SMs idle, and never into ranges of less than two steps.
  blocks = batch * hkv * tiles
  s = max(1, _num_sms() // blocks)
  return max(1, min(s, n_steps // 2 if n_steps >= 4 else 1))


def _stage_out(cfg: Config, rows: int, split_out: bool, page: int, head_dim: int, dtype,
               kv_dtype=None) -> bool:
  """Whether a bf16 output of ``rows`` packed rows leaves through its own
  untiled buffer, exactly those rows. Fewer than 8 rows only (else the tiled
  Q buffer serves); split partials already have such a buffer; the persistent
  kernel's output leaves through its Q buffer and stays padded; and a config
  that fits in SMEM only without the extra buffer keeps the padded output.
  With ``swap_ab`` every output does: O^T is stored transposed into it."""
  if cfg.swap_ab:
    return not split_out
  return (rows < 8 and not split_out and cfg.blocks_per_sm == 0
          and _smem_bytes(cfg, page, head_dim, dtype, False, kv_dtype) <= SMEM_LIMIT)


def _hbm_rows(tq, g, exact: bool = True) -> int:
  """Packed rows kept in HBM. With ``exact``, fewer than 8 stay as they are:
  Q's 8-row box is zero-filled by TMA past them (Q needs no padding copy),
  and an output stored from an untiled buffer leaves exactly them (it needs
  no slice); each of those was a kernel of its own in every decode layer.
  Else a multiple of 8 (a tiled global dimension must be), and whole 64-row
  tiles only when there is more than one tile."""
  n = tq * g
  if exact and n < 8:
    return n
  return dsl.round_up(n, 8) if n <= ROWS else dsl.round_up(n, ROWS)


def _io_rows(rows) -> int:
  """Rows of the 8-row boxes a block moves between HBM and its SMEM tile."""
  return min(dsl.round_up(rows, 8), ROWS)


def _pack_q(q, hkv):
  """q[B,Tq,Hq,D] -> [B,Hkv,rows,D]: row t*G+g is token t, head h*G+g."""
  b, tq, hq, d = q.shape
  g = hq // hkv
  x = q.reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tq * g, d)
  return jnp.pad(x, ((0, 0), (0, 0), (0, _hbm_rows(tq, g) - tq * g), (0, 0)))


def _unpack_o(o, tq, hq):
  """[B,Hkv,rows,D] -> [B,Tq,Hq,D]."""
  b, hkv, _, d = o.shape
  g = hq // hkv
  o = o[:, :, :tq * g].reshape(b, hkv, tq, g, d).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, tq, hq, d)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config"))
def _attention_decode_mosaic(q, k_pages, v_pages, lengths, page_table, layer=None,
                             kv_scales=None, sm_scale: float = 1.0,
                             config: Config | None = None):
  """``kv_scales``: float32 [L or 1, 2] (k_scale, v_scale) with fp8 pages, else None."""
  out_dtype = q.dtype
  if kv_scales is not None:
    q = q.astype(FP8_COMPUTE)
  b, tq, hq, d = q.shape
  hkv = k_pages.shape[-4]
  # A whole layer stack is read in place: [L, Hkv, ...] viewed as [L * Hkv,
  # ...] (a free reshape) and the kernel offsets the kv head by layer * Hkv.
  layer_arr = dsl.layer_operand(layer if k_pages.ndim == 5 else None)  # clamped in the kernel
  if k_pages.ndim == 5:
    k_pages = k_pages.reshape(-1, *k_pages.shape[2:])
    v_pages = v_pages.reshape(-1, *v_pages.shape[2:])
  o = _kernel_call(_pack_q(q, hkv), k_pages, v_pages, lengths, page_table, layer_arr,
                   kv_scales, tq=tq, group=hq // hkv, sm_scale=sm_scale, config=config)
  return _unpack_o(o, tq, hq).astype(out_dtype)


def _kernel_call(qp, k_pages, v_pages, lengths, page_table, layer_arr, kv_scales, *, tq: int,
                 group: int, sm_scale: float, config: Config | None, rope=None):
  """The Mosaic kernel on packed rows ``qp`` [B, Hkv, rows, D] and pages [L * Hkv,
  P, page, D] (arrays, or refs that the kernel writes with ``rope``, the
  append mode's table) -> the packed output [B, Hkv, rows, D], splits merged."""
  fp8 = kv_scales is not None
  append = rope is not None
  b, hkv, _, d = qp.shape
  page = k_pages.shape[-2]
  g = group
  # Q's rows: the packed query rows, or with ``append`` the token's q heads, k and v.
  q_rows = g + 2 if append else tq * g
  max_pages = page_table.shape[1]
  tiles = dsl.cdiv(tq * g, ROWS)
  kv_dtype = k_pages.dtype
  cfg = config or _pick_config(b, hkv, tiles, max_pages, page, d, qp.dtype, kv_dtype, q_rows)
  pps, spp = cfg.pages_per_step, cfg.steps_per_page
  block_kv = cfg.step_keys(page)
  what = f"{cfg.pages_per_step=} x {page=} / {cfg.steps_per_page=}"
  if page % spp:
    raise ValueError(f"{cfg.steps_per_page=} must divide {page=}")
  if block_kv % 16 or block_kv > 256:
    raise ValueError(f"{what} must be a multiple of 16 tokens and at most 256 (the K "
                     "dimension of the P V wgmma, the N of Q K^T)")
  if cfg.swap_ab and block_kv % ROWS:
    raise ValueError(f"swap_ab: {what} must be a multiple of {ROWS} tokens (the M of K Q^T)")
  n_steps = dsl.cdiv(max_pages * spp, pps)
  splits = cfg.splits or _auto_splits(b, hkv, tiles, n_steps)
  splits = min(splits, n_steps)
  # Steps past a sequence's last page are never run; the kernel clamps the
  # lengths to the table and the page indices of a partly used last step.
  split_out = splits > 1
  dt = qp.dtype
  persistent = cfg.blocks_per_sm > 0  # never with append (_append_mosaic_supports)
  stage_out = _stage_out(cfg, tq * g, split_out, page, d, dt, kv_dtype)
  rows = _hbm_rows(tq, g, exact=split_out or stage_out)  # of the output
  n_items = b * hkv * splits * tiles
  n = _tile_rows(cfg, q_rows)
  q_shape = (2, n, d) if persistent else (ROWS if append else n, d)  # persistent: prefetch
  scratch = [
      plgpu.SMEM(q_shape, dt, transforms=dsl.smem_transforms(q_shape[-2:], dt)),
      plgpu.SMEM((cfg.stages, block_kv, d), kv_dtype,
                 transforms=dsl.smem_transforms((block_kv, d), kv_dtype)),
      plgpu.SMEM((cfg.stages, block_kv, d), kv_dtype,
                 transforms=dsl.smem_transforms((block_kv, d), kv_dtype)),
      plgpu.SMEM((n, block_kv), dt, transforms=dsl.smem_transforms((n, block_kv), dt)),
  ]
  if split_out:
    out_type = (jax.ShapeDtypeStruct((splits, b, hkv, rows, d), jnp.float32),
                jax.ShapeDtypeStruct((splits, b, hkv, rows), jnp.float32))
    scratch += [plgpu.SMEM((n, d), jnp.float32), plgpu.SMEM((n,), jnp.float32)]
  else:
    out_type = jax.ShapeDtypeStruct((b, hkv, rows, d), dt)
    if stage_out:
      scratch.append(plgpu.SMEM((n, d), dt))
  if fp8:
    tile = plgpu.SMEM((block_kv, d), dt, transforms=dsl.smem_transforms((block_kv, d), dt))
    scratch.append((tile, tile))
  if append:
    scratch.append((plgpu.SMEM((2, d), jnp.float32), plgpu.SMEM((2, d), dt),
                    plgpu.SMEM((2, d), dt)))
  scratch.append((
      plgpu.Barrier(num_arrivals=3 if append else 1, num_barriers=2 if persistent else 1),
      plgpu.Barrier(num_arrivals=pps, num_barriers=cfg.stages),
      plgpu.Barrier(num_arrivals=pps, num_barriers=cfg.stages),
  ))
  common = dict(tq=tq, group=g, page=page, pages_per_step=pps, steps_per_page=spp,
                stages=cfg.stages,
                scale=sm_scale, split_out=split_out, fp8=fp8, swap=cfg.swap_ab,
                io_rows=_io_rows(q_rows), store_rows=min(rows, _io_rows(tq * g)))
  if persistent:
    grid_size = min(n_items, _num_sms() * cfg.blocks_per_sm)
    body = functools.partial(_persistent_kernel, dims=(b, hkv, splits, tiles),
                             grid_size=grid_size, **common)
    grid, names = (grid_size,), ("c",)
  else:
    body = functools.partial(_mosaic_kernel, splits=splits, stage_out=stage_out,
                             append=append, tile_rows=n, **common)
    grid, names = (b, hkv, splits, tiles), ("b", "h", "s", "r")
  out = dsl.kernel(
      body,
      out_type=out_type,
      grid=grid,
      grid_names=names,
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, page_table, layer_arr, qp, k_pages, v_pages, *([kv_scales] if fp8 else []),
    *([rope] if append else []))
  if split_out:
    o_parts, lse = out
    return _combine(o_parts, lse)
  return out


def _combine(o_parts, lse):
  """Merges split partials (o_s normalized, lse_s in log2 units):
  o = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max_s lse_s).

  Up to ``_UNROLLED_SPLITS`` splits it is written as elementwise terms, not
  as reductions over the split axis, so that XLA emits loop kernels, and
  every term at the output's shape (lse broadcast over D first): a weight
  needed at two shapes is materialized by a kernel of its own. On the H200
  (bench/results/decode_merge_pack_h200/) 16 splits merge in one
  kernel of 1.6 us, against 2.5 us in two kernels with the weights at lse's
  shape (and 3.1 us as reductions, 4.9 us as one pairwise-merge reduction)."""
  lse = jnp.broadcast_to(lse[..., None], o_parts.shape)
  if lse.shape[0] > _UNROLLED_SPLITS:  # a program the size of the split count is not worth it
    mx = lse.max(axis=0)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp2(lse - safe[None])
    den, num = w.sum(axis=0), (w * o_parts).sum(axis=0)
  else:
    parts = range(lse.shape[0])
    mx = functools.reduce(jnp.maximum, [lse[s] for s in parts])
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)  # no key in any split: all weights 0
    w = [jnp.exp2(lse[s] - safe) for s in parts]
    den = functools.reduce(jnp.add, w)
    num = functools.reduce(jnp.add, [w[s] * o_parts[s] for s in parts])
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


_UNROLLED_SPLITS = 64


# --------------------------------------------------------------------------
# Public wrappers, validation


def _check(q, k_pages, v_pages, lengths, page_table, layer=None, kv_scales=None):
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("lengths", lengths),
                  ("page_table", page_table)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, Hq, D], got {q.shape=}")
  if layer is None and k_pages.ndim != 4:
    raise ValueError(f"k_pages must be [Hkv, num_pages, page_size, D] (or the whole "
                     f"[layers, Hkv, ...] stack with layer=), got {k_pages.shape=}")
  if layer is not None:
    if k_pages.ndim != 5:
      raise ValueError(f"with layer=, k_pages must be [layers, Hkv, num_pages, page_size, D], "
                       f"got {k_pages.shape=}")
    dsl.check_layer(layer, k_pages.shape[0])
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}")
  b, tq, hq, d = q.shape
  hkv, _, page, dk = k_pages.shape[-4:]
  if dk != d:
    raise ValueError(f"head dims differ: {q.shape=} vs {k_pages.shape=}")
  if hkv == 0 or hq % hkv:
    raise ValueError(f"query heads must be a multiple of kv heads: {hq=}, {hkv=}")
  if not 1 <= tq <= MAX_TQ:
    raise ValueError(f"{tq=} (q.shape[1]) must be in [1, {MAX_TQ}]")
  if lengths.shape != (b,) or jnp.dtype(lengths.dtype) != jnp.int32:
    raise ValueError(f"lengths must be int32 [{b}], got {lengths.shape=} {lengths.dtype=}")
  if page_table.ndim != 2 or page_table.shape[0] != b or jnp.dtype(page_table.dtype) != jnp.int32:
    raise ValueError(f"page_table must be int32 [{b}, max_pages], got "
                     f"{page_table.shape=} {page_table.dtype=}")
  if page_table.shape[1] == 0 or page == 0:
    raise ValueError(f"need at least one page: {page_table.shape=}, {k_pages.shape=}")
  if jnp.dtype(q.dtype).name not in DTYPES:
    raise ValueError(f"q.dtype={jnp.dtype(q.dtype).name} is not supported; supported: {DTYPES}")
  fp8 = jnp.dtype(k_pages.dtype).name in FP8_DTYPES
  if k_pages.dtype != v_pages.dtype or not (fp8 or k_pages.dtype == q.dtype):
    raise ValueError(f"q, k_pages, v_pages must share a dtype (or the pages both be one of "
                     f"{FP8_DTYPES}): {q.dtype=}, {k_pages.dtype=}, {v_pages.dtype=}")
  if kv_scales is not None:
    if not fp8:
      raise ValueError(f"kv_scales apply to fp8 pages ({FP8_DTYPES}) only; the pages are "
                       f"{jnp.dtype(k_pages.dtype).name}")
    if not hasattr(kv_scales, "shape"):
      raise ValueError(f"kv_scales must be a float32 array, got {type(kv_scales).__name__}")
    ok = [(2,)] + ([(k_pages.shape[0], 2)] if layer is not None else [])
    if tuple(kv_scales.shape) not in ok or jnp.dtype(kv_scales.dtype) != jnp.float32:
      raise ValueError(f"kv_scales must be float32 (k_scale, v_scale) of shape "
                       f"{' or '.join(map(str, ok))}, got {kv_scales.shape} {kv_scales.dtype}")
  # Values, where they are known on the host (not traced, not on a GPU,
  # where reading them would wait for it): a page index outside the pages read
  # another page or garbage, differently per backend, and a negative length
  # read as 0.
  known = lambda x: (isinstance(x, np.ndarray) or (  # noqa: E731
      isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
      and all(d.platform == "cpu" for d in x.devices()))) and x.size
  num_pages = k_pages.shape[-3]
  if known(page_table):  # (np.asarray first: jnp's min would trace inside a jit)
    table = np.asarray(page_table)
    lo, hi = int(table.min()), int(table.max())
    if lo < 0 or hi >= num_pages:
      raise ValueError(f"page_table entries must be in [0, {num_pages}); got min {lo}, max {hi}")
  if known(lengths) and int(np.asarray(lengths).min()) < 0:
    raise ValueError(f"lengths must be >= 0; got {np.asarray(lengths).tolist()}")


def _scale(sm_scale, d) -> float:
  return float(d ** -0.5 if sm_scale is None else sm_scale)


def _scales_2d(k_pages, kv_scales):
  """float32 [L or 1, 2] (k_scale, v_scale) for fp8 pages (1.0 if not given), else None."""
  if jnp.dtype(k_pages.dtype).name not in FP8_DTYPES:
    return None
  if kv_scales is None:
    return jnp.ones((1, 2), jnp.float32)
  return jnp.asarray(kv_scales, jnp.float32).reshape(-1, 2)


def _dequantize(pages, scales, which: int, layer):
  """fp8 pages as float32 values times their scale (layer's row of [L, 2])."""
  x = pages.astype(jnp.float32)
  if scales is None:
    return x
  row = scales[0] if scales.shape[0] == 1 else dsl.take_layer(scales, layer)
  return x * row[which]


def quantize_pages(x, scale, dtype=FP8_DTYPES[0]):
  """x / scale as fp8 (saturating at +-FP8_MAX): what an fp8 cache stores; read
  back with ``kv_scales`` holding ``scale``."""
  if jnp.dtype(dtype).name not in FP8_DTYPES:
    raise ValueError(f"{dtype=} is not one of {FP8_DTYPES}")
  y = jnp.asarray(x, jnp.float32) / jnp.asarray(scale, jnp.float32)
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(dtype)


def fp8_scale(x) -> jax.Array:
  """The per-tensor scale that maps max|x| to the fp8 maximum (1 for all zeros)."""
  amax = jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)))
  return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def attention_decode_mosaic(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                            layer=None, kv_scales=None, config: Config | None = None):
  _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  why = _mosaic_supports(q, k_pages, v_pages, lengths, page_table, layer=layer,
                         kv_scales=kv_scales)
  if why:
    raise ValueError(f"attention_decode mosaic: {why}")
  return _attention_decode_mosaic(q, k_pages, v_pages, lengths, page_table, layer,
                                  _scales_2d(k_pages, kv_scales),
                                  sm_scale=_scale(sm_scale, q.shape[-1]), config=config)


def _mosaic_supports(q, k_pages, v_pages, lengths, page_table, *, layer=None, kv_scales=None,
                     **kwargs) -> str | None:
  del kwargs
  try:
    _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  except ValueError as e:
    return str(e)
  t = target_lib.current()
  if not (t.kind == "hopper" or dsl.interpreting()):
    return f"the kernel uses wgmma and TMA (Hopper); this target is {t.kind}"
  name = jnp.dtype(q.dtype).name
  if name not in KERNEL_DTYPES:
    return f"dtype {name} is not supported (supported: {', '.join(KERNEL_DTYPES)})"
  d = q.shape[-1]
  if d % 64 or d > 256:
    return f"head dim must be a multiple of 64 and <= 256, got {d}"
  page = k_pages.shape[-2]
  if page % 8 or page > 256:
    return f"page size must be a multiple of 8 and <= 256, got {page}"
  return None


# --------------------------------------------------------------------------
# Pallas Triton paged kernel (a baseline; the layout of jax's paged_attention)


def _triton_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                   tq: int, group: int, pages_per_block: int, blocks_per_split: int,
                   scale: float):
  from jax.experimental.pallas import triton as pltriton

  s = pl.program_id(2)
  rows, _ = q_ref.shape
  page = k_ref.shape[-2]
  block_k = pages_per_block * page
  length = lengths_ref[0]
  q = q_ref[...]
  row_ids = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
  col_ids = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
  first = s * blocks_per_split
  n_pages = (length + page - 1) // page
  n_blocks = jnp.clip((n_pages + pages_per_block - 1) // pages_per_block - first, 0,
                      blocks_per_split)

  def body(i, carry):
    o, m, l = carry
    pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
    k = k_ref[pages].reshape(block_k, -1)
    v = v_ref[pages].reshape(block_k, -1)
    x = pltriton.dot(q, k.T).astype(jnp.float32) * (scale * _LOG2E)
    start = (first + i) * block_k
    visible = (col_ids + (start - length + tq)) * group <= row_ids
    x = jnp.where(visible, x, -jnp.inf)
    m_new = jnp.maximum(m, x.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(x - m_new[:, None])
    l = l * alpha + p.sum(axis=-1)
    o = o * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
    return o, m_new, l

  init = (jnp.zeros(q_ref.shape, jnp.float32), jnp.full((rows,), _M_INIT, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  o, m, l = lax.fori_loop(0, n_blocks, body, init)
  o_ref[...] = o
  m_ref[...] = jnp.where(l > 0, m, -jnp.inf)
  l_ref[...] = l


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("sm_scale", "splits", "pages_per_block",
                                             "num_warps", "num_stages"))
def _attention_decode_triton(q, k_pages, v_pages, lengths, page_table, sm_scale: float,
                             splits: int = 0, pages_per_block: int = 0, num_warps: int = 4,
                             num_stages: int = 2):
  from jax.experimental.pallas import triton as pltriton

  b, tq, hq, d = q.shape
  hkv, _, page, _ = k_pages.shape
  g = hq // hkv
  rows = max(16, _pow2(tq * g))
  ppb = pages_per_block or max(1, 128 // page)
  n_blocks = dsl.cdiv(page_table.shape[1], ppb)
  if not splits:
    splits = max(1, min(n_blocks, _num_sms() * 2 // (b * hkv)))
  # Triton blocks are powers of two: so is each split's slice of the table.
  bps = _pow2(dsl.cdiv(n_blocks, min(splits, n_blocks)))
  splits = dsl.cdiv(n_blocks, bps)
  table = jnp.pad(page_table, ((0, 0), (0, splits * bps * ppb - page_table.shape[1])))
  table = table.reshape(b, splits, bps * ppb)
  lengths = jnp.minimum(lengths, page_table.shape[1] * page)
  qp = q.reshape(b, tq, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tq * g, d)
  qp = jnp.pad(qp, ((0, 0), (0, 0), (0, rows - tq * g), (0, 0)))
  total_pages = k_pages.shape[1]
  kernel = functools.partial(_triton_kernel, tq=tq, group=g, pages_per_block=ppb,
                             blocks_per_split=bps, scale=sm_scale)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, hkv, splits),
      in_specs=[
          pl.BlockSpec((None, 1), lambda i, h, s: (i, 0)),
          pl.BlockSpec((None, None, bps * ppb), lambda i, h, s: (i, s, 0)),
          pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((None, total_pages, page, d), lambda i, h, s: (h, 0, 0, 0)),
          pl.BlockSpec((None, total_pages, page, d), lambda i, h, s: (h, 0, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, d), lambda i, h, s: (s, i, h, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
          pl.BlockSpec((None, None, None, rows), lambda i, h, s: (s, i, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((splits, b, hkv, rows, d), jnp.float32),
          jax.ShapeDtypeStruct((splits, b, hkv, rows), jnp.float32),
          jax.ShapeDtypeStruct((splits, b, hkv, rows), jnp.float32),
      ],
      interpret=dsl.interpreting(),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name="paged_decode_attention",
  )(lengths[:, None], table, qp, k_pages, v_pages)
  # Per split: o unnormalized, running max m (log2 units), sum l.
  mx = m.max(axis=0)
  safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
  w = jnp.exp2(m - safe[None])
  den = (w * l).sum(axis=0)
  num = (w[..., None] * o).sum(axis=0)
  out = jnp.where((den > 0)[..., None], num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
  return _unpack_o(out, tq, hq).astype(q.dtype)


def attention_decode_triton(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                            layer=None, kv_scales=None, splits: int = 0, pages_per_block: int = 0):
  """Pallas Triton paged attention. With ``layer=``, the layer's pages are
  sliced out of the stack first (a copy: Triton block specs cannot take a
  run-time layer index)."""
  _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  why = _triton_supports(q, k_pages, v_pages, lengths, page_table, layer=layer,
                         kv_scales=kv_scales)
  if why:
    raise ValueError(f"attention_decode triton: {why}")
  return _attention_decode_triton(q, dsl.take_layer(k_pages, layer), dsl.take_layer(v_pages, layer), lengths,
                                  page_table, _scale(sm_scale, q.shape[-1]), splits,
                                  pages_per_block)


def _triton_supports(q, k_pages, v_pages, lengths, page_table, *, layer=None, kv_scales=None,
                     **kwargs) -> str | None:
  del kwargs
  try:
    _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  except ValueError as e:
    return str(e)
  if jnp.dtype(k_pages.dtype).name in FP8_DTYPES:
    return "fp8 pages are read by the mosaic, xla and reference backends, not this baseline"
  t = target_lib.current()
  if t.kind == "cpu" and not dsl.interpreting():
    return "Pallas Triton needs a CUDA GPU"
  d, page = q.shape[-1], k_pages.shape[-2]
  if d < 16 or d & (d - 1):
    return f"head dim must be a power of two >= 16, got {d}"
  if page < 16 or page & (page - 1):
    return f"page size must be a power of two >= 16, got {page}"
  return None


# --------------------------------------------------------------------------
# XLA (gather + softmax) and the float32 reference


def _gather(pages, page_table):
  """[Hkv,P,page,D] x [B,max_pages] -> [B,Hkv,max_pages*page,D]."""
  hkv, _, page, d = pages.shape
  b, mp = page_table.shape
  x = jnp.take(pages, page_table.reshape(-1), axis=1)  # [Hkv, B*mp, page, D]
  return x.reshape(hkv, b, mp * page, d).transpose(1, 0, 2, 3)


def _visible(lengths, tq, n):
  """[B,Tq,n]: query t of sequence b sees key j iff j <= lengths[b] - tq + t."""
  qpos = lengths[:, None] - tq + jnp.arange(tq)[None, :]
  return jnp.arange(n)[None, None, :] <= qpos[:, :, None]


def _attend(q, k, v, lengths, scale, compute_dtype):
  b, tq, hq, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  qg = q.reshape(b, tq, hkv, g, d).astype(compute_dtype)
  s = jnp.einsum("bthgd,bhnd->bhgtn", qg, k.astype(compute_dtype),
                 preferred_element_type=jnp.float32) * scale
  vis = _visible(lengths, tq, k.shape[2])[:, None, None]
  s = jnp.where(vis, s, -jnp.inf)
  mx = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
  den = p.sum(axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)  # a row that sees nothing stays 0
  o = jnp.einsum("bhgtn,bhnd->bthgd", p.astype(compute_dtype), v.astype(compute_dtype),
                 preferred_element_type=jnp.float32)
  return o.reshape(b, tq, hq, d)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _attention_decode_xla(q, k_pages, v_pages, lengths, page_table, scales=None, layer=None,
                          sm_scale: float = 1.0):
  cap = page_table.shape[1] * k_pages.shape[2]
  lengths = jnp.minimum(lengths, cap)
  k = _gather(k_pages, page_table)
  v = _gather(v_pages, page_table)
  if scales is not None:  # fp8: dequantized in the gathered copy
    k = _dequantize(k, scales, 0, layer).astype(q.dtype)
    v = _dequantize(v, scales, 1, layer).astype(q.dtype)
  return _attend(q, k, v, lengths, sm_scale, q.dtype).astype(q.dtype)


def attention_decode_xla(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                         layer=None, kv_scales=None):
  _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  return _attention_decode_xla(q, dsl.take_layer(k_pages, layer), dsl.take_layer(v_pages, layer),
                               lengths, page_table, _scales_2d(k_pages, kv_scales), layer,
                               _scale(sm_scale, q.shape[-1]))


def attention_decode_reference(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None,
                               layer=None, kv_scales=None):
  """The meaning of the op, in float32 (the result stays float32); fp8 pages
  mean their values times kv_scales."""
  _check(q, k_pages, v_pages, lengths, page_table, layer, kv_scales)
  scales = _scales_2d(k_pages, kv_scales)
  k_pages, v_pages = dsl.take_layer(k_pages, layer), dsl.take_layer(v_pages, layer)
  cap = page_table.shape[1] * k_pages.shape[2]
  lengths = jnp.minimum(jnp.asarray(lengths), cap)
  k = _gather(_dequantize(k_pages, scales, 0, layer), page_table)
  v = _gather(_dequantize(v_pages, scales, 1, layer), page_table)
  return _attend(jnp.asarray(q, jnp.float32), k, v, lengths, _scale(sm_scale, q.shape[-1]),
                 jnp.float32)


def contiguous_to_paged(k, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                        seed: int = 0):
  """[B,S,Hkv,D] -> (pages [Hkv,P,page,D], page_table [B,cdiv(S,page)]).

  Pages are handed out in a random order (page 0 stays the reserved null
  page), the layout a long-running engine ends up with; for tests and
  benchmarks.
  """
  b, s, hkv, d = k.shape
  mp = dsl.cdiv(s, page_size)
  need = b * mp + 1
  num_pages = num_pages or need
  if num_pages < need:
    raise ValueError(f"{num_pages=} is too small for {b=} x {mp} pages + the null page")
  perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[:b * mp]
  table = perm.reshape(b, mp).astype(np.int32)
  x = jnp.pad(k, ((0, 0), (0, mp * page_size - s), (0, 0), (0, 0)))
  x = x.reshape(b * mp, page_size, hkv, d).transpose(2, 0, 1, 3)
  pages = jnp.zeros((hkv, num_pages, page_size, d), k.dtype)
  pages = pages.at[:, jnp.asarray(table.reshape(-1))].set(x)
  return pages, jnp.asarray(table)


# --------------------------------------------------------------------------
# Registration

op = registry.op("attention_decode", "paged decode attention (GQA, Tq <= 8, split-K)")
op.register("mosaic", attention_decode_mosaic, supports=_mosaic_supports,
            doc="Mosaic GPU: GQA-packed wgmma rows, TMA page ring, split-K")
op.register("triton", attention_decode_triton, supports=_triton_supports,
            doc="Pallas Triton paged kernel with split-K")
op.register("xla", attention_decode_xla, supports=lambda *a, **k: _try_check(*a, **k),
            doc="gather pages + softmax in jnp")
op.register("reference", attention_decode_reference,
            supports=lambda *a, **k: _try_check(*a, **k), doc="float32 jnp; output stays float32")
op.set_defaults(hopper=("mosaic", "triton", "xla"), blackwell=("triton", "xla"),
                cuda=("triton", "xla"), default=("xla",))


def _try_check(*args, layer=None, kv_scales=None, **kwargs) -> str | None:
  del kwargs
  try:
    _check(*args[:5], layer=layer, kv_scales=kv_scales)
  except (ValueError, TypeError) as e:
    return str(e)
  return None


def attention_decode(q, k_pages, v_pages, lengths, page_table, *, sm_scale=None, layer=None,
                     kv_scales=None, backend: str | None = None):
  """See the module docstring. ``layer``: when given, k_pages/v_pages are the
  whole cache stack [layers, Hkv, pages, page_size, D] and this layer's pages
  are attended (the Mosaic kernel reads them in place, no slice copy).
  ``kv_scales``: with fp8 pages, float32 (k_scale, v_scale), [2] or per layer
  [layers, 2]; the pages hold K / k_scale and V / v_scale (1.0 if not given)."""
  kw = {} if layer is None else {"layer": layer}
  if kv_scales is not None:
    kw["kv_scales"] = kv_scales
  return op(q, k_pages, v_pages, lengths, page_table, sm_scale=sm_scale, backend=backend, **kw)
