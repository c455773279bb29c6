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
from jmem.models.llama.decoder import decode_layers
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
    """Mean next-token cross-entropy of ``batch = {"inputs": [B,S], "targets": [B,S]}``,
    plus ``router_aux_loss_coef`` times the load-balancing loss for a mixture-of-experts
    config (``num_experts > 0``; as transformers' ``MixtralForCausalLM`` and
    ``Qwen3MoeForCausalLM`` add it when ``output_router_logits``).

    Optional batch entries, int32/float ``[B, S]``: ``"mask"`` (loss weight per target),
    ``"positions"`` and ``"segment_ids"`` (packed rows; passed to ``forward``). Extra
    keyword arguments go to ``forward``. ``levers``: as ``forward``'s (None:
    ``jmem.Levers()``). The loss is computed ``levers.loss_chunk`` tokens at a time
    (``linear_cross_entropy``, with ``final_logit_softcap``), never holding the
    ``[B, S, V]`` logits unless ``loss_chunk=0``. ``loss_terms`` returns the two terms
    apart. ``fp8=metas`` is deprecated:
    ``jmem.fp8.apply(loss_fn)(params, metas, batch, config, ...)``."""
    fp8 = kwargs.pop("fp8", None)
    if fp8 is not None:
        return with_fp8(loss_fn, "loss_fn", params, fp8, batch, config, levers=levers, **kwargs)
    return loss_terms(params, batch, config, levers=levers, **kwargs)["loss"]


def loss_terms(
    params: Params,
    batch: dict[str, jax.Array],
    config: LlamaConfig,
    *,
    levers: Any = None,
    **kwargs,
) -> dict[str, jax.Array]:
    """``loss_fn``'s loss and its terms, float32 scalars: ``{"loss", "cross_entropy",
    "router_aux_loss"}`` with ``loss = cross_entropy + router_aux_loss_coef *
    router_aux_loss``; ``router_aux_loss`` is the load-balancing loss over every layer and
    every token of ``batch["inputs"]`` (transformers' ``load_balancing_loss_func`` without
    an attention mask: padding counts), 0 for a dense config. For
    ``jax.grad(..., has_aux=True)``: ``lambda p, b: (t := loss_terms(p, b, cfg))["loss"], t``.
    Arguments as ``loss_fn``."""
    kwargs = {"layer_transform": None, **kwargs}
    params = offload_params.fetch_resident(params, levers)
    x, lv, aux = decode_layers(
        params,
        batch["inputs"],
        config,
        positions=batch.get("positions"),
        segment_ids=batch.get("segment_ids"),
        levers=levers,
        **kwargs,
    )
    ce = linear_cross_entropy(
        final_norm(params, x, config),
        head_kernel(params, config),
        batch["targets"],
        batch.get("mask"),
        chunk=lv.loss_chunk,
        logit_softcap=config.final_logit_softcap,
    )
    if aux is None:
        return {"loss": ce, "cross_entropy": ce, "router_aux_loss": jnp.zeros((), jnp.float32)}
    loss = ce + config.router_aux_loss_coef * aux
    return {"loss": loss, "cross_entropy": ce, "router_aux_loss": aux}
