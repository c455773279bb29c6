"""Arguments checked at the call: each malformed value raises a
ValueError naming the argument instead of a silent wrong result or JAX's own error deep
inside; negative targets (PyTorch's ignore_index=-100) are ignored, never trained on."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import ops
from jmem import planner
from jmem._src.train.accumulation import mask_count
from jmem.models import llama


def _qkv(s=8):
    q = jax.random.normal(jax.random.key(0), (1, s, 4, 8))
    k = v = jax.random.normal(jax.random.key(1), (1, s, 2, 8))
    return q, k, v


@pytest.mark.slow
@pytest.mark.parametrize("cap", [0.0, -1.0, "1"])
def test_attention_refuses_a_softcap_that_is_not_positive(cap):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="logit_softcap"):
        ops.attention(q, k, v, q_index=jnp.arange(8), logit_softcap=cap)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["block_q", "block_kv"])
@pytest.mark.parametrize("value", [0, -4, 2.0, True])
def test_attention_refuses_a_bad_block_size(name, value):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=name):
        ops.attention(q, k, v, q_index=jnp.arange(8), implementation="blockwise", **{name: value})


@pytest.mark.parametrize("value", [2.0, "2", True])
def test_train_step_refuses_non_int_microbatches(value):
    with pytest.raises(ValueError, match="microbatches"):
        jmem.train_step(lambda p, b: jnp.sum(p), optax.sgd(0.1), microbatches=value)


@pytest.mark.parametrize("alpha", [0, 0.0, -8, None])
def test_lora_refuses_alpha_that_cannot_learn(alpha):
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match="alpha"):
        jmem.lora.init(jax.random.key(0), params, rank=2, alpha=alpha, modules=".*")


@pytest.mark.parametrize("memory", ["1e400GB", float("inf"), float("nan"), "-3GB"])
def test_memory_sizes_are_finite_and_positive(memory):
    with pytest.raises(ValueError, match="memory"):
        planner.parse_memory(memory)


@pytest.mark.slow
def test_negative_targets_are_ignored_as_masked():
    """-100 targets (and any negative id) weigh 0: the loss equals the one with those
    tokens masked out, chunked or not, and so do the gradients."""
    x = jax.random.normal(jax.random.key(0), (2, 12, 16))
    head = jax.random.normal(jax.random.key(1), (16, 50)) / 4
    targets = jax.random.randint(jax.random.key(2), (2, 12), 0, 50)
    ignored = jnp.zeros((2, 12), bool).at[0, :5].set(True).at[1, -1].set(True)
    padded = jnp.where(ignored, -100, targets)
    mask = (~ignored).astype(jnp.int32)
    for chunk in (0, 5):
        loss = lambda x, t, m=None: ops.linear_cross_entropy(x, head, t, m, chunk=chunk)  # noqa: B023
        want = jax.value_and_grad(loss)(x, targets, mask)
        chex.assert_trees_all_close(jax.value_and_grad(loss)(x, padded), want, rtol=1e-6)
        both = jax.value_and_grad(loss)(x, padded, jnp.ones_like(mask))
        chex.assert_trees_all_close(both, want, rtol=1e-6)
    dense = llama.cross_entropy(x @ head, padded)
    chex.assert_trees_all_close(dense, want[0], rtol=1e-5)


def test_accumulation_weights_count_only_trained_tokens():
    batch = {"targets": jnp.asarray([[1, -100, 2, -100]]), "mask": jnp.ones((1, 4))}
    assert float(mask_count(batch)) == 2.0
    np.testing.assert_equal(float(mask_count({"mask": jnp.ones((1, 4))})), 4.0)
