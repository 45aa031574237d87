"""Ops x implementations, chosen by short name.

Every op (``rms_norm``, ``matmul``, ``attention_prefill``, ...) has several
implementations keyed by a short name (``mosaic``, ``xla``, ``triton``,
``cudnn``, ``reference``). A call resolves its implementation in this order:

1. ``backend=`` passed to the call;
2. ``use(op=name)`` context (what entry points set from their flags);
3. the environment variable ``MOSAIC_BACKEND_<OP>`` (e.g.
   ``MOSAIC_BACKEND_ATTENTION_PREFILL=cudnn``);
4. the op's ordered default list for the current target kind.

A name chosen explicitly (1-3) must support the call, else the call fails with
the implementation's reason: there is no silent downgrade. From the default
list the first implementation that supports the call wins. The choice is
logged once per (op, implementation, reason).

Each implementation carries ``supports(*args, **kwargs) -> str | None``:
``None`` when it can run the call, otherwise a sentence saying why not.

An implementation may also carry a planner: ``op.plan(*args, **kwargs)``
resolves the implementation as a call would and returns a ``Plan`` of what it
can compute once for calls of that shape (the arrays may be
jax.ShapeDtypeStruct; only what the plan needs must be real). A call inside a
loop then takes ``plan=`` and skips that work: FlashInfer's plan / run, so
that per-step metadata is not rebuilt in every layer. A plan made for another
implementation, or with other keyword arguments (arrays: other shapes), is
refused; one made for an implementation without a planner is ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from mosaic import target as target_lib

log = logging.getLogger("mosaic.registry")

SupportsFn = Callable[..., "str | None"]


class BackendError(ValueError):
  """An unknown backend name, or one that cannot run the call."""


@dataclasses.dataclass(frozen=True)
class Impl:
  op: str
  name: str
  fn: Callable[..., Any]
  supports: SupportsFn
  doc: str = ""
  planner: Callable[..., Any] | None = None  # (*args, **kwargs) -> plan data (a pytree)

  def why_not(self, *args, **kwargs) -> str | None:
    return self.supports(*args, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """What ``Op.plan`` precomputed, for one op's implementation (a pytree:
  ``data`` is its arrays, or None)."""

  op: str = dataclasses.field(metadata=dict(static=True))
  backend: str = dataclasses.field(metadata=dict(static=True))
  data: Any = None
  # The keyword arguments it was made with (_call_key): a call must pass the
  # same ones (arrays: the same shapes), or the plan describes another call.
  args: tuple = dataclasses.field(default=(), metadata=dict(static=True))


def _call_key(kwargs: dict) -> tuple:
  """A call's keyword arguments as a hashable key: values, and arrays (which
  may be traced) by their shape."""
  def one(v):
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if hasattr(v, "shape"):
      return ("array", tuple(v.shape))
    try:
      hash(v)
      return v
    except TypeError:
      return repr(v)
  return tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _always(*args, **kwargs) -> None:
  del args, kwargs
  return None


class Op:
  """One op: its implementations and its default order per target kind."""

  def __init__(self, name: str, doc: str = ""):
    self.name = name
    self.doc = doc
    self.impls: dict[str, Impl] = {}
    self.defaults: dict[str, tuple[str, ...]] = {}

  def register(
      self,
      name: str,
      fn: Callable[..., Any] | None = None,
      *,
      supports: SupportsFn | None = None,
      doc: str = "",
      plan: Callable[..., Any] | None = None,
  ):
    """Registers ``fn`` under ``name``; usable as a decorator. ``plan``: the
    implementation's planner (see ``Op.plan``); ``fn`` then takes ``plan=``."""

    def add(f: Callable[..., Any]):
      if name in self.impls:
        raise BackendError(f"{self.name}: backend {name!r} is registered twice")
      self.impls[name] = Impl(self.name, name, f, supports or _always, doc, plan)
      return f

    return add(fn) if fn is not None else add

  def set_defaults(self, **per_kind: Sequence[str]) -> None:
    """Default order per target kind, e.g. ``hopper=("mosaic", "xla")``.

    The key ``default`` applies to kinds not named.
    """
    for kind, names in per_kind.items():
      if kind != "default" and kind not in target_lib.KINDS:
        raise BackendError(f"{kind=} is not a target kind; valid: {target_lib.KINDS}")
      self.defaults[kind] = tuple(names)

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(sorted(self.impls))

  def get(self, name: str) -> Impl:
    try:
      return self.impls[name]
    except KeyError:
      raise BackendError(
          f"unknown {self.name} backend {name!r}; valid: {', '.join(self.names)}"
      ) from None

  def default_order(self, kind: str | None = None) -> tuple[str, ...]:
    kind = kind or target_lib.current().kind
    order = self.defaults.get(kind, self.defaults.get("default", ()))
    return tuple(n for n in order if n in self.impls)

  def explicit_choice(self, backend: str | None) -> str | None:
    if backend:
      return backend
    chosen = _CHOICES.get().get(self.name)
    if chosen:
      return chosen
    return os.environ.get(env_var(self.name)) or None

  def select(self, *args, backend: str | None = None, **kwargs) -> Impl:
    """Resolves the implementation for this call (see module docstring)."""
    explicit = self.explicit_choice(backend)
    if explicit is not None:
      impl = self.get(explicit)
      reason = impl.why_not(*args, **kwargs)
      if reason is not None:
        raise BackendError(f"{self.name} backend {explicit!r} cannot run this call: {reason}")
      _log_choice(self.name, explicit, "chosen explicitly")
      return impl
    rejected = []
    for name in self.default_order():
      impl = self.impls[name]
      reason = impl.why_not(*args, **kwargs)
      if reason is None:
        why = "default" + (f" (skipped {'; '.join(rejected)})" if rejected else "")
        _log_choice(self.name, name, why)
        return impl
      rejected.append(f"{name}: {reason}")
    raise BackendError(
        f"no {self.name} backend supports this call on {target_lib.current().kind}: "
        + ("; ".join(rejected) or f"no defaults; valid: {', '.join(self.names)}")
    )

  def plan(self, *args, backend: str | None = None, **kwargs) -> Plan:
    """The plan of the implementation this call would run (see module docstring)."""
    impl = self.select(*args, backend=backend, **kwargs)
    data = impl.planner(*args, **kwargs) if impl.planner is not None else None
    return Plan(self.name, impl.name, data, _call_key(kwargs))

  def __call__(self, *args, backend: str | None = None, plan: Plan | None = None, **kwargs):
    impl = self.select(*args, backend=backend, **kwargs)
    if plan is not None:
      if not isinstance(plan, Plan) or plan.op != self.name:
        raise BackendError(f"{self.name}: plan= must be a Plan of this op (from "
                           f"{self.name}.plan), got {plan!r:.80}")
      if plan.backend != impl.name:
        raise BackendError(f"{self.name}: the plan was made for backend {plan.backend!r}, "
                           f"but this call runs {impl.name!r}")
      if plan.args != _call_key(kwargs):  # (its masks and ranges would be another call's)
        made, now = dict(plan.args), dict(_call_key(kwargs))
        diff = sorted(k for k in made.keys() | now.keys() if made.get(k) != now.get(k))
        raise BackendError(f"{self.name}: the plan was made with other arguments: "
                           + "; ".join(f"{k}={made.get(k)!r} there, {now.get(k)!r} here"
                                       for k in diff))
      if impl.planner is not None:
        kwargs["plan"] = plan.data
    return impl.fn(*args, **kwargs)

  def __repr__(self) -> str:
    return f"Op({self.name!r}, backends={self.names})"


_OPS: dict[str, Op] = {}
_CHOICES: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar(
    "mosaic_backend_choices", default={}
)
_LOGGED: set[tuple[str, str, str]] = set()


def _log_choice(op: str, name: str, why: str) -> None:
  key = (op, name, why)
  if key not in _LOGGED:
    _LOGGED.add(key)
    log.info("%s: using backend %r (%s)", op, name, why)


def env_var(op: str) -> str:
  return f"MOSAIC_BACKEND_{op.upper()}"


def op(name: str, doc: str = "") -> Op:
  """Returns the op called ``name``, creating it on first use."""
  if name not in _OPS:
    _OPS[name] = Op(name, doc)
  elif doc and not _OPS[name].doc:
    _OPS[name].doc = doc
  return _OPS[name]


def get_op(name: str) -> Op:
  try:
    return _OPS[name]
  except KeyError:
    raise BackendError(f"unknown op {name!r}; valid: {', '.join(sorted(_OPS))}") from None


def ops() -> dict[str, Op]:
  return dict(_OPS)


@contextlib.contextmanager
def use(**choices: str | None) -> Iterator[None]:
  """Chooses backends for the ops named, e.g. ``use(attention_prefill="cudnn")``.

  Names are checked now, so a typo in a flag fails at start-up, not at the
  first call. ``None`` leaves an op on its default order.
  """
  for op_name, name in choices.items():
    if name is not None:
      get_op(op_name).get(name)
  merged = {**_CHOICES.get(), **{k: v for k, v in choices.items() if v is not None}}
  token = _CHOICES.set(merged)
  try:
    yield
  finally:
    _CHOICES.reset(token)


def describe() -> str:
  """One line per op: its backends and default order here."""
  kind = target_lib.current().kind
  lines = []
  for name in sorted(_OPS):
    o = _OPS[name]
    lines.append(f"{name}: backends {', '.join(o.names)}; default on {kind}: "
                 f"{', '.join(o.default_order(kind)) or '-'}")
  return "\n".join(lines)
