"""jmem.ops.linear_cross_entropy equals the dense loss (values and gradients) with masks,
softcap, tied heads, microbatch accumulation and NF4/LoRA heads, and never holds the
[B, S, V] logits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import ops
from jmem import qlora
from jmem.models import llama
from tests.helpers import small_config
from tests.helpers import token_batch

B, S, H, V = 2, 37, 16, 50
#: float32: the loss and gradients within 1e-5 relative (chunk sums are added in another
#: order); bfloat16 inputs: 1e-2 (logits accumulate in float32 either way).
RTOL = 1e-5


def _inputs(dtype=jnp.float32, mask_kind="float"):
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (B, S, H), dtype)
    head = (jax.random.normal(ks[1], (H, V)) / 4).astype(dtype)
    targets = jax.random.randint(ks[2], (B, S), 0, V)
    masks = {
        None: None,
        "bool": jax.random.bernoulli(ks[3], 0.7, (B, S)),
        "float": jax.random.uniform(ks[3], (B, S)) * (jax.random.uniform(ks[0], (B, S)) > 0.3),
    }
    return x, head, targets, masks[mask_kind]


def _dense(x, head, targets, mask, cap=None):
    logits = jnp.einsum("bsh,hv->bsv", x, head, preferred_element_type=jnp.float32)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return llama.cross_entropy(logits, targets, mask)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 8, 16, 74, 500])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_equals_dense_loss_and_gradients(chunk, mask_kind):
    x, head, targets, mask = _inputs(mask_kind=mask_kind)
    f = lambda x, h: ops.linear_cross_entropy(x, h, targets, mask, chunk=chunk)
    g = lambda x, h: _dense(x, h, targets, mask)
    got = jax.jit(jax.value_and_grad(f, (0, 1)))(x, head)
    want = jax.value_and_grad(g, (0, 1))(x, head)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_softcap_and_bfloat16():
    x, head, targets, mask = _inputs(jnp.bfloat16)
    f = lambda x, h: ops.linear_cross_entropy(x, h, targets, mask, chunk=16, logit_softcap=3.0)
    g = lambda x, h: _dense(x, h, targets, mask, cap=3.0)
    (lf, gf), (lg, gg) = (
        jax.value_and_grad(f, (0, 1))(x, head),
        jax.value_and_grad(g, (0, 1))(x, head),
    )
    assert lf.dtype == jnp.float32 and gf[0].dtype == jnp.bfloat16
    chex.assert_trees_all_close(lf, lg, rtol=1e-2)
    chex.assert_trees_all_close(
        jax.tree.map(lambda a: a.astype(jnp.float32), gf),
        jax.tree.map(lambda a: a.astype(jnp.float32), gg),
        atol=1e-3,
        rtol=1e-2,
    )


@pytest.mark.slow
def test_token_weighted_microbatches():
    """Accumulated over 2 microbatches (weighted by unmasked tokens), the gradient is the
    whole batch's: the chunked loss is a token mean as the dense one."""
    x, head, targets, mask = _inputs(mask_kind="bool")
    batch = {"x": x, "targets": targets, "mask": mask}
    loss = lambda h, b: ops.linear_cross_entropy(b["x"], h, b["targets"], b["mask"], chunk=8)
    grad_fn = lambda h, b: (jax.grad(loss)(h, b), None)
    accumulated, _ = jmem.accumulate_gradients(grad_fn, head, batch, 2)
    chex.assert_trees_all_close(accumulated, jax.grad(loss)(head, batch), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_chunked_equals_unchunked(tie):
    cfg = small_config(tie_embeddings=tie)
    params = llama.init(jax.random.key(0), cfg)
    batch = token_batch(cfg, seq_len=24)
    batch["mask"] = (batch["targets"] % 3 > 0).astype(jnp.int32)
    out = {
        c: jax.value_and_grad(
            lambda p, b: llama.loss_fn(p, b, cfg, levers=jmem.Levers(loss_chunk=c))
        )(params, batch)
        for c in (0, 10)
    }
    chex.assert_trees_all_close(out[10], out[0], rtol=1e-5, atol=1e-7)
    logits = llama.forward(params, batch["inputs"], cfg)
    ref = llama.cross_entropy(logits, batch["targets"], batch["mask"])
    chex.assert_trees_all_close(out[10][0], ref, rtol=1e-6)


@pytest.mark.slow
def test_qlora_nf4_head_stays_implicit():
    """An NF4-quantized, LoRA-adapted head under qlora.apply: chunked equals unchunked
    (loss and adapter gradients), and nothing materializes the head (no ImplicitWeightError)."""
    cfg = small_config()
    params = qlora.quantize_params(
        llama.init(jax.random.key(0), cfg), lambda p, x: p.endswith("kernel")
    )
    adapters = jmem.lora.init(
        jax.random.key(1), params, rank=4, modules=lambda p, x: "lm_head" in p or "q_proj" in p
    )
    assert any("lm_head" in k for k in adapters)
    batch = token_batch(cfg, seq_len=24)

    def run(chunk):
        lv = jmem.Levers(loss_chunk=chunk)
        f = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return jax.value_and_grad(lambda a: f(params, a, batch))(adapters)

    chex.assert_trees_all_close(run(10), run(0), rtol=1e-5, atol=1e-7)


def _temp(chunk: int, n: int = 4096, v: int = 32000) -> int:
    x = jax.ShapeDtypeStruct((1, n, 64), jnp.float32)
    head = jax.ShapeDtypeStruct((64, v), jnp.float32)
    t = jax.ShapeDtypeStruct((1, n), jnp.int32)
    f = lambda x, h, t: ops.linear_cross_entropy(x, h, t, chunk=chunk)
    lowered = jax.jit(jax.grad(f, (0, 1))).lower(x, head, t)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_never_holds_the_logits():
    """4,096 tokens x 32,000 vocabulary: float32 logits are 500 MiB (and their gradient);
    chunks of 256 keep the temporaries under 96 MiB (measured about 63 MiB on XLA:CPU)."""
    assert _temp(256) < 96 * 2**20 < 500 * 2**20 < _temp(0)


@pytest.mark.slow
def test_bfloat16_backward_holds_no_float32_head():
    """bfloat16 x and head: the backward pass multiplies a bfloat16 logits cotangent by the
    head, so XLA:CPU keeps no float32 copy of the head ([H, V] = 2 GiB for Llama-3.1-8B)."""
    h, v = 64, 1000
    x = jax.random.normal(jax.random.key(0), (1, 512, h), jnp.bfloat16)
    head = jax.random.normal(jax.random.key(1), (h, v), jnp.bfloat16)
    t = jax.random.randint(jax.random.key(2), (1, 512), 0, v)
    for chunk in (128, 0):  # chunked, and whole (chunk 0, or a chunk >= the tokens)
        f = lambda x: ops.linear_cross_entropy(x, head, t, chunk=chunk)
        hlo = jax.jit(jax.grad(f)).lower(x).compile().as_text()
        assert f"f32[{h},{v}]" not in hlo and f"f32[{v},{h}]" not in hlo, chunk


@pytest.mark.slow
def test_errors():
    x, head, targets, _ = _inputs()
    with pytest.raises(ValueError, match="chunk"):
        ops.linear_cross_entropy(x, head, targets, chunk=-1)
    with pytest.raises(ValueError, match="head"):
        ops.linear_cross_entropy(x, head.T, targets, chunk=8)
    with pytest.raises(ValueError, match="targets"):
        ops.linear_cross_entropy(x, head, targets[:, 1:], chunk=8)


@pytest.mark.slow
def test_tiled_mlp_equals_whole():
    """The token-chunked layer parts (``mlp_chunk``: norms, projections, RoPE, MLP; a
    partial last chunk) give the whole layer's loss and gradients."""
    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg)
    batch = token_batch(cfg, seq_len=24)
    out = {
        c: jax.jit(
            jax.value_and_grad(
                lambda p, b: llama.loss_fn(p, b, cfg, levers=jmem.Levers(token_chunk=c))
            )
        )(params, batch)
        for c in (0, 20)
    }
    chex.assert_trees_all_close(out[20], out[0], rtol=1e-5, atol=1e-7)


def test_chunked_loss_value_is_computed_before_its_backward_pass():
    """The chunked loss's cotangent passes through an optimization barrier with the forward
    value, so XLA cannot sink the value's scan to the end of the step (which kept the final
    hidden states live across the backward pass: one more ``[S, H]`` buffer at the peak of
    the 8B QLoRA step from 512k tokens on, h100_sxm compile)."""
    x = jnp.ones((1, 64, 8), jnp.float32)
    head = jnp.ones((8, 32), jnp.float32) / 8
    t = jnp.zeros((1, 64), jnp.int32)

    def f(x, head):
        return ops.linear_cross_entropy(x, head, t, chunk=16)

    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, head)
    barriers = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 1, jaxpr
    # the barrier joins the loss's forward value (a float32 scalar) with the cotangent
    assert all(v.aval.shape == () for v in barriers[0].invars)
    np.testing.assert_allclose(
        jax.grad(f)(x, head), jax.grad(lambda x: llama.cross_entropy(x @ head, t))(x), rtol=1e-6
    )
