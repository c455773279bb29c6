"""Skipping non-finite steps: the optimizer update runs only when the gradients are finite."""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src.tree import select_tree

#: ``update(grads, opt_state, params, **extra) -> (new_params, new_opt_state)``.
ParamUpdate = Callable[..., tuple[Any, Any]]


def _keep(grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    del grads
    return params, opt_state


def skip_if_nonfinite(update: ParamUpdate, *, select_inside: bool = False) -> Callable:
    """Wraps a param update so that a step whose ``finite`` flag is false changes nothing.

    The wrapped function is ``wrapped(grads, opt_state, params, finite)`` with ``finite`` a
    scalar bool array; it returns ``(params, opt_state)``, bitwise the inputs when
    ``finite`` is false. As ``optax.conditionally_transform``, the update runs in a
    ``jax.lax.cond`` branch rather than being computed and then discarded by a select: the
    state is then updated in place (a select of new and old values keeps the old state
    alive next to the new one, e.g. 15 GiB more temporaries for Llama-2-7B with
    ``optax.adamw``). XLA compiles the branch apart, so results can differ in the last bit
    from an unwrapped update.

    Args:
      update: ``update(grads, opt_state, params, **extra) -> (new_params, new_opt_state)``.
      select_inside: for an update whose state lives in host memory (``jmem.offload``): no
        ``cond``; ``update`` is called with ``skip=~finite`` and selects the state itself,
        on the device, where old and new state both are; the params are then selected here.

    Returns:
      ``wrapped(grads, opt_state, params, finite) -> (params, opt_state)``.

    Raises:
      TypeError: when traced, if the update returns params or a state whose types (tree
        structure, shapes, dtypes) differ from those it was given: a skipped step keeps the
        old ones, so they must match.
    """
    if select_inside:
        return lambda grads, opt_state, params, finite: _select_inside(
            update, grads, opt_state, params, finite
        )
    return lambda grads, opt_state, params, finite: _cond(update, grads, opt_state, params, finite)


def _select_inside(update, grads, opt_state, params, finite):
    new_params, new_state = update(grads, opt_state, params, skip=jnp.logical_not(finite))
    return select_tree(finite, new_params, params), new_state


def _cond(update, grads, opt_state, params, finite):
    try:
        return jax.lax.cond(finite, update, _keep, grads, opt_state, params)
    except TypeError as e:
        if "branch" not in str(e):
            raise
        raise TypeError(
            "train_step(skip_nonfinite=True): the optimizer's update returns params or a "
            "state whose types differ from those it was given (a skipped step keeps the "
            "old ones, so they must match; e.g. a state leaf whose dtype changes after "
            "the first step). Initialize the state in the dtypes the update returns, or "
            f"pass skip_nonfinite=False. JAX said: {e}"
        ) from e
