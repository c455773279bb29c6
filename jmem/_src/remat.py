"""Activation rematerialization (gradient checkpointing) that reaches every layer.

``jax.checkpoint`` around a whole loss saves nothing: XLA recomputes the forward pass
all at once in the backward pass, so the peak holds every layer's activations anyway.
The savings come from checkpointing each *layer*, i.e. the body of the ``lax.scan``
that iterates a stacked layer pytree. ``jmem.remat`` does that for you: it traces
``fn`` to a jaxpr and re-evaluates it with every ``lax.scan`` body wrapped in
``jax.checkpoint(body, policy=...)``, including scans nested inside ``jit``/``pjit``,
``cond`` and existing ``jax.checkpoint`` regions. So ``jax.grad(jmem.remat(loss, "full"))``
gets per-layer savings without touching the model.

Policies (``REMAT_POLICIES``), from most device memory to least:

=============  ======================================================================
``none``       no rematerialization: every intermediate is kept for the backward pass.
``dots``       save every matmul output (incl. attention scores), recompute the rest.
``selective``  Korthikanti et al. 2022: save matmuls against weights (dots without
               batch dims: QKV, output and MLP projections); recompute attention
               scores, softmax, dropout and element-wise work.
``full``       save only each layer's input; recompute the whole layer (~1/3 more
               forward FLOPs).
``offload``    like ``selective``, but the saved residuals live in ``pinned_host``
               memory and are copied back for the backward pass.
=============  ======================================================================

Besides these names, ``policy`` may be a tuple/list of ``checkpoint_name`` names to
save (``jax.checkpoint_policies.save_only_these_names``) or any JAX policy callable.

Limits: a function without ``lax.scan`` is wrapped whole in ``jax.checkpoint`` (the
standard behaviour: it saves memory only when that function is one piece of a larger
differentiated computation, e.g. a layer you call in a Python loop). A function that
already calls ``jax.grad`` inside has made its residual choices when it traced the
gradient; wrap the loss instead (``jmem.train_step(..., remat=...)`` does). The bodies
of ``custom_vjp`` and ``custom_jvp`` functions are left alone (their rules are kept, and
a ``custom_vjp``'s ``fwd`` decides what is saved), so scans inside them are not rematted.

Source: Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"), Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), and
JAX's ``jax.checkpoint`` policies (``jax/_src/ad_checkpoint.py``).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
from jax import lax
from jax.extend import core as jcore

from jmem._src import tree as _tree
from jmem._src.interpret import bind_eqn, eval_jaxpr

_cp = jax.checkpoint_policies

#: Remat policies by name, from most device memory to least (module docstring's table):
#: each maps to the ``jax.checkpoint_policies`` callable it uses (``None``: no remat).
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "dots": _cp.dots_saveable,
    "selective": _cp.dots_with_no_batch_dims_saveable,
    "full": _cp.nothing_saveable,
    "offload": _cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def resolve_policy(policy: str | Sequence[str] | Callable | None) -> Callable | None:
    """Maps a policy name, a sequence of ``checkpoint_name`` names, or a callable to a JAX
    remat policy callable. Returns ``None`` for ``"none"``/``None`` (no remat).

    Raises:
      ValueError: for an unknown name (the message lists ``REMAT_POLICIES``).
      TypeError: for anything that is not a str, a sequence of str, or a callable.
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy not in REMAT_POLICIES:
            raise ValueError(
                f"Unknown remat policy {policy!r}. Valid names: {list(REMAT_POLICIES)}; or pass a "
                "tuple of checkpoint_name names to save, or a jax.checkpoint_policies callable."
            )
        return REMAT_POLICIES[policy]
    if isinstance(policy, (list, tuple)) and all(isinstance(n, str) for n in policy):
        return _cp.save_only_these_names(*policy)
    if callable(policy):
        return policy
    raise TypeError(
        f"remat policy must be a name, a sequence of checkpoint names or a callable; "
        f"got {type(policy).__name__}."
    )


def _has_scan(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return True
        if eqn.primitive.name.startswith(("custom_vjp", "custom_jvp")):
            continue  # their custom rules decide what is saved; left as they are
        for sub in jcore.jaxprs_in_params(eqn.params):
            if _has_scan(sub):
                return True
    return False


class _Interpreter:
    """Re-evaluates a jaxpr, wrapping each outermost scan body in ``jax.checkpoint``."""

    def __init__(self, policy: Callable | None, prevent_cse: bool, every: int | str | None = None):
        self.policy = policy
        self.prevent_cse = prevent_cse
        self.every = every

    def eval(self, jaxpr, consts, args):
        return eval_jaxpr(jaxpr, consts, args, self.eval_eqn)

    def eval_closed(self, closed, args):
        return self.eval(closed.jaxpr, closed.consts, args)

    def eval_eqn(self, eqn, invals):
        name = eqn.primitive.name
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if name == "scan":
            return self.scan(eqn, invals)
        if not name.startswith(("custom_vjp", "custom_jvp")) and any(_has_scan(s) for s in subs):
            if name in ("pjit", "jit", "closed_call", "core_call"):
                return (
                    self.eval_closed(eqn.params["jaxpr"], invals)
                    if hasattr(eqn.params["jaxpr"], "jaxpr")
                    else self.eval(eqn.params["jaxpr"], (), invals)
                )
            if name == "cond":
                index, *ops = invals
                branches = [functools.partial(self._call_closed, b) for b in eqn.params["branches"]]
                return lax.switch(index, branches, *ops)
            if name in ("remat", "checkpoint"):
                inner = eqn.params["jaxpr"]
                fn = functools.partial(self._call_open, inner)
                return jax.checkpoint(
                    fn,
                    policy=eqn.params.get("policy"),
                    prevent_cse=eqn.params.get("prevent_cse", True),
                )(*invals)
        return bind_eqn(eqn, invals)

    def _call_closed(self, closed, *args):
        return self.eval_closed(closed, args)

    def _call_open(self, jaxpr, *args):
        return self.eval(jaxpr, (), args)

    def scan(self, eqn, invals):
        p = eqn.params
        body = p["jaxpr"]
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]

        def step(consts, carry, x):
            # Inner scans run as they are: they are inside this checkpointed region.
            outs = jcore.jaxpr_as_fun(body)(*consts, *carry, *x)
            return list(outs[:ncarry]), list(outs[ncarry:])

        if self.policy is not None:
            step = jax.checkpoint(step, policy=self.policy, prevent_cse=self.prevent_cse)
        length = p["length"]
        k = group_size(length, self.every)
        if k == 1:
            carry, ys = lax.scan(
                lambda c, x: step(consts, c, x),
                list(init),
                list(xs),
                length=length,
                reverse=p["reverse"],
                unroll=p["unroll"],
            )
            return [*carry, *ys]

        # Chen et al. 2016: checkpoint groups of k iterations (only each group's input is
        # saved); a group's iterations are recomputed, under `policy`, in the backward pass.
        def group(consts, carry, xg):
            return lax.scan(
                lambda c, x: step(consts, c, x), carry, xg, length=k, reverse=p["reverse"]
            )

        group = jax.checkpoint(
            group, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=self.prevent_cse
        )
        xs_g = [x.reshape(length // k, k, *x.shape[1:]) for x in xs]
        carry, ys = lax.scan(
            lambda c, x: group(consts, c, x),
            list(init),
            xs_g,
            length=length // k,
            reverse=p["reverse"],
        )
        return [*carry, *[y.reshape(length, *y.shape[2:]) for y in ys]]


def group_size(length: int, every: int | str | None) -> int:
    """Iterations per checkpointed group for ``every`` (1: no grouping).

    ``"sqrt"`` picks the divisor of ``length`` nearest to ``sqrt(length)``; an int ``k`` groups
    scans whose length it divides and leaves the others ungrouped.
    """
    if every is None or every == 1 or length <= 1:
        return 1
    if every == "sqrt":
        divisors = [d for d in range(1, length + 1) if length % d == 0]
        k = min(divisors, key=lambda d: (abs(d - length**0.5), d))
        return k if 1 < k < length else 1
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int or 'sqrt'; got {every!r}.")
    if length % every:
        return 1  # a scan whose length `every` does not divide is not grouped
    return every if every < length else 1


def remat(
    fn: Callable | None = None,
    policy: str | Sequence[str] | Callable | None = "full",
    *,
    prevent_cse: bool | None = None,
    static_argnums: int | Sequence[int] = (),
    every: int | str | None = None,
) -> Callable:
    """Rematerializes ``fn``'s activations per layer under a named policy.

    Works on a layer or scan-step function (``lax.scan(jmem.remat(step, "selective"), ...)``)
    and on a whole loss: every ``lax.scan`` traced inside ``fn`` gets its body checkpointed,
    so ``jax.grad(jmem.remat(loss_fn, "full"))`` saves one layer input per layer. Values and
    gradients are unchanged (bitwise on CPU for the reference Llama in jmem's tests; XLA may
    fuse a recomputed region differently elsewhere, changing the last bits).

    Args:
      fn: the function; may be omitted to use ``remat`` as a decorator factory.
      policy: a name from ``REMAT_POLICIES``, a sequence of ``checkpoint_name`` names to
        save, or a JAX policy callable.
      prevent_cse: passed to ``jax.checkpoint``. Default (None): False for scan bodies (scan
        already blocks CSE, and True costs speed there) and True for a function without scan.
      static_argnums: positional arguments that are not arrays (hashable Python values).
        Non-array pytree leaves in any argument, and Python bools and ints (flags, lengths),
        are treated as static automatically; Python floats are traced.
      every: group ``every`` consecutive scan iterations into one checkpoint that saves only
        the group's input (Chen et al. 2016); ``"sqrt"`` picks ~sqrt(L), the O(sqrt(L))
        memory scheme. Inside a group, iterations follow ``policy`` when the group is
        recomputed (``policy="none"`` with ``every="sqrt"`` is Chen et al.'s scheme: each
        layer's forward runs twice). Applies to scans only; an int applies to the scans whose
        length it divides. A weight shared by all iterations (closed over, not scanned) gets
        its gradient summed in another order, so it may differ in the last bits.

    Returns:
      A function with ``fn``'s signature and outputs (Python scalars that ``fn`` returns,
      e.g. in an aux dict, come back as Python scalars, not 0-d arrays).

    Raises:
      ValueError / TypeError: for an unknown policy (see ``resolve_policy``).
    """
    if fn is None:
        return functools.partial(
            remat,
            policy=policy,
            prevent_cse=prevent_cse,
            static_argnums=static_argnums,
            every=every,
        )
    pol = resolve_policy(policy)
    if every is not None and every != "sqrt" and (not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int or 'sqrt'; got {every!r}.")
    if pol is None and every is None:
        return fn
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    static_argnums = tuple(static_argnums)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        flat, treedef = jax.tree.flatten((args, kwargs))
        for i in static_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"static_argnums={static_argnums} out of range for {len(args)} args."
                )
        static_ids = {i % len(args) for i in static_argnums}
        # Leaves of static positional args, and non-array leaves anywhere, are closed over.
        forced = [i in static_ids for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        forced += [False] * (len(flat) - len(forced))
        dyn, combine = _tree.partition(flat, forced)

        traced_out = {}

        def flat_fn(*dyn_leaves):
            a, kw = jax.tree.unflatten(treedef, combine(dyn_leaves))
            out = fn(*a, **kw)
            traced_out.setdefault("out", out)
            return out

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
        if not _has_scan(closed.jaxpr):
            if pol is None:
                return flat_fn(*dyn)
            cse = True if prevent_cse is None else prevent_cse
            out = jax.checkpoint(flat_fn, policy=pol, prevent_cse=cse)(*dyn)
        else:
            cse = False if prevent_cse is None else prevent_cse
            out = jax.tree.unflatten(
                jax.tree.structure(out_shape),
                _Interpreter(pol, cse, every).eval_closed(closed, dyn),
            )
        # Python scalars returned by ``fn`` (e.g. a step count in aux) do not depend on the
        # traced inputs: give them back as they were, not as 0-d arrays.
        return jax.tree.map(
            lambda o, t: t if isinstance(t, (bool, int, float, complex)) else o,
            out,
            traced_out["out"],
        )

    return wrapped
