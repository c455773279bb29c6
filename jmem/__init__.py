"""jmem: fit LLM training in less accelerator memory, in pure JAX.

Top level: ``remat``, ``measure``, precision policies and master weights, loss scales, 8-/4-bit
Adam and its weight-decay mask (``decay_mask``), block-wise quantization, ``offload``, and
``train_step`` which composes them; ``host_huge_pages`` and ``retain_host_allocations``
for CPU steps without per-step page faults.
Namespaces: ``jmem.lora``, ``jmem.qlora``, ``jmem.nf4``, ``jmem.fp8``, ``jmem.sharding``,
``jmem.planner``, ``jmem.targets``, ``jmem.tree``, ``jmem.data``; the reference model in ``jmem.models``.
"""

from jmem import data as data
from jmem import fp8 as fp8
from jmem import lora as lora
from jmem import nf4 as nf4
from jmem import ops as ops
from jmem import planner as planner
from jmem import qlora as qlora
from jmem import sharding as sharding
from jmem import targets as targets
from jmem import tree as tree
from jmem._src.checkpointing import Checkpointer
from jmem._src.decay_mask import decay_mask
from jmem._src.host_allocator import host_huge_pages
from jmem._src.host_allocator import retain_host_allocations
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
    "Checkpointer",
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
    "host_huge_pages",
    "linear_map",
    "lora",
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
    "retain_host_allocations",
    "scale_by_quantized_adam",
    "sharding",
    "targets",
    "to_device",
    "to_host",
    "train_step",
    "tree",
)
