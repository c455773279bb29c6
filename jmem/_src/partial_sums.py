"""Per-device partial sums of a replicated ``jax.shard_map`` input's cotangent, summed
outside the body by the partitioner.

A ``shard_map`` (``check_vma=False``) that receives an array replicated over its manual
axes (``P()``: a layer's weights, gathered once at the body's entry) transposes to a
``psum`` of that array's cotangent inside the body. Instead, ``sinks`` passes one zero
slot per device of the manual axes (``[N, *w.shape]``, split over them) and ``attach``
sends the weight's cotangent inside the body to the device's slot: the cotangent leaves
the body split, and the sink's sum over its slots, outside, is the weight's cotangent, a
reduction the partitioner lowers to the collective the weight's own split asks for (a
reduce-scatter into an FSDP shard, as without the ``shard_map``). It also keeps
XLA:CPU's all-reduce promotion off the body's bf16 ``psum``, which it aborts on
("Invalid binary instruction opcode copy": the reducer's root is a sharding custom call).
Source: GSPMD (arXiv:2105.04663), partial results reduced by the partitioner.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = ["attach", "sink", "slots"]


def slots(mesh, axes) -> tuple[int, P]:
    """``(N, spec)``: the number of devices over the manual ``axes`` of ``mesh`` and the
    spec that gives each one slot of a ``[N, ...]`` sink (``P(axes)``; ``P()`` for none)."""
    axes = tuple(a for a in mesh.axis_names if a in set(axes))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return math.prod(int(sizes[a]) for a in axes), P(axes or None)


def sink(w: jax.Array, n: int, spec: P) -> jax.Array | None:
    """Zeros ``[n, *w.shape]`` in ``w``'s dtype, split as ``spec`` (one slot per device),
    whose cotangent summed over the slots is ``w``'s; None for a ``w`` that has no
    cotangent (integers: NF4 codes, keys) or a sink of one slot."""
    if n < 2 or not jnp.issubdtype(w.dtype, jnp.inexact):
        return None
    return _sink(w, n, spec)


def _sink(w, n, spec):
    @jax.custom_vjp
    def zeros(w):
        return jax.lax.with_sharding_constraint(jnp.zeros((n, *w.shape), w.dtype), spec)

    zeros.defvjp(lambda w: (zeros(w), None), lambda _, g: (_sum_slots(g).astype(w.dtype),))
    return zeros(w)


def _sum_slots(g: jax.Array) -> jax.Array:
    """``g``'s sum over its slots (axis 0) in its own dtype, as the partitioner reduces a
    gradient without the slots: ``jnp.sum`` adds bf16 in float32, and the reduce-scatter
    then moves float32, twice the bytes."""
    return jax.lax.reduce(g, jnp.zeros((), g.dtype), jax.lax.add, (0,))


@jax.custom_vjp
def attach(w: jax.Array, slot: jax.Array) -> jax.Array:
    """``w``, inside the ``shard_map`` body; its cotangent goes to ``slot`` (this device's
    ``[1, *w.shape]`` of a ``sink``) and none to ``w``, so the transpose has nothing to
    ``psum``."""
    return w


attach.defvjp(lambda w, slot: (w, None), lambda _, g: (None, g[None]))
