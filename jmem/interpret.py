"""Re-evaluating a jaxpr with custom rules: the shared core of ``jmem.remat`` (which wraps
scan bodies in ``jax.checkpoint``) and ``jmem.implicit`` (which swaps matmuls against NF4 /
LoRA weights). The same walk as ``jax.core.eval_jaxpr``, with a hook per equation.

Also :func:`zero_after`, the ordering dependency used by the quantized optimizers, which
jaxpr rewriters (``jmem.offload`` leaf by leaf) recognize by :data:`ZERO_AFTER_NAME`.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

ZERO_AFTER_NAME = "_jmem_zero_after"


def _jmem_zero_after(*arrays):
    total = sum(jnp.max(a[:, 0]).astype(jnp.float32) for a in arrays)
    return total * jnp.float32(0.0)


_zero_after = jax.jit(_jmem_zero_after)
assert _jmem_zero_after.__name__ == ZERO_AFTER_NAME


def zero_after(*arrays: jax.Array) -> jax.Array:
    """A float32 ``+0.0`` that data-depends on ``arrays``; folding it into another input
    (the quantized optimizers OR it, cast to ``uint8``, into the next codes) orders work.

    XLA:CPU drops ``jax.lax.optimization_barrier`` before scheduling, so only a real data
    dependency makes one computation wait for another there. ``0 * x`` is not folded by XLA
    for floats (it would be NaN for an infinite ``x``); here ``x`` is a converted integer, so
    the result is exactly ``+0.0``. It reads one column of each array (under sharding: a
    local reduction and a scalar all-reduce). It is a ``jit`` named :data:`ZERO_AFTER_NAME`,
    so a jaxpr rewriter can replace it by the literal 0 (``jmem.offload`` leaf by leaf, which
    orders the leaves itself).

    Args:
      arrays: integer arrays of rank 2 (e.g. ``uint8`` codes ``[num_blocks, width]``).

    Returns:
      float32 scalar ``0.0``.
    """
    return _zero_after(*arrays)


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
