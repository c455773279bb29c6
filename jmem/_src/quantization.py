"""Block-wise absmax quantization to the nearest value of a sorted code book (dynamic map).

Each block of ``block_size`` elements is scaled by its own absmax into ``[-1, 1]`` and
rounded to the nearest code; codes are stored as ``uint8`` (two per byte for maps of at most
16 values). Design and implementation notes: ``docs/optimizers.md``.

Sources: Dettmers et al. 2022 (arXiv:2110.02861; ``bitsandbytes.functional.create_dynamic_map``),
Dettmers 2016 (arXiv:1511.04561), Li et al. 2023 (arXiv:2309.01507).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src import tree as _tree

__all__ = [
    "QuantizedArray",
    "dynamic_map",
    "linear_map",
    "quantize_blockwise",
    "dequantize_blockwise",
]


# ----------------------------------------------------------------------------------------
# Maps.
# ----------------------------------------------------------------------------------------


def _linspace_f32(start: float, stop: float, num: int) -> np.ndarray:
    """float32 linspace rounded like torch's CPU kernel (fused multiply-add, two halves)."""
    a, b = np.float32(start), np.float32(stop)
    step = (b - a) / np.float32(num - 1)
    i = np.arange(num)
    lo = np.float64(a) + np.float64(step) * i
    hi = np.float64(b) - np.float64(step) * (num - 1 - i)
    return np.where(i < num // 2, lo, hi).astype(np.float32)


def dynamic_map(signed: bool = True, bits: int = 8) -> np.ndarray:
    """The dynamic (tree) quantization map of Dettmers (2016, 2022), sorted ascending.

    Each decade ``[10**-k, 10**(1-k))`` gets a linearly spaced set of values whose count
    doubles per decade towards 1 (the "dynamic exponent" with ``bits - 1`` exponent bits),
    plus the exact values 0 and 1. For ``bits=8`` this equals
    ``bitsandbytes.functional.create_dynamic_map(signed=signed)``; for other widths it equals
    the first-``2**bits`` non-padding entries of
    ``create_dynamic_map(signed, max_exponent_bits=bits - 1, total_bits=bits)``.

    Args:
      signed: ``True`` for a map over ``[-1, 1]`` (first moments), ``False`` for ``[0, 1]``
        (second moments).
      bits: code width in bits, 2..8.

    Returns:
      ``np.ndarray`` float32 ``[2**bits]``, sorted ascending, values in ``[-1, 1]``.

    Raises:
      ValueError: if ``bits`` is not an integer in ``[2, 8]``.
    """
    if not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [2, 8], got {bits!r}.")
    max_exp = bits - 1
    non_sign = bits - 1
    data: list[np.ndarray] = []
    f32 = np.float32
    for i in range(max_exp):
        n_items = (
            2 ** (i + non_sign - max_exp) + 1 if signed else 2 ** (i + non_sign - max_exp + 1) + 1
        )
        # float32 arithmetic as in the reference, so that the values agree bit for bit.
        bounds = _linspace_f32(0.1, 1.0, n_items)
        means = (bounds[:-1] + bounds[1:]) / f32(2.0)
        vals = means * f32(10.0 ** (-(max_exp - 1) + i))
        data.append(vals)
        if signed:
            data.append(-vals)
    data.append(np.array([0.0, 1.0], f32))
    out = np.sort(np.concatenate(data).astype(f32))
    if out.shape[0] != 2**bits:  # pragma: no cover - structural invariant
        raise AssertionError(f"dynamic map has {out.shape[0]} values, expected {2**bits}")
    return out


def linear_map(bits: int = 4, *, include_zero: bool = False) -> np.ndarray:
    """Unsigned linear map on ``(0, 1]`` (Li et al. 2023, "Linear" map for second moments).

    ``include_zero=False`` (the paper's choice for the second moment) gives
    ``(i + 1) / 2**bits`` for ``i = 0 .. 2**bits - 1``: the smallest code is ``2**-bits``,
    so a quantized second moment is never zero and ``m / (sqrt(v) + eps)`` cannot blow up.
    ``include_zero=True`` gives ``i / (2**bits - 1)``.

    Returns:
      ``np.ndarray`` float32 ``[2**bits]``, sorted ascending.

    Raises:
      ValueError: if ``bits`` is not an integer in ``[1, 8]``.
    """
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}.")
    n = 2**bits
    if include_zero:
        return (np.arange(n, dtype=np.float64) / (n - 1)).astype(np.float32)
    return ((np.arange(n, dtype=np.float64) + 1) / n).astype(np.float32)


# ----------------------------------------------------------------------------------------
# Nearest-code lookup tables.
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Lut:
    code: np.ndarray  # float32 [K], sorted
    base: np.ndarray  # uint8 [T]: candidate code per bin
    thr: np.ndarray  # float32 [T]: midpoint after the candidate (+inf if none)
    shift: int  # bits dropped from the float32 pattern of |s|
    base_off: int  # (|s| bits >> shift) of the smallest non-collapsed bin
    num_abs_bins: int  # bins per sign
    signed: bool  # whether the table has a negative half
    bits: int  # 4 (packed) or 8
    packed: np.ndarray  # int32 [T]: base | key << 8 (one lookup per element, see _nearest_codes)
    mids: np.ndarray  # float32 [K - 1]: rounding thresholds (midpoints), ascending


def _canonical_code(code: Any) -> tuple[float, ...]:
    if isinstance(code, jax.core.Tracer):
        raise TypeError(
            "`code` must be a concrete array (e.g. dynamic_map(...)), not a traced value."
        )
    arr = np.asarray(code, dtype=np.float32).reshape(-1)
    if arr.size < 2 or arr.size > 256:
        raise ValueError(f"`code` must have 2..256 values, got {arr.size}.")
    if not np.all(np.isfinite(arr)) or np.any(np.abs(arr) > 1.0):
        raise ValueError("`code` values must be finite and in [-1, 1].")
    if np.any(np.diff(arr) < 0):
        raise ValueError("`code` must be sorted ascending (use np.sort(code)).")
    return tuple(float(v) for v in arr)


@functools.lru_cache(maxsize=64)
def _build_lut(code: tuple[float, ...]) -> _Lut:
    c = np.asarray(code, np.float32)
    k = c.size
    mids = ((c[:-1].astype(np.float64) + c[1:].astype(np.float64)) / 2).astype(np.float32)
    signed = bool(c[0] < 0)
    absmids = np.abs(mids[mids != 0]).astype(np.float64)
    tiny = absmids.min() if absmids.size else 1.0
    # Smallest bin edge: a power of two below the smallest non-zero |midpoint|.
    e_min = int(np.floor(np.log2(tiny))) - 1
    one_bits = int(np.float32(1.0).view(np.int32))
    for mbits in range(2, 16):
        shift = 23 - mbits
        base_off = int(np.float32(2.0**e_min).view(np.int32)) >> shift
        n_abs = (one_bits >> shift) - base_off + 1
        # abs bin a covers |s| in [lo_a, hi_a).
        a = np.arange(n_abs, dtype=np.int64)
        lo = ((base_off + a) << shift).astype(np.int32).view(np.float32).astype(np.float64)
        lo[0] = 0.0
        hi = ((base_off + a + 1) << shift).astype(np.int32).view(np.float32).astype(np.float64)
        m64 = mids.astype(np.float64)
        pos_base = np.searchsorted(m64, lo, side="left")  # #mids < lo
        nxt = np.minimum(pos_base + 1, k - 2)
        ok_pos = (pos_base + 1 > k - 2) | (m64[nxt] >= hi)
        if signed:
            # Negative bin for abs bin a covers s in (-hi_a, -lo_a].
            neg_base = np.searchsorted(m64, -hi, side="right")  # #mids <= -hi
            nxt_n = np.minimum(neg_base + 1, k - 2)
            ok_neg = (neg_base + 1 > k - 2) | (m64[nxt_n] >= -lo)
            if not (ok_pos.all() and ok_neg.all()):
                continue
            base = np.concatenate([neg_base[::-1], pos_base])
        else:
            if not ok_pos.all():
                continue
            base = pos_base
        thr = np.where(base < k - 1, mids[np.minimum(base, k - 2)], np.float32(np.inf))
        packed = _pack_thresholds(base, thr.astype(np.float32), lo, hi, shift, signed)
        if packed is None:
            if k > 16:
                continue
            packed = np.zeros(0, np.int32)  # maps <= 16 values round by counting midpoints
        return _Lut(
            code=c,
            base=base.astype(np.uint8),
            thr=thr.astype(np.float32),
            shift=shift,
            base_off=base_off,
            num_abs_bins=int(n_abs),
            signed=signed,
            bits=4 if k <= 16 else 8,
            packed=packed,
            mids=mids,
        )
    raise ValueError("`code` values are too close together to tabulate; spread them out.")


def _pack_thresholds(base, thr, lo, hi, shift, signed) -> Optional[np.ndarray]:
    """Merge each bin's candidate code and threshold into one int32 (one lookup, not two).

    Inside abs bin ``a`` (``|s|`` in ``[lo_a, hi_a)``, a > 0) every float32 pattern has the
    same bits above ``shift``, so ``s > thr`` only depends on the low ``shift`` bits:
    positive half: ``low(|s|) > low(thr)``; negative half (``s > thr <=> |s| < |thr|``):
    ``low(|s|) < low(|thr|)``. ``key`` stores that low part, or a value that makes the
    comparison always false when the bin holds no threshold (``2**shift`` positive, 0
    negative). Returns None if some threshold is not tabulable this way (caller refines).
    """
    n_abs = lo.size
    mask = (1 << shift) - 1
    thr_bits = np.abs(thr.astype(np.float64)).astype(np.float32).view(np.int32).astype(np.int64)

    def keys(t_abs, t_bits, positive):
        inside = np.isfinite(t_abs) & (t_abs >= lo) & (t_abs < hi)
        if np.any(inside[:1]):  # bin 0 (from 0) mixes exponents: no threshold may be in it
            return None
        none = (1 << shift) if positive else 0
        return np.where(inside, t_bits & mask, none)

    if signed:
        neg_thr = thr[:n_abs][::-1].astype(np.float64)
        pos_thr = thr[n_abs:].astype(np.float64)
        # A negative-half threshold inside (-hi, -lo] has |thr| in [lo, hi).
        k_neg = keys(np.where(neg_thr <= 0, -neg_thr, np.inf), thr_bits[:n_abs][::-1], False)
        k_pos = keys(np.where(pos_thr >= 0, pos_thr, np.inf), thr_bits[n_abs:], True)
        if k_neg is None or k_pos is None:
            return None
        key = np.concatenate([k_neg[::-1], k_pos])
    else:
        key = keys(thr.astype(np.float64), thr_bits, True)
        if key is None:
            return None
    return (base.astype(np.int64) | (key << 8)).astype(np.int32)


def _nearest_codes(s: jax.Array, lut: _Lut) -> jax.Array:
    """uint8 index of the nearest code value for ``s`` in [-1, 1] (elementwise).

    Maps with at most 16 values: the number of midpoints below ``s`` (vectorizes, no
    lookup). Larger maps: one int32 table lookup per element, indexed by the high bits of the
    float32 pattern of ``|s|``, that gives the candidate code and the low bits of the one
    midpoint that can lie in that bin (see :func:`_pack_thresholds`). Both give
    ``#{j : s > mids[j]}``, the index of the nearest code (ties at an exact midpoint go
    down).
    """
    lo_clip = -1.0 if lut.signed else 0.0
    s = jnp.clip(s, lo_clip, 1.0)
    if lut.code.size <= 16:
        count = jnp.zeros(s.shape, jnp.uint8)
        for m in lut.mids:
            count = count + (s > m).astype(jnp.uint8)
        return count
    ab = jax.lax.bitcast_convert_type(jnp.abs(s), jnp.int32)
    abin = jnp.clip((ab >> lut.shift) - lut.base_off, 0, lut.num_abs_bins - 1)
    low = ab & ((1 << lut.shift) - 1)
    if lut.signed:
        n = lut.num_abs_bins
        neg = s < 0
        idx = jnp.where(neg, n - 1 - abin, n + abin)
    else:
        idx = abin
    # t = (low - key) * 256 + (255 - base): the looked-up entry has a single user, so XLA
    # fuses the lookup instead of writing it to memory. low > key <=> t >= 256 and
    # low < key <=> t < 0; the low byte of t is 255 - base.
    t = ((low << 8) | 0xFF) - jnp.asarray(lut.packed)[idx]
    base = (255 - (t & 0xFF)).astype(jnp.uint8)
    up = t >= 256
    if lut.signed:
        up = jnp.where(neg, t < 0, up)
    return base + up.astype(jnp.uint8)


def _decode_unscaled(codes: jax.Array, table: np.ndarray) -> jax.Array:
    """``table[codes]`` as float32. Tables of at most 16 values use a select tree on the
    code bits (vectorizes; a gather does not on XLA:CPU); larger ones one gather."""
    table = np.asarray(table, np.float32)
    if table.size > 16:
        return jnp.asarray(table)[codes]
    t = np.zeros(16, np.float32)
    t[: table.size] = table
    level = [jnp.float32(v) for v in t]
    bit = 0
    while len(level) > 1:
        sel = ((codes >> bit) & 1).astype(jnp.bool_)
        level = [jnp.where(sel, level[i + 1], level[i]) for i in range(0, len(level), 2)]
        bit += 1
    return jnp.broadcast_to(level[0], codes.shape).astype(jnp.float32)


def _pack4(codes: jax.Array) -> jax.Array:
    """[nb, bs] uint8 codes < 16 -> [nb, bs // 2]: byte j = code[j] | code[j + bs/2] << 4."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def _unpack4(packed: jax.Array) -> jax.Array:
    return jnp.concatenate([packed & 0xF, packed >> 4], axis=-1)


def quantize_blocks(xb: jax.Array, code: Any) -> tuple[jax.Array, jax.Array]:
    """Quantize an already blocked float array ``[nb, bs]``.

    Returns ``(codes, absmax)``: codes uint8 ``[nb, bs]`` (or ``[nb, bs // 2]`` packed when
    the map has at most 16 values), absmax float32 ``[nb]``. Low-level building block of
    :func:`quantize_blockwise`; ``xb`` must be finite.
    """
    lut = _build_lut(_canonical_code(code))
    xb = xb.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xb), axis=-1)
    inv = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    q = _nearest_codes(xb * inv[:, None], lut)
    if lut.bits == 4:
        q = _pack4(q)
    return q, absmax


def dequantize_blocks(
    codes: jax.Array, absmax: jax.Array, code: Any, values: Optional[np.ndarray] = None
) -> jax.Array:
    """Inverse of :func:`quantize_blocks`: float32 ``[nb, bs]``.

    ``values`` optionally replaces the decoded value of each code (same length as ``code``);
    used by the optimizers to decode a zero second moment as its rounding threshold.
    """
    lut = _build_lut(_canonical_code(code))
    if lut.bits == 4:
        codes = _unpack4(codes)
    table = lut.code if values is None else np.asarray(values, np.float32)
    return _decode_unscaled(codes, table) * absmax[:, None]


# ----------------------------------------------------------------------------------------
# QuantizedArray.
# ----------------------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "absmax"],
    meta_fields=["shape", "dtype", "block_size", "code"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-wise quantized array (a pytree: ``codes`` and ``absmax`` are the leaves).

    Attributes:
      codes: uint8 ``[num_blocks, block_size]`` for maps with more than 16 values, or
        ``[num_blocks, block_size // 2]`` (two 4-bit codes per byte: element ``j`` in the low
        nibble, element ``j + block_size // 2`` in the high nibble of byte ``j``).
      absmax: float32 ``[num_blocks]``, the per-block scale (absolute maximum).
      shape: original shape (static).
      dtype: original dtype (static, normalized to ``np.dtype``);
        :func:`dequantize_blockwise` returns it.
      block_size: elements per block (static).
      code: the sorted code book as a tuple of floats (static).
    """

    codes: jax.Array
    absmax: jax.Array
    shape: tuple[int, ...]
    dtype: Any
    block_size: int
    code: tuple[float, ...]

    def __post_init__(self):
        # One canonical static part (np.dtype, tuple shape), so that trees built from
        # ``jnp.bfloat16`` or ``np.dtype("bfloat16")`` have equal structures.
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def bits(self) -> int:
        return 4 if len(self.code) <= 16 else 8

    @property
    def nbytes(self) -> int:
        """Bytes held by the leaves (codes + absmax)."""
        return _tree.nbytes(self)

    def dequantize(self) -> jax.Array:
        return dequantize_blockwise(self)


def _check_block_size(block_size: int, code_len: int) -> None:
    if not isinstance(block_size, (int, np.integer)) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}.")
    if code_len <= 16 and block_size % 2:
        raise ValueError(
            f"4-bit maps pack two codes per byte: block_size must be even, got {block_size}."
        )


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Flatten ``x``, zero-pad to a multiple of ``block_size`` and reshape to ``[nb, bs]``."""
    flat = jnp.ravel(x)
    n = flat.shape[0]
    nb = max(1, -(-n // block_size))
    pad = nb * block_size - n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(nb, block_size)


def from_blocks(xb: jax.Array, shape: tuple[int, ...], dtype: Any = None) -> jax.Array:
    """Inverse of :func:`to_blocks`."""
    n = int(np.prod(shape, dtype=np.int64))
    flat = xb.reshape(-1)
    if flat.shape[0] != n:
        flat = flat[:n]
    out = flat.reshape(shape)
    return out if dtype is None else out.astype(dtype)


def quantize_blockwise(x: jax.Array, *, code: Any, block_size: int = 256) -> QuantizedArray:
    """Block-wise absmax quantization to the nearest value of ``code``.

    Args:
      x: float array, any shape; must be finite (non-finite values give unspecified codes).
      code: sorted code book, 2..256 float values in ``[-1, 1]`` (e.g. :func:`dynamic_map`).
        Maps with at most 16 values are stored 4-bit (two codes per byte).
      block_size: elements per block (the last block is zero-padded internally).

    Returns:
      :class:`QuantizedArray` with uint8 codes and one float32 absmax per block
      (``ceil(x.size / block_size)`` blocks). An all-zero block has ``absmax == 0`` and
      dequantizes to exact zeros (no division by zero).

    Raises:
      TypeError: ``x`` is not a floating array, or ``code`` is traced.
      ValueError: bad ``code`` or ``block_size``.

    Reference: ``bitsandbytes.functional.quantize_blockwise`` (same rounding: nearest code of
    ``x / absmax``).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize_blockwise expects a floating array, got dtype {x.dtype}.")
    ctuple = _canonical_code(code)
    _check_block_size(block_size, len(ctuple))
    codes, absmax = quantize_blocks(to_blocks(x, block_size), ctuple)
    return QuantizedArray(codes, absmax, tuple(x.shape), np.dtype(x.dtype), int(block_size), ctuple)


def dequantize_blockwise(q: QuantizedArray, dtype: Optional[Any] = None) -> jax.Array:
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax`` in the original shape.

    Args:
      q: a :class:`QuantizedArray`.
      dtype: output dtype; defaults to the original dtype of the quantized array.

    Returns:
      array of shape ``q.shape``.

    Raises:
      TypeError: ``q`` is not a :class:`QuantizedArray`.
    """
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize_blockwise expects a QuantizedArray, got {type(q).__name__}.")
    xb = dequantize_blocks(q.codes, q.absmax, q.code)
    return from_blocks(xb, q.shape, q.dtype if dtype is None else dtype)
