"""Checkpointer: keep the last K, restore exactly, clear errors, frozen params re-attached."""

import pathlib
import shutil

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import Checkpointer
from jmem import DynamicLossScale
from jmem import TrainState
from jmem import nf4


def _state(v):
    params = {"w": jnp.full((4, 4), v, jnp.float32)}
    return TrainState(
        step=jnp.asarray(int(v), jnp.int32),
        params=params,
        opt_state=optax.adam(1e-3).init(params),
        loss_scale=DynamicLossScale(jnp.float32(2.0**v)),
        frozen={"base": jnp.ones((8,), jnp.bfloat16)},
    )


def test_keeps_last_k_and_restores_latest(tmp_path):
    ck = Checkpointer(str(tmp_path), save_every=2, keep=2)
    for s in range(1, 7):
        ck.maybe_save(s, _state(s), {"data": {"epoch": 0, "index": s}})
    ck.wait()
    assert ck.all_steps() == [4, 6]
    target = _state(0)
    restored, meta = ck.restore(target)
    chex.assert_trees_all_equal(restored.replace(frozen=None), _state(6).replace(frozen=None))
    assert meta["data"]["index"] == 6
    assert restored.frozen is target.frozen  # frozen base is re-attached, not saved
    ck.close()


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    ck = Checkpointer(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        ck.restore(_state(0))
    with pytest.raises(ValueError):
        Checkpointer(str(tmp_path), keep=0)


def test_restores_8bit_state_written_by_jmem_0_1(tmp_path):
    """A checkpoint of jmem 0.1.0 (QuantizedArray fields saved by position) restores into
    today's state, bitwise, and training goes on from it."""
    data = pathlib.Path(__file__).parent / "data" / "v0_1_adamw_8bit"
    shutil.copytree(data / "checkpoint", tmp_path / "checkpoint")
    params = {"w": {"kernel": jnp.zeros((32, 64))}, "b": jnp.zeros((64,))}
    step = jmem.train_step(
        lambda p, b: jnp.mean((b @ p["w"]["kernel"] + p["b"]) ** 2),
        jmem.adamw_8bit(1e-3, min_8bit_size=1024),
        loss_scale=jmem.DynamicLossScale(2.0**10),
    )
    ck = Checkpointer(str(tmp_path / "checkpoint"))
    state, meta = ck.restore(step.init(params))
    ck.close()
    assert meta == {"written_by": "jmem 0.1.0 (af1cf08)"}
    assert isinstance(state.opt_state[0].mu["w"]["kernel"], jmem.QuantizedArray)
    expected = np.load(data / "expected.npz")
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(expected["names"])
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(np.asarray(leaf), expected[f"leaf{i}"])
    state, metrics = step(state, jnp.ones((4, 32)))
    assert int(state.step) == 3 and bool(metrics["grads_finite"])


# ----------------------------------------------------------------------------------------
# Restore never converts: the target is checked against the checkpoint's metadata.
# ----------------------------------------------------------------------------------------


def _saved(tmp_path, state, step=1):
    ck = Checkpointer(str(tmp_path))
    ck.save(step, state)
    ck.wait()
    return ck


def _params_state(dtype):
    params = {"w": jnp.arange(16, dtype=jnp.float32).reshape(4, 4).astype(dtype) / 3}
    return TrainState(
        step=jnp.asarray(3, jnp.int32),
        params=params,
        opt_state=optax.adam(1e-3).init(params),
        loss_scale=jmem.NoOpLossScale(),
    )


@pytest.mark.parametrize(
    "saved, target, match",
    [
        (jnp.bfloat16, jnp.float32, r"params\.w: saved bfloat16\[4,4\], target float32\[4,4\]"),
        (jnp.float32, jnp.bfloat16, r"params\.w: saved float32\[4,4\], target bfloat16\[4,4\]"),
    ],
    ids=["bf16 into f32", "f32 into bf16"],
)
def test_restore_into_another_dtype_is_an_error(tmp_path, saved, target, match):
    ck = _saved(tmp_path, _params_state(saved))
    with pytest.raises(ValueError, match=match) as err:
        ck.restore(_params_state(target))
    # Adam's moments follow the params' dtype: listed too, and what to do is said.
    assert "opt_state.0.mu.w" in str(err.value)
    assert "cast the restored leaves yourself" in str(err.value)
    # a matching target restores bitwise, dtype kept
    restored, _ = ck.restore(jax.eval_shape(lambda: _params_state(saved)))
    assert restored.params["w"].dtype == saved
    helpers.assert_bitwise_equal(restored, _params_state(saved))
    ck.close()


def test_nf4_double_quant_into_single_quant_target_is_an_error(tmp_path):
    w = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    double, single = nf4.quantize(w, double_quant=True), nf4.quantize(w, double_quant=False)
    ck = _saved(tmp_path, {"base": {"w": double}})
    with pytest.raises(ValueError) as err:
        ck.restore({"base": {"w": single}})
    msg = str(err.value)
    assert "base.w.absmax: saved uint8[128], target float32[128]" in msg
    assert "base.w.absmax_scale: saved float32[1], not in the target" in msg
    assert "base.w.absmax_offset: saved float32[], not in the target" in msg
    assert "double_quant" in msg
    # and the other way round: the scales the target expects are not in the checkpoint
    ck2 = _saved(tmp_path / "single", {"base": {"w": single}})
    with pytest.raises(ValueError, match=r"base\.w\.absmax_scale: not in the checkpoint"):
        ck2.restore({"base": {"w": double}})
    # the matching target gives the weight back exactly
    restored, _ = ck.restore(jax.eval_shape(lambda: {"base": {"w": double}}))
    helpers.assert_bitwise_equal(restored, {"base": {"w": double}})
    np.testing.assert_array_equal(
        nf4.dequantize(restored["base"]["w"], jnp.float32), nf4.dequantize(double, jnp.float32)
    )
    ck.close()
    ck2.close()


def test_extra_missing_and_reshaped_leaves_are_errors(tmp_path):
    state = {"a": jnp.ones((4, 8)), "b": {"c": jnp.zeros((3,), jnp.int32)}}
    ck = _saved(tmp_path, state)
    with pytest.raises(ValueError, match=r"b\.c: saved int32\[3\], not in the target"):
        ck.restore({"a": jnp.ones((4, 8)), "b": {}})
    with pytest.raises(ValueError, match=r"b\.d: not in the checkpoint, target float32\[2\]"):
        ck.restore({**state, "b": {**state["b"], "d": jnp.ones((2,))}})
    with pytest.raises(ValueError, match=r"a: saved float32\[4,8\], target float32\[8,4\]"):
        ck.restore({**state, "a": jnp.ones((8, 4))})
    ck.close()


def test_mismatch_error_lists_every_leaf_up_to_a_limit(tmp_path):
    ck = _saved(tmp_path, {f"w{i:02d}": jnp.ones((2,)) for i in range(20)})
    with pytest.raises(ValueError, match=r"in 20 leaf/leaves(.|\n)*and 8 more") as err:
        ck.restore({f"w{i:02d}": jnp.ones((2,), jnp.bfloat16) for i in range(20)})
    assert "w00: saved float32[2], target bfloat16[2]" in str(err.value)
    ck.close()
