"""Leaf-by-leaf update of a layer stack one row at a time: a parameter leaf ``[L, ...]`` whose
per-leaf update is elementwise (checked on its traced equations) is updated in a
``lax.fori_loop`` over its ``L`` rows, each row of its host-resident state copied to the
device, updated and written back into its buffer in place, so one row's moments and master
are on the device at a time.

Design notes: docs/offload.md ("Updating a layer stack row by row"). Reference:
ZeRO-Infinity (Rajbhandari et al., 2021, arXiv:2104.07857) for streaming state in pieces.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jmem._src.jaxpr import bind_eqn
from jmem._src.jaxpr import eqn_context
from jmem._src.offload.memory_kinds import DEVICE
from jmem._src.offload.memory_kinds import HOST
from jmem._src.offload.memory_kinds import move
from jmem._src.offload.params import in_host_space

#: Primitives computing each output element from the same element of each operand (or from
#: a rank-0 operand): their result on a row is the row of their result.
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp copy copy_p
    convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge
    gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
    nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan
    tanh xor""".split()
)


def _shape(env: dict, r: Any) -> tuple | None:
    if isinstance(r, jcore.Literal):
        return np.shape(r.val)
    return np.shape(env[r]) if r in env else None


def _row_eqn_ok(eqn: Any, row_ins: list, other_shapes: list, length: int) -> bool:
    """Whether ``eqn`` computes row ``j`` of its outputs from row ``j`` of ``row_ins`` and
    the rank-0 values ``other_shapes`` only."""
    if eqn.effects or any(s != () for s in other_shapes):
        return False
    if eqn.params.get("sharding") is not None:  # a row would need another sharding
        return False
    name = eqn.primitive.name
    if name == "broadcast_in_dim":  # of a shared scalar only
        if row_ins:
            return False
    elif name not in ELEMENTWISE or not row_ins:
        return False
    return all(
        len(v.aval.shape) >= 1 and v.aval.shape[0] == length and v.aval.shape[1:] != ()
        for v in eqn.outvars
    )


def rows_separable(entries: list, row_refs: list, out_refs: list, env: dict) -> bool:
    """Whether a leaf's update (``entries``, from leaf-by-leaf mode's program) is separable
    along axis 0 of its inputs ``row_refs`` (gradient, param, owned state: all ``[L, ...]``
    of rank >= 2, in ``env``).

    Structural: every entry is elementwise over values ``[L, ...]`` and rank-0 values
    computed outside the leaf (step count, bias corrections, literals), or a
    ``broadcast_in_dim`` of such a scalar; every output in ``out_refs`` is one of those
    values. Anything else (a reshape, a reduction, a call, a non-scalar shared operand, an
    explicit sharding) refuses: the caller keeps the whole-leaf update.
    """
    shapes = [_shape(env, r) for r in row_refs]
    if any(s is None or len(s) < 2 for s in shapes) or len({s[0] for s in shapes}) != 1:
        return False
    length = shapes[0][0]
    rows = set(row_refs)
    for e in entries:
        row_ins = [r for r in e.ins if not isinstance(r, jcore.Literal) and r in rows]
        others = [_shape(env, r) for r in e.ins if isinstance(r, jcore.Literal) or r not in rows]
        if not _row_eqn_ok(e.eqn, row_ins, others, length):
            return False
        rows.update(e.outs)
    return all(not isinstance(r, jcore.Literal) and r in rows for r in out_refs)


def _bind_row(eqn: Any, ins: list) -> Any:
    """``eqn`` bound on rows: a ``broadcast_in_dim`` broadcasts to the row's shape."""
    if eqn.primitive.name == "broadcast_in_dim":
        eqn = eqn.replace(params={**eqn.params, "shape": tuple(eqn.params["shape"][1:])})
    return bind_eqn(eqn, ins)


def _evaluate_rows(env: dict, entries: list) -> None:
    for e in entries:
        ins = [r.val if isinstance(r, jcore.Literal) else env[r] for r in e.ins]
        with eqn_context(e.eqn, e.prefix):
            outs = _bind_row(e.eqn, ins)
        if not e.eqn.primitive.multiple_results:
            outs = [outs]
        for r, o in zip(e.outs, outs):
            env[r] = o


def _read(env: dict, r: Any) -> Any:
    return jnp.asarray(r.val if isinstance(r, jcore.Literal) else env[r])


def _slots(row_avals: list, out_avals: list, places: list, row_places: list) -> list:
    """For each output, the index of the input buffer it is written into in place: a new
    state leaf into its old value's buffer (``row_avals[k - 1]``), the update into the
    param's (else the gradient's) buffer, when shape, dtype and memory kind match; None:
    a fresh buffer."""
    slots: list[int | None] = []
    for k, (aval, place) in enumerate(zip(out_avals, places)):
        candidates = [k - 1] if k else list(range(len(row_avals) - 1, len(out_avals) - 2, -1))
        slots.append(
            next(
                (
                    c
                    for c in candidates
                    if row_avals[c] == aval and row_places[c] == place and c not in slots
                ),
                None,
            )
        )
    return slots


def _row_body(env, entries, row_refs, out_refs, places, dest, skip, j, bufs):
    """Iteration ``j``: reads row ``j`` of the inputs onto the device, evaluates the leaf's
    update on them, writes each output's row ``j`` into its buffer (``dest``)."""
    local = dict(env)
    for r, b in zip(row_refs, bufs):
        local[r] = move(jax.lax.dynamic_index_in_dim(b, j, keepdims=False), DEVICE)
    _evaluate_rows(local, entries)
    bufs = list(bufs)
    for k, (r, place) in enumerate(zip(out_refs, places)):
        y = _read(local, r)
        if skip is not None:
            old = jnp.zeros_like(y) if k == 0 else local[row_refs[k - 1]]
            y = jax.lax.select(skip, old, y)
        bufs[dest[k]] = jax.lax.dynamic_update_index_in_dim(bufs[dest[k]], move(y, place), j, 0)
    return bufs


def run_rows(
    env: dict,
    entries: list,
    row_refs: list,
    xs: list,
    out_refs: list,
    places: list,
    skip: Any,
) -> list:
    """Evaluates a row-separable leaf update (``rows_separable``) one row at a time.

    A ``lax.fori_loop`` over axis 0 of ``xs`` (the values of ``row_refs``: the leaf's
    state, gradient and param, in host or device memory), carrying them: iteration ``j``
    copies row ``j`` of each to the device, evaluates ``entries`` on the rows (the values of
    ``env`` are shared scalars) and writes row ``j`` of each output of ``out_refs``, moved to
    its memory kind in ``places``, into a buffer in place (``dynamic_update_slice``): a new
    state leaf into its old value's buffer, the update into the param's or gradient's
    buffer (each row is read before it is written), so no second ``[L, ...]`` buffer is
    made. Output 0 is the update (zeros where ``skip``), outputs ``k >= 1`` new state leaves
    whose old value is ``row_refs[k - 1]`` (kept where ``skip``). Elementwise work on a row
    gives that row of the whole-leaf result, so the values are the whole-leaf update's.

    Returns:
      The outputs, ``[L, ...]`` each.
    """
    length = np.shape(xs[0])[0]
    avals = {r: (tuple(np.shape(x)), jnp.result_type(x)) for r, x in zip(row_refs, xs)}
    for e in entries:
        avals.update(
            {r: (tuple(v.aval.shape), v.aval.dtype) for r, v in zip(e.outs, e.eqn.outvars)}
        )
    out_avals = [avals[r] for r in out_refs]
    row_avals = [avals[r] for r in row_refs]
    row_places = [places[k + 1] if k + 1 < len(places) else None for k in range(len(xs))]
    for k in range(len(places) - 1, len(xs)):  # gradient and param: where they are
        row_places[k] = HOST if in_host_space(xs[k]) else DEVICE
    slots = _slots(row_avals, out_avals, places, row_places)
    fresh = [
        jnp.zeros(*aval) if place == DEVICE else move(jnp.zeros(*aval), place)
        for aval, place, slot in zip(out_avals, places, slots)
        if slot is None
    ]
    fresh_at = iter(range(len(xs), len(xs) + len(fresh)))
    dest = [next(fresh_at) if slot is None else slot for slot in slots]
    body = functools.partial(_row_body, env, entries, row_refs, out_refs, places, dest, skip)
    bufs = jax.lax.fori_loop(0, length, body, list(xs) + fresh)
    return [bufs[d] for d in dest]
