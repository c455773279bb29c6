"""The FP8 matmul: ``fp8_dot(x, kernel, meta)`` quantizes both operands to E4M3 and, in the
backward pass, the output gradient to E5M2 (the "hybrid" format of Micikevicius et al. 2022,
"FP8 Formats for Deep Learning", arXiv:2209.05433), with the delayed scales of its
``Fp8Meta`` (``fp8_meta.py``); the updated ``Fp8Meta`` is returned as the meta's gradient
(flax ``fp8_ops``'s "overwrite with gradient"). Its forward and backward rules are exposed
for the implicit-weight interpreter (``implicit/fp8_rules.py``). See ``docs/fp8.md``.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Sequence

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from jmem._src import jax_compat as _compat
from jmem._src.fp8_meta import E4M3
from jmem._src.fp8_meta import E5M2
from jmem._src.fp8_meta import Fp8Meta
from jmem._src.fp8_meta import Fp8TensorMeta
from jmem._src.fp8_meta import is_meta
from jmem._src.fp8_meta import quantize
from jmem._src.fp8_meta import update_tensor_meta

__all__ = [
    "fp8_dot_general",
    "fp8_dot",
    "Fp8DotConfig",
    "fp8_bits",
    "fp8_dot_forward",
    "fp8_dot_backward",
    "dot_config_of",
    "canonical_dimension_numbers",
]


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
