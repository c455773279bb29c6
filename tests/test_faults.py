"""Fault injection: damaged checkpoints, non-finite runs, a locked run directory,
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
from jmem._src.finetune.config_file import parse_args

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


@pytest.mark.slow
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
    """Checkpoint 4 byte-flipped, the outputs whole: ``--resume`` is not "Nothing to do" but
    names the damaged file, restores step 2 and trains steps 3-4 again, bit for bit."""
    out = _copy_run(reference, tmp_path)
    name = _damage("flip", out / "checkpoints" / "4")
    summary = jmem.finetune.main(SMALL + ["--steps", "4", "--out", str(out), "--resume"])
    printed = capsys.readouterr().out
    # the outputs are there, but "Nothing to do" re-verifies the checkpoint first
    assert "Nothing to do" not in printed
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
    assert prepare_out(parse_args(argv + ["--steps", "2"])) is None


@pytest.mark.slow
def test_a_run_that_fails_in_its_first_step_leaves_nothing_that_refuses_its_retry(
    tmp_path, monkeypatch
):
    """An error in the first step (here the compile raises) leaves no ``run.json`` and no
    checkpoint directory in ``--out``: there is nothing to resume, so running the same
    command again is not refused as "already holds a run" (the ``--out`` the run created
    is removed)."""
    from jmem._src.finetune import loop  # noqa: PLC0415
    from jmem._src.finetune.rundir import prepare_out  # noqa: PLC0415

    def failing(*args):
        raise RuntimeError("the first step failed")

    monkeypatch.setattr(loop, "_compile", failing)
    keep = tmp_path / "keep"
    keep.mkdir()  # an --out that existed before the run is kept, emptied of the run
    for out in (tmp_path / "new", keep):
        argv = SMALL + ["--steps", "2", "--out", str(out), "--host-allocator", "system"]
        with pytest.raises(RuntimeError, match="the first step failed"):
            jmem.finetune.main(argv)
        assert not (out / "run.json").exists() and not (out / "checkpoints").exists()
        assert prepare_out(parse_args(argv)) is None
    assert not (tmp_path / "new").exists() and keep.is_dir()


_killed = helpers.killed


@pytest.mark.slow
def test_a_run_killed_at_each_phase_resumes_to_the_same_results(reference, tmp_path, capsys):
    """kill -9 while checkpoint 4 is saved (its files written, before orbax's rename); the
    resume of that run killed -9 after the last checkpoint (before the adapters); a second
    --resume. Each resume takes over the dead run's lock and continues from the last
    committed checkpoint (step 2, then 4: only the outputs are left to write), and the last
    one gives the uninterrupted run's losses bit for bit. (One chain of kills: the run the
    ``outputs`` kill interrupts is itself a resume.)"""
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "4", "--out", str(out)]
    pid = _killed("save:4", argv)
    assert not (out / "summary.json").exists()
    expect = (f"took over the lock of pid {pid}", "Resumed at step 2")
    pid = _killed("outputs", argv + ["--resume"], expect)
    assert not (out / "summary.json").exists()
    summary = jmem.finetune.main(argv + ["--resume"])
    printed = capsys.readouterr().out
    assert f"took over the lock of pid {pid}" in printed
    assert "Resumed at step 4" in printed
    assert "Nothing to do" not in printed
    assert summary["losses"] == reference[1]["losses"]
    assert (out / "adapter" / "adapter_config.json").exists()
    assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]


@pytest.mark.slow
def test_an_offload_params_run_killed_mid_save_resumes_to_the_in_memory_losses(tmp_path, capsys):
    """--offload params (the frozen base in pinned_host, streamed per layer; one device):
    kill -9 while checkpoint 4 is saved, --resume from checkpoint 2; the losses are the
    uninterrupted in-memory run's on one device bit for bit (on XLA:CPU the copies move no
    bytes: the same arithmetic)."""
    one = ["--mesh", "data=1,fsdp=1"]
    plain = jmem.finetune.main(SMALL + ["--steps", "4", "--out", str(tmp_path / "ref"), *one])
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "4", "--out", str(out), "--offload", "params", *one]
    _killed("save:4", argv)
    summary = jmem.finetune.main(argv + ["--resume"])
    assert "Resumed at step 2" in capsys.readouterr().out
    assert summary["losses"] == plain["losses"]
    assert summary["eval_losses"] == plain["eval_losses"]
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
    and skips bit for bit.

    The learning-rate schedule counts applied updates (the optimizer state, optax's count
    in it, is kept whole on a skipped step): the rate the optimizer used at each applied
    step, recorded from inside the compiled step, is schedule(updates applied before it),
    and it is the rate logged for that step."""
    import jmem._src.finetune.build as build

    monkeypatch.setattr(
        build, "DynamicLossScale", lambda scale, period: DynamicLossScale(2.0**22, period=period)
    )
    used, real = [], optax.warmup_cosine_decay_schedule

    def recorded(*args, **kwargs):
        schedule = real(*args, **kwargs)

        def lr(count):
            value = schedule(count)
            if jnp.ndim(count) == 0:  # inside the step (the loop's table is a vector)
                jax.debug.callback(lambda c, v: used.append((int(c), float(v))), count, value)
            return value

        return lr

    monkeypatch.setattr(optax, "warmup_cosine_decay_schedule", recorded)
    out = tmp_path / "run"
    argv = SMALL + ["--steps", "6", "--precision", "fp16", "--out", str(out)]
    full = jmem.finetune.main(argv)
    assert full["skipped_steps"], "no step was skipped: the test needs a higher scale"
    assert len(full["losses"]) == 6
    applied = [s for s in range(6) if s + 1 not in full["skipped_steps"]]
    if len(used) == 6:  # on a mesh the skip is a select: the update runs on every step
        used[:] = [used[s] for s in applied]
    assert [c for c, _ in used] == list(range(len(applied)))  # the count: updates applied
    assert [v for _, v in used] == [full["learning_rates"][s] for s in applied]
    used.clear()
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


def test_a_stray_step_directory_is_no_checkpoint(tmp_path):
    """A run whose last committed checkpoint is at --steps: a stray empty ``checkpoints/9``
    is no checkpoint."""
    from jmem._src.finetune.rundir import prepare_out

    out = tmp_path / "run"
    ck = Checkpointer(str(out / "checkpoints"), save_every=1)
    ck.save(2, _state(2))
    ck.close()
    (out / "checkpoints" / "9").mkdir()
    argv = SMALL + ["--steps", "2", "--out", str(out), "--resume"]
    assert prepare_out(parse_args(argv)) == 2


# ------------------------------------------- results published at once, never half-written


def _tree(root):
    """``{relative path: bytes}`` of every file under ``root`` (the lock file left out)."""
    root = pathlib.Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in _files(root) if p.name != ".lock"}


#: What a run publishes in --out (its results; checkpoints and run.json are its state).
OUTPUTS = ("adapter", "summary.json", "loss.png", "outputs.json")


class _Killed(BaseException):
    """Stands for a SIGKILL inside ``publish``: nothing after it runs."""


def test_a_publish_killed_at_any_rename_is_finished_or_undone_never_mixed(tmp_path, monkeypatch):
    """``publish`` killed before each of its renames (journal and manifest writes included):
    the next run's ``recover`` leaves either the earlier results byte for byte or the new
    ones whole (``verify_outputs`` clean), never a mix; nothing is left aside."""
    from jmem._src.finetune import publish as pub

    def make(root):
        out, merged = root / "run", root / "merged"
        for base, tag in ((out, "old"), (out / ".staging", "new")):
            (base / "adapter").mkdir(parents=True)
            for name in ("adapter/adapter_model.safetensors", "summary.json", "loss.png"):
                (base / name).write_text(f"{tag} {name}")
        merged.mkdir()
        (merged / "config.json").write_text("old")
        staged = pathlib.Path(str(merged) + pub.MERGED_STAGING)
        staged.mkdir()
        (staged / "config.json").write_text("new")
        return out, merged

    real_replace, k = os.replace, 0
    while True:
        root = tmp_path / f"k{k}"
        out, merged = make(root)
        old = {n: v for n, v in _tree(out).items() if not n.startswith(".staging")}
        new = _tree(out / ".staging")
        calls = []

        def dying(src, dst, _calls=calls, _k=k):
            if len(_calls) == _k:
                raise _Killed
            _calls.append(src)
            real_replace(src, dst)

        monkeypatch.setattr(pub.os, "replace", dying)
        paths = pub.RunPaths(str(out), str(merged))
        try:
            pub.publish(paths, steps=4)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.setattr(pub.os, "replace", real_replace)
        notes = pub.recover(str(out), str(merged))
        now = _tree(out)
        if now == old:
            assert (merged / "config.json").read_text() == "old", k
            assert notes and not finished
        else:
            assert {n: now[n] for n in new} == new, k
            assert (merged / "config.json").read_text() == "new", k
            assert pub.verify_outputs(str(out), 4, str(merged)) == [], k
        assert sorted(os.listdir(root)) == ["merged", "run"], k
        assert not {".staging", ".replaced", ".publish.json"} & set(os.listdir(out)), k
        if finished:
            assert k == 11  # manifest, journal, 3 outputs (2 each), outputs.json, the export (2)
            break
        k += 1


@pytest.mark.slow
def test_a_kill_during_the_export_keeps_the_earlier_result_and_resume_finishes_it(
    reference, tmp_path, capsys
):
    """kill -9 while the adapters are written, then while ``--export-merged`` is: the
    earlier results in --out stay byte for byte (the half-written files are aside, in
    ``.staging`` and ``merged.jmem-staging``); ``--resume`` removes them, restores the
    committed checkpoint and publishes whole outputs."""
    from jmem._src.finetune.publish import verify_outputs
    from jmem.models import hf
    from jmem.models import llama

    out, merged = _copy_run(reference, tmp_path), tmp_path / "merged"
    results = lambda: {n: v for n, v in _tree(out).items() if n.split("/")[0] in OUTPUTS}
    before = results()  # a resume adds checkpoints and rewrites run.json; these are kept
    argv = SMALL + ["--steps", "6", "--out", str(out), "--resume"]
    _killed("export:adapter", argv)
    staged = out / ".staging" / "adapter"
    assert (staged / "adapter_model.safetensors").exists()
    assert not (staged / "adapter_config.json").exists()  # half-written, aside
    assert results() == before
    argv += ["--export-merged", str(merged)]
    _killed("export:merged", argv)
    assert (tmp_path / "merged.jmem-staging" / "model-00001-of-00001.safetensors").exists()
    assert not merged.exists() and results() == before
    summary = jmem.finetune.main(argv)
    printed = capsys.readouterr().out
    assert f"note: removed {out / '.staging'}" in printed
    assert f"note: removed {tmp_path / 'merged.jmem-staging'}" in printed
    assert "Resumed at step 6" in printed and "outputs.json: the outputs are of step 4" in printed
    assert summary["steps"] == 6 and summary["losses"][:4] == reference[1]["losses"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    assert verify_outputs(str(out), 6, str(merged)) == []
    assert hf.load_config(str(merged)).num_layers == llama.get_config("tiny").num_layers
    assert sorted(os.listdir(tmp_path)) == ["merged", "run"]


@pytest.mark.slow
def test_a_failing_overwrite_leaves_the_earlier_run_byte_identical(reference, tmp_path, capsys):
    """``--overwrite`` works aside (``--out/.staging``) and replaces the earlier run only
    once it has succeeded: bad data, a NaN loss and a kill -9 each leave every file of the
    earlier run as it was; a run that succeeds replaces all of it."""
    out = _copy_run(reference, tmp_path)
    before = _tree(out)
    argv = SMALL + ["--steps", "4", "--out", str(out), "--overwrite"]
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(argv + ["--data", str(tmp_path / "missing.txt")])
    helpers.one_line_error(capsys, e, "--data")
    with pytest.raises(SystemExit) as e:
        jmem.finetune.main(argv + ["--lr", "1e30"])
    line = helpers.one_line_error(capsys, e, "the loss is", "stopped without writing")
    assert f"--overwrite: the earlier run in {out} is kept as it was" in line
    assert _tree(out) == before
    _killed("save:4", argv + ["--lr", "1e-3"])  # checkpoint 2 of the new run was written
    assert (out / ".staging" / "checkpoints" / "2").is_dir()
    assert {k: v for k, v in _tree(out).items() if not k.startswith(".staging")} == before
    summary = jmem.finetune.main(argv + ["--lr", "1e-3"])
    assert f"note: removed {out / '.staging'}" in capsys.readouterr().out
    assert summary["args"]["lr"] == 1e-3 and summary["losses"] != reference[1]["losses"]
    assert json.loads((out / "summary.json").read_text())["args"]["lr"] == 1e-3
    assert json.loads((out / "run.json").read_text())["lr"] == 1e-3
    for step in (2, 4):
        meta = json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())
        assert meta["args"]["lr"] == 1e-3
    assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]
    assert not (out / ".staging").exists()


@pytest.mark.slow
def test_two_training_runs_on_one_out(reference, tmp_path, capsys):
    """A real run holds --out (paused after checkpoint 2): a second run on it, with
    ``--resume --lr 1e-3`` or ``--overwrite``, is refused in one line naming the first's
    pid; the first then finishes with its own checkpoints and the reference's losses."""
    out, go = tmp_path / "run", tmp_path / "go"
    argv = SMALL + ["--steps", "4", "--out", str(out)]
    worker = os.path.join(os.path.dirname(__file__), "_faults_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FAULTS_GO": str(go)}
    first = subprocess.Popen(
        [sys.executable, worker, "pause:2", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert any(line.strip() == "paused" for line in first.stdout)
        for extra in (["--resume", "--lr", "1e-3"], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                jmem.finetune.main(argv + extra)
            helpers.one_line_error(capsys, e, "in use by another run", f"pid {first.pid} ")
    finally:
        go.touch()
        stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())["losses"] == reference[1]["losses"]
    assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]
    for step in (2, 4):
        meta = json.loads((out / "checkpoints" / str(step) / "meta" / "metadata").read_text())
        assert meta["args"]["lr"] == 3e-3


@pytest.mark.slow
def test_nothing_to_do_verifies_the_outputs(reference, tmp_path, capsys):
    """``--resume`` with the checkpoint at --steps re-hashes the outputs: a byte-flipped
    adapter and a truncated summary.json are named in one line, not called done, and
    written again from the checkpoint (the adapter byte for byte as before)."""
    from jmem._src.finetune.publish import verify_outputs

    out = _copy_run(reference, tmp_path)
    adapter = out / "adapter" / "adapter_model.safetensors"
    good = adapter.read_bytes()
    _flip(adapter)
    (out / "summary.json").write_text('{"steps": 4, "loss')
    argv = SMALL + ["--steps", "4", "--out", str(out), "--resume"]
    summary = jmem.finetune.main(argv)
    printed = capsys.readouterr().out
    note = [ln for ln in printed.splitlines() if "the outputs are not this run's" in ln]
    assert len(note) == 1 and "adapter/adapter_model.safetensors: content differs" in note[0]
    assert "(and 1 more)" in note[0] and "Nothing to do" not in printed
    assert "Resumed at step 4" in printed
    assert adapter.read_bytes() == good and summary["losses"] == reference[1]["losses"]
    assert verify_outputs(str(out), 4, None) == []
    jmem.finetune.main(argv)
    assert "Nothing to do: the checkpoint is at step 4" in capsys.readouterr().out
