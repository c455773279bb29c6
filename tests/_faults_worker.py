"""A ``jmem finetune`` process that SIGKILLs itself at a chosen phase, for tests/test_faults.py
(not a test module itself).

Usage: ``python tests/_faults_worker.py PHASE ARGS...`` with PHASE one of
``save:N`` (in the middle of saving checkpoint N: every file written, ``hashes.json`` too,
just before orbax's rename that commits it; the hook wraps orbax's own temporary-path class,
as tests/_ckpt_worker.py does), ``outputs`` (after the last checkpoint is committed, before
the adapters are written) or ``none``.
"""

import os
import signal
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

import orbax.checkpoint._src.path.atomicity as atomicity  # noqa: E402

import jmem._src.finetune.loop as loop  # noqa: E402
from jmem import finetune  # noqa: E402


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


if __name__ == "__main__":
    phase, argv = sys.argv[1], sys.argv[2:]
    if phase.startswith("save:"):
        _kill_before_commit(int(phase.split(":")[1]))
    elif phase == "outputs":
        loop.save_adapters = lambda *args, **kwargs: _kill()
    finetune.main(argv)
