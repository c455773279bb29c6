"""Float32 master weights for low-precision (bfloat16/float16) parameters.

When parameters live in bfloat16, an update smaller than half a bfloat16 ulp of the
parameter (2**-9 relative) is rounded away: with Adam at lr=1e-4 most weights of
magnitude > ~0.05 never move. The fix (Micikevicius et al., "Mixed Precision Training",
ICLR 2018, section 3.1) keeps a float32 *master* copy of the weights in the optimizer
state, runs the optimizer on the masters with float32 gradients and re-derives the
low-precision parameters from the masters after every step.

:func:`mixed_precision` wraps any optax optimizer this way. Its state holds the masters
(``MixedPrecisionState.masters``, same structure as the params) and the inner optimizer's
state, initialised on the masters. Two ways to apply a step:

* exact (recommended for train-step builders)::

      updates, opt_state = tx.update(grads, opt_state, params)
      params = params_from_masters(opt_state, params)   # == masters.astype(param dtype)

* optax-compatible: ``params = optax.apply_updates(params, updates)``. The updates are
  float32 ``new_masters.astype(low).astype(f32) - params.astype(f32)``, so that
  ``(params + updates).astype(low)`` equals ``new_masters.astype(low)`` bitwise whenever
  that float32 difference is exact, which is every element except a rare corner case: a
  weight whose new value is tiny next to its old one (below ~2**-16·|p| for bfloat16,
  ~2**-13·|p| for float16, e.g. it crosses zero and lands next to it) and falls between
  the float32 numbers reachable as ``p + u`` (spaced up to 2**-23·|p| apart). No float32
  ``u`` can then make ``p + u`` hit it; the result is off by at most 2**-23·|p|.
  Measured: 3 such elements out of 13M over 200 AdamW steps (bfloat16), none for
  float16. It does not accumulate: the next update is computed from the actual params
  against the exact masters.

Leaves: a floating leaf narrower than ``master_dtype`` gets a master in ``master_dtype``;
a floating leaf already at least as wide (e.g. float32 norm scales) gets a master in its
own dtype (a copy, so that :func:`params_from_masters` can rebuild every leaf). Its update
is ``new_master - param`` too, exact (by Sterbenz's lemma) whenever the step changes the
weight by less than a factor of 2, otherwise off by at most 2**-23·(|step| + |weight|),
re-synced every step. (Returning the inner updates instead is not exact either: under
``jit`` XLA may contract ``masters + updates`` into a fused multiply-add, which rounds
differently from the caller's ``optax.apply_updates``, and that error would accumulate.)
Non-floating leaves (int counters, uint8 codes) pass through: their master is the param
itself and their grads and updates are handed to/from the inner optimizer untouched.

Memory: bfloat16 params (2 bytes) + float32 masters (4 bytes) = 6 bytes per parameter
before the inner optimizer's state, vs 4 bytes for plain float32 params: master weights buy
accuracy, and the savings of a bfloat16 model are in activations and in the weights that
are gathered/communicated, not in weight storage.

Source: Micikevicius et al. 2018; NVIDIA apex ``amp`` O2 master weights; the optax
wrapper shape follows ``optax.apply_if_finite`` / ``optax.MultiSteps``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

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


def _master_dtype(p, master_dtype):
    return jnp.promote_types(p.dtype, master_dtype) if _is_float(p) else None


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
        corner case, see the module docstring); :func:`params_from_masters` gives it
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
    try:
        master_dtype = jnp.dtype(master_dtype)
    except TypeError as e:
        raise TypeError(f"master_dtype must be a floating dtype, got {master_dtype!r}.") from e
    if not jnp.issubdtype(master_dtype, jnp.floating):
        raise TypeError(f"master_dtype must be a floating dtype, got {master_dtype}.")

    def init_fn(params):
        # Always a copy (never an alias of the params), so donating params is safe.
        masters = jax.tree_util.tree_map(
            lambda p: (
                jnp.array(p, dtype=_master_dtype(p, master_dtype), copy=True)
                if hasattr(p, "dtype")
                else p
            ),
            params,
        )
        return MixedPrecisionState(masters=masters, inner_state=inner.init(masters))

    def update_fn(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "mixed_precision.update needs params (the low-precision "
                "parameters): call tx.update(grads, state, params)."
            )
        masters = state.masters
        ts_m = jax.tree_util.tree_structure(masters)
        for what, tree in (("grads", grads), ("params", params)):
            ts = jax.tree_util.tree_structure(tree)
            if ts != ts_m:
                raise ValueError(
                    f"mixed_precision: {what} structure {ts} does not match the "
                    f"master weights {ts_m} (built by init from the params)."
                )

        grads32 = jax.tree_util.tree_map(
            lambda g, m: g.astype(m.dtype) if (_is_float(g) and _is_float(m)) else g, grads, masters
        )
        if isinstance(inner, optax.GradientTransformationExtraArgs):
            inner_updates, inner_state = inner.update(
                grads32, state.inner_state, masters, **extra_args
            )
        else:
            inner_updates, inner_state = inner.update(grads32, state.inner_state, masters)
        new_masters = optax.apply_updates(masters, inner_updates)

        def param_update(p, m_new, u):
            if not (_is_float(p) and _is_float(m_new)):
                return u
            # Land on the rounded master: p + u is exact whenever this difference is exactly
            # representable (see the module docstring). It is a plain subtraction, so no
            # multiply-add contraction in the caller's jit can change the result.
            wide = m_new.dtype
            return m_new.astype(p.dtype).astype(wide) - p.astype(wide)

        updates = jax.tree_util.tree_map(param_update, params, new_masters, inner_updates)
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
            "state of a jmem.master_weights.mixed_precision optimizer."
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
