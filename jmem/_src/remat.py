"""Activation rematerialization (gradient checkpointing) that reaches every layer: ``remat``
traces a function and checkpoints the body of every ``lax.scan`` in it (the per-layer loop of
a stacked model) under a named policy. Policies, mechanism and limits: ``docs/remat.md``.

Source: Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"), Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), and JAX's
``jax.checkpoint`` policies (``jax.checkpoint_policies``, JAX's ``ad_checkpoint`` module).
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Callable
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from jmem._src import attention as _attention
from jmem._src import jaxpr as _jaxpr
from jmem._src import remat_bits as _bits
from jmem._src import scan_intercept as _si
from jmem._src import tree as _tree
from jmem._src.implicit import matmul_rules as _matmul
from jmem._src.names import REMAT_NAMES
from jmem._src.names import check_implements

_cp = jax.checkpoint_policies


class RematPolicies(dict):
    """Remat policies by name, from most device memory to least: name -> the
    ``jax.checkpoint_policies`` callable it uses (``None`` for ``"none"``: no remat).

    ``none``: everything saved. ``dots``: every matmul output saved. ``selective``: matmuls
    against weights saved, attention and element-wise work recomputed (Korthikanti et al.
    2022). Both also save the blockwise attention's output and log-sum-exp by name (its
    loops are opaque to policies); token chunks (``mlp_chunk``) recompute their internals
    under every policy. ``full``: each layer's input saved, the layer recomputed (Chen et al. 2016).
    ``offload``: as ``selective`` with the residuals in ``pinned_host`` memory, and the
    value named ``"layer_input"`` (each layer's input in ``jmem.models.llama``) offloaded
    too, so the residual stream leaves the device. ``offload_inputs``: as ``full`` with
    each layer's input in ``pinned_host`` memory (nothing else saved: the least device
    memory, and host memory of one hidden-sized activation per layer, as unsloth's
    offloaded gradient checkpointing).
    ``docs/remat.md`` has the measured table.
    """


#: The ``checkpoint_name`` of a layer's input that the ``offload`` policy sends to host.
LAYER_INPUT = "layer_input"
_offload_inputs = _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device",
    offload_dst="pinned_host",
)
_offload_named = _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[LAYER_INPUT, _matmul.LORA_MATMUL],
    offload_src="device",
    offload_dst="pinned_host",
)
_offload_dots = _cp.offload_dot_with_no_batch_dims("device", "pinned_host")
_RECOMPUTE = _offload_inputs(jax.lax.add_p)  # what a policy answers for "not saved"


def _offload_policy(prim, *avals, **params):
    """``offload``: the named layer input and LoRA-adapted matmul outputs to host, else
    matmuls against weights to host."""
    decision = _offload_named(prim, *avals, **params)
    return _offload_dots(prim, *avals, **params) if decision is _RECOMPUTE else decision


#: The blockwise attention's output and log-sum-exp (``[S]``-sized, no ``[S, T]`` array):
#: its loops are opaque to policies, so ``dots`` and ``selective`` save these by name
#: instead of recomputing the whole forward loop in the backward pass.
#: A LoRA-adapted matmul (``jmem.lora``/``jmem.qlora``) is two matmuls and a sum; these
#: policies save the sum by name (``LORA_MATMUL``), not both full-width terms.
_ATTENTION = (_attention.ATTENTION_OUT, _attention.ATTENTION_LSE)
_save_named = _cp.save_only_these_names(
    *_ATTENTION, _matmul.LORA_MATMUL, _matmul.LORA_BATCHED_MATMUL
)
_save_named_unbatched = _cp.save_only_these_names(*_ATTENTION, _matmul.LORA_MATMUL)
_dots = _cp.save_from_both_policies(_cp.dots_saveable, _save_named)
_selective = _cp.save_from_both_policies(
    _cp.dots_with_no_batch_dims_saveable, _save_named_unbatched
)

REMAT_POLICIES = RematPolicies(
    none=None,
    dots=_dots,
    selective=_selective,
    full=_cp.nothing_saveable,
    offload=_offload_policy,
    offload_inputs=_offload_inputs,
)
check_implements("REMAT_POLICIES", REMAT_NAMES, REMAT_POLICIES)

#: The policies that save residuals on the device and offload none (``dots``,
#: ``selective``, names policies made by ``resolve_policy``): a scan body under one of
#: them keeps its 16-bit residuals as bits (``remat_bits.policy_bits_checkpoint``).
_DEVICE_SAVING = weakref.WeakSet([_dots, _selective])


def _saves_on_device(policy) -> bool:
    return policy in _DEVICE_SAVING


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
        names = _cp.save_only_these_names(*policy)
        _DEVICE_SAVING.add(names)
        return names
    if callable(policy):
        return policy
    raise TypeError(
        f"remat policy must be a name, a sequence of checkpoint names or a callable; "
        f"got {type(policy).__name__}."
    )


class RematInterpreter:
    """Re-evaluates a jaxpr, wrapping each outermost scan body in ``jax.checkpoint`` (once: a
    body the user checkpointed is kept as it is), keeping user jits, checkpoints and every
    equation's name stack (``jmem._src.jaxpr`` does the re-binding)."""

    def __init__(self, policy: Callable | None, prevent_cse: bool, every: int | str | None = None):
        self.policy = policy
        self.prevent_cse = prevent_cse
        self.every = every

    def eval(self, jaxpr, consts, args):
        return _jaxpr.eval_jaxpr(jaxpr, consts, args, self.eval_eqn)

    def eval_closed(self, closed, args):
        return self.eval(closed.jaxpr, closed.consts, args)

    def rewrite_jit(self, params, args):
        """A ``jax.jit`` call (its equation's ``params``) with its scans rewritten, kept a jit."""
        return _jaxpr.rebind_jit(params, args, self.eval)

    def eval_eqn(self, eqn, invals):
        kind = _jaxpr.kind(eqn)
        if kind == _jaxpr.SCAN:
            return checkpointed_scan(eqn.params, invals, self.policy, self.prevent_cse, self.every)
        subs = jcore.jaxprs_in_params(eqn.params)
        if _jaxpr.is_custom(eqn) or not any(_jaxpr.has_scan(s) for s in subs):
            return _jaxpr.bind_eqn(eqn, invals)
        if kind == _jaxpr.CALL:
            return _jaxpr.rebind_call(eqn, invals, self.eval)
        if kind == _jaxpr.COND:
            return _jaxpr.rebind_cond(eqn, invals, self.eval)
        if kind == _jaxpr.CHECKPOINT:
            return _jaxpr.rebind_checkpoint(eqn, invals, self.eval)
        return _jaxpr.bind_eqn(eqn, invals)  # while: its scans run as they are


def checkpointed_scan(params, invals, policy, prevent_cse, every):
    """The outputs of the scan ``params`` on ``invals``, re-bound with its body checkpointed
    (``policy``; a body already checkpointed is kept) and, with ``every``, its iterations
    grouped (``_grouped_scan``)."""
    p = params
    consts, init, xs = _jaxpr.scan_operands(p, invals)
    step = functools.partial(_scan_step, p["jaxpr"], p["num_carry"])
    if policy is not None and not _jaxpr.scan_body_checkpointed(p):
        dtypes = [jnp.result_type(c) for c in init]
        if policy is _cp.nothing_saveable and _bits.has_16bit_floats(dtypes):
            step = _bits.bits_checkpoint(step, dtypes)  # no float32 stack on XLA:CPU
        elif _saves_on_device(policy) and _bits.has_16bit_floats(dtypes):
            step = _bits.policy_bits_checkpoint(step, policy, prevent_cse)  # the same
        else:
            step = jax.checkpoint(step, policy=policy, prevent_cse=prevent_cse)
    length = p["length"]
    k = group_size(length, every)
    if k == 1:
        return _jaxpr.rebind_scan(p, init, xs, lambda c, x: step(consts, c, x))
    return _grouped_scan(step, consts, init, xs, length, k, p["reverse"], prevent_cse)


def _scan_step(body, ncarry, consts, carry, x):
    """One iteration of a scan ``body`` (a closed jaxpr): ``(new_carry, y)`` as lists.

    Inner scans run as they are: they are inside the checkpointed region.
    """
    outs = jcore.jaxpr_as_fun(body)(*consts, *carry, *x)
    return list(outs[:ncarry]), list(outs[ncarry:])


def _grouped_scan(step, consts, init, xs, length, k, reverse, prevent_cse):
    """A scan of ``length // k`` checkpointed groups of ``k`` iterations of ``step``.

    Chen et al. 2016: only each group's input is saved; a group's iterations are recomputed,
    under ``step``'s own policy, in the backward pass.
    """

    def group(consts, carry, xg):
        return lax.scan(lambda c, x: step(consts, c, x), carry, xg, length=k, reverse=reverse)

    group = jax.checkpoint(
        group, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse
    )
    xs_g = [x.reshape(length // k, k, *x.shape[1:]) for x in xs]
    carry, ys = lax.scan(
        lambda c, x: group(consts, c, x),
        list(init),
        xs_g,
        length=length // k,
        reverse=reverse,
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

    Works on a layer or scan-step function (``lax.scan(jmem.remat(step, "selective"), ...)``),
    on a whole loss and on a whole train step: the body of every outermost ``lax.scan`` that
    ``fn`` runs (``nnx.scan``, ``flax.linen.scan``, ``fori_loop`` included) is checkpointed
    exactly once (a body the user checkpointed is kept). A loss is traced and its jaxpr
    rewritten (user jits and name stacks kept), so ``jax.grad(jmem.remat(loss_fn, "full"))``
    saves one layer input per layer. A step that differentiates inside or takes NNX objects
    runs as written while each scan it binds gets its body checkpointed before any
    ``jax.grad``/``nnx.grad`` inside differentiates it, so ``jmem.remat(step, policy)``
    around ``jax.value_and_grad`` and an optax update (or ``nnx.value_and_grad`` and
    ``optimizer.update(model, grads)``) saves the same, and in-place NNX updates
    (optimizer state, batch statistics, RNG counters) are as without remat. Values and
    gradients are unchanged (bitwise on CPU for the reference Llama in jmem's tests; XLA
    may fuse a recomputed region differently elsewhere, changing the last bits).
    Mechanism and the JAX internals it relies on: ``docs/remat.md``.

    A function without a scan is checkpointed whole (a layer called in a Python loop);
    when that saves nothing (a whole loss, or a step that differentiates inside or mutates
    NNX state, which then runs as written) it warns (``UserWarning``) with how to scan the
    layers.

    Args:
      fn: the function; may be omitted to use ``remat`` as a decorator factory.
      policy: a name from ``REMAT_POLICIES``, a sequence of ``checkpoint_name`` names to
        save, or a JAX policy callable.
      prevent_cse: passed to ``jax.checkpoint``. Default (None): False for scan bodies (scan
        already blocks CSE, and True costs speed there) and True for a function without scan.
      static_argnums: positional arguments that are not arrays (hashable Python values).
        Every non-array leaf in any argument (Python bools, ints and floats included) is
        static automatically (``jmem.tree``'s rule, shared with ``jmem.lora.apply``).
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
      ValueError: an unknown policy name (names: ``jmem.REMAT_POLICIES``), ``every`` not a positive
        int or ``"sqrt"``; on call: ``static_argnums`` out of range, or a names policy naming
        a ``checkpoint_name`` that ``fn`` does not carry (the message lists those it does).
      TypeError: a policy that is not a name, a sequence of names or a callable.
      RuntimeError: on call, a step ``fn`` holds a scan but none was bound while it ran
        (traced before, by a cache jmem cannot see), so nothing would be checkpointed; or
        another library replaced ``scan_p.bind``/``jit_p.bind`` (not chained). Called
        eagerly (concrete outputs) this is a ``UserWarning`` instead: its scans ran in a
        ``jax.jit`` executable compiled earlier; call it under ``jax.jit``.
      JaxInternalsError: on call, on a JAX outside ``jax_compat.CHECKED_RANGE``.
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
    names = tuple(policy) if isinstance(policy, (list, tuple)) else None
    return _RematWrapper(fn, pol, prevent_cse, tuple(static_argnums), every, names)


def _split_args(args, kwargs, static_argnums):
    """Flattens ``(args, kwargs)`` into traced leaves and ``rebuild(leaves) -> (args, kwargs)``.

    Leaves of static positional args, and non-array leaves anywhere, are closed over.
    """
    flat, treedef = jax.tree.flatten((args, kwargs))
    for i in static_argnums:
        if not -len(args) <= i < len(args):
            raise ValueError(f"static_argnums={static_argnums} out of range for {len(args)} args.")
    static_ids = {i % len(args) for i in static_argnums}
    forced = [i in static_ids for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    forced += [False] * (len(flat) - len(forced))
    dyn, combine = _tree.partition(flat, forced)
    return dyn, lambda leaves: jax.tree.unflatten(treedef, combine(leaves))


def _python_scalars_back(out, traced_out):
    """Python scalars that ``fn`` returned (e.g. a step count in aux) do not depend on the
    traced inputs: gives them back as they were, not as 0-d arrays."""
    return jax.tree.map(
        lambda o, t: t if isinstance(t, (bool, int, float, complex)) else o, out, traced_out
    )


def _is_graph_node(x) -> bool:
    """True for a Flax NNX object (module, optimizer, RNG stream): state mutated in place."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    kinds = tuple(getattr(nnx, n, None) for n in ("Pytree", "Object", "Variable"))
    return isinstance(x, tuple(k for k in kinds if isinstance(k, type)))


def _has_graph_nodes(args, kwargs) -> bool:
    leaves = jax.tree.leaves((args, kwargs), is_leaf=_is_graph_node)
    return any(_is_graph_node(x) for x in leaves)


_UNROLLED_ADVICE = (
    "Put the repeated layers under a scan so each layer is checkpointed: nnx.scan over "
    "layers created with nnx.vmap, flax.linen.scan, or jax.lax.scan over stacked layer "
    "params (docs/remat.md)."
)


class _RematWrapper:
    """``fn`` with its scan bodies (or, without scans, all of it) checkpointed; see ``remat``."""

    def __init__(self, fn, policy, prevent_cse, static_argnums, every, names=None):
        self.fn, self.policy, self.prevent_cse = fn, policy, prevent_cse
        self.static_argnums, self.every, self.names = static_argnums, every, names
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"remat({self.fn!r}, policy={self.policy!r}, every={self.every!r})"

    def __get__(self, instance, owner=None):
        # Behave like a function when stored as a class attribute (a method).
        return self if instance is None else functools.partial(self, instance)

    def __call__(self, *args, **kwargs):
        dyn, rebuild = _split_args(args, kwargs, self.static_argnums)
        traced_out = {}

        def flat_fn(*dyn_leaves):
            a, kw = rebuild(dyn_leaves)
            out = self.fn(*a, **kw)
            traced_out.setdefault("out", out)
            return out

        # A trace on copies of the arguments (NNX objects included: they are pytrees, so
        # in-place writes land on copies) tells whether fn holds a scan and which
        # checkpoint names it carries; fn itself then runs once, as written.
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
        self._check_names(closed.jaxpr)
        if not _jaxpr.has_scan(closed.jaxpr):
            return self._run_without_scan(flat_fn, dyn, closed, traced_out, args, kwargs)
        if _has_graph_nodes(args, kwargs) or _jaxpr.differentiates(closed.jaxpr):
            return self._run_intercepted(args, kwargs)
        # A function that neither differentiates inside nor mutates NNX state (a loss): its
        # jaxpr is rewritten, each outermost scan body checkpointed, and evaluated.
        with _si.passthrough():
            outs = self._interpreter().eval_closed(closed, dyn)
        out = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
        return _python_scalars_back(out, traced_out["out"])

    def _interpreter(self) -> RematInterpreter:
        cse = False if self.prevent_cse is None else self.prevent_cse
        return RematInterpreter(self.policy, cse, self.every)

    def _check_names(self, jaxpr):
        if self.names is None:
            return
        carried = _jaxpr.checkpoint_names(jaxpr)
        missing = [n for n in self.names if n not in carried]
        if missing:
            raise ValueError(
                f"remat policy names {missing} are not checkpoint names of "
                f"{getattr(self.fn, '__name__', self.fn)!r}; it carries {sorted(carried)}. "
                "Tag values with jax.ad_checkpoint.checkpoint_name(x, name) or use a named "
                f"policy ({list(REMAT_POLICIES)})."
            )

    def _run_intercepted(self, args, kwargs):
        """Runs ``fn`` as written while every ``lax.scan`` it binds gets a checkpointed body."""
        interp = self._interpreter()
        icp = _si.Interception(
            lambda params, invals: checkpointed_scan(
                params, invals, interp.policy, interp.prevent_cse, interp.every
            ),
            interp.rewrite_jit,
            key=("jmem.remat", self.policy, interp.prevent_cse, self.every),
            entry=sys._getframe(),
        )
        with _si.intercepting(icp):
            out = self.fn(*args, **kwargs)
        if icp.scans + icp.jits > 0:
            return out
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
            warnings.warn(
                f"jmem.remat: {getattr(self.fn, '__name__', self.fn)!r} ran eagerly and no "
                "scan was bound (its scans ran inside a jax.jit executable compiled earlier), "
                "so this call checkpointed nothing. Call it under jit: "
                "jax.jit(jmem.remat(step, policy)).",
                UserWarning,
                stacklevel=3,
            )
            return out
        raise RuntimeError(
            f"jmem.remat: {getattr(self.fn, '__name__', self.fn)!r} holds a lax.scan, but "
            "no scan was bound while it ran (it was traced before jmem.remat ran, e.g. in "
            "a cached function transform), so nothing would be checkpointed. Wrap the loss "
            "that holds the scan instead: jax.grad(jmem.remat(loss, policy))."
        )

    def _run_without_scan(self, flat_fn, dyn, closed, traced_out, args, kwargs):
        """No scan: checkpoint ``fn`` whole (a layer called in a Python loop), or, for a step
        that differentiates inside or mutates NNX objects, run it as written; warn when
        that saves nothing."""
        name = getattr(self.fn, "__name__", repr(self.fn))
        stateful = _has_graph_nodes(args, kwargs)
        if stateful or _jaxpr.differentiates(closed.jaxpr):
            warnings.warn(
                f"jmem.remat: {name!r} has no lax.scan; it differentiates inside or takes NNX "
                "objects (whose in-place updates a whole-function jax.checkpoint would drop), "
                "so it ran as written and nothing was checkpointed (no memory saved; for one "
                f"NNX layer use nnx.remat). {_UNROLLED_ADVICE}",
                UserWarning,
                stacklevel=3,
            )
            return self.fn(*args, **kwargs)
        if self.policy is None:
            return flat_fn(*dyn)
        if any(getattr(v.aval, "shape", None) == () for v in closed.jaxpr.outvars[:1]):
            warnings.warn(
                f"jmem.remat: {name!r} has no lax.scan (outside custom_vjp/custom_jvp rules), "
                "so it was checkpointed whole, which "
                "saves no memory for a whole loss (the backward pass recomputes every layer at "
                f"once and holds them all). {_UNROLLED_ADVICE}",
                UserWarning,
                stacklevel=3,
            )
        cse = True if self.prevent_cse is None else self.prevent_cse
        out = jax.checkpoint(flat_fn, policy=self.policy, prevent_cse=cse)(*dyn)
        return _python_scalars_back(out, traced_out["out"])
