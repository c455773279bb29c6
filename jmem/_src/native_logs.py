"""XLA's own log lines kept off the user's terminal: the C++ runtime's absl/glog lines
(``W1203 16:49:45.265767 25178 hlo_rematerialization.cc:3231] Can't reduce memory use
below ...``, ``I0000 ... cudart_stub.cc:31] Could not find cuda drivers ...``) that it
writes straight to file descriptor 2 while it starts a backend or compiles.

``TF_CPP_MIN_LOG_LEVEL`` cannot hide them: XLA logs before ``absl::InitializeLog`` runs.
So ``hidden()`` points descriptor 2 at a temporary file for the duration of a compile or a
backend start, then writes back every line that is not such a log line (Python's own
warnings and messages pass, in order, once the block ends). ``show(True)`` (the commands'
``--debug``) turns it off. jmem's own reports carry what these lines say (the compiled
peak against the card's memory, ``--dry-run``); docs/planner.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading

__all__ = ["hidden", "show", "is_native_log_line"]

#: A glog/absl line (``[IWEF]MMDD hh:mm:ss.micros thread file:line] message``) or absl's
#: one-time preamble about logging before ``InitializeLog``.
_LOG_LINE = re.compile(
    rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+\s+[^\s\]]+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called)"
)

_state = {"show": False, "depth": 0}
_lock = threading.Lock()


def show(on: bool = True) -> None:
    """Let XLA's log lines through (``on=True``: ``--debug``) or hide them (False, the
    default) in every later ``hidden()`` block of this process."""
    _state["show"] = bool(on)


def is_native_log_line(line: bytes | str) -> bool:
    """Whether ``line`` is one of the C++ runtime's log lines that ``hidden()`` drops."""
    raw = line.encode() if isinstance(line, str) else line
    return _LOG_LINE.match(raw) is not None


@contextlib.contextmanager
def hidden():
    """Within the block, file descriptor 2 goes to a temporary file; at its end every line
    but XLA's log lines (``is_native_log_line``) is written back to the real descriptor 2.
    Re-entrant (an inner block does nothing) and a no-op after ``show(True)`` or where
    descriptor 2 cannot be duplicated. Yields nothing; raises what the block raises (its
    stderr restored first)."""
    with _lock:
        outer = _state["depth"] == 0 and not _state["show"]
        _state["depth"] += 1
    try:
        if not outer:
            yield
            return
        with _captured_fd2():
            yield
    finally:
        with _lock:
            _state["depth"] -= 1


@contextlib.contextmanager
def _captured_fd2():
    """Descriptor 2 into a temporary file for the block; the kept lines written back."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        _flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            _flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(line for line in tmp if not is_native_log_line(line))
            while kept:
                kept = kept[os.write(2, kept) :]


def _flush() -> None:
    """Python's stderr flushed, so that its buffered text lands on the right side."""
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
