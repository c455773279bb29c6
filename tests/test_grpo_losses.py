"""jmem.losses.group_advantages and grpo equal TRL's GRPOTrainer (its own ``_compute_loss`` on
tensors, and its advantage formula with TRL's ``nanstd``) on ragged masks: loss, gradient and
metrics for every loss type, with and without the KL term and DAPO's clip-higher; padding
gets no gradient; bad input is named."""

import collections
import functools
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem import losses

G, P, T = 4, 3, 9  # generations per prompt, prompts, completion tokens
B = G * P


def _rollout(seed=0):
    """Per-token logps, old and reference logps ``[B, T]`` and a ragged completion mask (row
    lengths 1..T, padding filled with junk), float32 rewards ``[B]`` with one all-equal group."""
    rng = np.random.default_rng(seed)
    logps = np.log(rng.uniform(0.05, 0.95, size=(B, T))).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, size=(B, T))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.5, size=(B, T))).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[0], lengths[1] = 1, T
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.int64)
    rewards = rng.normal(0, 1, size=B).astype(np.float32)
    rewards[G : 2 * G] = 0.7  # an all-equal group
    return logps, old, ref, mask, rewards


def _torch():
    torch = pytest.importorskip("torch", reason="torch (CPU) runs TRL, the oracle")
    pytest.importorskip("trl", reason="TRL's GRPOTrainer is the oracle; install the test extra")
    return torch


def _trl_advantages(rewards, num_generations, scale):
    """TRL's advantages, as written in ``GRPOTrainer._generate_and_score_completions``
    (``multi_objective_aggregation="sum_then_normalize"``, one reward function), with TRL's
    own ``nanstd``."""
    torch = _torch()
    from trl.trainer.utils import nanstd

    r = torch.tensor(rewards)
    mean = torch.nanmean(r.view(-1, num_generations), dim=1)
    mean = mean.repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):
        std = nanstd(r.view(-1, num_generations), dim=1).repeat_interleave(num_generations, 0)
    else:
        std = nanstd(r).expand_as(r)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return adv.numpy()


class _Accelerator:
    """The parts of accelerate's Accelerator that ``GRPOTrainer._compute_loss`` reads."""

    device = "cpu"
    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_grpo(loss_type, beta, epsilon_high, logps, old, ref, mask, adv, entropy):
    """TRL's ``GRPOTrainer._compute_loss`` on a trainer built without a model
    (``object.__new__``) whose log-prob function returns ``logps``: (loss, d loss / d logps,
    logged metrics)."""
    torch = _torch()
    from trl.trainer.grpo_trainer import GRPOTrainer

    per_token = torch.tensor(logps, requires_grad=True)
    trainer = object.__new__(GRPOTrainer)
    fields = dict(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        args=types.SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=1
        ),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.2 if epsilon_high is None else epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token, torch.tensor(entropy), None),
    )
    for name, value in fields.items():
        setattr(trainer, name, value)
    n = mask.shape[0]
    inputs = {
        "prompt_ids": torch.zeros((n, 2), dtype=torch.long),
        "prompt_mask": torch.ones((n, 2), dtype=torch.long),
        "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(adv),
        "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref),
        "num_items_in_batch": torch.tensor(mask.sum()),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return loss.item(), per_token.grad.numpy(), metrics


def _close(got, want, tol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def _check_against_trl(loss_type, beta, epsilon_high):
    logps, old, ref, mask, rewards = _rollout()
    entropy = np.random.default_rng(1).uniform(0, 3, size=(B, T)).astype(np.float32)
    adv = np.asarray(losses.group_advantages(rewards, G))
    want, want_grad, want_metrics = _trl_grpo(
        loss_type, beta, epsilon_high, logps, old, ref, mask, adv, entropy
    )
    fn = functools.partial(
        losses.grpo, beta=beta, epsilon_high=epsilon_high, loss_type=loss_type, entropy=entropy
    )
    fn = functools.partial(fn, ref_logps=ref) if beta else fn
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logps, old, adv, mask)
    _close(loss, want)
    _close(grad, want_grad)
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"]
    for name in names + (["kl"] if beta else []):
        _close(metrics[name], want_metrics[name])
    assert want_metrics["clip_ratio/region_mean"] > 0  # the clipping is exercised
    assert np.all(np.asarray(grad)[mask == 0] == 0)


@pytest.mark.slow  # importing torch and TRL takes ~10 s
def test_grpo_equals_trl_compute_loss_dapo():
    """The default (DAPO's token mean, clip-higher, with the KL term): the fast cell."""
    _check_against_trl("dapo", 0.04, 0.28)


_GRID = list(itertools.product(("grpo", "bnpo", "dr_grpo", "dapo"), (0.0, 0.04)))


@pytest.mark.slow
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("loss_type,beta", _GRID)
def test_grpo_equals_trl_compute_loss(loss_type, beta, epsilon_high):
    _check_against_trl(loss_type, beta, epsilon_high)


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    rewards = _rollout()[-1]
    got = losses.group_advantages(rewards, G, scale=scale)
    _close(got, _trl_advantages(rewards, G, scale), tol=1e-5)
    assert np.all(np.asarray(got)[G : 2 * G] == 0)  # the all-equal group: exactly 0


def test_group_advantages_all_equal_is_zero_never_nan():
    rewards = jnp.full((8,), 0.1, jnp.float32)
    for scale in ("group", "batch", "none"):
        got = jax.jit(losses.group_advantages, static_argnums=(1, 2))(rewards, 4, scale)
        assert np.all(np.asarray(got) == 0), scale


def test_grpo_padding_gets_no_gradient_even_when_it_is_inf():
    logps, old, ref, mask, rewards = _rollout()
    logps = np.where(mask > 0, logps, -np.inf).astype(np.float32)
    old = np.where(mask > 0, old, np.nan).astype(np.float32)
    adv = losses.group_advantages(rewards, G)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        fn = functools.partial(losses.grpo, ref_logps=ref, beta=0.04, loss_type=loss_type)
        fn = jax.jit(jax.value_and_grad(fn, has_aux=True))
        (loss, metrics), grad = fn(logps, old, adv, mask)
        grad = np.asarray(grad)
        assert np.isfinite(loss) and np.isfinite(metrics["kl"]), loss_type
        assert np.all(grad[mask == 0] == 0), loss_type
        assert np.any(grad[mask > 0] != 0), loss_type


def test_grpo_old_logps_none_is_on_policy():
    """mu = 1: ratio 1, so the loss is -mean(A) over tokens and nothing is clipped."""
    logps, _, _, mask, rewards = _rollout()
    adv = losses.group_advantages(rewards, G)
    loss, metrics = losses.grpo(logps, None, adv, mask, loss_type="bnpo")
    want = -(np.asarray(adv)[:, None] * mask).sum() / mask.sum()
    _close(loss, want)
    assert float(metrics["clip_ratio/region_mean"]) == 0 and float(metrics["kl"]) == 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: losses.group_advantages(jnp.zeros(8), 1), "num_generations"),
        (lambda: losses.group_advantages(jnp.zeros(6), 4), "not a multiple"),
        (lambda: losses.group_advantages(jnp.zeros(8), 4, scale="std"), "scale"),
        (lambda: losses.grpo(*_zeros(), beta=0.1), "ref_logps"),
        (lambda: losses.grpo(*_zeros(), loss_type="ppo"), "loss_type"),
        (lambda: losses.grpo(jnp.zeros((4, 3)), None, jnp.zeros(4), jnp.ones((4, 2))), "mask"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _zeros():
    return jnp.zeros((4, 3)), jnp.zeros((4, 3)), jnp.zeros(4), jnp.ones((4, 3))
