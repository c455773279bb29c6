"""``TrainState``: everything a train step reads and writes, as one pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step reads and writes; a pytree that jits, donates and checkpoints.

    Attributes:
      step: int32 scalar, number of applied (finite) optimizer steps.
      params: trainable params (for LoRA/QLoRA: the adapters).
      opt_state: the optimizer's state (fp32 masters live here with ``master_weights``).
      loss_scale: a ``NoOpLossScale``/``StaticLossScale``/``DynamicLossScale``.
      frozen: params that are read but never trained (LoRA/QLoRA base, NF4 leaves), or None.
      fp8: FP8 delayed-scaling metadata (``jmem.fp8``), or None.
      dropout_key: uint32 key data (``jax.random.key_data``) from which the step derives
        each step's and microbatch's dropout key (``train_step``), or None.
    """

    step: Any
    params: Any
    opt_state: Any
    loss_scale: Any
    frozen: Any = None
    fp8: Any = None
    dropout_key: Any = None

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "loss_scale", "frozen", "fp8", "dropout_key"],
    meta_fields=[],
)
