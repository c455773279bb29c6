"""Preference losses (DPO, IPO, ORPO, SimPO) over sequence log-probabilities, the reference
model as the adapter-free base, a loss builder for ``jmem.train_step``, and the GRPO family
(GRPO, BNPO, Dr. GRPO, DAPO) over per-token log-probabilities with group advantages."""

from jmem._src.grpo import group_advantages
from jmem._src.grpo import grpo
from jmem._src.preference import dpo
from jmem._src.preference import orpo
from jmem._src.preference import precompute_reference
from jmem._src.preference import preference_loss
from jmem._src.preference import reference_logprobs
from jmem._src.preference import simpo

__all__ = (
    "dpo",
    "group_advantages",
    "grpo",
    "orpo",
    "precompute_reference",
    "preference_loss",
    "reference_logprobs",
    "simpo",
)
