"""FP8 matmuls with delayed (per-tensor, amax-history) scaling.

``fp8_dot(x, kernel, meta)`` quantizes both operands to E4M3 and, in the backward pass, the
output gradient to E5M2 (the "hybrid" format of Micikevicius et al. 2022, "FP8 Formats for
Deep Learning", arXiv:2209.05433), with NVIDIA Transformer Engine's ``DelayedScaling``
recipe; the updated ``Fp8Meta`` is returned as the meta's gradient (flax ``fp8_ops``'s
"overwrite with gradient"). Recipe, state layout and limits: ``docs/fp8.md``.
"""

from __future__ import annotations

import contextvars
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
from jax import lax

from jmem._src import jax_compat as _compat
from jmem._src import tree as _tree

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


# --------------------------------------------------------------------------------------
# The FP8 matmul.


class Fp8DotConfig(NamedTuple):
    """The static part of one ``fp8_dot_general`` call (hashable).

    Attributes:
        dimension_numbers: as ``lax.dot_general`` (tuples of ints).
        out_dtype: dtype of the result.
        x_dtype, k_dtype: dtypes of ``x`` and ``kernel`` (and of their gradients).
        amax_compute_algo, margin: the meta's recipe (``Fp8Meta`` static fields).
    """

    dimension_numbers: tuple
    out_dtype: Any
    x_dtype: Any
    k_dtype: Any
    amax_compute_algo: str
    margin: float

    def unflatten_meta(self, leaves: Sequence[jax.Array]) -> Fp8Meta:
        """Rebuilds the ``Fp8Meta`` from its 6 leaves (``jax.tree.leaves`` order)."""
        xs, xh, ks, kh, gs, gh = leaves
        return Fp8Meta(
            Fp8TensorMeta(xs, xh),
            Fp8TensorMeta(ks, kh),
            Fp8TensorMeta(gs, gh),
            self.amax_compute_algo,
            self.margin,
        )


def fp8_bits(t: jax.Array, scale_inv: jax.Array, fp8_dtype=E4M3) -> jax.Array:
    """``quantize(t, scale_inv, fp8_dtype)`` bit-cast to ``uint8`` (the residual format).

    Saved FP8 residuals travel as ``uint8``: under ``jax.checkpoint``, JAX wraps every
    saved floating residual in ``reduce_precision(finfo(dtype))``, which on XLA:CPU (jax
    0.10) flushes ``float8_e4m3fn`` subnormals to zero and so changed the forward result.
    The bit-cast is free (same width) and integers are left alone.
    """
    return lax.bitcast_convert_type(quantize(t, scale_inv, fp8_dtype), jnp.uint8)


def fp8_dot_forward(cfg: Fp8DotConfig, x: jax.Array, kernel: jax.Array, meta: Fp8Meta):
    """Forward rule of ``fp8_dot_general``: ``(y, residuals)``.

    ``residuals = (qx, qk, x_meta, k_meta, grad_meta)``: ``qx``/``qk`` are the E4M3
    operands as ``uint8`` (``fp8_bits``), ``x_meta``/``k_meta`` the updated states used
    to quantize them, ``grad_meta`` the incoming (not yet updated) gradient state.
    Exposed so that the implicit-weight interpreter (``jmem._src.implicit``) can wrap it in its own
    ``custom_vjp`` (e.g. to recompute ``qk`` in the backward pass from a compact weight).
    """
    x_meta = update_tensor_meta(x, meta.x, E4M3, cfg.amax_compute_algo, cfg.margin)
    k_meta = update_tensor_meta(kernel, meta.kernel, E4M3, cfg.amax_compute_algo, cfg.margin)
    qx = quantize(x, x_meta.scale_inv, E4M3)
    qk = quantize(kernel, k_meta.scale_inv, E4M3)
    y = lax.dot_general(qx, qk, cfg.dimension_numbers, preferred_element_type=jnp.float32)
    y = fp8_ops.dequantize(y, jnp.float32, x_meta.scale_inv * k_meta.scale_inv)
    res = (
        lax.bitcast_convert_type(qx, jnp.uint8),
        lax.bitcast_convert_type(qk, jnp.uint8),
        x_meta,
        k_meta,
        meta.grad,
    )
    return y.astype(cfg.out_dtype), res


def fp8_dot_backward(cfg: Fp8DotConfig, res, g: jax.Array):
    """Backward rule of ``fp8_dot_general``: ``(grad_x, grad_kernel, new_meta)`` from the
    residuals of ``fp8_dot_forward`` and the output cotangent ``g``."""
    qx, qk, x_meta, k_meta, g_meta = res
    qx, qk = lax.bitcast_convert_type(qx, E4M3), lax.bitcast_convert_type(qk, E4M3)
    algo, margin, dn = cfg.amax_compute_algo, cfg.margin, cfg.dimension_numbers
    g_meta = update_tensor_meta(g, g_meta, E5M2, algo, margin)
    qg = quantize(g, g_meta.scale_inv, E5M2)
    gx = fp8_ops.dot_general_transpose_lhs(
        qg, qx, qk, dimension_numbers=dn, precision=None, preferred_element_type=jnp.float32
    )
    gx = fp8_ops.dequantize(gx, jnp.float32, g_meta.scale_inv * k_meta.scale_inv)
    gk = fp8_ops.dot_general_transpose_rhs(
        qg, qx, qk, dimension_numbers=dn, precision=None, preferred_element_type=jnp.float32
    )
    gk = fp8_ops.dequantize(gk, jnp.float32, g_meta.scale_inv * x_meta.scale_inv)
    new_meta = Fp8Meta(x_meta, k_meta, g_meta, algo, margin)
    return gx.astype(cfg.x_dtype), gk.astype(cfg.k_dtype), new_meta


_CONFIG_ATTR = "_jmem_fp8_dot_config"


@functools.lru_cache(maxsize=None)
def _fp8_dg(cfg: Fp8DotConfig) -> Callable:
    """The ``custom_vjp`` FP8 matmul for one static config (cached per config).

    Its backward function carries ``cfg`` as an attribute: the ``custom_vjp_call``
    equation of a traced ``fp8_dot_general`` holds it in ``params["bwd"]``, which is how
    ``dot_config_of`` (and so ``jmem._src.implicit``) recognizes an FP8 matmul in a jaxpr.
    """

    def fwd(x, kernel, meta):
        return fp8_dot_forward(cfg, x, kernel, meta)

    def bwd(res, g):
        return fp8_dot_backward(cfg, res, g)

    def fp8_dg(x, kernel, meta):
        return fp8_dot_forward(cfg, x, kernel, meta)[0]

    setattr(bwd, _CONFIG_ATTR, cfg)
    f = jax.custom_vjp(fp8_dg)
    f.defvjp(fwd, bwd)
    return f


def dot_config_of(custom_vjp_params: dict) -> Fp8DotConfig | None:
    """The ``Fp8DotConfig`` of a traced ``fp8_dot_general``, or None for any other call.

    Args:
        custom_vjp_params: ``eqn.params`` of a ``custom_vjp_call`` jaxpr equation. Its
            operands are ``(x, kernel, *meta_leaves)`` (after ``num_consts`` consts) and
            ``cfg.unflatten_meta(meta_leaves)`` rebuilds the ``Fp8Meta``.
    """
    fn = _compat.custom_vjp_bwd(custom_vjp_params.get("bwd"))
    cfg = getattr(fn, _CONFIG_ATTR, None)
    return cfg if isinstance(cfg, Fp8DotConfig) else None


def _check_operands(x, kernel, meta, fn):
    if not is_meta(meta):
        raise TypeError(
            f"{fn}: meta must be an Fp8Meta (from fp8.init_meta / init_metas); "
            f"got {type(meta).__name__}."
        )
    if meta.batch_shape != ():
        raise ValueError(
            f"{fn}: meta is a stack of shape {meta.batch_shape}; pass one matmul's "
            f"meta (slice it per layer, e.g. scan over the stacked metas as xs)."
        )
    for name, a in (("x", x), ("kernel", kernel)):
        if not jnp.issubdtype(jnp.result_type(a), jnp.floating):
            raise TypeError(f"{fn}: {name} must be a floating array; got {jnp.result_type(a)}.")


def canonical_dimension_numbers(dimension_numbers) -> tuple:
    """``lax.dot_general`` dimension numbers as nested tuples of ints (hashable, for
    ``Fp8DotConfig``)."""
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
        (tuple(int(i) for i in lb), tuple(int(i) for i in rb)),
    )


def fp8_dot_general(
    x: jax.Array, kernel: jax.Array, meta: Fp8Meta, dimension_numbers, preferred_element_type=None
) -> jax.Array:
    """``lax.dot_general(x, kernel, dimension_numbers)`` in FP8 with delayed scaling.

    Forward: ``x`` and ``kernel`` are quantized to E4M3 with their delayed scales, the dot
    accumulates in float32 and is dequantized by ``x_scale_inv * kernel_scale_inv``.
    Backward (custom VJP): the output gradient is quantized to E5M2 with its delayed
    scale and both input gradients are FP8 dots against the saved FP8 operands; the
    cotangent of ``meta`` is the updated ``Fp8Meta`` (see the module docstring).

    Args:
        x: floating array (any float dtype, e.g. bfloat16 activations).
        kernel: floating array.
        meta: one matmul's ``Fp8Meta`` (``batch_shape == ()``).
        dimension_numbers: as ``lax.dot_general``.
        preferred_element_type: output dtype; default ``jnp.result_type(x, kernel)``.

    Returns:
        The ``dot_general`` result in ``preferred_element_type``. Gradients have ``x``'s and
        ``kernel``'s dtypes.

    Raises:
        TypeError: if ``meta`` is not an ``Fp8Meta`` or an operand is not floating.
        ValueError: if ``meta`` is a stack of metas.
    """
    _check_operands(x, kernel, meta, "fp8_dot_general")
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x, kernel))
    cfg = Fp8DotConfig(
        canonical_dimension_numbers(dimension_numbers),
        out_dtype,
        jnp.dtype(x.dtype),
        jnp.dtype(kernel.dtype),
        meta.amax_compute_algo,
        meta.margin,
    )
    return _fp8_dg(cfg)(x, kernel, meta)


def fp8_dot(
    x: jax.Array, kernel: jax.Array, meta: Fp8Meta, preferred_element_type=None
) -> jax.Array:
    """``x @ kernel`` in FP8 with delayed scaling: x ``[..., in]``, kernel ``[in, out]``
    -> ``[..., out]``. See ``fp8_dot_general``.

    Raises:
        ValueError: if ``kernel`` is not 2-D or its ``in`` does not match ``x``'s last dim.
    """
    if jnp.ndim(kernel) != 2 or jnp.ndim(x) < 1 or jnp.shape(x)[-1] != jnp.shape(kernel)[0]:
        raise ValueError(
            f"fp8_dot computes x[..., in] @ kernel[in, out]; got x{jnp.shape(x)} "
            f"and kernel{jnp.shape(kernel)}."
        )
    nd = jnp.ndim(x)
    return fp8_dot_general(x, kernel, meta, (((nd - 1,), (0,)), ((), ())), preferred_element_type)


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
    "amax_from_history",
    "compute_scale_inv",
    "roll_history",
    "update_tensor_meta",
    "quantize",
    "fp8_dot_general",
    "fp8_dot",
    "Fp8DotConfig",
    "fp8_bits",
    "fp8_dot_forward",
    "fp8_dot_backward",
    "dot_config_of",
]

# FP8 brings its own implicit-weight rules (a weight carrying an Fp8Meta; an FP8 matmul of
# a NF4/LoRA weight); the interpreter's core never imports this module.
from jmem._src.implicit import fp8_rules as _fp8_rules  # noqa: E402, F401
from jmem._src.implicit import interpreter as _interpreter  # noqa: E402


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


def apply(fn: Callable, *, allow_materialize: bool = False) -> Callable:
    """Wraps ``fn(params, *args, **kwargs)`` as ``fn_fp8(params, metas, *args, **kwargs)``,
    whose matmuls against the kernels with a meta run in FP8 with delayed scaling.

    The model writes plain matmuls (``x @ kernel``, ``einsum``, ``dot_general``); the
    implicit-weight interpreter (the one behind ``jmem.lora.apply``/``jmem.qlora.apply``,
    ``docs/lora.md``) carries each kernel with its ``Fp8Meta`` and runs ``fp8_dot_general``
    at each matmul against it: stacked kernels ``[L, in, out]`` with stacked metas
    ``[L]`` are sliced together by the model's ``lax.scan`` (or indexing), an ``NF4Array``
    kernel is dequantized to the view dtype first. The cotangent of ``metas`` is the
    updated states (the overwrite rule, see the module docstring): ``jax.grad(fn_fp8,
    argnums=(0, 1))`` gives ``(param_grads, new_metas)``. A kernel used inside a loop over
    token chunks (``jmem.Levers(token_chunk=...)``) gets one state update, exactly the one
    of the unchunked call (per-chunk amaxes max-reduced, ``implicit/structural_rules.py``).

    Args:
      fn: a function whose first argument is a params pytree (e.g. ``llama.loss_fn``).
      allow_materialize: where a kernel with a meta is used other than in a matmul, use its
        dense value there (its state then gets no update from that use) instead of
        raising.

    Returns:
      ``fn_fp8(params, metas, *args, **kwargs)``; ``metas`` as ``init_metas(params, ...)``
      returns (an ``Fp8Meta`` at each FP8 kernel, None elsewhere), or None (``fn``
      unchanged).

    Raises (when called):
      TypeError: ``metas`` holds leaves other than ``Fp8Meta``/None.
      ValueError: a meta's path is not a leaf of ``params``, or its batch shape is not the
        kernel's stacked shape.
      jmem.lora.ImplicitWeightError: a kernel with a meta used other than in a matmul, or a
        stacked meta reaching a matmul unsliced.
    """

    @functools.wraps(fn)
    def fn_fp8(params, metas, *args, **kwargs):
        paths = meta_paths(metas)
        if not paths:
            return fn(params, *args, **kwargs)
        token = _APPLYING.set(True)
        try:
            return _interpreter.call(
                fn, params, None, args, kwargs, allow_materialize=allow_materialize, metas=paths
            )
        finally:
            _APPLYING.reset(token)

    return fn_fp8


#: True while ``apply`` traces its function with at least one meta.
_APPLYING = contextvars.ContextVar("jmem_fp8_applying", default=False)


def applying() -> bool:
    """Whether the code calling this is being traced under ``jmem.fp8.apply`` with at least
    one ``Fp8Meta`` (its matmuls against the kernels with a meta then run in FP8). The
    reference Llama reads it to refuse ``jmem.Levers(fp8=True)`` outside ``apply``."""
    return _APPLYING.get()


__all__ += ["apply", "applying", "meta_paths", "canonical_dimension_numbers"]
