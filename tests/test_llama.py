"""Reference Llama: shapes, parameter counts, GQA, tied embeddings, checkpoint names."""

import functools

import chex
import helpers
import jax
import jax.numpy as jnp
import pytest

import jmem
from jmem import lora
from jmem import qlora
from jmem.models import llama


def test_config_param_counts_match_published_sizes():
    assert abs(llama.num_params(llama.get_config("llama2_7b")) - 6.738e9) < 0.001e9
    assert abs(llama.num_params(llama.get_config("llama3_8b")) - 8.030e9) < 0.001e9
    assert 1.0e9 < llama.num_params(llama.get_config("llama_1b")) < 1.2e9
    assert llama.num_params(llama.get_config("tiny")) < 5e6
    # exact published counts (model cards / safetensors index totals)
    assert llama.num_params(llama.get_config("llama3_2_1b")) == 1_235_814_400
    assert llama.num_params(llama.get_config("mistral_7b")) == 7_241_732_096
    assert llama.num_params(llama.get_config("qwen2_5_7b")) == 7_615_616_512
    # the safetensors index totals (bf16 bytes / 2) of Llama-3.1-70B and Qwen2.5-72B
    assert llama.num_params(llama.get_config("llama3_1_70b")) == 70_553_706_496
    assert llama.num_params(llama.get_config("qwen2_5_72b")) == 72_706_203_648
    assert llama.get_config("llama3_1_8b").rope_scaling.rope_type == "llama3"
    hash(llama.get_config("qwen2_5_7b"))  # a static jit argument


@functools.cache
def _params(dtype=jnp.float32, **overrides):
    """Tiny one-layer params, initialised once per dtype/config under one jit."""
    cfg = llama.get_config("tiny", **{"num_layers": 1, **overrides})
    return jax.jit(llama.init, static_argnums=(1, 2))(jax.random.key(0), cfg, dtype), cfg


class ForwardTest(chex.TestCase):
    """Properties of ``llama.forward`` that hold with and without jit."""

    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_shapes_and_dtype_follow_params(self):
        p, cfg = _params(jnp.bfloat16)
        logits = self.variant(lambda p, t: llama.forward(p, t, cfg))(
            p, jnp.zeros((2, 16), jnp.int32)
        )
        chex.assert_shape(logits, (2, 16, cfg.vocab_size))
        chex.assert_type(logits, jnp.float32)
        assert jax.tree.structure(p) == jax.tree.structure(llama.abstract_params(cfg))

    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_causality(self):
        p, cfg = _params()
        forward = self.variant(lambda p, t: llama.forward(p, t, cfg))
        a = jnp.arange(16, dtype=jnp.int32)[None]
        la, lb = forward(p, a), forward(p, a.at[0, 10].set(99))
        chex.assert_trees_all_close(la[:, :10], lb[:, :10], rtol=1e-5, atol=1e-5)
        assert not jnp.allclose(la[:, 10:], lb[:, 10:])

    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_tied_embeddings_have_no_head(self):
        p, cfg = _params(tie_embeddings=True)
        assert "lm_head" not in p
        logits = self.variant(lambda p, t: llama.forward(p, t, cfg))(
            p, jnp.zeros((1, 4), jnp.int32)
        )
        chex.assert_shape(logits, (1, 4, 256))


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{}, {"norm_placement": "sandwich", "qk_norm": "head"}, {"num_experts": 4, "qk_norm": "head"}],
)
def test_checkpoint_names_are_visible_to_policies(options):
    """Every name of CHECKPOINT_NAMES tags its intermediate (Gemma 3's sandwich norms and
    QK-norms included); Llama has all but those and the routed experts' (a mixture of
    experts has those instead of the dense MLP's)."""
    cfg = llama.get_config("tiny", num_layers=1, **options)
    p = llama.init(jax.random.key(0), cfg)
    batch = {"inputs": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32)}
    jaxpr = str(jax.make_jaxpr(lambda p: llama.loss_fn(p, batch, cfg))(p))
    absent = {"q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"} - {
        n for n in ("q_norm", "k_norm") if cfg.qk_norm
    }
    absent -= {"post_attn_norm", "post_mlp_norm"} if cfg.norm_placement != "pre" else set()
    moe_names = {"router_logits", "expert_gate", "expert_up", "expert_hidden", "expert_down"}
    absent |= {"mlp_gate", "mlp_up", "mlp_hidden", "mlp_down"} if cfg.num_experts else moe_names
    for name in llama.CHECKPOINT_NAMES:
        assert (f"name={name}" in jaxpr) == (name not in absent), name


@pytest.mark.slow
def test_bad_inputs():
    with pytest.raises(ValueError, match="Unknown model config"):
        llama.get_config("gpt5")
    with pytest.raises(ValueError, match="num_kv_heads"):
        llama.LlamaConfig(num_heads=32, num_kv_heads=5)
    cfg = llama.get_config("tiny", num_layers=1)
    with pytest.raises(ValueError, match="integer"):
        llama.forward(llama.init(jax.random.key(0), cfg), jnp.zeros((2, 4)), cfg)


class PackingTest(chex.TestCase):
    """Packed rows (``segment_ids`` + ``positions``) give each example its logits alone."""

    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_packed_example_equals_example_alone(self):
        p, cfg = _params(num_layers=2)
        first = jax.random.randint(jax.random.key(1), (1, 5), 0, 256, jnp.int32)
        second = jax.random.randint(jax.random.key(2), (1, 7), 0, 256, jnp.int32)
        packed = jnp.concatenate([first, second], axis=1)
        segment_ids = jnp.array([[1] * 5 + [2] * 7], jnp.int32)
        positions = jnp.array([list(range(5)) + list(range(7))], jnp.int32)
        forward = self.variant(
            lambda p, t, pos, seg: llama.forward(p, t, cfg, positions=pos, segment_ids=seg)
        )
        got = forward(p, packed, positions, segment_ids)
        alone = self.variant(lambda p, t: llama.forward(p, t, cfg))
        chex.assert_trees_all_close(got[:, 5:], alone(p, second), atol=1e-5, rtol=0)
        chex.assert_trees_all_close(got[:, :5], alone(p, first), atol=1e-5, rtol=0)
        # without the segment ids the second example sees the first: the test can fail
        leaky = forward(p, packed, positions, jnp.ones_like(segment_ids))
        assert float(jnp.max(jnp.abs(leaky[:, 5:] - alone(p, second)))) > 1e-3


@pytest.mark.slow
def test_loss_fn_reads_positions_and_segment_ids():
    p, cfg = _params(num_layers=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 13), 0, 256, jnp.int32)
    seg = jnp.array([[1] * 6 + [2] * 6, [1] * 12], jnp.int32)
    pos = jnp.array([list(range(6)) * 2, list(range(12))], jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": pos}
    ref = llama.cross_entropy(
        llama.forward(p, batch["inputs"], cfg, positions=pos, segment_ids=seg), batch["targets"]
    )
    chex.assert_trees_all_close(llama.loss_fn(p, {**batch, "segment_ids": seg}, cfg), ref)
    assert abs(float(llama.loss_fn(p, batch, cfg)) - float(ref)) > 1e-6


@pytest.mark.slow
def test_attention_mask():
    m = llama.attention_mask(
        jnp.arange(5), segment_ids=jnp.array([[1, 1, 2, 2, 2]]), sliding_window=2
    )
    expect = jnp.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        bool,
    )
    chex.assert_trees_all_equal(m, expect[None])
    with pytest.raises(ValueError, match="positions"):
        p, cfg = _params()
        llama.forward(p, jnp.zeros((1, 4), jnp.int32), cfg, positions=jnp.zeros((1, 3), jnp.int32))


def _greedy_by_forward(forward, prompt, n):
    out = prompt
    for _ in range(n):
        nxt = jnp.argmax(forward(out)[:, -1], axis=-1).astype(jnp.int32)
        out = jnp.concatenate([out, nxt[:, None]], axis=1)
    return out


@pytest.mark.slow
def test_generate_with_kv_cache_equals_greedy_full_forward():
    cfg = llama.get_config(
        "tiny", num_layers=2, sliding_window=5, biases=("q_proj", "v_proj"), hidden_act="gelu"
    )
    p = llama.init(jax.random.key(0), cfg)
    p["layers"]["q_proj"]["bias"] = 0.1 * jax.random.normal(jax.random.key(1), (2, 256))
    prompt = jax.random.randint(jax.random.key(2), (2, 7), 0, 256, jnp.int32)
    got = llama.generate(p, prompt, cfg, max_new_tokens=6)
    chex.assert_shape(got, (2, 13))
    chex.assert_type(got, jnp.int32)
    ref = _greedy_by_forward(lambda t: llama.forward(p, t, cfg), prompt, 6)
    chex.assert_trees_all_equal(got, ref)
    sampled = llama.generate(
        p, prompt, cfg, max_new_tokens=6, temperature=1.0, top_p=0.9, key=jax.random.key(3)
    )
    chex.assert_trees_all_equal(sampled[:, :7], prompt)
    with pytest.raises(ValueError, match="key"):
        llama.generate(p, prompt, cfg, max_new_tokens=2, temperature=1.0)


@pytest.mark.slow
def test_generate_on_nf4_base_with_adapters():
    cfg = llama.get_config("tiny", num_layers=2)
    dense = llama.init(jax.random.key(0), cfg)
    q = qlora.quantize_params(dense)
    ad = lora.init(jax.random.key(1), q, rank=4, modules=".*(q_proj|v_proj|down_proj).*")
    ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), ad)
    merged = lora.merge(qlora.dequantize_params(q), ad)
    prompt = jax.random.randint(jax.random.key(3), (1, 5), 0, 256, jnp.int32)
    got = llama.generate(q, prompt, cfg, max_new_tokens=5, adapters=ad, apply=qlora.apply)
    ref = _greedy_by_forward(lambda t: llama.forward(merged, t, cfg), prompt, 5)
    chex.assert_trees_all_equal(got, ref)
    # the adapters change the output: a generate that ignored them would fail above
    base = llama.generate(qlora.dequantize_params(q), prompt, cfg, max_new_tokens=5)
    assert not jnp.array_equal(base, ref)


def test_generate_refuses_token_ids_outside_the_vocabulary():
    """A prompt id >= vocab_size (or < 0) would be clamped or wrapped by the embedding
    lookup and decode garbage; ``generate`` names the ids instead."""
    config = helpers.small_config()
    params = llama.abstract_params(config)
    prompt = jnp.asarray([[1, config.vocab_size + 3], [-5, 2]], jnp.int32)
    with pytest.raises(ValueError, match=r"outside \[0, .*-5, .*tokenizer"):
        llama.generate(params, prompt, config, max_new_tokens=2)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"norm_placement": "middle"}, "norm_placement='middle'"),
        ({"qk_norm": "layer"}, "qk_norm='layer'"),
        ({"attn_logit_softcap": 0.0}, "attn_logit_softcap must be None or > 0"),
        ({"layer_types": ("full_attention",)}, "num_layers=2 entries"),
        ({"layer_types": ("full_attention", "local")}, r"unknown \['local'\]"),
        ({"layer_types": ("full_attention", "sliding_attention")}, "set sliding_window"),
        ({"biases": ("q_proj",), "fused_projections": True}, r"biases \['q_proj'\]"),
    ],
)
def test_family_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        llama.get_config("tiny", num_layers=2, **options)


@pytest.mark.slow
def test_family_weights_follow_the_options():
    """Which leaves a layer has: sandwich norms, QK-norms per head or per projection, fused
    kernels (Phi-3), and no pre-norms with post placement (OLMo 2)."""
    c = llama.get_config("tiny", num_layers=2, norm_placement="sandwich", qk_norm="head")
    layers = llama.param_shapes(c)["layers"]
    assert layers["post_mlp_norm"]["scale"] == (2, 256) and layers["q_norm"]["scale"] == (2, 32)
    c = llama.get_config("tiny", num_layers=2, norm_placement="post", qk_norm="proj")
    layers = llama.param_shapes(c)["layers"]
    assert "attn_norm" not in layers and layers["k_norm"]["scale"] == (2, 4 * 32)
    c = llama.get_config("tiny", num_layers=2, fused_projections=True)
    layers = llama.param_shapes(c)["layers"]
    assert sorted(n for n in layers if n.endswith("proj")) == sorted(llama.FUSED_LINEAR_NAMES)
    assert layers["qkv_proj"]["kernel"] == (2, 256, (8 + 2 * 4) * 32)
    p = llama.init(jax.random.key(0), llama.get_config(c, norm_offset=1.0))
    assert float(jnp.abs(p["layers"]["attn_norm"]["scale"]).max()) == 0.0  # 1 + w = 1


class ScanUnrollTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_inlined_layers_equal_the_layer_loop(self):
        """``Levers(scan_unroll=True)`` inlines every layer (no ``while`` over layers in the
        compiled step, so no stacked residuals without remat) and computes the same loss
        and gradients (float32, 1e-6)."""
        cfg = helpers.small_config()
        inlined, loop = jmem.Levers(scan_unroll=True), jmem.Levers(scan_unroll=1)
        params = llama.init(jax.random.key(0), cfg)
        batch = helpers.token_batch(cfg, 2, 16, seed=1)
        grad = lambda lv: jax.value_and_grad(  # noqa: E731
            lambda p: llama.loss_fn(p, batch, cfg, levers=lv)
        )
        ref = grad(loop)(params)
        got = self.variant(grad(inlined))(params)
        chex.assert_trees_all_close(got, ref, atol=1e-6, rtol=1e-6)
        hlo = jax.jit(grad(inlined)).lower(params).compile().as_text()
        loops = jax.jit(grad(loop)).lower(params).compile().as_text()
        assert " while(" in loops and " while(" not in hlo


def test_scan_unroll_must_be_true_or_a_positive_int():
    for bad in (0, -1, 1.5, "yes", False):
        with pytest.raises(ValueError, match="scan_unroll"):
            jmem.Levers(scan_unroll=bad)
