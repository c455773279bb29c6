"""Leaf-by-leaf optimizer update: the whole-tree ``inner.update`` traced once, its equations
labelled by parameter leaf and re-emitted one leaf at a time, each leaf's state loaded only
after the previous leaf's new state is stored (a ``jax.lax.optimization_barrier`` chain); a
layer stack whose update is elementwise along its rows is run one row at a time
(``stack_rows.py``).

Design notes: docs/offload.md. Reference: ZeRO-Offload (Ren et al., 2021, arXiv:2101.06840).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Any
from typing import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from jmem._src import jaxpr as _jaxpr
from jmem._src.jaxpr import bind_eqn
from jmem._src.jaxpr import eqn_context
from jmem._src.jaxpr import name_stack_of
from jmem._src.offload import stack_rows as _rows
from jmem._src.offload.memory_kinds import DEVICE
from jmem._src.offload.memory_kinds import HOST
from jmem._src.offload.memory_kinds import is_array
from jmem._src.offload.memory_kinds import is_tracer
from jmem._src.offload.memory_kinds import move
from jmem._src.offload.params import in_host_space
from jmem._src.offload.params import to_space_of
from jmem._src.ordering import ZERO_AFTER_NAME

# Call-like primitives: one sub-jaxpr, called once on exactly the equation's inputs. One
# that mixes several parameter leaves (a jitted helper applied to the whole tree) is
# inlined, so that its per-leaf parts can be scheduled with their leaf.
_CALL_KINDS = (_jaxpr.CALL, _jaxpr.CUSTOM_JVP, _jaxpr.CUSTOM_VJP, _jaxpr.CHECKPOINT)


# ------------------------------------------------------------------------------ errors


def _not_per_leaf(what: str) -> ValueError:
    return ValueError(
        f"offload(leaf_by_leaf=True): {what}. Leaf-by-leaf mode needs an optimizer whose "
        f"state is laid out per parameter (optax adam/adamw, jmem.adamw_8bit/"
        f"adamw_4bit, jmem.mixed_precision of those, ...); use "
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


def _sharded_call_error() -> ValueError:
    return ValueError(
        "offload(leaf_by_leaf=True): inner.update contains a jax.jit over several "
        "parameter leaves with in_shardings/out_shardings; splitting it by leaf would "
        "drop those shardings. Constrain inside the function instead "
        "(jax.lax.with_sharding_constraint is kept), or use offload(inner) "
        "(whole-tree mode)."
    )


# ------------------------------------------------------------------- abstract values


def _weak(x: Any) -> bool:
    if is_tracer(x):
        return bool(x.aval.weak_type)
    return bool(getattr(x, "weak_type", False))


def _abstract(x: Any) -> Any:
    """``ShapeDtypeStruct`` of an array leaf in device memory (a traced leaf keeps its
    sharding, which matters with ``Explicit`` mesh axes, and every leaf its weak type, so
    the re-emitted update returns the dtypes of the plain one); other leaves unchanged."""
    if is_tracer(x):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.aval.sharding, weak_type=x.aval.weak_type
        )
    if is_array(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=_weak(x))
    return x


def _cache_key(*trees: Any) -> tuple | None:
    """Structure, shapes, dtypes (and traced shardings) of ``trees`` plus their non-array
    leaves; None if a non-array leaf is not hashable (then nothing is cached)."""
    key = []
    for tree in trees:
        leaves, treedef = jax.tree.flatten(tree)
        key.append(treedef)
        key.extend(
            (np.shape(x), x.dtype, _weak(x), x.aval.sharding if is_tracer(x) else None)
            if is_array(x)
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


def _bit(k: int) -> int:
    return 0 if k < 0 else 1 << k


# ------------------------------------------------------------- state split by leaf


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
    users = _state_users(inner, u_def, init_leaves, {p: np.shape(x) for p, x in flat}, names)
    n = len(init_leaves)
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


def _state_users(inner, u_def, init_leaves, shapes: dict, names: list[str]) -> dict:
    """State key path -> the parameter leaves whose ``inner.init`` alone creates it."""
    abstract = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in init_leaves]
    users: dict[Any, list[int]] = {}
    for i in range(len(init_leaves)):
        sub = jax.eval_shape(inner.init, _masked(abstract, u_def, i))
        for p, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
            if p not in shapes or np.shape(x) != shapes[p]:
                raise _not_per_leaf(
                    f"inner.init on parameter {names[i]} alone has a state leaf "
                    f"{jax.tree_util.keystr(p)} of shape {np.shape(x)} that the full state does "
                    f"not have"
                )
            users.setdefault(p, []).append(i)
    return users


# ------------------------------------------------------------------------- tracing


class _Entry(NamedTuple):
    eqn: Any  # a jax.extend.core.JaxprEqn
    ins: list  # refs of its inputs (or Literals)
    outs: list  # refs of its outputs
    deps: int  # bit mask: parameter leaves its inputs depend on
    prefix: Any = None  # name stack of the inlined calls around it (None at top level)


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


class _Layout(NamedTuple):
    """The flat inputs of ``inner.update``: which leaves of the state and extra args are arrays."""

    u_def: Any
    s_paths: list  # key path of every state leaf
    s_def: Any
    s_leaves: list
    s_idx: list  # indices of the state's array leaves
    e_def: Any
    e_leaves: list
    e_idx: list  # indices of the extra args' array leaves


def _layout(u_def: Any, state: Any, extra: dict) -> _Layout:
    s_flat, s_def = jax.tree_util.tree_flatten_with_path(state)
    s_leaves = [x for _, x in s_flat]
    e_leaves, e_def = jax.tree.flatten(extra)
    return _Layout(
        u_def,
        [p for p, _ in s_flat],
        s_def,
        s_leaves,
        [k for k, x in enumerate(s_leaves) if is_array(x)],
        e_def,
        e_leaves,
        [k for k, x in enumerate(e_leaves) if is_array(x)],
    )


def _flat_update(inner, lay: _Layout, traced: dict, u, p, s, e) -> tuple[list, list]:
    """``inner.update`` on flat array inputs; records the output structure in ``traced``."""
    s_all, e_all = list(lay.s_leaves), list(lay.e_leaves)
    for k, x in zip(lay.s_idx, s):
        s_all[k] = x
    for k, x in zip(lay.e_idx, e):
        e_all[k] = x
    params = None if p is None else lay.u_def.unflatten(p)
    new_u, new_s = inner.update(
        lay.u_def.unflatten(u), lay.s_def.unflatten(s_all), params, **lay.e_def.unflatten(e_all)
    )
    nu, traced["u_def"] = jax.tree.flatten(new_u)
    ns, traced["s_def"] = jax.tree.flatten(new_s)
    traced["static"] = [None if is_array(x) else x for x in ns]
    return nu, [x for x in ns if is_array(x)]


def _make_jaxpr(inner, lay: _Layout, u_leaves, p_leaves) -> tuple[Any, list]:
    """Traces the whole-tree update; returns the closed jaxpr and the new state's static
    leaves (arrays: None).

    Raises:
      ValueError: the updates or the new state have another structure than their inputs.
    """
    traced: dict[str, Any] = {}
    closed = jax.make_jaxpr(functools.partial(_flat_update, inner, lay, traced))(
        [_abstract(x) for x in u_leaves],
        None if p_leaves is None else [_abstract(x) for x in p_leaves],
        [_abstract(lay.s_leaves[k]) for k in lay.s_idx],
        [_abstract(lay.e_leaves[k]) for k in lay.e_idx],
    )
    if traced["u_def"] != lay.u_def:
        raise _not_per_leaf(
            f"inner.update returns updates of structure {traced['u_def']}, "
            f"not that of the gradients {lay.u_def}"
        )
    if (
        traced["s_def"] != lay.s_def
        or [k for k, x in enumerate(traced["static"]) if x is None] != lay.s_idx
    ):
        raise _not_per_leaf("inner.update returns a state of another structure than it was given")
    return closed, traced["static"]


# ------------------------------------------------------------------------ labelling


@dataclasses.dataclass
class _Labels:
    """What the walk over the jaxpr collects: per ref its leaf bit mask, constants, entries."""

    deps: dict
    consts: dict = dataclasses.field(default_factory=dict)
    entries: list = dataclasses.field(default_factory=list)
    contexts: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))


def _call_body(eqn: Any):
    """``(jaxpr, consts)`` of a call-like equation's body, or None for other equations."""
    if _jaxpr.kind(eqn) not in _CALL_KINDS:
        return None
    subs = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
    if len(subs) != 1:
        return None
    body = _jaxpr.body_of(eqn)
    if body is None:
        return None
    jaxpr, consts = body
    if (
        len(jaxpr.invars) != len(eqn.invars)
        or len(jaxpr.outvars) != len(eqn.outvars)
        or len(jaxpr.constvars) != len(consts)
    ):
        return None
    return jaxpr, consts


def _is_zero_after(eqn: Any) -> bool:
    return eqn.params.get("name") == ZERO_AFTER_NAME and _jaxpr.kind(eqn) == _jaxpr.CALL


def _inline(eqn: Any, body: tuple, ins: list, ref_of: dict, labels: _Labels, prefix=None) -> None:
    """Walks a call spanning several leaves in place of the call (its shardings must be
    unset: splitting it would drop them); its equations keep the call's name stack."""
    shardings = (*eqn.params.get("in_shardings", ()), *eqn.params.get("out_shardings", ()))
    if any(isinstance(x, jax.sharding.Sharding) for x in shardings):
        raise _sharded_call_error()
    sub_ref_of = dict(zip(body[0].invars, ins))
    _walk(body[0], body[1], sub_ref_of, labels, name_stack_of(eqn, prefix))
    for v, w in zip(eqn.outvars, body[0].outvars):
        ref_of[v] = w if isinstance(w, jcore.Literal) else sub_ref_of[w]


def _walk(jaxpr: Any, const_vals: list, ref_of: dict, labels: _Labels, prefix=None) -> None:
    """Labels every equation of ``jaxpr`` with the parameter leaves its inputs depend on.

    ``ref_of`` maps the jaxpr's input variables to refs (see ``_Program``) and is extended
    with every equation output. An ordering dependency ``zero_after`` (exactly 0) becomes
    the literal 0: the leaves are ordered here anyway. Calls spanning several leaves are
    inlined; ``prefix`` is the name stack of the calls inlined around ``jaxpr``.
    """
    ctx = next(labels.contexts)
    for v, c in zip(jaxpr.constvars, const_vals):
        ref_of[v] = (ctx, v)
        labels.consts[(ctx, v)], labels.deps[(ctx, v)] = c, 0
    for eqn in jaxpr.eqns:
        ins = [v if isinstance(v, jcore.Literal) else ref_of[v] for v in eqn.invars]
        d = functools.reduce(
            operator.or_, (labels.deps[r] for r in ins if not isinstance(r, jcore.Literal)), 0
        )
        if _is_zero_after(eqn):
            for v in eqn.outvars:
                ref_of[v] = jcore.Literal(np.zeros((), v.aval.dtype), v.aval)
            continue
        body = _call_body(eqn)
        if body is not None and d & (d - 1):  # spans several leaves: inline
            _inline(eqn, body, ins, ref_of, labels, prefix)
            continue
        outs = [(ctx, v) for v in eqn.outvars]
        for v, r in zip(eqn.outvars, outs):
            ref_of[v], labels.deps[r] = r, d
        labels.entries.append(_Entry(eqn, ins, outs, d, prefix))


def _check_outputs(out_refs, deps, owner, lay: _Layout, names) -> None:
    """Raises unless update i and leaf i's new state depend on leaf i only (shared state on
    no leaf)."""
    n = len(names)
    allowed = [_bit(j) for j in range(n)] + [_bit(k) for k in owner]
    for m, (r, ok) in enumerate(zip(out_refs, allowed)):
        other = 0 if isinstance(r, jcore.Literal) else deps[r] & ~ok
        if not other:
            continue
        if m < n:
            what = f"the update of {names[m]}"
        else:
            k = owner[m - n]
            what = f"state leaf {jax.tree_util.keystr(lay.s_paths[lay.s_idx[m - n]])} (" + (
                f"kept for {names[k]})" if k >= 0 else "shared by all parameters)"
            )
        raise _not_separable(what, [names[j] for j in range(n) if other >> j & 1])


def _group(entries: list, out_refs: list, names: list[str]) -> tuple[list, list]:
    """Keeps the entries the outputs need (and effects); returns ``(shared, groups)``."""
    live = {r for r in out_refs if not isinstance(r, jcore.Literal)}
    kept = []
    for e in reversed(entries):
        if e.eqn.effects or any(r in live for r in e.outs):
            kept.append(e)
            live.update(r for r in e.ins if not isinstance(r, jcore.Literal))
    kept.reverse()
    groups: list[list[_Entry]] = [[] for _ in names]
    shared = []
    for e in kept:
        if e.deps & (e.deps - 1):  # only an effect can get here: outputs were checked
            raise _not_separable(
                f"the operation {e.eqn.primitive.name!r}",
                [names[j] for j in range(len(names)) if e.deps >> j & 1],
            )
        (groups[e.deps.bit_length() - 1] if e.deps else shared).append(e)
    return shared, groups


def _trace_program(
    inner: Any,
    u_def: Any,
    u_leaves: list,
    p_leaves: list | None,
    state: Any,
    extra: dict,
    names: list[str],
    resident_inputs: bool = False,
) -> _Program:
    """Traces ``inner.update`` on the whole tree and splits it by parameter leaf.

    The update is traced once (``jax.make_jaxpr``, abstract values, nothing runs). A walk
    over the jaxpr's data flow labels every value with the parameter leaves it depends
    on: gradient i, param i and the state leaves owned by leaf i (``_owners``) carry bit
    i; shared state leaves, extra args and constants carry none. An equation's label is
    the union of its inputs' labels (for ``scan``/``while``/``cond`` bodies this may
    over-approximate). Separable means: update i and leaf i's new state carry at most bit
    i, shared new state carries none. The equations are then grouped, only reordered:
    shared ones first, then leaf 0's, leaf 1's, ... (a valid order: a value with label
    {i} is computed only from values labelled {i} or none).

    With ``resident_inputs`` (disk mode: every gradient and param is on the device
    anyway) gradients and params carry no bit: only the state must split by leaf, and work
    on gradients alone (``optax.clip_by_global_norm``'s norm) is shared work.

    Raises:
      ValueError: not separable (names the first output or equation that mixes leaves),
        or a state that does not split by parameter leaf (``_owners``).
    """
    n = len(u_leaves)
    lay = _layout(u_def, state, extra)
    owner_of = _owners(inner, u_def, u_leaves if p_leaves is None else p_leaves, state, names)
    owner = [owner_of[lay.s_paths[k]] for k in lay.s_idx]
    closed, state_static = _make_jaxpr(inner, lay, u_leaves, p_leaves)
    in_deps = [0 if resident_inputs else _bit(j) for j in range(n)]
    in_deps *= 1 if p_leaves is None else 2
    state_base = len(in_deps)
    in_deps += [_bit(k) for k in owner] + [0] * len(lay.e_idx)
    labels = _Labels(deps={("in", k): d for k, d in enumerate(in_deps)})
    top = {v: ("in", k) for k, v in enumerate(closed.jaxpr.invars)}
    _walk(closed.jaxpr, closed.consts, top, labels)
    out_refs = [w if isinstance(w, jcore.Literal) else top[w] for w in closed.jaxpr.outvars]
    _check_outputs(out_refs, labels.deps, owner, lay, names)
    shared, groups = _group(labels.entries, out_refs, names)
    return _Program(labels.consts, shared, groups, out_refs, state_base, owner, state_static)


def _program_for(
    inner, cache: dict, u_def, u_leaves, p_leaves, state, extra_args, resident_inputs=False
) -> _Program:
    """The traced program for these trees, from ``cache`` (per structure, shapes, dtypes)."""
    key = _cache_key(
        u_def.unflatten(u_leaves),
        None if p_leaves is None else u_def.unflatten(p_leaves),
        state,
        extra_args,
    )
    key = None if key is None else (key, resident_inputs)
    prog = cache.get(key) if key is not None else None
    if prog is None:
        names = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(u_def.unflatten(u_leaves))[0]
        ]
        prog = _trace_program(
            inner, u_def, u_leaves, p_leaves, state, extra_args, names, resident_inputs
        )
        # Constants that are tracers (an optimizer built inside the jitted function)
        # belong to this trace only.
        if key is not None and not any(is_tracer(c) for c in prog.consts.values()):
            cache[key] = prog
    return prog


# ------------------------------------------------------------------------- running


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


def _read(env: dict, r: Any) -> Any:
    return r.val if isinstance(r, jcore.Literal) else env[r]


def _evaluate(env: dict, entries: list) -> None:
    for e in entries:
        with eqn_context(e.eqn, e.prefix):
            outs = bind_eqn(e.eqn, [_read(env, r) for r in e.ins])
        if not e.eqn.primitive.multiple_results:
            outs = [outs]
        for r, o in zip(e.outs, outs):
            env[r] = o


def _load(env: dict, prog: _Program, ms: list, host: list) -> None:
    """Moves state leaves ``ms`` (host values ``host``) to the device, as program inputs."""
    for m, x in zip(ms, host):
        env[("in", prog.state_base + m)] = move(x, DEVICE)


def _store(env: dict, prog: _Program, ms: list, skip: Any, memory_kind: str) -> list:
    """``(m, new state leaf m in memory_kind)`` for ``ms``; the old leaf where ``skip``."""
    n = len(prog.groups)
    out = []
    for m in ms:
        x = jnp.asarray(_read(env, prog.out_refs[n + m]))
        if skip is not None:  # on the device, where old and new state are
            x = jax.lax.select(skip, env[("in", prog.state_base + m)], x)
        out.append((m, move(x, memory_kind)))
    return out


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
    streamed = _streamed_inputs(inputs, n)  # host-resident gradients/params, per leaf
    for k, x in enumerate(inputs):
        if k % n not in streamed:
            env[("in", k)] = x
    for k, x in enumerate(e_leaves):
        env[("in", prog.state_base + len(s_leaves) + k)] = x
    owned = [[] for _ in range(n)]
    for m, k in enumerate(prog.owner):
        if k >= 0:
            owned[k].append(m)
    shared = [m for m, k in enumerate(prog.owner) if k < 0]
    # Shared leaves (step count, hyperparameters: scalars) are moved in once.
    _load(env, prog, shared, [s_leaves[m] for m in shared])
    _evaluate(env, prog.shared)
    pending = _store(env, prog, shared, skip, memory_kind)  # not yet ordered before a load
    new_state: list[Any] = [None] * len(s_leaves)
    new_u: list[Any] = [None] * n
    for i in range(n):
        host = [s_leaves[m] for m in owned[i]]
        ins = [i, i + n][: len(inputs) // n] if i in streamed else []
        host += [inputs[k] for k in ins]
        if pending and host:
            # Leaf i's state is loaded only after the earlier leaves' new state is on host.
            host, stored = _order_after(host, [v for _, v in pending])
            for (m, _), v in zip(pending, stored):
                _put_result(new_state, new_u, m, v)
            pending = []
        if memory_kind != DEVICE and _stacked(prog, env, i, owned[i], inputs, s_leaves):
            u, stored = _run_rows(prog, env, i, owned[i], host, inputs, streamed, skip, memory_kind)
        else:
            u, stored = _run_whole(prog, env, i, owned[i], host, ins, skip, memory_kind)
        if i in streamed:  # back to host memory before the next leaf is loaded
            pending.append((("u", i), to_space_of(u, inputs[streamed[i]])))
        else:
            new_u[i] = u
        pending += stored
    for m, v in pending:
        _put_result(new_state, new_u, m, v)
    return new_u, new_state


def _run_whole(prog, env, i, owned_i, host, ins, skip, memory_kind) -> tuple[Any, list]:
    """Leaf ``i``'s update on the whole leaf: its state (and streamed gradient/param,
    ``host[len(owned_i):]`` for the inputs ``ins``) moved to the device, the equations
    evaluated, the new state stored. Returns ``(update on the device, stored state)``."""
    _load(env, prog, owned_i, host[: len(owned_i)])
    for k, x in zip(ins, host[len(owned_i) :]):
        env[("in", k)] = move(x, DEVICE)
    _evaluate(env, prog.groups[i])
    u = jnp.asarray(_read(env, prog.out_refs[i]))
    u = u if skip is None else jax.lax.select(skip, jnp.zeros_like(u), u)
    return u, _store(env, prog, owned_i, skip, memory_kind)


def _row_refs(prog: _Program, i: int, owned_i: list, num_inputs: int) -> list:
    """Refs of leaf ``i``'s inputs: its owned state leaves, then its gradient (and param)."""
    n = len(prog.groups)
    state = [("in", prog.state_base + m) for m in owned_i]
    return state + [("in", k) for k in (i, i + n)[: num_inputs // n]]


def _stacked(prog: _Program, env: dict, i: int, owned_i: list, inputs: list, s_leaves) -> bool:
    """Whether leaf ``i`` is a layer stack (gradient of rank >= 3, ``L > 1`` leading every
    input it owns) whose update is separable along that axis (``rows_separable``; ``env``
    holds the shared values)."""
    n = len(prog.groups)
    if not owned_i or np.ndim(inputs[i]) < 3 or np.shape(inputs[i])[0] < 2:
        return False
    refs = _row_refs(prog, i, owned_i, len(inputs))
    vals = [s_leaves[m] for m in owned_i] + [inputs[k] for k in (i, i + n)[: len(inputs) // n]]
    outs = [prog.out_refs[i]] + [prog.out_refs[n + m] for m in owned_i]
    return _rows.rows_separable(prog.groups[i], refs, outs, {**env, **dict(zip(refs, vals))})


def _run_rows(prog, env, i, owned_i, host, inputs, streamed, skip, memory_kind):
    """Leaf ``i``'s update row by row (``stack_rows.run_rows``): ``host`` are its state
    leaves (and streamed gradient/param), in the order of ``_row_refs``. Returns ``(update,
    stored state)``, the update in host memory when leaf ``i`` is streamed."""
    n = len(prog.groups)
    refs = _row_refs(prog, i, owned_i, len(inputs))
    xs = host if i in streamed else host + [inputs[k] for k in (i, i + n)[: len(inputs) // n]]
    outs = [prog.out_refs[i]] + [prog.out_refs[n + m] for m in owned_i]
    u_place = HOST if i in streamed and in_host_space(inputs[streamed[i]]) else DEVICE
    ys = _rows.run_rows(
        env, prog.groups[i], refs, xs, outs, [u_place] + [memory_kind] * len(owned_i), skip
    )
    return ys[0], list(zip(owned_i, ys[1:]))


def _streamed_inputs(inputs: list, n: int) -> dict:
    """``{leaf i: index of its reference input}`` for the leaves whose gradient or param is
    in host memory (full-parameter training with ``Levers(offload_params=True)``): those
    are moved to the device with leaf i's state, and its update goes back to host memory.
    The reference is the param when given (the update has its memory space), else the
    gradient."""
    out = {}
    for i in range(n):
        if any(in_host_space(inputs[k]) for k in range(i, len(inputs), n)):
            out[i] = i + n if len(inputs) > n else i
    return out


def _put_result(new_state: list, new_u: list, key: Any, v: Any) -> None:
    """Stores a result from the ``pending`` list: a state leaf ``m`` or an update ``("u", i)``."""
    if isinstance(key, tuple):
        new_u[key[1]] = v
    else:
        new_state[key] = v


def update(
    inner: optax.GradientTransformationExtraArgs,
    cache: dict,
    updates: Any,
    state: Any,
    params: Any,
    skip: Any,
    extra_args: dict,
    memory_kind: str,
) -> tuple[Any, Any]:
    """``inner.update`` run one parameter leaf at a time (values of the whole-tree update).

    Args:
      inner: a separable transformation (see ``jmem.offload``) with extra-args support.
      cache: dict of traced programs, filled here (one per tree structure/shapes/dtypes).
      updates: gradient tree of at least two array leaves (device memory).
      state: ``inner``'s state, its arrays in ``memory_kind`` memory.
      params: None or a tree of the structure of ``updates``.
      skip: None or a scalar bool array (true: state returned unchanged, updates zero).
      extra_args: keyword args forwarded to ``inner.update``.
      memory_kind: where the new state goes (``"pinned_host"`` or ``"device"``).

    Returns:
      ``(updates, new_state)``, the new state's arrays in ``memory_kind`` memory.

    Raises:
      ValueError: ``params`` has another structure than ``updates``, the optimizer is not
        separable, or its state does not split by parameter leaf.
    """
    u_leaves, u_def = jax.tree.flatten(updates)
    p_leaves = None
    if params is not None:
        p_leaves, p_def = jax.tree.flatten(params)
        if p_def != u_def:
            raise ValueError(
                f"offload(leaf_by_leaf=True): params structure {p_def} differs from the "
                f"updates structure {u_def}; the per-leaf split needs them equal."
            )
    prog = _program_for(inner, cache, u_def, u_leaves, p_leaves, state, extra_args)
    s_leaves, s_def = jax.tree.flatten(state)
    new_u, new_arrays = _run_program(
        prog,
        u_leaves,
        p_leaves,
        [x for x in s_leaves if is_array(x)],
        [x for x in jax.tree.leaves(extra_args) if is_array(x)],
        skip,
        memory_kind,
    )
    it = iter(new_arrays)
    new_s = [next(it) if x is None else x for x in prog.state_static]
    return u_def.unflatten(new_u), s_def.unflatten(new_s)
