"""Fault injection (issue #37): damaged checkpoints, non-finite runs, a locked run directory,
resumes of something else, kills at each phase, unwritable and full disks. Each fault ends
in one ``error:`` line (non-zero exit, no traceback) or a correct recovery, and no earlier
result is damaged or replaced."""

import json
import os
import pathlib
import subprocess
import sys

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
from jmem import finetune  # noqa: F401 (jmem.finetune.main)

SMALL = ["--config", "tiny", "--batch-size", "4", "--seq-len", "16", "--lora-rank", "4"]
SMALL += ["--no-progress", "--lr", "3e-3", "--eval-split", "0", "--save-every", "2"]


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


@pytest.mark.slow
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


# ------------------------------------------------------------- weights and configs at load


def _hf_checkpoint(path, cfg=None, seed=0):
    """A Hugging Face checkpoint of a small model (jmem's exporter), float32."""
    from jmem.models import hf
    from jmem.models import llama

    cfg = cfg or llama.get_config("tiny", num_layers=2, hidden_size=64, intermediate_size=128)
    params = llama.init(jax.random.key(seed), cfg, jnp.float32)
    hf.save_params(str(path), params, cfg)
    return cfg


def _edit_tensor(path, name, edit):
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file

    file = str(path / WEIGHTS)
    tensors = load_file(file)
    tensors[name] = edit(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
WEIGHTS = "model-00001-of-00001.safetensors"  # the exporter's one shard


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda w: w.astype(np.int8), "is int8, not floating point"),
        (
            lambda w: np.where(np.arange(w.size).reshape(w.shape) == 7, np.inf, w),
            "holds 1 non-finite",
        ),
    ],
)
def test_weights_that_would_train_wrongly_are_refused_naming_the_tensor(tmp_path, edit, match):
    from jmem.models import hf

    _hf_checkpoint(tmp_path)
    _edit_tensor(tmp_path, Q_PROJ, edit)
    with pytest.raises(ValueError, match=f"{WEIGHTS}: tensor '{Q_PROJ}' {match}"):
        hf.load_params(str(tmp_path), dtype=jnp.float32)


@pytest.mark.slow
def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path):
    from jmem.models import hf

    _hf_checkpoint(tmp_path)
    file = tmp_path / WEIGHTS
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{WEIGHTS}: .*(truncated|readable)") as e:
        hf.load_params(str(tmp_path), dtype=jnp.float32)
    assert "\n" not in str(e.value)
    file.write_bytes(b"\x08")  # not even a header
    with pytest.raises(ValueError, match=f"{WEIGHTS}: not a readable safetensors"):
        hf.load_params(str(tmp_path), dtype=jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_hidden_layers", "2", "num_hidden_layers must be a positive integer, got '2'"),
        ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
        (None, "{not json", "not valid JSON"),
    ],
)
def test_bad_config_json_is_one_line_naming_the_file(tmp_path, field, value, match):
    from jmem.models import hf

    _hf_checkpoint(tmp_path)
    config = tmp_path / "config.json"
    if field is None:
        config.write_text(value)
    else:
        raw = json.loads(config.read_text())
        raw[field] = value
        config.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"config.json: {match}"):
        hf.load_config(str(tmp_path))


# ------------------------------------------------------------------ the run directory's lock


def _lock_holder(out):
    """A process that holds ``out/.lock`` as a run would, until killed."""
    code = (
        "import fcntl, os, socket, sys, time\n"
        f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.pwrite(fd, f'{os.getpid()} {socket.gethostname()}'.encode(), 0)\n"
        "print('locked', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_locked_out_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, capsys):
    from jmem._src.finetune.runlock import RunLock

    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"steps": 2}')
    holder = _lock_holder(out)
    try:
        for extra in ([], ["--resume"], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                jmem.finetune.main(SMALL + ["--steps", "2", "--out", str(out), *extra])
            line = helpers.one_line_error(capsys, e, "--out", "in use by another run")
            assert f"pid {holder.pid}" in line
        assert (out / "summary.json").read_text() == '{"steps": 2}'  # --overwrite: kept
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(str(out))
    notes = lock.acquire()  # the kernel released the dead process's lock
    assert len(notes) == 1 and f"took over the lock of pid {holder.pid}" in notes[0]
    assert (out / ".lock").read_text().split()[0] == str(os.getpid())
    lock.release()
    assert (out / ".lock").read_text() == ""
    with RunLock(str(out)) as again:
        assert again.acquire() == []  # released cleanly: no note


# ------------------------------------------------------------- --resume checks what it resumes


def _recorded_run(tmp_path, **flags):
    """``--out`` holding run.json (with fingerprints) of a run on a checkpoint and data file,
    as a run writes it; returns ``(config, out)``."""
    from jmem._src.finetune.rundir import run_record
    from jmem._src.finetune.rundir import write_json

    ckpt, data, out = tmp_path / "model", tmp_path / "data.txt", tmp_path / "run"
    _hf_checkpoint(ckpt)
    data.write_text("hello world, " * 200)
    out.mkdir()
    config = jmem.finetune.FinetuneConfig.from_flat(
        checkpoint=str(ckpt), data=str(data), out=str(out), tokenizer="byte", steps=4, **flags
    )
    write_json(str(out / "run.json"), run_record(config))
    return config, out


def _resume_refusal(config, **changes):
    from jmem._src.finetune.rundir import prepare_out

    with pytest.raises(jmem._src.cli.CliError) as e:
        prepare_out(config.replace(resume=True, **changes))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.slow
def test_resume_refuses_another_base_model_or_data_by_content(tmp_path, monkeypatch):
    config, out = _recorded_run(tmp_path)
    record = (out / "run.json").read_bytes()
    ckpt, data = tmp_path / "model", tmp_path / "data.txt"
    # the same files by another spelling are the same run (no checkpoint yet: that error)
    monkeypatch.chdir(tmp_path)
    line = _resume_refusal(config, data="./data.txt", checkpoint="model/")
    assert "--resume: no checkpoint in" in line
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "rope_theta": 1234.0}))
    line = _resume_refusal(config)
    assert f"--checkpoint {ckpt}: config.json changed" in line
    (ckpt / "config.json").write_text(json.dumps(raw))
    _hf_checkpoint(ckpt, seed=1)  # another model of the same shapes at the same path
    assert f"{WEIGHTS} changed" in _resume_refusal(config)
    _hf_checkpoint(ckpt, seed=0)
    data.write_text("hello world, " * 100)  # halved
    line = _resume_refusal(config)
    assert f"--data {data}: size 1300 bytes (was 2600)" in line
    data.write_text("HELLO WORLD, " * 200)  # same size, other text
    assert "content changed" in _resume_refusal(config)
    assert (out / "run.json").read_bytes() == record  # a refused resume keeps run.json


def test_resume_refuses_a_flag_that_changes_the_state_tree(tmp_path):
    config, out = _recorded_run(tmp_path)
    line = _resume_refusal(config, lora_dropout=0.1)
    assert "--lora-dropout 0.1 (was 0.0)" in line and "--overwrite" in line


@pytest.mark.parametrize("name", ["run.json"])
def test_damaged_run_record_is_one_line_naming_it(tmp_path, name):
    config, out = _recorded_run(tmp_path)
    (out / name).write_text('{"lora_rank": 8, "trunc')
    line = _resume_refusal(config)
    assert f"{out / name}: cannot be read" in line and "--overwrite" in line


# ------------------------------------------------ unwritable, read-only or full --out (fast)


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size, ro=False)``: a tmpfs of ``size`` bytes (root and mount(8) needed; the
    test is skipped otherwise). Unmounted at the end."""
    mounted = []

    def mount(size, ro=False):
        path = tmp_path / f"mnt{len(mounted)}"
        path.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
        )
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _refused_before_training(capsys, argv, *words):
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(SMALL + ["--steps", "2", *argv])
    line = helpers.one_line_error(capsys, e, *words)
    assert "compiled the train step" not in capsys.readouterr().out
    return line


def test_out_under_a_regular_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    _refused_before_training(capsys, ["--out", str(out)], "--out", "Not a directory")
    line = _refused_before_training(
        capsys,
        ["--out", str(tmp_path / "run"), "--export-merged", str(out)],
        "--export-merged",
        "cannot write",
    )
    assert "Not a directory" in line
    assert not (tmp_path / "run" / "run.json").exists()  # nothing blocks a retry
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_read_only_or_full_out_is_refused_before_training(tmp_path, tmpfs, capsys):
    ro = tmpfs("1m", ro=True)
    _refused_before_training(capsys, ["--out", str(ro / "run")], "--out", "Read-only file system")
    merged = ro / "merged"
    line = _refused_before_training(
        capsys, ["--out", str(tmp_path / "run"), "--export-merged", str(merged)], "--export-merged"
    )
    assert "Read-only file system" in line
    full = tmpfs("32k")
    line = _refused_before_training(capsys, ["--out", str(full / "run")], "--out", "disk is full")
    assert "No space left on device" in line


# ------------------------------------------------------- runs broken on purpose (slow: train)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run (checkpoints 2 and 4): ``(out, summary)``."""
    out = tmp_path_factory.mktemp("reference") / "run"
    summary = jmem.finetune.main(SMALL + ["--steps", "4", "--out", str(out)])
    return out, summary


def _copy_run(reference, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    return out


def _results(out):
    """The bytes of a run's results (summary, plot, adapters)."""
    files = [out / "summary.json", out / "loss.png", *sorted((out / "adapter").iterdir())]
    return {str(p): p.read_bytes() for p in files}


@pytest.mark.slow
def test_damaged_checkpoint_resumes_from_the_intact_one_bitwise(reference, tmp_path, capsys):
    """Checkpoint 4 byte-flipped and the outputs gone (killed while writing them): the
    resume names the damaged file, restores step 2 and trains steps 3-4 again, bit for bit."""
    out = _copy_run(reference, tmp_path)
    name = _damage("flip", out / "checkpoints" / "4")
    os.remove(out / "summary.json")
    summary = jmem.finetune.main(SMALL + ["--steps", "4", "--out", str(out), "--resume"])
    printed = capsys.readouterr().out
    assert f"note: checkpoint step 4 in '{out / 'checkpoints'}' is damaged: {name}" in printed
    assert "Resumed at step 2" in printed
    assert summary["losses"] == reference[1]["losses"]  # steps 3-4 again, bitwise
    ck = Checkpointer(str(out / "checkpoints"))
    assert ck.all_steps() == [2, 4] and ck.verify(4) == []
    assert (out / "checkpoints" / "4.damaged").is_dir()  # set aside, not deleted


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_nonfinite_loss_stops_with_one_line_and_keeps_the_results(
    reference, tmp_path, capsys, precision
):
    """--lr 1e30 from step 5 on: the run stops at its first non-finite loss, names the last
    good checkpoint, writes no checkpoint after it and leaves the earlier results as
    they were."""
    out = _copy_run(reference, tmp_path)
    before = _results(out)
    argv = SMALL + ["--steps", "8", "--out", str(out), "--resume", "--lr", "1e30"]
    if precision == "fp16":  # a new fp16 run: its checkpoints hold a dynamic loss scale
        out = tmp_path / "fp16"
        argv = SMALL + ["--steps", "8", "--out", str(out), "--lr", "1e30", "--precision", "fp16"]
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(argv)
    line = helpers.one_line_error(capsys, e, "step ", "stopped without writing")
    if precision == "bf16":
        assert "the loss is nan" in line or "the loss is inf" in line
        assert f"the last good checkpoint is step 4 in {out / 'checkpoints'}" in line
        assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]
        assert _results(out) == before
    else:
        assert "last good checkpoint" in line or "no checkpoint was written" in line
        assert not (out / "summary.json").exists() and not (out / "adapter").exists()


@pytest.mark.slow
def test_inf_in_the_base_weights_is_refused_naming_the_tensor(tmp_path, capsys):
    from jmem._src.finetune.rundir import prepare_out

    ckpt = tmp_path / "model"
    _hf_checkpoint(ckpt)
    _edit_tensor(ckpt, Q_PROJ, lambda w: np.where(w == w.flat[3], np.inf, w))
    argv = [a for a in SMALL if a not in ("--config", "tiny")]
    argv += ["--checkpoint", str(ckpt), "--tokenizer", "byte", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(argv + ["--steps", "2"])
    helpers.one_line_error(capsys, e, "--checkpoint", Q_PROJ, "non-finite")
    assert not (tmp_path / "run" / "run.json").exists()  # the retry is not refused
    assert prepare_out(jmem.finetune.parse_args(argv + ["--steps", "2"])) is None


def _killed(phase, argv):
    worker = os.path.join(os.path.dirname(__file__), "_faults_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, worker, phase, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == -9, stdout[-2000:] + stderr[-2000:]
    assert stdout.rstrip().endswith("killed")
    return proc.pid


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["save:4", "outputs"])
def test_a_run_killed_at_each_phase_resumes_to_the_same_results(reference, tmp_path, capsys, phase):
    """kill -9 while checkpoint 4 is saved (its files written, before orbax's rename) or
    after the last checkpoint (before the adapters): --resume takes over the dead run's
    lock, continues from the last committed checkpoint (or only writes the outputs) and
    gives the uninterrupted run's losses bit for bit."""
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "4", "--out", str(out)]
    pid = _killed(phase, argv)
    assert not (out / "summary.json").exists()
    summary = jmem.finetune.main(argv + ["--resume"])
    printed = capsys.readouterr().out
    assert f"took over the lock of pid {pid}" in printed
    assert ("Resumed at step 2" if phase == "save:4" else "Resumed at step 4") in printed
    assert "Nothing to do" not in printed
    assert summary["losses"] == reference[1]["losses"]
    assert (out / "adapter" / "adapter_config.json").exists()
    assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_names_the_last_good_checkpoint(tmp_path, tmpfs, capsys):
    """A 700 KiB tmpfs: checkpoint 2 (about 490 KiB) fits, checkpoint 4 does not."""
    out = tmpfs("700k") / "run"
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(SMALL + ["--steps", "4", "--out", str(out)])
    line = helpers.one_line_error(capsys, e, "could not be written")
    assert f"the last good checkpoint is step 2 in {out / 'checkpoints'}" in line
    ck = Checkpointer(str(out / "checkpoints"))
    assert ck.all_steps() == [2] and ck.verify(2) == []


@pytest.mark.slow
def test_fp16_run_with_skipped_steps_resumes_bitwise_on_one_step_counter(
    tmp_path, capsys, monkeypatch
):
    """A loss scale that starts too high (2^22) makes the first fp16 steps overflow and be
    skipped, as a calibrating scale does. Checkpoints, losses and resume count attempted
    steps (skipped ones included), and a run resumed after the skips gives the same losses
    and skips bit for bit."""
    import jmem._src.finetune.build as build

    monkeypatch.setattr(
        build, "DynamicLossScale", lambda scale, period: DynamicLossScale(2.0**22, period=period)
    )
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "6", "--precision", "fp16", "--out", str(out)]
    full = jmem.finetune.main(argv)
    assert full["skipped_steps"], "no step was skipped: the test needs a higher scale"
    assert len(full["losses"]) == 6
    ck = Checkpointer(str(out / "checkpoints"))
    assert ck.all_steps() == [4, 6]
    import shutil

    shutil.rmtree(out / "checkpoints" / "6")
    capsys.readouterr()
    resumed = jmem.finetune.main(argv + ["--resume"])
    assert "Resumed at step 4" in capsys.readouterr().out
    assert resumed["losses"] == full["losses"]
    assert resumed["skipped_steps"] == full["skipped_steps"]
    assert resumed["learning_rates"] == full["learning_rates"]


# --------------------------------------------------------------------- multi-process flags


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num-processes", "2", "--process-id", "5"], ["--process-id 5", "below"]),
        (["--num-processes", "2", "--process-id", "2"], ["--process-id 2", "0 to 1"]),
    ],
)
def test_process_flags_are_checked_in_one_line(capsys, flags, words):
    argv = ["--coordinator", "127.0.0.1:1234", *flags, "--out", "unused"]
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(SMALL + argv)
    helpers.one_line_error(capsys, e, *words)


@pytest.mark.parametrize("address", ["nohostport", "host:", ":1234", "host:99999", "host:x"])
def test_coordinator_must_be_host_and_port(capsys, address):
    argv = ["--coordinator", address, "--num-processes", "2", "--process-id", "0"]
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(SMALL + argv + ["--out", "unused"])
    helpers.one_line_error(capsys, e, f"--coordinator {address}", "HOST:PORT")


def test_damaged_summary_and_a_stray_step_directory(tmp_path, capsys):
    """A run whose last committed checkpoint is at --steps: a stray empty ``checkpoints/9``
    is no checkpoint, and a damaged summary.json is one line naming it."""
    from jmem._src.finetune.rundir import prepare_out

    out = tmp_path / "run"
    ck = Checkpointer(str(out / "checkpoints"), save_every=1)
    ck.save(2, _state(2))
    ck.close()
    (out / "checkpoints" / "9").mkdir()
    argv = SMALL + ["--steps", "2", "--out", str(out), "--resume"]
    assert prepare_out(jmem.finetune.parse_args(argv)) == 2
    (out / "summary.json").write_text('{"steps": 2, "loss')
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(argv)
    helpers.one_line_error(capsys, e, f"{out / 'summary.json'}: cannot be read", "--overwrite")
