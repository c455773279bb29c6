"""``bits_checkpoint``: the ``full`` remat of a scan step whose saved carry keeps its 16-bit
floats as same-width unsigned integers.

Why: a scan's saved carries are stacked ``[L, ...]`` and read back by a dynamic slice in the
backward loop. XLA:CPU computes a bfloat16 dynamic slice in float32 (``convert`` of the whole
stack, slice, ``convert`` back), and its loop-invariant code motion then hoists the
``convert`` of the stack out of the loop: a float32 copy of every layer's input (24 GiB for
Llama-3.1-8B at 49,152 tokens). An integer stack is sliced as it is. The values are the same
bits, so the gradients are those of ``jax.checkpoint(step, policy=nothing_saveable)``.
"""

from __future__ import annotations

from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.float16): jnp.uint16}


def has_16bit_floats(dtypes: Sequence) -> bool:
    """True when any of ``dtypes`` is a 16-bit float (what ``bits_checkpoint`` changes)."""
    return any(jnp.dtype(d) in _BITS for d in dtypes)


def to_bits(a: jax.Array) -> jax.Array:
    """``a`` as same-width unsigned integers when it is a 16-bit float, else ``a``."""
    bits = _BITS.get(jnp.result_type(a))
    return a if bits is None else lax.bitcast_convert_type(a, bits)


def from_bits(b: jax.Array, dtype) -> jax.Array:
    """The inverse of :func:`to_bits` for an array of ``dtype``."""
    return b if jnp.result_type(b) == jnp.dtype(dtype) else lax.bitcast_convert_type(b, dtype)


def bits_checkpoint(step: Callable, carry_dtypes: Sequence) -> Callable:
    """``jax.checkpoint(step, policy=nothing_saveable)`` for a scan step
    ``step(consts, carry, x) -> (carry, ys)`` (lists), with the carry's bfloat16/float16
    arrays saved as ``uint16`` (the same bits): the backward pass recomputes the step from
    its saved inputs, as full remat does.

    Args:
      step: the scan step; ``consts``, ``carry`` and ``x`` are lists of arrays.
      carry_dtypes: the dtypes of ``carry``, in order.

    Returns:
      A function with ``step``'s signature and values, differentiable by its custom VJP.

    Source: Chen et al. 2016 (recompute each segment from its saved input); the layout
    reason is XLA:CPU's float normalization plus loop-invariant code motion (module docstring).
    """
    dtypes = [jnp.dtype(d) for d in carry_dtypes]

    @jax.custom_vjp
    def run(consts, carry, x):
        return step(consts, carry, x)

    def fwd(consts, carry, x):
        return step(consts, carry, x), (consts, [to_bits(c) for c in carry], x)

    def bwd(res, g):
        consts, bits, x = res
        carry = [from_bits(b, d) for b, d in zip(bits, dtypes)]
        _, vjp = jax.vjp(step, consts, carry, x)
        return jax.tree.map(_in_space_of, vjp(g), (consts, carry, x))

    run.defvjp(fwd, bwd)
    return run


def _in_space_of(ct, primal):
    """The cotangent ``ct`` in the memory space of its ``primal`` (a host-resident input,
    e.g. a layer slice streamed by ``Levers(offload_params=True)``, gets a host cotangent:
    custom VJPs must return their inputs' types)."""
    space = getattr(jax.typeof(primal), "memory_space", None)
    if space is None or getattr(jax.typeof(ct), "memory_space", None) == space:
        return ct
    return jax.device_put(ct, space)
