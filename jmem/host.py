"""The host (CPU) memory allocator for XLA:CPU steps: 2 MiB huge pages, or glibc keeping
freed memory. Each function that changes the process says so by its name
(``restart_with_huge_pages``: ``os.execve``; ``retain_host_allocations``: ``mallopt``);
nothing else in jmem changes them. See docs/performance.md."""

from jmem._src.host_allocator import ENV_VALUES
from jmem._src.host_allocator import ENV_VAR
from jmem._src.host_allocator import HUGE_PAGES_TUNABLE
from jmem._src.host_allocator import HostAllocatorStatus
from jmem._src.host_allocator import env_opts_out
from jmem._src.host_allocator import huge_pages_active
from jmem._src.host_allocator import huge_pages_environ
from jmem._src.host_allocator import huge_pages_unavailable
from jmem._src.host_allocator import restart_with_huge_pages
from jmem._src.host_allocator import restarted
from jmem._src.host_allocator import retain_host_allocations
from jmem._src.host_allocator import retained

__all__ = (
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
)
