"""Per-sequence log-probabilities of target tokens under a linear output head, computed over
token chunks so that the ``[B, S, V]`` logits never exist at once: the chunked loop and
custom-VJP head matmul of ``linear_cross_entropy`` (after Cut Cross-Entropy, Wijmans et al.
2024, arXiv:2411.09009), keeping per-token log-probs ``[B, S]`` instead of their mean, as
the preference losses need (Liger Kernel's chunked preference losses, arXiv:2410.10989).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jmem._src.linear_cross_entropy import _check
from jmem._src.linear_cross_entropy import _group_chunks
from jmem._src.linear_cross_entropy import _logits
from jmem._src.linear_cross_entropy import token_nll
from jmem._src.mesh_batch import batch_groups

__all__ = ("SequenceLogprobs", "sequence_logprobs", "token_logprobs")


@dataclasses.dataclass(frozen=True)
class SequenceLogprobs:
    """Target log-probabilities of each sequence over its masked (response) tokens.

    Attributes:
      sum: float32 ``[B]``, ``sum_t mask[b, t] * log p(targets[b, t])`` (nats).
      mean: float32 ``[B]``, ``sum / max(count, 1)``: the length-normalised log-prob
        (ORPO, SimPO, IPO).
      count: float32 ``[B]``, ``sum_t mask[b, t]``: the response tokens (weights) counted.
    """

    sum: jax.Array
    mean: jax.Array
    count: jax.Array


jax.tree_util.register_dataclass(
    SequenceLogprobs, data_fields=["sum", "mean", "count"], meta_fields=[]
)


def _token_logprobs(head, logit_softcap, x, targets, temperature=1.0):
    """float32 ``[N]`` log-probs of ``targets [N]`` under the logits ``x [N, H] @ head``
    (soft-capped, then divided by ``temperature``)."""
    logits = _logits(x, head.astype(x.dtype))
    if temperature != 1.0:
        if logit_softcap is not None:
            logits = logit_softcap * jnp.tanh(logits / logit_softcap)
        return -token_nll(logits / temperature, targets, None)
    return -token_nll(logits, targets, logit_softcap)


def _chunk_logprobs(head, logit_softcap, temperature, carry, xs):
    x, targets = xs
    return carry, _token_logprobs(head, logit_softcap, x, targets, temperature)


def _grouped_logprobs(head, logit_softcap, hidden, targets, chunk, temperature):
    """float32 ``[B, S]`` target log-probs, chunked per row group of the mesh's batch split
    (``linear_cross_entropy._group_chunks``: ``[K, G, chunk, ...]`` scan inputs), so that
    each device computes its own rows' chunks."""
    b, s = targets.shape
    xs, ts = _group_chunks(chunk, hidden, targets)
    k, g = ts.shape[:2]

    def body(carry, xs_):
        x, t = xs_
        x, t = x.reshape(-1, x.shape[-1]), t.reshape(-1)
        logp = _token_logprobs(head, logit_softcap, x, t, temperature)
        return carry, logp.reshape(xs_[1].shape)

    _, logp = lax.scan(jax.checkpoint(body), (), (xs, ts))  # [K, G, chunk]
    logp = logp.swapaxes(0, 1).reshape(g, k * chunk)[:, : b // g * s]
    return logp.reshape(b, s)


def _chunked_logprobs(hidden, head, targets, chunk, logit_softcap, temperature):
    """float32 ``[B, S]`` log-probs of ``targets`` (valid ids), over chunks of tokens."""
    b, s, h = hidden.shape
    n = b * s
    g = batch_groups(b)[1]
    if chunk == 0 or chunk >= n // g:  # each device's tokens: one chunk
        x, t = hidden.reshape(n, h), targets.reshape(n)
        return _token_logprobs(head, logit_softcap, x, t, temperature).reshape(b, s)
    if g > 1:  # a mesh splits the rows: each device chunks its own tokens
        return _grouped_logprobs(head, logit_softcap, hidden, targets, chunk, temperature)
    pad = -n % chunk
    xs = jnp.pad(hidden.reshape(n, h), ((0, pad), (0, 0))).reshape(-1, chunk, h)
    ts = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)
    step = lambda c, xs_: _chunk_logprobs(head, logit_softcap, temperature, c, xs_)
    _, logp = lax.scan(jax.checkpoint(step), (), (xs, ts))
    return logp.reshape(-1)[:n].reshape(b, s)


@jax.named_scope("token_logprobs")
def token_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    chunk: int,
    logit_softcap: float | None = None,
    temperature: float = 1.0,
) -> jax.Array:
    """Per-token target log-probs ``[B, S]``, chunked as ``sequence_logprobs`` (no ``[B, S,
    V]`` logits): what GRPO's clipped ratio needs per completion token.

    ``log_softmax(softcap(hidden @ head) / temperature)[targets]``, float32, 0 where
    ``mask`` is 0 (those targets are never read). ``temperature`` is the sampler's, as
    TRL's ``GRPOTrainer`` divides the logits by it before its log-probs.

    Args:
      hidden: ``[B, S, H]`` final hidden states, float32 or 16-bit.
      head: ``[H, V]`` output kernel.
      targets: int ``[B, S]``, the next token of each position.
      mask: optional ``[B, S]``, nonzero on the tokens to compute; default every token.
      chunk: tokens per chunk (0: all at once); per device on a mesh that splits rows.
      logit_softcap: None or ``c`` (Gemma 2's ``final_logit_softcapping``).
      temperature: a positive divisor of the (soft-capped) logits.

    Returns:
      float32 ``[B, S]`` (nats).

    Raises:
      ValueError: misshaped inputs, non-integer targets, a negative / non-int ``chunk``,
        or a temperature that is not positive.

    Source: TRL's ``GRPOTrainer._get_per_token_logps`` (``selective_log_softmax`` of the
    logits over temperature), chunked after Cut Cross-Entropy (arXiv:2411.09009).
    """
    _check(hidden, head, targets, mask, chunk, "token_logprobs", "hidden")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0; got {temperature!r}.")
    weight = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    targets = jnp.where(weight != 0, targets, 0).astype(jnp.int32)
    logp = _chunked_logprobs(hidden, head, targets, chunk, logit_softcap, float(temperature))
    return jnp.where(weight != 0, logp, 0.0)


@jax.named_scope("sequence_logprobs")
def sequence_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    chunk: int,
    logit_softcap: float | None = None,
) -> SequenceLogprobs:
    """Per-sequence sum, mean and count of the target log-probs over masked tokens, chunked.

    ``log p(targets[b, t]) = logits[b, t, targets[b, t]] - logsumexp(logits[b, t])`` with
    ``logits = hidden @ head`` (float32, soft-capped with ``logit_softcap``), summed over the
    tokens where ``mask`` is nonzero (weighted by it). As ``jmem.ops.linear_cross_entropy``:
    the ``B * S`` tokens are cut into chunks of ``chunk``; a ``lax.scan`` computes one chunk's
    float32 logits ``[chunk, V]`` and keeps only the picked log-prob, and (checkpointed, with
    the head matmul's custom VJP) recomputes that chunk's logits in the backward pass. The
    largest temporaries are ``[chunk, V]`` float32 instead of ``[B, S, V]``; what is kept is
    ``[B, S]`` float32. The head is cast to ``hidden``'s dtype and the matmul accumulates in
    float32. Under ``jmem.qlora.apply`` an NF4 or LoRA head stays implicit (dequantized per
    chunk).

    Targets where ``mask`` is 0 are never read (they may be ``-100`` or any padding id).

    Args:
      hidden: ``[B, S, H]`` final hidden states (after the final norm), float32 or 16-bit.
        For a preference batch, the chosen and rejected answers are rows of one batch.
      head: ``[H, V]`` output kernel; a tied head is ``embedding.T`` (``embedding [V, H]``).
      targets: int ``[B, S]``, the next token of each position (already shifted).
      mask: optional ``[B, S]`` weights (bool, int or float), 1 on the response tokens to
        count, 0 elsewhere (prompt, padding). Default: every token.
      chunk: tokens per chunk (per device on a mesh that splits the batch rows: each device
        chunks its own rows); 0 (or ``>= B * S``, per device) computes all logits at once.
      logit_softcap: None or ``c``: logits become ``c * tanh(logits / c)`` (Gemma 2's
        ``final_logit_softcapping``).

    Returns:
      ``SequenceLogprobs(sum, mean, count)``, each float32 ``[B]`` (nats; tokens).

    Raises:
      ValueError: misshaped inputs, non-integer targets, or a negative / non-int ``chunk``.

    Source: the per-sequence log-probs of DPO (Rafailov et al. 2023, arXiv:2305.18290) as
    TRL's ``get_batch_logps``/``selective_log_softmax`` compute them from dense logits.
    """
    _check(hidden, head, targets, mask, chunk, "sequence_logprobs", "hidden")
    b, s = targets.shape
    weight = jnp.ones((b, s), jnp.float32) if mask is None else mask.astype(jnp.float32)
    targets = jnp.where(weight != 0, targets, 0).astype(jnp.int32)
    logp = _chunked_logprobs(hidden, head, targets, chunk, logit_softcap, 1.0)
    total = jnp.sum(logp * weight, axis=1)
    count = jnp.sum(weight, axis=1)
    return SequenceLogprobs(sum=total, mean=total / jnp.maximum(count, 1.0), count=count)
