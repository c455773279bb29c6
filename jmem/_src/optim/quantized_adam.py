"""Adam / AdamW with 8-bit and 4-bit block-wise quantized moments, as optax transformations.

The moments are stored as :class:`jmem.quantization.QuantizedArray` (uint8 codes plus one
float32 absmax per block). Every step dequantizes them, updates them in float32, computes the
update from the float32 moments (bias-corrected, the formula of ``optax.adamw`` and of
``bitsandbytes.optim.AdamW8bit``), and requantizes with a fresh per-block absmax. Parameters
with fewer than ``min_8bit_size`` (``min_4bit_size``) elements keep float32 moments, as in
bitsandbytes.

Non-finite gradients: a NaN/inf gradient *element* is treated as a zero gradient for that
element (its moments decay by ``b1``/``b2``; its update is computed from the decayed moments),
so the stored moments of the other elements in its block stay finite and exact. The squared
gradient entering the second moment is also clamped to half the largest float32, so that a
huge finite gradient cannot store ``inf``. To skip whole steps with non-finite gradients,
wrap the optimizer in ``optax.apply_if_finite``.

Transients: each step dequantizes a tensor's moments to float32, so the update needs float32
temporaries of about 8 bytes per element (4-bit: 9, with the unpacked codes) of the tensor
being updated. Left to itself XLA schedules these for every tensor at once (8 bytes per
trainable parameter: 54 GB for a 7B model). Here the tensors are updated in groups of at
least ``chunk_size / 16`` elements (a large tensor is a group of its own; the small ones of
a group run concurrently), one group after another: each group's moments wait, through a
data dependency on an exact zero computed from the previous group's new codes
(``jmem.interpret.zero_after``, OR-ed into the codes; XLA:CPU drops
``optimization_barrier`` before scheduling), until the previous group is requantized. A
tensor with more than ``chunk_size`` elements (default ``2**24``, e.g. the layer-stacked
weights of ``jmem.models.llama``) is updated in equal chunks of whole blocks in a
``fori_loop``; chunk ``j`` holds blocks ``j, j + k, j + 2k, ...`` so a blocks axis sharded
over devices is sliced locally (``k`` is picked so that the blocks of a chunk divide by up to
256 devices where the block count allows), the update overwrites the gradient's blocks in
place and the new codes the old ones. The temporaries of the update are then about
``8 * min(largest group, chunk_size)`` bytes (128 MiB by default), and a full fine-tuning
step needs no more temporaries than with ``optax.sgd`` (``benchmarks/optimizer_memory.py``).
A tensor whose block count has no divisor giving chunks between ``chunk_size / 64`` and
``chunk_size`` elements (e.g. a prime count) is updated whole, with a warning. Under sharding
each ordering dependency is one scalar all-reduce.

Sources:
  * Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization" (arXiv:2110.02861);
    reference implementation ``bitsandbytes.optim.AdamW8bit`` (block size 256, signed dynamic
    map for the first moment, unsigned dynamic map for the second, fp32 state below 4096
    elements).
  * Li et al. 2023, "Memory Efficient Optimizers with 4-bit States" (arXiv:2309.01507):
    block size 128, signed 4-bit dynamic-exponent map for the first moment, and a second
    moment map without zero: the paper's DE-0 (default, ``nu_map="dynamic_no_zero"``) or its
    Linear map (``nu_map="linear"``). The paper pairs Linear with rank-1 normalization, which
    is not implemented here: both moments use B128 block-wise absmax normalization, for which
    the paper reports DE-0 as stable and which converged closer to fp32 AdamW in our tests
    (tiny byte LM, 300 steps: DE-0 -0.5%, Linear +2.5% final loss vs optax.adamw).

Zero second moments (8-bit): a second moment that rounds to the zero code is decoded as the
rounding threshold (half the smallest positive code, times absmax) instead of 0, because a
zero ``v`` with a surviving ``m`` makes the step ``m / eps`` explode (Li et al.'s zero-point
problem; it showed up on embedding rows of rare tokens). bitsandbytes decodes it as 0.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional, Union

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
#: Elements of a tensor updated at a time by the quantized optimizers (``chunk_size=None``).
DEFAULT_CHUNK_SIZE = 1 << 24
_F32_MAX = float(np.finfo(np.float32).max)
_G_MAX = float(np.sqrt(np.float32(0.5) * np.finfo(np.float32).max))  # |g| clip: g*g <= MAX/2


class ScaleByQuantizedAdamState(NamedTuple):
    """State of :func:`scale_by_quantized_adam`.

    Attributes:
      count: int32 scalar, number of steps taken.
      mu: first moments, a pytree with the structure of the params whose leaves are
        :class:`~jmem.quantization.QuantizedArray` (large tensors) or float32 arrays.
      nu: second moments, same structure as ``mu``.
    """

    count: jax.Array
    mu: Any
    nu: Any


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
        blocks (module docstring, "Transients"), so their float32 transients are about
        ``8 * chunk_size`` bytes, not 8 per element. Under ``optax.inject_hyperparams`` an
        explicit value must be in ``static_args``.

    Returns:
      ``optax.GradientTransformation``; updates have the gradients' shapes and dtypes, the
      state is a :class:`ScaleByQuantizedAdamState`.

    Raises:
      ValueError / TypeError: bad ``block_size``, ``min_quantized_size`` or code books.
    """
    mu_code = qz._canonical_code(mu_code)
    nu_code = qz._canonical_code(nu_code)
    chunk = DEFAULT_CHUNK_SIZE if chunk_size is None else _static_int(chunk_size, "chunk_size")
    if chunk < 1:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size!r}.")

    def init_fn(params):
        bs = _static_int(block_size, "block_size")
        min_size = _static_int(min_quantized_size, "min_quantized_size")
        qz._check_block_size(bs, min(len(mu_code), len(nu_code)))
        if min_size < 0:
            raise ValueError(f"min_quantized_size must be >= 0, got {min_size}.")

        def zeros_q(p, code):
            p = jnp.asarray(p) if not hasattr(p, "shape") else p
            if not jnp.issubdtype(p.dtype, jnp.floating):
                raise TypeError(f"quantized Adam needs floating params, got dtype {p.dtype}.")
            n = int(np.prod(p.shape, dtype=np.int64))
            if n < min_size:
                return jnp.zeros(p.shape, jnp.float32)
            nb = max(1, -(-n // bs))
            width = bs // 2 if len(code) <= 16 else bs
            # Zero moments: codes of the value nearest to 0; absmax 0 makes them exact zeros.
            zero_code = int(np.argmin(np.abs(np.asarray(code))))
            codes = jnp.full(
                (nb, width), zero_code if width == bs else zero_code | (zero_code << 4), jnp.uint8
            )
            return qz.QuantizedArray(
                codes, jnp.zeros((nb,), jnp.float32), tuple(p.shape), np.dtype(p.dtype), bs, code
            )

        mu = jax.tree.map(lambda p: zeros_q(p, mu_code), params)
        nu = jax.tree.map(lambda p: zeros_q(p, nu_code), params)
        return ScaleByQuantizedAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        count_inc = optax.safe_increment(state.count)
        t = count_inc.astype(jnp.float32)
        b1_ = jnp.asarray(b1, jnp.float32)
        b2_ = jnp.asarray(b2, jnp.float32)
        eps_ = jnp.asarray(eps, jnp.float32)
        c1 = 1.0 - b1_**t
        c2 = 1.0 - b2_**t

        def moments(g, m, v):
            # Non-finite elements act as zero; a huge finite gradient is clipped to
            # +-sqrt(MAX / 2), so g * g <= MAX / 2 and, by induction, v stays finite for any
            # b2 in [0, 1] while m / sqrt(v) stays the bounded Adam ratio (no m without its v).
            # Clipping g (not the sum) lets XLA:CPU fuse the decode lookup into the one pass
            # that materializes v (about 25% of the step time).
            g = jnp.clip(jnp.where(jnp.isfinite(g), g, 0.0), -_G_MAX, _G_MAX)
            m = b1_ * m + (1.0 - b1_) * g
            v = b2_ * v + (1.0 - b2_) * (g * g)
            u = (m / c1) / (jnp.sqrt(v / c2) + eps_)
            return u, m, v

        def blocks_update(gb, mcodes, mabs, vcodes, vabs, mq, vq):
            """One run of whole blocks: float32 [r, bs] grads -> (u, m codes/absmax, v ...)."""
            m = qz.dequantize_blocks(mcodes, mabs, mq.code)
            v = qz.dequantize_blocks(vcodes, vabs, vq.code, _nu_decode_values(vq.code))
            u, m, v = moments(gb, m, v)
            return u, qz.quantize_blocks(m, mq.code), qz.quantize_blocks(v, vq.code)

        def leaf(g, mq, vq, after):
            """(update, new mu, new nu) of one leaf."""
            if g is None:
                return None, mq, vq
            if not _is_q(mq):
                u, m, v = moments(g.astype(jnp.float32), mq, vq)
                return u.astype(g.dtype), m, v
            # `after` is a float32 zero computed from the previous group's new codes (or
            # None): OR-ing it into this leaf's codes (exact, and the constants b1/b2 stay
            # constants) makes this leaf's float32 moments start only once the previous
            # group is requantized, so that one group's transients are live at a time.
            mcodes, vcodes = mq.codes, vq.codes
            if after is not None:
                zero = after.astype(jnp.uint8)
                mcodes, vcodes = mcodes | zero, vcodes | zero
            bs = mq.block_size
            gb = qz.to_blocks(g, bs)
            nb = gb.shape[0]
            k = _num_chunks(nb, bs, chunk)
            if k == 1 and nb * bs > chunk:
                warnings.warn(
                    f"jmem quantized Adam: a tensor of shape {tuple(g.shape)} ({nb} blocks) is "
                    f"updated whole, not in chunks of chunk_size={chunk} elements: no divisor of "
                    f"its block count gives chunks of about that size. Its float32 transients "
                    f"are about {8 * nb * bs / 2**20:.0f} MiB.",
                    stacklevel=2,
                )
            if k == 1:
                u, (mc, ma), (vc, va) = blocks_update(
                    gb.astype(jnp.float32), mcodes, mq.absmax, vcodes, vq.absmax, mq, vq
                )
                u = qz.from_blocks(u, g.shape, g.dtype)
            else:
                # Chunk j holds blocks j, j + k, j + 2k, ...: a slice of an unsharded axis of
                # [nb / k, k, ...], so a blocks axis sharded over devices stays local. The
                # update overwrites the gradient's blocks in place (it has their dtype) and
                # the new codes overwrite the old ones, so the float32 transients are one
                # chunk's.
                r = nb // k
                split = lambda x: x.reshape(r, k, *x.shape[1:])  # noqa: E731
                take = lambda x, j: jax.lax.dynamic_index_in_dim(x, j, 1, keepdims=False)  # noqa: E731
                put = lambda x, y, j: jax.lax.dynamic_update_index_in_dim(x, y, j, 1)  # noqa: E731

                def body(j, carry):
                    ub, mcb, vcb, mab, vab = carry
                    u, (mc, ma), (vc, va) = blocks_update(
                        take(ub, j).astype(jnp.float32),
                        take(mcb, j),
                        take(mab, j),
                        take(vcb, j),
                        take(vab, j),
                        mq,
                        vq,
                    )
                    return (
                        put(ub, u.astype(ub.dtype), j),
                        put(mcb, mc, j),
                        put(vcb, vc, j),
                        put(mab, ma, j),
                        put(vab, va, j),
                    )

                ub, mc, vc, ma, va = jax.lax.fori_loop(
                    0, k, body, tuple(map(split, (gb, mcodes, vcodes, mq.absmax, vq.absmax)))
                )
                u = qz.from_blocks(ub.reshape(nb, bs), g.shape, g.dtype)
                mc, vc = mc.reshape(nb, -1), vc.reshape(nb, -1)
                ma, va = ma.reshape(nb), va.reshape(nb)
            mq = qz.QuantizedArray(mc, ma, mq.shape, mq.dtype, bs, mq.code)
            vq = qz.QuantizedArray(vc, va, vq.shape, vq.dtype, bs, vq.code)
            return u, mq, vq

        g_leaves, treedef = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
        mu_leaves = treedef.flatten_up_to(state.mu)
        nu_leaves = treedef.flatten_up_to(state.nu)
        # Leaves are updated in groups of at least chunk / 16 elements (a larger tensor is a
        # group of its own): the leaves of a group run concurrently (many small tensors keep
        # the CPU's cores busy), each group waits for the previous one's new codes.
        out, after, group, group_size = [], None, [], 0
        for g, m, v in zip(g_leaves, mu_leaves, nu_leaves):
            if group and g is not None and _is_q(m) and m.size * 16 >= chunk:
                after, group, group_size = zero_after(*group), [], 0  # a large tensor alone
            u, m_new, v_new = leaf(g, m, v, after)
            out.append((u, m_new, v_new))
            if g is not None and _is_q(m_new):
                group += [m_new.codes, v_new.codes]
                group_size += m_new.size
                if group_size * 16 >= chunk:
                    after, group, group_size = zero_after(*group), [], 0
        new_updates = treedef.unflatten([o[0] for o in out])
        mu = treedef.unflatten([o[1] for o in out])
        nu = treedef.unflatten([o[2] for o in out])
        return new_updates, ScaleByQuantizedAdamState(count=count_inc, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _make(
    learning_rate: ScalarOrSchedule,
    b1,
    b2,
    eps,
    weight_decay,
    mask,
    *,
    mu_code,
    nu_code,
    block_size,
    min_size,
    chunk_size,
) -> optax.GradientTransformation:
    parts = [
        scale_by_quantized_adam(
            b1,
            b2,
            eps,
            mu_code=mu_code,
            nu_code=nu_code,
            block_size=block_size,
            min_quantized_size=min_size,
            chunk_size=chunk_size,
        )
    ]
    if weight_decay is not None:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


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
    signed (first) and unsigned (second) dynamic maps of :func:`jmem.quantization.dynamic_map`
    with one float32 absmax per ``block_size`` elements: about 2.03 bytes per parameter for
    tensors with at least ``min_8bit_size`` elements, 8 bytes below.

    Args:
      learning_rate: scalar or ``optax`` schedule.
      b1, b2, eps: as ``optax.adam``.
      block_size: elements per quantization block (bitsandbytes: 256).
      min_8bit_size: tensors with fewer elements (global size) keep float32 moments.
      chunk_size: larger tensors are updated in chunks of about this many elements (None:
        ``2**24``), which bounds the update's float32 transients (module docstring,
        "Transients").

    Returns:
      ``optax.GradientTransformation`` (works inside ``optax.chain`` and
      ``optax.inject_hyperparams``).

    Raises:
      ValueError / TypeError: bad ``block_size`` or ``min_8bit_size`` (at ``init``).
    """
    return _make(
        learning_rate,
        b1,
        b2,
        eps,
        None,
        None,
        mu_code=qz.dynamic_map(True, 8),
        nu_code=qz.dynamic_map(False, 8),
        block_size=block_size,
        min_size=min_8bit_size,
        chunk_size=chunk_size,
    )


def adamw_8bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
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
        ``2**24``), which bounds the update's float32 transients (module docstring,
        "Transients").

    Returns:
      ``optax.GradientTransformation``.

    Raises:
      ValueError / TypeError: bad ``block_size`` or ``min_8bit_size`` (at ``init``).
    """
    return _make(
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        mask,
        mu_code=qz.dynamic_map(True, 8),
        nu_code=qz.dynamic_map(False, 8),
        block_size=block_size,
        min_size=min_8bit_size,
        chunk_size=chunk_size,
    )


def _nu_map_4bit(nu_map: str) -> np.ndarray:
    if nu_map == "linear":
        return qz.linear_map(4, include_zero=False)
    if nu_map == "dynamic_no_zero":
        # DE-0: the unsigned 4-bit dynamic map without its zero (15 values).
        m = qz.dynamic_map(False, 4)
        return m[m > 0]
    raise ValueError(f"nu_map must be 'linear' or 'dynamic_no_zero', got {nu_map!r}.")


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
    """Adam with 4-bit block-wise quantized moments (Li et al. 2023); see :func:`adamw_4bit`."""
    return _make(
        learning_rate,
        b1,
        b2,
        eps,
        None,
        None,
        mu_code=qz.dynamic_map(True, 4),
        nu_code=_nu_map_4bit(nu_map),
        block_size=block_size,
        min_size=min_4bit_size,
        chunk_size=chunk_size,
    )


def adamw_4bit(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    block_size: int = 128,
    min_4bit_size: int = 4096,
    nu_map: str = "dynamic_no_zero",
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformation:
    """AdamW with 4-bit moments after Li et al. 2023, "Memory Efficient Optimizers with 4-bit
    States" (arXiv:2309.01507).

    Storage: block size 128, two 4-bit codes per byte, one float32 absmax per block for each
    moment: about 1.06 bytes per parameter for tensors with at least ``min_4bit_size``
    elements. First moment: signed 4-bit dynamic-exponent map (``dynamic_map(True, 4)``,
    the paper's "DE"). Second moment: a map *without zero*, because a second moment rounded
    to zero makes ``m / (sqrt(v) + eps)`` explode (the paper's zero-point problem):
    ``nu_map="dynamic_no_zero"`` (default; the paper's DE-0: the unsigned 4-bit dynamic map
    minus its zero, 15 values) or ``"linear"`` (``(i + 1) / 16``). The paper pairs Linear
    with rank-1 normalization, which is not implemented; with the block-wise (B128)
    normalization used here DE-0 tracked fp32 AdamW more closely in our tests.

    Args:
      learning_rate, b1, b2, eps, weight_decay, mask: as :func:`adamw_8bit`.
      block_size: elements per block (even; paper: 128).
      min_4bit_size: tensors with fewer elements (global size) keep float32 moments.
      chunk_size: as :func:`adamw_8bit`.
      nu_map: ``"linear"`` or ``"dynamic_no_zero"``.

    Returns:
      ``optax.GradientTransformation``.

    Raises:
      ValueError: unknown ``nu_map``; odd ``block_size`` (at ``init``).
    """
    return _make(
        learning_rate,
        b1,
        b2,
        eps,
        weight_decay,
        mask,
        mu_code=qz.dynamic_map(True, 4),
        nu_code=_nu_map_4bit(nu_map),
        block_size=block_size,
        min_size=min_4bit_size,
        chunk_size=chunk_size,
    )
