"""Loss scaling for float16 training: no-op, static and dynamic loss scales.

Float16 has 5 exponent bits: its smallest subnormal is 2**-24 (~6e-8) and its largest
finite value 65504, so small gradients flush to zero in the backward pass. Loss scaling
multiplies the loss by ``S`` before differentiating (so every cotangent is ``S`` times
larger and stays representable), then divides the gradients by ``S`` in float32. Dynamic
loss scaling picks the largest ``S`` that keeps gradients finite: it grows ``S`` by
``factor`` after ``period`` consecutive finite steps and shrinks it by ``factor`` (not below
``min_loss_scale``) on every non-finite step, whose update the caller skips.

Sources: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), section 3.2; jmp
(``jmp.DynamicLossScale``, ``jmp.all_finite``, ``jmp.select_tree``); PyTorch's
``torch.amp.GradScaler``.

Differences from jmp:

* Every field of :class:`DynamicLossScale` is an array leaf of the pytree (jmp keeps only
  ``loss_scale`` and ``counter``; its ``tree_unflatten`` silently resets
  ``min_loss_scale`` to 1 whenever the object passes through ``jit``/``tree_map``). Making
  ``period``, ``factor`` and ``min_loss_scale`` leaves means they survive ``jit``, are
  written into checkpoints and come back from an orbax restore with or without a target,
  and changing them does not recompile the train step. ``adjust`` never changes them.
* The scale is always a float32 array (a float16 scale overflows at 2**16), ``unscale``
  computes in float32 and casts back to each gradient's dtype, and ``scale`` returns float32
  for half-precision losses so that ``loss * S`` cannot overflow.
* Only floating-point leaves are scaled, unscaled or checked for finiteness; integer
  leaves and ``float0`` gradients pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src.tree import is_float_array as _is_float_array
from jmem._src.tree import select_tree  # noqa: F401  (re-exported)

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


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_scalar(x, name: str):
    if getattr(x, "shape", ()) != ():
        raise ValueError(f"{name} must be a scalar, got shape {x.shape}.")


def all_finite(tree: Any) -> jax.Array:
    """Returns a scalar ``bool[]`` array: True iff every floating leaf of ``tree`` is finite.

    Non-floating leaves (ints, bools, ``float0``) are ignored; an empty tree is finite.
    Works under ``jit``. Source: ``jmp.all_finite``.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if _is_float_array(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


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


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Scales the loss and unscales gradients by a fixed constant.

    Attributes:
      loss_scale: positive finite scalar; stored as a float32 ``[]`` array (the pytree's
        only leaf, so it is checkpointed and can be traced).

    Raises:
      ValueError: ``loss_scale`` is not a positive finite scalar.

    Source: ``jmp.StaticLossScale``.
    """

    loss_scale: Any = 2.0**15

    def __post_init__(self):
        s = jnp.asarray(self.loss_scale, _F32)
        _check_scalar(s, "loss_scale")
        if _is_concrete(s) and not (np.isfinite(float(s)) and float(s) > 0):
            raise ValueError(f"loss_scale must be positive and finite, got {float(s)}.")
        object.__setattr__(self, "loss_scale", s)

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
        positive and finite, ``period`` < 1 or ``factor`` < 1.

    Source: ``jmp.DynamicLossScale`` (same rule; here every field is a leaf), Micikevicius et
    al. 2018.
    """

    loss_scale: Any = 2.0**15
    period: Any = 2000
    factor: Any = 2
    min_loss_scale: Any = 1.0
    counter: Any = 0

    def __post_init__(self):
        conv = {
            "loss_scale": _F32,
            "period": jnp.int32,
            "factor": _F32,
            "min_loss_scale": _F32,
            "counter": jnp.int32,
        }
        for name, dtype in conv.items():
            v = getattr(self, name)
            if dtype == jnp.int32 and _is_concrete(v) and _is_float_array(np.asarray(v)):
                if float(np.asarray(v)) != int(np.asarray(v)):
                    raise ValueError(f"{name} must be an integer, got {v}.")
            v = jnp.asarray(v, dtype)
            _check_scalar(v, name)
            object.__setattr__(self, name, v)
        if all(_is_concrete(getattr(self, n)) for n in conv):
            s, m = float(self.loss_scale), float(self.min_loss_scale)
            if not (np.isfinite(s) and s > 0):
                raise ValueError(f"loss_scale must be positive and finite, got {s}.")
            if not (np.isfinite(m) and m > 0):
                raise ValueError(f"min_loss_scale must be positive and finite, got {m}.")
            if int(self.period) < 1:
                raise ValueError(f"period must be >= 1, got {int(self.period)}.")
            if not (np.isfinite(float(self.factor)) and float(self.factor) >= 1):
                raise ValueError(f"factor must be a finite number >= 1, got {float(self.factor)}.")
            if int(self.counter) < 0:
                raise ValueError(f"counter must be >= 0, got {int(self.counter)}.")

    def scale(self, tree: T) -> T:
        """Multiplies each floating leaf by the scale; half-precision leaves come back float32
        (so ``loss * S`` cannot overflow float16), ``float64`` stays ``float64``."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divides each floating leaf by the scale in float32 and casts back to its dtype.

        Gradients of float16 *parameters* would underflow again when cast back; take
        gradients with respect to float32 parameters/masters (cast to the compute dtype inside
        the loss, see :class:`jmem.precision.Policy`) or cast them to float32 before
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
        return _replace_leaves(self, loss_scale=new_scale, counter=new_counter)


_DYNAMIC_FIELDS = ("loss_scale", "period", "factor", "min_loss_scale", "counter")


def _replace_leaves(obj, **changes):
    new = object.__new__(type(obj))
    for f in _DYNAMIC_FIELDS:
        object.__setattr__(new, f, changes.get(f, getattr(obj, f)))
    return new


def _dynamic_flatten_with_keys(x: DynamicLossScale):
    return tuple((jax.tree_util.GetAttrKey(f), getattr(x, f)) for f in _DYNAMIC_FIELDS), None


def _dynamic_flatten(x: DynamicLossScale):
    return tuple(getattr(x, f) for f in _DYNAMIC_FIELDS), None


def _dynamic_unflatten(aux, children):
    # Bypass __post_init__: under jit/tree_map the children may be tracers, None or
    # placeholder objects, which must be stored as they are.
    del aux
    new = object.__new__(DynamicLossScale)
    for f, c in zip(_DYNAMIC_FIELDS, children):
        object.__setattr__(new, f, c)
    return new


def _static_flatten_with_keys(x: StaticLossScale):
    return ((jax.tree_util.GetAttrKey("loss_scale"), x.loss_scale),), None


def _static_unflatten(aux, children):
    del aux
    new = object.__new__(StaticLossScale)
    object.__setattr__(new, "loss_scale", children[0])
    return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale, _dynamic_flatten_with_keys, _dynamic_unflatten, _dynamic_flatten
)
jax.tree_util.register_pytree_with_keys(
    StaticLossScale, _static_flatten_with_keys, _static_unflatten, lambda x: ((x.loss_scale,), None)
)
jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda x: ((), None), lambda aux, children: NoOpLossScale()
)

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
