"""``zero_after``: an exact-zero data dependency that orders work under XLA:CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
