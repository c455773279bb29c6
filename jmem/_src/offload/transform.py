"""``offload``: an optax wrapper keeping any optimizer's state in host memory between steps.

Mechanism, device-peak bounds and what is verified where: docs/offload.md. References: JAX
"Memories and host offloading" guide; ZeRO-Offload (Ren et al., 2021, arXiv:2101.06840).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem._src.offload import disk as _disk
from jmem._src.offload import leaf_by_leaf as _leaf_by_leaf
from jmem._src.offload.memory_kinds import HOST
from jmem._src.offload.memory_kinds import IN_JIT_SPACES
from jmem._src.offload.memory_kinds import abstract_like
from jmem._src.offload.memory_kinds import check_kind
from jmem._src.offload.memory_kinds import devices_of
from jmem._src.offload.memory_kinds import is_array
from jmem._src.offload.memory_kinds import memory_kinds
from jmem._src.offload.memory_kinds import move
from jmem._src.offload.memory_kinds import placement_like
from jmem._src.offload.memory_kinds import to_device
from jmem._src.offload.memory_kinds import to_host
from jmem._src.offload.params import to_space_of

# to_host/to_device/abstract_like/memory_kinds live in memory_kinds.py; re-exported here.
__all__ = ["offload", "to_host", "to_device", "abstract_like", "memory_kinds"]

DISK = "disk"  # memory_kind of the disk rung: the state in files under ``directory``


def _check_args(inner: Any, memory_kind: Any, leaf_by_leaf: Any, directory: Any) -> None:
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"offload expects an optax.GradientTransformation, got {type(inner).__name__}."
        )
    if not isinstance(memory_kind, str):
        raise TypeError(f"memory_kind must be a str, got {type(memory_kind).__name__}.")
    if (memory_kind == DISK) != (directory is not None):
        raise ValueError(
            "offload(memory_kind='disk') needs directory=PATH, and directory= is only for "
            f"memory_kind='disk' (got memory_kind={memory_kind!r}, directory={directory!r})."
        )
    if memory_kind == DISK:
        _disk.check_directory(directory, arg="offload(directory=...)")
    elif memory_kind not in IN_JIT_SPACES:
        raise ValueError(
            f"offload(memory_kind={memory_kind!r}) is not supported: inside jit JAX "
            f"{jax.__version__} can place values only in {sorted(IN_JIT_SPACES)} "
            f"(this backend's devices address {memory_kinds()}, see "
            f"device.addressable_memories()). Use memory_kind='pinned_host' (or 'disk' with "
            f"directory=PATH)."
        )
    if not isinstance(leaf_by_leaf, (bool, np.bool_)):
        raise TypeError(
            f"leaf_by_leaf must be a bool, got {type(leaf_by_leaf).__name__} {leaf_by_leaf!r}."
        )


def _check_skip(skip: Any) -> jax.Array:
    skip = jnp.asarray(skip)
    if skip.shape != () or skip.dtype != jnp.bool_:
        raise TypeError(
            f"skip must be a scalar bool (e.g. ~jmem.all_finite(grads)), got "
            f"{skip.dtype}{list(skip.shape)}."
        )
    return skip


def _check_backend(tree: Any, memory_kind: str) -> None:
    """Raises unless the devices of ``tree``'s first concrete array address ``memory_kind``."""
    devices = None
    for leaf in jax.tree.leaves(tree):
        devices = devices_of(leaf)
        if devices:
            break
    check_kind(memory_kind, devices)


def _select_state(skip: jax.Array, new: Any, old: Any) -> Any:
    return jax.lax.select(skip, old, new) if is_array(new) else new


def _select_update(skip: jax.Array, u: jax.Array) -> jax.Array:
    return jax.lax.select(skip, jnp.zeros_like(u), u)


def _init(inner, memory_kind: str, directory: Any, params: Any) -> Any:
    """``inner.init(params)`` with every array leaf moved to ``memory_kind`` (to files
    under ``directory`` for ``"disk"``)."""
    if memory_kind == DISK:
        return _disk.init(inner, directory, params)
    _check_backend(params, memory_kind)
    placement = placement_like(params)
    return jax.tree.map(lambda x: move(x, memory_kind, placement), inner.init(params))


def _whole_tree_update(inner, memory_kind, updates, state, params, skip, extra_args):
    """Moves the whole state in, runs ``inner.update`` once, moves the new state out."""
    old_state = to_device(state)
    # Host-resident gradients/params (full-parameter training with streamed params) come
    # to the device with the state, and the updates go back to their params' memory.
    refs = updates if params is None else params
    new_updates, new_state = inner.update(
        to_device(updates), old_state, to_device(params), **extra_args
    )
    if skip is not None:  # selected on the device, where both states already are
        new_state = jax.tree.map(functools.partial(_select_state, skip), new_state, old_state)
        new_updates = jax.tree.map(functools.partial(_select_update, skip), new_updates)
    return jax.tree.map(to_space_of, new_updates, refs), to_host(new_state, memory_kind)


def _update(
    inner, memory_kind, leaf_by_leaf, cache, /, updates, state, params=None, *, skip=None, **extra
):
    """The offloaded ``update``: ``inner``, ``memory_kind``, ``leaf_by_leaf`` and the program
    ``cache`` are bound by ``offload``; the rest is ``GradientTransformationExtraArgs.update``."""
    if skip is not None:
        skip = _check_skip(skip)
    if memory_kind == DISK:
        return _disk.update(inner, cache, updates, state, params, skip, extra)
    _check_backend(updates, memory_kind)
    if leaf_by_leaf and len(jax.tree.leaves(updates)) >= 2:
        return _leaf_by_leaf.update(inner, cache, updates, state, params, skip, extra, memory_kind)
    return _whole_tree_update(inner, memory_kind, updates, state, params, skip, extra)


def offload(
    inner: optax.GradientTransformation,
    *,
    memory_kind: str = HOST,
    leaf_by_leaf: bool = False,
    directory: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Keeps ``inner``'s optimizer state in host memory between steps.

    ``init`` runs ``inner.init`` and moves the state to ``memory_kind``; ``update`` moves
    the state to the device, runs ``inner.update`` and moves the new state back. The state
    has exactly ``inner``'s structure (checkpoints are interchangeable) and the values are
    those of ``inner`` (bitwise on CPU). Mechanism, device peak, donation and shardings:
    docs/offload.md.

    Args:
      inner: any optax transformation (``optax.adamw``, ``jmem.adamw_8bit``,
        ``jmem.mixed_precision(...)``, chains, ...).
      memory_kind: ``"pinned_host"`` (default; the only host kind JAX tracks inside
        ``jit``) or ``"device"`` (no offload; for A/B runs).
      leaf_by_leaf: a Python bool. True: update one parameter leaf at a time, so about
        two leaves' state is on the device at once; only for *separable* optimizers
        (each leaf's update and state depend only on its own gradient, param and state
        and on shared scalars: adam/adamw/lion/sgd, ``adamw_8bit``, ``mixed_precision``
        of those; not ``clip_by_global_norm``, ``apply_if_finite``, ``MultiSteps``). A
        layer stack ``[L, ...]`` whose update is elementwise (adam/adamw/lion/sgd and
        ``mixed_precision`` of those) is updated one row at a time, so one row's state
        is on the device (docs/offload.md, "Updating a layer stack row by row").
      directory: with ``memory_kind="disk"``, the directory (created if its parent
        exists) where ``init`` writes each parameter's state leaves, one file each; the
        state is then a ``DiskState`` and ``update`` streams it leaf by leaf (read, update
        on the device, write back; leaf-by-leaf mode's program, work on the gradients
        alone such as ``clip_by_global_norm`` allowed). Single device only (ordered
        ``io_callback``s); checkpoint ``state.full()``, restore with ``state.restored(full)``.

    The returned ``update(updates, state, params=None, *, skip=None, **extra_args)``
    takes ``updates`` (and ``params``, same structure) as ``inner`` does and forwards
    ``extra_args``. ``skip`` is None or a scalar bool array: when true the returned state
    is the input state bitwise and the updates are zeros (selected on the device).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state arrays report
      ``sharding.memory_kind == memory_kind`` after ``init`` and ``update``.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation, ``memory_kind`` not a str,
        ``leaf_by_leaf`` not a bool, or ``skip`` not a scalar bool.
      ValueError: ``memory_kind`` is not usable inside ``jit`` (e.g. ``"unpinned_host"``);
        ``"disk"`` without ``directory`` (or ``directory`` otherwise), a ``directory``
        whose parent is missing, that is not writable, or (at ``init``) too small;
        at ``init``/``update``, the devices do not address ``memory_kind`` (the message
        lists them); in leaf-by-leaf mode, at ``update``, a non-separable optimizer, a
        state that does not split by parameter leaf, or ``params`` with another
        structure than ``updates``.

    Source: JAX host-offloading guide (memory kinds); ZeRO-Offload (arXiv:2101.06840);
    ZeRO-Infinity (arXiv:2104.07857) for the disk rung.
    """
    _check_args(inner, memory_kind, leaf_by_leaf, directory)
    inner = optax.with_extra_args_support(inner)
    cache: dict = {}  # leaf-by-leaf programs per tree structure/shapes, filled when traced
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, inner, memory_kind, directory),
        functools.partial(_update, inner, memory_kind, bool(leaf_by_leaf), cache),
    )
