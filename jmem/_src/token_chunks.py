"""``over_tokens``: a token-local function computed over chunks of tokens, recomputed chunk by
chunk in the backward pass, with no float32 copy of its 16-bit inputs or outputs on XLA:CPU.

Why not ``lax.scan`` over the chunks: a scan slices its stacked ``xs`` (and, in the backward
pass, the stacked output cotangents) with a dynamic slice in the loop. XLA:CPU computes a
bfloat16 dynamic slice in float32 (a ``convert`` of the whole array) and hoists that
``convert`` out of the loop: a float32 copy of every ``[S, H]`` input and cotangent (three
0.75 GiB copies per layer for Llama-3.1-8B at 49,152 tokens). Here a ``fori_loop`` over
chunk indices slices the whole arrays as ``uint16`` bits (``take``) and writes each chunk's
outputs in place (``put``), each with a custom VJP on the activations only (never on
weights: the NF4/LoRA interpreter inlines a custom VJP that receives a weight).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src.remat_bits import from_bits
from jmem._src.remat_bits import to_bits


def _slice(x, i, size):
    """Rows ``[i * size, (i + 1) * size)`` of ``x``, sliced as integer bits when 16-bit."""
    return from_bits(lax.dynamic_slice_in_dim(to_bits(x), i * size, size, axis=0), x.dtype)


def _take(x: jax.Array, i: jax.Array, size: int) -> jax.Array:
    """Chunk ``i`` (``size`` rows) of ``x``; its cotangent is written into zeros like ``x``."""
    shape, dtype = x.shape, x.dtype

    @jax.custom_vjp
    def take(x, i):
        return _slice(x, i, size)

    def fwd(x, i):
        return _slice(x, i, size), i

    def bwd(i, g):
        return lax.dynamic_update_slice_in_dim(jnp.zeros(shape, dtype), g, i * size, 0), None

    take.defvjp(fwd, bwd)
    return take(x, i)


def _put(out: jax.Array, y: jax.Array, i: jax.Array) -> jax.Array:
    """``out`` with chunk ``i`` set to ``y``. The cotangent passes through to ``out`` whole:
    exact when every chunk is written once into an array that does not depend on the
    inputs (``over_tokens``'s zeros)."""
    size = y.shape[0]

    @jax.custom_vjp
    def put(out, y, i):
        return lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), i * size, 0)

    def fwd(out, y, i):
        return put(out, y, i), i

    def bwd(i, g):
        return g, _slice(g, i, size).astype(y.dtype), None

    put.defvjp(fwd, bwd)
    return put(out, y, i)


def over_tokens(fn: Callable, chunk: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``fn(*arrays)`` computed over chunks of ``chunk`` tokens.

    ``fn`` must be token-local (row ``t`` of each output depends on row ``t`` of each input
    only: norms, projections, RoPE, an MLP); it is called on ``[1, chunk, ...]`` slices under
    ``jax.checkpoint``, so its intermediates exist for one chunk at a time and are recomputed
    chunk by chunk in the backward pass.

    Args:
      fn: ``fn(*chunks) -> tuple of arrays``, each ``[1, chunk, ...]``.
      chunk: tokens per chunk (> 0).
      *arrays: ``[B, S, ...]`` arrays (same ``B, S``); the ``B * S`` tokens are chunked
        (the last chunk zero-padded).

    Returns:
      ``fn``'s outputs as ``[B, S, ...]`` arrays, equal to ``fn`` on the whole arrays
      (token-local ``fn``); whole (``fn(*arrays)``, no loop) when the tokens fit one chunk.

    Raises:
      ValueError: ``chunk`` not a positive int, or arrays with different ``[B, S]``.

    Source: the "tiled MLP" of long-context fine-tuning (unsloth; Arctic Long Sequence
    Training, arXiv:2506.13996), with Chen et al. 2016's recomputation per chunk.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1 (tokens per chunk); got {chunk!r}.")
    b, s = arrays[0].shape[:2]
    if any(a.shape[:2] != (b, s) for a in arrays):
        raise ValueError(f"arrays must share their [B, S] axes; got {[a.shape for a in arrays]}.")
    n = b * s
    if n <= chunk:
        return tuple(fn(*arrays))
    pad = -n % chunk
    flat = [a.reshape(n, *a.shape[2:]) for a in arrays]
    flat = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) if pad else a for a in flat]

    @jax.checkpoint
    def chunk_fn(flat, i):
        return fn(*(_take(a, i, chunk)[None] for a in flat))

    shapes = jax.eval_shape(chunk_fn, flat, 0)
    init = tuple(jnp.zeros((n + pad, *o.shape[2:]), o.dtype) for o in shapes)

    def body(i, out):
        ys = chunk_fn(flat, i)
        return tuple(_put(o, y[0], i) for o, y in zip(out, ys))

    outs = lax.fori_loop(0, (n + pad) // chunk, body, init)
    return tuple((o[:n] if pad else o).reshape(b, s, *o.shape[1:]) for o in outs)
