"""Generation: a KV cache, greedy or nucleus sampling (Holtzman et al. 2020), and
``generate``, compiled once per shape; greedy output equals transformers'
``generate(do_sample=False)``.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jmem.models.llama.block import _layer
from jmem.models.llama.config import LlamaConfig
from jmem.models.llama.config import Params
from jmem.models.llama.decoder import _is_local
from jmem.models.llama.decoder import _layer_rope
from jmem.models.llama.decoder import _per_layer
from jmem.models.llama.layers import _embed
from jmem.models.llama.layers import _head


def _cached_forward(params, tokens, config, cache, index):
    """Logits of the last of ``tokens [B, S]`` (row indices ``index..index+S-1``) and the
    updated cache; ``cache``: a pair ``[L, B, T, nKV, D]`` of keys and values."""
    c = config
    q_index = index + jnp.arange(tokens.shape[1])
    rope = _layer_rope(c, q_index)
    attn = {"q_index": q_index, "kv_index": jnp.arange(cache[0].shape[2])}
    is_local = _is_local(c)
    x = _embed(params, tokens, c)

    def body(x, xs):
        layer, kv, local = xs
        layer_rope, layer_attn = _per_layer(local, rope, attn, c)
        return _layer(x, layer, c, layer_rope, layer_attn, kv, index)

    x, cache = jax.lax.scan(body, x, (params["layers"], cache, is_local))
    return _head(params, x[:, -1:], c)[:, 0], cache


def _sample(logits: jax.Array, temperature: float, top_p: float, key) -> jax.Array:
    """Next tokens int32 ``[B]`` from float32 logits ``[B, V]``: argmax at temperature 0,
    else nucleus sampling (Holtzman et al. 2020) at ``temperature``."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # keep the most likely tokens until their mass reaches top_p (at least one)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "temperature", "top_p", "apply")
)
def _generate(params, adapters, prompt, key, *, config, max_new_tokens, temperature, top_p, apply):
    c = config
    b, p = prompt.shape
    if apply is None:
        run = lambda t, cache, i: _cached_forward(params, t, c, cache, i)
    else:
        step = lambda prm, t, cache, i: _cached_forward(prm, t, c, cache, i)
        run = lambda t, cache, i: apply(step)(params, adapters, t, cache, i)
    dtype = params["embed"]["embedding"].dtype
    shape = (c.num_layers, b, p + max_new_tokens, c.num_kv_heads, c.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    logits, cache = run(prompt, cache, 0)
    keys = jax.random.split(key, max_new_tokens)
    out = jnp.zeros((b, p + max_new_tokens), jnp.int32).at[:, :p].set(prompt)
    out = out.at[:, p].set(_sample(logits, temperature, top_p, keys[0]))

    def step_fn(i, carry):
        out, cache = carry
        index = p + i
        token = jax.lax.dynamic_slice_in_dim(out, index, 1, axis=1)
        logits, cache = run(token, cache, index)
        nxt = _sample(logits, temperature, top_p, keys[i + 1])
        return jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], index + 1, axis=1), cache

    out, _ = jax.lax.fori_loop(0, max_new_tokens - 1, step_fn, (out, cache))
    return out


def _check_token_ids(tokens, vocab_size: int) -> None:
    """Raises for ids outside ``[0, vocab_size)`` in a concrete ``tokens`` (a tracer is
    not checked): ``jnp.take`` would clamp or wrap them silently."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(
            f"prompt_tokens hold ids outside [0, {vocab_size}) (the model's vocab_size): "
            f"{sorted(set(bad.tolist()))[:8]}; is the tokenizer the checkpoint's?"
        )


def generate(
    params: Params,
    prompt_tokens: jax.Array,
    config: LlamaConfig,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    adapters: Any = None,
    apply: Callable | None = None,
) -> jax.Array:
    """Autoregressive decoding with a KV cache, compiled once per shape (``jax.jit``).

    The prompt is run in one pass (prefill), then one token per step in a ``fori_loop``;
    keys and values of every layer live in a cache ``[L, B, P + max_new_tokens, nKV, D]``
    of the activation dtype. Greedy output equals transformers' ``generate(do_sample=False)``
    on the same checkpoint. All rows share the prompt length (no padding); decoding does
    not stop at an end-of-sequence token: cut the output after it.

    On an NF4 base with LoRA adapters, pass the frozen params, the adapters and the
    transform that runs a function on them, ``apply=jmem.qlora.apply`` (or
    ``jmem.lora.apply``): each decoding step is then ``apply(step)(params, adapters, ...)``,
    the same calling convention as training (``x·W + s·(x·a)·b``, W never materialized).

    Args:
      params: the params pytree (``init``, ``hf.load_params``), dense or NF4.
      prompt_tokens: int32 ``[B, P]``, P >= 1.
      config: the model's ``LlamaConfig``.
      max_new_tokens: tokens to generate (>= 1).
      temperature: 0 for greedy (argmax), else the softmax temperature of sampling.
      top_p: nucleus sampling mass in (0, 1]; 1 samples from the whole distribution.
      key: PRNG key, required when ``temperature > 0``.
      adapters: LoRA adapters for ``apply`` (with ``apply`` only).
      apply: None, or a transform ``apply(fn)(params, adapters, *args)`` such as
        ``jmem.qlora.apply``.

    Returns:
      int32 ``[B, P + max_new_tokens]``: the prompt followed by the new tokens.

    Raises:
      ValueError: a prompt that is not int ``[B, P]``, ``max_new_tokens < 1``, a negative
        temperature, ``top_p`` outside (0, 1], sampling without ``key``, or ``adapters``
        without ``apply``, or (for a concrete prompt) token ids outside ``[0, vocab_size)``.
    """
    if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(
            f"prompt_tokens must be int [batch, len]; got {prompt_tokens.dtype}"
            f"{prompt_tokens.shape}."
        )
    if prompt_tokens.shape[1] < 1 or max_new_tokens < 1:
        raise ValueError(
            f"need a prompt of >= 1 token and max_new_tokens >= 1; got prompt "
            f"{prompt_tokens.shape} and max_new_tokens={max_new_tokens}."
        )
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1; got {temperature}, {top_p}.")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass key=.")
    if adapters is not None and apply is None:
        raise ValueError("adapters need apply= (e.g. jmem.qlora.apply) to be used.")
    _check_token_ids(prompt_tokens, config.vocab_size)
    return _generate(
        params,
        adapters,
        prompt_tokens.astype(jnp.int32),
        jax.random.key(0) if key is None else key,
        config=config,
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        apply=apply,
    )
