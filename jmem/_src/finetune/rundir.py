"""The run directory: ``run.json`` (the flags), the rules of ``--resume`` and
``--overwrite``, and what a run records of its flags."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil

import jax

from jmem._src.cli import CliError

#: Flags that must match the run in --out for --resume (they shape the state or the data).
RESUME_FLAGS = (
    "config",
    "checkpoint",
    "data",
    "tokenizer",
    "seq_len",
    "batch_size",
    "grad_accum",
    "optimizer",
    "precision",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "eval_split",
    "seed",
)


def is_writer() -> bool:
    """Whether this process writes logs, plots and adapters (process 0 of a multi-process
    run; checkpoints are written by every process together)."""
    return jax.process_index() == 0


def flags(config) -> dict:
    """The run's flags as resolved (defaults filled in), by flag name (``lora_rank``), for
    run.json and summary.json."""
    skip = ("resume", "overwrite", "debug", "no_progress", "dry_run")
    return {k: v for k, v in config.flat().items() if k not in skip}


#: The packages whose versions a run records (run.json, summary.json).
PACKAGES = ("jmem", "jax", "jaxlib", "flax", "optax")


def versions() -> dict[str, str | None]:
    """The installed versions of ``PACKAGES`` (None where one is not installed)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_record(config) -> dict:
    """run.json: the resolved flags and, under ``versions``, the packages' versions."""
    return {**flags(config), "versions": versions()}


def _checkpoint_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def prepare_out(config) -> int | None:
    """Checks ``--out`` against ``--resume``/``--overwrite``; returns the step to resume
    from (None for a new run). A new run never mixes with another run's checkpoints."""
    out = config.run.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--out {out} is a file; pass a directory")
    replace_merged = _check_merged(config.output.export_merged, config.run.overwrite)
    ckpt_dir = os.path.join(out, "checkpoints")
    steps = _checkpoint_steps(ckpt_dir)
    record = os.path.join(out, "run.json")
    if config.run.resume:
        if not steps:
            raise CliError(
                f"--resume: no checkpoint in {ckpt_dir}; run without --resume to start a run"
            )
        _check_same_run(config, record)
        return steps[-1]
    previous = steps or os.path.exists(record) or os.path.exists(os.path.join(out, "summary.json"))
    if previous and not config.run.overwrite:
        at = f" (checkpoints at steps {steps})" if steps else ""
        raise CliError(
            f"--out {out} already holds a run{at}; pass --resume to continue it, "
            "--overwrite to replace it, or another --out"
        )
    if replace_merged and is_writer():
        shutil.rmtree(config.output.export_merged)
    if previous and is_writer():  # every process checks; process 0 alone deletes
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(out, "adapter"), ignore_errors=True)
        for name in ("run.json", "summary.json", "loss.png"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
    return None


def _check_merged(merged: str | None, overwrite: bool) -> bool:
    """Whether ``--export-merged`` holds an earlier merged checkpoint to replace
    (``--overwrite``); a directory that is not empty is refused otherwise."""
    if not merged or not os.path.exists(merged):
        return False
    if os.path.isdir(merged) and not os.listdir(merged):
        return False
    is_checkpoint = os.path.isfile(os.path.join(merged, "config.json"))
    if overwrite and is_checkpoint:
        return True
    why = "pass --overwrite to replace it, or" if is_checkpoint else "it is not a checkpoint;"
    raise CliError(f"--export-merged {merged} exists and is not empty; {why} pass a new directory")


def _check_same_run(config, record: str) -> None:
    """--resume: the flags that shape the state and the data must match run.json's."""
    if not os.path.exists(record):
        return
    with open(record) as f:
        before = json.load(f)
    now = flags(config)
    diff = [
        f"--{k.replace('_', '-')} {now[k]} (was {before[k]})"
        for k in RESUME_FLAGS
        if k in before and before[k] != now.get(k)
    ]
    if diff:
        raise CliError(
            f"--resume: this run's flags differ from the run in --out {config.run.out}: "
            f"{', '.join(diff)}; pass the same flags, or --overwrite to start over"
        )
    if before.get("steps") != config.training.steps:
        print(
            f"note: --steps {config.training.steps} (was {before.get('steps')}): the learning-rate "
            f"schedule now decays over {config.training.steps} steps.",
            flush=True,
        )
