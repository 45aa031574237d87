import logging

import pytest

from mosaic import registry


@pytest.fixture
def op():
  name = "toy_op_for_tests"
  registry._OPS.pop(name, None)
  o = registry.op(name, "doubles x")
  o.register("fast", lambda x: ("fast", 2 * x),
             supports=lambda x: None if x < 100 else "x must be < 100")
  o.register("slow", lambda x: ("slow", 2 * x))
  o.set_defaults(cpu=("fast", "slow"), default=("slow",))
  yield o
  registry._OPS.pop(name, None)


def test_default_order_skips_unsupported(op):
  assert op(3) == ("fast", 6)
  assert op(300) == ("slow", 600)


def test_explicit_choice_never_downgrades(op):
  assert op(3, backend="slow") == ("slow", 6)
  with pytest.raises(registry.BackendError, match="'fast' cannot run this call: x must be < 100"):
    op(300, backend="fast")


def test_unknown_name_lists_valid(op):
  with pytest.raises(registry.BackendError, match="unknown toy_op_for_tests backend 'tpu'; valid: fast, slow"):
    op(1, backend="tpu")
  with pytest.raises(registry.BackendError, match="valid: fast, slow"):
    with registry.use(toy_op_for_tests="tpu"):
      pass
  with pytest.raises(registry.BackendError, match="unknown op"):
    registry.get_op("no_such_op")


def test_context_and_env(op, monkeypatch):
  with registry.use(toy_op_for_tests="slow"):
    assert op(3)[0] == "slow"
    assert op(3, backend="fast")[0] == "fast"  # the argument wins
  assert op(3)[0] == "fast"
  monkeypatch.setenv(registry.env_var("toy_op_for_tests"), "slow")
  assert op(3)[0] == "slow"


def test_choice_is_logged(op, caplog):
  registry._LOGGED.clear()
  with caplog.at_level(logging.INFO, logger="mosaic.registry"):
    op(300)
  assert "using backend 'slow'" in caplog.text and "x must be < 100" in caplog.text


def test_no_backend_supports(op):
  op.set_defaults(cpu=("fast",), default=("fast",))
  with pytest.raises(registry.BackendError, match="no toy_op_for_tests backend supports"):
    op(300)


def test_duplicate_registration(op):
  with pytest.raises(registry.BackendError, match="registered twice"):
    op.register("fast", lambda x: x)


def test_describe_lists_real_ops():
  import kernels

  kernels.load_all()
  text = registry.describe()
  assert "rms_norm: backends mosaic, reference, xla; default on cpu: xla" in text


def test_plan_goes_to_the_backend_it_was_made_for():
  name = "toy_planned_op_for_tests"
  registry._OPS.pop(name, None)
  o = registry.op(name)
  calls = []
  o.register("planned", lambda x, plan=None: ("planned", x, plan),
             plan=lambda x: calls.append(x) or f"plan of {x}")
  o.register("plain", lambda x: ("plain", x))
  o.set_defaults(default=("planned", "plain"))
  try:
    p = o.plan(3)
    assert (p.op, p.backend, p.data) == (name, "planned", "plan of 3") and calls == [3]
    assert o(5, plan=p) == ("planned", 5, "plan of 3")  # the planned work is not redone
    assert o(5) == ("planned", 5, None)
    plain = o.plan(3, backend="plain")
    assert plain.data is None and o(5, backend="plain", plan=plain) == ("plain", 5)
    with pytest.raises(registry.BackendError, match="made for backend 'plain'.*runs 'planned'"):
      o(5, plan=plain)
    with pytest.raises(registry.BackendError, match="must be a Plan of this op"):
      o(5, plan="plan of 3")
    import jax

    assert jax.tree.leaves(p) == ["plan of 3"]  # a pytree: plans cross jit boundaries
  finally:
    registry._OPS.pop(name, None)


def test_a_plan_made_with_other_arguments_is_refused():
  """A plan describes one call (a mosaic prefill plan holds the masks' block
  ranges): used with other keyword arguments it gave another call's answer
  (a window's plan on an unwindowed call: rel. error 0.73). Arrays count by
  shape, so a traced positions array of the same shape passes."""
  import jax
  import jax.numpy as jnp

  name = "toy_planned_kwargs_op_for_tests"
  registry._OPS.pop(name, None)
  o = registry.op(name)
  o.register("planned", lambda x, plan=None, **kw: (x, plan, sorted(kw)),
             plan=lambda x, **kw: "plan")
  o.set_defaults(default=("planned",))
  try:
    pos = jnp.arange(4)
    p = o.plan(1, causal=True, window=8, positions=pos)
    assert o(2, plan=p, causal=True, window=8, positions=pos + 1)[1] == "plan"
    assert jax.jit(lambda q: o(2, plan=p, causal=True, window=8, positions=q)[1] == "plan")(pos)
    for kw, what in ((dict(causal=True, positions=pos), "window=8 there, None here"),
                     (dict(causal=False, window=8, positions=pos), "causal=True there, False here"),
                     (dict(causal=True, window=8, positions=jnp.arange(5)),
                      r"positions=\('array', \(4,\)\) there, \('array', \(5,\)\) here")):
      with pytest.raises(registry.BackendError, match="made with other arguments: " + what):
        o(2, plan=p, **kw)
  finally:
    registry._OPS.pop(name, None)


def test_a_mosaic_prefill_plan_is_checked_against_its_call():
  import jax.numpy as jnp

  import kernels
  from mosaic import testing

  kernels.load_all()
  q, k, v = testing.random_inputs([(1, 64, 2, 64)] * 3, "bfloat16")
  op = registry.get_op("attention_prefill")
  seg = jnp.ones((1, 64), jnp.int32)
  windowed = op.plan(q, k, v, backend="mosaic", causal=False, sliding_window=8)
  with pytest.raises(registry.BackendError, match="sliding_window=8 there, None here"):
    op(q, k, v, backend="mosaic", causal=False, plan=windowed)
  segmented = op.plan(q, k, v, backend="mosaic", q_segment_ids=seg, kv_segment_ids=seg)
  with pytest.raises(registry.BackendError, match="kv_segment_ids=.* there, None here"):
    op(q, k, v, backend="mosaic", plan=segmented)
