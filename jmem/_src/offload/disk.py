"""Optimizer state on disk: each parameter's moments and masters live in a file under a
directory, and the update streams them leaf by leaf (read one leaf's state, update it on
the device, write it back), so host memory holds one leaf's state at a time.

The update is leaf-by-leaf mode's program (``leaf_by_leaf.py``: the whole-tree update
traced once and re-emitted one leaf at a time), with its loads and stores replaced by
ordered ``jax.experimental.io_callback`` reads and writes, so the values are those of the
in-memory update. The files are a cache of the current step, not the source of truth:
``step.json`` says ``clean: false`` from the first read of an update until its last write,
and a run that stopped mid-step rebuilds the files from a checkpoint (``write_state``).

Design notes: docs/offload.md. Reference: ZeRO-Infinity (Rajbhandari et al., 2021,
arXiv:2104.07857) for optimizer state on NVMe.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem._src.offload import leaf_by_leaf as _lbl
from jmem._src.offload.memory_kinds import is_array

LAYOUT_FILE = "layout.json"
STEP_FILE = "step.json"


def _bad_dir(arg: str, path: str, why: str) -> ValueError:
    return ValueError(f"{arg} {path!r}: {why}.")


def check_directory(
    path: Any, nbytes: int = 0, *, arg: str = "offload_dir", create: bool = True
) -> str:
    """Checks that ``path`` can hold ``nbytes`` of optimizer state; creates it if absent.

    Args:
      path: a directory (str or ``os.PathLike``); its parent must exist.
      nbytes: bytes the state needs (checked against ``shutil.disk_usage``'s free bytes plus
        those of state files already there, which are overwritten).
      arg: the argument's name for messages (``--offload-dir`` in the job).
      create: make the directory when the checks pass (False: check only).

    Returns:
      The absolute path.

    Raises:
      ValueError: one line naming ``arg``: not a str/path, missing parent, not a directory,
        not writable, or too little free space.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{arg} must be a directory path, got {path!r}.")
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise _bad_dir(arg, path, f"its parent {parent} does not exist; create it first")
    if os.path.exists(path) and not os.path.isdir(path):
        raise _bad_dir(arg, path, "is a file, not a directory; name a directory")
    where = path if os.path.isdir(path) else parent
    if not os.access(where, os.W_OK | os.X_OK):
        raise _bad_dir(arg, path, f"{where} is not writable; choose a writable directory")
    reusable = (
        sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith(".bin") and e.is_file())
        if os.path.isdir(path)
        else 0
    )
    free = shutil.disk_usage(where).free + reusable
    if nbytes > free:
        raise _bad_dir(
            arg,
            path,
            f"the optimizer state needs {nbytes:,} bytes but only {free:,} are free "
            f"there; free space or choose another disk",
        )
    if create:
        os.makedirs(path, exist_ok=True)
    return path


@dataclasses.dataclass(eq=False)  # hashed by identity: the jit cache keys on it
class DiskStore:
    """One directory holding an optimizer state's per-parameter leaves, one file each.

    Attributes:
      directory: absolute path.
      s_def: treedef of the wrapped optimizer's state.
      static: that state's leaves, None where an array is.
      specs: per array leaf (flatten order) its ``jax.ShapeDtypeStruct``.
      owner: per array leaf its parameter leaf index, or -1 for shared leaves (step count,
        hyperparameters: kept in ``DiskState.shared`` on the device, not on disk).
      io_seconds, bytes_read, bytes_written: the disk I/O of this process so far.
    """

    directory: str
    s_def: Any
    static: list
    specs: list
    owner: list
    io_seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def owned(self) -> list[int]:
        return [m for m, k in enumerate(self.owner) if k >= 0]

    @property
    def nbytes(self) -> int:
        """Bytes of the state on disk (the files' total size)."""
        return sum(_nbytes(self.specs[m]) for m in self.owned)

    def path(self, m: int) -> str:
        return os.path.join(self.directory, f"leaf_{m:05d}.bin")

    def read(self, m: int) -> np.ndarray:
        """State array leaf ``m`` read from its file."""
        t0, spec = time.perf_counter(), self.specs[m]
        raw = np.fromfile(self.path(m), dtype=np.uint8, count=_nbytes(spec))
        x = raw.view(spec.dtype).reshape(spec.shape)
        self.io_seconds += time.perf_counter() - t0
        self.bytes_read += raw.nbytes
        return x

    def write(self, m: int, x: Any) -> None:
        """Writes state array leaf ``m`` over its file, in place."""
        t0 = time.perf_counter()
        raw = np.ascontiguousarray(x, dtype=self.specs[m].dtype).reshape(-1).view(np.uint8)
        with open(self.path(m), "r+b" if os.path.exists(self.path(m)) else "wb") as f:
            f.write(raw.tobytes())
        self.io_seconds += time.perf_counter() - t0
        self.bytes_written += raw.nbytes

    def mark(self, clean: bool) -> None:
        """Writes ``step.json``: ``clean`` is false while an update is writing the files."""
        with open(os.path.join(self.directory, STEP_FILE), "w") as f:
            json.dump({"clean": bool(clean), "updates": self.updates}, f)

    updates: int = 0  # updates whose writes finished (skipped ones included)

    def is_clean(self) -> bool:
        """Whether the files hold one whole state (no update stopped between its writes)."""
        try:
            with open(os.path.join(self.directory, STEP_FILE)) as f:
                return bool(json.load(f)["clean"])
        except (OSError, ValueError, KeyError):
            return False


def left_mid_update(directory: Any) -> bool:
    """Whether ``directory``'s ``step.json`` says ``clean: false`` (or cannot be read): a
    process stopped between an update's first read and its last write (``kill -9``, a
    crash), so the files may mix two steps. They are not to be read as they are: the job
    rebuilds them from the checkpoint on ``--resume`` (from init otherwise), whatever this
    says; it only names the case. False when there is no ``step.json`` (a new directory).
    """
    path = os.path.join(os.fspath(directory), STEP_FILE)
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            return json.load(f)["clean"] is not True
    except (OSError, ValueError, KeyError, TypeError):
        return True


def _nbytes(spec: Any) -> int:
    return math.prod(spec.shape) * np.dtype(spec.dtype).itemsize


@jax.tree_util.register_pytree_node_class
class DiskState:
    """An optimizer state kept on disk: the shared leaves (step counts) as arrays, the
    per-parameter leaves in ``store``'s files. A pytree whose children are the shared
    leaves; ``full_state`` gives the wrapped optimizer's state (for checkpoints)."""

    def __init__(self, shared: tuple, store: DiskStore):
        self.shared, self.store = tuple(shared), store

    def tree_flatten(self):
        return self.shared, self.store

    @classmethod
    def tree_unflatten(cls, store, children):
        return cls(tuple(children), store)

    def full(self, *, copy: bool = False) -> Any:
        """The wrapped optimizer's state, for a checkpoint (``full_state``)."""
        return full_state(self, copy=copy)

    def restored(self, state: Any) -> DiskState:
        """``state`` (the wrapped optimizer's, e.g. from a checkpoint) written over this
        state's files (``write_state``); returns the new ``DiskState``."""
        return write_state(self.store, state)

    def __repr__(self) -> str:
        return f"DiskState({self.store.directory!r}, {self.store.nbytes:,} bytes on disk)"


def _shared_idx(store: DiskStore) -> list[int]:
    return [m for m, k in enumerate(store.owner) if k < 0]


def _leaves(store: DiskStore, arrays: list) -> Any:
    it = iter(arrays)
    return store.s_def.unflatten([next(it) if x is None else x for x in store.static])


def full_state(state: DiskState, *, copy: bool = False) -> Any:
    """The wrapped optimizer's state: shared leaves as they are, per-parameter leaves as
    read-only ``np.memmap``s of their files (``copy``: every leaf a NumPy array in memory,
    which outlives the next step's donation of the shared leaves).
    Save it with the checkpointer; a memmap changes when the next update writes."""
    store, shared = state.store, iter(state.shared)
    arrays = []
    for m, k in enumerate(store.owner):
        if k < 0:
            x = next(shared)
            arrays.append(np.array(x) if copy else x)
        elif copy or not _nbytes(store.specs[m]):
            arrays.append(store.read(m).copy())
        else:
            spec = store.specs[m]
            arrays.append(np.memmap(store.path(m), spec.dtype, "r", shape=spec.shape))
    return _leaves(store, arrays)


def write_state(store: DiskStore, state: Any) -> DiskState:
    """Writes the wrapped optimizer's ``state`` (e.g. restored from a checkpoint) over the
    files, leaf by leaf; returns the ``DiskState``. Raises ValueError for another layout."""
    leaves, s_def = jax.tree.flatten(state)
    arrays = [x for x in leaves if is_array(x)]
    shapes = [(tuple(np.shape(x)), np.dtype(x.dtype)) for x in arrays]
    want = [(tuple(s.shape), np.dtype(s.dtype)) for s in store.specs]
    if s_def != store.s_def or shapes != want:
        raise ValueError(
            f"offload to disk: the state to write has another layout than {store.directory} "
            f"(structure or shapes/dtypes differ); build the step for this state."
        )
    store.mark(False)
    for m in store.owned:
        store.write(m, np.asarray(arrays[m]))
    store.mark(True)
    shared = [jnp.asarray(arrays[m]) for m in _shared_idx(store)]
    return DiskState(tuple(shared), store)


def init(inner: Any, directory: str, params: Any) -> DiskState:
    """``inner.init(params)`` written to files under ``directory`` one parameter leaf at a
    time (``inner.init`` on that leaf alone, every other leaf None, as leaf-by-leaf mode
    splits the state), so host memory holds one leaf's state at a time.

    Raises:
      ValueError: a bad ``directory`` (``check_directory``), a state that does not split by
        parameter leaf, or ``params`` that are traced (the files are written eagerly).
    """
    p_leaves, p_def = jax.tree.flatten(params)
    if any(isinstance(x, jax.core.Tracer) for x in p_leaves):
        raise ValueError(
            "offload to disk: init writes files and cannot run under jit/eval_shape; call "
            "step.init(params) (or tx.init) eagerly."
        )
    abstract = jax.eval_shape(inner.init, params)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    owner_of = _lbl._owners(inner, p_def, p_leaves, abstract, names)
    flat, s_def = jax.tree_util.tree_flatten_with_path(abstract)
    paths = [p for p, x in flat]
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in flat]
    owner = [owner_of[p] for p in paths]
    nbytes = sum(_nbytes(s) for s, k in zip(specs, owner) if k >= 0)
    directory = check_directory(directory, nbytes)
    store = DiskStore(directory, s_def, [None] * len(specs), specs, owner)
    _write_layout(store, paths)
    store.mark(False)
    shared = {}
    init_jit = jax.jit(inner.init)
    for i in range(len(p_leaves)):
        sub = init_jit(_lbl._masked(p_leaves, p_def, i))
        for p, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
            m = paths.index(p)
            if owner[m] == i:
                store.write(m, np.asarray(x))
            elif owner[m] < 0 and m not in shared:
                shared[m] = x
    store.mark(True)
    return DiskState(tuple(shared[m] for m in _shared_idx(store)), store)


def _write_layout(store: DiskStore, paths: list) -> None:
    layout = [
        {
            "path": jax.tree_util.keystr(p),
            "shape": list(s.shape),
            "dtype": np.dtype(s.dtype).name,
            "file": os.path.basename(store.path(m)) if store.owner[m] >= 0 else None,
        }
        for m, (p, s) in enumerate(zip(paths, store.specs))
    ]
    with open(os.path.join(store.directory, LAYOUT_FILE), "w") as f:
        json.dump({"leaves": layout, "bytes": store.nbytes}, f, indent=1)


# ------------------------------------------------------------------------- the update


def _read(store: DiskStore, m: int) -> jax.Array:
    spec = store.specs[m]
    return jax.experimental.io_callback(
        lambda: store.read(m), jax.ShapeDtypeStruct(spec.shape, spec.dtype), ordered=True
    )


def _write(store: DiskStore, m: int, x: jax.Array) -> None:
    jax.experimental.io_callback(lambda v: store.write(m, v), None, x, ordered=True)


def _begin(store: DiskStore) -> None:
    jax.experimental.io_callback(lambda: store.mark(False), None, ordered=True)


def _commit(store: DiskStore) -> None:
    def commit():
        store.updates += 1
        store.mark(True)

    jax.experimental.io_callback(commit, None, ordered=True)


def _trace_state(store: DiskStore, shared: tuple) -> Any:
    """The wrapped state for tracing: shared leaves as given, per-parameter leaves as
    zero-stride NumPy views (shape and dtype only; no memory)."""
    it = iter(shared)
    arrays = [
        next(it) if k < 0 else np.broadcast_to(np.zeros((), s.dtype), s.shape)
        for s, k in zip(store.specs, store.owner)
    ]
    return _leaves(store, arrays)


def update(inner, cache: dict, updates, state: DiskState, params, skip, extra_args):
    """``inner.update`` streaming the state from disk, one parameter leaf at a time.

    Each parameter leaf's state is read (ordered ``io_callback``), updated on the device
    by leaf-by-leaf mode's program and written back before the next leaf is read. The
    gradients and params are on the device already, so work that depends only on them
    (``optax.clip_by_global_norm``'s norm) runs first, as shared work.

    Returns:
      ``(updates, DiskState)``; the files hold the new state once the step has run.

    Raises:
      ValueError: as leaf-by-leaf mode (an optimizer whose state update mixes leaves).
    """
    if not isinstance(state, DiskState):
        raise TypeError(
            f"offload to disk: the state must be a DiskState (from init), got "
            f"{type(state).__name__}."
        )
    store = state.store
    u_leaves, u_def = jax.tree.flatten(updates)
    p_leaves = None if params is None else jax.tree.leaves(params)
    prog = _lbl._program_for(
        inner,
        cache,
        u_def,
        u_leaves,
        p_leaves,
        _trace_state(store, state.shared),
        extra_args,
        resident_inputs=True,
    )
    new_u, new_shared = _run(prog, store, u_leaves, p_leaves, state.shared, extra_args, skip)
    return u_def.unflatten(new_u), DiskState(tuple(new_shared), store)


def _run(prog, store: DiskStore, u_leaves, p_leaves, shared, extra_args, skip):
    """Evaluates ``prog``: shared work, then per leaf read -> update -> write."""
    n, n_state = len(u_leaves), len(store.specs)
    env = dict(prog.consts)
    for k, x in enumerate(list(u_leaves) + list(p_leaves or [])):
        env[("in", k)] = x
    for k, x in enumerate(x for x in jax.tree.leaves(extra_args) if is_array(x)):
        env[("in", prog.state_base + n_state + k)] = x
    shared_idx = _shared_idx(store)
    for m, x in zip(shared_idx, shared):
        env[("in", prog.state_base + m)] = x
    _lbl._evaluate(env, prog.shared)
    _begin(store)
    new_u: list[Any] = [None] * n
    for i in range(n):
        mine = [m for m in store.owned if prog.owner[m] == i]
        for m in mine:
            env[("in", prog.state_base + m)] = _read(store, m)
        _lbl._evaluate(env, prog.groups[i])
        u = jnp.asarray(_lbl._read(env, prog.out_refs[i]))
        new_u[i] = u if skip is None else jax.lax.select(skip, jnp.zeros_like(u), u)
        for m in mine:
            _write(store, m, _selected(env, prog, n, m, skip))
    _commit(store)
    return new_u, [_selected(env, prog, n, m, skip) for m in shared_idx]


def _selected(env, prog, n: int, m: int, skip) -> jax.Array:
    x = jnp.asarray(_lbl._read(env, prog.out_refs[n + m]))
    return x if skip is None else jax.lax.select(skip, env[("in", prog.state_base + m)], x)
