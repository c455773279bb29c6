"""Reference Llama: shapes, parameter counts, GQA, tied embeddings, checkpoint names."""

import jax
import jax.numpy as jnp
import pytest

from jmem.models import llama


def test_config_param_counts_match_published_sizes():
    assert abs(llama.num_params(llama.get_config("llama2_7b")) - 6.738e9) < 0.001e9
    assert abs(llama.num_params(llama.get_config("llama3_8b")) - 8.030e9) < 0.001e9
    assert 1.0e9 < llama.num_params(llama.get_config("llama_1b")) < 1.2e9
    assert llama.num_params(llama.get_config("tiny")) < 5e6


def test_forward_shapes_and_dtype_follow_params():
    cfg = llama.get_config("tiny", num_layers=2)
    p = llama.init(jax.random.key(0), cfg, jnp.bfloat16)
    logits = llama.forward(p, jnp.zeros((2, 16), jnp.int32), cfg)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    assert jax.tree.structure(p) == jax.tree.structure(llama.abstract_params(cfg))


def test_causality():
    cfg = llama.get_config("tiny", num_layers=2)
    p = llama.init(jax.random.key(0), cfg)
    a = jnp.arange(16, dtype=jnp.int32)[None]
    b = a.at[0, 10].set(99)
    la, lb = llama.forward(p, a, cfg), llama.forward(p, b, cfg)
    assert jnp.allclose(la[:, :10], lb[:, :10]) and not jnp.allclose(la[:, 10:], lb[:, 10:])


def test_tied_embeddings_have_no_head():
    cfg = llama.get_config("tiny", tie_embeddings=True, num_layers=1)
    p = llama.init(jax.random.key(0), cfg)
    assert "lm_head" not in p
    assert llama.forward(p, jnp.zeros((1, 4), jnp.int32), cfg).shape == (1, 4, 256)


def test_checkpoint_names_are_visible_to_policies():
    cfg = llama.get_config("tiny", num_layers=1)
    p = llama.init(jax.random.key(0), cfg)
    batch = {"inputs": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32)}
    jaxpr = str(jax.make_jaxpr(lambda p: llama.loss_fn(p, batch, cfg))(p))
    for name in llama.CHECKPOINT_NAMES:
        assert f"name={name}" in jaxpr, name


def test_bad_inputs():
    with pytest.raises(ValueError, match="Unknown model config"):
        llama.get_config("gpt5")
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama.LlamaConfig(num_heads=32, num_kv_heads=5)
    cfg = llama.get_config("tiny", num_layers=1)
    with pytest.raises(ValueError, match="integer"):
        llama.forward(llama.init(jax.random.key(0), cfg), jnp.zeros((2, 4)), cfg)
