"""Parameters in host memory, streamed to the device layer by layer inside the layer scan.

The layer-stacked weights (``[L, ...]``: NF4 codes and absmax, or bf16 kernels) stay in
``pinned_host``; the scan body copies its layer's slice to the device (``fetch``), so the
forward pass, the remat recomputation and the backward pass each hold one layer's weights
on the device at a time. The copies are XLA's: the host-memory dynamic-slice and the move
to the device become one asynchronous host-to-device copy per iteration, which XLA's
scheduler overlaps with the iteration's other work (docs/offload.md). References:
ZeRO-Infinity (Rajbhandari et al., 2021, arXiv:2104.07857) for streaming parameters from
host memory; JAX's "Memories and host offloading" guide for the memory kinds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmem._src.offload.memory_kinds import HOST
from jmem._src.offload.memory_kinds import is_tracer
from jmem._src.offload.memory_kinds import to_device
from jmem._src.offload.memory_kinds import to_host

__all__ = [
    "fetch",
    "fetch_resident",
    "params_to_host",
    "is_on_host",
    "offloads_params",
    "in_host_space",
    "to_space_of",
    "streamed_norm_and_finite",
    "host_zeros",
    "streamed_to_host",
]

#: The params entry holding the layer-stacked weights (streamed; the rest is fetched whole).
LAYERS = "layers"


def offloads_params(levers: Any) -> bool:
    """Whether ``levers`` (a ``jmem.Levers``/``ResolvedLevers`` or None) stream params."""
    return bool(getattr(levers, "offload_params", False))


def fetch(tree: Any) -> Any:
    """Copies every array leaf of ``tree`` to device memory; inside ``jit`` a
    ``device_put`` to ``jax.memory.Space.Device`` (a no-op for leaves already there).

    Used on one layer's slice inside the layer scan: XLA turns the dynamic-slice of the
    host-resident stack plus this copy into one host-to-device transfer of that layer.
    """
    return to_device(tree)


def fetch_resident(params: Any, levers: Any) -> Any:
    """``params`` with every top-level entry but ``"layers"`` (embedding, final norm, LM
    head) copied to the device whole, when ``levers.offload_params``; else ``params``.

    These are device-resident for the call (the embedding's gather and the chunked loss
    read all of them); only the layer stack is streamed."""
    if not offloads_params(levers) or not isinstance(params, dict):
        return params
    return {k: v if k == LAYERS else fetch(v) for k, v in params.items()}


def params_to_host(tree: Any) -> Any:
    """Moves every array leaf of ``tree`` to ``pinned_host`` (outside or inside ``jit``).

    For a params pytree run with ``jmem.Levers(offload_params=True)`` (e.g. the frozen
    NF4 base of QLoRA); ``jmem.train_step`` does it itself for its ``frozen`` params.

    Raises:
      ValueError: the devices holding an array have no ``pinned_host`` memory.
    """
    return to_host(tree, HOST)


def is_on_host(tree: Any) -> bool:
    """Whether every concrete array leaf of ``tree`` is in ``pinned_host`` memory (tracers
    and non-array leaves are not looked at)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not is_tracer(x)]
    return all(getattr(x.sharding, "memory_kind", None) == HOST for x in leaves)


def in_host_space(x: Any) -> bool:
    """Whether the array ``x`` (concrete or traced) lives in host memory: a traced value
    typed ``jax.memory.Space.Host`` or a concrete array in ``pinned_host``."""
    if is_tracer(x):
        return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
    return isinstance(x, jax.Array) and getattr(x.sharding, "memory_kind", None) == HOST


def to_space_of(x: Any, ref: Any) -> Any:
    """``x`` moved to host memory when ``ref`` is in host memory (``in_host_space``), else
    ``x``. Used for the new params of a step whose trainable params are host-resident
    (full-parameter training with ``Levers(offload_params=True)``): each leaf's new value
    goes back to host memory as soon as it is computed."""
    return to_host(x, HOST) if in_host_space(ref) and not in_host_space(x) else x


def _sumsq_and_finite(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of squares in float32, all finite)`` of one leaf; a host-resident leaf of
    rank >= 3 (a layer stack) is read one slice along its first axis at a time."""
    if not in_host_space(x):
        return jnp.sum(jnp.square(x.astype(jnp.float32))), jnp.isfinite(x).all()
    if x.ndim < 3:
        x = fetch(x).astype(jnp.float32)
        return jnp.sum(jnp.square(x)), jnp.isfinite(x).all()

    def body(carry, xi):
        xi = fetch(xi).astype(jnp.float32)
        return (carry[0] + jnp.sum(jnp.square(xi)), carry[1] & jnp.isfinite(xi).all()), None

    init = (jnp.zeros((), jnp.float32), jnp.ones((), bool))
    return jax.lax.scan(body, init, x)[0]


def streamed_norm_and_finite(tree: Any) -> tuple[jax.Array, jax.Array]:
    """``(global L2 norm, all finite)`` of the float leaves of ``tree`` (scalars), with
    host-resident layer stacks read onto the device one layer at a time (the gradients of
    full-parameter training with ``Levers(offload_params=True)``).

    Sums squares in float32 per layer and returns the norm in the leaves' result dtype (as
    ``optax.tree.norm``, which sums each leaf in its own dtype: for bf16 gradients the two
    differ by bf16 rounding); the finite check is exact.
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return jnp.zeros((), jnp.float32), jnp.ones((), bool)
    parts = [_sumsq_and_finite(x) for x in leaves]
    total = sum(p[0] for p in parts[1:]) + parts[0][0]
    dtype = jnp.result_type(*leaves)  # the dtype optax.tree.norm would give
    return jnp.sqrt(total).astype(dtype), jnp.stack([p[1] for p in parts]).all()


def host_zeros(shape: tuple, dtype: Any) -> jax.Array:
    """Zeros of ``shape``/``dtype`` in host memory (inside ``jit``), written from the device
    one slice along the first axis at a time for rank >= 3 (a layer stack): the accumulator
    of host-resident gradients never stands whole on the device."""
    if len(shape) < 3:
        return to_host(jnp.zeros(shape, dtype), HOST)
    slice_zeros = lambda carry, _: (carry, to_host(jnp.zeros(shape[1:], dtype), HOST))
    return jax.lax.scan(slice_zeros, None, length=shape[0])[1]


def streamed_to_host(fn: Any, *leaves: jax.Array) -> jax.Array:
    """``fn(*leaves)`` for an elementwise ``fn`` of host-resident leaves of one shape,
    computed on the device and returned in host memory: layer stacks (rank >= 3) one slice
    along the first axis at a time (a scan), smaller leaves whole. Elementwise, so the
    values are those of ``fn`` on the whole leaves, bit for bit."""
    if leaves[0].ndim < 3:
        return to_host(fn(*fetch(leaves)), HOST)
    body = lambda carry, xs: (carry, to_host(fn(*fetch(xs)), HOST))
    return jax.lax.scan(body, None, leaves)[1]
