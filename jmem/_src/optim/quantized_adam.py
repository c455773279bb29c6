"""Adam / AdamW with 8-bit and 4-bit block-wise quantized moments, as optax transformations.

The moments are stored as :class:`jmem.QuantizedArray` (uint8 codes plus one
float32 absmax per block); each step dequantizes them, updates them in float32 with the
formula of ``optax.scale_by_adam``, computes the bias-corrected update and requantizes them.
Design notes (non-finite gradients, the bounded transients of the chunked update, the
zero-point decode of second moments) are in ``docs/optimizers.md``.

Sources:
  * Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861);
    reference implementation ``bitsandbytes.optim.AdamW8bit``.
  * Li et al. 2023, "Memory Efficient Optimizers with 4-bit States" (arXiv:2309.01507).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any
from typing import Callable
from typing import NamedTuple
from typing import Optional
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmem._src import quantization as qz
from jmem._src.ordering import zero_after

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ScaleByQuantizedAdamState",
    "scale_by_quantized_adam",
    "adam_8bit",
    "adamw_8bit",
    "adam_4bit",
    "adamw_4bit",
]

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
MaskOrFn = Optional[Union[Any, Callable[[Any], Any]]]
#: Elements of a tensor updated at a time by the quantized optimizers (``chunk_size=None``).
DEFAULT_CHUNK_SIZE = 1 << 24
_F32_MAX = float(np.finfo(np.float32).max)
_G_MAX = float(np.sqrt(np.float32(0.5) * np.finfo(np.float32).max))  # |g| clip: g*g <= MAX/2


class ScaleByQuantizedAdamState(NamedTuple):
    """State of :func:`scale_by_quantized_adam`.

    Attributes:
      count: int32 scalar, number of steps taken.
      mu: first moments, a pytree with the structure of the params whose leaves are
        :class:`jmem.QuantizedArray` (large tensors) or float32 arrays.
      nu: second moments, same structure as ``mu``.
    """

    count: jax.Array
    mu: Any
    nu: Any


class _Hyper(NamedTuple):
    """float32 scalars of one step: decay rates, eps and the bias corrections ``1 - b**t``."""

    b1: jax.Array
    b2: jax.Array
    eps: jax.Array
    c1: jax.Array
    c2: jax.Array


# ------------------------------------------------------------------------------------------
# Arguments.
# ------------------------------------------------------------------------------------------


def _static_int(value: Any, name: str) -> int:
    """int() of a Python or concrete array value (inject_hyperparams turns ints into arrays).

    Raises:
      TypeError: ``value`` is traced, or not an integer (a bool, a float, a string).
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} is traced: under optax.inject_hyperparams the integer arguments (block "
            "size, size threshold, chunk size) must stay static, e.g. "
            "optax.inject_hyperparams(jmem.adamw_8bit, static_args=('block_size', "
            "'min_8bit_size', 'chunk_size'))(learning_rate=...), or call init outside a traced "
            "function."
        )
    arr = np.asarray(value)
    if isinstance(value, bool) or arr.dtype.kind not in "iu" or arr.ndim:
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    return int(arr)


def _chunk_elements(chunk_size: Optional[int]) -> int:
    """``chunk_size`` as a positive int (None: :data:`DEFAULT_CHUNK_SIZE`)."""
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else _static_int(chunk_size, "chunk_size")
    if chunk < 1:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size!r}.")
    return chunk


def _init_sizes(block_size: Any, min_quantized_size: Any, code_len: int) -> tuple[int, int]:
    """(block size, size threshold) as checked ints; read at ``init``, not at construction."""
    bs = _static_int(block_size, "block_size")
    min_size = _static_int(min_quantized_size, "min_quantized_size")
    qz._check_block_size(bs, code_len)
    if min_size < 0:
        raise ValueError(f"min_quantized_size must be >= 0, got {min_size}.")
    return bs, min_size


def _is_q(x: Any) -> bool:
    return isinstance(x, qz.QuantizedArray)


def _nu_decode_values(code: tuple[float, ...]) -> np.ndarray:
    """Decode table for second moments: the zero code decodes to its rounding threshold.

    A second moment that rounded to zero lies in ``[0, t)`` with ``t`` half the smallest
    positive code (times absmax). Decoding it as 0 while the first moment of the same element
    survives makes ``m / (sqrt(v) + eps)`` explode (the zero-point problem of Li et al. 2023);
    decoding it as ``t`` bounds the step. Maps without zero are unchanged.
    """
    c = np.asarray(code, np.float32)
    pos = c[c > 0]
    if pos.size == 0:
        return c
    return np.where(c == 0, pos.min() / 2, c).astype(np.float32)


def _num_chunks(num_blocks: int, block_size: int, chunk_size: int) -> int:
    """How many equal chunks to update a tensor of ``num_blocks`` blocks in.

    1 if it fits ``chunk_size`` elements. Else a divisor ``k`` of ``num_blocks`` between the
    minimum count ``k0`` (chunks of at most ``chunk_size`` elements, at least one block) and
    ``64 * k0``, chosen so that ``num_blocks / k``, the blocks of a chunk, keeps as many
    factors of 2 as possible up to ``2**8`` (then the smallest such ``k``): chunk ``j`` is
    blocks ``j, j + k, ...``, and it is a local slice on every device when the blocks axis
    is split over a number of devices dividing ``num_blocks / k``. 1 (no chunking) if there
    is no such divisor, e.g. for a prime ``num_blocks``.
    """
    per_chunk = max(1, chunk_size // block_size)
    k0 = -(-num_blocks // per_chunk)
    if k0 <= 1:
        return 1
    divisors = [d for d in range(k0, min(64 * k0, num_blocks) + 1) if num_blocks % d == 0]
    if not divisors:
        return 1

    def twos(d):  # factors of 2 in the blocks per chunk, capped at 8 (256 devices)
        r = num_blocks // d
        return min((r & -r).bit_length() - 1, 8)

    return max(divisors, key=lambda d: (twos(d), -d))


def _num_chunks_or_warn(shape: tuple[int, ...], num_blocks: int, block_size: int, chunk: int):
    """:func:`_num_chunks`, warning when a tensor larger than ``chunk`` is updated whole."""
    k = _num_chunks(num_blocks, block_size, chunk)
    if k == 1 and num_blocks * block_size > chunk:
        warnings.warn(
            f"jmem quantized Adam: a tensor of shape {tuple(shape)} ({num_blocks} blocks) is "
            f"updated whole, not in chunks of chunk_size={chunk} elements: no divisor of "
            f"its block count gives chunks of about that size. Its float32 transients "
            f"are about {8 * num_blocks * block_size / 2**20:.0f} MiB.",
            stacklevel=5,
        )
    return k


# ------------------------------------------------------------------------------------------
# init.
# ------------------------------------------------------------------------------------------


def _zero_moment(p: Any, code: tuple[float, ...], block_size: int, min_size: int) -> Any:
    """Zero moment of param ``p``: float32 zeros below ``min_size`` elements, else quantized.

    Raises:
      TypeError: ``p`` is not floating.
    """
    p = jnp.asarray(p) if not hasattr(p, "shape") else p
    if not jnp.issubdtype(p.dtype, jnp.floating):
        raise TypeError(f"quantized Adam needs floating params, got dtype {p.dtype}.")
    n = int(np.prod(p.shape, dtype=np.int64))
    if n < min_size:
        return jnp.zeros(p.shape, jnp.float32)
    nb = max(1, -(-n // block_size))
    width = block_size // 2 if len(code) <= 16 else block_size
    # Zero moments: codes of the value nearest to 0; absmax 0 makes them exact zeros.
    zero_code = int(np.argmin(np.abs(np.asarray(code))))
    packed = zero_code if width == block_size else zero_code | (zero_code << 4)
    codes = jnp.full((nb, width), packed, jnp.uint8)
    absmax = jnp.zeros((nb,), jnp.float32)
    return qz.QuantizedArray(codes, absmax, tuple(p.shape), np.dtype(p.dtype), block_size, code)


# ------------------------------------------------------------------------------------------
# update: one line per equation, then blocks, chunks, leaves and the tree.
# ------------------------------------------------------------------------------------------


def _hyperparams(b1: Any, b2: Any, eps: Any, count: jax.Array) -> _Hyper:
    """The step's float32 scalars for the update after ``count`` steps (``count >= 1``)."""
    t = count.astype(jnp.float32)
    b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
    eps = jnp.asarray(eps, jnp.float32)
    return _Hyper(b1, b2, eps, 1.0 - b1**t, 1.0 - b2**t)


def _sanitize(g: jax.Array) -> jax.Array:
    """Non-finite elements act as zero; ``|g|`` is clipped to ``sqrt(MAX / 2)``.

    Then ``g * g <= MAX / 2`` and, by induction, ``v`` stays finite for any ``b2`` in
    ``[0, 1]`` while ``m / sqrt(v)`` stays the bounded Adam ratio. Clipping ``g`` (not the
    sum) lets XLA:CPU fuse the decode lookup into the one pass that materializes ``v``.
    """
    return jnp.clip(jnp.where(jnp.isfinite(g), g, 0.0), -_G_MAX, _G_MAX)


def _moments(g: jax.Array, m: jax.Array, v: jax.Array, hp: _Hyper):
    """Adam in float32: ``(update, new m, new v)`` (Kingma & Ba 2015, Algorithm 1)."""
    g = _sanitize(g)
    m = hp.b1 * m + (1.0 - hp.b1) * g
    v = hp.b2 * v + (1.0 - hp.b2) * (g * g)
    u = (m / hp.c1) / (jnp.sqrt(v / hp.c2) + hp.eps)
    return u, m, v


def _update_blocks(gb, mcodes, mabs, vcodes, vabs, mu_code, nu_code, hp):
    """One run of whole blocks: float32 ``[r, bs]`` grads -> ``(u, (m codes, m absmax),
    (v codes, v absmax))``: dequantize, update, requantize."""
    m = qz.dequantize_blocks(mcodes, mabs, mu_code)
    v = qz.dequantize_blocks(vcodes, vabs, nu_code, _nu_decode_values(nu_code))
    u, m, v = _moments(gb, m, v, hp)
    return u, qz.quantize_blocks(m, mu_code), qz.quantize_blocks(v, nu_code)


def _take(x: jax.Array, j: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False)


def _put(x: jax.Array, y: jax.Array, j: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(x, y, j, 1)


def _update_chunk(mu_code, nu_code, hp, j, carry):
    """``fori_loop`` body: update chunk ``j`` of the split ``[r, k, ...]`` arrays in place."""
    ub, mcb, vcb, mab, vab = carry
    u, (mc, ma), (vc, va) = _update_blocks(
        _take(ub, j).astype(jnp.float32),
        _take(mcb, j),
        _take(mab, j),
        _take(vcb, j),
        _take(vab, j),
        mu_code,
        nu_code,
        hp,
    )
    return (
        _put(ub, u.astype(ub.dtype), j),
        _put(mcb, mc, j),
        _put(vcb, vc, j),
        _put(mab, ma, j),
        _put(vab, va, j),
    )


def _update_chunked(gb, mcodes, mabs, vcodes, vabs, k, mu_code, nu_code, hp):
    """:func:`_update_blocks` of ``[nb, bs]`` blocks in ``k`` chunks, one at a time.

    Chunk ``j`` holds blocks ``j, j + k, j + 2k, ...``: a slice of an unsharded axis of
    ``[nb / k, k, ...]``, so a blocks axis sharded over devices stays local. The update
    overwrites the gradient's blocks in place (it has their dtype, not float32) and the new
    codes the old ones, so the float32 transients are one chunk's.
    """
    nb, r = gb.shape[0], gb.shape[0] // k

    def split(x):
        return x.reshape(r, k, *x.shape[1:])

    body = functools.partial(_update_chunk, mu_code, nu_code, hp)
    ub, mc, vc, ma, va = jax.lax.fori_loop(
        0, k, body, tuple(map(split, (gb, mcodes, vcodes, mabs, vabs)))
    )
    return (
        ub.reshape(nb, -1),
        (mc.reshape(nb, -1), ma.reshape(nb)),
        (vc.reshape(nb, -1), va.reshape(nb)),
    )


def _update_leaf(g, mq, vq, after, hp, chunk):
    """``(update, new mu, new nu)`` of one leaf; ``after`` orders it after the last group.

    ``after`` is a float32 zero computed from the previous group's new codes (or None):
    OR-ing it into this leaf's codes (exact, and the constants b1/b2 stay constants) makes
    this leaf's float32 moments start only once the previous group is requantized.
    """
    if g is None:
        return None, mq, vq
    if not _is_q(mq):
        u, m, v = _moments(g.astype(jnp.float32), mq, vq, hp)
        return u.astype(g.dtype), m, v
    mcodes, vcodes = mq.codes, vq.codes
    if after is not None:
        zero = after.astype(jnp.uint8)
        mcodes, vcodes = mcodes | zero, vcodes | zero
    bs = mq.block_size
    gb = qz.to_blocks(g, bs)
    k = _num_chunks_or_warn(g.shape, gb.shape[0], bs, chunk)
    args = (mcodes, mq.absmax, vcodes, vq.absmax)
    if k == 1:
        u, m, v = _update_blocks(gb.astype(jnp.float32), *args, mq.code, vq.code, hp)
    else:
        u, m, v = _update_chunked(gb, *args, k, mq.code, vq.code, hp)
    u = qz.from_blocks(u, g.shape, g.dtype)
    mq = qz.QuantizedArray(m[0], m[1], mq.shape, mq.dtype, bs, mq.code)
    vq = qz.QuantizedArray(v[0], v[1], vq.shape, vq.dtype, bs, vq.code)
    return u, mq, vq


def _update_tree(updates, mu, nu, hp, chunk):
    """``(updates, mu, nu)`` of a tree: leaves in groups, one group after another.

    A group holds at least ``chunk / 16`` elements of quantized leaves (a larger tensor is a
    group of its own): the leaves of a group run concurrently (many small tensors keep the
    CPU's cores busy), and each group waits, through :func:`~jmem._src.ordering.zero_after`,
    for the previous group's new codes, so one group's float32 transients are live at a time.
    """
    g_leaves, treedef = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
    mu_leaves = treedef.flatten_up_to(mu)
    nu_leaves = treedef.flatten_up_to(nu)
    out, after, group, group_size = [], None, [], 0
    for g, m, v in zip(g_leaves, mu_leaves, nu_leaves):
        if group and g is not None and _is_q(m) and m.size * 16 >= chunk:
            after, group, group_size = zero_after(*group), [], 0  # a large tensor alone
        u, m_new, v_new = _update_leaf(g, m, v, after, hp, chunk)
        out.append((u, m_new, v_new))
        if g is not None and _is_q(m_new):
            group += [m_new.codes, v_new.codes]
            group_size += m_new.size
            if group_size * 16 >= chunk:
                after, group, group_size = zero_after(*group), [], 0
    return tuple(treedef.unflatten([o[i] for o in out]) for i in range(3))


# ------------------------------------------------------------------------------------------
# The transformation and its 8-/4-bit aliases.
# ------------------------------------------------------------------------------------------


def scale_by_quantized_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    *,
    mu_code: Any,
    nu_code: Any,
    block_size: int = 256,
    min_quantized_size: int = 4096,
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """Adam scaling (``optax.scale_by_adam``) with block-wise quantized moments.

    Args:
      b1, b2: moment decay rates (may be traced, e.g. under ``optax.inject_hyperparams``).
      eps: added to ``sqrt(nu_hat)`` in the denominator.
      mu_code: sorted code book for the first moment (signed, e.g.
        ``quantization.dynamic_map(True)``); at most 16 values -> 4-bit packed.
      nu_code: sorted code book for the second moment (unsigned).
      block_size: elements per quantization block.
      min_quantized_size: parameters with fewer elements (global ``x.size``, never a shard's
        size) keep float32 moments.
      chunk_size: elements (global) updated at a time within one tensor (None:
        ``DEFAULT_CHUNK_SIZE``, ``2**24``): larger tensors are updated in chunks of whole
        blocks (``docs/optimizers.md``, "Transients"), so their float32 transients are about
        ``8 * chunk_size`` bytes, not 8 per element. Under ``optax.inject_hyperparams`` an
        explicit value must be in ``static_args``.

    Returns:
      ``optax.GradientTransformation``; updates have the gradients' shapes and dtypes, the
      state is a :class:`ScaleByQuantizedAdamState`.

    Raises:
      ValueError / TypeError: bad ``block_size``, ``min_quantized_size`` or code books.

    References:
      Dettmers et al. 2022 (arXiv:2110.02861); Li et al. 2023 (arXiv:2309.01507).
    """
    mu_code = qz._canonical_code(mu_code)
    nu_code = qz._canonical_code(nu_code)
    chunk = _chunk_elements(chunk_size)

    def init_fn(params):
        sizes = _init_sizes(block_size, min_quantized_size, min(len(mu_code), len(nu_code)))
        mu = jax.tree.map(lambda p: _zero_moment(p, mu_code, *sizes), params)
        nu = jax.tree.map(lambda p: _zero_moment(p, nu_code, *sizes), params)
        return ScaleByQuantizedAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        hp = _hyperparams(b1, b2, eps, count_inc)
        updates, mu, nu = _update_tree(updates, state.mu, state.nu, hp, chunk)
        return updates, ScaleByQuantizedAdamState(count=count_inc, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _nu_map_4bit(nu_map: str) -> np.ndarray:
    """Second-moment map of the 4-bit optimizers: ``"linear"`` or ``"dynamic_no_zero"``.

    Raises:
      ValueError: unknown ``nu_map``.
    """
    if nu_map == "linear":
        return qz.linear_map(4, include_zero=False)
    if nu_map == "dynamic_no_zero":
        # DE-0: the unsigned 4-bit dynamic map without its zero (15 values).
        m = qz.dynamic_map(False, 4)
        return m[m > 0]
    raise ValueError(f"nu_map must be 'linear' or 'dynamic_no_zero', got {nu_map!r}.")


def _codes(bits: int, nu_map: str) -> tuple[np.ndarray, np.ndarray]:
    """(first-moment map, second-moment map) of the ``bits``-bit optimizers."""
    if bits == 8:
        return qz.dynamic_map(True, 8), qz.dynamic_map(False, 8)
    return qz.dynamic_map(True, 4), _nu_map_4bit(nu_map)


def _quantized_adamw(
    bits: int,
    learning_rate: ScalarOrSchedule,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    mask: MaskOrFn,
    block_size: Any,
    min_size: Any,
    chunk_size: Optional[int],
    nu_map: str = "dynamic_no_zero",
) -> optax.GradientTransformation:
    """The factory behind the four aliases: quantized Adam scaling, optional decoupled weight
    decay (``weight_decay=None``: none, i.e. Adam), then the learning rate."""
    mu_code, nu_code = _codes(bits, nu_map)
    scale = scale_by_quantized_adam(
        b1,
        b2,
        eps,
        mu_code=mu_code,
        nu_code=nu_code,
        block_size=block_size,
        min_quantized_size=min_size,
        chunk_size=chunk_size,
    )
    decay = [] if weight_decay is None else [optax.add_decayed_weights(weight_decay, mask)]
    return optax.chain(scale, *decay, optax.scale_by_learning_rate(learning_rate))


def adam_8bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """Adam with 8-bit block-wise quantized moments (bitsandbytes ``Adam8bit``).

    Same update as ``optax.adam`` computed from float32 moments; the stored moments use the
    signed (first) and unsigned (second) dynamic maps of :func:`jmem.dynamic_map`
    with one float32 absmax per ``block_size`` elements: about 2.03 bytes per parameter for
    tensors with at least ``min_8bit_size`` elements, 8 bytes below.

    Args:
      learning_rate: scalar or ``optax`` schedule.
      b1, b2, eps: as ``optax.adam``.
      block_size: elements per quantization block (bitsandbytes: 256).
      min_8bit_size: tensors with fewer elements (global size) keep float32 moments.
      chunk_size: larger tensors are updated in chunks of about this many elements (None:
        ``2**24``), which bounds the update's float32 transients (``docs/optimizers.md``,
        "Transients").

    Returns:
      ``optax.GradientTransformation`` (works inside ``optax.chain`` and
      ``optax.inject_hyperparams``; put ``block_size``, ``min_8bit_size`` and an explicit
      ``chunk_size`` in ``static_args``).

    Raises:
      ValueError / TypeError: bad ``block_size`` or ``min_8bit_size`` (at ``init``).

    Reference: Dettmers et al. 2022 (arXiv:2110.02861), ``bitsandbytes.optim.Adam8bit``.
    """
    return _quantized_adamw(
        8, learning_rate, b1, b2, eps, None, None, block_size, min_8bit_size, chunk_size
    )


def adamw_8bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: MaskOrFn = None,
    block_size: int = 256,
    min_8bit_size: int = 4096,
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """AdamW with 8-bit block-wise quantized moments (bitsandbytes ``AdamW8bit``).

    The update equals ``optax.adamw`` (decoupled weight decay ``-lr * weight_decay * p``)
    computed from the float32 moments of this step; see :func:`adam_8bit` for the storage.
    Requires ``params`` in ``update``.

    Args:
      learning_rate: scalar or ``optax`` schedule.
      b1, b2, eps: as ``optax.adamw``.
      weight_decay: decoupled weight decay coefficient (bitsandbytes default 0.01).
      mask: as ``optax.adamw``: which params get weight decay (default: all, like
        bitsandbytes).
      block_size: elements per quantization block (bitsandbytes: 256).
      min_8bit_size: tensors with fewer elements (global size) keep float32 moments.
      chunk_size: larger tensors are updated in chunks of about this many elements (None:
        ``2**24``), which bounds the update's float32 transients (``docs/optimizers.md``,
        "Transients").

    Returns:
      ``optax.GradientTransformation``.

    Raises:
      ValueError / TypeError: bad ``block_size`` or ``min_8bit_size`` (at ``init``).

    Reference: Dettmers et al. 2022 (arXiv:2110.02861), ``bitsandbytes.optim.AdamW8bit``.
    """
    return _quantized_adamw(
        8, learning_rate, b1, b2, eps, weight_decay, mask, block_size, min_8bit_size, chunk_size
    )


def adam_4bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    block_size: int = 128,
    min_4bit_size: int = 4096,
    nu_map: str = "dynamic_no_zero",
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """Adam with 4-bit block-wise quantized moments (Li et al. 2023).

    :func:`adamw_4bit` without weight decay: the update equals ``optax.adam`` computed from
    the float32 moments of this step; storage as :func:`adamw_4bit`.

    Args:
      learning_rate, b1, b2, eps: as :func:`adam_8bit`.
      block_size: elements per block (even; paper: 128).
      min_4bit_size: tensors with fewer elements (global size) keep float32 moments.
      nu_map: ``"linear"`` or ``"dynamic_no_zero"`` (see :func:`adamw_4bit`).
      chunk_size: as :func:`adam_8bit`.

    Returns:
      ``optax.GradientTransformation``.

    Raises:
      ValueError: unknown ``nu_map``; odd ``block_size`` (at ``init``).

    Reference: Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"
    (arXiv:2309.01507).
    """
    return _quantized_adamw(
        4, learning_rate, b1, b2, eps, None, None, block_size, min_4bit_size, chunk_size, nu_map
    )


def adamw_4bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: MaskOrFn = None,
    block_size: int = 128,
    min_4bit_size: int = 4096,
    nu_map: str = "dynamic_no_zero",
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """AdamW with 4-bit block-wise quantized moments (Li et al. 2023).

    Storage: block size 128, two 4-bit codes per byte, one float32 absmax per block for each
    moment: about 1.06 bytes per parameter for tensors with at least ``min_4bit_size``
    elements. First moment: signed 4-bit dynamic-exponent map (``dynamic_map(True, 4)``,
    the paper's "DE"). Second moment: a map *without zero* (a second moment rounded to zero
    makes ``m / (sqrt(v) + eps)`` explode, the paper's zero-point problem):
    ``nu_map="dynamic_no_zero"`` (default; the paper's DE-0, 15 values) or ``"linear"``
    (``(i + 1) / 16``). The paper pairs Linear with rank-1 normalization, which is not
    implemented (``docs/optimizers.md``, "4-bit maps").

    Args:
      learning_rate, b1, b2, eps, weight_decay, mask: as :func:`adamw_8bit`.
      block_size: elements per block (even; paper: 128).
      min_4bit_size: tensors with fewer elements (global size) keep float32 moments.
      nu_map: ``"linear"`` or ``"dynamic_no_zero"``.
      chunk_size: as :func:`adamw_8bit`.

    Returns:
      ``optax.GradientTransformation``.

    Raises:
      ValueError: unknown ``nu_map``; odd ``block_size`` (at ``init``).

    Reference: Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"
    (arXiv:2309.01507).
    """
    return _quantized_adamw(
        4,
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        mask,
        block_size,
        min_4bit_size,
        chunk_size,
        nu_map,
    )
