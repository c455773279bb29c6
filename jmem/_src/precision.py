"""Mixed-precision policies: the dtypes parameters, compute and outputs use, a jmp-style
string grammar, and casts that touch floating-point leaves only (grammar and the differences
from jmp: ``docs/mixed_precision.md``).

Source: jmp (``jmp.Policy``, https://github.com/google-deepmind/jmp); Micikevicius et al.,
"Mixed Precision Training" (ICLR 2018).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src.dtypes import dtype_name
from jmem._src.dtypes import parse_dtype

T = TypeVar("T")

_KEYS = {
    "p": "param_dtype",
    "param": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "out": "output_dtype",
    "output": "output_dtype",
}


def _is_floating_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _as_float_dtype(dtype, what: str):
    """Normalises ``dtype`` (a dtype, a scalar type or a name) to a floating ``np.dtype``."""
    if isinstance(dtype, str):
        return parse_dtype(dtype)
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise TypeError(
            f"{what} must be a floating dtype (e.g. jnp.bfloat16 or 'bf16'), got {dtype!r}."
        ) from e
    if not _is_floating_dtype(d):
        raise TypeError(f"{what} must be a floating dtype (e.g. jnp.bfloat16 or 'bf16'), got {d}.")
    return d


def _cast_leaf(x, dtype):
    if isinstance(x, jax.ShapeDtypeStruct):
        if _is_floating_dtype(x.dtype):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and _is_floating_dtype(x.dtype):
        if x.dtype == dtype:
            return x
        if isinstance(x, (np.ndarray, np.generic)):
            return np.asarray(x).astype(dtype)
        return x.astype(dtype)
    return x


def cast_floating(tree: T, dtype) -> T:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``.

    Args:
      tree: any pytree. Leaves that are ``jax.Array``/``np.ndarray``/``np.generic`` with a
        floating dtype (float64/32/16, bfloat16, float8 variants) are cast with ``astype``
        (NumPy leaves stay NumPy); floating ``jax.ShapeDtypeStruct`` leaves get the new dtype
        with the same shape and sharding. Everything else (int, uint8 codes, bool, Python
        scalars, ``None``) is returned as is. Leaves already in ``dtype`` are returned
        unchanged (no copy).
      dtype: target floating dtype: a dtype, scalar type or a name accepted by
        :func:`parse_dtype` (``"bf16"``, ``"f32"``, ...).

    Returns:
      A tree of the same structure and shapes.

    Raises:
      TypeError: ``dtype`` is not a floating dtype.
      ValueError: ``dtype`` is an unknown name.

    Source: ``jmp._src.policy._cast_floating_to`` (same rule: only floating leaves move).
    """
    dtype = _as_float_dtype(dtype, "dtype")
    return jax.tree_util.tree_map(lambda x: _cast_leaf(x, dtype), tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: the dtypes of parameters, computation and outputs.

    Attributes:
      param_dtype: dtype parameters are stored in (e.g. float32, or bfloat16 together with
        :func:`jmem.mixed_precision` float32 master weights).
      compute_dtype: dtype of the forward/backward computation (e.g. bfloat16).
      output_dtype: dtype of the model outputs (e.g. float32 for the logits and loss).

    Dtypes may be given as dtypes, scalar types (``jnp.bfloat16``) or names (``"bf16"``);
    they are normalised to ``np.dtype`` so that policies compare and hash by value.

    Raises:
      TypeError: a field is not a floating dtype.
      ValueError: a field is an unknown dtype name.

    Source: ``jmp.Policy`` (same three fields and casting methods).
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _as_float_dtype(getattr(self, f), f))

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``param_dtype`` (others untouched)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``compute_dtype`` (others untouched)."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating leaves of ``tree`` to ``output_dtype`` (others untouched)."""
        return cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype) -> "Policy":
        """Returns a copy of this policy with a different ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        return (
            f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
            f"output={dtype_name(self.output_dtype)}"
        )


def get_policy(policy: str | Policy) -> Policy:
    """Parses a policy string such as ``"params=float32,compute=bfloat16,output=float32"``.

    Grammar (jmp's, plus long/short keys and whitespace tolerance):

    * comma-separated ``key=dtype`` pairs; keys ``p``/``param``/``params``,
      ``c``/``compute``, ``o``/``out``/``output``; dtype names as in :func:`parse_dtype`.
      Missing keys default as in jmp: params default to float32, compute follows params and
      output follows compute; e.g. ``"c=bf16"`` is ``params=f32,compute=bf16,output=bf16``
      and ``"p=f32,c=bf16,o=f32"`` is the usual mixed-precision recipe.
    * a single dtype name without ``=`` (``"bf16"``, ``"half"``) means all three dtypes.

    ``str(policy)`` prints a string that parses back to an equal policy. A :class:`Policy`
    argument is returned unchanged.

    Raises:
      TypeError: ``policy`` is neither a string nor a :class:`Policy`.
      ValueError: empty string, malformed pair, unknown or repeated key, or unknown dtype
        name; the message lists the valid keys/names.

    Source: ``jmp.get_policy``.
    """
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a string like 'p=f32,c=bf16,o=f32' or a Policy, got "
            f"{type(policy).__name__}."
        )
    text = policy.strip()
    if not text:
        raise ValueError(
            "Empty policy string; use e.g. 'params=f32,compute=bf16,output=f32' "
            "or a single dtype name such as 'bf16'."
        )
    if "=" not in text:
        d = parse_dtype(text)
        return Policy(d, d, d)
    found: dict[str, Any] = {}
    for part in text.split(","):
        part = part.strip()
        if part.count("=") != 1:
            raise ValueError(
                f"Malformed entry {part!r} in policy {policy!r}: expected "
                "'key=dtype' pairs separated by commas, e.g. 'p=f32,c=bf16,o=f32'."
            )
        key, value = (s.strip() for s in part.split("="))
        field = _KEYS.get(key.lower())
        if field is None:
            raise ValueError(
                f"Unknown key {key!r} in policy {policy!r}; valid keys are: "
                f"{', '.join(sorted(_KEYS))}."
            )
        if field in found:
            raise ValueError(f"Key {key!r} ({field}) given twice in policy {policy!r}.")
        found[field] = parse_dtype(value)
    param = found.get("param_dtype", jnp.dtype(jnp.float32))
    compute = found.get("compute_dtype", param)
    output = found.get("output_dtype", compute)
    return Policy(param, compute, output)
