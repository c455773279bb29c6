"""``bits_checkpoint``: the ``full`` remat of a scan step whose saved carry keeps its 16-bit
floats as same-width unsigned integers; ``policy_bits_checkpoint``: the remat of a scan step
under a saving policy (``dots``, ``selective``, names) whose saved residuals do the same.

Why: a scan's saved carries are stacked ``[L, ...]`` and read back by a dynamic slice in the
backward loop. XLA:CPU computes a bfloat16 dynamic slice in float32 (``convert`` of the whole
stack, slice, ``convert`` back), and its loop-invariant code motion then hoists the
``convert`` of the stack out of the loop: a float32 copy of every layer's input (24 GiB for
Llama-3.1-8B at 49,152 tokens). An integer stack is sliced as it is. The values are the same
bits, so the gradients are those of ``jax.checkpoint(step, policy=...)``. The residuals a
saving policy keeps (matmul outputs, named values) are stacked and sliced the same way.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class _Saved:
    """The residuals of a pullback (``jax.vjp``'s, flattened), 16-bit floats as bits, with
    what rebuilds it: the pullback's tree, the leaves' dtypes and the memory spaces of the
    step's inputs (their cotangents must be in the same space)."""

    leaves: list
    treedef: object = dataclasses.field(metadata=dict(static=True))
    dtypes: tuple = dataclasses.field(metadata=dict(static=True))
    spaces: tuple = dataclasses.field(metadata=dict(static=True))

    def pullback(self):
        leaves = [from_bits(b, d) for b, d in zip(self.leaves, self.dtypes)]
        return jax.tree.unflatten(self.treedef, leaves)


jax.tree_util.register_dataclass(
    _Saved, data_fields=["leaves"], meta_fields=["treedef", "dtypes", "spaces"]
)


def policy_bits_checkpoint(step: Callable, policy: Callable, prevent_cse: bool = False):
    """``jax.checkpoint(step, policy=policy)`` for a scan step ``step(consts, carry, x) ->
    (carry, ys)`` (lists) under a policy that saves values (``dots``, ``selective``, a
    names policy; not an offloading one), with the saved bfloat16/float16 residuals kept
    as ``uint16`` (the same bits), the saved carry too, and the step's other inputs kept
    as they are (a scan forwards those instead of stacking them).

    A custom VJP whose ``fwd`` is ``jax.vjp`` of the checkpointed step: its residuals are
    the pullback's, the values the policy saves, so the backward pass recomputes what the
    policy does not save, as ``jax.checkpoint`` would; gradients are the same.

    Returns:
      A function with ``step``'s signature and values, differentiable by its custom VJP
      (no forward-mode rule, as ``bits_checkpoint``).

    Source: the layout reason of ``bits_checkpoint`` (module docstring), applied to the
    residuals of ``jax.checkpoint``'s policies (JAX, ``ad_checkpoint``).
    """
    checkpointed = jax.checkpoint(step, policy=policy, prevent_cse=prevent_cse)

    @jax.custom_vjp
    def run(consts, carry, x):
        return checkpointed(consts, carry, x)

    def fwd(consts, carry, x):
        out, pullback = jax.vjp(checkpointed, consts, carry, x)
        leaves, treedef = jax.tree.flatten(pullback)
        inputs = jax.tree.leaves((consts, carry, x))
        own = {id(a) for a in jax.tree.leaves((consts, x))}  # a carry is stacked: as bits
        bits = [a if id(a) in own else to_bits(a) for a in leaves]
        spaces = tuple(getattr(jax.typeof(a), "memory_space", None) for a in inputs)
        dtypes = tuple(jnp.result_type(a) for a in leaves)
        return out, _Saved(bits, treedef, dtypes, spaces)

    def bwd(saved, g):
        cts = saved.pullback()(g)
        flat, tree = jax.tree.flatten(cts)
        return jax.tree.unflatten(tree, [_in_space(c, s) for c, s in zip(flat, saved.spaces)])

    run.defvjp(fwd, bwd)
    return run


def _in_space(ct, space):
    """``ct`` moved to the memory ``space`` of its primal (None: where it is)."""
    if space is None or getattr(jax.typeof(ct), "memory_space", None) == space:
        return ct
    return jax.device_put(ct, space)
