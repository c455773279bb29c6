"""The structure of the programs ``jmem.remat`` builds, for each model style users
bring: exactly one checkpoint per scan body (never a checkpoint inside a checkpoint), the
user's ``jax.jit`` calls kept, and name scopes not doubled. These assert on the jaxpr, so the
``remat2`` drift (a checkpointed body counted as unchecked and checkpointed again) fails here.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
import user_models
from jax.extend import core as jcore

import jmem
from jmem import lora
from jmem import qlora
from jmem._src import jaxpr as core
from jmem.models import llama

TINY = dict(layers=2, hidden=32, seq=8, batch_size=1, vocab=16)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def checkpoint_depth(jaxpr) -> int:
    """The deepest nesting of checkpoint equations with no scan between them (2 = a scan
    body checkpointed twice); a scan body starts a new count."""
    return _depths(jaxpr)[1]


def _depths(jaxpr) -> tuple[int, int]:
    """(nesting reaching this jaxpr's top without crossing a scan, deepest anywhere)."""
    chain = best = 0
    for eqn in jaxpr.eqns:
        subs = [_depths(s) for s in jcore.jaxprs_in_params(eqn.params)]
        best = max(best, *(b for _, b in subs)) if subs else best
        if core.kind(eqn) != core.SCAN:
            here = max((c for c, _ in subs), default=0) + core.is_checkpoint(eqn)
            chain, best = max(chain, here), max(best, here)
    return chain, best


def checkpoints_per_scan_body(jaxpr) -> list[int]:
    """For each outermost scan whose body holds a matmul: the number of checkpoint equations
    at the top of its body."""
    found = []
    for eqn in jaxpr.eqns:
        if core.kind(eqn) == core.SCAN:
            body = eqn.params["jaxpr"].jaxpr
            if any(e.primitive.name == "dot_general" for e in _eqns(body)):
                found.append(sum(core.is_checkpoint(e) for e in body.eqns))
            continue
        for sub in jcore.jaxprs_in_params(eqn.params):
            found += checkpoints_per_scan_body(sub)
    return found


def jit_names(jaxpr) -> set[str]:
    """The names of the jit calls (a recomputed body repeats its jits, so a set)."""
    return {str(e.params.get("name")) for e in _eqns(jaxpr) if core.kind(e) == core.CALL}


def doubled_scopes(jaxpr) -> set[str]:
    """Name stacks with a scope repeated next to itself (``blocks/blocks``, ``head/head``)."""
    out = set()
    for eqn in _eqns(jaxpr):
        parts = str(eqn.source_info.name_stack).split("/")
        if any(a == b and a for a, b in zip(parts, parts[1:])):
            out.add(str(eqn.source_info.name_stack))
    return out


def scopes(jaxpr) -> set[str]:
    return {p for e in _eqns(jaxpr) for p in str(e.source_info.name_stack).split("/")}


def assert_structure(remat_fn, plain_fn, *args, forward=True):
    """``remat_fn``'s program: one checkpoint per layer scan, no nesting, jits and scopes as
    in ``plain_fn``'s. ``forward``: the program is not differentiated, so every outermost
    layer scan body carries exactly one checkpoint."""
    got = jax.make_jaxpr(remat_fn)(*args).jaxpr
    ref = jax.make_jaxpr(plain_fn)(*args).jaxpr
    assert checkpoint_depth(got) == 1, f"a checkpoint inside a checkpoint:\n{got}"
    if forward:
        per_scan = checkpoints_per_scan_body(got)
        assert per_scan and all(n == 1 for n in per_scan), per_scan
    assert jit_names(got) == jit_names(ref), (jit_names(got), jit_names(ref))
    assert doubled_scopes(got) <= doubled_scopes(ref), doubled_scopes(got) - doubled_scopes(ref)
    missing = {s for s in ("head", "ln_f") if s in scopes(ref)} - scopes(got)
    assert not missing, f"name scopes lost: {missing}"
    return got


@pytest.mark.slow
@pytest.mark.parametrize("style", user_models.STYLES)
@pytest.mark.parametrize("where", ["loss", "step"])
def test_user_models_checkpoint_each_layer_once(style, where):
    """NNX nnx.scan, linen nn.scan and plain lax.scan; remat around the loss or the step."""
    m = user_models.make(style, **TINY)
    assert_structure(m.step("full", where), m.step("none", "none"), m.state, m.batch, forward=False)


@pytest.mark.slow
@pytest.mark.parametrize("style", user_models.STYLES)
def test_forward_of_each_style_has_one_checkpoint_per_scan_body(style):
    m = user_models.make(style, **TINY)
    state = m.state if style == "nnx" else m.state[0]  # the loss's first argument
    assert_structure(jmem.remat(m.loss, "full"), m.loss, state, m.batch)


def _stacked(key=0, layers=3, d=16):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {"w": jax.random.normal(k1, (layers, d, d)) / 4}, jax.random.normal(k2, (2, d))


def _fori_loss(p, x):
    def body(i, h):
        with jax.named_scope("block"):
            return jnp.tanh(h @ p["w"][i])

    return jnp.sum(jax.lax.fori_loop(0, p["w"].shape[0], body, x) ** 2)


def _scan_loss(p, x, step_transform=lambda f: f):
    def step(h, w):
        with jax.named_scope("block"):
            return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(step_transform(step), x, p["w"])
    with jax.named_scope("head"):
        return jnp.sum(h**2)


_jitted_scan_loss = jax.jit(_scan_loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss",
    [
        _fori_loss,
        _scan_loss,
        lambda p, x: _jitted_scan_loss(p, x),
        lambda p, x: _scan_loss(p, x, jax.checkpoint),  # body checkpointed by the user
    ],
    ids=["fori_loop", "lax.scan", "jitted_scan", "user_checkpointed"],
)
def test_plain_jax_loops_checkpoint_each_layer_once(loss):
    p, x = _stacked()
    assert_structure(jmem.remat(loss, "full"), loss, p, x)
    step = jax.value_and_grad(loss)
    assert_structure(jmem.remat(step, "full"), step, p, x, forward=False)
    assert_structure(jax.grad(jmem.remat(loss, "full")), step, p, x, forward=False)


@pytest.mark.slow
def test_jitted_scan_traced_before_is_kept_a_jit_with_one_checkpoint():
    """The drift this guards against: a jit cached before remat ran held a checkpointed body under
    the ``remat2`` name, was counted unchecked, inlined and checkpointed twice."""
    p, x = _stacked()
    _jitted_scan_loss(p, x)  # caches the trace
    loss = lambda p, x: _jitted_scan_loss(p, x)
    got = assert_structure(jmem.remat(loss, "full"), loss, p, x)
    assert "_scan_loss" in jit_names(got)


@pytest.mark.slow
def test_qlora_loss_of_the_main_job_checkpoints_each_layer_once():
    """The reference Llama's loss through the implicit NF4/LoRA interpreter, remat around it
    as ``jmem.train_step(remat=...)`` does."""
    import helpers

    cfg = helpers.small_config()
    q = qlora.quantize_params(llama.init(jax.random.key(0), cfg))
    ad = lora.init(jax.random.key(1), q, modules=r"layers/.*_proj/kernel", rank=4)
    batch = helpers.token_batch(cfg, 1, 8)
    loss = lambda ad, b: qlora.apply(lambda p, b: llama.loss_fn(p, b, cfg))(q, ad, b)
    assert_structure(jmem.remat(loss, "full"), loss, ad, batch)
    step = jax.grad(jmem.remat(loss, "full"))
    assert_structure(step, jax.grad(loss), ad, batch, forward=False)


@pytest.mark.slow
def test_gradient_accumulation_scan_inside_the_step_checkpoints_each_layer_once():
    p, xs = _stacked()
    xs = jnp.stack([xs, xs])
    opt = optax.sgd(0.1)

    step = user_models.grad_accumulation_step(_scan_loss, opt)
    got = assert_structure(jmem.remat(step, "full"), step, p, opt.init(p), xs, forward=False)
    assert checkpoint_depth(got) == 1


def test_remat2_is_a_checkpoint_in_the_one_primitive_table():
    """The name ``jax.checkpoint`` binds today is in the table (``remat2`` on JAX 0.10)."""
    eqn = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).jaxpr.eqns[0]
    assert core.is_checkpoint(eqn), eqn.primitive.name
    assert {"checkpoint", "remat", "remat2"} <= core.names_of(core.CHECKPOINT)


@pytest.mark.slow
def test_remat_loss_nested_in_a_remat_step_checkpoints_each_layer_once():
    """The inner loss rewrite runs with the outer step's hook paused: no double checkpoint."""
    p, x = _stacked()
    inner = lambda p, x: jax.value_and_grad(jmem.remat(_scan_loss, "full"))(p, x)
    assert_structure(jmem.remat(inner, "full"), jax.value_and_grad(_scan_loss), p, x, forward=False)


@pytest.mark.parametrize("nest", ["once", "nested", "jit_nested"])
def test_full_remat_of_bf16_carries_wraps_each_scan_body_once(nest):
    """``full`` remat of a scan with bfloat16 carries replaces the body by one custom VJP that
    saves the carry as uint16 bits (``remat_bits``), never a checkpoint as well, and remat
    around an already remat'd loss (plain or jitted) does not wrap it again: the backward pass
    recomputes each layer once."""
    ws = jnp.ones((3, 8, 8), jnp.bfloat16)

    def loss(x):
        c, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)
        return jnp.sum(c.astype(jnp.float32))

    f = jmem.remat(loss, "full")
    f = {"once": f, "nested": jmem.remat(f, "full"), "jit_nested": jmem.remat(jax.jit(f), "full")}
    x = jnp.ones((2, 8), jnp.bfloat16)
    fwd = jax.make_jaxpr(f[nest])(x).jaxpr
    names = [e.primitive.name for e in _eqns(fwd)]
    assert sum(core.is_custom(e) for e in _eqns(fwd)) == 1, names
    assert checkpoint_depth(fwd) == 0, names
    assert str(jax.make_jaxpr(jax.grad(f[nest]))(x)).count("tanh") == 2  # forward + one recompute
