"""Scan interception for a whole-step ``jmem.remat`` (a function that differentiates inside):
while the wrapped function runs, every ``lax.scan`` it calls (``fori_loop``, ``nnx.scan``,
``flax.linen.scan`` included) is bound with its body checkpointed, *before* any ``jax.grad``
inside the function differentiates it.

``scan_p.bind`` and ``jit_p.bind`` are replaced only for the duration of the call (under a
lock, restored on exit and on exceptions; a ``bind`` replaced by someone else is refused).
The patched binds act only for the thread that runs the call; other threads pass through.
The JAX internals this relies on live in ``jmem._src.jax_compat``: ``lax.scan``'s and
``jax.jit``'s code objects (which frame binds), the autodiff trace types and a trace-context
config state. ``docs/remat.md`` lists them.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any
from typing import Callable

from jmem._src import jax_compat as _compat
from jmem._src import jaxpr as _jaxpr

_LOCAL = threading.local()
_PATCHES: dict = {"depth": 0}  # installed binds: depth, and per primitive the bind replaced
_CONTEXT = {}  # the trace-context config state, created on first use


class Interception:
    """One call of a ``jmem.remat``-wrapped function: how to rewrite a scan bind
    (``rewrite_scan(params, args)``) and a jit call holding unchecked scans
    (``rewrite_jit(params, args)``), the trace-cache ``key``, and the counts of
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


def context_state():
    """The config state holding the active remat configuration (part of JAX's trace-cache
    keys), or None where this JAX has none."""
    if "state" not in _CONTEXT:
        try:
            _CONTEXT["state"] = _compat.trace_context_state(
                "jmem_remat_context",
                "jmem.remat's active configuration (separates JAX's trace caches).",
            )
        except (TypeError, AttributeError):  # pragma: no cover - JAX without such states
            _CONTEXT["state"] = None
    return _CONTEXT["state"]


@contextlib.contextmanager
def intercepting(interception: Interception):
    """Within the block, scans bound by ``lax.scan`` (and jit calls holding unrewritten scans)
    on this thread go through ``interception``'s rewrite functions.

    Raises:
      RuntimeError: ``scan_p.bind`` or ``jit_p.bind`` was replaced by another library (two
        interceptions of one primitive cannot both be honoured).
    """
    state = context_state()
    _install()
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append(interception)
    try:
        with state(interception.key) if state is not None else contextlib.nullcontext():
            yield interception
    finally:
        stack.pop()
        _uninstall()


@contextlib.contextmanager
def busy(interception: Interception):
    """Binds inside the block (jmem's own rewriting) pass through unchanged."""
    prev, interception.busy = interception.busy, True
    try:
        yield
    finally:
        interception.busy = prev


@contextlib.contextmanager
def passthrough():
    """jmem's own binds inside the block (a jaxpr rewrite run while a whole-step remat
    intercepts on this thread) pass unchanged and count as rewrites of the active calls."""
    icp = _active()
    if icp is None:
        yield
        return
    for outer in _LOCAL.stack:
        outer.scans += 1
    with busy(icp):
        yield


def _install():
    with _compat.patch_lock():
        if _PATCHES["depth"] == 0:
            prims = (_compat.SCAN_P, _compat.JIT_P)
            foreign = [p.name for p in prims if "bind" in vars(p)]
            if foreign:
                raise RuntimeError(
                    f"jmem.remat: the bind of {foreign} was replaced by another library "
                    "(or a jmem.remat that did not exit); two interceptions of one primitive "
                    "cannot both be honoured. Run jmem.remat outside that library's context."
                )
            _PATCHES["codes"] = (_compat.scan_code(), _compat.jit_caller_codes())
            _PATCHES["scan"], _PATCHES["jit"] = _compat.SCAN_P.bind, _compat.JIT_P.bind
            _compat.SCAN_P.bind, _compat.JIT_P.bind = _scan_bind, _jit_bind
        _PATCHES["depth"] += 1


def _uninstall():
    with _compat.patch_lock():
        _PATCHES["depth"] -= 1
        if _PATCHES["depth"] == 0:  # the class's bind is visible again
            del _compat.SCAN_P.bind, _compat.JIT_P.bind


def installed() -> bool:
    """True while some thread runs a whole-step ``jmem.remat`` (the binds are replaced)."""
    return _PATCHES["depth"] > 0


def _inside_user_scan(frame, entry) -> bool:
    """True when a ``lax.scan`` call is on the stack above ``frame`` (up to ``entry``, the
    wrapper's frame): the bind comes from tracing another scan's body (a nested scan, left
    to the outer checkpoint)."""
    scan_code = _PATCHES["codes"][0]
    while frame is not None and frame is not entry:
        if frame.f_code is scan_code:
            return True
        frame = frame.f_back
    return False


def _scan_bind(*args, **params):
    icp = _active()
    if icp is None or icp.busy:
        return _PATCHES["scan"](*args, **params)
    caller = sys._getframe(1)
    if caller.f_code is not _PATCHES["codes"][0]:
        return _PATCHES["scan"](*args, **params)
    if _inside_user_scan(caller.f_back, icp.entry) and not _compat.differentiating():
        return _PATCHES["scan"](*args, **params)
    for outer in _LOCAL.stack:  # an inner jmem.remat's rewrite serves the outer ones too
        outer.scans += 1
    with busy(icp):
        return icp.rewrite_scan(params, list(args))


def _jit_bind(*args, **params):
    icp = _active()
    if icp is None or icp.busy:
        return _PATCHES["jit"](*args, **params)
    caller = sys._getframe(1)
    callers = _PATCHES["codes"][1]
    if callers and caller.f_code not in callers:
        return _PATCHES["jit"](*args, **params)
    closed = params.get("jaxpr")
    if (
        closed is None
        or _inside_user_scan(caller, icp.entry)
        or not _jaxpr.has_plain_scan(closed.jaxpr)
    ):
        return _PATCHES["jit"](*args, **params)
    for outer in _LOCAL.stack:
        outer.jits += 1
    with busy(icp):
        return icp.rewrite_jit(params, list(args))
