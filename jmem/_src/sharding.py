"""FSDP / ZeRO placement rules for a train state over a ``jax.sharding`` mesh (docs/sharding.md).

Sources: ZeRO (arXiv:1910.02054), PyTorch FSDP (arXiv:2304.11277), GSPMD (arXiv:2105.04663).
"""

from __future__ import annotations

import math
import re
from typing import Any
from typing import Callable

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmem._src import lora as _lora
from jmem._src import nf4 as _nf4
from jmem._src import quantization as _qz

__all__ = [
    "DATA_AXIS",
    "FSDP_AXIS",
    "CONTEXT_AXIS",
    "EXPERT_AXIS",
    "STRATEGIES",
    "make_mesh",
    "array_spec",
    "param_shardings",
    "gradient_shardings",
    "opt_state_shardings",
    "state_shardings",
    "batch_sharding",
    "shard_state",
    "shard_batch",
    "constrain_gradients",
]

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
#: The context-parallel axis: one sequence split over its devices (docs/sharding.md).
CONTEXT_AXIS = "context"
#: The expert-parallel axis: the experts of a mixture-of-experts layer split over its
#: devices, the batch split over it too (docs/sharding.md, "Expert parallelism").
EXPERT_AXIS = "expert"
#: Param paths whose leaves carry a stacked expert axis ``[*L, E, in, out]``.
EXPERT_KERNELS = re.compile(r"expert_(gate|up|down)")
STRATEGIES = ("zero1", "zero2", "zero3", "fsdp")
#: Dense arrays with fewer elements are replicated (a 4096-element fp32 tensor is 16 KiB).
DEFAULT_MIN_SIZE = 4096


# ----------------------------------------------------------------------------------------
# Mesh.
# ----------------------------------------------------------------------------------------


def make_mesh(
    data: int = 1, fsdp: int | None = None, devices=None, *, context: int = 1, expert: int = 1
) -> Mesh:
    """A mesh ``("data", "fsdp", "context")`` with Auto axis types (module docstring), or
    ``("data", "fsdp", "expert", "context")`` for ``expert > 1``.

    Args:
      data: size of the data-parallel axis (replicas of params and state).
      fsdp: size of the sharding axis; default ``len(devices) // (data * expert * context)``.
      devices: devices to use, in order (default ``jax.devices()``, all processes' devices).
        The context axis varies fastest, then expert, then fsdp: consecutive devices (one
        host's) form a context group, then an expert group, then an fsdp group.
      context: size of the context-parallel axis: each sequence is split over it
        (docs/sharding.md, "Context parallelism"); params are replicated over it.
      expert: size of the expert-parallel axis: the routed experts' stacked kernels are
        split over it, and the batch too (docs/sharding.md, "Expert parallelism").

    Returns:
      ``jax.sharding.Mesh`` of shape ``(data, fsdp, context)`` or ``(data, fsdp, expert,
      context)``.

    Raises:
      ValueError: non-positive sizes, or a product of the sizes other than ``len(devices)``.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("context", context), ("expert", expert)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}.")
    rest = data * context * expert
    if fsdp is None:
        if len(devices) % rest:
            raise ValueError(
                f"data * expert * context = {rest} does not divide the {len(devices)} "
                f"devices; pass fsdp= explicitly or choose a divisor."
            )
        fsdp = len(devices) // rest
    if not isinstance(fsdp, (int, np.integer)) or fsdp < 1:
        raise ValueError(f"fsdp must be a positive int, got {fsdp!r}.")
    n = fsdp * rest
    if n != len(devices):
        what = "data * fsdp * context" if expert == 1 else "data * fsdp * expert * context"
        sizes = f"{data} * {fsdp}" + (f" * {expert}" if expert > 1 else "") + f" * {context}"
        raise ValueError(
            f"{what} = {sizes} = {n} but {len(devices)} devices were given; pass "
            f"devices=jax.devices()[:{n}] or sizes whose product is {len(devices)}."
        )
    shape, axes = (data, fsdp, context), (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS)
    if expert > 1:
        shape, axes = (
            (data, fsdp, expert, context),
            (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, CONTEXT_AXIS),
        )
    arr = np.asarray(devices, dtype=object).reshape(*(int(d) for d in shape))
    return Mesh(arr, axes, axis_types=(AxisType.Auto,) * len(axes))


def expert_size(mesh: Any) -> int:
    """Size of ``mesh``'s ``"expert"`` axis (1 when it has none)."""
    return int(dict(mesh.shape).get(EXPERT_AXIS, 1))


def batch_axes(mesh: Any) -> tuple[str, ...]:
    """The axes a batch's rows are split over: ``("data", "fsdp")``, and ``"expert"`` when
    the mesh has one (outside the routed experts it is one more data axis)."""
    return (DATA_AXIS, FSDP_AXIS) + ((EXPERT_AXIS,) if EXPERT_AXIS in mesh.axis_names else ())


def context_size(mesh: Any) -> int:
    """Size of ``mesh``'s ``"context"`` axis (1 when it has none)."""
    return int(dict(mesh.shape).get(CONTEXT_AXIS, 1))


def check_mesh(mesh: Any) -> Mesh:
    if not isinstance(mesh, Mesh | AbstractMesh):  # AbstractMesh: jmem.targets.mesh
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (see jmem.sharding.make_mesh), "
            f"got {type(mesh).__name__}."
        )
    missing = [a for a in (DATA_AXIS, FSDP_AXIS) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"mesh has axes {mesh.axis_names}; jmem.sharding needs axes "
            f"{(DATA_AXIS, FSDP_AXIS)} (missing {missing}). Build it with "
            f"jmem.sharding.make_mesh(data=..., fsdp=...)."
        )
    if any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        raise ValueError(
            "mesh has Explicit axis types; jmem.sharding's rules need Auto axes "
            "(module docstring). Build it with jmem.sharding.make_mesh or "
            "jax.make_mesh(..., axis_types=(AxisType.Auto,) * 2)."
        )
    return mesh


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    return strategy


def _fsdp_size(mesh: Mesh) -> int:
    return int(mesh.shape[FSDP_AXIS])


# ----------------------------------------------------------------------------------------
# Per-leaf rules.
# ----------------------------------------------------------------------------------------


def shape_of(x: Any) -> tuple[int, ...] | None:
    s = getattr(x, "shape", None)
    return None if s is None else tuple(int(d) for d in s)


def array_spec(shape: tuple[int, ...], fsdp_size: int, *, min_size: int = DEFAULT_MIN_SIZE) -> P:
    """``PartitionSpec`` of a dense array under the FSDP rule (module docstring).

    Args:
      shape: global shape (elements per axis).
      fsdp_size: devices on the ``"fsdp"`` axis.
      min_size: arrays with fewer elements are replicated.

    Returns:
      ``P()`` (replicated) or a spec with ``"fsdp"`` on one of the last two axes.
    """
    shape = tuple(int(d) for d in shape)
    if fsdp_size <= 1 or not shape or math.prod(shape) < min_size:
        return P()
    candidates = range(max(0, len(shape) - 2), len(shape))
    best = None
    for i in candidates:
        if shape[i] % fsdp_size == 0 and (best is None or shape[i] > shape[best]):
            best = i
    if best is None:
        return P()
    return P(*([None] * best + [FSDP_AXIS]))


def _sharding(mesh: Mesh, spec: P, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


def _quantized_shardings(q: _qz.QuantizedArray, mesh: Mesh, kind) -> _qz.QuantizedArray:
    nb = shape_of(q.codes)[0]
    n = _fsdp_size(mesh)
    split = n > 1 and nb % n == 0
    codes = _sharding(mesh, P(FSDP_AXIS) if split else P(), kind(q.codes))
    absmax = _sharding(mesh, P(FSDP_AXIS) if split else P(), kind(q.absmax))
    return jax.tree.unflatten(jax.tree.structure(q), [codes, absmax])


def _nf4_shardings(w: _nf4.NF4Array, mesh: Mesh, split_ok: bool, kind) -> _nf4.NF4Array:
    n = _fsdp_size(mesh)
    ab = shape_of(w.absmax)
    nb = ab[-1] if ab else 0
    split = split_ok and n > 1 and nb > 0 and nb % n == 0

    def last(x):
        if x is None:
            return None
        nd = len(shape_of(x))
        spec = P(*([None] * (nd - 1) + [FSDP_AXIS])) if split and nd else P()
        return _sharding(mesh, spec, kind(x))

    def rep(x):
        return None if x is None else _sharding(mesh, P(), kind(x))

    return _nf4.NF4Array(
        packed=last(w.packed),
        absmax=last(w.absmax),
        absmax_scale=rep(w.absmax_scale),
        absmax_offset=rep(w.absmax_offset),
        shape=w.shape,
        dtype=w.dtype,
        block_size=w.block_size,
        double_quant=w.double_quant,
        batch_ndim=w.batch_ndim,
    )


def _is_special(x: Any) -> bool:
    return isinstance(x, (_qz.QuantizedArray, _nf4.NF4Array, _lora.LoraWeight))


def _existing_kind(x: Any) -> str | None:
    """A non-device memory kind the leaf already lives in (kept), else None; a traced
    value in ``jax.memory.Space.Host`` (inside ``jit``) is ``"pinned_host"``."""
    if isinstance(x, jax.core.Tracer):
        host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
        return "pinned_host" if host else None
    s = getattr(x, "sharding", None)
    k = getattr(s, "memory_kind", None)
    return k if k not in (None, "device") else None


def _kind_fn(memory_kind: str | None) -> Callable[[Any], str | None]:
    return lambda x: memory_kind if memory_kind is not None else _existing_kind(x)


def _tree_shardings(
    tree: Any,
    mesh: Mesh,
    *,
    split: bool,
    min_size: int,
    memory_kind: str | None = None,
    split_lora: bool = False,
) -> Any:
    """Shardings for a params-like (or optimizer-state-like) tree; ``split=False`` replicates
    every dense array and NF4 leaf. QuantizedArrays are split by blocks when ``split``.
    ``LoraWeight`` nodes are replicated, unless ``split_lora`` (an optimizer state, whose
    moments of ``a`` and ``b`` follow the rules of their own leaves)."""
    n = _fsdp_size(mesh)
    kind = _kind_fn(memory_kind)

    def one(x):
        if x is None:
            return None
        if isinstance(x, _qz.QuantizedArray):
            if split:
                return _quantized_shardings(x, mesh, kind)
            return jax.tree.map(lambda l: _sharding(mesh, P(), kind(l)), x)
        if isinstance(x, _nf4.NF4Array):
            return _nf4_shardings(x, mesh, split, kind)
        if isinstance(x, _lora.LoraWeight):
            if split_lora:
                inner = lambda y: y is not x and (y is None or _is_special(y))
                leaves, treedef = jax.tree.flatten(x, is_leaf=inner)
                return jax.tree.unflatten(treedef, [one(c) for c in leaves])
            return jax.tree.map(lambda l: _sharding(mesh, P(), kind(l)), x)
        shape = shape_of(x)
        if shape is None:  # Python scalars and other non-array leaves: replicated.
            return _sharding(mesh, P(), kind(x))
        spec = array_spec(shape, n, min_size=min_size) if split else P()
        return _sharding(mesh, spec, kind(x))

    out = jax.tree.map(one, tree, is_leaf=lambda x: x is None or _is_special(x))
    return _expert_shardings(tree, out, mesh) if expert_size(mesh) > 1 else out


def _add_expert(s: NamedSharding | None, shape, axis: int) -> NamedSharding | None:
    """``s`` with ``"expert"`` on ``axis`` of a leaf of ``shape`` (unchanged when the axis
    does not exist, is taken, or the expert axis does not divide it)."""
    n = expert_size(s.mesh) if s is not None else 1
    if s is None or shape is None or not 0 <= axis < len(shape) or shape[axis] % n:
        return s
    spec = list(s.spec) + [None] * (len(shape) - len(s.spec))
    if spec[axis] is not None:
        return s
    spec[axis] = EXPERT_AXIS
    return NamedSharding(s.mesh, P(*spec), memory_kind=s.memory_kind)


def _expert_shardings(tree: Any, shardings: Any, mesh: Mesh) -> Any:
    """``shardings`` with the stacked expert axis ``E`` of the routed experts' kernels
    (paths matching ``EXPERT_KERNELS``) split over ``"expert"``: a dense kernel or LoRA
    factor ``[*L, E, in, out]`` on its axis ``ndim - 3``, an NF4 kernel's codes and scales
    ``[*L, E, ...]`` on axis ``batch_ndim - 1``; any FSDP split stays on its axis."""

    def dense(x, s):
        shape = shape_of(x)
        return s if shape is None or len(shape) < 3 else _add_expert(s, shape, len(shape) - 3)

    def one(path, x, s):
        if x is None or not EXPERT_KERNELS.search(jax.tree_util.keystr(path)):
            return s
        if isinstance(x, _qz.QuantizedArray):
            return s
        if isinstance(x, _nf4.NF4Array):
            axis = x.batch_ndim - 1
            return jax.tree.map(lambda l, t: _add_expert(t, shape_of(l), axis), x, s)
        if isinstance(x, _lora.LoraWeight):
            return jax.tree.map(dense, x, s)
        return dense(x, s)

    special = lambda x: x is None or _is_special(x)
    return jax.tree_util.tree_map_with_path(one, tree, shardings, is_leaf=special)


def param_shardings(
    params: Any,
    mesh: Mesh,
    strategy: str = "zero3",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
    memory_kind: str | None = None,
) -> Any:
    """``NamedSharding`` per leaf of ``params`` (or of a frozen base) for ``strategy``.

    Args:
      params: pytree of arrays / ``ShapeDtypeStruct`` (global shapes), ``NF4Array`` and
        ``LoraWeight`` nodes.
      mesh: a mesh with ``"data"`` and ``"fsdp"`` axes (:func:`make_mesh`).
      strategy: one of ``STRATEGIES``; ``"zero1"``/``"zero2"`` replicate params.
      min_size: dense arrays with fewer elements are replicated.
      memory_kind: e.g. ``"pinned_host"`` for params streamed from host memory
        (``jmem.Levers(offload_params=True)``): the same ``PartitionSpec`` in that memory;
        None keeps each leaf's current non-device memory kind, if any.

    Returns:
      A pytree like ``params`` whose array leaves are ``NamedSharding``.

    Raises:
      ValueError / TypeError: unknown strategy, or a mesh without the two axes / with
      Explicit axes.
    """
    check_mesh(mesh)
    split = check_strategy(strategy) in ("zero3", "fsdp")
    return _tree_shardings(params, mesh, split=split, min_size=min_size, memory_kind=memory_kind)


def gradient_shardings(
    grads: Any, mesh: Mesh, strategy: str = "zero3", *, min_size: int = DEFAULT_MIN_SIZE
) -> Any:
    """Shardings of the gradients: replicated for ``"zero1"`` (an all-reduce), split by the
    dense rule for the others (a reduce-scatter); LoRA adapters' gradients are replicated.

    Args / Raises: as :func:`param_shardings`.
    """
    check_mesh(mesh)
    split = check_strategy(strategy) != "zero1"
    return _tree_shardings(grads, mesh, split=split, min_size=min_size)


def opt_state_shardings(
    opt_state: Any, mesh: Mesh, *, memory_kind: str | None = None, min_size: int = DEFAULT_MIN_SIZE
) -> Any:
    """Shardings of an optimizer state: split under every strategy (ZeRO-1 and up).

    Dense leaves (fp32 moments, fp32 masters) use the dense rule on their global shape (the
    moments of LoRA adapters too: unlike the adapters, they are split),
    ``QuantizedArray`` moments split by whole blocks, scalars (counts, injected
    hyperparameters) are replicated.

    Args:
      opt_state: the state pytree (arrays or ``ShapeDtypeStruct``).
      mesh: see :func:`param_shardings`.
      memory_kind: e.g. ``"pinned_host"`` for an offloaded state (``jmem.offload``); None
        keeps each leaf's current non-device memory kind, if any.
      min_size: dense arrays with fewer elements are replicated.

    Returns:
      A pytree like ``opt_state`` of ``NamedSharding``.
    """
    check_mesh(mesh)
    return _tree_shardings(
        opt_state, mesh, split=True, min_size=min_size, memory_kind=memory_kind, split_lora=True
    )


def replicated(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda x: _sharding(mesh, P(), _existing_kind(x)), tree)


def state_shardings(
    abstract_state: Any,
    mesh: Mesh,
    strategy: str = "zero3",
    *,
    opt_state_memory_kind: str | None = None,
    min_size: int = DEFAULT_MIN_SIZE,
    params_memory_kind: str | None = None,
    frozen_memory_kind: str | None = None,
) -> Any:
    """``NamedSharding`` for every leaf of a ``jmem.TrainState``.

    Args:
      abstract_state: a ``TrainState`` of arrays or ``ShapeDtypeStruct`` (e.g.
        ``TrainStep.abstract_state(params)``); any object with ``step``, ``params``,
        ``opt_state``, ``loss_scale``, ``frozen``, ``fp8`` fields and ``.replace``.
      mesh: mesh with ``"data"`` and ``"fsdp"`` axes, Auto axis types (:func:`make_mesh`).
      strategy: ``"zero1"``, ``"zero2"``, ``"zero3"`` or ``"fsdp"`` (module docstring).
      opt_state_memory_kind: memory kind of the optimizer state (``"pinned_host"`` when it is
        offloaded); None keeps leaves' current non-device memory kinds.
      min_size: dense arrays with fewer elements are replicated.
      params_memory_kind, frozen_memory_kind: the memory kind of the trainable / frozen
        params (``"pinned_host"`` for the ones ``jmem.Levers(offload_params=True)``
        streams); their ``PartitionSpec`` is that of the params rule either way. None
        keeps leaves' current non-device memory kinds.

    Returns:
      The same ``TrainState`` type whose leaves are ``NamedSharding`` (usable as
      ``jax.jit`` in/out shardings and by :func:`shard_state`).

    Raises:
      TypeError: ``abstract_state`` is not a TrainState-like object, or a bad mesh.
      ValueError: unknown strategy or a mesh without ``"data"``/``"fsdp"`` axes.
    """
    check_mesh(mesh)
    check_strategy(strategy)
    fields = ("step", "params", "opt_state", "loss_scale", "frozen", "fp8")
    if not all(hasattr(abstract_state, f) for f in fields) or not hasattr(
        abstract_state, "replace"
    ):
        raise TypeError(
            f"state_shardings expects a jmem TrainState (fields {fields}), got "
            f"{type(abstract_state).__name__}; for a bare params or optimizer "
            f"state tree use param_shardings / opt_state_shardings."
        )
    s = abstract_state
    return s.replace(
        step=replicated(s.step, mesh),
        params=param_shardings(
            s.params, mesh, strategy, min_size=min_size, memory_kind=params_memory_kind
        ),
        opt_state=opt_state_shardings(
            s.opt_state, mesh, memory_kind=opt_state_memory_kind, min_size=min_size
        ),
        loss_scale=replicated(s.loss_scale, mesh),
        frozen=param_shardings(
            s.frozen, mesh, strategy, min_size=min_size, memory_kind=frozen_memory_kind
        ),
        fp8=replicated(s.fp8, mesh),
        **({"dropout_key": replicated(s.dropout_key, mesh)} if hasattr(s, "dropout_key") else {}),
    )


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Sharding of a batch array: leading (batch) axis split over ``("data", "fsdp")`` (and
    ``"expert"`` on a mesh with one, ``batch_axes``), and, on a mesh with a ``"context"``
    axis larger than 1 and ``ndim >= 2``, the second (sequence) axis over ``"context"``.

    The batch size must be a multiple of the batch axes' product; the sequence length one of
    ``2 * context`` (``check_context_length``).
    """
    check_mesh(mesh)
    if ndim >= 2 and context_size(mesh) > 1:
        return NamedSharding(mesh, P(batch_axes(mesh), CONTEXT_AXIS))
    return NamedSharding(mesh, P(batch_axes(mesh)))


def check_context_length(length: int, context: int, what: str = "sequence length") -> None:
    """ValueError unless ``length`` is a multiple of ``2 * context`` (the zigzag order
    splits a sequence into ``2 * context`` chunks); nothing for ``context == 1``."""
    if context > 1 and length % (2 * context):
        raise ValueError(
            f"{what} {length} is not a multiple of 2 * context = {2 * context} (the "
            f"zigzag split of a sequence over the context axis); pad or pick a length "
            f"that is a multiple of {2 * context}."
        )


def batch_shardings_of(batch: Any, mesh: Mesh) -> Any:
    axes = batch_axes(mesh)
    n = math.prod(int(mesh.shape[a]) for a in axes)
    cp = context_size(mesh)

    def one(path, x):
        shape = shape_of(x)
        if not shape:
            return NamedSharding(mesh, P())
        if shape[0] % n:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has leading (batch) size {shape[0]}, "
                f"not a multiple of {' * '.join(axes)} = {n}: pad or resize the global batch."
            )
        if len(shape) >= 2 and cp > 1:
            check_context_length(shape[1], cp, f"batch leaf {jax.tree_util.keystr(path)}'s length")
        return batch_sharding(mesh, len(shape))

    return jax.tree_util.tree_map_with_path(one, batch)


# ----------------------------------------------------------------------------------------
# Placing values.
# ----------------------------------------------------------------------------------------


def _put(x: Any, s: NamedSharding | None) -> Any:
    if s is None or x is None:
        return x
    if isinstance(x, jax.core.Tracer):
        return jax.device_put(x, s)
    if isinstance(x, jax.Array) and x.sharding == s:
        return x
    if s.is_fully_addressable:
        return jax.device_put(x, s)
    # Multi-process: a global array is resharded by device_put; host values (identical on
    # every process) are assembled from each process's addressable shards.
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def shard_state(state: Any, shardings: Any) -> Any:
    """Places every leaf of ``state`` with the matching sharding of ``shardings``.

    Args:
      state: pytree of arrays (any device, host NumPy, or already sharded).
      shardings: pytree of ``NamedSharding`` with ``state``'s structure (e.g. from
        :func:`state_shardings`); ``None`` entries leave the leaf as it is.

    Returns:
      ``state`` with each array resharded (``jax.device_put``; across processes, values
      that are not yet global are assembled with ``jax.make_array_from_callback`` from the
      full host value, which must be identical on every process).

    Raises:
      ValueError: if the structures differ.
    """
    try:
        return jax.tree.map(_put, state, shardings, is_leaf=lambda x: x is None)
    except ValueError as e:
        raise ValueError(
            f"shard_state: state and shardings have different structures ({e}). "
            f"Build shardings from this state with state_shardings()."
        ) from e


def shard_batch(batch: Any, mesh: Mesh, *, process_local: bool = False) -> Any:
    """Places a batch with :func:`batch_sharding` (leading axis over ``data x fsdp``).

    Args:
      batch: pytree of arrays ``[B, ...]``.
      mesh: the mesh.
      process_local: the arrays are this process's slice of the global batch (multi-host
        input pipelines); assembled with ``jax.make_array_from_process_local_data``. When
        False the arrays are the whole global batch.

    Returns:
      Pytree of global ``jax.Array`` sharded over the batch axis.

    Raises:
      ValueError: the (global) batch size is not a multiple of ``data * fsdp``.
    """
    check_mesh(mesh)
    if process_local:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                batch_sharding(mesh, np.ndim(x)), np.asarray(x)
            ),
            batch,
        )
    return jax.tree.map(_put, batch, batch_shardings_of(batch, mesh))


# ----------------------------------------------------------------------------------------
# Train-step integration.
# ----------------------------------------------------------------------------------------


def constrain_gradients(
    inner: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str = "zero3",
    *,
    min_size: int = DEFAULT_MIN_SIZE,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer so the gradients it receives are placed per ``strategy``.

    ``update`` applies ``jax.lax.with_sharding_constraint(grads, gradient_shardings(...))``
    and calls ``inner.update`` (extra args, e.g. ``jmem.offload``'s ``skip``, forwarded).
    Stateless: ``init`` is ``inner.init``, so states and checkpoints are interchangeable.
    This is where ZeRO-2/3's reduce-scatter (or ZeRO-1's all-reduce) is requested; the
    partitioner emits it.

    Raises:
      TypeError / ValueError: as :func:`gradient_shardings`.
    """
    check_mesh(mesh)
    check_strategy(strategy)
    inner = optax.with_extra_args_support(inner)

    def update_fn(updates, state, params=None, **extra_args):
        sh = gradient_shardings(updates, mesh, strategy, min_size=min_size)
        updates = jax.lax.with_sharding_constraint(updates, sh)
        return inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
