"""The language-model loss: mean next-token cross-entropy, computed over token chunks
(``jmem.ops.linear_cross_entropy``) so that the ``[B, S, V]`` logits are never held.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmem._src.linear_cross_entropy import ignore_negative_targets
from jmem._src.linear_cross_entropy import linear_cross_entropy
from jmem._src.linear_cross_entropy import token_nll
from jmem._src.offload import params as offload_params
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.decoder import hidden_states
from jmem.models.llama.decoder import with_fp8
from jmem.models.llama.layers import final_norm
from jmem.models.llama.layers import head_kernel


@jax.named_scope("cross_entropy")
def cross_entropy(
    logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Mean token cross-entropy (nats). logits ``[B,S,V]`` float, targets int ``[B,S]``;
    ``mask`` optional ``[B, S]`` weights. A negative target (PyTorch's ``ignore_index=-100``)
    weighs 0, as in ``linear_cross_entropy``."""
    weight, targets = ignore_negative_targets(targets, mask)
    nll = token_nll(logits, targets)
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def loss_fn(
    params: Params,
    batch: dict[str, jax.Array],
    config: LlamaConfig,
    *,
    levers: Any = None,
    **kwargs,
) -> jax.Array:
    """Mean next-token cross-entropy of ``batch = {"inputs": [B,S], "targets": [B,S]}``.

    Optional batch entries, int32/float ``[B, S]``: ``"mask"`` (loss weight per target),
    ``"positions"`` and ``"segment_ids"`` (packed rows; passed to ``forward``). Extra
    keyword arguments go to ``forward``. ``levers``: as ``forward``'s (None:
    ``jmem.Levers()``). The loss is computed ``levers.loss_chunk`` tokens at a time
    (``linear_cross_entropy``, with ``final_logit_softcap``), never holding the
    ``[B, S, V]`` logits unless ``loss_chunk=0``. ``fp8=metas`` is deprecated:
    ``jmem.fp8.apply(loss_fn)(params, metas, batch, config, ...)``."""
    fp8 = kwargs.pop("fp8", None)
    if fp8 is not None:
        return with_fp8(loss_fn, "loss_fn", params, fp8, batch, config, levers=levers, **kwargs)
    kwargs = {"layer_transform": None, **kwargs}
    params = offload_params.fetch_resident(params, levers)
    x, lv = hidden_states(
        params,
        batch["inputs"],
        config,
        positions=batch.get("positions"),
        segment_ids=batch.get("segment_ids"),
        levers=levers,
        **kwargs,
    )
    return linear_cross_entropy(
        final_norm(params, x, config),
        head_kernel(params, config),
        batch["targets"],
        batch.get("mask"),
        chunk=lv.loss_chunk,
        logit_softcap=config.final_logit_softcap,
    )
