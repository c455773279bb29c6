"""A run's results, written aside and published at once. A run writes its outputs (the
adapters, ``summary.json``, ``loss.png``; with ``--overwrite`` of an earlier run, its
checkpoints and ``run.json`` too) into ``--out/.staging``, and the merged export into
``<--export-merged>.jmem-staging`` beside it. Only once the run has succeeded are they
synced to disk and moved into place (``publish``), by renames listed first in a journal,
``--out/.publish.json``: a run killed while it publishes is finished from the journal by
the next run on ``--out`` (``recover``); a run killed or failed before has changed
nothing but its staging area, which the next run removes. ``outputs.json``, published with
the outputs, holds the SHA-256 of each output file (``verify_outputs``).

A half-written output is therefore never in the place of a result: the previous result
stays byte for byte until the new one is whole (the atomic-rename discipline of orbax's
checkpoints and of ``git``'s object store, applied to a set of files)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil

from jmem._src.checkpointing import compare_hashes
from jmem._src.checkpointing import hash_files
from jmem._src.file_hash import hash_file
from jmem._src.finetune.rundir import MANIFEST
from jmem._src.finetune.rundir import read_json
from jmem._src.finetune.rundir import write_json

#: Under ``--out``: where a run writes what it will publish.
STAGING = ".staging"
#: Under ``--out``: the results being replaced, while a publish is under way.
REPLACED = ".replaced"
#: Under ``--out``: the renames of a publish under way (``{"moves": [[src, dst, old]]}``).
JOURNAL = ".publish.json"
#: Beside ``--export-merged``: the suffixes of its staging and replaced directories.
MERGED_STAGING, MERGED_REPLACED = ".jmem-staging", ".jmem-replaced"
#: What a run publishes from its staging directory into ``--out``, in this order.
ITEMS = (
    "checkpoints",
    "run.json",
    "adapter",
    "summary.json",
    "metrics.jsonl",
    "loss.png",
    MANIFEST,
)
#: The published outputs (``outputs.json`` hashes them): the rest are the run's state.
OUTPUTS = ("adapter", "summary.json", "metrics.jsonl", "loss.png")


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run writes: ``work`` (its checkpoints and ``run.json``: ``--out``, or, when
    it replaces an earlier run (``aside``), the staging directory) and ``staging`` (its
    outputs until ``publish``)."""

    out: str
    merged: str | None = None
    aside: bool = False

    @classmethod
    def of(cls, config, aside: bool = False) -> RunPaths:
        return cls(config.run.out, config.output.export_merged, aside)

    @property
    def staging(self) -> str:
        return os.path.join(self.out, STAGING)

    @property
    def work(self) -> str:
        return self.staging if self.aside else self.out

    @property
    def merged_staging(self) -> str | None:
        return self.merged.rstrip(os.sep) + MERGED_STAGING if self.merged else None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _fsync(path: str) -> None:
    """Syncs a file or directory to disk (``fsync`` on a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Syncs every file and directory under ``root`` (``root`` included)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def manifest(paths: RunPaths, steps: int) -> dict:
    """``outputs.json``'s content for the outputs staged for ``paths`` (SHA-256 of each
    file, paths relative to ``--out``; the merged export's relative to it)."""
    files = {}
    for name in OUTPUTS:
        path = os.path.join(paths.staging, name)
        if os.path.isdir(path):
            files.update({f"{name}/{k}": v for k, v in hash_files(path, ()).items()})
        elif os.path.isfile(path):
            files[name] = hash_file(path)
    out = {"format": 1, "steps": steps, "files": files}
    if paths.merged:
        out["merged"] = {
            "path": os.path.abspath(paths.merged),
            "files": hash_files(paths.merged_staging, ()),
        }
    return out


def publish(paths: RunPaths, steps: int) -> None:
    """Moves a finished run's staged results into place (process 0, ``--out`` locked):
    hashes the outputs into ``outputs.json``, syncs everything staged, writes the journal,
    then renames (each earlier result first moved to ``.replaced``, removed at the end)."""
    write_json(os.path.join(paths.staging, MANIFEST), manifest(paths, steps))
    _fsync_tree(paths.staging)
    moves = [
        [
            os.path.join(paths.staging, n),
            os.path.join(paths.out, n),
            os.path.join(paths.out, REPLACED, n),
        ]
        for n in ITEMS
        if os.path.lexists(os.path.join(paths.staging, n))
    ]
    if paths.merged:
        _fsync_tree(paths.merged_staging)
        merged = paths.merged.rstrip(os.sep)
        moves.append([paths.merged_staging, merged, merged + MERGED_REPLACED])
    write_json(os.path.join(paths.out, JOURNAL), {"moves": moves})
    _fsync(paths.out)
    _finish(paths.out, moves)


def _finish(out: str, moves: list) -> None:
    """The renames of a journal, from wherever a kill left them (each one is done at most
    once: a source that is gone was moved), then the journal and the replaced results go."""
    for src, dst, old in moves:
        if not os.path.lexists(src):
            continue
        if os.path.lexists(dst):
            _remove(old)
            os.makedirs(os.path.dirname(old), exist_ok=True)
            os.replace(dst, old)
        os.replace(src, dst)
        _fsync(os.path.dirname(os.path.abspath(dst)))
    os.remove(os.path.join(out, JOURNAL))
    _fsync(out)
    for _, _, old in moves:
        _remove(old)
    _remove(os.path.join(out, REPLACED))
    _remove(os.path.join(out, STAGING))


def recover(out: str, merged: str | None) -> list[str]:
    """At the start of a run on ``out`` (process 0, the lock held): finishes a publish that
    a kill interrupted (its journal), and removes what a run killed or failed before
    publishing left aside (``--out/.staging``, ``<--export-merged>.jmem-staging``).
    Returns one note per thing done."""
    notes = []
    journal = os.path.join(out, JOURNAL)
    if os.path.exists(journal):
        _finish(out, read_json(journal, "; remove it and pass --overwrite to start over")["moves"])
        notes.append(
            f"note: --out {out}: finished publishing the results of a run that was killed "
            "while it published them"
        )
    stale = [os.path.join(out, STAGING), os.path.join(out, REPLACED)]
    if merged:
        stale += [merged.rstrip(os.sep) + MERGED_STAGING, merged.rstrip(os.sep) + MERGED_REPLACED]
    for path in stale:
        if os.path.lexists(path):
            _remove(path)
            notes.append(
                f"note: removed {path}, left by a run that was killed or failed before it "
                "published its results (the earlier results are as they were)"
            )
    return notes


def discard(paths: RunPaths) -> None:
    """A failed run's staging areas removed (process 0), unless its publish had begun (the
    journal is there: the next run finishes it)."""
    if os.path.exists(os.path.join(paths.out, JOURNAL)):
        return
    for path in (paths.staging, paths.merged_staging):
        if path:
            with contextlib.suppress(OSError):
                _remove(path)


def verify_outputs(out: str, steps: int, merged: str | None) -> list[str]:
    """What keeps the outputs in ``out`` from being this run's result at ``steps``, one
    line each (empty: ``outputs.json`` lists them for ``steps`` and every file hashes as
    it did when published; with ``merged``, that export too)."""
    path = os.path.join(out, MANIFEST)
    if not os.path.exists(path):
        return [f"{MANIFEST}: missing (the outputs were not all written)"]
    try:
        record = read_json(path)
        files, steps_done = dict(record["files"]), record["steps"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST}: unreadable ({e})"]
    if steps_done != steps:
        return [f"{MANIFEST}: the outputs are of step {steps_done}, not --steps {steps}"]
    problems = compare_hashes(out, files)
    if merged:
        done = record.get("merged") or {}
        if done.get("path") != os.path.abspath(merged):
            problems.append(f"--export-merged {merged}: not written by this run")
        else:
            problems += compare_hashes(merged, dict(done["files"]), f"{merged}/")
    return problems
