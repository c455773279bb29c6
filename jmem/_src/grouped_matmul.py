"""A grouped matmul in plain XLA whose work is that of the rows' own groups, not of all E.

``lhs [M, K]`` rows sorted by group (``group_sizes [E]``) times stacked kernels
``rhs [E, K, N]``: row ``i`` of group ``e`` gives ``lhs[i] @ rhs[e]``, as
``jax.lax.ragged_dot``. XLA (jaxlib 0.10, XLA:CPU and XLA:GPU) rewrites ``ragged_dot``
into one dot over a zero-padded ``[M, E K]`` copy of the rows, E times the work; this
places the rows into tiles of ``tile`` rows instead, each group padded to a multiple of
``tile`` (at most ``ceil((M + E (tile - 1)) / tile)`` tiles, a static bound), and every
tile multiplies its own group's kernel: batched ``[G, tile, K] x [G, K, N]`` dots over
chunks of ``G`` tiles in a ``lax.scan`` (the ``G`` gathered kernels are the transient,
kept under ``KERNEL_CHUNK_BYTES``); the rows are gathered back. The backward pass (a
custom VJP) is the same tiling: the input gradient multiplies each tile by its kernel
transposed, the kernel gradient scatter-adds every tile's ``x_tᵀ dy_t`` into
``[E, K, N]``. FLOPs: ``2 (M + E tile) K N`` for each, against ``2 M K N`` active.
The idea is MegaBlocks' block-sparse grouped matmul (Gale et al. 2023, arXiv:2211.15841)
and megablox's ``gmm``/``tgmm``, written here in ``jnp``/``lax`` (no Pallas).
See ``docs/moe.md``, "The grouped matmul".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src import jax_compat as _compat

__all__ = ["GroupedConfig", "config_of", "grouped_matmul", "tile_rows"]

#: Bytes of the kernels one chunk of tiles gathers (and of its kernel-gradient partials).
KERNEL_CHUNK_BYTES = 1 << 28
#: The padding a tile size may cost, ``E tile`` rows, as a fraction of ``M``.
PAD_FRACTION = 0.08
MIN_TILE, MAX_TILE = 8, 512
_CONFIG_ATTR = "_jmem_grouped_config"


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile for ``rows`` sorted rows in ``groups`` groups: the largest power of two
    in ``[MIN_TILE, MAX_TILE]`` whose padding ``groups * tile`` is at most ``PAD_FRACTION``
    of ``rows``, else ``MIN_TILE``. Larger tiles read each kernel fewer times (one read of
    ``K N`` elements per tile); smaller ones pad less."""
    t = MIN_TILE
    while t * 2 <= MAX_TILE and groups * t * 2 <= PAD_FRACTION * rows:
        t *= 2
    return t


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Static parameters of one grouped matmul: ``transpose_rhs`` (``rhs`` is ``[E, N, K]``
    and each tile multiplies ``rhs[e]ᵀ``), the dots' ``precision`` and
    ``preferred_element_type`` (None: ``lhs``'s dtype)."""

    transpose_rhs: bool = False
    precision: Any = None
    preferred_element_type: Any = None


def config_of(custom_vjp_params: dict) -> GroupedConfig | None:
    """The ``GroupedConfig`` of a traced ``grouped_matmul`` (``eqn.params`` of its
    ``custom_vjp_call``; operands ``(lhs, rhs, group_sizes)``), None for any other call."""
    fn = _compat.custom_vjp_bwd(custom_vjp_params.get("bwd"))
    cfg = getattr(fn, _CONFIG_ATTR, None)
    return cfg if isinstance(cfg, GroupedConfig) else None


def _chunking(rows: int, groups: int, tile: int, kernel_bytes: int) -> tuple[int, int]:
    """``(chunks, tiles per chunk)``: the static tile bound cut into chunks whose kernels
    fit ``KERNEL_CHUNK_BYTES``, as even as the bound allows (the last tiles empty)."""
    n = -(-(rows + groups * (tile - 1)) // tile)
    per = max(1, min(n, KERNEL_CHUNK_BYTES // max(1, kernel_bytes)))
    chunks = -(-n // per)
    return chunks, -(-n // chunks)


def _layout(group_sizes, rows: int, groups: int, tile: int, n_tiles: int):
    """``(src, dst, tile_group)``: the source row of every tiled row (``rows``, out of range,
    for padding), the tiled position of every row (out of range for rows past the groups)
    and each tile's group, int32 ``[n_tiles tile]``, ``[rows]``, ``[n_tiles]``."""
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    tiles = (gs + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    tile_starts = (tile_ends - tiles) * tile
    j = jnp.arange(n_tiles, dtype=jnp.int32)
    tile_group = jnp.minimum(jnp.searchsorted(tile_ends, j, side="right"), groups - 1)
    p = jnp.arange(n_tiles * tile, dtype=jnp.int32)
    g = jnp.repeat(tile_group, tile, total_repeat_length=n_tiles * tile)
    off = p - tile_starts[g]
    src = jnp.where((off >= 0) & (off < gs[g]), starts[g] + off, rows)
    i = jnp.arange(rows, dtype=jnp.int32)
    rg = jnp.searchsorted(ends, i, side="right")
    rc = jnp.minimum(rg, groups - 1)
    dst = jnp.where(rg < groups, tile_starts[rc] + i - starts[rc], n_tiles * tile)
    return src.astype(jnp.int32), dst.astype(jnp.int32), tile_group.astype(jnp.int32)


def _tiles(a, src, chunks: int, per: int, tile: int):
    """``a [M, D]``'s rows at ``src`` (zeros out of range) as ``[chunks, per, tile, D]``."""
    rows = jnp.take(a, src, axis=0, mode="fill", fill_value=0)
    return rows.reshape(chunks, per, tile, a.shape[-1])


def _products(xt, rhs, tile_group, transpose: bool, precision, out_type):
    """Every tile of ``xt [C, G, tile, K]`` times its group's kernel, ``[C G tile, N]``."""
    contract = 2 if transpose else 1

    def step(_, inp):
        x, tg = inp
        w = jnp.take(rhs, tg, axis=0)  # [G, K, N] (or [G, N, K])
        dims = (((2,), (contract,)), ((0,), (0,)))
        y = lax.dot_general(x, w, dims, precision=precision, preferred_element_type=out_type)
        return None, y.astype(out_type)

    _, y = lax.scan(step, None, (xt, tile_group.reshape(xt.shape[:2])))
    return y.reshape(-1, y.shape[-1])


def _kernel_grad(xt, dt, tile_group, groups: int, precision):
    """``sum over the tiles t of group e of xt_tᵀ dt_t``, float32 ``[E, K, N]`` for
    ``xt [C, G, tile, K]`` and ``dt [C, G, tile, N]``, one chunk's partials at a time."""
    k, n = xt.shape[-1], dt.shape[-1]

    def step(acc, inp):
        x, d, tg = inp
        dims = (((1,), (1,)), ((0,), (0,)))
        part = lax.dot_general(x, d, dims, precision=precision, preferred_element_type=jnp.float32)
        return acc.at[tg].add(part), None

    acc = jnp.zeros((groups, k, n), jnp.float32)
    acc, _ = lax.scan(step, acc, (xt, dt, tile_group.reshape(xt.shape[:2])))
    return acc


def _plan(lhs, rhs, cfg: GroupedConfig):
    """``(groups, tile, chunks, per, out_type)`` of a call."""
    rows, groups = lhs.shape[0], rhs.shape[0]
    tile = tile_rows(rows, groups)
    itemsize = max(4, jnp.dtype(rhs.dtype).itemsize)  # the kernel gradient's float32 partials
    chunks, per = _chunking(rows, groups, tile, rhs.shape[1] * rhs.shape[2] * itemsize)
    out_type = cfg.preferred_element_type or lhs.dtype
    return groups, tile, chunks, per, out_type


def _forward(lhs, rhs, group_sizes, cfg: GroupedConfig):
    groups, tile, chunks, per, out_type = _plan(lhs, rhs, cfg)
    src, dst, tg = _layout(group_sizes, lhs.shape[0], groups, tile, chunks * per)
    xt = _tiles(lhs, src, chunks, per, tile)
    y = _products(xt, rhs, tg, cfg.transpose_rhs, cfg.precision, out_type)
    return jnp.take(y, dst, axis=0, mode="fill", fill_value=0)


def _backward(cfg: GroupedConfig, res, g):
    lhs, rhs, group_sizes = res
    groups, tile, chunks, per, _ = _plan(lhs, rhs, cfg)
    src, dst, tg = _layout(group_sizes, lhs.shape[0], groups, tile, chunks * per)
    gt = _tiles(g, src, chunks, per, tile)
    dx_type = cfg.preferred_element_type or lhs.dtype
    dx = _products(gt, rhs, tg, not cfg.transpose_rhs, cfg.precision, dx_type)
    dx = jnp.take(dx, dst, axis=0, mode="fill", fill_value=0).astype(lhs.dtype)
    xt = _tiles(lhs, src, chunks, per, tile).astype(g.dtype)
    if cfg.transpose_rhs:
        dw = _kernel_grad(gt, xt, tg, groups, cfg.precision)
    else:
        dw = _kernel_grad(xt, gt, tg, groups, cfg.precision)
    return dx, dw.astype(rhs.dtype), None


@functools.lru_cache(maxsize=None)
def _op(cfg: GroupedConfig):
    """The custom-VJP grouped matmul of ``cfg``; its ``bwd`` carries ``cfg`` (``config_of``)."""

    @jax.custom_vjp
    def op(lhs, rhs, group_sizes):
        return _forward(lhs, rhs, group_sizes, cfg)

    def fwd(lhs, rhs, group_sizes):
        return _forward(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)

    bwd = functools.partial(_backward, cfg)
    setattr(bwd, _CONFIG_ATTR, cfg)
    op.defvjp(fwd, bwd)
    return op


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` computed as tiles of the groups' rows.

    Args:
      lhs: ``[M, K]`` rows sorted by group (group 0's first); rows past
        ``sum(group_sizes)`` give zeros.
      rhs: ``[E, K, N]`` kernels (``[E, N, K]`` with ``transpose_rhs``: ``rhs[e]ᵀ``).
      group_sizes: int ``[E]``, rows per group, summing to at most ``M``.
      transpose_rhs: multiply each group's rows by ``rhs[e]ᵀ``.
      precision, preferred_element_type: as ``lax.dot_general``'s (the output dtype is
        ``preferred_element_type`` or ``lhs.dtype``).

    Returns:
      ``[M, N]``. Differentiable in ``lhs`` and ``rhs`` (a custom VJP, the same tiling); FLOPs
      ``2 (M + E tile) K N`` per pass, ``tile`` = ``tile_rows(M, E)``.

    Raises:
      ValueError: operands that are not ``[M, K]``, ``[E, K, N]`` and ``[E]``.
    """
    contract = 2 if transpose_rhs else 1
    if (
        lhs.ndim != 2
        or rhs.ndim != 3
        or group_sizes.shape != (rhs.shape[0],)
        or lhs.shape[1] != rhs.shape[contract]
    ):
        raise ValueError(
            f"grouped_matmul takes lhs [M, K], rhs [E, K, N] (transpose_rhs: [E, N, K]) and "
            f"group_sizes [E]; got {lhs.shape}, {rhs.shape}, {group_sizes.shape}."
        )
    if preferred_element_type is not None:
        preferred_element_type = jnp.dtype(preferred_element_type)
    cfg = GroupedConfig(bool(transpose_rhs), precision, preferred_element_type)
    return _op(cfg)(lhs, rhs, group_sizes)
