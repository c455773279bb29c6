"""Checkpointer: keep the last K, restore exactly, clear errors, frozen params re-attached."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import chex
import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------------------
# TrainStep.abstract_state carries the step's shardings and memory kinds.
# ----------------------------------------------------------------------------------------


def _mlp_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)


def _mlp_params(d=64, f=128):
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "w1": 0.1 * jax.random.normal(k[0], (d, f)),
        "b1": jnp.zeros((f,)),
        "w2": 0.1 * jax.random.normal(k[1], (f, d)),
    }


def _mlp_batch(seed, b=8, d=64):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"x": jax.random.normal(k[0], (b, d)), "y": jax.random.normal(k[1], (b, d))}


def _mesh(n):
    return jmem.sharding.make_mesh(data=1, fsdp=n, devices=jax.devices()[:n])


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"offload_optimizer": True},
        {"offload_optimizer": "leaf_by_leaf", "master_weights": True, "precision": "p=bf16"},
        {"mesh": 4},
        {"mesh": 4, "offload_optimizer": True},
    ],
    ids=["plain", "offload", "leaf_by_leaf+masters", "mesh", "mesh+offload"],
)
def test_abstract_state_has_the_shardings_of_init(kw):
    if "mesh" in kw:
        kw = {**kw, "mesh": _mesh(kw["mesh"])}
    step = jmem.train_step(_mlp_loss, jmem.adamw_8bit(1e-3, min_8bit_size=1024), **kw)
    params = _mlp_params()
    abstract = step.abstract_state(params)
    state = step.init(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)
    assert _shardings(abstract) == _shardings(state)
    if kw.get("offload_optimizer"):
        assert helpers.memory_kinds(state.opt_state) == {"pinned_host"}
    # ShapeDtypeStruct params give the same target
    assert step.abstract_state(jax.eval_shape(lambda: params)) == abstract


@pytest.mark.slow
def test_offloaded_opt_state_restores_into_host_memory(tmp_path):
    step = jmem.train_step(
        _mlp_loss, jmem.adamw_8bit(1e-3, min_8bit_size=1024), offload_optimizer=True
    )
    params = _mlp_params()
    state, _ = step(step.init(params), _mlp_batch(0))
    ck = _saved(tmp_path, state)
    restored, _ = ck.restore(step.abstract_state(params))
    frozen = {"base": jnp.ones((8,))}
    with pytest.raises(ValueError, match="frozen base is not in the checkpoint"):
        ck.restore(step.abstract_state(params, frozen=frozen))
    again, _ = ck.restore(step.abstract_state(params).replace(frozen=frozen))
    assert again.frozen is frozen
    ck.close()
    assert helpers.memory_kinds(restored.opt_state) == {"pinned_host"}
    assert helpers.memory_kinds(restored.params) == {"device"}
    helpers.assert_bitwise_equal(restored, state)
    # the restored state trains exactly as the saved one does
    _, m_restored = step(restored, _mlp_batch(1))
    _, m_saved = step(state, _mlp_batch(1))
    assert float(m_restored["loss"]) == float(m_saved["loss"])


@pytest.mark.slow
def test_mesh_checkpoint_restores_onto_another_device_count(tmp_path):
    """Saved on a 2-device mesh (offloaded), restored onto a 4-device mesh and onto one
    device through abstract_state: each lands with its step's shardings and memory kinds."""
    opt = lambda: jmem.adamw_8bit(1e-3, min_8bit_size=1024)  # noqa: E731
    params = _mlp_params()
    step2 = jmem.train_step(_mlp_loss, opt(), mesh=_mesh(2), offload_optimizer=True)
    state2, _ = step2(step2.init(params), _mlp_batch(0))
    ck = _saved(tmp_path, state2)

    step4 = jmem.train_step(_mlp_loss, opt(), mesh=_mesh(4), offload_optimizer=True)
    target4 = step4.abstract_state(params)
    got4, _ = ck.restore(target4)
    helpers.assert_bitwise_equal(got4, state2)
    assert _shardings(got4) == _shardings(target4)
    kernel_codes = got4.opt_state[0].mu["w1"].codes
    assert kernel_codes.sharding.mesh.size == 4 and kernel_codes.sharding.spec == P("fsdp")
    assert helpers.memory_kinds(got4.opt_state) == {"pinned_host"}

    step1 = jmem.train_step(_mlp_loss, opt())
    got1, _ = ck.restore(step1.abstract_state(params))
    ck.close()
    helpers.assert_bitwise_equal(got1, state2)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(got1)} == {1}

    # all three continue alike (sums over shards in another order: rounding only)
    losses = [
        float(s(st, _mlp_batch(1))[1]["loss"])
        for s, st in [(step2, state2), (step4, got4), (step1, got1)]
    ]
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)


# ----------------------------------------------------------------------------------------
# A process killed in the middle of a save resumes from the last complete checkpoint.
# ----------------------------------------------------------------------------------------

WORKER = pathlib.Path(__file__).parent / "_ckpt_worker.py"


def _worker(*args):
    """Runs tests/_ckpt_worker.py; returns (returncode, JSON records printed, stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, records, proc.stderr[-4000:]


def _losses(records, run):
    return {r["batch"]: r["loss"] for r in records if r.get("run") == run}


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write", "commit"])
def test_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path, point):
    """SIGKILL while checkpoint 4 is being saved (temporary directory just created, or
    every file written but not committed): checkpoint 4 does not exist, the next run
    resumes from checkpoint 3 and its losses from there equal an uninterrupted run's,
    bitwise (losses compared as float.hex)."""
    steps, killed_at = 6, 4
    ckpt = tmp_path / "ckpt"
    rc, records, err = _worker(ckpt, steps, "--kill-at", killed_at, "--kill-point", point)
    assert rc == -signal.SIGKILL, err
    # What makes resuming safe: orbax wrote into <step>.orbax-checkpoint-tmp and never
    # renamed it, so step 4 is not a checkpoint; latest_step ignores the leftover.
    assert [p.name for p in ckpt.glob(f"{killed_at}.orbax-checkpoint-tmp*")], list(ckpt.iterdir())
    assert not (ckpt / str(killed_at)).exists()
    ck = Checkpointer(str(ckpt))
    assert ck.latest_step() == killed_at - 1 and killed_at not in ck.all_steps()
    with pytest.raises(FileNotFoundError):
        ck.restore(_state(0), step=killed_at)
    ck.close()
    killed = _losses(records, "main")

    rc, records, err = _worker(ckpt, steps, "--reference", tmp_path / "reference")
    assert rc == 0, err
    assert {"resumed_from": killed_at - 1} in records
    resumed, reference = _losses(records, "main"), _losses(records, "reference")
    assert sorted(resumed) == list(range(killed_at - 1, steps))
    assert resumed == {i: reference[i] for i in resumed}
    assert killed == {i: reference[i] for i in killed}  # before the kill: the same run
    # re-saving step 4 replaced orbax's leftover temporary directory
    assert not list(ckpt.glob("*.orbax-checkpoint-tmp*"))
    ck = Checkpointer(str(ckpt))
    assert ck.latest_step() == steps
    ck.close()


_RESTORE_ON_4_DEVICES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np, jmem
sys.path.insert(0, sys.argv[2])
import test_checkpoint as t
step = jmem.train_step(t._mlp_loss, jmem.adamw_8bit(1e-3, min_8bit_size=1024),
                       mesh=t._mesh(4), offload_optimizer=True)
state, _ = jmem.Checkpointer(sys.argv[1]).restore(step.abstract_state(t._mlp_params()))
codes = state.opt_state[0].mu["w1"].codes
assert len(jax.devices()) == 4 and codes.sharding.mesh.size == 4, codes.sharding
assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
np.savez(sys.argv[3], *[np.asarray(x) for x in jax.tree.leaves(state)])
"""


@pytest.mark.slow
def test_checkpoint_of_an_8_device_process_restores_in_a_4_device_process(tmp_path):
    """The user's case: written by a process with 8 devices, read by one with 4. A target
    without shardings makes orbax look for the writer's devices (a topology error);
    abstract_state's shardings put it on the reader's mesh."""
    step = jmem.train_step(
        _mlp_loss,
        jmem.adamw_8bit(1e-3, min_8bit_size=1024),
        mesh=_mesh(8),
        offload_optimizer=True,
    )
    state, _ = step(step.init(_mlp_params()), _mlp_batch(0))
    _saved(tmp_path / "ckpt", state).close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "restored.npz"
    args = [tmp_path / "ckpt", pathlib.Path(__file__).parent, out]
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE_ON_4_DEVICES, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    restored = np.load(out)
    leaves = jax.tree.leaves(state)
    assert len(restored.files) == len(leaves)
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(restored[f"arr_{i}"], np.asarray(leaf))
