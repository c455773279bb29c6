"""NF4 (4-bit NormalFloat) block-wise weight quantization with double quantization.

Bit-exact with bitsandbytes on CPU (``functional.quantize_4bit(quant_type="nf4")`` /
``dequantize_4bit``); 0.516 bytes per parameter with 64-blocks and double quantization.
Source: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"
(arXiv:2305.14314). Format details and stacking: ``docs/lora.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src import quantization as _quantization
from jmem._src import tree as _tree

__all__ = ["NF4_TABLE", "NF4Array", "quantize", "dequantize", "bytes_per_param"]

#: The 16 NF4 code values (bitsandbytes ``get_4bit_type("nf4")``), sorted, float32.
NF4_TABLE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)

# Decision boundaries: a scaled value v gets code i with mid[i-1] < v <= mid[i].
_NF4_MIDPOINTS = ((NF4_TABLE[:-1] + NF4_TABLE[1:]) / np.float32(2)).astype(np.float32)

_VALID_BLOCKS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


# The signed 8-bit dynamic map (bitsandbytes ``create_dynamic_map(signed=True)``) codes the
# absmax of each block under double quantization.
_DYNAMIC_MAP = np.asarray(_quantization.dynamic_map(True, 8), np.float32)


@dataclasses.dataclass(frozen=True)
class NF4Array:
    """A weight stored in NF4; a pytree whose leaves are the packed fields.

    Leaves (``*B`` = the stacked leading axes of ``shape``; ``nb`` = blocks per matrix):
      packed: uint8 ``[*B, nb * block_size // 2]``: two 4-bit codes per byte, first
        element in the high nibble.
      absmax: float32 ``[*B, nb]`` (``double_quant=False``) or uint8 ``[*B, nb]`` codes into
        the signed dynamic map (``double_quant=True``).
      absmax_scale: float32 ``[*B, ceil(nb / 256)]``, the second-level block absmax
        (``None`` without double quantization).
      absmax_offset: float32 ``[*B]``, the mean subtracted from absmax before quantizing it
        (``None`` without double quantization).

    Static metadata: ``shape`` (the logical shape, incl. stacked axes), ``dtype`` (the
    original dtype, which ``dequantize`` returns by default in ``jmem.qlora``),
    ``block_size``, ``double_quant``, ``batch_ndim`` (number of stacked axes).
    """

    packed: Any
    absmax: Any
    absmax_scale: Any = None
    absmax_offset: Any = None
    shape: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))
    block_size: int = dataclasses.field(default=64, metadata=dict(static=True))
    double_quant: bool = dataclasses.field(default=True, metadata=dict(static=True))
    batch_ndim: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of logical elements (parameters)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed fields (codes, absmax codes, scales, offsets)."""
        return _tree.nbytes(self)

    def dequantize(self, dtype=None) -> jax.Array:
        """The dense weight (``dequantize(self, dtype)``; its own dtype by default)."""
        return dequantize(self, self.dtype if dtype is None else dtype)


jax.tree_util.register_dataclass(
    NF4Array,
    data_fields=["packed", "absmax", "absmax_scale", "absmax_offset"],
    meta_fields=["shape", "dtype", "block_size", "double_quant", "batch_ndim"],
)


def bytes_per_param(q: NF4Array) -> float:
    """Stored bytes per logical element of ``q`` (0.516 with double quantization, 64-blocks)."""
    return _tree.nbytes(q) / q.size


def _split_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    batch = tuple(shape[:-2]) if len(shape) >= 3 else ()
    return batch, math.prod(shape[len(batch) :])


def _nearest_code(v: jax.Array, code: np.ndarray) -> jax.Array:
    """Index of the nearest value of sorted ``code``; ties go to the lower index."""
    code_j = jnp.asarray(code)
    i = jnp.clip(jnp.searchsorted(code_j, v, side="right") - 1, 0, len(code) - 2)
    left, right = code_j[i], code_j[i + 1]
    return jnp.where(jnp.abs(v - right) < jnp.abs(v - left), i + 1, i).astype(jnp.uint8)


def _blockwise_8bit(v: jax.Array, block: int):
    """Block-wise 8-bit quantization of ``v [*B, n]`` with the signed dynamic map.

    Mirrors bitsandbytes' CPU ``quantize_blockwise``: absmax per block, ``v / absmax``,
    nearest code. Returns (uint8 codes ``[*B, n]``, float32 absmax ``[*B, ceil(n/block)]``).
    """
    n = v.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    vp = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)]).reshape(*v.shape[:-1], nb, block)
    amax = jnp.max(jnp.abs(vp), axis=-1)
    safe = jnp.where(amax > 0, amax, 1.0)
    normed = jnp.clip(vp / safe[..., None], -1.0, 1.0)
    codes = _nearest_code(normed, _DYNAMIC_MAP).reshape(*v.shape[:-1], nb * block)[..., :n]
    return codes, amax


def _check_block_size(block_size: int) -> None:
    if block_size not in _VALID_BLOCKS:
        raise ValueError(
            f"block_size must be one of {_VALID_BLOCKS} (as bitsandbytes); got {block_size!r}."
        )


@functools.partial(jax.jit, static_argnames=("block_size", "double_quant"))
def quantize(w: jax.Array, *, block_size: int = 64, double_quant: bool = True) -> NF4Array:
    """Quantizes a float array to NF4 (bitsandbytes' ``quantize_4bit(quant_type="nf4")``).

    Args:
      w: float16/bfloat16/float32 array, rank >= 1. Rank >= 3 is a stack of matrices over
        the leading axes (each quantized on its own; see module docstring).
      block_size: elements per absmax block (32 ... 4096, powers of two; default 64).
      double_quant: also quantize the absmax values to 8 bits (blocks of 256, signed
        dynamic map, mean subtracted), as bitsandbytes' ``compress_statistics=True``.

    Returns:
      An ``NF4Array``; ``dequantize`` gives back an array of ``w.shape``.
      Bytes per parameter: 0.5 + 4/block_size (single) or 0.5 + 1/block_size +
      4/(block_size*256) (double): 0.5627 / 0.5159 at block 64.

    Raises:
      TypeError: if ``w`` is not a floating-point array.
      ValueError: for an unsupported ``block_size`` or an empty / 0-d array.
    """
    _check_block_size(block_size)
    if not (hasattr(w, "shape") and hasattr(w, "dtype")):
        raise TypeError(
            f"nf4.quantize takes one array, got {type(w).__name__}; for a params tree use "
            "jmem.qlora.quantize_params(params)."
        )
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"NF4 quantizes floating-point weights; got dtype {w.dtype}.")
    if w.ndim == 0 or w.size == 0:
        raise ValueError(f"NF4 needs a non-empty array of rank >= 1; got shape {w.shape}.")
    shape = tuple(w.shape)
    batch, n = _split_shape(shape)
    nb = -(-n // block_size)
    pad = nb * block_size - n
    flat = w.astype(jnp.float32).reshape(*batch, n)
    blocks = jnp.pad(flat, [(0, 0)] * len(batch) + [(0, pad)]).reshape(*batch, nb, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)  # [*B, nb] float32
    nonzero = absmax > 0
    safe = jnp.where(nonzero, absmax, 1.0)
    # bitsandbytes multiplies full blocks by 1/absmax but divides the partial last block.
    scaled = blocks * jnp.where(nonzero, 1.0 / safe, 0.0)[..., None]
    if pad:
        last = blocks[..., -1, :] / safe[..., -1:]
        scaled = scaled.at[..., -1, :].set(last)
    scaled = jnp.clip(scaled, -1.0, 1.0)
    codes = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), scaled, side="left").astype(jnp.uint8)
    codes = codes.reshape(*batch, nb * block_size)
    packed = (codes[..., 0::2] << 4) | codes[..., 1::2]
    if not double_quant:
        return NF4Array(
            packed=packed,
            absmax=absmax,
            shape=shape,
            dtype=jnp.dtype(w.dtype),
            block_size=block_size,
            double_quant=False,
            batch_ndim=len(batch),
        )
    offset = jnp.mean(absmax, axis=-1)
    qabs, scale2 = _blockwise_8bit(absmax - offset[..., None], 256)
    return NF4Array(
        packed=packed,
        absmax=qabs,
        absmax_scale=scale2,
        absmax_offset=offset,
        shape=shape,
        dtype=jnp.dtype(w.dtype),
        block_size=block_size,
        double_quant=True,
        batch_ndim=len(batch),
    )


def dequantize_absmax(q: NF4Array) -> jax.Array:
    """The float32 per-block absmax ``[*B, nb]`` of ``q`` (decoding double quantization)."""
    if not q.double_quant:
        return q.absmax.astype(jnp.float32)
    nb = q.absmax.shape[-1]
    scale = jnp.repeat(
        q.absmax_scale, 256, axis=-1, total_repeat_length=q.absmax_scale.shape[-1] * 256
    )
    absmax = jnp.asarray(_DYNAMIC_MAP)[q.absmax.astype(jnp.int32)] * scale[..., :nb]
    return absmax + q.absmax_offset[..., None]


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: NF4Array, dtype=jnp.bfloat16) -> jax.Array:
    """Decodes an ``NF4Array`` (bitsandbytes' ``dequantize_4bit``).

    Args:
      q: from ``quantize``.
      dtype: output dtype (default bfloat16). Values are computed in float32
        (``table[code] * absmax``) and cast, as bitsandbytes does.

    Returns:
      An array of ``q.shape`` and ``dtype``.

    Raises:
      TypeError: if ``q`` is not an ``NF4Array``.
    """
    if not isinstance(q, NF4Array):
        raise TypeError(
            f"dequantize expects an NF4Array (from jmem.nf4.quantize); got {type(q).__name__}."
        )
    batch, n = _split_shape(q.shape)
    absmax = dequantize_absmax(q)  # [*B, nb] float32
    nb = absmax.shape[-1]
    hi = q.packed >> 4
    lo = q.packed & 0xF
    codes = jnp.stack([hi, lo], axis=-1).reshape(*batch, nb, q.block_size)
    vals = jnp.asarray(NF4_TABLE)[codes.astype(jnp.int32)] * absmax[..., None]
    vals = vals.reshape(*batch, nb * q.block_size)[..., :n]
    return vals.reshape(q.shape).astype(dtype)
