"""Every JAX internal jmem relies on (``jmem/_src/jax_compat.py``), checked directly, so a JAX
upgrade fails here first with a message naming what changed, instead of a remat that
silently saves nothing. Also the lifetime of the whole-step interception (installed only
during the call, restored on exit and on exceptions, per thread, refusing foreign patches).
"""

import sys
import threading

import jax
import jax.numpy as jnp
import pytest

import jmem
from jmem._src import jax_compat as compat
from jmem._src import jaxpr as core
from jmem._src import scan_intercept

WHAT = "JAX changed an internal jmem relies on ({}); update jmem/_src/jax_compat.py."


def _first_eqn(f, *args):
    """The first equation that is not a cast (``lax.cond`` casts its predicate first)."""
    eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
    return next(e for e in eqns if e.primitive.name != "convert_element_type")


def test_this_jax_is_in_the_checked_range():
    low, high = compat.CHECKED_RANGE
    compat.check()  # raises JaxInternalsError with the versions otherwise
    assert low <= compat._version() < high


def test_version_gate_raises_a_clear_error_outside_the_range(monkeypatch):
    monkeypatch.setattr(compat, "CHECKED_RANGE", ((0, 0, 1), (0, 0, 2)))
    with pytest.raises(compat.JaxInternalsError, match=r"checked on JAX >=0\.0\.1,<0\.0\.2"):
        compat.check()
    with pytest.raises(compat.JaxInternalsError, match="pip install"):
        jmem.remat(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0])(1.0)


def test_checkpoint_primitive_is_in_the_table():
    eqn = _first_eqn(jax.checkpoint(jnp.sin), 1.0)
    assert eqn.primitive is compat.REMAT_P, WHAT.format(f"jax.checkpoint binds {eqn.primitive}")
    assert core.kind(eqn) == core.CHECKPOINT, WHAT.format(
        f"jax.checkpoint's primitive is named {eqn.primitive.name!r}, not in jaxpr._KINDS"
    )


def test_jit_primitive_is_in_the_table():
    eqn = _first_eqn(jax.jit(jnp.sin), 1.0)
    assert eqn.primitive is compat.JIT_P, WHAT.format(f"jax.jit binds {eqn.primitive}")
    assert core.kind(eqn) == core.CALL, WHAT.format(f"jax.jit binds {eqn.primitive.name!r}")
    for key in ("jaxpr", "name", "inline", "keep_unused", "donated_invars"):
        assert key in eqn.params, WHAT.format(f"a jit equation has no {key!r} param")


def test_scan_cond_while_names_are_in_the_table():
    scan = _first_eqn(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0], 1.0)
    cond = _first_eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0)
    loop = _first_eqn(lambda x: jax.lax.while_loop(lambda c: c < 3, lambda c: c + 1, x), 1.0)
    assert scan.primitive is compat.SCAN_P and core.kind(scan) == core.SCAN, scan.primitive
    assert core.kind(cond) == core.COND, WHAT.format(f"lax.cond binds {cond.primitive.name!r}")
    assert core.kind(loop) == core.WHILE, WHAT.format(f"while_loop binds {loop.primitive.name!r}")


def _callers_of_bind(prim, fn, *args):
    """The code objects of the frames that call ``prim.bind`` while ``fn`` is traced."""
    seen, orig = [], prim.bind

    def spy(*a, **kw):
        seen.append(sys._getframe(1).f_code)
        return orig(*a, **kw)

    prim.bind = spy
    try:
        jax.make_jaxpr(fn)(*args)
    finally:
        del prim.bind
    return seen


def test_primitive_bind_is_a_class_attribute_an_instance_patch_shadows():
    """Interception sets ``bind`` on the primitive instance and deletes it to restore."""
    for prim in (compat.SCAN_P, compat.JIT_P):
        assert "bind" not in vars(prim), WHAT.format(f"{prim.name}.bind is an instance attribute")
        assert callable(type(prim).bind), WHAT.format("Primitive.bind is not a method")


def test_lax_scan_binds_the_scan_primitive_itself():
    """A bind whose caller is lax.scan's implementation is the one rewritten."""
    f = lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0]
    callers = _callers_of_bind(compat.SCAN_P, f, 1.0)
    assert callers == [compat.scan_code()], WHAT.format(
        f"lax.scan's scan_p.bind comes from {[c.co_name for c in callers]}, not loops.scan"
    )
    fori = lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 2, x)
    assert _callers_of_bind(compat.SCAN_P, fori, 1.0) == [compat.scan_code()], WHAT.format(
        "fori_loop with static bounds no longer binds a scan through lax.scan"
    )


def test_jit_binds_from_its_python_call_path():
    callers = _callers_of_bind(compat.JIT_P, lambda x: jax.jit(jnp.sin)(x), 1.0)
    assert compat.jit_caller_codes(), WHAT.format("jax.jit's Python call path was renamed")
    assert callers and all(c in compat.jit_caller_codes() for c in callers), WHAT.format(
        f"jit_p.bind is called from {[c.co_name for c in callers]}"
    )


def test_autodiff_trace_types():
    seen = {}

    def f(x):
        seen["grad"] = compat.differentiating()
        return jnp.sin(x)

    jax.grad(f)(1.0)
    assert seen["grad"], WHAT.format("the trace under jax.grad is not a JVPTrace/LinearizeTrace")
    jax.make_jaxpr(f)(1.0)
    assert not seen["grad"], WHAT.format("a plain trace counts as differentiating")
    jax.linearize(f, 1.0)
    assert seen["grad"], WHAT.format("the trace under jax.linearize is not an autodiff trace")


def test_trace_context_state_separates_jit_trace_caches():
    state = scan_intercept.context_state()
    assert state is not None, WHAT.format("config states in the trace context are gone")
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    call = jax.make_jaxpr(lambda x: f(x))  # the Python path (eager calls skip the check)
    call(1.0)
    with state(("test", 1)):
        call(1.0)
    call(1.0)
    assert len(traces) == 2, WHAT.format("a trace-context config state no longer keys jit caches")


def test_name_context_keeps_named_scopes_of_a_reevaluated_jaxpr():
    def f(x):
        with jax.named_scope("outer_scope"):
            return jnp.sin(x)

    closed = jax.make_jaxpr(f)(1.0)
    again = jax.make_jaxpr(
        lambda x: core.eval_jaxpr(closed.jaxpr, closed.consts, [x], core.bind_eqn)
    )(1.0)
    stack = str(again.jaxpr.eqns[0].source_info.name_stack)
    assert stack == "outer_scope", WHAT.format(f"re-evaluated name stack is {stack!r}")


def test_custom_vjp_equation_holds_the_users_bwd():
    def fwd(x):
        return jnp.sin(x), x

    def bwd(res, g):
        return (g * jnp.cos(res),)

    bwd.marker = "mine"
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(fwd, bwd)
    eqn = _first_eqn(f, 1.0)
    assert core.kind(eqn) == core.CUSTOM_VJP, eqn.primitive.name
    got = compat.custom_vjp_bwd(eqn.params.get("bwd"))
    assert getattr(got, "marker", None) == "mine", WHAT.format(
        f"a custom_vjp_call's bwd param is {type(eqn.params.get('bwd')).__name__} without .f"
    )


# ------------------------------------------------------- interception lifetime


def _step(p, x):
    def loss(p):
        h, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p)
        return jnp.sum(h)

    return jax.grad(loss)(p)


def _args():
    return jnp.ones((2, 4, 4)) * 0.1, jnp.ones((3, 4))


def test_interception_is_installed_only_during_the_call():
    assert "bind" not in vars(compat.SCAN_P) and not scan_intercept.installed()
    seen = {}

    def step(p, x):
        seen["during"] = "bind" in vars(compat.SCAN_P) and scan_intercept.installed()
        return _step(p, x)

    jax.jit(jmem.remat(step, "full"))(*_args())
    assert seen["during"]
    assert "bind" not in vars(compat.SCAN_P) and "bind" not in vars(compat.JIT_P)


def test_interception_is_restored_on_exceptions():
    def step(p, x):
        _step(p, x)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        jax.jit(jmem.remat(step, "full"))(*_args())
    assert not scan_intercept.installed() and "bind" not in vars(compat.SCAN_P)


def test_a_foreign_patch_is_refused_and_left_alone(monkeypatch):
    foreign = lambda *a, **kw: type(compat.SCAN_P).bind(compat.SCAN_P, *a, **kw)
    monkeypatch.setattr(compat.SCAN_P, "bind", foreign, raising=False)
    with pytest.raises(RuntimeError, match="replaced by another library"):
        jax.jit(jmem.remat(_step, "full"))(*_args())
    assert compat.SCAN_P.bind is foreign and not scan_intercept.installed()


def test_other_threads_are_not_intercepted():
    """While one thread runs a whole-step remat, another thread's scans bind unchanged."""
    started, release, out = threading.Event(), threading.Event(), {}

    def step(p, x):
        started.set()
        release.wait(30)
        return _step(p, x)

    t = threading.Thread(target=lambda: out.setdefault("r", jax.jit(jmem.remat(step))(*_args())))
    t.start()
    assert started.wait(30)
    plain = jax.make_jaxpr(_step)(*_args()).jaxpr
    release.set()
    t.join(60)
    assert "r" in out and core.has_plain_scan(plain)
    assert "remat" not in str(plain) and "checkpoint" not in str(plain)
    assert not scan_intercept.installed()


def test_current_trace_is_the_trace_operations_bind_to():
    seen = []

    def f(x):
        seen.append(compat.current_trace())
        return x * 2

    jax.jit(f)(1.0)
    jax.grad(f)(1.0)
    assert len(seen) == 2 and seen[0] is not seen[1], WHAT.format("core.trace_ctx.trace")
    assert compat.current_trace() is not seen[0], WHAT.format("core.trace_ctx.trace")


def test_backends_initialized_reports_started_backends():
    jax.devices()
    assert compat.backends_initialized(), WHAT.format("xla_bridge.backends_are_initialized")


def test_a_single_device_host_array_is_rebuilt_in_host_space_on_its_own_buffer():
    """``make_array_from_single_device_arrays`` (orbax's restore) types an array on a
    ``SingleDeviceSharding(memory_kind="pinned_host")`` in device space on JAX 0.10.2;
    ``with_sharding_memory_space`` gives it the host space, on the same buffer, and leaves
    an array whose type already agrees as it is."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.device_put(jnp.arange(8.0), host)
    assert jax.typeof(x).memory_space == jax.memory.Space.Host
    made = jax.make_array_from_single_device_arrays(x.shape, host, [x])
    fixed = compat.with_sharding_memory_space(made)
    assert compat.array_space_matches_sharding(fixed)
    assert jax.typeof(fixed).memory_space == jax.memory.Space.Host and fixed.sharding == host
    assert fixed.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    assert (fixed == x).all()
    assert compat.with_sharding_memory_space(x) is x
