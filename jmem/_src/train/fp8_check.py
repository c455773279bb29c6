"""The step's refusal of ``jmem.Levers(fp8=True)`` that would not run FP8 matmuls.

``Levers.fp8`` records a choice (for the resolver, the planner and the printout); FP8 runs
where the loss is wrapped in ``jmem.fp8.apply`` (or calls ``jmem.fp8.fp8_dot``) with the
scaling states that ``jmem.train_step`` carries in ``TrainState.fp8`` and passes to the
loss as ``fp8=``. A step given ``levers.fp8=True`` with no metas in its state, or whose
loss has no FP8 value in its trace (the metas passed but not applied), would train in the
compute dtype with nothing said: it raises instead, when it is traced. The traced loss
tells: FP8 quantization leaves ``float8_*`` values in its jaxpr (in every sub-jaxpr:
scans, remat, custom rules, calls).
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jmem._src import fp8_meta
from jmem._src.train.precision_check import shape_specs

#: ids of the loss functions whose trace already showed FP8 values.
_checked: set[int] = set()


def _is_fp8(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1


def has_fp8_values(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` or one of its sub-jaxprs makes a ``float8_*`` value."""
    for eqn in jaxpr.eqns:
        if any(_is_fp8(v.aval) for v in eqn.outvars):
            return True
        for sub in jcore.jaxprs_in_params(eqn.params):
            if has_fp8_values(getattr(sub, "jaxpr", sub)):
                return True
    return False


def check_fp8_levers(key: Any, levers: Any, metas: Any, fn: Callable, *args: Any) -> None:
    """Raises when ``levers.fp8`` is True but the step would not run FP8 matmuls.

    Args:
      key: the user's loss function (once its trace has shown FP8 values, it is not
        traced again for this).
      levers: the step's ``jmem.Levers``/``ResolvedLevers`` or None (nothing checked).
      metas: the state's FP8 metadata (``TrainState.fp8``).
      fn: the loss as the step calls it; ``*args``: its arguments (tracers, arrays or
        ``ShapeDtypeStruct``s; traced on shapes only).

    Raises:
      ValueError: ``levers.fp8=True`` and no ``Fp8Meta`` in ``metas``, or no FP8 value in
        the traced ``fn``.
    """
    if levers is None or not levers.fp8:
        return
    if not fp8_meta.meta_paths(metas):
        raise ValueError(
            "levers.fp8=True but the state has no FP8 metas: build it with "
            "step.init(params, fp8=jmem.fp8.init_metas(params, names)) and wrap the loss in "
            "jmem.fp8.apply (docs/fp8.md), or set Levers(fp8=False)."
        )
    if id(key) in _checked:
        return
    if not has_fp8_values(jax.make_jaxpr(fn)(*shape_specs(args)).jaxpr):
        raise ValueError(
            "levers.fp8=True but the loss runs no FP8 matmul (its fp8= metas are not "
            "applied): wrap it, loss_fn=lambda p, b, *, fp8: jmem.fp8.apply(f)(p, fp8, b) "
            "(docs/fp8.md), or set Levers(fp8=False)."
        )
    _checked.add(id(key))
