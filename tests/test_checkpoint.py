"""Checkpointer: keep the last K, restore exactly, clear errors, frozen params re-attached."""

import chex
import jax.numpy as jnp
import optax
import pytest

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
