"""Training checkpoints with orbax: save every N steps, keep the last K, resume exactly.

What is saved: the ``TrainState`` minus its ``frozen`` params (the LoRA/QLoRA base is
rebuilt from the model checkpoint or seed, not re-saved every N steps), i.e. the
trainable params (adapters), the optimizer state with quantized moments (uint8 codes and
float32 absmax stay as they are), the loss scale and the step; plus a JSON record of the
data position, the RNG seed and anything else the caller passes in ``meta``.

Orbax writes each step to a temporary directory and renames it when complete, so an
interrupted save never replaces a good checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jmem._src.quantization import QuantizedArray


class Checkpointer:
    """Saves and restores train states in ``directory``.

    Args:
      directory: where step directories are written (created if missing).
      save_every: save when ``step % save_every == 0`` (``maybe_save``).
      keep: number of most recent checkpoints kept.
    """

    def __init__(self, directory: str, *, save_every: int = 100, keep: int = 3):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1; got {save_every}, {keep}.")
        self.directory = os.path.abspath(directory)
        self.save_every = save_every
        self._mgr = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    @staticmethod
    def _savable(state):
        return state.replace(frozen=None) if hasattr(state, "replace") else state

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = True) -> bool:
        """Saves ``state`` (without ``frozen``) and ``meta`` (JSON-serializable) as ``step``."""
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
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores ``(state, meta)``.

        Args:
          target: a state (or ``jax.eval_shape`` of one) with the structure, dtypes and
            shardings to restore into; its ``frozen`` field is kept as given (re-attached).
          step: which step; default the latest.

        Raises:
          FileNotFoundError: if the directory holds no checkpoint (or not that step).
        """
        steps = self.all_steps()
        if step is None:
            step = self.latest_step()
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"No checkpoint{'' if step is None else f' for step {step}'} in {self.directory!r} "
                f"(found steps {steps}). Start without --resume, or point to the right directory."
            )
        frozen = getattr(target, "frozen", None)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            self._savable(target),
        )
        try:
            state, meta = self._restore(step, abstract)
        except ValueError:
            if not _has_quantized(abstract):
                raise
            # A checkpoint written before QuantizedArray became a registered dataclass
            # (jmem <= 0.1.0) names its fields by position: [codes, absmax].
            state, meta = self._restore(step, _positional_quantized(abstract))
            state = _named_quantized(state, abstract)
        if frozen is not None:
            state = state.replace(frozen=frozen)
        return state, meta

    def _restore(self, step: int, abstract: Any) -> tuple[Any, dict]:
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"] or {})

    def wait(self):
        """Blocks until asynchronous saves are on disk."""
        self._mgr.wait_until_finished()

    def close(self):
        self._mgr.wait_until_finished()
        self._mgr.close()


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
