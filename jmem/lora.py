"""LoRA adapters as a separate pytree (Hu et al. 2021, arXiv:2106.09685)."""

from jmem._src.implicit.interpreter import ImplicitWeightError
from jmem._src.lora import DEFAULT_TARGETS, LoraWeight, apply, init, merge, num_trainable

__all__ = (
    "DEFAULT_TARGETS",
    "ImplicitWeightError",
    "LoraWeight",
    "apply",
    "init",
    "merge",
    "num_trainable",
)
