"""Jaxpr re-evaluation with a hook per equation (shared by remat, implicit and offload).

Re-evaluated equations keep their source information: each one is bound (and its rule
runs) under the equation's name stack (``jax.named_scope``, Flax module paths) and user
traceback, as ``jax.core.eval_jaxpr`` does, so profiles and HLO ``op_name`` metadata /
locations of a transformed program still show the model's scopes. This relies on
``JaxprEqn.source_info`` (``.name_stack``, ``.traceback``) and on
``jax._src.source_info_util`` (``current_name_stack``, ``user_context(traceback,
name_stack=...)``), private API stable since JAX 0.3; where it is missing the equation is
bound without source information (as before), never with an error.
"""

from __future__ import annotations

import contextlib
from typing import Any
from typing import Callable

from jax.extend import core as jcore

try:  # private: see the module docstring.
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - a JAX without it binds without source info
    _siu = None


def eqn_context(eqn, prefix=None):
    """A context manager binding under ``eqn``'s source information.

    Args:
      eqn: a ``JaxprEqn``.
      prefix: an optional ``NameStack`` placed between the current name stack and the
        equation's own (the name stack of an enclosing call that was inlined).

    Returns:
      ``user_context(eqn.source_info.traceback, name_stack=current + prefix + eqn's)``,
      or a null context where JAX lacks that API.
    """
    info = getattr(eqn, "source_info", None)
    if _siu is None or info is None:
        return contextlib.nullcontext()
    try:
        stack = _siu.current_name_stack()
        if prefix is not None:
            stack = stack + prefix
        stack = stack + info.name_stack
        return _siu.user_context(info.traceback, name_stack=stack)
    except (AttributeError, TypeError):  # pragma: no cover - another JAX's private API
        return contextlib.nullcontext()


def name_stack_of(eqn, prefix=None):
    """``prefix + eqn``'s name stack (the prefix for the equations of an inlined call body),
    or ``prefix`` where JAX lacks that API."""
    info = getattr(eqn, "source_info", None)
    stack = getattr(info, "name_stack", None)
    if stack is None:
        return prefix
    try:
        return stack if prefix is None else prefix + stack
    except TypeError:  # pragma: no cover
        return prefix


def bind_eqn(eqn, invals):
    """Binds ``eqn``'s primitive on new inputs, as ``jax.core.eval_jaxpr`` does (the caller
    sets the source information, see ``eqn_context``)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)


def eval_jaxpr(jaxpr, consts, args, eval_eqn: Callable[[Any, list], Any]) -> list:
    """Evaluates ``jaxpr`` on ``consts``/``args``; ``eval_eqn(eqn, invals)`` computes each
    equation's output (a list when the primitive has multiple results), under the
    equation's name stack and traceback (``eqn_context``)."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        with eqn_context(eqn):
            outs = eval_eqn(eqn, [read(v) for v in eqn.invars])
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]
