"""The reference Llama's final hidden states and output head, for losses that never hold the
``[B, S, V]`` logits (``jmem.ops.sequence_logprobs``, ``jmem.losses``): ``llama.forward``
without its head, after Rafailov et al. 2023's per-sequence log-probs (arXiv:2305.18290).
"""

from __future__ import annotations

from typing import Any
from typing import Callable

import jax

from jmem._src.sequence_logprobs import SequenceLogprobs
from jmem._src.sequence_logprobs import sequence_logprobs as _sequence_logprobs
from jmem.models import llama

__all__ = ("hidden_states", "head_kernel", "sequence_logprobs")


def hidden_states(
    params: llama.Params,
    tokens: jax.Array,
    config: llama.LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    layer_transform: Callable | None = None,
    levers: Any = None,
) -> jax.Array:
    """The final hidden states of ``llama.forward``, after the final norm, before the head.

    ``llama.forward(params, tokens, config)`` equals these times ``head_kernel(params,
    config)`` (float32 accumulation), soft-capped with ``config.final_logit_softcap``.

    Args:
      params, tokens, config, positions, segment_ids, layer_transform, levers: as
        ``llama.forward`` (tokens int32 ``[B, S]``).

    Returns:
      ``[B, S, H]`` in the activations' dtype (the embedding's).

    Raises:
      ValueError: as ``llama.forward`` (misshaped tokens, positions or segment ids).
    """
    x, _ = llama.hidden_states(
        params,
        tokens,
        config,
        positions=positions,
        segment_ids=segment_ids,
        layer_transform=layer_transform,
        levers=levers,
    )
    return llama.final_norm(params, x, config)


#: The output head ``[H, V]``: ``lm_head/kernel``, or ``embedding.T`` when tied.
head_kernel = llama.head_kernel


def sequence_logprobs(
    params: llama.Params,
    rows: dict[str, jax.Array],
    config: llama.LlamaConfig,
    *,
    levers: Any = None,
) -> SequenceLogprobs:
    """Per-row summed / mean target log-probs over response tokens, without logits.

    ``jmem.ops.sequence_logprobs(hidden_states(...), head_kernel(...), rows["targets"],
    rows["completion_mask"], chunk=levers.loss_chunk,
    logit_softcap=config.final_logit_softcap)``: the ``logprobs_fn`` of
    ``jmem.losses.preference_loss`` (with ``functools.partial(..., config=cfg)``).

    Args:
      params: the (possibly NF4/LoRA-applied) params.
      rows: ``{"inputs": int32[N, S], "targets": int32[N, S], "completion_mask": [N, S]}``
        and optional ``"positions"``, ``"segment_ids"`` (int32 ``[N, S]``).
      config: the model's ``LlamaConfig``.
      levers: a ``jmem.Levers`` or ``ResolvedLevers`` (None: ``jmem.Levers()``): the
        model's execution settings, ``loss_chunk`` tokens per chunk (0 = dense logits).

    Returns:
      ``jmem.ops.SequenceLogprobs`` with float32 ``[N]`` leaves.

    Raises:
      ValueError: misshaped rows; KeyError: a missing ``inputs``/``targets``/``completion_mask``.
    """
    x, lv = llama.hidden_states(
        params,
        rows["inputs"],
        config,
        positions=rows.get("positions"),
        segment_ids=rows.get("segment_ids"),
        layer_transform=None,
        levers=levers,
    )
    return _sequence_logprobs(
        llama.final_norm(params, x, config),
        head_kernel(params, config),
        rows["targets"],
        rows["completion_mask"],
        chunk=lv.loss_chunk,
        logit_softcap=config.final_logit_softcap,
    )
