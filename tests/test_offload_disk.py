"""Optimizer state on disk (``offload_optimizer="disk"``, ``jmem.offload(memory_kind="disk")``):
steps bitwise equal to in-memory training, file sizes, directory errors (docs/offload.md)."""

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import helpers
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import assert_bitwise_equal
from test_faults import tmpfs  # noqa: F401 (the fixture: a tmpfs, read-only or small)

import jmem
from jmem import finetune
from jmem._src.offload import disk


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["kernel"] + p["b"] - b["y"]) ** 2)


def _params():
    return {
        "w": jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16),
        "kernel": jnp.cos(jnp.arange(16.0 * 4)).reshape(16, 4) / 4,
        "b": jnp.zeros(4),
    }


def _batch(k):
    x = jnp.sin(jnp.arange(6.0 * 8).reshape(6, 8) * (k + 1))
    return {"x": x, "y": jnp.cos(jnp.arange(24.0).reshape(6, 4) + k)}


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=jmem.decay_mask),
    # 8-bit moments for every leaf (blocks of 32), behind the job's global-norm clip
    "adamw_8bit_clipped": lambda: optax.chain(
        optax.clip_by_global_norm(0.05),
        jmem.adamw_8bit(1e-2, block_size=32, min_8bit_size=0, mask=jmem.decay_mask),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "master_weights"), [("adamw", False), ("adamw_8bit_clipped", True)]
)
def test_disk_steps_bitwise_equal_in_memory(tmp_path, name, master_weights):
    kw = dict(
        master_weights=master_weights, precision="p=bf16,c=bf16,o=f32" if master_weights else None
    )
    ref = jmem.train_step(_loss, OPTIMIZERS[name](), **kw)
    step = jmem.train_step(
        _loss, OPTIMIZERS[name](), offload_optimizer="disk", offload_dir=tmp_path / "s", **kw
    )
    s_ref, s = ref.init(_params()), step.init(_params())
    assert isinstance(s.opt_state, disk.DiskState)
    for k in range(3):
        s_ref, m_ref = ref(s_ref, _batch(k))
        s, m = step(s, _batch(k))
        assert float(m["loss"]) == float(m_ref["loss"])
    assert_bitwise_equal((s_ref.params, s_ref.opt_state), (s.params, s.opt_state.full()))
    store = s.opt_state.store
    # the files hold exactly the per-parameter state: its bytes, nothing else
    files = [f for f in os.listdir(tmp_path / "s") if f.endswith(".bin")]
    shared = jax.tree.leaves(s.opt_state.shared)
    state_bytes = jmem.tree.nbytes(s_ref.opt_state) - sum(x.nbytes for x in shared)
    assert sum(os.path.getsize(tmp_path / "s" / f) for f in files) == store.nbytes == state_bytes
    assert len(files) == len(store.owned)
    assert json.loads((tmp_path / "s" / disk.STEP_FILE).read_text()) == {
        "clean": True,
        "updates": 3,
    }
    # the step read and wrote every state byte once per step (plus the writes of init)
    assert store.bytes_read == 3 * store.nbytes
    assert store.bytes_written == 4 * store.nbytes


def test_disk_state_round_trip_and_skip(tmp_path):
    """``full()`` -> ``restored()`` rebuilds the files (resume from a checkpoint); a
    non-finite step leaves them bitwise unchanged."""
    opt = OPTIMIZERS["adamw"]()
    step = jmem.train_step(_loss, opt, offload_optimizer="disk", offload_dir=tmp_path / "s")
    s, _ = step(step.init(_params()), _batch(0))
    saved = s.opt_state.full(copy=True)
    s, _ = step(s, _batch(1))
    s = s.replace(opt_state=s.opt_state.restored(saved))
    assert_bitwise_equal(s.opt_state.full(copy=True), saved)
    bad = {"x": _batch(2)["x"].at[0, 0].set(jnp.nan), "y": _batch(2)["y"]}
    s2, m = step(s, bad)
    assert not bool(m["grads_finite"])
    assert_bitwise_equal(s2.opt_state.full(copy=True), saved)


def test_offload_wrapper_disk_matches_plain_update(tmp_path):
    opt = optax.adamw(1e-2)
    tx = jmem.offload(opt, memory_kind="disk", directory=str(tmp_path / "s"))
    params, g = _params(), jax.tree.map(jnp.sin, _params())
    u_ref, s_ref = jax.jit(opt.update)(g, opt.init(params), params)
    u, s = jax.jit(tx.update)(g, tx.init(params), params)
    assert_bitwise_equal((u_ref, s_ref), (u, s.full()))


def test_disk_rejects_cross_leaf_state(tmp_path):
    """A state whose update mixes parameter leaves cannot stream leaf by leaf."""
    Mixed = namedtuple("Mixed", "m")

    def update(g, state, params=None):
        total = sum(jnp.sum(x) for x in jax.tree.leaves(state.m))
        return g, Mixed(jax.tree.map(lambda m: m + total, state.m))

    opt = optax.GradientTransformation(lambda p: Mixed(jax.tree.map(jnp.zeros_like, p)), update)
    tx = jmem.offload(opt, memory_kind="disk", directory=str(tmp_path / "s"))
    params = _params()
    with pytest.raises(ValueError, match="separable"):
        jax.jit(tx.update)(params, tx.init(params), params)


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_bad_offload_dir_one_line_errors(tmp_path, monkeypatch):
    opt = optax.adamw(1e-2)
    with pytest.raises(ValueError) as e:
        jmem.train_step(_loss, opt, offload_optimizer="disk", offload_dir=tmp_path / "no" / "s")
    _one_line(e, "offload_dir", "parent", "does not exist")
    with pytest.raises(ValueError) as e:
        jmem.train_step(_loss, opt, offload_optimizer="disk")
    _one_line(e, "offload_dir=PATH")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError) as e:
        jmem.train_step(_loss, opt, offload_optimizer="disk", offload_dir=tmp_path / "f")
    _one_line(e, "offload_dir", "is a file")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError) as e:
            jmem.train_step(_loss, opt, offload_optimizer="disk", offload_dir=ro / "s")
        _one_line(e, "offload_dir", "not writable")
        ro.chmod(0o700)
    # too small: the free space the state needs, measured by shutil.disk_usage
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage._replace(free=100))
    step = jmem.train_step(_loss, opt, offload_optimizer="disk", offload_dir=tmp_path / "s")
    with pytest.raises(ValueError) as e:
        step.init(_params())
    n = sum(x.size for x in jax.tree.leaves(_params()))
    _one_line(e, "offload_dir", f"needs {2 * 4 * n:,} bytes", "only 100")  # fp32 mu and nu
    with pytest.raises(ValueError) as e:
        jmem.offload(opt, memory_kind="disk")
    _one_line(e, "directory=PATH")


def test_planner_transfers_are_the_analytic_sums():
    """Each offloaded ledger moves in and out once per step (2 x its bytes); on disk the
    state and masters are also read and written; the time is bytes / bandwidth."""
    kw = dict(optimizer="adamw", param_dtype="bf16", seq_len=128)
    n = 1e8
    plain = jmem.planner.estimate(n, **kw)
    assert plain.transfers == {} and plain.flops == 6 * plain.n_params * 128
    host = jmem.planner.estimate(n, offload="optimizer+masters", **kw)
    s, m = plain.optimizer_state, plain.master_weights
    assert host.transfers == {"optimizer": 2 * s, "master_weights": 2 * m}
    # The backward pass loses the offloaded bytes; the leaf-by-leaf update is its own phase.
    assert host.static + host.activations == plain.total - s - m
    assert host.total == max(host.static + host.activations, host.update_phase)
    on_disk = jmem.planner.estimate(n, offload="disk", **kw)
    assert on_disk.transfers == {"optimizer": 2 * s, "master_weights": 2 * m, "disk": 2 * (s + m)}
    assert dict(on_disk.disk) == {"optimizer_state": s, "master_weights": m}
    assert "optimizer_state" not in on_disk.host and on_disk.static == host.static
    assert on_disk.update_phase >= host.update_phase  # the disk rung updates whole leaves
    secs = on_disk.transfer_seconds(pcie_gbps=20.0, disk_gbps=4.0)
    assert secs["disk"] == 2 * (s + m) / 4e9 and secs["optimizer"] == 2 * s / 20e9
    line = on_disk.trade(20.0, 4.0)
    assert f"moves {4 * (s + m) / 1e9:.3g} GB per step" in line and "at 4 GB/s" in line
    advice = jmem.planner.advise("8GB", n * 30, **kw)
    names = [lv.name for lv in advice.suggestions]
    rungs = [k for k, x in enumerate(names) if "offload" in x or "disk" in x]
    assert [names[k] for k in rungs][-1].endswith("on disk (NVMe)")  # the costliest rung last


# ------------------------------------------------------------------ the job: kill -9, resume

SMALL = ["--config", "tiny", "--batch-size", "4", "--seq-len", "16", "--lora-rank", "4"]
SMALL += ["--no-progress", "--lr", "3e-3", "--eval-split", "0", "--save-every", "2"]
SMALL += ["--steps", "3", "--lora-targets", ".*(q_proj|v_proj).*"]  # 4 adapters, 8 files


def _bin_files(directory):
    return {f: (directory / f).read_bytes() for f in sorted(os.listdir(directory)) if ".bin" in f}


def _saved_state(out, step):
    """Checkpoint ``step``'s train state as orbax saved it (nested dicts of arrays)."""
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer().restore(str(out / "checkpoints" / str(step) / "state"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_kill_during_a_disk_update_then_resume_is_bitwise(tmp_path, capsys):
    """``kill -9`` after 3 of the 8 leaf files of update 3 were written (checkpoint 2 is the
    last): the directory is left torn (``clean: false``, 3 files of step 3, the rest of
    step 2). ``--resume`` rebuilds the files from checkpoint 2 (it does not read them) and
    ends with the losses, adapters and optimizer state of an uninterrupted in-memory run,
    bit for bit."""
    ref = tmp_path / "ref"
    # in memory on one device (a mesh of one: --offload-dir runs on one device)
    summary_ref = finetune.main(SMALL + ["--out", str(ref), "--mesh", "data=1,fsdp=1"])
    out, state_dir = tmp_path / "run", tmp_path / "state"
    argv = SMALL + ["--out", str(out), "--offload-dir", str(state_dir)]
    worker = os.path.join(os.path.dirname(__file__), "_faults_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, worker, "disk:3:3", *argv], capture_output=True, text=True, env=env
    )
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = proc.stdout.rstrip().splitlines()[-2].split()[1:]
    assert len(written) == 3 and proc.stdout.rstrip().endswith("killed")
    assert json.loads((state_dir / disk.STEP_FILE).read_text()) == {"clean": False, "updates": 2}
    assert disk.left_mid_update(state_dir)
    torn = _bin_files(state_dir)
    assert not (out / "summary.json").exists() and (out / "checkpoints" / "2").is_dir()
    capsys.readouterr()

    summary = finetune.main(argv + ["--resume"])
    printed = capsys.readouterr().out
    assert "Resumed at step 2" in printed
    assert f"note: --offload-dir {state_dir} was left in the middle of an update" in printed
    assert "rebuilt from checkpoint step 2, not read" in printed
    assert summary["losses"] == summary_ref["losses"] and len(summary["losses"]) == 3
    for f in sorted(os.listdir(ref / "adapter")):
        assert (out / "adapter" / f).read_bytes() == (ref / "adapter" / f).read_bytes(), f
    saved, saved_ref = _saved_state(out, 3), _saved_state(ref, 3)
    assert_bitwise_equal(saved["opt_state"], saved_ref["opt_state"])
    assert_bitwise_equal(saved["params"], saved_ref["params"])
    # the files now hold step 3's state: the torn directory had 3 of them, the rest older
    final = _bin_files(state_dir)
    assert (
        set(final) == set(torn) and sum(map(len, final.values())) == summary["offload_disk_bytes"]
    )
    assert all(torn[f] == final[f] for f in written)
    assert all(torn[f] != final[f] for f in final if f not in written)
    assert json.loads((state_dir / disk.STEP_FILE).read_text())["clean"] is True
    assert summary["offload"]["optimizer_state"] == "disk"
    assert f"offload: optimizer state and masters on disk under {state_dir}" in printed


def test_bad_offload_dir_is_refused_in_one_line_before_training(
    tmp_path, capsys, monkeypatch, request
):
    """``jmem finetune --offload-dir``: a missing parent, a file, a read-only disk and a mesh
    are each one ``error:`` line (status 2) before the train step is compiled, leaving no
    run.json (a retry is not refused)."""
    (tmp_path / "file").write_text("x")
    ro = request.getfixturevalue("tmpfs")("1m", ro=True)  # skipped without root and mount(8)
    cases = [
        (ro / "s", [], ["not writable"]),
        (tmp_path / "no" / "s", [], ["parent", "does not exist"]),
        (tmp_path / "file", [], ["is a file"]),
        (tmp_path / "s", ["--mesh", "data=1,fsdp=2"], ["runs on one device", "--mesh"]),
    ]
    for k, (path, extra, words) in enumerate(cases):
        out = tmp_path / f"run{k}"
        with pytest.raises(SystemExit) as e:
            finetune.main(SMALL + ["--out", str(out), "--offload-dir", str(path), *extra])
        helpers.one_line_error(capsys, e, "--offload-dir", *words)
        assert not (out / "run.json").exists()
    assert "compiled the train step" not in capsys.readouterr().out


@pytest.mark.slow  # the NF4 base is built before the state's bytes are known (about 5 s)
def test_offload_dir_too_small_is_refused_in_one_line_before_training(
    tmp_path, capsys, monkeypatch
):
    """Too little free space for the state (``shutil.disk_usage`` says 100 bytes): one line
    naming ``--offload-dir`` and the bytes, before the train step is compiled."""
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage._replace(free=100))
    with pytest.raises(SystemExit) as e:
        finetune.main(SMALL + ["--out", str(tmp_path / "small"), "--offload-dir", str(tmp_path)])
    helpers.one_line_error(capsys, e, f"--offload-dir '{tmp_path}'", "bytes but only 100 are free")
    assert "compiled the train step" not in capsys.readouterr().out
    assert not (tmp_path / "small" / "run.json").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--offload", "params", "--remat", "none"], ["--offload params", "--remat"]),
        (["--offload", "params", "--offload-dir", "D"], ["exclude each other", "--offload-dir"]),
    ],
)
def test_offload_combinations_that_cannot_work_are_refused_in_one_line(
    tmp_path, capsys, flags, words
):
    """Each refused before anything is written (no run directory), status 2."""
    flags = [str(tmp_path / "d") if f == "D" else f for f in flags]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        finetune.main(SMALL + ["--out", str(out), *flags])
    helpers.one_line_error(capsys, e, *words)
    assert not out.exists()


def test_every_offload_in_effect_is_named_and_recorded():
    """The run's start line and ``summary.json``'s ``offload`` name each rung in effect."""
    from jmem._src.finetune.setup import offload_in_effect
    from jmem._src.finetune.setup import offload_record

    plain = finetune.FinetuneConfig.from_flat()
    assert offload_in_effect(plain) is None
    assert set(offload_record(plain).values()) == {"device", None}
    c = finetune.FinetuneConfig.from_flat(offload="params", remat="offload_inputs")
    r = offload_record(c)
    assert (r["optimizer_state"], r["params"], r["layer_inputs"]) == ("device", "host", "host")
    line = offload_in_effect(c)
    assert "frozen base in host memory" in line and "layer inputs in host memory" in line
    full = finetune.FinetuneConfig.from_flat(offload="optimizer,params", lora_rank=0)
    line = offload_in_effect(full)  # --lora-rank 0: the params stream, and they train
    assert "trained params in host memory" in line and "frozen" not in line
    d = finetune.FinetuneConfig.from_flat(offload_dir="/x")
    assert offload_record(d)["optimizer_state"] == "disk" and "/x" in offload_in_effect(d)
    with pytest.raises(ValueError, match="cannot be combined with params streamed"):
        jmem.train_step(
            lambda p, b: 0.0,
            optax.sgd(0.1),
            levers=jmem.Levers(offload_params=True),
            offload_optimizer="disk",
            offload_dir="/tmp",
        )


def test_dry_run_prints_a_transfer_line_per_rung_in_use():
    """The dry run's transfer lines (``dry_run.transfer_lines``) from the planner's ledger:
    one line per rung in use with its bytes per step, seconds at the stated bandwidth and
    the flag; ``none`` without offload."""
    from jmem._src.finetune.dry_run import transfer_lines  # noqa: PLC0415

    kw = dict(optimizer="adamw", param_dtype="bf16", seq_len=128)
    plain = jmem.planner.estimate(1e8, **kw)
    assert transfer_lines(plain, 25.0, 3.0)[0] == "transfers per step: none"
    on_disk = jmem.planner.estimate(1e8, offload="disk", **kw)
    s, m = on_disk.disk["optimizer_state"], on_disk.disk["master_weights"]
    lines = transfer_lines(on_disk, 20.0, 4.0, "--offload-dir")
    assert len(lines) == 5 and lines[0].startswith("transfers per step")
    opt, masters, disk_row = (line.split() for line in lines[1:4])
    assert opt[:3] == ["optimizer", "state", "host<->device"]
    assert float(opt[3]) == float(f"{2 * s / 1e9:.3g}") and opt[-1] == "[--offload-dir]"
    assert float(opt[5]) == float(f"{2 * s / 20e9:.3g}") and "(--pcie-gbps)" in opt
    assert masters[:3] == ["master", "weights", "host<->device"]
    assert float(masters[3]) == float(f"{2 * m / 1e9:.3g}")
    assert disk_row[4] == "disk<->host" and "(--disk-gbps)" in disk_row
    assert float(disk_row[5]) == float(f"{2 * (s + m) / 1e9:.3g}")
    assert float(disk_row[7]) == float(f"{2 * (s + m) / 4e9:.3g}")
    assert lines[4] == on_disk.trade(20.0, 4.0) + " (planner; GB = 1e9 B)"
    host = transfer_lines(jmem.planner.estimate(1e8, offload="optimizer", **kw), 25.0, 3.0)
    assert len(host) == 3 and host[1].split()[-1] == "[--offload]"


@pytest.mark.slow
def test_dry_run_with_offload_dir_prints_both_rungs(tmp_path, capsys):
    """``--dry-run --offload-dir``: the compile of the step (host offload: the same device
    footprint) prints the host<->device and the disk line; nothing is written to the
    directory (a dry run allocates nothing)."""
    state_dir = tmp_path / "state"
    argv = SMALL + ["--out", str(tmp_path / "run"), "--offload-dir", str(state_dir)]
    record = finetune.main(argv + ["--dry-run", "--disk-gbps", "2"])
    printed = capsys.readouterr().out.splitlines()
    first = printed.index("transfers per step (planner; GB = 1e9 B):")
    opt, disk_row = printed[first + 1].split(), printed[first + 2].split()
    assert opt[:3] == ["optimizer", "state", "host<->device"] and opt[-1] == "[--offload-dir]"
    assert disk_row[4] == "disk<->host" and "at 2 GB/s" in printed[first + 2]
    moved = record["transfers"]
    assert float(disk_row[5]) == float(f"{moved['disk'] / 1e9:.3g}") > 0
    assert float(opt[3]) == float(f"{moved['optimizer'] / 1e9:.3g}") > 0
    assert printed[first + 1 + len(moved)].startswith("offload saves")
    assert not state_dir.exists()


def test_offloaded_layer_inputs_are_counted_as_transfers():
    """``remat="offload_inputs"``: each layer's input goes to host in the forward pass and
    back for the backward, so the planner's transfers carry 2 x its host activations
    (``L x tokens x 2 B x hidden``), the dry run prints their line with the remat flag,
    and the run's offload line and ``summary.json``'s record carry the same bytes."""
    from jmem._src.finetune.dry_run import transfer_lines  # noqa: PLC0415
    from jmem._src.finetune.setup import offload_in_effect  # noqa: PLC0415
    from jmem._src.finetune.setup import offload_record  # noqa: PLC0415
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config("llama3_2_1b")
    kw = dict(optimizer="adamw", param_dtype="bf16", seq_len=4096, batch_size=2)
    led = jmem.planner.estimate(cfg, remat="offload_inputs", **kw)
    inputs = cfg.num_layers * 2 * 4096 * 2 * cfg.hidden_size
    assert led.host["activations"] == inputs
    assert led.transfers == {"activations": 2 * inputs}
    assert jmem.planner.estimate(cfg, remat="full", **kw).transfers == {}
    lines = transfer_lines(led, 25.0, 3.0, "--offload", "--remat offload_inputs")
    row = lines[1].split()
    assert row[:2] == ["layer", "inputs"] and row[-2:] == ["[--remat", "offload_inputs]"]
    assert float(row[5]) == float(f"{2 * inputs / 1e9:.3g}")
    c = finetune.FinetuneConfig.from_flat(remat="offload_inputs", seq_len=4096, batch_size=2)
    r = offload_record(c, cfg)
    assert r["layer_inputs"] == "host" and r["layer_inputs_bytes_per_step"] == 2 * inputs
    assert f"{2 * inputs / 1e9:.3g} GB host<->device per step" in offload_in_effect(c, cfg)
    plain = finetune.FinetuneConfig.from_flat(seq_len=4096, batch_size=2)
    assert offload_record(plain, cfg)["layer_inputs_bytes_per_step"] == 0


@pytest.mark.slow
def test_a_run_with_offloaded_layer_inputs_prints_and_records_their_bytes(tmp_path, capsys):
    """A tiny CPU run with ``--remat offload_inputs``: the start line names the layer inputs
    in host memory with their bytes per step (``2 x 2 B x L x rows x seq_len x hidden``:
    to the host in the forward pass, back for the backward) and ``summary.json``'s
    ``offload`` records the same bytes."""
    from jmem.models import llama  # noqa: PLC0415

    cfg = llama.get_config("tiny")
    out = tmp_path / "run"
    flags = SMALL + ["--steps", "1"]  # one step (the last --steps counts)
    finetune.main(flags + ["--remat", "offload_inputs", "--out", str(out)])
    moved = 2 * 2 * cfg.num_layers * 4 * 16 * cfg.hidden_size  # batch 4, 16 tokens
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("offload:")]
    assert "layer inputs in host memory (--remat offload_inputs" in line
    assert f"{moved / 1e9:.3g} GB host<->device per step" in line
    record = json.loads((out / "summary.json").read_text())["offload"]
    assert record["layer_inputs"] == "host" and record["layer_inputs_bytes_per_step"] == moved
