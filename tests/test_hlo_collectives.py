"""Collective bytes counted from the compiled HLO (``jmem._src.hlo_collectives``): per
kind, per device, loops by trip count, on small shard_map compiles over 4 CPU devices."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jmem._src.hlo_collectives import collective_bytes
from jmem._src.hlo_collectives import shape_bytes


def _mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 CPU devices)")
    return Mesh(np.asarray(jax.devices()[:4]), ("x",))


def _compiled_text(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_shape_bytes_of_arrays_and_tuples():
    assert shape_bytes("bf16[4,128]{1,0}") == 4 * 128 * 2
    assert shape_bytes("(f32[8]{0}, s8[3,2]{1,0}, u32[])") == 8 * 4 + 6 + 4
    assert shape_bytes("f8e4m3fn[16]{0}") == 16
    assert shape_bytes("s4[10]{0}") == 5


def test_each_kind_counts_the_bytes_it_delivers_per_device():
    """A [4 * 16, 32] f32 array split over 4 devices: all-gather delivers the whole
    [64, 32] array (8192 B), psum the reduced [16, 32] shard (2048 B), a ppermute and an
    all-to-all each the [16, 32] shard they receive, psum_scatter the [4, 32] piece."""
    mesh = _mesh()

    def per_device(x):
        g = jax.lax.all_gather(x, "x", tiled=True)
        s = jax.lax.psum(x, "x")
        r = jax.lax.ppermute(x, "x", [(i, (i + 1) % 4) for i in range(4)])
        a = jax.lax.all_to_all(x, "x", 0, 0, tiled=True)
        rs = jax.lax.psum_scatter(x, "x", scatter_dimension=0, tiled=True)
        return g, s, r, a, rs

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 5)
    got = collective_bytes(_compiled_text(f, jnp.ones((64, 32), jnp.float32)))
    shard = 16 * 32 * 4
    assert got["all-gather"] == 4 * shard
    assert got["collective-permute"] == shard
    assert got["all-to-all"] == shard
    assert got["reduce-scatter"] == shard // 4
    assert got["all-reduce"] == shard
    assert got["collective-broadcast"] == 0.0


def test_a_loop_body_counts_once_per_trip():
    """A fori_loop of 3 ring steps moves 3 shards; XLA's loop body has one ppermute."""
    mesh = _mesh()

    def per_device(x):
        step = lambda _, c: jax.lax.ppermute(c, "x", [(i, (i + 1) % 4) for i in range(4)]) * 2
        return jax.lax.fori_loop(0, 3, step, x)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    got = collective_bytes(_compiled_text(f, jnp.ones((64, 32), jnp.float32)))
    assert got["collective-permute"] == 3 * 16 * 32 * 4
    assert got["all-gather"] == got["all-to-all"] == 0.0


def test_no_collectives_on_one_device():
    got = collective_bytes(_compiled_text(lambda x: x @ x.T, jnp.ones((8, 8))))
    assert set(got.values()) == {0.0}


def test_refuses_a_loop_with_collectives_of_unknown_length():
    mesh = _mesh()

    def per_device(x):
        body = lambda c: jax.lax.ppermute(c, "x", [(i, (i + 1) % 4) for i in range(4)]) + 1
        return jax.lax.while_loop(lambda c: c[0, 0] < 100.0, body, x)

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="known trip count"):
        collective_bytes(_compiled_text(f, jnp.ones((64, 32), jnp.float32)))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,kind", [("all_gather", "all-gather"), ("ulysses", "all-to-all")])
def test_the_dry_run_on_a_context_mesh_records_its_strategys_collective(tmp_path, strategy, kind):
    """``--dry-run --mesh context=4``: the compiled step's collectives are recorded and
    printed, the strategy's own kind among them, within 10% of the planner's attention
    collectives (``jmem._src.planner.context``)."""
    from jmem import finetune
    from jmem._src.planner import context as cp
    from jmem.models import llama

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 CPU devices)")
    argv = ["--config", "tiny", "--dry-run", "--seq-len", "256", "--batch-size", "1"]
    argv += ["--mesh", "context=4", "--context-strategy", strategy, "--out", str(tmp_path)]
    finetune.main(argv)
    got = json.loads((tmp_path / "dry_run.json").read_text())["compiled"]["collective_bytes"]
    # XLA:CPU moves bf16 collectives as f32 (4 bytes a value)
    cfg = llama.get_config("tiny")
    planned = cp.collective_bytes(cfg, 256, 4, strategy, passes=2, itemsize=4)
    assert got[kind] > 0, got
    np.testing.assert_allclose(got[kind], planned[kind], rtol=0.1)
