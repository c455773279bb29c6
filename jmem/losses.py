"""Preference losses (DPO, IPO, ORPO, SimPO) over sequence log-probabilities, the reference
model as the adapter-free base, and a loss builder for ``jmem.train_step``."""

from jmem._src.preference import dpo
from jmem._src.preference import orpo
from jmem._src.preference import precompute_reference
from jmem._src.preference import preference_loss
from jmem._src.preference import reference_logprobs
from jmem._src.preference import simpo

__all__ = (
    "dpo",
    "orpo",
    "precompute_reference",
    "preference_loss",
    "reference_logprobs",
    "simpo",
)
