"""A ``jmem finetune`` process that SIGKILLs itself at a chosen phase, for tests/test_faults.py
(not a test module itself).

Usage: ``python tests/_faults_worker.py PHASE ARGS...`` with PHASE one of
``save:N`` (in the middle of saving checkpoint N: every file written, ``hashes.json`` too,
just before orbax's rename that commits it; the hook wraps orbax's own temporary-path class,
as tests/_ckpt_worker.py does), ``outputs`` (after the last checkpoint is committed, before
the adapters are written), ``disk:S:K`` (``--offload-dir``: in update S >= 2, just after its
K-th leaf file is written; the names of the files written are printed first),
``export:adapter`` (during the adapter export: its safetensors
file written, its config not), ``export:merged`` (during ``--export-merged``: its first shard
written, the rest not), ``pause:N`` (checkpoint N committed, the run prints ``paused`` and
waits until the file named by ``$FAULTS_GO`` exists, then trains on) or ``none``.
"""

import os
import signal
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import orbax.checkpoint._src.path.atomicity as atomicity  # noqa: E402

import jmem._src.finetune.loop as loop  # noqa: E402
from jmem import finetune  # noqa: E402
from jmem._src.offload import disk  # noqa: E402


def _kill():
    print("killed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_before_commit(step: int) -> None:
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        original = cls.finalize

        async def hooked(self, *args, _original=original, **kwargs):
            if self.get_final().name == str(step):
                _kill()
            return await _original(self, *args, **kwargs)

        cls.finalize = hooked


def _kill_in_disk_update(update: int, k: int) -> None:
    """Kills after the ``k``-th leaf write of update ``update`` (1-based; ``DiskStore.updates``
    counts the updates whose writes finished, so it is ``update - 1`` during that one's writes;
    init's writes happen at 0, hence ``update >= 2``)."""
    assert update >= 2 and k >= 1, (update, k)
    original, written = disk.DiskStore.write, []

    def write(self, m, x):
        original(self, m, x)
        if self.updates == update - 1:
            written.append(os.path.basename(self.path(m)))
            if len(written) == k:
                print("wrote " + " ".join(written), flush=True)
                _kill()

    disk.DiskStore.write = write


def _kill_after_writing(part: str) -> None:
    """SIGKILL once ``safetensors.numpy.save_file`` has written a file whose path holds
    ``part`` (the exporters import it at each call)."""
    import safetensors.numpy  # noqa: PLC0415

    original = safetensors.numpy.save_file

    def hooked(tensors, filename, *args, **kwargs):
        original(tensors, filename, *args, **kwargs)
        if part in str(filename):
            _kill()

    safetensors.numpy.save_file = hooked


def _pause_after(step: int) -> None:
    import jmem  # noqa: PLC0415

    original = jmem.Checkpointer.maybe_save

    def hooked(self, n, *args, **kwargs):
        saved = original(self, n, *args, **kwargs)
        if int(n) == step:
            self.wait()
            print("paused", flush=True)
            while not os.path.exists(os.environ["FAULTS_GO"]):
                time.sleep(0.05)
        return saved

    jmem.Checkpointer.maybe_save = hooked


if __name__ == "__main__":
    phase, argv = sys.argv[1], sys.argv[2:]
    if phase.startswith("save:"):
        _kill_before_commit(int(phase.split(":")[1]))
    elif phase.startswith("disk:"):
        _kill_in_disk_update(*map(int, phase.split(":")[1:]))
    elif phase == "outputs":
        loop.save_adapters = lambda *args, **kwargs: _kill()
    elif phase == "export:adapter":
        _kill_after_writing("adapter_model")
    elif phase == "export:merged":
        _kill_after_writing("model-00001-of")
    elif phase.startswith("pause:"):
        _pause_after(int(phase.split(":")[1]))
    finetune.main(argv)
