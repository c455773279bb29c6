"""FP8 delayed-scaling state: per-tensor scales and amax histories (``Fp8TensorMeta``), one
matmul's state (``Fp8Meta``), their initialization for a params pytree, and the scale and
history update of each step, with NVIDIA Transformer Engine's ``DelayedScaling`` recipe
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433; flax
``fp8_ops``). The matmul is ``fp8_dot.py``, the transform ``fp8_apply.py``; recipe, state
layout and limits: ``docs/fp8.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops

from jmem._src import tree as _tree

__all__ = [
    "E4M3",
    "E5M2",
    "AMAX_COMPUTE_ALGOS",
    "DEFAULT_HISTORY_LEN",
    "Fp8TensorMeta",
    "Fp8Meta",
    "init_meta",
    "init_metas",
    "is_meta",
    "partition",
    "combine",
    "meta_paths",
    "amax_from_history",
    "compute_scale_inv",
    "roll_history",
    "update_tensor_meta",
    "quantize",
]

#: FP8 format of the forward operands (``x`` and ``kernel``): 4 exponent, 3 mantissa bits.
E4M3 = jnp.float8_e4m3fn
#: FP8 format of the output gradient: 5 exponent, 2 mantissa bits.
E5M2 = jnp.float8_e5m2
#: How a scale's amax is taken from the history (Transformer Engine's ``amax_compute_algo``).
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
#: Default amax history length, in steps (Transformer Engine's ``amax_history_len``).
DEFAULT_HISTORY_LEN = 1024


class Fp8TensorMeta(NamedTuple):
    """Delayed-scaling state of one tensor (or a stack of them).

    Attributes:
        scale_inv: float32 ``[*batch]``; ``1 / scale = amax * 2**margin / fp8_max``, the
            factor that dequantizes (quantize divides by it).
        amax_history: float32 ``[*batch, history_len]``; index 0 is the newest amax.
    """

    scale_inv: jax.Array
    amax_history: jax.Array

    @property
    def scale(self) -> jax.Array:
        """The TE ``scale`` (``fp8_max / amax / 2**margin``) = ``1 / scale_inv``."""
        return 1.0 / self.scale_inv


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["x", "kernel", "grad"],
    meta_fields=["amax_compute_algo", "margin"],
)
@dataclasses.dataclass(frozen=True)
class Fp8Meta:
    """FP8 scaling state of one matmul ``x @ kernel`` (a pytree; or a stack of them).

    Attributes:
        x: state of the input (E4M3).
        kernel: state of the weights (E4M3).
        grad: state of the output gradient (E5M2).
        amax_compute_algo: ``"max"`` (max over the history) or ``"most_recent"``; static.
        margin: the scale is divided by ``2**margin`` (headroom); static.
    """

    x: Fp8TensorMeta
    kernel: Fp8TensorMeta
    grad: Fp8TensorMeta
    amax_compute_algo: str = "max"
    margin: float = 0

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading stack dims (``()`` for one matmul, ``(L,)`` for per-layer metas)."""
        return tuple(self.x.scale_inv.shape)

    @property
    def history_len(self) -> int:
        return int(self.x.amax_history.shape[-1])


def _check_recipe(history_len: int, amax_compute_algo: str, margin) -> None:
    if not isinstance(history_len, (int, np.integer)) or history_len < 1:
        raise ValueError(f"history_len must be a positive int; got {history_len!r}.")
    if amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}; got {amax_compute_algo!r}."
        )
    if not isinstance(margin, (int, float, np.integer, np.floating)) or not np.isfinite(margin):
        raise ValueError(
            f"margin must be a finite number (a power-of-two exponent, usually 0); got {margin!r}."
        )


def init_meta(
    history_len: int = DEFAULT_HISTORY_LEN,
    *,
    amax_compute_algo: str = "max",
    margin: float = 0,
    batch_shape: Sequence[int] = (),
) -> Fp8Meta:
    """Fresh scaling state for one matmul (``batch_shape=(L,)``: a stack of ``L``).

    Every tensor starts with ``scale_inv = 1`` and an all-zero amax history
    (Transformer Engine's initialization): the first step quantizes unscaled, and the
    scales follow the data from the second step on.

    Args:
        history_len: amax history length (TE's ``amax_history_len``), in steps.
        amax_compute_algo: ``"max"`` or ``"most_recent"`` (TE's ``amax_compute_algo``).
        margin: scale headroom exponent, ``scale = fp8_max / amax / 2**margin``.
        batch_shape: leading stack dims of every leaf.

    Returns:
        An ``Fp8Meta`` with float32 leaves ``scale_inv [*batch_shape]`` and
        ``amax_history [*batch_shape, history_len]`` for ``x``, ``kernel`` and ``grad``.

    Raises:
        ValueError: for a non-positive ``history_len``, an unknown ``amax_compute_algo`` or
            a non-finite ``margin``.
    """
    _check_recipe(history_len, amax_compute_algo, margin)
    batch_shape = tuple(int(d) for d in batch_shape)

    def one():
        return Fp8TensorMeta(
            jnp.ones(batch_shape, jnp.float32),
            jnp.zeros(batch_shape + (int(history_len),), jnp.float32),
        )

    return Fp8Meta(one(), one(), one(), amax_compute_algo, margin)


def init_metas(
    params: Any,
    targets: Sequence[str] | Callable[[str, Any], bool],
    *,
    history_len: int = DEFAULT_HISTORY_LEN,
    amax_compute_algo: str = "max",
    margin: float = 0,
) -> Any:
    """Scaling states for the matmul kernels of a params pytree, stacked where they are.

    A kernel ``[*stack, in, out]`` (e.g. ``[L, in, out]`` for layers stacked on a
    leading axis and run under ``lax.scan``) gets an ``Fp8Meta`` with
    ``batch_shape = stack``: one state per layer, which ``lax.scan`` slices together
    with the kernel when passed as ``xs``.

    Args:
        params: the params pytree (arrays or ``jax.ShapeDtypeStruct``).
        targets: module names (a leaf is selected when one of its path components equals
            a name and its last component is ``"kernel"``, e.g. ``("q_proj", "down_proj")``
            selects ``layers/q_proj/kernel``), or a predicate ``(path, leaf) -> bool`` with
            ``path`` the ``/``-joined key names.
        history_len, amax_compute_algo, margin: see ``init_meta``.

    Returns:
        A pytree with ``params``' structure: an ``Fp8Meta`` at each selected leaf and
        ``None`` elsewhere.

    Raises:
        ValueError: if a selected leaf has fewer than 2 dims, a name in ``targets``
            selects nothing (probably a typo), or the recipe arguments are invalid.
        TypeError: if ``targets`` is a single string or neither names nor a callable.
    """
    _check_recipe(history_len, amax_compute_algo, margin)
    if isinstance(targets, str):
        raise TypeError(
            f"targets must be a sequence of names or a callable, not the string "
            f"{targets!r}; write ({targets!r},)."
        )
    if callable(targets):
        names, pred = None, _tree.path_predicate(targets)
    else:
        names = tuple(targets)
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"targets must be strings (module names) or a callable; got {names!r}.")

        def pred(path, leaf):
            parts = path.split("/")
            return parts[-1] == "kernel" and any(p in names for p in parts)

    used: set[str] = set()

    def make(path, leaf):
        p = _tree.path_str(path)
        if not pred(p, leaf):
            return None
        shape = tuple(leaf.shape)
        if len(shape) < 2:
            raise ValueError(f"{p} has shape {shape}; FP8 targets must be kernels [..., in, out].")
        if names is not None:
            used.update(n for n in p.split("/") if n in names)
        return init_meta(
            history_len, amax_compute_algo=amax_compute_algo, margin=margin, batch_shape=shape[:-2]
        )

    metas = jax.tree_util.tree_map_with_path(make, params)
    if names is not None and set(names) - used:
        raise ValueError(
            f"targets {sorted(set(names) - used)} matched no '.../<name>/.../kernel' "
            f"leaf of params; check the names."
        )
    return metas


def is_meta(x: Any) -> bool:
    """True for an ``Fp8Meta`` (use as ``is_leaf`` in ``jax.tree`` functions)."""
    return isinstance(x, Fp8Meta)


def partition(tree: Any) -> tuple[Any, Any]:
    """Splits a tree into ``(rest, metas)``: ``Fp8Meta`` subtrees vs. everything else.

    Each output keeps ``tree``'s structure with ``None`` in place of the other part, so
    ``rest`` can go to an optax optimizer and ``metas`` (from ``jax.grad``: the *new*
    states) replace the old ones unchanged. ``combine`` is the inverse.
    """
    rest = jax.tree.map(lambda x: None if is_meta(x) else x, tree, is_leaf=is_meta)
    metas = jax.tree.map(lambda x: x if is_meta(x) else None, tree, is_leaf=is_meta)
    return rest, metas


def combine(rest: Any, metas: Any) -> Any:
    """Inverse of ``partition``: fills the ``None`` holes of ``rest`` from ``metas``."""
    return jax.tree.map(
        lambda r, m: m if r is None else r, rest, metas, is_leaf=lambda x: x is None or is_meta(x)
    )


def meta_paths(metas: Any) -> dict[str, Fp8Meta]:
    """``{path: Fp8Meta}`` of a metas tree (``init_metas``: an ``Fp8Meta`` at each selected
    leaf, ``None`` elsewhere), ``path`` the '/'-joined key path of the kernel it scales.

    Raises:
      TypeError: a leaf of ``metas`` that is neither an ``Fp8Meta`` nor None.
    """
    leaves = jax.tree_util.tree_flatten_with_path(metas, is_leaf=is_meta)[0]
    bad = [_tree.path_str(p) for p, m in leaves if not is_meta(m)]
    if bad:
        raise TypeError(
            f"metas must hold only Fp8Meta (from fp8.init_metas) and None; got other leaves "
            f"at {bad[:5]}."
        )
    return {_tree.path_str(p): m for p, m in leaves}


# --------------------------------------------------------------------------------------
# Scale and history updates.


def amax_from_history(amax_history: jax.Array, amax_compute_algo: str = "max") -> jax.Array:
    """The amax a scale is computed from. ``[*batch, H]`` -> ``[*batch]`` float32."""
    if amax_compute_algo == "max":
        return jnp.max(amax_history, axis=-1)
    if amax_compute_algo == "most_recent":
        return amax_history[..., 0]
    raise ValueError(
        f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}; got {amax_compute_algo!r}."
    )


def compute_scale_inv(
    amax: jax.Array, prev_scale_inv: jax.Array, fp8_dtype, margin: float = 0
) -> jax.Array:
    """``1 / (fp8_max / amax / 2**margin)``, keeping ``prev_scale_inv`` (else 1) when
    ``amax`` is 0 or not finite or the result is not finite and positive. float32.

    Source: Transformer Engine's delayed-scaling update (via flax ``compute_scale``).
    """
    prev = prev_scale_inv.astype(jnp.float32)
    prev_ok = jnp.isfinite(prev) & (prev > 0)
    prev = jnp.where(prev_ok, prev, jnp.ones_like(prev))
    fp8_max = fp8_ops.get_fp8_max(fp8_dtype, jnp.float32)
    s = fp8_ops.compute_scale(amax.astype(jnp.float32), prev, fp8_max, margin)
    return jnp.where(jnp.isfinite(s) & (s > 0), s, prev)


def roll_history(amax_history: jax.Array, amax: jax.Array) -> jax.Array:
    """Puts ``amax [*batch]`` at index 0 and shifts older entries up (oldest drops)."""
    return jnp.concatenate(
        [amax[..., None].astype(amax_history.dtype), amax_history[..., :-1]], axis=-1
    )


def update_tensor_meta(
    x: jax.Array, meta: Fp8TensorMeta, fp8_dtype, amax_compute_algo: str, margin: float
) -> Fp8TensorMeta:
    """One delayed-scaling step for tensor ``x`` (unstacked meta).

    Returns ``Fp8TensorMeta(scale_inv to quantize x with now, history with amax(|x|)
    at index 0)``. A non-finite ``amax(|x|)`` is recorded as 0.
    """
    scale_inv = compute_scale_inv(
        amax_from_history(meta.amax_history, amax_compute_algo), meta.scale_inv, fp8_dtype, margin
    )
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    return Fp8TensorMeta(scale_inv, roll_history(meta.amax_history.astype(jnp.float32), amax))


def quantize(x: jax.Array, scale_inv: jax.Array, fp8_dtype) -> jax.Array:
    """``fp8(clip(x / scale_inv, +-fp8_max))`` computed in float32 (flax ``quantize``)."""
    return fp8_ops.quantize(x.astype(jnp.float32), fp8_dtype, scale_inv, jnp.float32)
