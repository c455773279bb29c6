"""jmem.ops.attention: the blockwise path equals the dense one (values and gradients) for
every mask the model builds, holds no [S, T] array, and skips fully masked tiles."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jmem
from jmem import ops
from jmem._src import attention as attention_lib
from jmem.models import llama
from tests.helpers import small_config
from tests.helpers import token_batch

B, S, NH, NKV = 2, 100, 4, 2
#: float32: forward and gradients within 1e-5 (both accumulate in float32; only the order
#: of the softmax sums differs). bfloat16: 2e-2 (inputs and P rounded to bf16 differently).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _qkv(d=16, dtype=jnp.float32, s=S, t=None):
    ks = jax.random.split(jax.random.key(0), 3)
    t = s if t is None else t
    q = jax.random.normal(ks[0], (B, s, NH, d), dtype)
    k = jax.random.normal(ks[1], (B, t, NKV, d), dtype)
    v = jax.random.normal(ks[2], (B, t, NKV, d), dtype)
    return q, k, v


def _packed():
    """Two rows packing 3 and 2 examples."""
    cuts = np.array([[0] * 30 + [1] * 45 + [2] * 25, [0] * 64 + [1] * 36])
    return jnp.asarray(cuts, jnp.int32)


CASES = {
    "causal": {},
    "window": {"sliding_window": 17},
    "segments": {"segment_ids": "packed"},
    "segments_window": {"segment_ids": "packed", "sliding_window": 9},
    "softcap_scale": {"logit_softcap": 5.0, "scale": 0.3},
}


def _loss(impl, kw, window_arg=None):
    def f(q, k, v, window=None):
        extra = dict(kw)
        if extra.get("segment_ids") == "packed":
            extra["segment_ids"] = _packed()
        if window is not None:
            extra["sliding_window"] = window
        out = ops.attention(
            q, k, v, q_index=jnp.arange(q.shape[1]), implementation=impl, block_q=32,
            block_kv=16, **extra,
        )  # fmt: skip
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    return f


@pytest.mark.slow
class BlockwiseEqualsDense(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*[(n, kw) for n, kw in CASES.items()])
    def test_values_and_gradients_float32(self, kw):
        q, k, v = _qkv()
        grad = lambda impl: self.variant(jax.grad(_loss(impl, kw), argnums=(0, 1, 2), has_aux=True))
        (gd, od), (gb, ob) = grad("dense")(q, k, v), grad("blockwise")(q, k, v)
        chex.assert_trees_all_close(ob, od, atol=TOL[jnp.float32], rtol=TOL[jnp.float32])
        chex.assert_trees_all_close(gb, gd, atol=TOL[jnp.float32], rtol=TOL[jnp.float32])

    @chex.variants(with_jit=True, without_jit=True)
    def test_traced_per_layer_window(self):
        """A window traced as an int32 scalar (scanned with the layer params) masks as the
        Python int does; 0 means global."""
        q, k, v = _qkv()
        for w in (0, 23):
            f = lambda w: _loss("blockwise", {})(q, k, v, w)[1]
            ref = _loss("dense", {} if w == 0 else {"sliding_window": w})(q, k, v)[1]
            chex.assert_trees_all_close(self.variant(f)(jnp.int32(w)), ref, atol=1e-5)
            g = jax.grad(lambda q, w: _loss("blockwise", {})(q, k, v, w)[0])
            gd = jax.grad(lambda q, w: _loss("dense", {})(q, k, v, w)[0])
            chex.assert_trees_all_close(
                self.variant(g)(q, jnp.int32(w)), gd(q, jnp.int32(w)), atol=1e-5
            )


@pytest.mark.slow
@pytest.mark.parametrize("d", [12, 64])
def test_bfloat16_and_any_head_dim(d):
    q, k, v = _qkv(d=d, dtype=jnp.bfloat16)
    grad = lambda impl: jax.grad(_loss(impl, {}), argnums=(0, 1, 2), has_aux=True)
    (gd, od), (gb, ob) = grad("dense")(q, k, v), grad("blockwise")(q, k, v)
    assert ob.dtype == jnp.bfloat16
    tol = TOL[jnp.bfloat16]
    chex.assert_trees_all_close(ob.astype(jnp.float32), od.astype(jnp.float32), atol=tol)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), gb),
        jax.tree.map(lambda x: x.astype(jnp.float32), gd),
        atol=4 * tol,
        rtol=tol,
    )


@pytest.mark.slow
def test_kv_cache_indices():
    """Queries at rows 40..42 over a 50-slot cache: the later slots are masked."""
    q, _, _ = _qkv(s=3)
    _, k, v = _qkv(s=50)
    kw = dict(q_index=40 + jnp.arange(3), kv_index=jnp.arange(50), block_q=2, block_kv=16)
    dense = ops.attention(q, k, v, implementation="dense", **kw)
    block = ops.attention(q, k, v, implementation="blockwise", **kw)
    chex.assert_trees_all_close(block, dense, atol=1e-5)
    alone = ops.attention(
        q, k[:, :43], v[:, :43], implementation="dense", **kw | {"kv_index": jnp.arange(43)}
    )
    chex.assert_trees_all_close(dense, alone, atol=1e-6)


def _max_array_size(jaxpr) -> int:
    """The largest array (elements) any equation of ``jaxpr`` or its sub-jaxprs produces."""
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            best = max(best, int(np.prod(getattr(v.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            best = max(best, _max_array_size(sub))
    return best


@pytest.mark.slow
def test_blockwise_holds_no_score_matrix():
    """The jaxpr of the blockwise gradient holds nothing of ``S * T`` elements per head
    (its largest array is a hidden-sized one); the dense path's holds ``B * nH * S * T``."""
    s = 1024
    q, k, v = _qkv(s=s)
    jaxprs = {
        impl: jax.make_jaxpr(jax.grad(lambda q, k, v: _loss(impl, {})(q, k, v)[0], (0, 1, 2)))(
            q, k, v
        )
        for impl in ("dense", "blockwise")
    }
    assert _max_array_size(jaxprs["dense"].jaxpr) >= B * NH * s * s
    assert _max_array_size(jaxprs["blockwise"].jaxpr) <= q.size


@pytest.mark.slow
def test_blockwise_bfloat16_gradient_temporaries():
    """bf16 q/k/v/do are sliced in the blockwise loops as uint16 bits, so XLA:CPU hoists no
    float32 copy of them out of the loops: the gradient's temporaries stay under 5.5 times
    q's float32 bytes (5.38 measured; 5.88 when slicing bf16 directly)."""
    b, s, nh, nkv, d = 1, 4096, 4, 2, 64
    q = jax.ShapeDtypeStruct((b, s, nh, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, nkv, d), jnp.bfloat16)

    def loss(q, k, v):
        out = ops.attention(
            q, k, v, q_index=jnp.arange(s), implementation="blockwise", block_q=512, block_kv=512
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 5.5 * (b * s * nh * d * 4)


def test_causal_skips_half_the_tiles_and_window_more():
    qi = jnp.broadcast_to(jnp.arange(1024), (1, 1024))
    seg = jnp.zeros_like(qi)
    causal = attention_lib._needed_blocks(qi, qi, seg, seg, jnp.int32(0), 128, 128)
    assert int(causal.sum()) == 8 * 9 // 2  # the diagonal and below, of 8 x 8
    window = attention_lib._needed_blocks(qi, qi, seg, seg, jnp.int32(100), 128, 128)
    assert int(window.sum()) == 8 + 7  # the diagonal and the one before it
    packed = jnp.where(qi < 512, 0, 1)
    assert int(attention_lib._needed_blocks(qi, qi, packed, packed, 0, 128, 128).sum()) == 20


@pytest.mark.slow
def test_model_loss_blockwise_equals_dense():
    """The tiny model's loss and gradients with packed rows and a window, both paths."""
    cfg = small_config(sliding_window=7)
    params = llama.init(jax.random.key(1), cfg)
    batch = token_batch(cfg, seq_len=40)
    batch["segment_ids"] = jnp.asarray([[0] * 25 + [1] * 15, [0] * 40], jnp.int32)
    batch["positions"] = jnp.asarray([list(range(25)) + list(range(15)), list(range(40))])
    out = {
        impl: jax.value_and_grad(
            lambda p, b: llama.loss_fn(p, b, cfg, levers=jmem.Levers(attention=impl))
        )(params, batch)
        for impl in ("dense", "blockwise")
    }
    chex.assert_trees_all_close(out["blockwise"], out["dense"], atol=1e-5, rtol=1e-5)


def _temp_bytes(impl: str, seq: int) -> int:
    cfg = llama.get_config("tiny")
    lv = jmem.Levers(attention=impl, loss_chunk=512)
    params = llama.abstract_params(cfg)
    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    grad = jax.jit(jax.grad(jmem.remat(lambda p, b: llama.loss_fn(p, b, cfg, levers=lv), "full")))
    return grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


#: Temporaries of the tiny model's gradient at 4,096 tokens, blockwise attention (measured
#: about 157 MiB on XLA:CPU under full remat); the dense path's scores alone are 8 heads x
#: 4096^2 x 4 bytes = 512 MiB, and their gradient again (1.7 GiB measured).
TINY_4K_BOUND = 256 * 2**20


@pytest.mark.slow
def test_compiled_temporaries_at_4k_tokens():
    assert _temp_bytes("blockwise", 4096) < TINY_4K_BOUND < _temp_bytes("dense", 4096)


@pytest.mark.slow
def test_errors_name_the_cause():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="GPU"):
        ops.attention(q, k, v, q_index=jnp.arange(S), implementation="cudnn")
    with pytest.raises(ValueError, match="unknown"):
        ops.attention(q, k, v, q_index=jnp.arange(S), implementation="flash")
    with pytest.raises(ValueError, match="q_index"):
        ops.attention(q, k, v, q_index=jnp.arange(S + 1))
    with pytest.raises(ValueError, match="multiple"):
        ops.attention(q[:, :, :3], k, v, q_index=jnp.arange(S))
    with pytest.raises(ValueError, match="attention="):
        jmem.Levers(attention="flash")
    with pytest.raises(ValueError, match="loss_chunk"):
        jmem.Levers(loss_chunk=-1)
    with pytest.raises(ValueError, match="execution settings"):
        llama.get_config("tiny", attention="dense")


def test_auto_picks_dense_short_and_blockwise_long_on_cpu():
    assert attention_lib.pick_implementation("auto", "no GPU", 8) == "dense"
    assert attention_lib.pick_implementation("auto", "no GPU", 4096) == "blockwise"


@pytest.mark.slow
def test_blockwise_equals_dense_quick():
    """The fast run's check (the full matrix is marked slow): GQA, packed rows and a
    window, values and gradients, jitted, with a partial last tile."""
    q, k, v = _qkv(s=40)
    seg = jnp.asarray([[0] * 25 + [1] * 15, [0] * 40], jnp.int32)

    def loss(impl, q, k, v):
        out = ops.attention(
            q, k, v, q_index=jnp.arange(40), segment_ids=seg, sliding_window=11,
            implementation=impl, block_q=16, block_kv=16,
        )  # fmt: skip
        return jnp.sum(jnp.sin(out)), out

    grad = lambda impl: jax.jit(jax.grad(lambda *a: loss(impl, *a), (0, 1, 2), has_aux=True))
    chex.assert_trees_all_close(grad("blockwise")(q, k, v), grad("dense")(q, k, v), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3_scaling", "mistral_sliding", "qwen2", "llama_gelu"])
def test_hugging_face_logits_with_blockwise_tiles(tmp_path, monkeypatch, family):
    """Every supported family's Hugging Face logits within 1e-4 through the blockwise path
    cut into several tiles (16 x 8 over 40 tokens; Mistral's window included)."""
    pytest.importorskip("transformers", reason="transformers is the oracle")
    pytest.importorskip("torch", reason="transformers runs on torch")
    import functools

    import torch

    from jmem.models import hf
    from tests import test_hf

    if family not in test_hf.FAMILIES:
        pytest.skip(f"{family} is not among test_hf.FAMILIES {sorted(test_hf.FAMILIES)}")
    model = test_hf._save_family(tmp_path, family)
    params, cfg = hf.load_params(str(tmp_path), dtype=jnp.float32)
    lv = jmem.Levers(attention="blockwise")
    tiled = functools.partial(ops.attention, block_q=16, block_kv=8)
    monkeypatch.setattr(llama.block, "attention", tiled)  # the block's attention call
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(llama.forward(params, jnp.asarray(tokens, jnp.int32), cfg, levers=lv))
    assert np.max(np.abs(got - ref)) <= 1e-4, np.max(np.abs(got - ref))


def _autodiff_dense(q, k, v, mask, scale):
    """The dense path as plain autodiff sees it (the formulation before its custom VJP)."""
    b, s, nh, d = q.shape
    nkv, t = k.shape[2], k.shape[1]
    g = nh // nkv
    qg = attention_lib._to_groups(q, nkv).reshape(b, nkv, g * s, d)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bkqd,bksd->bkqs", qg, kh).astype(jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores.reshape(b, nkv, g, s, t), -3e38)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, nkv, g * s, t)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vh).reshape(b, nkv, g, s, d)
    return attention_lib._from_groups(out)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_saves_the_probabilities_once_in_the_compute_dtype(dtype):
    """The dense path's custom VJP keeps one ``[.., S, T]`` residual, in ``v``'s dtype:
    autodiff kept the float32 softmax output too (in bf16 the largest array of a no-remat
    step). Its gradients equal autodiff's (float32 1e-5; bf16 within the bf16
    tolerance: the softmax backward reads the bf16-rounded probabilities)."""
    q, k, v = _qkv(dtype=dtype)
    idx = jnp.arange(S)
    mask = attention_lib._allowed(
        jnp.broadcast_to(idx, (B, S)), jnp.broadcast_to(idx, (B, S)),
        jnp.zeros((B, S), jnp.int32), jnp.zeros((B, S), jnp.int32), attention_lib._window(9),
    )  # fmt: skip
    scale = 0.25

    def new(q, k, v):
        return attention_lib._dense(q, k, v, mask, scale, None)

    _, vjp_fn = jax.vjp(new, q, k, v)
    big = [x for x in jax.tree.leaves(vjp_fn) if x.size >= B * NH * S * S]
    assert [x.dtype for x in big] == [jnp.dtype(dtype)], [(x.dtype, x.shape) for x in big]
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))  # noqa: E731
    got = jax.jit(jax.grad(loss(new), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(loss(lambda q, k, v: _autodiff_dense(q, k, v, mask, scale)), (0, 1, 2))(q, k, v)
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(f32(got), f32(ref), atol=TOL[dtype] * 4, rtol=TOL[dtype])
