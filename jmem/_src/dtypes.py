"""Dtype names: one table for precision policies, the planner and the CLI."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

# Canonical name first; the first name is what ``str(policy)`` prints.
_DTYPE_NAMES: dict[Any, tuple[str, ...]] = {
    jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    jnp.dtype(jnp.float16): ("f16", "fp16", "float16", "half"),
    jnp.dtype(jnp.float32): ("f32", "fp32", "float32", "full", "single"),
    jnp.dtype(jnp.float64): ("f64", "fp64", "float64", "double"),
}
_NAME_TO_DTYPE: dict[str, Any] = {
    name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names
}
# Storage-only names the planner also accepts (bytes per element).
_STORAGE_NAMES: dict[str, int] = {"fp8": 1, "float8": 1, "int8": 1}


def parse_dtype(name: str):
    """Parses a dtype name into a floating ``np.dtype``.

    Accepted names (case-insensitive): ``bf16``/``bfloat16``; ``f16``/``fp16``/``float16``/
    ``half``; ``f32``/``fp32``/``float32``/``full``/``single``; ``f64``/``fp64``/``float64``/
    ``double``.

    Raises:
      TypeError: ``name`` is not a string.
      ValueError: unknown name; the message lists the valid ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"dtype name must be a string, got {type(name).__name__}: {name!r}.")
    key = name.strip().lower()
    try:
        return _NAME_TO_DTYPE[key]
    except KeyError:
        valid = ", ".join(sorted(_NAME_TO_DTYPE))
        raise ValueError(f"Unknown dtype name {name!r}; valid names are: {valid}.") from None


def dtype_name(dtype) -> str:
    """Short canonical name of a floating dtype (``"bf16"``, ``"f16"``, ``"f32"``, ``"f64"``);
    other dtypes fall back to ``np.dtype(dtype).name``."""
    d = jnp.dtype(dtype)
    names = _DTYPE_NAMES.get(d)
    return names[0] if names else d.name


def itemsize(name: Any, what: str = "dtype") -> int:
    """Bytes per element of a dtype or dtype name (``"bf16"`` -> 2, ``"fp8"`` -> 1).

    Raises:
      ValueError: unknown name; the message lists the valid ones.
    """
    key = str(getattr(name, "name", name)).strip().lower()
    if key in _STORAGE_NAMES:
        return _STORAGE_NAMES[key]
    if key in _NAME_TO_DTYPE:
        return _NAME_TO_DTYPE[key].itemsize
    try:
        return np.dtype(key).itemsize
    except TypeError:
        valid = sorted(set(_NAME_TO_DTYPE) | set(_STORAGE_NAMES))
        raise ValueError(f"{what}={name!r} is not a known dtype; use one of {valid}.") from None
