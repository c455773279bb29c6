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
truncated. Design notes: docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmem._src.quantization import QuantizedArray

#: At most this many differing leaves are listed in a mismatch error.
_MAX_LISTED = 12


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
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            # Registered up front so that a fresh manager can read a step's metadata.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    @staticmethod
    def _savable(state):
        return state.replace(frozen=None) if hasattr(state, "replace") else state

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = True) -> bool:
        """Saves ``state`` (without ``frozen``) and ``meta`` (JSON-serializable) as ``step``.

        The write is asynchronous (``wait`` blocks until it is on disk); it goes to a
        temporary directory renamed when complete.
        """
        saved = self._mgr.save(
            int(step),
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
        """The newest complete checkpoint's step (None if there is none).

        Incomplete saves (orbax temporary directories left by a killed process) are ignored.
        """
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints in ``directory``, ascending."""
        return sorted(self._mgr.all_steps())

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores ``(state, meta)`` exactly as saved: no leaf changes dtype, shape or place
        in the tree.

        The target is checked leaf by leaf against the checkpoint's metadata before
        anything is read. A mismatch is an error, never a conversion: a bfloat16 checkpoint
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
          step: which step; default the latest complete one.

        Returns:
          ``(state, meta)``: ``state`` has ``target``'s structure and dtypes (equal to the
          saved ones), ``meta`` the JSON dict given to ``save``.

        Raises:
          FileNotFoundError: if the directory holds no complete checkpoint (or not that step).
          ValueError: if the target does not match the checkpoint: a leaf saved but not in
            the target, in the target but not saved, or with another shape or dtype. The
            message lists each leaf by its path (``params.w``, ``opt_state.0.mu.w.codes``)
            with the saved and the target shape/dtype. Also if the checkpoint has no tree
            metadata to check against, or if ``target.frozen`` holds ShapeDtypeStructs.

        A checkpoint of jmem 0.1.0, which stored each ``QuantizedArray`` by position as
        ``[codes, absmax]``, is recognized from its metadata and restored into today's
        named fields.
        """
        self._mgr.wait_until_finished()  # a save still in flight is listed, not yet readable
        steps = self.all_steps()
        if step is None:
            step = self.latest_step()
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"No checkpoint{'' if step is None else f' for step {step}'} in {self.directory!r} "
                f"(found steps {steps}). Start without --resume, or point to the right directory."
            )
        frozen = getattr(target, "frozen", None)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(frozen)):
            raise ValueError(
                "target.frozen holds jax.ShapeDtypeStructs (e.g. from abstract_state(params, "
                "frozen=...)): the frozen base is not in the checkpoint, it is re-attached as "
                "given, so the restored state would hold no weights. Pass the real frozen "
                "params: restore(target.replace(frozen=frozen)), placed as the step wants them "
                "(jmem.sharding.shard_state(frozen, shardings of target.frozen) on a mesh)."
            )
        abstract = jax.tree.map(_abstract_leaf, self._savable(target))
        saved = self._saved_leaves(step)
        problems = _mismatches(saved, _target_leaves(abstract))
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
        state = out["state"]
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
