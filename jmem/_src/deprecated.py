"""Deprecated top-level names, kept for one release: each warns (``DeprecationWarning``,
naming its new place) and then does what it did."""

from __future__ import annotations

import warnings

from jmem._src import host_allocator

__all__ = ["host_huge_pages", "retain_host_allocations"]


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"jmem.{old} is deprecated and will be removed in the next release: use {new} "
        "(same arguments)",
        DeprecationWarning,
        stacklevel=3,
    )


def host_huge_pages(**kwargs) -> host_allocator.HostAllocatorStatus:
    """Deprecated: ``jmem.host.restart_with_huge_pages`` (same keywords), which may restart
    the Python process with ``os.execve``."""
    _warn("host_huge_pages()", "jmem.host.restart_with_huge_pages()")
    return host_allocator.restart_with_huge_pages(**kwargs)


def retain_host_allocations(**kwargs) -> host_allocator.HostAllocatorStatus:
    """Deprecated: ``jmem.host.retain_host_allocations`` (same keywords), which calls glibc's
    ``mallopt`` for the whole process."""
    _warn("retain_host_allocations()", "jmem.host.retain_host_allocations()")
    return host_allocator.retain_host_allocations(**kwargs)
