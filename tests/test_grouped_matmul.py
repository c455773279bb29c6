"""jmem._src.grouped_matmul: equal to jax.lax.ragged_dot (values and gradients), its tile
rule, and the interpreter's rule for its call (NF4 experts with LoRA)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmem._src import grouped_matmul as gmm


def _loss(f, x, w, sizes):
    return jnp.sum(jnp.sin(f(x, w, sizes)))


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_ragged_dot_values_and_gradients(seed, transpose):
    """Random group sizes with empty groups, groups spanning several 8-row tiles, and rows
    past the groups (zeros): product and both gradients equal ``ragged_dot``'s, float32."""
    m, k, n, e = 83, 6, 5, 7
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(m - 3, rng.dirichlet(np.ones(e) * 0.5))
    sizes[rng.integers(e)] = 0
    sizes = jnp.asarray(sizes, jnp.int32)
    assert int(sizes.max()) > gmm.tile_rows(m, e)  # a group larger than a tile
    x = jax.random.normal(jax.random.key(seed), (m, k), jnp.float32)
    w = jax.random.normal(jax.random.key(seed + 10), (e, n, k) if transpose else (e, k, n))

    def ref(x, w, sizes):
        return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose else w, sizes)

    got_f = functools.partial(gmm.grouped_matmul, transpose_rhs=transpose)
    np.testing.assert_allclose(got_f(x, w, sizes), ref(x, w, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got_f(x, w, sizes)[m - 3 :], 0)
    got = jax.grad(functools.partial(_loss, got_f), argnums=(0, 1))(x, w, sizes)
    want = jax.grad(functools.partial(_loss, ref), argnums=(0, 1))(x, w, sizes)
    for g, wg in zip(got, want):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-5)


def test_all_rows_in_one_group_and_bfloat16_output_type():
    """One group holding every row; bfloat16 operands with a float32 output type."""
    m, k, n, e = 40, 8, 4, 5
    sizes = jnp.array([0, 0, 40, 0, 0], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (m, k)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (e, k, n)).astype(jnp.bfloat16)
    got = gmm.grouped_matmul(x, w, sizes, preferred_element_type=jnp.float32)
    want = jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_tile_rule_pads_at_most_the_fraction_and_stays_in_bounds():
    """Qwen3-30B-A3B at 4,096 tokens (32,768 rows, 128 experts): 16-row tiles (6.25%);
    Mixtral (8,192 rows, 8 experts): 64; too few rows: the 8-row floor; a cap of 512."""
    assert gmm.tile_rows(32768, 128) == 16
    assert gmm.tile_rows(8192, 8) == 64
    assert gmm.tile_rows(100, 16) == gmm.MIN_TILE
    assert gmm.tile_rows(1 << 24, 2) == gmm.MAX_TILE
    for rows, e in ((32768, 128), (8192, 8), (2048, 16)):
        assert e * gmm.tile_rows(rows, e) <= gmm.PAD_FRACTION * rows


def test_bad_shapes_are_refused():
    x = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match="lhs \\[M, K\\], rhs \\[E, K, N\\]"):
        gmm.grouped_matmul(x, jnp.zeros((2, 4, 5)), jnp.array([2, 2]))


def test_gradients_reach_expert_adapters_and_not_the_frozen_nf4_codes():
    """QLoRA over routed experts: the adapters' gradients equal those of the same loss with
    the dequantized experts and ``ragged_dot`` (a float reference), are nonzero for every
    expert's factors, and the NF4 base is not differentiated (lora.apply's value and grad
    take the adapters only; the packed codes are integer)."""
    from jmem import lora  # noqa: PLC0415
    from jmem import qlora  # noqa: PLC0415
    from jmem._src import moe  # noqa: PLC0415

    e, h, f, k, t = 4, 16, 32, 2, 64
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = {"expert_gate": (e, h, f), "expert_up": (e, h, f), "expert_down": (e, f, h)}
    base = {
        n: {"kernel": 0.2 * jax.random.normal(kk, s)} for kk, (n, s) in zip(keys, shapes.items())
    }
    base = qlora.quantize_params(base, modules=lambda path, leaf: True)
    ad = lora.init(keys[3], base, rank=2, modules=tuple(shapes))
    ad = jax.tree.map(lambda a: a + 0.05, ad)
    router, x = jax.random.normal(keys[4], (h, e)), jax.random.normal(keys[5], (t, h))

    def fn(p):
        kern = [p[n]["kernel"] for n in shapes]
        return jnp.sum(moe.routed_experts(x, router, *kern, top_k=k, norm_topk_prob=True)[0] ** 2)

    got = jax.grad(lambda ad: lora.apply(fn)(base, ad))(ad)
    dense = qlora.dequantize_params(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_grouped", jax.lax.ragged_dot)
        want = jax.grad(lambda ad: fn(lora.merge(dense, ad)))(ad)

    def close(g, w):  # float32 rounding of the merged weights, relative to the largest
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))))

    jax.tree.map(close, got, want)
    leaves = jax.tree.leaves(got)
    assert leaves and all(jnp.issubdtype(g.dtype, jnp.floating) for g in leaves)
    for g in leaves:
        assert bool(jnp.all(jnp.any(g != 0, axis=tuple(range(1, g.ndim))))), g.shape
    nf4_leaves = [v for v in jax.tree.leaves(base) if not jnp.issubdtype(v.dtype, jnp.floating)]
    assert nf4_leaves  # the packed codes: integer, not differentiable
