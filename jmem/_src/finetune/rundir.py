"""The run directory: ``run.json`` (the flags and the fingerprints of what the run trained
on), the rules of ``--resume`` and ``--overwrite``, and what a run records of its flags.
Only committed checkpoints count (``jmem._src.checkpointing.committed_steps``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil

import jax

from jmem._src import lora_modules
from jmem._src.checkpointing import MARKER
from jmem._src.checkpointing import committed_steps
from jmem._src.cli import CliError
from jmem._src.cli import one_line
from jmem._src.finetune.fingerprints import differences
from jmem._src.finetune.fingerprints import fingerprints

#: In ``--out``: the published outputs' hashes, ``{"steps", "files": {path: sha256},
#: "merged": {"path", "files"}}`` (``jmem._src.finetune.publish``).
MANIFEST = "outputs.json"
#: Flags naming a file or directory: compared by resolved path (and content, by
#: ``fingerprints``), not by spelling.
PATH_FLAGS = ("checkpoint", "data", "tokenizer")
#: Flags that must match the run in --out for --resume (they shape the state's tree, the
#: data or what is trained), besides ``PATH_FLAGS``.
RESUME_FLAGS = (
    "config",
    "seq_len",
    "batch_size",
    "grad_accum",
    "optimizer",
    "precision",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_dropout",
    "eval_split",
    "seed",
    "objective",
    "beta",
    "loss_type",
    "label_smoothing",
    "simpo_gamma",
    "reward",
    "reward_weights",
    "num_generations",
    "max_prompt_len",
    "max_completion_len",
    "temperature",
    "top_p",
    "top_k",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "num_iterations",
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


def run_record(config, prints: dict | None = None) -> dict:
    """run.json: the resolved flags, under ``versions`` the packages' versions, under
    ``fingerprints`` those of ``--checkpoint`` and ``--data`` (``fingerprints``)."""
    prints = fingerprints(config) if prints is None else prints
    return {**flags(config), "versions": versions(), "fingerprints": prints}


def read_json(path: str, what: str = "") -> dict:
    """A JSON object from ``path``.

    Raises:
      CliError: naming the file, for one that cannot be read or is not a JSON object.
    """
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise CliError(f"{path}: cannot be read ({one_line(e)}){what}") from None
    if not isinstance(value, dict):
        raise CliError(f"{path}: expected a JSON object, got {type(value).__name__}{what}")
    return value


def write_json(path: str, value: dict) -> None:
    """Writes ``value`` to ``path`` atomically (a temporary file renamed): a kill or a
    full disk leaves the previous file whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(value, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _step_dirs(directory: str) -> list[int]:
    """Every step-named directory, committed or not (what makes ``--out`` hold a run)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def prepare_out(config) -> int | None:
    """Checks ``--out`` against ``--resume``/``--overwrite``; returns the step to resume
    from (None for a new run). A new run never mixes with another run's checkpoints; with
    ``--overwrite`` nothing is deleted here: the new run works aside and replaces the
    earlier results only once it has succeeded (``jmem._src.finetune.publish``)."""
    out = config.run.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--out {out} is a file; pass a directory")
    ckpt_dir = os.path.join(out, "checkpoints")
    steps = _step_dirs(ckpt_dir)
    record = os.path.join(out, "run.json")
    if config.run.resume:
        _check_merged(config.output.export_merged, _own_merged(out, config.output.export_merged))
        _check_same_run(config, record)
        committed = committed_steps(ckpt_dir)
        if not committed:
            found = f" (only uncommitted step directories {steps})" if steps else ""
            raise CliError(
                f"--resume: no checkpoint in {ckpt_dir}{found}; run without "
                "--resume (--overwrite) to start a run"
            )
        return committed[-1]
    _check_merged(config.output.export_merged, config.run.overwrite)
    if holds_run(out) and not config.run.overwrite:
        at = f" (checkpoints at steps {steps})" if steps else ""
        raise CliError(
            f"--out {out} already holds a run{at}; pass --resume to continue it, "
            "--overwrite to replace it, or another --out"
        )
    return None


def holds_run(out: str) -> bool:
    """Whether ``out`` holds a run (step directories, ``run.json`` or ``summary.json``):
    what ``--overwrite`` replaces."""
    files = ("run.json", "summary.json", MANIFEST)
    return bool(_step_dirs(os.path.join(out, "checkpoints"))) or any(
        os.path.exists(os.path.join(out, n)) for n in files
    )


def forget_unstarted(out: str) -> bool:
    """After a new run in ``out`` failed before its first checkpoint was committed (an error
    in the first step, a non-finite loss, a failed first save): removes what it wrote
    there, ``run.json`` and its checkpoint directory's marker and uncommitted step
    directories, so that running it again is not refused as "already holds a run" (there is
    nothing to ``--resume``). A new run without ``--overwrite`` starts in an ``out`` that
    holds no run (``prepare_out``), so all of it is this run's. Returns whether it did."""
    ckpt_dir = os.path.join(out, "checkpoints")
    if committed_steps(ckpt_dir):
        return False
    with contextlib.suppress(OSError):
        os.remove(os.path.join(out, "run.json"))
    if os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            path = os.path.join(ckpt_dir, name)
            with contextlib.suppress(OSError):
                if name == MARKER:
                    os.remove(path)
                elif name.split(".")[0].isdigit() and os.path.isdir(path):
                    shutil.rmtree(path)
        with contextlib.suppress(OSError):
            os.rmdir(ckpt_dir)  # only when nothing else is left in it
    return True


def _own_merged(out: str, merged: str | None) -> bool:
    """Whether ``merged`` is the export the run in ``out`` published (its outputs.json)."""
    path = os.path.join(out, MANIFEST)
    if not merged or not os.path.isfile(path):
        return False
    with contextlib.suppress(CliError, AttributeError):
        done = read_json(path).get("merged") or {}
        return done.get("path") == os.path.abspath(merged)
    return False


def _check_merged(merged: str | None, overwrite: bool) -> bool:
    """Whether ``--export-merged`` holds an earlier merged checkpoint to replace
    (``overwrite``: ``--overwrite``, or the export of the run resumed); a directory that
    is not empty is refused otherwise. Nothing is deleted: the run replaces it when it
    publishes its results."""
    if not merged or not os.path.exists(merged):
        return False
    if os.path.isdir(merged) and not os.listdir(merged):
        return False
    is_checkpoint = os.path.isfile(os.path.join(merged, "config.json"))
    if overwrite and is_checkpoint:
        return True
    why = "pass --overwrite to replace it, or" if is_checkpoint else "it is not a checkpoint;"
    raise CliError(f"--export-merged {merged} exists and is not empty; {why} pass a new directory")


def _canonical(before: dict) -> dict:
    """run.json's flags as ``flags`` gives them now: ``lora_targets`` in its canonical form
    (``lora_modules.parse``: the default's regex spelling is ``all``), ``loss_type`` unset
    outside dpo and grpo, lists (``reward``) as tuples."""
    value = before.get("lora_targets")
    if isinstance(value, str):
        with contextlib.suppress(argparse.ArgumentTypeError):
            before = {**before, "lora_targets": lora_modules.parse(value)}
    if before.get("loss_type") == "sigmoid" and before.get("objective") != "dpo":
        before = {**before, "loss_type": None}  # recorded for every objective before grpo
    lists = {k: tuple(v) for k, v in before.items() if isinstance(v, list)}
    return {**before, **lists}  # JSON's lists are the config's tuples


def _check_same_run(config, record: str) -> None:
    """--resume: the flags that shape the state and the data must match run.json's, and
    the files ``--checkpoint``/``--data`` name must hold what they held (fingerprints)."""
    if not os.path.exists(record):
        return
    before = _canonical(read_json(record, "; pass --overwrite to start over"))
    now = flags(config)
    diff = [
        f"--{k.replace('_', '-')} {now[k]} (was {before[k]})"
        for k in RESUME_FLAGS
        if k in before and before[k] != now.get(k)
    ]
    if "fingerprints" in before:
        diff += differences(before["fingerprints"], fingerprints(config))
    else:  # a run.json of jmem <= 0.2: paths compared resolved
        real = lambda v: os.path.realpath(v) if isinstance(v, str) and v != "byte" else v
        diff += [
            f"--{k} {now[k]} (was {before[k]})"
            for k in PATH_FLAGS
            if k in before and real(before[k]) != real(now.get(k))
        ]
    if diff:
        raise CliError(
            f"--resume: this run differs from the run in --out {config.run.out}: "
            f"{'; '.join(diff)}; pass the same flags and files, or --overwrite to start over"
        )
    if before.get("steps") != config.training.steps:
        print(
            f"note: --steps {config.training.steps} (was {before.get('steps')}): the learning-rate "
            f"schedule now decays over {config.training.steps} steps.",
            flush=True,
        )
