"""The training process of the kill-during-save test in tests/test_checkpoint.py (not a test
module itself).

Usage: ``python tests/_ckpt_worker.py DIR STEPS [--kill-at N --kill-point write|commit]
[--reference REF_DIR]``. Trains a small MLP with ``jmem.train_step`` (8-bit AdamW, dynamic
loss scale) for STEPS batches, saving a ``Checkpointer`` checkpoint after every batch
(checkpoint ``i + 1`` holds the state after batch ``i`` and ``{"next_batch": i + 1}``), and
resumes from the latest complete checkpoint in DIR if there is one. Prints one JSON line per
event: ``{"resumed_from": step}``, ``{"run": name, "batch": i, "loss": float.hex}``.

``--kill-at N`` makes the process SIGKILL itself in the middle of saving checkpoint N, at
one of orbax's own steps (hooked by wrapping its temporary-path class, the same code a real
save runs): ``write`` right after orbax created the step's temporary directory (nothing of
the state written yet), ``commit`` after every file is written, just before the rename
that commits it. ``--reference REF_DIR`` then also runs the same training uninterrupted
from scratch in REF_DIR, in this process, as run ``"reference"``.
"""

import argparse
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint._src.path.atomicity as atomicity

import jmem


def _emit(**record):
    print(json.dumps(record), flush=True)


def _kill_during_save(step: int, point: str) -> None:
    """Wraps orbax's temporary paths so that saving checkpoint ``step`` kills the process."""
    method = {"write": "create", "commit": "finalize"}[point]
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        original = getattr(cls, method)

        async def hooked(self, *args, _original=original, **kwargs):
            final = self.get_final()
            if point == "commit" and final.name == str(step):
                os.kill(os.getpid(), signal.SIGKILL)
            out = await _original(self, *args, **kwargs)
            if point == "write" and final.name == str(step):
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(cls, method, hooked)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def _params():
    k = jax.random.split(jax.random.key(0), 2)
    return {
        "w1": 0.1 * jax.random.normal(k[0], (32, 64)),
        "b1": jnp.zeros((64,)),
        "w2": 0.1 * jax.random.normal(k[1], (64, 32)),
    }


def _batch(i):
    k = jax.random.split(jax.random.fold_in(jax.random.key(1), i), 2)
    return {"x": jax.random.normal(k[0], (8, 32)), "y": jax.random.normal(k[1], (8, 32))}


def train(directory: str, steps: int, run: str) -> None:
    step = jmem.train_step(
        _loss,
        jmem.adamw_8bit(1e-2, min_8bit_size=1024),
        loss_scale=jmem.DynamicLossScale(2.0**8, period=3),
    )
    params = _params()
    ck = jmem.Checkpointer(directory, save_every=1, keep=2)
    latest, start = ck.latest_step(), 0
    if latest is None:
        state = step.init(params)
    else:
        state, meta = ck.restore(step.abstract_state(params))
        start = meta["next_batch"]
        _emit(resumed_from=latest)
    for i in range(start, steps):
        state, metrics = step(state, _batch(i))
        _emit(run=run, batch=i, loss=float(metrics["loss"]).hex())
        ck.save(i + 1, state, {"next_batch": i + 1})
    ck.close()


def main(argv):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("directory")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-point", choices=("write", "commit"), default="commit")
    parser.add_argument("--reference")
    args = parser.parse_args(argv)
    if args.kill_at is not None:
        _kill_during_save(args.kill_at, args.kill_point)
    train(args.directory, args.steps, "main")
    if args.reference:
        train(args.reference, args.steps, "reference")


if __name__ == "__main__":
    main(sys.argv[1:])
