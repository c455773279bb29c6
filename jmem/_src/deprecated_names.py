"""Deprecated names of a public namespace, kept for one release: the module ``__getattr__``
(PEP 562) that warns and resolves them. Standard library only."""

from __future__ import annotations

import importlib
import warnings
from typing import Callable

__all__ = ["module_getattr"]


def module_getattr(namespace: str, table: dict[str, tuple[str, str, str]]) -> Callable:
    """A ``__getattr__`` for ``namespace`` (e.g. ``"jmem.planner"``).

    Args:
      namespace: the public module's name, for the messages.
      table: deprecated name -> (the module that holds it, its name there, what to use
        instead, as the warning says it).

    Returns:
      ``__getattr__(name)``: warns ``DeprecationWarning`` and returns the object for a name
      of ``table``; raises ``AttributeError`` for any other name.
    """

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
        module, attr, instead = table[name]
        warnings.warn(
            f"{namespace}.{name} is deprecated and will be removed in the next release: "
            f"use {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), attr)

    return __getattr__
