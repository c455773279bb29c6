"""The run directory's lock and write probes: process 0 holds ``fcntl.flock`` on
``--out/.lock`` for the whole run (a second run on the same ``--out`` is refused, naming the
holder's pid), and every directory the run will write (``--out``, ``--export-merged``) is
probed by creating and writing a file before training, so that a read-only, full or
impossible path is one line up front instead of a traceback after the training."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket

from jmem._src.cli import CliError
from jmem._src.cli import one_line

#: The lock file in ``--out``.
LOCK = ".lock"
#: Bytes a write probe writes (and syncs) before it is deleted.
PROBE_BYTES = 1 << 16


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder(text: str) -> tuple[int | None, str]:
    """``(pid, host)`` recorded in a lock file (``"pid host"``), or ``(None, "")``."""
    parts = text.split()
    if parts and parts[0].isdigit():
        return int(parts[0]), parts[1] if len(parts) > 1 else ""
    return None, ""


def _os_error(flag: str, path: str, e: OSError) -> CliError:
    why = os.strerror(e.errno) if e.errno else one_line(e)
    full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return CliError(f"{flag} {path}: cannot write there: {why}{full}; pass a writable directory")


class RunLock:
    """``fcntl.flock`` on ``<out>/.lock``, held from ``acquire`` to ``release`` (or the
    process's end: the kernel releases a dead process's lock). The file records the
    holder's pid and host, cleared on release; a pid left by a killed run is reported as
    taken over.

    Raises:
      CliError: from ``acquire``, naming ``--out`` and the holder's pid when another run
        holds the lock, or the reason when ``--out`` cannot be created or written.
    """

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK)
        self._fd: int | None = None
        self._created = False  # --out made by acquire: removed again if left empty

    def acquire(self) -> list[str]:
        """Takes the lock; returns notes (a stale lock taken over)."""
        try:
            self._created = not os.path.exists(self.out)
            os.makedirs(self.out, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _os_error("--out", self.out, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            text = os.pread(fd, 200, 0).decode(errors="replace")
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _os_error("--out", self.out, e) from None
            pid, host = _holder(text)
            who = f"pid {pid}" + (f" on {host}" if host else "") if pid else "another process"
            raise CliError(
                f"--out {self.out} is in use by another run ({who} holds {self.path}); "
                "wait for it to end, stop it, or pass another --out"
            ) from None
        notes = []
        pid, host = _holder(os.pread(fd, 200, 0).decode(errors="replace"))
        if pid is not None and pid != os.getpid():
            alive = host == socket.gethostname() and _pid_running(pid)
            state = "no longer holds it" if alive else "is no longer running"
            notes.append(
                f"note: --out {self.out}: took over the lock of pid {pid}, which {state} "
                "(a run that was killed)"
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise _os_error("--out", self.out, e) from None
        self._fd = fd
        return notes

    def release(self) -> None:
        """Clears the recorded pid and releases the lock (idempotent). An ``--out`` that
        ``acquire`` created and the run left empty (refused at start) is removed."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        with contextlib.suppress(OSError):
            if self._created and os.listdir(self.out) == [LOCK]:
                os.remove(self.path)
                os.rmdir(self.out)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def probe_writable(flag: str, directory: str) -> None:
    """Creates ``directory`` if missing (removed again if it was), writes ``PROBE_BYTES``
    to a file in it, syncs and deletes it.

    Raises:
      CliError: ``<flag> <directory>: cannot write there: <reason>`` (read-only, full,
        a path under a regular file, no permission).
    """
    made = []
    try:
        head = os.path.abspath(directory)
        while not os.path.exists(head):
            made.append(head)
            head = os.path.dirname(head)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f".write-probe-{os.getpid()}")
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                os.remove(path)
    except OSError as e:
        raise _os_error(flag, directory, e) from None
    finally:
        for d in made:  # leave nothing that was not there
            with contextlib.suppress(OSError):
                os.rmdir(d)
