"""Tests for jmem.quantization: dynamic maps, block-wise quantize/dequantize.

Oracle: bitsandbytes (CPU backend) ``create_dynamic_map`` / ``quantize_blockwise`` /
``dequantize_blockwise``. bitsandbytes' CPU quantizer is *not* exact nearest rounding (its
search picks a neighbouring code near midpoints, and for the unsigned map sometimes a code
several steps away for values below ~1e-4 of absmax); jmem rounds to the exact nearest code.
So the tests require: identical maps, identical absmax, identical dequantization of the same
codes, codes equal to bitsandbytes' wherever bitsandbytes is nearest, and a rounding error
never larger than bitsandbytes' (to 1 float32 ulp).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jmem._src import quantization as qz

ULP = 6e-8  # float32 ulp just below 1.0


def _bnb():
    pytest.importorskip("torch", reason="torch is needed for the bitsandbytes oracle")
    return pytest.importorskip(
        "bitsandbytes.functional", reason="bitsandbytes oracle not installed"
    )


@pytest.mark.slow  # imports torch (about 4 s)
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_matches_bitsandbytes(signed):
    F = _bnb()
    ours = qz.dynamic_map(signed)
    ref = F.create_dynamic_map(signed=signed).numpy()
    assert ours.shape == (256,) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-7)


@pytest.mark.slow  # imports torch (about 4 s)
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_4bit_matches_bitsandbytes(signed):
    F = _bnb()
    ref = F.create_dynamic_map(signed, max_exponent_bits=3, total_bits=4).numpy()
    # bitsandbytes pads the 16 values with zeros up to 256 entries.
    ref = np.sort(np.concatenate([ref[ref != 0], [0.0]]))
    ours = qz.dynamic_map(signed, bits=4)
    assert ours.shape == (16,)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-7)


def test_linear_map():
    m = qz.linear_map(4)
    np.testing.assert_allclose(m, (np.arange(16) + 1) / 16)
    assert m.min() > 0
    assert qz.linear_map(4, include_zero=True)[0] == 0


CODES = {
    "dyn8_signed": qz.dynamic_map(True),
    "dyn8_unsigned": qz.dynamic_map(False),
    "dyn4_signed": qz.dynamic_map(True, 4),
    "linear4": qz.linear_map(4),
    "dyn4_no_zero": qz.dynamic_map(False, 4)[1:],
}


@pytest.mark.parametrize("name", list(CODES))
def test_nearest_rounding_is_exact(name):
    code = CODES[name]
    lut = qz._build_lut(qz._canonical_code(code))
    c = code.astype(np.float64)
    mids = ((c[:-1] + c[1:]) / 2).astype(np.float32)
    lo = -1.0 if code[0] < 0 else 0.0
    rng = np.random.default_rng(0)
    s = np.concatenate(
        [
            rng.uniform(lo, 1.0, 50_000),
            np.logspace(-12, 0, 20_000) * (rng.integers(0, 2, 20_000) * 2 - 1 if lo < 0 else 1),
            mids,
            np.nextafter(mids, np.float32(2)),
            np.nextafter(mids, np.float32(-2)),
            code,
            [0.0, 1.0, lo],
        ]
    ).astype(np.float32)
    s = np.clip(s, lo, 1.0)
    got = np.asarray(jax.jit(lambda v: qz._nearest_codes(v, lut))(jnp.asarray(s)))
    dist = np.abs(s[:, None].astype(np.float64) - c[None])
    excess = dist[np.arange(s.size), got] - dist.min(axis=1)
    # Only exact float32 ties at a midpoint may go either way (1 ulp).
    assert excess.max() <= ULP


@pytest.mark.parametrize("name", list(CODES))
def test_nearest_codes_equal_midpoint_count(name):
    # The one-lookup table (8-bit maps) and the compare-count path (<= 16 values) must both
    # give exactly #{j : s > mids[j]} with float32 midpoints (ties at a midpoint go down).
    code = CODES[name]
    lut = qz._build_lut(qz._canonical_code(code))
    mids = ((code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2).astype(np.float32)
    lo = -1.0 if code[0] < 0 else 0.0
    rng = np.random.default_rng(7)
    tiny = np.float32(np.abs(mids[mids != 0]).min())
    s = np.concatenate(
        [
            rng.uniform(lo, 1.0, 20_000),
            np.logspace(-40, 0, 5_000),
            mids,
            np.nextafter(mids, np.float32(2)),
            np.nextafter(mids, np.float32(-2)),
            code,
            [0.0, -0.0, 1.0, lo, tiny / 2, np.nextafter(tiny, 0), 1e-45],
        ]
    ).astype(np.float32)
    if lo < 0:
        s = np.concatenate([s, -s])
    s = np.clip(s, lo, 1.0).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: qz._nearest_codes(v, lut))(jnp.asarray(s)))
    want = (s[:, None] > mids[None, :]).sum(axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CODES))
def test_decode_every_code_exactly(name):
    code = CODES[name]
    k = code.size
    if k <= 16:
        bs = 2 * k
        idx = np.concatenate([np.arange(k), np.arange(k)[::-1]]).astype(np.uint8)
        packed = jnp.asarray((idx[: bs // 2] | (idx[bs // 2 :] << 4))[None, :])
    else:
        idx = np.arange(k, dtype=np.uint8)
        packed = jnp.asarray(idx[None, :])
    out = np.asarray(qz.dequantize_blocks(packed, jnp.ones((1,), jnp.float32), code))
    np.testing.assert_array_equal(out[0], code[idx])


def _blocks_of(x, bs):
    n = x.size
    return np.pad(x.reshape(-1), (0, (-n) % bs)).reshape(-1, bs)


@pytest.mark.slow  # imports torch (about 4 s)
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_blockwise_vs_bitsandbytes(signed):
    F = _bnb()
    import torch

    rng = np.random.default_rng(1)
    n = 256 * 40 + 77  # not a multiple of the block size
    scales = np.repeat(10.0 ** rng.uniform(-4, 1, 41), 256)[:n]
    x = rng.standard_normal(n) * scales
    if not signed:
        x = x * x
    x = x.astype(np.float32)
    x[512:768] = 0.0  # an all-zero block
    code_t = F.create_dynamic_map(signed=signed)
    ref_q, ref_state = F.quantize_blockwise(torch.tensor(x), code=code_t, blocksize=256)
    ref_deq = F.dequantize_blockwise(ref_q, ref_state).numpy()
    ref_codes = ref_q.numpy().reshape(-1)

    q = qz.quantize_blockwise(jnp.asarray(x), code=qz.dynamic_map(signed), block_size=256)
    assert q.codes.dtype == jnp.uint8 and q.absmax.dtype == jnp.float32
    assert q.codes.shape == (41, 256) and q.absmax.shape == (41,)
    np.testing.assert_allclose(np.asarray(q.absmax), ref_state.absmax.numpy(), rtol=1e-7, atol=0)

    # Our dequantization of bitsandbytes' codes equals bitsandbytes' dequantization.
    same_codes = qz.QuantizedArray(
        jnp.asarray(_blocks_of(ref_codes, 256)), q.absmax, q.shape, q.dtype, 256, q.code
    )
    np.testing.assert_allclose(
        np.asarray(qz.dequantize_blockwise(same_codes)), ref_deq, rtol=1e-7, atol=0
    )

    # Codes: equal wherever bitsandbytes picked the nearest code; our error is never larger.
    ours = np.asarray(q.codes).reshape(-1)[:n]
    code = qz.dynamic_map(signed).astype(np.float64)
    absmax = np.repeat(np.asarray(q.absmax, np.float64), 256)[:n]
    s = np.where(absmax > 0, x / np.where(absmax > 0, absmax, 1), 0)
    nonzero_block = absmax > 0
    dist = np.sort(np.abs(s[:, None] - code[None]), axis=1)
    # bitsandbytes picked the nearest code and it is not a (near-)tie.
    ref_is_nearest = (np.abs(s - code[ref_codes]) <= dist[:, 0] + ULP) & (
        dist[:, 1] - dist[:, 0] > 1e-6
    )
    np.testing.assert_array_equal(
        ours[ref_is_nearest & nonzero_block], ref_codes[ref_is_nearest & nonzero_block]
    )
    assert ref_is_nearest[nonzero_block].mean() > 0.9
    assert np.all(np.abs(s - code[ours]) <= np.abs(s - code[ref_codes]) + ULP)
    deq = np.asarray(qz.dequantize_blockwise(q))
    assert np.all(np.abs(deq - x) <= np.abs(ref_deq - x) + 2 * ULP * absmax)
    # The all-zero block: absmax 0 and exact zeros, as in bitsandbytes.
    assert float(q.absmax[2]) == 0.0
    np.testing.assert_array_equal(deq[512:768], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CODES))
@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), (257,), (4, 128)])
def test_round_trip_error_bound_and_shapes(name, shape):
    code = CODES[name]
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32)
    if code[0] >= 0:
        x = np.abs(x)
    bs = 64
    q = jax.jit(lambda v: qz.quantize_blockwise(v, code=code, block_size=bs))(jnp.asarray(x))
    nb = -(-x.size // bs)
    width = bs // 2 if code.size <= 16 else bs
    assert q.codes.shape == (nb, width) and q.codes.dtype == jnp.uint8
    assert q.absmax.shape == (nb,) and q.absmax.dtype == jnp.float32
    deq = np.asarray(qz.dequantize_blockwise(q))
    assert deq.shape == shape and deq.dtype == np.float32
    # Nearest rounding: error <= absmax * (half the largest gap, or the distance from the
    # smallest code to 0 for maps without zero).
    c = code.astype(np.float64)
    lowest = -1.0 if c[0] < 0 else 0.0  # smallest representable scaled value
    half_gap = max(np.diff(c).max() / 2, c[0] - lowest, 1 - c[-1])
    absmax = np.repeat(np.asarray(q.absmax), bs)[: x.size].reshape(shape)
    assert np.all(np.abs(deq - x) <= absmax * (half_gap + 2 * ULP))
    # Block maxima of maps containing 1.0 are exact.
    if c.max() == 1.0:
        flat_x, flat_d = _blocks_of(x, bs), _blocks_of(deq, bs)
        i = np.argmax(np.abs(flat_x), axis=1)
        rows = np.arange(nb)
        pos = flat_x[rows, i] > 0
        np.testing.assert_allclose(flat_d[rows, i][pos], flat_x[rows, i][pos], rtol=1e-6)


@pytest.mark.slow
def test_zero_array_and_bf16():
    q = qz.quantize_blockwise(
        jnp.zeros((5, 100), jnp.bfloat16), code=qz.dynamic_map(True), block_size=256
    )
    out = qz.dequantize_blockwise(q)
    assert out.dtype == jnp.bfloat16 and out.shape == (5, 100)
    assert not np.any(np.isnan(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    q = qz.quantize_blockwise(jnp.zeros((300,)), code=qz.linear_map(4), block_size=128)
    np.testing.assert_array_equal(np.asarray(qz.dequantize_blockwise(q)), 0.0)


@pytest.mark.slow
def test_4bit_packing_two_codes_per_byte():
    code = qz.dynamic_map(True, 4)
    x = jnp.asarray(np.random.default_rng(3).standard_normal(1000), jnp.float32)
    q = qz.quantize_blockwise(x, code=code, block_size=128)
    assert q.codes.shape == (8, 64) and q.nbytes == 8 * 64 + 8 * 4
    lo, hi = np.asarray(q.codes) & 15, np.asarray(q.codes) >> 4
    unpacked = np.concatenate([lo, hi], axis=1).reshape(-1)[:1000]
    absmax = np.repeat(np.asarray(q.absmax), 128)[:1000]
    np.testing.assert_allclose(
        np.asarray(qz.dequantize_blockwise(q)), code[unpacked] * absmax, rtol=1e-7
    )


class QuantizedArrayPytreeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_pytree_through_jit(self):
        code = qz.dynamic_map(True)
        x = jnp.linspace(-3.0, 2.0, 1000).reshape(10, 100)

        @self.variant
        def f(x):
            q = qz.quantize_blockwise(x, code=code, block_size=256)
            return q, qz.dequantize_blockwise(q)

        q, deq = f(x)
        self.assertIsInstance(q, qz.QuantizedArray)
        leaves = jax.tree.leaves(q)
        self.assertEqual([l.dtype for l in leaves], [jnp.uint8, jnp.float32])
        self.assertEqual(q.shape, (10, 100))
        chex.assert_trees_all_close(deq, x, atol=float(jnp.max(jnp.abs(x))) * 0.0071)
        # A QuantizedArray is a valid jit argument and output.
        out = jax.jit(lambda q: qz.dequantize_blockwise(q) * 2)(q)
        chex.assert_trees_all_close(out, 2 * deq)


@pytest.mark.slow
def test_quantized_array_static_fields_and_orbax_round_trip(tmp_path):
    x = jnp.linspace(-3.0, 2.0, 1000, dtype=jnp.bfloat16).reshape(10, 100)
    q = qz.quantize_blockwise(x, code=qz.dynamic_map(True, 4), block_size=128)
    # The static part is canonical: a list shape and a scalar type give the same structure.
    same = qz.QuantizedArray(q.codes, q.absmax, [10, 100], jnp.bfloat16, 128, q.code)
    assert jax.tree.structure(same) == jax.tree.structure(q)
    assert [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(q)] == [
        ".codes",
        ".absmax",
    ]
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "q", {"q": q})
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "q", jax.eval_shape(lambda: {"q": q}))["q"]
    assert isinstance(restored, qz.QuantizedArray) and restored.dtype == jnp.bfloat16
    chex.assert_trees_all_equal(restored, q)


def test_bad_inputs():
    code = qz.dynamic_map(True)
    with pytest.raises(TypeError, match="floating"):
        qz.quantize_blockwise(jnp.arange(10), code=code)
    with pytest.raises(ValueError, match="sorted"):
        qz.quantize_blockwise(jnp.ones(10), code=code[::-1])
    with pytest.raises(ValueError, match="\\[-1, 1\\]"):
        qz.quantize_blockwise(jnp.ones(10), code=code * 2)
    with pytest.raises(ValueError, match="even"):
        qz.quantize_blockwise(jnp.ones(10), code=qz.linear_map(4), block_size=127)
    with pytest.raises(ValueError, match="block_size"):
        qz.quantize_blockwise(jnp.ones(10), code=code, block_size=0)
    with pytest.raises(ValueError, match="bits"):
        qz.dynamic_map(True, bits=9)
    with pytest.raises(TypeError, match="QuantizedArray"):
        qz.dequantize_blockwise(jnp.ones(3))
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda c: qz.quantize_blockwise(jnp.ones(4), code=c))(jnp.asarray(code))
