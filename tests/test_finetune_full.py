"""Full fine-tuning from the job (``jmem finetune --lora-rank 0``): bf16 params with fp32
masters through ``jmem.train_step``; it trains from the command line, resumes bit for bit
after kill -9, exports a model transformers loads with equal logits, and refuses the
options that contradict it in one line; its dry run compiles the full step."""

import json
import os
import re
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_faults import _killed

import jmem
import jmem.finetune
from jmem import Checkpointer
from jmem.models import hf
from jmem.models import llama

FULL = ["--config", "tiny", "--batch-size", "4", "--seq-len", "16", "--lora-rank", "0"]
FULL += ["--no-progress", "--lr", "1e-3", "--eval-split", "0", "--save-every", "2"]
FULL += ["--optimizer", "adamw", "--host-allocator", "system"]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lora-dropout", "0.1"], ("--lora-dropout", "--lora-rank 0", "drop it")),
        (["--lora-alpha", "16"], ("--lora-alpha", "--lora-rank 0")),
        (["--lora-targets", ".*q_proj.*"], ("--lora-targets", "--lora-rank 0")),
        (["--objective", "dpo"], ("--objective dpo", "--lora-rank 0", "orpo or simpo")),
        (
            ["--offload", "params", "--offload-dir", "/tmp/x"],
            ("--offload params", "--offload-dir", "exclude each other"),
        ),
        (["--offload", "params"], ("--offload params", "pass --offload optimizer,params")),
        (
            ["--offload", "optimizer,params", "--offload-dir", "/tmp/x"],
            ("--offload params", "--offload-dir", "exclude each other"),
        ),
    ],
)
def test_contradictions_of_full_finetuning_are_refused_in_one_line(extra, words, capsys):
    """Refused by the parser, before JAX or any file: one line, status 2."""
    with pytest.raises(SystemExit) as e:
        jmem.finetune.parse_args(FULL + extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)


def test_lora_rank_zero_is_accepted_and_a_negative_rank_is_not():
    config = jmem.finetune.parse_args(FULL)
    assert config.training.lora_rank == 0 and config.training.lora_alpha is None
    with pytest.raises(ValueError, match="lora_rank"):
        jmem.finetune.FinetuneConfig.from_flat(lora_rank=-1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step full fine-tuning run from the command line (``python -m jmem
    finetune``; checkpoints 2 and 4) with a merged export: ``(out, export, summary)``."""
    root = tmp_path_factory.mktemp("full")
    out, export = root / "run", root / "export"
    argv = FULL + ["--steps", "4", "--out", str(out), "--export-merged", str(export)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "jmem", "finetune", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "full fine-tuning: first loss" in proc.stdout
    assert "no PEFT adapter is written" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    return out, export, summary


@pytest.mark.slow
def test_a_full_finetuning_run_trains_every_weight(reference):
    """The loss falls; every weight is trainable; the reports say full fine-tuning; no PEFT
    adapter is written (there is none)."""
    out, _, summary = reference
    cfg = llama.get_config("tiny")
    assert summary["last_loss"] < summary["first_loss"] - 0.1, summary["losses"]
    assert summary["trainable_params"] == llama.num_params(cfg)
    assert summary["method"] == "full fine-tuning"
    assert summary["args"]["lora_rank"] == 0
    assert not (out / "adapter").exists()


@pytest.mark.slow
def test_a_full_finetuning_run_killed_mid_save_resumes_bitwise(reference, tmp_path, capsys):
    """kill -9 while checkpoint 4 is saved; --resume continues from checkpoint 2 and gives
    the uninterrupted run's losses bit for bit."""
    out = tmp_path / "run"
    argv = FULL + ["--steps", "4", "--out", str(out)]
    pid = _killed("save:4", argv)
    summary = jmem.finetune.main(argv + ["--resume"])
    printed = capsys.readouterr().out
    assert f"took over the lock of pid {pid}" in printed and "Resumed at step 2" in printed
    assert summary["losses"] == reference[2]["losses"]
    assert Checkpointer(str(out / "checkpoints")).all_steps() == [2, 4]


def _trained_params(out):
    """The bf16 params of the run's last checkpoint, restored into the job's own state."""
    from jmem._src.finetune.build import build  # noqa: PLC0415

    cfg = llama.get_config("tiny")
    config = jmem.finetune.parse_args(FULL + ["--steps", "4", "--out", str(out)])
    step = build(config, cfg)[0]
    target = step.abstract_state(llama.abstract_params(cfg, jnp.float32))
    state, _ = Checkpointer(str(out / "checkpoints")).restore(target, 4)
    return state.params, cfg


@pytest.mark.slow
def test_the_merged_export_is_the_trained_model_and_transformers_agrees(reference):
    """``--export-merged`` writes the trained bf16 params bit for bit (no adapters to merge),
    and transformers' logits on the export equal jmem's forward of those params."""
    torch = pytest.importorskip("torch", reason="the transformers oracle needs torch")
    transformers = pytest.importorskip("transformers", reason="the Hugging Face oracle")
    out, export, _ = reference
    params, cfg = _trained_params(out)
    exported, _ = hf.load_params(str(export), cfg, dtype=jnp.bfloat16)
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, exported), jax.tree.map(np.asarray, params)
    )
    init = llama.init(jax.random.key(0), cfg, jnp.bfloat16)
    assert not np.array_equal(
        np.asarray(init["layers"]["q_proj"]["kernel"]),
        np.asarray(params["layers"]["q_proj"]["kernel"]),
    )
    tokens = np.arange(1, 13, dtype=np.int32)[None]
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ours = np.asarray(llama.forward(f32, jnp.asarray(tokens), cfg))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    with torch.no_grad():
        theirs = model.eval()(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.slow
def test_the_dry_run_compiles_the_full_step(tmp_path, capsys):
    """``--dry-run --lora-rank 0`` on tiny: every weight trainable, no NF4 base; the state
    holds bf16 params, fp32 masters and AdamW's two fp32 moments (14 bytes a parameter), as
    the planner's ledger says; the compute minimum is 6NT."""
    out = tmp_path / "dry"
    one = ["--mesh", "data=1,fsdp=1"]
    record = jmem.finetune.main(FULL + ["--dry-run", "--out", str(out), *one])
    printed = capsys.readouterr().out
    assert "full fine-tuning (bf16 params, fp32 masters" in printed and "NF4 base:" not in printed
    n = llama.num_params(llama.get_config("tiny"))
    assert record["trainable_params"] == n and record["nf4_bytes_per_param"] is None
    assert record["compute"]["minimum"] == "6NT"
    state = record["estimate"]["params"] + record["estimate"]["optimizer_state"]
    state += record["estimate"]["master_weights"]
    assert state == 14 * n
    batch = 2 * 4 * 16 * 4  # inputs and targets, int32
    assert abs(record["compiled"]["argument_bytes"] - batch - state) < 0.01 * state


@pytest.mark.slow
@pytest.mark.parametrize("room, brings", [(2**20, False), (40 * 2**20, True)])
def test_the_dry_runs_params_lever_is_judged_as_its_advice(tmp_path, capsys, room, brings):
    """A step that misses ``--memory`` (the 2 GB reserve plus ``room`` bytes): the
    ``lever: --offload optimizer,params`` line says whether it brings the step under by the
    advice's rule (its planner total plus the compile's excess, with the reserve), so it
    never contradicts ``no lever or plan of the planner's advice brings it under``; the
    levers the job's defaults supplied say so."""
    from jmem._src.finetune import card_fit

    memory = 2 * 10**9 + room
    argv = FULL + ["--dry-run", "--out", str(tmp_path / "dry"), "--memory", str(memory)]
    argv += ["--mesh", "data=1,fsdp=1"]  # one device: the peak the room is sized for
    record = jmem.finetune.main(argv)
    printed = capsys.readouterr().out
    (line,) = [ln for ln in printed.splitlines() if ln.startswith("lever: --offload")]
    assert line.startswith("lever: --offload optimizer,params keeps the params")
    said = "by the planner it brings the step under" in line
    assert said == brings and said != ("does not bring the step under" in line), line
    if "no lever or plan of the planner's advice brings it under" in printed:
        assert not said
    excess = record["compiled"]["peak_bytes"] - record["estimate"]["total"]
    assert not card_fit.lever_fits(record["estimate"]["total"], memory, excess)
    assert re.search(r"remat += full +\(default", printed), printed


@pytest.mark.slow
def test_full_finetuning_on_an_fsdp_mesh_with_host_offload_trains(tmp_path):
    """``--mesh fsdp=2 --offload optimizer,params --optimizer adamw_8bit --remat dots``: the
    params and the optimizer state in host memory, sharded over two devices; it trains."""
    argv = FULL + ["--steps", "3", "--out", str(tmp_path / "run"), "--mesh", "fsdp=2"]
    argv += ["--offload", "optimizer,params", "--optimizer", "adamw_8bit", "--remat", "dots"]
    summary = jmem.finetune.main(argv)
    assert summary["mesh"] == {"data": 1, "fsdp": 2}
    assert all(np.isfinite(summary["losses"])) and summary["last_loss"] < summary["first_loss"]


HOST = ["--offload", "optimizer,params"]


def _on_one_device(argv, out):
    """``python -m jmem finetune ARGV --out OUT`` on one CPU device (the test session's
    8 devices would make the job pick an FSDP mesh): the summary, or ``dry_run.json``."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = flags.strip()
    proc = subprocess.run(
        [sys.executable, "-m", "jmem", "finetune", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    name = "dry_run.json" if "--dry-run" in argv else "summary.json"
    return json.loads((out / name).read_text()), proc.stdout


@pytest.mark.slow
def test_a_run_with_host_params_on_one_device_resumes_bitwise(tmp_path):
    """One device, ``--offload optimizer,params`` added at ``--resume`` to an in-memory run
    (docs/checkpoints.md: offload may differ), then resumed again from a checkpoint the
    offloaded run wrote: each resume gives the uninterrupted run's losses bit for bit."""
    out = tmp_path / "run"
    argv = FULL + ["--steps", "4", "--save-every", "1", "--keep", "4"]
    reference, _ = _on_one_device(argv, out)
    assert reference["devices"] == 1 and reference["mesh"] is None
    for step in (3, 4):
        shutil.rmtree(out / "checkpoints" / str(step))
    summary, printed = _on_one_device(argv + HOST + ["--resume"], out)
    assert "Resumed at step 2" in printed and summary["offload"]["params"] == "host"
    assert summary["losses"] == reference["losses"]
    shutil.rmtree(out / "checkpoints" / "4")  # 3 is the offloaded run's
    summary, printed = _on_one_device(argv + HOST + ["--resume"], out)
    assert "Resumed at step 3" in printed
    assert summary["losses"] == reference["losses"]


@pytest.mark.slow
def test_gradient_accumulation_with_host_params_on_one_device_and_its_dry_run(tmp_path):
    """One device, ``--grad-accum 2 --offload optimizer,params``: the dry run compiles the
    step the run executes (the same compiled peak), and the run gives the in-memory
    ``--grad-accum 2`` run's losses bit for bit. (On a mesh: ``tests/test_offload_full.py``.)"""
    argv = FULL + ["--grad-accum", "2", "--steps", "2"]
    dry, _ = _on_one_device(argv + HOST + ["--dry-run"], tmp_path / "dry")
    host, _ = _on_one_device(argv + HOST, tmp_path / "host")
    assert host["peak_source"] == "compiled (jmem.measure)" and host["devices"] == 1
    assert dry["compiled"]["peak_bytes"] == host["peak_bytes"]
    in_memory, _ = _on_one_device(argv, tmp_path / "memory")
    assert host["losses"] == in_memory["losses"]


@pytest.mark.slow
def test_estimate_target_compiles_the_full_step(capsys):
    """``jmem estimate --lora-rank 0 --target cpu`` compiles the job's full fine-tuning step."""
    from jmem.__main__ import main  # noqa: PLC0415

    argv = ["estimate", "--model", "tiny", "--lora-rank", "0", "--optimizer", "adamw"]
    assert main(argv + ["--target", "cpu", "--seq-len", "64", "--batch-size", "2"]) == 0
    assert "compiled for cpu" in capsys.readouterr().out
