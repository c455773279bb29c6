"""Compile targets: measure and plan for a GPU on a machine without one (``jmem.measure(...,
target="h100_sxm")``; docs/targets.md)."""

from jmem._src.targets import NAMES
from jmem._src.targets import Target
from jmem._src.targets import compile_platform
from jmem._src.targets import concrete_mesh
from jmem._src.targets import current
from jmem._src.targets import devices
from jmem._src.targets import get
from jmem._src.targets import mesh
from jmem._src.targets import unavailable_reason

__all__ = (
    "NAMES",
    "Target",
    "compile_platform",
    "concrete_mesh",
    "current",
    "devices",
    "get",
    "mesh",
    "unavailable_reason",
)
