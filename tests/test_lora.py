"""LoRA adapters: init semantics (PEFT), unmerged apply == merged model, adapter-only grads."""

import math

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jmem
from jmem import fp8
from jmem import lora
from jmem import qlora
from jmem.models import llama

IN, OUT, HID, R = 48, 40, 56, 4


def _params(key=0):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    return {
        "up": {"kernel": jax.random.normal(k1, (IN, HID)) * 0.1, "bias": jnp.zeros(HID)},
        "down": {"kernel": jax.random.normal(k2, (HID, OUT)) * 0.1},
        "stack": {"kernel": jax.random.normal(k3, (3, OUT, OUT)) * 0.1},
    }


def mlp(params, x):
    """Uses weights as rhs, as lhs (einsum order), transposed and scanned."""
    h = jax.nn.gelu(x @ params["up"]["kernel"] + params["up"]["bias"])
    y = jnp.einsum("ho,bh->bo", params["down"]["kernel"], h)  # weight as lhs
    y = y + (y @ params["down"]["kernel"].T) @ params["down"]["kernel"]  # contract 'out'
    y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), y, params["stack"]["kernel"])
    return y


def _nonzero(ad, key=5):
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    )


@pytest.mark.slow
def test_init_shapes_scale_and_distribution():
    p = _params()
    ad = lora.init(jax.random.key(1), p, rank=R, alpha=8.0, modules=r".*kernel")
    assert list(ad) == ["down/kernel", "stack/kernel", "up/kernel"]
    chex.assert_shape(ad["up/kernel"].a, (IN, R))
    chex.assert_shape(ad["up/kernel"].b, (R, HID))
    chex.assert_shape(ad["stack/kernel"].a, (3, OUT, R))
    assert ad["up/kernel"].scale == 8.0 / R
    assert all(float(jnp.abs(w.b).max()) == 0 for w in ad.values())
    big = lora.init(jax.random.key(1), {"w": jnp.zeros((1024, 512))}, rank=64, modules="w")["w"].a
    bound = 1 / math.sqrt(1024)  # kaiming_uniform(a=sqrt(5)) on lora_A [r, in]
    assert float(jnp.abs(big).max()) <= bound and float(jnp.abs(big).max()) > 0.99 * bound
    np.testing.assert_allclose(float(jnp.std(big)), bound / math.sqrt(3), rtol=0.02)
    g = lora.init(
        jax.random.key(1), {"w": jnp.zeros((1024, 512))}, rank=16, modules="w", init="gaussian"
    )["w"].a
    np.testing.assert_allclose(float(jnp.std(g)), 1 / 16, rtol=0.02)
    rs = lora.init(jax.random.key(1), p, rank=16, alpha=8.0, modules=r".*kernel", rslora=True)
    assert rs["up/kernel"].scale == 8.0 / 4.0
    # Biases (rank 1) are never adapted; parameters are counted.
    assert "up/bias" not in lora.init(jax.random.key(0), p, modules=r"up/.*")
    assert lora.num_trainable(ad) == (IN * R + R * HID) + (HID * R + R * OUT) + 3 * 2 * OUT * R
    with pytest.raises(ValueError, match="(?i)no weight"):
        lora.init(jax.random.key(0), p, modules="nothing")
    with pytest.raises(ValueError, match="rank"):
        lora.init(jax.random.key(0), p, rank=0, modules=r".*kernel")


@pytest.mark.slow
class ApplyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_apply_equals_merged_and_identity_at_init(self):
        p = _params()
        x = jax.random.normal(jax.random.key(2), (5, IN))
        ad0 = lora.init(jax.random.key(1), p, rank=R, modules=r".*kernel")
        f = self.variant(lora.apply(mlp))
        chex.assert_trees_all_close(f(p, ad0, x), mlp(p, x), atol=1e-6)
        ad = _nonzero(ad0)
        out = f(p, ad, x)
        chex.assert_trees_all_close(out, mlp(lora.merge(p, ad), x), atol=2e-5, rtol=1e-5)
        assert float(jnp.abs(out - mlp(p, x)).max()) > 1e-3  # the adapters do something


@pytest.mark.slow
def test_grads_match_merged_and_only_adapters():
    p = _params()
    x = jax.random.normal(jax.random.key(2), (5, IN))
    ad = _nonzero(lora.init(jax.random.key(1), p, rank=R, modules=r".*kernel"))
    loss = lambda p, ad, x: jnp.sum(lora.apply(mlp)(p, ad, x) ** 2)
    g = jax.jit(jax.grad(loss, argnums=1))(p, ad, x)
    g_ref = jax.grad(lambda ad: jnp.sum(mlp(lora.merge(p, ad), x) ** 2))(ad)
    chex.assert_trees_all_close(g, g_ref, atol=2e-4, rtol=1e-4)  # grads are O(10)
    # No gradient buffer for the base: nothing in the backward jaxpr has a base weight's
    # shape (the only [IN, HID] / [HID, OUT] arrays are the inputs themselves).
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(p, ad, x).jaxpr
    shapes = {(IN, HID), (HID, IN), (HID, OUT), (OUT, HID)}

    def walk(j):
        for e in j.eqns:
            for v in e.outvars:
                assert tuple(getattr(v.aval, "shape", ())) not in shapes, e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jaxpr)


@pytest.mark.slow
def test_token_axes_grads_and_name_scopes():
    """x with two token axes ([B, S, in], flattened inside the LoRA path): values and factor
    gradients equal the merged weight's; the model's named scopes reach the compiled ops."""
    p = _params()
    x = jax.random.normal(jax.random.key(2), (2, 3, IN))
    ad = _nonzero(lora.init(jax.random.key(1), p, rank=R, modules=r"up/kernel"))

    def f(params, x):
        with jax.named_scope("my_block"):
            return jnp.tanh(x @ params["up"]["kernel"])

    loss = lambda ad: jnp.sum(lora.apply(f)(p, ad, x) ** 2)
    chex.assert_trees_all_close(
        lora.apply(f)(p, ad, x), f(lora.merge(p, ad), x), atol=1e-5, rtol=1e-5
    )
    g_ref = jax.grad(lambda ad: jnp.sum(f(lora.merge(p, ad), x) ** 2))(ad)
    chex.assert_trees_all_close(jax.jit(jax.grad(loss))(ad), g_ref, atol=1e-4, rtol=1e-4)
    hlo = jax.jit(jax.grad(loss)).lower(ad).compile().as_text()
    assert "my_block)/lora/dot_general" in hlo  # as jvp(my_block)/lora/... in op names


@pytest.mark.slow
def test_lossy_cast_chain_is_kept():
    """``w.astype(bf16).astype(f32)`` rounds w to bf16 before the matmul, as in fn."""
    p = _params()
    x = jax.random.normal(jax.random.key(2), (5, IN))
    f = lambda p, x: x @ p["up"]["kernel"].astype(jnp.bfloat16).astype(jnp.float32)
    ad = lora.init(jax.random.key(1), p, rank=R, modules=r"up/kernel")
    chex.assert_trees_all_close(lora.apply(f)(p, ad, x), f(p, x), atol=1e-6)
    assert float(jnp.abs(f(p, x) - x @ p["up"]["kernel"]).max()) > 1e-4


@pytest.mark.slow
def test_nnx_model():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.q_proj = nnx.Linear(IN, HID, rngs=rngs)
            self.v_proj = nnx.Linear(HID, OUT, rngs=rngs)

        def __call__(self, x):
            return self.v_proj(nnx.relu(self.q_proj(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    fwd = lambda s, x: nnx.merge(graphdef, s)(x)
    ad = _nonzero(lora.init(jax.random.key(1), state, rank=R))
    assert set(ad) == {"q_proj/kernel", "v_proj/kernel"}
    x = jax.random.normal(jax.random.key(2), (3, IN))
    chex.assert_trees_all_close(
        jax.jit(lora.apply(fwd))(state, ad, x), fwd(lora.merge(state, ad), x), atol=1e-5
    )


@pytest.mark.slow
def test_errors():
    p = _params()
    x = jax.random.normal(jax.random.key(2), (5, IN))
    ad = lora.init(jax.random.key(1), p, rank=R, modules=r"up/kernel")
    with pytest.raises(ValueError, match="no matching leaf"):
        lora.apply(mlp)(p, {"nope/kernel": ad["up/kernel"]}, x)
    bad = lambda p, x: x @ jnp.exp(p["up"]["kernel"])
    with pytest.raises(lora.ImplicitWeightError, match="up/kernel.*'exp'"):
        lora.apply(bad)(p, ad, x)
    out = lora.apply(bad, allow_materialize=True)(p, ad, x)
    chex.assert_trees_all_close(out, bad(lora.merge(p, ad), x), atol=1e-6)


@pytest.mark.slow
def test_matches_peft():
    torch = pytest.importorskip("torch", reason="PEFT oracle needs torch")
    peft = pytest.importorskip("peft", reason="PEFT is the LoRA oracle")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(IN, OUT, bias=False)

        def forward(self, x):
            return self.q_proj(x)

    for rslora in (False, True):
        torch.manual_seed(0)
        model = peft.get_peft_model(
            Net(),
            peft.LoraConfig(
                r=R, lora_alpha=12, target_modules=["q_proj"], lora_dropout=0.0, use_rslora=rslora
            ),
        )
        layer = model.base_model.model.q_proj
        lora_a = layer.lora_A["default"].weight  # [r, in], kaiming-uniform
        assert float(lora_a.detach().abs().max()) <= 1 / math.sqrt(IN)
        with torch.no_grad():
            layer.lora_B["default"].weight.normal_()
        x = np.random.default_rng(0).standard_normal((6, IN)).astype(np.float32)
        want = model(torch.tensor(x)).detach().numpy()
        p = {"q_proj": {"kernel": jnp.asarray(layer.base_layer.weight.detach().numpy().T)}}
        ad = lora.init(jax.random.key(0), p, rank=R, alpha=12, rslora=rslora)
        assert ad["q_proj/kernel"].scale == pytest.approx(layer.scaling["default"])
        ad = {
            "q_proj/kernel": lora.LoraWeight(
                a=jnp.asarray(lora_a.detach().numpy().T),
                b=jnp.asarray(layer.lora_B["default"].weight.detach().numpy().T),
                scale=ad["q_proj/kernel"].scale,
            )
        }
        got = lora.apply(lambda p, x: x @ p["q_proj"]["kernel"])(p, ad, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- FP8 base


def _fp8_stack_fn(p, x, metas):
    """A stacked FP8 layer loop (kernel transposed in its view, as in ``W.T``)."""

    def body(h, wm):
        w, m = wm
        return jnp.tanh(fp8.fp8_dot(h, w.T.astype(h.dtype), m)), None

    return jax.lax.scan(body, x, (p["stack"]["kernel"], metas))[0]


@pytest.mark.slow
def test_fp8_base_plus_bf16_lowrank_matches_hand_written():
    """LoRA over ``fp8_dot``: the base matmul runs in FP8 with the meta's delayed scaling,
    the low-rank path ``s·(x·a)·b`` in bf16; same values, adapter grads and new metas as
    the same computation written by hand (tolerance: bf16 rounding of the sum)."""
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params())
    x = jax.random.normal(jax.random.key(2), (5, OUT), jnp.bfloat16)
    ad = _nonzero(lora.init(jax.random.key(1), p, rank=R, modules=r"stack/kernel"))
    s = ad["stack/kernel"].scale
    metas = fp8.init_meta(4, batch_shape=(3,))

    def by_hand(ad, metas):
        # The model uses W.T ([out, in] view) and x contracts W's *output* axis, so the
        # low-rank path of (W + s·a·b).T is s·(x·bᵀ)·aᵀ; the base is FP8, the rest bf16.
        def body(h, xs):
            k, a, b, m = xs
            base = fp8.fp8_dot(h, jax.lax.stop_gradient(k.T), m)
            low = (h @ b.T.astype(h.dtype)) @ a.T.astype(h.dtype)
            return jnp.tanh(base + low * jnp.asarray(s, h.dtype)), None

        w = ad["stack/kernel"]
        return jax.lax.scan(body, x, (p["stack"]["kernel"], w.a, w.b, metas))[0]

    loss_l = lambda ad, m: jnp.sum(lora.apply(_fp8_stack_fn)(p, ad, x, m).astype(jnp.float32) ** 2)
    loss_h = lambda ad, m: jnp.sum(by_hand(ad, m).astype(jnp.float32) ** 2)
    out = jax.jit(lora.apply(_fp8_stack_fn))(p, ad, x, metas)
    chex.assert_trees_all_close(out, by_hand(ad, metas), atol=1e-2, rtol=1e-2)  # 1-2 bf16 ulps
    base = _fp8_stack_fn(p, x, metas)
    assert float(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32)).max()) > 0.05
    (g, m_new), (g_ref, m_ref) = (
        jax.jit(jax.grad(f, argnums=(0, 1)))(ad, metas) for f in (loss_l, loss_h)
    )
    chex.assert_trees_all_close(g, g_ref, atol=0.05, rtol=0.05)  # O(1-10) grads, bf16 path
    chex.assert_trees_all_close(m_new, m_ref, rtol=1e-2)
    assert all(bool(jnp.all(jnp.isfinite(t)) and jnp.any(t != 0)) for t in jax.tree.leaves(g))
    assert bool(jnp.all(m_new.kernel.amax_history[:, 0] > 0)) and bool(
        jnp.all(m_new.grad.amax_history[:, 0] > 0)
    )
    # Without adapters on the weight, the FP8 call is untouched (same program as today).
    chex.assert_trees_all_close(lora.apply(_fp8_stack_fn)(p, None, x, metas), base, atol=0, rtol=0)


@pytest.mark.slow
def test_fp8_unsupported_use_raises_or_materializes():
    """A selected weight as the *activation* operand of ``fp8_dot`` is not rewritten: the
    call is inlined and its ``abs`` (amax) raises; ``allow_materialize`` quantizes the merged weight."""
    p = _params()
    x = jax.random.normal(jax.random.key(2), (HID, 6))
    ad = _nonzero(lora.init(jax.random.key(1), p, rank=R, modules=r"up/kernel"))
    fn = lambda p, x, m: fp8.fp8_dot(p["up"]["kernel"], x, m)
    m = fp8.init_meta(4)
    with pytest.raises(lora.ImplicitWeightError, match="up/kernel.*'abs'"):
        lora.apply(fn)(p, ad, x, m)
    chex.assert_trees_all_close(
        lora.apply(fn, allow_materialize=True)(p, ad, x, m), fn(lora.merge(p, ad), x, m), atol=1e-6
    )


@pytest.mark.slow
def test_llama_fp8_lora():
    """The reference Llama with FP8 projections under ``lora.apply``: at init (b = 0) the
    logits equal the FP8 base model's exactly and the new metas equal the base model's;
    adapter grads are finite and b's nonzero; with b != 0 the output moves, and stays
    within FP8 error of the FP8 model with merged weights."""
    from jmem.models import llama

    cfg = helpers.small_config()
    p = llama.init(jax.random.key(0), cfg, dtype=jnp.bfloat16)
    # FP8 + LoRA (q, down), FP8 only (o), LoRA only (v); fewer FP8 matmuls compile faster.
    metas = fp8.init_metas(p, ("q_proj", "o_proj", "down_proj"), history_len=4)
    tok = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    ad = lora.init(jax.random.key(2), p, modules=r"layers/(q|v|down)_proj/kernel")
    fwd = jax.jit(lora.apply(lambda p, t, m: llama.forward(p, t, cfg, fp8=m)))
    ref = jax.jit(lambda p, t, m: llama.forward(p, t, cfg, fp8=m))
    chex.assert_trees_all_equal(fwd(p, ad, batch["inputs"], metas), ref(p, batch["inputs"], metas))
    loss = lora.apply(lambda p, b, m: llama.loss_fn(p, b, cfg, fp8=m))
    g, new = jax.jit(jax.grad(loss, argnums=(1, 3)))(p, ad, batch, metas)
    _, new_ref = jax.jit(
        jax.grad(lambda p, m: llama.loss_fn(p, batch, cfg, fp8=m), argnums=(0, 1))
    )(p, metas)
    chex.assert_trees_all_close(new, new_ref, rtol=1e-6)
    assert jax.tree.structure(new, is_leaf=fp8.is_meta) == jax.tree.structure(
        metas, is_leaf=fp8.is_meta
    )
    assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(g))
    assert all(float(jnp.abs(w.b).max()) > 0 for w in g.values())
    # b != 0 (0.01·N, so the activations stay within the delayed scales' range): the
    # output moves away from the base, and only the base matmuls carry FP8 error, so it
    # stays as close to the bf16 merged model as the FP8 base is to the bf16 base
    # (measured: 0.29 from the base; 0.038 from bf16 merged; FP8 base vs bf16 base 0.037).
    adn = {
        k: lora.LoraWeight(w.a, 0.01 * jax.random.normal(jax.random.key(3), w.b.shape), w.scale)
        for k, w in ad.items()
    }
    out, base = fwd(p, adn, batch["inputs"], new), ref(p, batch["inputs"], new)
    bf16 = jax.jit(lambda p, t: llama.forward(p, t, cfg))
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    assert rel(out, base) > 0.15
    assert rel(out, bf16(lora.merge(p, adn), batch["inputs"])) < 0.1


@pytest.mark.slow
def test_lora_weight_survives_jit_and_orbax(tmp_path):
    ad = _nonzero(lora.init(jax.random.key(1), _params(), rank=R, alpha=8.0, modules=r".*kernel"))
    out = jax.jit(lambda t: t)(ad)
    chex.assert_trees_all_equal(out, ad)
    assert out["up/kernel"].scale == ad["up/kernel"].scale
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "lora", ad)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "lora", ad)
    chex.assert_trees_all_equal(restored, ad)
    assert isinstance(restored["up/kernel"], lora.LoraWeight)


def test_apply_keeps_python_float_arguments_static():
    params = {"w": {"kernel": jnp.ones((4, 8))}}
    ad = lora.init(jax.random.key(0), params, modules=r"w/kernel", rank=2)
    fn = lora.apply(lambda p, x, t: (x / t if t > 0 else x) @ p["w"]["kernel"])
    out = fn(params, ad, jnp.ones((2, 4)), 0.5)
    chex.assert_trees_all_close(out, 2.0 * jnp.ones((2, 4)) @ params["w"]["kernel"])


# ----------------------------------------------------------------------------- PEFT options


@pytest.mark.slow
def test_init_peft_options_are_recorded_and_named_as_peft():
    p = {"w": jnp.zeros((1024, 512))}
    a_ref = lora.init(jax.random.key(1), p, rank=16, modules="w")["w"]
    # True / "default" = the old default (kaiming-uniform a, zero b), same draws.
    for how in (True, "default"):
        w = lora.init(jax.random.key(1), p, rank=16, modules="w", init_lora_weights=how)["w"]
        helpers.assert_bitwise_equal(w, a_ref)
        assert w.init_lora_weights is True
    g = lora.init(jax.random.key(1), p, rank=16, modules="w", init_lora_weights="gaussian")["w"]
    helpers.assert_bitwise_equal(
        g.a, lora.init(jax.random.key(1), p, rank=16, modules="w", init="gaussian")["w"].a
    )
    # False: b random as nn.Linear(r, out) inits lora_B: U(-1/sqrt(r), 1/sqrt(r)).
    f = lora.init(jax.random.key(1), p, rank=16, modules="w", init_lora_weights=False)["w"]
    helpers.assert_bitwise_equal(f.a, a_ref.a)
    assert 0.99 * 0.25 < float(jnp.abs(f.b).max()) <= 0.25
    np.testing.assert_allclose(float(jnp.std(f.b)), 0.25 / math.sqrt(3), rtol=0.02)
    w = lora.init(
        jax.random.key(1), p, rank=16, alpha=8.0, modules="w", use_rslora=True, dropout=0.1
    )["w"]
    assert (w.scale, w.alpha, w.use_rslora, w.dropout, w.lora_alpha) == (2.0, 8.0, True, 0.1, 8.0)
    assert lora.LoraWeight(w.a, w.b, scale=2.0, use_rslora=True).lora_alpha == 8.0
    with pytest.raises(ValueError, match="init_lora_weights"):
        lora.init(jax.random.key(0), p, modules="w", init_lora_weights="pissa")
    with pytest.raises(ValueError, match="contradicts"):
        lora.init(jax.random.key(0), p, modules="w", init="kaiming", init_lora_weights=False)
    with pytest.raises(ValueError, match="contradicts"):
        lora.init(jax.random.key(0), p, modules="w", rslora=False, use_rslora=True)
    with pytest.raises(ValueError, match="dropout"):
        lora.init(jax.random.key(0), p, modules="w", dropout=1.0)


def _dropout_case(n=16, rate=0.3):
    x = jax.random.normal(jax.random.key(2), (8, n)) + 3.0  # no zeros
    w = jax.random.normal(jax.random.key(3), (n, n)) * 0.1
    ident = lora.LoraWeight(a=jnp.eye(n), b=jnp.eye(n), scale=1.0, dropout=rate)
    k1, k2 = jax.random.split(jax.random.key(4))
    ad = lora.LoraWeight(
        a=jax.random.normal(k1, (n, 4)), b=jax.random.normal(k2, (4, n)), scale=0.5, dropout=rate
    )
    return x, w, ident, ad


class DropoutTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_dropout_is_peft_dropout_on_the_adapter_input(self):
        """With a key: y = x·W + s·((m⊙x/(1-p))·a)·b, m ~ Bernoulli(1-p) (the mask read off an
        identity adapter); the base sees x unchanged. Without a key: bitwise no dropout."""
        rate = 0.3
        x, w, ident, ad = _dropout_case(rate=rate)
        key = jax.random.key(0)
        f = self.variant(lora.apply(lambda p, x: x @ p["w"]))
        zero = {"w": jnp.zeros_like(w)}
        m = f(zero, {"w": ident}, x, lora_dropout_key=key)
        kept = np.asarray(m) != 0
        np.testing.assert_allclose(np.asarray(m)[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
        assert 0.15 < 1 - kept.mean() < 0.45
        y = f({"w": w}, {"w": ad}, x, lora_dropout_key=key)
        want = x @ w + 0.5 * ((x * kept / (1 - rate)) @ ad.a) @ ad.b
        chex.assert_trees_all_close(y, want, atol=1e-5, rtol=1e-5)
        no_drop = lora.LoraWeight(ad.a, ad.b, scale=0.5)
        helpers.assert_bitwise_equal(f({"w": w}, {"w": ad}, x), f({"w": w}, {"w": no_drop}, x))
        helpers.assert_bitwise_equal(
            f({"w": w}, {"w": no_drop}, x, lora_dropout_key=key), f({"w": w}, {"w": no_drop}, x)
        )
        other = f({"w": w}, {"w": ad}, x, lora_dropout_key=jax.random.key(1))
        assert float(jnp.abs(other - y).max()) > 1e-3
        # Gradients flow through the kept elements only (as the formula's).
        loss = lambda ad: jnp.sum(f({"w": w}, {"w": ad}, x, lora_dropout_key=key) ** 2)
        ref = lambda a, b: jnp.sum((x @ w + 0.5 * ((x * kept / (1 - rate)) @ a) @ b) ** 2)
        g = jax.grad(loss)(ad)
        ga, gb = jax.grad(ref, argnums=(0, 1))(ad.a, ad.b)
        chex.assert_trees_all_close((g.a, g.b), (ga, gb), atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_dropout_masks_differ_per_layer_and_per_use():
    n, rate = 16, 0.5
    x = jnp.ones((4, n))
    p = {"stack": jnp.zeros((3, n, n)), "w": jnp.zeros((n, n))}
    eye = jnp.broadcast_to(jnp.eye(n), (3, n, n))
    ad = {
        "stack": lora.LoraWeight(a=eye, b=eye, scale=1.0, dropout=rate),
        "w": lora.LoraWeight(a=jnp.eye(n), b=jnp.eye(n), scale=1.0, dropout=rate),
    }

    def fn(p, x):
        _, ys = jax.lax.scan(lambda c, w: (c, x @ w), 0.0, p["stack"])
        return ys, x @ p["w"], x @ p["w"]

    ys, u1, u2 = jax.jit(lora.apply(fn))(p, ad, x, lora_dropout_key=jax.random.key(0))
    masks = [np.asarray(m) != 0 for m in (*ys, u1, u2)]
    for i in range(len(masks)):
        for j in range(i):
            assert (masks[i] != masks[j]).any(), (i, j)


_DIFFERENTIATIONS = {
    "grad": lambda f: jax.grad(f),
    "jit(grad)": lambda f: jax.jit(jax.grad(f)),
    "grad(jit)": lambda f: jax.grad(jax.jit(f)),
    "grad(checkpoint)": lambda f: jax.grad(jax.checkpoint(f)),
    "grad(jmem.remat)": lambda f: jax.grad(jmem.remat(f, "full")),
    "vjp": lambda f: lambda ad: jax.vjp(f, ad)[1](1.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("how", list(_DIFFERENTIATIONS))
def test_training_dropout_adapters_without_a_key_raises_naming_the_argument(how):
    """Adapters with dropout > 0 differentiated without lora_dropout_key would train as
    dropout 0: a ValueError naming lora_dropout_key, however the grad is
    nested with jit, checkpoint, remat or a scan."""
    x, w, _, ad = _dropout_case()
    f = lora.apply(lambda p, x: jax.lax.scan(lambda c, _: (c, x @ p["w"]), 0.0, None, length=2)[1])
    loss = lambda ad: jnp.sum(f({"w": w}, {"w": ad}, x) ** 2)
    with pytest.raises(ValueError, match=r"dropout=0\.3.*lora_dropout_key="):
        _DIFFERENTIATIONS[how](loss)(ad)


@pytest.mark.slow
def test_dropout_key_none_or_evaluation_is_bitwise_no_dropout():
    """lora_dropout_key=None trains without dropout (bitwise the dropout-0 gradient); an
    undifferentiated call without the argument (evaluation, generate) needs none; with
    dropout 0 nothing is added to the program."""
    x, w, _, ad = _dropout_case()
    no_drop = lora.LoraWeight(ad.a, ad.b, scale=ad.scale)
    f = lora.apply(lambda p, x: x @ p["w"])
    loss = lambda ad, **kw: jnp.sum(f({"w": w}, {"w": ad}, x, **kw) ** 2)
    helpers.assert_bitwise_equal(
        jax.grad(loss)(ad, lora_dropout_key=None).a, jax.grad(loss)(no_drop).a
    )
    helpers.assert_bitwise_equal(jax.jit(f)({"w": w}, {"w": ad}, x), f({"w": w}, {"w": no_drop}, x))
    plain = str(jax.make_jaxpr(jax.grad(loss))(no_drop))
    assert plain == str(jax.make_jaxpr(jax.grad(lambda a: loss(a, lora_dropout_key=None)))(no_drop))
    assert "custom_jvp" not in plain


@pytest.mark.slow
def test_qlora_llama_dropout():
    """NF4 base, scanned layers, jit + grad: a key changes the loss (same key, same loss),
    no key equals dropout=0; materializing with dropout active raises."""
    cfg = helpers.small_config()
    q = qlora.quantize_params(llama.init(jax.random.key(0), cfg))
    batch = helpers.token_batch(cfg)
    mk = lambda d: lora.init(
        jax.random.key(1), q, modules=r"layers/.*_proj/kernel", dropout=d, init_lora_weights=False
    )
    ad, ad0 = mk(0.2), mk(0.0)
    loss = jax.jit(qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg)))
    grad = jax.jit(jax.value_and_grad(qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg)), 1))
    key = jax.random.key(7)
    assert float(loss(q, ad, batch)) == float(loss(q, ad0, batch))
    l1, g1 = grad(q, ad, batch, lora_dropout_key=key)
    l2, g2 = grad(q, ad, batch, lora_dropout_key=key)
    assert float(l1) == float(l2) and float(l1) != float(loss(q, ad, batch))
    helpers.assert_bitwise_equal(g1, g2)
    assert all(bool(jnp.all(jnp.isfinite(t))) for t in jax.tree.leaves(g1))
    bad = qlora.apply(
        lambda p, b: jnp.sum(jnp.exp(p["layers"]["q_proj"]["kernel"])), allow_materialize=True
    )
    with pytest.raises(lora.ImplicitWeightError, match="dropout"):
        bad(q, ad, batch, lora_dropout_key=key)
    assert np.isfinite(float(bad(q, ad, batch)))  # no key: materializing is allowed
