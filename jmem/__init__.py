"""jmem: fit LLM training in less accelerator memory, in pure JAX.

Training memory is five ledgers: parameters, gradients, optimizer state, fp32 master
weights and activations. Each jmem transform shrinks one of them and composes with any
JAX train step; ``jmem.train_step`` stacks them into one jitted, donating step.
"""
from jmem import fp8, implicit, lora, nf4, qlora, sharding
from jmem.accumulation import accumulate_gradients
from jmem.checkpoint import Checkpointer
from jmem.lora import LoraWeight
from jmem.loss_scale import (DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale,
                             all_finite, loss_scale_from_name, select_tree)
from jmem.master_weights import MixedPrecisionState, mixed_precision, params_from_masters
from jmem.measure import MemoryReport, format_bytes, measure
from jmem.offload import abstract_like, memory_kinds, offload, to_device, to_host
from jmem.nf4 import NF4Array
from jmem.optimizers import (adam_4bit, adam_8bit, adamw_4bit, adamw_8bit,
                             scale_by_quantized_adam, state_bytes, state_bytes_per_param)
from jmem.planner import (Advice, Ledger, activation_bytes, advise, estimate, largest_batch,
                          largest_model, largest_seq_len, parse_memory)
from jmem.precision import Policy, cast_floating, get_policy
from jmem.quantization import (QuantizedArray, dequantize_blockwise, dynamic_map, linear_map,
                               quantize_blockwise)
from jmem.remat import REMAT_POLICIES, remat, resolve_policy
from jmem.train_step import TrainState, TrainStep, train_step

__version__ = "0.1.0"
