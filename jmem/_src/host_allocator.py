"""Host (CPU) memory for XLA:CPU's per-step temporaries: huge pages, or glibc keeping them.

XLA:CPU allocates a step's temporaries (``compiled.memory_analysis().temp_size_in_bytes``)
as one buffer per execution with ``posix_memalign`` and frees it when the step ends. glibc
serves an allocation that large with a fresh ``mmap`` (always, from a worker thread's
arena) and returns it with ``munmap``, so every step page-faults its whole temp buffer in
again in 4 KiB pages: measured on a 2-core AMD EPYC VM, about 0.5 ms per MiB (2 us per
page), or 59 ms of a 360 ms QLoRA step at 116 MiB of temporaries and 184 ms of it at 360
MiB (``remat="none"``, which saves more and so faulted more than it saved). PyTorch's CPU
tensors go through the same ``malloc``.

Two remedies, both glibc's own settings:

* **Huge pages** (``restart_with_huge_pages``; the ``jmem finetune`` command line's default
  on CPU): glibc's
  ``glibc.malloc.hugetlb=1`` tunable makes ``malloc`` ``madvise(MADV_HUGEPAGE)`` each
  large block, so the kernel backs it with 2 MiB transparent huge pages: a step faults
  its temporaries in with far fewer faults (measured 70,527 -> 516 per step without
  remat), and the step's own loads and stores miss the TLB less. Measured on the job's
  float32 step: 228 -> 178 ms with ``remat="full"`` and 214 -> 148 ms without remat.
  Needs glibc >= 2.35 and transparent huge pages in ``madvise`` mode
  (``/sys/kernel/mm/transparent_hugepage/enabled``; in ``always`` mode the kernel does it
  without the tunable, in ``never`` not at all); a tunable is read when the
  process starts, so it takes a launcher: ``GLIBC_TUNABLES`` set before Python starts, or
  ``restart_with_huge_pages``, which restarts the Python process once (``os.execve`` with
  the same command line). The library itself never restarts its caller's process.
* **Retaining freed memory** (``retain_host_allocations``): one arena (so XLA's worker
  threads allocate from the main heap), no ``mmap`` for large blocks, and no trimming of
  the heap's top, applied in-process by ``mallopt`` when called. Faults fall to about 0, but the
  threads then share one arena's lock: the same steps took 196 / 176 ms, and the job ran
  3-7% slower than glibc's defaults with remat on two cores, a multi-threaded PyTorch
  step in the same process much slower (docs/performance.md). Opt-in: measure.

Either keeps memory the process freed: huge pages round large blocks up to 2 MiB extents;
retaining keeps the resident size at its peak.

Source: glibc's manual, "Memory Allocation Tunables" (``glibc.malloc.hugetlb``) and
``mallopt(3)`` (``M_ARENA_MAX``, ``M_MMAP_MAX``, ``M_TRIM_THRESHOLD``); the kernel's
``Documentation/admin-guide/mm/transhuge.rst``; the same kind of settings CPU launchers for
PyTorch (``torch.backends.xeon.run_cpu``) apply before a process starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import sys
import warnings

__all__ = [
    "ENV_VALUES",
    "ENV_VAR",
    "HUGE_PAGES_TUNABLE",
    "HostAllocatorStatus",
    "env_opts_out",
    "huge_pages_active",
    "huge_pages_environ",
    "huge_pages_unavailable",
    "restart_with_huge_pages",
    "restarted",
    "retain_host_allocations",
    "retained",
]

#: ``JMEM_HOST_ALLOCATOR=system`` keeps the C library's defaults where jmem would change
#: them when asked (``restart_with_huge_pages``, ``retain_host_allocations``, the
#: ``jmem finetune`` command line's ``--host-allocator auto``).
ENV_VAR = "JMEM_HOST_ALLOCATOR"
#: The values ``JMEM_HOST_ALLOCATOR`` may take (any case; unset or empty is ``auto``).
ENV_VALUES = ("auto", "system")

#: The glibc tunable that makes ``malloc`` advise huge pages for its large blocks.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_ENVIRON = "/proc/self/environ"  # the environment block the process started with

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_NEVER = 2**31 - 1  # the largest int mallopt takes: freed heap tops stay mapped
_applied = False  # set once the settings took effect in this process


@dataclasses.dataclass(frozen=True)
class HostAllocatorStatus:
    """What ``restart_with_huge_pages`` or ``retain_host_allocations`` did: ``applied`` and, when
    not, ``reason``."""

    applied: bool
    reason: str = ""


def env_opts_out() -> bool:
    """Whether ``JMEM_HOST_ALLOCATOR`` is ``system`` (keep glibc's defaults).

    Raises:
      ValueError: for a value other than ``ENV_VALUES`` (any case) or empty, naming them.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value not in ("", *ENV_VALUES):
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of {', '.join(ENV_VALUES)}: "
            "set system to keep glibc's defaults, or unset it"
        )
    return value == "system"


def retained() -> bool:
    """Whether ``retain_host_allocations`` has applied its settings in this process."""
    return _applied


def _backends_initialized() -> bool:
    """Whether JAX already created its backends (and so XLA:CPU its worker threads)."""
    if "jax" not in sys.modules:
        return False
    from jmem._src import jax_compat  # noqa: PLC0415 - only when JAX is already imported

    return jax_compat.backends_initialized()


def retain_host_allocations(*, respect_env: bool = True) -> HostAllocatorStatus:
    """Makes glibc keep freed host memory mapped, so steps stop page-faulting it in.

    Call it before the first JAX computation of the process (before JAX creates its CPU
    worker threads, which otherwise keep arenas of their own that ``mmap`` every large
    buffer). Process-wide and not undoable; PyTorch in the same process is affected alike.

    Args:
      respect_env: when True, ``JMEM_HOST_ALLOCATOR=system`` in the environment makes this
        a no-op (``applied=False``, the reason says so).

    Returns:
      A ``HostAllocatorStatus``; ``applied=False`` with the reason on a C library other
      than glibc (macOS, musl, Windows: nothing to do there), with the opt-out set, or
      when ``mallopt`` refused a setting.

    Raises:
      ValueError: ``respect_env`` and ``JMEM_HOST_ALLOCATOR`` holds none of ``ENV_VALUES``.

    Warns:
      RuntimeWarning: when JAX's backends already exist (the settings are applied, but
      XLA's existing worker threads keep their own arenas: call it earlier).

    Source: see the module docstring (glibc ``mallopt(3)``).
    """
    global _applied
    if _applied:
        return HostAllocatorStatus(True)
    if respect_env and env_opts_out():
        return HostAllocatorStatus(False, f"{ENV_VAR}=system")
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return HostAllocatorStatus(False, "not glibc (nothing to change)")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:
        return HostAllocatorStatus(False, f"mallopt unavailable: {e}")
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_NEVER))
    refused = [param for param, value in settings if mallopt(param, value) != 1]
    if refused:
        return HostAllocatorStatus(False, f"mallopt refused parameters {refused}")
    _applied = True
    if _backends_initialized():
        warnings.warn(
            "retain_host_allocations() was called after JAX created its backends: XLA's "
            "CPU worker threads keep their own malloc arenas and still map and unmap large "
            "buffers each step. Call it before the first JAX computation (e.g. right after "
            "the imports).",
            RuntimeWarning,
            stacklevel=2,
        )
    return HostAllocatorStatus(True)


def _glibc_version() -> tuple[int, int] | None:
    """The running C library's glibc version (``confstr``, not the executable's symbols)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, TypeError, ValueError):  # not Linux, or not glibc
        return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or None
    when it has none."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_unavailable() -> str | None:
    """Why large host allocations cannot come in transparent huge pages here (not glibc,
    glibc < 2.35, transparent huge pages ``never`` or absent), or None when they can."""
    version = _glibc_version()
    if version is None:
        return "not glibc (nothing to change)"
    if version < (2, 35):
        return f"glibc {version[0]}.{version[1]} has no glibc.malloc.hugetlb tunable (2.35+)"
    mode = _thp_mode()
    if mode is None:
        return f"this kernel has no transparent huge pages ({_THP_ENABLED})"
    if mode == "never":
        return f"transparent huge pages are off ([never] in {_THP_ENABLED}; madvise enables them)"
    return None


def _environ_tunables(raw: bytes) -> str:
    """The ``GLIBC_TUNABLES`` of a ``/proc/<pid>/environ`` blob, as glibc applied them.

    glibc (2.36 measured) writes a NUL over the ``:`` after each tunable it recognised, in
    the environment block itself, so ``GLIBC_TUNABLES=a=1:glibc.malloc.hugetlb=1`` reads
    back as two entries; entries named ``glibc.*`` after it are its tunables again. Every
    ``GLIBC_TUNABLES`` entry is applied in turn, so they are joined in order (the last
    value of a tunable wins)."""
    found: list[str] = []
    inside = False
    for item in raw.split(b"\0"):
        text = item.decode(errors="replace")
        key, sep, value = text.partition("=")
        if key == "GLIBC_TUNABLES" and sep:
            found.append(value)
            inside = True
        elif inside and sep and key.startswith("glibc."):
            found.append(text)
        else:
            inside = False
    return ":".join(t for t in found if t)


def _start_tunables() -> str:
    """The ``GLIBC_TUNABLES`` this process started with (the ones glibc read)."""
    try:
        with open(_ENVIRON, "rb") as f:
            return _environ_tunables(f.read())
    except OSError:
        return os.environ.get("GLIBC_TUNABLES", "")


def _hugetlb_value(tunables: str) -> str | None:
    """The ``glibc.malloc.hugetlb`` value a ``GLIBC_TUNABLES`` string sets (glibc applies
    them in order, so the last one), or None when it does not set it."""
    value = None
    for item in tunables.split(":"):
        key, sep, v = item.partition("=")
        value = v.strip() if sep and key.strip() == "glibc.malloc.hugetlb" else value
    return value


def huge_pages_active() -> bool:
    """Whether large host allocations of this process come in transparent huge pages: the
    kernel's mode is ``always`` (no tunable needed: glibc's is a no-op then), or it is
    ``madvise`` and ``glibc.malloc.hugetlb=1`` was in ``GLIBC_TUNABLES`` when the process
    started."""
    if huge_pages_unavailable() is not None:
        return False
    return _thp_mode() == "always" or _hugetlb_value(_start_tunables()) == "1"


def huge_pages_environ(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) whose ``GLIBC_TUNABLES`` also holds
    ``HUGE_PAGES_TUNABLE``: the environment to start a process with huge pages in. A
    ``glibc.malloc.hugetlb`` value the environment already sets is kept as it is."""
    env = dict(os.environ if environ is None else environ)
    current = env.get("GLIBC_TUNABLES", "")
    if _hugetlb_value(current) is None:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (current, HUGE_PAGES_TUNABLE) if t)
    return env


_RESTARTED = "JMEM_HUGE_PAGES_RESTARTED"  # the restarted process's id: restart only once


def restarted() -> bool:
    """Whether ``restart_with_huge_pages`` restarted this process (to set the tunable)."""
    return os.environ.get(_RESTARTED) == str(os.getpid())


def _restart_hazard() -> str | None:
    """What in this process a restart would break (None when nothing known would): a test
    runner, a ``multiprocessing`` child (its pipe was read), other threads (killed by
    ``execve``), a ``jax.distributed`` client (its peers would lose it)."""
    if "_pytest" in sys.modules:  # pytest-xdist's workers too (their code comes over stdin)
        return "pytest is running this process"
    import multiprocessing  # noqa: PLC0415
    import threading  # noqa: PLC0415

    if multiprocessing.parent_process() is not None:
        return "this is a multiprocessing child"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} other threads are running"
    jax_module = sys.modules.get("jax")
    distributed = getattr(jax_module, "distributed", None)
    if distributed is not None and getattr(distributed, "is_initialized", lambda: False)():
        return "jax.distributed is initialized (its other processes would lose this one)"
    return None


def _cannot_restart() -> str | None:
    """Why this process cannot restart itself with ``os.execve`` (None when it can)."""
    fix = f"set GLIBC_TUNABLES={HUGE_PAGES_TUNABLE} in the environment before starting Python"
    if restarted():
        return f"the tunable had no effect after a restart; {fix}"
    if hasattr(sys, "ps1") or "ipykernel" in sys.modules or sys.argv[:1] == [""]:
        return f"an interactive session cannot restart itself; {fix}"
    if sys.argv[:1] == ["-"]:
        return f"a script read from standard input cannot be run again; {fix}"
    if not getattr(sys, "orig_argv", None) or not sys.executable:
        return f"the command line is unknown; {fix}"
    if _backends_initialized():
        return f"JAX already started in this process (a restart would lose its state); {fix}"
    hazard = _restart_hazard()
    return f"a restart is unsafe here ({hazard}); {fix}" if hazard else None


def _refusal(restart: bool, respect_env: bool) -> tuple[str | None, bool]:
    """Why ``restart_with_huge_pages`` leaves this process as it is (None: it restarts it), and
    whether the reason is this process's state (which the caller can change) rather than
    the machine's or the user's settings."""
    if respect_env and env_opts_out():
        return f"{ENV_VAR}=system", False
    unavailable = huge_pages_unavailable()
    if unavailable:
        return unavailable, False
    value = _hugetlb_value(_start_tunables())
    if value is not None:
        return f"GLIBC_TUNABLES sets glibc.malloc.hugetlb={value}: left as set", False
    cannot = _cannot_restart()
    if restart or cannot:
        return cannot, True
    return (
        f"GLIBC_TUNABLES={HUGE_PAGES_TUNABLE} was not set when Python started: set it, or "
        "call jmem.host.restart_with_huge_pages() first in the script",
        True,
    )


def restart_with_huge_pages(
    *, restart: bool = True, respect_env: bool = True, announce: bool = True
) -> HostAllocatorStatus:
    """Restarts the Python process (``os.execve``) so that glibc backs its large host
    allocations with 2 MiB transparent huge pages.

    XLA:CPU's per-step temporaries are then faulted in with far fewer page faults (a 2
    MiB page each, not 4 KiB) and read through fewer TLB misses (measured: the
    fine-tuning job's float32 QLoRA step 1.28x faster with full remat and 1.45x without,
    on a 2-core AMD EPYC). Where the kernel's
    transparent huge pages are in ``madvise`` mode, glibc's ``glibc.malloc.hugetlb=1``
    tunable asks for them, and glibc reads it only when a process starts: unless
    ``GLIBC_TUNABLES`` held it then, this restarts the Python process once
    (``os.execve(sys.executable, sys.orig_argv)``: same command line and process id, the
    tunable added to the environment, which child processes inherit). Call it first thing
    in a script: whatever ran before the call runs again. In ``always`` mode the kernel
    needs no tunable and nothing is done.

    Args:
      restart: when False, only report (``applied=False`` with the reason) instead of
        restarting the process.
      respect_env: when True, ``JMEM_HOST_ALLOCATOR=system`` makes this a no-op.
      announce: print one line to stderr before restarting, and warn when this process's
        state prevents the restart (``restarted()`` tells the restarted process that it was
        restarted, for a caller that reports it itself).

    Warns:
      RuntimeWarning: when ``restart`` and ``announce`` and this process cannot restart
        (interactive, a script from standard input, JAX started, pytest, other threads).

    Returns:
      ``HostAllocatorStatus(True)`` when huge pages are in effect; ``applied=False`` with
      the reason when they are not and this does not restart: not glibc, glibc < 2.35,
      transparent huge pages ``never``, ``glibc.malloc.hugetlb`` already set otherwise in
      ``GLIBC_TUNABLES``, the opt-out set, or a process a restart would harm (interactive,
      JAX started, pytest, a ``multiprocessing`` child, other threads running,
      ``jax.distributed`` initialized), or a failed ``execve``. When it restarts the
      process, it does not return.

    Raises:
      ValueError: ``respect_env`` and ``JMEM_HOST_ALLOCATOR`` holds none of ``ENV_VALUES``.

    Source: see the module docstring (glibc's ``glibc.malloc.hugetlb`` tunable).
    """
    if respect_env:
        env_opts_out()  # a value other than auto/system is refused, huge pages on or not
    if huge_pages_active():
        return HostAllocatorStatus(True)
    reason, process_state = _refusal(restart, respect_env)
    if reason and announce and restart and process_state:
        warnings.warn(f"restart_with_huge_pages() changed nothing: {reason}", RuntimeWarning, 2)
    if reason:
        return HostAllocatorStatus(False, reason)
    if announce:
        print(
            f"jmem: restarting the process with GLIBC_TUNABLES={HUGE_PAGES_TUNABLE} (huge "
            f"pages for host allocations; {ENV_VAR}=system keeps glibc's defaults)",
            file=sys.stderr,
        )
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    env = huge_pages_environ() | {_RESTARTED: str(os.getpid())}
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:
        return HostAllocatorStatus(False, f"the restart failed: {e}")
    return HostAllocatorStatus(False, "os.execve returned")  # pragma: no cover - it does not
