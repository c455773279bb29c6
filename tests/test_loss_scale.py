"""Loss scales: dynamic-scale semantics, every field surviving pytree ops/jit/orbax, fp16."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jmem._src.loss_scale import DynamicLossScale
from jmem._src.loss_scale import NoOpLossScale
from jmem._src.loss_scale import StaticLossScale
from jmem._src.loss_scale import all_finite
from jmem._src.loss_scale import loss_scale_from_name
from jmem._src.loss_scale import select_tree

_FIELDS = ("loss_scale", "period", "factor", "min_loss_scale", "counter")


def _reference(flags, scale, period, factor, min_scale, counter=0):
    """Pure-Python model of the documented semantics (float32 arithmetic, as documented for
    the scale); returns [(scale, counter)] per step."""
    out = []
    for finite in flags:
        if finite:
            counter += 1
            if counter >= period:
                counter = 0
                with np.errstate(over="ignore"):
                    grown = np.float32(scale) * np.float32(factor)
                if np.isfinite(grown):
                    scale = grown
        else:
            counter = 0
            scale = max(np.float32(min_scale), np.float32(scale) / np.float32(factor))
        out.append((scale, counter))
    return out


@jax.jit
@chex.assert_max_traces(n=1)
def _run(ls, flags):
    """Runs `adjust` over `flags` in a lax.scan (the loss scale is the scan carry). Traced
    once for all hyper-parameters: they are leaves, so changing them does not recompile."""

    def body(carry, f):
        new = carry.adjust(f)
        return new, (new.loss_scale, new.counter)

    return jax.lax.scan(body, ls, flags)


@pytest.mark.parametrize(
    "seed, p_finite, scale, period, factor, min_scale",
    [
        (0, 0.9, 2.0**15, 5, 2, 1.0),
        (1, 0.6, 2.0**4, 3, 2, 4.0),  # min_loss_scale above 1 is reached often
        (2, 0.97, 2.0**100, 2, 16, 2.0**-3),  # growth saturates near float32 max
        (3, 0.8, 3.0, 4, 3, 0.5),  # non-power-of-two factor
        (4, 0.95, 1.0, 1, 2, 1.0),  # period 1: grow on every finite step
    ],
)
def test_dynamic_matches_reference_model(seed, p_finite, scale, period, factor, min_scale):
    flags = np.random.default_rng(seed).random(600) < p_finite
    ls = DynamicLossScale(scale, period=period, factor=factor, min_loss_scale=min_scale)
    final, (scales, counters) = _run(ls, jnp.asarray(flags))
    ref = _reference(flags.tolist(), np.float32(scale), period, factor, np.float32(min_scale))
    np.testing.assert_array_equal(np.asarray(counters), [c for _, c in ref])
    np.testing.assert_array_equal(np.asarray(scales), np.array([s for s, _ in ref], np.float32))
    # The hyper-parameters come out of the scan unchanged.
    assert int(final.period) == period and float(final.factor) == factor
    assert float(final.min_loss_scale) == np.float32(min_scale)
    assert min(np.asarray(scales)) >= np.float32(min_scale) or scale < min_scale


def test_dynamic_growth_never_overflows_float32():
    ls = DynamicLossScale(2.0**127, period=1)
    ls = ls.adjust(jnp.array(True))
    assert float(ls.loss_scale) == 2.0**127 and int(ls.counter) == 0
    assert ls.loss_scale.dtype == jnp.float32


@pytest.mark.slow
def test_agrees_with_jmp_when_min_loss_scale_is_one():
    jmp = pytest.importorskip("jmp")
    flags = np.random.default_rng(7).random(400) < 0.85
    ours = DynamicLossScale(2.0**10, period=4, factor=2)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**10), period=4, factor=2)
    for f in flags:
        ours, theirs = ours.adjust(jnp.asarray(f)), theirs.adjust(jnp.asarray(f))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.counter) == int(theirs.counter)


def test_jmp_drops_min_loss_scale_under_jit_and_we_do_not():
    jmp = pytest.importorskip("jmp")
    overflow = jnp.array(False)
    adjust_many = jax.jit(lambda ls: jax.lax.fori_loop(0, 10, lambda i, l: l.adjust(overflow), ls))
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=jnp.float32(2.0**6))
    # jmp: eager adjust respects the floor ...
    eager = theirs
    for _ in range(10):
        eager = eager.adjust(overflow)
    assert float(eager.loss_scale) == 2.0**6
    # ... but its pytree flattening drops min_loss_scale, so jit resets it to 1.
    assert float(jax.jit(lambda l: l)(theirs).min_loss_scale) == 1.0
    assert float(adjust_many(theirs).loss_scale) == 1.0
    # Ours keeps the floor through jit and the fori_loop carry.
    ours = DynamicLossScale(2.0**10, min_loss_scale=2.0**6)
    assert float(jax.jit(lambda l: l)(ours).min_loss_scale) == 2.0**6
    assert float(adjust_many(ours).loss_scale) == 2.0**6


def _assert_same_fields(a, b):
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype, f
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f)


class JitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_every_field_survives_identity_and_adjust(self):
        ls = DynamicLossScale(2.0**9, period=3, factor=4, min_loss_scale=8.0, counter=2)
        _assert_same_fields(self.variant(lambda l: l)(ls), ls)
        grown = self.variant(lambda l: l.adjust(jnp.array(True)))(ls)
        expected = DynamicLossScale(2.0**11, period=3, factor=4, min_loss_scale=8.0, counter=0)
        _assert_same_fields(grown, expected)

        def shrink4(l):  # 512 -> 128 -> 32 -> 8 -> max(8, 2) = 8: the floor holds.
            for _ in range(4):
                l = l.adjust(jnp.array(False))
            return l

        shrunk = self.variant(shrink4)(ls)
        _assert_same_fields(shrunk, dataclasses.replace(expected, loss_scale=8.0))

    @chex.variants(with_jit=True, without_jit=True)
    def test_static_and_noop_survive(self):
        st = self.variant(lambda l: l.adjust(jnp.array(False)))(StaticLossScale(128.0))
        assert isinstance(st, StaticLossScale) and float(st.loss_scale) == 128.0
        noop = self.variant(lambda l: l.adjust(jnp.array(False)))(NoOpLossScale())
        assert isinstance(noop, NoOpLossScale) and float(noop.loss_scale) == 1.0


def test_flattening_names_every_dataclass_field():
    """jmp's bug was a field left out of flattening: every field must be a keyed leaf."""
    for ls in (DynamicLossScale(), StaticLossScale(4.0), NoOpLossScale()):
        paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
        assert paths == [f".{f.name}" for f in dataclasses.fields(ls)]


def test_every_field_survives_pytree_operations():
    ls = DynamicLossScale(2.0**9, period=3, factor=4, min_loss_scale=8.0, counter=2)
    # scan stacks the loss scales it outputs: arrays of shape [2] are stored as they are.
    _, stacked = jax.lax.scan(lambda c, f: (c.adjust(f), c), ls, jnp.array([True, False]))
    _assert_same_fields(jax.tree.map(lambda x: x[0], stacked), ls)
    batched = jax.vmap(lambda l: l.adjust(jnp.array(True)))(
        jax.tree.map(lambda x: jnp.stack([x, x]), ls)
    )
    _assert_same_fields(jax.tree.map(lambda x: x[1], batched), ls.adjust(jnp.array(True)))
    abstract = jax.eval_shape(lambda l: l.adjust(jnp.array(True)), ls)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)] == [
        ((), jnp.asarray(getattr(ls, f)).dtype) for f in _FIELDS
    ]
    assert jax.tree.leaves(jax.tree.map(lambda x: None, ls)) == []
    mask = jax.tree.map(lambda x: x.dtype == jnp.float32, ls)  # bools stay bools
    assert jax.tree.leaves(mask) == [True, False, True, True, False]
    on_host = jax.device_get(ls)  # NumPy leaves stay NumPy
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(on_host))
    _assert_same_fields(on_host, ls)
    grads = jax.grad(lambda l: l.loss_scale * 2, allow_int=True)(ls)  # float0 for ints
    assert float(grads.loss_scale) == 2.0 and grads.period.dtype == jax.dtypes.float0


def test_orbax_round_trip(tmp_path):
    state = {
        "dynamic": DynamicLossScale(2.0**9, period=3, factor=4, min_loss_scale=8.0, counter=2),
        "static": StaticLossScale(64.0),
        "noop": NoOpLossScale(),
    }
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
    # Restore onto a target with different values: every field comes from the checkpoint.
    target = {
        "dynamic": DynamicLossScale(),
        "static": StaticLossScale(1.0),
        "noop": NoOpLossScale(),
    }
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, target)
        raw = ckptr.restore(path)  # no target: plain dicts, but nothing is lost
    assert isinstance(restored["dynamic"], DynamicLossScale)
    _assert_same_fields(restored["dynamic"], state["dynamic"])
    assert float(restored["static"].loss_scale) == 64.0
    assert isinstance(restored["noop"], NoOpLossScale)
    assert {k: float(v) for k, v in raw["dynamic"].items()} == {
        "loss_scale": 512.0,
        "period": 3,
        "factor": 4.0,
        "min_loss_scale": 8.0,
        "counter": 2,
    }


def test_scale_unscale_dtypes_and_values():
    ls = DynamicLossScale(2.0**15)
    loss16 = jnp.float16(3.0)
    scaled = ls.scale(loss16)
    # 3 * 2**15 overflows float16 (max 65504) but the scaled loss is float32.
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2**15
    grads = {
        "h": jnp.array([60000.0, 2.0**-10], jnp.float16),
        "f": jnp.array([1.5], jnp.float32),
        "i": jnp.array([7], jnp.int32),
    }
    un = ls.unscale(grads)
    assert un["h"].dtype == jnp.float16 and un["f"].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(un["h"]), np.array([60000.0 / 2**15, 2.0**-25], np.float16)
    )
    assert un["i"] is grads["i"]
    chex.assert_trees_all_close(
        StaticLossScale(4.0).unscale(StaticLossScale(4.0).scale(grads)), grads
    )
    assert NoOpLossScale().scale(grads) is grads


@pytest.mark.slow
def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16), "i": jnp.arange(3)}
    assert bool(all_finite(good)) and bool(all_finite({}))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        t = dict(good, b=good["b"].at[1, 0].set(bad))
        assert not bool(all_finite(t)) and not bool(jax.jit(all_finite)(t))
    other = jax.tree_util.tree_map(lambda x: x + 1, good)
    chex.assert_trees_all_equal(select_tree(jnp.array(True), good, other), good)
    chex.assert_trees_all_equal(jax.jit(select_tree)(jnp.array(False), good, other), other)
    with pytest.raises(ValueError, match="scalar"):
        select_tree(jnp.array([True]), good, other)
    with pytest.raises(TypeError, match="boolean"):
        select_tree(jnp.array(1), good, other)
    with pytest.raises(ValueError, match="same structure"):
        select_tree(jnp.array(True), good, {"a": good["a"]})


def test_validation_and_from_name():
    with pytest.raises(ValueError, match="positive"):
        DynamicLossScale(0.0)
    with pytest.raises(ValueError, match="period"):
        DynamicLossScale(period=0)
    with pytest.raises(ValueError, match="factor"):
        DynamicLossScale(factor=0.5)
    with pytest.raises(ValueError, match="scalar"):
        DynamicLossScale(jnp.ones(2))
    with pytest.raises(ValueError, match="positive"):
        StaticLossScale(-1.0)
    with pytest.raises(ValueError, match="scalar"):
        DynamicLossScale().adjust(jnp.array([True, False]))
    with pytest.raises(TypeError, match="boolean"):
        DynamicLossScale().adjust(jnp.array(1.0))
    assert isinstance(loss_scale_from_name("Dynamic", period=10), DynamicLossScale)
    assert float(loss_scale_from_name("static", loss_scale=8.0).loss_scale) == 8.0
    assert isinstance(loss_scale_from_name("none"), NoOpLossScale)
    with pytest.raises(ValueError, match="valid names are"):
        loss_scale_from_name("auto")
    ls = DynamicLossScale(jnp.float16(1024.0), counter=jnp.int16(1))
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32


# fp16 underflow: a loss whose backward pass carries ~1e-8 cotangents through float16.
_X = jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)
_TINY = 5e-9


def _loss(w32):
    h = w32.astype(jnp.float16) * _X.astype(jnp.float16)  # float16 compute
    return _TINY * jnp.sum(h.astype(jnp.float32) ** 2)  # float32 output / loss


def _scaled_grads(ls, w):
    grads = jax.grad(lambda p: ls.scale(_loss(p)))(w)
    return ls.unscale(grads)


def test_fp16_small_gradients_vanish_without_scaling_and_survive_with_it():
    w = jnp.linspace(0.5, 1.0, 8, dtype=jnp.float32)
    true = jax.grad(lambda p: _TINY * jnp.sum((p * _X) ** 2))(w)  # float32 reference
    # ~1e-8: below 2**-25, the smallest magnitude float16 does not round to zero.
    assert 1e-9 < float(jnp.max(jnp.abs(true))) < 2.0**-25
    unscaled = jax.grad(_loss)(w)
    assert float(jnp.max(jnp.abs(unscaled))) == 0.0  # all flushed to zero
    # Dynamic scaling, started too high on purpose: overflowing steps shrink the scale
    # until the fp16 backward pass is finite, then the gradients match float32.
    ls = DynamicLossScale(2.0**50, period=1000)
    step = jax.jit(lambda ls: (_scaled_grads(ls, w),))
    for _ in range(40):
        (grads,) = step(ls)
        finite = all_finite(grads)
        ls = ls.adjust(finite)
        if bool(finite):
            break
    assert bool(finite)
    assert float(ls.loss_scale) < 2.0**50  # it had to back off
    print(f"fp16 loss scale settled at 2**{math.log2(float(ls.loss_scale)):.0f}")
    chex.assert_trees_all_close(grads, true, rtol=2e-3)
