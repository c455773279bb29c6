"""Moves between JAX memory kinds (``device`` <-> ``pinned_host``), outside and inside ``jit``.

Reference: JAX "Memories and host offloading" guide
(https://docs.jax.dev/en/latest/notebooks/host-offloading.html).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["memory_kinds", "to_host", "to_device", "abstract_like"]

HOST = "pinned_host"
DEVICE = "device"
# Memory kinds that JAX can express inside ``jit`` (as ``jax.memory.Space``).
IN_JIT_SPACES = {HOST: jax.memory.Space.Host, DEVICE: jax.memory.Space.Device}


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a traced value (inside ``jit``, ``make_jaxpr``, ...)."""
    return isinstance(x, jax.core.Tracer)


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array leaf (``jax.Array``, tracer, NumPy array or scalar)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def memory_kinds(devices=None) -> list[str]:
    """Memory kinds addressable by every one of ``devices`` (default: ``jax.local_devices()``).

    Returns:
      Sorted list of kind names, e.g. ``['device', 'pinned_host', 'unpinned_host']`` on
      CPU and GPU (JAX 0.10).
    """
    devices = list(jax.local_devices() if devices is None else devices)
    kinds = None
    for d in devices:
        k = {m.kind for m in d.addressable_memories()}
        kinds = k if kinds is None else kinds & k
    return sorted(kinds or ())


def check_kind(memory_kind: Any, devices=None) -> None:
    """Raises unless every one of ``devices`` (default: local devices) addresses ``memory_kind``.

    Raises:
      TypeError: ``memory_kind`` is not a str.
      ValueError: the kind is not addressable (the message lists the kinds that are).
    """
    if not isinstance(memory_kind, str):
        raise TypeError(
            f"memory_kind must be a str such as 'pinned_host', got {type(memory_kind).__name__} "
            f"{memory_kind!r}."
        )
    devices = list(jax.local_devices() if devices is None else devices)
    available = memory_kinds(devices)
    if memory_kind not in available:
        raise ValueError(
            f"memory_kind={memory_kind!r} is not available on {devices[0].platform} device(s) "
            f"{devices[0]}...: their addressable memories (device.addressable_memories()) are "
            f"{available}. Pick one of these, or train without offload on this backend."
        )


def devices_of(x: Any) -> list | None:
    """The devices of a concrete ``jax.Array``; None for tracers and other leaves."""
    if isinstance(x, jax.Array) and not is_tracer(x):
        return list(x.sharding.device_set)
    return None


def placement_like(tree: Any) -> jax.sharding.Sharding | None:
    """Where uncommitted state leaves (e.g. optax's scalar ``count``) should go.

    Moving an array to another memory kind commits it to its device; an uncommitted scalar
    on device 0 would then clash with parameters on a mesh ("incompatible devices" at
    ``jit``). So such leaves are replicated over the mesh of the first committed parameter
    (or put on its single device). Returns a ``Sharding`` or None.
    """
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not is_tracer(leaf) and leaf.committed:
            s = leaf.sharding
            if isinstance(s, jax.sharding.NamedSharding):
                return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
            if len(s.device_set) == 1:
                return jax.sharding.SingleDeviceSharding(next(iter(s.device_set)))
            return None
    return None


def _move_traced(x: Any, memory_kind: str) -> Any:
    space = IN_JIT_SPACES.get(memory_kind)
    if space is None:
        raise ValueError(
            f"memory_kind={memory_kind!r} cannot be used inside jit: JAX {jax.__version__} "
            f"tracks only {sorted(IN_JIT_SPACES)} in traced code (an output placed in "
            f"{memory_kind!r} would silently come back in device memory). Use 'pinned_host'."
        )
    return jax.device_put(x, space)


def _move_numpy(x: Any, memory_kind: str, placement) -> Any:
    if placement is not None:
        check_kind(memory_kind, placement.device_set)
        return jax.device_put(x, placement.with_memory_kind(memory_kind))
    device = jax.local_devices()[0]
    check_kind(memory_kind, [device])
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind))


def move(x: Any, memory_kind: str, placement=None) -> Any:
    """Moves one leaf to ``memory_kind`` keeping its sharding; non-arrays pass through.

    ``placement`` (a Sharding) is used for uncommitted arrays and NumPy arrays.
    """
    if is_tracer(x):
        return _move_traced(x, memory_kind)
    if isinstance(x, jax.Array) and placement is not None and not x.committed:
        check_kind(memory_kind, placement.device_set)
        return jax.device_put(x, placement.with_memory_kind(memory_kind))
    if isinstance(x, jax.Array):
        check_kind(memory_kind, x.sharding.device_set)
        if x.sharding.memory_kind == memory_kind:
            return x
        return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))
    if isinstance(x, (np.ndarray, np.generic)):
        return _move_numpy(x, memory_kind, placement)
    return x


def to_host(tree: Any, memory_kind: str = HOST) -> Any:
    """Moves every array leaf of ``tree`` to host memory, keeping shapes, dtypes and shardings.

    Works outside ``jit`` (concrete ``jax.Array``: same ``Sharding`` with
    ``memory_kind`` replaced; NumPy arrays go to the first local device's host memory) and
    inside ``jit`` (traced values: ``jax.device_put(x, jax.memory.Space.Host)``). Non-array
    leaves (``None``, Python numbers, ``optax.MaskedNode``) are returned unchanged.

    Args:
      tree: pytree of arrays of any shape/dtype (uint8 codes, float32 absmax, ... all fine).
      memory_kind: target memory kind; ``"pinned_host"`` (default) or, outside ``jit`` only,
        any other kind the devices address (e.g. ``"unpinned_host"``).

    Returns:
      A pytree with the same structure whose arrays have ``sharding.memory_kind ==
      memory_kind``.

    Raises:
      TypeError: ``memory_kind`` is not a string.
      ValueError: the devices holding an array do not address ``memory_kind`` (the message
        lists ``device.addressable_memories()``), or a kind other than ``"pinned_host"`` is
        requested inside ``jit``.
    """
    if not isinstance(memory_kind, str):
        raise TypeError(
            f"memory_kind must be a str such as 'pinned_host', got {type(memory_kind).__name__}."
        )
    return jax.tree.map(lambda x: move(x, memory_kind), tree)


def to_device(tree: Any) -> Any:
    """Moves every array leaf of ``tree`` to accelerator memory (kind ``"device"``).

    The inverse of ``to_host``: shardings, shapes and dtypes are kept, only the memory kind
    changes. Works outside and inside ``jit``; non-array leaves pass through.

    Raises:
      ValueError: as ``to_host``.
    """
    return jax.tree.map(lambda x: move(x, DEVICE), tree)


def _abstract_leaf(x: Any) -> Any:
    if isinstance(x, jax.Array) and not is_tracer(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if is_array(x):
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return x


def abstract_like(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` per array leaf carrying the leaf's sharding *and* memory kind.

    Use as the restore target for a checkpoint of offloaded state: orbax's saved metadata
    records shardings without the memory kind, so restoring with these targets (e.g.
    ``checkpointer.restore(path, abstract_like(state))`` or
    ``ocp.args.StandardRestore(abstract_like(state))``) brings the state back directly
    into host memory instead of device memory.

    Args:
      tree: pytree of concrete ``jax.Array`` (or NumPy arrays, which get no sharding).

    Returns:
      Same structure with ``jax.ShapeDtypeStruct(shape, dtype, sharding=x.sharding)``
      leaves; non-array leaves unchanged.
    """
    return jax.tree.map(_abstract_leaf, tree)
