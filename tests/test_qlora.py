"""QLoRA: NF4 base + LoRA on a plain function, a Flax NNX model and the reference Llama."""

import functools

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmem
from jmem import lora
from jmem import nf4
from jmem import qlora
from jmem._src.implicit.weight import flatten_params
from jmem.models import llama

CFG = helpers.small_config()
PROJ = r"layers/.*_proj/kernel"


def _nonzero(ad, key=7, s=0.05):
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return jax.tree.unflatten(
        tree, [x + s * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    )


def _batch(b=2, s=8, key=1):
    return helpers.token_batch(CFG, b, s, seed=key)


def _max_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _mlp_params(key=3):
    k = jax.random.split(jax.random.key(key), 3)
    return {
        "stack": jax.random.normal(k[0], (2, 32, 32)) * 0.2,
        "head": jax.random.normal(k[1], (32, 64)) * 0.2,
    }


def _mlp(p, x):
    x, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p["stack"])
    return x @ p["head"]


class QLoRAPropertyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_loss_and_grads_equal_dense_merged(self):
        """QLoRA loss and adapter grads equal the dequantized, merged dense computation."""
        q = jax.jit(functools.partial(qlora.quantize_params, modules=r".*"))(_mlp_params())
        init = functools.partial(lora.init, modules=r".*", rank=4)
        ad = _nonzero(jax.jit(init)(jax.random.key(4), q), s=0.2)
        x = jax.random.normal(jax.random.key(5), (4, 32))
        deq = jax.jit(qlora.dequantize_params)(q)
        loss_q = lambda a: jnp.mean(qlora.apply(_mlp)(q, a, x) ** 2)
        loss_ref = lambda a: jnp.mean(_mlp(lora.merge(deq, a), x) ** 2)
        value, g = self.variant(jax.value_and_grad(loss_q))(ad)
        value_ref, g_ref = jax.value_and_grad(loss_ref)(ad)
        chex.assert_trees_all_close(value, value_ref, rtol=1e-5)
        chex.assert_trees_all_close(g, g_ref, atol=1e-6, rtol=1e-4)


@pytest.mark.slow
def test_quantize_default_modules():
    p = llama.init(jax.random.key(0), CFG)
    q = qlora.quantize_params(p)
    is_q = lambda x: isinstance(x, nf4.NF4Array)
    for name in llama.LINEAR_NAMES:
        assert is_q(q["layers"][name]["kernel"]), name
        assert q["layers"][name]["kernel"].shape == p["layers"][name]["kernel"].shape
    for path in (
        ("embed", "embedding"),
        ("lm_head", "kernel"),
        ("final_norm", "scale"),
        ("layers", "attn_norm", "scale"),
    ):
        leaf = functools.reduce(lambda t, k: t[k], path, q)
        assert not is_q(leaf), path
    assert jmem.tree.nbytes(q) < 0.35 * jmem.tree.nbytes(p)
    with pytest.raises(ValueError, match="matched no weight"):
        qlora.quantize_params(p, modules="nothing")


@pytest.mark.slow
def test_llama_outputs_and_grads_match_dequantized_merged():
    p = llama.init(jax.random.key(0), CFG)
    q = qlora.quantize_params(p)
    deq = qlora.dequantize_params(q)
    ad = _nonzero(lora.init(jax.random.key(2), q, modules=PROJ))
    batch = _batch()
    fwd = jax.jit(qlora.apply(lambda p, t: llama.forward(p, t, CFG)))
    ref_fwd = jax.jit(lambda p, t: llama.forward(p, t, CFG))
    chex.assert_trees_all_close(
        fwd(q, ad, batch["inputs"]), ref_fwd(lora.merge(deq, ad), batch["inputs"]), atol=2e-5
    )
    loss = qlora.apply(lambda p, b: llama.loss_fn(p, b, CFG))
    g = jax.jit(jax.grad(loss, argnums=1))(q, ad, batch)
    g_ref = jax.jit(jax.grad(lambda a: llama.loss_fn(lora.merge(deq, a), batch, CFG)))(ad)
    chex.assert_trees_all_close(g, g_ref, atol=2e-5, rtol=1e-4)
    # lora=None: plain quantized inference equals the dequantized model.
    chex.assert_trees_all_close(
        fwd(q, None, batch["inputs"]), ref_fwd(deq, batch["inputs"]), atol=2e-5
    )


@pytest.mark.slow
def test_no_dequantized_weight_kept_for_backward():
    """The forward scan's residuals (its stacked outputs) hold no weight-sized array: the
    NF4 matmul saves x and the packed codes (forwarded scan inputs), not bf16 weights."""
    p = llama.init(jax.random.key(0), CFG, dtype=jnp.bfloat16)
    q = qlora.quantize_params(p)
    ad = lora.init(jax.random.key(2), q, modules=PROJ)
    loss = qlora.apply(lambda p, b: llama.loss_fn(p, b, CFG))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(q, ad, _batch()).jaxpr
    weight_shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(p["layers"]) if x.ndim == 3}
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) >= 2  # forward and backward
    for e in scans:
        for v in e.outvars:
            assert tuple(v.aval.shape[-2:]) not in weight_shapes, (v.aval, e.primitive)


def _residual_shapes(f, *args):
    """Shapes of the arrays ``jax.vjp`` keeps for the backward pass of ``f`` at ``args``."""
    _, vjp_fn = jax.vjp(f, *args)
    return [tuple(x.shape) for x in jax.tree.leaves(vjp_fn)]


@pytest.mark.slow
def test_frozen_nf4_matmul_saves_no_input():
    """The frozen NF4 base's backward pass (``g·Wᵀ``) reads no activation: without LoRA the
    only residual is the packed weight, never the ``[N, in]`` input (each saved
    input was a stacked copy per projection per layer without remat)."""
    w = {"kernel": jax.random.normal(jax.random.key(0), (64, 48))}
    q = qlora.quantize_params(w, modules=r".*")
    x = jax.random.normal(jax.random.key(1), (16, 64))
    f = qlora.apply(lambda p, x: jnp.tanh(x @ p["kernel"]))
    shapes = _residual_shapes(lambda x: f(q, None, x), x)
    assert (16, 64) not in shapes, shapes
    dx = jax.grad(lambda x: f(q, None, x).sum())(x)
    deq = qlora.dequantize_params(q)["kernel"]
    ref = jax.grad(lambda x: jnp.tanh(x @ deq).sum())(x)
    chex.assert_trees_all_close(dx, ref, atol=1e-5)


@pytest.mark.slow
def test_adapters_on_one_input_save_it_once():
    """Three adapted projections of one input (q/k/v) keep one flattened copy of it for
    their ``a`` gradients, not three (``lora_term``'s per-evaluation memo)."""
    k = jax.random.split(jax.random.key(2), 4)
    w = {n: {"kernel": jax.random.normal(kk, (32, 32)) * 0.2} for n, kk in zip("qkv", k)}
    q = qlora.quantize_params(w, modules=r".*")
    ad = _nonzero(lora.init(jax.random.key(3), q, modules=r".*", rank=4))
    x = jax.random.normal(k[3], (2, 8, 32))
    f = qlora.apply(lambda p, x: sum(jnp.tanh(x @ p[n]["kernel"]) for n in "qkv").sum())
    shapes = _residual_shapes(lambda a: f(q, a, x), ad)
    assert shapes.count((16, 32)) == 1, shapes
    grads = jax.grad(lambda a: f(q, a, x))(ad)
    deq = qlora.dequantize_params(q)
    ref = jax.grad(
        lambda a: sum(jnp.tanh(x @ lora.merge(deq, a)[n]["kernel"]) for n in "qkv").sum()
    )(ad)
    chex.assert_trees_all_close(grads, ref, atol=1e-4)


def test_cpu_dequantization_tie_reads_one_element_of_the_activation():
    """On XLA:CPU each dequantization is tied to its activation through a popcount of the
    activation's first element, not a reduction over all of it (which cost 9% of a QLoRA
    step)."""
    w = {"kernel": jax.random.normal(jax.random.key(0), (64, 48))}
    q = qlora.quantize_params(w, modules=r".*")
    x = jax.random.normal(jax.random.key(1), (16, 64))
    f = qlora.apply(lambda p, x: jnp.tanh(x @ p["kernel"]).sum())
    text = jax.jit(jax.grad(lambda x: f(q, None, x))).lower(x).as_text()
    popcounts = [line for line in text.splitlines() if "popcnt" in line]
    assert popcounts, "the tie is gone: nothing orders the dequantization after x"
    assert all("tensor<16x64x" not in line for line in popcounts), popcounts


@pytest.mark.slow
def test_plain_function_python_loop_and_fori_loop():
    """A function not written for jmem: stacked weights indexed in a Python loop and in a
    fori_loop (dynamic_slice), a weight transposed, and an einsum with the weight first."""
    k = jax.random.split(jax.random.key(3), 3)
    p = {
        "stack": jax.random.normal(k[0], (3, 32, 32)) * 0.2,
        "head": jax.random.normal(k[1], (32, 64)) * 0.2,
    }

    def fn(p, x):
        for i in range(3):
            x = jnp.tanh(x @ p["stack"][i])
        x = jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ p["stack"][i].T), x)
        return jnp.einsum("hv,bh->bv", p["head"], x)

    q = qlora.quantize_params(p, modules=r".*")
    ad = _nonzero(lora.init(jax.random.key(4), q, modules=r".*", rank=4), s=0.2)
    x = jax.random.normal(k[2], (4, 32))
    deq = qlora.dequantize_params(q)
    f = jax.jit(qlora.apply(fn))
    chex.assert_trees_all_close(f(q, ad, x), jax.jit(fn)(lora.merge(deq, ad), x), atol=1e-5)
    g = jax.jit(jax.grad(lambda a: jnp.sum(qlora.apply(fn)(q, a, x) ** 2)))(ad)
    g_ref = jax.jit(jax.grad(lambda a: jnp.sum(fn(lora.merge(deq, a), x) ** 2)))(ad)
    scale = max(float(jnp.abs(t).max()) for t in jax.tree.leaves(g_ref))  # grads are O(100)
    chex.assert_trees_all_close(g, g_ref, atol=1e-5 * scale, rtol=1e-4)
    with pytest.raises(qlora.ImplicitWeightError, match="'stack'.*'reduce_sum'"):
        qlora.apply(lambda p, x: x * jnp.sum(p["stack"]))(q, None, x)


@pytest.mark.slow
def test_nnx_model():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(32, 64, rngs=rngs)
            self.fc2 = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.fc2(nnx.gelu(self.fc1(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    fwd = lambda s, x: nnx.merge(graphdef, s)(x)
    q = qlora.quantize_params(state)
    flat, _ = flatten_params(q)
    assert {p for p, x in flat if isinstance(x, nf4.NF4Array)} == {"fc1/kernel", "fc2/kernel"}
    ad = _nonzero(lora.init(jax.random.key(1), q, modules=r".*kernel", rank=4), s=0.2)
    x = jax.random.normal(jax.random.key(2), (5, 32))
    deq = qlora.dequantize_params(q)
    chex.assert_trees_all_close(
        jax.jit(qlora.apply(fwd))(q, ad, x), fwd(lora.merge(deq, ad), x), atol=1e-5
    )
    g = jax.jit(jax.grad(lambda a: jnp.sum(qlora.apply(fwd)(q, a, x) ** 2)))(ad)
    g_ref = jax.jit(jax.grad(lambda a: jnp.sum(fwd(lora.merge(deq, a), x) ** 2)))(ad)
    scale = max(float(jnp.abs(t).max()) for t in jax.tree.leaves(g_ref))
    chex.assert_trees_all_close(g, g_ref, atol=1e-5 * scale, rtol=1e-4)


def _train(loss, q, ad, opt, steps=6):
    state = opt.init(ad)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(ad, state, batch):
        value, g = jax.value_and_grad(loss, argnums=1)(q, ad, batch)
        updates, state = opt.update(g, state, ad)
        return optax.apply_updates(ad, updates), state, value

    batch = _batch(b=4, s=16, key=9)
    losses = []
    for _ in range(steps):
        ad, state, value = step(ad, state, batch)
        losses.append(float(value))
    return losses


@pytest.mark.slow
def test_training_step_lowers_loss():
    p = llama.init(jax.random.key(0), CFG)
    q = qlora.quantize_params(p)
    ad = lora.init(jax.random.key(2), q, modules=PROJ, rank=8)
    losses = _train(qlora.apply(lambda p, b: llama.loss_fn(p, b, CFG)), q, ad, optax.adamw(3e-3))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_training_step_remat_bf16_8bit_adamw():
    """QLoRA + per-layer remat + bf16 compute + (8-bit) AdamW together."""
    from jmem._src.remat import remat

    opt = jmem.adamw_8bit(3e-3)
    p = llama.init(jax.random.key(0), CFG, dtype=jnp.bfloat16)  # bf16 weights and activations
    q = qlora.quantize_params(p)
    assert q["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    ad = lora.init(jax.random.key(2), q, modules=PROJ, rank=8)
    loss = qlora.apply(remat(lambda p, b: llama.loss_fn(p, b, CFG), "full"))
    losses = _train(loss, q, ad, opt)
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_7b_arguments_fit_in_about_3_6_gib():
    """Llama-2-7B shapes, abstract (nothing allocated): NF4 body + bf16 embed/head ~3.6 GiB
    of arguments for the compiled QLoRA forward, vs 12.55 GiB for the bf16 model."""
    measure = jmem.measure
    cfg = llama.get_config("llama2_7b")
    ap = llama.abstract_params(cfg, jnp.bfloat16)
    qp = jax.eval_shape(qlora.quantize_params, ap)
    ad = jax.eval_shape(lambda: lora.init(jax.random.key(0), qp))  # q_proj, v_proj; r=8
    assert lora.num_trainable(ad) == 32 * 2 * (4096 * 8 + 8 * 4096)
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    report = measure(qlora.apply(lambda p, t: llama.forward(p, t, cfg)), qp, ad, tokens)
    gib = report.argument_bytes / 2**30
    bf16_gib = jmem.tree.nbytes(ap) / 2**30
    assert 3.4 < gib < 3.8, gib
    assert bf16_gib > 12.5 and gib < 0.3 * bf16_gib
    quantized = [
        x
        for x in jax.tree.leaves(qp, is_leaf=lambda x: isinstance(x, nf4.NF4Array))
        if isinstance(x, nf4.NF4Array)
    ]
    assert sum(jmem.tree.nbytes(x) for x in quantized) / sum(x.size for x in quantized) <= 0.52


# ----------------------------------------------------------------------------- FP8 base

FP8_NAMES = ("q_proj", "o_proj", "down_proj")  # FP8 + LoRA (q, down), FP8 only (o)
FP8_LORA = r"layers/(q|v|down)_proj/kernel"  # LoRA only (v)


@pytest.mark.slow
def test_fp8_base_exact_at_init_and_no_weight_residuals():
    """NF4 base + FP8 matmuls + LoRA: at init (b = 0) the logits equal the FP8 model run
    on the dequantized weights bit for bit; for backward, neither the dequantized bf16
    weight nor its FP8 copy is saved (the FP8 kernel is re-quantized from the NF4 codes /
    the frozen array in the backward pass): no residual has a weight's shape."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals

    from jmem import fp8

    p = llama.init(jax.random.key(0), CFG, dtype=jnp.bfloat16)
    q = qlora.quantize_params(p)
    metas = fp8.init_metas(p, FP8_NAMES, history_len=4)
    ad = lora.init(jax.random.key(2), q, modules=FP8_LORA)
    batch = _batch()
    fwd = jax.jit(qlora.apply(lambda p, t, m: llama.forward(p, t, CFG, fp8=m)))
    ref = jax.jit(lambda p, t, m: llama.forward(p, t, CFG, fp8=m))
    chex.assert_trees_all_equal(
        fwd(q, ad, batch["inputs"], metas), ref(qlora.dequantize_params(q), batch["inputs"], metas)
    )

    loss = qlora.apply(lambda p, b, m: llama.loss_fn(p, b, CFG, fp8=m))

    def saved(base, names):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(
                lambda a, m: loss(base, a, batch, m), ad, fp8.init_metas(p, names, history_len=4)
            )
        return [
            ln for ln in buf.getvalue().splitlines() if not ln.endswith("from a constant")
        ]  # the closed-over frozen base itself

    weight_shapes = {
        "[{},{},{}]".format(*x.shape) for x in jax.tree.leaves(p["layers"]) if x.ndim == 3
    }
    # NF4 base: every projection is implicit. Plain bf16 base: FP8 only where LoRA is.
    for base, names in ((q, FP8_NAMES), (p, ("q_proj", "down_proj"))):
        lines = saved(base, names)
        assert any("u8[2,2,8,128]" in ln for ln in lines)  # FP8 bits of x (1 byte/element)
        for ln in lines:
            assert not any(s in ln for s in weight_shapes), ln
    # Contrast: a plain FP8 projection without LoRA (o_proj [128, 64]) is not rewritten and
    # keeps its FP8 kernel for backward, as jmem.fp8 does.
    assert any("u8[2,128,64]" in ln for ln in saved(p, ("o_proj",)))


@pytest.mark.slow
def test_fp8_remat_train_step():
    """QLoRA (NF4 base) + FP8 projections + ``train_step(remat="full")``: the builder passes
    ``frozen=`` and ``fp8=``, differentiates (adapters, metas); the loss goes down and the
    metas are replaced by their updated states every step."""
    from jmem import fp8
    from jmem import train_step

    p = llama.init(jax.random.key(0), CFG, dtype=jnp.bfloat16)
    q = qlora.quantize_params(p)
    metas = fp8.init_metas(p, FP8_NAMES, history_len=4)
    ad = lora.init(jax.random.key(2), q, modules=FP8_LORA, rank=8)
    lq = qlora.apply(lambda p, b, m: llama.loss_fn(p, b, CFG, fp8=m))

    def loss(adapters, batch, *, frozen, fp8):
        return lq(frozen, adapters, batch, fp8)

    step = train_step(loss, optax.adam(3e-3), remat="full")
    state = step.init(ad, frozen=q, fp8=metas)
    batch = _batch(b=4, s=16, key=9)
    losses, hist = [], []
    for _ in range(5):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        hist.append(jax.device_get(state.fp8["layers"]["down_proj"]["kernel"]))  # state is donated
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.05, losses
    assert int(state.step) == 5
    m1, m5 = hist[0], hist[-1]
    for t in (m5.x, m5.kernel, m5.grad):  # 4 steps of amaxes in a 4-long history
        assert np.all(t.amax_history > 0)
    assert np.all(m1.x.amax_history[:, 0] > 0) and np.all(m1.x.amax_history[:, 1:] == 0)
    assert not np.all(m5.grad.scale_inv == 1.0)  # the scales follow the data
    # The NF4 kernel amax is the same every step (frozen base): its history is constant.
    np.testing.assert_allclose(
        m5.kernel.amax_history,
        m5.kernel.amax_history[:, :1] * np.ones_like(m5.kernel.amax_history),
        rtol=0,
    )
