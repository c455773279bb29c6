"""Exact attention over a sequence split across the ``context`` mesh axis.

Each device holds ``S / N`` queries, keys and values of every row (in the zigzag order,
``jmem._src.context_order``) and their global token indices, from which the masks are
built as on one device. Three strategies (``CONTEXT_STRATEGIES``), each a
``jax.shard_map`` over the mesh in context inside the otherwise auto-sharded step:

- ``"all_gather"``: K/V (and their indices) are gathered over the axis; each device
  attends its queries to the whole sequence. One collective per layer; every device
  receives the K/V of the whole sequence (MaxText's default).
- ``"ring"``: the K/V shards travel around a ring (``ppermute``), ``N`` steps; each step
  attends the local queries to the shard at hand with the blockwise kernel and merges
  the results by their log-sum-exp (online softmax across shards), as Liu et al. 2023
  ("Ring Attention", arXiv:2310.01889). The same bytes as ``all_gather`` in ``N - 1``
  steps, never more than two K/V shards per device.
- ``"ulysses"``: all-to-alls trade the sequence split for a head split, each device
  attends all tokens with ``nH / N`` query and ``nKV / N`` key/value heads, and an
  all-to-all trades back (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv:2309.14509).
  Four all-to-alls of activations per layer; needs both head counts to divide ``N``.

Gradients are JAX's transposes of the collectives (``all_gather`` -> reduce-scatter,
``ppermute`` -> the reverse ``ppermute``, ``all_to_all`` -> ``all_to_all``) through the
local kernels' own custom VJPs.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jmem._src.mesh_batch import token_groups
from jmem._src.names import CONTEXT_STRATEGY_NAMES
from jmem._src.sharding import CONTEXT_AXIS

__all__ = ("CONTEXT_STRATEGIES", "check_strategy", "context_attention")

#: ``Levers.context_strategy`` values.
CONTEXT_STRATEGIES = CONTEXT_STRATEGY_NAMES

_NEG = -1e30


def check_strategy(strategy: str, num_heads: int, num_kv_heads: int, n: int) -> None:
    """ValueError for an unknown strategy, or ``"ulysses"`` with head counts that the
    context axis size ``n`` does not divide."""
    if strategy not in CONTEXT_STRATEGIES:
        raise ValueError(
            f"context strategy {strategy!r} is unknown; choose from {CONTEXT_STRATEGIES}."
        )
    if strategy == "ulysses" and n > 1 and (num_heads % n or num_kv_heads % n):
        raise ValueError(
            f"context strategy 'ulysses' splits heads over the context axis ({n} devices), "
            f"but {num_heads} query / {num_kv_heads} key-value heads are not multiples of "
            f"{n}; use 'all_gather' or 'ring'."
        )


def _gather(x):
    return lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True)


def _all_gather(local, q, k, v, qi, qs, window):
    return local(q, _gather(k), _gather(v), qi, _gather(qi), qs, _gather(qs), window)


def _rotate(xs, n):
    """Each device's arrays to the next device of the ring."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return tuple(lax.ppermute(x, CONTEXT_AXIS, perm) for x in xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, k, v, qi, qs, window, static):
    """Ring attention; ``static = (local_lse, local_grads, n)``. A custom VJP: the residuals
    are the local q, k, v, the output and its log-sum-exp (autodiff of the forward loop
    kept every step's partial output and K/V shard), and the backward pass sends the K/V
    shards around the ring again with their dK/dV accumulators."""
    return _ring_forward(q, k, v, qi, qs, window, static)[0]


def _ring_forward(q, k, v, qi, qs, window, static):
    """``n`` steps: attend to the K/V shard at hand, merge by log-sum-exp, pass it on. The
    steps after the first are a loop, so that only one shard is in flight at a time (XLA
    scheduled the unrolled steps' transfers together: all ``n`` shards at once)."""
    local_lse, _, n = static

    def merge(shard, out, lse):
        kb, vb, ki, ks = shard
        o, l = local_lse(q, kb, vb, qi, ki, qs, ks, window)
        new = jnp.logaddexp(lse, l)
        o = o.astype(jnp.float32) * jnp.exp(l - new)[..., None]
        return out * jnp.exp(lse - new)[..., None] + o, new

    def step(_, carry):
        shard = _rotate(carry[0], n)
        return shard, *merge(shard, *carry[1:])

    out = jnp.zeros(q.shape, jnp.float32)
    lse = jnp.full(q.shape[:3], _NEG, jnp.float32)
    shard = (k, v, qi, qs)
    carry = lax.fori_loop(1, n, step, (shard, *merge(shard, out, lse)))
    return carry[1].astype(v.dtype), carry[2]


def _ring_fwd(q, k, v, qi, qs, window, static):
    out, lse = _ring_forward(q, k, v, qi, qs, window, static)
    return out, (q, k, v, qi, qs, window, out, lse)


def _ring_bwd(static, res, do):
    """dq accumulates on its device; dK/dV travel with their shard (a loop, as the forward
    steps) and come home after a last step."""
    _, local_grads, n = static
    q, k, v, qi, qs, window, out, lse = res

    def add(shard, grads):
        kb, vb, ki, ks = shard
        g = local_grads(q, kb, vb, qi, ki, qs, ks, window, out, lse, do)
        return tuple(a + b for a, b in zip(grads, g))

    def step(_, carry):
        shard, (dq, dk, dv) = carry
        shard, (dk, dv) = _rotate(shard, n), _rotate((dk, dv), n)
        return shard, add(shard, (dq, dk, dv))

    f32 = lambda x: jnp.zeros(x.shape, jnp.float32)
    shard = (k, v, qi, qs)
    _, (dq, dk, dv) = lax.fori_loop(1, n, step, (shard, add(shard, (f32(q), f32(k), f32(v)))))
    dk, dv = _rotate((dk, dv), n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ulysses(local, q, k, v, qi, qs, window):
    """Sequence split -> head split (all-to-all), local attention, and back."""
    heads = lambda x: lax.all_to_all(x, CONTEXT_AXIS, 2, 1, tiled=True)
    qi, qs = _gather(qi), _gather(qs)
    out = local(heads(q), heads(k), heads(v), qi, qi, qs, qs, window)
    return lax.all_to_all(out, CONTEXT_AXIS, 1, 2, tiled=True)


def context_attention(
    q,
    k,
    v,
    qi,
    qs,
    window,
    *,
    strategy: str,
    local: Callable,
    local_lse: Callable,
    local_grads: Callable,
) -> jax.Array:
    """Attention of ``q [B, S, nH, D]`` to ``k, v [B, S, nKV, D]`` whose sequence axis the
    mesh in context's ``"context"`` axis splits, by ``strategy``.

    Args:
      q, k, v: global arrays (sequence axis split over ``"context"``, rows over the batch
        axes that divide ``B``).
      qi, qs: int32 ``[B, S]`` global token indices (the mask's causal order: the zigzag
        order's indices, not ``0..S-1``) and segment ids, of the queries and the keys.
      window: int32 scalar sliding window (``<= 0``: global).
      strategy: one of ``CONTEXT_STRATEGIES``.
      local: ``local(q, k, v, qi, ki, qs, ks, window) -> out``, single-device attention
        (dense or blockwise) on one device's arrays.
      local_lse: the blockwise kernel returning ``(out, float32 lse [b, s, nH])`` (ring).
      local_grads: ``local_grads(q, k, v, qi, ki, qs, ks, window, out, lse, do) -> (dq,
        dk, dv)`` of the blockwise kernel for one K/V shard, from the output and lse over
        all of them (the ring's backward pass).

    Returns:
      ``[B, S, nH, D]`` in ``v``'s dtype, split as ``q``.

    Raises:
      ValueError: as :func:`check_strategy`.
    """
    b, s = q.shape[:2]
    axes, _, n = token_groups(b, s)
    check_strategy(strategy, q.shape[2], k.shape[2], n)
    if strategy == "all_gather":
        body = lambda *a: _all_gather(local, *a)
    elif strategy == "ring":
        body = lambda *a: _ring(*a, (local_lse, local_grads, n))
    else:
        body = lambda *a: _ulysses(local, *a)
    spec = P(axes or None, CONTEXT_AXIS)
    fn = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(spec, spec, spec, spec, spec, P()),
        out_specs=spec,
        check_vma=False,  # the local kernels' loops and conds carry unvarying zeros
    )
    return fn(q, k, v, qi, qs, window)
