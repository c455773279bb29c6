"""The batch split of the mesh in context: the mesh axes a ``[B, ...]`` activation's rows are
sharded over, so that loops over tokens slice each device's own rows.

Inside jmem's sharded step (``jax.set_mesh``) the batch is split over ``("data", "fsdp")``
(``jmem.sharding.batch_sharding``). A loop that flattens the ``B * S`` tokens and slices
chunk ``i`` of them slices across that split: the partitioner then gathers or reshards the
whole batch's activations, and every device works on every chunk. ``batch_groups`` gives the
number of row groups ``G`` (the devices' shares); the token loops reshape ``[B, S, ...]``
to ``[G, B / G * S, ...]`` and chunk the second axis, so each device loops over its own
tokens, as without a mesh. On a mesh with a ``"context"`` axis the sequence axis is split
over it too (context parallelism, docs/sharding.md): ``token_groups`` adds that split, so
each device still loops over its own tokens. Source: GSPMD (arXiv:2105.04663), sharding propagation through
reshapes and ``with_sharding_constraint``.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jmem._src.sharding import CONTEXT_AXIS
from jmem._src.sharding import DATA_AXIS
from jmem._src.sharding import EXPERT_AXIS
from jmem._src.sharding import FSDP_AXIS


def batch_groups(batch_size: int) -> tuple[tuple[str, ...], int]:
    """``(axes, G)``: the Auto batch axes (``"data"``, ``"fsdp"``, ``"expert"``: those of
    ``jmem.sharding.batch_sharding``) of the mesh in context (``jax.sharding.get_abstract_mesh``)
    over which ``batch_size`` rows are split, in mesh order while their product divides
    ``batch_size``, and ``G``, that product; ``((), 1)`` without a mesh (or a 1-device one).
    Other axes (a user's tensor-parallel ``"model"`` axis) never split the rows."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty or m.size == 1:
        return (), 1
    axes, n = [], 1
    for name, size, kind in zip(m.axis_names, m.axis_sizes, m.axis_types):
        batch_axis = name in (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)
        if batch_axis and kind == AxisType.Auto and size > 1 and batch_size % (n * size) == 0:
            axes.append(name)
            n *= size
    return tuple(axes), n


def context_split() -> int:
    """Size of the Auto ``"context"`` axis of the mesh in context (1 without one): the
    number of devices one sequence is split over."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty:
        return 1
    for name, size, kind in zip(m.axis_names, m.axis_sizes, m.axis_types):
        if name == CONTEXT_AXIS and kind == AxisType.Auto:
            return int(size)
    return 1


def expert_split() -> int:
    """Size of the Auto ``"expert"`` axis of the mesh in context (1 without one): the
    number of devices the routed experts are split over (``jmem._src.expert_parallel``)."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty:
        return 1
    for name, size, kind in zip(m.axis_names, m.axis_sizes, m.axis_types):
        if name == EXPERT_AXIS and kind == AxisType.Auto:
            return int(size)
    return 1


def token_groups(batch_size: int, length: int) -> tuple[tuple[str, ...], int, int]:
    """``(axes, G, C)``: the batch split (``batch_groups``) and the number ``C`` of
    context-parallel shards of the sequence axis (``context_split`` when it divides
    ``length``, else 1). Each device holds ``B / G`` rows of ``length / C`` tokens."""
    axes, g = batch_groups(batch_size)
    c = context_split()
    return axes, g, c if c > 1 and length % c == 0 else 1


def split_tokens(x: jax.Array, axes: tuple[str, ...], g: int, c: int) -> jax.Array:
    """``x [B, S, ...]`` as ``[G, C, B / G * S / C, ...]``: each device's tokens (``token_groups``)
    on the last of the leading axes, constrained to the split."""
    b, s = x.shape[:2]
    y = x.reshape(g, b // g, c, s // c, *x.shape[2:]).swapaxes(1, 2)
    y = y.reshape(g, c, b // g * (s // c), *x.shape[2:])
    return jax.lax.with_sharding_constraint(y, P(axes or None, CONTEXT_AXIS))


def merge_tokens(y: jax.Array, b: int, s: int) -> jax.Array:
    """The inverse of ``split_tokens``: ``[G, C, B / G * S / C, ...]`` -> ``[B, S, ...]``."""
    g, c = y.shape[:2]
    x = y.reshape(g, c, b // g, s // c, *y.shape[3:]).swapaxes(1, 2)
    return x.reshape(b, s, *y.shape[3:])


def constrain_groups(x: jax.Array, axes: tuple[str, ...], axis: int = 0) -> jax.Array:
    """``x`` with its ``axis`` split over ``axes`` (the other axes replicated); unchanged when
    ``axes`` is empty."""
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, P(*([None] * axis), axes))


def rows_split(x: jax.Array) -> jax.Array:
    """``x [B, ...]`` constrained to its rows' batch split (``batch_groups(B)``), the other
    axes replicated: applied to a projection's output it makes the partitioner all-gather
    the (FSDP-sharded) weight and keep each device's rows, instead of gathering the whole
    batch's activations to multiply with a weight shard (tensor parallelism, which it
    otherwise picks when the activations are the smaller operand). Unchanged without a
    mesh in context. On a mesh with a ``"context"`` axis, a ``[B, S, ...]`` output (3-D or
    more) keeps its sequence axis split over it too (context parallelism)."""
    if x.ndim == 0:
        return x
    axes = batch_groups(x.shape[0])[0]
    c = context_split()
    if c > 1 and x.ndim >= 3 and x.shape[1] % c == 0:
        return jax.lax.with_sharding_constraint(x, P(axes or None, CONTEXT_AXIS))
    return constrain_groups(x, axes)
