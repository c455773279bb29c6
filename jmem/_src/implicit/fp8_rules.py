"""FP8 rules of the implicit-weight interpreter: a ``Weight`` that carries an ``Fp8Meta``.

One matmul core, ``fp8_weight_dot``, runs the delayed-scaling FP8 matmul
(``jmem.fp8.fp8_dot_general``) of a plain, NF4 or LoRA-adapted weight; the LoRA term stays
in the compute dtype (Transformer Engine + PEFT semantics). It is reached two ways:

- ``dot_general`` of a weight with a meta (``jmem.fp8.apply``: the model writes ``x @ W``);
- a traced ``fp8_dot_general`` whose kernel is an implicit weight (a model that calls
  ``jmem.fp8.fp8_dot`` itself, under ``jmem.lora.apply`` / ``jmem.qlora.apply``).

See ``docs/fp8.md`` and ``docs/lora.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmem._src import fp8_dot as _fp8
from jmem._src import fp8_meta as _fp8_meta
from jmem._src import jaxpr as _jaxpr
from jmem._src.implicit import registry as _registry
from jmem._src.implicit.matmul_rules import adapted
from jmem._src.implicit.matmul_rules import lora_term
from jmem._src.implicit.matmul_rules import lowrank_ok
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import error
from jmem._src.implicit.weight import is_nf4
from jmem._src.implicit.weight import is_weight

__all__ = ["dot_general", "fp8_custom_vjp", "fp8_weight_dot"]


def _fp8_base_dot(x, src, meta, *, w: Weight, cfg):
    """``fp8_dot_general(x, view(src), meta)`` whose backward pass re-quantizes the kernel
    from ``src`` (the NF4 fields or the frozen array of *this* layer) instead of keeping
    its FP8 copy: the residuals are ``x``'s FP8 bits, ``src`` (a slice of a scan input,
    which ``lax.scan`` forwards instead of stacking) and the small states. The forward
    and the re-quantization run the same ops, so the backward sees the forward's bits.
    ``meta``'s cotangent is the updated ``Fp8Meta`` (``jmem.fp8``'s overwrite rule); an
    NF4 ``src`` gets no cotangent, a plain array gets ``∂L/∂W`` through its view."""
    view = w.replace(base=None, a=None, b=None, key=None, meta=None)  # static view only
    nf4_src = is_nf4(src)

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
        qk = _fp8.fp8_bits(k, k_meta.scale_inv, _fp8_meta.E4M3)
        gx, gk, new_meta = _fp8.fp8_dot_backward(cfg, (qx, qk, x_meta, k_meta, g_meta), g)
        return gx, (None if k_vjp is None else k_vjp(gk)[0]), new_meta

    f.defvjp(fwd, bwd)
    return f(x, src, meta)


def _view_kernel(w: Weight) -> jax.Array:
    """The weight's view as a dense array (cast, then transposed by ``perm``)."""
    k = w.dense_base()
    return k if tuple(w.perm) == tuple(range(len(w.perm))) else jnp.transpose(k, w.perm)


def fp8_weight_dot(interp, x, w: Weight, meta, dimension_numbers, out_dtype):
    """``dot_general(x, W)`` in FP8 with ``meta``'s delayed scaling, ``W`` the right operand.

    A plain weight without adapters is exactly ``jmem.fp8.fp8_dot_general(x, view(W),
    meta)`` (the program a model calling ``fp8_dot`` itself traces); an NF4 or
    LoRA-adapted base goes through ``_fp8_base_dot`` (its FP8 kernel re-quantized in the
    backward pass, never saved) and the LoRA term ``s·(x·a)·b`` is added in the compute
    dtype. Returns None when ``W``'s adapter cannot stay low-rank (the caller then raises or
    materializes).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if w.a is not None and not lowrank_ok(w, rc, rb):
        return None
    if w.a is None and not is_nf4(w.base):
        return _fp8.fp8_dot_general(x, _view_kernel(w), meta, dimension_numbers, out_dtype)
    cfg = _fp8.Fp8DotConfig(
        _fp8.canonical_dimension_numbers(dimension_numbers),
        jnp.dtype(out_dtype),
        jnp.dtype(x.dtype),
        jnp.dtype(w.dtype),
        meta.amax_compute_algo,
        meta.margin,
    )
    y = _fp8_base_dot(x, w.base, meta, w=w, cfg=cfg)
    if w.a is None:
        return y
    site = interp.next_dropout_site() if w.dropout_active else 0
    u = lora_term(x, w, wi=1, dimension_numbers=dimension_numbers, site=site)
    return adapted(y, u, batched=bool(dimension_numbers[1][1]))


def _swap(dimension_numbers):
    """Dimension numbers of ``dot_general(rhs, lhs)`` for those of ``dot_general(lhs, rhs)``."""
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(rc), tuple(lc)), (tuple(rb), tuple(lb)))


def dot_general(interp, eqn, invals):
    """``dot_general`` with one operand a ``Weight`` that carries an FP8 meta (else
    ``NotImplemented``: the plain matmul rule). A weight on the left is computed as
    ``dot_general(x, W)`` and its output permuted back (``x``'s state quantizes ``x``)."""
    lhs, rhs = invals
    wi = 0 if is_weight(lhs) else 1
    w, x = (lhs, rhs) if wi == 0 else (rhs, lhs)
    if is_weight(x) or w.meta is None:
        return NotImplemented
    if jax.tree.leaves(w.meta)[0].ndim != 0:
        return interp.fallback(
            eqn,
            invals,
            w,
            "its FP8 state is a stack (one per stacked matrix): scan over the stacked axis "
            "so that each matmul sees one matrix and its state",
        )
    dn = eqn.params["dimension_numbers"] if wi == 1 else _swap(eqn.params["dimension_numbers"])
    out_dtype = eqn.outvars[0].aval.dtype
    y = fp8_weight_dot(interp, x, w, w.meta, dn, out_dtype)
    if y is None:
        return interp.fallback(eqn, invals, w, "the LoRA path needs one contracted matrix axis")
    if wi == 0:  # dot_general(W, x) is [batch, W free, x free]; (x, W) gave [batch, x, W]
        (_, rc), (_, rb) = dn
        nb, nw = len(rb), len(w.shape) - len(rc) - len(rb)
        nx = y.ndim - nb - nw
        y = jnp.transpose(y, (*range(nb), *range(nb + nx, y.ndim), *range(nb, nb + nx)))
    return y


def fp8_custom_vjp(interp, eqn, invals):
    """The rule for a ``custom_vjp_call`` receiving a weight: ``fp8_weight_dot`` for a
    traced ``fp8_dot_general`` whose kernel is the weight, ``NotImplemented`` (the next
    rule: inlining) for anything else."""
    cfg = _fp8.dot_config_of(eqn.params)
    if cfg is None:
        return NotImplemented
    nc = eqn.params.get("num_consts", 0)
    consts, ops = invals[:nc], invals[nc:]
    if len(ops) != 8 or any(is_weight(v) for v in consts):
        return NotImplemented
    x, w, *meta_leaves = ops
    if not is_weight(w) or is_weight(x) or any(is_weight(m) for m in meta_leaves):
        return NotImplemented
    if tuple(w.shape) != tuple(eqn.invars[nc + 1].aval.shape):
        return NotImplemented
    if w.meta is not None:
        raise error(w, "fp8_dot_general", "the weight has an FP8 state already (jmem.fp8.apply)")
    meta = cfg.unflatten_meta(meta_leaves)
    y = fp8_weight_dot(interp, x, w, meta, cfg.dimension_numbers, cfg.out_dtype)
    return NotImplemented if y is None else [y]


_registry.register("dot_general", dot_general)
for _name in sorted(_jaxpr.names_of(_jaxpr.CUSTOM_VJP)):
    _registry.register(_name, fp8_custom_vjp)
