"""Activation bytes of a Llama training step under each remat mode.

Per-layer residuals as read off ``jax.ad_checkpoint.print_saved_residuals`` of
``jmem.models.llama.loss_fn`` (after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"); the derivation is in ``docs/planner.md``.
"""

from __future__ import annotations

from typing import Any

from jmem._src import dtypes as _dtypes
from jmem._src.planner.shapes import ModelShape

__all__ = ["REMAT_MODES", "activation_bytes"]

#: Remat modes, as named by ``jmem.REMAT_POLICIES``, from most to least memory.
REMAT_MODES = ("none", "dots", "selective", "full", "offload")


def _saved_per_token(shape: ModelShape, A: int, s: int) -> dict[str, int]:
    """Bytes one layer saves per token under each remat mode (``A``: activation itemsize)."""
    h, F, a = shape.hidden_size, shape.intermediate_size, shape.num_heads
    qd, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    none = 2 * (8 + A) * h + A * (2 * qd + 2 * kv) + (4 + A) * a * s + 6 * A * F
    return {
        "none": none,
        "dots": A * (2 * h + 2 * qd + 2 * kv + 2 * F + a * s),
        "selective": A * (2 * h + qd + 2 * kv + 2 * F),
        "full": A * h,
        "offload": A * h,
    }


def _offloaded_per_token(shape: ModelShape, A: int) -> int:
    """Bytes one layer sends to host per token under ``offload`` (selective's residuals)."""
    h, F = shape.hidden_size, shape.intermediate_size
    qd, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return A * (h + qd + 2 * kv + 2 * F)


def activation_bytes(
    shape: ModelShape,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    activation_dtype: Any = "bf16",
    remat: str | None = None,
) -> dict[str, int]:
    """Bytes of activations kept for the backward pass of one micro-batch, by part.

    ``layers``: the residuals the layer scan saves (per layer and token, ``none`` is
    ``2 (8 + A) h + A (2 qd + 2 kv) + (4 + A) a s + 6 A F``; ``full`` keeps the layer
    input ``A h``); ``recompute``: one layer's ``none`` residuals, live while the backward
    pass recomputes it (any remat); ``logits``: fp32 logits and their gradient
    ``8 b s V``; ``other``: the embedding output and the causal mask ``5 b a s^2``;
    ``host_activations``: what ``offload`` keeps in host memory. The derivation and the
    table of modes are in ``docs/planner.md``.

    Args:
      shape: a :class:`ModelShape` (see :func:`resolve_shape`).
      batch_size: sequences per micro-batch on this device (``b``).
      seq_len: tokens per sequence (``s``).
      activation_dtype: dtype of activations (the compute dtype; ``A`` bytes).
      remat: one of :data:`REMAT_MODES` (``None`` = ``"none"``).

    Returns:
      ``{"layers", "recompute", "logits", "other", "host_activations"}`` in bytes.

    Raises:
      ValueError: for an unknown remat mode or non-positive sizes.

    Source: Korthikanti et al. 2022, Sec. 4 (``s b h (34 + 5 a s / h)`` per GPT layer),
    adapted to jmem's Llama (fp32 RMSNorm, GQA, SwiGLU, no dropout).
    """
    remat = "none" if remat is None else remat
    if remat not in REMAT_MODES:
        raise ValueError(f"remat={remat!r} is not one of {REMAT_MODES}.")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1; got {batch_size}, {seq_len}.")
    A = _dtypes.itemsize(activation_dtype, "activation_dtype")
    L, s, t = shape.num_layers, seq_len, batch_size * seq_len
    saved = _saved_per_token(shape, A, s)
    host = L * t * _offloaded_per_token(shape, A) if remat == "offload" else 0
    return {
        "layers": L * t * saved[remat],
        "recompute": 0 if remat == "none" else t * saved["none"],
        "logits": 2 * 4 * t * shape.vocab_size,
        "other": A * t * shape.hidden_size + 5 * batch_size * shape.num_heads * s * s,
        "host_activations": host,
    }
