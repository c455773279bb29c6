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
the state bytes. During the optimizer update it depends on the mode:

* whole tree (default, any optimizer): the wrapper moves the whole state tree in, runs
  ``inner.update`` once and moves the new state out. It forces no order on the per-leaf
  copies, so XLA's scheduler decides how many leaves are staged on the device at once
  (it may stage all of them; with buffer donation the new state reuses the staged
  buffers). Bound: peak(offload) <= max(peak of forward/backward without state,
  params + grads + state at update time).
* leaf by leaf (``offload(inner, leaf_by_leaf=True)``, separable optimizers only, see
  :func:`offload`): the state of parameter leaf i+1 is moved in only after leaf i's new
  state has been moved out. The device then holds about two leaves' state at a time
  (the old and the new state of the leaf being updated, plus that leaf's temporaries,
  e.g. the dequantized float32 moments of an 8-bit leaf, and the shared scalars).
  Bound: peak(offload) <= max(peak of forward/backward without state, params + grads
  (+ the updates, which XLA may place in dead gradient buffers) + 2 x the largest
  leaf's state + its temporaries). The price: one leaf's copies no longer overlap
  another leaf's update, so the update takes longer.

How the order is forced: the whole-tree ``inner.update`` is traced once
(``jax.make_jaxpr``); every equation is labelled with the parameter leaves its inputs
depend on (gradient i, param i and the state leaves that ``inner.init`` creates for leaf
i carry label i); the equations are then emitted again, unchanged, grouped by leaf
(scalars shared by all leaves first). Before leaf i+1's host->device copies, one
``jax.lax.optimization_barrier`` takes leaf i+1's host-resident state together with leaf
i's new state already copied to host, and the copies read the barrier's results: a data
dependency the compiler must respect. According to XLA's sources (not run on a GPU
here), current XLA:GPU removes barriers in a post-scheduling pass, so the order binds its
scheduler, and its host-offload pass accepts barriers on host-copy paths; XLA:CPU
removes them before scheduling (host and device memory are the same RAM there). Running
``inner.update`` once per leaf on trees with the other leaves None was tried first: XLA
then sees the shared scalar work (Adam's bias corrections) once per leaf and rewrites the
divisions differently, which changed results by an ulp on CPU; re-emitting the traced
equations keeps the operations of the whole-tree update, and the results are bitwise
equal on CPU.

What is verified where: on CPU, the dependency chain in the lowered StableHLO (each
leaf's state arguments are used only by a barrier that also yields the previous leaf's
returned new state), bitwise equal training and the memory kinds (tests/test_offload.py).
The bytes saved on an accelerator are measured by ``benchmarks/offload_gpu.py
--leaf-by-leaf`` on a GPU; no such measurement has been recorded for leaf-by-leaf mode
yet.

References: JAX "Memories and host offloading" guide
(https://docs.jax.dev/en/latest/notebooks/host-offloading.html); ZeRO-Offload
(Ren et al., 2021, https://arxiv.org/abs/2101.06840) for the idea of keeping optimizer
state and master weights in host memory.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from jmem._src.interpret import bind_eqn
from jmem._src.ordering import ZERO_AFTER_NAME

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
                f"{memory_kind!r} would silently come back in device memory). Use 'pinned_host'."
            )
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
        return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind))
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
            f"memory_kind must be a str such as 'pinned_host', got {type(memory_kind).__name__}."
        )
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


# ------------------------------------------------------------------------- leaf by leaf
# Call-like primitives: one sub-jaxpr, called once on exactly the equation's inputs. One
# that mixes several parameter leaves (a jitted helper applied to the whole tree) is
# inlined, so that its per-leaf parts can be scheduled with their leaf.
_CALL_PRIMITIVES = frozenset(
    {
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
    }
)


def _call_body(eqn: Any):
    """``(jaxpr, consts)`` of a call-like equation's body, or None for other equations."""
    if eqn.primitive.name not in _CALL_PRIMITIVES:
        return None
    subs = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
    if len(subs) != 1:
        return None
    sub = subs[0]
    jaxpr, consts = (
        (sub.jaxpr, list(sub.consts)) if isinstance(sub, jcore.ClosedJaxpr) else (sub, [])
    )
    if (
        len(jaxpr.invars) != len(eqn.invars)
        or len(jaxpr.outvars) != len(eqn.outvars)
        or len(jaxpr.constvars) != len(consts)
    ):
        return None
    return jaxpr, consts


def _abstract(x: Any) -> Any:
    """``ShapeDtypeStruct`` of an array leaf in device memory (a traced leaf keeps its
    sharding, which matters with ``Explicit`` mesh axes, and every leaf its weak type, so
    the re-emitted update returns the dtypes of the plain one); other leaves unchanged."""
    if _is_tracer(x):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.aval.sharding, weak_type=x.aval.weak_type
        )
    if _is_array(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=_weak(x))
    return x


def _weak(x: Any) -> bool:
    if _is_tracer(x):
        return bool(x.aval.weak_type)
    return bool(getattr(x, "weak_type", False))


def _cache_key(*trees: Any) -> tuple | None:
    """Structure, shapes, dtypes (and traced shardings) of ``trees`` plus their non-array
    leaves; None if a non-array leaf is not hashable (then nothing is cached)."""
    key = []
    for tree in trees:
        leaves, treedef = jax.tree.flatten(tree)
        key.append(treedef)
        key.extend(
            (np.shape(x), x.dtype, _weak(x), x.aval.sharding if _is_tracer(x) else None)
            if _is_array(x)
            else ("static", x)
            for x in leaves
        )
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _masked(leaves: list, treedef: Any, i: int) -> Any:
    """The tree ``treedef`` with leaf ``i`` kept and every other leaf replaced by None."""
    return treedef.unflatten([x if j == i else None for j, x in enumerate(leaves)])


def _not_per_leaf(what: str) -> ValueError:
    return ValueError(
        f"offload(leaf_by_leaf=True): {what}. Leaf-by-leaf mode needs an optimizer whose "
        f"state is laid out per parameter (optax adam/adamw, jmem.optimizers.adamw_8bit/"
        f"adamw_4bit, jmem.master_weights.mixed_precision of those, ...); use "
        f"offload(inner) (whole-tree mode) for this one."
    )


def _not_separable(what: str, others: list[str]) -> ValueError:
    more = " ..." if len(others) > 8 else ""
    return ValueError(
        f"offload(leaf_by_leaf=True) needs a separable optimizer: each parameter's update "
        f"and state may depend only on its own gradient, param and state and on shared "
        f"scalars (step count, schedules). In inner.update, {what} depends on the "
        f"gradients/params/state of {others[:8]}{more} too (or sits in a cond/scan/while "
        f"that runs over several leaves at once, which counts as a dependency), so it "
        f"cannot run leaf by leaf. "
        f"Cross-leaf transforms (optax.clip_by_global_norm, optax.apply_if_finite, "
        f"optax.MultiSteps, anything reducing over all leaves) need offload(inner) "
        f"(whole-tree mode), or move them out of the offloaded optimizer."
    )


def _owners(inner: Any, u_def: Any, init_leaves: list, state: Any, names: list[str]) -> dict:
    """Which parameter leaf each state leaf belongs to, from ``inner.init`` per leaf.

    For each parameter leaf i, ``jax.eval_shape(inner.init, params_i)`` (params_i: every
    other leaf None, as optax's and jmem's transforms accept) gives the key paths of the
    state leaves kept for leaf i; a path every such state has is shared (step count,
    injected hyperparameters).

    Args:
      inner: the wrapped transformation.
      u_def: treedef of the updates/params (None is an empty node, as in ``jax.tree``).
      init_leaves: the params' leaves (arrays or tracers; only shapes/dtypes are used).
      state: the full optimizer state (only key paths and shapes are used).
      names: ``keystr`` of each parameter leaf's path, for error messages.

    Returns:
      dict: state key path -> parameter leaf index, or -1 for shared leaves.

    Raises:
      ValueError: a per-leaf state has a leaf the full state lacks or with another shape,
        or a full-state leaf belongs to no parameter or to several but not all.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    shapes = {p: np.shape(x) for p, x in flat}
    n = len(init_leaves)
    abstract = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in init_leaves]
    users: dict[Any, list[int]] = {}
    for i in range(n):
        sub = jax.eval_shape(inner.init, _masked(abstract, u_def, i))
        for p, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
            if p not in shapes or np.shape(x) != shapes[p]:
                raise _not_per_leaf(
                    f"inner.init on parameter {names[i]} alone has a state leaf "
                    f"{jax.tree_util.keystr(p)} of shape {np.shape(x)} that the full state does "
                    f"not have"
                )
            users.setdefault(p, []).append(i)
    owner = {}
    for p, _ in flat:
        u = users.get(p, [])
        if n > 1 and len(u) == n:
            owner[p] = -1
        elif len(u) == 1:
            owner[p] = u[0]
        elif not u:
            raise _not_per_leaf(
                f"state leaf {jax.tree_util.keystr(p)} belongs to no parameter (inner.init on "
                f"each parameter alone never creates it)"
            )
        else:
            raise _not_per_leaf(
                f"state leaf {jax.tree_util.keystr(p)} is shared by parameters "
                f"{[names[k] for k in u]} but not by all of them"
            )
    return owner


class _Entry(NamedTuple):
    eqn: Any  # a jax.extend.core.JaxprEqn
    ins: list  # refs of its inputs (or Literals)
    outs: list  # refs of its outputs
    deps: int  # bit mask: parameter leaves its inputs depend on


class _Program(NamedTuple):
    """The whole-tree ``inner.update``, traced once, its equations grouped by parameter leaf.

    A ref names a value: ``("in", k)`` the k-th flat input (n gradients, n params if
    given, the state's array leaves, extra args' arrays), ``(ctx, var)`` an equation
    output, or a ``jax.extend.core.Literal``.

    Attributes:
      consts: ref -> value of the jaxpr constants.
      shared: entries depending on no parameter leaf (step count, bias corrections).
      groups: per parameter leaf i, the entries depending on leaf i only, in trace order.
      out_refs: refs of the n update leaves, then of the new state's array leaves.
      state_base: index of the first state leaf among the flat inputs.
      owner: per state array leaf, its parameter leaf index or -1 (shared).
      state_static: the new state's leaves as traced (arrays: None).
    """

    consts: dict
    shared: list
    groups: list
    out_refs: list
    state_base: int
    owner: list
    state_static: list


def _bit(k: int) -> int:
    return 0 if k < 0 else 1 << k


def _trace_program(
    inner: Any,
    u_def: Any,
    u_leaves: list,
    p_leaves: list | None,
    state: Any,
    extra: dict,
    names: list[str],
) -> _Program:
    """Traces ``inner.update`` on the whole tree and splits it by parameter leaf.

    The update is traced once (``jax.make_jaxpr``, abstract values, nothing runs). A walk
    over the jaxpr's data flow labels every value with the parameter leaves it depends
    on: gradient i, param i and the state leaves owned by leaf i (``_owners``) carry bit
    i; shared state leaves, extra args and constants carry none. An equation's label is
    the union of its inputs' labels, so a reduction over several leaves carries all of
    them (for ``scan``/``while``/``cond`` bodies this may over-approximate); call-like
    equations spanning several leaves are inlined first. Separable means: update i and leaf i's
    new state carry at most bit
    i, shared new state carries none. The equations are then re-emitted as traced, only
    reordered: shared ones first, then leaf 0's, leaf 1's, ... (a valid order: a value
    with label {i} is computed only from values labelled {i} or none). So the values are
    those of ``inner.update`` on the whole tree, operation for operation.

    Raises:
      ValueError: not separable (names the first output or equation that mixes leaves),
        or a state that does not split by parameter leaf (``_owners``).
    """
    n = len(u_leaves)
    s_flat, s_def = jax.tree_util.tree_flatten_with_path(state)
    s_leaves = [x for _, x in s_flat]
    s_idx = [k for k, x in enumerate(s_leaves) if _is_array(x)]
    e_leaves, e_def = jax.tree.flatten(extra)
    e_idx = [k for k, x in enumerate(e_leaves) if _is_array(x)]
    owner_of = _owners(inner, u_def, u_leaves if p_leaves is None else p_leaves, state, names)
    owner = [owner_of[s_flat[k][0]] for k in s_idx]
    traced: dict[str, Any] = {}

    def run(u, p, s, e):
        s_all, e_all = list(s_leaves), list(e_leaves)
        for k, x in zip(s_idx, s):
            s_all[k] = x
        for k, x in zip(e_idx, e):
            e_all[k] = x
        params = None if p is None else u_def.unflatten(p)
        new_u, new_s = inner.update(
            u_def.unflatten(u), s_def.unflatten(s_all), params, **e_def.unflatten(e_all)
        )
        nu, traced["u_def"] = jax.tree.flatten(new_u)
        ns, traced["s_def"] = jax.tree.flatten(new_s)
        traced["static"] = [None if _is_array(x) else x for x in ns]
        return nu, [x for x in ns if _is_array(x)]

    closed = jax.make_jaxpr(run)(
        [_abstract(x) for x in u_leaves],
        None if p_leaves is None else [_abstract(x) for x in p_leaves],
        [_abstract(s_leaves[k]) for k in s_idx],
        [_abstract(e_leaves[k]) for k in e_idx],
    )
    if traced["u_def"] != u_def:
        raise _not_per_leaf(
            f"inner.update returns updates of structure {traced['u_def']}, "
            f"not that of the gradients {u_def}"
        )
    if (
        traced["s_def"] != s_def
        or [k for k, x in enumerate(traced["static"]) if x is None] != s_idx
    ):
        raise _not_per_leaf("inner.update returns a state of another structure than it was given")

    in_deps = [_bit(j) for j in range(n)] * (1 if p_leaves is None else 2)
    state_base = len(in_deps)
    in_deps += [_bit(k) for k in owner] + [0] * len(e_idx)
    deps: dict[Any, int] = {("in", k): d for k, d in enumerate(in_deps)}
    consts: dict[Any, Any] = {}
    entries: list[_Entry] = []
    contexts = iter(range(1, 1 << 62))

    def walk(jaxpr, const_vals, ref_of):
        ctx = next(contexts)
        for v, c in zip(jaxpr.constvars, const_vals):
            ref_of[v] = (ctx, v)
            consts[(ctx, v)], deps[(ctx, v)] = c, 0
        for eqn in jaxpr.eqns:
            ins = [v if isinstance(v, jcore.Literal) else ref_of[v] for v in eqn.invars]
            d = functools.reduce(
                operator.or_, (deps[r] for r in ins if not isinstance(r, jcore.Literal)), 0
            )
            if eqn.params.get("name") == ZERO_AFTER_NAME and eqn.primitive.name in ("pjit", "jit"):
                # An ordering dependency between leaves (jmem's quantized optimizers): its value is
                # exactly 0 and the leaves are ordered here anyway, so it becomes the literal 0.
                for v in eqn.outvars:
                    ref_of[v] = jcore.Literal(np.zeros((), v.aval.dtype), v.aval)
                continue
            body = _call_body(eqn)
            if body is not None and d & (d - 1):  # spans several leaves: inline
                shardings = (
                    *eqn.params.get("in_shardings", ()),
                    *eqn.params.get("out_shardings", ()),
                )
                if any(isinstance(x, jax.sharding.Sharding) for x in shardings):
                    raise ValueError(
                        "offload(leaf_by_leaf=True): inner.update contains a jax.jit over several "
                        "parameter leaves with in_shardings/out_shardings; splitting it by leaf would "
                        "drop those shardings. Constrain inside the function instead "
                        "(jax.lax.with_sharding_constraint is kept), or use offload(inner) "
                        "(whole-tree mode)."
                    )
                sub_ref_of = dict(zip(body[0].invars, ins))
                walk(body[0], body[1], sub_ref_of)
                for v, w in zip(eqn.outvars, body[0].outvars):
                    ref_of[v] = w if isinstance(w, jcore.Literal) else sub_ref_of[w]
                continue
            outs = [(ctx, v) for v in eqn.outvars]
            for v, r in zip(eqn.outvars, outs):
                ref_of[v], deps[r] = r, d
            entries.append(_Entry(eqn, ins, outs, d))

    top = {v: ("in", k) for k, v in enumerate(closed.jaxpr.invars)}
    walk(closed.jaxpr, closed.consts, top)
    out_refs = [w if isinstance(w, jcore.Literal) else top[w] for w in closed.jaxpr.outvars]

    # Outputs may depend only on their own leaf (shared ones on none).
    allowed = [_bit(j) for j in range(n)] + [_bit(k) for k in owner]
    for m, (r, ok) in enumerate(zip(out_refs, allowed)):
        other = 0 if isinstance(r, jcore.Literal) else deps[r] & ~ok
        if other:
            if m < n:
                what = f"the update of {names[m]}"
            else:
                k = owner[m - n]
                what = f"state leaf {jax.tree_util.keystr(s_flat[s_idx[m - n]][0])} (" + (
                    f"kept for {names[k]})" if k >= 0 else "shared by all parameters)"
                )
            raise _not_separable(what, [names[j] for j in range(n) if other >> j & 1])

    # Keep the equations the outputs need (and effects), grouped by leaf.
    live = {r for r in out_refs if not isinstance(r, jcore.Literal)}
    kept = []
    for e in reversed(entries):
        if e.eqn.effects or any(r in live for r in e.outs):
            kept.append(e)
            live.update(r for r in e.ins if not isinstance(r, jcore.Literal))
    kept.reverse()
    groups: list[list[_Entry]] = [[] for _ in range(n)]
    shared = []
    for e in kept:
        if e.deps & (e.deps - 1):  # only an effect can get here: outputs were checked
            raise _not_separable(
                f"the operation {e.eqn.primitive.name!r}",
                [names[j] for j in range(n) if e.deps >> j & 1],
            )
        (groups[e.deps.bit_length() - 1] if e.deps else shared).append(e)
    return _Program(consts, shared, groups, out_refs, state_base, owner, traced["static"])


def _order_after(loads: list, stores: list) -> tuple[list, list]:
    """Makes ``loads`` data-dependent on ``stores`` without changing any value.

    One ``jax.lax.optimization_barrier`` over both lists: no result is available before
    every operand is (here: the previous leaf's new state, already moved to host memory),
    so the host->device copies of ``loads``, which consume the results, cannot start
    earlier. It accepts operands in different memory spaces.

    Args:
      loads: host-resident state leaves (arrays) of the next parameter leaf.
      stores: host-resident new state leaves (arrays) of the previous parameter leaf(s).

    Returns:
      ``(loads, stores)``: the same values, routed through the barrier.
    """
    if not loads or not stores:
        return loads, stores
    a, b = jax.lax.optimization_barrier((list(loads), list(stores)))
    return list(a), list(b)


def _check_skip(skip: Any) -> Any:
    skip = jnp.asarray(skip)
    if skip.shape != () or skip.dtype != jnp.bool_:
        raise TypeError(
            f"skip must be a scalar bool (e.g. ~jmem.loss_scale.all_finite(grads)), got "
            f"{skip.dtype}{list(skip.shape)}."
        )
    return skip


def _run_program(
    prog: _Program,
    u_leaves: list,
    p_leaves: list | None,
    s_leaves: list,
    e_leaves: list,
    skip: Any,
    memory_kind: str,
) -> tuple[list, list]:
    """Evaluates ``prog`` leaf by leaf, moving each leaf's state in and out around it.

    Args:
      prog: from ``_trace_program``.
      u_leaves, p_leaves: gradient and param leaves (device memory).
      s_leaves: the state's array leaves (``memory_kind`` memory), in flatten order.
      e_leaves: the extra args' array leaves.
      skip: None or a scalar bool (true: state kept, updates zero).
      memory_kind: where the new state goes.

    Returns:
      ``(update leaves, new state array leaves)``.
    """
    n = len(u_leaves)
    env = dict(prog.consts)
    inputs = list(u_leaves) + (list(p_leaves) if p_leaves is not None else [])
    for k, x in enumerate(inputs):
        env[("in", k)] = x
    for k, x in enumerate(e_leaves):
        env[("in", prog.state_base + len(s_leaves) + k)] = x

    def read(r):
        return r.val if isinstance(r, jcore.Literal) else env[r]

    def evaluate(entries):
        for e in entries:
            outs = bind_eqn(e.eqn, [read(r) for r in e.ins])
            if not e.eqn.primitive.multiple_results:
                outs = [outs]
            for r, o in zip(e.outs, outs):
                env[r] = o

    def load(ms, host):
        for m, x in zip(ms, host):
            env[("in", prog.state_base + m)] = _move(x, _DEVICE)

    def store(ms):
        out = []
        for m in ms:
            x = jnp.asarray(read(prog.out_refs[n + m]))
            if skip is not None:  # on the device, where old and new state are
                x = jax.lax.select(skip, env[("in", prog.state_base + m)], x)
            out.append((m, _move(x, memory_kind)))
        return out

    owned = [[] for _ in range(n)]
    for m, k in enumerate(prog.owner):
        if k >= 0:
            owned[k].append(m)
    shared = [m for m, k in enumerate(prog.owner) if k < 0]
    # Shared leaves (step count, hyperparameters: scalars) are moved in once.
    load(shared, [s_leaves[m] for m in shared])
    evaluate(prog.shared)
    pending = store(shared)  # (state index, host value), not yet ordered before a load
    new_state: list[Any] = [None] * len(s_leaves)
    new_u: list[Any] = [None] * n
    for i in range(n):
        host = [s_leaves[m] for m in owned[i]]
        if pending and host:
            # Leaf i's state is loaded only after the earlier leaves' new state is on host.
            host, stored = _order_after(host, [v for _, v in pending])
            for (m, _), v in zip(pending, stored):
                new_state[m] = v
            pending = []
        load(owned[i], host)
        evaluate(prog.groups[i])
        u = jnp.asarray(read(prog.out_refs[i]))
        new_u[i] = u if skip is None else jax.lax.select(skip, jnp.zeros_like(u), u)
        pending += store(owned[i])
    for m, v in pending:
        new_state[m] = v
    return new_u, new_state


def offload(
    inner: optax.GradientTransformation, *, memory_kind: str = _HOST, leaf_by_leaf: bool = False
) -> optax.GradientTransformationExtraArgs:
    """Keeps ``inner``'s optimizer state in host memory between steps.

    ``init`` runs ``inner.init`` and moves the resulting state to ``memory_kind``.
    ``update`` moves the state to device memory, runs ``inner.update`` and moves the new
    state back, so ``jax.jit(step, donate_argnums=...)`` returns a state whose leaves all
    report ``sharding.memory_kind == memory_kind`` while ``updates``/params stay in device
    memory. The state pytree has exactly the structure of ``inner``'s state (no wrapper),
    so checkpoints are interchangeable with the non-offloaded optimizer and the numerics
    are identical (bitwise on CPU; transfers do not change values).

    Two modes (module docstring, "Device peak"):

    * whole tree (default): the whole state is moved in, ``inner.update`` runs once, the
      new state is moved out; XLA decides how much of the state is staged on the device.
      Valid for any optimizer.
    * ``leaf_by_leaf=True``: the update runs one parameter leaf at a time: leaf i's state
      (the state leaves ``inner.init`` creates for leaf i) is moved in, its update
      computed, its new state moved out, and only then leaf i+1's state is moved in, so
      about two leaves' state is on the device at a time (module docstring, "How the
      order is forced"). The values are those of the whole-tree update (the same traced
      operations, regrouped). Only for *separable* optimizers: a parameter's update and
      new state depend only on its own gradient, param and state and on scalars shared
      by all leaves (step count, schedules). Fine: ``optax.adam``/``adamw``/``lion``/
      ``lamb``/``adafactor``/``sgd`` (momentum), elementwise ``optax.clip``, weight-decay
      masks, ``optax.inject_hyperparams(...)`` of those, ``jmem.optimizers.adamw_8bit``/
      ``adamw_4bit``, ``jmem.master_weights.mixed_precision`` of any of these (bitwise
      equal to the plain optimizer on CPU). Not fine: ``optax.clip_by_global_norm``,
      ``optax.apply_if_finite``, ``optax.MultiSteps`` (a ``cond`` over all leaves),
      anything that reduces over all leaves. Checked when ``update`` is traced: the
      whole-tree update is traced once (``jax.make_jaxpr``) and its data flow walked; an
      update or state leaf that depends on another leaf's gradient, param or state
      raises (a sound check: a dependency is never missed; an optimizer that loops with
      ``scan``/``while`` over several leaves at once is rejected although it may be
      separable). The split of the state by leaf comes from
      ``jax.eval_shape(inner.init, params_i)`` with every other param None (key paths;
      optax's and jmem's transforms accept None leaves); a state that does not split
      this way raises. Both are done once per tree structure and shapes (trace time grows
      faster than linearly with the leaf count: several times the whole-tree trace at
      hundreds of leaves, in a review run). With one parameter leaf this is
      the whole-tree update. Bitwise equality holds under ``jit`` (eagerly, op-by-op
      dispatch can differ from a jitted update by an ulp). Not supported: ``jax.grad``
      through a leaf-by-leaf update (JAX cannot transpose the barrier chain on host-memory
      values; whole-tree mode is differentiable), and a ``jax.jit`` with
      ``in_shardings``/``out_shardings`` inside ``inner.update`` spanning several leaves
      (raises instead of dropping the shardings).

    Donation: JAX pairs a donated input buffer with an output of the same shape and dtype
    whatever their memory kinds, so ``jax.jit(opt.update, donate_argnums=1)`` can hand a
    ``pinned_host`` state buffer to a device-side update of the same shape and abort the
    runtime ("memory kind does not match"). Donate the state in a step whose outputs list
    the state where it came in (as ``jmem.train_step`` does), or do not donate it.

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
      leaf_by_leaf: update one parameter leaf at a time (see above); a Python bool.

    ``update(updates, state, params=None, *, skip=None, **extra_args)``: ``updates`` (and
    ``params``) trees of arrays of any shape/dtype, as for ``inner``. ``skip`` is an
    optional scalar bool; when true the returned state is the input state (bitwise) and
    the updates are zeros (per leaf in leaf-by-leaf mode). Use it to skip non-finite
    steps: the select then runs on the device, where old and new state already are.
    Selecting between the offloaded old and new state *outside* ``update`` is worse: with
    a non-scalar predicate JAX refuses to trace it ("memory_space of all inputs passed to
    `select_n` must be the same"); with a scalar one it traces, but asks XLA to compute on
    ``pinned_host`` buffers (untested on GPU); moving both states to the device for it
    doubles the state's device bytes.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation, ``memory_kind`` not a str,
        ``leaf_by_leaf`` not a bool, or ``skip`` not a scalar bool.
      ValueError: ``memory_kind`` is not usable inside ``jit`` (e.g. ``"unpinned_host"``);
        at ``init``/``update`` time, the backend's devices do not address ``memory_kind``
        (the message lists ``device.addressable_memories()``); in leaf-by-leaf mode, at
        ``update`` time, an optimizer that is not separable or whose state does not split
        by parameter leaf, or ``params`` with another structure than ``updates``.

    Source: JAX host-offloading guide (memory kinds); ZeRO-Offload (arXiv:2101.06840) for
    host-resident optimizer state.
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"offload expects an optax.GradientTransformation, got {type(inner).__name__}."
        )
    if not isinstance(memory_kind, str):
        raise TypeError(f"memory_kind must be a str, got {type(memory_kind).__name__}.")
    if memory_kind not in _IN_JIT_SPACES:
        raise ValueError(
            f"offload(memory_kind={memory_kind!r}) is not supported: inside jit JAX "
            f"{jax.__version__} can place values only in {sorted(_IN_JIT_SPACES)} "
            f"(this backend's devices address {memory_kinds()}, see "
            f"device.addressable_memories()). Use memory_kind='pinned_host'."
        )
    if not isinstance(leaf_by_leaf, (bool, np.bool_)):
        raise TypeError(
            f"leaf_by_leaf must be a bool, got {type(leaf_by_leaf).__name__} {leaf_by_leaf!r}."
        )
    inner = optax.with_extra_args_support(inner)
    programs: dict[Any, _Program] = {}  # per tree structure/shapes, filled when traced

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

    def whole_tree(updates, state, params, skip, extra_args):
        old_state = to_device(state)
        new_updates, new_state = inner.update(updates, old_state, params, **extra_args)
        if skip is not None:
            # Selected on the device, where both states already are (see docstring).
            new_state = jax.tree.map(
                lambda n, o: jax.lax.select(skip, o, n) if _is_array(n) else n, new_state, old_state
            )
            new_updates = jax.tree.map(
                lambda u: jax.lax.select(skip, jnp.zeros_like(u), u), new_updates
            )
        return new_updates, to_host(new_state, memory_kind)

    def program(u_def, u_leaves, p_leaves, state, extra_args):
        key = _cache_key(
            u_def.unflatten(u_leaves),
            None if p_leaves is None else u_def.unflatten(p_leaves),
            state,
            extra_args,
        )
        prog = programs.get(key) if key is not None else None
        if prog is None:
            names = [
                jax.tree_util.keystr(p)
                for p, _ in jax.tree_util.tree_flatten_with_path(u_def.unflatten(u_leaves))[0]
            ]
            prog = _trace_program(inner, u_def, u_leaves, p_leaves, state, extra_args, names)
            # Constants that are tracers (an optimizer built inside the jitted function)
            # belong to this trace only.
            if key is not None and not any(_is_tracer(c) for c in prog.consts.values()):
                programs[key] = prog
        return prog

    def leaf_by_leaf_update(updates, state, params, skip, extra_args):
        u_leaves, u_def = jax.tree.flatten(updates)
        n = len(u_leaves)
        if n < 2:
            return whole_tree(updates, state, params, skip, extra_args)
        p_leaves = None
        if params is not None:
            p_leaves, p_def = jax.tree.flatten(params)
            if p_def != u_def:
                raise ValueError(
                    f"offload(leaf_by_leaf=True): params structure {p_def} differs from the "
                    f"updates structure {u_def}; the per-leaf split needs them equal."
                )
        prog = program(u_def, u_leaves, p_leaves, state, extra_args)
        s_leaves, s_def = jax.tree.flatten(state)
        arrays = [x for x in s_leaves if _is_array(x)]
        new_u, new_arrays = _run_program(
            prog,
            u_leaves,
            p_leaves,
            arrays,
            [x for x in jax.tree.leaves(extra_args) if _is_array(x)],
            skip,
            memory_kind,
        )
        it = iter(new_arrays)
        new_s = [next(it) if x is None else x for x in prog.state_static]
        return u_def.unflatten(new_u), s_def.unflatten(new_s)

    def update_fn(updates, state, params=None, *, skip=None, **extra_args):
        _check_backend(updates)
        if skip is not None:
            skip = _check_skip(skip)
        if leaf_by_leaf:
            return leaf_by_leaf_update(updates, state, params, skip, extra_args)
        return whole_tree(updates, state, params, skip, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
