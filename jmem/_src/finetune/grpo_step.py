"""GRPO's programs in the job, each a function of the config: the loss the train step
minimises (``grpo_loss``: ``jmem.losses.grpo`` over per-token log-probs of the completions,
chunked, no ``[B, S, V]`` logits), the batch it takes (``pack_rows``, ``abstract_batch``),
the rollout (``rollout_program``: ``llama.rollout`` over the NF4 base and the current
adapters) and the log-prob pass for the old and reference log-probs (``logps_program``).
The training step itself is ``build.build(config, cfg)``, as for every objective."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jmem import lora
from jmem import qlora
from jmem._src.grpo import grpo
from jmem._src.preference import reference_logprobs
from jmem._src.sequence_logprobs import token_logprobs
from jmem.models import llama
from jmem.models import preference

#: The loss types whose loss is a token mean over the batch: gradient accumulation weights
#: their microbatches by completion tokens (``batch["mask"]``, ``jmem.train_step``); the
#: others (a mean of sequence means, a constant normaliser) weight microbatches equally.
TOKEN_MEAN_LOSSES = ("dapo", "bnpo")


def mask_key(config) -> str:
    """The batch key of the completion mask: ``"mask"`` for a token-mean loss (so that
    gradient accumulation weights microbatches by their tokens), else
    ``"completion_mask"``."""
    loss_type = "dapo" if config.training.loss_type is None else config.training.loss_type
    return "mask" if loss_type in TOKEN_MEAN_LOSSES else "completion_mask"


def _token_logps(params, batch, *, cfg, levers, temperature, key):
    """float32 ``[B, S]`` log-probs of ``batch["targets"]`` where ``batch[key]`` is nonzero
    (the completion tokens), at the sampling temperature."""
    x, lv = llama.hidden_states(params, batch["inputs"], cfg, levers=levers)
    return token_logprobs(
        llama.final_norm(params, x, cfg),
        preference.head_kernel(params, cfg),
        batch["targets"],
        batch[key],
        chunk=lv.loss_chunk,
        logit_softcap=cfg.final_logit_softcap,
        temperature=temperature,
    )


def loss_hyperparams(config) -> dict:
    """``jmem.losses.grpo``'s keyword arguments from the resolved config: ``beta``,
    ``epsilon``, ``epsilon_high``, ``loss_type`` and Dr. GRPO's normaliser
    ``max_completion_length`` (``--max-completion-len``)."""
    t, g = config.training, config.grpo
    return {
        "beta": 0.0 if t.beta is None else t.beta,
        "epsilon": g.epsilon,
        "epsilon_high": g.epsilon_high,
        "loss_type": "dapo" if t.loss_type is None else t.loss_type,
        "max_completion_length": g.max_completion_len,
    }


def grpo_loss(config, cfg, levers, full: bool):
    """``loss_fn(trainable, batch, *, frozen=None, dropout_key=None) -> (loss, metrics)``:
    the GRPO loss of one batch of ``pack_rows`` rows; QLoRA (adapters on the frozen NF4
    base) or, with ``full``, the params themselves. ``metrics`` are ``jmem.losses.grpo``'s
    (``kl``, ``clip_ratio/*``)."""
    logps = functools.partial(
        _token_logps,
        cfg=cfg,
        levers=levers,
        temperature=config.grpo.temperature,
        key=mask_key(config),
    )
    hyper = loss_hyperparams(config)

    def loss_fn(trainable, batch, *, frozen=None, dropout_key=None):
        if full:
            policy = logps(trainable, batch)
        else:
            policy = qlora.apply(logps)(frozen, trainable, batch, lora_dropout_key=dropout_key)
        return grpo(
            policy,
            batch["old_logps"],
            batch["advantages"],
            batch[mask_key(config)],
            ref_logps=batch.get("ref_logps"),
            **hyper,
        )

    return loss_fn


def logps_program(config, cfg, levers):
    """``logps(trainable, frozen, batch, reference) -> float32 [B, S]``, jitted, no
    gradient: the completion tokens' log-probs under the policy (``reference`` False: the
    old log-probs of ``--num-iterations`` > 1, before the first update) or under the base
    with the adapters off (``reference`` True: the KL term's reference, ``--beta`` > 0)."""
    logps = functools.partial(
        _token_logps,
        cfg=cfg,
        levers=levers,
        temperature=config.grpo.temperature,
        key=mask_key(config),
    )

    @functools.partial(jax.jit, static_argnames=("reference",))
    def run(trainable, frozen, batch, reference: bool):
        if reference:
            return reference_logprobs(logps, frozen, batch)
        if frozen is None:
            return jax.lax.stop_gradient(logps(trainable, batch))
        return jax.lax.stop_gradient(lora.apply(logps)(frozen, trainable, batch))

    return run


def eos_id(tok) -> int | None:
    """The tokenizer's end-of-sequence id (a one-token ``eos_token``), or None (the byte
    tokenizer has none: completions run to ``--max-completion-len``)."""
    eos = getattr(tok, "eos_token", None)
    if not eos:
        return None
    ids = np.asarray(tok.encode(eos)).reshape(-1)
    return int(ids[0]) if ids.size == 1 else None


def rollout_program(config, cfg, tok):
    """``sample(trainable, frozen, prompt_ids, prompt_mask, key) -> llama.Rollout``: the
    ``--num-generations`` completions of each left-padded prompt, sampled with
    ``--temperature``/``--top-p``/``--top-k`` over the current adapters on the NF4 base
    (``trainable`` in the compute dtype; ``frozen`` None for full fine-tuning), in
    micro-batches of ``--generation-batch`` rows."""
    g = config.grpo
    kwargs = dict(
        num_generations=g.num_generations,
        max_new_tokens=g.max_completion_len,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        eos_token_id=eos_id(tok),
        generation_batch=g.generation_batch,
    )

    def sample(trainable, frozen, prompt_ids, prompt_mask, key):
        if frozen is None:
            return llama.rollout(trainable, prompt_ids, prompt_mask, cfg, key=key, **kwargs)
        return llama.rollout(
            frozen,
            prompt_ids,
            prompt_mask,
            cfg,
            key=key,
            adapters=trainable,
            apply=qlora.apply,
            **kwargs,
        )

    return sample


def pack_rows(config, ro, advantages) -> dict:
    """The train step's batch from a rollout (host arrays): each row its prompt's real
    tokens, then its completion, right-padded to ``S = --max-prompt-len +
    --max-completion-len``, so the causal forward needs no mask and RoPE positions start
    at the prompt's first token (as the sampler's).

    Returns ``{"inputs", "targets"}`` int32 ``[B, S]``, the completion mask float32
    ``[B, S]`` (under ``mask_key``: 1 where the target is a completion token),
    ``"advantages"`` float32 ``[B]`` and ``"old_logps"`` float32 ``[B, S]`` (the sampler's
    log-probs at the targets' places)."""
    p_ids, p_mask = np.asarray(ro.prompt_ids), np.asarray(ro.prompt_mask)
    c_ids, c_mask = np.asarray(ro.completion_ids), np.asarray(ro.completion_mask)
    c_logps = np.asarray(ro.logps, np.float32)
    b, t = c_ids.shape
    s = config.grpo.max_prompt_len + config.grpo.max_completion_len
    tokens = np.zeros((b, s + 1), np.int32)
    mask = np.zeros((b, s), np.float32)
    old = np.zeros((b, s), np.float32)
    for r in range(b):
        prompt = p_ids[r][p_mask[r] > 0]
        n = len(prompt)
        tokens[r, :n], tokens[r, n : n + t] = prompt, c_ids[r]
        mask[r, n - 1 : n - 1 + t] = c_mask[r]
        old[r, n - 1 : n - 1 + t] = np.where(c_mask[r] > 0, c_logps[r], 0.0)
    batch = {"inputs": tokens[:, :s], "targets": tokens[:, 1:], mask_key(config): mask}
    batch.update(advantages=np.asarray(advantages, np.float32), old_logps=old)
    return batch


def abstract_batch(config) -> dict:
    """The GRPO train step's batch as ``jax.ShapeDtypeStruct``s (``[B, S]`` with ``B =
    --batch-size`` completions, ``S = --max-prompt-len + --max-completion-len``): int32
    inputs and targets, float32 completion mask, old log-probs and (``--beta`` > 0)
    reference log-probs, float32 ``[B]`` advantages."""
    b = config.data.batch_size
    s = config.grpo.max_prompt_len + config.grpo.max_completion_len
    i32, f32 = jnp.int32, jnp.float32
    batch = {k: jax.ShapeDtypeStruct((b, s), i32) for k in ("inputs", "targets")}
    batch[mask_key(config)] = jax.ShapeDtypeStruct((b, s), f32)
    batch["advantages"] = jax.ShapeDtypeStruct((b,), f32)
    batch["old_logps"] = jax.ShapeDtypeStruct((b, s), f32)
    if loss_hyperparams(config)["beta"] > 0:
        batch["ref_logps"] = jax.ShapeDtypeStruct((b, s), f32)
    return batch
