"""Float32 master weights for low-precision (bfloat16/float16) parameters: an optax wrapper
that runs any optimizer on float32 copies of the weights and re-derives the low-precision
parameters from them after every step (exactness and memory: ``docs/mixed_precision.md``).

Source: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.1; NVIDIA apex
``amp`` O2 master weights; the wrapper shape follows ``optax.apply_if_finite``.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmem._src.tree import is_float_array as _is_float


class MixedPrecisionState(NamedTuple):
    """State of :func:`mixed_precision`.

    Attributes:
      masters: tree like the params; floating leaves in
        ``promote_types(param dtype, master_dtype)``, other leaves as the params.
      inner_state: the wrapped optimizer's state, built on ``masters``.
    """

    masters: Any
    inner_state: Any


def _check_master_dtype(master_dtype) -> jnp.dtype:
    """``master_dtype`` as a floating dtype; raises ``TypeError`` otherwise."""
    try:
        master_dtype = jnp.dtype(master_dtype)
    except TypeError as e:
        raise TypeError(f"master_dtype must be a floating dtype, got {master_dtype!r}.") from e
    if not jnp.issubdtype(master_dtype, jnp.floating):
        raise TypeError(f"master_dtype must be a floating dtype, got {master_dtype}.")
    return master_dtype


def _init_master(p, master_dtype):
    """A float leaf's master: a copy in ``promote_types(p.dtype, master_dtype)``.

    Always a copy (never an alias of the param), so donating the params is safe; other array
    leaves are copied as they are, non-array leaves passed through.
    """
    if not hasattr(p, "dtype"):
        return p
    dtype = jnp.promote_types(p.dtype, master_dtype) if _is_float(p) else None
    return jnp.array(p, dtype=dtype, copy=True)


def _check_update_args(grads, masters, params) -> None:
    """Raises ``ValueError`` if ``params`` is missing or a structure differs from the masters."""
    if params is None:
        raise ValueError(
            "mixed_precision.update needs params (the low-precision "
            "parameters): call tx.update(grads, state, params)."
        )
    ts_m = jax.tree_util.tree_structure(masters)
    for what, tree in (("grads", grads), ("params", params)):
        ts = jax.tree_util.tree_structure(tree)
        if ts != ts_m:
            raise ValueError(
                f"mixed_precision: {what} structure {ts} does not match the "
                f"master weights {ts_m} (built by init from the params)."
            )


def _cast_grad(g, m):
    """A float gradient in its master's dtype; other gradients untouched."""
    return g.astype(m.dtype) if (_is_float(g) and _is_float(m)) else g


def _inner_update(inner, grads, inner_state, masters, extra_args):
    """``inner.update`` on the masters, forwarding extra args where ``inner`` takes them."""
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner.update(grads, inner_state, masters, **extra_args)
    return inner.update(grads, inner_state, masters)


def _param_update(p, m_new, u):
    """The update that takes ``p`` to ``m_new.astype(p.dtype)``; ``u`` for non-float leaves.

    ``p + update`` is exact whenever this difference is exactly representable (see
    ``docs/mixed_precision.md``). It is a plain subtraction, so no multiply-add contraction in
    the caller's jit can change the result.
    """
    if not (_is_float(p) and _is_float(m_new)):
        return u
    wide = m_new.dtype
    return m_new.astype(p.dtype).astype(wide) - p.astype(wide)


def mixed_precision(
    inner: optax.GradientTransformation, *, master_dtype=jnp.float32
) -> optax.GradientTransformation:
    """Runs ``inner`` on float32 master copies of low-precision parameters.

    Args:
      inner: any ``optax.GradientTransformation`` (``optax.adamw(...)``, chains, ...). It
        sees float32 masters as params and float32 gradients.
      master_dtype: floating dtype of the masters (default float32).

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.GradientTransformationExtraArgs`` if
      ``inner`` is one, forwarding extra args) with state :class:`MixedPrecisionState`:

      * ``init(params)``: ``masters = params`` cast up (floating leaves), inner state
        initialised on the masters.
      * ``update(grads, state, params)``: grads (any float dtype, shapes as params) are cast
        to the master dtype; ``u = inner.update(grads, inner_state, masters)``;
        ``new_masters = optax.apply_updates(masters, u)``. Returns ``(updates, new_state)``
        where ``optax.apply_updates(params, updates)`` reproduces
        ``new_masters.astype(param dtype)`` (bitwise for low-precision leaves up to a rare
        corner case, see ``docs/mixed_precision.md``); :func:`params_from_masters` gives it
        exactly. ``params`` is required.

    Raises:
      TypeError: ``inner`` is not a GradientTransformation or ``master_dtype`` is not a
        floating dtype.
      ValueError: ``update`` called without ``params``, or grads/params structure differs
        from the masters.

    Source: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.1.
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            f"inner must be an optax.GradientTransformation, got {type(inner).__name__}."
        )
    master_dtype = _check_master_dtype(master_dtype)

    def init_fn(params):
        masters = jax.tree_util.tree_map(lambda p: _init_master(p, master_dtype), params)
        return MixedPrecisionState(masters=masters, inner_state=inner.init(masters))

    def update_fn(grads, state, params=None, **extra_args):
        masters = state.masters
        _check_update_args(grads, masters, params)
        grads = jax.tree_util.tree_map(_cast_grad, grads, masters)
        u, inner_state = _inner_update(inner, grads, state.inner_state, masters, extra_args)
        new_masters = optax.apply_updates(masters, u)
        updates = jax.tree_util.tree_map(_param_update, params, new_masters, u)
        return updates, MixedPrecisionState(masters=new_masters, inner_state=inner_state)

    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return optax.GradientTransformation(init_fn, update_fn)


def params_from_masters(state: MixedPrecisionState, params: Any) -> Any:
    """Returns the parameters implied by the masters: ``masters.astype(param dtype)``.

    Args:
      state: a :class:`MixedPrecisionState` (after ``update``, holds the new masters). It
        may also be nested inside other optax states (e.g. ``optax.chain``): the first
        :class:`MixedPrecisionState` found is used.
      params: the current params (only their dtypes and structure are used).

    Returns:
      A tree like ``params`` with each leaf ``master.astype(param.dtype)``: exact, the
      recommended way to apply a :func:`mixed_precision` step.

    Raises:
      ValueError: no :class:`MixedPrecisionState` in ``state``, or structure mismatch.
    """
    mp = _find_state(state)
    if mp is None:
        raise ValueError(
            "params_from_masters: no MixedPrecisionState found in state; pass the "
            "state of a jmem.mixed_precision optimizer."
        )
    ts_m, ts_p = jax.tree_util.tree_structure(mp.masters), jax.tree_util.tree_structure(params)
    if ts_m != ts_p:
        raise ValueError(
            f"params_from_masters: params structure {ts_p} does not match the masters {ts_m}."
        )
    return jax.tree_util.tree_map(
        lambda m, p: m.astype(p.dtype) if hasattr(p, "dtype") else m, mp.masters, params
    )


def _find_state(state):
    if isinstance(state, MixedPrecisionState):
        return state
    found = [
        s
        for s in jax.tree_util.tree_leaves(
            state, is_leaf=lambda x: isinstance(x, MixedPrecisionState)
        )
        if isinstance(s, MixedPrecisionState)
    ]
    return found[0] if found else None
