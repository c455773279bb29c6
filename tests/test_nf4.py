"""NF4 quantization: table, packing, double quantization and dequantization vs bitsandbytes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jmem
from jmem import nf4


def _bnb():
    F = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is the NF4 oracle")
    torch = pytest.importorskip("torch", reason="bitsandbytes needs torch")
    return F, torch


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 2.0)).astype(np.float32)
    return w


@pytest.mark.slow
def test_table_and_dynamic_map_match_bitsandbytes():
    F, _ = _bnb()
    np.testing.assert_array_equal(nf4.NF4_TABLE, F.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_array_equal(
        jmem.dynamic_map(True, 8), F.create_dynamic_map(signed=True).numpy()
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(128, 256), (64, 640), (33, 65), (3, 7)])
def test_codes_absmax_and_dequant_match_bitsandbytes(shape):
    """Single-level NF4: packed bytes, absmax and dequantized values are bit-exact."""
    F, torch = _bnb()
    w = _weights(shape)
    w[0, : min(shape[1], 64)] = 0.0  # an all-zero block (when the row is long enough)
    packed, state = F.quantize_4bit(
        torch.tensor(w), blocksize=64, quant_type="nf4", compress_statistics=False
    )
    q = nf4.quantize(jnp.asarray(w), double_quant=False)
    n = packed.numel()  # bnb stores ceil(n/2) bytes; we store whole blocks (zero padded).
    np.testing.assert_array_equal(np.asarray(q.packed).reshape(-1)[:n], packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(q.absmax), state.absmax.numpy())
    ours = np.asarray(nf4.dequantize(q, jnp.float32))
    if shape[-1] % 64 == 0:
        ref = F.dequantize_4bit(packed, state, quant_type="nf4").numpy()
    else:
        # bitsandbytes' CPU kernel mis-decodes rows that are not whole blocks; its pure-torch
        # reference implementation is the oracle there.
        ops = pytest.importorskip("bitsandbytes.backends.default.ops", reason="bnb reference op")
        ref = ops._dequantize_4bit_compute(
            packed.reshape(-1),
            state.absmax,
            F.get_4bit_type("nf4", device="cpu"),
            64,
            shape,
            torch.float32,
        ).numpy()
    np.testing.assert_array_equal(ours, ref)
    assert np.isfinite(ours).all()


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(256, 512), (64, 19200)])
def test_double_quant_matches_bitsandbytes(shape):
    """compress_statistics=True: 4-bit codes exact; absmax mean to float32 rounding; 8-bit
    absmax codes equal except near-ties (bnb's CPU search is approximate there); our
    dequantize of bitsandbytes' own state equals bitsandbytes' dequantize (float32 rounding)."""
    F, torch = _bnb()
    w = _weights(shape, seed=1)
    packed, state = F.quantize_4bit(
        torch.tensor(w), blocksize=64, quant_type="nf4", compress_statistics=True
    )
    q = nf4.quantize(jnp.asarray(w), double_quant=True)
    np.testing.assert_array_equal(np.asarray(q.packed).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_allclose(float(q.absmax_offset), float(state.offset), rtol=1e-6)
    codes, ref_codes = np.asarray(q.absmax).astype(int), state.absmax.numpy().astype(int)
    assert np.abs(codes - ref_codes).max() <= 1
    assert np.mean(codes != ref_codes) < 0.01
    np.testing.assert_allclose(np.asarray(q.absmax_scale), state.state2.absmax.numpy(), rtol=1e-6)
    q_bnb = nf4.NF4Array(
        packed=q.packed,
        absmax=jnp.asarray(state.absmax.numpy()),
        absmax_scale=jnp.asarray(state.state2.absmax.numpy()),
        absmax_offset=jnp.asarray(np.float32(state.offset.item())),
        shape=shape,
        dtype=jnp.float32,
        block_size=64,
        double_quant=True,
    )
    ref = F.dequantize_4bit(packed, state, quant_type="nf4")
    # Equal up to float32 rounding: XLA may fuse the absmax multiply-add into an FMA.
    np.testing.assert_allclose(
        np.asarray(nf4.dequantize(q_bnb, jnp.float32)), ref.numpy(), rtol=3e-7, atol=0
    )
    bf = np.asarray(nf4.dequantize(q_bnb, jnp.bfloat16)).astype(np.float32)
    np.testing.assert_allclose(
        bf, ref.to(torch.bfloat16).float().numpy(), rtol=2**-7
    )  # one bfloat16 ulp
    assert np.mean(bf != ref.to(torch.bfloat16).float().numpy()) < 1e-3
    # And our own state decodes to within one 8-bit absmax step of bitsandbytes.
    ours = np.asarray(nf4.dequantize(q, jnp.float32))
    np.testing.assert_allclose(ours, ref.numpy(), atol=0.02 * np.abs(w).max())


@pytest.mark.slow
def test_bytes_per_param():
    q = nf4.quantize(jnp.ones((4096, 4096), jnp.bfloat16))
    assert nf4.bytes_per_param(q) <= 0.52
    assert q.nbytes == 4096 * 4096 // 2 + 4096 * 4096 // 64 + 4 * (4096 * 4096 // 64 // 256) + 4
    single = nf4.quantize(jnp.ones((4096, 4096), jnp.bfloat16), double_quant=False)
    assert nf4.bytes_per_param(single) == pytest.approx(0.5 + 4 / 64)
    abstract = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct((32, 4096, 11008), jnp.bfloat16))
    assert jmem.tree.nbytes(abstract) / (32 * 4096 * 11008) <= 0.52


class NF4Test(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @pytest.mark.slow
    def test_round_trip_error_bound(self):
        w = jnp.asarray(_weights((64, 256), seed=2))
        q = self.variant(nf4.quantize)(w)
        d = self.variant(lambda q: nf4.dequantize(q, jnp.float32))(q)
        chex.assert_shape(d, w.shape)
        # Largest half-gap of the NF4 table is (1 - 0.6961928) / 2 = 0.152 of the block absmax,
        # plus the 8-bit absmax error.
        absmax = jnp.max(jnp.abs(w.reshape(-1, 64)), axis=1, keepdims=True)
        err = jnp.abs(d - w).reshape(-1, 64)
        assert bool(jnp.all(err <= 0.153 * absmax + 0.01))


@pytest.mark.slow
def test_all_zero_and_constant():
    z = nf4.quantize(jnp.zeros((8, 64)))
    np.testing.assert_array_equal(np.asarray(z.packed), 0x77)
    chex.assert_trees_all_equal(nf4.dequantize(z, jnp.float32), jnp.zeros((8, 64)))
    c = nf4.quantize(jnp.full((4, 128), 0.5))  # absmax - mean == 0 everywhere
    chex.assert_trees_all_close(nf4.dequantize(c, jnp.float32), jnp.full((4, 128), 0.5), atol=1e-6)


@pytest.mark.slow
def test_stacked_is_per_layer_and_sliceable():
    w = jnp.asarray(_weights((3, 40, 72), seed=3))  # 2880 = 45 blocks per layer
    q = nf4.quantize(w)
    assert q.packed.shape[0] == 3 and q.absmax_offset.shape == (3,)
    for i in range(3):
        qi = nf4.quantize(w[i])
        sliced = jax.tree.map(lambda x, i=i: x[i], q)
        sliced = nf4.NF4Array(
            sliced.packed,
            sliced.absmax,
            sliced.absmax_scale,
            sliced.absmax_offset,
            shape=(40, 72),
            dtype=q.dtype,
        )
        chex.assert_trees_all_equal(
            nf4.dequantize(sliced, jnp.float32), nf4.dequantize(qi, jnp.float32)
        )
    chex.assert_trees_all_equal(
        nf4.dequantize(q, jnp.float32)[1], nf4.dequantize(nf4.quantize(w[1]), jnp.float32)
    )

    def body(c, qi):
        return c + jnp.sum(nf4.dequantize(qi, jnp.float32)), None

    carrier = nf4.NF4Array(
        q.packed, q.absmax, q.absmax_scale, q.absmax_offset, shape=(40, 72), dtype=q.dtype
    )
    total, _ = jax.lax.scan(body, 0.0, carrier)
    chex.assert_trees_all_close(total, jnp.sum(nf4.dequantize(q, jnp.float32)), rtol=1e-5)


def test_odd_sizes_pad_last_block():
    w = jnp.asarray(_weights((5, 13), seed=4))  # 65 elements: one full + one partial block
    q = nf4.quantize(w)
    assert q.packed.shape == (64,) and q.absmax.shape == (2,)
    chex.assert_trees_all_close(
        nf4.dequantize(q, jnp.float32), w, atol=0.15 * float(jnp.abs(w).max())
    )


def test_bad_inputs():
    with pytest.raises(TypeError, match="floating"):
        nf4.quantize(jnp.ones((4, 64), jnp.int32))
    with pytest.raises(ValueError, match="block_size"):
        nf4.quantize(jnp.ones((4, 64)), block_size=100)
    with pytest.raises(ValueError, match="non-empty"):
        nf4.quantize(jnp.ones(()))
    with pytest.raises(TypeError, match="NF4Array"):
        nf4.dequantize(jnp.ones((4, 64)))


@pytest.mark.slow
def test_nf4_array_survives_jit_and_orbax(tmp_path):
    q = nf4.quantize(jnp.asarray(_weights((3, 16, 64), seed=5)))
    out = jax.jit(lambda t: t)(q)
    chex.assert_trees_all_equal(out, q)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "q", q)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "q", q)
    chex.assert_trees_all_equal(restored, q)
    assert isinstance(restored, nf4.NF4Array)
