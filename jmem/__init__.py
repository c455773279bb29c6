"""jmem: fit LLM training in less accelerator memory, in pure JAX."""

from jmem import data as data
from jmem import fp8 as fp8
from jmem import lora as lora
from jmem import nf4 as nf4
from jmem import planner as planner
from jmem import qlora as qlora
from jmem import sharding as sharding
from jmem import tree as tree
from jmem._src.checkpointing import Checkpointer
from jmem._src.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
)
from jmem._src.master_weights import MixedPrecisionState, mixed_precision, params_from_masters
from jmem._src.measure import MemoryReport, measure
from jmem._src.offload.transform import offload, to_device, to_host
from jmem._src.optim.quantized_adam import (
    ScaleByQuantizedAdamState,
    adam_4bit,
    adam_8bit,
    adamw_4bit,
    adamw_8bit,
    scale_by_quantized_adam,
)
from jmem._src.precision import Policy, cast_floating, get_policy
from jmem._src.quantization import (
    QuantizedArray,
    dequantize_blockwise,
    dynamic_map,
    linear_map,
    quantize_blockwise,
)
from jmem._src.remat import REMAT_POLICIES, remat
from jmem._src.train.accumulation import accumulate_gradients
from jmem._src.train.builder import TrainState, TrainStep, train_step

__version__ = "0.1.0"

__all__ = (
    "REMAT_POLICIES",
    "Checkpointer",
    "DynamicLossScale",
    "LossScale",
    "MemoryReport",
    "MixedPrecisionState",
    "NoOpLossScale",
    "Policy",
    "QuantizedArray",
    "ScaleByQuantizedAdamState",
    "StaticLossScale",
    "TrainState",
    "TrainStep",
    "accumulate_gradients",
    "adam_4bit",
    "adam_8bit",
    "adamw_4bit",
    "adamw_8bit",
    "all_finite",
    "cast_floating",
    "data",
    "dequantize_blockwise",
    "dynamic_map",
    "fp8",
    "get_policy",
    "linear_map",
    "lora",
    "measure",
    "mixed_precision",
    "nf4",
    "offload",
    "params_from_masters",
    "planner",
    "qlora",
    "quantize_blockwise",
    "remat",
    "scale_by_quantized_adam",
    "sharding",
    "to_device",
    "to_host",
    "train_step",
    "tree",
)
