"""FP8 matmuls with delayed scaling (Micikevicius et al. 2022, arXiv:2209.05433)."""

from jmem._src.fp8_apply import apply
from jmem._src.fp8_dot import fp8_dot
from jmem._src.fp8_dot import fp8_dot_general
from jmem._src.fp8_meta import AMAX_COMPUTE_ALGOS
from jmem._src.fp8_meta import DEFAULT_HISTORY_LEN
from jmem._src.fp8_meta import E4M3
from jmem._src.fp8_meta import E5M2
from jmem._src.fp8_meta import Fp8Meta
from jmem._src.fp8_meta import Fp8TensorMeta
from jmem._src.fp8_meta import combine
from jmem._src.fp8_meta import init_meta
from jmem._src.fp8_meta import init_metas
from jmem._src.fp8_meta import is_meta
from jmem._src.fp8_meta import partition
from jmem._src.fp8_meta import update_tensor_meta

__all__ = (
    "AMAX_COMPUTE_ALGOS",
    "DEFAULT_HISTORY_LEN",
    "E4M3",
    "E5M2",
    "Fp8Meta",
    "Fp8TensorMeta",
    "apply",
    "combine",
    "fp8_dot",
    "fp8_dot_general",
    "init_meta",
    "init_metas",
    "is_meta",
    "partition",
    "update_tensor_meta",
)
