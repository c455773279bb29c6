"""The jaxpr core shared by remat, the implicit-weight interpreter and leaf-by-leaf offload:
the one table of primitive kinds, re-evaluation of a jaxpr with a hook per equation (under
each equation's name stack, as ``jax.core.eval_jaxpr``), and generic rules that re-bind a
higher-order primitive (call, checkpoint, cond, while) around an interpreted body.

A JAX rename of a primitive is fixed here, in one line of ``_KINDS``. Source: JAX's
``jax.core.eval_jaxpr`` and ``jax.checkpoint``'s own re-binding (JAX, ``ad_checkpoint``).
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable

import jax
from jax import lax
from jax.extend import core as jcore

from jmem._src import jax_compat as _compat

CALL = "call"  # one body called once on exactly the equation's inputs
CHECKPOINT = "checkpoint"  # jax.checkpoint / jax.remat
SCAN = "scan"
COND = "cond"
WHILE = "while"
CUSTOM_JVP = "custom_jvp"
CUSTOM_VJP = "custom_vjp"
OTHER = "other"

#: Primitive name -> kind, under every name JAX has used (``jax.checkpoint`` bound
#: ``checkpoint``, then ``remat``, and ``remat2`` since JAX 0.4; ``jax.jit`` bound ``pjit``
#: before JAX 0.7 and ``jit`` after).
_KINDS: dict[str, str] = {
    "pjit": CALL,
    "jit": CALL,
    "closed_call": CALL,
    "core_call": CALL,
    "checkpoint": CHECKPOINT,
    "remat": CHECKPOINT,
    "remat2": CHECKPOINT,
    "scan": SCAN,
    "cond": COND,
    "while": WHILE,
    "custom_jvp_call": CUSTOM_JVP,
    "custom_jvp_call_jaxpr": CUSTOM_JVP,
    "custom_vjp_call": CUSTOM_VJP,
    "custom_vjp_call_jaxpr": CUSTOM_VJP,
}
for _p, _k in ((_compat.REMAT_P, CHECKPOINT), (_compat.JIT_P, CALL), (_compat.SCAN_P, SCAN)):
    if _p is not None:  # the names this JAX binds, whatever they are
        _KINDS.setdefault(_p.name, _k)

#: The parameter holding the body of a call-like / checkpoint / custom equation.
_BODY_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def kind(eqn_or_name) -> str:
    """The kind of an equation's primitive (``CALL``, ``CHECKPOINT``, ``SCAN``, ``COND``,
    ``WHILE``, ``CUSTOM_JVP``, ``CUSTOM_VJP``) or ``OTHER``."""
    name = eqn_or_name if isinstance(eqn_or_name, str) else eqn_or_name.primitive.name
    return _KINDS.get(name, OTHER)


def names_of(*kinds: str) -> frozenset:
    """The primitive names of the given kinds."""
    return frozenset(n for n, k in _KINDS.items() if k in kinds)


def is_checkpoint(eqn) -> bool:
    """True for a ``jax.checkpoint`` equation (under any of its names)."""
    return kind(eqn) == CHECKPOINT


def is_custom(eqn) -> bool:
    """True for a ``custom_jvp``/``custom_vjp`` call (its rules decide what is saved)."""
    return kind(eqn) in (CUSTOM_JVP, CUSTOM_VJP)


def body_of(eqn) -> tuple[Any, list] | None:
    """``(jaxpr, consts)`` of a call, checkpoint or custom equation's body, else None."""
    if kind(eqn) not in (CALL, CHECKPOINT, CUSTOM_JVP, CUSTOM_VJP):
        return None
    for key in _BODY_KEYS:
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr, list(sub.consts)
        if isinstance(sub, jcore.Jaxpr):
            return sub, []
    return None


# ------------------------------------------------------------------ queries


def scan_body_checkpointed(eqn_or_params) -> bool:
    """True when a scan's body is already checkpointed: it binds a checkpoint and does no
    matmul outside checkpoints (``lax.scan(jax.checkpoint(step), ...)``, ``nnx.remat``
    inside ``nnx.scan``). Takes the equation or its params."""
    params = getattr(eqn_or_params, "params", eqn_or_params)
    eqns = params["jaxpr"].jaxpr.eqns
    return any(is_checkpoint(e) for e in eqns) and not any(
        _has_dot(e) for e in eqns if not is_checkpoint(e)
    )


def _has_dot(eqn) -> bool:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        return True
    return any(_has_dot(e) for sub in jcore.jaxprs_in_params(eqn.params) for e in sub.eqns)


def find_scan(jaxpr, pred: Callable = lambda eqn: True) -> bool:
    """True when ``jaxpr`` holds a scan with ``pred(eqn)``, outside custom-derivative bodies
    and outside the body of a scan that fails ``pred``... (an outer scan is looked at first)."""
    for eqn in jaxpr.eqns:
        if kind(eqn) == SCAN:
            if pred(eqn):
                return True
            continue
        if is_custom(eqn):
            continue  # their custom rules decide what is saved; left as they are
        if any(find_scan(sub, pred) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def has_scan(jaxpr) -> bool:
    """True when ``jaxpr`` holds a scan, outside ``custom_vjp``/``custom_jvp`` bodies."""
    return find_scan(jaxpr)


def has_plain_scan(jaxpr) -> bool:
    """True when ``jaxpr`` holds an outermost scan whose body is not checkpointed."""
    return find_scan(jaxpr, lambda eqn: not scan_body_checkpointed(eqn))


def checkpoint_names(jaxpr, found: set | None = None) -> set:
    """The ``jax.ad_checkpoint.checkpoint_name`` names bound anywhere in ``jaxpr``."""
    found = set() if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name" and "name" in eqn.params:
            found.add(eqn.params["name"])
        for sub in jcore.jaxprs_in_params(eqn.params):
            checkpoint_names(sub, found)
    return found


def differentiates(jaxpr) -> bool:
    """True when ``jaxpr`` holds a backward pass (equations under a ``transpose`` name)."""
    for eqn in jaxpr.eqns:
        if "transpose" in str(eqn.source_info.name_stack):
            return True
        if any(differentiates(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


# ------------------------------------------------------------------ evaluation


def eqn_context(eqn, prefix=None):
    """The one name-context helper: binds under ``eqn``'s traceback and name stack
    (``current + prefix + eqn's``), as ``jax.core.eval_jaxpr`` does; ``prefix`` is the name
    stack of an enclosing call that was inlined."""
    return _compat.name_context(getattr(eqn, "source_info", None), prefix)


def name_stack_of(eqn, prefix=None):
    """``prefix + eqn``'s name stack (the prefix for the equations of an inlined call body)."""
    stack = eqn.source_info.name_stack
    return stack if prefix is None else prefix + stack


def bind_eqn(eqn, invals):
    """Binds ``eqn``'s primitive on new inputs, as ``jax.core.eval_jaxpr`` does (the caller
    sets the source information, see ``eqn_context``)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn.ctx.manager:
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)


def eval_jaxpr(jaxpr, consts, args, eval_eqn: Callable[[Any, list], Any]) -> list:
    """Evaluates ``jaxpr`` on ``consts``/``args``; ``eval_eqn(eqn, invals)`` computes each
    equation's output (a list when the primitive has multiple results), under the
    equation's name stack and traceback (``eqn_context``)."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        with eqn_context(eqn):
            outs = eval_eqn(eqn, [read(v) for v in eqn.invars])
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


# ------------------------------------------- re-binding higher-order primitives
# ``evaluate(jaxpr, consts, args) -> outs`` is an interpreter's own evaluation of a body.


def _eval_sub(evaluate, sub, *args):
    if isinstance(sub, jcore.ClosedJaxpr):
        return evaluate(sub.jaxpr, sub.consts, list(args))
    return evaluate(sub, (), list(args))


def inline_call(eqn, invals, evaluate):
    """A call-like or custom-derivative equation, its body evaluated in place (a custom
    call's own derivative rule is dropped: JAX differentiates the body)."""
    body = body_of(eqn)
    if body is None:
        raise ValueError(f"{eqn.primitive.name!r} has no single body to inline.")
    return evaluate(body[0], body[1], list(invals))


def rebind_call(eqn, invals, evaluate):
    """A call equation: a ``jax.jit`` kept as a jit around its evaluated body
    (``rebind_jit``), any other call inlined."""
    if kind(eqn) != CALL or not isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr):
        return inline_call(eqn, invals, evaluate)
    return rebind_jit(eqn.params, invals, evaluate)


def rebind_jit(params, invals, evaluate):
    """A ``jax.jit`` call (``params`` of its equation) kept as a jit, with the same name,
    ``inline`` and ``keep_unused``, around its evaluated body; one with shardings, layouts
    or donation set is inlined instead (its body evaluated in place)."""
    closed = params["jaxpr"]
    if _has_placement(params):
        return evaluate(closed.jaxpr, closed.consts, list(invals))

    def fn(*args):
        return _eval_sub(evaluate, closed, *args)

    fn.__name__ = fn.__qualname__ = str(params.get("name", "jit"))
    jitted = jax.jit(
        fn, inline=params.get("inline", False), keep_unused=params.get("keep_unused", False)
    )
    return jitted(*invals)


def _has_placement(params) -> bool:
    shardings = (*params.get("in_shardings", ()), *params.get("out_shardings", ()))
    layouts = (*params.get("in_layouts", ()), *params.get("out_layouts", ()))
    return (
        any(isinstance(s, jax.sharding.Sharding) for s in shardings)
        or any(x is not None for x in layouts)
        or any(params.get("donated_invars", ()))
    )


def rebind_checkpoint(eqn, invals, evaluate):
    """A checkpoint equation re-bound by ``jax.checkpoint`` around its evaluated body, with
    the same ``policy`` and ``prevent_cse``."""
    fn = functools.partial(_eval_sub, evaluate, eqn.params["jaxpr"])
    return jax.checkpoint(
        fn, policy=eqn.params.get("policy"), prevent_cse=eqn.params.get("prevent_cse", True)
    )(*invals)


def rebind_cond(eqn, invals, evaluate, check_out: Callable = lambda outs: outs):
    """A ``cond`` as ``lax.switch`` over its evaluated branches; ``check_out`` may inspect
    (and raise for) each branch's outputs."""
    index, *ops = invals

    def branch(closed, *args):
        return check_out(_eval_sub(evaluate, closed, *args))

    branches = [functools.partial(branch, b) for b in eqn.params["branches"]]
    return lax.switch(index, branches, *ops)


def rebind_while(eqn, invals, evaluate):
    """A ``while`` as ``lax.while_loop`` over its evaluated condition and body."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]

    def cond_fn(carry):
        return _eval_sub(evaluate, p["cond_jaxpr"], *cconsts, *carry)[0]

    def body_fn(carry):
        return list(_eval_sub(evaluate, p["body_jaxpr"], *bconsts, *carry))

    return lax.while_loop(cond_fn, body_fn, list(init))


def scan_operands(params, invals) -> tuple[list, list, list]:
    """``(consts, init, xs)`` of a scan equation's inputs."""
    nc, ncarry = params["num_consts"], params["num_carry"]
    return list(invals[:nc]), list(invals[nc : nc + ncarry]), list(invals[nc + ncarry :])


def rebind_scan(params, init, xs, step: Callable) -> list:
    """Re-binds a scan (``params`` of the equation) with ``step(carry, x) -> (carry, y)``
    as its body: ``[*final_carry, *ys]``."""
    kw = {}
    if "_split_transpose" in params:
        kw["_split_transpose"] = params["_split_transpose"]
    carry, ys = lax.scan(
        step,
        list(init),
        list(xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
        **kw,
    )
    return [*carry, *ys]


# ------------------------------------------- custom VJPs rebuilt around an interpreted body

#: The attribute of a ``custom_vjp``'s backward function that holds its rebuild rule
#: (``rebuildable``).
_REBUILD_ATTR = "_jmem_rebuild"


def rebuildable(bwd: Callable, rebuild: Callable) -> Callable:
    """Marks the custom VJP whose backward function is ``bwd`` as one an interpreter rebuilds
    rather than inlines: ``rebuild(body, invals) -> outs`` makes the same custom VJP around
    ``body(*invals) -> outs``, the interpreter's evaluation of the primal body, on the
    equation's flat inputs (which may be an interpreter's own values, such as implicit
    weights). For a custom VJP whose backward pass is the derivative of its body, computed
    from what its ``fwd`` keeps (a recomputation): inlining it would hand what it saves to
    an outer remat policy. Returns ``bwd``."""
    setattr(bwd, _REBUILD_ATTR, rebuild)
    return bwd


def rebuild_rule(eqn) -> Callable | None:
    """The rebuild rule of a ``custom_vjp`` equation marked ``rebuildable``, else None."""
    if kind(eqn) != CUSTOM_VJP or eqn.params.get("num_consts", 0):
        return None
    return getattr(_compat.custom_vjp_bwd(eqn.params.get("bwd")), _REBUILD_ATTR, None)


def rebind_custom_vjp(eqn, invals, evaluate):
    """A ``rebuildable`` custom VJP rebuilt by its rule around its evaluated body."""
    jaxpr, consts = body_of(eqn)
    return list(rebuild_rule(eqn)(lambda *args: evaluate(jaxpr, consts, list(args)), invals))
