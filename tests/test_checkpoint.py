"""Checkpointer: keep the last K, restore exactly, clear errors, frozen params re-attached."""

import pathlib
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import Checkpointer
from jmem import DynamicLossScale
from jmem import TrainState


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
