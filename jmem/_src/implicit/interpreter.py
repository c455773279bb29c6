"""A jaxpr interpreter that runs a model with frozen weights replaced by implicit values.

This is the mechanism behind ``jmem.lora.apply`` and ``jmem.qlora.apply`` (in the spirit of
qax / "implicit arrays"). ``call(fn, params, lora, args, kwargs)``:

1. traces ``fn(params, *args, **kwargs)`` to a jaxpr, with abstract placeholders of the
   logical shape/dtype for every *targeted* leaf of ``params``: every ``jmem.nf4.NF4Array``
   leaf and every leaf named in ``lora`` (a ``{path: LoraWeight}`` dict);
2. re-evaluates that jaxpr equation by equation. A targeted leaf is carried as a
   ``Weight`` (the frozen base, an array or an ``NF4Array``, plus optional LoRA factors
   ``a [.., in, r]``, ``b [.., r, out]`` and scale) with a pending *view*: the dtype it was
   cast to and a transpose permutation. Equations that do not touch a ``Weight`` are bound
   unchanged. Equations that do are rewritten:

   - ``convert_element_type``, ``transpose``, ``copy``, ``sharding_constraint``, ``name``
     (checkpoint_name) update the view lazily (nothing is materialized; a transpose is
     folded into the matmul's dimension numbers; a lossy cast chain such as
     ``f32 -> bf16 -> f32`` keeps its rounding; a sharding constraint on the raw weight is
     dropped);
   - ``slice`` / ``dynamic_slice`` / ``squeeze`` / ``reshape`` that only index or drop
     leading *stacked* axes (``w[i]`` in a Python or ``fori_loop`` over layers) slice the
     packed fields and factors;
   - ``dot_general`` with a ``Weight`` operand becomes ``x·W`` plus ``s·(x·a)·b``. With an
     ``NF4Array`` base, ``x·W`` is a ``custom_vjp`` matmul that dequantizes the weight to
     the view dtype just before the matmul and again in the backward pass: its residuals
     are ``x`` and the packed NF4 fields, never the dequantized weight (no ``[L, in, out]``
     bf16 stack is kept for backward). The NF4 fields get no cotangent. A plain-array base
     uses an ordinary (differentiable) ``dot_general``.
   - ``scan``: a stacked ``Weight`` among ``xs`` is passed as ``xs`` of a new ``lax.scan``
     (its packed fields / factors are sliced per iteration, so each step sees its layer);
     one among the consts is closed over; in the carry it is an error.
   - ``jit``/``pjit``/``closed_call``/``core_call`` are inlined (the enclosing ``jit`` still
     compiles the whole program); ``checkpoint``/``remat`` is re-wrapped in
     ``jax.checkpoint`` with the same ``policy`` and ``prevent_cse``; ``cond`` becomes
     ``lax.switch``; ``while`` accepts ``Weight``s among its consts only.
   - ``jmem.fp8.fp8_dot_general`` (recognized by ``jmem.fp8.dot_config_of``) whose kernel
     is a ``Weight``: ``fp8_dot_general(x, base, meta) + s·(x·a)·b``. The base of this
     call (the NF4 slice dequantized to the view dtype, or the plain array, in its view)
     goes through the FP8 matmul with ``meta``'s delayed scaling; the low-rank path runs
     in the view (compute) dtype, e.g. bf16 — Transformer Engine + PEFT semantics. The
     ``meta``'s cotangent is its updated state (``jmem.fp8``'s overwrite-with-gradient).
     The backward pass re-quantizes the FP8 kernel from the NF4 codes / frozen array
     instead of keeping it: the residuals are ``x``'s FP8 bits and the (forwarded) base,
     never a dequantized or FP8 weight stack. The call is rewritten when the weight is
     the kernel operand and, with LoRA factors, contracts one matrix axis with its
     stacked axes as batch dims; otherwise it is inlined as below (and its ``abs``
     (amax) of the weight raises, or with ``allow_materialize`` quantizes the merged
     weight). FP8 calls whose kernel is not targeted are bound unchanged.
   - other ``custom_jvp_call`` / ``custom_vjp_call`` that receive a ``Weight`` are inlined:
     their primal body is interpreted and differentiated by JAX's rules, i.e. the custom
     derivative rule of *that* call is dropped (calls that don't receive a weight, e.g.
     ``jax.nn.relu``, keep theirs).

Anything else applied to a targeted weight (an element-wise op on the raw weight, a
``reshape`` of its matrix axes, a ``gather``, a weight returned as an output, or in a
scan carry) raises ``ImplicitWeightError`` naming the weight path and the primitive,
unless ``allow_materialize=True``: then the weight's merged, dequantized view is
materialized for that one equation (costing the memory this module exists to avoid).

A ``dot_general`` gets the low-rank path when the weight contracts exactly one of its two
matrix axes and its stacked axes (if any) are batch dimensions; other layouts raise (or
materialize when allowed). Cost: tracing happens once per trace of the caller (under
``jax.jit``: once); no Python loop over layers ever runs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src import fp8 as _fp8
from jmem._src import nf4 as _nf4
from jmem._src import tree as _tree
from jmem._src.interpret import bind_eqn, eval_jaxpr

__all__ = ["ImplicitWeightError", "Weight", "call", "flatten_params"]


class ImplicitWeightError(ValueError):
    """A targeted (NF4 / LoRA) weight is used in a way the interpreter cannot rewrite."""


def _is_nf4(x) -> bool:
    return isinstance(x, _nf4.NF4Array)


def flatten_params(params):
    """``([(path_str, leaf)], treedef)`` with ``NF4Array``s kept as leaves."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_nf4)
    return [(_tree.path_str(p), x) for p, x in leaves], treedef


# --------------------------------------------------------------------------------------
# The implicit value.


@dataclasses.dataclass(frozen=True)
class Weight:
    """A frozen weight (array or ``NF4Array``) + optional LoRA factors, with a lazy view.

    ``perm[d]`` is the original axis shown at view axis ``d``; ``dtype`` is the view dtype;
    ``via`` the lossy intermediate casts before it (``f32 -> bf16 -> f32`` rounds to bf16).
    """

    def cast(self, w) -> jax.Array:
        """Casts the (dequantized) base value ``w`` through ``via`` to ``dtype``."""
        for d in self.via:
            w = w.astype(d)
        return w.astype(self.dtype)

    def dense_base(self) -> jax.Array:
        """The base weight in the view dtype (not transposed), dequantized if NF4."""
        if _is_nf4(self.base):
            return self.cast(_nf4.dequantize(self.base, self.via[0] if self.via else self.dtype))
        return self.cast(self.base)

    base: Any
    a: Any = None
    b: Any = None
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))
    name: str = dataclasses.field(default="", metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=None, metadata=dict(static=True))
    perm: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    base_shape: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    via: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def n_lead(self) -> int:
        return len(self.base_shape) - 2

    @property
    def shape(self) -> tuple:
        return tuple(self.base_shape[p] for p in self.perm)

    def replace(self, **kw) -> "Weight":
        return dataclasses.replace(self, **kw)

    def materialize(self) -> jax.Array:
        """The merged, dequantized weight in its view (allocates the full matrix)."""
        w = self.dense_base()
        if self.a is not None:
            delta = (
                jnp.einsum(
                    "...ir,...ro->...io", self.a.astype(jnp.float32), self.b.astype(jnp.float32)
                )
                * self.scale
            )
            w = (w.astype(jnp.float32) + delta).astype(self.dtype)
        return jnp.transpose(w, self.perm)

    def map_lead(self, f: Callable, new_lead: tuple) -> "Weight":
        """Applies ``f`` (acting on the leading stacked axes) to every field and factor."""
        base = jax.tree.map(f, self.base)
        if _is_nf4(base):
            base = dataclasses.replace(
                base,
                shape=tuple(new_lead) + self.base_shape[self.n_lead :],
                batch_ndim=len(new_lead) if len(new_lead) else 0,
            )
        a = None if self.a is None else f(self.a)
        b = None if self.b is None else f(self.b)
        nl_new = len(new_lead)
        perm = tuple(range(nl_new)) + tuple(
            p - self.n_lead + nl_new for p in self.perm[self.n_lead :]
        )
        return self.replace(
            base=base,
            a=a,
            b=b,
            perm=perm,
            base_shape=tuple(new_lead) + self.base_shape[self.n_lead :],
        )

    def scan_carrier(self) -> "Weight":
        """A pytree whose leaves keep the stacked axis 0 and whose metadata describe one
        slice: ``lax.scan`` slices the leaves and rebuilds a consistent per-layer Weight."""
        base = self.base
        if _is_nf4(base):
            base = dataclasses.replace(
                base, shape=base.shape[1:], batch_ndim=max(base.batch_ndim - 1, 0)
            )
        perm = tuple(p - 1 for p in self.perm[1:])
        return self.replace(base=base, perm=perm, base_shape=self.base_shape[1:])


jax.tree_util.register_dataclass(
    Weight,
    data_fields=["base", "a", "b"],
    meta_fields=["scale", "name", "dtype", "perm", "base_shape", "via"],
)


def _is_weight(x) -> bool:
    return isinstance(x, Weight)


def _err(w: Weight, prim: str, why: str = "") -> ImplicitWeightError:
    return ImplicitWeightError(
        f"Weight {w.name!r} (view shape {w.shape}, {jnp.dtype(w.dtype).name}) reaches primitive "
        f"{prim!r}, which jmem cannot apply to an NF4/LoRA weight without materializing it"
        f"{': ' + why if why else ''}. Use the weight only through matmuls (dot_general/einsum/@), "
        f"optionally after astype/transpose/slicing its stacked axis, or pass "
        f"allow_materialize=True to dequantize/merge it for this operation."
    )


# --------------------------------------------------------------------------------------
# Matmuls.


def _weight_dot(x, wdense, *, wi: int, perm: tuple, params: dict):
    """``dot_general`` of ``x`` with the view ``transpose(wdense, perm)``, without transposing
    the weight: dimension numbers are mapped to the weight's own axes and the (small)
    output is permuted instead."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if wi == 0:
        wc, wb = lc, lb
        dn = ((tuple(perm[d] for d in lc), tuple(rc)), (tuple(perm[d] for d in lb), tuple(rb)))
    else:
        wc, wb = rc, rb
        dn = ((tuple(lc), tuple(perm[d] for d in rc)), (tuple(lb), tuple(perm[d] for d in rb)))
    y = lax.dot_general_p.bind(
        *((wdense, x) if wi == 0 else (x, wdense)), **{**params, "dimension_numbers": dn}
    )
    free_view = [d for d in range(len(perm)) if d not in wc and d not in wb]
    orig_free = [perm[d] for d in free_view]
    order = [sorted(orig_free).index(o) for o in orig_free]
    if order != sorted(order):
        nb = len(wb)
        start = nb if wi == 0 else y.ndim - len(free_view)
        full = list(range(y.ndim))
        full[start : start + len(order)] = [start + i for i in order]
        y = jnp.transpose(y, full)
    return y


def _frozen_nf4_dot(x, q, *, wi: int, w: Weight, params: dict):
    """``dot_general`` of x with the dequantized view of ``q``, recomputed in backward."""
    meta = w.replace(base=None, a=None, b=None)  # static view only; no tracers captured

    def prim(x, q):
        return _weight_dot(
            x, meta.replace(base=q).dense_base(), wi=wi, perm=meta.perm, params=params
        )

    @jax.custom_vjp
    def f(x, q):
        return prim(x, q)

    def fwd(x, q):
        return prim(x, q), (x, q)

    def bwd(res, g):
        x, q = res
        _, vjp = jax.vjp(lambda x: prim(x, q), x)
        return vjp(g)[0], None

    f.defvjp(fwd, bwd)
    return f(x, q)


def _dot_general(interp, eqn, invals):
    lhs, rhs = invals
    params = dict(eqn.params)
    if _is_weight(lhs) and _is_weight(rhs):
        if not interp.allow_materialize:
            raise _err(lhs, "dot_general", f"both operands are targeted weights ({rhs.name!r})")
        rhs = rhs.materialize()
    wi = 0 if _is_weight(lhs) else 1
    w, x = (lhs, rhs) if wi == 0 else (rhs, lhs)
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    wc, wb = (lc, lb) if wi == 0 else (rc, rb)
    if w.a is not None and not _lowrank_ok(w, wc, wb):
        if not interp.allow_materialize:
            raise _err(
                w,
                "dot_general",
                "the LoRA path needs the weight to contract exactly one "
                "matrix axis with its stacked axes as batch dimensions",
            )
        wm = w.materialize()
        return lax.dot_general_p.bind(*((wm, x) if wi == 0 else (x, wm)), **params)

    if _is_nf4(w.base):
        y = _frozen_nf4_dot(x, w.base, wi=wi, w=w, params=params)
    else:
        y = _weight_dot(x, w.dense_base(), wi=wi, perm=w.perm, params=params)
    if w.a is None:
        return y
    u = _lora_term(
        x,
        w,
        wi=wi,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )
    return y + u.astype(y.dtype)


def _lowrank_ok(w: Weight, wc, wb) -> bool:
    """Whether ``w`` contracts exactly one matrix axis and its stacked axes are batch dims."""
    orig_c = [w.perm[d] for d in wc]
    orig_b = [w.perm[d] for d in wb]
    nl = w.n_lead
    return len(orig_c) == 1 and orig_c[0] >= nl and sorted(orig_b) == list(range(nl))


def _lora_term(
    x, w: Weight, *, wi: int, dimension_numbers, precision=None, preferred_element_type=None
):
    """``s·(x·a)·b`` laid out as ``dot_general(x, W)`` (``wi=1``) or ``(W, x)`` (``wi=0``)
    would lay it out, computed in the weight's view dtype (the compute dtype). The caller
    checked ``_lowrank_ok``."""
    (lc, rc), (lb, rb) = dimension_numbers
    wc, xc = (lc, rc) if wi == 0 else (rc, lc)
    wb, xb = (lb, rb) if wi == 0 else (rb, lb)
    orig_c = [w.perm[d] for d in wc]
    orig_b = [w.perm[d] for d in wb]
    nl = w.n_lead
    pet = preferred_element_type
    a, b = w.a.astype(w.dtype), w.b.astype(w.dtype)
    if orig_c[0] == nl:  # x contracts W's input axis:  (x·a)·b
        first, first_c, second, second_c = a, nl, b, nl
    else:  # x contracts W's output axis: (x·bᵀ)·aᵀ
        first, first_c, second, second_c = b, nl + 1, a, nl + 1
    if x.dtype != first.dtype:
        x = x.astype(first.dtype)
    t = lax.dot_general(
        x,
        first,
        ((tuple(xc), (first_c,)), (tuple(xb), tuple(orig_b))),
        precision=precision,
        preferred_element_type=pet,
    )
    nb = len(xb)
    t = t.astype(second.dtype)
    u = lax.dot_general(
        t,
        second,
        (((t.ndim - 1,), (second_c,)), (tuple(range(nb)), tuple(orig_b))),
        precision=precision,
        preferred_element_type=pet,
    )
    if wi == 0:  # dot_general(W, x) puts W's free axis before x's free axes.
        u = jnp.moveaxis(u, -1, nb)
    return u * jnp.asarray(w.scale, u.dtype)


# --------------------------------------------------------------------------------------
# FP8 matmuls (``jmem.fp8.fp8_dot_general``).


def _fp8_base_dot(x, src, meta, *, w: Weight, cfg):
    """``fp8_dot_general(x, view(src), meta)`` whose backward pass re-quantizes the kernel
    from ``src`` (the NF4 fields or the frozen array of *this* layer) instead of keeping
    its FP8 copy: the residuals are ``x``'s FP8 bits, ``src`` (a slice of a scan input,
    which ``lax.scan`` forwards instead of stacking) and the small states. The forward
    and the re-quantization run the same ops, so the backward sees the forward's bits.
    ``meta``'s cotangent is the updated ``Fp8Meta`` (``jmem.fp8``'s overwrite rule); an
    NF4 ``src`` gets no cotangent, a plain array gets ``∂L/∂W`` through its view."""
    view = w.replace(base=None, a=None, b=None)  # static view only; no tracers captured
    nf4_src = _is_nf4(src)

    def build(src):
        k = view.replace(base=src).dense_base()
        if tuple(view.perm) != tuple(range(len(view.perm))):
            k = jnp.transpose(k, view.perm)
        return k.astype(cfg.k_dtype)

    @jax.custom_vjp
    def f(x, src, meta):
        return _fp8.fp8_dot_forward(cfg, x, build(src), meta)[0]

    def fwd(x, src, meta):
        y, (qx, _, x_meta, k_meta, g_meta) = _fp8.fp8_dot_forward(cfg, x, build(src), meta)
        return y, (qx, src, x_meta, k_meta, g_meta)

    def bwd(res, g):
        qx, src, x_meta, k_meta, g_meta = res
        if nf4_src:
            k, k_vjp = build(src), None
        else:
            k, k_vjp = jax.vjp(build, src)
        qk = _fp8.fp8_bits(k, k_meta.scale_inv, _fp8.E4M3)
        gx, gk, new_meta = _fp8.fp8_dot_backward(cfg, (qx, qk, x_meta, k_meta, g_meta), g)
        return gx, (None if k_vjp is None else k_vjp(gk)[0]), new_meta

    f.defvjp(fwd, bwd)
    return f(x, src, meta)


def _fp8_dot(interp, eqn, invals, cfg):
    """``fp8_dot_general(x, W, meta)`` with an implicit kernel ``W``: the frozen base of
    this call (dequantized if NF4) goes through the FP8 matmul with ``meta``'s delayed
    scaling; the LoRA term ``s·(x·a)·b`` is added in the compute dtype. Returns None when
    the call cannot be rewritten (the caller then inlines it, which raises)."""
    nc = eqn.params.get("num_consts", 0)
    consts, ops = invals[:nc], invals[nc:]
    if len(ops) != 8 or any(_is_weight(v) for v in consts):
        return None
    x, w, *meta_leaves = ops
    if not _is_weight(w) or _is_weight(x) or any(_is_weight(m) for m in meta_leaves):
        return None
    (lc, rc), (lb, rb) = cfg.dimension_numbers
    if w.a is not None and not _lowrank_ok(w, rc, rb):
        return None
    if tuple(w.shape) != tuple(eqn.invars[nc + 1].aval.shape):
        return None
    meta = cfg.unflatten_meta(meta_leaves)
    y = _fp8_base_dot(x, w.base, meta, w=w, cfg=cfg)
    if w.a is None:
        return [y]
    u = _lora_term(x, w, wi=1, dimension_numbers=cfg.dimension_numbers)
    return [y + u.astype(y.dtype)]


# --------------------------------------------------------------------------------------
# View ops.


def _only_weight(interp, eqn, invals):
    w = invals[0]
    if any(_is_weight(v) for v in invals[1:]):
        raise _err(w, eqn.primitive.name, "several weights in one operation")
    return w


def _lossy(d, new) -> bool:
    """Whether casting to ``d`` and then to ``new`` can differ from casting to ``new``."""
    d, new = jnp.dtype(d), jnp.dtype(new)
    if not (jnp.issubdtype(d, jnp.floating) and jnp.issubdtype(new, jnp.floating)):
        return d != new
    fd, fn = jnp.finfo(d), jnp.finfo(new)
    return fd.nmant < fn.nmant or fd.maxexp < fn.maxexp or fd.minexp > fn.minexp


def _convert(interp, eqn, invals):
    w = _only_weight(interp, eqn, invals)
    new = jnp.dtype(eqn.params["new_dtype"])
    via = tuple(d for d in (*w.via, w.dtype) if _lossy(d, new))
    return w.replace(dtype=new, via=via)


def _transpose(interp, eqn, invals):
    w = _only_weight(interp, eqn, invals)
    return w.replace(perm=tuple(w.perm[d] for d in eqn.params["permutation"]))


def _identity(interp, eqn, invals):
    return _only_weight(interp, eqn, invals)


def _lead_view_ok(w: Weight) -> bool:
    return tuple(w.perm[: w.n_lead]) == tuple(range(w.n_lead))


def _slice(interp, eqn, invals):
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


def _dynamic_slice(interp, eqn, invals):
    w = invals[0]
    if any(_is_weight(v) for v in invals[1:]):
        raise _err(w, "dynamic_slice", "a weight used as an index")
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
    keep = tuple(d for d in range(w.n_lead) if d not in dims)
    new_lead = tuple(w.base_shape[d] for d in keep)
    return w.map_lead(lambda arr: jnp.squeeze(arr, axis=dims), new_lead)


def _squeeze(interp, eqn, invals):
    w = _only_weight(interp, eqn, invals)
    dims = tuple(d % len(w.shape) for d in eqn.params["dimensions"])
    if not (_lead_view_ok(w) and all(d < w.n_lead for d in dims)):
        return interp.fallback(eqn, invals, w, "it squeezes a matrix axis")
    return _drop_lead(w, dims)


def _reshape(interp, eqn, invals):
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


def _inline_closed(key):
    def rule(interp, eqn, invals):
        sub = eqn.params[key]
        if hasattr(sub, "jaxpr"):
            return interp.eval(sub.jaxpr, sub.consts, invals)
        return interp.eval(sub, (), invals)

    return rule


def _custom_vjp(interp, eqn, invals):
    cfg = _fp8.dot_config_of(eqn.params)
    if cfg is not None:
        outs = _fp8_dot(interp, eqn, invals, cfg)
        if outs is not None:
            return outs
    return _inline_custom(interp, eqn, invals)


def _inline_custom(interp, eqn, invals):
    sub = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    if sub is None:
        raise _err(next(v for v in invals if _is_weight(v)), eqn.primitive.name)
    if hasattr(sub, "jaxpr"):
        return interp.eval(sub.jaxpr, sub.consts, invals)
    return interp.eval(sub, (), invals)


def _checkpoint(interp, eqn, invals):
    inner = eqn.params["jaxpr"]

    def f(*vals):
        if hasattr(inner, "jaxpr"):
            return interp.eval(inner.jaxpr, inner.consts, vals)
        return interp.eval(inner, (), vals)

    return jax.checkpoint(
        f, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )(*invals)


def _scan(interp, eqn, invals):
    p = eqn.params
    body = p["jaxpr"]
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    for v in init:
        if _is_weight(v):
            raise _err(v, "scan", "a targeted weight in the scan carry")
    xs_in = []
    for v in xs:
        if _is_weight(v):
            if v.n_lead < 1 or v.perm[0] != 0:
                return interp.fallback(eqn, invals, v, "scanned over a non-stacked axis")
            v = v.scan_carrier()
        xs_in.append(v)

    def step(carry, x):
        outs = interp.eval(body.jaxpr, body.consts, [*consts, *carry, *x])
        for o in outs:
            if _is_weight(o):
                raise _err(o, "scan", "a targeted weight returned from the scan body")
        return list(outs[:ncarry]), list(outs[ncarry:])

    kw = {}
    if "_split_transpose" in p:
        kw["_split_transpose"] = p["_split_transpose"]
    carry, ys = lax.scan(
        step, list(init), xs_in, length=p["length"], reverse=p["reverse"], unroll=p["unroll"], **kw
    )
    return [*carry, *ys]


def _cond(interp, eqn, invals):
    index, *ops = invals
    if _is_weight(index):
        raise _err(index, "cond", "a weight used as a branch index")

    def branch(closed, *args):
        outs = interp.eval(closed.jaxpr, closed.consts, args)
        for o in outs:
            if _is_weight(o):
                raise _err(o, "cond", "a targeted weight returned from a branch")
        return outs

    return lax.switch(index, [functools.partial(branch, b) for b in eqn.params["branches"]], *ops)


def _while(interp, eqn, invals):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
    for v in init:
        if _is_weight(v):
            raise _err(v, "while", "a targeted weight in the loop carry")
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]

    def cond_fn(carry):
        return interp.eval(cj.jaxpr, cj.consts, [*cconsts, *carry])[0]

    def body_fn(carry):
        outs = interp.eval(bj.jaxpr, bj.consts, [*bconsts, *carry])
        return list(outs)

    return lax.while_loop(cond_fn, body_fn, list(init))


_RULES: dict[str, Callable] = {
    "dot_general": _dot_general,
    "convert_element_type": _convert,
    "transpose": _transpose,
    "copy": _identity,
    "copy_p": _identity,
    "sharding_constraint": _identity,
    "name": _identity,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "squeeze": _squeeze,
    "reshape": _reshape,
    "jit": _inline_closed("jaxpr"),
    "pjit": _inline_closed("jaxpr"),
    "closed_call": _inline_closed("call_jaxpr"),
    "core_call": _inline_closed("call_jaxpr"),
    "checkpoint": _checkpoint,
    "remat": _checkpoint,
    "remat2": _checkpoint,
    "scan": _scan,
    "cond": _cond,
    "while": _while,
    "custom_jvp_call": _inline_custom,
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
}


_bind = bind_eqn


class _Interpreter:
    def __init__(self, allow_materialize: bool):
        self.allow_materialize = allow_materialize

    def fallback(self, eqn, invals, w: Weight, why: str = ""):
        if not self.allow_materialize:
            raise _err(w, eqn.primitive.name, why)
        return _bind(eqn, [v.materialize() if _is_weight(v) else v for v in invals])

    def eval(self, jaxpr, consts, args):
        return eval_jaxpr(jaxpr, consts, args, self.eval_eqn)

    def eval_eqn(self, eqn, invals):
        if any(_is_weight(v) for v in invals):
            rule = _RULES.get(eqn.primitive.name)
            if rule is None:
                w = next(v for v in invals if _is_weight(v))
                return self.fallback(eqn, invals, w)
            return rule(self, eqn, invals)
        return _bind(eqn, invals)


# --------------------------------------------------------------------------------------
# Entry point.


def call(fn: Callable, params, lora, args: tuple, kwargs: dict, *, allow_materialize: bool = False):
    """Evaluates ``fn(params, *args, **kwargs)`` with NF4 leaves and LoRA adapters implicit.

    Args:
      fn: a function whose first argument is a params pytree.
      params: the params; ``NF4Array`` leaves are frozen quantized weights.
      lora: ``None`` or a ``{path: LoraWeight}`` dict (``jmem.lora.init``); each path names
        a leaf of ``params`` (2-D ``[in, out]`` or stacked ``[..., in, out]``).
      args, kwargs: the other arguments; array leaves are traced, other leaves are static.
      allow_materialize: materialize a weight where it cannot stay implicit, instead of
        raising ``ImplicitWeightError``.

    Returns:
      What ``fn`` returns.

    Raises:
      ValueError: if a LoRA path is not a leaf of ``params`` or shapes disagree.
      ImplicitWeightError: for an unsupported use of a targeted weight (see module doc).
    """
    lora = dict(lora or {})
    flat, treedef = flatten_params(params)
    names = [n for n, _ in flat]
    missing = sorted(set(lora) - set(names))
    if missing:
        raise ValueError(
            f"LoRA adapters for {missing} have no matching leaf in params "
            f"(leaves: {names[:20]}{'...' if len(names) > 20 else ''})."
        )
    p_avals, p_vals = [], []
    for name, leaf in flat:
        if _is_nf4(leaf) or name in lora:
            shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
            if len(shape) < 2:
                raise ValueError(
                    f"Targeted weight {name!r} has shape {shape}; NF4/LoRA weights "
                    f"must be >= 2-D ([..., in, out])."
                )
            ad = lora.get(name)
            if ad is not None:
                exp_a = shape[:-1] + (ad.a.shape[-1],)
                exp_b = shape[:-2] + (ad.b.shape[-2], shape[-1])
                if tuple(ad.a.shape) != exp_a or tuple(ad.b.shape) != exp_b:
                    raise ValueError(
                        f"LoRA factors for {name!r} have shapes a{tuple(ad.a.shape)}, "
                        f"b{tuple(ad.b.shape)}; expected a{exp_a}, b{exp_b} for a weight "
                        f"of shape {shape}."
                    )
            p_avals.append(jax.ShapeDtypeStruct(shape, dtype))
            p_vals.append(
                Weight(
                    base=leaf,
                    a=None if ad is None else ad.a,
                    b=None if ad is None else ad.b,
                    scale=1.0 if ad is None else float(ad.scale),
                    name=name,
                    dtype=dtype,
                    perm=tuple(range(len(shape))),
                    base_shape=shape,
                )
            )
        else:
            p_avals.append(leaf)
            p_vals.append(leaf)

    a_flat, a_tree = jax.tree.flatten((args, kwargs))
    a_dyn, a_combine = _tree.partition(a_flat)
    n_p = len(p_avals)

    def flat_fn(*leaves):
        ps = leaves[:n_p]
        a, kw = jax.tree.unflatten(a_tree, a_combine(leaves[n_p:]))
        return fn(jax.tree.unflatten(treedef, list(ps)), *a, **kw)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*p_avals, *a_dyn)
    interp = _Interpreter(allow_materialize)
    outs = interp.eval(closed.jaxpr, closed.consts, [*p_vals, *a_dyn])
    outs = [o.materialize() if (_is_weight(o) and allow_materialize) else o for o in outs]
    for o in outs:
        if _is_weight(o):
            raise _err(o, "<output>", "the function returns the weight itself")
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
