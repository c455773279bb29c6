"""Gradient accumulation over microbatches inside one jitted step.

The batch is split into ``microbatches`` equal slices along its leading axis and a
``lax.scan`` runs the gradient function on one slice at a time, summing float32
gradients. Each microbatch loss is a mean over its examples, so the accumulated
gradient divided by ``microbatches`` equals the full-batch mean gradient (exactly in
real arithmetic; with per-token masks of different sizes it is the mean of means).
Activation memory is that of one microbatch.

Relation to ``optax.MultiSteps``: MultiSteps accumulates across *optimizer calls*, one
microbatch per jitted step, and keeps a params-sized accumulator in the optimizer state
between steps. Here the whole accumulation happens in one jitted step, the accumulator
is a temporary of that step, loss scaling is unscaled and checked once after
accumulation, and the optimizer, schedule and step count see one step per batch.
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src.tree import is_float_array


def split_microbatches(batch: Any, microbatches: int) -> Any:
    """Reshapes every leaf ``[B, ...]`` of ``batch`` to ``[microbatches, B // microbatches, ...]``.

    Raises:
      ValueError: if ``microbatches < 1`` or a leaf's leading size is not divisible by it.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}.")

    def split(x):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % microbatches:
            raise ValueError(
                f"Batch leaf of shape {x.shape} cannot be split into {microbatches} microbatches: "
                "its leading (batch) size must be divisible by `microbatches`."
            )
        return x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:])

    return jax.tree.map(split, batch)


def accumulate_gradients(
    grad_fn: Callable,
    params: Any,
    batch: Any,
    microbatches: int,
    *,
    accum_dtype=jnp.float32,
    maximum: Any = None,
):
    """Mean gradient over ``microbatches`` slices of ``batch``.

    Args:
      grad_fn: ``grad_fn(params, microbatch) -> (grads, aux)``, e.g.
        ``jax.grad(loss, has_aux=True)``; ``aux`` must be a pytree of scalars/arrays with
        the same structure for every microbatch.
      params: what ``grad_fn`` differentiates.
      batch: pytree of arrays with a leading batch axis divisible by ``microbatches``.
      microbatches: number of slices (1 calls ``grad_fn`` once, without a scan).
      accum_dtype: dtype of the gradient accumulator for floating-point gradients.
      maximum: optional pytree prefix of ``params`` with bools: subtrees marked True are
        combined by elementwise maximum over microbatches instead of averaged (FP8 scaling
        state, whose "gradient" is its new amax history: the step's amax is the max).

    Returns:
      ``(grads, aux)``: grads averaged over microbatches (in ``accum_dtype`` when
      ``microbatches > 1``), aux averaged likewise (floating leaves) or taken from the
      last microbatch (other leaves).

    Raises:
      ValueError: if the batch cannot be split (see ``split_microbatches``).
    """
    if microbatches == 1:
        return grad_fn(params, batch)
    mbs = split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], mbs)
    g_shape, aux_shape = jax.eval_shape(grad_fn, params, first)
    if maximum is None:
        maximum = False
    is_max = jax.tree.map(
        lambda m, sub: jax.tree.map(lambda _: bool(m), sub),
        maximum,
        g_shape,
        is_leaf=lambda x: isinstance(x, bool),
    )

    def zeros(s):
        dt = accum_dtype if is_float_array(s) else s.dtype
        return jnp.zeros(s.shape, dt)

    def init_leaf(s, m):
        if m:
            return jnp.full(
                s.shape,
                -jnp.inf if is_float_array(s) else jnp.iinfo(s.dtype).min,
                s.dtype,
            )
        return zeros(s)

    def combine(a, x, m):
        return jnp.maximum(a, x.astype(a.dtype)) if m else a + x.astype(a.dtype)

    def body(acc, mb):
        g_acc, aux_acc = acc
        g, aux = grad_fn(params, mb)
        g_acc = jax.tree.map(combine, g_acc, g, is_max)
        aux_acc = jax.tree.map(
            lambda a, x: a + x.astype(a.dtype) if is_float_array(a) else x,
            aux_acc,
            aux,
        )
        return (g_acc, aux_acc), None

    init = (jax.tree.map(init_leaf, g_shape, is_max), jax.tree.map(zeros, aux_shape))
    (g_sum, aux_sum), _ = jax.lax.scan(body, init, mbs)
    scale = 1.0 / microbatches
    mean = lambda x: x * scale if is_float_array(x) else x
    grads = jax.tree.map(lambda x, m: x if m else mean(x), g_sum, is_max)
    return grads, jax.tree.map(mean, aux_sum)
