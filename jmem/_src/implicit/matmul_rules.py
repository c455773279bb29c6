"""Matmul rules of the NF4/LoRA interpreter: ``dot_general`` against an implicit ``Weight``.

``x·W`` becomes ``x·W + s·(x·a)·b`` (Hu et al. 2021, arXiv:2106.09685); an NF4 base is
dequantized just before the matmul and again in the backward pass (Dettmers et al. 2023,
arXiv:2305.14314). See ``docs/lora.md``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from jmem._src import jax_compat
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import error
from jmem._src.implicit.weight import is_nf4
from jmem._src.implicit.weight import is_weight

__all__ = [
    "LORA_MATMUL",
    "LORA_BATCHED_MATMUL",
    "adapted",
    "dot_general",
    "lowrank_ok",
    "lora_dropout",
    "lora_term",
]

#: The ``checkpoint_name`` of a LoRA-adapted matmul's output ``x·W + s·(x·a)·b`` (one
#: model matmul, computed as two): the remat policies that save matmul outputs save this
#: one value, so neither full-width term is saved on its own. ``LORA_BATCHED_MATMUL``: the
#: same for a matmul with batch dimensions (``dots`` saves it, ``selective`` does not).
LORA_MATMUL = "lora_matmul"
LORA_BATCHED_MATMUL = "lora_batched_matmul"


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


def _opaque_zero(dep: jax.Array) -> jax.Array:
    """A uint8 zero computed from ``dep`` that XLA cannot constant-fold.

    ``popcount(bits(d)) >> bit_length(width)`` is 0 for every value ``d`` (the popcount of
    a ``width``-bit word is at most ``width``), but no XLA simplifier tracks the range of a
    popcount, so the result stays a data dependency on ``dep``. It reads the first element
    of ``dep`` along every axis that is not sharded in its type (explicit sharding cannot
    slice a sharded axis; there the whole axis is kept and reduced): a reduction over all of
    ``dep`` cost a pass over every activation per projection, 9% of a QLoRA step on XLA:CPU,
    and a data dependency on part of it orders the work as well."""
    if dep.size == 0:
        return jnp.zeros((), jnp.uint8)
    if jnp.iscomplexobj(dep):
        dep = jnp.real(dep)
    if dep.dtype == jnp.bool_:
        dep = dep.astype(jnp.uint8)
    bits = 8 * jnp.dtype(dep.dtype).itemsize
    spec = tuple(getattr(getattr(jax.typeof(dep), "sharding", None), "spec", None) or ())
    sharded = [i < len(spec) and spec[i] is not None for i in range(dep.ndim)]
    part = lax.slice(dep, (0,) * dep.ndim, [n if s else 1 for n, s in zip(dep.shape, sharded)])
    u = jnp.max(lax.population_count(lax.bitcast_convert_type(part, jnp.dtype(f"uint{bits}"))))
    return lax.shift_right_logical(u, jnp.asarray(bits.bit_length(), u.dtype)).astype(jnp.uint8)


def _tie_cpu(packed: jax.Array, dep: jax.Array) -> jax.Array:
    """``packed | 0`` with the 0 computed from ``dep``: XLA:CPU expands optimization
    barriers early in its pipeline (right after its first CSE pass, before the CSE and
    scheduling that would merge and hoist the dequantizations), so there the order needs a
    data dependency."""
    return packed | _opaque_zero(dep)


def _tie_barrier(packed: jax.Array, dep: jax.Array) -> jax.Array:
    """``packed`` through an ``optimization_barrier`` with ``dep``: XLA:GPU/TPU keep
    barriers until after scheduling, and a barrier costs no compute or communication
    (``dep`` may be sharded)."""
    return lax.optimization_barrier((packed, dep))[0]


@custom_vmap
def _tie(packed: jax.Array, dep: jax.Array) -> jax.Array:
    """``packed``, ordered after ``dep`` and distinct from any other use of ``packed`` for
    XLA (the branch is picked at lowering, per platform)."""
    return lax.platform_dependent(packed, dep, cpu=_tie_cpu, default=_tie_barrier)


@_tie.def_vmap
def _tie_vmap(axis_size, in_batched, packed, dep):
    """Under ``vmap`` the dependency is on the whole batch of ``dep`` at once: a batched
    activation must not turn the shared packed weight (and so its dequantization) into a
    per-example copy."""
    del axis_size
    return _tie(packed, dep), in_batched[0]


def _after(q, dep: jax.Array):
    """``q`` (an ``NF4Array``) made dependent on ``dep`` without changing its value.

    Ties a dequantization to the activation it multiplies (the layer input ``x`` in the
    forward pass, the cotangent ``g`` in the backward pass), so XLA can neither hoist every
    layer's dequantization to the start of the program nor merge (CSE) the backward
    dequantization with the forward one: either keeps every layer's dense weight alive at
    once in an unrolled (Python-loop) model."""
    return dataclasses.replace(q, packed=_tie(q.packed, lax.stop_gradient(dep)))


def _frozen_nf4_dot(x, q, *, wi: int, w: Weight, params: dict):
    """``dot_general`` of x with the dequantized view of ``q``, recomputed in backward.

    The only residual is the packed ``q``: the frozen base has no weight gradient, and the
    input gradient ``g·Wᵀ`` does not read ``x`` (saving ``x`` per projection cost a stacked
    copy of each projection's input per layer without remat). Each dequantization depends
    on its activation (``_after``), so an unrolled model holds one layer's dense weight at a
    time, forward and backward, as a scanned one.
    """
    meta = w.replace(base=None, a=None, b=None)  # static view only; no tracers captured
    x_type = jax.typeof(x)  # shape, dtype and (explicit) sharding of the cotangent
    x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x_type.sharding)

    def prim(x, q):
        return _weight_dot(
            x, meta.replace(base=q).dense_base(), wi=wi, perm=meta.perm, params=params
        )

    @jax.custom_vjp
    def f(x, q):
        return prim(x, _after(q, x))

    def fwd(x, q):
        return prim(x, _after(q, x)), q

    def bwd(q, g):
        q = _after(q, g)
        return jax.linear_transpose(lambda x: prim(x, q), x_aval)(g)[0], None

    f.defvjp(fwd, bwd)
    return f(x, q)


def dot_general(interp, eqn, invals):
    """``dot_general`` with a ``Weight`` operand: ``x·W + s·(x·a)·b``.

    An NF4 base goes through ``_frozen_nf4_dot`` (dequantized in forward and backward, never
    saved); a plain base through an ordinary ``dot_general``. A LoRA weight that does not
    contract exactly one matrix axis (stacked axes as batch dims) raises, or with
    ``allow_materialize`` is merged for this matmul. Two weight operands: the right one is
    materialized (or raises).
    """
    lhs, rhs = invals
    params = dict(eqn.params)
    if is_weight(lhs) and is_weight(rhs):
        if not interp.allow_materialize:
            raise error(lhs, "dot_general", f"both operands are selected weights ({rhs.name!r})")
        rhs = rhs.materialize()
    wi = 0 if is_weight(lhs) else 1
    w, x = (lhs, rhs) if wi == 0 else (rhs, lhs)
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    wc, wb = (lc, lb) if wi == 0 else (rc, rb)
    if w.a is not None and not lowrank_ok(w, wc, wb):
        if not interp.allow_materialize:
            raise error(
                w,
                "dot_general",
                "the LoRA path needs the weight to contract exactly one "
                "matrix axis with its stacked axes as batch dimensions",
            )
        wm = w.materialize()
        return lax.dot_general_p.bind(*((wm, x) if wi == 0 else (x, wm)), **params)

    if is_nf4(w.base):
        y = _frozen_nf4_dot(x, w.base, wi=wi, w=w, params=params)
    else:
        y = _weight_dot(x, w.dense_base(), wi=wi, perm=w.perm, params=params)
    if w.a is None:
        return y
    u = lora_term(
        x,
        w,
        wi=wi,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
        site=interp.next_dropout_site() if w.dropout_active else 0,
        memo=interp.memo,
    )
    return adapted(y, u, batched=bool(wb))


def adapted(y: jax.Array, u: jax.Array, *, batched: bool) -> jax.Array:
    """``y + u`` (the base matmul and its LoRA term, in ``y``'s dtype) named
    ``LORA_MATMUL`` (``LORA_BATCHED_MATMUL`` with batch dimensions): the one value a remat
    policy saves for the adapted matmul. Unnamed, ``dots_saveable`` saved both terms at
    full width (the sum is element-wise, so it was recomputed from them)."""
    return checkpoint_name(y + u.astype(y.dtype), LORA_BATCHED_MATMUL if batched else LORA_MATMUL)


def lowrank_ok(w: Weight, wc, wb) -> bool:
    """Whether ``w`` contracts exactly one matrix axis and its stacked axes are batch dims."""
    orig_c = [w.perm[d] for d in wc]
    orig_b = [w.perm[d] for d in wb]
    nl = w.n_lead
    return len(orig_c) == 1 and orig_c[0] >= nl and sorted(orig_b) == list(range(nl))


def lora_dropout(x, w: Weight, site: int):
    """Inverted dropout of the adapter input ``x`` (PEFT's ``lora_dropout``): each element
    is zeroed with probability ``w.dropout``, the others scaled by ``1 / (1 - dropout)``.
    The mask comes from ``w.key`` (one key per stacked matrix; a batched matmul over the
    stack uses the first, its mask covering every matrix's input) folded with ``site``."""
    key = w.key if w.key.ndim == 0 else w.key.reshape(-1)[0]
    keep = jax.random.bernoulli(jax.random.fold_in(key, site), 1.0 - w.dropout, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - w.dropout, x.dtype), jnp.zeros((), x.dtype))


@jax.named_scope("lora")  # op names in profiles (benchmarks/qlora_profile.py)
def lora_term(
    x,
    w: Weight,
    *,
    wi: int,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    site: int = 0,
    memo: dict | None = None,
):
    """``s·(x·a)·b`` laid out as ``dot_general(x, W)`` (``wi=1``) or ``(W, x)`` (``wi=0``)
    would lay it out, computed in the weight's view dtype (the compute dtype), with ``x``
    through ``lora_dropout`` when ``w.dropout_active`` (``site`` numbers this matmul). The
    caller checked ``lowrank_ok``. ``memo`` (one per evaluation) shares the flattened input
    between the adapters that read the same ``x`` (q/k/v, gate/up), so autodiff saves it
    once per layer instead of once per adapter."""
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
    trace = jax_compat.current_trace()
    key = (id(x), id(trace), tuple(xb), tuple(xc), first.dtype)
    if w.dropout_active:
        memo = None  # a distinct masked input per adapter
    if memo is not None and key in memo:
        x, unflatten = memo[key][2]
    else:
        x_in = x
        if x.dtype != first.dtype:
            x = x.astype(first.dtype)
        if w.dropout_active:
            x = lora_dropout(x, w, site)
        flat = _flatten_free(x, xb, xc)
        if memo is not None:
            memo[key] = (x_in, trace, flat)  # both kept alive: their ids are not reused
        x, unflatten = flat
    if unflatten is not None:
        xc = (x.ndim - 1,)
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
    if unflatten is not None:
        u = u.reshape(*unflatten, u.shape[-1])
    if wi == 0:  # dot_general(W, x) puts W's free axis before x's free axes.
        u = jnp.moveaxis(u, -1, nb)
    return u * jnp.asarray(w.scale, u.dtype)


def _flatten_free(x, xb, xc):
    """``x [*batch, *free, in]`` -> ``[*batch, prod(free), in]`` and the shape to restore.

    With one free axis the LoRA factors' gradients (``tᵀ·g``, contracting the tokens) are
    plain 2-D matmuls; with several, XLA:CPU copies the ``[*free, out]`` cotangent into a
    transposed layout first, which costs more than the matmuls themselves. Only
    when the batch axes lead and the contracted axis is last (the usual ``x @ W``); else
    ``(x, None)``."""
    nb = len(xb)
    if tuple(xb) != tuple(range(nb)) or tuple(xc) != (x.ndim - 1,) or x.ndim - nb <= 2:
        return x, None
    return x.reshape(*x.shape[:nb], -1, x.shape[-1]), x.shape[:-1]
