"""Skipping non-finite steps: an optax-style wrapper that runs the update only when finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jmem._src.targets import compile_platform
from jmem._src.tree import select_tree


def skip_if_nonfinite(
    inner: optax.GradientTransformation,
    *,
    select_inside: bool = False,
    select: bool | str = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps a transformation whose update returns new params so a non-finite step is a no-op.

    ``inner.update(grads, state, params, **extra)`` must return ``(new_params, new_state)``
    (the train-step builder's convention: the optimizer with the update already applied).
    The wrapper's ``update(grads, state, params, *, finite, **extra)`` takes a scalar bool
    ``finite`` and returns ``(params, state)`` bitwise unchanged when it is false.

    Two forms, as the compiler updates state in place: a ``jax.lax.cond`` around the update
    (as ``optax.conditionally_transform``; XLA:CPU keeps one state copy fewer with it), or
    the update followed by a per-leaf ``jax.lax.select(finite, new, old)`` that fuses into
    each leaf's update (XLA:GPU: the cond's branch copies every donated param and state
    leaf, a second state as temporaries). docs/mixed_precision.md has the figures.

    Args:
      inner: the transformation (its ``init`` is kept).
      select_inside: for a state in host memory (``jmem.offload``): no ``cond``; ``inner``
        is called with ``skip=~finite`` and selects the state itself, on the device where
        old and new state both are; the params are then selected here.
      select: ``True``: the per-leaf select; ``False``: the cond; ``"auto"``: the select
        when the program is compiled for a GPU or TPU (``compile_platform()`` at trace
        time), the cond for XLA:CPU.

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
        if uses_select(select):
            new = inner.update(grads, state, params, **extra_args)
            _check_same_types(new, (params, state))
            return select_tree(finite, new, (params, state))
        return _cond(inner, finite, grads, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def uses_select(select: bool | str) -> bool:
    """Whether ``skip_if_nonfinite(select=select)`` selects (else: a ``lax.cond``), decided
    while tracing: ``"auto"`` selects unless the program compiles for XLA:CPU."""
    if select == "auto":
        return compile_platform() != "cpu"
    return bool(select)


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
