"""jmem.losses: DPO/IPO, ORPO and SimPO equal TRL's losses and metrics on the same log-probs;
the adapters-off reference equals a precomputed one; the built loss composes with
train_step; a compiled preference gradient holds no [B, S, V] logits."""

import collections
import functools
import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import losses
from jmem.models import llama
from jmem.models import preference
from tests.helpers import small_config

NB, NS = 4, 11  # pairs, tokens per answer


def _logps(seed=0):
    """Per-token log-probs ``[2B, S-1]`` (chosen rows first, as TRL), completion masks
    ``[2B, S]`` (the prompt masked out), and reference sums ``[2B]``."""
    rng = np.random.default_rng(seed)
    per_token = np.log(rng.uniform(0.05, 0.9, size=(2 * NB, NS - 1))).astype(np.float32)
    start = rng.integers(1, NS - 2, size=(2 * NB, 1))
    mask = (np.arange(NS)[None] >= start).astype(np.int64)
    per_token = per_token * mask[:, 1:]
    ref = per_token.sum(1) + rng.normal(0, 2, size=2 * NB)
    ref[0] += 20.0  # pair 0: the chosen log-ratio is lower (a wrong pair), pair 1: higher
    ref[NB + 1] += 20.0
    ref = ref.astype(np.float32)
    return per_token, mask, ref


def _torch():
    torch = pytest.importorskip("torch", reason="torch (CPU) runs TRL, the oracle")
    pytest.importorskip("trl", reason="TRL is the oracle; install the test extra")
    return torch


class _Accelerator:
    """The parts of accelerate's Accelerator that TRL's loss code reads (one process)."""

    device = "cpu"

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _trl_dpo(loss_type, beta, per_token, mask, ref):
    """TRL's ``DPOTrainer._compute_loss`` on a stand-in model returning ``per_token``."""
    torch = _torch()
    from trl.trainer.dpo_trainer import DPOTrainer

    rows = per_token.shape[0]
    out = types.SimpleNamespace(
        log_probs=torch.tensor(per_token),
        entropy=torch.zeros(per_token.shape),
        mean_logits=torch.zeros(per_token.shape),
        is_top1=torch.zeros(per_token.shape, dtype=torch.bool),
    )
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(mask.shape, dtype=torch.long),
        "attention_mask": torch.ones(mask.shape, dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "ref_chosen_logps": torch.tensor(ref[: rows // 2]),
        "ref_rejected_logps": torch.tensor(ref[rows // 2 :]),
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: out, inputs, False)
    return float(loss), {k: v[0] for k, v in trainer._metrics["train"].items()}


_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
_METRICS += ("logps/chosen", "logps/rejected")


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("ipo", 0.3)])
def test_dpo_equals_trl_dpo_trainer(loss_type, beta):
    per_token, mask, ref = _logps()
    want, want_metrics = _trl_dpo(loss_type, beta, per_token, mask, ref)
    sums, counts = per_token.sum(1), mask.sum(1).astype(np.float32)
    loss, metrics = jax.jit(functools.partial(losses.dpo, beta=beta, loss_type=loss_type))(
        sums[:NB],
        sums[NB:],
        ref[:NB],
        ref[NB:],
        chosen_tokens=counts[:NB],
        rejected_tokens=counts[NB:],
    )
    _close(loss, want)
    for name in _METRICS:
        _close(metrics[name], want_metrics[name])
    assert 0 < want_metrics["rewards/accuracies"] < 1  # the accuracy is exercised


def _fake_trainer(**fields):
    return types.SimpleNamespace(accelerator=_Accelerator(), **fields)


def _trl_metrics(chosen_rewards, rejected_rewards):
    c, r = chosen_rewards.numpy(), rejected_rewards.numpy()
    return {
        "rewards/chosen": c.mean(),
        "rewards/rejected": r.mean(),
        "rewards/margins": (c - r).mean(),
        "rewards/accuracies": (c > r).mean(),
    }


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_dpo_label_smoothing_equals_trl_cpo_sigmoid_on_log_ratios(label_smoothing):
    """Conservative DPO: TRL's DPOTrainer (1.x) dropped label smoothing from "sigmoid";
    CPOTrainer's "sigmoid" keeps the formula, and on the log-ratios it is DPO's loss."""
    torch = _torch()
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    per_token, _, ref = _logps(1)
    ratios = per_token.sum(1) - ref
    trl = _fake_trainer(alpha=0.0, loss_type="sigmoid", beta=0.2, label_smoothing=label_smoothing)
    losses_, c, r = CPOTrainer.cpo_loss(trl, torch.tensor(ratios[:NB]), torch.tensor(ratios[NB:]))
    sums = per_token.sum(1)
    loss, metrics = losses.dpo(
        sums[:NB], sums[NB:], ref[:NB], ref[NB:], beta=0.2, label_smoothing=label_smoothing
    )
    _close(loss, losses_.mean().item())
    for name, value in _trl_metrics(c, r).items():
        _close(metrics[name], value)


def test_orpo_equals_trl_odds_ratio_loss():
    torch = _torch()
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    per_token, mask, _ = _logps(2)
    means = per_token.sum(1) / mask[:, 1:].sum(1)
    means[0] = -0.01  # both sides of log1mexp's branch at -ln 2
    nll = np.float32(1.7)
    trl = _fake_trainer(beta=0.25)
    out, c, r, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        trl, torch.tensor(means[:NB]), torch.tensor(means[NB:])
    )
    loss, metrics = jax.jit(functools.partial(losses.orpo, beta=0.25))(means[:NB], means[NB:], nll)
    _close(loss, (torch.tensor(nll) - out.mean()).item())  # ORPOTrainer's "full ORPO loss"
    for name, value in _trl_metrics(c, r).items():
        _close(metrics[name], value)
    _close(metrics["log_odds_ratio"], log_odds_ratio.item())
    _close(metrics["log_odds_chosen"], log_odds_chosen.item())
    _close(metrics["nll_loss"], nll)


@pytest.mark.parametrize("beta,gamma,label_smoothing", [(2.0, 1.0, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_equals_trl_cpo_simpo(beta, gamma, label_smoothing):
    torch = _torch()
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    per_token, mask, _ = _logps(3)
    means = per_token.sum(1) / mask[:, 1:].sum(1)
    trl = _fake_trainer(
        alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=label_smoothing
    )
    out, c, r = CPOTrainer.cpo_loss(trl, torch.tensor(means[:NB]), torch.tensor(means[NB:]))
    loss, metrics = losses.simpo(
        means[:NB], means[NB:], beta=beta, gamma=gamma, label_smoothing=label_smoothing
    )
    _close(loss, out.mean().item())  # cpo_alpha = 0: no NLL term
    for name, value in _trl_metrics(c, r).items():
        _close(metrics[name], value)


def test_loss_errors():
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="beta must be > 0"):
        losses.dpo(z, z, z, z, beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        losses.simpo(z, z, label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type must be"):
        losses.dpo(z, z, z, z, loss_type="hinge")
    with pytest.raises(ValueError, match="needs chosen_tokens and rejected_tokens"):
        losses.dpo(z, z, z, z, loss_type="ipo")
    with pytest.raises(ValueError, match=r"each \[B\] with the same B"):
        losses.orpo(z, jnp.zeros(2), 0.0)
    with pytest.raises(ValueError, match="nll must be a scalar"):
        losses.orpo(z, z, z)


# --- the built loss on the reference Llama ----------------------------------------------------


def _pair_batch(cfg, n=2, s=12, prompt=4, seed=0):
    """``[n, 2, s]`` pairs: a shared prompt, then different answers; masks on the answers."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    answers = jax.random.randint(k1, (n, 2, s + 1), 0, cfg.vocab_size)
    prompts = jax.random.randint(k2, (n, 1, prompt), 0, cfg.vocab_size)
    tokens = answers.at[:, :, :prompt].set(jnp.broadcast_to(prompts, (n, 2, prompt)))
    mask = jnp.broadcast_to((jnp.arange(s) >= prompt - 1).astype(jnp.int32), (n, 2, s))
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "completion_mask": mask}


#: 16 tokens of logits at a time.
LV16 = jmem.Levers(loss_chunk=16)


def _qlora_setup(cfg, seed=1):
    qparams = jmem.qlora.quantize_params(llama.init(jax.random.key(0), cfg))
    adapters = jmem.lora.init(jax.random.key(seed), qparams, rank=4)
    return qparams, adapters


@pytest.mark.slow
def test_first_dpo_loss_is_ln2_with_zero_adapters():
    cfg = small_config()
    qparams, adapters = _qlora_setup(cfg)
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    loss, metrics = losses.preference_loss(fn, "dpo")(adapters, _pair_batch(cfg), frozen=qparams)
    np.testing.assert_allclose(float(loss), np.log(2.0), rtol=1e-6)
    assert float(metrics["rewards/margins"]) == 0.0


@pytest.mark.slow
def test_adapters_off_reference_equals_precomputed_and_dense():
    """In-step reference (adapters off) == precomputed reference: loss, metrics and adapter
    gradients; and both equal the dense-logits computation (chunk 0)."""
    cfg = small_config()
    qparams, adapters = _qlora_setup(cfg)
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # a policy != the reference
    batch = _pair_batch(cfg)
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    in_step = losses.preference_loss(fn, "dpo", beta=0.5)
    pre = losses.preference_loss(fn, "dpo", reference="precomputed", beta=0.5)
    batch_ref = {**batch, "ref_logps": losses.precompute_reference(fn, qparams, batch)}
    grad = lambda loss, b: jax.jit(jax.value_and_grad(loss, has_aux=True))(  # noqa: E731
        adapters, b, frozen=qparams
    )
    got, want = grad(in_step, batch), grad(pre, batch_ref)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    dense_fn = functools.partial(
        preference.sequence_logprobs, config=cfg, levers=jmem.Levers(loss_chunk=0)
    )
    dense = grad(losses.preference_loss(dense_fn, "dpo", beta=0.5), batch)
    chex.assert_trees_all_close(got, dense, rtol=1e-4, atol=1e-6)
    assert float(got[0][0]) != pytest.approx(np.log(2.0))


@pytest.mark.slow
def test_train_step_raises_dpo_accuracy_and_splits_pairs():
    """train_step(has_aux) with the adapters-off reference: microbatches split whole pairs
    (2 microbatches == 1 on the first step), and a few steps on one toy batch raise the
    reward accuracy above 0.5 and lower the loss below ln 2."""
    cfg = small_config()
    qparams, adapters = _qlora_setup(cfg)
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    loss = losses.preference_loss(fn, "dpo", beta=0.5)
    batch = _pair_batch(cfg, n=4)
    first = {}
    for k in (1, 2):
        step = jmem.train_step(loss, optax.adam(3e-2), has_aux=True, microbatches=k)
        state = step.init(adapters, frozen=qparams)
        state, metrics = step(state, batch)
        first[k] = metrics["loss"]
    np.testing.assert_allclose(first[2], first[1], rtol=1e-5)
    for _ in range(5):
        state, metrics = step(state, batch)
    assert float(metrics["aux"]["rewards/accuracies"]) > 0.5
    assert float(metrics["loss"]) < np.log(2.0) - 0.05


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_train_full_params(objective):
    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg)
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    loss = losses.preference_loss(fn, objective, reference=None, beta=0.2)
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, _pair_batch(cfg))
    assert np.isfinite(float(value)) and set(_METRICS) <= set(metrics)
    assert float(optax.tree.norm(grads)) > 0


@pytest.mark.slow
def test_reference_tree_for_full_fine_tuning():
    """reference="tree": the frozen tree is the reference; at the start (policy == the
    reference) the loss is ln 2, and the gradient reaches the params only."""
    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg)
    fn = functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    loss = losses.preference_loss(fn, "dpo", reference="tree")
    (value, _), grads = jax.value_and_grad(loss, has_aux=True)(
        params, _pair_batch(cfg), frozen=params
    )
    np.testing.assert_allclose(float(value), np.log(2.0), rtol=1e-6)
    assert float(optax.tree.norm(grads)) > 0


@pytest.mark.slow
def test_builder_errors():
    fn = lambda p, rows: None  # noqa: E731
    with pytest.raises(ValueError, match="objective must be one of"):
        losses.preference_loss(fn, "kto")
    with pytest.raises(ValueError, match="ORPO and SimPO use no reference"):
        losses.preference_loss(fn, "orpo")
    with pytest.raises(ValueError, match=r"unknown \['gamma'\]"):
        losses.preference_loss(fn, "dpo", gamma=1.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        losses.preference_loss(fn, "simpo", reference=None, beta=-1.0)
    cfg = small_config()
    loss = losses.preference_loss(
        functools.partial(preference.sequence_logprobs, config=cfg, levers=LV16)
    )
    flat = {k: v[:, 0] for k, v in _pair_batch(cfg).items()}
    with pytest.raises(ValueError, match=r"must be \[B, 2, \.\.\.\]"):
        loss(None, flat, frozen=None)
    with pytest.raises(ValueError, match="needs the base params as frozen="):
        loss(None, _pair_batch(cfg))
    pre = losses.preference_loss(fn, "dpo", reference="precomputed")
    with pytest.raises(ValueError, match=r"needs batch\['ref_logps'\]"):
        pre(llama.init(jax.random.key(0), cfg), _pair_batch(cfg))


def _logits_shapes(hlo: str, v: int) -> list[str]:
    """Every array type in ``hlo`` whose last dimension is the vocabulary ``v``."""
    return sorted(set(re.findall(rf"\b(?:f32|bf16|f16)\[[0-9,]*,{v}\]", hlo)))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_compiled_gradient_holds_no_logits(objective):
    """The compiled QLoRA preference gradient (2 pairs x 2 answers x 40 tokens, vocabulary
    97) holds no [4, 40, 97] or [160, 97] array; its only vocabulary-wide arrays are the head
    and [16, 97] chunks. Dense logits (chunk 0) do hold them, so the check can fail."""
    v = 97
    cfg = small_config(vocab_size=v)
    qparams, adapters = _qlora_setup(cfg)
    batch = _pair_batch(cfg, n=2, s=40)
    hlos = {}
    for chunk in (16, 0):
        fn = functools.partial(
            preference.sequence_logprobs, config=cfg, levers=jmem.Levers(loss_chunk=chunk)
        )
        ref = "adapters_off" if objective == "dpo" else None
        loss = losses.preference_loss(fn, objective, reference=ref)
        f = jax.grad(lambda a, q, b: loss(a, b, frozen=q)[0])
        hlos[chunk] = jax.jit(f).lower(adapters, qparams, batch).compile().as_text()
    full = {f"f32[4,40,{v}]", f"f32[160,{v}]"}
    assert not full & set(_logits_shapes(hlos[16], v)), _logits_shapes(hlos[16], v)
    assert set(_logits_shapes(hlos[16], v)) <= {f"f32[16,{v}]", f"f32[64,{v}]"}
    assert full & set(_logits_shapes(hlos[0], v)), _logits_shapes(hlos[0], v)
