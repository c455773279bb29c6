"""jmem.ops.sequence_logprobs equals the dense log-softmax-gather (values and gradients) with
masks, padding targets, soft-caps, tied and NF4/LoRA heads, never holds the [B, S, V]
logits, and equals transformers' log-probs on tiny checkpoints."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmem
from jmem import ops
from jmem import qlora
from jmem.models import llama
from jmem.models import preference
from tests import test_linear_cross_entropy as lce
from tests.helpers import small_config

B, S, H, V = lce.B, lce.S, lce.H, lce.V


def _inputs(dtype=jnp.float32, mask_kind="float"):
    """``test_linear_cross_entropy``'s inputs, with masked targets set to padding ids (as
    Hugging Face's -100)."""
    x, head, targets, mask = lce._inputs(dtype, mask_kind)
    if mask is not None:
        targets = jnp.where(mask != 0, targets, -100)
    return x, head, targets, mask


def _dense(x, head, targets, mask, cap=None):
    """The reference: dense float32 logits, log-softmax, gather, masked sums."""
    logits = jnp.einsum("bsh,hv->bsv", x, head, preferred_element_type=jnp.float32)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    w = jnp.ones(targets.shape) if mask is None else mask.astype(jnp.float32)
    safe = jnp.where(w != 0, targets, 0)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), safe[..., None], axis=-1)[..., 0]
    total, count = jnp.sum(logp * w, axis=1), jnp.sum(w, axis=1)
    return total, total / jnp.maximum(count, 1.0), count


def _as_tuple(out):
    return (out.sum, out.mean, out.count)


def _objective(out):
    """A scalar that weighs sum and mean differently, so both gradients are checked."""
    return jnp.sum(out[0] * jnp.arange(1.0, B + 1)) + 3.0 * jnp.sum(out[1])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 8, 16, 87, 500])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_equals_dense_values_and_gradients(chunk, mask_kind):
    x, head, targets, mask = _inputs(mask_kind=mask_kind)
    f = lambda x, h: _as_tuple(ops.sequence_logprobs(x, h, targets, mask, chunk=chunk))
    g = lambda x, h: _dense(x, h, targets, mask)
    chex.assert_trees_all_close(jax.jit(f)(x, head), g(x, head), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda x, h: _objective(f(x, h)), (0, 1)))(x, head)
    want = jax.grad(lambda x, h: _objective(g(x, h)), (0, 1))(x, head)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_softcap_and_bfloat16():
    x, head, targets, mask = _inputs(jnp.bfloat16)
    f = lambda x, h: _as_tuple(
        ops.sequence_logprobs(x, h, targets, mask, chunk=16, logit_softcap=3.0)
    )
    g = lambda x, h: _dense(x, h, targets, mask, cap=3.0)
    out = f(x, head)
    assert all(o.dtype == jnp.float32 and o.shape == (B,) for o in out)
    chex.assert_trees_all_close(out, g(x, head), rtol=1e-2, atol=1e-2)
    gf = jax.grad(lambda x, h: _objective(f(x, h)), (0, 1))(x, head)
    gg = jax.grad(lambda x, h: _objective(g(x, h)), (0, 1))(x, head)
    assert gf[0].dtype == jnp.bfloat16
    to32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(to32(gf), to32(gg), atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_tied_model_head_equals_forward():
    """The tied reference Llama (head = embedding.T): hidden states times the head equals
    llama.forward's log-softmax-gather, values and gradients w.r.t. every param."""
    cfg = small_config(tie_embeddings=True)
    params = llama.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, cfg.vocab_size)
    mask = (jnp.arange(12) >= 5) * jnp.ones((2, 12), jnp.int32)
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "completion_mask": mask}

    def dense(p):
        logp = jax.nn.log_softmax(llama.forward(p, rows["inputs"], cfg))
        picked = jnp.take_along_axis(logp, rows["targets"][..., None], axis=-1)[..., 0]
        return jnp.sum(picked * mask, axis=1)

    lv = jmem.Levers(loss_chunk=8)
    chunked = lambda p: preference.sequence_logprobs(p, rows, cfg, levers=lv).sum  # noqa: E731
    chex.assert_trees_all_close(chunked(params), dense(params), rtol=1e-5)
    obj = lambda f: lambda p: jnp.sum(f(p) * jnp.array([1.0, -2.0]))  # noqa: E731
    chex.assert_trees_all_close(
        jax.grad(obj(chunked))(params), jax.grad(obj(dense))(params), rtol=1e-4, atol=1e-6
    )


@pytest.mark.slow
def test_qlora_nf4_head_stays_implicit():
    """An NF4, LoRA-adapted head under qlora.apply: chunked equals unchunked (values and
    adapter gradients) and nothing materializes the head (no ImplicitWeightError)."""
    x, head, targets, mask = _inputs(mask_kind="bool")
    params = qlora.quantize_params({"head": head}, lambda p, leaf: True, block_size=32)
    adapters = jmem.lora.init(jax.random.key(1), params, rank=4, modules=lambda p, leaf: True)
    noise = lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape)  # noqa: E731
    adapters = jax.tree.map(noise, adapters)  # random B != 0: the adapter acts

    def run(chunk):
        f = lambda p: _as_tuple(ops.sequence_logprobs(x, p["head"], targets, mask, chunk=chunk))
        fq = qlora.apply(f)
        return jax.value_and_grad(lambda a: _objective(fq(params, a)))(adapters)

    chex.assert_trees_all_close(run(8), run(0), rtol=1e-5, atol=1e-6)


def _temp_bytes(chunk: int, n: int = 4096, v: int = 32000) -> int:
    x = jax.ShapeDtypeStruct((2, n // 2, 64), jnp.float32)
    head = jax.ShapeDtypeStruct((64, v), jnp.float32)
    t = jax.ShapeDtypeStruct((2, n // 2), jnp.int32)
    f = lambda x, h, t: jnp.sum(ops.sequence_logprobs(x, h, t, chunk=chunk).sum)
    return jmem.measure(jax.grad(f, (0, 1)), x, head, t).temp_bytes


def test_never_holds_the_logits():
    """4,096 tokens x 32,000 vocabulary: float32 logits are 500 MiB; chunks of 256 keep the
    gradient's temporaries under 96 MiB, while the dense computation exceeds the logits."""
    assert _temp_bytes(256) < 96 * 2**20 < 500 * 2**20 < _temp_bytes(0)


@pytest.mark.slow
def test_errors():
    x, head, targets, mask = _inputs()
    with pytest.raises(ValueError, match=r"hidden \[B, S, H\] and head \[H, V\]"):
        ops.sequence_logprobs(x, head.T, targets, chunk=8)
    with pytest.raises(ValueError, match="targets must be an integer"):
        ops.sequence_logprobs(x, head, targets.astype(jnp.float32), chunk=8)
    with pytest.raises(ValueError, match="mask must be"):
        ops.sequence_logprobs(x, head, targets, mask[:, :-1], chunk=8)
    with pytest.raises(ValueError, match="chunk must be an int"):
        ops.sequence_logprobs(x, head, targets, chunk=-1)


# --- oracle: transformers' log-softmax-gather on tiny checkpoints --------------------------

_TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
)
#: family -> (transformers class prefix, overrides): untied Llama; Gemma 2 (tied head,
#: final soft-cap 1.5, large weights so the cap acts); Qwen3 (tied, QK-norm).
_FAMILIES = {
    "llama": ("Llama", dict()),
    "gemma2": (
        "Gemma2",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            final_logit_softcapping=1.5,
            attn_logit_softcapping=2.0,
            initializer_range=0.3,
        ),
    ),
    "qwen3": ("Qwen3", dict(head_dim=16, tie_word_embeddings=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_equals_transformers_log_softmax_gather(tmp_path, family):
    torch = pytest.importorskip("torch", reason="torch (CPU) is the oracle's runtime")
    transformers = pytest.importorskip("transformers", reason="transformers is the oracle")
    from jmem.models import hf

    prefix, overrides = _FAMILIES[family]
    hf_cfg = getattr(transformers, f"{prefix}Config")(**{**_TINY, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(hf_cfg).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokens = np.random.default_rng(0).integers(3, 97, size=(3, 25))
    mask = (np.arange(24)[None] >= np.array([[4], [9], [15]])).astype(np.int64)
    labels = np.where(mask == 1, tokens[:, 1:], -100)
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits[:, :-1].double()
        lab = torch.tensor(labels)
        logp = torch.log_softmax(logits, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0]
        want = (logp * (lab != -100)).sum(-1).numpy()
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    rows = {"inputs": tokens[:, :-1], "targets": labels, "completion_mask": mask}
    rows = {k: jnp.asarray(v, jnp.int32) for k, v in rows.items()}
    fn = functools.partial(
        preference.sequence_logprobs, config=cfg, levers=jmem.Levers(loss_chunk=16)
    )
    got = np.asarray(jax.jit(fn)(params, rows).sum)
    # 1e-5 relative to the summed log-probs (about 90 nats here): float32 against float64
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
def test_chunks_per_device_on_an_fsdp_mesh():
    """On a mesh splitting the batch rows (8 devices, 8 rows of 32 tokens, chunks of 16),
    each device chunks its own rows: the per-device dot FLOPs are the 1-device, 1-row
    call's (trip-count weighted, within 2%; slicing the flattened ``B * S`` tokens computed
    other devices' chunks), and the values equal the unsharded call's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.helpers import hlo_dot_flops

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 32, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((64, 96)) / 8, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 96, (8, 32)), jnp.int32)
    mask = jnp.asarray(rng.random((8, 32)) < 0.7, jnp.float32)
    f = jax.jit(lambda x, t, m: ops.sequence_logprobs(x, head, t, m, chunk=16))
    want = f(x, targets, mask)
    one = hlo_dot_flops(f.lower(x[:1], targets[:1], mask[:1]).compile().as_text())
    mesh = jmem.sharding.make_mesh(fsdp=8)
    rows = NamedSharding(mesh, P("fsdp"))
    args = [jax.device_put(a, rows) for a in (x, targets, mask)]
    with jax.set_mesh(mesh):
        got = f(*args)
        eight = hlo_dot_flops(f.lower(*args).compile().as_text())
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
    assert one <= eight <= 1.02 * one
