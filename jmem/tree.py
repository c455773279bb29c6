"""Tree helpers: byte and element counts, key paths, selection."""

from jmem._src.tree import bytes_per_param
from jmem._src.tree import nbytes
from jmem._src.tree import num_elements
from jmem._src.tree import path_str
from jmem._src.tree import select_tree

__all__ = (
    "bytes_per_param",
    "nbytes",
    "num_elements",
    "path_str",
    "select_tree",
)
