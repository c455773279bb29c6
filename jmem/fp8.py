"""FP8 matmuls with delayed scaling (Micikevicius et al. 2022, arXiv:2209.05433)."""

from jmem._src.fp8 import (
    AMAX_COMPUTE_ALGOS,
    DEFAULT_HISTORY_LEN,
    E4M3,
    E5M2,
    Fp8Meta,
    Fp8TensorMeta,
    combine,
    fp8_dot,
    fp8_dot_general,
    init_meta,
    init_metas,
    is_meta,
    partition,
    update_tensor_meta,
)

__all__ = (
    "AMAX_COMPUTE_ALGOS",
    "DEFAULT_HISTORY_LEN",
    "E4M3",
    "E5M2",
    "Fp8Meta",
    "Fp8TensorMeta",
    "combine",
    "fp8_dot",
    "fp8_dot_general",
    "init_meta",
    "init_metas",
    "is_meta",
    "partition",
    "update_tensor_meta",
)
