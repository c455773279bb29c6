"""Cross-entropy of a linear output head computed over token chunks, so the ``[B, S, V]``
logits never exist at once: a ``lax.scan`` over chunks whose body (head matmul,
log-sum-exp, picked logit) is checkpointed and recomputed in the backward pass, as Apple's
Cut Cross-Entropy (Wijmans et al. 2024, arXiv:2411.09009) and unsloth's chunked loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jmem._src import partial_sums
from jmem._src.mesh_batch import constrain_groups
from jmem._src.mesh_batch import expert_split
from jmem._src.mesh_batch import split_tokens
from jmem._src.mesh_batch import token_groups
from jmem._src.sharding import CONTEXT_AXIS

__all__ = ("ignore_negative_targets", "linear_cross_entropy", "token_nll")


def token_nll(logits: jax.Array, targets: jax.Array, logit_softcap: float | None = None):
    """Per-token negative log-likelihood (nats, float32) of int ``targets [...]`` under
    ``logits [..., V]``, after ``c * tanh(logits / c)`` with ``logit_softcap=c``."""
    logits = logits.astype(jnp.float32)
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


@jax.custom_vjp
def _logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """float32 logits ``[N, V]`` of ``x [N, H]`` and ``head [H, V]`` (both of one dtype)."""
    return jnp.einsum("nh,hv->nv", x, head, preferred_element_type=jnp.float32)


def _logits_fwd(x, head):
    return _logits(x, head), (x, head)


def _logits_bwd(res, g):
    """The logits' cotangent in the inputs' dtype, as a bfloat16 matmul's backward pass is
    computed (PyTorch autocast; float32 inputs: unchanged). JAX's own rule multiplies the
    float32 cotangent by the head, which XLA:CPU does in float32: a float32 copy of the
    whole head per chunk (2 GiB for a 128k x 4096 head)."""
    x, head = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("nv,hv->nh", g, head, preferred_element_type=jnp.float32)
    dhead = jnp.einsum("nh,nv->hv", x, g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dhead.astype(head.dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


@jax.custom_vjp
def _value_before_backward(total: jax.Array) -> jax.Array:
    """``total`` unchanged; its backward pass waits for ``total``'s forward value.

    The loss's forward scan only feeds the reported value (the backward pass recomputes
    each chunk), so XLA's scheduler may sink it to the end of the step, keeping its input,
    the final hidden states ``[B, S, H]``, live across the whole backward pass (seen on the
    h100_sxm compile of the 8B QLoRA step from 512k tokens on: one more ``[S, H]`` buffer
    at the peak). Tying the cotangent to the value with an optimization barrier computes
    the value first."""
    return total


def _value_before_backward_fwd(total):
    return total, total


def _value_before_backward_bwd(total, g):
    g, _ = lax.optimization_barrier((g, total))
    return (g,)


_value_before_backward.defvjp(_value_before_backward_fwd, _value_before_backward_bwd)


def ignore_negative_targets(targets: jax.Array, mask: jax.Array | None):
    """``(weight, targets)``: float32 ``[B, S]`` loss weights (``mask``, 1 without one) that
    are 0 where a target is negative (PyTorch's ``ignore_index=-100`` convention), and the
    targets with those ids set to 0 (a valid index, never read with weight 0): a negative
    id would otherwise wrap around the vocabulary and be trained on."""
    weight = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    ignored = targets < 0
    return jnp.where(ignored, 0.0, weight), jnp.where(ignored, 0, targets)


def _chunk_sum(head, logit_softcap, carry, xs):
    """Adds one chunk's masked NLL sum to ``carry`` (float32 scalar); ``xs``: ``x [G, C, H]``,
    ``targets``/``weight [G, C]``."""
    x, targets, weight = xs
    logits = _logits(x.reshape(-1, x.shape[-1]), head.astype(x.dtype)).reshape(*x.shape[:2], -1)
    return carry + jnp.sum(token_nll(logits, targets, logit_softcap) * weight), None


def _check(x, head, targets, mask, chunk, fn="linear_cross_entropy", x_name="x"):
    """ValueError naming a misshaped input of ``fn`` (``x_name``: how it calls ``x``)."""
    if x.ndim != 3 or head.ndim != 2 or head.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{fn} needs {x_name} [B, S, H] and head [H, V]; got {x_name}{x.shape}, "
            f"head{head.shape}."
        )
    if targets.shape != x.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets must be an integer array [B, S] = {x.shape[:2]}; got "
            f"{targets.dtype}{targets.shape}."
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise ValueError(f"mask must be [B, S] = {x.shape[:2]}; got {mask.shape}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"chunk must be an int >= 0 (0 = unchunked); got {chunk!r}.")


@jax.named_scope("cross_entropy")
def linear_cross_entropy(
    x: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    chunk: int,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Token-weighted mean cross-entropy of the logits ``x @ head``, chunk by chunk.

    Equal to ``llama.cross_entropy(x @ head, targets, mask)``: ``sum(nll * mask) /
    max(sum(mask), 1)`` (the mean over tokens without ``mask``), so microbatches combine
    as ``jmem.accumulate_gradients`` weights them (by their unmasked-token counts). The
    ``B * S`` tokens are cut into chunks of ``chunk`` (on a mesh in context that splits the
    batch, each device's own tokens: ``_group_chunks``); a ``lax.scan`` computes one chunk's
    float32 logits ``[chunk, V]``, its log-sum-exp and the picked logit, keeps only their
    masked sum, and (checkpointed) recomputes that chunk's logits in the backward pass, so
    the largest temporaries are ``[chunk, V]`` float32 (forward and backward) instead of
    ``[B, S, V]``. The head is cast to ``x``'s dtype (as an untied or tied head,
    ``embedding.T``, is in ``llama.forward``) and the matmul accumulates in float32.

    Under ``jmem.qlora.apply`` an NF4 or LoRA head stays implicit: it is a constant of the
    scan, and each chunk's matmul goes through its rule (an NF4 head is dequantized per
    chunk, one ``[H, V]`` temporary at a time).

    Args:
      x: ``[B, S, H]`` final hidden states (after the final norm).
      head: ``[H, V]`` output kernel.
      targets: int ``[B, S]``; a negative id (PyTorch's ``ignore_index=-100``) is
        ignored, as a 0 in ``mask``.
      mask: optional ``[B, S]`` loss weights (bool, int or float), 0 = ignored.
      chunk: tokens per chunk (per device of the batch split); 0 (or ``>= B * S``, per
        device) computes all logits at once.
      logit_softcap: None or ``c``: logits become ``c * tanh(logits / c)`` (Gemma 2's
        final-logit soft-capping).

    Returns:
      float32 scalar, nats per (unmasked) token.

    Raises:
      ValueError: misshaped inputs or a negative / non-int ``chunk``.
    """
    _check(x, head, targets, mask, chunk)
    b, s, h = x.shape
    n = b * s
    weight, targets = ignore_negative_targets(targets, mask)
    denom = jnp.maximum(jnp.sum(weight), 1.0)
    _, g, c = token_groups(b, s)
    if chunk == 0 or chunk >= n // (g * c):  # each device's tokens: one chunk
        logits = _logits(x.reshape(n, h), head.astype(x.dtype)).reshape(b, s, -1)
        return jnp.sum(token_nll(logits, targets, logit_softcap) * weight) / denom
    total = _chunked_sum(x, head, targets, weight, chunk, logit_softcap)
    return _value_before_backward(total) / denom


def _chunked_sum(x, head, targets, weight, chunk: int, logit_softcap) -> jax.Array:
    """The masked NLL sum (float32 scalar) over chunks of ``chunk`` tokens: a checkpointed
    ``lax.scan`` over each device's chunks (``_group_chunks``), run per device
    (``_per_device_sum``) on a mesh whose Auto axes split the tokens."""
    b, s = x.shape[:2]
    axes, _, c = token_groups(b, s)
    if (axes or c > 1) and expert_split() == 1:
        return _per_device_sum(x, head, targets, weight, chunk, logit_softcap, axes, c)
    body = jax.checkpoint(lambda c, xs_: _chunk_sum(head, logit_softcap, c, xs_))
    total, _ = lax.scan(body, jnp.zeros((), jnp.float32), _group_chunks(chunk, x, targets, weight))
    return total


def _per_device_sum(x, head, targets, weight, chunk, logit_softcap, axes, c) -> jax.Array:
    """``_chunked_sum`` in a ``jax.shard_map`` manual over the token split (the batch
    ``axes``, and ``"context"`` for ``c > 1``: ``mesh_batch.token_groups``): the
    head enters replicated (an FSDP-sharded head all-gathered once, not once per chunk of
    the backward scan, where the partitioner put it), its cotangent goes to per-device
    slots summed outside (``jmem._src.partial_sums``: reduced once, not once per chunk),
    and each device's sum leaves as one element of a ``[G, C]`` array, summed outside.
    Under expert parallelism (a ``shard_map`` over the whole mesh in the layers) the scan
    runs as the partitioner places it."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = axes + ((CONTEXT_AXIS,) if c > 1 else ())
    spec = P(axes or None, CONTEXT_AXIS if c > 1 else None)
    n, slot_spec = partial_sums.slots(mesh, manual)
    sink = partial_sums.sink(head, n, slot_spec)

    def body(head, sink, x, targets, weight):
        head = head if sink is None else partial_sums.attach(head, sink)
        return _chunked_sum(x, head, targets, weight, chunk, logit_softcap).reshape(1, 1)

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), None if sink is None else slot_spec, spec, spec, spec),
        out_specs=spec,
        axis_names=set(manual),
        check_vma=False,
    )
    return jnp.sum(run(head, sink, x, targets, weight))


def _group_chunks(chunk: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``[B, S, ...]`` arrays as ``[K, G, chunk, ...]`` scan inputs: the rows in ``G`` groups
    (one per device of the batch split of the mesh in context, ``jmem._src.mesh_batch``;
    1 without), each group's ``B / G * S`` tokens zero-padded to ``K`` chunks. The scan
    slices the unsplit axis ``K``: each device computes its own tokens' chunks."""
    b, s = arrays[0].shape[:2]
    axes, g, c = token_groups(b, s)
    if c > 1:  # a context axis splits the sequence too: [G, C, n] per device's tokens
        return tuple(_context_chunks(chunk, a, axes, g, c) for a in arrays)
    n = b // g * s
    pad = -n % chunk
    out = []
    for a in arrays:
        a = constrain_groups(a.reshape(g, n, *a.shape[2:]), axes)
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(g, -1, chunk, *a.shape[2:]).swapaxes(0, 1)
        out.append(constrain_groups(a, axes, axis=1))
    return tuple(out)


def _context_chunks(chunk: int, a: jax.Array, axes, g: int, c: int) -> jax.Array:
    """``a [B, S, ...]`` as ``[K, G * C, chunk, ...]`` scan inputs when a context axis splits
    the sequence over ``C`` devices (``mesh_batch.split_tokens``): axis 1 is split over the
    batch axes and ``"context"``, one device's tokens each."""
    a = split_tokens(a, axes, g, c)
    pad = -a.shape[2] % chunk
    a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
    a = a.reshape(g, c, -1, chunk, *a.shape[3:])
    a = jnp.moveaxis(a, 2, 0).reshape(a.shape[2], g * c, chunk, *a.shape[4:])
    return jax.lax.with_sharding_constraint(a, P(None, (*axes, CONTEXT_AXIS)))
