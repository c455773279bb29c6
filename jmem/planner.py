"""Memory planner: ledgers of a training configuration, verdicts and suggestions."""

from jmem._src.deprecated_names import module_getattr
from jmem._src.planner.activations import REMAT_MODES
from jmem._src.planner.activations import activation_bytes
from jmem._src.planner.advice import DEFAULT_RESERVE
from jmem._src.planner.advice import Advice
from jmem._src.planner.advice import Suggestion
from jmem._src.planner.advice import advise
from jmem._src.planner.advice import fits
from jmem._src.planner.capacity import largest_batch
from jmem._src.planner.capacity import largest_model
from jmem._src.planner.capacity import largest_seq_len
from jmem._src.planner.capacity import largest_seq_len_by_remat
from jmem._src.planner.estimate import estimate
from jmem._src.planner.grpo_phases import largest_generation_batch
from jmem._src.planner.grpo_phases import training_phase
from jmem._src.planner.kv_cache import Phase
from jmem._src.planner.kv_cache import generation_phase
from jmem._src.planner.kv_cache import kv_bytes_per_token
from jmem._src.planner.kv_cache import kv_cache_bytes
from jmem._src.planner.ledger import Ledger
from jmem._src.planner.offload import Offload
from jmem._src.planner.shapes import MODEL_SHAPES
from jmem._src.planner.shapes import ModelShape
from jmem._src.planner.shapes import resolve_shape
from jmem._src.planner.shapes import standard_shape
from jmem._src.planner.tables import OPTIMIZERS
from jmem._src.units import parse_memory

__all__ = (
    "DEFAULT_RESERVE",
    "MODEL_SHAPES",
    "OPTIMIZERS",
    "REMAT_MODES",
    "Advice",
    "Ledger",
    "ModelShape",
    "Offload",
    "Phase",
    "Suggestion",
    "activation_bytes",
    "advise",
    "estimate",
    "fits",
    "generation_phase",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "largest_batch",
    "largest_generation_batch",
    "largest_model",
    "largest_seq_len",
    "largest_seq_len_by_remat",
    "parse_memory",
    "resolve_shape",
    "standard_shape",
    "training_phase",
)

#: Deprecated names, kept for one release: name -> (module, its new name, what to use).
__getattr__ = module_getattr(
    "jmem.planner",
    {
        "GB": ("jmem._src.units", "GB", "10**9 (bytes in a decimal gigabyte)"),
        "Lever": ("jmem._src.planner.advice", "Suggestion", "jmem.planner.Suggestion"),
        "max_seq_len": (
            "jmem._src.planner.capacity",
            "largest_seq_len_by_remat",
            "jmem.planner.largest_seq_len_by_remat (same arguments)",
        ),
    },
)
