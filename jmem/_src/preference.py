"""Preference losses as pure functions of sequence log-probabilities: DPO (Rafailov et al.
2023, arXiv:2305.18290) with conservative label smoothing and IPO (Azar et al. 2023,
arXiv:2310.12036), ORPO (Hong et al. 2024, arXiv:2403.07691) and SimPO (Meng et al. 2024,
arXiv:2405.14734), with the metrics TRL logs; the reference log-probs of a LoRA/QLoRA run
from the same base with the adapters off; and a loss builder for ``jmem.train_step``.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp

from jmem._src import lora as _lora
from jmem._src.sequence_logprobs import SequenceLogprobs

__all__ = (
    "dpo",
    "orpo",
    "simpo",
    "reference_logprobs",
    "precompute_reference",
    "preference_loss",
)

Metrics = dict[str, jax.Array]

#: the ``reference=`` settings of ``preference_loss`` (see there).
REFERENCES = ("adapters_off", "precomputed", "tree", None)


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _check_pairs(name: str, *xs) -> None:
    shapes = {jnp.shape(x) for x in xs}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(
            f"{name} needs per-example log-probs, each [B] with the same B; got shapes "
            f"{[jnp.shape(x) for x in xs]}."
        )


def _check_positive(name: str, value) -> None:
    if isinstance(value, int | float) and not value > 0:
        raise ValueError(f"{name} must be > 0; got {value!r}.")


def _check_smoothing(label_smoothing) -> None:
    if isinstance(label_smoothing, int | float) and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing must be in [0, 0.5) (the probability that a label is flipped); "
            f"got {label_smoothing!r}."
        )


def _smoothed_sigmoid_loss(logits, beta, label_smoothing):
    """``-(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)`` per example."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
        beta * logits
    ) - label_smoothing * jax.nn.log_sigmoid(-beta * logits)


def _reward_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> Metrics:
    """TRL's logged metrics, batch means (float32 scalars); rewards are not differentiated."""
    chosen, rejected = jax.lax.stop_gradient((chosen_rewards, rejected_rewards))
    return {
        "rewards/chosen": jnp.mean(chosen),
        "rewards/rejected": jnp.mean(rejected),
        "rewards/margins": jnp.mean(chosen - rejected),
        "rewards/accuracies": jnp.mean((chosen > rejected).astype(jnp.float32)),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(chosen_logps)),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(rejected_logps)),
    }


def dpo(
    policy_chosen_logps: jax.Array,
    policy_rejected_logps: jax.Array,
    reference_chosen_logps: jax.Array,
    reference_rejected_logps: jax.Array,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
    chosen_tokens: jax.Array | None = None,
    rejected_tokens: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Direct Preference Optimization loss (sigmoid, or IPO's squared loss).

    With the log-ratios ``r_c = pi_c - ref_c`` and ``r_r = pi_r - ref_r`` (per-sequence
    summed log-probs, ``SequenceLogprobs.sum``):

    - ``"sigmoid"`` (DPO, Eq. 7): ``-(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)``
      with ``d = r_c - r_r`` and ``e = label_smoothing`` (conservative DPO, Mitchell 2023;
      ``e = 0`` is DPO). TRL's ``CPOTrainer`` ``"sigmoid"`` and TRL < 1.0's ``DPOTrainer``.
    - ``"ipo"`` (IPO, Eq. 17): ``(d' - 1 / (2 beta))^2`` with the length-normalised
      ``d' = r_c / n_c - r_r / n_r`` (``n`` = ``chosen_tokens``/``rejected_tokens``, the
      response token counts, ``SequenceLogprobs.count``), as TRL's ``DPOTrainer`` ``"ipo"``.

    Args:
      policy_chosen_logps, policy_rejected_logps: float ``[B]``, the policy's summed
        log-probs of the chosen / rejected responses (nats).
      reference_chosen_logps, reference_rejected_logps: float ``[B]``, the reference's.
      beta: the KL penalty's inverse temperature (> 0; IPO's ``tau``).
      label_smoothing: ``e`` in ``[0, 0.5)``, the assumed probability of a flipped label
        (``"sigmoid"`` only).
      loss_type: ``"sigmoid"`` or ``"ipo"``.
      chosen_tokens, rejected_tokens: float ``[B]`` response token counts; required by
        ``"ipo"`` (counts below 1 count as 1).

    Returns:
      ``(loss, metrics)``: the float32 scalar mean loss over the ``B`` pairs, and float32
      scalar batch means named as TRL logs them: ``rewards/chosen`` (``beta * r_c``),
      ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies`` (fraction with
      ``r_c > r_r``), ``logps/chosen``, ``logps/rejected`` (the policy's).

    Raises:
      ValueError: inputs not all ``[B]``, ``beta <= 0``, ``label_smoothing`` outside
        ``[0, 0.5)`` or with ``"ipo"``, an unknown ``loss_type``, or ``"ipo"`` without the
        token counts.

    Source: Rafailov et al. 2023 (arXiv:2305.18290); Azar et al. 2023 (arXiv:2310.12036);
    TRL's ``DPOTrainer``.
    """
    _check_pairs(
        "dpo",
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
    )
    _check_positive("beta", beta)
    _check_smoothing(label_smoothing)
    pc, pr, rc, rr = _f32(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
    )
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(chosen_ratio - rejected_ratio, beta, label_smoothing)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError(
                "dpo(loss_type='ipo') needs chosen_tokens and rejected_tokens (the response "
                "token counts, SequenceLogprobs.count) to length-normalise the log-ratios."
            )
        if isinstance(label_smoothing, int | float) and label_smoothing != 0:
            raise ValueError("label_smoothing applies to loss_type='sigmoid' only; pass 0.")
        nc, nr = (jnp.maximum(n, 1.0) for n in _f32(chosen_tokens, rejected_tokens))
        losses = (chosen_ratio / nc - rejected_ratio / nr - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo'; got {loss_type!r}.")
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio, pc, pr)
    return jnp.mean(losses), metrics


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-ln 2`` (Maechler 2012)."""
    x = jnp.minimum(x, -1e-30)  # a probability of exactly 1 has no odds
    return jnp.where(x < -math.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    nll: jax.Array,
    *,
    beta: float = 0.1,
) -> tuple[jax.Array, Metrics]:
    """Odds Ratio Preference Optimization loss: the SFT term plus the odds-ratio term.

    ``loss = nll - beta * mean(log sigmoid(log odds(p_c) - log odds(p_r)))`` with
    ``log odds(p) = log p - log(1 - p)`` of the length-normalised (per-token mean)
    log-probs ``log p`` (Hong et al. 2024, Eqs. 4-7; ``beta`` is their ``lambda``). No
    reference model.

    Args:
      chosen_logps, rejected_logps: float ``[B]``, the policy's mean per-token log-probs
        of the chosen / rejected responses (``SequenceLogprobs.mean``, nats, < 0).
      nll: float scalar, the SFT loss: the mean negative log-likelihood per chosen token.
        The paper takes it over the response (``preference_loss`` does:
        ``-sum(chosen.sum) / sum(chosen.count)``); TRL's ``ORPOTrainer`` over prompt and
        response.
      beta: the odds-ratio term's weight (> 0).

    Returns:
      ``(loss, metrics)``: float32 scalar loss, and float32 scalars: TRL's
      ``rewards/chosen`` (``beta * chosen_logps``), ``rewards/rejected``,
      ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``,
      ``nll_loss``, ``log_odds_ratio`` (mean log sigmoid) and ``log_odds_chosen`` (mean log
      odds ratio).

    Raises:
      ValueError: inputs not ``[B]`` (``nll`` not a scalar), or ``beta <= 0``.

    Source: Hong et al. 2024 (arXiv:2403.07691); TRL's ``ORPOTrainer.odds_ratio_loss``.
    """
    _check_pairs("orpo", chosen_logps, rejected_logps)
    if jnp.ndim(nll) != 0:
        raise ValueError(f"orpo's nll must be a scalar (the SFT loss); got shape {jnp.shape(nll)}.")
    _check_positive("beta", beta)
    pc, pr, nll = _f32(chosen_logps, rejected_logps, nll)
    log_odds = (pc - pr) - (_log1mexp(pc) - _log1mexp(pr))
    ratio = jax.nn.log_sigmoid(log_odds)
    metrics = _reward_metrics(beta * pc, beta * pr, pc, pr)
    metrics["nll_loss"] = jax.lax.stop_gradient(nll)
    metrics["log_odds_ratio"] = jax.lax.stop_gradient(jnp.mean(ratio))
    metrics["log_odds_chosen"] = jax.lax.stop_gradient(jnp.mean(log_odds))
    return nll - beta * jnp.mean(ratio), metrics


def simpo(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, Metrics]:
    """Simple Preference Optimization loss: length-normalised rewards with a target margin.

    ``loss = mean(-(1 - e) log sigmoid(z) - e log sigmoid(-z))`` with
    ``z = beta * (chosen_logps - rejected_logps) - gamma`` (Meng et al. 2024, Eq. 6;
    ``e = label_smoothing``, 0 in the paper) on per-token mean log-probs. No reference
    model. Defaults: the paper's ``beta = 2``, ``gamma = 1`` (``gamma / beta = 0.5``).

    Args:
      chosen_logps, rejected_logps: float ``[B]``, the policy's mean per-token log-probs
        (``SequenceLogprobs.mean``, nats).
      beta: the reward scale (> 0).
      gamma: the target reward margin (nats of scaled reward).
      label_smoothing: ``e`` in ``[0, 0.5)``.

    Returns:
      ``(loss, metrics)``: float32 scalar mean loss, and TRL's float32 scalar metrics
      ``rewards/chosen`` (``beta * chosen_logps``), ``rewards/rejected``,
      ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``.

    Raises:
      ValueError: inputs not both ``[B]``, ``beta <= 0``, or ``label_smoothing`` outside
        ``[0, 0.5)``.

    Source: Meng et al. 2024 (arXiv:2405.14734); TRL's ``CPOTrainer`` with
    ``loss_type="simpo"``, ``cpo_alpha=0`` (its ``simpo_gamma`` is ``gamma`` here).
    """
    _check_pairs("simpo", chosen_logps, rejected_logps)
    _check_positive("beta", beta)
    _check_smoothing(label_smoothing)
    pc, pr = _f32(chosen_logps, rejected_logps)
    logits = pc - pr - gamma / beta
    losses = _smoothed_sigmoid_loss(logits, beta, label_smoothing)
    return jnp.mean(losses), _reward_metrics(beta * pc, beta * pr, pc, pr)


def reference_logprobs(logprobs_fn: Callable, base_params: Any, *args: Any, **kwargs: Any):
    """The reference model's output: ``logprobs_fn`` on the base, adapters off, no gradient.

    For a LoRA/QLoRA run the reference model is the base the adapters are trained on, so it
    needs no second copy of the weights: this calls ``jmem.lora.apply(logprobs_fn)`` with
    ``lora=None`` (NF4 leaves of ``base_params`` are dequantized per matmul, as in training)
    under ``jax.lax.stop_gradient``, so no activation is kept for a backward pass. For full
    fine-tuning pass the frozen reference tree (dense or NF4) as ``base_params``. Call it in
    the step (``preference_loss(..., reference="adapters_off")``) or once over the data
    before training (``reference="precomputed"``); ``docs/preference.md`` measures both.

    Args:
      logprobs_fn: ``logprobs_fn(params, *args, **kwargs) -> pytree`` (e.g. a
        ``SequenceLogprobs`` from ``jmem.ops.sequence_logprobs``); not ``lora.apply``'d.
      base_params: the base params (arrays or ``NF4Array`` leaves).
      *args, **kwargs: passed to ``logprobs_fn`` (the batch).

    Returns:
      ``logprobs_fn``'s output with every leaf under ``stop_gradient``.

    Raises:
      Whatever ``logprobs_fn`` raises; ``jmem.lora.ImplicitWeightError`` where an NF4 leaf
      is used other than in a matmul.

    Source: TRL's ``DPOTrainer`` with a PEFT model and no ``ref_model`` (the reference is
    the model with its adapters disabled).
    """
    base = jax.lax.stop_gradient(base_params) if _is_plain(base_params) else base_params
    out = _lora.apply(logprobs_fn)(base, None, *args, **kwargs)
    return jax.lax.stop_gradient(out)


def _is_plain(tree) -> bool:
    """Whether every leaf is a JAX/NumPy array (``stop_gradient`` takes it as is)."""
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree))


def _pairs_to_rows(batch: dict, keep: tuple[str, ...]) -> dict:
    """``[B, 2, ...]`` batch arrays as ``[2B, ...]`` rows (chosen and rejected of a pair
    adjacent), the keys in ``keep`` left out."""
    rows = {}
    for k, v in batch.items():
        if k in keep:
            continue
        if jnp.ndim(v) < 2 or jnp.shape(v)[1] != 2:
            raise ValueError(
                f"preference batch[{k!r}] must be [B, 2, ...] (axis 1: chosen, rejected); "
                f"got shape {jnp.shape(v)}."
            )
        rows[k] = jnp.reshape(v, (-1, *jnp.shape(v)[2:]))
    return rows


def _pairs(logps: SequenceLogprobs) -> tuple[SequenceLogprobs, SequenceLogprobs]:
    """The chosen and rejected halves of ``[2B]`` rows laid out as ``_pairs_to_rows``."""
    split = jax.tree.map(lambda a: jnp.reshape(a, (-1, 2)), logps)
    return (jax.tree.map(lambda a: a[:, 0], split), jax.tree.map(lambda a: a[:, 1], split))


def precompute_reference(logprobs_fn: Callable, base_params: Any, batch: dict) -> jax.Array:
    """The reference log-probs of a preference batch, to store as ``batch["ref_logps"]``.

    Args:
      logprobs_fn: ``logprobs_fn(params, rows) -> SequenceLogprobs`` over ``[2B]`` rows
        (see ``preference_loss``).
      base_params: the base (adapters off) or the frozen reference tree; NF4 leaves allowed.
      batch: a preference batch, arrays ``[B, 2, ...]`` (axis 1: chosen, rejected).

    Returns:
      float32 ``[B, 2]``: summed log-probs of each pair's chosen and rejected response.

    Raises:
      ValueError: a batch array not shaped ``[B, 2, ...]``.
    """
    rows = _pairs_to_rows(batch, keep=("ref_logps",))
    out = reference_logprobs(logprobs_fn, base_params, rows)
    return jnp.reshape(out.sum, (-1, 2))


_NEEDS_FROZEN = {
    "adapters_off": "reference='adapters_off' needs the base params as frozen= (the LoRA/QLoRA "
    "base: step.init(adapters, frozen=base)); for full fine-tuning use reference='tree' or "
    "'precomputed'.",
    "tree": "reference='tree' needs the frozen reference tree as frozen= "
    "(step.init(params, frozen=reference_params)).",
}


def _policy(logprobs_fn, reference, trainable, frozen, rows, dropout_key) -> SequenceLogprobs:
    """The policy's log-probs: adapters on the frozen base, or full params."""
    if reference == "tree" or frozen is None:
        if reference == "adapters_off":
            raise ValueError(_NEEDS_FROZEN[reference])
        return logprobs_fn(trainable, rows)
    kw = {} if dropout_key is None else {"lora_dropout_key": dropout_key}
    return _lora.apply(logprobs_fn)(frozen, trainable, rows, **kw)


def _reference(logprobs_fn, reference, frozen, rows, batch) -> tuple[jax.Array, jax.Array]:
    """The reference's summed log-probs ``([B], [B])`` of the chosen and rejected rows."""
    if reference == "precomputed":
        ref = batch.get("ref_logps")
        if ref is None or jnp.ndim(ref) != 2 or jnp.shape(ref)[1] != 2:
            raise ValueError(
                "reference='precomputed' needs batch['ref_logps'], float32 [B, 2] from "
                f"precompute_reference; got {None if ref is None else jnp.shape(ref)}."
            )
        ref = jax.lax.stop_gradient(jnp.asarray(ref, jnp.float32))
        return ref[:, 0], ref[:, 1]
    if frozen is None:
        raise ValueError(_NEEDS_FROZEN[reference])
    chosen, rejected = _pairs(reference_logprobs(logprobs_fn, frozen, rows))
    return chosen.sum, rejected.sum


def _loss(logprobs_fn, objective, reference, hyper, trainable, batch, *, frozen=None, **extras):
    """The built loss: ``(loss, metrics)`` of one preference batch (see ``preference_loss``)."""
    rows = _pairs_to_rows(batch, keep=("ref_logps",))
    if objective == "dpo":  # the reference first: its errors before the policy's forward
        ref_chosen, ref_rejected = _reference(logprobs_fn, reference, frozen, rows, batch)
    policy = _policy(logprobs_fn, reference, trainable, frozen, rows, extras.get("dropout_key"))
    chosen, rejected = _pairs(policy)
    if objective == "dpo":
        counts = {"chosen_tokens": chosen.count, "rejected_tokens": rejected.count}
        return dpo(chosen.sum, rejected.sum, ref_chosen, ref_rejected, **counts, **hyper)
    if objective == "orpo":
        nll = -jnp.sum(chosen.sum) / jnp.maximum(jnp.sum(chosen.count), 1.0)
        return orpo(chosen.mean, rejected.mean, nll, **hyper)
    return simpo(chosen.mean, rejected.mean, **hyper)


_OBJECTIVES = {"dpo": dpo, "orpo": orpo, "simpo": simpo}


def _check_builder(objective, reference, hyper) -> None:
    if objective not in _OBJECTIVES:
        raise ValueError(f"objective must be one of {sorted(_OBJECTIVES)}; got {objective!r}.")
    wanted = (None,) if objective != "dpo" else REFERENCES[:3]
    if reference not in wanted:
        raise ValueError(
            f"{objective} takes reference={' or '.join(map(repr, wanted))}; got {reference!r}"
            + (" (ORPO and SimPO use no reference model)." if objective != "dpo" else ".")
        )
    sig = inspect.signature(_OBJECTIVES[objective])
    allowed = {
        n
        for n, p in sig.parameters.items()
        if p.kind is p.KEYWORD_ONLY and n not in ("chosen_tokens", "rejected_tokens")
    }
    unknown = sorted(set(hyper) - allowed)
    if unknown:
        raise ValueError(f"{objective} takes {sorted(allowed)}; got unknown {unknown}.")
    # Validates the values now (beta, label_smoothing, loss_type) on dummy log-probs.
    z = jnp.zeros((1,), jnp.float32)
    args = {"dpo": (z, z, z, z), "orpo": (z - 1, z - 2, z[0]), "simpo": (z, z)}[objective]
    extra = {"chosen_tokens": z + 1, "rejected_tokens": z + 1} if objective == "dpo" else {}
    jax.eval_shape(functools.partial(_OBJECTIVES[objective], **extra, **hyper), *args)


def preference_loss(
    logprobs_fn: Callable,
    objective: str = "dpo",
    *,
    reference: str | None = "adapters_off",
    **hyperparams: Any,
) -> Callable:
    """Builds ``loss(trainable, batch, *, frozen=None, dropout_key=None) -> (loss, metrics)``.

    The loss runs ``logprobs_fn`` once on the chosen and rejected responses of every pair
    as rows of one batch (no second forward pass for the rejected ones), then ``dpo``,
    ``orpo`` or ``simpo``. It composes with ``jmem.train_step(loss, opt, has_aux=True)``
    (``metrics`` then in ``step_metrics["aux"]``) and with ``jax.grad(..., has_aux=True)``.

    The batch holds pairs: every array ``[B, 2, ...]`` with axis 1 = (chosen, rejected),
    e.g. ``{"inputs": int32[B, 2, S], "targets": int32[B, 2, S], "completion_mask":
    [B, 2, S]}``, and with ``reference="precomputed"`` ``"ref_logps": float32[B, 2]``
    (from ``precompute_reference``). They reach ``logprobs_fn`` as ``[2B, ...]`` rows
    (the two answers of a pair adjacent), so ``train_step(microbatches=k)`` splits whole
    pairs. Name the response mask ``"completion_mask"`` (TRL's name), not ``"mask"``: with a
    ``"mask"``, gradient accumulation weighs microbatches by token counts, while these
    losses are means over pairs.

    ``reference`` (DPO only; ORPO and SimPO take ``None``):

    - ``"adapters_off"``: ``trainable`` are LoRA adapters, ``frozen`` the (NF4) base; the
      reference is the same base with the adapters off under ``stop_gradient``, computed in
      the step (``reference_logprobs``): no second model.
    - ``"precomputed"``: the reference log-probs come from ``batch["ref_logps"]``;
      ``trainable`` are adapters on ``frozen`` or, with ``frozen=None``, the full params.
    - ``"tree"``: full fine-tuning: ``trainable`` the params, ``frozen`` the frozen
      reference tree (dense or NF4 leaves; e.g. ``qlora.quantize_params`` of the start).

    Args:
      logprobs_fn: ``logprobs_fn(params, rows) -> SequenceLogprobs`` with ``[2B]`` leaves,
        ``rows`` the batch as ``[2B, ...]`` arrays (e.g. hidden states from
        ``jmem.models.preference.hidden_states`` and ``jmem.ops.sequence_logprobs`` with
        ``mask=rows["completion_mask"]``). Plain params: ``jmem.lora.apply`` is applied here.
      objective: ``"dpo"``, ``"orpo"`` or ``"simpo"``.
      reference: see above.
      **hyperparams: the objective's keyword arguments (``beta``, ``label_smoothing``,
        ``loss_type``, ``gamma``).

    Returns:
      ``loss(trainable, batch, *, frozen=None, dropout_key=None)``: float32 scalar and the
      objective's metrics (float32 scalars). ``dropout_key`` is passed to the adapters as
      ``lora_dropout_key``.

    Raises:
      ValueError: an unknown objective, a reference the objective does not take, unknown or
        invalid hyperparameters; when called: a batch array not ``[B, 2, ...]``, a missing
        ``frozen`` or ``ref_logps``.

    Source: TRL's ``DPOTrainer`` (concatenated forward, PEFT reference with adapters
    disabled, ``precompute_ref_log_probs``), ``ORPOTrainer``, ``CPOTrainer`` (SimPO).
    """
    _check_builder(objective, reference, hyperparams)
    return functools.partial(_loss, logprobs_fn, objective, reference, hyperparams)
