"""Skipping non-finite steps: an optax-style wrapper that runs the update only when finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jmem._src.tree import select_tree


def skip_if_nonfinite(
    inner: optax.GradientTransformation, *, select_inside: bool = False, select: bool = False
) -> optax.GradientTransformationExtraArgs:
    """Wraps a transformation whose update returns new params so a non-finite step is a no-op.

    ``inner.update(grads, state, params, **extra)`` must return ``(new_params, new_state)``
    (the train-step builder's convention: the optimizer with the update already applied).
    The wrapper's ``update(grads, state, params, *, finite, **extra)`` takes a scalar bool
    ``finite`` and returns ``(params, state)`` bitwise unchanged when it is false. As in
    ``optax.conditionally_transform``, the update runs in a ``jax.lax.cond`` branch instead
    of being computed and then discarded by a select: the state is then updated in place (a
    select of new and old values keeps the old state alive next to the new one: 15 GiB more
    temporaries for Llama-2-7B with ``optax.adamw``). XLA compiles the branch apart, so
    results can differ in the last bit from the unwrapped update.

    On a mesh (``select=True``) the cond is what costs memory: XLA:GPU's SPMD program
    copies every donated param and optimizer-state shard the cond passes through (a whole
    second copy of the sharded state as temporaries: 13.5 GB per device for Llama-2-7B,
    ZeRO-3 over 8 ``h100_sxm``, fp32 AdamW + masters; issue #39), while the select fuses
    into each leaf's update and writes it in place (docs/offload.md, "ZeRO-3 + offload, compiled").

    Args:
      inner: the transformation (its ``init`` is kept).
      select_inside: for a state in host memory (``jmem.offload``): no ``cond``; ``inner``
        is called with ``skip=~finite`` and selects the state itself, on the device where
        old and new state both are; the params are then selected here.
      select: no ``cond``: the update is computed and each new leaf selected against the old
        one (``jax.lax.select(finite, new, old)``); for a step on a mesh (see above).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: when traced, if ``inner`` returns params or a state whose types (tree
        structure, shapes, dtypes) differ from those it was given: a skipped step keeps
        the old ones, so they must match.
    """
    inner = optax.with_extra_args_support(inner)

    def update(grads, state, params=None, *, finite, **extra_args):
        if select_inside:
            new_params, new_state = inner.update(
                grads, state, params, skip=jnp.logical_not(finite), **extra_args
            )
            return select_tree(finite, new_params, params), new_state
        if select:
            new = inner.update(grads, state, params, **extra_args)
            _check_same_types(new, (params, state))
            return select_tree(finite, new, (params, state))
        return _cond(inner, finite, grads, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _cond(inner, finite, grads, state, params, extra_args):
    """``inner.update`` under ``lax.cond(finite, ...)``; the false branch keeps everything."""

    def apply(grads, state, params):
        return inner.update(grads, state, params, **extra_args)

    def keep(grads, state, params):
        del grads
        return params, state

    try:
        return jax.lax.cond(finite, apply, keep, grads, state, params)
    except TypeError as e:
        if "branch" not in str(e):
            raise
        raise TypeError(_TYPES_DIFFER + f" JAX said: {e}") from e


_TYPES_DIFFER = (
    "train_step(skip_nonfinite=True): the optimizer's update returns params or a "
    "state whose types differ from those it was given (a skipped step keeps the "
    "old ones, so they must match; e.g. a state leaf whose dtype changes after "
    "the first step). Initialize the state in the dtypes the update returns, or "
    "pass skip_nonfinite=False."
)


def _check_same_types(new, old) -> None:
    """TypeError (``_TYPES_DIFFER``) unless ``new`` and ``old`` have one tree structure
    and each leaf's shape and dtype (what ``lax.cond`` checks for its branches)."""
    types = lambda t: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), t)
    if jax.tree.structure(new) != jax.tree.structure(old) or types(new) != types(old):
        raise TypeError(_TYPES_DIFFER)
