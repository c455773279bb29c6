"""Scan interception for ``jmem.remat``: while a wrapped function runs, every ``lax.scan`` it
calls (``fori_loop``, ``nnx.scan``, ``flax.linen.scan`` included) is bound with its body
checkpointed, *before* any ``jax.grad`` inside the function differentiates it.

The JAX internals this relies on (checked for JAX 0.10; ``docs/remat.md`` lists them):

- ``jax._src.lax.control_flow.loops.scan_p`` is the scan primitive, and ``lax.scan``
  (``loops.scan``) binds it itself, once, after tracing the body. ``scan_p.bind`` is
  replaced by a pass-through that rewrites only binds whose caller is ``loops.scan``: the
  binds JAX makes while differentiating, transposing, batching or partially evaluating a
  scan come from its rules and pass unchanged.
- ``jax._src.pjit.jit_p`` (``pjit_p`` in older JAX) binds a ``jax.jit`` call from
  ``_run_python_pjit`` (``_python_pjit_helper`` in older JAX); a jitted function whose trace
  was cached before (so its scans were bound without the hook) is inlined and its scans
  rewritten (``RematInterpreter``).
- ``jax._src.config.string_or_object_state(..., include_in_trace_context=True)``: a config
  state holding the active remat configuration, so JAX's trace caches (``jax.jit`` bodies,
  ``cond`` branches) keep separate entries for code traced under ``jmem.remat`` and code
  traced without it: a jitted function first traced inside ``jmem.remat`` does not stay
  rematerialized when called elsewhere.
- ``jax._src.source_info_util.user_context``: keeps each equation's name stack when a
  jaxpr is re-evaluated.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any
from typing import Callable

from jax._src import config as _jax_config
from jax._src import core as _core
from jax._src import source_info_util as _siu
from jax._src.lax.control_flow import loops as _loops
from jax.extend import core as jcore

try:  # JAX >= 0.7 names the primitive jit_p; older pjit_p
    from jax._src.pjit import jit_p as _jit_p
except ImportError:  # pragma: no cover - older JAX
    from jax._src.pjit import pjit_p as _jit_p
from jax._src import pjit as _pjit_mod

_SCAN_P = _loops.scan_p
_SCAN_CODE = inspect.unwrap(_loops.scan).__code__
_JIT_CALLERS = tuple(
    getattr(_pjit_mod, n).__code__
    for n in ("_run_python_pjit", "_python_pjit_helper")
    if callable(getattr(_pjit_mod, n, None))
)
# the primitives' own binds (kept on them, so a reload of this module finds them again)
_ORIG_SCAN_BIND = _SCAN_P.__dict__.get("_jmem_original_bind", _SCAN_P.bind)
_ORIG_JIT_BIND = _jit_p.__dict__.get("_jmem_original_bind", _jit_p.bind)
_LOCAL = threading.local()
_INSTALLED = []


def _make_context_state():
    existing = getattr(_jax_config, "config_states", {}).get("jmem_remat_context")
    if existing is not None:  # this module imported again (reload, second copy of jmem)
        return existing
    try:
        return _jax_config.string_or_object_state(
            "jmem_remat_context",
            None,
            "jmem.remat's active configuration (separates JAX's trace caches).",
            include_in_trace_context=True,
        )
    except (TypeError, AttributeError):  # JAX without trace-context states
        return None


_CONTEXT_STATE = _make_context_state()


class Interception:
    """One call of a ``jmem.remat``-wrapped function: how to rewrite a scan bind
    (``rewrite_scan(params, args)``) and a jit call holding unchecked scans
    (``rewrite_jit(closed_jaxpr, args)``), the trace-cache ``key``, and the counts of
    scans and jit calls rewritten."""

    def __init__(self, rewrite_scan: Callable, rewrite_jit: Callable, key: Any, entry=None):
        self.rewrite_scan, self.rewrite_jit, self.key = rewrite_scan, rewrite_jit, key
        self.entry = entry  # the frame that runs the wrapped function: nesting counts below it
        self.busy = False
        self.scans = 0
        self.jits = 0


def _active() -> Interception | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def intercepting(interception: Interception):
    """Within the block, scans bound by ``lax.scan`` (and jit calls holding unrewritten scans)
    go through ``interception``'s rewrite functions."""
    _install()
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(interception)
    ctx = _CONTEXT_STATE(interception.key) if _CONTEXT_STATE is not None else _null()
    try:
        with ctx:
            yield interception
    finally:
        stack.pop()


@contextlib.contextmanager
def _null():
    yield


@contextlib.contextmanager
def busy(interception: Interception):
    """Binds inside the block (jmem's own rewriting) pass through unchanged."""
    prev, interception.busy = interception.busy, True
    try:
        yield
    finally:
        interception.busy = prev


def _inside_user_scan(frame, entry) -> bool:
    """True when a ``lax.scan`` call is on the stack above ``frame`` (up to ``entry``, the
    wrapper's frame): the bind comes from tracing another scan's body (a nested scan, left
    to the outer checkpoint)."""
    while frame is not None and frame is not entry:
        if frame.f_code is _SCAN_CODE:
            return True
        frame = frame.f_back
    return False


def _scan_bind(*args, **params):
    icp = _active()
    if icp is None or icp.busy:
        return _ORIG_SCAN_BIND(*args, **params)
    caller = sys._getframe(1)
    if caller.f_code is not _SCAN_CODE:
        return _ORIG_SCAN_BIND(*args, **params)
    if _inside_user_scan(caller.f_back, icp.entry) and not _differentiating():
        return _ORIG_SCAN_BIND(*args, **params)
    for outer in _LOCAL.stack:  # an inner jmem.remat's rewrite serves the outer ones too
        outer.scans += 1
    with busy(icp):
        return icp.rewrite_scan(params, list(args))


def _differentiating() -> bool:
    """True when the current trace is an autodiff trace (``JVPTrace``/``LinearizeTrace``):
    a scan bound under it inside another scan's body is differentiated *there* (e.g. a
    ``value_and_grad`` per microbatch inside a ``lax.scan`` over microbatches), so the
    outer scan's checkpoint cannot cover it and it is rewritten itself."""
    trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
    return type(trace).__name__ in ("JVPTrace", "LinearizeTrace")


def _jit_bind(*args, **params):
    icp = _active()
    if icp is None or icp.busy:
        return _ORIG_JIT_BIND(*args, **params)
    caller = sys._getframe(1)
    if _JIT_CALLERS and caller.f_code not in _JIT_CALLERS:
        return _ORIG_JIT_BIND(*args, **params)
    closed = params.get("jaxpr")
    if closed is None or _inside_user_scan(caller, icp.entry) or not has_plain_scan(closed.jaxpr):
        return _ORIG_JIT_BIND(*args, **params)
    for outer in _LOCAL.stack:
        outer.jits += 1
    with busy(icp):
        return icp.rewrite_jit(closed, list(args))


def _install():
    if not _INSTALLED:
        _SCAN_P._jmem_original_bind, _jit_p._jmem_original_bind = _ORIG_SCAN_BIND, _ORIG_JIT_BIND
        _SCAN_P.bind = _scan_bind
        _jit_p.bind = _jit_bind
        _INSTALLED.append(True)


def _is_custom_rule(eqn) -> bool:
    return eqn.primitive.name.startswith(("custom_vjp", "custom_jvp"))


def _body_is_checkpointed(eqn) -> bool:
    body = eqn.params["jaxpr"].jaxpr
    return any(e.primitive.name in ("checkpoint", "remat") for e in body.eqns)


def has_scan(jaxpr) -> bool:
    """True when ``jaxpr`` holds a scan, outside ``custom_vjp``/``custom_jvp`` bodies."""
    return _find_scan(jaxpr, lambda eqn: True)


def has_plain_scan(jaxpr) -> bool:
    """True when ``jaxpr`` holds a scan whose body is not checkpointed (outside custom rules)."""
    return _find_scan(jaxpr, lambda eqn: not _body_is_checkpointed(eqn))


def _find_scan(jaxpr, pred) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            if pred(eqn):
                return True
            continue
        if _is_custom_rule(eqn):
            continue  # their custom rules decide what is saved; left as they are
        if any(_find_scan(sub, pred) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def checkpoint_names(jaxpr, found: set | None = None) -> set:
    """The ``jax.ad_checkpoint.checkpoint_name`` names bound anywhere in ``jaxpr``."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and "name" in eqn.params:
            found.add(eqn.params["name"])
        for sub in jcore.jaxprs_in_params(eqn.params):
            checkpoint_names(sub, found)
    return found


def differentiates(jaxpr) -> bool:
    """True when ``jaxpr`` holds a backward pass (equations under a ``transpose`` name)."""
    for eqn in jaxpr.eqns:
        if "transpose" in str(eqn.source_info.name_stack):
            return True
        if any(differentiates(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def name_context(eqn):
    """The name stack and traceback ``eqn`` was traced under (as ``core.eval_jaxpr`` does)."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    return _siu.user_context(eqn.source_info.traceback, name_stack=name_stack)
