"""jmem.decay_mask: decay projection matrices, never norms, biases or embeddings (by name)."""

import warnings

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem.models import llama

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _expected_llama(tied: bool) -> dict:
    want = {
        "embed": {"embedding": False},
        "layers": {name: {"kernel": True} for name in PROJ},
        "final_norm": {"scale": False},
    }
    want["layers"].update(attn_norm={"scale": False}, mlp_norm={"scale": False})
    if not tied:
        want["lm_head"] = {"kernel": True}
    return want


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_reference_llama_mask_by_name_not_ndim(tied):
    cfg = helpers.small_config(tie_embeddings=tied)
    params = llama.init(jax.random.key(0), cfg)
    mask = jmem.decay_mask(params)
    assert mask == _expected_llama(tied)
    # The stacked per-layer norm scales are 2-D: an ndim > 1 rule would decay them.
    assert params["layers"]["attn_norm"]["scale"].shape == (cfg.num_layers, cfg.hidden_size)
    assert jmem.decay_mask(llama.abstract_params(cfg)) == mask  # ShapeDtypeStructs too
    # Stacked q/k/v biases [L, out] (Qwen2 style) are 2-D too, and never decayed.
    params["layers"]["q_proj"]["bias"] = jnp.zeros((cfg.num_layers, 8))
    assert jmem.decay_mask(params)["layers"]["q_proj"] == {"kernel": True, "bias": False}


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_tx, as_function",
    [
        (lambda m: optax.adamw(0.1, weight_decay=0.5, mask=m), True),
        (lambda m: optax.adamw(0.1, weight_decay=0.5, mask=m), False),
        (lambda m: jmem.adamw_8bit(0.1, weight_decay=0.5, mask=m), False),
        (lambda m: jmem.adamw_4bit(0.1, weight_decay=0.5, mask=m), True),
    ],
    ids=["optax.adamw-function", "optax.adamw-tree", "adamw_8bit-tree", "adamw_4bit-function"],
)
def test_optimizers_decay_only_the_masked_params(make_tx, as_function):
    params = llama.init(jax.random.key(0), helpers.small_config())
    tx = make_tx(jmem.decay_mask if as_function else jmem.decay_mask(params))
    zeros = jax.tree.map(jnp.zeros_like, params)  # zero gradients: only decay moves params
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    mask = jmem.decay_mask(params)

    def check(m, p, n):
        if m:  # AdamW: p <- p - lr * wd * p
            np.testing.assert_allclose(n, p * (1 - 0.1 * 0.5), rtol=1e-6, atol=1e-8)
        else:
            np.testing.assert_array_equal(n, p)

    jax.tree.map(check, mask, params, new)


@pytest.mark.slow
def test_flax_linen_variables():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Embed(10, 8)(x)
            x = nn.LayerNorm()(x)
            x = nn.MultiHeadDotProductAttention(num_heads=2)(x)
            x = nn.RMSNorm()(x)
            return nn.Dense(4)(x)

    variables = Block().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
    attn = {k: {"kernel": True, "bias": False} for k in ("query", "key", "value", "out")}
    assert jmem.decay_mask(variables) == {
        "params": {
            "Embed_0": {"embedding": False},
            "LayerNorm_0": {"scale": False, "bias": False},
            "MultiHeadDotProductAttention_0": attn,
            "RMSNorm_0": {"scale": False},
            "Dense_0": {"kernel": True, "bias": False},
        }
    }


@pytest.mark.slow
def test_flax_nnx_state_works_with_optax():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 8, rngs=rngs)
            self.norm = nnx.RMSNorm(8, rngs=rngs)
            self.proj = nnx.Linear(8, 8, rngs=rngs)
            self.ln_f = nnx.LayerNorm(8, rngs=rngs)

    state = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
    mask = jmem.decay_mask(state)
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat == {
        "['embed']['embedding'].value": False,
        "['norm']['scale'].value": False,
        "['proj']['bias'].value": False,
        "['proj']['kernel'].value": True,
        "['ln_f']['bias'].value": False,
        "['ln_f']['scale'].value": False,
    }
    tx = optax.adamw(0.1, weight_decay=0.5, mask=mask)
    zeros = jax.tree.map(jnp.zeros_like, state)
    new = optax.apply_updates(state, tx.update(zeros, tx.init(state), state)[0])
    np.testing.assert_array_equal(new["norm"]["scale"][...], state["norm"]["scale"][...])
    np.testing.assert_allclose(
        new["proj"]["kernel"][...], 0.95 * state["proj"]["kernel"][...], rtol=1e-6
    )


@pytest.mark.slow
def test_lora_adapters_and_torch_style_names():
    params = llama.init(jax.random.key(0), helpers.small_config())
    adapters = jmem.lora.init(jax.random.key(1), params, rank=2)
    mask = jmem.decay_mask(adapters)
    assert set(mask) == {"layers/q_proj/kernel", "layers/v_proj/kernel"}
    for m in mask.values():
        assert isinstance(m, jmem.lora.LoraWeight) and m.a is True and m.b is True
    # The mask keeps every static field (scale, alpha, ...): optax needs the same treedef.
    assert jax.tree.structure(mask) == jax.tree.structure(adapters)
    tx = optax.adamw(0.1, weight_decay=0.5, mask=jmem.decay_mask)  # masks LoraWeight leaves
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    new = optax.apply_updates(adapters, tx.update(zeros, tx.init(adapters), adapters)[0])
    for key, w in adapters.items():
        np.testing.assert_allclose(new[key].a, 0.95 * w.a, rtol=1e-6)
    torch_style = {
        "model.embed_tokens.weight": jnp.zeros((4, 2)),
        "model.layers.0.input_layernorm.weight": jnp.ones((2,)),
        "model.layers.0.self_attn.q_proj.weight": jnp.zeros((2, 2)),
        "model.layers.0.self_attn.q_proj.lora_A.weight": jnp.zeros((1, 2)),
        "transformer.h.0.ln_1.weight": jnp.ones((2,)),
        "transformer.wte.weight": jnp.zeros((4, 2)),
        "lm_head.weight": jnp.zeros((4, 2)),
    }
    assert jmem.decay_mask(torch_style) == {
        "model.embed_tokens.weight": False,
        "model.layers.0.input_layernorm.weight": False,
        "model.layers.0.self_attn.q_proj.weight": True,
        "model.layers.0.self_attn.q_proj.lora_A.weight": True,
        "transformer.h.0.ln_1.weight": False,
        "transformer.wte.weight": False,
        "lm_head.weight": True,
    }


def test_unknown_names_are_a_clear_error_unless_a_default_is_given():
    params = {"block": {"proj": jnp.zeros((2, 2)), "kernel": jnp.zeros((2, 2))}}
    with pytest.raises(ValueError, match=r"\['block'\]\['proj'\].*default=True"):
        jmem.decay_mask(params)
    assert jmem.decay_mask(params, default=False) == {"block": {"proj": False, "kernel": True}}
    assert jmem.decay_mask({"step": jnp.zeros((), jnp.int32)}) == {"step": False}


def test_gpt_neox_output_head_and_ln_prefixed_matrices_are_decayed():
    """``embed_out`` (GPT-NeoX's output head) and ``lnproj`` (not a norm) are matrices;
    ``ln_f``/``ln1`` are norms."""
    tree = {
        "embed_out": {"weight": jnp.ones((4, 3))},
        "embed_in": {"weight": jnp.ones((4, 3))},
        "lnproj": {"kernel": jnp.ones((3, 3))},
        "ln_f": {"weight": jnp.ones((3,))},
        "ln1": {"weight": jnp.ones((3,))},
    }
    mask = jmem.decay_mask(tree)
    assert mask == {
        "embed_out": {"weight": True},
        "embed_in": {"weight": False},
        "lnproj": {"kernel": True},
        "ln_f": {"weight": False},
        "ln1": {"weight": False},
    }


_STACKED = {
    "embed": {"embedding": jnp.ones((16, 8))},
    "layers": {"attn_norm": {"scale": jnp.ones((2, 8))}, "q": {"kernel": jnp.ones((2, 8, 8))}},
    "head": {"kernel": jnp.ones((8, 16)), "bias": jnp.zeros(16)},
}


def _sum_loss(p, batch):
    return sum(jnp.sum(x) for x in jax.tree.leaves(p)) * batch["x"].mean()


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda m: optax.adamw(1e-3, mask=m),
        lambda m: jmem.adamw_8bit(1e-3, mask=m),
        lambda m: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, mask=m)),
        lambda m: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, mask=m),
        lambda m: optax.MultiSteps(optax.adamw(1e-3, mask=m), 2).gradient_transformation(),
    ],
    ids=["adamw", "adamw_8bit", "chain", "inject_hyperparams", "MultiSteps(cond)"],
)
def test_train_step_warns_once_when_decay_reaches_norms_or_biases(make, monkeypatch):
    """Weight decay > 0 without a mask on norm scales / biases warns once
    per process, naming them and mask=jmem.decay_mask; with the mask it is silent."""
    from jmem._src.train import decay_warning

    monkeypatch.setattr(decay_warning, "_warned", False)
    batch = {"x": jnp.ones((2,))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jmem.train_step(_sum_loss, make(jmem.decay_mask)).init(_STACKED)
    step = jmem.train_step(_sum_loss, make(None))
    with pytest.warns(UserWarning, match=r"attn_norm.*bias.*mask=jmem\.decay_mask") as record:
        state = step.init(_STACKED)
    assert "embed" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step.init(_STACKED)  # once per process
    step(state, batch)


@pytest.mark.slow
def test_no_decay_warning_for_adam_zero_decay_lamb_or_lora(monkeypatch):
    """No param-proportional update on norms: plain Adam, weight_decay=0, LAMB's trust ratio
    (a norm of the params), and LoRA adapters (never norms) stay silent."""
    from jmem._src.train import decay_warning

    monkeypatch.setattr(decay_warning, "_warned", False)
    ad = jmem.lora.init(jax.random.key(0), _STACKED, modules=r"layers/q/kernel")
    cases = [
        (optax.adam(1e-3), _STACKED),
        (optax.adamw(1e-3, weight_decay=0.0), _STACKED),
        (jmem.adamw_8bit(1e-3, weight_decay=0.0), _STACKED),
        (optax.lamb(1e-3), _STACKED),
        (jmem.adamw_8bit(1e-3), ad),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for opt, p in cases:
            jmem.train_step(_sum_loss, opt).init(p)
