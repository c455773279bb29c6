"""FP8 rules of the NF4/LoRA interpreter: ``jmem.fp8.fp8_dot_general`` with an implicit kernel.

The frozen base runs through the FP8 matmul with delayed scaling, the LoRA term in the
compute dtype (Transformer Engine + PEFT semantics). See ``docs/lora.md`` and ``docs/fp8.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmem._src import fp8 as _fp8
from jmem._src import jaxpr as _jaxpr
from jmem._src.implicit import registry as _registry
from jmem._src.implicit.matmul_rules import lora_term
from jmem._src.implicit.matmul_rules import lowrank_ok
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import is_nf4
from jmem._src.implicit.weight import is_weight

__all__ = ["fp8_dot", "fp8_custom_vjp"]


def _fp8_base_dot(x, src, meta, *, w: Weight, cfg):
    """``fp8_dot_general(x, view(src), meta)`` whose backward pass re-quantizes the kernel
    from ``src`` (the NF4 fields or the frozen array of *this* layer) instead of keeping
    its FP8 copy: the residuals are ``x``'s FP8 bits, ``src`` (a slice of a scan input,
    which ``lax.scan`` forwards instead of stacking) and the small states. The forward
    and the re-quantization run the same ops, so the backward sees the forward's bits.
    ``meta``'s cotangent is the updated ``Fp8Meta`` (``jmem.fp8``'s overwrite rule); an
    NF4 ``src`` gets no cotangent, a plain array gets ``∂L/∂W`` through its view."""
    view = w.replace(base=None, a=None, b=None, key=None)  # static view only; no tracers
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
        qk = _fp8.fp8_bits(k, k_meta.scale_inv, _fp8.E4M3)
        gx, gk, new_meta = _fp8.fp8_dot_backward(cfg, (qx, qk, x_meta, k_meta, g_meta), g)
        return gx, (None if k_vjp is None else k_vjp(gk)[0]), new_meta

    f.defvjp(fwd, bwd)
    return f(x, src, meta)


def fp8_dot(interp, eqn, invals, cfg):
    """``fp8_dot_general(x, W, meta)`` with an implicit kernel ``W``: the frozen base of
    this call (dequantized if NF4) goes through the FP8 matmul with ``meta``'s delayed
    scaling; the LoRA term ``s·(x·a)·b`` is added in the compute dtype. Returns None when
    the call cannot be rewritten (the caller then inlines it, which raises)."""
    nc = eqn.params.get("num_consts", 0)
    consts, ops = invals[:nc], invals[nc:]
    if len(ops) != 8 or any(is_weight(v) for v in consts):
        return None
    x, w, *meta_leaves = ops
    if not is_weight(w) or is_weight(x) or any(is_weight(m) for m in meta_leaves):
        return None
    (lc, rc), (lb, rb) = cfg.dimension_numbers
    if w.a is not None and not lowrank_ok(w, rc, rb):
        return None
    if tuple(w.shape) != tuple(eqn.invars[nc + 1].aval.shape):
        return None
    meta = cfg.unflatten_meta(meta_leaves)
    y = _fp8_base_dot(x, w.base, meta, w=w, cfg=cfg)
    if w.a is None:
        return [y]
    site = interp.next_dropout_site() if w.dropout_active else 0
    u = lora_term(x, w, wi=1, dimension_numbers=cfg.dimension_numbers, site=site)
    return [y + u.astype(y.dtype)]


def fp8_custom_vjp(interp, eqn, invals):
    """The rule for a ``custom_vjp_call`` receiving a weight: ``fp8_dot`` for a traced
    ``fp8_dot_general``, ``NotImplemented`` (the next rule: inlining) for anything else."""
    cfg = _fp8.dot_config_of(eqn.params)
    if cfg is None:
        return NotImplemented
    outs = fp8_dot(interp, eqn, invals, cfg)
    return NotImplemented if outs is None else outs


for _name in sorted(_jaxpr.names_of(_jaxpr.CUSTOM_VJP)):
    _registry.register(_name, fp8_custom_vjp)
