"""LoRA adapters as a separate pytree (Hu et al. 2021, arXiv:2106.09685)."""

from jmem._src.implicit.weight import ImplicitWeightError
from jmem._src.lora import DEFAULT_TARGETS
from jmem._src.lora import LoraWeight
from jmem._src.lora import apply
from jmem._src.lora import init
from jmem._src.lora import merge
from jmem._src.lora import num_trainable

__all__ = (
    "DEFAULT_TARGETS",
    "ImplicitWeightError",
    "LoraWeight",
    "apply",
    "init",
    "merge",
    "num_trainable",
)
