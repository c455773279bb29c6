"""Jaxpr re-evaluation with a hook per equation (shared by remat, implicit and offload)."""

from __future__ import annotations

from typing import Any
from typing import Callable

from jax.extend import core as jcore


def bind_eqn(eqn, invals):
    """Binds ``eqn``'s primitive on new inputs, as ``jax.core.eval_jaxpr`` does."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)


def eval_jaxpr(jaxpr, consts, args, eval_eqn: Callable[[Any, list], Any]) -> list:
    """Evaluates ``jaxpr`` on ``consts``/``args``; ``eval_eqn(eqn, invals)`` computes each
    equation's output (a list when the primitive has multiple results)."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        outs = eval_eqn(eqn, [read(v) for v in eqn.invars])
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]
