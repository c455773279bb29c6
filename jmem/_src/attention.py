"""Causal grouped-query attention whose mask is built from token indices: a dense path
(one ``[S, T]`` score matrix per head), a blockwise path that never holds it (online
softmax over key/value blocks with a custom VJP that recomputes blocks, as FlashAttention,
Dao et al. 2022, arXiv:2205.14135, and Rabe & Staats 2021, arXiv:2112.05682), and cuDNN's
fused kernel through ``jax.nn.dot_product_attention`` on GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jmem._src.context_attention import context_attention
from jmem._src.mesh_batch import batch_groups
from jmem._src.mesh_batch import constrain_groups
from jmem._src.mesh_batch import context_split
from jmem._src.mesh_batch import token_groups
from jmem._src.names import ATTENTION_NAMES
from jmem._src.remat_bits import from_bits
from jmem._src.remat_bits import to_bits
from jmem._src.targets import compile_platform

__all__ = ("IMPLEMENTATIONS", "attention", "attention_mask")

#: ``attention(implementation=...)`` values.
IMPLEMENTATIONS = ATTENTION_NAMES

#: ``"auto"`` runs the dense path up to this many keys (one block would cover them anyway,
#: and the dense path is one pair of matmuls), blockwise beyond.
AUTO_DENSE_MAX_KEYS = 1024

#: Default query and key/value block sizes of the blockwise path (tokens).
BLOCK_Q = 512
BLOCK_KV = 512

#: ``checkpoint_name`` names of the blockwise path's forward outputs, its custom VJP's
#: residuals besides q, k, v: the output (padded ``[B, Sp, nKV, G, D]``) and the float32
#: log-sum-exp ``[B, Sp, nKV, G]``. A names policy that saves both (``jmem.remat``'s
#: ``dots``) keeps the backward pass from recomputing the forward loop.
ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

_NEG = -1e30  # "minus infinity" of a masked score that keeps exp() and max() finite


def _as_rows(index, batch: int, length: int, name: str) -> jax.Array:
    """An int ``[S]`` or ``[B, S]`` array as int32 ``[B, S]``."""
    index = jnp.asarray(index)
    if not jnp.issubdtype(index.dtype, jnp.integer) or index.shape not in (
        (length,),
        (batch, length),
        (1, length),
    ):
        raise ValueError(
            f"{name} must be an integer array [{length}] or [{batch}, {length}]; "
            f"got {index.dtype}{index.shape}."
        )
    return jnp.broadcast_to(jnp.atleast_2d(index), (batch, length)).astype(jnp.int32)


def _window(sliding_window) -> jax.Array:
    """The window as an int32 scalar (0 = global); a Python int is checked."""
    if sliding_window is None:
        return jnp.zeros((), jnp.int32)
    if isinstance(sliding_window, bool) or (
        not isinstance(sliding_window, int) and jnp.ndim(sliding_window) != 0
    ):
        raise ValueError(
            f"sliding_window must be None, an int or an int scalar array; got {sliding_window!r}."
        )
    return jnp.asarray(sliding_window, jnp.int32)


def _allowed(qi, ki, qs, ks, window, kv_valid=None) -> jax.Array:
    """bool ``[B, S, T]``: causal, same segment, within the window (``<= 0``: global)."""
    qi, ki = qi[:, :, None], ki[:, None, :]
    m = (ki <= qi) & ((window <= 0) | (qi - ki < window)) & (qs[:, :, None] == ks[:, None, :])
    return m if kv_valid is None else m & kv_valid[:, None, :]


def attention_mask(
    q_index: jax.Array,
    kv_index: jax.Array | None = None,
    *,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window=None,
) -> jax.Array:
    """Boolean attention mask, True where query ``i`` may attend key ``j``.

    Query ``i`` attends key ``j`` iff ``kv_index[j] <= q_index[i]`` (causal), both carry the
    same segment id (packed examples never see each other), and, with ``sliding_window=W > 0``,
    ``q_index[i] - kv_index[j] < W`` (the query and the ``W - 1`` tokens before it, as
    Mistral and Hugging Face's ``sliding_window_overlay``).

    Args:
      q_index: int ``[S]`` or ``[B, S]``: each query's index in its row (not its RoPE
        position: positions restart in packed rows, indices do not).
      kv_index: int ``[T]`` or ``[B, T]``: each key's index (a KV cache's slot); default
        ``q_index`` (self-attention over the same tokens).
      segment_ids: int ``[B, S]`` of the queries, or None (one segment).
      kv_segment_ids: int ``[B, T]`` of the keys; default ``segment_ids``.
      sliding_window: None or an int (a traced int32 scalar allowed): the window W in
        tokens; ``W <= 0`` means global attention.

    Returns:
      bool ``[B, S, T]`` (``B`` is 1 when nothing has a batch axis).

    Raises:
      ValueError: a Python ``sliding_window < 1`` (use None for global attention).
    """
    if isinstance(sliding_window, int) and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}.")
    kv_index = q_index if kv_index is None else kv_index
    qi, ki = jnp.atleast_2d(q_index), jnp.atleast_2d(kv_index)
    b = max(qi.shape[0], ki.shape[0], 1 if segment_ids is None else segment_ids.shape[0])
    qs = jnp.zeros((b, qi.shape[1]), jnp.int32) if segment_ids is None else segment_ids
    ks = qs if kv_segment_ids is None else kv_segment_ids
    if segment_ids is None and kv_segment_ids is None:
        ks = jnp.zeros((b, ki.shape[1]), jnp.int32)
    qi, ki = jnp.broadcast_to(qi, (b, qi.shape[1])), jnp.broadcast_to(ki, (b, ki.shape[1]))
    return _allowed(qi, ki, qs, ks, _window(sliding_window))


def _softcap(scores, cap):
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def _to_groups(q, nkv):
    """``[B, S, nH, D]`` -> ``[B, nKV, G, S, D]`` (query head ``h = kv * G + g``)."""
    b, s, nh, d = q.shape
    return q.reshape(b, s, nkv, nh // nkv, d).transpose(0, 2, 3, 1, 4)


def _from_groups(x):
    """``[B, nKV, G, S, D]`` -> ``[B, S, nH, D]``."""
    b, nkv, g, s, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, s, nkv * g, d)


def _dense(q, k, v, mask, scale, cap):
    """Softmax attention over a full score matrix; ``mask`` bool ``[B, S, T]``."""
    b, s, nh, d = q.shape
    nkv = k.shape[2]
    g = nh // nkv
    # Heads-major layouts make both einsums plain batched matmuls whose results need no
    # transpose: the [.., S, T] scores and their gradients (the big arrays) are written once,
    # in place; only q/k/v/out (D wide) are transposed. The G query heads of a KV head are
    # merged with the queries so that every gradient contracts one axis.
    q = _to_groups(q, nkv).reshape(b, nkv, g * s, d)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if cap is None:
        out = _dense_saving_probs(q, k, v, mask, scale, g)
    else:
        out = _dense_context(_dense_probs(q, k, mask, scale, cap, g).astype(v.dtype), v)
    return _from_groups(out.reshape(b, nkv, g, s, d))


def _dense_probs(q, k, mask, scale, cap, g):
    """float32 softmax probabilities ``[B, nKV, G*S, T]`` of heads-major ``q``/``k``."""
    b, nkv, gs, _ = q.shape
    t = k.shape[2]
    scores = jnp.einsum("bkqd,bksd->bkqs", q, k).astype(jnp.float32) * scale
    scores = _softcap(scores, cap).reshape(b, nkv, g, gs // g, t)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1).reshape(b, nkv, gs, t)


def _dense_context(probs, v):
    return jnp.einsum("bkqs,bksd->bkqd", probs, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _dense_saving_probs(q, k, v, mask, scale, g):
    """The dense path (no soft-cap) with one residual of score size: the probabilities in
    ``v``'s dtype, as the context matmul reads them. Autodiff saved the float32 softmax
    output as well (and the bf16 copy), two ``[.., S, T]`` stacks per layer without remat:
    in bf16 the float32 one would be the largest array of the step."""
    return _dense_context(_dense_probs(q, k, mask, scale, None, g).astype(v.dtype), v)


def _dense_saving_probs_fwd(q, k, v, mask, scale, g):
    probs = _dense_probs(q, k, mask, scale, None, g).astype(v.dtype)
    return _dense_context(probs, v), (q, k, v, mask, probs)


def _dense_saving_probs_bwd(scale, g, res, dout):
    """The softmax backward pass (``dS = P * (dP - rowsum(dP * P))``) in float32, from the
    saved probabilities; masked scores get none (as ``jnp.where``'s gradient)."""
    q, k, v, mask, probs = res
    dv = jnp.einsum("bkqs,bkqd->bksd", probs, dout)
    dp = jnp.einsum("bkqd,bksd->bkqs", dout, v).astype(jnp.float32)
    p = probs.astype(jnp.float32)
    ds = p * (dp - jnp.sum(dp * p, axis=-1, keepdims=True)) * scale
    b, nkv, gs, t = ds.shape
    ds = jnp.where(mask[:, None, None], ds.reshape(b, nkv, g, gs // g, t), 0.0)
    ds = ds.reshape(b, nkv, gs, t).astype(q.dtype)
    dq = jnp.einsum("bkqs,bksd->bkqd", ds, k)
    dk = jnp.einsum("bkqs,bkqd->bksd", ds, q)
    return dq, dk, dv, None


_dense_saving_probs.defvjp(_dense_saving_probs_fwd, _dense_saving_probs_bwd)


# --------------------------------------------------------------------------------------
# Blockwise: q [B, Sp, nKV, G, D], k/v [B, Tp, nKV, D] (token-major, as the projections
# produce them: no transposed copies); Sp, Tp multiples of the blocks; tiles along axis 1.


def _sliceable(x):
    """``x`` as :func:`_block` slices it in a loop: a 16-bit float as ``(uint16 bits,
    dtype)``. XLA:CPU slices bf16 in float32 (a ``convert`` of the whole array) and hoists
    that ``convert`` out of the loop: a float32 copy of q, k, v or do per layer."""
    return (to_bits(x), x.dtype)


def _block(x, i, size):
    if isinstance(x, tuple):  # from _sliceable
        bits, dtype = x
        return from_bits(lax.dynamic_slice_in_dim(bits, i * size, size, axis=1), dtype)
    return lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _put(x, i, size, value):
    """``x`` with block ``i`` set to ``value``, written as integer bits when 16-bit (XLA:CPU
    writes a bf16 block by converting the whole array to float32 and back, per block)."""
    bits = lax.dynamic_update_slice_in_dim(
        to_bits(x), to_bits(value.astype(x.dtype)), i * size, axis=1
    )
    return from_bits(bits, x.dtype)


def _block_scores(qb, kb, scale, cap):
    """Raw (pre-softcap) float32 scores ``[B, nKV, G, bq, bk]`` and softcapped ones."""
    raw = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
    return raw, _softcap(raw, cap)


def _block_mask(idx, i, j, bq, bk):
    """bool ``[B, 1, 1, bq, bk]`` for query block ``i`` and key block ``j``."""
    qi, ki, qs, ks, kv_valid, window = idx
    m = _allowed(
        _block(qi, i, bq),
        _block(ki, j, bk),
        _block(qs, i, bq),
        _block(ks, j, bk),
        window,
        _block(kv_valid, j, bk),
    )
    return m[:, None, None]


def _rows(x):
    """``[B, nKV, G, bq]`` -> ``[B, bq, nKV, G]`` (per-query statistics, token-major)."""
    return jnp.moveaxis(x, 3, 1)


def _opaque_loop(n: int, body, init):
    """``lax.fori_loop(0, n, body, init)`` as a ``while`` loop, never a ``scan``.

    The forward loops are not differentiated (the custom VJP recomputes the tiles), so
    they need no scan. A ``while`` loop is opaque to remat policies: JAX's partial
    evaluation of a ``while`` saves nothing inside it and recomputes the whole loop from
    its inputs when the backward pass needs its outputs, whereas a policy applied inside
    a scan saves per-iteration values (``dots_saveable`` saved every tile's scores and
    ``p @ v``: the ``[S, T]`` score matrix again, stacked per tile).
    """

    def cond(carry):
        return carry[0] < n

    def step(carry):
        i, state = carry
        return i + 1, body(i, state)

    return lax.while_loop(cond, step, (jnp.zeros((), jnp.int32), init))[1]


def _fwd_q_block(q, k, v, idx, needed, static, i, carry):
    """Writes query block ``i``'s output (``v``'s dtype) and float32 log-sum-exp into
    ``carry = (out, lse)``."""
    scale, cap, bq, bk = static
    qb = _block(q, i, bq)
    b, _, nkv, g, d = qb.shape

    def step(j, state):
        def compute(state):
            m, l, acc = state
            _, s = _block_scores(qb, _block(k, j, bk), scale, cap)
            mask = _block_mask(idx, i, j, bq, bk)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            vb = _block(v, j, bk)
            pv = jnp.einsum(
                "bkgqs,bskd->bkgqd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32
            )
            return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

        return lax.cond(needed[i, j], compute, lambda st: st, state)

    shape = (b, nkv, g, bq)
    init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.float32))
    m, l, acc = _opaque_loop(needed.shape[1], step, init + (jnp.zeros(shape + (d,)),))
    ok = l > 0  # a query with no key to attend (padding) gets a zero output
    ob = jnp.moveaxis(acc / jnp.where(ok, l, 1.0)[..., None], 3, 1)
    # A row with no key here gets lse = _NEG: weight 0 when context-parallel attention
    # combines the blocks of several key shards (``_flash_lse``).
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), _NEG)
    return _put(carry[0], i, bq, ob), _put(carry[1], i, bq, _rows(lse))


def _flash_fwd_impl(q, k, v, idx, needed, static):
    """Blockwise forward: output like ``q`` in ``v``'s dtype, float32 lse ``[B, Sp, nKV, G]``."""
    # Ties the indices to q: without it, a scan over layers (whose indices are constants)
    # hoists the mask tiles of every (query, key) block pair out of the loop as
    # [nq, nk, ..., bq, bk] arrays when it is differentiated.
    q, k, v, idx, needed = lax.optimization_barrier((q, k, v, idx, needed))
    init = (jnp.zeros(q.shape, v.dtype), jnp.zeros(q.shape[:-1], jnp.float32))
    qkv = (_sliceable(q), _sliceable(k), _sliceable(v))
    body = functools.partial(_fwd_q_block, *qkv, idx, needed, static)
    out, lse = _opaque_loop(needed.shape[0], body, init)
    return checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)


def _bwd_kv_block(res, static, j, carry):
    """Adds key/value block ``j``'s share to ``carry = (dq float32, dk, dv)``."""
    q, k, v, idx, needed, lse, do, delta = res
    scale, cap, bq, bk = static
    kb, vb = _block(k, j, bk), _block(v, j, bk)

    def step(i, state):
        def compute(state):
            dk, dv = state
            qb, dob = _block(q, i, bq), _block(do, i, bq)
            raw, s = _block_scores(qb, kb, scale, cap)
            mask = _block_mask(idx, i, j, bq, bk)
            lse_b = jnp.moveaxis(_block(lse, i, bq), 1, 3)
            p = jnp.where(mask, jnp.exp(s - lse_b[..., None]), 0.0)
            dv = dv + jnp.einsum(
                "bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - jnp.moveaxis(_block(delta, i, bq), 1, 3)[..., None])
            if cap is not None:
                ds = ds * (1.0 - jnp.square(s / cap))
            ds = (ds * scale).astype(qb.dtype)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb, preferred_element_type=jnp.float32)
            dqb = jnp.einsum("bkgqs,bskd->bqkgd", ds, kb, preferred_element_type=jnp.float32)
            return (dk, dv), dqb

        def skip(state):
            return state, jnp.zeros(_block(q, i, bq).shape, jnp.float32)

        (dk, dv), dqb = lax.cond(needed[i, j], compute, skip, state[:2])
        dq = _put(state[2], i, bq, _block(state[2], i, bq) + dqb)
        return dk, dv, dq

    zeros = jnp.zeros(kb.shape, jnp.float32)
    dk, dv, dq = lax.fori_loop(0, needed.shape[0], step, (zeros, zeros, carry[0]))
    return dq, _put(carry[1], j, bk, dk), _put(carry[2], j, bk, dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, idx, needed, static):
    return _flash_fwd_impl(q, k, v, idx, needed, static)[0]


def _flash_fwd(q, k, v, idx, needed, static):
    out, lse = _flash_fwd_impl(q, k, v, idx, needed, static)
    return out, (q, k, v, idx, needed, out, lse)


def _flash_bwd(static, res, do):
    q, k, v, idx, needed, out, lse = lax.optimization_barrier(res)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return _flash_grads(static, q, k, v, idx, needed, lse, do, delta)


def _flash_grads(static, q, k, v, idx, needed, lse, do, delta):
    """``(dq, dk, dv, None indices, None)`` of the blockwise path from the saved ``lse``,
    the output cotangent ``do`` and ``delta`` (``rowsum(do * out)``, less the cotangent of
    ``lse`` when it is an output: ``_flash_lse``)."""
    q_, k_, v_, do_ = (_sliceable(a) for a in (q, k, v, do))
    body = functools.partial(_bwd_kv_block, (q_, k_, v_, idx, needed, lse, do_, delta), static)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    dq, dk, dv = lax.fori_loop(0, needed.shape[1], body, init)
    zero_idx = jax.tree.map(lambda _: None, idx)
    return dq.astype(q.dtype), dk, dv, zero_idx, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_lse(q, k, v, idx, needed, static):
    """``_flash`` returning ``(out, lse)``, both differentiable: the blocks of one query
    shard against several key shards (ring attention) are combined by their lse. With
    ``dlse`` the score gradient is ``p * (dp - (delta - dlse))``."""
    return _flash_fwd_impl(q, k, v, idx, needed, static)


def _flash_lse_fwd(q, k, v, idx, needed, static):
    out, lse = _flash_fwd_impl(q, k, v, idx, needed, static)
    return (out, lse), (q, k, v, idx, needed, out, lse)


def _flash_lse_bwd(static, res, cotangents):
    do, dlse = cotangents
    q, k, v, idx, needed, out, lse = lax.optimization_barrier(res)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
    return _flash_grads(static, q, k, v, idx, needed, lse, do, delta)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


def _pad_to(x, multiple, axis, mode="edge"):
    n = x.shape[axis]
    extra = -n % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, mode=mode) if mode == "edge" else jnp.pad(x, widths)


def _range(x, bsize):
    """Per-row min and max over blocks: ``[B, n]`` each, for ``x [B, n * bsize]``."""
    x = x.reshape(x.shape[0], -1, bsize)
    return x.min(-1), x.max(-1)


def _needed_blocks(qi, ki, qs, ks, window, bq, bk):
    """bool ``[nq, nk]``: False where no query of block ``i`` may attend a key of block
    ``j`` in any row (causal, window or segment ranges rule it out), so it is skipped."""
    qmin, qmax = _range(qi, bq)
    kmin, kmax = _range(ki, bk)
    qsmin, qsmax = _range(qs, bq)
    ksmin, ksmax = _range(ks, bk)
    need = kmin[:, None, :] <= qmax[:, :, None]
    need &= (window <= 0) | (kmax[:, None, :] > qmin[:, :, None] - window)
    need &= (ksmin[:, None, :] <= qsmax[:, :, None]) & (ksmax[:, None, :] >= qsmin[:, :, None])
    return jnp.any(need, axis=0)


def _blockwise(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv):
    """The blockwise path on ``[B, S, nH, D]`` / ``[B, T, nKV, D]`` inputs."""
    args = _blockwise_args(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)
    b, s, nh, d = q.shape
    return _flash(*args)[:, :s].reshape(b, s, nh, d)


def blockwise_lse(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv):
    """The blockwise path returning ``(out [B, S, nH, D], float32 lse [B, S, nH])``, both
    differentiable; a query with no key to attend gets zeros and lse ``-1e30``. The
    arguments are ``_blockwise``'s (indices ``[B, S]`` / ``[B, T]`` int32, ``window`` an
    int32 scalar)."""
    args = _blockwise_args(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)
    b, s, nh, d = q.shape
    out, lse = _flash_lse(*args)
    return out[:, :s].reshape(b, s, nh, d), lse[:, :s].reshape(b, s, nh)


def blockwise_grads(q, k, v, qi, ki, qs, ks, window, out, lse, do, scale, cap, block_q, block_kv):
    """``(dq float32, dk float32, dv float32)`` of the blockwise path's output for the
    cotangent ``do``, from the output ``out`` and the log-sum-exp ``lse [B, S, nH]`` of
    *all* the keys the queries attend (ring attention: of every K/V shard, this call
    seeing one). Shapes and arguments as :func:`blockwise_lse`."""
    args = _blockwise_args(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)
    qg, kp, vp, idx, needed, static = args
    b, s, nh, d = q.shape
    t = k.shape[1]
    nkv, g, bq = qg.shape[2], qg.shape[3], static[2]
    out_g, do_g = (_pad_to(x.reshape(b, s, nkv, g, d), bq, 1, "zero") for x in (out, do))
    # padded query rows get lse 1e30, so their probabilities are 0 (their do is 0 too)
    pad = [(0, 0), (0, qg.shape[1] - s), (0, 0), (0, 0)]
    lse_g = jnp.pad(lse.reshape(b, s, nkv, g), pad, constant_values=-_NEG)
    delta = jnp.sum(do_g.astype(jnp.float32) * out_g.astype(jnp.float32), axis=-1)
    q_, k_, v_, do_ = (_sliceable(a) for a in (qg, kp, vp, do_g.astype(qg.dtype)))
    body = functools.partial(_bwd_kv_block, (q_, k_, v_, idx, needed, lse_g, do_, delta), static)
    f32 = lambda x: jnp.zeros(x.shape, jnp.float32)
    dq, dk, dv = lax.fori_loop(0, needed.shape[1], body, (f32(qg), f32(kp), f32(vp)))
    return dq[:, :s].reshape(b, s, nh, d), dk[:, :t], dv[:, :t]


def _blockwise_args(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv):
    """``_flash``'s arguments: padded grouped q, k, v, the indices, the needed tiles."""
    b, s, nh, d = q.shape
    t, nkv = k.shape[1], k.shape[2]
    bq, bk = min(block_q, s), min(block_kv, t)
    qg = _pad_to(q.reshape(b, s, nkv, nh // nkv, d), bq, 1, "zero")
    kp, vp = _pad_to(k, bk, 1, "zero"), _pad_to(v, bk, 1, "zero")
    kv_valid = _pad_to(jnp.ones((b, t), bool), bk, 1, "zero")
    qi, qs = _pad_to(qi, bq, 1), _pad_to(qs, bq, 1)
    ki, ks = _pad_to(ki, bk, 1), _pad_to(ks, bk, 1)
    needed = _needed_blocks(qi, ki, qs, ks, window, bq, bk)
    idx = (qi, ki, qs, ks, kv_valid, window)
    return qg, kp, vp, idx, needed, (float(scale), cap, bq, bk)


def cudnn_reason(
    q,
    k,
    segment_ids,
    sliding_window,
    cap,
    kv_index,
    *,
    platform: str | None = None,
    context: int | None = None,
) -> str | None:
    """Why cuDNN's fused attention cannot run these inputs (arrays or ShapeDtypeStructs)
    on ``platform`` (None: the platform being compiled for, ``compile_platform``), or None
    when it can. The one ``"auto"`` rule: ``jmem.resolve_levers`` calls it with the
    model's facts and the target's platform. ``context``: devices one sequence is split
    over (None: the mesh in context's ``"context"`` axis, ``mesh_batch.context_split``)."""
    platform = compile_platform() if platform is None else platform
    context = context_split() if context is None else context
    if context > 1:
        return (
            f"a context axis ({context} devices) splits the sequence, and cuDNN's causal mask "
            "assumes consecutive token indices (the zigzag order is not)"
        )
    if platform != "gpu":
        return f"it needs a GPU (compiling for {platform!r})"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"it needs bfloat16 or float16 inputs (got {q.dtype})"
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"it needs a head dim that is a multiple of 8 and <= 128 (got {q.shape[-1]})"
    if segment_ids is not None:
        return "packed segment_ids are not passed to it"
    if cap is not None:
        return "it has no logit softcap"
    if sliding_window is not None and not isinstance(sliding_window, int):
        return "its sliding window must be a Python int (got a traced value)"
    if kv_index is not None or q.shape[1] != k.shape[1]:
        return "it runs self-attention only (no kv_index / KV cache)"
    return None


def _batch_sharded(q, k, v):
    """q, k, v constrained to one sharding: cuDNN's partitioner refuses q, k and v sharded
    differently ("Query, key and value should have same sharding"), as GSPMD leaves them under
    FSDP. On a mesh in context (``jax.set_mesh``; jmem's sharded step sets its mesh), the
    batch goes over the Auto batch axes whose sizes divide it (``mesh_batch.batch_groups``), the
    other dims replicated."""
    axes, _ = batch_groups(q.shape[0])
    return tuple(constrain_groups(x, axes) for x in (q, k, v))


def _cudnn(q, k, v, sliding_window, scale):
    window = None if not sliding_window or sliding_window <= 0 else (sliding_window - 1, 0)
    q, k, v = _batch_sharded(q, k, v)
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, local_window_size=window, implementation="cudnn"
    )


def _local_paths(impl, scale, cap, block_q, block_kv):
    """``(local, local_lse, local_grads)`` of ``context_attention``: the ``impl`` path on
    one device's arrays, and the blockwise path with its log-sum-exp and its gradients
    (ring attention)."""

    def local(q, k, v, qi, ki, qs, ks, window):
        if impl == "dense":
            return _dense(q, k, v, _allowed(qi, ki, qs, ks, window), scale, cap)
        return _blockwise(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)

    def local_lse(q, k, v, qi, ki, qs, ks, window):
        return blockwise_lse(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)

    def local_grads(q, k, v, qi, ki, qs, ks, window, out, lse, do):
        args = (window, out, lse, do, scale, cap, block_q, block_kv)
        return blockwise_grads(q, k, v, qi, ki, qs, ks, *args)

    return local, local_lse, local_grads


def _check_options(logit_softcap, block_q, block_kv):
    """ValueError naming a soft-cap or block size ``attention`` cannot use."""
    if logit_softcap is not None and not (
        isinstance(logit_softcap, (int, float)) and logit_softcap > 0
    ):
        raise ValueError(
            f"logit_softcap must be None (no cap) or > 0; got {logit_softcap!r} (0 would "
            "squash every score to 0: uniform attention)."
        )
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (tokens per tile); got {value!r}.")


def _check_shapes(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[::3] != k.shape[::3]:
        raise ValueError(
            "attention needs q [B, S, nH, D] and k, v [B, T, nKV, D] (same B and D); got "
            f"q{q.shape}, k{k.shape}, v{v.shape}."
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})."
        )


def pick_implementation(implementation, reason, t):
    """The implementation ``"auto"`` resolves to (see ``attention``)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r} is unknown; choose from {IMPLEMENTATIONS}."
        )
    if implementation == "cudnn" and reason is not None:
        raise ValueError(
            f"implementation='cudnn' cannot run here: {reason}. Use 'blockwise' (any backend) "
            "or 'auto'."
        )
    if implementation != "auto":
        return implementation
    if reason is None:
        return "cudnn"
    return "dense" if t <= AUTO_DENSE_MAX_KEYS else "blockwise"


@jax.named_scope("attention")  # op names in profiles (benchmarks/qlora_profile.py)
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_index: jax.Array,
    kv_index: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window=None,
    scale: float | None = None,
    logit_softcap: float | None = None,
    implementation: str = "auto",
    block_q: int = BLOCK_Q,
    block_kv: int = BLOCK_KV,
    platform: str | None = None,
    context_strategy: str = "all_gather",
) -> jax.Array:
    """Causal grouped-query softmax attention (softmax in float32), masked by token indices.

    Query ``i`` attends key ``j`` where ``attention_mask`` allows it: ``kv_index[j] <=
    q_index[i]``, the same segment id, and ``q_index[i] - kv_index[j] < sliding_window``
    when the window is > 0. Scores are ``scale * q.k``, then ``c * tanh(scores / c)`` with
    ``logit_softcap=c`` (Gemma 2), then masked.

    Implementations:
      - ``"dense"``: one float32 ``[B, nH, S, T]`` score matrix (and its gradient). Without
        a soft-cap its custom VJP saves only the probabilities in ``v``'s dtype and runs the
        softmax backward from them in float32 (autodiff also saved the float32 ones).
      - ``"blockwise"``: online softmax over ``block_q x block_kv`` tiles (pure JAX, any
        backend); the backward pass recomputes the tiles from the output and the float32
        log-sum-exp (``[B, nH, S]``), so no ``[S, T]`` array exists. Tiles that the causal
        mask, the window or the segment ranges rule out entirely are skipped (causal: about
        half the FLOPs of the dense path).
      - ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``: GPU,
        bf16/fp16, head dim a multiple of 8 up to 128, self-attention without
        ``segment_ids``, ``kv_index`` or softcap, a Python-int window; it assumes
        consecutive ``q_index`` (as ``llama.forward`` passes).
      - ``"auto"``: cuDNN where it can run; else dense up to ``AUTO_DENSE_MAX_KEYS`` keys
        (one tile would cover them) and blockwise beyond.

    Args:
      q: ``[B, S, nH, D]`` queries.
      k, v: ``[B, T, nKV, D]`` keys and values; ``nH`` a multiple of ``nKV``.
      q_index: int ``[S]`` or ``[B, S]``: each query's row index.
      kv_index: int ``[T]`` or ``[B, T]``; default ``q_index``.
      segment_ids, kv_segment_ids: int ``[B, S]`` / ``[B, T]`` packed-example ids, or None.
      sliding_window: None, a Python int or a traced int32 scalar; ``<= 0`` is global.
      scale: score scale; default ``1 / sqrt(D)``.
      logit_softcap: None or the cap ``c > 0``.
      implementation: one of ``IMPLEMENTATIONS``.
      block_q, block_kv: tile sizes of the blockwise path (tokens).
      context_strategy: on a mesh in context whose ``"context"`` axis splits the sequence
        (context parallelism, docs/sharding.md): ``"all_gather"``, ``"ring"`` or
        ``"ulysses"`` (``jmem._src.context_attention``); the dense or blockwise path then
        runs on each device's shard. Unused without such an axis.
      platform: ``"gpu"``, ``"cpu"`` or ``"tpu"``: what ``"auto"`` and ``"cudnn"`` resolve
        for. None: the platform being compiled for (``jmem.targets.compile_platform``: the
        default device or mesh of the trace, so ``jmem.measure(..., target="h100_sxm")``
        gets cuDNN on a machine without a GPU), else ``jax.default_backend()``.

    Returns:
      ``[B, S, nH, D]`` in ``v``'s dtype. A query with no key to attend gets zeros
      (blockwise) or the mean of the values (dense); callers never produce one.

    Raises:
      ValueError: for mismatched shapes, non-integer or misshaped indices, an unknown
        implementation or platform, ``"cudnn"`` where it cannot run (the message says
        why), a ``logit_softcap`` that is not None or > 0 (0 would make every score 0:
        uniform attention), ``block_q``/``block_kv`` that are not ints >= 1, or, on a
        context axis, ``kv_index`` / ``kv_segment_ids`` (self-attention only), an unknown
        ``context_strategy`` or ``"ulysses"`` with head counts the axis does not divide.

    Reverse-mode only: the blockwise path and the dense one without soft-cap are custom
    VJPs, so ``jax.jvp`` / ``jax.jacfwd`` through them raise JAX's custom-VJP error.
    """
    _check_shapes(q, k, v)
    _check_options(logit_softcap, block_q, block_kv)
    b, s, _, d = q.shape
    t = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cap = None if logit_softcap is None else float(logit_softcap)
    if platform not in (None, "cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be None, 'cpu', 'gpu' or 'tpu' (got {platform!r}).")
    platform = compile_platform() if platform is None else platform
    reason = cudnn_reason(q, k, segment_ids, sliding_window, cap, kv_index, platform=platform)
    impl = pick_implementation(implementation, reason, t)
    window = _window(sliding_window)
    qi = _as_rows(q_index, b, s, "q_index")
    ki = qi if kv_index is None else _as_rows(kv_index, b, t, "kv_index")
    qs = (
        jnp.zeros((b, s), jnp.int32)
        if segment_ids is None
        else _as_rows(segment_ids, b, s, "segment_ids")
    )
    ks = qs if kv_segment_ids is None else _as_rows(kv_segment_ids, b, t, "kv_segment_ids")
    if segment_ids is None and kv_segment_ids is None and t != s:
        ks = jnp.zeros((b, t), jnp.int32)
    if impl == "cudnn":
        return _cudnn(q, k, v, sliding_window, scale)
    if token_groups(b, s)[2] > 1:
        if kv_index is not None or kv_segment_ids is not None or t != s:
            raise ValueError(
                "attention over a context axis runs self-attention only; drop kv_index / "
                "kv_segment_ids, or call it outside the context-parallel mesh."
            )
        local, local_lse, local_grads = _local_paths(impl, scale, cap, block_q, block_kv)
        return context_attention(
            q,
            k,
            v,
            qi,
            qs,
            window,
            strategy=context_strategy,
            local=local,
            local_lse=local_lse,
            local_grads=local_grads,
        )
    if impl == "dense":
        return _dense(q, k, v, _allowed(qi, ki, qs, ks, window), scale, cap)
    return _blockwise(q, k, v, qi, ki, qs, ks, window, scale, cap, block_q, block_kv)
