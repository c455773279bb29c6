"""The implicit value of the NF4/LoRA/FP8 interpreter: a weight, its adapters, its FP8
scaling state and a lazy view.

See ``docs/lora.md`` for how the interpreter carries a ``Weight`` through a jaxpr.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src import nf4 as _nf4
from jmem._src import tree as _tree

__all__ = [
    "Adapter",
    "ImplicitWeightError",
    "Scaling",
    "Storage",
    "View",
    "Weight",
    "flatten_params",
    "is_nf4",
    "is_weight",
    "error",
]


class ImplicitWeightError(ValueError):
    """A selected (NF4 / LoRA) weight is used in a way the interpreter cannot rewrite.

    Attributes:
      weight_name: the '/'-joined path of the weight in params ("" if unknown).
    """

    def __init__(self, message: str, weight_name: str = ""):
        super().__init__(message)
        self.weight_name = weight_name


def is_nf4(x) -> bool:
    """Whether ``x`` is a ``jmem.nf4.NF4Array``."""
    return isinstance(x, _nf4.NF4Array)


def flatten_params(params):
    """Flattens a params pytree keeping ``NF4Array``s as leaves.

    Args:
      params: a params pytree (arrays, ``NF4Array`` or ``ShapeDtypeStruct`` leaves).

    Returns:
      ``([(path, leaf)], treedef)`` with ``path`` the '/'-joined key path (``tree.path_str``).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_nf4)
    return [(_tree.path_str(p), x) for p, x in leaves], treedef


def _static(default=None):
    return dataclasses.field(default=default, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class Storage:
    """How the frozen weight is stored.

    Attributes:
      base: the frozen weight ``[*L, in, out]``, an array or an ``NF4Array`` (codes, absmax).
      base_shape: static shape of ``base`` (``[*L, in, out]``).
      name: static '/'-joined path of the weight in params (for error messages).
    """

    base: Any
    base_shape: tuple = _static(())
    name: str = _static("")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The LoRA adapter of a weight (PEFT semantics: ``W + scale * a @ b``).

    Attributes:
      a, b: LoRA factors ``[*L, in, r]`` and ``[*L, r, out]``, or None (no adapter).
      key: PRNG key array ``[*L]`` (one key per stacked matrix) for LoRA dropout, or None.
      scale: static LoRA scale ``s``.
      dropout: static LoRA dropout probability on the adapter's input (used with ``key``).
    """

    a: Any = None
    b: Any = None
    key: Any = None
    scale: float = _static(1.0)
    dropout: float = _static(0.0)


@dataclasses.dataclass(frozen=True)
class View:
    """How the model sees the weight (static): the lazy cast and transpose.

    Attributes:
      dtype: view dtype (what the model cast the weight to).
      perm: view permutation: ``perm[d]`` is the original axis shown at view axis ``d``.
      via: lossy intermediate casts before ``dtype`` (``f32 -> bf16 -> f32`` rounds to bf16).
    """

    dtype: Any = _static(None)
    perm: tuple = _static(())
    via: tuple = _static(())


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How the weight's matmuls are scaled: an FP8 delayed-scaling state, or None.

    Attributes:
      meta: a ``jmem.fp8.Fp8Meta`` with ``batch_shape`` the weight's stacked shape ``[*L]``
        (one state per stacked matrix), or None (matmuls in the view dtype). Its cotangent
        is the updated state (``jmem.fp8``'s overwrite rule); the core treats it as an
        opaque pytree and the FP8 rules (``fp8_rules.py``) use it.
    """

    meta: Any = None


_UNSET = object()
_PARTS = {
    "storage": tuple(f.name for f in dataclasses.fields(Storage)),
    "adapter": tuple(f.name for f in dataclasses.fields(Adapter)),
    "scaling": tuple(f.name for f in dataclasses.fields(Scaling)),
    "view": tuple(f.name for f in dataclasses.fields(View)),
}
_CLASSES = {"storage": Storage, "adapter": Adapter, "scaling": Scaling, "view": View}


@dataclasses.dataclass(frozen=True, init=False)
class Weight:
    """A weight in four parts: ``storage`` (the array or ``NF4Array``), ``adapter``
    (LoRA factors, scale, dropout), ``scaling`` (FP8 state) and ``view`` (lazy cast and
    transpose).

    Constructed with the flat fields (``Weight(base, a=..., b=..., scale=..., name=...,
    dtype=..., perm=..., base_shape=..., via=..., key=..., dropout=..., meta=...)``), which
    also read as attributes (``w.base``, ``w.a``, ``w.meta``, ...); ``replace`` takes them
    too.
    """

    storage: Storage
    adapter: Adapter
    scaling: Scaling
    view: View

    def __init__(
        self, base=_UNSET, *, storage=None, adapter=None, scaling=None, view=None, **fields
    ):
        unknown = set(fields) - {n for names in _PARTS.values() for n in names}
        if unknown:
            raise TypeError(f"Weight has no field(s) {sorted(unknown)}.")
        parts = {"storage": storage, "adapter": adapter, "scaling": scaling, "view": view}
        if base is not _UNSET:
            fields["base"] = base
        elif storage is None:
            raise TypeError("Weight needs base= (or storage=).")
        for part, cls in _CLASSES.items():
            kw = {n: fields[n] for n in _PARTS[part] if n in fields}
            if parts[part] is None:
                parts[part] = cls(**kw)
            elif kw:
                parts[part] = dataclasses.replace(parts[part], **kw)
            object.__setattr__(self, part, parts[part])

    def __getattr__(self, name):
        for part, names in _PARTS.items():
            if name in names:
                return getattr(object.__getattribute__(self, part), name)
        raise AttributeError(f"'Weight' object has no attribute {name!r}")

    @property
    def n_lead(self) -> int:
        """Number of leading stacked axes (``len(base_shape) - 2``)."""
        return len(self.base_shape) - 2

    @property
    def shape(self) -> tuple:
        """The view shape (``base_shape`` permuted by ``perm``)."""
        return tuple(self.base_shape[p] for p in self.perm)

    def replace(self, **kw) -> "Weight":
        """A copy with the given (flat) fields replaced."""
        parts = {p: getattr(self, p) for p in _CLASSES}
        return Weight(**parts, **kw)

    def cast(self, w) -> jax.Array:
        """Casts the (dequantized) base value ``w`` through ``via`` to ``dtype``."""
        for d in self.via:
            w = w.astype(d)
        return w.astype(self.dtype)

    def dense_base(self) -> jax.Array:
        """The base weight in the view dtype (not transposed), dequantized if NF4."""
        if is_nf4(self.base):
            return self.cast(_nf4.dequantize(self.base, self.via[0] if self.via else self.dtype))
        return self.cast(self.base)

    @property
    def dropout_active(self) -> bool:
        """Whether this weight's LoRA path drops its input (a key and ``dropout > 0``)."""
        return self.a is not None and self.key is not None and self.dropout > 0

    def materialize(self) -> jax.Array:
        """The merged, dequantized weight in its view (allocates the full matrix).

        Raises:
          ImplicitWeightError: when LoRA dropout is active (it acts on the adapter's input,
            which a merged weight no longer has).
        """
        if self.dropout_active:
            raise error(
                self,
                "<materialize>",
                f"LoRA dropout ({self.dropout}) drops the adapter's input, which a merged "
                "weight cannot do; call without lora_dropout_key or use the weight only in "
                "matmuls",
            )
        w = self.dense_base()
        if self.a is not None:
            a, b = self.a.astype(jnp.float32), self.b.astype(jnp.float32)
            delta = jnp.einsum("...ir,...ro->...io", a, b) * self.scale
            w = (w.astype(jnp.float32) + delta).astype(self.dtype)
        return jnp.transpose(w, self.perm)

    def map_lead(self, f: Callable, new_lead: tuple) -> "Weight":
        """Applies ``f`` (acting on the leading stacked axes) to every field and factor.

        Args:
          f: maps an array ``[*L, ...]`` to ``[*new_lead, ...]`` (slice, squeeze, index).
          new_lead: the stacked shape after ``f``.
        """
        base = jax.tree.map(f, self.base)
        if is_nf4(base):
            base = dataclasses.replace(
                base,
                shape=tuple(new_lead) + self.base_shape[self.n_lead :],
                batch_ndim=len(new_lead) if len(new_lead) else 0,
            )
        a = None if self.a is None else f(self.a)
        b = None if self.b is None else f(self.b)
        key = None if self.key is None else f(self.key)
        meta = None if self.meta is None else jax.tree.map(f, self.meta)
        nl_new = len(new_lead)
        perm = tuple(range(nl_new)) + tuple(
            p - self.n_lead + nl_new for p in self.perm[self.n_lead :]
        )
        return self.replace(
            base=base,
            a=a,
            b=b,
            key=key,
            meta=meta,
            perm=perm,
            base_shape=tuple(new_lead) + self.base_shape[self.n_lead :],
        )

    def scan_carrier(self) -> "Weight":
        """A pytree for ``lax.scan``'s ``xs``: leaves keep the stacked axis 0, metadata
        describe one slice, so the scan rebuilds a consistent per-layer ``Weight``."""
        base = self.base
        if is_nf4(base):
            base = dataclasses.replace(
                base, shape=base.shape[1:], batch_ndim=max(base.batch_ndim - 1, 0)
            )
        perm = tuple(p - 1 for p in self.perm[1:])
        return self.replace(base=base, perm=perm, base_shape=self.base_shape[1:])


jax.tree_util.register_dataclass(Storage, data_fields=["base"], meta_fields=["base_shape", "name"])
jax.tree_util.register_dataclass(
    Adapter, data_fields=["a", "b", "key"], meta_fields=["scale", "dropout"]
)
jax.tree_util.register_dataclass(Scaling, data_fields=["meta"], meta_fields=[])
jax.tree_util.register_dataclass(View, data_fields=[], meta_fields=["dtype", "perm", "via"])
jax.tree_util.register_pytree_node(
    Weight,
    lambda w: (tuple(getattr(w, p) for p in _CLASSES), None),
    lambda _, parts: Weight(**dict(zip(_CLASSES, parts))),
)


def is_weight(x) -> bool:
    """Whether ``x`` is a ``Weight``."""
    return isinstance(x, Weight)


def error(w: Weight, prim: str, why: str = "") -> ImplicitWeightError:
    """The ``ImplicitWeightError`` for weight ``w`` reaching primitive ``prim``."""
    return ImplicitWeightError(
        f"Weight {w.name!r} (view shape {w.shape}, {jnp.dtype(w.dtype).name}) reaches primitive "
        f"{prim!r}, which jmem cannot apply to an NF4/LoRA weight without materializing it"
        f"{': ' + why if why else ''}. Use the weight only through matmuls (dot_general/einsum/@; "
        f"jax.lax.ragged_dot for a stack of experts), "
        f"optionally after astype/transpose/slicing its stacked axis, or pass "
        f"allow_materialize=True to dequantize/merge it for this operation.",
        weight_name=w.name,
    )
