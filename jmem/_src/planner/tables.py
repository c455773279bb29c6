"""The planner's table of optimizers: each one's per-parameter state layout. Sources: Kingma
& Ba 2015 (Adam), Dettmers et al. 2022 (8-bit states), Li et al. 2023 (4-bit states), Chen
et al. 2023 (Lion)."""

from __future__ import annotations

import dataclasses

from jmem._src.names import OPTIMIZER_NAMES

__all__ = ["MIN_QUANTIZED_SIZE", "OPTIMIZERS", "OptimizerLayout", "state_bytes_per_param"]


@dataclasses.dataclass(frozen=True)
class OptimizerLayout:
    """Per-parameter state layout of an optimizer."""

    states: int  # per-parameter state tensors (Adam: m and v)
    bits: float  # bits per state element
    block: int | None  # quantization block (one fp32 absmax per block) or None
    about: str  # what it is and where it comes from


#: Optimizer state layouts: name -> (states per parameter, bits each, quant block, note).
#: Only optimizers a user can build: optax's, and jmem's block-quantized Adam.
OPTIMIZERS: dict[str, OptimizerLayout] = {
    "adamw": OptimizerLayout(2, 32, None, "fp32 m and v (Kingma & Ba 2015; optax.adamw)"),
    "adam": OptimizerLayout(2, 32, None, "fp32 m and v (optax.adam)"),
    "adamw_8bit": OptimizerLayout(
        2, 8, 256, "block-wise 8-bit m and v (Dettmers et al. 2022; jmem.adamw_8bit)"
    ),
    "adam_8bit": OptimizerLayout(2, 8, 256, "block-wise 8-bit m and v (jmem.adam_8bit)"),
    "adamw_4bit": OptimizerLayout(
        2, 4, 128, "block-wise 4-bit m and v (Li et al. 2023; jmem.adamw_4bit)"
    ),
    "adam_4bit": OptimizerLayout(2, 4, 128, "block-wise 4-bit m and v (jmem.adam_4bit)"),
    "sgd": OptimizerLayout(0, 0, None, "no state (optax.sgd)"),
    "sgd_momentum": OptimizerLayout(1, 32, None, "fp32 momentum (optax.sgd(momentum=...))"),
    "lion": OptimizerLayout(1, 32, None, "fp32 momentum (Chen et al. 2023; optax.lion)"),
}


if not set(OPTIMIZER_NAMES) <= set(OPTIMIZERS):
    raise RuntimeError(f"the planner's OPTIMIZERS lack some of {OPTIMIZER_NAMES}.")

#: scale_by_quantized_adam(min_quantized_size=...): smaller leaves keep fp32 moments.
MIN_QUANTIZED_SIZE = 4096


def state_bytes_per_param(opt: OptimizerLayout, accounting: str, block: int | None) -> float:
    """Optimizer-state bytes per parameter (``stored`` adds one fp32 absmax per block)."""
    per = opt.bits / 8
    b = block or opt.block
    if accounting == "stored" and b:
        per += 4 / b
    return opt.states * per
