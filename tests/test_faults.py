"""Fault injection (issue #37): damaged checkpoints, non-finite runs, a locked run directory,
resumes of something else, kills at each phase, unwritable and full disks. Each fault ends
in one ``error:`` line (non-zero exit, no traceback) or a correct recovery, and no earlier
result is damaged or replaced."""

import json
import os
import pathlib

import chex
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmem
from jmem import Checkpointer
from jmem import DynamicLossScale
from jmem import TrainState


def _state(v, bad=False):
    w = jnp.full((4, 4), v, jnp.float32)
    params = {"w": w.at[0, 0].set(jnp.nan) if bad else w}
    return TrainState(
        step=jnp.asarray(int(v), jnp.int32),
        params=params,
        opt_state=optax.adam(1e-3).init(params),
        loss_scale=DynamicLossScale(jnp.float32(2.0**v)),
    )


def _saved(path, steps=(1, 2, 3), keep=3):
    ck = Checkpointer(str(path), save_every=1, keep=keep)
    for s in steps:
        ck.save(s, _state(s), {"i": s})
    ck.wait()
    return ck


def _files(step_dir):
    return sorted(p for p in pathlib.Path(step_dir).rglob("*") if p.is_file())


def _largest_data_file(step_dir):
    data = [p for p in _files(step_dir) if "/d/" in str(p)]
    return max(data, key=lambda p: p.stat().st_size)


def _flip(path, n=64):
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    for i in range(max(0, mid - n // 2), min(len(raw), mid + n // 2)):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _damage(kind, step_dir):
    """Damages one file of a step: returns its path relative to the checkpoint directory."""
    target = {
        "flip": lambda: _largest_data_file(step_dir),
        "delete": lambda: pathlib.Path(step_dir) / "state" / "_METADATA",
        "truncate": lambda: _largest_data_file(step_dir),
        "junk_meta": lambda: pathlib.Path(step_dir) / "meta" / "metadata",
    }[kind]()
    if kind == "flip":
        _flip(target)
    elif kind == "delete":
        target.unlink()
    elif kind == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    else:
        target.write_text("{not json")
    return str(target.relative_to(pathlib.Path(step_dir).parent))


@pytest.mark.parametrize("kind", ["flip", "delete", "truncate", "junk_meta"])
def test_damaged_checkpoint_is_named_and_the_newest_intact_step_restored(tmp_path, kind):
    ck = _saved(tmp_path)
    name = _damage(kind, tmp_path / "3")
    assert ck.verify(2) == []
    problems = ck.verify(3)
    assert len(problems) == 1 and problems[0].startswith(name + ": "), problems
    notes = []
    state, meta = ck.restore(_state(0), on_damaged=notes.append)
    assert len(notes) == 1 and "step 3" in notes[0] and name in notes[0], notes
    assert "\n" not in notes[0]
    chex.assert_trees_all_equal(state, _state(2))
    assert meta == {"i": 2}
    with pytest.raises(jmem.CheckpointDamagedError, match=f"step 3 .*{name}"):
        ck.restore(_state(0), step=3)
    # the damaged step is set aside when it is saved again; the new one verifies
    ck.save(3, _state(3), {"i": 3})
    ck.wait()
    assert ck.all_steps() == [1, 2, 3] and ck.verify(3) == []
    assert (tmp_path / "3.damaged").is_dir()
    chex.assert_trees_all_equal(ck.restore(_state(0))[0], _state(3))
    ck.close()


def test_every_step_damaged_is_one_refusal(tmp_path):
    ck = _saved(tmp_path, steps=(1, 2))
    for s in (1, 2):
        _flip(_largest_data_file(tmp_path / str(s)))
    with pytest.raises(jmem.CheckpointDamagedError, match="every checkpoint .* is damaged"):
        ck.restore(_state(0), on_damaged=lambda line: None)
    ck.close()


def test_nonfinite_state_is_refused_at_restore(tmp_path):
    ck = Checkpointer(str(tmp_path), save_every=1)
    ck.save(1, _state(1))
    ck.save(2, _state(2, bad=True))
    ck.wait()
    notes = []
    state, _ = ck.restore(_state(0), on_damaged=notes.append)
    assert int(state.step) == 1
    assert "non-finite values in params.w" in notes[0] and "step 2" in notes[0]
    ck.close()


def test_only_committed_steps_with_hashes_count(tmp_path):
    ck = _saved(tmp_path, steps=(2, 4))
    (tmp_path / "9").mkdir()  # a stray empty step directory
    (tmp_path / "6.orbax-checkpoint-tmp").mkdir()  # a save killed before its commit
    os.remove(tmp_path / "4" / "hashes.json")  # a step without its hashes
    ck2 = Checkpointer(str(tmp_path), save_every=1)
    assert ck2.all_steps() == [2] and ck2.latest_step() == 2
    assert ck2.verify(4) == ["4/hashes.json: missing"]
    ck2.save(4, _state(4))  # the step without hashes is set aside, then saved again
    ck2.wait()
    assert ck2.all_steps() == [2, 4] and ck2.verify(4) == []
    ck.close()
    ck2.close()


def test_hashes_are_written_before_the_commit(tmp_path):
    ck = _saved(tmp_path, steps=(1,))
    record = json.loads((tmp_path / "1" / "hashes.json").read_text())
    hashed = {str(p.relative_to(tmp_path / "1")) for p in _files(tmp_path / "1")}
    # orbax writes its step metadata (timestamps) and the top commit marker after the hash
    unhashed = {"hashes.json", "_CHECKPOINT_METADATA", "commit_success.txt"}
    assert set(record["files"]) == hashed - unhashed
    assert record["algorithm"] == "sha256" and len(record["files"]) >= 5
    assert (tmp_path / "jmem-checkpoints.json").is_file()
    ck.close()
    np.testing.assert_array_equal(
        np.asarray(Checkpointer(str(tmp_path)).restore(_state(0))[0].params["w"]),
        np.full((4, 4), 1, np.float32),
    )
