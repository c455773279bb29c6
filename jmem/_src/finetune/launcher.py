"""The host allocator of the fine-tuning job: what its command line sets up before JAX
starts, and the one note line each run prints about what is in effect.

``run()`` (the library) changes nothing in its caller's process: it only reports. The
command lines (``jmem finetune``, ``python -m jmem finetune``, ``examples/qlora_7b.py``)
call ``restart_with_huge_pages`` with the parsed config from their entry point
(``finetune.main(restart_with_huge_pages=True)``), which restarts the interpreter once
with glibc's ``glibc.malloc.hugetlb=1`` tunable (``jmem.host.restart_with_huge_pages``,
the one ``os.execve``), and the job's command line (``finetune.main``) applies
``--host-allocator retain`` (``jmem.host.retain_host_allocations``, the one ``mallopt``).
Launchers own the process, as levanter leaves ``XLA_FLAGS`` to its launcher and
``torch.backends.xeon.run_cpu`` sets allocator variables before starting Python.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import warnings
from typing import Sequence

from jmem._src import host_allocator
from jmem._src.cli import CliError
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config_file import parse_args

#: The start of the note ``auto`` leaves when a JAX accelerator plugin is installed.
PLUGIN_NOTE = "host allocator: unchanged ("
_HOW = (
    f"run the job from the command line (jmem finetune), or start Python with "
    f"GLIBC_TUNABLES={host_allocator.HUGE_PAGES_TUNABLE}"
)
_refused: str | None = None  # why restart_with_huge_pages did not restart this process


def accelerator_plugin() -> str | None:
    """The name of an installed JAX GPU/TPU plugin (or a ``JAX_PLATFORMS`` without cpu):
    host temporaries then do not hold the step's activations, so ``auto`` changes nothing."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return None if platforms.split(",")[0].strip() == "cpu" else platforms
    for dist in importlib.metadata.distributions():
        name = (dist.name or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "libtpu")):
            return name
    return None


def _opts_out() -> bool:
    """``JMEM_HOST_ALLOCATOR=system``, or a one-line ``CliError`` for a bad value."""
    try:
        return host_allocator.env_opts_out()
    except ValueError as e:
        raise CliError(str(e)) from None


def _no_restart(choice: str, dry_run: bool) -> str | None:
    """Why the job's command line keeps its process as it is (None: restart it)."""
    if dry_run:
        return "a dry run runs no step"
    if choice not in ("auto", "huge-pages"):
        return f"--host-allocator {choice}"
    if choice == "auto" and _opts_out():
        return f"{host_allocator.ENV_VAR}=system"
    if choice == "auto" and (plugin := accelerator_plugin()):
        return f"{plugin} is installed"
    return "in effect" if host_allocator.huge_pages_active() else None


def restart_with_huge_pages(config: FinetuneConfig) -> str | None:
    """Restarts this process once (``os.execve``, same command line) with
    ``glibc.malloc.hugetlb=1`` added to ``GLIBC_TUNABLES``, when the parsed job ``config``
    asks for huge pages (``--host-allocator auto`` without a GPU/TPU plugin, or
    ``huge-pages``; not ``--dry-run``) and they are not in effect yet. Only a program's
    entry point may call it (``jmem``, ``python -m jmem finetune``,
    ``examples/qlora_7b.py``, through ``finetune.main(restart_with_huge_pages=True)``),
    before JAX starts.

    Returns:
      Why it did not restart (or None when huge pages are in effect); when it restarts the
      process, it does not return. A refusal owed to this process's state (threads,
      a ``multiprocessing`` child, ...) goes into the run's note line; a bad
      ``JMEM_HOST_ALLOCATOR`` is left for the job to report.

    Source: glibc's ``glibc.malloc.hugetlb`` tunable (``jmem.host.restart_with_huge_pages``).
    """
    global _refused
    try:
        reason = _no_restart(config.run.host_allocator, config.run.dry_run)
    except CliError as e:
        return f"a bad input ({e})"
    if reason:
        return None if reason == "in effect" else reason
    status = host_allocator.restart_with_huge_pages(respect_env=False, announce=False)
    _refused = None if status.applied else status.reason
    return _refused


def relaunch_with_huge_pages(argv: Sequence[str], prog: str = "jmem finetune") -> str | None:
    """Deprecated: ``finetune.main(argv, restart_with_huge_pages=True)`` parses the flags
    once and restarts where they ask for huge pages (``restart_with_huge_pages``). This
    parses ``argv`` quietly (``--help`` and bad input are left to the job) and calls it."""
    warnings.warn(
        "relaunch_with_huge_pages is deprecated; call "
        "jmem.finetune.main(argv, restart_with_huge_pages=True)",
        DeprecationWarning,
        stacklevel=2,
    )
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            config = parse_args(list(argv), prog=prog)
    except SystemExit as e:
        return f"--help, or a bad input ({e})"
    return restart_with_huge_pages(config)


def _active_note(choice: str) -> str:
    """The note when large allocations come in huge pages (whatever ``choice``)."""
    if host_allocator._thp_mode() == "always":
        how = "the kernel's transparent huge pages are [always]"
    elif host_allocator.restarted():
        how = "set by restarting the process; --host-allocator system to skip"
    else:
        how = "GLIBC_TUNABLES set when Python started"
    if choice == "system" or (choice == "auto" and _opts_out()):
        return f"host allocator: huge pages all the same ({how})"
    also = ", freed memory retained too" if host_allocator.retained() else ""
    return f"host allocator: 2 MiB huge pages ({how}){also}"


def _no_huge_pages(remat: str) -> str:
    """The note when huge pages were asked for and are not in effect: why, and how."""
    unavailable = host_allocator.huge_pages_unavailable()
    value = host_allocator._hugetlb_value(host_allocator._start_tunables())
    if unavailable:
        return f"host allocator: no huge pages ({unavailable})"
    if value is not None:
        return f"host allocator: no huge pages (GLIBC_TUNABLES sets glibc.malloc.hugetlb={value})"
    why = _refused or f"not set when Python started: {_HOW}"
    gain = "; measured 1.45x faster steps without remat on CPU" if remat == "none" else ""
    return f"host allocator: no huge pages ({why}{gain})"


def allocator_note(choice: str, remat: str, dry_run: bool) -> str | None:
    """The job's note line on the host allocator in effect (None for a dry run, which runs
    no step); changes nothing. ``choice`` is ``--host-allocator``.

    Raises:
      CliError: ``JMEM_HOST_ALLOCATOR`` is neither auto nor system.
    """
    opted_out = _opts_out()
    if dry_run:
        return None
    if host_allocator.huge_pages_active():
        return _active_note(choice)
    if choice == "system" or (choice == "auto" and opted_out):
        why = "--host-allocator system" if choice == "system" else "JMEM_HOST_ALLOCATOR=system"
        return f"host allocator: glibc's defaults ({why})"
    if choice == "retain":
        if host_allocator.retained():
            return "host allocator: freed memory retained"
        return (
            "host allocator: glibc's defaults (finetune.run() leaves the process's malloc "
            "alone: --host-allocator retain on the command line, or call "
            "jmem.host.retain_host_allocations() first in the script)"
        )
    if choice == "auto" and (plugin := accelerator_plugin()):
        return f"{PLUGIN_NOTE}{plugin}: --host-allocator huge-pages to use huge pages anyway)"
    return _no_huge_pages(remat)


def apply_allocator(choice: str, remat: str, dry_run: bool) -> str | None:
    """The job's command line: ``--host-allocator retain`` applied before JAX starts
    (``jmem.host.retain_host_allocations``), then ``allocator_note``. Huge pages need the
    entry point's ``restart_with_huge_pages``: nothing to apply here."""
    if choice == "retain" and not dry_run and not host_allocator.retained():
        if host_allocator._backends_initialized():
            return (
                "host allocator: freed memory not retained (JAX already started in this "
                "process: call jmem.host.retain_host_allocations() first in the script)"
            )
        status = host_allocator.retain_host_allocations(respect_env=False)
        if not status.applied:
            return f"host allocator: unchanged ({status.reason})"
    return allocator_note(choice, remat, dry_run)
