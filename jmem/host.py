"""The host (CPU) memory allocator for XLA:CPU steps: 2 MiB huge pages, or glibc keeping
freed memory. Each function that changes the process says so by its name
(``restart_with_huge_pages``: ``os.execve``; ``retain_host_allocations``: ``mallopt``);
nothing else in jmem changes them. See docs/performance.md."""

import warnings as _warnings

from jmem._src import host_allocator as _host_allocator
from jmem._src.host_allocator import ENV_VAR
from jmem._src.host_allocator import HostAllocatorStatus
from jmem._src.host_allocator import env_opts_out
from jmem._src.host_allocator import huge_pages_active
from jmem._src.host_allocator import huge_pages_environ
from jmem._src.host_allocator import huge_pages_unavailable
from jmem._src.host_allocator import restart_with_huge_pages
from jmem._src.host_allocator import retain_host_allocations

__all__ = (
    "ENV_VAR",
    "HostAllocatorStatus",
    "env_opts_out",
    "huge_pages_active",
    "huge_pages_environ",
    "huge_pages_unavailable",
    "restart_with_huge_pages",
    "retain_host_allocations",
)

#: Internal names that were exported here (deprecated; jmem.host's functions cover them).
_DEPRECATED = ("ENV_VALUES", "HUGE_PAGES_TUNABLE", "restarted", "retained")


def __getattr__(name: str):
    if name not in _DEPRECATED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(
        f"jmem.host.{name} is internal and deprecated here; huge_pages_active(), "
        "huge_pages_environ() and the HostAllocatorStatus of restart_with_huge_pages() / "
        "retain_host_allocations() say what is in effect",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_host_allocator, name)
