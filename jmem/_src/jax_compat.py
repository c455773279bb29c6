"""Every use of JAX internals (``jax._src``) in jmem, in one place, behind a version gate.

Each item names the public behaviour it stands in for; ``tests/test_jax_internals.py``
checks each assumption directly, so a JAX upgrade fails there first, with a message. On a
JAX outside ``CHECKED_RANGE`` (or one where an internal has moved), the first use of an
internal raises ``JaxInternalsError`` saying what to install; importing jmem never fails for
this. The primitives themselves come from the public ``jax.extend.core.primitives``.
Mechanism and list: ``docs/remat.md`` ("JAX internals this relies on").
"""

from __future__ import annotations

import contextlib
import threading

import jax
from jax.extend.core import primitives as _prims

#: JAX versions whose internals jmem was checked against: ``[low, high)``. Equal to the
#: ``jax`` range in ``pyproject.toml`` and run by ``.ci/run`` at both ends.
CHECKED_RANGE = ((0, 10, 2), (0, 11, 0))

_IMPORT_ERROR: Exception | None = None
try:
    # (0) the scan, jit and checkpoint primitives: public in jax.extend.core.primitives in
    #     JAX 0.10 (jit_p, remat_p; not in 0.8, where only scan_p is); else internal
    #     (jit_p was pjit_p before JAX 0.7).
    SCAN_P = _prims.scan_p
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import pjit as _pjit

    JIT_P = getattr(_prims, "jit_p", None) or getattr(_pjit, "jit_p", None) or _pjit.pjit_p
    REMAT_P = getattr(_prims, "remat_p", None) or _ad_checkpoint.remat_p

    # (1) source_info_util: name stacks of a re-evaluated equation (jax.named_scope, Flax
    #     module paths), as jax.core.eval_jaxpr keeps them; no public API binds under a
    #     given NameStack.
    # (2) config: a trace-context config state; the public jax.config cannot add a state
    #     that is part of JAX's trace-cache keys (jit bodies, cond branches).
    # (3) core.trace_ctx and ad.JVPTrace/LinearizeTrace: "is this traced under jax.grad
    #     right now"; no public API.
    # (4) loops.scan: lax.scan's implementation (its code object identifies its own bind).
    # (5) pjit: jax.jit's Python call path (its code objects identify a jit call's bind).
    from jax._src import config as _config
    from jax._src import core as _core
    from jax._src import source_info_util as _siu
    from jax._src.interpreters import ad as _ad
    from jax._src.lax.control_flow import loops as _loops
except (ImportError, AttributeError) as e:  # pragma: no cover - a JAX that moved them
    _IMPORT_ERROR = e
    SCAN_P = JIT_P = REMAT_P = None


class JaxInternalsError(RuntimeError):
    """A JAX internal jmem relies on is missing or this JAX version was not checked."""


def _version() -> tuple:
    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


_VERSION = _version()  # parsed once: check() runs for every re-evaluated equation


def _fmt(v: tuple) -> str:
    return ".".join(str(p) for p in v)


def check() -> None:
    """Raises ``JaxInternalsError`` unless this JAX is in ``CHECKED_RANGE`` with its internals
    where jmem expects them.

    Raises:
      JaxInternalsError: the installed JAX, the checked range and what to install.
    """
    low, high = CHECKED_RANGE
    installed = jax.__version__
    if _IMPORT_ERROR is not None or not low <= _VERSION < high:
        why = f": {_IMPORT_ERROR}" if _IMPORT_ERROR is not None else ""
        raise JaxInternalsError(
            f"jmem's remat and jaxpr rewriting use JAX internals checked on JAX "
            f">={_fmt(low)},<{_fmt(high)}; this is JAX {installed}{why}. Install a checked "
            f"version (pip install 'jax>={_fmt(low)},<{_fmt(high)}') or report the new JAX "
            "(tests/test_jax_internals.py says which assumption changed)."
        ) from _IMPORT_ERROR


# ---------------------------------------------------------------------------- (1) names


def name_context(source_info, prefix=None):
    """Binds under ``source_info``'s traceback and ``current + prefix + source_info``'s name
    stack (as ``jax.core.eval_jaxpr`` does for an equation); ``prefix`` is the name stack
    of an enclosing call that was inlined. A null context for ``source_info=None``."""
    if source_info is None:
        return contextlib.nullcontext()
    check()
    stack = _siu.current_name_stack()
    if prefix is not None:
        stack = stack + prefix
    return _siu.user_context(source_info.traceback, name_stack=stack + source_info.name_stack)


# ---------------------------------------------------------------------- (2) cache keys


def trace_context_state(name: str, help_text: str):
    """A config state (a context manager factory ``state(value)``) that is part of JAX's
    trace-cache keys, so code traced under different values is cached apart. Created once
    per process (a reloaded jmem finds the existing one)."""
    check()
    existing = getattr(_config, "config_states", {}).get(name)
    if existing is not None:
        return existing
    return _config.string_or_object_state(name, None, help_text, include_in_trace_context=True)


# ------------------------------------------------------------------------ (3) autodiff


def differentiating() -> bool:
    """True when the current trace is an autodiff trace (``JVPTrace``/``LinearizeTrace``):
    the code being traced is being differentiated right there."""
    check()
    kinds = tuple(k for k in (_ad.JVPTrace, getattr(_ad, "LinearizeTrace", None)) if k)
    return isinstance(_core.trace_ctx.trace, kinds)


def current_trace():
    """The trace that operations bind to right now (``core.trace_ctx.trace``): values
    computed under it may be reused only while it is the current one."""
    check()
    return _core.trace_ctx.trace


# ------------------------------------------------------------------- (4) (5) callers


def scan_code():
    """The code object of ``lax.scan``'s implementation: the frame that binds ``scan_p``."""
    check()
    import inspect  # noqa: PLC0415 - only here

    return inspect.unwrap(_loops.scan).__code__


def jit_caller_codes() -> tuple:
    """The code objects of ``jax.jit``'s Python call path that bind ``jit_p``."""
    check()
    names = ("_run_python_pjit", "_python_pjit_helper")
    return tuple(getattr(_pjit, n).__code__ for n in names if callable(getattr(_pjit, n, None)))


# ------------------------------------------------------------------ (6) custom_vjp


def custom_vjp_bwd(bwd):
    """The user's backward function held by a ``custom_vjp_call`` equation's ``bwd`` param
    (JAX wraps it in a ``linear_util.WrappedFun``, whose ``.f`` is the function)."""
    return getattr(bwd, "f", bwd)


# --------------------------------------------------------------------- (7) patching

_PATCH_LOCK = threading.RLock()


def patch_lock():
    """The lock under which jmem replaces and restores a primitive's ``bind``."""
    return _PATCH_LOCK


def backends_initialized() -> bool:
    """(6) xla_bridge: whether JAX has created its backends (and XLA:CPU its worker
    threads); ``jax.devices()`` would create them, and no public API asks without doing so.
    False when the internal is missing (the caller's check is advisory)."""
    try:
        from jax._src import xla_bridge  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a JAX that moved it
        return False
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if probe is not None else False


# ----------------------------------------------------------------- (8) memory spaces


def _space_of_kind(memory_kind: str | None):
    """The space ``jax.jit`` traces a buffer of ``memory_kind`` in (only ``pinned_host`` is
    ``Host``; ``unpinned_host`` is not addressable inside ``jit``)."""
    return jax.memory.Space.Host if memory_kind == "pinned_host" else jax.memory.Space.Device


def array_space_matches_sharding(x) -> bool:
    """Whether the abstract value ``jax.jit`` traces for ``x`` names the memory space of its
    sharding's memory kind (``float32<host>[...]`` for ``pinned_host``); True for
    non-arrays and arrays without a memory kind."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or kind is None:
        return True
    return getattr(jax.typeof(x), "memory_space", None) == _space_of_kind(kind)


def with_sharding_memory_space(x):
    """``x`` (a ``jax.Array``) with its abstract value's memory space set from its
    sharding's memory kind: the same buffers, no copy; ``x`` itself when they agree.

    ``jax.make_array_from_single_device_arrays`` (orbax's restore uses it) gives an array
    whose sharding is a ``SingleDeviceSharding(memory_kind="pinned_host")`` the *device*
    space (JAX 0.10.2's ``core.update_aval_with_sharding`` reads the memory kind of a
    ``NamedSharding`` only), so ``jax.jit`` traces it as a device value while its buffers
    are in host memory: a step compiled for it returns such leaves in device memory, and the
    next call aborts ("PjRtBuffer's memory kind does not match sharding's memory kind").
    Rebuilt as ``make_array_from_single_device_arrays`` builds a ``NamedSharding``'s array.
    """
    if array_space_matches_sharding(x):
        return x
    check()
    from jax._src import array as _array  # noqa: PLC0415 - only here

    aval = jax.typeof(x).update(memory_space=_space_of_kind(x.sharding.memory_kind))
    return _array.ArrayImpl(aval, x.sharding, list(x._arrays), committed=x.committed)
