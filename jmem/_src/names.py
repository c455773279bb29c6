"""The one table of the names that flags, resolvers and the planner accept.

A leaf with no JAX import, so that ``jmem finetune --help`` and config-file parsing need no
JAX. Every module that implements one of these names (``remat.REMAT_POLICIES``,
``attention.attention``, the job's optimizers, ``jmem.targets``) is keyed by the tuple here
and checks at import that it implements exactly these names.
"""

from __future__ import annotations

from jmem._src.model_table import PRESETS

__all__ = [
    "ATTENTION_NAMES",
    "COMPILE_TARGET_NAMES",
    "CONTEXT_STRATEGY_NAMES",
    "MODEL_NAMES",
    "OPTIMIZER_NAMES",
    "REMAT_NAMES",
    "check_implements",
]

#: Remat policies (``jmem.REMAT_POLICIES``, ``Levers.remat``, ``--remat``), from most device
#: memory to least.
REMAT_NAMES = ("none", "dots", "selective", "full", "offload", "offload_inputs")

#: Attention implementations (``jmem.ops.attention``, ``Levers.attention``, ``--attention``).
ATTENTION_NAMES = ("auto", "dense", "blockwise", "cudnn")

#: How attention runs across the shards of a sequence split over a ``context`` mesh axis
#: (``Levers.context_strategy``, ``--context-strategy``; docs/sharding.md): gather K/V,
#: rotate K/V blocks in a ring, or all-to-all heads for sequence (Ulysses).
CONTEXT_STRATEGY_NAMES = ("all_gather", "ring", "ulysses")

#: The optimizers the fine-tuning job builds (``--optimizer``); the planner knows more.
OPTIMIZER_NAMES = ("adamw", "adamw_4bit", "adamw_8bit")

#: Compile targets (``jmem.targets``, ``--target``): XLA:GPU devices and the host CPU.
COMPILE_TARGET_NAMES = ("h100_sxm", "h200", "a100_sxm_80", "a100_sxm_40", "b200", "rtx4090", "cpu")

#: Model presets (``llama.get_config``, ``--config``), sorted.
MODEL_NAMES = tuple(sorted(PRESETS))


def check_implements(what: str, names: tuple[str, ...], implemented) -> None:
    """Raises ``RuntimeError`` at import when a table does not implement exactly ``names``.

    Args:
      what: the table's name, for the message.
      names: the tuple of this module.
      implemented: the implementing table's keys (any iterable of str).
    """
    got = tuple(implemented)
    if set(got) != set(names):
        raise RuntimeError(f"{what} implements {got}, but jmem._src.names lists {names}.")
