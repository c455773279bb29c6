"""Token-local parts of a layer over chunks of tokens (``jmem._src.token_chunks``,
``LlamaConfig.mlp_chunk``): the same values and gradients as whole, and fewer temporaries."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized

import jmem
from jmem import qlora
from jmem._src.token_chunks import over_tokens
from jmem.models import llama
from tests.helpers import small_config
from tests.helpers import token_batch


def _local(w, x, y):
    """A token-local function with a weight: a norm, a projection and a gated product."""
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return jnp.tanh(h @ w) * y, (h @ w)[..., :3]


class OverTokensTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((jnp.float32, 1e-6), (jnp.bfloat16, 2**-6))
    @pytest.mark.slow
    def test_equals_whole(self, dtype, tol):
        """Outputs and gradients (weight and inputs) of ``over_tokens`` with a partial last
        chunk over two rows equal the whole function's: float32 to 1e-6, bfloat16 to 2^-6
        relative, two bf16 ulps (a bf16 weight's gradient is rounded per chunk and summed
        over the chunks in bf16; the whole matmul rounds once)."""
        k = jax.random.split(jax.random.key(0), 3)
        w = jax.random.normal(k[0], (8, 8), dtype) / 3
        x = jax.random.normal(k[1], (2, 13, 8), dtype)
        y = jax.random.normal(k[2], (2, 13, 8), dtype)

        def loss(w, x, y, chunk):
            f = lambda x, y: _local(w, x, y)
            out = over_tokens(f, chunk, x, y) if chunk else f(x, y)
            return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in out), out

        grad = self.variant(jax.grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)
        chunked, whole = grad(w, x, y, 5), grad(w, x, y, 0)
        chex.assert_trees_all_equal_shapes_and_dtypes(chunked, whole)
        chex.assert_trees_all_close(chunked, whole, rtol=tol, atol=tol)

    def test_one_chunk_is_the_plain_function(self):
        """At most ``chunk`` tokens: ``fn`` itself, no loop in the jaxpr."""
        w, x = jnp.ones((8, 8)), jnp.ones((2, 4, 8))
        jaxpr = jax.make_jaxpr(lambda x: over_tokens(lambda a, b: _local(w, a, b), 8, x, x))(x)
        assert not any(e.primitive.name in ("while", "scan") for e in jaxpr.jaxpr.eqns)

    def test_errors(self):
        x = jnp.ones((2, 4, 8))
        with self.assertRaisesRegex(ValueError, "chunk must be an int >= 1"):
            over_tokens(lambda a: (a,), 0, x)
        with self.assertRaisesRegex(ValueError, r"share their \[B, S\]"):
            over_tokens(lambda a, b: (a,), 2, x, x[:, :3])


def test_no_whole_array_work_per_chunk():
    """bf16 chunks are read, written and their cotangents placed as uint16 bits in place:
    the compiled gradient has no float dynamic-update-slice or add over a whole
    ``[S, H]`` array (XLA:CPU converts a bf16 one to float32 whole, per chunk; a scan's
    transpose adds a whole-sized cotangent per chunk for a closed-over input)."""
    w = jnp.ones((64, 64), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, 4096, 64), jnp.bfloat16)

    def loss(w, x, y):
        out = over_tokens(lambda a, b: _local(w, a, b), 512, x, y)
        return sum(jnp.sum(o.astype(jnp.float32)) for o in out)

    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(w, x, x).compile().as_text()
    whole = re.compile(r"= (f32|bf16)\[(1,)?4096,64\]\S* (dynamic-update-slice|add)\(")
    assert not [line for line in hlo.splitlines() if whole.search(line)]


_FAMILIES = {
    "llama": {},
    "gemma3": dict(norm_placement="sandwich", qk_norm="head", norm_offset=1.0),
    "olmo2": dict(norm_placement="post", qk_norm="proj"),
    "phi3": dict(fused_projections=True),
    "qwen2": dict(biases=("q_proj", "k_proj", "v_proj")),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_model_chunks_equal_whole(family, dtype, tol):
    """The model's loss and gradients with its token-local parts in chunks of 20 tokens
    (a partial last one over two rows of 24) equal the whole layer's, for each layer
    structure; float32 to 1e-5, bfloat16 to 2e-2 (relative and absolute)."""
    cfg = small_config(**_FAMILIES[family])
    params = llama.init(jax.random.key(0), cfg, dtype)
    batch = token_batch(cfg, seq_len=24)
    grad = jax.jit(
        jax.value_and_grad(lambda p, b, lv: llama.loss_fn(p, b, cfg, levers=lv)),
        static_argnums=2,
    )
    out = {c: grad(params, batch, jmem.Levers(token_chunk=c)) for c in (0, 20)}
    chex.assert_trees_all_close(out[20], out[0], rtol=tol, atol=tol)


@pytest.mark.slow
def test_qlora_chunks_equal_whole():
    """Under the NF4/LoRA interpreter (the chunks' custom VJPs see activations only, never a
    weight) the adapters' gradients with chunks equal those without, in float32."""
    cfg = small_config()
    params = llama.init(jax.random.key(0), cfg)
    frozen = qlora.quantize_params(params)
    adapters = jmem.lora.init(jax.random.key(1), frozen, rank=4)
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # B != 0: every path counts
    batch = token_batch(cfg, seq_len=24)

    def loss(adapters, c):
        lv = jmem.Levers(token_chunk=c)
        f = qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv))
        return f(frozen, adapters, batch)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    chex.assert_trees_all_close(grad(adapters, 20), grad(adapters, 0), rtol=1e-5, atol=1e-7)


def _temp_bytes(chunk: int, seq: int = 4096, hidden: int = 256) -> float:
    """Compiled temporaries of the full-remat bf16 gradient, in float32 ``[S, H]`` units."""
    cfg = llama.get_config(
        "tiny",
        num_layers=2,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=64,
    )
    lv = jmem.Levers(attention="blockwise", token_chunk=chunk)
    params = llama.abstract_params(cfg, jnp.bfloat16)
    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    f = jmem.remat(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv), "full")
    compiled = jax.jit(jax.grad(f)).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (seq * hidden * 4)


@pytest.mark.slow
def test_chunked_layer_temporaries():
    """At 4,096 tokens the full-remat bf16 gradient of a 2-layer model holds under 12 float32
    ``[S, H]`` of temporaries with its token-local parts in 1,024-token chunks (10.6
    measured on XLA:CPU; 14.7 when only the MLP was chunked, with a ``lax.scan`` whose
    bf16 inputs XLA:CPU copied to float32; 23.0 whole)."""
    assert _temp_bytes(1024) < 12
