"""Memory planner: ledgers of a training configuration, verdicts and levers."""

from jmem._src.planner.activations import REMAT_MODES
from jmem._src.planner.activations import activation_bytes
from jmem._src.planner.advice import DEFAULT_RESERVE
from jmem._src.planner.advice import Advice
from jmem._src.planner.advice import Lever
from jmem._src.planner.advice import advise
from jmem._src.planner.advice import fits
from jmem._src.planner.capacity import largest_batch
from jmem._src.planner.capacity import largest_model
from jmem._src.planner.capacity import largest_seq_len
from jmem._src.planner.capacity import max_seq_len
from jmem._src.planner.estimate import estimate
from jmem._src.planner.ledger import Ledger
from jmem._src.planner.offload import Offload
from jmem._src.planner.shapes import MODEL_SHAPES
from jmem._src.planner.shapes import ModelShape
from jmem._src.planner.shapes import resolve_shape
from jmem._src.planner.shapes import standard_shape
from jmem._src.planner.tables import OPTIMIZERS
from jmem._src.units import GB
from jmem._src.units import parse_memory

__all__ = (
    "DEFAULT_RESERVE",
    "GB",
    "MODEL_SHAPES",
    "OPTIMIZERS",
    "REMAT_MODES",
    "Advice",
    "Ledger",
    "Lever",
    "ModelShape",
    "Offload",
    "activation_bytes",
    "advise",
    "estimate",
    "fits",
    "largest_batch",
    "largest_model",
    "largest_seq_len",
    "max_seq_len",
    "parse_memory",
    "resolve_shape",
    "standard_shape",
)
