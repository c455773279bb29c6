"""Host (CPU) memory that stays mapped between steps: glibc ``malloc`` settings.

XLA:CPU allocates a step's temporaries (``compiled.memory_analysis().temp_size_in_bytes``)
as one buffer per execution with ``posix_memalign`` and frees it when the step ends. glibc
serves an allocation that large with a fresh ``mmap`` (always, from a worker thread's
arena) and returns it with ``munmap``, so every step page-faults its whole temp buffer in
again: measured on a 2-core AMD EPYC VM, about 0.5 ms per MiB (2 us per 4 KiB page), or 59
ms of a 360 ms QLoRA step at 116 MiB of temporaries and 184 ms of it at 360 MiB (``remat=
"none"``, which saves more and so faulted more than it saved). PyTorch's CPU tensors go
through the same ``malloc``. Keeping freed memory in the heap removes that cost: one
arena (so XLA's worker threads allocate from the main heap), no ``mmap`` for large
blocks, and no trimming of the heap's top. The cost: freed host memory is kept for reuse
rather than returned to the operating system (the process's resident size stays at its
peak), and threads share one arena's lock: measured, the fine-tuning job ran 9% faster on
one core but 3-7% slower on two, and a multi-threaded PyTorch step in the same process
much slower (docs/performance.md). The job applies it without remat (``--host-allocator
auto``), where the temporaries are largest; elsewhere it is opt-in: measure.

Source: glibc's ``mallopt(3)`` (``M_ARENA_MAX``, ``M_MMAP_MAX``, ``M_TRIM_THRESHOLD``); the
same remedy as the ``GLIBC_TUNABLES`` / ``LD_PRELOAD`` allocator settings that CPU
launchers for PyTorch (``torch.backends.xeon.run_cpu``) apply before a process starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import sys

__all__ = ["ENV_VAR", "HostAllocatorStatus", "retain_host_allocations", "retained"]

#: ``JMEM_HOST_ALLOCATOR=system`` keeps the C library's defaults where jmem would call
#: ``retain_host_allocations`` itself (the fine-tuning job, the benchmarks).
ENV_VAR = "JMEM_HOST_ALLOCATOR"

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_TRIM_NEVER = 2**31 - 1  # the largest int mallopt takes: freed heap tops stay mapped
_applied = False  # set once the settings took effect in this process


@dataclasses.dataclass(frozen=True)
class HostAllocatorStatus:
    """What ``retain_host_allocations`` did: ``applied`` and, when not, ``reason``."""

    applied: bool
    reason: str = ""


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

    Warns:
      RuntimeWarning: when JAX's backends already exist (the settings are applied, but
      XLA's existing worker threads keep their own arenas: call it earlier).

    Source: see the module docstring (glibc ``mallopt(3)``).
    """
    global _applied
    if _applied:
        return HostAllocatorStatus(True)
    if respect_env and os.environ.get(ENV_VAR, "").lower() == "system":
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
        import warnings  # noqa: PLC0415

        warnings.warn(
            "retain_host_allocations() was called after JAX created its backends: XLA's "
            "CPU worker threads keep their own malloc arenas and still map and unmap large "
            "buffers each step. Call it before the first JAX computation (e.g. right after "
            "the imports).",
            RuntimeWarning,
            stacklevel=2,
        )
    return HostAllocatorStatus(True)
