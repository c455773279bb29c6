"""Training checkpoints with orbax: save every N steps, keep the last K, resume exactly.

What is saved: the ``TrainState`` minus its ``frozen`` params (the LoRA/QLoRA base is
rebuilt from the model checkpoint or seed, not re-saved every N steps), i.e. the
trainable params (adapters), the optimizer state with quantized moments (uint8 codes and
float32 absmax stay as they are), the loss scale and the step; plus a JSON record of the
data position, the RNG seed and anything else the caller passes in ``meta``.

Orbax writes each step into a temporary directory (``<step>.orbax-checkpoint-tmp``) and
renames it when complete, so an interrupted save (a killed process) never replaces a good
checkpoint and is not listed by ``all_steps``/``latest_step``. A restore is checked against
the checkpoint's own metadata first: orbax reads what the *target* describes and casts to
its dtypes, so a mismatched target would otherwise come back silently converted or
truncated. Orbax records no checksum, so each step also holds ``hashes.json`` (SHA-256 of
every file, written before the rename that commits the step) and a restore re-hashes the
files first: a damaged step is named with its file and skipped for the newest intact one.
Design notes: docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jmem._src.file_hash import hash_file
from jmem._src.jax_compat import with_sharding_memory_space
from jmem._src.quantization import QuantizedArray

#: At most this many differing leaves are listed in a mismatch error.
_MAX_LISTED = 12
#: Each committed step's content hashes: ``{"algorithm": "sha256", "files": {path: hex}}``.
HASHES = "hashes.json"
#: Written in a checkpoint directory that jmem started: its steps must carry ``HASHES``
#: (a directory without it was written by jmem <= 0.2, whose steps are read unverified).
MARKER = "jmem-checkpoints.json"
#: Files orbax rewrites after the commit (its step metadata: timestamps), not hashed.
_UNHASHED = (HASHES, "_CHECKPOINT_METADATA")
#: Orbax's suffix of a step's directory while it is written.
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointDamagedError(ValueError):
    """A checkpoint step whose files differ from the hashes written at save, are missing,
    cannot be read, or hold non-finite values. The message names the step and the file."""


class Checkpointer:
    """Saves and restores train states in ``directory``.

    Args:
      directory: where step directories are written (created if missing).
      save_every: save when ``step % save_every == 0`` (``maybe_save``).
      keep: number of most recent checkpoints kept.

    Raises:
      ValueError: ``save_every`` or ``keep`` < 1.
    """

    def __init__(self, directory: str, *, save_every: int = 100, keep: int = 3):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1; got {save_every}, {keep}.")
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        self._saving: int | None = None  # the step whose async save is in flight
        self._damaged: set[int] = set()  # steps found damaged (set aside before a re-save)
        fresh = not os.path.isdir(self.directory) or not any(
            n.isdigit() for n in os.listdir(self.directory)
        )
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                # hashes.json is written after every file, before the rename that commits
                async_options=ocp.AsyncOptions(post_finalization_callback=self._write_hashes),
            ),
            # Registered up front so that a fresh manager can read a step's metadata.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

        if fresh and jax.process_index() == 0:
            _write_json(os.path.join(self.directory, MARKER), {"format": 1, "hashes": HASHES})

    @staticmethod
    def _savable(state):
        return state.replace(frozen=None) if hasattr(state, "replace") else state

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = True) -> bool:
        """Saves ``state`` (without ``frozen``) and ``meta`` (JSON-serializable) as ``step``.

        The write is asynchronous (``wait`` blocks until it is on disk); it goes to a
        temporary directory renamed when complete, after ``hashes.json`` (the SHA-256 of
        every file) is written into it. A directory of ``step`` left by a damaged or
        unfinished save is first renamed ``<step>.damaged``.
        """
        self._mgr.wait_until_finished()
        step = int(step)
        if step in self._mgr.all_steps() and (step in self._damaged or not self._committed(step)):
            self._set_aside(step)
        self._saving = step
        saved = self._mgr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self._savable(state)),
                meta=ocp.args.JsonSave(meta or {}),
            ),
            force=force,
        )
        return bool(saved)

    def maybe_save(self, step: int, state: Any, meta: dict | None = None) -> bool:
        """Saves when ``step`` is a multiple of ``save_every``."""
        if int(step) % self.save_every:
            return False
        return self.save(step, state, meta)

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step (None if there is none).

        Incomplete saves (orbax temporary directories left by a killed process), and step
        directories without ``hashes.json`` (an empty ``9/``) are ignored; the content is
        checked by ``verify`` and ``restore``.
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints in ``directory`` (renamed from orbax's
        temporary directory, with ``hashes.json``), ascending."""
        self._mgr.wait_until_finished()
        return sorted(s for s in self._mgr.all_steps() if self._committed(s))

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _committed(self, step: int) -> bool:
        return _is_committed(self.directory, step)

    def _write_hashes(self) -> None:
        """orbax's post-finalization callback (process 0, every process's files written,
        before the rename that commits the step): ``hashes.json`` of the step in flight."""
        final = self._step_dir(self._saving)
        path = final + _TMP_SUFFIX if os.path.isdir(final + _TMP_SUFFIX) else final
        _write_json(os.path.join(path, HASHES), {"algorithm": "sha256", "files": hash_files(path)})

    def verify(self, step: int) -> list[str]:
        """What is wrong with checkpoint ``step``'s files, one line each naming the file
        relative to ``directory`` (``4/state/d/9f3c...: content differs from its hash``);
        empty when every file hashes as it did at save. A step of a directory written by
        jmem <= 0.2 (no hashes) has nothing to compare: empty.

        Re-reads every file of the step (SHA-256, about 1 GB/s).
        """
        return verify_step(self.directory, step)

    def _set_aside(self, step: int) -> None:
        """Renames step ``step``'s directory to ``<step>.damaged`` (process 0; every process
        then re-lists), so that the step can be saved again."""
        if jax.process_index() == 0:
            path, n = self._step_dir(step), 0
            while os.path.exists(aside := f"{path}.damaged" + (f".{n}" if n else "")):
                n += 1
            os.rename(path, aside)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jmem_checkpoint_set_aside_{step}")
        self._damaged.discard(step)
        self._mgr.reload()

    def restore(
        self,
        target: Any,
        step: int | None = None,
        *,
        on_damaged: Callable[[str], None] | None = None,
    ) -> tuple[Any, dict]:
        """Restores ``(state, meta)`` exactly as saved: no leaf changes dtype, shape or place
        in the tree; its files verified first, its values finite.

        The step's files are re-hashed against its ``hashes.json`` (``verify``), and the
        target is checked leaf by leaf against the checkpoint's metadata before anything is
        read. A mismatch is an error, never a conversion: a bfloat16 checkpoint
        is not widened into a float32 target, a float32 one not narrowed into bfloat16, and
        an NF4 base written with double quantization (uint8 absmax codes plus scales) is not
        read into a tree built without it. To change a dtype on purpose, restore into a
        matching target and cast the result yourself.

        Args:
          target: a state (or ``jax.ShapeDtypeStruct``s of one, e.g.
            ``TrainStep.abstract_state(params)``) with the structure, dtypes and shardings
            to restore into. Each leaf is restored with the target's sharding, memory kind
            included (``abstract_state`` of an offloaded step puts the optimizer state
            straight into ``pinned_host``; of a ``mesh=`` step, onto that mesh, whatever
            device count wrote the checkpoint). Its ``frozen`` field is kept as given
            (re-attached, not read), so it must hold the real frozen params (or None).
          step: which step; default the newest intact one: a damaged newer step is
            reported (``on_damaged``) and the next older one tried, and a later ``save`` of
            the damaged step first renames its directory ``<step>.damaged``.
          on_damaged: called with one line per damaged step skipped (default: a
            ``UserWarning``), e.g. ``checkpoint step 4 in '/run/checkpoints' is damaged:
            4/state/d/9f3c...: content differs from its hash (damaged)``.

        Returns:
          ``(state, meta)``: ``state`` has ``target``'s structure and dtypes (equal to the
          saved ones), ``meta`` the JSON dict given to ``save``.

        Raises:
          FileNotFoundError: if the directory holds no committed checkpoint (or not that step).
          CheckpointDamagedError: (a ``ValueError``) if ``step`` (or, with ``step=None``,
            every step) is damaged: a file missing, differing from its hash or unreadable,
            or a float leaf restored non-finite; the message names the step and the file.
          ValueError: if the target does not match the checkpoint: a leaf saved but not in
            the target, in the target but not saved, or with another shape or dtype. The
            message lists each leaf by its path (``params.w``, ``opt_state.0.mu.w.codes``)
            with the saved and the target shape/dtype. Also if the checkpoint has no tree
            metadata to check against, or if ``target.frozen`` holds ShapeDtypeStructs.

        A checkpoint of jmem 0.1.0, which stored each ``QuantizedArray`` by position as
        ``[codes, absmax]``, is recognized from its metadata and restored into today's
        named fields.
        """
        steps = self.all_steps()  # waits for a save still in flight
        if step is not None and step not in steps:
            steps = []
        if not steps:
            raise FileNotFoundError(
                f"No checkpoint{'' if step is None else f' for step {step}'} in {self.directory!r} "
                f"(found steps {self.all_steps()}). Start without --resume, or point to the "
                f"right directory."
            )
        _check_frozen(target)
        if step is not None:
            return self._restore_verified(target, step)
        report = on_damaged or (lambda line: warnings.warn(line, stacklevel=3))
        damaged = []
        for s in reversed(steps):
            try:
                return self._restore_verified(target, s)
            except CheckpointDamagedError as e:
                self._damaged.add(s)
                damaged.append(str(e))
                report(str(e))
        raise CheckpointDamagedError(
            f"every checkpoint in {self.directory!r} is damaged (steps {steps}): "
            f"{'; '.join(damaged)}. Start the run again (--overwrite) or restore the files."
        )

    def _restore_verified(self, target: Any, step: int) -> tuple[Any, dict]:
        """``restore`` of one step: its files verified, the target checked, values finite."""
        problems = self.verify(step)
        where = f"checkpoint step {step} in {self.directory!r}"
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointDamagedError(f"{where} is damaged: {problems[0]}{more}")
        abstract = jax.tree.map(_abstract_leaf, self._savable(target))
        try:
            saved = self._saved_leaves(step)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointDamagedError(f"{where}: unreadable metadata ({_one_line(e)})") from e
        problems = _mismatches(saved, _target_leaves(abstract))
        try:
            if not problems:
                state, meta = self._restore(step, abstract)
            elif _has_quantized(abstract) and not _mismatches(
                saved, _target_leaves(_positional_quantized(abstract))
            ):
                # A checkpoint written before QuantizedArray became a registered dataclass
                # (jmem <= 0.1.0) names its fields by position: [codes, absmax].
                state, meta = self._restore(step, _positional_quantized(abstract))
                state = _named_quantized(state, abstract)
            else:
                raise ValueError(_mismatch_message(step, self.directory, problems))
        except (OSError, RuntimeError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointDamagedError(f"{where}: unreadable ({_one_line(e)})") from e
        bad = _nonfinite_leaves(state)
        if bad:
            raise CheckpointDamagedError(
                f"{where} holds non-finite values in {', '.join(bad[:_MAX_LISTED])}"
            )
        frozen = getattr(target, "frozen", None)
        if frozen is not None:
            state = state.replace(frozen=frozen)
        return state, meta

    def _saved_leaves(self, step: int) -> dict[str, tuple]:
        """``{leaf path: (shape, dtype)}`` of the state saved at ``step``, from its metadata."""
        metadata = self._mgr.item_metadata(step)
        tree = None if metadata is None else metadata["state"]
        if tree is None:
            raise ValueError(
                f"Checkpoint step {step} in {self.directory!r} has no readable tree metadata "
                f"(state/_METADATA), so the restore target cannot be checked against it. "
                f"Re-save it with the orbax installed with jmem, which writes that metadata."
            )
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {_path_name(p): (tuple(m.shape), _dtype_name(m.dtype)) for p, m in leaves}

    def _restore(self, step: int, abstract: Any) -> tuple[Any, dict]:
        target, absent = _without_absent_fields(abstract, self._mgr.item_metadata(step)["state"])
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        # A host-memory leaf on one device comes back traced as a device value; as the step
        # compiled for it would return it to device memory, give it its memory kind's space.
        state = jax.tree.map(with_sharding_memory_space, out["state"])
        if absent:  # the fields the checkpoint predates stay None
            state = dataclasses.replace(abstract, **state)
        return state, dict(out["meta"] or {})

    def wait(self):
        """Blocks until asynchronous saves are on disk (committed)."""
        self._mgr.wait_until_finished()

    def close(self):
        """Waits for pending saves, then releases orbax's resources."""
        self._mgr.wait_until_finished()
        self._mgr.close()


def _is_committed(directory: str, step: int) -> bool:
    """Step ``step`` of ``directory`` is committed: renamed by orbax, with ``HASHES`` (or,
    in a directory of jmem <= 0.2 without ``MARKER``, with its ``state`` item)."""
    path = os.path.join(directory, str(step))
    if os.path.isfile(os.path.join(path, HASHES)):
        return True
    legacy = not os.path.exists(os.path.join(directory, MARKER))
    return legacy and os.path.isdir(os.path.join(path, "state"))


def verify_step(directory: str, step: int) -> list[str]:
    """``Checkpointer.verify`` of step ``step`` in ``directory``, without an orbax manager:
    one line per file that is missing, unreadable or differs from ``hashes.json``."""
    path = os.path.join(directory, str(step))
    record = os.path.join(path, HASHES)
    if not os.path.exists(record):
        return [] if _is_committed(directory, step) else [f"{step}/{HASHES}: missing"]
    try:
        with open(record) as f:
            saved = json.load(f)["files"]
        saved = {str(k): str(v) for k, v in saved.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{step}/{HASHES}: unreadable ({_one_line(e)})"]
    return compare_hashes(path, saved, f"{step}/")


def compare_hashes(root: str, saved: dict[str, str], prefix: str = "") -> list[str]:
    """One line per file of ``saved`` (``{path relative to root: sha256}``) that is
    missing, unreadable or hashes otherwise now, named ``prefix + path``; empty if none."""
    problems = []
    for name, digest in sorted(saved.items()):
        file = os.path.join(root, name)
        if not os.path.isfile(file):
            problems.append(f"{prefix}{name}: missing")
            continue
        try:
            now = hash_file(file)
        except OSError as e:
            problems.append(f"{prefix}{name}: unreadable ({_one_line(e)})")
            continue
        if now != digest:
            problems.append(f"{prefix}{name}: content differs from its hash (damaged)")
    return problems


def committed_steps(directory: str) -> list[int]:
    """The committed steps in a checkpoint directory, ascending, read from the directory
    alone (no orbax manager is made; ``Checkpointer.all_steps`` is the same list): step
    directories with ``hashes.json``, not orbax's temporary ones, not a stray empty ``9/``.
    """
    if not os.path.isdir(directory):
        return []
    steps = [int(n) for n in os.listdir(directory) if n.isdigit()]
    return sorted(s for s in steps if _is_committed(directory, s))


def _check_frozen(target: Any) -> None:
    """A target whose ``frozen`` holds ShapeDtypeStructs would restore no weights."""
    frozen = getattr(target, "frozen", None)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(frozen)):
        raise ValueError(
            "target.frozen holds jax.ShapeDtypeStructs (e.g. from abstract_state(params, "
            "frozen=...)): the frozen base is not in the checkpoint, it is re-attached as "
            "given, so the restored state would hold no weights. Pass the real frozen "
            "params: restore(target.replace(frozen=frozen)), placed as the step wants them "
            "(jmem.sharding.shard_state(frozen, shardings of target.frozen) on a mesh)."
        )


def _nonfinite_leaves(state: Any) -> list[str]:
    """Paths of the float leaves holding a NaN or an infinity. Each process reads the
    shards it holds (on the host: an offloaded leaf stays where it is); across processes
    the verdicts are gathered, so that every process agrees."""
    names, bad = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jax.dtypes.issubdtype(dtype, np.inexact):
            continue
        shards = [s.data for s in x.addressable_shards] if hasattr(x, "addressable_shards") else [x]
        names.append(_path_name(path))
        bad.append(not all(np.isfinite(np.asarray(d, np.float32)).all() for d in shards))
    flags = np.asarray(bad, bool)
    if jax.process_count() > 1 and len(flags):
        flags = np.asarray(multihost_utils.process_allgather(flags)).any(axis=0)
    return [n for n, f in zip(names, flags) if f]


def hash_files(root: str, skip: tuple[str, ...] = _UNHASHED) -> dict[str, str]:
    """``{path relative to root: sha256}`` of every file under ``root`` but ``skip`` (paths
    relative to ``root``; default the files orbax rewrites after a step's commit)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel not in skip:
                out[rel] = hash_file(path)
    return dict(sorted(out.items()))


def _write_json(path: str, value: Any) -> None:
    """Writes ``value`` to ``path`` atomically (a temporary file, fsync, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _without_absent_fields(abstract: Any, saved: Any) -> tuple[Any, list[str]]:
    """``(restore target, absent)``: a state dataclass whose None fields are not in the
    saved tree (a field added after the checkpoint was written, e.g. ``dropout_key``,
    absent from jmem 0.1.0's checkpoints) is restored as a dict of its other fields."""
    if not dataclasses.is_dataclass(abstract) or not hasattr(saved, "keys"):
        return abstract, []
    names = [f.name for f in dataclasses.fields(abstract)]
    absent = [n for n in names if n not in saved.keys() and getattr(abstract, n) is None]
    if not absent:
        return abstract, []
    return {n: getattr(abstract, n) for n in names if n not in absent}, absent


def _abstract_leaf(x: Any) -> Any:
    """``ShapeDtypeStruct`` of an array leaf, keeping its sharding (memory kind included)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(
            x.shape,
            x.dtype,
            sharding=getattr(x, "sharding", None),
            weak_type=bool(getattr(x, "weak_type", False)),
        )
    return x


def _path_name(path: tuple) -> str:
    """Orbax's name of a leaf: its keys joined by dots (``opt_state.0.mu.w.codes``)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # e.g. typed PRNG keys
        return str(dtype)


def _target_leaves(tree: Any) -> dict[str, tuple]:
    """``{leaf path: (shape, dtype)}`` of a restore target."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for path, x in leaves:
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        out[_path_name(path)] = (tuple(np.shape(x)), _dtype_name(dtype))
    return out


def _describe(spec: tuple) -> str:
    shape, dtype = spec
    return f"{dtype}[{','.join(map(str, shape))}]"


def _mismatches(saved: dict[str, tuple], target: dict[str, tuple]) -> list[str]:
    """One line per leaf whose presence, shape or dtype differs; empty when they match."""
    lines = []
    for name in sorted(set(saved) | set(target)):
        if name not in target:
            lines.append(f"{name}: saved {_describe(saved[name])}, not in the target")
        elif name not in saved:
            lines.append(f"{name}: not in the checkpoint, target {_describe(target[name])}")
        elif saved[name] != target[name]:
            lines.append(
                f"{name}: saved {_describe(saved[name])}, target {_describe(target[name])}"
            )
    return lines


def _mismatch_message(step: int, directory: str, problems: list[str]) -> str:
    listed = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return (
        f"Checkpoint step {step} in {directory!r} does not match the restore target in "
        f"{len(problems)} leaf/leaves (orbax would read what the target describes, casting "
        f"dtypes and dropping leaves silently, so nothing was restored):\n  {listed}{more}\n"
        f"Build the target with the options the checkpoint was written with (precision and "
        f"master_weights; the optimizer and its 8-/4-bit settings; NF4 block_size and "
        f"double_quant; LoRA rank and targets; offload and mesh may differ), e.g. "
        f"step.abstract_state(params) of the same train_step. To change a dtype on purpose, "
        f"restore into a matching target and cast the restored leaves yourself."
    )


def _is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedArray)


def _has_quantized(tree: Any) -> bool:
    return any(_is_quantized(x) for x in jax.tree.leaves(tree, is_leaf=_is_quantized))


def _positional_quantized(tree: Any) -> Any:
    """``tree`` with each ``QuantizedArray`` as the list ``[codes, absmax]`` (the old layout)."""
    return jax.tree.map(
        lambda x: [x.codes, x.absmax] if _is_quantized(x) else x, tree, is_leaf=_is_quantized
    )


def _named_quantized(restored: Any, target: Any) -> Any:
    """Rebuilds the ``QuantizedArray`` leaves of ``target`` from ``[codes, absmax]`` lists."""
    return jax.tree.map(
        lambda t, r: dataclasses.replace(t, codes=r[0], absmax=r[1]) if _is_quantized(t) else r,
        target,
        restored,
        is_leaf=_is_quantized,
    )
