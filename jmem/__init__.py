"""jmem: fit LLM training in less accelerator memory, in pure JAX.

Top level: ``remat``, ``measure``, precision policies and master weights, loss scales, 8-/4-bit
Adam and its weight-decay mask (``decay_mask``), block-wise quantization, ``offload``, and
``train_step`` which composes them.
Namespaces: ``jmem.lora``, ``jmem.qlora``, ``jmem.nf4``, ``jmem.fp8``, ``jmem.sharding``,
``jmem.planner``, ``jmem.targets`` (compile targets), ``jmem.tree``, ``jmem.data``, ``jmem.losses`` (preference losses),
``jmem.rewards`` (GRPO reward functions), ``jmem.host`` (the host allocator of CPU steps); the
reference model in ``jmem.models``, the fine-tuning job in ``jmem.finetune`` (both load on
first use, as every name here).
"""

import typing

if typing.TYPE_CHECKING:  # imported on first use (``__getattr__``): ``jmem --help`` needs no JAX
    from jmem import data as data
    from jmem import finetune as finetune  # the job; not in __all__ (``import *`` skips it)
    from jmem import fp8 as fp8
    from jmem import host as host
    from jmem import lora as lora
    from jmem import losses as losses
    from jmem import models as models  # on top; not in __all__
    from jmem import nf4 as nf4
    from jmem import ops as ops
    from jmem import planner as planner
    from jmem import qlora as qlora
    from jmem import rewards as rewards  # not in __all__ (the top level's curated size)
    from jmem import sharding as sharding
    from jmem import targets as targets
    from jmem import tree as tree
    from jmem._src.checkpointing import CheckpointDamagedError
    from jmem._src.checkpointing import Checkpointer
    from jmem._src.decay_mask import decay_mask
    from jmem._src.deprecated import host_huge_pages as host_huge_pages  # -> jmem.host
    from jmem._src.deprecated import retain_host_allocations as retain_host_allocations
    from jmem._src.levers import Levers
    from jmem._src.levers import ResolvedLevers
    from jmem._src.levers import resolve as resolve_levers
    from jmem._src.loss_scale import DynamicLossScale
    from jmem._src.loss_scale import NoOpLossScale
    from jmem._src.loss_scale import StaticLossScale
    from jmem._src.loss_scale import all_finite
    from jmem._src.master_weights import MixedPrecisionState
    from jmem._src.master_weights import mixed_precision
    from jmem._src.master_weights import params_from_masters
    from jmem._src.measure import MemoryReport
    from jmem._src.measure import measure
    from jmem._src.offload.memory_kinds import abstract_like
    from jmem._src.offload.memory_kinds import memory_kinds
    from jmem._src.offload.memory_kinds import to_device
    from jmem._src.offload.memory_kinds import to_host
    from jmem._src.offload.transform import offload
    from jmem._src.optim.quantized_adam import ScaleByQuantizedAdamState
    from jmem._src.optim.quantized_adam import adam_4bit
    from jmem._src.optim.quantized_adam import adam_8bit
    from jmem._src.optim.quantized_adam import adamw_4bit
    from jmem._src.optim.quantized_adam import adamw_8bit
    from jmem._src.optim.quantized_adam import scale_by_quantized_adam
    from jmem._src.precision import Policy
    from jmem._src.precision import cast_floating
    from jmem._src.precision import get_policy
    from jmem._src.quantization import QuantizedArray
    from jmem._src.quantization import dequantize_blockwise
    from jmem._src.quantization import dynamic_map
    from jmem._src.quantization import linear_map
    from jmem._src.quantization import quantize_blockwise
    from jmem._src.remat import REMAT_POLICIES
    from jmem._src.remat import remat
    from jmem._src.train.accumulation import accumulate_gradients
    from jmem._src.train.builder import TrainState
    from jmem._src.train.builder import TrainStep
    from jmem._src.train.builder import train_step

__version__ = "0.1.0"

__all__ = (
    "REMAT_POLICIES",
    "Levers",
    "ResolvedLevers",
    "resolve_levers",
    "Checkpointer",
    "CheckpointDamagedError",
    "DynamicLossScale",
    "MemoryReport",
    "MixedPrecisionState",
    "NoOpLossScale",
    "Policy",
    "QuantizedArray",
    "ScaleByQuantizedAdamState",
    "StaticLossScale",
    "TrainState",
    "TrainStep",
    "abstract_like",
    "accumulate_gradients",
    "adam_4bit",
    "adam_8bit",
    "adamw_4bit",
    "adamw_8bit",
    "all_finite",
    "cast_floating",
    "data",
    "decay_mask",
    "dequantize_blockwise",
    "dynamic_map",
    "fp8",
    "get_policy",
    "host",
    "linear_map",
    "lora",
    "losses",
    "measure",
    "memory_kinds",
    "mixed_precision",
    "nf4",
    "offload",
    "ops",
    "params_from_masters",
    "planner",
    "qlora",
    "quantize_blockwise",
    "remat",
    "scale_by_quantized_adam",
    "sharding",
    "targets",
    "to_device",
    "to_host",
    "train_step",
    "tree",
)


def _lazy_table() -> dict[str, tuple[str, str | None]]:
    """Public name -> (module, attribute or None for a module), read from the imports under
    ``TYPE_CHECKING`` above (as ``lazy_loader.attach_stub`` reads a stub file)."""
    import ast  # noqa: PLC0415
    import pathlib  # noqa: PLC0415

    table = {}
    for node in ast.walk(ast.parse(pathlib.Path(__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jmem"):
            for a in node.names:
                sub = node.module == "jmem"
                table[a.asname or a.name] = (
                    (f"jmem.{a.name}", None) if sub else (node.module, a.name)
                )
    return table


_LAZY: dict[str, tuple[str, str | None]] = {}


def __getattr__(name: str):
    if not _LAZY:
        _LAZY.update(_lazy_table())
    if name not in _LAZY:  # __all__, and the deprecated aliases (``jmem._src.deprecated``)
        raise AttributeError(f"module 'jmem' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"finetune", "models"})
