"""A jaxpr interpreter that runs a model with weights replaced by implicit values.

The mechanism behind ``jmem.lora.apply``, ``jmem.qlora.apply`` and ``jmem.fp8.apply``, in
the spirit of qax ("implicit arrays"): NF4 leaves and LoRA-adapted leaves of ``params``
stay packed/factored, leaves with an FP8 state carry it, and every matmul against them is
rewritten. How it works and what a model may do with a selected weight: ``docs/lora.md``.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src import jaxpr as _jaxpr
from jmem._src import tree as _tree
from jmem._src.implicit import matmul_rules as _matmul
from jmem._src.implicit import modules as _modules
from jmem._src.implicit import ragged_rules as _ragged
from jmem._src.implicit import registry as _registry
from jmem._src.implicit import shard_map_rule as _shard_map
from jmem._src.implicit import structural_rules as _structural
from jmem._src.implicit.weight import ImplicitWeightError
from jmem._src.implicit.weight import Weight
from jmem._src.implicit.weight import error
from jmem._src.implicit.weight import flatten_params
from jmem._src.implicit.weight import is_nf4
from jmem._src.implicit.weight import is_weight
from jmem._src.jaxpr import bind_eqn
from jmem._src.jaxpr import eval_jaxpr

__all__ = ["ImplicitWeightError", "Weight", "call", "flatten_params", "register"]

register = _registry.register


def _register_defaults() -> None:
    """The interpreter's own rules: matmuls, views, and every higher-order primitive of the
    jaxpr core's table (under each name JAX has used for it)."""
    own = {
        "dot_general": _matmul.dot_general,
        "ragged_dot_general": _ragged.ragged_dot_general,
        "convert_element_type": _structural.convert,
        "transpose": _structural.transpose,
        "copy": _structural.identity,
        "copy_p": _structural.identity,
        "sharding_constraint": _structural.identity,
        "name": _structural.identity,
        "slice": _structural.slice_,
        "dynamic_slice": _structural.dynamic_slice,
        "squeeze": _structural.squeeze,
        "reshape": _structural.reshape,
        "device_put": _structural.device_put,
        "shard_map": _shard_map.shard_map,
    }
    by_kind = {
        _jaxpr.CALL: _structural.inline_call,
        _jaxpr.CHECKPOINT: _structural.checkpoint,
        _jaxpr.SCAN: _structural.scan,
        _jaxpr.COND: _structural.cond,
        _jaxpr.WHILE: _structural.while_,
        _jaxpr.CUSTOM_JVP: _structural.inline_custom,
        _jaxpr.CUSTOM_VJP: _structural.inline_custom,
    }
    for k, rule in by_kind.items():
        own.update(dict.fromkeys(_jaxpr.names_of(k), rule))
    for name, rule in own.items():
        _registry.register(name, rule, last=True)


_register_defaults()


class _Interpreter:
    """Re-evaluates a jaxpr, routing equations that receive a ``Weight`` to the rules of
    ``jmem._src.implicit.registry``."""

    def __init__(self, allow_materialize: bool):
        self.allow_materialize = allow_materialize
        self.dropout_sites = 0
        self.memo = {}  # LoRA inputs flattened once per value (matmul_rules.lora_term)

    def next_dropout_site(self) -> int:
        """A new number for a LoRA matmul, folded into its dropout key (distinct masks for
        two matmuls of one weight)."""
        self.dropout_sites += 1
        return self.dropout_sites

    def fallback(self, eqn, invals, w: Weight, why: str = ""):
        """Raises for ``w`` reaching ``eqn``, or (``allow_materialize``) binds ``eqn`` on the
        materialized weights."""
        if not self.allow_materialize:
            raise error(w, eqn.primitive.name, why)
        return bind_eqn(eqn, [v.materialize() if is_weight(v) else v for v in invals])

    def eval(self, jaxpr, consts, args):
        """Evaluates ``jaxpr`` with ``Weight`` values among ``consts``/``args``."""
        return eval_jaxpr(jaxpr, consts, args, self.eval_eqn)

    def eval_eqn(self, eqn, invals):
        """One equation: its rule if an input is a ``Weight``, else the primitive itself."""
        if any(is_weight(v) for v in invals):
            for rule in _registry.rules_for(eqn.primitive.name):
                outs = rule(self, eqn, invals)
                if outs is not NotImplemented:
                    return outs
            w = next(v for v in invals if is_weight(v))
            return self.fallback(eqn, invals, w)
        return bind_eqn(eqn, invals)


def _check_adapter_paths(lora: dict, names: list, what: str = "LoRA adapters") -> None:
    """Raises ``ValueError`` if an adapter (or FP8 state) path is not a leaf of params."""
    missing = sorted(set(lora) - set(names))
    if missing:
        raise ValueError(
            f"{what} for {missing} have no matching leaf in params "
            f"(leaves: {names[:20]}{'...' if len(names) > 20 else ''})."
        )


def _check_selected(name: str, shape: tuple, adapter) -> None:
    """Raises ``ValueError`` for a selected leaf below 2-D or adapter factors of wrong shape."""
    if len(shape) < 2:
        raise ValueError(
            f"Targeted weight {name!r} has shape {shape}; NF4/LoRA weights "
            f"must be >= 2-D ([..., in, out])."
        )
    if adapter is None:
        return
    exp_a = shape[:-1] + (adapter.a.shape[-1],)
    exp_b = shape[:-2] + (adapter.b.shape[-2], shape[-1])
    if tuple(adapter.a.shape) != exp_a or tuple(adapter.b.shape) != exp_b:
        raise ValueError(
            f"LoRA factors for {name!r} have shapes a{tuple(adapter.a.shape)}, "
            f"b{tuple(adapter.b.shape)}; expected a{exp_a}, b{exp_b} for a weight "
            f"of shape {shape}."
        )


def _dropout_keys(key, index: int, lead: tuple):
    """One PRNG key per stacked matrix (``[*lead]``) for the adapter of leaf ``index``."""
    if not jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
    key = jax.random.fold_in(key, index)
    n = math.prod(lead)
    return jax.random.split(key, n).reshape(lead) if lead else key


def _check_meta(name: str, shape: tuple, meta) -> None:
    """Raises ``ValueError`` unless every leaf of ``meta`` leads with the weight's stacked
    shape ``shape[:-2]`` (one scaling state per stacked matrix)."""
    lead = shape[:-2]
    bad = [tuple(x.shape) for x in jax.tree.leaves(meta) if tuple(x.shape[: len(lead)]) != lead]
    if bad or not jax.tree.leaves(meta):
        raise ValueError(
            f"The FP8 state for {name!r} has leaves of shapes {bad}; a weight of shape "
            f"{shape} needs one state per stacked matrix (batch_shape {lead}): build it "
            f"with jmem.fp8.init_metas(params, ...)."
        )


def _implicit_leaf(
    name: str, leaf, adapter, key=None, meta=None
) -> tuple[jax.ShapeDtypeStruct, Weight]:
    """The tracing placeholder and the ``Weight`` standing for one selected leaf; ``key``
    (``[*L]`` keys) turns on the adapter's dropout, ``meta`` (an FP8 state with batch
    shape ``[*L]``) makes its matmuls FP8."""
    shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
    _check_selected(name, shape, adapter)
    if meta is not None:
        _check_meta(name, shape, meta)
    dropout = 0.0 if adapter is None else float(getattr(adapter, "dropout", 0.0))
    weight = Weight(
        base=leaf,
        a=None if adapter is None else adapter.a,
        b=None if adapter is None else adapter.b,
        scale=1.0 if adapter is None else float(adapter.scale),
        name=name,
        dtype=dtype,
        perm=tuple(range(len(shape))),
        base_shape=shape,
        key=key if dropout > 0 else None,
        dropout=dropout,
        meta=meta,
    )
    return jax.ShapeDtypeStruct(shape, dtype), weight


def call(
    fn: Callable,
    params,
    lora,
    args: tuple,
    kwargs: dict,
    *,
    allow_materialize: bool = False,
    dropout_key=None,
    metas: dict | None = None,
):
    """Evaluates ``fn(params, *args, **kwargs)`` with NF4 leaves, LoRA adapters and FP8
    scaling states implicit.

    Args:
      fn: a function whose first argument is a params pytree.
      params: the params; ``NF4Array`` leaves are frozen quantized weights.
      lora: ``None`` or a ``{path: LoraWeight}`` dict (``jmem.lora.init``); each path names
        a leaf of ``params`` (2-D ``[in, out]`` or stacked ``[..., in, out]``).
      args, kwargs: the other arguments; array leaves are traced, other leaves are static.
      allow_materialize: materialize a weight where it cannot stay implicit, instead of
        raising ``ImplicitWeightError``.
      dropout_key: PRNG key for the adapters' dropout (``LoraWeight.dropout``), or None
        (no dropout: the same program as with ``dropout = 0``).
      metas: None or a ``{path: Fp8Meta}`` dict (``jmem.fp8.apply``); each path names a
        leaf of ``params`` ``[*L, in, out]`` whose state has batch shape ``[*L]``. Its
        matmuls run in FP8 (``fp8_rules.py``); the state's cotangent is its update.

    Returns:
      What ``fn`` returns.

    Raises:
      ValueError: if a LoRA or FP8 path is not a leaf of ``params`` or shapes disagree.
      ImplicitWeightError: for an unsupported use of a selected weight (see docs/lora.md).
    """
    lora, metas = dict(lora or {}), dict(metas or {})
    flat, treedef = flatten_params(params)
    _check_adapter_paths(lora, [n for n, _ in flat])
    _check_adapter_paths(metas, [n for n, _ in flat], "FP8 states")
    p_avals, p_vals = [], []
    for i, (name, leaf) in enumerate(flat):
        if is_nf4(leaf) or name in lora or name in metas:
            ad = lora.get(name)
            key = None
            if dropout_key is not None and ad is not None and getattr(ad, "dropout", 0.0) > 0:
                key = _dropout_keys(dropout_key, i, tuple(leaf.shape[:-2]))
            aval, leaf_val = _implicit_leaf(name, leaf, ad, key, metas.get(name))
        else:
            aval, leaf_val = leaf, leaf
        p_avals.append(aval)
        p_vals.append(leaf_val)

    a_flat, a_tree = jax.tree.flatten((args, kwargs))
    a_dyn, a_combine = _tree.partition(a_flat)
    n_p = len(p_avals)

    def flat_fn(*leaves):
        ps = leaves[:n_p]
        a, kw = jax.tree.unflatten(a_tree, a_combine(leaves[n_p:]))
        return fn(jax.tree.unflatten(treedef, list(ps)), *a, **kw)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*p_avals, *a_dyn)
    interp = _Interpreter(allow_materialize)
    try:
        outs = interp.eval(closed.jaxpr, closed.consts, [*p_vals, *a_dyn])
        outs = [o.materialize() if (is_weight(o) and allow_materialize) else o for o in outs]
        for o in outs:
            if is_weight(o):
                raise error(o, "<output>", "the function returns the weight itself")
    except ImplicitWeightError as e:
        _add_rule_note(e, flat, lora)
        raise
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _add_rule_note(e: ImplicitWeightError, flat: list, lora: dict) -> None:
    """Appends to ``e`` which module rule made its weight implicit (once, innermost call)."""
    leaf = dict(flat).get(e.weight_name)
    if leaf is None or getattr(e, "rule_noted", False):
        return
    note = _modules.rule_note(e.weight_name, flat, nf4=is_nf4(leaf), lora=e.weight_name in lora)
    if note:
        e.args = (f"{e.args[0]} {note}", *e.args[1:])
    e.rule_noted = True
