"""Gradient accumulation over microbatches inside one jitted step.

The batch is split into ``microbatches`` equal slices along its leading axis and a
``lax.scan`` runs the gradient function on one slice at a time, summing float32
gradients. Activation memory is that of one microbatch.

Normalization: each microbatch loss is a mean over its own tokens (or examples), and
microbatch ``i`` is weighted by ``w_i = n_i / sum_j n_j``, ``n_i`` its count of unmasked
tokens (``sum(batch["mask"])`` of the slice) when the batch is a mapping with a ``"mask"``,
else ``w_i = 1 / microbatches``. Then ``sum_i w_i * mean_i = sum(loss * mask) / sum(mask)``
over the whole batch: the loss and gradient are those of one big batch (in real
arithmetic), not the mean of microbatch means, which would over-weight the tokens of a
microbatch with few unmasked tokens (e.g. 3 and 9 tokens of losses 1 and 2: the token mean
is 1.75, the mean of means 1.5).

Relation to ``optax.MultiSteps``: MultiSteps accumulates across *optimizer calls*, one
microbatch per jitted step, and keeps a params-sized accumulator in the optimizer state
between steps. Here the whole accumulation happens in one jitted step, the accumulator
is a temporary of that step, loss scaling is unscaled and checked once after
accumulation, and the optimizer, schedule and step count see one step per batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src.offload.params import host_zeros
from jmem._src.offload.params import in_host_space
from jmem._src.offload.params import streamed_to_host
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


def mask_count(microbatch: Any) -> jax.Array | None:
    """The number of unmasked tokens of a batch: float32 ``sum(batch["mask"])`` (less the
    tokens whose ``batch["targets"]`` is negative, PyTorch's ``ignore_index``, which the
    losses ignore), or None when ``batch`` is not a mapping with a ``"mask"`` (the default
    ``weight_fn``)."""
    if isinstance(microbatch, Mapping) and microbatch.get("mask") is not None:
        mask = jnp.asarray(microbatch["mask"], jnp.float32)
        targets = microbatch.get("targets")
        if targets is not None and getattr(targets, "shape", None) == mask.shape:
            mask = jnp.where(jnp.asarray(targets) < 0, 0.0, mask)
        return jnp.sum(mask)
    return None


def accumulate_gradients(
    grad_fn: Callable,
    params: Any,
    batch: Any,
    microbatches: int,
    *,
    accum_dtype=jnp.float32,
    maximum: Any = None,
    weight_fn: Callable | None = mask_count,
    key: jax.Array | None = None,
):
    """Gradient of the whole batch's loss, accumulated over ``microbatches`` slices of it.

    Args:
      grad_fn: ``grad_fn(params, microbatch) -> (grads, aux)``, e.g.
        ``jax.grad(loss, has_aux=True)``, where the loss is a mean over the microbatch's
        (unmasked) tokens; ``aux`` must be a pytree of scalars/arrays with the same
        structure for every microbatch.
      params: what ``grad_fn`` differentiates.
      batch: pytree of arrays with a leading batch axis divisible by ``microbatches``.
      microbatches: number of slices (1 calls ``grad_fn`` once, without a scan).
      accum_dtype: dtype of the gradient accumulator for floating-point gradients.
      maximum: optional pytree prefix of ``params`` with bools: subtrees marked True are
        combined by elementwise maximum over microbatches instead of averaged (FP8 scaling
        state, whose "gradient" is its new amax history: the step's amax is the max).
      weight_fn: ``weight_fn(microbatch) -> float scalar or None``, the count of elements
        the microbatch's loss averages over. Microbatch ``i`` is weighted by
        ``n_i / sum_j n_j`` (all weights 0 when the counts sum to 0), so the result is the
        gradient of the mean over all counted elements of the batch. The default,
        ``mask_count``, counts ``batch["mask"]`` (the ``mask`` of ``jmem.models.llama.loss_fn``
        and ``jmem.data``); None (from ``weight_fn`` or as ``weight_fn``) weights every
        microbatch ``1 / microbatches``.
      key: optional PRNG key: ``grad_fn`` is then called as ``grad_fn(params, microbatch,
        jax.random.fold_in(key, i))`` for microbatch ``i`` (``i = 0`` when
        ``microbatches == 1``), e.g. for dropout.

    Returns:
      ``(grads, aux)``: grads combined with those weights (in ``accum_dtype`` when
      ``microbatches > 1``), aux combined likewise (floating leaves) or taken from the
      last microbatch (other leaves).

    Raises:
      ValueError: if the batch cannot be split (see ``split_microbatches``).
    """
    if key is not None:
        return _accumulate_with_keys(
            grad_fn, params, batch, microbatches, key, accum_dtype, maximum, weight_fn
        )
    if microbatches == 1:
        return grad_fn(params, batch)
    mbs = split_microbatches(batch, microbatches)
    weights, scale = _weights(weight_fn, mbs, microbatches)
    first = jax.tree.map(lambda x: x[0], mbs)
    g_shape, aux_shape = _out_types(grad_fn, params, first)
    if maximum is None:
        maximum = False
    is_max = jax.tree.map(
        lambda m, sub: jax.tree.map(lambda _: bool(m), sub),
        maximum,
        g_shape,
        is_leaf=lambda x: isinstance(x, bool),
    )

    def body(acc, xs):
        (g_acc, aux_acc), (mb, w) = acc, xs
        g, aux = grad_fn(params, mb)
        g_acc = jax.tree.map(
            lambda a, x, m: jnp.maximum(a, x.astype(a.dtype)) if m else _add(a, x, w),
            g_acc,
            g,
            is_max,
        )
        aux_acc = jax.tree.map(lambda a, x: _add(a, x, w), aux_acc, aux)
        return (g_acc, aux_acc), None

    zeros = lambda s: _zeros(s, accum_dtype)
    init = (jax.tree.map(lambda s, m: _init_leaf(s, m, accum_dtype), g_shape, is_max),)
    init = (*init, jax.tree.map(zeros, aux_shape))
    (g_sum, aux_sum), _ = jax.lax.scan(body, init, (mbs, weights))
    mean = lambda x: _scaled(x, scale)
    grads = jax.tree.map(lambda x, m: x if m else mean(x), g_sum, is_max)
    return grads, jax.tree.map(mean, aux_sum)


def _out_types(grad_fn: Callable, params: Any, first: Any) -> tuple[Any, Any]:
    """``(grads, aux)`` of one microbatch as abstract values with their memory space
    (``jax.eval_shape`` drops it): the gradients of host-resident params (full-parameter
    training with ``Levers(offload_params=True)``) are host-resident, and so is their
    accumulator."""
    jaxpr, shapes = jax.make_jaxpr(grad_fn, return_shape=True)(params, first)
    return jax.tree.unflatten(jax.tree.structure(shapes), jaxpr.out_avals)


def _in_host(x: Any) -> bool:
    """Whether ``x`` (an abstract value or a traced array) is in host memory."""
    return getattr(x, "memory_space", None) == jax.memory.Space.Host or (
        isinstance(x, jax.Array) and in_host_space(x)
    )


def _zeros(s: Any, accum_dtype: Any) -> jax.Array:
    """The accumulator of a leaf typed ``s``: zeros in ``accum_dtype`` for a float leaf, in
    host memory when the leaf is."""
    dt = accum_dtype if is_float_array(s) else s.dtype
    return host_zeros(s.shape, dt) if _in_host(s) else jnp.zeros(s.shape, dt)


def _init_leaf(s: Any, is_max: bool, accum_dtype: Any) -> jax.Array:
    """The accumulator's start: the dtype's lowest value for a maximum, else zeros."""
    if is_max:
        low = -jnp.inf if is_float_array(s) else jnp.iinfo(s.dtype).min
        return jnp.full(s.shape, low, s.dtype)
    return _zeros(s, accum_dtype)


def _add(a: Any, x: Any, w: jax.Array) -> Any:
    """``a + w * x``; a microbatch of weight 0 (no unmasked token) adds exactly 0, even where
    its own loss is 0/0 = NaN (a ``sum(nll * mask) / sum(mask)`` loss). A host-resident
    accumulator is added to on the device, a layer at a time, and stays in host memory."""
    if not is_float_array(a):
        return x
    add = lambda a, x: a + jnp.where(w > 0, x.astype(a.dtype) * w.astype(a.dtype), 0)
    return streamed_to_host(add, a, x) if _in_host(a) else add(a, x)


def _scaled(x: Any, scale: float) -> Any:
    """``x * scale`` for a float leaf (host-resident ones on the device, a layer at a time)."""
    if not is_float_array(x):
        return x
    return streamed_to_host(lambda v: v * scale, x) if _in_host(x) else x * scale


def _weights(weight_fn: Callable | None, mbs: Any, microbatches: int):
    """``(weights [microbatches] float32, scale)``: the accumulated sum times ``scale`` is
    the weighted mean. Counted: weights ``n_i / sum(n)`` (all 0 when the counts sum to 0),
    scale 1. Uncounted: weights 1, scale ``1 / microbatches`` (summed, then scaled once)."""
    first = jax.tree.map(lambda x: x[0], mbs)
    if weight_fn is None or weight_fn(first) is None:
        return jnp.ones((microbatches,), jnp.float32), 1.0 / microbatches
    counts = jax.vmap(lambda mb: jnp.asarray(weight_fn(mb), jnp.float32))(mbs)
    total = jnp.sum(counts)
    return jnp.where(total > 0, counts / jnp.where(total > 0, total, 1.0), 0.0), 1.0


def _accumulate_with_keys(
    grad_fn, params, batch, microbatches, key, accum_dtype, maximum, weight_fn
):
    """``accumulate_gradients`` with microbatch ``i`` given ``fold_in(key, i)``: the
    microbatch index travels with the batch (a leading axis the split keeps) and the
    weights see the batch alone."""
    index = jnp.arange(microbatches, dtype=jnp.uint32)
    index = jnp.repeat(index, _leading_size(batch) // microbatches)  # [B]: row -> microbatch

    def keyed(p, mb_and_index):
        mb, i = mb_and_index
        return grad_fn(p, mb, jax.random.fold_in(key, i[0]))

    def weight(mb_and_index):
        return None if weight_fn is None else weight_fn(mb_and_index[0])

    return accumulate_gradients(
        keyed,
        params,
        (batch, index),
        microbatches,
        accum_dtype=accum_dtype,
        maximum=maximum,
        weight_fn=weight,
    )


def _leading_size(batch: Any) -> int:
    """The leading (batch) size of ``batch``'s leaves (split_microbatches checks them)."""
    leaves = jax.tree.leaves(batch)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise ValueError("The batch needs at least one leaf with a leading batch axis.")
    return int(jnp.shape(leaves[0])[0])
