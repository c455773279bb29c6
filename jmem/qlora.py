"""QLoRA: NF4 frozen base weights plus LoRA adapters (Dettmers et al. 2023, arXiv:2305.14314)."""

import warnings

from jmem._src.implicit.weight import ImplicitWeightError
from jmem._src.qlora import EXCLUDE
from jmem._src.qlora import apply
from jmem._src.qlora import default_modules
from jmem._src.qlora import dequantize_params
from jmem._src.qlora import quantize_params

__all__ = (
    "EXCLUDE",
    "ImplicitWeightError",
    "apply",
    "default_modules",
    "dequantize_params",
    "quantize_params",
)

_RENAMED = {"quantize": "quantize_params", "dequantize": "dequantize_params"}
#: Deprecated names, kept for one release: old name -> new name.
_DEPRECATED = {"default_targets": "default_modules"}


def __getattr__(name: str):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"jmem.qlora.{name} is deprecated; use jmem.qlora.{new}.", DeprecationWarning, 2
        )
        return globals()[new]
    if name in _RENAMED:
        raise AttributeError(
            f"jmem.qlora.{name} was renamed to jmem.qlora.{_RENAMED[name]} (it works on a "
            f"params tree; jmem.nf4.{name} works on one array)."
        )
    raise AttributeError(f"module 'jmem.qlora' has no attribute {name!r}")
