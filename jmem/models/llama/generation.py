"""Generation: a KV cache, greedy or nucleus sampling (Holtzman et al. 2020), and
``generate``, compiled once per shape; greedy output equals transformers'
``generate(do_sample=False)``.
"""

from __future__ import annotations

import dataclasses
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


def _cached_forward(params, tokens, config, cache, index, rows=None):
    """Logits of the last of ``tokens [B, S]`` (row indices ``index..index+S-1``) and the
    updated cache; ``cache``: a pair ``[L, B, T, nKV, D]`` of keys and values. ``rows``:
    None, or ``(pad, slot_ids)`` for left-padded rows: ``pad`` int32 ``[B]`` padding tokens
    before each row's prompt (RoPE positions start after them, as transformers'
    ``position_ids``) and ``slot_ids`` int32 ``[B, T]``, 1 on the cache slots of real
    tokens, 0 on padding (which only padding attends)."""
    c = config
    q_index = index + jnp.arange(tokens.shape[1])
    attn = {"q_index": q_index, "kv_index": jnp.arange(cache[0].shape[2])}
    positions = q_index
    if rows is not None:
        pad, slot_ids = rows
        positions = jnp.maximum(q_index[None] - pad[:, None], 0)
        segment = jax.lax.dynamic_slice_in_dim(slot_ids, index, tokens.shape[1], axis=1)
        attn = {**attn, "segment_ids": segment, "kv_segment_ids": slot_ids}
    rope = _layer_rope(c, positions)
    is_local = _is_local(c)
    x = _embed(params, tokens, c)

    def body(x, xs):
        layer, kv, local = xs
        layer_rope, layer_attn = _per_layer(local, rope, attn, c)
        return _layer(x, layer, c, layer_rope, layer_attn, kv, index)[:2]

    x, cache = jax.lax.scan(body, x, (params["layers"], cache, is_local))
    return _head(params, x[:, -1:], c)[:, 0], cache


def _filtered(logits: jax.Array, temperature: float, top_p: float, top_k: int = 0) -> jax.Array:
    """Sampling logits: divided by ``temperature``, then the ``top_k`` most likely tokens
    kept (0: all), then the nucleus of mass ``top_p`` (transformers' order of warpers)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # keep the most likely tokens until their mass reaches top_p (at least one)
        kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def _sample(logits: jax.Array, temperature: float, top_p: float, key) -> jax.Array:
    """Next tokens int32 ``[B]`` from float32 logits ``[B, V]``: argmax at temperature 0,
    else nucleus sampling (Holtzman et al. 2020) at ``temperature``."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = _filtered(logits, temperature, top_p)
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


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logps"),
    meta_fields=(),
)
@dataclasses.dataclass(frozen=True)
class Rollout:
    """``rollout``'s completions, ``B = P * num_generations`` rows (prompt ``g``'s
    completions are rows ``g * G ... g * G + G - 1``, TRL's order).

    Attributes:
      prompt_ids: int32 ``[B, S_p]``, each row's left-padded prompt (repeated G times).
      prompt_mask: int32 ``[B, S_p]``, 1 on real prompt tokens.
      completion_ids: int32 ``[B, T]`` (``T = max_new_tokens``), the sampled tokens; after
        a row's end-of-sequence token, ``pad_token_id``.
      completion_mask: int32 ``[B, T]``, 1 on the real completion tokens, the EOS
        included; 0 after it.
      logps: float32 ``[B, T]``, the log-probability of each sampled token under the
        sampling policy at ``temperature`` (``log_softmax(logits / temperature)``, over the
        whole vocabulary, as TRL's ``old_per_token_logps``; raw logits when greedy); 0 on
        padding.
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    logps: jax.Array


def _runner(params, adapters, config, apply):
    """``run(tokens, cache, index, rows) -> (logits, cache)``, through ``apply`` if given."""
    if apply is None:
        return lambda t, cache, i, rows: _cached_forward(params, t, config, cache, i, rows)
    step = lambda prm, t, cache, i, rows: _cached_forward(prm, t, config, cache, i, rows)
    return lambda t, cache, i, rows: apply(step)(params, adapters, t, cache, i, rows)


def _next_tokens(logits, row_keys, step, temperature, top_p, top_k):
    """Sampled int32 ``[B]`` and their float32 log-probs; row ``r`` draws with
    ``fold_in(row_keys[r], step)`` (so a row's draws do not depend on its micro-batch)."""
    if temperature == 0.0:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
        warped = _filtered(logits, temperature, top_p, top_k)
        token = jax.vmap(jax.random.categorical)(keys, warped).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _rollout_step(run, rows, row_keys, eos, pad_id, sampling, p, carry):
    """One decoding step of ``_rollout_chunk``'s ``while_loop``: the previous token through
    the cache, the next one sampled; rows past their EOS write padding."""
    i, tokens, mask, logps, done, cache, logits = carry
    token, logp = _next_tokens(logits, row_keys, i, *sampling)
    token = jnp.where(done, pad_id, token)
    tokens = tokens.at[:, i].set(token)
    mask = mask.at[:, i].set(jnp.where(done, 0, 1))
    logps = logps.at[:, i].set(jnp.where(done, 0.0, logp))
    done = done | jnp.isin(token, jnp.asarray(eos, jnp.int32))
    logits, cache = jax.lax.cond(  # the last step's forward would be unused
        i + 1 < tokens.shape[1],
        lambda c: run(token[:, None], c, p + i, rows),
        lambda c: (logits, c),
        cache,
    )
    return i + 1, tokens, mask, logps, done, cache, logits


@functools.partial(
    jax.jit,
    static_argnames=("config", "max_new_tokens", "sampling", "eos", "pad_id", "apply"),
)
def _rollout_chunk(
    params,
    adapters,
    prompt,
    prompt_mask,
    row_keys,
    *,
    config,
    max_new_tokens,
    sampling,
    eos,
    pad_id,
    apply,
):
    """Completions of one micro-batch of left-padded prompts ``[b, S_p]``; the KV cache is
    sized ``S_p + max_new_tokens``; decoding stops when every row has emitted an EOS."""
    b, p = prompt.shape
    t = max_new_tokens
    run = _runner(params, adapters, config, apply)
    dtype = params["embed"]["embedding"].dtype
    shape = (config.num_layers, b, p + t, config.num_kv_heads, config.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    prompt_mask = prompt_mask.astype(jnp.int32)
    pad = p - jnp.sum(prompt_mask, axis=1)
    rows = (pad, jnp.concatenate([prompt_mask, jnp.ones((b, t), jnp.int32)], axis=1))
    logits, cache = run(prompt, cache, 0, rows)
    carry = (
        jnp.int32(0),
        jnp.full((b, t), pad_id, jnp.int32),
        jnp.zeros((b, t), jnp.int32),
        jnp.zeros((b, t), jnp.float32),
        jnp.zeros((b,), bool),
        cache,
        logits,
    )
    step = functools.partial(_rollout_step, run, rows, row_keys, eos, pad_id, sampling, p)
    cond = lambda c: (c[0] < t) & ~jnp.all(c[4])
    _, tokens, mask, logps, _, _, _ = jax.lax.while_loop(cond, step, carry)
    return tokens, mask, logps


def _check_rollout(prompt_tokens, prompt_mask, num_generations, max_new_tokens, sampling, key):
    temperature, top_p, top_k = sampling
    if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(
            f"prompt_tokens must be int [prompts, len]; got {prompt_tokens.dtype}"
            f"{prompt_tokens.shape}."
        )
    if prompt_mask.shape != prompt_tokens.shape:
        raise ValueError(
            f"prompt_mask must be shaped like prompt_tokens {prompt_tokens.shape}; got "
            f"{prompt_mask.shape}."
        )
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be an int >= 1; got {num_generations!r}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}.")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0; got {temperature}, "
            f"{top_p}, {top_k}."
        )
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs a PRNG key: pass key=.")
    if not isinstance(prompt_mask, jax.core.Tracer):
        m = np.asarray(prompt_mask)
        if not np.all(np.diff(m.astype(np.int32), axis=1) >= 0) or not np.all(m[:, -1]):
            raise ValueError(
                "prompts must be left-padded with a real last token: each prompt_mask row "
                "0...0 1...1 with at least one 1."
            )


def _eos_ids(eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return tuple(int(i) for i in ids)


def rollout(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    config: LlamaConfig,
    *,
    num_generations: int,
    max_new_tokens: int,
    key: jax.Array | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
    generation_batch: int | None = None,
    adapters: Any = None,
    apply: Callable | None = None,
) -> Rollout:
    """``num_generations`` sampled completions of each left-padded prompt, with their masks
    and per-token log-probs (the rollout of GRPO), over the training weights.

    Each prompt is repeated G times (``B = P * G`` rows), then decoded ``generation_batch``
    rows at a time (the KV cache, ``[L, generation_batch, S_p + max_new_tokens, nKV, D]``,
    never holds more), each micro-batch by one program compiled once per shape (prefill,
    then a ``while_loop`` that stops when every row has emitted an EOS). Left padding is
    masked out of attention and RoPE positions start at each row's first real token, as
    transformers' ``generate`` with an ``attention_mask``. Row ``r`` draws from
    ``fold_in(key, r)``: the output does not depend on ``generation_batch``.

    On an NF4 base with LoRA adapters pass ``adapters`` and ``apply=jmem.qlora.apply`` (or
    ``jmem.lora.apply``): every step is ``apply(step)(params, adapters, ...)``, the rules of
    the training step, no merged copy.

    Args:
      params: the params pytree, dense or NF4 (frozen, with ``apply``).
      prompt_tokens: int ``[P, S_p]``, left-padded prompts (ids of padding are ignored).
      prompt_mask: int or bool ``[P, S_p]``, 1 on real tokens: ``0...0 1...1`` per row.
      config: the model's ``LlamaConfig``.
      num_generations: completions per prompt G (>= 1).
      max_new_tokens: the completion length T (>= 1).
      key: PRNG key, required when ``temperature > 0``.
      temperature: 0 for greedy (argmax), else the softmax temperature.
      top_p: nucleus mass in (0, 1]; 1 keeps every token.
      top_k: keep the k most likely tokens (0: all); applied before ``top_p``.
      eos_token_id: an id or ids that end a completion (included in the mask); None never
        stops early.
      pad_token_id: the id written after a row's EOS; default the first EOS id (or 0).
      generation_batch: rows per micro-batch, a divisor of ``B``; default ``B``.
      adapters: LoRA adapters for ``apply`` (with ``apply`` only).
      apply: None, or a transform ``apply(fn)(params, adapters, *args)``.

    Returns:
      a ``Rollout`` of ``B = P * G`` rows.

    Raises:
      ValueError: prompts not int ``[P, S_p]``, a mask of another shape or not
        left-padded (for a concrete mask), ``num_generations < 1``, ``max_new_tokens <
        1``, a bad temperature/top-p/top-k, sampling without ``key``, a
        ``generation_batch`` that does not divide ``B``, ``adapters`` without ``apply``,
        or (for concrete prompts) token ids outside ``[0, vocab_size)``.

    Source: TRL's ``GRPOTrainer._generate_and_score_completions`` (the repeated prompts,
    the completion mask up to and including EOS); transformers' ``generate`` (warpers).
    """
    sampling = (float(temperature), float(top_p), int(top_k))
    prompt_mask = jnp.asarray(prompt_mask)
    _check_rollout(prompt_tokens, prompt_mask, num_generations, max_new_tokens, sampling, key)
    if adapters is not None and apply is None:
        raise ValueError("adapters need apply= (e.g. jmem.qlora.apply) to be used.")
    prompt_tokens = jnp.where(prompt_mask > 0, prompt_tokens, 0).astype(jnp.int32)
    _check_token_ids(prompt_tokens, config.vocab_size)
    prompts = jnp.repeat(prompt_tokens, num_generations, axis=0)
    masks = jnp.repeat(prompt_mask.astype(jnp.int32), num_generations, axis=0)
    b = prompts.shape[0]
    gb = b if generation_batch is None else int(generation_batch)
    if gb < 1 or b % gb:
        raise ValueError(
            f"generation_batch={generation_batch} must divide the {b} rows "
            f"(prompts x num_generations)."
        )
    eos = _eos_ids(eos_token_id)
    pad_id = int(pad_token_id if pad_token_id is not None else (eos[0] if eos else 0))
    keys = jax.random.key(0) if key is None else key
    row_keys = jax.vmap(functools.partial(jax.random.fold_in, keys))(jnp.arange(b))
    chunk = functools.partial(
        _rollout_chunk,
        config=config,
        max_new_tokens=int(max_new_tokens),
        sampling=sampling,
        eos=eos,
        pad_id=pad_id,
        apply=apply,
    )
    parts = [
        chunk(params, adapters, prompts[s : s + gb], masks[s : s + gb], row_keys[s : s + gb])
        for s in range(0, b, gb)
    ]
    tokens, mask, logps = (jnp.concatenate(x, axis=0) for x in zip(*parts))
    return Rollout(prompts, masks, tokens, mask, logps)
