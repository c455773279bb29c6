"""Structural rules of the NF4/LoRA interpreter: views, stacked-axis indexing and control flow.

Casts and transposes update a ``Weight``'s lazy view; slices of its stacked axes slice the
packed fields; ``scan``/``cond``/``while``/``checkpoint``/custom derivatives are re-built
around the interpreted body. See ``docs/lora.md``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src import jaxpr as _jaxpr
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import error
from jmem._src.implicit.weight import is_weight


def _only_weight(interp, eqn, invals):
    """The single ``Weight`` operand (first) of a view op; raises if there are several."""
    w = invals[0]
    if any(is_weight(v) for v in invals[1:]):
        raise error(w, eqn.primitive.name, "several weights in one operation")
    return w


def _lossy(d, new) -> bool:
    """Whether casting to ``d`` and then to ``new`` can differ from casting to ``new``."""
    d, new = jnp.dtype(d), jnp.dtype(new)
    if not (jnp.issubdtype(d, jnp.floating) and jnp.issubdtype(new, jnp.floating)):
        return d != new
    fd, fn = jnp.finfo(d), jnp.finfo(new)
    return fd.nmant < fn.nmant or fd.maxexp < fn.maxexp or fd.minexp > fn.minexp


def convert(interp, eqn, invals):
    """``convert_element_type``: changes the view dtype, recording lossy intermediate casts."""
    w = _only_weight(interp, eqn, invals)
    new = jnp.dtype(eqn.params["new_dtype"])
    via = tuple(d for d in (*w.via, w.dtype) if _lossy(d, new))
    return w.replace(dtype=new, via=via)


def transpose(interp, eqn, invals):
    """``transpose``: composes the view permutation (folded into the matmul later)."""
    w = _only_weight(interp, eqn, invals)
    return w.replace(perm=tuple(w.perm[d] for d in eqn.params["permutation"]))


def identity(interp, eqn, invals):
    """``copy``/``sharding_constraint``/``name``: the weight unchanged (a constraint is dropped)."""
    return _only_weight(interp, eqn, invals)


def _lead_view_ok(w: Weight) -> bool:
    """Whether the stacked axes are still the leading view axes, in order."""
    return tuple(w.perm[: w.n_lead]) == tuple(range(w.n_lead))


def slice_(interp, eqn, invals):
    """``slice`` of the stacked axes only: slices every packed field and factor."""
    w = _only_weight(interp, eqn, invals)
    p = eqn.params
    nl = w.n_lead
    start, limit = tuple(p["start_indices"]), tuple(p["limit_indices"])
    strides = tuple(p["strides"] or (1,) * len(start))
    full = all(
        start[d] == 0 and limit[d] == w.shape[d] and strides[d] == 1 for d in range(nl, len(start))
    )
    if not (_lead_view_ok(w) and full):
        return interp.fallback(eqn, invals, w, "it slices the matrix axes")
    new_lead = tuple(len(range(start[d], limit[d], strides[d])) for d in range(nl))

    def f(arr):
        return lax.slice(
            arr,
            start[:nl] + (0,) * (arr.ndim - nl),
            limit[:nl] + arr.shape[nl:],
            strides[:nl] + (1,) * (arr.ndim - nl),
        )

    return w.map_lead(f, new_lead)


def dynamic_slice(interp, eqn, invals):
    """``dynamic_slice`` of the stacked axes only (``w[i]`` in a ``fori_loop``)."""
    w = invals[0]
    if any(is_weight(v) for v in invals[1:]):
        raise error(w, "dynamic_slice", "a weight used as an index")
    idx = invals[1:]
    sizes = tuple(eqn.params["slice_sizes"])
    nl = w.n_lead
    full = all(sizes[d] == w.shape[d] for d in range(nl, len(sizes)))  # start clamps to 0
    if not (_lead_view_ok(w) and full):
        return interp.fallback(eqn, invals, w, "it slices the matrix axes")

    def f(arr):
        starts = list(idx[:nl]) + [jnp.zeros((), jnp.int32)] * (arr.ndim - nl)
        starts = [jnp.asarray(s).astype(jnp.int32) for s in starts]
        return lax.dynamic_slice(arr, starts, sizes[:nl] + arr.shape[nl:])

    return w.map_lead(f, sizes[:nl])


def _drop_lead(w: Weight, dims: tuple):
    """Squeezes the stacked axes ``dims`` out of every field and factor."""
    keep = tuple(d for d in range(w.n_lead) if d not in dims)
    new_lead = tuple(w.base_shape[d] for d in keep)
    return w.map_lead(lambda arr: jnp.squeeze(arr, axis=dims), new_lead)


def squeeze(interp, eqn, invals):
    """``squeeze`` of size-1 stacked axes."""
    w = _only_weight(interp, eqn, invals)
    dims = tuple(d % len(w.shape) for d in eqn.params["dimensions"])
    if not (_lead_view_ok(w) and all(d < w.n_lead for d in dims)):
        return interp.fallback(eqn, invals, w, "it squeezes a matrix axis")
    return _drop_lead(w, dims)


def reshape(interp, eqn, invals):
    """``reshape`` that is the identity or drops size-1 stacked axes."""
    w = _only_weight(interp, eqn, invals)
    new = tuple(eqn.params["new_sizes"])
    if new == w.shape:
        return w
    nl = w.n_lead
    # Supported: dropping size-1 stacked axes (``w[i:i+1]`` then reshape to ``[in, out]``).
    if (
        _lead_view_ok(w)
        and eqn.params.get("dimensions") is None
        and len(new) >= 2
        and new[-2:] == w.shape[nl:]
        and new[:-2] == tuple(s for s in w.shape[:nl] if s != 1)
    ):
        return _drop_lead(w, tuple(d for d in range(nl) if w.shape[d] == 1))
    return interp.fallback(eqn, invals, w, "it reshapes the weight's matrix axes")


# --------------------------------------------------------------------------------------
# Higher-order primitives.


def inline_call(interp, eqn, invals):
    """A call primitive (``jit``, ``closed_call``) receiving a weight: its body inlined."""
    return _jaxpr.inline_call(eqn, invals, interp.eval)


def inline_custom(interp, eqn, invals):
    """A custom-derivative call receiving a weight: its primal body is interpreted
    (JAX differentiates it; that call's own derivative rule is dropped), or, for a custom
    VJP marked ``jmem._src.jaxpr.rebuildable`` (the token chunks' recomputation), the same
    custom VJP is rebuilt around the interpreted body, so what it saves stays its own
    (inlined, an outer remat policy would save its internals). Rules for particular
    custom calls (``jmem.fp8.fp8_dot_general``) are registered before it."""
    if _jaxpr.body_of(eqn) is None:
        raise error(next(v for v in invals if is_weight(v)), eqn.primitive.name)
    if _jaxpr.rebuild_rule(eqn) is not None:
        return _jaxpr.rebind_custom_vjp(eqn, invals, interp.eval)
    return _jaxpr.inline_call(eqn, invals, interp.eval)


def checkpoint(interp, eqn, invals):
    """``checkpoint``/``remat``: the interpreted body re-wrapped in ``jax.checkpoint``
    with the same ``policy`` and ``prevent_cse``."""
    return _jaxpr.rebind_checkpoint(eqn, invals, interp.eval)


def _no_weight_out(where: str, what: str):
    def check(outs):
        for o in outs:
            if is_weight(o):
                raise error(o, where, what)
        return outs

    return check


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(state, n: int):
    """``state`` (a pytree) repeated ``n`` times on a new leading axis; the cotangent of
    the copies comes back max-reduced over that axis, not summed.

    For a scaling state whose cotangent is its update (``jmem.fp8``'s overwrite rule) used
    once per loop iteration: each iteration updates its own copy and the updates combine
    into one. For FP8's delayed scaling the combination is exact: every iteration computes
    the same new scale and the same shifted history from the same old state, and only
    history index 0 differs, each holding its own amax; the max of those is the amax over
    every iteration's tensor, the update one call over all of them would make. An
    iteration that does not use the state gives zeros, which the max ignores (scales are
    positive, amaxes non-negative)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state)


def _fan_out_fwd(state, n):
    return fan_out(state, n), None


def _fan_out_bwd(n, _, g):
    return (jax.tree.map(lambda a: jnp.max(a, axis=0), g),)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def _fan_out_scaling(consts: list, length: int) -> tuple[list, list, Callable]:
    """``(consts, states, rebuild)``: the scaling states (``Weight.meta``) of the weights
    among a loop's consts moved to per-iteration inputs (``fan_out``), so that their
    per-iteration updates are max-combined instead of summed by the loop's transpose (token
    chunks run each projection once per chunk); ``rebuild(consts, states)`` puts one
    iteration's states back."""
    idx = [i for i, v in enumerate(consts) if is_weight(v) and v.meta is not None]
    states = [fan_out(consts[i].meta, length) for i in idx]
    stripped = [v.replace(meta=None) if i in idx else v for i, v in enumerate(consts)]

    def rebuild(consts, states):
        consts = list(consts)
        for i, m in zip(idx, states):
            consts[i] = consts[i].replace(meta=m)
        return consts

    return stripped, states, rebuild


def scan(interp, eqn, invals):
    """``scan``: a stacked weight in ``xs`` is scanned over (each step sees its layer), one
    among the consts is closed over (its FP8 state fanned out per step, ``fan_out``); one
    in the carry raises."""
    p = eqn.params
    body = p["jaxpr"]
    consts, init, xs = _jaxpr.scan_operands(p, invals)
    consts, states, rebuild = _fan_out_scaling(consts, p["length"])
    for v in init:
        if is_weight(v):
            raise error(v, "scan", "a selected weight in the scan carry")
    xs_in = []
    for v in xs:
        if is_weight(v):
            if v.n_lead < 1 or v.perm[0] != 0:
                return interp.fallback(eqn, invals, v, "scanned over a non-stacked axis")
            v = v.scan_carrier()
        xs_in.append(v)
    check = _no_weight_out("scan", "a selected weight returned from the scan body")
    ncarry = p["num_carry"]

    nxs = len(xs_in)

    def step(carry, x):
        cs = rebuild(consts, x[nxs:])
        outs = check(interp.eval(body.jaxpr, body.consts, [*cs, *carry, *x[:nxs]]))
        return list(outs[:ncarry]), list(outs[ncarry:])

    return _jaxpr.rebind_scan(p, init, [*xs_in, *states], step)


def cond(interp, eqn, invals):
    """``cond`` as ``lax.switch`` over the interpreted branches (weights among operands only)."""
    if is_weight(invals[0]):
        raise error(invals[0], "cond", "a weight used as a branch index")
    check = _no_weight_out("cond", "a selected weight returned from a branch")
    return _jaxpr.rebind_cond(eqn, invals, interp.eval, check)


def while_(interp, eqn, invals):
    """``while``: weights among the consts only (one in the carry raises)."""
    p = eqn.params
    for v in invals[p["cond_nconsts"] + p["body_nconsts"] :]:
        if is_weight(v):
            raise error(v, "while", "a selected weight in the loop carry")
    return _jaxpr.rebind_while(eqn, invals, interp.eval)


def device_put(interp, eqn, invals):
    """``device_put`` (e.g. to ``jax.memory.Space.Device`` inside ``jit``): every array of a
    weight (NF4 codes and absmax, LoRA factors) is moved, the weight stays implicit; the
    layer scan of ``jmem.Levers(offload_params=True)`` copies each layer's slice so."""
    dsts = eqn.params["devices"]
    return [jax.tree.map(lambda a, d=d: jax.device_put(a, d), v) for v, d in zip(invals, dsts)]
