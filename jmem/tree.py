"""Tree helpers: byte and element counts, key paths, selection."""

from jmem._src.tree import bytes_per_param, nbytes, num_elements, path_str, select_tree

__all__ = (
    "bytes_per_param",
    "nbytes",
    "num_elements",
    "path_str",
    "select_tree",
)
