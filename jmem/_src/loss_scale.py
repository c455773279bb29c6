"""Loss scaling for float16 training: no-op, static and dynamic loss scales, as frozen
dataclass pytrees whose every field is a leaf (so none is lost under ``jit`` or in a
checkpoint). Design notes and the differences from jmp: ``docs/mixed_precision.md``.

Sources: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.2; jmp
(``jmp.DynamicLossScale``, ``jmp.all_finite``, ``jmp.select_tree``); PyTorch's
``torch.amp.GradScaler``.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import TypeVar
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src.tree import is_float_array as _is_float_array
from jmem._src.tree import select_tree

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "loss_scale_from_name",
    "select_tree",
]

T = TypeVar("T")

_F32 = jnp.float32


def _scale_leaf(x, s):
    if not _is_float_array(x):
        return x
    out_dtype = jnp.promote_types(x.dtype, _F32)
    return x.astype(out_dtype) * s.astype(out_dtype)


def _unscale_leaf(x, s):
    if not _is_float_array(x):
        return x
    wide = jnp.promote_types(x.dtype, _F32)
    return (x.astype(wide) / s.astype(wide)).astype(x.dtype)


def _is_python_number(x) -> bool:
    """A Python int or float (not a bool): what a user's call (or a default) passes."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _to_scalar(value, dtype, name: str) -> jax.Array:
    """``value`` as a ``dtype[]`` array; raises if it is not a scalar or not integral."""
    if np.issubdtype(dtype, np.integer) and isinstance(value, (float, np.ndarray, np.generic)):
        if _is_float_array(np.asarray(value)) and float(value) != int(value):
            raise ValueError(f"{name} must be an integer, got {value}.")
    value = jnp.asarray(value, dtype)
    if value.shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {value.shape}.")
    return value


#: Field -> (dtype, check, requirement).
_FIELDS = {
    "loss_scale": (_F32, lambda v: np.isfinite(v) and v > 0, "positive and finite"),
    "period": (jnp.int32, lambda v: v >= 1, ">= 1"),
    "factor": (_F32, lambda v: np.isfinite(v) and v >= 1, "a finite number >= 1"),
    "min_loss_scale": (_F32, lambda v: np.isfinite(v) and v > 0, "positive and finite"),
    "counter": (jnp.int32, lambda v: v >= 0, ">= 0"),
}


def _init_fields(obj, names) -> None:
    """Converts and validates the fields ``names`` of a loss scale built by a user's call.

    ``register_dataclass`` rebuilds the object through its constructor on every unflatten
    (``jit``, ``scan``, ``vmap``, ``tree_map``, ``jax.device_get``, an orbax restore), with
    leaves that may be tracers, stacked or NumPy arrays, bools, ``None`` or placeholders.
    Those are stored as they are: only an object with at least one field given as a Python
    int or float (a user's call, defaults included) is converted and checked, so no array is
    read back to the host after a jitted step.
    """
    values = [getattr(obj, n) for n in names]
    if not any(_is_python_number(v) for v in values):
        return
    for name, value in zip(names, values):
        object.__setattr__(obj, name, _to_scalar(value, _FIELDS[name][0], name))
    if any(isinstance(getattr(obj, n), jax.core.Tracer) for n in names):
        return
    for name in names:
        _, check, requirement = _FIELDS[name]
        v = getattr(obj, name).item()
        if not check(v):
            raise ValueError(f"{name} must be {requirement}, got {v}.")


def all_finite(tree: Any) -> jax.Array:
    """Returns a scalar ``bool[]`` array: True iff every floating leaf of ``tree`` is finite.

    Non-floating leaves (ints, bools, ``float0``) are ignored; an empty tree is finite.
    Works under ``jit``. Source: ``jmp.all_finite``.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale of 1 that does nothing (float32/bfloat16 training).

    A pytree with no leaves. Source: ``jmp.NoOpLossScale``.
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), _F32)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: Any) -> "NoOpLossScale":
        """Returns ``self``."""
        del grads_finite
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales the loss and unscales gradients by a fixed constant.

    Attributes:
      loss_scale: positive finite scalar; stored as a float32 ``[]`` array (the pytree's
        only leaf, so it is checkpointed and can be traced).

    Raises:
      ValueError: ``loss_scale`` is not a positive finite scalar (checked, and converted to
        float32, when given as a Python number; any other leaf is stored as it is, as on a
        pytree unflatten).

    Source: ``jmp.StaticLossScale``.
    """

    loss_scale: Any = 2.0**15

    def __post_init__(self):
        _init_fields(self, ("loss_scale",))

    def scale(self, tree: T) -> T:
        """Multiplies each floating leaf by the scale; half-precision leaves come back float32
        (``float64`` stays ``float64``)."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides each floating leaf by the scale in float32 and casts back to its dtype."""
        return jax.tree_util.tree_map(lambda x: _unscale_leaf(x, self.loss_scale), tree)

    def adjust(self, grads_finite: Any) -> "StaticLossScale":
        """Returns ``self`` (a static scale never changes)."""
        del grads_finite
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scale: grows by ``factor`` every ``period`` finite steps, shrinks on
    non-finite steps.

    Semantics of :meth:`adjust` (``S`` = ``loss_scale``, ``n`` = ``counter``)::

        if grads_finite:
          n += 1
          if n >= period:
            n = 0
            if isfinite(S * factor): S = S * factor
        else:
          n = 0
          S = max(min_loss_scale, S / factor)

    Attributes (all scalar array leaves; ``adjust`` changes only ``loss_scale`` and
    ``counter``):
      loss_scale: current scale, float32 ``[]`` (default 2**15).
      period: number of consecutive finite steps before growing, int32 ``[]`` >= 1
        (default 2000).
      factor: growth/shrink factor, float32 ``[]`` >= 1 (default 2).
      min_loss_scale: floor for shrinking, float32 ``[]`` > 0 (default 1).
      counter: finite steps since the last change, int32 ``[]`` (default 0).

    Typical use (inside a jitted train step)::

        loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, batch)))(params)
        grads = ls.unscale(grads)
        finite = all_finite(grads)
        ls = ls.adjust(finite)
        new_params, new_opt = optimizer_step(...)
        params, opt_state = select_tree(finite, (new_params, new_opt), (params, opt_state))

    Raises:
      ValueError: non-scalar fields, or (when concrete) ``loss_scale``/``min_loss_scale`` not
        positive and finite, ``period`` < 1, ``factor`` < 1 or ``counter`` < 0. Checked (and
        every field converted to its dtype) when at least one field is a Python int or
        float, as in any user call (defaults included); an object rebuilt from arrays,
        NumPy values, bools or ``None`` is stored as it is, as on a pytree unflatten.

    Source: ``jmp.DynamicLossScale`` (same rule; here every field is a leaf), Micikevicius et
    al. 2018.
    """

    loss_scale: Any = 2.0**15
    period: Any = 2000
    factor: Any = 2
    min_loss_scale: Any = 1.0
    counter: Any = 0

    def __post_init__(self):
        _init_fields(self, tuple(_FIELDS))

    def scale(self, tree: T) -> T:
        """Multiplies each floating leaf by the scale; half-precision leaves come back float32
        (so ``loss * S`` cannot overflow float16), ``float64`` stays ``float64``."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides each floating leaf by the scale in float32 and casts back to its dtype.

        Gradients of float16 *parameters* would underflow again when cast back; take
        gradients with respect to float32 parameters/masters (cast to the compute dtype inside
        the loss, see :class:`jmem.Policy`) or cast them to float32 before
        unscaling.
        """
        return jax.tree_util.tree_map(lambda x: _unscale_leaf(x, self.loss_scale), tree)

    def adjust(self, grads_finite: Any) -> "DynamicLossScale":
        """Returns the next loss scale given whether this step's gradients were finite.

        Args:
          grads_finite: scalar bool (``bool[]`` array or Python bool), e.g.
            ``all_finite(grads)``.

        Raises:
          ValueError: ``grads_finite`` is not a scalar.
          TypeError: ``grads_finite`` is not boolean.
        """
        finite = jnp.asarray(grads_finite)
        if finite.shape != ():
            raise ValueError(f"grads_finite must be a scalar bool, got shape {finite.shape}.")
        if finite.dtype != jnp.bool_:
            raise TypeError(f"grads_finite must be boolean, got {finite.dtype}.")
        count = self.counter + 1
        grow = count >= self.period
        grown = self.loss_scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        on_finite = jnp.where(grow, grown, self.loss_scale)
        on_overflow = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        new_scale = jnp.where(finite, on_finite, on_overflow).astype(_F32)
        new_counter = jnp.where(finite & ~grow, count, 0).astype(jnp.int32)
        return dataclasses.replace(self, loss_scale=new_scale, counter=new_counter)


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def loss_scale_from_name(name: str, **kwargs) -> LossScale:
    """Builds a loss scale from a name, e.g. for a CLI flag.

    Args:
      name: ``"dynamic"`` (:class:`DynamicLossScale`), ``"static"`` (:class:`StaticLossScale`)
        or ``"none"``/``"noop"`` (:class:`NoOpLossScale`); case-insensitive.
      **kwargs: passed to the class (``loss_scale=``, ``period=``, ...).

    Raises:
      ValueError: unknown name, or keyword arguments given for ``"none"``.
      TypeError: a keyword the class does not take.
    """
    key = str(name).strip().lower()
    if key == "dynamic":
        return DynamicLossScale(**kwargs)
    if key == "static":
        return StaticLossScale(**kwargs)
    if key in ("none", "noop", "no_op"):
        if kwargs:
            raise ValueError(f"NoOpLossScale takes no arguments, got {sorted(kwargs)}.")
        return NoOpLossScale()
    raise ValueError(f"Unknown loss scale {name!r}; valid names are: dynamic, static, none.")
