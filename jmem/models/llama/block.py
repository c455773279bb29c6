"""One residual block, written plainly, ``x += attn(norm x)`` then ``x += mlp(norm x)``
(with the family's extra norms), with token chunking as a transform over its token-local
steps: everything but attention runs ``lv.token_chunk`` tokens at a time (``_over_tokens``,
``jmem._src.token_chunks``), as Liu et al. 2024's blockwise feed-forward.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jmem._src import fp8_apply
from jmem._src import levers as levers_lib
from jmem._src import moe
from jmem._src.attention import attention
from jmem._src.token_chunks import over_tokens
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.layers import _mlp
from jmem.models.llama.layers import _moe
from jmem.models.llama.layers import _norm
from jmem.models.llama.layers import _proj
from jmem.models.llama.layers import _qkv
from jmem.models.llama.layers import apply_rope


def _layer(x, layer, config, rope, attn, cache=None, index=None, lv=None):
    """One residual block, ``[B, S, H]`` -> ``([B, S, H], cache, router)``, as Llama's::

        x = x + attn(norm(x))   # _attn_in (norm, q/k/v, RoPE) | _attend | _attn_out
        x = x + mlp(norm(x))    # _mlp_block

    with the family's extra norms (``post_attn_norm``/``post_mlp_norm`` after each
    sublayer for ``norm_placement`` sandwich or post, which has no pre-norms; QK-norm).
    Token chunking is a transform over the token-local steps: ``local(fn, *arrays)`` runs
    ``fn`` over chunks of ``lv.token_chunk`` tokens (``_over_tokens``); only attention,
    which mixes tokens, sees every token at once.

    ``rope``: ``(cos, sin)``; ``attn``: ``_attend``'s index arguments; ``cache``: None, or
    a pair ``[B, T, nKV, D]`` into which this call's keys/values are written at row index
    ``index``, attention then running over the whole cache (returned updated); the third
    output is None, or for a mixture-of-experts layer its ``moe.router_stats`` over the
    call's tokens (float32 ``[E]`` choices and probability sums). ``lv``: the
    ``ResolvedLevers`` (None: decoding, ``_DECODE``). No FP8 argument: FP8 (as NF4 and
    LoRA) is an implicit weight, ``jmem.fp8.apply``."""
    lv = _DECODE if lv is None else lv
    local = functools.partial(_local, lv=lv, layer=layer, config=config)
    b, s, _ = x.shape
    cos, sin = (jnp.broadcast_to(t, (b, s, t.shape[-1])) for t in rope)
    q, k, v = local(_attn_in, x, cos, sin)
    k, v, cache = _write_cache(cache, k, v, index)
    ctx = checkpoint_name(_attend(q, k, v, config, attn, lv).reshape(b, s, -1), "attn_context")
    x, *probs = local(_residuals, x, ctx)
    router = moe.router_stats(probs[0], config.num_experts_per_tok) if probs else None
    return x, cache, router


def _residuals(x, ctx, *, layer, config):
    """The block after attention, token-local: ``x += attn_out(ctx)``, ``x += mlp(norm x)``;
    ``x [B, S, H]``, ``ctx [B, S, nH * D]`` -> ``(x,)``, or ``(x, router probabilities
    [B, S, E])`` for a mixture-of-experts layer."""
    x = x + _attn_out(ctx, layer, config)
    out, *probs = _mlp_block(x, layer, config)
    return (x + out, *probs)


def _attn_in(x, cos, sin, *, layer, config):
    """The attention sublayer's token-local input: pre-norm, q/k/v projections
    (QK-norm) and RoPE; ``[B, S, H]`` -> q ``[B, S, nH, D]``, k/v ``[B, S, nKV, D]``."""
    h = x if config.norm_placement == "post" else _norm(x, layer, "attn_norm", config)
    q, k, v = _qkv(h, layer, config)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _attn_out(ctx, layer, config: LlamaConfig) -> jax.Array:
    """``o_proj(ctx)``, then ``post_attn_norm`` unless ``norm_placement="pre"``."""
    out = checkpoint_name(_proj(ctx, layer, "o_proj"), "attn_out")
    return out if config.norm_placement == "pre" else _norm(out, layer, "post_attn_norm", config)


def _mlp_block(x, layer, config: LlamaConfig) -> jax.Array:
    """The MLP sublayer without its residual: ``mlp_norm`` (not with ``"post"``), the gated
    MLP or the routed experts (``num_experts > 0``), ``post_mlp_norm`` (not with ``"pre"``);
    returns ``(out,)``, or ``(out, router probabilities)`` with experts."""
    h = x if config.norm_placement == "post" else _norm(x, layer, "mlp_norm", config)
    if config.num_experts:
        out, *probs = _moe(h, layer, config)
    else:
        out, probs = _mlp(h, layer, config), []
    if config.norm_placement != "pre":
        out = _norm(out, layer, "post_mlp_norm", config)
    return (out, *probs)


def _write_cache(cache, k, v, index):
    """``(k, v, cache)``: without a cache the inputs; else the cache pair with ``k``/``v``
    written at row ``index`` (axis 1), returned as the keys/values to attend and the cache."""
    if cache is None:
        return k, v, None
    cache = tuple(
        jax.lax.dynamic_update_slice_in_dim(full, new.astype(full.dtype), index, axis=1)
        for full, new in zip(cache, (k, v))
    )
    return *cache, cache


def _local(fn, *arrays, lv, layer, config):
    """``fn(*arrays, layer=, config=)`` as a token-local step (``_over_tokens``), the
    layer's weights passed as ``over_tokens``'s ``weights`` (on an FSDP mesh gathered once
    per loop, not per chunk). Not under FP8: a projection's scaling state is max-reduced
    over the chunks, and per-device partial sums (``over_tokens`` on a mesh) would add
    the devices' states; FP8's weights are closed over (gathered per chunk on a mesh)."""
    if lv.fp8 or fp8_apply.applying():
        return _over_tokens(functools.partial(fn, layer=layer, config=config), lv, *arrays)
    step = functools.partial(_with_layer, fn, config)
    return _over_tokens(step, lv, *arrays, weights=layer)


def _with_layer(fn, config, layer, *arrays):
    """``fn(*arrays, layer=layer, config=config)``."""
    return fn(*arrays, layer=layer, config=config)


def _over_tokens(fn, lv, *arrays, weights=None):
    """``fn(*arrays)``, token-local, over chunks of ``lv.token_chunk`` tokens
    (``jmem._src.token_chunks.over_tokens``: its ``[chunk, F]`` MLP tensors and float32
    norms and projections exist for one chunk at a time and are recomputed per chunk in
    the backward pass); ``arrays`` are ``[B, S, ...]``, returns ``fn``'s tuple of
    ``[B, S, ...]`` outputs. Whole (no loop) when the tokens fit one chunk or with
    ``token_chunk=0``. FP8 composes: under ``jmem.fp8.apply`` each projection's scaling
    state is fanned out over the chunks and its per-chunk updates max-reduced into the
    unchunked call's one. Checkpoint names inside a chunk are not seen by an outer remat
    policy."""
    if not lv.token_chunk:
        return tuple(fn(*arrays) if weights is None else fn(weights, *arrays))
    return over_tokens(fn, lv.token_chunk, *arrays, weights=weights)


def _attend(q, k, v, config: LlamaConfig, attn: dict, lv) -> jax.Array:
    """``attention`` with the config's scale and soft-cap and the resolved levers'
    implementation (``lv.attention``); ``attn`` holds
    the index arguments (``q_index``, optional ``kv_index``, ``segment_ids``) and this
    layer's ``sliding_window`` (default: the config's, for every layer)."""
    attn = {"sliding_window": _uniform_window(config), **attn}
    return attention(
        q,
        k,
        v,
        **attn,
        scale=config.attn_scale,
        logit_softcap=config.attn_logit_softcap,
        implementation=lv.attention,
        context_strategy=lv.context_strategy,
    )


def _uniform_window(config: LlamaConfig) -> int | None:
    """The window of every layer when layers do not differ (see ``decoder._is_local``)."""
    c = config
    if c.layer_types is not None and "sliding_attention" not in c.layer_types:
        return None
    return c.sliding_window


#: The levers of a KV-cache decoding step: attention picked per call (a cache is not
#: self-attention, so never cuDNN), no token chunks, one layer loop.
_DECODE = levers_lib.ResolvedLevers("none", "auto", 0, 0, 1, False, "any", None)


def _resolved(levers, config, shape, dtype, segment_ids) -> levers_lib.ResolvedLevers:
    """``levers`` resolved for this call's batch ``shape`` ``(B, S)`` on the running
    backend, unless already resolved (for a compile target: ``jmem.resolve_levers``)."""
    if isinstance(levers, levers_lib.ResolvedLevers):
        return levers
    levers = levers_lib.Levers() if levers is None else levers
    batch = {"inputs": jax.ShapeDtypeStruct(tuple(shape), jnp.int32)}
    if segment_ids is not None:
        batch["segment_ids"] = segment_ids
    return levers_lib.resolve(levers, config, batch, dtype=dtype)


def decoder_layer(
    x: jax.Array,
    layer: Params,
    config: LlamaConfig,
    cos,
    sin,
    attn: dict,
    fp8: Params | None = None,
    levers: Any = None,
) -> jax.Array:
    """One decoder layer. x ``[B, S, H]`` -> ``[B, S, H]``, same dtype.

    ``cos``/``sin`` from ``rope_tables``; ``attn``: the index keyword arguments of
    ``jmem.ops.attention`` (``q_index`` int ``[S]`` or ``[B, S]``, optional
    ``kv_index`` and ``segment_ids``), from which the mask is built inside attention, and
    optionally this layer's ``sliding_window`` (needed with mixed ``layer_types``);
    ``levers``: a ``jmem.Levers`` or ``ResolvedLevers`` (None: ``jmem.Levers()``).
    ``fp8``: deprecated; this layer's FP8 states (``Fp8Meta`` per projection, unstacked):
    same as ``jmem.fp8.apply(f)(layer, fp8, ...)`` with ``f`` calling ``decoder_layer``."""
    if fp8 is not None:
        warn_fp8_argument("decoder_layer")

        def f(layer, x, cos, sin, attn):
            return decoder_layer(x, layer, config, cos, sin, attn, levers=levers)

        return fp8_apply.apply(f)(layer, fp8, x, cos, sin, attn)
    lv = _resolved(levers, config, x.shape[:2], x.dtype, attn.get("segment_ids"))
    return _layer(x, layer, config, (cos, sin), attn, lv=lv)[0]


def warn_fp8_argument(fn: str, stacklevel: int = 3) -> None:
    """The ``DeprecationWarning`` of the ``fp8=`` argument of ``fn`` (one release)."""
    warnings.warn(
        f"llama.{fn}(..., fp8=metas) is deprecated: FP8 is an implicit weight now; call "
        f"jmem.fp8.apply(llama.{fn})(params, metas, ...) (docs/fp8.md).",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
