"""jmem.remat on the JAX code users bring: whole train steps that differentiate
inside (Flax NNX with nnx.scan, Flax linen with nn.scan, plain JAX with lax.scan), NNX state
mutated in place, unrolled layers, checkpoint names and name stacks."""

import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
import user_models

import jmem
from jmem._src import jax_compat
from jmem._src import scan_intercept

nnx = pytest.importorskip("flax.nnx")

SHAPE = dict(layers=4, hidden=32, seq=64, batch_size=2, vocab=64)


@pytest.fixture(scope="module", params=user_models.STYLES)
def model(request):
    return user_models.make(request.param, **SHAPE)


def _temp(model, where, policy="selective", **kw):
    return jmem.measure(model.step(policy, where, **kw), model.state, model.batch).temp_bytes


def _comparable(tree):
    """PRNG key arrays as their raw data, so chex can compare them."""
    is_key = lambda x: jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


@pytest.mark.slow
def test_whole_step_saves_what_the_loss_wrapped_form_saves(model):
    """jmem.remat(step) with jax.value_and_grad / nnx.value_and_grad and an AdamW update
    inside: within 5% of remat around the loss, and at most 0.6x of no remat."""
    none, loss, step = (_temp(model, w) for w in ("none", "loss", "step"))
    print(model.style, {"none": none, "loss": loss, "step": step})
    assert step <= 1.05 * loss, (step, loss)
    assert step <= 0.6 * none, (step, none)


@pytest.mark.slow
class WholeStepResultsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_whole_step_results_equal_the_plain_step(self):
        for style in user_models.STYLES:
            m = user_models.make(style, **SHAPE)
            ref = self.variant(m.step("selective", "none"))(m.state, m.batch)
            got = self.variant(m.step("selective", "step"))(m.state, m.batch)
            # AdamW divides by sqrt(v): last-bit gradient differences of the op-by-op
            # (unjitted) recomputation show up as ~1e-6 in a few parameters
            chex.assert_trees_all_close(_comparable(got), _comparable(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True])
def test_nnx_optimizer_dropout_batchnorm_state_identical_with_and_without_remat(jit):
    """optimizer.update(model, grads), nnx.Dropout's RNG counter and nnx.BatchNorm's batch
    statistics, mutated in place inside the wrapped step, come out as without remat."""
    batch = user_models.make("jax", **SHAPE).batch
    results = []
    for policy in ("none", "selective"):
        m, opt, step = user_models.nnx_step_fns(2, 32, SHAPE["vocab"], extras=True)
        f = step if policy == "none" else jmem.remat(step, policy)
        f = nnx.jit(f) if jit else f
        losses = [f(m, opt, batch) for _ in range(2)]
        assert int(opt.step[...]) == 2 and int(m.drop.rngs.count[...]) == 2
        results.append((losses, nnx.state(m), nnx.state(opt)))
    assert not jnp.allclose(results[1][1]["bn"]["mean"][...], 0.0)
    chex.assert_trees_all_close(_comparable(results[1]), _comparable(results[0]), atol=1e-6)


@pytest.mark.slow
def test_unrolled_layers_warn_that_nothing_is_saved():
    m = user_models.make("jax_unrolled", **SHAPE)
    for where in ("step", "loss"):
        with pytest.warns(UserWarning, match="no lax.scan.*nnx.scan.*linen.scan.*lax.scan"):
            jax.jit(m.step("full", where)).lower(m.state, m.batch)


def test_nnx_step_with_python_loop_layers_warns_and_keeps_state():
    """No scan and NNX state mutated in place: run as written (state advances), with a
    warning that nothing was checkpointed."""
    batch = {"x": jnp.ones((2, 8)), "y": jnp.zeros((2, 8))}

    def run(wrap):
        layers = nnx.List([nnx.Linear(8, 8, rngs=nnx.Rngs(i)) for i in range(3)])
        opt = nnx.Optimizer(layers, optax.sgd(0.1), wrt=nnx.Param)

        def step(layers, opt, batch):
            def loss_fn(layers):
                h = batch["x"]
                for layer in layers:
                    h = jnp.tanh(layer(h))
                return jnp.mean((h - batch["y"]) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(layers)
            opt.update(layers, grads)
            return loss

        return wrap(step)(layers, opt, batch), nnx.state(layers), int(opt.step[...])

    ref = run(lambda f: f)
    with pytest.warns(UserWarning, match="no lax.scan.*ran as written"):
        got = run(lambda f: jmem.remat(f, "full"))
    assert got[2] == ref[2] == 1
    chex.assert_trees_all_close(got[:2], ref[:2], atol=1e-6)


@pytest.mark.slow
def test_remat_step_around_a_remat_loss():
    """Both forms at once (e.g. jmem.remat around a step built with train_step(remat=...)):
    the inner wrapper checkpoints the scans, the outer one accepts that."""
    m = user_models.make("jax", layers=2, hidden=16, seq=8, batch_size=1, vocab=16)
    both = jmem.remat(m.step("full", "loss"), "full")
    chex.assert_trees_all_close(
        jax.jit(both)(m.state, m.batch),
        jax.jit(m.step("full", "none"))(m.state, m.batch),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.slow
def test_scanned_layers_do_not_warn():
    m = user_models.make("jax", **SHAPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        jax.jit(m.step("full", "step")).lower(m.state, m.batch)


@pytest.mark.slow
def test_names_policy_with_a_typo_lists_the_names_the_function_carries():
    m = user_models.make("jax", **SHAPE)
    with pytest.raises(ValueError, match=r"\['mlp_hiden'\].*carries \['mlp_hidden'\]"):
        jax.grad(jmem.remat(m.loss, ("mlp_hiden",)))(m.state[0], m.batch)
    with pytest.raises(ValueError, match="mlp_hiden"):  # whole step: same check
        jax.jit(m.step(("mlp_hiden",), "step")).lower(m.state, m.batch)
    ok = jax.grad(jmem.remat(m.loss, ("mlp_hidden",)))(m.state[0], m.batch)
    chex.assert_trees_all_close(ok, jax.grad(m.loss)(m.state[0], m.batch), atol=1e-6)


@pytest.mark.slow
def test_train_step_checks_checkpoint_names():
    import optax

    m = user_models.make("jax", **SHAPE)
    ts = jmem.train_step(m.loss, optax.sgd(0.1), remat=("mlp_hiden",), donate=False)
    with pytest.raises(ValueError, match="carries"):
        ts(ts.init(m.state[0]), m.batch)


@pytest.mark.slow
def test_name_stacks_survive_in_the_lowered_hlo(model):
    """Equations outside scan bodies keep their jax.named_scope names (head, ln_f)."""
    text = jax.jit(model.step("selective", "step")).lower(model.state, model.batch)
    text = text.as_text(debug_info=True)
    assert "head" in text and "ln_f" in text


def _inner_jit_loss():
    m = user_models.make("jax", **SHAPE)
    apply = jax.jit(m.loss)
    return m, apply, lambda p, b: apply(p, b)


@pytest.mark.slow
def test_jit_traced_before_remat_is_rematerialized_and_not_polluted():
    """An inner jax.jit whose trace was cached without remat is still checkpointed under
    jmem.remat, and calling it without remat afterwards saves nothing again."""
    m, apply, loss = _inner_jit_loss()
    params = m.state[0]
    jax.grad(loss)(params, m.batch)  # caches apply's trace
    plain = jmem.measure(jax.grad(loss), params, m.batch).temp_bytes
    remat = jmem.measure(jax.grad(jmem.remat(loss, "selective")), params, m.batch).temp_bytes
    after = jmem.measure(jax.grad(loss), params, m.batch).temp_bytes
    assert remat <= 0.6 * plain and after == plain, (plain, remat, after)


@pytest.mark.slow
def test_cached_jit_is_rewritten_without_trace_cache_separation(monkeypatch):
    """Where JAX cannot separate trace caches (older versions), a whole step's cached jit
    holding an unrewritten scan is re-bound with its scan checkpointed (the jit safety
    net), and stays a jit."""
    monkeypatch.setattr(scan_intercept, "_CONTEXT", {"state": None})
    m, apply, loss = _inner_jit_loss()
    params = m.state[0]
    step = jax.grad(loss)
    ref = step(params, m.batch)
    plain = jmem.measure(step, params, m.batch).temp_bytes
    remat = jmem.measure(jmem.remat(step, "selective"), params, m.batch).temp_bytes
    assert remat <= 0.6 * plain, (plain, remat)
    got = jmem.remat(step, "selective")(params, m.batch)
    chex.assert_trees_all_close(got, ref, atol=1e-6)


@pytest.mark.slow
def test_every_groups_layers_of_a_whole_step():
    m = user_models.make("jax", **SHAPE)
    loss = _temp(m, "loss", policy="none", every=2)
    step = _temp(m, "step", policy="none", every=2)
    assert step <= 1.05 * loss and step < _temp(m, "none"), (step, loss)


@pytest.mark.slow
def test_scan_that_is_not_intercepted_raises_instead_of_saving_nothing(monkeypatch):
    """If no scan can be intercepted (simulated: a JAX whose lax.scan binds elsewhere),
    jmem.remat raises rather than return a function that silently saves nothing."""
    monkeypatch.setattr(jax_compat, "scan_code", lambda: (lambda: None).__code__)
    m = user_models.make("jax", layers=2, hidden=16, seq=8, batch_size=1, vocab=16)
    with pytest.raises(RuntimeError, match="nothing would be checkpointed"):
        jax.jit(jmem.remat(jax.grad(m.loss), "full"))(m.state[0], m.batch)


def _mlp_scan_loss(p, x):
    def body(h, w):
        return h + jnp.tanh(h @ w[0]) @ w[1], None

    h, _ = jax.lax.scan(body, x, (p["w1"], p["w2"]))
    return jnp.mean(h**2)


@pytest.mark.slow
def test_gradient_accumulation_scan_in_the_step_is_rematerialized():
    """A step that scans over microbatches and takes ``value_and_grad`` inside that scan's
    body: the layer scan is differentiated inside the outer body, so it is rewritten too
    (the outer checkpoint cannot cover it). Same temporaries as remat on the loss inside,
    at most 0.6x of no remat, results equal."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {
        "w1": jax.random.normal(k1, (4, 128, 128)) * 0.05,
        "w2": jax.random.normal(k2, (4, 128, 128)) * 0.05,
    }
    xs = jax.random.normal(k3, (3, 256, 128))
    opt = optax.adamw(1e-3)

    make_step = lambda loss: user_models.grad_accumulation_step(loss, opt)

    s = opt.init(p)
    plain = make_step(_mlp_scan_loss)
    whole = jmem.remat(plain, "full")
    inner = make_step(jmem.remat(_mlp_scan_loss, "full"))

    def temp(f):
        return jax.jit(f).lower(p, s, xs).compile().memory_analysis().temp_size_in_bytes

    assert temp(whole) <= 1.05 * temp(inner)
    assert temp(whole) <= 0.6 * temp(plain)
    chex.assert_trees_all_close(jax.jit(whole)(p, s, xs), jax.jit(plain)(p, s, xs), atol=1e-6)


@pytest.mark.slow
def test_eager_call_whose_scans_ran_in_a_compiled_jit_warns():
    """An eager ``jmem.remat(jitted_step)`` call after the jitted step compiled: jit's fast
    path binds nothing, nothing is checkpointed, and jmem says so."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    p = {"w1": jax.random.normal(k1, (2, 16, 16)), "w2": jax.random.normal(k2, (2, 16, 16))}
    x = jax.random.normal(k3, (4, 16))
    jstep = jax.jit(jax.value_and_grad(_mlp_scan_loss))
    want = jstep(p, x)
    with pytest.warns(UserWarning, match="ran eagerly and no scan was bound"):
        got = jmem.remat(jstep, "full")(p, x)
    chex.assert_trees_all_close(got, want)
