"""Group Relative Policy Optimization as pure functions of per-token log-probabilities: the
group-relative advantages (Shao et al. 2024, arXiv:2402.03300) and the clipped surrogate
loss with the k3 KL penalty, DAPO's two-sided clipping and token-level aggregation (Yu et
al. 2025, arXiv:2503.14476) and Dr. GRPO's constant normaliser (Liu et al. 2025,
arXiv:2503.20783), with the metrics TRL's ``GRPOTrainer`` logs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ("group_advantages", "grpo")

Metrics = dict[str, jax.Array]

#: the ``scale`` settings of ``group_advantages`` (TRL's ``scale_rewards``).
SCALES = ("group", "batch", "none")
#: the ``loss_type`` settings of ``grpo`` (TRL's names).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

_STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def _bessel_std(x: jax.Array, axis) -> jax.Array:
    """The sample standard deviation (ddof=1, as ``torch.std``) over ``axis``, keepdims."""
    return jnp.std(x, axis=axis, ddof=1, keepdims=True)


def group_advantages(rewards: jax.Array, num_generations: int, scale: str = "group") -> jax.Array:
    """Group-relative advantages: each reward minus its group's mean, optionally scaled.

    Rows ``g * num_generations ... (g + 1) * num_generations - 1`` are the completions of
    prompt ``g`` (TRL's order: ``repeat_interleave``). ``A_i = r_i - mean(group)``, divided
    by ``std + 1e-4`` where ``std`` is the Bessel-corrected (ddof=1) standard deviation of
    the group (``scale="group"``) or of the whole batch (``"batch"``); ``"none"`` does not
    divide (Dr. GRPO). A group whose rewards are all equal gets advantage exactly 0.

    Args:
      rewards: float ``[B]``, one scalar reward per completion, ``B`` a multiple of
        ``num_generations``.
      num_generations: completions per prompt ``G`` (>= 2; a static Python int).
      scale: ``"group"``, ``"batch"`` or ``"none"`` (TRL's ``scale_rewards``).

    Returns:
      float32 ``[B]``, not differentiated (rewards are data).

    Raises:
      ValueError: ``num_generations < 2``, ``B`` not a multiple of it, ``rewards`` not
        ``[B]``, or an unknown ``scale``.

    Source: Shao et al. 2024 (arXiv:2402.03300), Sec. 4.1.2; TRL's
    ``GRPOTrainer._generate_and_score_completions`` (``scale_rewards``).
    """
    rewards = jax.lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [B] (one per completion); got shape {rewards.shape}.")
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2; got {num_generations!r}.")
    if rewards.shape[0] % num_generations:
        raise ValueError(
            f"the batch of {rewards.shape[0]} rewards is not a multiple of "
            f"num_generations={num_generations}."
        )
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}; got {scale!r}.")
    grouped = rewards.reshape(-1, num_generations)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if scale == "group":
        centred = centred / (_bessel_std(grouped, 1) + _STD_EPS)
    elif scale == "batch":
        centred = centred / (_bessel_std(rewards, 0) + _STD_EPS)
    # exactly 0 for an all-equal group (its float32 mean may be an ulp off the values)
    equal = jnp.max(grouped, axis=1, keepdims=True) == jnp.min(grouped, axis=1, keepdims=True)
    return jnp.where(equal, 0.0, centred).reshape(-1)


def _check_grpo(logps, old_logps, advantages, mask, ref_logps, beta, epsilon, eps_high, loss):
    if logps.ndim != 2:
        raise ValueError(f"logps must be per-token [B, T]; got shape {logps.shape}.")
    for name, x in (("old_logps", old_logps), ("mask", mask), ("ref_logps", ref_logps)):
        if x is not None and x.shape != logps.shape:
            raise ValueError(f"{name} must match logps {logps.shape}; got {x.shape}.")
    if advantages.shape not in ((logps.shape[0],), logps.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] for logps {logps.shape}; got {advantages.shape}."
        )
    if loss not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {loss!r}.")
    if isinstance(beta, int | float) and beta < 0:
        raise ValueError(f"beta (the KL weight) must be >= 0; got {beta!r}.")
    if isinstance(beta, int | float) and beta > 0 and ref_logps is None:
        raise ValueError("grpo with beta > 0 needs ref_logps (the reference's per-token logps).")
    for name, e in (("epsilon", epsilon), ("epsilon_high", eps_high)):
        if isinstance(e, int | float) and not e >= 0:
            raise ValueError(f"{name} must be >= 0; got {e!r}.")


def _aggregate(per_token, mask, loss_type, max_completion_length):
    """TRL's reductions of a masked ``[B, T]`` per-token loss to a scalar."""
    if loss_type == "grpo":  # each sequence's token mean, then the batch mean
        return jnp.mean(jnp.sum(per_token, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))
    if loss_type == "dr_grpo":  # a constant normaliser: B * max_completion_length
        length = per_token.shape[1] if max_completion_length is None else max_completion_length
        return jnp.sum(per_token) / (per_token.shape[0] * length)
    return jnp.sum(per_token) / jnp.maximum(jnp.sum(mask), 1.0)  # bnpo, dapo: a token mean


def _masked_mean(x, mask):
    """The mean of ``x`` over the tokens of ``mask`` (TRL's ``global_masked_mean``)."""
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def grpo(
    logps: jax.Array,
    old_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    ref_logps: jax.Array | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The GRPO clipped surrogate loss over completion tokens, with an optional KL penalty.

    Per token, with the ratio ``rho = exp(logps - old_logps)``:
    ``l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta KL``, where ``KL``
    is the k3 estimator ``exp(ref - logps) - (ref - logps) - 1`` (Schulman 2020), added
    only when ``beta > 0``. The masked ``l`` is then reduced by ``loss_type``:

    - ``"grpo"``: each completion's token mean, then the batch mean (the paper's);
    - ``"bnpo"``, ``"dapo"``: the sum over all tokens / the number of tokens (DAPO's
      token-level loss; TRL's ``"dapo"`` divides by the tokens of the whole generation
      batch: pass that batch here, or weight micro-batches by their token counts);
    - ``"dr_grpo"``: the sum / ``(B * max_completion_length)`` (Dr. GRPO).

    Masked tokens (padding) take no part in the loss or the metrics, and the gradient with
    respect to ``logps`` is exactly 0 there (padding may hold any value, even ``-inf``).

    Args:
      logps: float ``[B, T]``, the policy's log-probs of the completion tokens (nats;
        computed in float32).
      old_logps: float ``[B, T]``, those of the policy that sampled the completions, or
        None for ``stop_gradient(logps)`` (one policy update per rollout, mu = 1).
      advantages: float ``[B]`` (``group_advantages``) or ``[B, T]``; not differentiated.
      mask: ``[B, T]``, 1 (or True) on real completion tokens (the EOS included), 0 on
        padding.
      ref_logps: float ``[B, T]``, the reference's log-probs; required when ``beta > 0``.
      beta: the KL weight (>= 0); 0 skips the reference.
      epsilon: the lower clip range (ratio >= 1 - epsilon).
      epsilon_high: the upper clip range (ratio <= 1 + epsilon_high); None for
        ``epsilon`` (DAPO's clip-higher: e.g. 0.28).
      loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"`` or ``"dapo"``.
      max_completion_length: ``"dr_grpo"``'s normaliser; None for ``T``.
      entropy: float ``[B, T]`` per-token entropies of the policy, for the metric only.

    Returns:
      ``(loss, metrics)``: the float32 scalar loss and float32 scalars named as TRL logs
      them, token means over ``mask``: ``kl`` (0 when ``beta == 0``),
      ``clip_ratio/low_mean`` (``rho < 1 - epsilon`` and ``A < 0``),
      ``clip_ratio/high_mean`` (``rho > 1 + epsilon_high`` and ``A > 0``),
      ``clip_ratio/region_mean`` (either), and ``entropy`` when given. Metrics are not
      differentiated.

    Raises:
      ValueError: shapes that do not match ``logps [B, T]``, an unknown ``loss_type``, a
        negative ``beta`` or clip range, or ``beta > 0`` without ``ref_logps``.

    Source: Shao et al. 2024 (arXiv:2402.03300); Yu et al. 2025 (DAPO, arXiv:2503.14476);
    Liu et al. 2025 (Dr. GRPO, arXiv:2503.20783); TRL's ``GRPOTrainer._compute_loss``
    (``trl/trainer/grpo_trainer.py``).
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    logps = jnp.asarray(logps, jnp.float32)
    advantages = jnp.asarray(advantages, jnp.float32)
    mask = jnp.asarray(mask)
    _check_grpo(logps, old_logps, advantages, mask, ref_logps, beta, epsilon, eps_high, loss_type)
    real = mask > 0
    mask = real.astype(jnp.float32)
    # padding is replaced before any arithmetic: its gradient is exactly 0, never NaN
    logps = jnp.where(real, logps, 0.0)
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    old = jax.lax.stop_gradient(jnp.where(real, jnp.asarray(old, jnp.float32), 0.0))
    adv = jax.lax.stop_gradient(advantages if advantages.ndim == 2 else advantages[:, None])
    ratio = jnp.exp(logps - old)
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(logps)
    if ref_logps is not None and not (isinstance(beta, int | float) and beta == 0):
        ref = jax.lax.stop_gradient(jnp.where(real, jnp.asarray(ref_logps, jnp.float32), 0.0))
        kl = jnp.exp(ref - logps) - (ref - logps) - 1.0
        per_token = per_token + beta * kl
    loss = _aggregate(jnp.where(real, per_token, 0.0), mask, loss_type, max_completion_length)
    ratio = jax.lax.stop_gradient(ratio)
    low = (ratio < 1.0 - epsilon) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    metrics = {
        "kl": _masked_mean(jax.lax.stop_gradient(kl), mask),
        "clip_ratio/low_mean": _masked_mean(low.astype(jnp.float32), mask),
        "clip_ratio/high_mean": _masked_mean(high.astype(jnp.float32), mask),
        "clip_ratio/region_mean": _masked_mean((low | high).astype(jnp.float32), mask),
    }
    if entropy is not None:
        entropy = jax.lax.stop_gradient(jnp.asarray(entropy, jnp.float32))
        metrics["entropy"] = _masked_mean(entropy, mask)
    return loss, metrics
