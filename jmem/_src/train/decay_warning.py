"""The once-per-process warning when weight decay reaches norm scales or biases.

optax's ``adamw`` and jmem's ``adamw_8bit``/``adamw_4bit`` decay every parameter unless
given ``mask=`` (as bitsandbytes does); Hugging Face's ``Trainer`` decays neither norm
weights nor biases. Which leaves an optimizer decays is read from its traced update: a
leaf's update depends elementwise on the parameter's own value only through a
param-proportional term (decoupled weight decay, or L2 added to the gradient), so the update
jaxpr's data dependencies tell, for any optax chain, wrapper or schedule, without running
it. Dependencies through a reduction (a norm: LAMB's trust ratio, Adafactor's parameter
scale) are not weight decay and are not followed.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
import optax
from jax.extend import core as jcore

from jmem._src import jaxpr as jaxpr_core
from jmem._src.decay_mask import norm_or_bias_paths

#: Set once the warning has been given (once per process).
_warned = False

#: Primitives whose outputs summarize their inputs (norms, maxima): not followed.
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "dot_general"}
)


def _is_zero_literal(x: Any) -> bool:
    return isinstance(x, jcore.Literal) and np.all(np.asarray(x.val) == 0)


def _sub_jaxpr(eqn: Any):
    """``(jaxpr, consts)`` of a call-like, checkpoint or custom-derivative equation (from the
    shared primitive table, ``jmem._src.jaxpr``), or None. ``cond``, ``scan`` and ``while``
    are followed separately; any other primitive: every output depends on every input (a
    conservative over-approximation)."""
    return jaxpr_core.body_of(eqn)


def _union(*sets) -> frozenset:
    return frozenset().union(*sets)


def _cond(eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    """``lax.cond``/``switch``: each output depends on the index and on what it depends on
    in any branch (``optax.MultiSteps``)."""
    per_branch = [_dependencies(b.jaxpr, ins[1:]) for b in eqn.params["branches"]]
    return [_union(ins[0], *outs) for outs in zip(*per_branch)]


def _loop(body: Any, consts: list, carry: list, xs: list, extra=frozenset()) -> list:
    """Outputs of a ``scan``/``while`` body iterated to a fixed point of the carry's deps."""
    while True:
        outs = _dependencies(body, [*consts, *carry, *xs])
        new = [_union(c, o, extra) for c, o in zip(carry, outs)]
        if new == carry:
            return [*new, *(_union(o, extra) for o in outs[len(carry) :])]
        carry = new


def _scan_or_while(eqn: Any, ins: list[frozenset]) -> list[frozenset] | None:
    """``scan``/``while`` followed through their bodies; None for other primitives."""
    p = eqn.params
    if jaxpr_core.kind(eqn) == jaxpr_core.SCAN:
        nc, ncarry = p["num_consts"], p["num_carry"]
        return _loop(p["jaxpr"].jaxpr, ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :])
    if jaxpr_core.kind(eqn) == jaxpr_core.WHILE:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        control = _union(*ins[:nc])  # the loop's condition reads its consts and the carry
        carry = ins[nc + nb :]
        outs = _loop(p["body_jaxpr"].jaxpr, ins[nc : nc + nb], carry, [], control)
        return [_union(o, *outs) for o in outs]
    return None


def _dependencies(jaxpr: Any, in_deps: list[frozenset]) -> list[frozenset]:
    """For each output of ``jaxpr``, the set of input labels it depends on."""
    env: dict = dict(zip(jaxpr.invars, in_deps))
    read = lambda v: frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        zero_mul = eqn.primitive.name == "mul" and any(_is_zero_literal(v) for v in eqn.invars)
        if zero_mul or eqn.primitive.name in _REDUCTIONS:  # 0 * p (weight_decay=0.0); norms
            outs = [frozenset()] * len(eqn.outvars)
        elif sub is not None and len(sub[0].invars) == len(ins):
            outs = _dependencies(sub[0], ins)
        elif jaxpr_core.kind(eqn) == jaxpr_core.COND:
            outs = _cond(eqn, ins)
        else:
            outs = _scan_or_while(eqn, ins) or [_union(*ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def decayed_leaves(optimizer: optax.GradientTransformation, params: Any) -> list[bool]:
    """For each leaf of ``params``, whether ``optimizer``'s update of it depends on its value.

    Traced on abstract shapes (``jax.make_jaxpr``): nothing is allocated or run.
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = jax.eval_shape(optimizer.init, abstract)
    update = lambda g, s, p: optimizer.update(g, s, p)[0]
    closed = jax.make_jaxpr(update)(abstract, state, abstract)
    n_p = len(jax.tree.leaves(abstract))
    n_in = len(closed.jaxpr.invars)
    labels = [frozenset()] * (n_in - n_p) + [frozenset({i}) for i in range(n_p)]
    outs = _dependencies(closed.jaxpr, labels)
    return [i in deps for i, deps in enumerate(outs[:n_p])]


def warn_if_norms_decayed(optimizer: optax.GradientTransformation, params: Any) -> None:
    """Warns (once per process) when ``optimizer`` decays norm scales or biases of ``params``.

    Args:
      optimizer: the user's optax transformation (before jmem's wrappers).
      params: the trainable params (arrays or ``ShapeDtypeStruct``s).
    """
    global _warned
    if _warned:
        return
    paths = norm_or_bias_paths(params)
    if not any(paths):
        return
    try:
        decayed = decayed_leaves(optimizer, params)
    except Exception:  # an optimizer that cannot be traced abstractly: no opinion
        return
    hit = [p for p, d in zip(paths, decayed) if p and d]
    if hit:
        _warned = True
        warnings.warn(
            f"The optimizer applies weight decay (a param-proportional update) to norm scales "
            f"or biases: {hit[:5]}{' ...' if len(hit) > 5 else ''}. optax.adamw and "
            "jmem.adamw_8bit decay every parameter unless given a mask (Hugging Face's "
            "Trainer decays neither norms nor biases); pass mask=jmem.decay_mask (optax) or "
            "mask=jmem.decay_mask(params). Warned once per process.",
            UserWarning,
            stacklevel=3,
        )
