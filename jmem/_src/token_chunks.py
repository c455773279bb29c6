"""``over_tokens``: a token-local function computed over chunks of tokens, recomputed chunk by
chunk in the backward pass, with no float32 copy of its 16-bit inputs or outputs and no
whole-array work per chunk on XLA:CPU.

Why not ``lax.scan`` over the chunks: a scan slices its stacked ``xs`` (and, in the backward
pass, the stacked output cotangents) with a dynamic slice in the loop. XLA:CPU computes a
bfloat16 dynamic slice in float32 (a ``convert`` of the whole array) and hoists that
``convert`` out of the loop: a float32 copy of every ``[S, H]`` input and cotangent (three
0.75 GiB copies per layer for Llama-3.1-8B at 49,152 tokens); it writes a bf16 slice by
converting the whole array too, per iteration. Here a ``fori_loop`` over chunk indices
reads each chunk of the whole arrays as ``uint16`` bits (``_take``) and writes each chunk's
outputs as bits in place (``_put``). A closed-over input's cotangent would be a whole-sized
array added per chunk by the loop's transpose; instead the loop carries a "sink" per input
(zeros whose cotangent is the input's, ``_grad_sink``) and each chunk writes its input
cotangent into the sink's in place. The slicing custom VJPs see activations only, never
weights (the NF4/LoRA interpreter inlines a custom VJP that receives a weight); the
chunk's recomputation, which receives the layer's weights, is rebuilt by the interpreter
around the interpreted chunk (``jmem._src.jaxpr.rebuildable``).
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jmem._src import partial_sums
from jmem._src.jaxpr import rebuildable
from jmem._src.mesh_batch import constrain_groups
from jmem._src.mesh_batch import expert_split
from jmem._src.mesh_batch import merge_tokens
from jmem._src.mesh_batch import split_tokens
from jmem._src.mesh_batch import token_groups
from jmem._src.remat_bits import from_bits
from jmem._src.remat_bits import to_bits
from jmem._src.sharding import CONTEXT_AXIS


def _slice(x, i, size, axis):
    """Tokens ``[i * size, (i + 1) * size)`` along ``axis`` (the token axis: 1 of
    ``x [G, T, ...]`` on a batch split, 0 of ``x [T, ...]`` without one), sliced as integer
    bits when 16-bit."""
    return from_bits(lax.dynamic_slice_in_dim(to_bits(x), i * size, size, axis=axis), x.dtype)


def _update(x, y, i, axis):
    """``x`` with tokens ``[i * y.shape[axis], ...)`` (along the token ``axis``) set to
    ``y``, written as integer bits when 16-bit (XLA:CPU writes a bf16 slice by converting
    the whole array to float32)."""
    y = to_bits(y.astype(x.dtype))
    start = i * y.shape[axis]
    return from_bits(lax.dynamic_update_slice_in_dim(to_bits(x), y, start, axis), x.dtype)


@jax.custom_vjp
def _grad_sink(x):
    """Zeros like ``x`` whose cotangent is ``x``'s: the loop carries it unchanged and each
    chunk writes its input cotangent into it (``_take``), instead of adding a whole-sized
    array per chunk as a scan's transpose does for a closed-over input."""
    return jnp.zeros_like(x)


_grad_sink.defvjp(lambda x: (jnp.zeros_like(x), None), lambda _, g: (g,))


def _take(x, sink, i, size, axis):
    """``(chunk i of x, sink)``: ``x``'s values (not differentiated), and the chunk's
    cotangent written into ``sink``'s at chunk ``i``."""

    @jax.custom_vjp
    def take(x, sink, i):
        return _slice(x, i, size, axis), sink

    def fwd(x, sink, i):
        return take(x, sink, i), i

    def bwd(i, g):
        g_chunk, g_sink = g
        return None, _update(g_sink, g_chunk, i, axis), None

    take.defvjp(fwd, bwd)
    return take(lax.stop_gradient(x), sink, i)


def _put(out: jax.Array, y: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """``out`` with chunk ``i`` set to ``y``. The cotangent passes through to ``out`` whole:
    exact when every chunk is written once into an array that does not depend on the
    inputs (``over_tokens``'s zeros)."""
    size = y.shape[axis]

    @jax.custom_vjp
    def put(out, y, i):
        return _update(out, y, i, axis)

    def fwd(out, y, i):
        return put(out, y, i), i

    def bwd(i, g):
        return g, _slice(g, i, size, axis).astype(y.dtype), None

    put.defvjp(fwd, bwd)
    return put(out, y, i)


def _recomputed(chunk_fn: Callable, flat: list, sinks: list, i: jax.Array):
    """``chunk_fn(flat, sinks, i)`` under a custom VJP that saves its inputs (but the
    sinks, zeros) and recomputes it in the backward pass: what ``jax.checkpoint`` with
    ``nothing_saveable`` does, but final. JAX's partial evaluation of a checkpoint nested
    in another applies the *outer* policy inside (``jax.checkpoint``'s own policy is
    dropped), so under ``jmem.remat(loss, "selective")`` every chunk's matmul outputs were
    saved, stacked over the chunks: the whole ``[S, F]`` MLP tensors the chunks exist to
    avoid. A custom VJP's residuals are the ones its ``fwd`` declares, whatever the policy.

    The values ``chunk_fn`` closes over (a layer's weights) become explicit inputs
    (``jax.closure_convert``) so that they get their gradients."""
    run_fn, consts = jax.closure_convert(chunk_fn, flat, sinks, i)
    primal = lambda consts, flat, sinks, i: run_fn(flat, sinks, i, *consts)
    return _recompute_call(primal, list(consts), list(flat), list(sinks), i)


def _recompute_call(primal: Callable, consts: list, flat: list, sinks: list, i):
    """``primal(consts, flat, sinks, i) -> (ys, sinks)`` under the recomputing custom VJP
    of ``_recomputed``: it saves ``consts``, ``flat`` and ``i``; the sinks' output
    cotangents stand in for their values in the backward pass. The primal is
    ``jax.checkpoint(primal)``, for a transform that inlines the custom VJP. The custom VJP
    is ``rebuildable``: the NF4/LoRA interpreter, whose weights are among ``consts``,
    rebuilds it around the interpreted body (``_rebuild``) instead of inlining it, so an
    outer remat policy never reaches a chunk's internals."""

    @jax.custom_vjp
    def run(consts, flat, sinks, i):
        return jax.checkpoint(primal)(consts, flat, sinks, i)

    def fwd(consts, flat, sinks, i):
        return primal(consts, flat, sinks, i), (consts, flat, i)

    def bwd(res, g):
        consts, flat, i = lax.optimization_barrier(res)  # as jax.checkpoint's prevent_cse
        # The sinks' values are never read: their cotangents stand in for them.
        _, vjp = jax.vjp(lambda c, s: primal(c, flat, s, i), consts, list(g[1]))
        d_consts, d_sinks = vjp(g)
        return d_consts, None, d_sinks, None

    counts = tuple(len(jax.tree.leaves(x)) for x in (consts, flat, sinks))
    rebuildable(bwd, functools.partial(_rebuild, counts))
    run.defvjp(fwd, bwd)
    return run(consts, flat, sinks, i)


def _rebuild(counts: tuple, body: Callable, invals: list) -> list:
    """The flat outputs of ``_recompute_call`` around ``body``, an interpreter's evaluation
    of the primal on the flat inputs ``invals`` (``consts``, ``flat``, ``sinks``, ``i``:
    ``counts`` leaves each of the first three)."""
    nc, nf, ns = counts
    consts, flat = invals[:nc], invals[nc : nc + nf]
    sinks, i = invals[nc + nf : nc + nf + ns], invals[nc + nf + ns]

    def primal(consts, flat, sinks, i):
        outs = body(*consts, *flat, *sinks, i)
        ny = len(outs) - ns
        return tuple(outs[:ny]), list(outs[ny:])

    ys, sinks = _recompute_call(primal, list(consts), list(flat), list(sinks), i)
    return [*ys, *sinks]


def over_tokens(
    fn: Callable, chunk: int, *arrays: jax.Array, weights: Any = None
) -> tuple[jax.Array, ...]:
    """``fn(*arrays)`` (``fn(weights, *arrays)`` with ``weights``) computed over chunks of
    ``chunk`` tokens.

    ``fn`` must be token-local (row ``t`` of each output depends on row ``t`` of each input
    only: norms, projections, RoPE, an MLP); it is called on ``[G, chunk, ...]`` slices under
    ``jax.checkpoint``, so its intermediates exist for one chunk at a time and are recomputed
    chunk by chunk in the backward pass.

    On a mesh in context whose Auto axes split the batch (jmem's sharded step), the rows
    form ``G`` groups, one per device of the split (``jmem._src.mesh_batch``), and each
    group's ``B / G * S`` tokens are chunked: every device loops over its own tokens (the
    same ``chunk`` tokens per device per iteration as on one device) and no activation of
    the whole batch is gathered. Without a mesh ``G = 1``: the ``B * S`` tokens are chunked.

    Args:
      fn: ``fn(*chunks) -> tuple of arrays``, each ``[G, chunk, ...]``
        (``fn(weights, *chunks)`` with ``weights``).
      chunk: tokens per chunk (> 0), per row group.
      *arrays: ``[B, S, ...]`` arrays (same ``B, S``); each group's tokens are chunked
        (the last chunk zero-padded).
      weights: None, or the pytree of arrays ``fn`` reads besides its tokens (a layer's
        weights), passed to ``fn`` first. On a mesh whose Auto axes split the tokens they
        are gathered once, before the chunk loop (``_per_device``), rather than once per
        chunk, as the partitioner gathers the weights ``fn`` closes over; pass every
        array ``fn`` would close over here.

    Returns:
      ``fn``'s outputs as ``[B, S, ...]`` arrays, equal to ``fn`` on the whole arrays
      (token-local ``fn``); whole (``fn(*arrays)``, no loop) when a group's tokens fit one
      chunk.

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
    layout = _Layout(b, s)
    if weights is not None and layout.n > chunk and layout.manual_axes:
        return _per_device(fn, chunk, layout, arrays, weights)
    if weights is not None:
        fn = functools.partial(fn, weights)
    if layout.n <= chunk:
        return tuple(fn(*arrays))
    return _loop(fn, chunk, layout, arrays)


def _loop(fn: Callable, chunk: int, layout: "_Layout", arrays) -> tuple[jax.Array, ...]:
    """``over_tokens``'s loop over ``layout.n``'s tokens in chunks of ``chunk``."""
    n, ax = layout.n, layout.ax
    pad = -n % chunk
    flat = [layout.split(a) for a in arrays]
    widths = [(0, 0)] * ax + [(0, pad)]
    flat = [jnp.pad(a, widths + [(0, 0)] * (a.ndim - ax - 1)) if pad else a for a in flat]

    def chunk_fn(flat, sinks, i):
        taken = [_take(a, sink, i, chunk, ax) for a, sink in zip(flat, sinks)]
        ys = fn(*(layout.to_fn(c, chunk) for c, _ in taken))
        return tuple(layout.from_fn(y, chunk) for y in ys), [sk for _, sk in taken]

    shapes = jax.eval_shape(chunk_fn, flat, flat, 0)[0]
    init = tuple(
        layout.constrain(jnp.zeros((*o.shape[:ax], n + pad, *o.shape[ax + 1 :]), o.dtype))
        for o in shapes
    )
    values = [lax.stop_gradient(a) for a in flat]  # cotangents go through the sinks

    def body(i, carry):
        out, sinks = carry
        ys, sinks = _recomputed(chunk_fn, values, sinks, i)
        return tuple(_put(o, y, i, ax) for o, y in zip(out, ys)), sinks

    sinks = [layout.constrain(_grad_sink(a)) for a in flat]  # sharded as the input, not whole
    outs, _ = lax.fori_loop(0, (n + pad) // chunk, body, (init, sinks))
    trim = [slice(None)] * ax + [slice(0, n)]
    return tuple(layout.merge(o[tuple(trim)] if pad else o) for o in outs)


def _per_device(fn: Callable, chunk: int, layout: "_Layout", arrays, weights):
    """``over_tokens`` on a mesh whose Auto axes split the tokens: a ``jax.shard_map``
    manual over those axes (``layout.manual_axes``), inside which each device chunks its
    own ``[B / G, S / C, ...]`` tokens as on one device. The ``weights`` enter the body
    replicated over the manual axes: an FSDP-sharded layer is all-gathered once, at the
    body's entry, not once per chunk (the partitioner, left to itself, puts the
    all-gather next to each matmul, inside the chunk loop). Their cotangents are each
    device's partial sums over its chunks, carried through the loop without a
    collective and sent to a per-device slot (``jmem._src.partial_sums``); the slots' sum,
    outside, is the weight's cotangent, which the partitioner reduce-scatters into the
    FSDP split once."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = P(layout.axes or None, CONTEXT_AXIS if layout.c > 1 else None)
    leaves, tree = jax.tree.flatten(weights)
    n, slot_spec = partial_sums.slots(mesh, layout.manual_axes)
    sinks = [partial_sums.sink(w, n, slot_spec) for w in leaves]

    def body(leaves, sinks, *xs):
        leaves = [w if s is None else partial_sums.attach(w, s) for w, s in zip(leaves, sinks)]
        return tuple(over_tokens(fn, chunk, *xs, weights=jax.tree.unflatten(tree, leaves)))

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), [None if s is None else slot_spec for s in sinks], *[spec] * len(arrays)),
        out_specs=spec,
        axis_names=set(layout.manual_axes),
        check_vma=False,
    )
    return run(leaves, sinks, *arrays)


class _Layout:
    """How ``over_tokens`` lays out ``[B, S, ...]`` arrays so that each device loops over its
    own ``n`` tokens (``jmem._src.mesh_batch``): ``[n, ...]`` without a split (token axis 0,
    the layout XLA:GPU assigns the least memory: a leading axis of 1 cost 10% of the tiny
    QLoRA step's peak at 4,096 tokens), ``[G, n, ...]`` on a batch split (axis 1), and
    ``[G, C, n, ...]`` when the sequence is split over a context axis too (axis 2; ``fn``
    then sees each chunk as ``[G, C * chunk, ...]``, whose sequence axis the context axis
    splits)."""

    def __init__(self, b: int, s: int):
        self.b, self.s = b, s
        self.axes, self.g, self.c = token_groups(b, s)
        self.n = b // self.g * (s // self.c)
        self.ax = 2 if self.c > 1 else (1 if self.g > 1 else 0)
        # The axes a per-device loop runs manual over (``_per_device``); none under
        # expert parallelism, whose layer is a shard_map over the whole mesh already.
        split = self.axes + ((CONTEXT_AXIS,) if self.c > 1 else ())
        self.manual_axes = () if expert_split() > 1 else split

    def split(self, a):
        if self.ax == 2:
            return split_tokens(a, self.axes, self.g, self.c)
        lead = (self.g,) if self.ax else ()
        return constrain_groups(a.reshape(*lead, self.n, *a.shape[2:]), self.axes)

    def constrain(self, a):
        if self.ax == 2:
            return jax.lax.with_sharding_constraint(a, P(self.axes or None, CONTEXT_AXIS))
        return constrain_groups(a, self.axes)

    def to_fn(self, c, chunk):
        if self.ax == 2:
            return c.reshape(self.g, self.c * chunk, *c.shape[3:])
        return c if self.ax else c[None]

    def from_fn(self, y, chunk):
        if self.ax == 2:
            return y.reshape(self.g, self.c, chunk, *y.shape[2:])
        return y if self.ax else y[0]

    def merge(self, o):
        if self.ax == 2:
            return merge_tokens(o, self.b, self.s)
        return o.reshape(self.b, self.s, *o.shape[self.ax + 1 :])
