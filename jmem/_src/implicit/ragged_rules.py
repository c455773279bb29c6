"""The grouped-matmul rule of the NF4/LoRA interpreter: ``ragged_dot_general`` (what
``jax.lax.ragged_dot`` binds) against an implicit ``Weight`` of stacked experts
``[E, in, out]``.

Each expert ``e`` multiplies its own rows ``x_e``: ``x_e·W_e`` becomes
``x_e·W_e + s·(x_e·a_e)·b_e``, one LoRA pair per expert (``a [E, in, r]``, ``b [E, r, out]``),
computed as two more grouped matmuls with the same group sizes. An NF4 base is dequantized,
all ``E`` experts of the layer at once, just before the grouped matmul and again in its
backward pass, never saved (Dettmers et al. 2023, arXiv:2305.14314; Hu et al. 2021,
arXiv:2106.09685). See ``docs/lora.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src import grouped_matmul as _gmm
from jmem._src import jaxpr as _jaxpr
from jmem._src.implicit import matmul_rules as _matmul
from jmem._src.implicit import registry as _registry
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import is_nf4
from jmem._src.implicit.weight import is_weight

__all__ = ["grouped_matmul_call", "ragged_dot_general", "supported"]


def _dims(params: dict):
    """``(lc, rc, lb, rb, ragged, group)`` of a ``ragged_dot_general``'s parameters."""
    rdn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    return (
        tuple(lc),
        tuple(rc),
        tuple(lb),
        tuple(rb),
        tuple(rdn.lhs_ragged_dimensions),
        tuple(rdn.rhs_group_dimensions),
    )


def supported(w: Weight, params: dict) -> str:
    """Why the grouped matmul of ``x`` (left) with ``w`` (right) cannot stay implicit, or
    ``""``: the weight must be one stack of experts ``[E, in, out]`` (no other stacked axis:
    inside the layer scan) grouped over its expert axis, contracting one matrix axis with a
    ragged axis of ``x`` that is not contracted (``jax.lax.ragged_dot``'s form), without batch
    dimensions or a ``group_offset``."""
    lc, rc, lb, rb, ragged, group = _dims(params)
    if w.n_lead != 1:
        return f"the expert stack has {w.n_lead} stacked axes; one ([E, in, out]) is supported"
    if lb or rb or params.get("group_offset") is not None:
        return "batch dimensions or a group_offset are not supported"
    if len(group) != 1 or w.perm[group[0]] != 0 or len(rc) != 1 or w.perm[rc[0]] == 0:
        return "the weight must be grouped over its expert axis and contract one matrix axis"
    if len(ragged) != 1 or ragged[0] in lc:
        return "the ragged axis of the input must not be contracted"
    return ""


def _bind(x, rhs, group_sizes, params: dict, rc: int):
    """``ragged_dot_general(x, rhs, group_sizes)`` with ``params``' lhs dimensions, ``rhs``
    ``[E, ., .]`` grouped over axis 0 and contracting its axis ``rc``."""
    lc, _, _, _, ragged, _ = _dims(params)
    rdn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=((lc, (rc,)), ((), ())),
        lhs_ragged_dimensions=ragged,
        rhs_group_dimensions=(0,),
    )
    return _ragged(x, rhs, group_sizes, rdn, params)


def _standard(x, rhs, rdn) -> bool:
    """``x [M, K]`` ragged over its rows times ``rhs [E, ., .]`` grouped over axis 0,
    without batch dimensions: the form ``jmem._src.grouped_matmul`` computes."""
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    return (
        x.ndim == 2
        and tuple(lc) == (1,)
        and tuple(rc) in ((1,), (2,))
        and not lb
        and not rb
        and tuple(rdn.lhs_ragged_dimensions) == (0,)
        and tuple(rdn.rhs_group_dimensions) == (0,)
    )


def _ragged(x, rhs, group_sizes, rdn, params: dict):
    """``lax.ragged_dot_general`` with ``rdn`` and the precision, output type and output
    sharding of ``params`` (no ``group_offset``: ``supported`` refused one), computed by
    ``jmem._src.grouped_matmul`` (k experts' FLOPs, not E: XLA rewrites ``ragged_dot``
    densely) in its form, by ``lax.ragged_dot_general`` otherwise."""
    if _standard(x, rhs, rdn) and params.get("out_sharding") is None:
        (_, rc), _ = rdn.dot_dimension_numbers
        y = _gmm.grouped_matmul(
            x,
            rhs,
            group_sizes,
            transpose_rhs=tuple(rc) == (2,),
            precision=params.get("precision"),
            preferred_element_type=params.get("preferred_element_type"),
        )
        return y
    return lax.ragged_dot_general(
        x,
        rhs,
        group_sizes,
        rdn,
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
        out_sharding=params.get("out_sharding"),
    )


def _frozen_nf4_ragged(x, q, group_sizes, *, w: Weight, params: dict, rc: int):
    """The grouped matmul of ``x`` with the dequantized experts of ``q``, recomputed in
    backward: the only residuals are the packed ``q`` and the group sizes (the frozen base
    has no gradient; the input gradient does not read ``x``), as ``_frozen_nf4_dot``. Each
    dequantization depends on its activation, so an unrolled model holds one layer's
    dequantized experts at a time."""
    meta = w.replace(base=None, a=None, b=None)
    x_type = jax.typeof(x)
    x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x_type.sharding)
    lc, _, _, _, ragged, _ = _dims(params)
    standard = x.ndim == 2 and lc == (1,) and ragged == (0,)

    def prim(x, q, gs):
        return _bind(x, meta.replace(base=q).dense_base(), gs, params, rc)

    @jax.custom_vjp
    def f(x, q, gs):
        return prim(x, _matmul._after(q, x), gs)

    def fwd(x, q, gs):
        return prim(x, _matmul._after(q, x), gs), (q, gs)

    def bwd(res, g):
        q, gs = res
        q = _matmul._after(q, g)
        if standard:  # the input gradient: each tile times its dequantized kernel transposed
            dense = meta.replace(base=q).dense_base()
            dx = _gmm.grouped_matmul(
                g, dense, gs, transpose_rhs=rc == 1, precision=params.get("precision")
            )
            return dx.astype(x_aval.dtype), None, None
        return jax.linear_transpose(lambda x: prim(x, q, gs), x_aval)(g)[0], None, None

    f.defvjp(fwd, bwd)
    return f(x, q, group_sizes)


@jax.named_scope("lora")
def _lora_ragged(x, w: Weight, group_sizes, params: dict, rc: int, site: int):
    """``s·ragged(ragged(x, a), b)`` (``rc`` = 1: ``x`` contracts the experts' input axis)
    or ``s·ragged(ragged(x, bᵀ), aᵀ)`` (``rc`` = 2), in the weight's view dtype, ``x``
    through ``lora_dropout`` when active; laid out as the base grouped matmul's output."""
    lc, _, _, _, ragged, _ = _dims(params)
    a, b = w.a.astype(w.dtype), w.b.astype(w.dtype)
    first, first_c, second, second_c = (a, 1, b, 1) if rc == 1 else (b, 2, a, 2)
    if x.dtype != first.dtype:
        x = x.astype(first.dtype)
    if w.dropout_active:
        x = _matmul.lora_dropout(x, w, site)
    inner = {"precision": params.get("precision"), "group_offset": None, "out_sharding": None}
    inner["preferred_element_type"] = params.get("preferred_element_type")
    t = _bind(x, first, group_sizes, {**params, **inner}, first_c).astype(second.dtype)
    free = [d for d in range(x.ndim) if d not in lc]  # t: x's free axes, then r
    rdn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((t.ndim - 1,), (second_c,)), ((), ())),
        lhs_ragged_dimensions=(free.index(ragged[0]),),
        rhs_group_dimensions=(0,),
    )
    u = _ragged(t, second, group_sizes, rdn, {**params, **inner})
    return u * jnp.asarray(w.scale, u.dtype)


def ragged_dot_general(interp, eqn, invals):
    """``ragged_dot_general(x, W, group_sizes)`` with ``W`` a ``Weight`` of experts
    ``[E, in, out]``: per expert ``x_e·W_e + s·(x_e·a_e)·b_e``.

    An NF4 base is dequantized for all ``E`` experts of the call (one layer's
    ``E·in·out`` elements in the compute dtype, transient) in forward and again in
    backward, never saved; a float base is multiplied as it is. The adapted output is named
    ``LORA_MATMUL``, as a dense adapted projection. A weight as the left operand or as the
    group sizes, or a form ``supported`` refuses, raises ``ImplicitWeightError`` (with
    ``allow_materialize``: merged for this call).
    """
    x, w, group_sizes = invals
    params = dict(eqn.params)
    if is_weight(x) or is_weight(group_sizes) or not is_weight(w):
        v = next(v for v in invals if is_weight(v))
        return interp.fallback(eqn, invals, v, "only the experts operand can be a selected weight")
    why = supported(w, params)
    if why:
        return interp.fallback(eqn, invals, w, why)
    return _adapted(interp, x, w, group_sizes, params)


def _adapted(interp, x, w: Weight, group_sizes, params: dict):
    """``x_e·W_e + s·(x_e·a_e)·b_e`` per expert, for a form ``supported`` accepts."""
    _, (rc_view,), _, _, _, _ = _dims(params)
    rc = w.perm[rc_view]
    if is_nf4(w.base):
        y = _frozen_nf4_ragged(x, w.base, group_sizes, w=w, params=params, rc=rc)
    else:
        y = _bind(x, w.dense_base(), group_sizes, params, rc)
    if w.a is None:
        return y
    site = interp.next_dropout_site() if w.dropout_active else 0
    u = _lora_ragged(x, w, group_sizes, params, rc, site)
    return _matmul.adapted(y, u, batched=False)


def grouped_matmul_call(interp, eqn, invals):
    """The rule for a ``custom_vjp_call`` receiving a weight: for a traced
    ``jmem._src.grouped_matmul.grouped_matmul`` (what ``routed_experts`` calls) whose
    kernels are the weight, the rule of the ``ragged_dot_general`` it computes;
    ``NotImplemented`` (the next rule) for anything else."""
    cfg = _gmm.config_of(eqn.params)
    nc = eqn.params.get("num_consts", 0)
    if cfg is None or len(invals) != nc + 3 or any(is_weight(v) for v in invals[:nc]):
        return NotImplemented
    x, w, group_sizes = invals[nc:]
    if is_weight(x) or is_weight(group_sizes) or not is_weight(w):
        return NotImplemented
    rdn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if cfg.transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    params = {
        "ragged_dot_dimension_numbers": rdn,
        "precision": cfg.precision,
        "preferred_element_type": cfg.preferred_element_type,
        "group_offset": None,
        "out_sharding": None,
    }
    if supported(w, params):
        return NotImplemented
    return [_adapted(interp, x, w, group_sizes, params)]


for _name in sorted(_jaxpr.names_of(_jaxpr.CUSTOM_VJP)):
    _registry.register(_name, grouped_matmul_call)
