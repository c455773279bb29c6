"""The job end to end: ``run(config)`` checks every input, then plans (``dry_run``) or
trains; ``run_command`` is what the command line (``command.main``: ``jmem finetune``,
``examples/qlora_7b.py``) runs once its flags are parsed."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jmem._src import host_allocator
from jmem._src import jax_compat
from jmem._src.cli import CliError
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import validate
from jmem._src.finetune.datasets import load_datasets
from jmem._src.finetune.dry_run import dry_run
from jmem._src.finetune.loop import train
from jmem._src.finetune.mesh import initialize_distributed
from jmem._src.finetune.mesh import job_mesh
from jmem._src.finetune.mesh import sync
from jmem._src.finetune.rundir import is_writer
from jmem._src.finetune.rundir import prepare_out
from jmem._src.finetune.rundir import run_record
from jmem._src.finetune.setup import check_lora_targets
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

    Raises:
      CliError: (a ``ValueError``) for a bad option or input, naming it, before training.

    Source: the QLoRA recipe of Dettmers et al. 2023 (arXiv:2305.14314).
    """
    config = validate(config)
    return _run(config, _host_allocator(config))


def _run(config: FinetuneConfig, allocator_note: str | None) -> dict | None:
    """``run`` on a validated config, the host allocator already applied (its note line)."""
    initialize_distributed(config)
    cfg = model_config(config)
    config, notes = resolve_defaults(config, cfg, on_gpu=jax.default_backend() == "gpu")
    on_accelerator = jax.default_backend() != "cpu"
    if allocator_note and not (on_accelerator and allocator_note.startswith(PLUGIN_NOTE)):
        notes.append(allocator_note)
    check_lora_targets(config, cfg)
    mesh, mesh_notes = job_mesh(config)
    dry = config.run.dry_run
    if not dry:
        tok = make_tokenizer(config, cfg)
        ds, held = load_datasets(config, tok)
        check_outputs(config, cfg, tok)
        resume_step = _agree(prepare_out(config))  # a refusal stops every process
    for line in notes + mesh_notes:
        print(line, flush=True)
    if dry:
        return dry_run(config, cfg, mesh)
    steps, out = config.training.steps, config.run.out
    if resume_step is not None and resume_step >= steps:
        print(f"Nothing to do: the checkpoint is at step {resume_step} >= --steps {steps}.")
        path = os.path.join(out, "summary.json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return None
    os.makedirs(out, exist_ok=True)
    if is_writer():
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(run_record(config), f, indent=2)
    return train(config, cfg, tok, ds, held, resume_step, mesh)


#: The start of the note ``auto`` leaves when a JAX accelerator plugin is installed.
PLUGIN_NOTE = "host allocator: unchanged ("


def _host_allocator(config, restart: bool = False) -> str | None:
    """Applies ``--host-allocator`` before JAX starts and returns its note line (None for a
    dry run, which runs no step and changes nothing). ``auto``: huge pages on a machine
    without a JAX accelerator plugin, else (huge pages impossible or refused) retaining
    with ``--remat none``; ``restart`` (the job's own command line) lets huge pages restart
    the process. ``JMEM_HOST_ALLOCATOR=system`` turns ``auto`` off, not an explicit choice."""
    wanted = config.run.host_allocator
    if config.run.dry_run:
        return None
    if wanted == "system" or (
        wanted == "auto" and os.environ.get(host_allocator.ENV_VAR, "").lower() == "system"
    ):
        if host_allocator.huge_pages_active():
            return "host allocator: huge pages all the same (GLIBC_TUNABLES or THP always)"
        why = "--host-allocator system" if wanted == "system" else "JMEM_HOST_ALLOCATOR=system"
        return f"host allocator: glibc's defaults ({why})"
    if wanted == "auto" and (plugin := _accelerator_plugin()):
        return f"{PLUGIN_NOTE}{plugin}: --host-allocator huge-pages to use huge pages anyway)"
    note = None
    if wanted in ("auto", "huge-pages"):
        status = host_allocator.host_huge_pages(
            restart=restart, respect_env=False, announce=False
        )  # restarts the process, or returns
        if status.applied:
            how = "set by restarting the process; " if host_allocator.restarted() else ""
            return f"host allocator: 2 MiB huge pages ({how}--host-allocator system to skip)"
        note = f"host allocator: no huge pages ({status.reason})"
        if wanted == "huge-pages" or config.levers.remat != "none":
            return note
    return _retain(note)


def _retain(note: str | None) -> str:
    """``retain_host_allocations`` (``--host-allocator retain``, or ``auto``'s fallback
    after ``note``) and its note line."""
    prefix = f"{note}; " if note else "host allocator: "
    if host_allocator.retained():
        return prefix + "freed memory retained"
    if jax_compat.backends_initialized():
        return prefix + (
            "freed memory not retained either (JAX already started in this process: call "
            "jmem.host_huge_pages() or jmem.retain_host_allocations() first in the script)"
        )
    status = host_allocator.retain_host_allocations(respect_env=False)
    return prefix + ("freed memory retained" if status.applied else f"unchanged ({status.reason})")


def _accelerator_plugin() -> str | None:
    """The name of an installed JAX GPU/TPU plugin (or a ``JAX_PLATFORMS`` without cpu):
    host temporaries then do not hold the step's activations, so ``auto`` changes nothing."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return None if platforms.split(",")[0].strip() == "cpu" else platforms
    import importlib.metadata  # noqa: PLC0415

    for dist in importlib.metadata.distributions():
        name = (dist.name or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "libtpu")):
            return name
    return None


def _agree(resume_step):
    """Process 0's reading of ``--out`` (the step to resume from), for every process, once
    process 0 has prepared the directory (every process checked it first, so a refused
    ``--out`` stops them all instead of leaving some waiting here)."""
    sync("prepare_out")
    if jax.process_count() == 1:
        return resume_step
    value = np.asarray(-1 if resume_step is None else resume_step, np.int64)
    value = int(multihost_utils.broadcast_one_to_all(value))
    return None if value < 0 else value


def run_command(config: FinetuneConfig, restart: bool) -> dict | None:
    """The command line's run of a parsed ``config``: a bad input exits with status 2 and
    one line ``error: ...`` naming the flag or file (``--debug``: the traceback instead).
    ``restart`` lets ``--host-allocator`` huge pages restart the process once with glibc's
    tunable set (``jmem.host_huge_pages``)."""
    try:
        return _run_quietly_off_process_0(config, restart)
    except CliError as e:
        if config.run.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _run_quietly_off_process_0(config, restart: bool):
    """``run``; in a multi-process run only process 0 prints (errors still reach stderr)."""
    config = validate(config)  # a bad input is refused before any restart
    note = _host_allocator(config, restart)  # before JAX starts; may restart the process
    initialize_distributed(config)
    if jax.process_index() == 0:
        return _run(config, note)
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        return _run(config, note)
