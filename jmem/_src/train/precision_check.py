"""The once-per-process warning when a 16-bit precision policy does not reach the matmuls.

``train_step(precision=...)`` casts the trainable params to the policy's compute dtype
before calling the loss; a module that pinned its computation dtype at construction undoes
that silently: Flax NNX's ``nnx.Embed`` stores ``dtype=float32`` (from ``param_dtype``) when
``dtype`` is not given, so its output is float32 whatever its table's dtype, and every
``nnx.Linear`` after it promotes back to float32. The traced loss tells: its
``dot_general`` equations (in every sub-jaxpr: scans, remat, custom rules, calls) and their
operand dtypes. Source: the dtype semantics of ``flax.nnx.Embed``/``nnx.Linear``
(``dtype`` vs ``param_dtype``) and JAX's type promotion.
"""

from __future__ import annotations

import warnings
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

#: ids of the loss functions already checked (each is traced once per process for this).
_checked: set[int] = set()

_WIDE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def _dots(jaxpr: Any, counts: list[int]) -> list[int]:
    """``[dots, dots with every operand float32/64]`` of ``jaxpr`` and its sub-jaxprs
    (each body counted once, as traced)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            counts[0] += 1
            dtypes = [jnp.dtype(v.aval.dtype) for v in eqn.invars]
            counts[1] += all(d in _WIDE for d in dtypes)
        for sub in jcore.jaxprs_in_params(eqn.params):
            _dots(getattr(sub, "jaxpr", sub), counts)
    return counts


def shape_specs(args: Any) -> Any:
    """``args`` with every array, tracer or ``ShapeDtypeStruct`` leaf as a
    ``ShapeDtypeStruct`` of its shape and dtype (other leaves as given)."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) if hasattr(x, "dtype") else x
        ),
        args,
    )


def wide_dots(fn: Callable, *args: Any) -> tuple[int, int]:
    """``(float32 dots, all dots)`` of ``fn(*args)`` traced on the shapes and dtypes of
    ``args`` (arrays, tracers or ``ShapeDtypeStruct``s; nothing is computed)."""
    closed = jax.make_jaxpr(fn)(*shape_specs(args))
    total, wide = _dots(closed.jaxpr, [0, 0])
    return wide, total


def warn_if_precision_ignored(key: Any, compute_dtype: Any, fn: Callable, *args: Any) -> None:
    """Warns once (per ``key``, e.g. the user's loss function) when ``compute_dtype`` is a
    16-bit float but the traced ``fn(*args)`` (the loss on params already cast to it) has
    matmuls whose operands are all float32: the policy does not apply to them.

    Args:
      key: what is checked once (its ``id``).
      compute_dtype: the precision policy's compute dtype.
      fn: the loss as the step calls it (casting included).
      *args: its arguments (tracers inside a jitted step, arrays or ShapeDtypeStructs).
    """
    dtype = jnp.dtype(compute_dtype)
    if id(key) in _checked or dtype.itemsize != 2 or not jnp.issubdtype(dtype, jnp.floating):
        return
    _checked.add(id(key))
    wide, total = wide_dots(fn, *args)
    if wide:
        warnings.warn(
            f"train_step(precision=...): the compute dtype is {dtype.name} but {wide} of the "
            f"{total} matmuls in the traced loss run in float32, so the policy does not apply "
            "to them (no memory or speed saved). Likely cause: a module that pinned its dtype "
            "at construction: flax nnx.Embed without dtype= computes in its param_dtype "
            "(float32) and every nnx.Linear after it promotes back to float32; build them "
            f"with dtype=jnp.{dtype.name} (param_dtype stays float32), see "
            "docs/mixed_precision.md.",
            stacklevel=4,
        )
