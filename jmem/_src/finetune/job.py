"""The job end to end: ``run(config)`` checks every input, then plans (``dry_run``) or
trains; ``run_command`` is what the command line (``command.main``: ``jmem finetune``,
``examples/qlora_7b.py``) runs once its flags are parsed."""

from __future__ import annotations

import contextlib
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jmem._src import native_logs
from jmem._src import rewards
from jmem._src.checkpointing import verify_step
from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import validate
from jmem._src.finetune.datasets import load_datasets
from jmem._src.finetune.dry_run import dry_run
from jmem._src.finetune.grpo_loop import train_grpo
from jmem._src.finetune.launcher import PLUGIN_NOTE
from jmem._src.finetune.launcher import allocator_note
from jmem._src.finetune.launcher import apply_allocator
from jmem._src.finetune.loop import train
from jmem._src.finetune.mesh import check_context
from jmem._src.finetune.mesh import check_expert
from jmem._src.finetune.mesh import initialize_distributed
from jmem._src.finetune.mesh import job_mesh
from jmem._src.finetune.mesh import sync
from jmem._src.finetune.mesh import target_mesh
from jmem._src.finetune.prompt_data import read_prompts
from jmem._src.finetune.publish import RunPaths
from jmem._src.finetune.publish import discard
from jmem._src.finetune.publish import publish
from jmem._src.finetune.publish import recover
from jmem._src.finetune.publish import verify_outputs
from jmem._src.finetune.report import quiet_stdout
from jmem._src.finetune.rundir import forget_unstarted
from jmem._src.finetune.rundir import holds_run
from jmem._src.finetune.rundir import is_writer
from jmem._src.finetune.rundir import prepare_out
from jmem._src.finetune.rundir import read_json
from jmem._src.finetune.runlock import RunLock
from jmem._src.finetune.runlock import probe_writable
from jmem._src.finetune.setup import check_lora_targets
from jmem._src.finetune.setup import check_offload_dir
from jmem._src.finetune.setup import check_outputs
from jmem._src.finetune.setup import make_tokenizer
from jmem._src.finetune.setup import model_config
from jmem._src.finetune.setup import resolve_defaults


def run(config: FinetuneConfig) -> dict | None:
    """Runs the fine-tuning job: checks every input (before any weight is read or step
    compiled), then plans (``dry_run``) or trains, writing under ``config.run.out``.

    Args:
      config: a ``FinetuneConfig`` (checked again here; unset sizes are resolved for the
        model and the device into a new value, ``config`` itself is not changed).

    Returns:
      The summary (as written to ``summary.json``; ``dry_run.json``'s content for a dry
      run; the previous summary, or None, when a resumed run has nothing left to do).

    Changes nothing in the calling process (no ``mallopt``, restart or environment
    variable): its note line says which host allocator is in effect and how to get huge
    pages on CPU (``jmem finetune`` on the command line, or ``GLIBC_TUNABLES``).

    Raises:
      CliError: (a ``ValueError``) for a bad option or input, naming it, before training.

    Source: the QLoRA recipe of Dettmers et al. 2023 (arXiv:2305.14314).
    """
    config = validate(config)
    note = allocator_note(config.run.host_allocator, config.execution.remat, config.run.dry_run)
    initialize_distributed(config)
    return _run(config, note)


def _run(config: FinetuneConfig, host_note: str | None) -> dict | None:
    """``run`` on a checked config, the host allocator applied (its note line) and
    ``jax.distributed`` initialized."""
    cfg = model_config(config)
    config, notes = resolve_defaults(config, cfg, on_gpu=jax.default_backend() == "gpu")
    on_accelerator = jax.default_backend() != "cpu"
    if host_note and not (on_accelerator and host_note.startswith(PLUGIN_NOTE)):
        notes.append(host_note)
    check_lora_targets(config, cfg)
    if not config.run.dry_run:  # the path, before any line is printed (its space: at init)
        check_offload_dir(config)
    check_context(config, cfg)
    check_expert(config, cfg)
    target = _check_target(config)
    mesh, mesh_notes = (target_mesh(config), []) if target else job_mesh(config)
    if config.run.dry_run:
        for line in notes + mesh_notes:
            print(line, flush=True)
        return dry_run(config, cfg, mesh, target=target)
    tok = make_tokenizer(config, cfg)
    if config.training.objective == "grpo":
        config = _generation_batch(config, cfg, on_accelerator, notes)
        ds, held = grpo_inputs(config, cfg, tok), None
    else:
        ds, held = load_datasets(config, tok)
    check_outputs(config, cfg, tok)
    with _locked(config) as lock_notes:
        aside = config.run.overwrite and holds_run(config.run.out)  # before anything changes
        resume_step = prepare_out(config)
        for line in notes + mesh_notes + lock_notes:
            print(line, flush=True)
        steps = config.training.steps
        done = resume_step is not None and resume_step >= steps and _done(config, resume_step)
        resume_step, aside, done = _agree(resume_step, aside, done)  # a refusal stops all
        if done:
            print(
                f"Nothing to do: the checkpoint is at step {resume_step} >= --steps {steps} "
                "(its files and the outputs verified)."
            )
            path = os.path.join(config.run.out, "summary.json")
            return read_json(path) if os.path.exists(path) else None
        return _train_and_publish(config, cfg, tok, ds, held, resume_step, mesh, aside)


def _train_and_publish(config, cfg, tok, ds, held, resume_step, mesh, aside):
    """``train`` into the staging area (``RunPaths``), then ``publish``; a run that fails
    or is stopped leaves the earlier results as they were (its staging area removed)."""
    paths = RunPaths.of(config, aside)
    try:
        if config.training.objective == "grpo":
            records, rewards = ds
            summary = train_grpo(config, cfg, tok, records, rewards, resume_step, mesh, paths)
        else:
            summary = train(config, cfg, tok, ds, held, resume_step, mesh, paths)
        if is_writer():
            publish(paths, config.training.steps)
    except BaseException:
        if is_writer():
            discard(paths)
            if resume_step is None and not aside:  # nothing to resume: the retry may start
                forget_unstarted(paths.work)
        raise
    return summary


def _generation_batch(config, cfg, on_accelerator: bool, notes: list):
    """GRPO's rollout micro-batch for a training run with ``--generation-batch`` unset: on
    an accelerator (its memory, or ``--memory``) or wherever ``--memory`` is given, the
    largest that the planner fits (its reason appended to ``notes``); else every row."""
    from jmem._src.finetune import grpo_plan  # noqa: PLC0415 (it imports the dry run)

    memory = config.run.memory
    if memory is None and on_accelerator:
        memory = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if memory is None:
        return config
    config, line = grpo_plan.run_generation_batch(config, cfg, int(memory))  # one device
    if line:
        notes.append(line)
    return config


def grpo_inputs(config, cfg, tok):
    """``(prompts, rewards)`` of a GRPO run, both checked before anything is compiled: the
    prompts of ``--data`` (``prompt_data.read_prompts``; its notes printed: prompts cut to
    ``--max-prompt-len``) and the ``--reward`` functions (``rewards.parse_rewards``).

    Raises:
      CliError: no ``--data``, a bad prompt file, a reward that cannot be loaded, a column
        a reward needs missing, or several processes; one line each."""
    g = config.grpo
    if jax.process_count() > 1:
        raise CliError(
            "--objective grpo runs in one process (its devices may form a --mesh); launch "
            "it without --num-processes"
        )
    if config.data.data is None:
        raise CliError(
            "--objective grpo needs --data FILE.jsonl of prompts (a 'prompt' column: text or "
            "chat messages; other columns go to the reward functions)"
        )
    try:
        reward_set = rewards.parse_rewards(
            list(g.reward), g.reward_weights, max_completion_length=g.max_completion_len
        )
        records, notes = read_prompts(
            config.data.data,
            tok,
            max_prompt_len=g.max_prompt_len,
            max_prompt_len_name="--max-prompt-len",
        )
        reward_set.check_columns(list(records[0].columns), f"--data {config.data.data}")
    except rewards.RewardError as e:
        raise CliError(f"--reward: {one_line(e)}") from None
    for line in notes:
        print(line, flush=True)
    return records, reward_set


def _done(config, resume_step: int) -> bool:
    """Whether a resumed run has nothing left to do (process 0 decides): the checkpoint is
    past ``--steps``, or at it with its files and the outputs verified. A damaged
    checkpoint is named by the restore that follows; damaged or missing outputs here."""
    if not is_writer():
        return False
    steps = config.training.steps
    if resume_step > steps:
        return True
    if verify_step(os.path.join(config.run.out, "checkpoints"), resume_step):
        return False
    problems = verify_outputs(config.run.out, steps, config.output.export_merged)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(
            f"note: --out {config.run.out}: the outputs are not this run's whole result: "
            f"{problems[0]}{more}; writing them again from checkpoint step {resume_step}",
            flush=True,
        )
    return not problems


@contextlib.contextmanager
def _locked(config):
    """Process 0 holds ``--out``'s lock for the run (``RunLock``) and probes ``--out`` and
    ``--export-merged`` by writing; every process learns whether it could. Yields notes."""
    out, notes, error = config.run.out, [], None
    lock = RunLock(out)
    if is_writer():
        try:
            if os.path.exists(out) and not os.path.isdir(out):
                raise CliError(f"--out {out} is a file; pass a directory")
            notes = lock.acquire()
            notes += recover(out, config.output.export_merged)
            probe_writable("--out", out)
            paths = RunPaths.of(config)
            if paths.merged:  # the export is written beside it, then renamed
                probe_writable("--export-merged", paths.merged_staging)
        except CliError as e:
            lock.release()
            error = e
    if jax.process_count() > 1:
        failed = np.asarray(error is not None, np.int32)
        if int(multihost_utils.broadcast_one_to_all(failed)) and error is None:
            error = CliError(f"--out {out}: process 0 could not lock or write it (see its error)")
    if error is not None:
        raise error
    try:
        yield notes
    finally:
        lock.release()


def _check_target(config) -> str | None:
    """``--target``, checked: only with ``--dry-run`` (the machine running is not the
    target), and a GPU target needs the ``gpu-plan`` extra (one line naming it)."""
    target = config.devices.target
    if target is None:
        return None
    if not config.run.dry_run:
        raise CliError(
            f"--target {target} compiles only (this machine is not a {target}): add --dry-run"
        )
    from jmem import targets  # noqa: PLC0415

    reason = targets.unavailable_reason(target)
    if reason:
        raise CliError(f"--target {target}: {reason}")
    return target


def _agree(resume_step, aside: bool, done: bool):
    """Process 0's reading of ``--out`` (the step to resume from, whether the run replaces
    an earlier one, whether there is nothing to do), for every process, once process 0
    has prepared the directory (every process checked it first, so a refused ``--out``
    stops them all instead of leaving some waiting here)."""
    sync("prepare_out")
    if jax.process_count() == 1:
        return resume_step, aside, done
    value = np.asarray([-1 if resume_step is None else resume_step, aside, done], np.int64)
    step, aside, done = (int(v) for v in multihost_utils.broadcast_one_to_all(value))
    return (None if step < 0 else step), bool(aside), bool(done)


def run_command(config: FinetuneConfig) -> dict | None:
    """The command line's run of the ``config`` its flags were parsed into (checked there,
    so not again): a bad input exits with status 2 and one line ``error: ...`` naming the
    flag or file (``--debug``: the traceback instead).

    ``--host-allocator retain`` calls ``jmem.host.retain_host_allocations`` here, before
    JAX starts; huge pages come from the entry point (``restart_with_huge_pages``)."""
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"expected a jmem.finetune.FinetuneConfig, got {type(config).__name__}")
    try:
        return _run_quietly_off_process_0(config)
    except CliError as e:
        if config.run.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except OSError as e:  # a file the run writes: full disk, read-only, removed under it
        if config.run.debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _run_quietly_off_process_0(config):
    """``run``; in a multi-process run only process 0 prints (errors still reach stderr)."""
    run = config.run
    note = apply_allocator(run.host_allocator, config.execution.remat, run.dry_run)  # before JAX
    native_logs.show(run.debug)
    with native_logs.hidden():  # the backend's start-up lines (cudart_stub, ...)
        initialize_distributed(config)
        jax.devices()
    if jax.process_index() == 0:
        return _run(config, note)
    with quiet_stdout():  # gloo's connection lines too (C++ std::cout)
        return _run(config, note)
