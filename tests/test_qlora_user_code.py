"""QLoRA on models written without jmem in mind: Python-loop (unrolled) layers, Flax
``nn.scan`` / ``nnx.scan`` stacks with default modules, error messages naming the module
rule, and name stacks kept through the implicit-weight interpreter."""

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jmem import lora
from jmem import nf4
from jmem import qlora
from jmem._src.implicit.modules import per_layer_vectors
from jmem._src.implicit.weight import flatten_params

# ------------------------------------------------------------ unrolled vs scanned memory

L, D, B = 4, 1024, 8  # 4 layers of 1024x1024: 4 MiB per float32 layer
LAYER_BYTES = 4 * D * D


def _loop(p, x):
    for layer in p["layers"]:
        x = jnp.tanh(x @ layer["w"])
    return x


def _scan(p, x):
    x, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p["layers"]["w"])
    return x


def _abstract_params(stacked: bool):
    if stacked:
        return {"layers": {"w": jax.ShapeDtypeStruct((L, D, D), jnp.float32)}}
    return {"layers": [{"w": jax.ShapeDtypeStruct((D, D), jnp.float32)} for _ in range(L)]}


def _train_step_temp_bytes(fn, stacked: bool, quantize: bool, batched: bool = False) -> int:
    """Compiled temporaries of ``value_and_grad`` w.r.t. the adapters (abstract: nothing is
    allocated); the frozen base is an argument of the step, as in a train step."""
    base = _abstract_params(stacked)
    if quantize:
        base = jax.eval_shape(functools.partial(qlora.quantize_params, modules=r".*w"), base)
    ad = jax.eval_shape(lambda: lora.init(jax.random.key(0), base, modules=r".*w", rank=8))
    x = jax.ShapeDtypeStruct((B, 1, D) if batched else (B, D), jnp.float32)
    loss = lambda a, q, x: jnp.mean(qlora.apply(fn)(q, a, x) ** 2)
    step = jax.value_and_grad(loss)
    if batched:  # per-example gradients
        step = jax.vmap(step, in_axes=(None, None, 0))
    compiled = jax.jit(step).lower(ad, base, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_unrolled_qlora_dequantizes_one_layer_at_a_time():
    """A Python-loop model holds one dequantized layer at a time in its train step, forward
    and backward, like the same model under lax.scan (was: all 4 layers, 101% of the
    float32 base, because XLA merged the backward dequantizations with the forward ones
    and hoisted them all to the start)."""
    loop = _train_step_temp_bytes(_loop, stacked=False, quantize=True)
    scan = _train_step_temp_bytes(_scan, stacked=True, quantize=True)
    assert loop <= 1.3 * scan, (loop / 2**20, scan / 2**20)
    assert loop < 1.5 * LAYER_BYTES, loop / LAYER_BYTES


def test_lora_on_dense_unrolled_does_not_regress():
    """LoRA on a plain (unquantized) base: no dequantization, no dense temporaries."""
    loop = _train_step_temp_bytes(_loop, stacked=False, quantize=False)
    scan = _train_step_temp_bytes(_scan, stacked=True, quantize=False)
    assert loop <= 1.3 * scan and loop < 0.1 * LAYER_BYTES, (loop / 2**20, scan / 2**20)


def test_vmapped_qlora_shares_the_weight_across_examples():
    """Per-example gradients (vmap over the batch): the data dependency that orders each
    dequantization must not make the shared weight per-example (8 copies)."""
    temp = _train_step_temp_bytes(_loop, stacked=False, quantize=True, batched=True)
    assert temp < 1.5 * LAYER_BYTES, temp / LAYER_BYTES


def test_ordering_is_a_barrier_on_gpu_tpu_and_a_data_dependency_on_cpu():
    """The order of the dequantizations is chosen per platform at lowering: an
    optimization barrier where XLA keeps barriers through scheduling (GPU, TPU: no extra
    compute or communication), a popcount-zero dependency on XLA:CPU."""
    base = _abstract_params(stacked=False)
    q = jax.eval_shape(functools.partial(qlora.quantize_params, modules=r".*w"), base)
    ad = jax.eval_shape(lambda: lora.init(jax.random.key(0), q, modules=r".*w", rank=8))
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    loss = lambda a, q, x: jnp.mean(qlora.apply(_loop)(q, a, x) ** 2)
    traced = jax.jit(jax.value_and_grad(loss)).trace(ad, q, x)
    for platform, barrier in (("cpu", False), ("cuda", True), ("tpu", True)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("popcnt" not in text) == barrier, platform
        assert text.count("optimization_barrier") >= (2 * L - 1 if barrier else 0), platform


@pytest.mark.slow
def test_batch_sharded_activations_explicit_mesh():
    """Batch-sharded activations on an explicit mesh: the ordering dependency needs no
    slicing of a sharded axis; values equal the unsharded run."""
    n = min(len(jax.devices()), 4)
    if n < 2:
        pytest.skip("needs several devices")
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    q, ad, x = _small_loop_case()
    x = jnp.tile(x, (n, 1))[: 2 * n]
    f = jax.jit(jax.grad(lambda a, x: jnp.sum(qlora.apply(_loop)(q, a, x) ** 2)))
    ref = f(ad, x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("data")))
        chex.assert_trees_all_close(f(ad, xs), ref, atol=1e-5, rtol=1e-5)


def _small_loop_case():
    k = jax.random.split(jax.random.key(3), L + 1)
    p = {"layers": [{"w": jax.random.normal(k[i], (64, 64)) * 0.2} for i in range(L)]}
    q = qlora.quantize_params(p, modules=r".*w")
    ad = lora.init(jax.random.key(4), q, modules=r".*w", rank=4)
    ad = jax.tree.map(lambda a: a + 0.05, ad)  # b != 0: the low-rank path matters
    return q, ad, jax.random.normal(k[-1], (5, 64))


class UnrolledNumericsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_loss_and_grads_equal_dequantized_merged(self):
        q, ad, x = _small_loop_case()
        deq = qlora.dequantize_params(q)
        loss = lambda a: jnp.mean(qlora.apply(_loop)(q, a, x) ** 2)
        loss_ref = lambda a: jnp.mean(_loop(lora.merge(deq, a), x) ** 2)
        value, g = self.variant(jax.value_and_grad(loss))(ad)
        value_ref, g_ref = jax.value_and_grad(loss_ref)(ad)
        chex.assert_trees_all_close(value, value_ref, rtol=1e-5)
        chex.assert_trees_all_close(g, g_ref, atol=1e-6, rtol=1e-4)

    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_per_example_grads_equal_reference(self):
        q, ad, x = _small_loop_case()
        deq = qlora.dequantize_params(q)
        grad = jax.grad(lambda a, x: jnp.sum(qlora.apply(_loop)(q, a, x) ** 2))
        grad_ref = jax.grad(lambda a, x: jnp.sum(_loop(lora.merge(deq, a), x) ** 2))
        g = self.variant(jax.vmap(grad, in_axes=(None, 0)))(ad, x)
        g_ref = jax.vmap(grad_ref, in_axes=(None, 0))(ad, x)
        chex.assert_trees_all_close(g, g_ref, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------ Flax nn.scan / nnx.scan

NL, H = 3, 32


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        gain = self.param("gain", nn.initializers.ones, (H,))  # [NL, H] once stacked
        h = nn.Dense(64, name="fc1")(nn.LayerNorm(name="ln1")(x) * gain)
        return x + nn.Dense(H, name="fc2")(nn.gelu(h)), None


class _LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            _LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=NL
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(8, name="head")(nn.LayerNorm(name="ln_f")(x))


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(H, rngs=rngs)
        self.gain = nnx.Param(jnp.ones((H,)))
        self.fc1 = nnx.Linear(H, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, H, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(nnx.gelu(self.fc1(self.ln1(x) * self.gain)))


class _NnxModel(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=NL)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _NnxBlock(rngs)

        self.blocks = make(rngs)
        self.ln_f = nnx.LayerNorm(H, rngs=rngs)
        self.head = nnx.Linear(H, 8, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.head(self.ln_f(body(x, self.blocks)))


def _flax_model(kind):
    """(params, fn(params, x), path prefix of the stacked blocks)."""
    x = jnp.ones((4, H))
    if kind == "linen":
        model = _LinenModel()
        return jax.jit(model.init)(jax.random.key(0), x), model.apply, "params/blocks"
    graphdef, state = nnx.split(_NnxModel(nnx.Rngs(0)))
    return state, lambda s, x: nnx.merge(graphdef, s)(x), "blocks"


def _nf4_paths(tree):
    return {p for p, x in flatten_params(tree)[0] if isinstance(x, nf4.NF4Array)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_default_modules_on_scanned_flax_model_train(kind):
    """Default modules quantize the stacked kernels and the head, never a norm scale or a
    per-layer vector ([NL, H] looks like a matrix); training the adapters works."""
    params, fn, blocks = _flax_model(kind)
    flat = flatten_params(params)[0]
    assert {p for p, _ in flat} >= {f"{blocks}/ln1/scale", f"{blocks}/gain"}
    assert per_layer_vectors(flat) == {
        f"{blocks}/{n}" for n in ("ln1/scale", "ln1/bias", "gain", "fc1/bias", "fc2/bias")
    }
    q = qlora.quantize_params(params)
    head = blocks.replace("blocks", "head")
    assert _nf4_paths(q) == {f"{blocks}/fc1/kernel", f"{blocks}/fc2/kernel", f"{head}/kernel"}

    ad = lora.init(jax.random.key(1), q, modules=r".*fc\d/kernel", rank=4)
    x = jax.random.normal(jax.random.key(2), (16, H))
    y = jax.random.normal(jax.random.key(3), (16, 8))
    loss = lambda a: jnp.mean((qlora.apply(fn)(q, a, x) - y) ** 2)
    opt = optax.adam(1e-2)
    state = opt.init(ad)

    @jax.jit
    def step(ad, state):
        value, g = jax.value_and_grad(loss)(ad)
        updates, state = opt.update(g, state, ad)
        return optax.apply_updates(ad, updates), state, value

    losses = []
    for _ in range(5):
        ad, state, value = step(ad, state)
        losses.append(float(value))
    assert losses[-1] < losses[0], losses


def test_exclude_names():
    excluded = ["ln1/scale", "model/ln_f/kernel", "blocks/lnf/w", "x/norm1/w", "a/scale"]
    kept = ["blocks/fc1/kernel", "mlp/linear/kernel", "attn/upscale_proj/kernel"]
    leaf = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    assert not any(qlora.default_modules(p, leaf) for p in excluded)
    assert all(qlora.default_modules(p, leaf) for p in kept)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_error_names_the_users_module_rule(kind):
    """A user regex that picks a stacked norm scale: the error names the weight, says the
    users' modules= chose it (not the default rule) and how to change it."""
    params, fn, blocks = _flax_model(kind)
    q = qlora.quantize_params(params, modules=r".*(kernel|ln1/scale)")
    with pytest.raises(qlora.ImplicitWeightError) as info:
        qlora.apply(fn)(q, None, jnp.ones((4, H)))
    msg = str(info.value)
    assert f"'{blocks}/ln1/scale'" in msg and "non-stacked axis" in msg
    assert "default rule would not pick it" in msg
    assert "the modules= selection passed to qlora.quantize_params" in msg


@pytest.mark.slow
def test_error_names_the_default_rules():
    w = jax.random.normal(jax.random.key(0), (32, 32))
    x = jnp.ones((2, 32))
    q = qlora.quantize_params({"w": w})
    with pytest.raises(qlora.ImplicitWeightError, match=r"'w'.*'reduce_sum'.*default rule picks"):
        qlora.apply(lambda p, x: x * jnp.sum(p["w"]))(q, None, x)
    p = {"q_proj": w, "w": w}
    ad = lora.init(jax.random.key(1), p)  # lora.DEFAULT_MODULES picks q_proj
    with pytest.raises(qlora.ImplicitWeightError, match=r"default modules \(lora.DEFAULT_MODULES"):
        lora.apply(lambda p, x: x * jnp.sum(p["q_proj"]))(p, ad, x)
    ad = lora.init(jax.random.key(1), p, modules="w")
    with pytest.raises(qlora.ImplicitWeightError, match=r"modules= selection passed to lora"):
        lora.apply(lambda p, x: x * jnp.sum(p["w"]))(p, ad, x)


# ------------------------------------------------------------ name stacks


def _scoped_model(p, x):
    for i in range(2):
        with jax.named_scope(f"block{i}"):
            x = jnp.tanh(x @ p["stack"][i])
    with jax.named_scope("scanned"):
        x, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, p["stack"])
    with jax.named_scope("ln_f"):
        x = x * p["ln_f"]
    with jax.named_scope("head"):
        return jax.jit(lambda x, w: x @ w)(x, p["head"])


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_name_stacks_survive_the_interpreter(grad):
    """jax.named_scope names (incl. around a scan and an inlined jit) reach the lowered
    HLO's locations of a qlora.apply'd function, forward and backward."""
    k = jax.random.split(jax.random.key(0), 2)
    p = {
        "stack": jax.random.normal(k[0], (2, 32, 32)) * 0.1,
        "head": jax.random.normal(k[1], (32, 16)) * 0.1,
        "ln_f": jnp.ones((32,)),
    }
    q = qlora.quantize_params(p, modules="stack|head")
    ad = lora.init(jax.random.key(2), q, modules="stack|head", rank=4)
    x = jnp.ones((4, 32))
    f = qlora.apply(_scoped_model)
    if grad:
        fn = jax.grad(lambda a: jnp.sum(f(q, a, x)))
    else:
        fn = lambda a: f(q, a, x)
    text = jax.jit(fn).lower(ad).as_text(debug_info=True)
    for name in ("block0", "block1", "scanned", "ln_f", "head"):
        assert re.search(rf"[/(]{name}[/)]", text), name
