"""LoRA adapters as a separate pytree (Hu et al. 2021, arXiv:2106.09685)."""

import warnings

from jmem._src.implicit.weight import ImplicitWeightError
from jmem._src.lora import DEFAULT_MODULES
from jmem._src.lora import LoraWeight
from jmem._src.lora import apply
from jmem._src.lora import init
from jmem._src.lora import merge
from jmem._src.lora import num_trainable

__all__ = (
    "DEFAULT_MODULES",
    "ImplicitWeightError",
    "LoraWeight",
    "apply",
    "init",
    "merge",
    "num_trainable",
)

#: Deprecated names, kept for one release: old name -> new name.
_DEPRECATED = {"DEFAULT_TARGETS": "DEFAULT_MODULES"}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"jmem.lora.{name} is deprecated; use jmem.lora.{new}.", DeprecationWarning, 2
        )
        return globals()[new]
    raise AttributeError(f"module 'jmem.lora' has no attribute {name!r}")
