"""Host offload of optimizer state (and fp32 master weights) via JAX memory kinds.

Between training steps the optimizer state lives in host memory (memory kind
``"pinned_host"``); inside the jitted step each state leaf is copied to the accelerator,
updated by the wrapped optimizer and copied back. Any ``optax.GradientTransformation``
can be wrapped, including jmem's 8-bit optimizers and ``jmem.master_weights``
(whose state holds the fp32 masters, so those are offloaded too).

Mechanism (JAX >= 0.4.31 memory kinds; checked on JAX 0.10.2):

* Outside ``jit`` an array moves by ``jax.device_put(x, x.sharding.with_memory_kind(k))``:
  the sharding (mesh, ``PartitionSpec`` or single device) is kept and only the memory
  kind changes.
* Inside ``jit`` a traced value has no concrete sharding (with ``Auto`` mesh axes the
  abstract value carries only an abstract mesh), so the move is expressed as
  ``jax.device_put(x, jax.memory.Space.Host | Device)``: the memory *space* is recorded in
  the abstract value and the sharding is left to the input sharding / propagation. On
  GPU and TPU this lowers to XLA ``annotate_device_placement`` custom calls, which XLA's
  host-offloader turns into async host<->device copies; on CPU the lowering is a no-op
  but the output buffers still get the ``pinned_host`` memory kind, so correctness
  (values, memory kinds, shardings, donation) is testable on CPU, savings are not.
  JAX tracks only two memory spaces inside ``jit`` (``Host`` = ``"pinned_host"`` and
  ``Device``), so ``"unpinned_host"`` works only outside ``jit`` (``to_host``) and is
  rejected by ``offload``.

Device peak: the state is not resident on the accelerator during forward/backward, so
for a step whose peak is in the backward pass (the usual case) the peak drops by about
the state bytes. During the optimizer update the wrapper does not force an order on the
per-leaf copies: it moves the whole state tree in, runs ``inner.update`` and moves the
new state out, and XLA's scheduler decides how many leaves are staged on the device at
once (it may stage all of them; with buffer donation the new state reuses the staged
buffers). The bound is therefore: peak(offload) <= max(peak of forward/backward without
state, params + grads + state at update time). Splitting the update leaf by leaf is not
done because it is not valid for every optimizer (global-norm clipping, shared counts,
all-finite checks). ``benchmarks/offload_gpu.py`` measures the peak on a GPU.

References: JAX "Memories and host offloading" guide
(https://docs.jax.dev/en/latest/notebooks/host-offloading.html); ZeRO-Offload
(Ren et al., 2021, https://arxiv.org/abs/2101.06840) for the idea of keeping optimizer
state and master weights in host memory.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["offload", "to_host", "to_device", "abstract_like", "memory_kinds"]

_HOST = "pinned_host"
_DEVICE = "device"
# Memory kinds that JAX can express inside ``jit`` (as ``jax.memory.Space``).
_IN_JIT_SPACES = {_HOST: jax.memory.Space.Host, _DEVICE: jax.memory.Space.Device}


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _is_array(x: Any) -> bool:
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


def _check_kind(memory_kind: Any, devices=None) -> None:
  if not isinstance(memory_kind, str):
    raise TypeError(
        f"memory_kind must be a str such as 'pinned_host', got {type(memory_kind).__name__} "
        f"{memory_kind!r}.")
  devices = list(jax.local_devices() if devices is None else devices)
  available = memory_kinds(devices)
  if memory_kind not in available:
    raise ValueError(
        f"memory_kind={memory_kind!r} is not available on {devices[0].platform} device(s) "
        f"{devices[0]}...: their addressable memories (device.addressable_memories()) are "
        f"{available}. Pick one of these, or train without offload on this backend.")


def _devices_of(x: Any):
  if isinstance(x, jax.Array) and not _is_tracer(x):
    return list(x.sharding.device_set)
  return None


def _placement_like(tree: Any):
  """Where uncommitted state leaves (e.g. optax's scalar ``count``) should go.

  Moving an array to another memory kind commits it to its device; an uncommitted scalar
  on device 0 would then clash with parameters on a mesh ("incompatible devices" at
  ``jit``). So such leaves are replicated over the mesh of the first committed parameter
  (or put on its single device). Returns a ``Sharding`` or None.
  """
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not _is_tracer(leaf) and leaf.committed:
      s = leaf.sharding
      if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
      if len(s.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(s.device_set)))
      return None
  return None


def _move(x: Any, memory_kind: str, placement=None) -> Any:
  """Moves one leaf to ``memory_kind`` keeping its sharding; non-arrays pass through.

  ``placement`` (a Sharding) is used for uncommitted arrays and NumPy arrays.
  """
  if _is_tracer(x):
    space = _IN_JIT_SPACES.get(memory_kind)
    if space is None:
      raise ValueError(
          f"memory_kind={memory_kind!r} cannot be used inside jit: JAX {jax.__version__} "
          f"tracks only {sorted(_IN_JIT_SPACES)} in traced code (an output placed in "
          f"{memory_kind!r} would silently come back in device memory). Use 'pinned_host'.")
    return jax.device_put(x, space)
  if isinstance(x, jax.Array) and placement is not None and not x.committed:
    _check_kind(memory_kind, placement.device_set)
    return jax.device_put(x, placement.with_memory_kind(memory_kind))
  if isinstance(x, jax.Array):
    _check_kind(memory_kind, x.sharding.device_set)
    if x.sharding.memory_kind == memory_kind:
      return x
    return jax.device_put(x, x.sharding.with_memory_kind(memory_kind))
  if isinstance(x, (np.ndarray, np.generic)):
    if placement is not None:
      _check_kind(memory_kind, placement.device_set)
      return jax.device_put(x, placement.with_memory_kind(memory_kind))
    device = jax.local_devices()[0]
    _check_kind(memory_kind, [device])
    return jax.device_put(
        x, jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind))
  return x


def to_host(tree: Any, memory_kind: str = _HOST) -> Any:
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
        f"memory_kind must be a str such as 'pinned_host', got {type(memory_kind).__name__}.")
  return jax.tree.map(lambda x: _move(x, memory_kind), tree)


def to_device(tree: Any) -> Any:
  """Moves every array leaf of ``tree`` to accelerator memory (kind ``"device"``).

  The inverse of ``to_host``: shardings, shapes and dtypes are kept, only the memory kind
  changes. Works outside and inside ``jit``; non-array leaves pass through.

  Raises:
    ValueError: as ``to_host``.
  """
  return jax.tree.map(lambda x: _move(x, _DEVICE), tree)


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
  def one(x):
    if isinstance(x, jax.Array) and not _is_tracer(x):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if _is_array(x):
      return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    return x
  return jax.tree.map(one, tree)


def offload(inner: optax.GradientTransformation, *,
            memory_kind: str = _HOST) -> optax.GradientTransformationExtraArgs:
  """Keeps ``inner``'s optimizer state in host memory between steps.

  ``init`` runs ``inner.init`` and moves the resulting state to ``memory_kind``.
  ``update`` moves the state to device memory, runs ``inner.update`` and moves the new
  state back, so ``jax.jit(step, donate_argnums=...)`` returns a state whose leaves all
  report ``sharding.memory_kind == memory_kind`` while ``updates``/params stay in device
  memory. The state pytree has exactly the structure of ``inner``'s state (no wrapper),
  so checkpoints are interchangeable with the non-offloaded optimizer and the numerics
  are identical (bitwise on CPU; transfers do not change values).

  Shardings: with ``Explicit`` mesh axes the abstract values carry the sharding and it
  is kept exactly; with ``Auto`` axes it follows the jitted function's input sharding
  and XLA's propagation (pass ``out_shardings`` to ``jax.jit`` to pin it; the shardings
  in ``abstract_like(state)`` include the memory kind).

  Args:
    inner: any optax transformation (``optax.adamw``, ``jmem.optimizers.adamw_8bit``,
      ``jmem.master_weights.mixed_precision(...)``, chains, ...). Extra args passed to
      ``update`` are forwarded.
    memory_kind: ``"pinned_host"`` (default; the only host kind JAX tracks inside
      ``jit``) or ``"device"`` (no offload; handy for A/B runs).

  ``update(updates, state, params=None, *, skip=None, **extra_args)``: ``skip`` is an
  optional scalar bool; when true the returned state is the input state (bitwise) and
  the updates are zeros. Use it to skip non-finite steps: the select then runs on the
  device, where old and new state already are. Selecting between the offloaded old and
  new state *outside* ``update`` is worse: with a non-scalar predicate JAX refuses to
  trace it ("memory_space of all inputs passed to `select_n` must be the same"); with a
  scalar one it traces, but asks XLA to compute on ``pinned_host`` buffers (untested on
  GPU); moving both states to the device for it doubles the state's device bytes.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    TypeError: ``inner`` is not a GradientTransformation, ``memory_kind`` not a str, or
      ``skip`` not a scalar bool.
    ValueError: ``memory_kind`` is not usable inside ``jit`` (e.g. ``"unpinned_host"``);
      at ``init``/``update`` time, the backend's devices do not address ``memory_kind``
      (the message lists ``device.addressable_memories()``).

  Source: JAX host-offloading guide (memory kinds); ZeRO-Offload (arXiv:2101.06840).
  """
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"offload expects an optax.GradientTransformation, got {type(inner).__name__}.")
  if not isinstance(memory_kind, str):
    raise TypeError(f"memory_kind must be a str, got {type(memory_kind).__name__}.")
  if memory_kind not in _IN_JIT_SPACES:
    raise ValueError(
        f"offload(memory_kind={memory_kind!r}) is not supported: inside jit JAX "
        f"{jax.__version__} can place values only in {sorted(_IN_JIT_SPACES)} "
        f"(this backend's devices address {memory_kinds()}, see "
        f"device.addressable_memories()). Use memory_kind='pinned_host'.")
  inner = optax.with_extra_args_support(inner)

  def _check_backend(tree):
    devices = None
    for leaf in jax.tree.leaves(tree):
      devices = _devices_of(leaf)
      if devices:
        break
    _check_kind(memory_kind, devices)

  def init_fn(params):
    _check_backend(params)
    placement = _placement_like(params)
    return jax.tree.map(lambda x: _move(x, memory_kind, placement), inner.init(params))

  def update_fn(updates, state, params=None, *, skip=None, **extra_args):
    _check_backend(updates)
    old_state = to_device(state)
    new_updates, new_state = inner.update(updates, old_state, params, **extra_args)
    if skip is not None:
      skip = jnp.asarray(skip)
      if skip.shape != () or skip.dtype != jnp.bool_:
        raise TypeError(
            f"skip must be a scalar bool (e.g. ~jmem.loss_scale.all_finite(grads)), got "
            f"{skip.dtype}{list(skip.shape)}.")
      # Selected on the device, where both states already are (see docstring).
      new_state = jax.tree.map(
          lambda n, o: jax.lax.select(skip, o, n) if _is_array(n) else n,
          new_state, old_state)
      new_updates = jax.tree.map(
          lambda u: jax.lax.select(skip, jnp.zeros_like(u), u), new_updates)
    return new_updates, to_host(new_state, memory_kind)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
