"""The zigzag token order of context parallelism: causal load balancing.

A sequence split over the ``context`` mesh axis in ``N`` contiguous shards gives the last
device ``N`` times the causal attention work of the first. In the zigzag order the
sequence is cut into ``2N`` chunks and device ``i`` holds chunks ``i`` and ``2N - 1 - i``:
every device then has the same share of the causal score matrix. The decoder moves its
inputs (tokens, positions, segment ids, token indices) into this order at the start and
its output back at the end; in between the token-local work does not care, and
attention's masks use the global token indices carried along. Source: the zigzag layout of
ring-flash-attention (zhuzilin) and of MaxText's context parallelism; Brandon et al. 2023
("Striped Attention", arXiv:2311.09431) for why contiguous shards are unbalanced.

Both moves are two ``ppermute``s of half a shard each (``jax.shard_map`` over the mesh in
context), so no device ever holds more than its own shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jmem._src.mesh_batch import token_groups
from jmem._src.sharding import CONTEXT_AXIS

__all__ = ("from_zigzag", "to_zigzag", "zigzag_order")


def zigzag_order(length: int, n: int) -> np.ndarray:
    """int ``[length]``: the natural index of the token at each position of the zigzag
    order over ``n`` shards (``x_zigzag = x[..., zigzag_order(S, n)]``).

    Raises:
      ValueError: ``length`` not a multiple of ``2 * n``.
    """
    if length % (2 * n):
        raise ValueError(f"length {length} is not a multiple of 2 * n = {2 * n}.")
    c = length // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


def _owner(j: int, n: int) -> int:
    """The device that holds natural chunk ``j`` in the zigzag order."""
    return j if j < n else 2 * n - 1 - j


def _perms(n: int) -> list[list[tuple[int, int]]]:
    """For each half ``s`` of a natural shard (chunk ``2d + s`` of device ``d``), the
    ``ppermute`` pairs ``(d, owner)``; each is a permutation of the devices."""
    return [[(d, _owner(2 * d + s, n)) for d in range(n)] for s in (0, 1)]


def _move(x: jax.Array, n: int, inverse: bool) -> jax.Array:
    """A device's ``[b, S / n, ...]`` shard in the zigzag order (or back with
    ``inverse``): natural half ``s`` travels with ``_perms(n)[s]``; on device ``e`` it is
    zigzag half ``0`` when ``s`` has ``e``'s parity, else half ``1``."""
    half = x.shape[1] // 2
    a, b = x[:, :half], x[:, half:]
    even = lax.axis_index(CONTEXT_AXIS) % 2 == 0
    perms = _perms(n)
    if inverse:
        perms = [[(dst, src) for src, dst in p] for p in perms]
        a, b = jnp.where(even, a, b), jnp.where(even, b, a)
    a, b = (lax.ppermute(h, CONTEXT_AXIS, p) for h, p in zip((a, b), perms))
    if not inverse:
        a, b = jnp.where(even, a, b), jnp.where(even, b, a)
    return jnp.concatenate([a, b], axis=1)


def _reorder(x: jax.Array, inverse: bool) -> jax.Array:
    b, s = x.shape[:2]
    axes, _, n = token_groups(b, s)
    if n == 1:
        return x
    spec = P(axes or None, CONTEXT_AXIS)
    fn = jax.shard_map(
        lambda y: _move(y, n, inverse),
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=spec,
        out_specs=spec,
        check_vma=False,  # the local kernels' loops and conds carry unvarying zeros
    )
    return fn(x)


def to_zigzag(x: jax.Array) -> jax.Array:
    """``x [B, S, ...]`` in the zigzag order of the mesh in context's ``"context"`` axis
    (``x[:, zigzag_order(S, N)]``, sharded over it); unchanged without one."""
    return _reorder(x, inverse=False)


def from_zigzag(x: jax.Array) -> jax.Array:
    """The inverse of :func:`to_zigzag`: ``[B, S, ...]`` back in the natural order."""
    return _reorder(x, inverse=True)
