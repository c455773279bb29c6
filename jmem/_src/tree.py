"""Tree helpers shared by every jmem transform: float checks, byte counts, key paths,
static/dynamic partition."""

from __future__ import annotations

import math
import re
from typing import Any
from typing import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def is_float_array(x: Any) -> bool:
    """True for an array (or ``jax.ShapeDtypeStruct``) with a floating dtype."""
    return hasattr(x, "dtype") and hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.floating)


def leaf_nbytes(x: Any) -> int:
    """Bytes of one leaf with ``shape`` and ``dtype`` (0 for anything else, e.g. None)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        return 0
    return int(math.prod(x.shape)) * np.dtype(x.dtype).itemsize


def nbytes(tree: Any) -> int:
    """Total bytes of a pytree's array leaves.

    Counts every leaf with a ``shape`` and a ``dtype`` (arrays and
    ``jax.ShapeDtypeStruct``s, the fields of ``QuantizedArray``/``NF4Array`` included), so a
    7B state can be counted from ``jax.eval_shape`` without allocating it.

    Args:
      tree: any pytree.

    Returns:
      int, bytes.
    """
    return sum(leaf_nbytes(x) for x in jax.tree.leaves(tree))


def num_elements(tree: Any) -> int:
    """Total elements of a pytree's array leaves (``shape`` products)."""
    return sum(int(math.prod(x.shape)) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def bytes_per_param(tree: Any, params: Any) -> float:
    """``nbytes(tree)`` divided by the number of elements of ``params``.

    E.g. an optimizer state's bytes per parameter: 8.0 for ``optax.adam``, about 2.03 for
    ``jmem.adamw_8bit``.

    Raises:
      ValueError: if ``params`` has no elements.
    """
    n = num_elements(params)
    if n == 0:
        raise ValueError("params has no elements; cannot compute bytes per parameter.")
    return nbytes(tree) / n


def path_str(path: tuple) -> str:
    """'/'-joined key path (``layers/q_proj/kernel``); a trailing NNX ``.value`` is dropped.

    Args:
      path: a key path from ``jax.tree_util.tree_flatten_with_path``.
    """
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if len(parts) > 1 and isinstance(path[-1], jax.tree_util.GetAttrKey) and parts[-1] == "value":
        parts = parts[:-1]
    return "/".join(parts)


def is_dynamic(x: Any) -> bool:
    """The one rule by which jmem's tracing transforms (remat, LoRA/QLoRA) split arguments.

    Arrays (``jax.Array`` and tracers, NumPy arrays and scalars, ``__jax_array__`` objects)
    are traced; everything else (Python bools, ints, floats, strings, None, functions) is
    static, so flags, lengths, rates and range bounds keep working in Python control flow
    (``x / t if t > 0 else x``). A value that must be traced is passed as an array.
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "__jax_array__")


def partition(leaves: list, static: list[bool] | None = None) -> tuple[list, Callable]:
    """Splits flat leaves into dynamic ones and a function that puts them back.

    Args:
      leaves: flat pytree leaves.
      static: optional per-leaf flags forcing a leaf static; ``is_dynamic`` decides the rest.

    Returns:
      ``(dynamic, combine)``: the dynamic leaves in order, and ``combine(new_dynamic)``
      returning the full leaf list with the static leaves in place.
    """
    if static is None:
        static = [False] * len(leaves)
    mask = [not s and is_dynamic(x) for x, s in zip(leaves, static)]
    dynamic = [x for x, d in zip(leaves, mask) if d]

    def combine(new_dynamic):
        it = iter(new_dynamic)
        return [next(it) if d else x for x, d in zip(leaves, mask)]

    return dynamic, combine


def select_tree(pred: Any, a: T, b: T) -> T:
    """Elementwise ``a if pred else b`` over two pytrees of the same structure.

    Args:
      pred: scalar boolean (``bool[]`` array or Python bool), e.g. from :func:`all_finite`.
      a, b: pytrees with the same structure and matching leaf shapes/dtypes.

    Returns:
      A tree like ``a``: each leaf is ``jax.lax.select(pred, a_leaf, b_leaf)``.

    Raises:
      ValueError: ``pred`` is not a scalar, or ``a`` and ``b`` differ in structure.
      TypeError: ``pred`` is not boolean, or two leaves differ in dtype.

    Source: ``jmp.select_tree``.
    """
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"select_tree: pred must be a scalar, got shape {pred.shape}.")
    if pred.dtype != jnp.bool_:
        raise TypeError(
            f"select_tree: pred must be boolean, got {pred.dtype}; compare first "
            "(e.g. all_finite(grads))."
        )
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if ta != tb:
        raise ValueError(f"select_tree: a and b must have the same structure, got {ta} and {tb}.")

    def sel(x, y):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.dtype != y.dtype:
            raise TypeError(f"select_tree: leaf dtypes differ ({x.dtype} vs {y.dtype}).")
        return jax.lax.select(pred, x, y)

    return jax.tree_util.tree_map(sel, a, b)


def path_predicate(targets: str | Callable[[str, Any], bool]) -> Callable[[str, Any], bool]:
    """The one rule for choosing leaves by path (LoRA, QLoRA): a predicate ``(path, leaf)``.

    Args:
      targets: a regex matched with ``re.fullmatch`` against the '/'-joined path
        (``path_str``), or a predicate ``(path, leaf) -> bool``.

    Raises:
      TypeError: ``targets`` is neither a string nor a callable.
    """
    if callable(targets):
        return lambda path, leaf: bool(targets(path, leaf))
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return lambda path, leaf: pattern.fullmatch(path) is not None
    raise TypeError(
        f"targets must be a regex string or a predicate (path, leaf) -> bool, got "
        f"{type(targets).__name__}: {targets!r}."
    )
