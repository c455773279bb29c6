"""Structural rules of the NF4/LoRA interpreter: views, stacked-axis indexing and control flow.

Casts and transposes update a ``Weight``'s lazy view; slices of its stacked axes slice the
packed fields; ``scan``/``cond``/``while``/``checkpoint``/custom derivatives are re-built
around the interpreted body. See ``docs/lora.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src import fp8 as _fp8
from jmem._src.implicit.fp8_rules import fp8_dot
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


def inline_closed(key):
    """The rule inlining a call primitive (``jit``, ``closed_call``) whose body is ``params[key]``."""

    def rule(interp, eqn, invals):
        sub = eqn.params[key]
        if hasattr(sub, "jaxpr"):
            return interp.eval(sub.jaxpr, sub.consts, invals)
        return interp.eval(sub, (), invals)

    return rule


def custom_vjp(interp, eqn, invals):
    """``custom_vjp_call``: the FP8 rule for ``fp8_dot_general``, else inlined."""
    cfg = _fp8.dot_config_of(eqn.params)
    if cfg is not None:
        outs = fp8_dot(interp, eqn, invals, cfg)
        if outs is not None:
            return outs
    return inline_custom(interp, eqn, invals)


def inline_custom(interp, eqn, invals):
    """A custom-derivative call receiving a weight: its primal body is interpreted
    (JAX differentiates it; that call's own derivative rule is dropped)."""
    sub = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    if sub is None:
        raise error(next(v for v in invals if is_weight(v)), eqn.primitive.name)
    if hasattr(sub, "jaxpr"):
        return interp.eval(sub.jaxpr, sub.consts, invals)
    return interp.eval(sub, (), invals)


def checkpoint(interp, eqn, invals):
    """``checkpoint``/``remat``: the interpreted body re-wrapped in ``jax.checkpoint``
    with the same ``policy`` and ``prevent_cse``."""
    inner = eqn.params["jaxpr"]

    def f(*vals):
        if hasattr(inner, "jaxpr"):
            return interp.eval(inner.jaxpr, inner.consts, vals)
        return interp.eval(inner, (), vals)

    return jax.checkpoint(
        f, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )(*invals)


def scan(interp, eqn, invals):
    """``scan``: a stacked weight in ``xs`` is scanned over (each step sees its layer), one
    among the consts is closed over; one in the carry raises."""
    p = eqn.params
    body = p["jaxpr"]
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    for v in init:
        if is_weight(v):
            raise error(v, "scan", "a targeted weight in the scan carry")
    xs_in = []
    for v in xs:
        if is_weight(v):
            if v.n_lead < 1 or v.perm[0] != 0:
                return interp.fallback(eqn, invals, v, "scanned over a non-stacked axis")
            v = v.scan_carrier()
        xs_in.append(v)

    def step(carry, x):
        outs = interp.eval(body.jaxpr, body.consts, [*consts, *carry, *x])
        for o in outs:
            if is_weight(o):
                raise error(o, "scan", "a targeted weight returned from the scan body")
        return list(outs[:ncarry]), list(outs[ncarry:])

    kw = {}
    if "_split_transpose" in p:
        kw["_split_transpose"] = p["_split_transpose"]
    carry, ys = lax.scan(
        step, list(init), xs_in, length=p["length"], reverse=p["reverse"], unroll=p["unroll"], **kw
    )
    return [*carry, *ys]


def cond(interp, eqn, invals):
    """``cond`` as ``lax.switch`` over the interpreted branches (weights among operands only)."""
    index, *ops = invals
    if is_weight(index):
        raise error(index, "cond", "a weight used as a branch index")

    def branch(closed, *args):
        outs = interp.eval(closed.jaxpr, closed.consts, args)
        for o in outs:
            if is_weight(o):
                raise error(o, "cond", "a targeted weight returned from a branch")
        return outs

    return lax.switch(index, [functools.partial(branch, b) for b in eqn.params["branches"]], *ops)


def while_(interp, eqn, invals):
    """``while``: weights among the consts only (one in the carry raises)."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    for v in init:
        if is_weight(v):
            raise error(v, "while", "a targeted weight in the loop carry")
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]

    def cond_fn(carry):
        return interp.eval(cj.jaxpr, cj.consts, [*cconsts, *carry])[0]

    def body_fn(carry):
        outs = interp.eval(bj.jaxpr, bj.consts, [*bconsts, *carry])
        return list(outs)

    return lax.while_loop(cond_fn, body_fn, list(init))
